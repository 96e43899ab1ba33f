//! Integration tests of stoke-data, one binary with a module per topic.

mod common {
    use stoke_data::{BatchSource, Loader, LoaderConfig, TokenStore};

    /// A store whose token `i` is `i`, so a row starting at token `t` is sample `t / seq_len`.
    pub fn counting_store(n_tokens: u32) -> TokenStore {
        TokenStore::from_u32(&(0..n_tokens).collect::<Vec<_>>(), "counting")
    }

    pub fn config(seq_len: usize, micro_batch: usize, world_size: usize, rank: usize, drop_last: bool) -> LoaderConfig {
        LoaderConfig { seq_len, micro_batch, seed: 42, rank, world_size, n_workers: 2, prefetch_depth: 3, drop_last }
    }

    /// Sample ids of a batch's rows, checking each row is a contiguous run of the counting store.
    pub fn sample_ids(tokens: &[i64], seq_len: usize) -> Vec<u64> {
        tokens
            .chunks_exact(seq_len + 1)
            .map(|row| {
                for pair in row.windows(2) {
                    assert_eq!(pair[0] + 1, pair[1], "rows are contiguous token runs");
                }
                assert_eq!(row[0] as usize % seq_len, 0, "rows start on a sample boundary");
                row[0] as u64 / seq_len as u64
            })
            .collect()
    }

    /// The rows of `n_steps` global batches from `position`: every rank's rows, rank by rank.
    pub fn global_rows(
        store: &TokenStore,
        base: &LoaderConfig,
        world_size: usize,
        position: u64,
        n_steps: usize,
    ) -> Vec<Vec<i64>> {
        let mut loaders: Vec<Loader> = (0..world_size)
            .map(|rank| {
                let mut loader = Loader::new(store.clone(), LoaderConfig { rank, world_size, ..base.clone() }).unwrap();
                loader.seek(position);
                loader
            })
            .collect();
        let mut rows = Vec::new();
        for _ in 0..n_steps {
            for loader in &mut loaders {
                let batch = loader.next_batch().unwrap();
                rows.extend(batch.tokens.chunks_exact(base.seq_len + 1).map(<[i64]>::to_vec));
            }
            let positions: Vec<u64> = loaders.iter().map(|l| l.position()).collect();
            assert!(positions.windows(2).all(|w| w[0] == w[1]), "ranks agree on the position: {positions:?}");
        }
        rows
    }

    /// The row at global stream position `position` alone.
    pub fn row_at(store: &TokenStore, base: &LoaderConfig, position: u64) -> Vec<i64> {
        let config = LoaderConfig {
            micro_batch: 1,
            world_size: 1,
            rank: 0,
            drop_last: false,
            prefetch_depth: 1,
            ..base.clone()
        };
        let mut loader = Loader::new(store.clone(), config).unwrap();
        loader.seek(position);
        loader.next_batch().unwrap().tokens
    }
}

mod sampling {
    use super::common::*;
    use stoke_data::{mix64, BatchSource, Loader, LoaderConfig};

    /// Runs every rank of a world for `n_steps` and returns, per rank, the per-step sample ids with
    /// the stream position of each step's start.
    fn run_world(
        n_samples: u32,
        seq_len: usize,
        micro_batch: usize,
        world_size: usize,
        drop_last: bool,
        n_steps: usize,
    ) -> Vec<Vec<(u64, Vec<u64>)>> {
        let store = counting_store(n_samples * seq_len as u32 + 1);
        (0..world_size)
            .map(|rank| {
                let mut loader =
                    Loader::new(store.clone(), config(seq_len, micro_batch, world_size, rank, drop_last)).unwrap();
                (0..n_steps)
                    .map(|_| {
                        let start = loader.state().samples_consumed;
                        (start, sample_ids(&loader.next_batch().unwrap().tokens, seq_len))
                    })
                    .collect()
            })
            .collect()
    }

    fn check_exactly_once(n_samples: u32, micro_batch: usize, world_size: usize) {
        let seq_len = 4;
        let global_batch = (micro_batch * world_size) as u64;
        let n = n_samples as u64;
        // drop_last: each epoch hands out floor(n / G) global batches, all distinct samples.
        let per_epoch = (n / global_batch) as usize;
        let ranks = run_world(n_samples, seq_len, micro_batch, world_size, true, 3 * per_epoch);
        for epoch in 0..3 {
            let mut log: Vec<u64> = Vec::new();
            for rank_steps in &ranks {
                assert_eq!(rank_steps.len(), 3 * per_epoch, "equal batch counts on every rank");
                for (start, ids) in &rank_steps[epoch * per_epoch..(epoch + 1) * per_epoch] {
                    assert_eq!(start / n, epoch as u64, "batch within its epoch");
                    log.extend(ids);
                }
            }
            let count = log.len();
            log.sort_unstable();
            log.dedup();
            assert_eq!(log.len(), count, "world {world_size} epoch {epoch}: a sample twice");
            assert_eq!(count as u64, per_epoch as u64 * global_batch);
        }
        // Without drop_last the epochs are whole: every sample exactly once per block of n positions.
        let n_steps = (2 * n).div_ceil(global_batch) as usize + 1;
        let ranks = run_world(n_samples, seq_len, micro_batch, world_size, false, n_steps);
        let mut by_position: Vec<(u64, u64)> = Vec::new();
        for (rank, rank_steps) in ranks.iter().enumerate() {
            for (start, ids) in rank_steps {
                for (row_idx, id) in ids.iter().enumerate() {
                    by_position.push((start + (rank * micro_batch + row_idx) as u64, *id));
                }
            }
        }
        by_position.sort_unstable();
        for epoch in 0..2u64 {
            let mut ids: Vec<u64> = by_position.iter().filter(|(p, _)| p / n == epoch).map(|&(_, id)| id).collect();
            ids.sort_unstable();
            assert_eq!(ids, (0..n).collect::<Vec<_>>(), "world {world_size} epoch {epoch}");
        }
    }

    #[test]
    fn every_sample_once_per_epoch_for_world_sizes_1_to_4() {
        for world_size in 1..=4 {
            for (n_samples, micro_batch) in [(97, 3), (120, 5), (64, 1)] {
                check_exactly_once(n_samples, micro_batch, world_size);
            }
        }
    }

    #[test]
    fn global_order_does_not_depend_on_world_size() {
        // The hash log of sample ids in global order is the same for every world size.
        let hash_log = |world_size: usize| -> u64 {
            let ranks = run_world(50, 4, 12 / world_size, world_size, false, 10);
            let mut log = 0u64;
            for step in 0..10 {
                for rank_steps in &ranks {
                    for id in &rank_steps[step].1 {
                        log = mix64(log ^ id);
                    }
                }
            }
            log
        };
        let reference = hash_log(1);
        for world_size in [2, 3, 4] {
            assert_eq!(hash_log(world_size), reference, "world {world_size}");
        }
    }

    #[test]
    fn seeds_change_the_order() {
        let store = counting_store(4001);
        let first_ids = |seed| {
            let mut loader = Loader::new(
                store.clone(),
                LoaderConfig { seed, seq_len: 4, micro_batch: 8, ..LoaderConfig::default() },
            )
            .unwrap();
            sample_ids(&loader.next_batch().unwrap().tokens, 4)
        };
        assert_eq!(first_ids(1), first_ids(1));
        assert_ne!(first_ids(1), first_ids(2));
    }

    #[test]
    fn blends_take_each_dataset_by_weight() {
        use stoke_data::{TokenStore, WeightedStore};
        let a = TokenStore::from_u32(&(0..4001).collect::<Vec<_>>(), "a");
        let b = TokenStore::from_u32(&(1_000_000..1_004_001).collect::<Vec<_>>(), "b");
        let config = LoaderConfig { seq_len: 4, micro_batch: 10, ..LoaderConfig::default() };
        let mut loader = Loader::blend(
            vec![WeightedStore { store: a, weight: 3.0 }, WeightedStore { store: b, weight: 1.0 }],
            config,
        )
        .unwrap();
        let mut from_b = 0;
        for _ in 0..40 {
            from_b += loader.next_batch().unwrap().tokens.chunks_exact(5).filter(|row| row[0] >= 1_000_000).count();
        }
        assert_eq!(from_b, 100, "a quarter of 400 rows");
    }
}

mod resume {
    use super::common::*;
    use stoke_data::{BatchSource, Loader};

    #[test]
    fn resuming_at_any_step_gives_identical_batches() {
        let store = counting_store(37 * 8 + 1);
        for world_size in 1..=3 {
            for drop_last in [true, false] {
                let base = config(8, 2, world_size, world_size - 1, drop_last);
                let mut reference = Loader::new(store.clone(), base.clone()).unwrap();
                let mut positions = Vec::new();
                let mut batches = Vec::new();
                for _ in 0..25 {
                    positions.push(reference.position());
                    batches.push(reference.next_batch().unwrap());
                }
                for step in [0, 1, 5, 9, 10, 17, 24] {
                    let mut resumed = Loader::new(store.clone(), base.clone()).unwrap();
                    resumed.seek(positions[step]);
                    for expected in &batches[step..] {
                        assert_eq!(&resumed.next_batch().unwrap(), expected, "world {world_size} step {step}");
                    }
                }
                // Seeking an already running loader, backwards, works the same.
                reference.seek(positions[3]);
                assert_eq!(reference.next_batch().unwrap(), batches[3]);
            }
        }
    }

    #[test]
    fn resuming_under_another_world_size_continues_the_global_order() {
        let store = counting_store(41 * 4 + 1);
        for drop_last in [false, true] {
            let base = config(4, 2, 1, 0, drop_last);
            for (world_before, world_after) in [(1, 2), (2, 3), (4, 1), (3, 4), (2, 2)] {
                // Train 7 steps under one world size, then resume under another.
                let mut loader =
                    Loader::new(store.clone(), stoke_data::LoaderConfig { world_size: world_before, ..base.clone() })
                        .unwrap();
                for _ in 0..7 {
                    loader.next_batch().unwrap();
                }
                let saved = loader.position();
                let rows = global_rows(&store, &base, world_after, saved, 12);
                // The oracle: rows at consecutive stream positions, skipping epoch tails under drop_last.
                let global_batch = (2 * world_after) as u64;
                let mut position = saved;
                let mut expected = Vec::new();
                for _ in 0..12 {
                    if drop_last && position % 41 + global_batch > 41 {
                        position = (position / 41 + 1) * 41;
                    }
                    for offset in 0..global_batch {
                        expected.push(row_at(&store, &base, position + offset));
                    }
                    position += global_batch;
                }
                assert_eq!(rows, expected, "{world_before} -> {world_after}, drop_last {drop_last}");
            }
        }
    }

    #[test]
    fn synchronous_loader_gives_the_prefetching_loaders_batches() {
        // No workers: each batch is assembled when asked, on this thread, with the same order,
        // epoch tails, ranks and seeks as the threaded loader.
        let store = counting_store(37 * 8 + 1);
        for (world_size, drop_last) in [(1, true), (2, false), (3, true)] {
            let base = config(8, 2, world_size, world_size - 1, drop_last);
            let mut threaded = Loader::new(store.clone(), base.clone()).unwrap();
            let mut synchronous =
                Loader::new(store.clone(), stoke_data::LoaderConfig { n_workers: 0, ..base.clone() }).unwrap();
            for step in 0..30 {
                if step == 20 {
                    threaded.seek(5 * base.micro_batch as u64 * world_size as u64);
                    synchronous.seek(5 * base.micro_batch as u64 * world_size as u64);
                }
                assert_eq!(synchronous.position(), threaded.position(), "step {step}");
                let batch = synchronous.next_batch().unwrap();
                assert_eq!(batch, threaded.next_batch().unwrap(), "world {world_size} step {step}");
                synchronous.recycle(batch);
            }
            let stats = synchronous.stats();
            assert_eq!((stats.batches, stats.waited, stats.jobs_dispatched), (30, 30, 0), "{stats:?}");
            assert_eq!(stats.buffers_allocated, 1, "a recycled buffer is reused: {stats:?}");
        }
    }

    #[test]
    fn recycled_buffers_are_reused_and_change_nothing() {
        let store = counting_store(10_001);
        let base = config(16, 4, 1, 0, true);
        let mut plain = Loader::new(store.clone(), base.clone()).unwrap();
        let mut recycling = Loader::new(store, base).unwrap();
        for _ in 0..50 {
            let batch = recycling.next_batch().unwrap();
            assert_eq!(batch, plain.next_batch().unwrap());
            recycling.recycle(batch);
        }
        assert!(recycling.stats().buffers_allocated <= 5, "{:?}", recycling.stats());
        assert_eq!(plain.stats().buffers_allocated, 53);
    }
}

mod startup {
    use stoke_data::{startup_bytes_read, BatchSource, Loader, LoaderConfig, TokenStore};

    /// Work before the first batch: bytes read from headers and manifests, and batch jobs dispatched.
    fn first_batch_work(n_tokens: usize) -> (u64, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.bin");
        let tokens: Vec<u8> = (0..n_tokens).flat_map(|i| ((i % 50_000) as u16).to_le_bytes()).collect();
        std::fs::write(&path, tokens).unwrap();
        let before = startup_bytes_read();
        let store = TokenStore::open(&path).unwrap();
        let mut loader =
            Loader::new(store, LoaderConfig { seq_len: 256, micro_batch: 8, ..LoaderConfig::default() }).unwrap();
        loader.next_batch().unwrap();
        (startup_bytes_read() - before, loader.stats().jobs_dispatched)
    }

    #[test]
    fn first_batch_work_does_not_grow_with_dataset_size() {
        let small = first_batch_work(10_000);
        let large = first_batch_work(4_000_000);
        assert_eq!(small, large);
        assert!(small.1 <= 5, "the prefetch depth plus one: {small:?}");
    }
}

mod formats {
    use std::path::Path;

    use stoke_data::{
        encode_megatron_index, prepare_text, verify_prepared, BatchSource, DataError, Loader, LoaderConfig,
        PrepTextConfig, TokenStore, LLMC_MAGIC,
    };

    fn read_all(store: &TokenStore) -> Vec<i64> {
        let mut out = vec![0; store.n_tokens() as usize];
        store.read(0, &mut out);
        out
    }

    fn prepare(dir: &Path, texts: &[&str], shard_tokens: u64) -> std::path::PathBuf {
        let inputs: Vec<_> = texts
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let path = dir.join(format!("doc{i}.txt"));
                std::fs::write(&path, text).unwrap();
                path
            })
            .collect();
        let out = dir.join("prepared");
        let config = PrepTextConfig { shard_tokens, ..PrepTextConfig::default() };
        prepare_text(&inputs, &config, &out).unwrap();
        out
    }

    #[test]
    fn prepared_bytes_round_trip_across_shards() {
        let dir = tempfile::tempdir().unwrap();
        let texts = ["hello world", "second document", "x", "the fourth and last one"];
        let out = prepare(dir.path(), &texts, 12);
        let manifest = verify_prepared(&out).unwrap();
        assert_eq!(manifest.n_documents, 4);
        assert!(manifest.shards.len() >= 2);
        let store = TokenStore::open(&out).unwrap();
        let expected: Vec<i64> = texts.concat().bytes().map(i64::from).collect();
        assert_eq!(read_all(&store), expected);
        let mut loader =
            Loader::new(store, LoaderConfig { seq_len: 8, micro_batch: 2, ..LoaderConfig::default() }).unwrap();
        assert_eq!(loader.next_batch().unwrap().tokens.len(), 18);
    }

    #[test]
    fn jsonl_documents_and_eos() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("docs.jsonl");
        std::fs::write(&input, "{\"text\": \"ab\"}\n\n{\"text\": \"c\"}\n").unwrap();
        let out = dir.path().join("out");
        let config = PrepTextConfig { eos: "10".into(), ..PrepTextConfig::default() };
        let manifest = prepare_text(std::slice::from_ref(&input), &config, &out).unwrap();
        assert_eq!(manifest.n_documents, 2);
        assert_eq!(read_all(&TokenStore::open(&out).unwrap()), vec![97, 98, 10, 99, 10]);
        std::fs::write(&input, "{\"text\": \"ab\"}\n{\"txt\": 1}\n").unwrap();
        let err = prepare_text(&[input], &config, &dir.path().join("bad")).unwrap_err();
        assert!(matches!(err, DataError::Corrupt { offset: 15, .. }), "{err}");
    }

    #[test]
    fn megatron_and_raw_files_read_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<u16> = (0..100).map(|i| i * 3).collect();
        let bin: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let expected: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();

        let megatron = dir.path().join("mg_text_document.bin");
        std::fs::write(&megatron, &bin).unwrap();
        std::fs::write(megatron.with_extension("idx"), encode_megatron_index(8, 2, &[40, 60])).unwrap();
        let store = TokenStore::open(&megatron).unwrap();
        assert_eq!((read_all(&store), store.n_documents()), (expected.clone(), 2));
        assert_eq!(read_all(&TokenStore::open(&megatron.with_extension("idx")).unwrap()), expected);

        let nanogpt = dir.path().join("train.bin");
        std::fs::write(&nanogpt, &bin).unwrap();
        assert_eq!(read_all(&TokenStore::open(&nanogpt).unwrap()), expected);

        let mut llmc = vec![0u8; 1024];
        llmc[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        llmc[4..8].copy_from_slice(&1u32.to_le_bytes());
        llmc[8..12].copy_from_slice(&100u32.to_le_bytes());
        llmc.extend_from_slice(&bin);
        let llmc_path = dir.path().join("fineweb_train_000001.bin");
        std::fs::write(&llmc_path, &llmc).unwrap();
        assert_eq!(read_all(&TokenStore::open(&llmc_path).unwrap()), expected);
    }

    /// Every bad input is an error naming the file (and an offset where there is one), never a panic.
    fn check_error(result: Result<impl std::fmt::Debug, DataError>, file: &str, expected: &str) {
        let err = result.unwrap_err();
        let message = err.to_string();
        assert!(message.contains(file), "{message} should name {file}");
        assert!(message.contains(expected), "{message} should contain {expected:?}");
    }

    #[test]
    fn corrupt_prepared_directories_are_errors_with_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let out = prepare(dir.path(), &["some text here", "more text"], 1 << 20);
        let bin = out.join("shard-00000.bin");
        let idx = out.join("shard-00000.idx");
        let original_bin = std::fs::read(&bin).unwrap();
        let original_idx = std::fs::read(&idx).unwrap();
        let restore = || {
            std::fs::write(&bin, &original_bin).unwrap();
            std::fs::write(&idx, &original_idx).unwrap();
        };

        // A truncated shard.
        std::fs::write(&bin, &original_bin[..original_bin.len() - 2]).unwrap();
        check_error(TokenStore::open(&out), "shard-00000.bin", "truncated");
        restore();

        // A flipped byte: the checksum catches it.
        let mut flipped = original_bin.clone();
        flipped[3] ^= 1;
        std::fs::write(&bin, &flipped).unwrap();
        check_error(verify_prepared(&out), "shard-00000.bin", "checksum mismatch");
        restore();

        // A truncated index.
        std::fs::write(&idx, &original_idx[..20]).unwrap();
        check_error(TokenStore::open(&out), "shard-00000.idx", "offset 0");
        restore();

        // A dtype that disagrees with the manifest.
        let mut wrong_dtype = original_idx.clone();
        wrong_dtype[8] = 4;
        std::fs::write(&idx, &wrong_dtype).unwrap();
        check_error(TokenStore::open(&out), "shard-00000.idx", "dtype mismatch at offset 8");
        restore();

        // A document offset out of order (the index checksum would also catch it).
        let mut bad_offset = original_idx.clone();
        bad_offset[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&idx, &bad_offset).unwrap();
        check_error(verify_prepared(&out), "shard-00000.idx", "checksum mismatch");
        restore();

        // A damaged manifest.
        std::fs::write(out.join("manifest.json"), b"{\"format\": ").unwrap();
        check_error(TokenStore::open(&out), "manifest.json", "bad manifest");
    }

    #[test]
    fn bad_raw_and_megatron_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("odd.bin");
        std::fs::write(&odd, [1u8, 2, 3]).unwrap();
        check_error(TokenStore::open(&odd), "odd.bin", "dtype mismatch at offset 2");

        let megatron = dir.path().join("mg.bin");
        std::fs::write(&megatron, [0u8; 8]).unwrap();
        let mut index = encode_megatron_index(8, 2, &[4]);
        std::fs::write(megatron.with_extension("idx"), &index[..30]).unwrap();
        check_error(TokenStore::open(&megatron), "mg.idx", "truncated");
        index[17] = 7;
        std::fs::write(megatron.with_extension("idx"), &index).unwrap();
        check_error(TokenStore::open(&megatron), "mg.idx", "offset 17");

        let missing = dir.path().join("missing.bin");
        check_error(TokenStore::open(&missing), "missing.bin", "cannot read");
    }
}

mod fuzz {
    use std::path::Path;

    use proptest::prelude::*;
    use stoke_data::{
        encode_megatron_index, encode_token_index, raw_layout, Dtype, MegatronIndex, TokenIndexHeader, TokenManifest,
    };

    fn parse_all(bytes: &[u8]) {
        let path = Path::new("fuzz.idx");
        if let Ok(header) = TokenIndexHeader::parse(path, bytes) {
            let _ = header.check_offsets(path, bytes);
        }
        if let Ok(index) = MegatronIndex::parse(path, bytes) {
            let _ = index.check_pointers(path, bytes, 1 << 20);
        }
        let _ = raw_layout(path, bytes, bytes.len() as u64, Dtype::U16);
        let _ = TokenManifest::parse(path, bytes);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

        #[test]
        fn parsers_never_panic_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            parse_all(&bytes);
        }

        #[test]
        fn parsers_never_panic_on_damaged_valid_files(
            ends in proptest::collection::vec(0u64..1000, 0..20),
            cut in any::<prop::sample::Index>(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            let mut ends = ends;
            ends.sort_unstable();
            let sizes: Vec<u32> = ends.iter().map(|&e| e as u32).collect();
            for mut bytes in [encode_token_index(Dtype::U16, &ends), encode_megatron_index(8, 2, &sizes)] {
                for (at, value) in &flips {
                    let at = at.index(bytes.len());
                    bytes[at] ^= value;
                }
                let len = cut.index(bytes.len() + 1);
                parse_all(&bytes[..len]);
                parse_all(&bytes);
            }
        }
    }

    proptest! {
        // Each case writes a record directory: fewer cases keep this under a few seconds.
        #![proptest_config(ProptestConfig { cases: 100, .. ProptestConfig::default() })]

        #[test]
        fn record_shards_never_panic_on_damaged_indexes(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let input = dir.path().join("sample.bin");
            std::fs::write(&input, b"payload bytes").unwrap();
            let out = dir.path().join("records");
            let manifest = stoke_data::prepare_records(&[input.clone(), input], &Default::default(), &out).unwrap();
            let ridx = out.join(&manifest.shards[0].ridx);
            let mut bytes = std::fs::read(&ridx).unwrap();
            for (at, value) in &flips {
                let at = at.index(bytes.len());
                bytes[at] ^= value;
            }
            let len = cut.index(bytes.len() + 1);
            std::fs::write(&ridx, &bytes[..len]).unwrap();
            if let Ok(store) = stoke_data::RecordStore::open(&out, false) {
                for record_idx in 0..store.len() {
                    let _ = store.get(record_idx);
                }
            }
        }
    }
}

mod cached {
    use stoke_data::{open_cached, prepare_text, CacheConfig, DataError, PrepTextConfig, TokenStore};

    #[test]
    fn a_prepared_directory_reads_the_same_through_the_cache() {
        let root = tempfile::tempdir().unwrap();
        let texts: Vec<_> = ["the quick brown fox", "jumps over the lazy dog", "again and again", "and once more"]
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let path = root.path().join(format!("{i}.txt"));
                std::fs::write(&path, text).unwrap();
                path
            })
            .collect();
        let remote = root.path().join("remote");
        let config = PrepTextConfig { shard_tokens: 10, ..PrepTextConfig::default() };
        assert_eq!(prepare_text(&texts, &config, &remote).unwrap().shards.len(), 4);
        let cache = CacheConfig { dir: root.path().join("cache"), budget_bytes: 1 << 20 };

        let local = TokenStore::open(&remote).unwrap();
        let (cached, shard_cache) = open_cached(remote.to_str().unwrap(), &cache).unwrap();
        let read = |store: &TokenStore| {
            let mut out = vec![0; store.n_tokens() as usize];
            store.read(0, &mut out);
            out
        };
        assert_eq!(read(&cached), read(&local));
        assert_eq!(shard_cache.stats().downloads, 2 * 4);

        // A second open hits the cache: no downloads.
        let (_, again) = open_cached(remote.to_str().unwrap(), &cache).unwrap();
        assert_eq!(again.stats().downloads, 0);
        assert!(again.stats().hits >= 8);

        // A shard that changed at the source fails its checksum on download.
        std::fs::remove_dir_all(root.path().join("cache")).unwrap();
        let bin = remote.join("shard-00001.bin");
        let mut bytes = std::fs::read(&bin).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&bin, bytes).unwrap();
        let err = open_cached(remote.to_str().unwrap(), &cache).err().unwrap();
        assert!(
            matches!(err, DataError::ChecksumMismatch { .. }) && err.to_string().contains("shard-00001.bin"),
            "{err}"
        );
    }

    #[test]
    fn urls_need_the_remote_feature_or_a_cache() {
        let cache = CacheConfig::default();
        let err = open_cached("s3://bucket/data", &cache).err().unwrap();
        assert!(err.to_string().contains("s3://bucket/data") || err.to_string().contains("cache"), "{err}");
    }
}

mod config {
    use super::common::*;
    use stoke_data::{DataError, Loader, LoaderConfig};

    #[test]
    fn invalid_loader_configs_name_the_field() {
        let check = |config: LoaderConfig, n_tokens: u32, expected: &str| {
            let err = Loader::new(counting_store(n_tokens), config).err().expect("an error");
            let message = err.to_string();
            assert!(message.contains(expected), "{message} should contain {expected:?}");
            assert!(matches!(
                err,
                DataError::Config { .. } | DataError::TooShortInMemory { .. } | DataError::TooShort { .. }
            ));
        };
        let base = LoaderConfig { seq_len: 4, micro_batch: 2, ..LoaderConfig::default() };
        check(LoaderConfig { seq_len: 0, ..base.clone() }, 100, "seq_len");
        check(LoaderConfig { micro_batch: 0, ..base.clone() }, 100, "micro_batch");
        check(LoaderConfig { prefetch_depth: 0, ..base.clone() }, 100, "prefetch_depth");
        check(LoaderConfig { rank: 2, world_size: 2, ..base.clone() }, 100, "rank");
        check(base.clone(), 4, "fewer than one sequence");
        check(LoaderConfig { world_size: 8, ..base.clone() }, 41, "fewer than one global batch of 16");
        assert!(Loader::new(counting_store(41), LoaderConfig { world_size: 8, drop_last: false, ..base }).is_ok());
    }
}

mod tokenizer {
    use stoke_data::{prepare_text, Dtype, PrepTextConfig, TokenStore};

    /// A HuggingFace tokenizer.json with a word-level model: `[UNK]` = 0, `<eos>` = 1, then `words`.
    fn word_level_tokenizer(path: &std::path::Path, words: &[String]) {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        vocab.insert("<eos>".into(), 1.into());
        for (i, word) in words.iter().enumerate() {
            vocab.insert(word.clone(), (i + 2).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        std::fs::write(path, serde_json::to_vec(&json).unwrap()).unwrap();
    }

    fn check(n_words: usize, text: &str, expected_dtype: Dtype, expected_tokens: &[i64]) {
        let dir = tempfile::tempdir().unwrap();
        let words: Vec<String> = (0..n_words).map(|i| format!("w{i}")).collect();
        let tokenizer = dir.path().join("tokenizer.json");
        word_level_tokenizer(&tokenizer, &words);
        let input = dir.path().join("doc.txt");
        std::fs::write(&input, text).unwrap();
        let config = PrepTextConfig {
            tokenizer: tokenizer.to_str().unwrap().into(),
            eos: "<eos>".into(),
            ..PrepTextConfig::default()
        };
        let out = dir.path().join("out");
        let manifest = prepare_text(&[input], &config, &out).unwrap();
        assert_eq!((manifest.dtype, manifest.vocab_size), (expected_dtype, n_words as u64 + 2));
        assert_eq!(manifest.tokenizer, "tokenizer.json");
        let store = TokenStore::open(&out).unwrap();
        let mut tokens = vec![0; store.n_tokens() as usize];
        store.read(0, &mut tokens);
        assert_eq!(tokens, expected_tokens);
    }

    #[test]
    fn hugging_face_tokenizers_choose_u16_or_u32_by_vocabulary() {
        check(10, "w3 w0 nope w9", Dtype::U16, &[5, 2, 0, 11, 1]);
        check(70_000, "w69999 w1", Dtype::U32, &[70_001, 3, 1]);
    }

    #[test]
    fn a_missing_tokenizer_or_eos_token_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("doc.txt");
        std::fs::write(&input, "w1").unwrap();
        let config = PrepTextConfig { tokenizer: "/no/such/tokenizer.json".into(), ..PrepTextConfig::default() };
        let err = prepare_text(std::slice::from_ref(&input), &config, &dir.path().join("a")).unwrap_err();
        assert!(err.to_string().contains("/no/such/tokenizer.json"), "{err}");
        let tokenizer = dir.path().join("tokenizer.json");
        word_level_tokenizer(&tokenizer, &["w1".into()]);
        let config = PrepTextConfig {
            tokenizer: tokenizer.to_str().unwrap().into(),
            eos: "</s>".into(),
            ..PrepTextConfig::default()
        };
        let err = prepare_text(&[input], &config, &dir.path().join("b")).unwrap_err();
        assert!(err.to_string().contains("</s>"), "{err}");
    }
}

/// LeRobot v2 datasets (Parquet tables and MP4 videos) through `prepare_episodes`; needs `ffmpeg`.
mod lerobot;

use super::*;
use crate::hostbuf::{checksum, stream_copy_checksummed};
use crate::verify_dir;

fn fill(snapshot: &mut Snapshot, value: f32, n: usize) {
    let dst = snapshot.tensor("model", "w", DType::F32, &[n]);
    for chunk in dst.chunks_exact_mut(4) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    let dst = snapshot.tensor("optim", "m", DType::F32, &[1]);
    dst.copy_from_slice(&(-value).to_le_bytes());
    snapshot.set_meta(serde_json::json!({ "value": value }));
}

#[test]
fn background_writes_commit_in_order_with_retention() {
    for background in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let config = WriterConfig { background, buffers: 2, keep: 2, keep_every: 0 };
        let mut writer = CheckpointWriter::new(store.clone(), config).unwrap();
        let mut committed = Vec::new();
        for step in 1..=5u64 {
            let mut snapshot = writer.begin(step).unwrap();
            fill(&mut snapshot, step as f32, 1000);
            writer.submit(snapshot).unwrap();
            writer.release(step).unwrap();
            committed.extend(writer.committed().unwrap());
        }
        committed.extend(writer.finish().unwrap());
        let steps: Vec<u64> = committed.iter().map(|c| c.step).collect();
        assert_eq!(steps, [1, 2, 3, 4, 5], "background {background}");
        assert_eq!(store.list().unwrap(), vec![4, 5]);
        let loaded = store.load(5).unwrap();
        assert_eq!(loaded.files["model"][0].data[..4], 5f32.to_le_bytes());
        assert_eq!(loaded.files["optim"][0].data, (-5f32).to_le_bytes());
        assert_eq!(loaded.manifest.meta["value"], 5.0);
        let stats = writer.stats();
        assert!(stats.buffers <= 2 && stats.commits == 5, "{stats:?}");
        assert!(stats.host_bytes >= 4004 && stats.host_bytes <= 2 * 4004 * 2, "{stats:?}");
    }
}

#[test]
fn checksums_handed_in_by_the_filler_make_the_same_checkpoint() {
    // Rooms large enough for O_DIRECT; pieces of them checksummed by the copy, some not,
    // one given twice (overlapping), one outside every room.
    let n = 300_000;
    let values: Vec<u8> = (0..4 * n).map(|i| (i * 17 % 241) as u8).collect();
    let mut files = Vec::new();
    for hand_in in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let mut writer = CheckpointWriter::new(store.clone(), WriterConfig::default()).unwrap();
        let mut snapshot = writer.begin(1).unwrap();
        for name in ["a", "b"] {
            snapshot.tensor("model", name, DType::F32, &[n]);
        }
        let rooms: Vec<(usize, usize)> =
            snapshot.rooms_mut().into_iter().map(|(_, _, r)| (r.as_mut_ptr() as usize, r.len())).collect();
        let mut pieces = Vec::new();
        for (i, (_, _, room)) in snapshot.rooms_mut().into_iter().enumerate() {
            let (head, tail) = room.split_at_mut(1000 + i);
            head.copy_from_slice(&values[..head.len()]);
            pieces.push((tail.as_ptr() as usize, tail.len(), stream_copy_checksummed(tail, &values[head.len()..], 2)));
        }
        if hand_in {
            pieces.push((rooms[0].0 + 8, 100, checksum(&values[8..108])));
            pieces.push((rooms[0].0 + 1050, 10, 0));
            pieces.push((rooms[1].0 + rooms[1].1 - 4, 8, 0));
            snapshot.add_checksums(pieces);
            // The two copies' pieces and the one at 8 are taken; the overlapping and the
            // outside ones are not.
            let known: Vec<usize> = snapshot.sources().unwrap()[0].known.iter().map(|k| k.0).collect();
            assert_eq!(known, [8, 1000, 4 * n + 1001]);
        }
        writer.submit(snapshot).unwrap();
        writer.release(1).unwrap();
        writer.finish().unwrap();
        let report = verify_dir(dir.path()).unwrap();
        assert_eq!((report.checkpoints.len(), report.damaged()), (1, 0));
        files.push(std::fs::read(dir.path().join("step-1/model.safetensors")).unwrap());
    }
    assert!(files[0] == files[1], "the files differ");
}

#[test]
fn a_failed_write_is_reported_and_sticks() {
    let dir = tempfile::tempdir().unwrap();
    // A file where the checkpoint folder should be: every commit fails.
    let blocked = dir.path().join("ckpt");
    std::fs::write(&blocked, b"not a folder").unwrap();
    let mut writer = CheckpointWriter::new(CheckpointStore::new(&blocked), WriterConfig::default()).unwrap();
    let mut snapshot = writer.begin(1).unwrap();
    fill(&mut snapshot, 1.0, 4);
    writer.submit(snapshot).unwrap();
    let err = writer.finish().unwrap_err().to_string();
    assert!(err.contains("ckpt"), "{err}");
    assert!(matches!(writer.begin(2), Err(CkptError::WriterFailed)));
}

#[test]
fn nothing_is_published_before_its_release() {
    for background in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let config = WriterConfig { background, buffers: 2, keep: 0, keep_every: 0 };
        let mut writer = CheckpointWriter::new(store.clone(), config).unwrap();
        for step in [1, 2] {
            let mut snapshot = writer.begin(step).unwrap();
            fill(&mut snapshot, 1.0, 8);
            writer.submit(snapshot).unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(store.list().unwrap(), Vec::<u64>::new(), "background {background}");
        writer.release(1).unwrap();
        let first = loop {
            let c = writer.committed().unwrap();
            if !c.is_empty() {
                break c;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(first.iter().map(|c| c.step).collect::<Vec<_>>(), [1]);
        assert_eq!(store.list().unwrap(), vec![1]);
        drop(writer);
        assert_eq!(store.list().unwrap(), vec![1], "dropping abandons the unreleased step 2");
        let leftovers = verify_dir(dir.path()).unwrap().leftovers;
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}

#[test]
fn pinning_is_done_or_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = CheckpointWriter::new(CheckpointStore::new(dir.path()), WriterConfig::default()).unwrap();
    match writer.pin_host_buffers() {
        // No CUDA runtime on the loader's path.
        Err(e) => assert!(e.to_string().contains("cannot pin the host buffers: the CUDA runtime"), "{e}"),
        Ok(()) => {
            let mut snapshot = writer.begin(1).unwrap();
            fill(&mut snapshot, 1.0, 1 << 16);
            match writer.submit(snapshot) {
                // A runtime but no GPU: the runtime's refusal, naming the buffer.
                Err(e) => assert!(e.to_string().contains("model.safetensors: cudaHostRegister"), "{e}"),
                Ok(()) => {
                    writer.release(1).unwrap();
                    writer.finish().unwrap();
                    assert!(writer.stats().pinned_bytes >= 4 << 16, "{:?}", writer.stats());
                }
            }
        }
    }
}

#[test]
fn buffers_are_reused_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let config = WriterConfig { background: true, buffers: 2, keep: 1, keep_every: 0 };
    let mut writer = CheckpointWriter::new(CheckpointStore::new(dir.path()), config).unwrap();
    for step in 1..=6u64 {
        let mut snapshot = writer.begin(step).unwrap();
        fill(&mut snapshot, 1.0, 1 << 16);
        writer.submit(snapshot).unwrap();
        writer.release(step).unwrap();
    }
    writer.finish().unwrap();
    let stats = writer.stats();
    assert_eq!((stats.buffers, stats.snapshots, stats.commits), (2, 6, 6));
    assert!(stats.host_bytes < 3 * (4 << 16), "two buffers of one snapshot each: {stats:?}");
}

fn shard_writer(dir: &std::path::Path, rank: usize, world: usize, wait_ms: u64) -> CheckpointWriter {
    let role = crate::ShardRole { rank, world, wait: Duration::from_millis(wait_ms) };
    let store = CheckpointStore::new(dir).with_shard(role).unwrap();
    CheckpointWriter::new(store, WriterConfig { background: true, buffers: 2, keep: 2, keep_every: 0 }).unwrap()
}

/// Rank `rank` of 2 holds elements [3 rank, 3 rank + 3) of a 6-element tensor `w` (2 x 3).
fn fill_piece(snapshot: &mut Snapshot, rank: usize, step: u64) {
    let range = 3 * rank..3 * rank + 3;
    let dst = snapshot.piece("model", "w", DType::F32, &[2, 3], range.clone());
    for (chunk, i) in dst.chunks_exact_mut(4).zip(range) {
        chunk.copy_from_slice(&(step as f32 * 10.0 + i as f32).to_le_bytes());
    }
    let own = snapshot.tensor("dist", &format!("r@rank{rank}"), DType::F32, &[1]);
    own.copy_from_slice(&(rank as f32).to_le_bytes());
    snapshot.set_meta(serde_json::json!({ "rank": rank }));
}

#[test]
fn ranks_write_their_pieces_and_rank_0_commits_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    // A part an earlier run left for a step this run writes again: removed when rank 0 starts.
    std::fs::create_dir_all(dir.path().join(".part-rank1-step-2")).unwrap();
    std::fs::write(dir.path().join(".part-rank1-step-2/part.json"), b"{}").unwrap();
    let mut rank0 = shard_writer(dir.path(), 0, 2, 20_000);
    let other = {
        let path = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let mut rank1 = shard_writer(&path, 1, 2, 20_000);
            for step in 1..=3u64 {
                let mut snapshot = rank1.begin(step).unwrap();
                fill_piece(&mut snapshot, 1, step);
                rank1.submit(snapshot).unwrap();
                rank1.release(step).unwrap();
            }
            assert!(rank1.finish().unwrap().is_empty(), "a rank's part is not a checkpoint of its own");
        })
    };
    for step in 1..=3u64 {
        let mut snapshot = rank0.begin(step).unwrap();
        fill_piece(&mut snapshot, 0, step);
        rank0.submit(snapshot).unwrap();
        rank0.release(step).unwrap();
    }
    let committed = rank0.finish().unwrap();
    other.join().unwrap();
    assert_eq!(committed.iter().map(|c| c.step).collect::<Vec<_>>(), [1, 2, 3]);
    let store = CheckpointStore::new(dir.path());
    assert_eq!(store.list().unwrap(), vec![2, 3]);
    let loaded = store.load(3).unwrap();
    let names: Vec<&str> = loaded.manifest.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        ["model-rank0.safetensors", "dist-rank0.safetensors", "model-rank1.safetensors", "dist-rank1.safetensors"]
    );
    let w = &loaded.files["model"][0];
    assert_eq!(w.shape, [2, 3]);
    let values: Vec<f32> = w.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values, [30., 31., 32., 33., 34., 35.]);
    let residuals: Vec<&str> = loaded.files["dist"].iter().map(|t| t.name.as_str()).collect();
    assert_eq!(residuals, ["r@rank0", "r@rank1"]);
    assert_eq!(loaded.manifest.meta["rank"], 0, "the manifest holds rank 0's meta");
    let report = verify_dir(dir.path()).unwrap();
    assert_eq!(report.damaged(), 0);
    assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
}

#[test]
fn a_rank_that_never_hands_over_fails_the_checkpoint_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut rank0 = shard_writer(dir.path(), 0, 3, 200);
    let mut rank2 = shard_writer(dir.path(), 2, 3, 200);
    let mut snapshot = rank2.begin(1).unwrap();
    fill_piece(&mut snapshot, 1, 1);
    rank2.submit(snapshot).unwrap();
    rank2.finish().unwrap();
    let mut snapshot = rank0.begin(1).unwrap();
    fill_piece(&mut snapshot, 0, 1);
    rank0.submit(snapshot).unwrap();
    let err = rank0.finish().unwrap_err().to_string();
    assert!(err.contains("rank 1 did not hand over") && err.contains("step 1"), "{err}");
    assert!(CheckpointStore::new(dir.path()).list().unwrap().is_empty(), "nothing was committed");
}

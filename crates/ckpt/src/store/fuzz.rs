//! The checkpoint manifest is input from disk, which may be anything after a crash or a bad copy:
//! mutated and truncated manifests and files either load or are refused with an error, never a
//! panic, and a load that succeeds gives back exactly what was saved. Cases that fail are kept by
//! proptest in `proptest-regressions/` and rerun first.

use proptest::prelude::*;

use super::*;
use crate::{DType, TensorRecord};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn fuzz_mutated_manifests_and_files(
        cuts in proptest::collection::vec((0usize..4000, any::<u8>()), 0..6),
        truncate in proptest::option::of(0usize..4000),
        in_file in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let values: Vec<u8> = (0..64u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let model = [TensorRecord::new("w", DType::F32, vec![8, 8], values).unwrap()];
        store.save(5, &[("model", &model)], serde_json::json!({"data_position": 3})).unwrap();
        let target = dir.path().join("step-5").join(if in_file { "model.safetensors" } else { MANIFEST });
        let mut bytes = std::fs::read(&target).unwrap();
        for (at, byte) in &cuts {
            let i = at % bytes.len();
            bytes[i] = *byte;
        }
        if let Some(len) = truncate {
            bytes.truncate(len % (bytes.len() + 1));
        }
        std::fs::write(&target, &bytes).unwrap();
        if let Ok(loaded) = store.load(5) {
            prop_assert_eq!(&loaded.files["model"], &model.to_vec());
        }
        let _ = verify_dir(dir.path());
        let _ = store.all_steps();
    }
}

//! Training data read from object storage: a prepared directory uploaded to a real S3-compatible
//! server on loopback (the same moto server the checkpoint mirror test starts) trains through
//! `data.path = "s3://..."` and the local shard cache with exactly the losses of the same
//! directory read from the disk.

use crate::s3::{put_object, start_s3, stoke_s3};
use crate::{losses, run_ok, stoke, SMALL};

#[test]
fn a_prepared_directory_on_s3_trains_like_the_same_directory_on_disk() {
    let server = start_s3("data");
    let dir = tempfile::tempdir().unwrap();
    // Four documents and small shards, so the run reads more than one shard through the cache
    // (a document is never split across shards).
    let corpus = stoke_data::builtin_corpus(11, 120_000);
    let mut prep = vec!["prep".to_string(), "text".to_string()];
    for (i, part) in corpus.chunks(30_000).enumerate() {
        let text = dir.path().join(format!("part-{i}.txt"));
        std::fs::write(&text, part).unwrap();
        prep.push(text.to_str().unwrap().to_string());
    }
    let prepared = dir.path().join("prepared");
    prep.extend(["--out", prepared.to_str().unwrap(), "--shard-tokens", "40000"].map(String::from));
    run_ok(&mut stoke(&prep.iter().map(String::as_str).collect::<Vec<_>>(), &[]));

    let mut uploaded = Vec::new();
    for entry in std::fs::read_dir(&prepared).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let status = put_object(server.port, &format!("/data/corpus/v1/{name}"), &std::fs::read(&path).unwrap());
        assert_eq!(status, 200, "uploading {name}");
        uploaded.push(name);
    }
    assert!(uploaded.iter().filter(|n| n.ends_with(".bin")).count() >= 2, "{uploaded:?}");

    let run = |name: &str, path: &str, cache: &str| -> Vec<String> {
        let mut v: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
        v.extend([
            "train.precision=\"fp32\"".to_string(),
            "prof.enabled=false".to_string(),
            "train.steps=12".to_string(),
            format!("data.path={path:?}"),
            format!("data.cache_dir={cache:?}"),
            format!("run.dir={}", dir.path().display()),
            format!("run.name={name}"),
        ]);
        v
    };
    let cache = dir.path().join("cache");
    let remote = run("remote", "s3://data/corpus/v1", cache.to_str().unwrap());
    let remote: Vec<&str> = remote.iter().map(String::as_str).collect();
    run_ok(&mut stoke_s3(server.port, &["train", "--quiet"], &remote));
    let local = run("local", prepared.to_str().unwrap(), "");
    let local: Vec<&str> = local.iter().map(String::as_str).collect();
    run_ok(&mut stoke(&["train", "--quiet"], &local));

    // The shards came through the cache, and the trajectory is the local one, bit for bit.
    let cached = std::fs::read_dir(&cache).unwrap().count();
    assert!(cached >= 2, "{cached} files in the shard cache");
    let (a, b) = (losses(&dir.path().join("remote")), losses(&dir.path().join("local")));
    assert_eq!(a.len(), 12);
    assert_eq!(a, b, "read from S3 vs from the disk");
}

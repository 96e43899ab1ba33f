//! A local cache of shards fetched from somewhere slower (object storage, HTTP, a network disk).
//!
//! Files live in one directory under their (flattened) names, with a size budget: inserting past the
//! budget evicts the least recently used files first. A download goes to a unique temporary file, is
//! checked against its crc32 when one is known, and is renamed into place only when complete, so a
//! crash never leaves a partial file under a real name (stale temporaries are removed at open).
//! `prefetch` downloads the next shards on a background thread while the current ones are read.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::DataError;

/// Where shards come from. Implementations: `LocalDirSource` (a directory, always built) and the
/// `object_store` source behind the `remote` feature (S3, GCS, HTTP, local paths).
pub trait ShardSource: Send + Sync {
    /// The full address of `name`, for messages.
    fn describe(&self, name: &str) -> String;
    /// Streams the object `name` into `out`; returns the bytes written.
    fn fetch(&self, name: &str, out: &mut dyn Write) -> Result<u64, DataError>;
}

/// A directory as a shard source (a mounted network file system, or tests).
#[derive(Debug, Clone)]
pub struct LocalDirSource {
    pub dir: PathBuf,
}

impl ShardSource for LocalDirSource {
    fn describe(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn fetch(&self, name: &str, out: &mut dyn Write) -> Result<u64, DataError> {
        let path = self.dir.join(name);
        let mut file = File::open(&path).map_err(DataError::read(&path))?;
        std::io::copy(&mut file, out).map_err(DataError::read(&path))
    }
}

/// Where the cache lives and how big it may grow. Plain data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// The cache directory (created if missing). Default "" (no cache: remote data is refused).
    pub dir: PathBuf,
    /// Size budget in bytes; least recently used files are evicted past it. Default 17179869184 (16 GiB).
    pub budget_bytes: u64,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig { dir: PathBuf::new(), budget_bytes: 16 << 30 }
    }
}

/// What the cache has done, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub downloads: u64,
    pub evictions: u64,
    pub bytes_cached: u64,
}

struct Entry {
    size: u64,
    last_use: u64,
}

struct State {
    entries: HashMap<String, Entry>,
    /// Files some thread is downloading now; others wait for it instead of downloading again.
    downloading: std::collections::HashSet<String>,
    clock: u64,
    stats: CacheStats,
}

/// A size-bounded LRU cache of shards from one `ShardSource`. Cheap to share (`Arc`).
pub struct ShardCache {
    dir: PathBuf,
    budget_bytes: u64,
    source: Arc<dyn ShardSource>,
    state: Mutex<State>,
    downloaded: std::sync::Condvar,
    tmp_counter: AtomicU64,
    /// Prefix of this source's files, so several datasets can share one cache directory.
    namespace: String,
}

impl ShardCache {
    /// Opens (or creates) the cache directory; files already there count against the budget, in
    /// order of their modification time, and leftover temporaries are deleted.
    pub fn open(config: &CacheConfig, source: Arc<dyn ShardSource>) -> Result<ShardCache, DataError> {
        if config.dir.as_os_str().is_empty() {
            return Err(DataError::Config { field: "cache.dir", reason: "remote data needs a cache directory".into() });
        }
        let dir = config.dir.clone();
        std::fs::create_dir_all(&dir).map_err(DataError::write(&dir))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(DataError::read(&dir))? {
            let entry = entry.map_err(DataError::read(&dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.contains(".tmp-") {
                std::fs::remove_file(&path).map_err(DataError::write(&path))?;
                continue;
            }
            let metadata = entry.metadata().map_err(DataError::read(&path))?;
            if metadata.is_file() {
                found.push((metadata.modified().ok(), name, metadata.len()));
            }
        }
        found.sort();
        let mut state =
            State { entries: HashMap::new(), downloading: Default::default(), clock: 0, stats: CacheStats::default() };
        for (_, name, size) in found {
            state.clock += 1;
            state.stats.bytes_cached += size;
            state.entries.insert(name, Entry { size, last_use: state.clock });
        }
        Ok(ShardCache {
            dir,
            budget_bytes: config.budget_bytes,
            state: Mutex::new(state),
            downloaded: std::sync::Condvar::new(),
            tmp_counter: AtomicU64::new(0),
            namespace: format!("{:08x}-", crc32fast::hash(source.describe("").as_bytes())),
            source,
        })
    }

    fn file_key(&self, name: &str) -> String {
        format!("{}{}", self.namespace, name.replace(['/', '\\'], "%"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain counters behind; they stay usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The local path of `name`, downloading it first if needed. With `expected_crc32`, a download
    /// whose checksum differs is deleted and reported.
    pub fn get(&self, name: &str, expected_crc32: Option<u32>) -> Result<PathBuf, DataError> {
        let key = self.file_key(name);
        let path = self.dir.join(&key);
        {
            let mut state = self.lock();
            while state.downloading.contains(&key) {
                state = self.downloaded.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            state.clock += 1;
            let clock = state.clock;
            if let Some(entry) = state.entries.get_mut(&key) {
                entry.last_use = clock;
                state.stats.hits += 1;
                return Ok(path);
            }
            state.downloading.insert(key.clone());
        }
        let result = self.fetch_and_insert(name, &key, &path, expected_crc32);
        self.lock().downloading.remove(&key);
        self.downloaded.notify_all();
        result
    }

    fn fetch_and_insert(
        &self,
        name: &str,
        key: &str,
        path: &Path,
        expected_crc32: Option<u32>,
    ) -> Result<PathBuf, DataError> {
        let tmp = self.dir.join(format!(
            "{key}.tmp-{}-{}",
            std::process::id(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        ));
        let result = self.download(name, &tmp, expected_crc32);
        let size = match result {
            Ok(size) => size,
            Err(err) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(err);
            }
        };
        if size > self.budget_bytes {
            let _ = std::fs::remove_file(&tmp);
            return Err(DataError::Cache {
                path: self.dir.clone(),
                detail: format!(
                    "{} is {size} bytes, over the whole budget of {}",
                    self.source.describe(name),
                    self.budget_bytes
                ),
            });
        }
        let mut state = self.lock();
        self.evict_for(&mut state, size)?;
        std::fs::rename(&tmp, path).map_err(DataError::write(path))?;
        state.clock += 1;
        let clock = state.clock;
        state.entries.insert(key.to_string(), Entry { size, last_use: clock });
        state.stats.bytes_cached += size;
        state.stats.downloads += 1;
        Ok(path.to_path_buf())
    }

    fn download(&self, name: &str, tmp: &Path, expected_crc32: Option<u32>) -> Result<u64, DataError> {
        struct Hashing<W> {
            inner: W,
            crc: crc32fast::Hasher,
        }
        impl<W: Write> Write for Hashing<W> {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let n = self.inner.write(buf)?;
                self.crc.update(&buf[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                self.inner.flush()
            }
        }
        let file = File::create(tmp).map_err(DataError::write(tmp))?;
        let mut out =
            Hashing { inner: std::io::BufWriter::with_capacity(1 << 20, file), crc: crc32fast::Hasher::new() };
        let size = self.source.fetch(name, &mut out)?;
        let file =
            out.inner.into_inner().map_err(|err| DataError::Write { path: tmp.into(), source: err.into_error() })?;
        file.sync_all().map_err(DataError::write(tmp))?;
        let actual = out.crc.finalize();
        if let Some(expected) = expected_crc32 {
            if actual != expected {
                return Err(DataError::ChecksumMismatch { path: self.source.describe(name).into(), expected, actual });
            }
        }
        Ok(size)
    }

    /// Evicts least recently used files until `incoming` more bytes fit in the budget.
    fn evict_for(&self, state: &mut State, incoming: u64) -> Result<(), DataError> {
        // Invariant: bytes_cached is the sum of the sizes of `entries`.
        while state.stats.bytes_cached + incoming > self.budget_bytes {
            let Some(oldest) = state.entries.iter().min_by_key(|(_, e)| e.last_use).map(|(k, _)| k.clone()) else {
                break;
            };
            let entry = state.entries.remove(&oldest).expect("just found");
            let path = self.dir.join(&oldest);
            // A file still memory-mapped by a reader stays readable after unlinking (POSIX).
            std::fs::remove_file(&path).map_err(DataError::write(&path))?;
            state.stats.bytes_cached -= entry.size;
            state.stats.evictions += 1;
        }
        Ok(())
    }

    /// Starts fetching `names` (with their optional crc32) on a background thread, in order.
    pub fn prefetch(
        self: &Arc<Self>,
        names: Vec<(String, Option<u32>)>,
    ) -> std::thread::JoinHandle<Result<(), DataError>> {
        let cache = Arc::clone(self);
        std::thread::spawn(move || {
            for (name, crc) in names {
                cache.get(&name, crc)?;
            }
            Ok(())
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.lock().entries.contains_key(&self.file_key(name))
    }

    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    pub fn source(&self) -> &Arc<dyn ShardSource> {
        &self.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(budget_bytes: u64) -> (tempfile::TempDir, Arc<ShardCache>) {
        let root = tempfile::tempdir().unwrap();
        let remote = root.path().join("remote");
        std::fs::create_dir_all(&remote).unwrap();
        for (name, size) in [("a", 100), ("b", 100), ("c", 100), ("big", 500)] {
            std::fs::write(remote.join(name), vec![name.as_bytes()[0]; size]).unwrap();
        }
        let config = CacheConfig { dir: root.path().join("cache"), budget_bytes };
        let cache = ShardCache::open(&config, Arc::new(LocalDirSource { dir: remote })).unwrap();
        (root, Arc::new(cache))
    }

    #[test]
    fn lru_eviction_keeps_the_budget() {
        let (_root, cache) = setup(250);
        cache.get("a", None).unwrap();
        cache.get("b", None).unwrap();
        cache.get("a", None).unwrap(); // a is now more recent than b
        cache.get("c", None).unwrap(); // evicts b
        assert!(cache.contains("a") && cache.contains("c") && !cache.contains("b"));
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.downloads, stats.evictions, stats.bytes_cached), (1, 3, 1, 200));
        assert!(matches!(cache.get("big", None), Err(DataError::Cache { .. })));
    }

    #[test]
    fn checksums_are_verified_and_failures_leave_nothing() {
        let (root, cache) = setup(1000);
        let good = crc32fast::hash(&[b'a'; 100]);
        assert!(cache.get("a", Some(good)).is_ok());
        let err = cache.get("b", Some(good)).unwrap_err();
        assert!(matches!(err, DataError::ChecksumMismatch { .. }), "{err}");
        assert!(err.to_string().contains("remote"));
        let names: Vec<_> =
            std::fs::read_dir(root.path().join("cache")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1);
        assert!(names[0].to_string_lossy().ends_with("-a"));
        assert!(cache.get("missing", None).is_err());
    }

    #[test]
    fn reopening_counts_existing_files_and_drops_temporaries() {
        let (root, cache) = setup(1000);
        cache.get("a", None).unwrap();
        cache.prefetch(vec![("b".into(), None), ("c".into(), None)]).join().unwrap().unwrap();
        std::fs::write(root.path().join("cache").join("x-d.tmp-1-1"), b"partial").unwrap();
        let config = CacheConfig { dir: root.path().join("cache"), budget_bytes: 1000 };
        let reopened = ShardCache::open(&config, Arc::clone(cache.source())).unwrap();
        assert_eq!(reopened.stats().bytes_cached, 300);
        assert!(!root.path().join("cache").join("x-d.tmp-1-1").exists());
        reopened.get("b", None).unwrap();
        assert_eq!(reopened.stats().hits, 1);
    }
}

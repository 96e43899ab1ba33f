//! The second tier: committed checkpoints mirrored in the background to object storage (S3 and
//! S3-compatible servers, or a folder) through `object_store`.
//!
//! A checkpoint on the mirror is the objects `<prefix>/step-<n>/<file>` plus
//! `<prefix>/step-<n>/manifest.json`, and the same rule holds as on disk: it exists if and only
//! if its manifest parses, names its step, and every file it lists is there with the listed size.
//! The protocol follows from that rule, since object stores have no rename: an upload puts every
//! file first and the manifest last (a kill mid-upload leaves files without a manifest: not a
//! checkpoint, overwritten by the next upload of that step); a deletion removes the manifest
//! first, then the files. A download writes into a temporary folder of the local store and
//! commits it with the local protocol, and the data is verified (CRC-32) when it is loaded.
//!
//! `MirrorStore` is the blocking interface (its own single-threaded runtime); `Mirror` runs it on
//! a thread that uploads what the trainer commits, in order, and applies the mirror's retention.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutPayload, WriteMultipart};

use crate::error::io;
use crate::fsops::{sync_dir, write_synced};
use crate::store::{inspect, parse_step_name};
use crate::{CheckpointStore, CkptError, Manifest, MANIFEST};

/// Files above this are uploaded in parts (S3 takes at most 5 GiB in one request).
const MULTIPART_ABOVE: u64 = 64 << 20;
/// Read size for uploads and downloads.
const CHUNK: usize = 16 << 20;

/// A place for checkpoints in object storage: `s3://bucket/prefix` (endpoint, region and
/// credentials from the usual `AWS_*` variables: `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`), or `file:///path` for a folder
/// (another disk or a network file system).
pub struct MirrorStore {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    runtime: tokio::runtime::Runtime,
}

impl MirrorStore {
    pub fn open(url: &str) -> Result<MirrorStore, CkptError> {
        MirrorStore::open_with(url, &[])
    }

    /// `open`, with S3 settings by object_store's names (`aws_endpoint`, `aws_allow_http`,
    /// `aws_access_key_id`...) over those of the environment.
    pub fn open_with(url: &str, options: &[(&str, &str)]) -> Result<MirrorStore, CkptError> {
        let bad = |message: String| CkptError::Mirror { url: url.into(), op: "open", message };
        let (store, prefix): (Arc<dyn ObjectStore>, ObjectPath) = if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("no bucket: write s3://BUCKET/PREFIX".into()));
            }
            let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
            for (key, value) in options {
                let key = key.parse().map_err(|e: object_store::Error| bad(e.to_string()))?;
                builder = builder.with_config(key, *value);
            }
            let store = builder.build().map_err(|e| bad(e.to_string()))?;
            (Arc::new(store), ObjectPath::from(prefix.trim_matches('/')))
        } else if let Some(path) = url.strip_prefix("file://") {
            std::fs::create_dir_all(path).map_err(|e| bad(format!("cannot create {path}: {e}")))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(path).map_err(|e| bad(e.to_string()))?;
            (Arc::new(store), ObjectPath::default())
        } else {
            return Err(bad("expected s3://BUCKET/PREFIX or file:///PATH".into()));
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| bad(format!("cannot start the I/O runtime: {e}")))?;
        Ok(MirrorStore { url: url.into(), store, prefix, runtime })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn error(&self, op: &'static str, message: impl std::fmt::Display) -> CkptError {
        CkptError::Mirror { url: self.url.clone(), op, message: message.to_string() }
    }

    fn step_prefix(&self, step: u64) -> ObjectPath {
        self.prefix.child(format!("step-{step}"))
    }

    /// Uploads the committed checkpoint in `dir` (a `step-<n>` folder, or a copy of one) as step
    /// `step`: its files, then its manifest. Returns the bytes uploaded.
    pub fn upload(&self, step: u64, dir: &Path) -> Result<u64, CkptError> {
        let manifest_path = dir.join(MANIFEST);
        let manifest_bytes =
            stoke_fsio::read_capped(&manifest_path, stoke_fsio::MANIFEST_CAP).map_err(io("read", &manifest_path))?;
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
            .map_err(|e| CkptError::BadManifest { path: manifest_path.clone(), message: e.to_string() })?;
        let target = self.step_prefix(step);
        let mut bytes = 0;
        for file in &manifest.files {
            let path = dir.join(&file.name);
            bytes += self.put_file(&path, &target.child(file.name.as_str()))?;
        }
        self.runtime
            .block_on(self.store.put(&target.child(MANIFEST), PutPayload::from(manifest_bytes)))
            .map_err(|e| self.error("upload", format!("{MANIFEST} of step {step}: {e}")))?;
        Ok(bytes)
    }

    fn put_file(&self, path: &Path, location: &ObjectPath) -> Result<u64, CkptError> {
        use std::io::Read;
        let mut file = std::fs::File::open(path).map_err(io("open", path))?;
        let len = file.metadata().map_err(io("inspect", path))?.len();
        let failed = |e: object_store::Error| self.error("upload", format!("{}: {e}", path.display()));
        if len <= MULTIPART_ABOVE {
            let mut data = Vec::with_capacity(len as usize);
            file.read_to_end(&mut data).map_err(io("read", path))?;
            self.runtime.block_on(self.store.put(location, PutPayload::from(data))).map_err(failed)?;
            return Ok(len);
        }
        self.runtime.block_on(async {
            let upload = self.store.put_multipart(location).await.map_err(failed)?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, CHUNK);
            let mut buffer = vec![0u8; CHUNK];
            loop {
                let n = file.read(&mut buffer).map_err(io("read", path))?;
                if n == 0 {
                    break;
                }
                // Bounded memory: at most a few parts in flight.
                writer.wait_for_capacity(4).await.map_err(failed)?;
                writer.write(&buffer[..n]);
            }
            writer.finish().await.map_err(failed)?;
            Ok(len)
        })
    }

    async fn manifest_of(&self, step: u64) -> Result<Manifest, String> {
        let location = self.step_prefix(step).child(MANIFEST);
        let bytes =
            self.store.get(&location).await.map_err(|e| e.to_string())?.bytes().await.map_err(|e| e.to_string())?;
        serde_json::from_slice(&bytes).map_err(|e| format!("{location}: {e}"))
    }

    /// Steps of the complete checkpoints on the mirror, oldest first (manifest present and
    /// parsing, every listed object there with the listed size).
    pub fn list(&self) -> Result<Vec<u64>, CkptError> {
        self.runtime.block_on(async {
            let objects: Vec<_> =
                self.store.list(Some(&self.prefix)).try_collect().await.map_err(|e| self.error("list", e))?;
            let mut sizes = std::collections::HashMap::new();
            let mut manifests = Vec::new();
            for object in objects {
                let parts: Vec<_> = object.location.parts().collect();
                let [.., folder, name] = parts.as_slice() else { continue };
                let Some(step) = parse_step_name(folder.as_ref()) else { continue };
                if name.as_ref() == MANIFEST {
                    manifests.push(step);
                }
                sizes.insert((step, name.as_ref().to_string()), object.size);
            }
            manifests.sort_unstable();
            let mut complete = Vec::new();
            for step in manifests {
                let Ok(manifest) = self.manifest_of(step).await else { continue };
                let whole = manifest.step == step
                    && manifest.files.iter().all(|f| sizes.get(&(step, f.name.clone())) == Some(&f.bytes));
                if whole {
                    complete.push(step);
                }
            }
            Ok(complete)
        })
    }

    pub fn latest(&self) -> Result<Option<u64>, CkptError> {
        Ok(self.list()?.last().copied())
    }

    /// Copies step `step` from the mirror into `local` and commits it there with the local
    /// protocol (temporary folder, fsync, rename). Returns the folder.
    pub fn download(&self, step: u64, local: &CheckpointStore) -> Result<PathBuf, CkptError> {
        let manifest = self.runtime.block_on(self.manifest_of(step)).map_err(|e| self.error("download", e))?;
        let tmp = local.dir().join(format!(".tmp-mirror-step-{step}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io("create", &tmp))?;
        let source = self.step_prefix(step);
        for file in &manifest.files {
            let path = tmp.join(&file.name);
            let location = source.child(file.name.as_str());
            let data = self
                .runtime
                .block_on(async { self.store.get(&location).await?.bytes().await })
                .map_err(|e| self.error("download", format!("{location}: {e}")))?;
            write_synced(&path, &data)?;
        }
        let manifest_bytes = serde_json::to_vec_pretty(&manifest).expect("a manifest always serializes");
        write_synced(&tmp.join(MANIFEST), &manifest_bytes)?;
        sync_dir(&tmp)?;
        inspect(&tmp, Some(step))?;
        let target = local.step_dir(step);
        if target.exists() {
            local.delete(step)?;
        }
        std::fs::rename(&tmp, &target).map_err(io("commit", &target))?;
        sync_dir(local.dir())?;
        Ok(target)
    }

    /// Deletes step `step` from the mirror: the manifest first, so it stops being a checkpoint
    /// before any of its data goes.
    pub fn delete(&self, step: u64) -> Result<(), CkptError> {
        let prefix = self.step_prefix(step);
        self.runtime.block_on(async {
            let manifest = prefix.child(MANIFEST);
            match self.store.delete(&manifest).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.error("delete", format!("{manifest}: {e}"))),
            }
            let objects: Vec<_> =
                self.store.list(Some(&prefix)).try_collect().await.map_err(|e| self.error("delete", e))?;
            for object in objects {
                match self.store.delete(&object.location).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(self.error("delete", format!("{}: {e}", object.location))),
                }
            }
            Ok(())
        })
    }
}

/// What the mirror thread did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MirrorStats {
    pub uploaded: usize,
    pub bytes: u64,
    pub upload_s: f64,
    pub deleted: usize,
    /// The first error, if the thread stopped on one (the local tier is unaffected).
    pub error: Option<String>,
}

enum Job {
    Upload { step: u64, staged: PathBuf },
}

/// Uploads committed checkpoints on a thread of its own, in commit order, then deletes from the
/// mirror what its retention (`keep` newest; 0 keeps all) no longer keeps.
pub struct Mirror {
    url: String,
    staging: PathBuf,
    jobs: std::sync::Mutex<Option<crossbeam_channel::Sender<Job>>>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<MirrorStats>>>,
}

impl Mirror {
    /// A mirror of the checkpoints committed in `local`'s folder to `store`.
    pub fn start(
        store: MirrorStore,
        local: &CheckpointStore,
        keep: usize,
        keep_every: u64,
    ) -> Result<Mirror, CkptError> {
        let url = store.url.clone();
        let staging = local.dir().join(".mirror-staging");
        if staging.exists() {
            std::fs::remove_dir_all(&staging).map_err(io("remove", &staging))?;
        }
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let thread = std::thread::Builder::new()
            .name("ckpt-mirror".into())
            .spawn(move || {
                let mut stats = MirrorStats::default();
                for Job::Upload { step, staged } in rx {
                    if stats.error.is_some() {
                        let _ = std::fs::remove_dir_all(&staged);
                        continue;
                    }
                    let start = Instant::now();
                    let result = store.upload(step, &staged).and_then(|bytes| {
                        stats.bytes += bytes;
                        stats.uploaded += 1;
                        stats.upload_s += start.elapsed().as_secs_f64();
                        if keep == 0 {
                            return Ok(());
                        }
                        for old in crate::steps_to_delete(&store.list()?, keep, keep_every) {
                            store.delete(old)?;
                            stats.deleted += 1;
                        }
                        Ok(())
                    });
                    let _ = std::fs::remove_dir_all(&staged);
                    if let Err(e) = result {
                        eprintln!("stoke: checkpoint mirror stopped: {e}");
                        stats.error = Some(e.to_string());
                    }
                }
                stats
            })
            .map_err(|e| CkptError::Writer { message: format!("cannot start the mirror thread: {e}") })?;
        Ok(Mirror { url, staging, jobs: std::sync::Mutex::new(Some(tx)), thread: std::sync::Mutex::new(Some(thread)) })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Queues the committed checkpoint in `dir` for upload. Its files are hard-linked into a
    /// staging folder first (instant, no copy), so local retention may delete the checkpoint
    /// while it is still being uploaded.
    pub fn submit(&self, step: u64, dir: &Path) -> Result<(), CkptError> {
        let staged = self.staging.join(format!("step-{step}"));
        if staged.exists() {
            std::fs::remove_dir_all(&staged).map_err(io("remove", &staged))?;
        }
        std::fs::create_dir_all(&staged).map_err(io("create", &staged))?;
        for entry in std::fs::read_dir(dir).map_err(io("list", dir))? {
            let entry = entry.map_err(io("list", dir))?;
            let link = staged.join(entry.file_name());
            std::fs::hard_link(entry.path(), &link).map_err(io("link", &link))?;
        }
        if let Some(jobs) = self.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = jobs.send(Job::Upload { step, staged });
        }
        Ok(())
    }

    /// Waits for every queued upload; the totals (once: later calls return the default).
    pub fn finish(&self) -> MirrorStats {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let stats = thread.and_then(|t| t.join().ok()).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&self.staging);
        stats
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        self.finish();
    }
}

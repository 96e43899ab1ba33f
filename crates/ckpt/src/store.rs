//! Checkpoint storage: save, list, load, verify and delete committed checkpoints, atomically.
//!
//! A checkpoint is a folder `step-<n>/` holding safetensors files and `manifest.json`, which lists
//! each file with its size and CRC-32. The commit protocol:
//!
//! 1. write every file into the writer's own temporary folder `.tmp-<writer>-step-<n>/`, fsync
//!    each file, write and fsync the manifest, fsync the folder;
//! 2. rename the folder to `step-<n>` and fsync the parent. When `step-<n>` already exists the two
//!    names are exchanged in one atomic step (`renameat2(RENAME_EXCHANGE)`), so there is no moment
//!    without a committed `step-<n>`; the old folder, now under the temporary name, is discarded;
//! 3. discarding (retention, replaced checkpoints) renames the folder to `.trash-<writer>-...` and
//!    fsyncs the parent before removing anything, so a kill mid-removal never leaves a `step-<n>`
//!    with missing files.
//!
//! A checkpoint exists if and only if its manifest parses, names its own step, and every file it
//! lists exists with the listed size; listing checks exactly that (no reading of data). Loading
//! also verifies every CRC-32 before parsing, and `verify_dir` does that for every checkpoint.
//! Temporaries and trash carry the writer's id, so concurrent writers (ranks) into one folder
//! never remove each other's; each writer removes its own leftovers before its next commit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::io;
use crate::format::{deserialize, write_file, FileSource, TensorRef};
use crate::fsops::{rename_exchange, sync_dir, write_synced};
use crate::shards::{assemble, check_file, check_table, merge, rank_stem, PieceRecord, ShardRole, ShardTable};
use crate::{CkptError, TensorRecord};

pub const MANIFEST: &str = "manifest.json";
const FORMAT_VERSION: u32 = 1;
const TMP_PREFIX: &str = ".tmp-";
const TRASH_PREFIX: &str = ".trash-";
const PART_PREFIX: &str = ".part-";
const STEP_PREFIX: &str = "step-";
/// A rank's part of a sharded checkpoint: its files and pieces (see `shards`).
const PART_FILE: &str = "part.json";

/// Makes trash names unique within a process.
static TRASH_COUNTER: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

/// `manifest.json`: what the checkpoint holds; `meta` is the trainer's own state (step, data
/// position, resolved config...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub step: u64,
    pub files: Vec<FileEntry>,
    pub meta: serde_json::Value,
    /// A checkpoint written by several ranks: where each logical tensor's pieces are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardTable>,
}

impl Manifest {
    /// Bytes of all listed files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

/// A checkpoint written and synced under its writer's temporary name, not yet published.
#[derive(Debug)]
pub(crate) struct Prepared {
    step: u64,
    tmp: PathBuf,
    pub(crate) bytes: u64,
    /// A rank's part of a sharded checkpoint, handed to the coordinator: nothing to publish.
    pub(crate) part: bool,
}

/// `part.json`: what rank `rank` wrote for the checkpoint of `step`.
#[derive(Debug, Serialize, Deserialize)]
struct Part {
    step: u64,
    rank: usize,
    world_size: usize,
    files: Vec<FileEntry>,
    pieces: Vec<(String, PieceRecord)>,
}

/// A loaded checkpoint: its manifest and, per file stem, its tensors.
#[derive(Debug)]
pub struct Loaded {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub files: BTreeMap<String, Vec<TensorRecord>>,
}

/// The checkpoints of one run, in one folder, as seen by one writer.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
    writer: String,
    /// Set for the ranks of a sharded checkpoint (`with_shard`).
    shard: Option<ShardRole>,
}

impl CheckpointStore {
    /// The store in `dir`, writing as writer `rank0`.
    pub fn new(dir: impl Into<PathBuf>) -> CheckpointStore {
        CheckpointStore { dir: dir.into(), writer: "rank0".into(), shard: None }
    }

    /// The same folder, as rank `role.rank` of `role.world` writing sharded checkpoints: every
    /// rank writes its own files (`<stem>-rank<r>.safetensors`, with its pieces of the logical
    /// tensors); rank 0 gathers the other ranks' parts into the checkpoint and writes the
    /// manifest, waiting at most `role.wait` for them. The writer id becomes `rank<r>`.
    pub fn with_shard(self, role: ShardRole) -> Result<CheckpointStore, CkptError> {
        if role.world == 0 || role.rank >= role.world {
            return Err(CkptError::Writer { message: format!("rank {} of a world of {}", role.rank, role.world) });
        }
        let mut store = self.with_writer(&format!("rank{}", role.rank))?;
        store.shard = Some(role);
        Ok(store)
    }

    pub fn shard_role(&self) -> Option<ShardRole> {
        self.shard
    }

    /// The same folder, writing as `id` (for example `rank3`): temporaries and trash carry it, so
    /// writers never remove each other's. The id is stable across restarts, so a restarted writer
    /// cleans up what its killed predecessor left.
    pub fn with_writer(mut self, id: &str) -> Result<CheckpointStore, CkptError> {
        let valid = !id.is_empty() && id.len() <= 32 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(CkptError::BadWriterId { id: id.into() });
        }
        self.writer = id.into();
        Ok(self)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{STEP_PREFIX}{step}"))
    }

    fn tmp_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{TMP_PREFIX}{}-step-{step}", self.writer))
    }

    fn part_dir(&self, rank: usize, step: u64) -> PathBuf {
        self.dir.join(format!("{PART_PREFIX}rank{rank}-step-{step}"))
    }

    fn trash_dir(&self, what: &str) -> PathBuf {
        let n = TRASH_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{TRASH_PREFIX}{}-{what}-{}-{n}", self.writer, std::process::id()))
    }

    /// Writes `files` (stem -> tensors, each to `<stem>.safetensors`) and the manifest, and commits
    /// them atomically as `step-<step>/`. An existing checkpoint of the same step is replaced in
    /// one atomic exchange.
    pub fn save(
        &self,
        step: u64,
        files: &[(&str, &[TensorRecord])],
        meta: serde_json::Value,
    ) -> Result<PathBuf, CkptError> {
        let sources: Vec<FileSource<'_>> = files
            .iter()
            .map(|(stem, tensors)| FileSource {
                stem,
                body: None,
                known: Vec::new(),
                tensors: tensors
                    .iter()
                    .map(|t| TensorRef { name: &t.name, dtype: t.dtype, shape: &t.shape, data: &t.data })
                    .collect(),
            })
            .collect();
        self.commit(step, &sources, meta).map(|(path, _)| path)
    }

    /// The commit protocol (see the module doc). Returns the folder and the bytes written.
    pub(crate) fn commit(
        &self,
        step: u64,
        sources: &[FileSource<'_>],
        meta: serde_json::Value,
    ) -> Result<(PathBuf, u64), CkptError> {
        std::fs::create_dir_all(&self.dir).map_err(io("create", &self.dir))?;
        self.remove_own_leftovers()?;
        let prepared = self.prepare(step, sources, &[], meta, &|| false)?;
        let bytes = prepared.bytes;
        Ok((self.publish(prepared)?, bytes))
    }

    /// Step 1 of the commit protocol: the checkpoint, complete and durable, under this writer's
    /// temporary name (not a checkpoint yet). On a sharded store, rank r > 0 hands its files to
    /// the coordinator as a part instead (`Prepared::part`), and rank 0 gathers every part
    /// (`pieces`: this rank's pieces of the logical tensors) before writing the manifest; it stops
    /// waiting when `give_up` says so.
    pub(crate) fn prepare(
        &self,
        step: u64,
        sources: &[FileSource<'_>],
        pieces: &[PieceRecord],
        meta: serde_json::Value,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Prepared, CkptError> {
        std::fs::create_dir_all(&self.dir).map_err(io("create", &self.dir))?;
        if !pieces.is_empty() && self.shard.is_none() {
            return Err(CkptError::Writer { message: "tensor pieces need a sharded store (with_shard)".into() });
        }
        let tmp = self.tmp_dir(step);
        if std::fs::symlink_metadata(&tmp).is_ok() {
            // Left by a killed predecessor of this writer.
            std::fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io("create", &tmp))?;
        let file_name = |stem: &str| match self.shard {
            Some(role) => format!("{}.safetensors", rank_stem(stem, role.rank)),
            None => format!("{stem}.safetensors"),
        };
        let mut entries = Vec::with_capacity(sources.len());
        for source in sources {
            let name = file_name(source.stem);
            let (bytes, crc32) = write_file(&tmp.join(&name), source)?;
            entries.push(FileEntry { name, bytes, crc32 });
        }
        let mut pieces: Vec<(String, PieceRecord)> = pieces.iter().map(|p| (file_name(&p.stem), p.clone())).collect();
        let mut shards = None;
        if let Some(role) = self.shard {
            if role.rank > 0 {
                return self.hand_over(step, role, tmp, entries, pieces);
            }
            for rank in 1..role.world {
                let part = self.take_part(step, rank, role, &tmp, give_up)?;
                entries.extend(part.files);
                pieces.extend(part.pieces);
            }
            sync_dir(&tmp)?;
            let table = merge(role.world, pieces);
            let names: Vec<String> = entries.iter().map(|e| e.name.clone()).collect();
            check_table(&table, &names, &tmp.join(MANIFEST))?;
            shards = Some(table);
        }
        let manifest = Manifest { format_version: FORMAT_VERSION, step, files: entries, meta, shards };
        let bytes = manifest.total_bytes();
        let manifest_bytes = serde_json::to_vec_pretty(&manifest).expect("a manifest always serializes");
        write_synced(&tmp.join(MANIFEST), &manifest_bytes)?;
        sync_dir(&tmp)?;
        Ok(Prepared { step, tmp, bytes, part: false })
    }

    /// Rank r > 0: its written files become its part of `step`, durably, under
    /// `.part-rank<r>-step-<n>/` (one rename, so the coordinator sees all of it or nothing).
    fn hand_over(
        &self,
        step: u64,
        role: ShardRole,
        tmp: PathBuf,
        files: Vec<FileEntry>,
        pieces: Vec<(String, PieceRecord)>,
    ) -> Result<Prepared, CkptError> {
        let bytes = files.iter().map(|f| f.bytes).sum();
        let part = Part { step, rank: role.rank, world_size: role.world, files, pieces };
        write_synced(&tmp.join(PART_FILE), &serde_json::to_vec(&part).expect("a part always serializes"))?;
        sync_dir(&tmp)?;
        let target = self.part_dir(role.rank, step);
        if std::fs::symlink_metadata(&target).is_ok() {
            std::fs::remove_dir_all(&target).map_err(io("remove", &target))?;
        }
        std::fs::rename(&tmp, &target).map_err(io("hand over", &target))?;
        sync_dir(&self.dir)?;
        Ok(Prepared { step, tmp: target, bytes, part: true })
    }

    /// Rank 0: waits for rank `rank`'s part of `step` (at most `role.wait`), checks it, and moves
    /// its files into the checkpoint's temporary folder `tmp`.
    fn take_part(
        &self,
        step: u64,
        rank: usize,
        role: ShardRole,
        tmp: &Path,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Part, CkptError> {
        let dir = self.part_dir(rank, step);
        let path = dir.join(PART_FILE);
        let deadline = std::time::Instant::now() + role.wait;
        while !path.is_file() {
            if give_up() || std::time::Instant::now() >= deadline {
                return Err(CkptError::Writer {
                    message: format!(
                        "rank {rank} did not hand over its part of the checkpoint of step {step} ({}) within {:.0} s",
                        dir.display(),
                        role.wait.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let text = stoke_fsio::read_capped(&path, stoke_fsio::MANIFEST_CAP).map_err(io("read", &path))?;
        let part: Part = serde_json::from_slice(&text)
            .map_err(|e| CkptError::BadManifest { path: path.clone(), message: e.to_string() })?;
        if (part.step, part.rank, part.world_size) != (step, rank, role.world) {
            return Err(CkptError::BadManifest {
                path,
                message: format!(
                    "is rank {} of {} for step {}, expected rank {rank} of {} for step {step}",
                    part.rank, part.world_size, part.step, role.world
                ),
            });
        }
        for file in &part.files {
            if !plain_name(&file.name)
                || file.name == MANIFEST
                || !file.name.ends_with(&format!("-rank{rank}.safetensors"))
            {
                return Err(CkptError::BadManifest {
                    path,
                    message: format!("file name {:?} is not rank {rank}'s", file.name),
                });
            }
            let from = dir.join(&file.name);
            let len = std::fs::metadata(&from).map_err(io("stat", &from))?.len();
            if len != file.bytes {
                return Err(CkptError::Corrupt {
                    path: from,
                    message: format!("{len} bytes on disk, its part.json says {}", file.bytes),
                });
            }
            std::fs::rename(&from, tmp.join(&file.name)).map_err(io("move", &from))?;
        }
        std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
        Ok(part)
    }

    /// Step 2 of the commit protocol: the prepared folder becomes `step-<n>`, durably.
    pub(crate) fn publish(&self, prepared: Prepared) -> Result<PathBuf, CkptError> {
        let Prepared { step, tmp, .. } = prepared;
        let target = self.step_dir(step);
        match std::fs::symlink_metadata(&target) {
            Ok(_) => {
                rename_exchange(&tmp, &target)
                    .map_err(|source| CkptError::NoAtomicReplace { path: target.clone(), source })?;
                sync_dir(&self.dir)?;
                // The replaced checkpoint now sits under the temporary name.
                self.discard(&tmp, &format!("replaced-step-{step}"))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::rename(&tmp, &target).map_err(io("commit", &target))?;
                sync_dir(&self.dir)?;
            }
            Err(e) => return Err(CkptError::Io { action: "inspect", path: target, source: e }),
        }
        Ok(target)
    }

    /// Drops a prepared checkpoint that will not be published.
    pub(crate) fn abandon(&self, prepared: Prepared) -> Result<(), CkptError> {
        std::fs::remove_dir_all(&prepared.tmp).map_err(io("remove", &prepared.tmp))
    }

    /// Steps of the committed checkpoints, oldest first: folders `step-<n>` whose manifest is
    /// complete and whose files all have the listed sizes. Anything else is not a checkpoint.
    pub fn list(&self) -> Result<Vec<u64>, CkptError> {
        let mut steps = Vec::new();
        for (step, path) in self.step_folders()? {
            if inspect(&path, Some(step)).is_ok() {
                steps.push(step);
            }
        }
        Ok(steps)
    }

    /// Steps of every `step-<n>` folder, oldest first, damaged or not. A folder gets that name
    /// only by the commit's rename, once complete, so one that fails its checks is damage (a
    /// truncated file, a lost manifest), never a checkpoint still being written: a resume names it.
    pub fn all_steps(&self) -> Result<Vec<u64>, CkptError> {
        Ok(self.step_folders()?.into_iter().map(|(step, _)| step).collect())
    }

    /// Every folder named `step-<n>`, committed or not, oldest first.
    fn step_folders(&self) -> Result<Vec<(u64, PathBuf)>, CkptError> {
        let read = match std::fs::read_dir(&self.dir) {
            Ok(read) => read,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(CkptError::Io { action: "list", path: self.dir.clone(), source: e }),
        };
        let mut out = Vec::new();
        for entry in read {
            let entry = entry.map_err(io("list", &self.dir))?;
            let name = entry.file_name();
            if let Some(step) = name.to_str().and_then(parse_step_name) {
                out.push((step, entry.path()));
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    pub fn latest(&self) -> Result<Option<u64>, CkptError> {
        Ok(self.list()?.last().copied())
    }

    /// The manifest of the committed checkpoint of `step` (sizes checked, data not read).
    pub fn manifest(&self, step: u64) -> Result<Manifest, CkptError> {
        let path = self.step_dir(step);
        if !path.join(MANIFEST).is_file() {
            return Err(CkptError::Missing { dir: self.dir.clone(), step });
        }
        inspect(&path, Some(step))
    }

    /// Reads and verifies (sizes, then every CRC-32) the checkpoint of `step`.
    pub fn load(&self, step: u64) -> Result<Loaded, CkptError> {
        let path = self.step_dir(step);
        if !path.join(MANIFEST).is_file() {
            return Err(CkptError::Missing { dir: self.dir.clone(), step });
        }
        let loaded = load_dir(&path)?;
        if loaded.manifest.step != step {
            return Err(CkptError::BadManifest {
                path: path.join(MANIFEST),
                message: format!("says step {}, the folder is step {step}", loaded.manifest.step),
            });
        }
        Ok(loaded)
    }

    /// Deletes the checkpoint of `step`: renamed to trash (and the rename made durable) before
    /// any file is removed.
    pub fn delete(&self, step: u64) -> Result<(), CkptError> {
        let path = self.step_dir(step);
        self.discard(&path, &format!("step-{step}"))
    }

    fn discard(&self, path: &Path, what: &str) -> Result<(), CkptError> {
        let trash = self.trash_dir(what);
        std::fs::rename(path, &trash).map_err(io("move to trash", path))?;
        sync_dir(&self.dir)?;
        std::fs::remove_dir_all(&trash).map_err(io("remove", &trash))
    }

    /// Removes this writer's temporaries, trash and parts (what a killed predecessor left).
    pub fn remove_own_leftovers(&self) -> Result<(), CkptError> {
        let prefixes = [TMP_PREFIX, TRASH_PREFIX, PART_PREFIX].map(|p| format!("{p}{}-", self.writer));
        self.remove_leftovers(&prefixes)
    }

    /// Removes every writer's temporaries, trash and parts. Only for a caller that knows no writer
    /// of this folder is alive (it holds the run's lock and starts none).
    pub fn remove_all_leftovers(&self) -> Result<(), CkptError> {
        self.remove_leftovers(&[TMP_PREFIX, TRASH_PREFIX, PART_PREFIX].map(String::from))
    }

    /// Removes every rank's parts. Rank 0 of a sharded run calls it when it starts, before any
    /// rank can hand over a part of this run: what is there was left by an earlier run (of any
    /// world size).
    pub fn remove_all_parts(&self) -> Result<(), CkptError> {
        self.remove_leftovers(&[PART_PREFIX.to_string()])
    }

    fn remove_leftovers(&self, prefixes: &[String]) -> Result<(), CkptError> {
        if !self.dir.is_dir() {
            return Ok(());
        }
        for entry in std::fs::read_dir(&self.dir).map_err(io("list", &self.dir))? {
            let entry = entry.map_err(io("list", &self.dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if prefixes.iter().any(|p| name.starts_with(p.as_str())) {
                let path = entry.path();
                std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
            }
        }
        Ok(())
    }
}

pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    // Only the canonical spelling, so one step has one folder name.
    let step = digits.parse::<u64>().ok()?;
    (step.to_string() == digits).then_some(step)
}

/// A file name inside the checkpoint folder itself: no path separator, not hidden.
fn plain_name(name: &str) -> bool {
    !name.contains(['/', '\\']) && !name.starts_with('.')
}

/// Reads a checkpoint folder's manifest and checks that every listed file has its size; with
/// `step`, also that the manifest names that step.
pub(crate) fn inspect(path: &Path, step: Option<u64>) -> Result<Manifest, CkptError> {
    let manifest_path = path.join(MANIFEST);
    let text = stoke_fsio::read_capped(&manifest_path, stoke_fsio::MANIFEST_CAP).map_err(io("read", &manifest_path))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| CkptError::BadManifest { path: manifest_path.clone(), message: e.to_string() })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(CkptError::BadManifest {
            path: manifest_path,
            message: format!("format_version {} is not {FORMAT_VERSION}", manifest.format_version),
        });
    }
    if let Some(step) = step.filter(|&s| s != manifest.step) {
        return Err(CkptError::BadManifest {
            path: manifest_path,
            message: format!("says step {}, the folder is step {step}", manifest.step),
        });
    }
    for entry in &manifest.files {
        if !plain_name(&entry.name) {
            return Err(CkptError::BadManifest {
                path: manifest_path,
                message: format!("file name {:?} is not a plain name", entry.name),
            });
        }
        let file_path = path.join(&entry.name);
        let len = std::fs::metadata(&file_path).map_err(io("stat", &file_path))?.len();
        if len != entry.bytes {
            return Err(CkptError::Corrupt {
                path: file_path,
                message: format!("{len} bytes on disk, the manifest says {}", entry.bytes),
            });
        }
    }
    if let Some(table) = &manifest.shards {
        let names: Vec<String> = manifest.files.iter().map(|f| f.name.clone()).collect();
        check_table(table, &names, &manifest_path)?;
    }
    Ok(manifest)
}

/// Reads and verifies a checkpoint folder: sizes, then every file's CRC-32, then the format.
pub fn load_dir(path: &Path) -> Result<Loaded, CkptError> {
    let manifest = inspect(path, None)?;
    let mut by_file = BTreeMap::new();
    for entry in &manifest.files {
        let file_path = path.join(&entry.name);
        let bytes = read_verified(&file_path, entry)?;
        let tensors = deserialize(&bytes).map_err(|message| CkptError::Corrupt { path: file_path.clone(), message })?;
        by_file.insert(entry.name.clone(), tensors);
    }
    let files = match &manifest.shards {
        // The ranks' pieces assembled: the same logical files a whole checkpoint holds.
        Some(table) => assemble(table, by_file, path)?,
        None => by_file
            .into_iter()
            .map(|(name, tensors)| (name.strip_suffix(".safetensors").unwrap_or(&name).to_string(), tensors))
            .collect(),
    };
    Ok(Loaded { path: path.to_path_buf(), manifest, files })
}

fn read_verified(file_path: &Path, entry: &FileEntry) -> Result<Vec<u8>, CkptError> {
    let bytes = std::fs::read(file_path).map_err(io("read", file_path))?;
    if bytes.len() as u64 != entry.bytes {
        return Err(CkptError::Corrupt {
            path: file_path.into(),
            message: format!("{} bytes on disk, the manifest says {}", bytes.len(), entry.bytes),
        });
    }
    let crc = crc32fast::hash(&bytes);
    if crc != entry.crc32 {
        return Err(CkptError::Corrupt {
            path: file_path.into(),
            message: format!("CRC-32 {crc:08x}, the manifest says {:08x}", entry.crc32),
        });
    }
    Ok(bytes)
}

/// What `verify_dir` found.
#[derive(Debug)]
pub struct VerifyReport {
    /// Each `step-<n>` folder, oldest first, with its manifest or what is wrong with it.
    pub checkpoints: Vec<(PathBuf, Result<Manifest, CkptError>)>,
    /// Temporaries and trash: never checkpoints, removed by their writer's next commit.
    pub leftovers: Vec<PathBuf>,
}

impl VerifyReport {
    pub fn damaged(&self) -> usize {
        self.checkpoints.iter().filter(|(_, r)| r.is_err()).count()
    }
}

/// A full pass over a folder of checkpoints (or one checkpoint folder): every `step-<n>` folder's
/// manifest, sizes and CRC-32s, and the safetensors format of every file.
pub fn verify_dir(dir: &Path) -> Result<VerifyReport, CkptError> {
    let check = |path: &Path, step: Option<u64>| -> Result<Manifest, CkptError> {
        let manifest = inspect(path, step)?;
        for entry in &manifest.files {
            let file_path = path.join(&entry.name);
            let bytes = read_verified(&file_path, entry)?;
            let tensors =
                deserialize(&bytes).map_err(|message| CkptError::Corrupt { path: file_path.clone(), message })?;
            if let Some(table) = &manifest.shards {
                check_file(table, &entry.name, &tensors, &file_path)?;
            }
        }
        Ok(manifest)
    };
    if dir.join(MANIFEST).is_file() {
        let step = dir.file_name().and_then(|n| n.to_str()).and_then(parse_step_name);
        return Ok(VerifyReport { checkpoints: vec![(dir.to_path_buf(), check(dir, step))], leftovers: Vec::new() });
    }
    let store = CheckpointStore::new(dir);
    let checkpoints = store.step_folders()?.into_iter().map(|(step, path)| {
        let result = check(&path, Some(step));
        (path, result)
    });
    let checkpoints = checkpoints.collect();
    let mut leftovers = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io("list", dir))? {
        let entry = entry.map_err(io("list", dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if [TMP_PREFIX, TRASH_PREFIX, PART_PREFIX].iter().any(|p| name.starts_with(p)) {
            leftovers.push(entry.path());
        }
    }
    leftovers.sort();
    Ok(VerifyReport { checkpoints, leftovers })
}

/// Retention policy, apart from the mechanism: given committed steps (any order), which to delete
/// so that the newest `keep` remain (`keep == 0` keeps everything), and of the older ones every
/// multiple of `keep_every` (when it is not 0: the long-term milestones).
pub fn steps_to_delete(steps: &[u64], keep: usize, keep_every: u64) -> Vec<u64> {
    if keep == 0 || steps.len() <= keep {
        return Vec::new();
    }
    let mut sorted = steps.to_vec();
    sorted.sort_unstable();
    let milestone = |step: u64| keep_every > 0 && step % keep_every == 0;
    sorted[..sorted.len() - keep].iter().copied().filter(|&step| !milestone(step)).collect()
}

/// `steps_to_delete`, never deleting `protected` (which then does not count toward `keep`).
pub fn steps_to_delete_protecting(steps: &[u64], keep: usize, keep_every: u64, protected: Option<u64>) -> Vec<u64> {
    let others: Vec<u64> = steps.iter().copied().filter(|&s| Some(s) != protected).collect();
    steps_to_delete(&others, keep, keep_every)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn retention_keeps_the_protected_step() {
        assert_eq!(steps_to_delete_protecting(&[10, 20, 30, 40], 2, 0, Some(10)), vec![20]);
        assert_eq!(steps_to_delete_protecting(&[10, 20, 30, 40], 2, 0, Some(40)), vec![10]);
        assert_eq!(steps_to_delete_protecting(&[10, 20, 30, 40], 2, 0, None), vec![10, 20]);
        assert!(steps_to_delete_protecting(&[10, 20], 0, 0, Some(10)).is_empty());
    }

    fn record(name: &str, values: &[f32]) -> TensorRecord {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorRecord::new(name, DType::F32, vec![values.len()], data).unwrap()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn save_list_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let model = [record("a", &[1.0, 2.0]), record("b", &[3.0])];
        store.save(10, &[("model", &model)], serde_json::json!({"data_position": 10})).unwrap();
        store.save(20, &[("model", &model)], serde_json::json!({})).unwrap();
        assert_eq!(store.list().unwrap(), vec![10, 20]);
        let loaded = store.load(10).unwrap();
        assert_eq!(loaded.manifest.meta["data_position"], 10);
        assert_eq!(loaded.files["model"], model.to_vec());
        assert_eq!(names(dir.path()), ["step-10", "step-20"], "no temporaries left");
    }

    #[test]
    fn only_complete_folders_are_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        for step in [1, 2, 3, 4] {
            store.save(step, &[("model", &[record("a", &[1.0, 2.0])])], serde_json::json!({})).unwrap();
        }
        // What older code left after a kill: a manifest with a missing shard, a truncated shard,
        // a half-written manifest, a folder without a manifest.
        std::fs::remove_file(dir.path().join("step-1/model.safetensors")).unwrap();
        let shard = dir.path().join("step-2/model.safetensors");
        let bytes = std::fs::read(&shard).unwrap();
        std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
        let manifest = std::fs::read(dir.path().join("step-3/manifest.json")).unwrap();
        std::fs::write(dir.path().join("step-3/manifest.json"), &manifest[..manifest.len() / 2]).unwrap();
        std::fs::create_dir_all(dir.path().join("step-7")).unwrap();
        std::fs::create_dir_all(dir.path().join("step-007")).unwrap();
        assert_eq!(store.list().unwrap(), vec![4]);
        assert!(matches!(store.load(7), Err(CkptError::Missing { .. })));
        let report = verify_dir(dir.path()).unwrap();
        assert_eq!(report.damaged(), 4, "{report:?}");
    }

    #[test]
    fn a_writer_removes_its_own_leftovers_and_no_one_else_s() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path()).with_writer("rank0").unwrap();
        // What kills leave behind: a temporary mid-write, trash mid-removal; and another rank's.
        for name in [".tmp-rank0-step-5", ".trash-rank0-step-3-1-0", ".tmp-rank1-step-5"] {
            std::fs::create_dir_all(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join(MANIFEST), b"{}").unwrap();
        }
        assert_eq!(store.list().unwrap(), Vec::<u64>::new());
        assert_eq!(verify_dir(dir.path()).unwrap().leftovers.len(), 3);
        store.save(9, &[("model", &[record("a", &[1.0])])], serde_json::json!({})).unwrap();
        assert_eq!(names(dir.path()), [".tmp-rank1-step-5", "step-9"]);
        assert!(CheckpointStore::new(dir.path()).with_writer("rank/1").is_err());
    }

    #[test]
    fn overwrite_replaces_in_place_and_delete_goes_through_trash() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        store.save(5, &[("model", &[record("a", &[1.0])])], serde_json::json!({"v": 1})).unwrap();
        store.save(5, &[("model", &[record("a", &[2.0])])], serde_json::json!({"v": 2})).unwrap();
        let loaded = store.load(5).unwrap();
        assert_eq!((loaded.manifest.meta["v"].as_u64(), &loaded.files["model"][0]), (Some(2), &record("a", &[2.0])));
        assert_eq!(names(dir.path()), ["step-5"]);
        store.delete(5).unwrap();
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn flipped_byte_is_reported_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let path = store.save(1, &[("model", &[record("a", &[1.0, 2.0, 3.0])])], serde_json::json!({})).unwrap();
        let file = path.join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&file, &bytes).unwrap();
        assert_eq!(store.list().unwrap(), vec![1], "same size: listed, caught on load");
        let err = store.load(1).unwrap_err().to_string();
        assert!(err.contains("model.safetensors") && err.contains("CRC-32"), "{err}");
        let report = verify_dir(dir.path()).unwrap();
        let err = report.checkpoints[0].1.as_ref().unwrap_err().to_string();
        assert!(err.contains("step-1/model.safetensors") && err.contains("CRC-32"), "{err}");
        std::fs::write(&file, &bytes[..10]).unwrap();
        let err = store.load(1).unwrap_err().to_string();
        assert!(err.contains("bytes on disk"), "{err}");
    }

    #[test]
    fn malformed_manifest_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let path = store.save(3, &[], serde_json::json!({})).unwrap();
        std::fs::write(path.join(MANIFEST), b"{\"format_version\": 1, \"step\":").unwrap();
        let err = store.load(3).unwrap_err().to_string();
        assert!(err.contains("manifest.json") && err.contains("malformed"), "{err}");
    }

    #[test]
    fn retention_keeps_newest() {
        assert_eq!(steps_to_delete(&[30, 10, 20, 40], 2, 0), vec![10, 20]);
        assert_eq!(steps_to_delete(&[10, 20], 3, 0), Vec::<u64>::new());
        assert_eq!(steps_to_delete(&[10, 20], 0, 0), Vec::<u64>::new());
        // Older milestones (multiples of keep_every) stay beside the newest `keep`.
        assert_eq!(steps_to_delete(&[10, 20, 30, 40, 50, 60], 2, 20), vec![10, 30]);
        assert_eq!(steps_to_delete(&[20, 40, 50], 1, 20), Vec::<u64>::new());
        assert_eq!(steps_to_delete_protecting(&[10, 20, 30, 40, 50], 1, 20, Some(10)), vec![30]);
    }
}

#[cfg(test)]
mod fuzz;

//! The executor's state: one SQLite database (`sched.db` in the state folder, WAL journal,
//! synchronous commits) holding the jobs, their allocations, the decisions with their reasons,
//! each job's history and its measured throughput.
//!
//! The server writes here before it acts (a decision is committed before the job is told; a start
//! is committed as `starting` before the process exists, and the process's pid and start time right
//! after), so a server killed at any moment finds on restart every job and what it was doing.
//! `submit`, `status` and `cancel` are other processes on the same file; SQLite's locking keeps
//! them apart (`busy_timeout` 10 s).

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension, Transaction};

use crate::SchedError;

/// The database's file name in the state folder.
pub const DB_FILE: &str = "sched.db";

/// A job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    /// Submitted (or taken back after its process was lost); no process.
    Queued,
    /// Its start is committed; the process may or may not exist yet (see `Store::started`).
    Starting,
    /// Its launcher runs (pid and start time recorded).
    Running,
    Finished,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Starting => "starting",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    fn parse(text: &str) -> JobState {
        match text {
            "starting" => JobState::Starting,
            "running" => JobState::Running,
            "finished" => JobState::Finished,
            "failed" => JobState::Failed,
            "cancelled" => JobState::Cancelled,
            _ => JobState::Queued,
        }
    }

    /// Submitted and not ended.
    pub fn is_active(self) -> bool {
        matches!(self, JobState::Queued | JobState::Starting | JobState::Running)
    }
}

/// What `submit` stores.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub name: String,
    /// The training config file (absolute), if any.
    pub config: Option<PathBuf>,
    /// `--set` overrides, in order.
    pub overrides: Vec<String>,
    pub min_workers: usize,
    pub max_workers: usize,
    pub priority: f64,
    /// `train.steps`: the job's work.
    pub steps: u64,
    pub ckpt_every: u64,
    /// Sequences each worker adds to a step (micro_batch x grad_accum of the resolved config).
    pub batch_per_worker: usize,
    /// The global batch grows with the workers (`train.global_batch` unset): the statistical
    /// efficiency of a larger world then depends on the gradient noise scale.
    pub batch_grows: bool,
}

/// One row of the jobs table.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRow {
    pub id: i64,
    pub job: NewJob,
    pub state: JobState,
    /// Unix seconds.
    pub submit_s: f64,
    pub start_s: Option<f64>,
    pub finish_s: Option<f64>,
    /// Workers the policy gives it (0: none).
    pub alloc: usize,
    pub last_resize_s: Option<f64>,
    pub resizes: u64,
    /// The launcher's pid and start time (clock ticks after boot, `/proc/PID/stat` field 22):
    /// together they name one process even after the pid is reused.
    pub pid: Option<(i32, u64)>,
    /// How many times a launcher was started for it (restarts after a lost launcher included).
    pub launches: u64,
    pub exit_code: Option<i32>,
    pub cancel_requested: bool,
    pub detail: String,
    /// The slots (indices into the server's cores) the job holds, in rank order: its workers run
    /// pinned on the first `alloc` of them; past those, slots it still runs on while it shrinks.
    pub slots: Vec<usize>,
}

/// One policy decision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Decision {
    pub time_s: f64,
    pub job: i64,
    pub policy: String,
    pub from_workers: usize,
    pub to_workers: usize,
    pub reason: String,
}

/// One line of a job's history: launched, adopted, resized, ended...
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HistoryEntry {
    pub time_s: f64,
    pub job: i64,
    pub event: String,
    pub workers: usize,
    /// The step it (re)started from, or reached.
    pub step: u64,
    pub detail: String,
}

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE,
    config TEXT,
    overrides TEXT NOT NULL,
    min_workers INTEGER NOT NULL,
    max_workers INTEGER NOT NULL,
    priority REAL NOT NULL,
    steps INTEGER NOT NULL,
    ckpt_every INTEGER NOT NULL,
    state TEXT NOT NULL,
    submit_s REAL NOT NULL,
    start_s REAL,
    finish_s REAL,
    alloc INTEGER NOT NULL DEFAULT 0,
    last_resize_s REAL,
    resizes INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    pid_start INTEGER,
    launches INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    cancel INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    slots TEXT NOT NULL DEFAULT '',
    batch_per_worker INTEGER NOT NULL DEFAULT 0,
    batch_grows INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS decisions(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time_s REAL NOT NULL, job INTEGER NOT NULL, policy TEXT NOT NULL,
    from_workers INTEGER NOT NULL, to_workers INTEGER NOT NULL, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS history(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time_s REAL NOT NULL, job INTEGER NOT NULL, event TEXT NOT NULL,
    workers INTEGER NOT NULL, step INTEGER NOT NULL, detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS throughput(
    job INTEGER NOT NULL, workers INTEGER NOT NULL, steps_per_s REAL NOT NULL, samples INTEGER NOT NULL,
    PRIMARY KEY(job, workers)
);
";

const JOB_COLUMNS: &str = "id, name, config, overrides, min_workers, max_workers, priority, steps, ckpt_every, state, \
     submit_s, start_s, finish_s, alloc, last_resize_s, resizes, pid, pid_start, launches, exit_code, cancel, detail, \
     slots, batch_per_worker, batch_grows";

/// Columns added after the first schema, with their definitions: added to an older database when
/// it is opened.
const ADDED_COLUMNS: [(&str, &str); 3] = [
    ("slots", "TEXT NOT NULL DEFAULT ''"),
    ("batch_per_worker", "INTEGER NOT NULL DEFAULT 0"),
    ("batch_grows", "INTEGER NOT NULL DEFAULT 0"),
];

/// `2,0,1` to [2, 0, 1]; anything else is skipped.
fn parse_slots(text: &str) -> Vec<usize> {
    text.split(',').filter_map(|s| s.trim().parse().ok()).collect()
}

fn slots_text(slots: &[usize]) -> String {
    slots.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

fn job_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<JobRow> {
    let overrides: String = row.get(3)?;
    let pid: Option<i32> = row.get(16)?;
    let pid_start: Option<i64> = row.get(17)?;
    Ok(JobRow {
        id: row.get(0)?,
        job: NewJob {
            name: row.get(1)?,
            config: row.get::<_, Option<String>>(2)?.map(PathBuf::from),
            overrides: serde_json::from_str(&overrides).unwrap_or_default(),
            min_workers: row.get::<_, i64>(4)? as usize,
            max_workers: row.get::<_, i64>(5)? as usize,
            priority: row.get(6)?,
            steps: row.get::<_, i64>(7)? as u64,
            ckpt_every: row.get::<_, i64>(8)? as u64,
            batch_per_worker: row.get::<_, i64>(23)? as usize,
            batch_grows: row.get::<_, i64>(24)? != 0,
        },
        state: JobState::parse(&row.get::<_, String>(9)?),
        submit_s: row.get(10)?,
        start_s: row.get(11)?,
        finish_s: row.get(12)?,
        alloc: row.get::<_, i64>(13)? as usize,
        last_resize_s: row.get(14)?,
        resizes: row.get::<_, i64>(15)? as u64,
        pid: pid.zip(pid_start.map(|s| s as u64)),
        launches: row.get::<_, i64>(18)? as u64,
        exit_code: row.get(19)?,
        cancel_requested: row.get::<_, i64>(20)? != 0,
        detail: row.get(21)?,
        slots: parse_slots(&row.get::<_, String>(22)?),
    })
}

/// One allocation change, committed with its decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub job: i64,
    pub from_workers: usize,
    pub to_workers: usize,
    pub reason: String,
    /// A resize of a running job (counted, and restarting the minimum interval).
    pub resize: bool,
}

impl Store {
    /// Opens (creating when absent) `dir/sched.db`.
    pub fn open(dir: &Path) -> Result<Store, SchedError> {
        let path = dir.join(DB_FILE);
        std::fs::create_dir_all(dir).map_err(|source| SchedError::Io { path: dir.to_path_buf(), source })?;
        let err = |what: &'static str| {
            let path = path.clone();
            move |source| SchedError::Store { path: path.clone(), what, source }
        };
        let conn = Connection::open(&path).map_err(err("open"))?;
        conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(err("set the busy timeout"))?;
        // WAL: readers (status, the launchers' slot checks) never block the server's commits;
        // synchronous=FULL: a committed decision survives a power cut, not only a killed process.
        conn.pragma_update(None, "journal_mode", "WAL").map_err(err("switch to WAL"))?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(err("set synchronous"))?;
        conn.execute_batch(SCHEMA).map_err(err("create the schema"))?;
        let present: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('jobs')")
            .and_then(|mut stmt| stmt.query_map([], |r| r.get(0))?.collect())
            .map_err(err("read the schema"))?;
        for (column, definition) in ADDED_COLUMNS {
            if !present.iter().any(|p| p == column) {
                conn.execute_batch(&format!("ALTER TABLE jobs ADD COLUMN {column} {definition}"))
                    .map_err(err("add a column"))?;
            }
        }
        Ok(Store { conn, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, what: &'static str) -> impl Fn(rusqlite::Error) -> SchedError + '_ {
        move |source| SchedError::Store { path: self.path.clone(), what, source }
    }

    /// Runs `f` in one transaction (committed when it returns Ok).
    fn write<T>(
        &mut self,
        what: &'static str,
        f: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
    ) -> Result<T, SchedError> {
        let path = self.path.clone();
        let err = |source| SchedError::Store { path: path.clone(), what, source };
        let tx = self.conn.transaction().map_err(err)?;
        let value = f(&tx).map_err(err)?;
        tx.commit().map_err(err)?;
        Ok(value)
    }

    pub fn meta(&self, key: &str) -> Result<Option<String>, SchedError> {
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(self.err("read meta"))
    }

    pub fn set_meta(&mut self, key: &str, value: &str) -> Result<(), SchedError> {
        self.write("write meta", |tx| {
            tx.execute(
                "INSERT INTO meta(key, value) VALUES(?1, ?2) ON CONFLICT(key) DO UPDATE SET value = ?2",
                [key, value],
            )
            .map(drop)
        })
    }

    /// Adds a queued job; its id. A name already used is refused.
    pub fn submit(&mut self, job: &NewJob, now_s: f64) -> Result<i64, SchedError> {
        // The name becomes the job's run folder and log file.
        stoke_fsio::check_name(&job.name)
            .map_err(|why| SchedError::BadJob { name: stoke_fsio::clip(&job.name).into_owned(), why })?;
        if self.job(&job.name)?.is_some() {
            return Err(SchedError::BadJob { name: job.name.clone(), why: "a job of that name exists".into() });
        }
        let overrides = serde_json::to_string(&job.overrides).expect("strings serialize");
        self.write("submit", |tx| {
            tx.execute(
                "INSERT INTO jobs(name, config, overrides, min_workers, max_workers, priority, steps, ckpt_every, state, submit_s,
                 batch_per_worker, batch_grows)
                 VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'queued', ?9, ?10, ?11)",
                params![
                    job.name,
                    job.config.as_ref().map(|p| p.display().to_string()),
                    overrides,
                    job.min_workers as i64,
                    job.max_workers as i64,
                    job.priority,
                    job.steps as i64,
                    job.ckpt_every as i64,
                    now_s,
                    job.batch_per_worker as i64,
                    job.batch_grows as i64
                ],
            )?;
            let id = tx.last_insert_rowid();
            tx.execute(
                "INSERT INTO history(time_s, job, event, workers, step, detail) VALUES(?1, ?2, 'submitted', 0, 0, '')",
                params![now_s, id],
            )?;
            Ok(id)
        })
    }

    /// Every job, in submission order.
    pub fn jobs(&self) -> Result<Vec<JobRow>, SchedError> {
        let mut stmt =
            self.conn.prepare(&format!("SELECT {JOB_COLUMNS} FROM jobs ORDER BY id")).map_err(self.err("read jobs"))?;
        let rows = stmt.query_map([], job_row).map_err(self.err("read jobs"))?;
        rows.collect::<Result<_, _>>().map_err(self.err("read jobs"))
    }

    /// A job by name, or by id when `key` is a number.
    pub fn job(&self, key: &str) -> Result<Option<JobRow>, SchedError> {
        let by = if key.parse::<i64>().is_ok() { "id" } else { "name" };
        self.conn
            .query_row(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE {by} = ?1"), [key], job_row)
            .optional()
            .map_err(self.err("read a job"))
    }

    /// Commits the policy's changes and their decisions in one transaction.
    pub fn commit_allocation(&mut self, now_s: f64, policy: &str, changes: &[Change]) -> Result<(), SchedError> {
        self.write("commit an allocation", |tx| {
            for c in changes {
                if c.resize {
                    tx.execute(
                        "UPDATE jobs SET alloc = ?1, last_resize_s = ?2, resizes = resizes + 1 WHERE id = ?3",
                        params![c.to_workers as i64, now_s, c.job],
                    )?;
                } else {
                    tx.execute("UPDATE jobs SET alloc = ?1 WHERE id = ?2", params![c.to_workers as i64, c.job])?;
                }
                tx.execute(
                    "INSERT INTO decisions(time_s, job, policy, from_workers, to_workers, reason) VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
                    params![now_s, c.job, policy, c.from_workers as i64, c.to_workers as i64, c.reason],
                )?;
            }
            Ok(())
        })
    }

    /// Before a launcher is started: the job is `starting`, its launch counted.
    pub fn starting(&mut self, id: i64, now_s: f64) -> Result<(), SchedError> {
        self.write("mark a job starting", |tx| {
            tx.execute(
                "UPDATE jobs SET state = 'starting', pid = NULL, pid_start = NULL, launches = launches + 1,
                 start_s = COALESCE(start_s, ?1), last_resize_s = ?1 WHERE id = ?2",
                params![now_s, id],
            )
            .map(drop)
        })
    }

    /// After the launcher started (or was found again): `running`, with its pid and start time.
    pub fn started(&mut self, id: i64, pid: i32, pid_start: u64, entry: &HistoryEntry) -> Result<(), SchedError> {
        self.write("mark a job running", |tx| {
            tx.execute(
                "UPDATE jobs SET state = 'running', pid = ?1, pid_start = ?2 WHERE id = ?3",
                params![pid, pid_start as i64, id],
            )?;
            insert_history(tx, entry)
        })
    }

    /// The job ended (`Finished`, `Failed`, `Cancelled`) or goes back to the queue (`Queued`,
    /// after its launcher was lost: the next start resumes its latest checkpoint).
    pub fn ended(
        &mut self,
        id: i64,
        state: JobState,
        exit_code: Option<i32>,
        entry: &HistoryEntry,
    ) -> Result<(), SchedError> {
        let finish = (!state.is_active()).then_some(entry.time_s);
        self.write("record a job's end", |tx| {
            tx.execute(
                "UPDATE jobs SET state = ?1, exit_code = ?2, finish_s = ?3, pid = NULL, pid_start = NULL, alloc = 0,
                 detail = ?4, slots = '' WHERE id = ?5",
                params![state.name(), exit_code, finish, entry.detail, id],
            )?;
            insert_history(tx, entry)
        })
    }

    pub fn history_entry(&mut self, entry: &HistoryEntry) -> Result<(), SchedError> {
        self.write("append history", |tx| insert_history(tx, entry))
    }

    /// Asks the server to stop a job; a queued one is cancelled at once. Returns its state after.
    pub fn request_cancel(&mut self, id: i64, now_s: f64) -> Result<JobState, SchedError> {
        self.write("cancel", |tx| {
            tx.execute(
                "UPDATE jobs SET state = 'cancelled', finish_s = ?1, alloc = 0 WHERE id = ?2 AND state = 'queued'",
                params![now_s, id],
            )?;
            tx.execute("UPDATE jobs SET cancel = 1 WHERE id = ?1", [id])?;
            let state: String = tx.query_row("SELECT state FROM jobs WHERE id = ?1", [id], |r| r.get(0))?;
            insert_history(
                tx,
                &HistoryEntry {
                    time_s: now_s,
                    job: id,
                    event: "cancel_requested".into(),
                    workers: 0,
                    step: 0,
                    detail: String::new(),
                },
            )?;
            Ok(JobState::parse(&state))
        })
    }

    /// Records the slots a job holds (see `JobRow::slots`), before its workers are told.
    pub fn set_slots(&mut self, id: i64, slots: &[usize]) -> Result<(), SchedError> {
        let text = slots_text(slots);
        self.write("record a job's slots", |tx| {
            tx.execute("UPDATE jobs SET slots = ?1 WHERE id = ?2", params![text, id]).map(drop)
        })
    }

    /// Replaces a job's measured throughput points (workers, steps/s, steps measured).
    pub fn set_throughput(&mut self, id: i64, points: &[(usize, f64, usize)]) -> Result<(), SchedError> {
        self.write("record throughput", |tx| {
            tx.execute("DELETE FROM throughput WHERE job = ?1", [id])?;
            for &(w, t, n) in points {
                tx.execute(
                    "INSERT INTO throughput(job, workers, steps_per_s, samples) VALUES(?1, ?2, ?3, ?4)",
                    params![id, w as i64, t, n as i64],
                )?;
            }
            Ok(())
        })
    }

    pub fn throughput(&self, id: i64) -> Result<Vec<(usize, f64, usize)>, SchedError> {
        let mut stmt = self
            .conn
            .prepare("SELECT workers, steps_per_s, samples FROM throughput WHERE job = ?1 ORDER BY workers")
            .map_err(self.err("read throughput"))?;
        let rows = stmt
            .query_map([id], |r| Ok((r.get::<_, i64>(0)? as usize, r.get(1)?, r.get::<_, i64>(2)? as usize)))
            .map_err(self.err("read throughput"))?;
        rows.collect::<Result<_, _>>().map_err(self.err("read throughput"))
    }

    pub fn decisions(&self) -> Result<Vec<Decision>, SchedError> {
        let mut stmt = self
            .conn
            .prepare("SELECT time_s, job, policy, from_workers, to_workers, reason FROM decisions ORDER BY id")
            .map_err(self.err("read decisions"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(Decision {
                    time_s: r.get(0)?,
                    job: r.get(1)?,
                    policy: r.get(2)?,
                    from_workers: r.get::<_, i64>(3)? as usize,
                    to_workers: r.get::<_, i64>(4)? as usize,
                    reason: r.get(5)?,
                })
            })
            .map_err(self.err("read decisions"))?;
        rows.collect::<Result<_, _>>().map_err(self.err("read decisions"))
    }

    pub fn history(&self) -> Result<Vec<HistoryEntry>, SchedError> {
        let mut stmt = self
            .conn
            .prepare("SELECT time_s, job, event, workers, step, detail FROM history ORDER BY id")
            .map_err(self.err("read history"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(HistoryEntry {
                    time_s: r.get(0)?,
                    job: r.get(1)?,
                    event: r.get(2)?,
                    workers: r.get::<_, i64>(3)? as usize,
                    step: r.get::<_, i64>(4)? as u64,
                    detail: r.get(5)?,
                })
            })
            .map_err(self.err("read history"))?;
        rows.collect::<Result<_, _>>().map_err(self.err("read history"))
    }
}

fn insert_history(tx: &Transaction<'_>, e: &HistoryEntry) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT INTO history(time_s, job, event, workers, step, detail) VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
        params![e.time_s, e.job, e.event, e.workers as i64, e.step as i64, e.detail],
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> NewJob {
        NewJob {
            name: name.into(),
            config: None,
            overrides: vec!["train.steps=10".into()],
            min_workers: 1,
            max_workers: 2,
            priority: 1.0,
            steps: 10,
            ckpt_every: 5,
            batch_per_worker: 8,
            batch_grows: false,
        }
    }

    #[test]
    fn an_older_database_gets_the_added_columns() {
        let dir = tempfile::tempdir().unwrap();
        {
            let conn = Connection::open(dir.path().join(DB_FILE)).unwrap();
            // The jobs table as first released, without the added columns.
            let first = SCHEMA.replace(
                ",\n    slots TEXT NOT NULL DEFAULT '',\n    batch_per_worker INTEGER NOT NULL DEFAULT 0,\n    batch_grows INTEGER NOT NULL DEFAULT 0",
                "",
            );
            assert_ne!(first, SCHEMA);
            conn.execute_batch(&first).unwrap();
            conn.execute(
                "INSERT INTO jobs(name, overrides, min_workers, max_workers, priority, steps, ckpt_every, state, submit_s)
                 VALUES('old', '[]', 1, 2, 1.0, 10, 5, 'queued', 1.0)",
                [],
            )
            .unwrap();
        }
        let mut store = Store::open(dir.path()).unwrap();
        let old = store.job("old").unwrap().unwrap();
        assert_eq!((old.slots.len(), old.job.batch_per_worker, old.job.batch_grows), (0, 0, false));
        store.set_slots(old.id, &[0]).unwrap();
        assert_eq!(store.job("old").unwrap().unwrap().slots, [0]);
    }

    #[test]
    fn jobs_decisions_and_history_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let a = store.submit(&job("a"), 100.0).unwrap();
        assert!(store.submit(&job("a"), 101.0).unwrap_err().to_string().contains("exists"));
        let change = Change { job: a, from_workers: 0, to_workers: 2, reason: "admitted".into(), resize: false };
        store.commit_allocation(102.0, "fair", &[change]).unwrap();
        store.starting(a, 102.0).unwrap();
        let entry = HistoryEntry {
            time_s: 103.0,
            job: a,
            event: "launched".into(),
            workers: 2,
            step: 0,
            detail: String::new(),
        };
        store.started(a, 4242, 777, &entry).unwrap();
        store.set_throughput(a, &[(1, 10.0, 5), (2, 18.0, 7)]).unwrap();
        store.set_slots(a, &[1, 0]).unwrap();
        drop(store);
        // A second process on the same file: what the first committed is there.
        let mut store = Store::open(dir.path()).unwrap();
        let row = store.job("a").unwrap().unwrap();
        assert_eq!((row.state, row.alloc, row.pid, row.launches), (JobState::Running, 2, Some((4242, 777)), 1));
        assert_eq!(row.job, job("a"));
        assert_eq!(row.slots, [1, 0]);
        assert_eq!(store.job(&a.to_string()).unwrap().unwrap().id, a);
        assert_eq!(store.decisions().unwrap()[0].reason, "admitted");
        assert_eq!(store.throughput(a).unwrap(), vec![(1, 10.0, 5), (2, 18.0, 7)]);
        let b = store.submit(&job("b"), 104.0).unwrap();
        assert_eq!(store.request_cancel(b, 105.0).unwrap(), JobState::Cancelled);
        assert_eq!(store.request_cancel(a, 105.0).unwrap(), JobState::Running);
        assert!(store.job("a").unwrap().unwrap().cancel_requested);
        let end =
            HistoryEntry { time_s: 106.0, job: a, event: "finished".into(), workers: 2, step: 10, detail: "ok".into() };
        store.ended(a, JobState::Finished, Some(0), &end).unwrap();
        let row = store.job("a").unwrap().unwrap();
        assert_eq!((row.state, row.alloc, row.pid, row.finish_s), (JobState::Finished, 0, None, Some(106.0)));
        assert!(row.slots.is_empty(), "an ended job holds no slot");
        let events: Vec<String> = store.history().unwrap().into_iter().map(|h| h.event).collect();
        assert_eq!(events, ["submitted", "launched", "submitted", "cancel_requested", "cancel_requested", "finished"]);
    }
}

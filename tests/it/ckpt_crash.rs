//! SIGKILL at random moments while checkpoints are written and old ones deleted: every time,
//! the checkpoints left verify, the latest one resumes without --fallback, and the finished
//! run's losses equal the uninterrupted run's bit for bit, each step once.
//!
//! A few trials run with the tests; `benches/ckpt_kill.sh` runs the same driver with
//! STOKE_CKPT_KILL_TRIALS=50 or more.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{losses, stoke, SMALL};

/// A checkpoint after every step, two kept: most of the run is spent writing or deleting one.
const CRASH: &[&str] = &["train.steps=30", "ckpt.every=1", "ckpt.keep=2", "prof.enabled=false"];

fn args(run_dir: &str, name: &str) -> Vec<String> {
    let mut v: Vec<String> = SMALL.iter().chain(CRASH).map(|s| s.to_string()).collect();
    v.push(run_dir.to_string());
    v.push(format!("run.name={name}"));
    v
}

fn command(extra_args: &[&str], overrides: &[String]) -> Command {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let mut cmd = stoke(extra_args, &refs);
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    cmd
}

fn first_line_seen(metrics: &Path) -> bool {
    std::fs::read_to_string(metrics).map(|t| t.lines().count() >= 1).unwrap_or(false)
}

/// xorshift64*: enough randomness for kill times, and reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

#[derive(Default, Debug)]
struct Tally {
    trials: usize,
    /// A `.tmp-*` folder was left: killed while a checkpoint was being written.
    mid_write: usize,
    /// A `.trash-*` folder was left: killed while an old checkpoint was being deleted.
    mid_delete: usize,
    before_first_commit: usize,
    after_finish: usize,
}

fn leftovers(run: &Path, prefix: &str) -> usize {
    std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| rd.filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(prefix)).count())
        .unwrap_or(0)
}

fn step_folders(run: &Path) -> usize {
    leftovers(run, "step-")
}

fn kill_trials(trials: usize) -> Tally {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());

    // The uninterrupted run, timed from its first logged step to its exit.
    let mut child = command(&["train", "--quiet"], &args(&run_dir, "reference")).spawn().unwrap();
    let metrics = dir.path().join("reference/metrics.jsonl");
    while !first_line_seen(&metrics) && child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(2));
    }
    let training_start = Instant::now();
    assert!(child.wait().unwrap().success(), "the reference run succeeds");
    let training_ms = training_start.elapsed().as_millis() as u64;
    let expected = losses(&dir.path().join("reference"));
    assert_eq!(expected.len(), 30);

    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    println!("kill trials: {trials}, kill times uniform over the {training_ms} ms the uninterrupted run trained, seed {seed}");
    let mut rng = Rng(seed);
    let mut tally = Tally { trials, ..Tally::default() };
    for trial in 0..trials {
        let name = format!("t{trial}");
        let run = dir.path().join(&name);
        let mut child = command(&["train", "--quiet"], &args(&run_dir, &name)).spawn().unwrap();
        let metrics = run.join("metrics.jsonl");
        let start = Instant::now();
        while !first_line_seen(&metrics) && child.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(300), "trial {trial} never started training");
            std::thread::sleep(Duration::from_millis(1));
        }
        let delay_ms = rng.below(training_ms);
        std::thread::sleep(Duration::from_millis(delay_ms));
        let finished = child.try_wait().unwrap().is_some();
        child.kill().unwrap_or(()); // SIGKILL
        child.wait().unwrap();
        let (tmp, trash) = (leftovers(&run, ".tmp-"), leftovers(&run, ".trash-"));
        tally.mid_write += usize::from(tmp > 0);
        tally.mid_delete += usize::from(trash > 0);
        tally.after_finish += usize::from(finished);

        // Every step folder left is a complete checkpoint that verifies.
        if step_folders(&run) > 0 {
            let verify = stoke(&["ckpt", "verify"], &[]).arg(&run).output().unwrap();
            assert!(
                verify.status.success(),
                "trial {trial} (killed {delay_ms} ms in): verify failed\n{}{}",
                String::from_utf8_lossy(&verify.stdout),
                String::from_utf8_lossy(&verify.stderr)
            );
        }
        // Resume (no --fallback: the latest must load) or, killed before the first commit, start over.
        let resumable = step_folders(&run) > 0;
        tally.before_first_commit += usize::from(!resumable);
        let mode: &[&str] = if resumable { &["train", "--quiet", "--resume"] } else { &["train", "--quiet"] };
        let out = command(mode, &args(&run_dir, &name)).output().unwrap();
        assert!(
            out.status.success(),
            "trial {trial} (killed {delay_ms} ms in, leftovers tmp {tmp} trash {trash}): resume failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(losses(&run), expected, "trial {trial} (killed {delay_ms} ms in): losses differ");
        // The run's own leftovers are gone after its resume (or its start over).
        let names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
            .map(|rd| rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        assert_eq!(
            leftovers(&run, ".tmp-") + leftovers(&run, ".trash-"),
            0,
            "trial {trial} (killed {delay_ms} ms in, finished {finished}): {names:?}"
        );
        std::fs::remove_dir_all(&run).unwrap();
    }
    println!("{tally:?}");
    tally
}

#[test]
fn sigkill_during_checkpoint_writes_and_retention_never_breaks_resume() {
    let trials = std::env::var("STOKE_CKPT_KILL_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let tally = kill_trials(trials);
    assert_eq!(tally.trials, trials);
}

//! `stoke bench gate --against REV`: code compared with code. The other revision's `stoke` (built
//! from a git worktree into the same target folder, or a binary given by path) and this one train
//! the gate's model in turn, A B, B A, ..., in one invocation on one machine, two runs side by
//! side (`--jobs`, at most one a core); each pair's
//! candidate-over-baseline ratio of every phase time and the step time (each a low percentile
//! over the run's steps, see `figures_of`) and of the peak memory is taken,
//! and a figure regresses when the median ratio exceeds 1 by more than its tolerance, which comes
//! from the spread of those ratios (never below a floor, never above a ceiling that would hide a
//! 10% change). A phase must also have grown by more than `MIN_PHASE_GROWTH_MS` and by more than
//! `MIN_STEP_SHARE` of the step, so a phase of a few microseconds (a checkpoint stall) cannot flag
//! on its own jitter, while a 10% slower optimizer (a twentieth to a tenth of the gate's step,
//! by machine) is above both.
//!
//! `--self-test` runs the same binary against itself: five unchanged series and five with an
//! injection each (`STOKE_TEST_*`: 10% slower forward, backward, optimizer, 2 ms more data wait per
//! batch, 10% more memory), interleaved with the baseline's runs round by round. Every unchanged
//! series must pass and every injected one must be caught in the figure it touches. Its reference
//! in a round is the median of the unchanged code's runs in that round (the baseline's and the
//! unchanged series', less the series being checked): six runs of the same code, so one slow run
//! cannot shift every comparison of its round, as a single baseline run does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::Value;
use stoke_prof::{median, percentile};

use crate::config::INJECTIONS;
use crate::exit::EXIT_GATE_REGRESSION;

/// A time figure's tolerance is at least this relative growth of its median pair ratio.
const MIN_TIME_TOLERANCE: f64 = 0.04;
/// The peak memory's: resident memory of the same code varies by well under 1% between runs.
const MIN_MEMORY_TOLERANCE: f64 = 0.03;
/// No tolerance reaches the 10% change the gate must catch: a noisier measurement than that is
/// reported as such, and a series whose spread needs more is not passed on it.
const MAX_TOLERANCE: f64 = 0.08;
/// The tolerance is this many standard errors of the median ratio (its MAD scaled to a standard
/// deviation, 1.4826, times the median's 1.2533 over the mean's, over the square root of the
/// pairs).
const STANDARD_ERRORS: f64 = 3.0;
/// A phase (not the step) flags only when it grew (the median of the pairs' growth) by more than
/// this many milliseconds...
const MIN_PHASE_GROWTH_MS: f64 = 0.05;
/// ... and by more than this share of the baseline's step (a 10% slower optimizer that takes a
/// twentieth of the step grows by half a percent of it).
const MIN_STEP_SHARE: f64 = 0.0025;

/// One figure of one run: its key in the comparison and its value.
type Figures = BTreeMap<String, f64>;

/// One series of runs: a binary and the environment it runs with.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub binary: PathBuf,
    /// STOKE_TEST_* variables set for its runs (all others removed).
    pub inject: Vec<(String, String)>,
    /// The figure an injection must be caught in (self-test only).
    pub must_catch: Option<String>,
}

/// The self-test's injections: (series name, variable, value, the figure that must flag).
pub const SELF_TEST_INJECTIONS: [(&str, &str, &str, &str); 5] = [
    ("forward+10%", "STOKE_TEST_SLOW_FORWARD", "0.10", "forward"),
    ("backward+10%", "STOKE_TEST_SLOW_BACKWARD", "0.10", "backward"),
    ("optimizer+10%", "STOKE_TEST_SLOW_OPTIMIZER", "0.10", "optimizer"),
    ("data_wait+2ms", "STOKE_TEST_DATA_WAIT_MS", "2", "data_wait"),
    ("memory+10%", "STOKE_TEST_MORE_MEMORY", "0.10", "peak_memory"),
];

/// Trains the gate's model once with `binary`; returns the figures of its report.json.
fn run_once(series: &Series, dir: &Path, name: &str, settings: &[String]) -> anyhow::Result<Figures> {
    let run_dir = dir.join(name);
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("cannot clear {}", run_dir.display()))?;
    }
    let mut cmd = Command::new(&series.binary);
    cmd.args(["train", "--quiet"]);
    for s in settings {
        cmd.args(["--set", s]);
    }
    cmd.args(["--set", &format!("run.dir={}", toml::Value::String(dir.display().to_string()))]);
    cmd.args(["--set", &format!("run.name={}", toml::Value::String(name.to_string()))]);
    for (var, ..) in INJECTIONS {
        cmd.env_remove(var);
    }
    for (var, value) in &series.inject {
        cmd.env(var, value);
    }
    if let Some(lib) = crate::environment::libtorch_dir() {
        // The other revision's binary finds the same libtorch as this one, wherever it was copied.
        let path =
            std::env::var("LD_LIBRARY_PATH").map_or(lib.display().to_string(), |p| format!("{}:{p}", lib.display()));
        cmd.env("LD_LIBRARY_PATH", path);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {} ({})", series.binary.display(), series.name))?;
    if !out.status.success() {
        bail!(
            "the gate run {name} of {} ({}) failed ({}): {}",
            series.name,
            series.binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let path = run_dir.join("report.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let report: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let path = run_dir.join("metrics.jsonl");
    let metrics = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    figures_of(&metrics, &report).with_context(|| format!("{} ({})", run_dir.display(), series.name))
}

/// A time figure of a run is this percentile of its steps after the first (the third fastest of
/// the gate's 149).
const RUN_PERCENTILE: f64 = 2.0;

/// The compared figures of a run: the 2nd percentile (`RUN_PERCENTILE`) of the step time and of
/// every phase over its steps after the first (metrics.jsonl), and the peak memory (report.json).
/// On a shared machine noise only ever adds to a wall time, and a disturbance slows a whole
/// stretch of steps: a memory-bound phase (the optimizer) runs in two speeds a third apart, by
/// stretches of seconds, and the fast one can hold fewer than a tenth of a run's steps, so the
/// 10th percentile (used before) fell on either speed by chance. The fast steps are the code's own
/// speed (the baseline gate's `run_figures` takes the fastest for the same reason); a low
/// percentile rather than the fastest keeps one lucky step from setting the figure. An injected or
/// real slowdown of a phase slows every instance of it.
pub fn figures_of(metrics: &str, report: &Value) -> anyhow::Result<Figures> {
    let number = |v: &Value, what: &str| -> anyhow::Result<f64> {
        v.as_f64().filter(|x| x.is_finite()).with_context(|| format!("no finite {what}"))
    };
    let mut values: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (i, line) in metrics.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let record: Value =
            serde_json::from_str(line).with_context(|| format!("metrics.jsonl line {} is not JSON", i + 1))?;
        if record["step"].as_u64().is_none_or(|s| s <= 1) {
            continue;
        }
        let step = number(&record["step_ms"], &format!("step_ms on metrics.jsonl line {}", i + 1))?;
        values.entry("step".into()).or_default().push(step);
        let phases =
            record["phases_ms"].as_object().with_context(|| format!("no phases_ms on metrics.jsonl line {}", i + 1))?;
        for (phase, ms) in phases {
            let ms = number(ms, &format!("phases_ms.{phase} on metrics.jsonl line {}", i + 1))?;
            values.entry(phase.clone()).or_default().push(ms);
        }
    }
    if values.is_empty() {
        bail!("metrics.jsonl has no step after the first");
    }
    let mut figures: Figures = values.iter().map(|(key, v)| (key.clone(), percentile(v, RUN_PERCENTILE))).collect();
    figures.insert("peak_memory".into(), number(&report["peak_memory_bytes"], "peak_memory_bytes in the report")?);
    Ok(figures)
}

/// One figure of one series against the baseline.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub figure: String,
    /// Median over the pairs of candidate / baseline.
    pub ratio: f64,
    /// Smallest and largest pair ratio.
    pub spread: (f64, f64),
    pub tolerance: f64,
    /// Median baseline and candidate values.
    pub base: f64,
    pub candidate: f64,
    pub regressed: bool,
}

/// Compares a series' runs with the baseline's, pair by pair (`base[i]` and `cand[i]` ran in the
/// same round).
pub fn compare(base: &[Figures], cand: &[Figures]) -> anyhow::Result<Vec<Verdict>> {
    if base.is_empty() || base.len() != cand.len() {
        bail!("{} baseline runs against {} candidate runs: pairs needed", base.len(), cand.len());
    }
    let base_step = median(&base.iter().map(|f| f["step"]).collect::<Vec<_>>());
    let mut verdicts = Vec::new();
    for key in base[0].keys() {
        let pick = |runs: &[Figures]| -> anyhow::Result<Vec<f64>> {
            runs.iter().map(|f| f.get(key).copied().with_context(|| format!("a run has no {key}"))).collect()
        };
        let (b, c) = (pick(base)?, pick(cand)?);
        let ratios: Vec<f64> = b
            .iter()
            .zip(&c)
            .map(|(b, c)| {
                if *b > 0.0 {
                    c / b
                } else if *c > 0.0 {
                    f64::INFINITY
                } else {
                    1.0
                }
            })
            .collect();
        let ratio = median(&ratios);
        let deviations: Vec<f64> = ratios.iter().map(|r| (r - ratio).abs()).filter(|d| d.is_finite()).collect();
        let mad = if deviations.is_empty() { 0.0 } else { median(&deviations) };
        let floor = if key == "peak_memory" { MIN_MEMORY_TOLERANCE } else { MIN_TIME_TOLERANCE };
        let spread_tolerance = STANDARD_ERRORS * 1.4826 * 1.2533 * mad / (ratios.len() as f64).sqrt();
        let tolerance = spread_tolerance.clamp(floor, MAX_TOLERANCE);
        let (base_median, cand_median) = (median(&b), median(&c));
        // Paired, as the ratio is: the median of each round's growth, which the machine's drift
        // between rounds leaves alone, where the difference of the two medians takes it in.
        let grew = median(&b.iter().zip(&c).map(|(b, c)| c - b).collect::<Vec<_>>());
        let mut regressed = ratio > 1.0 + tolerance;
        if key != "step" && key != "peak_memory" {
            regressed &= grew > MIN_PHASE_GROWTH_MS && grew > MIN_STEP_SHARE * base_step;
        }
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        verdicts.push(Verdict {
            figure: key.clone(),
            ratio,
            spread: (lo, hi),
            tolerance,
            base: base_median,
            candidate: cand_median,
            regressed,
        });
    }
    Ok(verdicts)
}

fn print_verdicts(name: &str, verdicts: &[Verdict]) {
    println!("{name}:");
    for v in verdicts {
        let unit = if v.figure == "peak_memory" { 1.0 / (1 << 20) as f64 } else { 1.0 };
        let what = if v.figure == "peak_memory" { "MiB" } else { "ms" };
        println!(
            "  {:<12} {:>7.4} [{:.4}, {:.4}] tolerance {:.3}  {what} {:.3} -> {:.3}{}",
            v.figure,
            v.ratio,
            v.spread.0,
            v.spread.1,
            v.tolerance,
            v.base * unit,
            v.candidate * unit,
            if v.regressed { "  REGRESSION" } else { "" }
        );
    }
}

/// Runs the baseline and every series `pairs` times, round by round, the order within a round
/// rotating by one each round, `jobs` runs at a time (the gate's model trains on one thread, so
/// `jobs_for` allows one a core; the scheduler places them); returns the baseline's runs and each
/// series' runs. Side by side, the two runs of a round meet the same neighbours, and twice the
/// rounds fit in the same time.
fn interleaved(
    base: &Series,
    series: &[Series],
    dir: &Path,
    pairs: usize,
    jobs: usize,
    settings: &[String],
) -> anyhow::Result<(Vec<Figures>, Vec<Vec<Figures>>)> {
    let all: Vec<&Series> = std::iter::once(base).chain(series).collect();
    let n = all.len();
    let schedule: Vec<(usize, usize)> =
        (0..pairs).flat_map(|round| (0..n).map(move |k| (round, (k + round) % n))).collect();
    let slots: Vec<Mutex<Option<Figures>>> = schedule.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1) {
            scope.spawn(|| loop {
                let at = next.fetch_add(1, Ordering::SeqCst);
                if at >= schedule.len() || failed.lock().expect("not poisoned").is_some() {
                    return;
                }
                let (round, i) = schedule[at];
                let label: String =
                    all[i].name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
                match run_once(all[i], dir, &format!("r{round}-s{i}-{label}"), settings) {
                    Ok(figures) => *slots[at].lock().expect("not poisoned") = Some(figures),
                    Err(e) => {
                        failed.lock().expect("not poisoned").get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().expect("not poisoned") {
        return Err(e);
    }
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); all.len()];
    for ((_, i), slot) in schedule.iter().zip(slots) {
        runs[*i].push(slot.into_inner().expect("not poisoned").expect("every scheduled run ran"));
    }
    let base_runs = runs.remove(0);
    Ok((base_runs, runs))
}

/// Runs side by side: `asked`, at most one a core (and at least one).
pub fn jobs_for(asked: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    asked.clamp(1, cores)
}

/// `stoke bench gate --against`: `this` (this binary's path, taken before `binary_of` built into
/// its target folder and put its file back) against `other`. Exit 4 on a regression.
pub fn against(
    this: &Path,
    other: &Path,
    other_name: &str,
    dir: &Path,
    pairs: usize,
    jobs: usize,
    settings: &[String],
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let base =
        Series { name: other_name.to_string(), binary: other.to_path_buf(), inject: Vec::new(), must_catch: None };
    let cand =
        Series { name: "this".into(), binary: this.to_path_buf(), inject: inherited_injections(), must_catch: None };
    let (base_runs, runs) = interleaved(&base, std::slice::from_ref(&cand), dir, pairs.max(3), jobs, settings)?;
    let verdicts = compare(&base_runs, &runs[0])?;
    print_verdicts(&format!("this code over {other_name} ({} pairs)", base_runs.len()), &verdicts);
    println!("gate: {} runs in {:.1} s", 2 * base_runs.len(), started.elapsed().as_secs_f64());
    let regressed: Vec<&str> = verdicts.iter().filter(|v| v.regressed).map(|v| v.figure.as_str()).collect();
    if regressed.is_empty() {
        println!("gate: no regression against {other_name}");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("gate: regression against {other_name} in {}", regressed.join(", "));
        Ok(ExitCode::from(EXIT_GATE_REGRESSION))
    }
}

/// `stoke bench gate --self-test`: five unchanged series and the five injections against this
/// binary's own baseline runs. Exit 0 when every unchanged series passes and every injection is
/// caught in its figure, 4 otherwise.
pub fn self_test(dir: &Path, pairs: usize, jobs: usize, settings: &[String]) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let this = std::env::current_exe().context("cannot locate this stoke binary")?;
    let plain = |name: String| Series { name, binary: this.clone(), inject: Vec::new(), must_catch: None };
    let base = plain("baseline".into());
    let mut series: Vec<Series> = (1..=5).map(|i| plain(format!("unchanged-{i}"))).collect();
    for (name, var, value, figure) in SELF_TEST_INJECTIONS {
        series.push(Series {
            name: name.into(),
            binary: this.clone(),
            inject: vec![(var.into(), value.into())],
            must_catch: Some(figure.into()),
        });
    }
    let (base_runs, runs) = interleaved(&base, &series, dir, pairs.max(3), jobs, settings)?;
    let unchanged: Vec<usize> = (0..series.len()).filter(|&i| series[i].must_catch.is_none()).collect();
    let mut failures = Vec::new();
    for (i, (s, own)) in series.iter().zip(&runs).enumerate() {
        let others: Vec<&[Figures]> = std::iter::once(base_runs.as_slice())
            .chain(unchanged.iter().filter(|&&u| u != i).map(|&u| runs[u].as_slice()))
            .collect();
        let reference = round_medians(&others)?;
        let verdicts = compare(&reference, own)?;
        print_verdicts(&format!("{} over the unchanged runs ({} rounds)", s.name, own.len()), &verdicts);
        let flagged: Vec<&str> = verdicts.iter().filter(|v| v.regressed).map(|v| v.figure.as_str()).collect();
        match &s.must_catch {
            None if !flagged.is_empty() => failures.push(format!("{} flagged in {}", s.name, flagged.join(", "))),
            Some(figure) if !flagged.contains(&figure.as_str()) => {
                failures.push(format!("{} not caught in {figure}", s.name))
            }
            _ => {}
        }
    }
    println!(
        "gate self-test: {} runs in {:.1} s",
        base_runs.len() * (series.len() + 1),
        started.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        println!("gate self-test: 5 unchanged series passed, 5 injections caught");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("gate self-test failed: {}", failures.join("; "));
        Ok(ExitCode::from(EXIT_GATE_REGRESSION))
    }
}

/// Per round, each figure's median over the series' runs of that round (every series has one run
/// a round).
fn round_medians(series: &[&[Figures]]) -> anyhow::Result<Vec<Figures>> {
    let rounds = series.first().map_or(0, |s| s.len());
    (0..rounds)
        .map(|round| {
            series[0][round]
                .keys()
                .map(|key| {
                    let values: Vec<f64> = series
                        .iter()
                        .map(|runs| runs[round].get(key).copied().with_context(|| format!("a run has no {key}")))
                        .collect::<anyhow::Result<_>>()?;
                    Ok((key.clone(), median(&values)))
                })
                .collect()
        })
        .collect()
}

/// The STOKE_TEST_* variables this process was given, passed to its own runs (so a caller can
/// check that the gate against another revision catches an injected slowdown).
fn inherited_injections() -> Vec<(String, String)> {
    INJECTIONS.iter().filter_map(|(var, ..)| std::env::var(var).ok().map(|v| (var.to_string(), v))).collect()
}

/// The `stoke` binary of `rev`: `rev` itself when it names an executable file; otherwise a git
/// revision of the repository in the current folder, built (once per commit, cached in
/// `<target>/gate/<commit>/stoke`) from a worktree into this binary's target folder and profile,
/// so that only the workspace's own crates compile. The build replaces this binary's file in the
/// target folder; it is put back afterwards.
pub fn binary_of(rev: &str) -> anyhow::Result<(PathBuf, String)> {
    let path = Path::new(rev);
    if path.is_file() {
        return Ok((path.to_path_buf(), rev.to_string()));
    }
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new("git").args(args).output().context("cannot run git")?;
        if !out.status.success() {
            bail!("git {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .with_context(|| format!("--against {rev}: neither a binary nor a revision of the repository here"))?;
    let short = &commit[..12.min(commit.len())];
    let exe = std::env::current_exe().context("cannot locate this stoke binary")?;
    let profile_dir = exe.parent().context("the binary has no folder")?;
    let target = profile_dir.parent().context("the binary is not in a cargo target folder")?;
    let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    let cached = target.join("gate").join(short).join("stoke");
    let name = format!("{rev} ({short})");
    if cached.is_file() {
        return Ok((cached, name));
    }
    let source = target.join("gate").join(format!("src-{short}"));
    if source.exists() {
        let _ = git(&["worktree", "remove", "--force", &source.display().to_string()]);
        let _ = std::fs::remove_dir_all(&source);
        let _ = git(&["worktree", "prune"]);
    }
    git(&["worktree", "add", "--detach", &source.display().to_string(), &commit])?;
    // Whatever happens to the build, this binary's file is put back and the worktree removed.
    let keep = target.join("gate").join(format!("this-{}", std::process::id()));
    std::fs::copy("/proc/self/exe", &keep).with_context(|| format!("cannot copy this binary to {}", keep.display()))?;
    let built = (|| -> anyhow::Result<()> {
        let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        cargo.args(["build", "--bin", "stoke"]);
        match profile {
            "debug" => {}
            "release" => {
                cargo.arg("--release");
            }
            other => {
                cargo.args(["--profile", other]);
            }
        }
        eprintln!("[gate] building {name} in {}", source.display());
        let status = cargo
            .current_dir(&source)
            .env("CARGO_TARGET_DIR", target)
            .stdin(Stdio::null())
            .status()
            .context("cannot run cargo")?;
        if !status.success() {
            bail!("cargo build of {name} failed ({status})");
        }
        std::fs::create_dir_all(cached.parent().expect("a parent"))?;
        std::fs::copy(profile_dir.join("stoke"), &cached)
            .with_context(|| format!("cannot copy the built binary to {}", cached.display()))?;
        Ok(())
    })();
    let restored = std::fs::rename(&keep, &exe).with_context(|| format!("cannot put {} back", exe.display()));
    let _ = git(&["worktree", "remove", "--force", &source.display().to_string()]);
    built?;
    restored?;
    Ok((cached, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(step: f64, forward: f64, optimizer: f64, stall: f64, memory: f64) -> Figures {
        [("step", step), ("forward", forward), ("optimizer", optimizer), ("ckpt_stall", stall), ("peak_memory", memory)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn flagged(verdicts: &[Verdict]) -> Vec<&str> {
        verdicts.iter().filter(|v| v.regressed).map(|v| v.figure.as_str()).collect()
    }

    #[test]
    fn a_tenth_more_of_a_phase_flags_and_jitter_of_a_tiny_phase_does_not() {
        let base: Vec<Figures> =
            [1.00, 1.01, 0.99, 1.0, 1.02].iter().map(|j| run(13.0 * j, 5.0 * j, 1.2 * j, 0.010, 180e6)).collect();
        // Unchanged code: the same figures with their own jitter, and a checkpoint stall of a few
        // microseconds that doubled.
        let same: Vec<Figures> =
            [1.01, 0.99, 1.0, 1.01, 0.99].iter().map(|j| run(13.0 * j, 5.0 * j, 1.2 * j, 0.020, 181e6)).collect();
        assert_eq!(flagged(&compare(&base, &same).unwrap()), Vec::<&str>::new());
        // The optimizer a tenth slower: a tenth of the step, caught in its own figure.
        let slow: Vec<Figures> =
            base.iter().map(|f| run(f["step"] + 0.12, f["forward"], f["optimizer"] * 1.1, 0.010, 180e6)).collect();
        assert_eq!(flagged(&compare(&base, &slow).unwrap()), vec!["optimizer"]);
        // 10% more memory.
        let fat: Vec<Figures> =
            base.iter().map(|f| run(f["step"], f["forward"], f["optimizer"], 0.010, 198e6)).collect();
        assert_eq!(flagged(&compare(&base, &fat).unwrap()), vec!["peak_memory"]);
    }

    #[test]
    fn a_run_is_its_fast_steps_so_a_disturbed_stretch_does_not_move_it() {
        let line = |step: u64, forward: f64, backward: f64| {
            format!(
                r#"{{"step":{step},"step_ms":{},"phases_ms":{{"forward":{forward},"backward":{backward}}}}}"#,
                forward + backward
            )
        };
        let report = serde_json::json!({ "peak_memory_bytes": 1.5e8 });
        // The first step (warm-up) is left out; of the other 100, all but six lost their core for
        // a while and one was lucky: the 2nd percentile is the second fastest.
        let mut lines = vec![line(1, 1.0, 2.0)];
        lines.extend((2..=101).map(|s| match s {
            2 => line(s, 4.0, 9.0),
            3..=7 => line(s, 5.0 + s as f64 * 0.01, 10.0),
            s => line(s, 8.0, 16.0),
        }));
        let figures = figures_of(&lines.join("\n"), &report).unwrap();
        assert_eq!(figures["forward"], 5.03);
        assert_eq!(figures["backward"], 10.0);
        assert_eq!(figures["step"], 15.03);
        assert_eq!(figures["peak_memory"], 1.5e8);
        // A step without its time, a line that is not JSON, or no step after the first: errors naming it.
        let broken = format!("{}\n{}", line(2, 5.0, 10.0), r#"{"step":3,"phases_ms":{}}"#);
        assert!(figures_of(&broken, &report).unwrap_err().to_string().contains("step_ms on metrics.jsonl line 2"));
        assert!(figures_of("{\"step\":2,", &report).unwrap_err().to_string().contains("line 1 is not JSON"));
        assert!(figures_of(&line(1, 1.0, 2.0), &report).unwrap_err().to_string().contains("no step after the first"));
    }

    #[test]
    fn the_self_tests_reference_is_each_rounds_median_so_one_slow_run_moves_nothing() {
        let at = |j: f64| run(10.0 * j, 5.0 * j, 1.0, 0.0, 1e8);
        // Three series of unchanged code, two rounds; the first series' second run lost its core.
        let (a, b, c) = ([at(1.0), at(1.5)], [at(1.02), at(0.99)], [at(0.98), at(1.01)]);
        let reference = round_medians(&[&a, &b, &c]).unwrap();
        assert_eq!(reference[0]["step"], 10.0);
        assert_eq!(reference[1]["forward"], 5.05);
        // A slowdown of a tenth is a tenth over that reference, where the slow run alone would hide it.
        let slow = [run(11.0, 5.5, 1.0, 0.0, 1e8), run(11.1, 5.55, 1.0, 0.0, 1e8)];
        assert!(flagged(&compare(&reference, &slow).unwrap()).contains(&"forward"));
        assert!(!flagged(&compare(&a, &slow).unwrap()).contains(&"forward"));
        let mut lacking = c.clone();
        lacking[1].remove("step");
        assert!(round_medians(&[&a, &b, &lacking]).unwrap_err().to_string().contains("step"));
    }

    #[test]
    fn the_tolerance_follows_the_spread_of_the_pairs_within_its_bounds() {
        let base: Vec<Figures> = (0..5).map(|_| run(10.0, 5.0, 1.0, 0.0, 1e8)).collect();
        let noisy: Vec<Figures> =
            [0.90, 1.10, 0.95, 1.05, 1.0].iter().map(|j| run(10.0 * j, 5.0, 1.0, 0.0, 1e8)).collect();
        let verdicts = compare(&base, &noisy).unwrap();
        let step = verdicts.iter().find(|v| v.figure == "step").unwrap();
        assert_eq!(step.tolerance, MAX_TOLERANCE, "a wide spread widens it up to the ceiling");
        assert_eq!((step.spread.0, step.spread.1), (0.9, 1.1));
        let forward = verdicts.iter().find(|v| v.figure == "forward").unwrap();
        assert_eq!(forward.tolerance, MIN_TIME_TOLERANCE, "no spread: the floor");
        // Runs that do not pair up, or a figure one side lacks, are errors.
        assert!(compare(&base, &noisy[..4]).is_err());
        let mut lacking = noisy.clone();
        lacking[2].remove("forward");
        assert!(compare(&base, &lacking).unwrap_err().to_string().contains("forward"));
    }
}

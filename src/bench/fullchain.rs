//! `stoke bench fullchain`: naive stoke, optimized stoke and two PyTorch peers on the same data
//! and tokens, each its own process; one table of throughput, phase shares, ECR, MFU, peak memory
//! and final loss, and the throughput ratios beside their reference figures.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::time_to_loss;
use crate::exit::UsageError;

/// What `stoke bench fullchain` runs.
#[derive(Debug, Clone)]
pub struct Fullchain {
    /// Tokens each configuration trains on (rounded to whole steps).
    pub tokens: u64,
    /// Working folder for the corpus, the runs and the peers' checkpoints.
    pub dir: PathBuf,
    /// Python with torch for the peers.
    pub python: PathBuf,
    /// The peers' script.
    pub peer_script: PathBuf,
    /// Run only the stoke configurations.
    pub no_peers: bool,
    /// Also write the table as JSON here.
    pub json: Option<PathBuf>,
    /// Seeds (`train.seed`) of the naive and optimized stoke runs, interleaved; the time-to-loss
    /// speed-up is given per seed and as their median. The table shows the first seed's runs.
    pub seeds: Vec<u64>,
    /// The optimized configuration trains this many times `tokens` (its schedule stretched to
    /// them), so that its time to the naive run's final held-out loss exists when its larger batch
    /// needs more tokens to get there; evaluations stay at the same token counts.
    pub optimized_tokens: f64,
}

const SEQ_LEN: u64 = 128;

/// A stoke configuration of the comparison.
struct StokeSetup {
    name: &'static str,
    micro_batch: u64,
    /// Precision, learning rate and checkpoint interval, which the matching PyTorch peer shares.
    precision: &'static str,
    lr: &'static str,
    ckpt_every: u64,
    overrides: &'static [&'static str],
}

/// Mirrors the naive PyTorch peer: fp32, a small batch, each batch assembled on the training
/// thread when the step asks for it (no loader thread, no prefetch), a synchronous checkpoint every
/// 50 steps, AdamW as a chain of tensor ops (PyTorch's default on a CPU), the C allocator's
/// defaults.
const NAIVE: StokeSetup = StokeSetup {
    name: "stoke-naive",
    micro_batch: 8,
    precision: "fp32",
    lr: "0.0015",
    ckpt_every: 50,
    overrides: &["data.workers=0", "ckpt.background=false", "train.fused_optimizer=false", "train.host_memory=system"],
};

/// What the other capabilities built: bf16, a 4x larger batch (the learning rate of the naive
/// setup doubled; higher rates diverged in a sweep), the prefetching loader, background
/// checkpoints at the naive setup's interval in tokens (12 steps of 4096 tokens against 50 of
/// 1024), the fused optimizer, retained host memory.
const OPTIMIZED: StokeSetup = StokeSetup {
    name: "stoke-optimized",
    micro_batch: 32,
    precision: "bf16",
    lr: "0.003",
    ckpt_every: 12,
    overrides: &["data.workers=1", "data.prefetch=4", "ckpt.background=true"],
};

/// The optimized configuration's final loss may exceed the naive one's by this share and still
/// count as the same quality (the two take different numbers of steps over the same tokens).
const LOSS_TOLERANCE: f64 = 0.03;

fn stoke_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("cannot find the running stoke binary")
}

/// Evaluations per run on held-out data, at the same token counts in every configuration.
const EVALS: u64 = 16;

/// Steps between evaluations of `setup`: `tokens / EVALS` in its steps (the configurations' step
/// tokens divide each other, so they evaluate at the same token counts).
fn eval_every(setup: &StokeSetup, tokens: u64) -> u64 {
    let largest = NAIVE.micro_batch.max(OPTIMIZED.micro_batch) * SEQ_LEN;
    let interval = (tokens / EVALS / largest).max(1) * largest;
    interval / (setup.micro_batch * SEQ_LEN)
}

/// Runs one stoke configuration to completion in its own process, in `dir/<name><suffix>`;
/// returns its report.json.
fn run_stoke(
    dir: &Path,
    corpus: &Path,
    setup: &StokeSetup,
    tokens: u64,
    eval_tokens: u64,
    suffix: &str,
    extra: &[String],
) -> anyhow::Result<Value> {
    let steps = (tokens / (setup.micro_batch * SEQ_LEN)).max(2);
    let name = format!("{}{suffix}", setup.name);
    let run_dir = dir.join(&name);
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("cannot clear {}", run_dir.display()))?;
    }
    let mut cmd = Command::new(stoke_exe()?);
    cmd.args(["train", "--quiet", "--data"]).arg(corpus);
    let mut overrides: Vec<String> = vec![
        format!("run.dir={}", toml::Value::String(dir.display().to_string())),
        format!("run.name={name}"),
        format!("eval.every={}", eval_every(setup, eval_tokens)),
        format!("train.steps={steps}"),
        format!("train.micro_batch={}", setup.micro_batch),
        format!("train.warmup_steps={}", (steps / 10).max(1)),
        format!("train.precision={}", setup.precision),
        format!("train.lr={}", setup.lr),
        format!("ckpt.every={}", setup.ckpt_every),
        "ckpt.keep=1".into(),
    ];
    overrides.extend(setup.overrides.iter().map(|s| s.to_string()));
    overrides.extend_from_slice(extra);
    for o in &overrides {
        cmd.arg("--set").arg(o);
    }
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let report_path = run_dir.join("report.json");
    let text =
        std::fs::read_to_string(&report_path).with_context(|| format!("cannot read {}", report_path.display()))?;
    let mut report: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", report_path.display()))?;
    report["final_loss"] = json!(final_loss(&run_dir.join("metrics.jsonl"))?);
    report["steps"] = json!(steps);
    Ok(report)
}

/// Mean of the last 10 logged losses: one step's loss is too noisy to compare runs by.
fn final_loss(metrics: &Path) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string(metrics).with_context(|| format!("cannot read {}", metrics.display()))?;
    let losses: Vec<f64> =
        text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter_map(|v| v["loss"].as_f64()).collect();
    let tail = &losses[losses.len().saturating_sub(10)..];
    Ok(tail.iter().sum::<f64>() / tail.len().max(1) as f64)
}

/// What the tuned peer's pick tries: attention variants (the tiny GPT under bf16; see
/// `benches/peers/train_gpt.py`), then DataLoader worker counts; each in short eager runs of
/// `PICK_STEPS` steps, `PICK_ROUNDS` interleaved rounds.
const PEER_ATTENTION: [&str; 3] = ["matmul", "matmul-blocked", "sdpa"];
const PEER_WORKERS: [u64; 3] = [0, 1, 2];
const PICK_STEPS: u64 = 60;
const PICK_ROUNDS: usize = 2;

/// The tuned peer's settings, picked here by measurement.
#[derive(Debug, Clone, Copy)]
struct PeerPick {
    attention: &'static str,
    workers: u64,
}

/// Of `candidates`, the one whose short runs had the highest median tokens/s; each is printed.
fn pick_best(args: &Fullchain, corpus: &Path, candidates: &[PeerPick]) -> anyhow::Result<PeerPick> {
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); candidates.len()];
    for round in 0..PICK_ROUNDS {
        for (i, pick) in candidates.iter().enumerate() {
            let v = run_peer(args, corpus, "tuned", PICK_STEPS * OPTIMIZED.micro_batch * SEQ_LEN, *pick, false)
                .with_context(|| format!("the tuned peer's pick, {pick:?}, round {round}"))?;
            rates[i].push(v["tokens_per_s"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let medians: Vec<f64> = rates.iter().map(|r| stoke_prof::median(r)).collect();
    for (pick, (median, rounds)) in candidates.iter().zip(medians.iter().zip(&rates)) {
        println!(
            "tuned peer pick: attention {}, {} workers: tokens/s {median:.0} (rounds {rounds:.0?})",
            pick.attention, pick.workers
        );
    }
    let best = (0..candidates.len()).max_by(|&a, &b| medians[a].total_cmp(&medians[b])).unwrap_or(0);
    Ok(candidates[best])
}

/// The tuned peer's attention, then its DataLoader workers, each the fastest here.
fn pick_peer(args: &Fullchain, corpus: &Path) -> anyhow::Result<PeerPick> {
    let attention: Vec<PeerPick> = PEER_ATTENTION.iter().map(|&attention| PeerPick { attention, workers: 2 }).collect();
    let attention = pick_best(args, corpus, &attention)?.attention;
    let workers: Vec<PeerPick> = PEER_WORKERS.iter().map(|&workers| PeerPick { attention, workers }).collect();
    let pick = pick_best(args, corpus, &workers)?;
    println!("tuned peer: attention {}, {} DataLoader workers", pick.attention, pick.workers);
    Ok(pick)
}

/// One PyTorch peer run; `pick` sets the tuned peer's attention and DataLoader workers, `compile`
/// its torch.compile (the pick's runs are eager, for speed).
fn run_peer(
    args: &Fullchain,
    corpus: &Path,
    pipeline: &str,
    tokens: u64,
    pick: PeerPick,
    compile: bool,
) -> anyhow::Result<Value> {
    let setup = if pipeline == "naive" { &NAIVE } else { &OPTIMIZED };
    let (micro_batch, precision, ckpt_every, lr) = (setup.micro_batch, setup.precision, setup.ckpt_every, setup.lr);
    let steps = (tokens / (micro_batch * SEQ_LEN)).max(2);
    let ckpt_dir = args.dir.join(format!("pytorch-{pipeline}"));
    std::fs::create_dir_all(&ckpt_dir)?;
    let mut cmd = Command::new(&args.python);
    cmd.arg(&args.peer_script)
        .args(["--pipeline", pipeline, "--precision", precision, "--lr", lr])
        .args(["--steps", &steps.to_string(), "--micro-batch", &micro_batch.to_string()])
        .args(["--warmup", &(steps / 10).max(1).to_string(), "--ckpt-every", &ckpt_every.to_string()])
        .arg("--data")
        .arg(corpus)
        .arg("--ckpt-dir")
        .arg(&ckpt_dir);
    if pipeline == "tuned" {
        // What `train.host_memory = "retain"` sets in stoke, through glibc's environment: a tuned
        // PyTorch CPU job keeps freed memory too (tcmalloc, jemalloc or these).
        cmd.envs(stoke_train::retain_env());
        // The tuned peer's attention and loader are the ones measured fastest here (`pick_peer`), and
        // the model is compiled (its compilation falls in the first step, which the means leave out
        // like stoke's first; it is printed apart as `compile_s`).
        cmd.args(["--attention", pick.attention, "--workers", &pick.workers.to_string()]);
        if compile {
            cmd.arg("--compile");
        }
    }
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("peer pytorch-{pipeline} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("the peer printed no JSON line")?;
    let mut v: Value = serde_json::from_str(line)?;
    v["steps"] = json!(steps);
    Ok(v)
}

/// One row of the table, from a stoke report or a peer's JSON.
struct Row {
    name: String,
    tokens_per_s: f64,
    step_ms: f64,
    data_share: f64,
    ckpt_share: f64,
    ecr: Option<f64>,
    mfu: Option<f64>,
    peak_mib: f64,
    final_loss: f64,
}

/// The whole chain's figures are the means over the measured steps (stoke's report and the peers'
/// JSON define them the same way, after the same warm-up step): unlike the median, the mean counts
/// the steps that checkpoint, which are part of what the chain costs.
fn stoke_row(name: &str, r: &Value) -> Row {
    let share = |p: &str| r["phase_shares"][p].as_f64().unwrap_or(f64::NAN);
    Row {
        name: name.into(),
        tokens_per_s: r["tokens_per_s_mean"].as_f64().unwrap_or(f64::NAN),
        step_ms: r["step_ms_mean"].as_f64().unwrap_or(f64::NAN),
        data_share: share("data_wait"),
        ckpt_share: share("ckpt_stall"),
        ecr: r["effective_compute_ratio"].as_f64(),
        mfu: r["mfu"].as_f64(),
        peak_mib: r["peak_memory_bytes"].as_f64().unwrap_or(f64::NAN) / (1 << 20) as f64,
        final_loss: r["final_loss"].as_f64().unwrap_or(f64::NAN),
    }
}

fn peer_row(v: &Value) -> Row {
    // The peers time whole steps only; their phase split would need their own profiler.
    Row {
        name: v["peer"].as_str().unwrap_or("peer").into(),
        tokens_per_s: v["tokens_per_s_mean"].as_f64().unwrap_or(f64::NAN),
        step_ms: v["step_ms_mean"].as_f64().unwrap_or(f64::NAN),
        data_share: f64::NAN,
        ckpt_share: f64::NAN,
        ecr: None,
        mfu: None,
        peak_mib: v["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN) / (1 << 20) as f64,
        final_loss: v["final_loss"].as_f64().unwrap_or(f64::NAN),
    }
}

fn fmt_opt(v: Option<f64>, scale: f64) -> String {
    v.map(|x| format!("{:.3}", x * scale)).unwrap_or_else(|| "-".into())
}

fn fmt_share(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * v)
    }
}

/// Runs the four configurations and prints the table.
pub fn fullchain(args: &Fullchain) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&args.dir).with_context(|| format!("cannot create {}", args.dir.display()))?;
    let corpus = args.dir.join("corpus.txt");
    std::fs::write(&corpus, stoke_data::builtin_corpus(1337, 4 << 20))?;
    if !args.no_peers && !args.python.exists() {
        return Err(UsageError(format!(
            "no Python at {} for the peers: run `cargo xtask peers`, or pass --python or --no-peers",
            args.python.display()
        ))
        .into());
    }
    let tokens = args.tokens;
    if !(args.optimized_tokens.is_finite() && (1.0..=16.0).contains(&args.optimized_tokens)) {
        return Err(
            UsageError(format!("--optimized-tokens must be from 1 to 16; got {}", args.optimized_tokens)).into()
        );
    }
    let optimized_tokens = (tokens as f64 * args.optimized_tokens) as u64;
    let mut rows = Vec::new();
    let seeds = if args.seeds.is_empty() { vec![1] } else { args.seeds.clone() };
    // Naive and optimized interleaved per seed; the first seed's runs keep the plain names.
    let mut seed_results = Vec::new();
    let (mut naive, mut optimized) = (Value::Null, Value::Null);
    for (i, seed) in seeds.iter().enumerate() {
        let suffix = if i == 0 { String::new() } else { format!("-seed{seed}") };
        let extra = [format!("train.seed={seed}")];
        let n = run_stoke(&args.dir, &corpus, &NAIVE, tokens, tokens, &suffix, &extra)?;
        let o = run_stoke(&args.dir, &corpus, &OPTIMIZED, optimized_tokens, tokens, &suffix, &extra)?;
        let curve =
            |name: &str| time_to_loss::eval_curve(&args.dir.join(format!("{name}{suffix}")).join("metrics.jsonl"));
        let rate = |r: &Value| r["tokens_per_s_mean"].as_f64().unwrap_or(f64::NAN);
        if let Some(result) =
            time_to_loss::SeedResult::of(*seed, &curve(NAIVE.name)?, &curve(OPTIMIZED.name)?, rate(&o) / rate(&n))
        {
            seed_results.push(result);
        }
        if i == 0 {
            (naive, optimized) = (n, o);
        }
    }
    rows.push(stoke_row(NAIVE.name, &naive));
    rows.push(stoke_row(OPTIMIZED.name, &optimized));
    let mut peers = Vec::new();
    if !args.no_peers {
        let pick = pick_peer(args, &corpus)?;
        for pipeline in ["naive", "tuned"] {
            let v = run_peer(args, &corpus, pipeline, tokens, pick, true)?;
            if let Some(s) = v["compile_s"].as_f64().filter(|_| pipeline == "tuned") {
                println!("pytorch-tuned: torch.compile took {s:.1} s (its first step, left out of its figures)");
            }
            rows.push(peer_row(&v));
            peers.push(v);
        }
    }
    println!(
        "\nfullchain: {tokens} tokens per configuration ({optimized_tokens} for optimized stoke, whose final loss \
         is therefore at more tokens), tiny GPT, byte-level built-in corpus, one run; tokens/s and step ms are \
         means over the steps after the first (checkpointing steps included)\n"
    );
    println!(
        "{:<18} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7} {:>9} {:>10}",
        "config", "tokens/s", "step ms", "data", "ckpt", "ECR", "MFU", "peak MiB", "final loss"
    );
    for r in &rows {
        println!(
            "{:<18} {:>10.0} {:>9.1} {:>9} {:>9} {:>7} {:>7} {:>9.0} {:>10.4}",
            r.name,
            r.tokens_per_s,
            r.step_ms,
            fmt_share(r.data_share),
            fmt_share(r.ckpt_share),
            fmt_opt(r.ecr, 1.0),
            fmt_opt(r.mfu, 1.0),
            r.peak_mib,
            r.final_loss
        );
    }
    let ratio = |a: &str, b: &str| {
        let find = |n: &str| rows.iter().find(|r| r.name == n).map(|r| r.tokens_per_s);
        find(a).zip(find(b)).map(|(x, y)| x / y)
    };
    let mut ratios = serde_json::Map::new();
    println!();
    for (a, b) in [
        ("stoke-optimized", "stoke-naive"),
        ("stoke-optimized", "pytorch-tuned"),
        ("stoke-naive", "pytorch-naive"),
        ("pytorch-tuned", "pytorch-naive"),
    ] {
        if let Some(r) = ratio(a, b) {
            println!("tokens/s {a} / {b}: {r:.2}x");
            ratios.insert(format!("{a}/{b}"), json!(r));
        }
    }
    let loss_gap = rows[1].final_loss - rows[0].final_loss;
    // `stoke compare`: the curves lined up by tokens seen, the verdict on the final loss.
    let (comparison, page) = crate::cli::compare::compare_runs(
        &args.dir.join(NAIVE.name).display().to_string(),
        &args.dir.join(OPTIMIZED.name).display().to_string(),
        LOSS_TOLERANCE,
        None,
        &args.dir,
    )?;
    let loss_ok = !comparison.regressed;
    print!("{}", comparison.render_text());
    println!(
        "final loss (mean of the last 10), optimized - naive: {loss_gap:+.4} ({:+.1}%); compare's verdict \
         (tolerance +{:.0}%): {}; curves: {}",
        100.0 * loss_gap / rows[0].final_loss,
        100.0 * LOSS_TOLERANCE,
        if loss_ok { "within" } else { "OUTSIDE" },
        page.display()
    );
    print!("\n{}", time_to_loss::render(&seed_results));
    println!("\nmeasured, beside the reference figures:");
    let speedups: Vec<f64> = seed_results.iter().filter_map(time_to_loss::SeedResult::speedup).collect();
    if speedups.len() == seed_results.len() && !speedups.is_empty() {
        let r = stoke_prof::median(&speedups);
        println!("  optimized / naive stoke, time to the same held-out loss: {r:.2}x (reference 2.3x)");
    }
    if let Some(r) = ratio("stoke-optimized", "pytorch-tuned") {
        println!("  optimized stoke / tuned PyTorch: {r:.2}x (reference 1.2x)");
    }
    if let Some(ecr) = rows[1].ecr {
        println!("  optimized stoke effective compute ratio: {ecr:.3} (reference 0.9)");
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "tokens": tokens,
            "stoke_naive": naive,
            "stoke_optimized": optimized,
            "peers": peers,
            "ratios": ratios,
            "final_loss_gap": loss_gap,
            "final_loss_within_tolerance": loss_ok,
            "compare": comparison,
            "loss_tolerance": LOSS_TOLERANCE,
            "time_to_loss": seed_results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(ExitCode::SUCCESS)
}

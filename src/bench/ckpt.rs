//! `stoke bench ckpt`: what a checkpoint costs the training step, in the background (the copy
//! into host buffers) against a synchronous save of the same state; save throughput against the
//! disk's write bandwidth with fsync, measured in the same run; the time to resume; and PyTorch's
//! `torch.save` and DCP `async_save` of the same state as peers.
//!
//! Background and synchronous runs alternate (A, B, A, B, ...), each its own `stoke train`
//! process writing several checkpoints, with two references in every round: a run without
//! checkpoints, and one beside which the benchmark writes as many bytes to the disk itself
//! (`O_DIRECT`, when the background writer would), whose cost to the steps is the disk's floor on
//! this machine: what writing the state costs any checkpointer here. Figures are the median with
//! min and max over all runs' checkpoints, ratios per round.

use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use stoke_prof::median;

use super::ckpt_runs::{run_peer, run_resume, run_train, wall_excess, warm_cost, CkptBench, RunFigures, Saves};
use super::limits::{copy_bandwidth, direct_write_bandwidth, disk_bandwidth};

/// (median, min, max); NaN for all three when empty.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (median(values), sorted[0], sorted[sorted.len() - 1])
}

fn row(name: &str, unit: &str, values: &[f64]) -> Value {
    let (median, min, max) = spread(values);
    println!("| {name} | {median:.4} | {min:.4} | {max:.4} | {unit} | {} |", values.len());
    json!({ "name": name, "unit": unit, "median": median, "min": min, "max": max, "n": values.len() })
}

/// Runs the benchmark and prints its tables.
pub fn ckpt(args: &CkptBench) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&args.dir)?;
    let (mut disk, mut async_steady, mut async_first, mut sync_save) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut sync_tput, mut async_tput, mut load_s, mut restore_s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut state_bytes, mut host_bytes, mut waits) = (0u64, 0u64, Vec::new());
    let (mut copy_stream, mut copy_plain, mut disk_direct) = (Vec::new(), Vec::new(), Vec::new());
    let (mut async_excess, mut sync_excess) = (Vec::new(), Vec::new());
    let (mut async_run, mut sync_run) = (Vec::new(), Vec::new());
    let (mut async_warm, mut sync_warm, mut raw_warm) = (Vec::new(), Vec::new(), Vec::new());
    if args.checkpoints < 4 {
        bail!("--checkpoints must be at least 4: the first two are cold, the last is cut off by the run's end");
    }
    for pair in 0..args.pairs {
        let a = run_train(args, &format!("async-{pair}"), Saves::Background)?;
        let b = run_train(args, &format!("sync-{pair}"), Saves::Synchronous)?;
        let none = run_train(args, &format!("none-{pair}"), Saves::None)?;
        state_bytes = b.bytes_written / b.commits.max(1);
        let raw = run_train(args, &format!("raw-{pair}"), Saves::RawWrites(state_bytes as usize))?;
        let per_checkpoint = |run: &RunFigures| (run.total_ms - none.total_ms) / args.checkpoints as f64;
        async_run.push(per_checkpoint(&a));
        sync_run.push(per_checkpoint(&b));
        async_warm.push(warm_cost(&a.walls, &none.walls, args.every, args.checkpoints));
        sync_warm.push(warm_cost(&b.walls, &none.walls, args.every, args.checkpoints));
        raw_warm.push(warm_cost(&raw.walls, &none.walls, args.every, args.checkpoints));
        let none_step = median(&none.walls.iter().filter(|w| w.0 > 2).map(|w| w.1).collect::<Vec<_>>());
        let (a_excess, b_excess) = (
            wall_excess(&a.walls, args.every, args.checkpoints, none_step),
            wall_excess(&b.walls, args.every, args.checkpoints, none_step),
        );
        let (write, _) = disk_bandwidth(&args.dir, state_bytes as usize)?;
        disk.push(write / 1e9);
        disk_direct.push(direct_write_bandwidth(&args.dir, state_bytes as usize)? / 1e9);
        let (stream, plain) = copy_bandwidth(state_bytes as usize);
        copy_stream.push(stream / 1e9);
        copy_plain.push(plain / 1e9);
        // The first snapshot into each of the two host buffers faults its pages in; later ones reuse them.
        let cold = a.stalls_ms.len().min(2);
        async_first.extend_from_slice(&a.stalls_ms[..cold]);
        async_steady.extend_from_slice(&a.stalls_ms[cold..]);
        sync_save.extend_from_slice(&b.stalls_ms);
        async_excess.extend_from_slice(&a_excess[cold..]);
        sync_excess.extend_from_slice(&b_excess);
        sync_tput.push(b.bytes_written as f64 / b.write_s / 1e9);
        async_tput.push(a.bytes_written as f64 / a.write_s / 1e9);
        host_bytes = a.host_bytes;
        waits.push(a.wait_s * 1e3);
        let (load, restore) = run_resume(args, &format!("sync-{pair}"))?;
        load_s.push(load);
        restore_s.push(restore);
        // Each run keeps a checkpoint of the whole state: keep only the last one (the peers' input).
        std::fs::remove_dir_all(args.dir.join(format!("async-{pair}")))?;
        std::fs::remove_dir_all(args.dir.join(format!("none-{pair}")))?;
        std::fs::remove_dir_all(args.dir.join(format!("raw-{pair}")))?;
        if pair + 1 < args.pairs {
            std::fs::remove_dir_all(args.dir.join(format!("sync-{pair}")))?;
        }
        println!(
            "round {pair}: background stalls {:?} ms (wall excess {:?}; whole run {:.0} ms a checkpoint, warm {:.0}), synchronous saves {:?} ms (wall excess {:?}; whole run {:.0} ms a checkpoint, warm {:.0}), raw writes beside a run without checkpoints: warm {:.0} ms a write; step {:.1} ms without checkpoints; disk {:.2} GB/s",
            a.stalls_ms.iter().map(|v| v.round()).collect::<Vec<_>>(),
            a_excess.iter().map(|v| v.round()).collect::<Vec<_>>(),
            async_run[pair],
            async_warm[pair],
            b.stalls_ms.iter().map(|v| v.round()).collect::<Vec<_>>(),
            b_excess.iter().map(|v| v.round()).collect::<Vec<_>>(),
            sync_run[pair],
            sync_warm[pair],
            raw_warm[pair],
            none_step,
            write / 1e9
        );
    }
    println!(
        "\nstate: {:.1} MB per checkpoint (model and AdamW moments, fp32); host buffers {:.1} MB",
        state_bytes as f64 / 1e6,
        host_bytes as f64 / 1e6
    );
    println!("\n| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
    let mut rows = vec![
        row(
            "background checkpoint: wall time of its step and the next beyond two steps of the run without checkpoints (warm)",
            "ms",
            &async_excess,
        ),
        row(
            "synchronous save: wall time of its step and the next beyond two steps of the run without checkpoints",
            "ms",
            &sync_excess,
        ),
        row(
            "background checkpoint: the whole run's wall time beyond a run without checkpoints, per checkpoint",
            "ms",
            &async_run,
        ),
        row(
            "synchronous save: the whole run's wall time beyond a run without checkpoints, per checkpoint",
            "ms",
            &sync_run,
        ),
        row(
            "background checkpoint: wall time of a warm checkpoint's interval beyond the run without checkpoints'",
            "ms",
            &async_warm,
        ),
        row("synchronous save: the same, per warm interval", "ms", &sync_warm),
        row(
            "raw O_DIRECT write of the state beside a run without checkpoints: the same, per warm interval (the disk's floor)",
            "ms",
            &raw_warm,
        ),
        row("background checkpoint: ckpt_stall phase (warm host buffers)", "ms", &async_steady),
        row("background checkpoint: step stall, first two (buffers faulted in)", "ms", &async_first),
        row("background: back-pressure waits per run", "ms", &waits),
        row("synchronous save of the same state: step stall", "ms", &sync_save),
        row("synchronous save throughput (write, fsync, commit)", "GB/s", &sync_tput),
        row("background save throughput (beside training)", "GB/s", &async_tput),
        row("disk write with fsync, same size, same run", "GB/s", &disk),
        row("disk write with O_DIRECT and fsync, same size, same run", "GB/s", &disk_direct),
        row("copy of as many bytes into a warm buffer: stream_copy, intra-op threads", "GB/s", &copy_stream),
        row("copy of as many bytes into a warm buffer: memcpy, one thread", "GB/s", &copy_plain),
        row("resume: load and verify (page cache dropped)", "s", &load_s),
        row("resume: restore into the model", "s", &restore_s),
    ];
    // The stall is the wall time a checkpoint costs the run, so that a copy moved beside the next
    // step counts with the cores it takes from it; the synchronous save is measured the same way.
    let (stall, _, _) = spread(&async_excess);
    let (save, _, _) = spread(&sync_excess);
    let (phase_stall, _, _) = spread(&async_steady);
    let (phase_save, _, _) = spread(&sync_save);
    let (tput, _, _) = spread(&sync_tput);
    let (disk_median, _, _) = spread(&disk);
    let stall_ratio = stall / save;
    // Per round, so each ratio's two runs are neighbours in time.
    let run_ratios: Vec<f64> = async_run.iter().zip(&sync_run).map(|(a, s)| a / s).collect();
    let (run_ratio, run_ratio_min, run_ratio_max) = spread(&run_ratios);
    let warm_ratios: Vec<f64> = async_warm.iter().zip(&sync_warm).map(|(a, s)| a / s).collect();
    let (warm_ratio, warm_ratio_min, warm_ratio_max) = spread(&warm_ratios);
    // What stoke adds beyond the disk's floor (the same bytes written beside the same steps).
    let own_ratios: Vec<f64> =
        async_warm.iter().zip(&raw_warm).zip(&sync_warm).map(|((a, r), s)| (a - r) / s).collect();
    let (own_ratio, own_ratio_min, own_ratio_max) = spread(&own_ratios);
    let floor_ratios: Vec<f64> = raw_warm.iter().zip(&sync_warm).map(|(r, s)| r / s).collect();
    let (floor_ratio, _, _) = spread(&floor_ratios);
    let tput_ratio = tput / disk_median;
    let (direct_median, _, _) = spread(&disk_direct);
    let (copy_median, _, _) = spread(&copy_stream);
    // The least a snapshot's copy can cost: the state copied at the memory's measured speed.
    let stall_floor_ratio = (state_bytes as f64 / 1e9 / copy_median * 1e3) / save;
    println!(
        "\nstall / synchronous save, in wall time: {:.1}% (reference: 5%; in ckpt_stall phases: {:.1}%); save throughput / disk: {:.0}% (reference: 70%)",
        100.0 * stall_ratio,
        100.0 * phase_stall / phase_save,
        100.0 * tput_ratio
    );
    println!(
        "whole-run cost, background / synchronous, per round: {:.1}% ({:.1}-{:.1}%; everything a checkpoint costs the run: the copy and its CRC-32s, the writer's CPU time and memory traffic beside the steps, retention)",
        100.0 * run_ratio,
        100.0 * run_ratio_min,
        100.0 * run_ratio_max
    );
    println!(
        "warm checkpoints' whole-run cost, background / synchronous, per round: {:.1}% ({:.1}-{:.1}%); of which the disk's floor (the same bytes written raw beside the same steps) {:.1}%; stoke's own beyond that floor: {:.1}% ({:.1}-{:.1}%)",
        100.0 * warm_ratio,
        100.0 * warm_ratio_min,
        100.0 * warm_ratio_max,
        100.0 * floor_ratio,
        100.0 * own_ratio,
        100.0 * own_ratio_min,
        100.0 * own_ratio_max
    );
    println!(
        "save throughput / O_DIRECT disk write: {:.0}%; the copy alone at the measured copy speed would be {:.1}% of the synchronous save (the floor of the first ratio)",
        100.0 * tput / direct_median,
        100.0 * stall_floor_ratio
    );
    // The write path alone, tightly interleaved with the raw disk figure: the last run's state,
    // saved through the store (serialize, CRC-32, write, fsync, commit), against the same bytes
    // written in 4 MiB blocks and fsynced.
    let last = args.dir.join(format!("sync-{}", args.pairs - 1)).join("checkpoints");
    let latest = stoke_ckpt::CheckpointStore::new(&last).latest()?.context("a checkpoint")?;
    let loaded = stoke_ckpt::CheckpointStore::new(&last).load(latest)?;
    let files: Vec<(&str, &[stoke_ckpt::TensorRecord])> =
        loaded.files.iter().map(|(stem, records)| (stem.as_str(), records.as_slice())).collect();
    let scratch = stoke_ckpt::CheckpointStore::new(args.dir.join("write-path"));
    let (mut save_tput, mut raw_tput) = (Vec::new(), Vec::new());
    for round in 0..args.pairs.max(3) {
        let (write, _) = disk_bandwidth(&args.dir, state_bytes as usize)?;
        raw_tput.push(write / 1e9);
        let start = std::time::Instant::now();
        scratch.save(round as u64, &files, loaded.manifest.meta.clone())?;
        save_tput.push(state_bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        scratch.delete(round as u64)?;
    }
    drop(loaded);
    println!("\nthe write path alone, interleaved (store save, raw write):");
    println!("| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
    rows.push(row("store save of the state (CRC-32, write, fsync, commit)", "GB/s", &save_tput));
    rows.push(row("raw write of as many bytes in 4 MiB blocks, fsync", "GB/s", &raw_tput));
    let ratios: Vec<f64> = save_tput.iter().zip(&raw_tput).map(|(s, r)| s / r).collect();
    rows.push(row("store save / raw write, per round", "ratio", &ratios));
    let (write_path_ratio, _, _) = spread(&ratios);
    println!("store save / raw disk write, same bytes, interleaved: {:.0}% (reference: 70%)", 100.0 * write_path_ratio);

    let mut peer = Value::Null;
    if !args.no_peers {
        peer = run_peer(args, &last.join(format!("step-{latest}")))?;
        let seconds = |key: &str| -> Vec<f64> {
            peer[key].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default()
        };
        println!(
            "\nPyTorch {} on the same state ({:.1} MB):",
            peer["torch"],
            peer["bytes"].as_f64().unwrap_or(0.0) / 1e6
        );
        println!("| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
        let ms = |v: Vec<f64>| v.iter().map(|s| s * 1e3).collect::<Vec<_>>();
        rows.push(row("torch.save + fsync", "ms", &ms(seconds("torch_save_s"))));
        rows.push(row("DCP async_save: stall until it returns", "ms", &ms(seconds("dcp_async_stall_s"))));
        rows.push(row("DCP async_save: until written", "ms", &ms(seconds("dcp_async_total_s"))));
    }
    if let Some(path) = &args.json {
        let out = json!({
            "state_bytes": state_bytes, "host_bytes": host_bytes, "rows": rows,
            "stall_over_sync_save": stall_ratio, "ckpt_stall_phase_over_sync_save": phase_stall / phase_save,
            "whole_run_over_sync_save": run_ratio,
            "warm_whole_run_over_sync_save": warm_ratio, "disk_floor_over_sync_save": floor_ratio,
            "own_beyond_disk_floor_over_sync_save": own_ratio,
            "save_throughput_over_disk": tput_ratio,
            "save_throughput_over_direct_disk": tput / direct_median, "copy_floor_over_sync_save": stall_floor_ratio,
            "write_path_over_raw_write": write_path_ratio, "peer": peer,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")?;
    }
    Ok(ExitCode::SUCCESS)
}

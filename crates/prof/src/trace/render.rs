//! Output formats: terminal tables, Markdown, Prometheus text, and an overlay Chrome trace. JSON
//! is the `Serialize` form of `Analysis` and `TraceDiff`.

use std::fmt::Write as _;
use std::io::Write;

use super::diff::{NameDiff, TraceDiff};
use super::figures::{Category, RankReport};
use super::Analysis;

fn ms(ns: i64) -> f64 {
    ns as f64 / 1e6
}

fn pct(part: i64, whole: i64) -> f64 {
    if whole > 0 {
        100.0 * part as f64 / whole as f64
    } else {
        0.0
    }
}

fn short(name: &str, width: usize) -> String {
    if name.chars().count() <= width {
        name.to_string()
    } else {
        let mut s: String = name.chars().take(width - 1).collect();
        s.push('~');
        s
    }
}

const HEADERS: [&str; 8] = ["kernel", "memcpy", "memset", "comm", "runtime", "dataldr", "cpu_op", "other"];

/// Rows of a rank's step table: step label, wall ms, category percentages, GPU busy %.
fn step_rows(r: &RankReport) -> Vec<(String, f64, [f64; 8], f64)> {
    let mut rows: Vec<(String, f64, [f64; 8], f64)> = r
        .steps
        .iter()
        .map(|s| {
            let label = s.step.map_or_else(|| "all".to_string(), |n| format!("#{n}"));
            let cats = Category::PRIORITY.map(|c| pct(s.categories.get(c), s.wall_ns));
            (label, ms(s.wall_ns), cats, pct(s.gpu_busy_ns, s.wall_ns))
        })
        .collect();
    if r.steps.len() > 1 {
        let busy: i64 = r.steps.iter().map(|s| s.gpu_busy_ns).sum();
        rows.push((
            "total".into(),
            ms(r.total_wall_ns),
            Category::PRIORITY.map(|c| pct(r.total.get(c), r.total_wall_ns)),
            pct(busy, r.total_wall_ns),
        ));
    }
    rows
}

/// The terminal report.
pub fn table(a: &Analysis) -> String {
    let mut o = String::new();
    for r in &a.ranks {
        let _ = writeln!(
            o,
            "rank {} ({}, rank from {}): {} events, {:.1} MB JSON",
            r.rank,
            r.file,
            r.rank_source,
            r.ingest.n_events,
            r.ingest.bytes as f64 / 1e6
        );
        if r.ingest.n_dropped() > 0 {
            let _ = writeln!(o, "  dropped {} events: {}", r.ingest.n_dropped(), r.ingest.dropped_reasons());
        }
        let _ = write!(o, "  {:>8} {:>10}", "step", "wall ms");
        for h in HEADERS {
            let _ = write!(o, " {h:>7}");
        }
        let _ = writeln!(o, " {:>8}", "gpu busy");
        for (label, wall, cats, busy) in step_rows(r) {
            let _ = write!(o, "  {label:>8} {wall:>10.3}");
            for c in cats {
                let _ = write!(o, " {c:>6.1}%");
            }
            let _ = writeln!(o, " {busy:>7.1}%");
        }
        let g = &r.gpu;
        let _ = writeln!(
            o,
            "  GPU ({}): span {:.3} ms, idle {:.1}%, compute {:.1}%, non-compute {:.1}%",
            r.gpu_scope,
            ms(g.span_ns),
            pct(g.idle_ns, g.span_ns),
            pct(g.compute_ns, g.span_ns),
            pct(g.non_compute_ns, g.span_ns)
        );
        let types: Vec<String> =
            r.kernel_types.iter().map(|k| format!("{} {:.1}% ({} x)", k.kind, 100.0 * k.share, k.count)).collect();
        let _ = writeln!(o, "  kernel time by type: {}", types.join(", "));
        for k in r.top_kernels.iter().take(5) {
            let _ = writeln!(o, "    {:>9.3} ms {:>6} x  {}", ms(k.total_ns), k.count, short(&k.name, 90));
        }
        for s in &r.idle_by_stream {
            let _ = writeln!(
                o,
                "  stream {:>3} idle: host wait {:.3} ms, kernel wait {:.3} ms, other {:.3} ms",
                s.stream,
                ms(s.host_wait_ns),
                ms(s.kernel_wait_ns),
                ms(s.other_ns)
            );
        }
        if let Some(ratio) = r.overlap.overlap_ratio {
            let _ = writeln!(
                o,
                "  communication {:.3} ms, {:.1}% overlapped with compute, {:.3} ms exposed",
                ms(r.overlap.comm_ns),
                100.0 * ratio,
                ms(r.overlap.exposed_ns)
            );
        }
        let l = &r.launches;
        let _ = writeln!(
            o,
            "  launches: {} , delay mean {:.1} us p99 {:.1} us ({} > cutoff), runtime mean {:.1} us ({} > cutoff)",
            l.launch_delay.count,
            l.launch_delay.mean_ns / 1e3,
            l.launch_delay.p99_ns as f64 / 1e3,
            l.launch_delay_outliers,
            l.runtime.mean_ns / 1e3,
            l.runtime_outliers
        );
        for m in &r.memcpy {
            let _ = writeln!(
                o,
                "  {:<12} {:>6} x {:>12} B  {:>8.3} ms  {:>7.2} GB/s",
                m.kind,
                m.count,
                m.bytes,
                ms(m.time_ns),
                m.gb_per_s
            );
        }
        if let Some(mfu) = r.mfu {
            let _ = writeln!(o, "  MFU {:.1}%", 100.0 * mfu);
        }
        for f in &r.findings {
            let bound = f.bound.map_or_else(String::new, |b| format!(" (up to {b:.2}x)"));
            let _ = writeln!(o, "  [{}] {}{}\n      fix: {}", f.id, f.evidence, bound, f.fix);
        }
        let _ = writeln!(o);
    }
    if let Some(c) = &a.cross_rank {
        let _ = writeln!(o, "across {} ranks:", c.n_ranks);
        for s in &c.steps {
            let _ = writeln!(
                o,
                "  step #{:<6} min {:.3} ms, median {:.3} ms, max {:.3} ms (rank {})",
                s.step,
                ms(s.min_ns),
                ms(s.median_ns),
                ms(s.max_ns),
                s.slowest_rank
            );
        }
        for col in &c.collectives {
            let _ = writeln!(
                o,
                "  rank {:>3} collectives: {} matched, wait {:.3} ms, transfer {:.3} ms",
                col.rank,
                col.n_matched,
                ms(col.wait_ns),
                ms(col.transfer_ns)
            );
        }
        for f in &c.findings {
            let _ = writeln!(o, "  [{}] {}", f.id, f.evidence);
        }
    }
    o
}

/// The Markdown report.
pub fn markdown(a: &Analysis) -> String {
    let mut o = String::from("# Trace analysis\n\n");
    for r in &a.ranks {
        let _ = writeln!(o, "## Rank {} (`{}`)\n", r.rank, r.file);
        let _ = writeln!(o, "| step | wall ms | {} | GPU busy |", HEADERS.join(" | "));
        let _ = writeln!(o, "|---|---:|{}---:|", "---:|".repeat(HEADERS.len()));
        for (label, wall, cats, busy) in step_rows(r) {
            let cells: Vec<String> = cats.iter().map(|c| format!("{c:.1}%")).collect();
            let _ = writeln!(o, "| {label} | {wall:.3} | {} | {busy:.1}% |", cells.join(" | "));
        }
        let g = &r.gpu;
        let _ = writeln!(
            o,
            "\nGPU ({}): span {:.3} ms, idle {:.1}%, compute {:.1}%, non-compute {:.1}%.\n",
            r.gpu_scope,
            ms(g.span_ns),
            pct(g.idle_ns, g.span_ns),
            pct(g.compute_ns, g.span_ns),
            pct(g.non_compute_ns, g.span_ns)
        );
        if !r.top_kernels.is_empty() {
            let _ = writeln!(o, "| kernel | type | count | total ms |\n|---|---|---:|---:|");
            for k in &r.top_kernels {
                let _ = writeln!(
                    o,
                    "| `{}` | {} | {} | {:.3} |",
                    short(&k.name, 80).replace('|', "\\|"),
                    k.kind,
                    k.count,
                    ms(k.total_ns)
                );
            }
            let _ = writeln!(o);
        }
        for f in &r.findings {
            let bound = f.bound.map_or_else(String::new, |b| format!(" Bound: {b:.2}x."));
            let _ = writeln!(
                o,
                "- **{}** ({}): {}. Cause: {}. Fix: {}.{}",
                f.id, f.threshold, f.evidence, f.cause, f.fix, bound
            );
        }
        let _ = writeln!(o);
    }
    if let Some(c) = &a.cross_rank {
        let _ = writeln!(
            o,
            "## Across {} ranks\n\n| step | min ms | median ms | max ms | slowest |\n|---:|---:|---:|---:|---:|",
            c.n_ranks
        );
        for s in &c.steps {
            let _ = writeln!(
                o,
                "| {} | {:.3} | {:.3} | {:.3} | {} |",
                s.step,
                ms(s.min_ns),
                ms(s.median_ns),
                ms(s.max_ns),
                s.slowest_rank
            );
        }
        for f in &c.findings {
            let _ = writeln!(o, "\n- **{}**: {}", f.id, f.evidence);
        }
    }
    o
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Prometheus text exposition (version 0.0.4).
pub fn prometheus(a: &Analysis) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP stoke_trace_step_seconds Wall time of a profiler step.\n# TYPE stoke_trace_step_seconds gauge"
    );
    for r in &a.ranks {
        for s in &r.steps {
            let step = s.step.map_or_else(|| "all".to_string(), |n| n.to_string());
            let _ = writeln!(
                o,
                "stoke_trace_step_seconds{{rank=\"{}\",step=\"{}\"}} {}",
                r.rank,
                step,
                s.wall_ns as f64 / 1e9
            );
        }
    }
    let _ = writeln!(o, "# HELP stoke_trace_category_seconds Step time by category (priority order), summed over steps.\n# TYPE stoke_trace_category_seconds gauge");
    for r in &a.ranks {
        for c in Category::PRIORITY {
            let _ = writeln!(
                o,
                "stoke_trace_category_seconds{{rank=\"{}\",category=\"{}\"}} {}",
                r.rank,
                c.key(),
                r.total.get(c) as f64 / 1e9
            );
        }
    }
    let _ = writeln!(o, "# HELP stoke_trace_gpu_seconds GPU time as HTA's temporal breakdown reports it.\n# TYPE stoke_trace_gpu_seconds gauge");
    for r in &a.ranks {
        for (kind, ns) in [
            ("span", r.gpu.span_ns),
            ("idle", r.gpu.idle_ns),
            ("compute", r.gpu.compute_ns),
            ("non_compute", r.gpu.non_compute_ns),
        ] {
            let _ = writeln!(o, "stoke_trace_gpu_seconds{{rank=\"{}\",kind=\"{}\"}} {}", r.rank, kind, ns as f64 / 1e9);
        }
    }
    let _ = writeln!(o, "# HELP stoke_trace_finding A diagnosis that fired (1).\n# TYPE stoke_trace_finding gauge");
    for (rank, f) in a.findings() {
        let rank = rank.map_or_else(|| "all".to_string(), |r| r.to_string());
        let _ = writeln!(o, "stoke_trace_finding{{rank=\"{}\",id=\"{}\"}} 1", rank, escape_label(&f.id));
    }
    o
}

/// A Chrome trace to open next to the original in Perfetto: per rank, one span per step with
/// its categories in `args`, counters for GPU busy and category shares, and an instant event per
/// finding. Times are those of the original trace (microseconds, without `baseTimeNanoseconds`).
pub fn overlay_trace(a: &Analysis, out: &mut impl Write) -> std::io::Result<()> {
    let mut events: Vec<serde_json::Value> = Vec::new();
    for r in &a.ranks {
        let pid = format!("stoke rank {}", r.rank);
        events
            .push(serde_json::json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pid}}));
        for s in &r.steps {
            let ts = s.start_ns as f64 / 1e3;
            let label = s.step.map_or_else(|| "trace".to_string(), |n| format!("step #{n}"));
            let ids: Vec<&str> = s.findings.iter().map(|f| f.id.as_str()).collect();
            events.push(serde_json::json!({
                "ph": "X", "name": label, "cat": "stoke", "pid": pid, "tid": "steps", "ts": ts, "dur": s.wall_ns as f64 / 1e3,
                "args": {"categories_ns": s.categories, "findings": ids},
            }));
            let mut shares = serde_json::Map::new();
            for c in Category::PRIORITY {
                shares.insert(c.key().into(), serde_json::json!(pct(s.categories.get(c), s.wall_ns)));
            }
            events.push(serde_json::json!({"ph": "C", "name": "category %", "pid": pid, "ts": ts, "args": shares}));
            events.push(serde_json::json!({"ph": "C", "name": "GPU busy %", "pid": pid, "ts": ts, "args": {"busy": pct(s.gpu_busy_ns, s.wall_ns)}}));
            for f in &s.findings {
                events.push(serde_json::json!({"ph": "i", "s": "p", "name": f.id, "pid": pid, "tid": "steps", "ts": ts, "args": {"evidence": f.evidence, "fix": f.fix}}));
            }
        }
        if let Some(last) = r.steps.last() {
            let end = (last.start_ns + last.wall_ns) as f64 / 1e3;
            events.push(
                serde_json::json!({"ph": "C", "name": "GPU busy %", "pid": pid, "ts": end, "args": {"busy": 0.0}}),
            );
        }
    }
    serde_json::to_writer(&mut *out, &serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}))?;
    out.write_all(b"\n")
}

fn diff_rows(o: &mut String, title: &str, rows: &[NameDiff], md: bool) {
    if rows.is_empty() {
        return;
    }
    if md {
        let _ = writeln!(o, "\n### {title}\n\n| status | count base -> new | ms base -> new | delta ms | name |\n|---|---|---|---:|---|");
    } else {
        let _ = writeln!(o, "{title}:");
    }
    for r in rows {
        if md {
            let _ = writeln!(
                o,
                "| {} | {} -> {} | {:.3} -> {:.3} | {:+.3} | `{}` |",
                r.status,
                r.base_count,
                r.new_count,
                ms(r.base_ns),
                ms(r.new_ns),
                ms(r.delta_ns),
                short(&r.name, 80).replace('|', "\\|")
            );
        } else {
            let _ = writeln!(
                o,
                "  {:<8} {:>6} -> {:<6} {:>10.3} -> {:<10.3} {:>+10.3} ms  {}",
                r.status,
                r.base_count,
                r.new_count,
                ms(r.base_ns),
                ms(r.new_ns),
                ms(r.delta_ns),
                short(&r.name, 70)
            );
        }
    }
}

fn verdict(d: &TraceDiff) -> String {
    format!(
        "step time {:.3} ms -> {:.3} ms ({:+.1}%, allowed +{:.1}%): {}",
        d.base.mean_ns / 1e6,
        d.new.mean_ns / 1e6,
        100.0 * d.step_change,
        100.0 * d.allowed_change,
        if d.regression { "REGRESSION" } else { "ok" }
    )
}

pub fn diff_table(d: &TraceDiff) -> String {
    let mut o = verdict(d);
    let _ = writeln!(
        o,
        "\nops: {} added, {} removed; kernels: {} added, {} removed",
        d.n_ops_added, d.n_ops_removed, d.n_kernels_added, d.n_kernels_removed
    );
    diff_rows(&mut o, "ops (largest time change first)", &d.ops, false);
    diff_rows(&mut o, "kernels (largest time change first)", &d.kernels, false);
    o
}

pub fn diff_markdown(d: &TraceDiff) -> String {
    let mut o = format!("# Trace diff\n\n{}\n", verdict(d));
    diff_rows(&mut o, "Operators", &d.ops, true);
    diff_rows(&mut o, "Kernels", &d.kernels, true);
    o
}

//! A simulation's figures, and its timeline as one self-contained HTML file (inline SVG).

use crate::sim::SimResult;

/// The figures of one simulation, for tables and JSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Figures {
    pub jobs: usize,
    pub mean_completion_s: f64,
    pub p99_completion_s: f64,
    pub makespan_s: f64,
    pub utilization: f64,
    pub resizes: usize,
}

pub fn figures(result: &SimResult) -> Figures {
    Figures {
        jobs: result.jobs.len(),
        mean_completion_s: result.mean_completion_s(),
        p99_completion_s: result.completion_percentile_s(0.99),
        makespan_s: result.makespan_s(),
        utilization: result.utilization(),
        resizes: result.resizes(),
    }
}

/// Each job's course, machine-readable: submission, start, finish, completion time, resizes,
/// and every change of its workers as `{"at_s", "workers"}` (0 at its finish).
pub fn jobs_json(result: &SimResult) -> serde_json::Value {
    let jobs: Vec<serde_json::Value> = result
        .jobs
        .iter()
        .map(|j| {
            let allocations: Vec<serde_json::Value> = j
                .allocations
                .iter()
                .map(|&(at_s, workers)| serde_json::json!({ "at_s": at_s, "workers": workers }))
                .collect();
            serde_json::json!({
                "name": j.name,
                "submit_s": j.submit_s,
                "start_s": j.start_s,
                "finish_s": j.finish_s,
                "completion_s": j.completion_s(),
                "resizes": j.resizes,
                "allocations": allocations,
            })
        })
        .collect();
    serde_json::json!({ "slots": result.slots, "jobs": jobs })
}

/// One line: the goodput policy's figures over FIFO's on the same workloads (median ratio, and the
/// least and most of mean completion time).
pub fn against_fifo(fifo: &[Figures], good: &[Figures]) -> String {
    let ratio = |f: fn(&Figures) -> f64| {
        let r: Vec<f64> = fifo.iter().zip(good).map(|(a, b)| f(b) / f(a)).collect();
        let lowest = r.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (stoke_stats::median(&r), lowest, highest)
    };
    let (jct, jct_lo, jct_hi) = ratio(|f| f.mean_completion_s);
    let (p99, ..) = ratio(|f| f.p99_completion_s);
    let (span, ..) = ratio(|f| f.makespan_s);
    format!(
        "goodput / fifo over {} workload(s): mean completion time {:.2}x (min {:.2}, max {:.2}; {:.0}% lower), p99 \
         {:.2}x, makespan {:.2}x (throughput {:.2}x)",
        fifo.len(),
        jct,
        jct_lo,
        jct_hi,
        100.0 * (1.0 - jct),
        p99,
        span,
        1.0 / span
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// One row per slot, time to the right; each job's slots in its own colour, with the job's name
/// on hover. Allocations are stacked in job order within each interval.
pub fn timeline_html(title: &str, result: &SimResult) -> String {
    let (width, row) = (1200.0, 14.0);
    let end = result.timeline.iter().map(|s| s.end_s).fold(1e-9, f64::max);
    let x = |t: f64| 60.0 + (width - 80.0) * t / end;
    let mut svg = String::new();
    for segment in &result.timeline {
        let mut slot = 0;
        for &(job, workers) in &segment.held {
            let hue = (job * 137) % 360;
            let name = escape(&result.jobs[job].name);
            svg.push_str(&format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.2}\" height=\"{:.1}\" fill=\"hsl({hue},60%,55%)\"><title>{name}: {workers} slot(s), {:.0}-{:.0} s</title></rect>\n",
                x(segment.start_s),
                20.0 + slot as f64 * row,
                (x(segment.end_s) - x(segment.start_s)).max(0.5),
                workers as f64 * row - 1.0,
                segment.start_s,
                segment.end_s
            ));
            slot += workers;
        }
    }
    for s in 0..result.slots {
        svg.push_str(&format!(
            "<text x=\"4\" y=\"{:.1}\" font-size=\"10\">slot {s}</text>\n",
            20.0 + s as f64 * row + row * 0.75
        ));
    }
    let height = 40.0 + result.slots as f64 * row;
    let f = figures(result);
    format!(
        "<!doctype html><meta charset=\"utf-8\"><title>{t}</title><h2>{t}</h2>\n<p>{} jobs; mean completion {:.0} s, p99 {:.0} s; makespan {:.0} s; utilization {:.1}%; {} resizes. Time axis 0-{end:.0} s.</p>\n<svg width=\"{width}\" height=\"{height}\" xmlns=\"http://www.w3.org/2000/svg\">\n{svg}</svg>\n",
        f.jobs,
        f.mean_completion_s,
        f.p99_completion_s,
        f.makespan_s,
        100.0 * f.utilization,
        f.resizes,
        t = escape(title)
    )
}

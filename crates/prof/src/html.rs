//! `report.html`: the step report with plots (loss, tokens/s, phase shares over time as stacked
//! areas, the final breakdown), drawn as inline SVG with `plotters`. One self-contained file, no
//! scripts, so it opens anywhere and renders headless.

use std::fmt::Write as _;

use plotters::prelude::*;

use crate::error::ProfError;
use crate::input::StepSample;
use crate::report::{format_bound, RunReport};
use crate::stats::tokens_per_s;
use crate::vocab::{Phase, N_PHASES};

const WIDTH: u32 = 560;
const HEIGHT: u32 = 300;
/// At most this many points per curve: long runs are averaged into buckets of steps.
const MAX_POINTS: usize = 400;

/// One color per phase, in `Phase::ALL` order.
const PHASE_COLORS: [RGBColor; N_PHASES] = [
    RGBColor(214, 39, 40),   // data_wait
    RGBColor(255, 127, 14),  // h2d
    RGBColor(31, 119, 180),  // forward
    RGBColor(44, 160, 44),   // backward
    RGBColor(148, 103, 189), // recompute
    RGBColor(140, 86, 75),   // comm_exposed
    RGBColor(23, 190, 207),  // optimizer
    RGBColor(227, 119, 194), // ckpt_stall
    RGBColor(127, 127, 127), // other
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Steps averaged in buckets: (mean step, mean wall ms, mean loss over logged steps, tokens/s,
/// mean phase ms).
struct Bucket {
    step: f64,
    loss: f64,
    tokens_per_s: f64,
    shares: [f64; N_PHASES],
}

fn buckets(steps: &[StepSample]) -> Vec<Bucket> {
    let size = steps.len().div_ceil(MAX_POINTS).max(1);
    steps
        .chunks(size)
        .map(|chunk| {
            let n = chunk.len() as f64;
            let wall: f64 = chunk.iter().map(|s| s.wall_ms).sum();
            let tokens: u64 = chunk.iter().map(|s| s.tokens).sum();
            let logged: Vec<f64> = chunk.iter().map(|s| s.loss).filter(|l| l.is_finite()).collect();
            let mut shares = [0.0; N_PHASES];
            for s in chunk {
                for (share, ms) in shares.iter_mut().zip(s.phases.ms) {
                    *share += ms;
                }
            }
            for share in shares.iter_mut() {
                *share = if wall > 0.0 { *share / wall } else { 0.0 };
            }
            Bucket {
                step: chunk.iter().map(|s| s.step as f64).sum::<f64>() / n,
                loss: if logged.is_empty() { f64::NAN } else { logged.iter().sum::<f64>() / logged.len() as f64 },
                tokens_per_s: tokens_per_s(tokens as f64, wall),
                shares,
            }
        })
        .collect()
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn plot_error(chart: &str, error: Box<dyn std::error::Error>) -> ProfError {
    ProfError::Plot { chart: chart.to_string(), message: error.to_string() }
}

fn line_chart(title: &str, y_label: &str, points: &[(f64, f64)], color: RGBColor) -> Result<String, ProfError> {
    let mut svg = String::new();
    let draw = |svg: &mut String| -> DrawResult {
        let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (x0, x1) = points.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (y0, y1) = points.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
        let (x0, x1) = if x0.is_finite() && x1 > x0 { (x0, x1) } else { (0.0, 1.0) };
        let (y0, y1) = if y0.is_finite() && y1 > y0 { (y0, y1) } else { (0.0, y1.max(1.0)) };
        let pad = (y1 - y0) * 0.05;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))?;
        chart.configure_mesh().x_desc("step").y_desc(y_label).draw()?;
        chart.draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| plot_error(title, e))?;
    Ok(svg)
}

fn phase_area_chart(buckets: &[Bucket]) -> Result<String, ProfError> {
    let mut svg = String::new();
    let draw = |svg: &mut String| -> DrawResult {
        let root = SVGBackend::with_string(svg, (WIDTH * 2, HEIGHT + 40)).into_drawing_area();
        root.fill(&WHITE)?;
        let x0 = buckets.first().map_or(0.0, |b| b.step);
        let x1 = buckets.last().map_or(1.0, |b| b.step).max(x0 + 1.0);
        let mut chart = ChartBuilder::on(&root)
            .caption("phase shares of the step over time", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(50)
            .build_cartesian_2d(x0..x1, 0.0..1.0)?;
        chart.configure_mesh().x_desc("step").y_desc("share of step").draw()?;
        // Stacked: draw the cumulative top of each phase, last phase first, so that each area
        // covers the ones above it only where it belongs.
        for phase_idx in (0..N_PHASES).rev() {
            if buckets.iter().all(|b| b.shares[phase_idx] == 0.0) {
                continue;
            }
            let top = buckets.iter().map(|b| (b.step, b.shares[..=phase_idx].iter().sum::<f64>().min(1.0)));
            let color = PHASE_COLORS[phase_idx];
            chart
                .draw_series(AreaSeries::new(top, 0.0, color.mix(0.85)).border_style(color))?
                .label(Phase::ALL[phase_idx].name())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| plot_error("phase areas", e))?;
    Ok(svg)
}

fn breakdown_chart(report: &RunReport) -> Result<String, ProfError> {
    let mut svg = String::new();
    let draw = |svg: &mut String| -> DrawResult {
        let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let max = report.phases.values().copied().fold(0.0, f64::max).max(1e-9) * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption("final breakdown (ms per step)", ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(100)
            .build_cartesian_2d(0.0..max, (0..N_PHASES).into_segmented())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(N_PHASES)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => Phase::ALL.get(*i).map(|p| p.name().to_string()).unwrap_or_default(),
                _ => String::new(),
            })
            .x_desc("ms")
            .draw()?;
        chart.draw_series(Phase::ALL.iter().enumerate().map(|(i, phase)| {
            let ms = report.phases.get(phase).copied().unwrap_or(0.0);
            let (bottom, top) = (SegmentValue::Exact(i), SegmentValue::Exact(i + 1));
            Rectangle::new([(0.0, bottom), (ms, top)], PHASE_COLORS[i].filled())
        }))?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| plot_error("breakdown", e))?;
    Ok(svg)
}

/// The whole page.
pub fn render_html(report: &RunReport, steps: &[StepSample]) -> Result<String, ProfError> {
    let buckets = buckets(steps);
    let loss: Vec<(f64, f64)> = buckets.iter().filter(|b| b.loss.is_finite()).map(|b| (b.step, b.loss)).collect();
    let speed: Vec<(f64, f64)> = buckets.iter().map(|b| (b.step, b.tokens_per_s)).collect();
    let mut html = String::new();
    let w = &mut html;
    let _ = writeln!(
        w,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>stoke report: {name}</title><style>\
         body{{font-family:sans-serif;margin:24px;color:#222}} table{{border-collapse:collapse;margin:8px 0}} \
         td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} th{{background:#f3f3f3}} \
         td.l{{text-align:left}} .plots svg{{margin:4px}} .swatch{{display:inline-block;width:10px;height:10px}}\
         </style></head><body>\n<h1>stoke step report: {name}</h1>",
        name = escape(&report.name)
    );
    let _ = writeln!(
        w,
        "<p><b>{:.2} ms/step</b> median (mean {:.2}, p90 {:.2}, std {:.2}) over {} steps ({} timed) | \
         <b>{:.0} tokens/s</b> median (mean {:.0}, p90 step {:.0}) | effective compute ratio \
         <b>{:.3}</b> | {} | peak memory {:.1} MB | profiler {:.3} ms/step</p>",
        report.step_ms,
        report.step_ms_mean,
        report.step_ms_p90,
        report.step_ms_std,
        report.steps_measured,
        report.steps_timed,
        report.tokens_per_s,
        report.tokens_per_s_mean,
        report.tokens_per_s_p90_step,
        report.effective_compute_ratio,
        match &report.mfu_withheld {
            Some(reason) => format!("MFU withheld ({})", escape(reason)),
            None => format!(
                "MFU <b>{:.2}%</b> of {:.1} GFLOP/s ({} {}; peak {})",
                100.0 * report.mfu,
                report.machine.peak_flops / 1e9,
                escape(&report.machine.device),
                report.train.precision,
                escape(report.machine.peak_source.as_deref().unwrap_or("as given"))
            ),
        },
        report.peak_memory_bytes as f64 / 1e6,
        report.profiler_overhead_ms
    );
    if let (Some(rank0), Some(ranks)) = (&report.rank0, &report.ranks) {
        let _ = writeln!(
            w,
            "<p>The job's rates, all {} ranks together ({:.1} samples/s); rank 0 alone: {:.0} tokens/s, {:.1} \
             samples/s, MFU {:.2}%.</p>",
            ranks.world_size,
            report.samples_per_s,
            rank0.tokens_per_s,
            rank0.samples_per_s,
            100.0 * rank0.mfu
        );
    }
    let _ = writeln!(w, "<table><tr><th>phase</th><th>ms/step</th><th>share</th><th>Amdahl bound</th></tr>");
    for (i, phase) in Phase::ALL.iter().enumerate() {
        let c = PHASE_COLORS[i];
        let _ = writeln!(
            w,
            "<tr><td class=\"l\"><span class=\"swatch\" style=\"background:rgb({},{},{})\"></span> {}</td>\
             <td>{:.2}</td><td>{:.1}%</td><td>{}</td></tr>",
            c.0,
            c.1,
            c.2,
            phase.name(),
            report.phases.get(phase).copied().unwrap_or(0.0),
            100.0 * report.phase_shares.get(phase).copied().unwrap_or(0.0),
            report.amdahl.get(phase).map(|b| format_bound(Some(*b))).unwrap_or_else(|| "-".into())
        );
    }
    let _ = writeln!(w, "</table>\n<h2>Findings</h2>");
    if report.findings.is_empty() {
        let _ = writeln!(w, "<p>None: no rule fired.</p>");
    } else {
        let _ = writeln!(w, "<table><tr><th>id</th><th>bound</th><th>evidence</th><th>cause</th><th>fix</th></tr>");
        for f in &report.findings {
            let _ = writeln!(
                w,
                "<tr><td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td></tr>",
                escape(&f.id),
                format_bound(f.bound),
                escape(&f.evidence),
                escape(&f.cause),
                escape(&f.fix)
            );
        }
        let _ = writeln!(w, "</table>");
    }
    if let Some(ranks) = &report.ranks {
        let _ = writeln!(
            w,
            "<h2>Ranks</h2>\n<p>{} of {} ranks reported; slowest rank <b>{}</b>: {} more busy time (step minus \
             comm_exposed) than the median rank, rank {}.</p>",
            ranks.ranks.len(),
            ranks.world_size,
            ranks.slowest_rank,
            crate::findings::pct(ranks.slowest_excess),
            ranks.median_rank
        );
        let _ = writeln!(
            w,
            "<table><tr><th>rank</th><th>step ms (median)</th><th>mean</th><th>p90</th><th>busy ms</th>\
             <th>comm_exposed ms</th><th>comm_total ms</th><th>data_wait ms</th></tr>"
        );
        for r in &ranks.ranks {
            let _ = writeln!(
                w,
                "<tr><td class=\"l\">rank {}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td>\
                 <td>{:.2}</td><td>{:.2}</td></tr>",
                r.rank,
                r.step_ms,
                r.step_ms_mean,
                r.step_ms_p90,
                r.busy_ms,
                r.comm_exposed_ms,
                r.comm_total_ms,
                r.data_wait_ms
            );
        }
        let _ = writeln!(w, "</table>");
    }
    let _ = writeln!(w, "<h2>Plots</h2><div class=\"plots\">");
    html.push_str(&line_chart("loss", "loss", &loss, RGBColor(31, 119, 180))?);
    html.push_str(&line_chart("tokens/s", "tokens/s", &speed, RGBColor(44, 160, 44))?);
    html.push_str("<br>\n");
    html.push_str(&phase_area_chart(&buckets)?);
    html.push_str("<br>\n");
    html.push_str(&breakdown_chart(report)?);
    html.push_str("\n</div>");
    if let Some(d) = &report.dynamics {
        dynamics_section(&mut html, d)?;
    }
    html.push_str("</body></html>\n");
    Ok(html)
}

/// The training-dynamics section: evaluation loss and perplexity, the latest per-block monitors,
/// loss spikes.
fn dynamics_section(html: &mut String, d: &crate::dynamics::Dynamics) -> Result<(), ProfError> {
    let _ = writeln!(html, "<h2>Training dynamics</h2>");
    if !d.eval.is_empty() {
        let eval: Vec<(f64, f64)> = d.eval.iter().map(|p| (p.step as f64, p.loss)).collect();
        html.push_str(&line_chart("evaluation loss", "eval loss", &eval, RGBColor(214, 39, 40))?);
        let _ =
            writeln!(html, "<table><tr><th>step</th><th>tokens seen</th><th>eval loss</th><th>perplexity</th></tr>");
        for p in &d.eval {
            let _ = writeln!(
                html,
                "<tr><td>{}</td><td>{}</td><td>{:.4}</td><td>{:.3}</td></tr>",
                p.step, p.tokens_seen, p.loss, p.perplexity
            );
        }
        let _ = writeln!(html, "</table>");
        if let Some((step, loss)) = d.best_eval() {
            let _ = writeln!(html, "<p>best evaluation loss {loss:.4} at step {step}</p>");
        }
    }
    for change in &d.batch_changes {
        let _ = writeln!(
            html,
            "<p>adaptive batch: {} -&gt; {} sequences after step {} (noise scale {:.0})</p>",
            change.from, change.to, change.step, change.noise_scale
        );
    }
    if let Some(step) = d.early_stopped_at {
        let _ = writeln!(html, "<p><b>early stopping</b> ended the run at step {step}</p>");
    }
    if let Some(m) = d.monitors.last() {
        let _ = writeln!(
            html,
            "<p>per-block monitors at step {} (global gradient norm {:.4}):</p>\n<table><tr><th>unit</th>\
             <th>gradient norm</th><th>update / weights</th></tr>",
            m.step, m.grad_norm
        );
        for (i, name) in d.units.iter().enumerate() {
            let _ = writeln!(
                html,
                "<tr><td class=\"l\">{}</td><td>{:.4e}</td><td>{:.3e}</td></tr>",
                escape(name),
                m.block_grad_norm.get(i).copied().unwrap_or(f64::NAN),
                m.update_ratio.get(i).copied().unwrap_or(f64::NAN)
            );
        }
        let _ = writeln!(html, "</table>");
    }
    let _ = writeln!(html, "<p>loss spikes (z &gt; {}): {}</p>", d.spike_z, d.spikes.len());
    for spike in d.spikes.iter().take(20) {
        let _ = writeln!(html, "<p>step {}: loss {:.4}, z = {:.1}</p>", spike.step, spike.loss, spike.z);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::ProfConfig;
    use crate::report::tests::{facts, step};
    use crate::step::build_report;

    #[test]
    fn the_page_has_every_plot_and_finding() {
        let steps: Vec<StepSample> = (1..=1000)
            .map(|i| {
                let mut s = step(
                    i,
                    &[(Phase::DataWait, 3.0), (Phase::Forward, 3.0), (Phase::Backward, 6.0), (Phase::Optimizer, 1.0)],
                );
                s.loss = 5.0 / (1.0 + i as f64 / 100.0);
                s
            })
            .collect();
        let report = build_report(&facts(), &steps, 1 << 20, 0.0, &ProfConfig::default());
        let html = render_html(&report, &steps).unwrap();
        assert_eq!(html.matches("<svg").count(), 4);
        for text in ["phase shares of the step over time", "final breakdown", "data_wait", "tokens/s"] {
            assert!(html.contains(text), "{text}");
        }
        assert!(!html.contains("<h2>Ranks</h2>"), "one process has no ranks section");
    }

    #[test]
    fn a_data_parallel_report_shows_its_ranks_and_the_straggler() {
        let steps: Vec<StepSample> =
            (1..=20).map(|i| step(i, &[(Phase::Forward, 6.0), (Phase::CommExposed, 4.0)])).collect();
        let mut report = build_report(&facts(), &steps, 1 << 20, 0.0, &ProfConfig::default());
        let fast = crate::RankSummary::of(0, &report);
        let mut slow = crate::RankSummary::of(1, &report);
        slow.busy_ms = 9.5;
        slow.comm_exposed_ms = 0.5;
        crate::merge_ranks(&mut report, 2, 1, vec![fast, slow], Vec::new(), &ProfConfig::default());
        let html = render_html(&report, &steps).unwrap();
        for text in
            ["<h2>Ranks</h2>", "slowest rank <b>1</b>", "<td class=\"l\">rank 1</td><td>10.00</td>", ">straggler<"]
        {
            assert!(html.contains(text), "{text}");
        }
    }
}

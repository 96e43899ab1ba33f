//! `stoke compare`: did run B learn as well as run A?
//!
//! Both runs' `metrics.jsonl` curves (training loss and, when present, evaluation loss) are put
//! on one axis, tokens seen (a line's step times its tokens per step, summed over the lines, so a
//! changed batch size still lines up), and B's points are compared with A's curve interpolated
//! at the same tokens. The training loss is smoothed first (a centred moving average over
//! `SMOOTH` logged points) so that batch noise is not reported as a gap. The verdict compares the
//! final evaluation losses (the final smoothed training losses when a run has no evaluation): B
//! regresses when its final loss exceeds A's by more than `tolerance` (relative).

use std::fmt::Write as _;

use serde::Serialize;

use crate::error::ProfError;

/// Logged points in the training loss's moving average.
pub const SMOOTH: usize = 9;

/// One run's curves, by tokens seen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunCurves {
    pub name: String,
    /// (tokens seen, step, training loss), every logged step.
    pub train: Vec<(f64, u64, f64)>,
    /// (tokens seen, step, evaluation loss).
    pub eval: Vec<(f64, u64, f64)>,
    /// (step, seconds of step time up to and including it), every line.
    pub wall: Vec<(u64, f64)>,
    /// Each line's step time (ms), for the median.
    pub step_ms: Vec<f64>,
}

impl RunCurves {
    /// Parses `metrics.jsonl` text: every line with `step`, `tokens` and a finite `loss`
    /// (and `eval_loss` where present). Tokens seen accumulate each line's tokens per step over
    /// the steps since the previous line.
    pub fn from_metrics(name: &str, text: &str) -> Result<RunCurves, ProfError> {
        let mut curves = RunCurves {
            name: name.to_string(),
            train: Vec::new(),
            eval: Vec::new(),
            wall: Vec::new(),
            step_ms: Vec::new(),
        };
        let (mut seen, mut last_step, mut wall_s) = (0f64, 0u64, 0f64);
        for (idx, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad =
                |what: &str| ProfError::Metrics { name: name.to_string(), line: idx + 1, message: what.to_string() };
            let value: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
            let step = value.get("step").and_then(serde_json::Value::as_u64).ok_or_else(|| bad("no step"))?;
            let tokens = value.get("tokens").and_then(serde_json::Value::as_f64).ok_or_else(|| bad("no tokens"))?;
            if step <= last_step {
                return Err(bad(&format!("step {step} after step {last_step}")));
            }
            seen += tokens * (step - last_step) as f64;
            // Lines may skip steps (train.log_every): those count at this line's step time.
            let step_ms = value.get("step_ms").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            wall_s += step_ms * (step - last_step) as f64 / 1e3;
            curves.wall.push((step, wall_s));
            if step_ms > 0.0 {
                curves.step_ms.push(step_ms);
            }
            last_step = step;
            if let Some(loss) = value.get("loss").and_then(serde_json::Value::as_f64).filter(|l| l.is_finite()) {
                curves.train.push((seen, step, loss));
            }
            if let Some(loss) = value.get("eval_loss").and_then(serde_json::Value::as_f64).filter(|l| l.is_finite()) {
                curves.eval.push((seen, step, loss));
            }
        }
        if curves.train.is_empty() {
            return Err(ProfError::Metrics { name: name.to_string(), line: 0, message: "no logged loss".into() });
        }
        Ok(curves)
    }

    /// The training loss as a centred moving average over `SMOOTH` points (fewer near the ends,
    /// still centred).
    pub fn smoothed_train(&self) -> Vec<(f64, u64, f64)> {
        let n = self.train.len();
        (0..n)
            .map(|i| {
                let half = (SMOOTH / 2).min(i).min(n - 1 - i);
                let (lo, hi) = (i - half, i + half + 1);
                let mean = self.train[lo..hi].iter().map(|p| p.2).sum::<f64>() / (hi - lo) as f64;
                (self.train[i].0, self.train[i].1, mean)
            })
            .collect()
    }

    /// The first point of the curve the verdict uses (`eval` or `train`, smoothed) at or below
    /// `target`: where the run reached that loss.
    pub fn reach(&self, basis: &str, target: f64) -> Option<Reach> {
        let curve = if basis == "eval" { self.eval.clone() } else { self.smoothed_train() };
        let &(tokens, step, loss) = curve.iter().find(|p| p.2 <= target)?;
        let wall_s = self.wall.iter().find(|w| w.0 == step).map_or(f64::NAN, |w| w.1);
        let median_step_s = stoke_stats::median(&self.step_ms) / 1e3;
        Some(Reach { tokens, step, wall_s, median_wall_s: median_step_s * step as f64, loss })
    }

    /// The final loss the verdict uses: the last evaluation, else the last smoothed training loss.
    pub fn final_loss(&self) -> (&'static str, f64) {
        match self.eval.last() {
            Some(p) => ("eval", p.2),
            None => ("train", self.smoothed_train().last().map_or(f64::NAN, |p| p.2)),
        }
    }
}

/// The largest relative gap between B and A on one curve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gap {
    /// "train" or "eval".
    pub curve: String,
    /// (B - A) / A at that point.
    pub relative: f64,
    pub tokens: f64,
    /// B's step there.
    pub step: u64,
    pub a: f64,
    pub b: f64,
}

/// Where a run first reached a loss.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reach {
    pub tokens: f64,
    pub step: u64,
    /// Summed step time up to that step (seconds).
    pub wall_s: f64,
    /// The run's median step time times the steps to that point: the same figure without the
    /// stalls a shared machine adds to some steps.
    pub median_wall_s: f64,
    pub loss: f64,
}

/// The comparison's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    /// The largest |gap| on each curve both runs have.
    pub gaps: Vec<Gap>,
    /// Which loss the verdict compared ("eval" or "train") and the final values.
    pub basis: String,
    pub final_a: f64,
    pub final_b: f64,
    /// (final_b - final_a) / final_a.
    pub final_relative: f64,
    pub tolerance: f64,
    /// True when B's final loss exceeds A's by more than the tolerance.
    pub regressed: bool,
    /// The target A's final loss x (1 + tolerance), and where each run first reached it.
    pub target: f64,
    pub reach_a: Option<Reach>,
    pub reach_b: Option<Reach>,
}

/// A's value at `tokens`, linearly interpolated; None outside A's range.
fn interpolate(curve: &[(f64, u64, f64)], tokens: f64) -> Option<f64> {
    let idx = curve.partition_point(|p| p.0 < tokens);
    if idx == curve.len() {
        return None;
    }
    if curve[idx].0 == tokens {
        return Some(curve[idx].2);
    }
    if idx == 0 {
        return None;
    }
    let (x0, _, y0) = curve[idx - 1];
    let (x1, _, y1) = curve[idx];
    Some(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))
}

fn largest_gap(name: &str, a: &[(f64, u64, f64)], b: &[(f64, u64, f64)]) -> Option<Gap> {
    b.iter()
        .filter_map(|&(tokens, step, vb)| {
            let va = interpolate(a, tokens)?;
            Some(Gap { curve: name.into(), relative: (vb - va) / va, tokens, step, a: va, b: vb })
        })
        .max_by(|x, y| x.relative.abs().total_cmp(&y.relative.abs()))
}

/// Compares B with A (see the module's docs).
pub fn compare(a: &RunCurves, b: &RunCurves, tolerance: f64) -> Comparison {
    let mut gaps: Vec<Gap> = largest_gap("train", &a.smoothed_train(), &b.smoothed_train()).into_iter().collect();
    gaps.extend(largest_gap("eval", &a.eval, &b.eval));
    // Both on evaluation loss when both have one; else both on training loss.
    let both_eval = !a.eval.is_empty() && !b.eval.is_empty();
    let last = |c: &RunCurves| {
        if both_eval {
            ("eval", c.eval.last().map_or(f64::NAN, |p| p.2))
        } else {
            ("train", c.smoothed_train().last().map_or(f64::NAN, |p| p.2))
        }
    };
    let ((basis, final_a), (_, final_b)) = (last(a), last(b));
    let final_relative = (final_b - final_a) / final_a;
    let target = final_a * (1.0 + tolerance);
    Comparison {
        target,
        reach_a: a.reach(basis, target),
        reach_b: b.reach(basis, target),
        a: a.name.clone(),
        b: b.name.clone(),
        gaps,
        basis: basis.into(),
        final_a,
        final_b,
        final_relative,
        tolerance,
        regressed: !(final_relative <= tolerance),
    }
}

impl Comparison {
    /// The printed summary.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "compare: A = {}, B = {}", self.a, self.b);
        for gap in &self.gaps {
            let _ = writeln!(
                out,
                "  largest {} loss gap: {:+.2}% at {:.0} tokens (B's step {}): A {:.4}, B {:.4}",
                gap.curve,
                gap.relative * 100.0,
                gap.tokens,
                gap.step,
                gap.a,
                gap.b
            );
        }
        let _ = writeln!(
            out,
            "  final {} loss: A {:.4}, B {:.4} ({:+.2}%, tolerance {:.2}%): {}",
            self.basis,
            self.final_a,
            self.final_b,
            self.final_relative * 100.0,
            self.tolerance * 100.0,
            if self.regressed { "B is WORSE than A" } else { "B is within tolerance of A" }
        );
        for (run, reach) in [("A", &self.reach_a), ("B", &self.reach_b)] {
            let _ = match reach {
                Some(r) => writeln!(
                    out,
                    "  {run} reached {} loss <= {:.4} at step {} after {:.0} tokens, {:.1} s of steps \
                     ({:.1} s at the median step time)",
                    self.basis, self.target, r.step, r.tokens, r.wall_s, r.median_wall_s
                ),
                None => writeln!(out, "  {run} never reached {} loss <= {:.4}", self.basis, self.target),
            };
        }
        out
    }
}

/// One HTML page (inline SVG, no scripts) with both runs' curves: training loss (smoothed) and
/// evaluation loss against tokens seen.
pub fn render_compare_html(a: &RunCurves, b: &RunCurves, comparison: &Comparison) -> String {
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>stoke compare</title>\
         <style>body{font-family:sans-serif;margin:2em}pre{background:#f4f4f4;padding:1em}</style></head><body>",
    );
    let _ = write!(html, "<h1>stoke compare</h1><pre>{}</pre>", escape(&comparison.render_text()));
    let panels: [(&str, Vec<(f64, u64, f64)>, Vec<(f64, u64, f64)>); 2] = [
        ("training loss (moving average)", a.smoothed_train(), b.smoothed_train()),
        ("evaluation loss", a.eval.clone(), b.eval.clone()),
    ];
    for (title, ca, cb) in panels {
        if ca.is_empty() && cb.is_empty() {
            continue;
        }
        let _ = write!(html, "<h2>{title}</h2>{}", svg_chart(&[(&a.name, "#1f77b4", &ca), (&b.name, "#d62728", &cb)]));
    }
    html.push_str("</body></html>\n");
    html
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A line chart of several series of (x, _, y) points.
fn svg_chart(series: &[(&str, &str, &Vec<(f64, u64, f64)>)]) -> String {
    let (w, h, pad) = (800.0, 360.0, 60.0);
    let points = series.iter().flat_map(|s| s.2.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for p in points {
        x0 = x0.min(p.0);
        x1 = x1.max(p.0);
        y0 = y0.min(p.2);
        y1 = y1.max(p.2);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let mut svg = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\">");
    let _ = write!(
        svg,
        "<rect x=\"{pad}\" y=\"{pad}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>",
        w - 2.0 * pad,
        h - 2.0 * pad
    );
    for i in 0..=4 {
        let (fx, fy) = (x0 + (x1 - x0) * i as f64 / 4.0, y0 + (y1 - y0) * i as f64 / 4.0);
        let _ = write!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{:.3e}</text>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{:.3}</text>",
            sx(fx),
            h - pad + 16.0,
            fx,
            pad - 6.0,
            sy(fy) + 4.0,
            fy
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">tokens seen</text>",
        w / 2.0,
        h - 12.0
    );
    for (idx, (name, color, pts)) in series.iter().enumerate() {
        let path: Vec<String> = pts.iter().map(|p| format!("{:.1},{:.1}", sx(p.0), sy(p.2))).collect();
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"{color}\">{}</text>",
            path.join(" "),
            w - pad - 200.0,
            pad + 18.0 + 16.0 * idx as f64,
            escape(name)
        );
    }
    svg.push_str("</svg>");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(losses: &[f64], tokens: u64, eval_every: usize) -> String {
        losses
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let eval =
                    if (i + 1) % eval_every == 0 { format!(",\"eval_loss\":{}", l + 0.1) } else { String::new() };
                format!("{{\"step\":{},\"loss\":{l},\"tokens\":{tokens}{eval}}}\n", i + 1)
            })
            .collect()
    }

    #[test]
    fn identical_runs_pass_and_a_worse_run_is_flagged() {
        let losses: Vec<f64> = (0..100).map(|i| 5.0 * (-(i as f64) / 40.0).exp() + 1.0).collect();
        let a = RunCurves::from_metrics("a", &metrics(&losses, 1000, 10)).unwrap();
        let same = RunCurves::from_metrics("b", &metrics(&losses, 1000, 10)).unwrap();
        let c = compare(&a, &same, 0.02);
        assert!(!c.regressed && c.final_relative == 0.0 && c.gaps.iter().all(|g| g.relative == 0.0), "{c:?}");
        assert_eq!(c.basis, "eval");
        let worse: Vec<f64> = losses.iter().map(|l| l * 1.05).collect();
        let b = RunCurves::from_metrics("b", &metrics(&worse, 1000, 10)).unwrap();
        let c = compare(&a, &b, 0.02);
        assert!(c.regressed, "{c:?}");
        let better = compare(&b, &a, 0.02);
        assert!(!better.regressed, "B better than A is no regression");
    }

    #[test]
    fn runs_line_up_by_tokens_not_steps() {
        // B takes steps of 4x the tokens: its step 25 is A's step 100.
        let a_losses: Vec<f64> = (0..100).map(|i| 3.0 - i as f64 * 0.01).collect();
        let b_losses: Vec<f64> = (0..25).map(|i| 3.0 - (i as f64 * 4.0 + 3.0) * 0.01).collect();
        let a = RunCurves::from_metrics("a", &metrics(&a_losses, 100, 1000)).unwrap();
        let b = RunCurves::from_metrics("b", &metrics(&b_losses, 400, 1000)).unwrap();
        assert_eq!(b.train.last().unwrap().0, 10_000.0);
        let c = compare(&a, &b, 0.02);
        assert_eq!(c.basis, "train");
        assert!(c.gaps[0].relative.abs() < 0.01, "{c:?}");
        assert!(!c.regressed);
    }

    #[test]
    fn broken_metrics_name_the_line() {
        let err = RunCurves::from_metrics("x", "{\"step\":1,\"loss\":2,\"tokens\":5}\nnot json\n").unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
    }
}

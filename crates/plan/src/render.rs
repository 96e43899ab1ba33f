//! The ranked table `stoke plan` prints.

use std::fmt::Write as _;

use crate::search::Estimate;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// A human unit for seconds.
pub fn format_seconds(seconds: f64) -> String {
    if seconds >= 1.0 {
        format!("{seconds:.2} s")
    } else if seconds >= 1e-3 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{:.0} us", seconds * 1e6)
    }
}

/// A table of the first `top` plans: layout, memory per device, step time with its error, MFU,
/// per-device FLOP/s and the bottleneck.
pub fn render_table(plans: &[Estimate], top: usize) -> String {
    let header = ["rank", "layout", "mem/device", "step", "± 1σ", "tokens/s", "MFU", "TFLOP/s/dev", "bottleneck"];
    let mut rows: Vec<[String; 9]> = Vec::new();
    for (rank_idx, plan) in plans.iter().take(top).enumerate() {
        rows.push([
            (rank_idx + 1).to_string(),
            plan.layout.to_string(),
            format!("{:.2} GiB", plan.memory.total / GIB),
            format_seconds(plan.time.step_s),
            format!("{:.0}%", 100.0 * plan.step_s_error / plan.time.step_s),
            format!("{:.0}", plan.tokens_per_s),
            format!("{:.1}%", 100.0 * plan.mfu),
            format!("{:.1}", plan.hardware_flops_per_device / 1e12),
            plan.bottleneck.clone(),
        ]);
    }
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[String]| {
        let mut text = String::new();
        for (idx, (cell, width)) in cells.iter().zip(widths).enumerate() {
            let pad = width - cell.chars().count();
            // Text columns align left, numbers right.
            if idx == 1 || idx == 8 {
                let _ = write!(text, "{cell}{}  ", " ".repeat(pad));
            } else {
                let _ = write!(text, "{}{cell}  ", " ".repeat(pad));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut out, &header.map(String::from));
    for row in &rows {
        line(&mut out, row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_pick_a_readable_unit() {
        for (seconds, expected) in [(2.5, "2.50 s"), (0.0123, "12.3 ms"), (0.000_042, "42 us")] {
            assert_eq!(format_seconds(seconds), expected);
        }
    }
}

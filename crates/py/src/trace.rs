//! `stoke.trace`'s native half: the analyzer behind `stoke trace analyze|diff`, run with the GIL
//! released; results leave as the same JSON the command prints, which Python parses into dicts.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use stoke_prof::{analyze_paths, diff, diff_markdown, markdown, prometheus, table, AnalyzeOptions, DiffOptions};

use crate::errors;

fn options(top: usize, model_flops: Option<f64>, peak_flops: Option<f64>) -> PyResult<AnalyzeOptions> {
    if peak_flops.is_some_and(|p| p <= 0.0) || model_flops.is_some_and(|f| f <= 0.0) {
        return Err(PyValueError::new_err("model_flops and peak_flops must be positive"));
    }
    Ok(AnalyzeOptions { top_kernels: top, model_flops_per_step: model_flops, peak_flops, ..AnalyzeOptions::default() })
}

fn paths(inputs: Vec<String>) -> Vec<PathBuf> {
    inputs.into_iter().map(PathBuf::from).collect()
}

/// The analysis of trace files or folders (one file per rank), as `stoke trace analyze --format
/// json` prints it; `format` "table", "markdown" or "prometheus" gives that text instead.
#[pyfunction]
#[pyo3(signature = (inputs, format="json", top=10, model_flops=None, peak_flops=None))]
pub fn analyze(
    py: Python<'_>,
    inputs: Vec<String>,
    format: &str,
    top: usize,
    model_flops: Option<f64>,
    peak_flops: Option<f64>,
) -> PyResult<String> {
    let opts = options(top, model_flops, peak_flops)?;
    let render: fn(&stoke_prof::Analysis) -> String = match format {
        "json" => |a| serde_json::to_string(a).expect("the analysis serializes"),
        "table" => table,
        "markdown" => markdown,
        "prometheus" => prometheus,
        other => {
            return Err(PyValueError::new_err(format!(
                "format {other:?}: expected json, table, markdown or prometheus"
            )))
        }
    };
    let inputs = paths(inputs);
    py.detach(|| analyze_paths(&inputs, &opts).map(|analysis| render(&analysis))).map_err(errors::trace)
}

/// Two sets of traces compared, as `stoke trace diff --format json` prints it (or "table",
/// "markdown"); its `regression` says whether the new step time regressed beyond `tolerance`.
#[pyfunction]
#[pyo3(signature = (base, new, format="json", tolerance=0.05, top=20))]
pub fn compare(
    py: Python<'_>,
    base: String,
    new: String,
    format: &str,
    tolerance: f64,
    top: usize,
) -> PyResult<String> {
    if !(0.0..10.0).contains(&tolerance) {
        return Err(PyValueError::new_err("tolerance must be in [0, 10)"));
    }
    if !matches!(format, "json" | "table" | "markdown") {
        return Err(PyValueError::new_err(format!("format {format:?}: expected json, table or markdown")));
    }
    let opts = AnalyzeOptions::default();
    let (base, new) = (PathBuf::from(base), PathBuf::from(new));
    py.detach(|| {
        let base = analyze_paths(std::slice::from_ref(&base), &opts)?;
        let new = analyze_paths(std::slice::from_ref(&new), &opts)?;
        let result = diff(&base, &new, &DiffOptions { tolerance, top })?;
        Ok(match format {
            "json" => serde_json::to_string(&result).expect("the diff serializes"),
            "markdown" => diff_markdown(&result),
            _ => stoke_prof::diff_table(&result),
        })
    })
    .map_err(errors::trace)
}

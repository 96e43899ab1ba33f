//! Job lists: the CSV format, and a generator of synthetic workloads.
//!
//! CSV, one job per line after a header (`#` starts a comment line):
//!
//! ```text
//! submit_s,name,work,min_workers,max_workers,scaling[,resize_s[,priority[,noise_scale,batch_per_worker]]]
//! 0,bert,360000,1,8,amdahl:100:0.95,30
//! 120,resnet,50000,1,4,points:1=80;2=150;4=260
//! ```
//!
//! `work` is samples; `scaling` is `amdahl:T1:P`, `linear:T1` or `points:W=T;...` (samples/s);
//! `resize_s` the seconds a resize costs (default 30); `priority` the job's weight (default 1);
//! with `noise_scale` > 0 the global batch grows with the workers (`batch_per_worker` each) and
//! statistical efficiency falls as McCandlish et al. (2018) model it; without it the global batch
//! is fixed (stoke's `train.global_batch`) and efficiency is 1.
//!
//! With a header, five more columns describe a job whose batch the goodput policy may choose
//! (`batch::BatchModel`): `step_table` (`WxM=STEP/SYNC;...`: seconds per step of micro-batch M on
//! W workers, and the synchronisation part), `batch` (the global batch it asks for, which the
//! other policies run), `batch_range` (`MIN-MAX`, the batches it accepts; MIN is the reference of
//! its efficiency and `work` counts samples at it), `micro_max` (the largest micro-batch; more
//! accumulates) and `noise_schedule` (`F=N;...`: noise scale N once fraction F of the work is
//! done; or `B@F=N;...`, schedules measured at several batches B, linear between them), `b0` (the batch whose efficiency is 1, at which `work` counts samples; default MIN).
//! `scaling` may then be left empty. `workers` (any job) is what it asks for, which FIFO and
//! Tiresias run it on (default `max_workers`); `start_s` the seconds its first start costs
//! (default 0).

use crate::batch::{BatchModel, StepTable};
use crate::limits::MIN_RATE;
use crate::limits::{MAX_NOISE_SCALE, MAX_PRIORITY, MAX_RESIZE_S, MAX_SUBMIT_S, MAX_WORK, MAX_WORKERS};
use crate::model::{Efficiency, JobSpec, Scaling};
use crate::SchedError;

/// The columns of the jobs CSV, in their positional order (a file without a header line lists
/// them in this order, the optional ones trailing).
pub const COLUMNS: &[&str] = &[
    "submit_s",
    "name",
    "work",
    "min_workers",
    "max_workers",
    "scaling",
    "resize_s",
    "priority",
    "noise_scale",
    "batch_per_worker",
    "batch",
    "batch_range",
    "micro_max",
    "step_table",
    "noise_schedule",
    "b0",
    "workers",
    "start_s",
];
/// Columns 0..REQUIRED are required, except `scaling` when a `step_table` is given; columns past
/// `POSITIONAL` need a header.
const REQUIRED: usize = 6;
const POSITIONAL: usize = 10;
const SCALING: usize = 5;
const STEP_TABLE: usize = 13;

/// A numeric field's allowed range, in words, with its test.
struct Range {
    words: &'static str,
    ok: fn(f64) -> bool,
}

const SUBMIT: Range = Range { words: "0 <= submit_s <= 1e9", ok: |v| (0.0..=MAX_SUBMIT_S).contains(&v) };
const WORK: Range = Range { words: "0 < work <= 1e15", ok: |v| v > 0.0 && v <= MAX_WORK };
const RESIZE: Range = Range { words: "0 <= resize_s <= 1e7", ok: |v| (0.0..=MAX_RESIZE_S).contains(&v) };
const START: Range = Range { words: "0 <= start_s <= 1e7", ok: |v| (0.0..=MAX_RESIZE_S).contains(&v) };
const PRIORITY: Range = Range { words: "0 < priority <= 1e6", ok: |v| v > 0.0 && v <= MAX_PRIORITY };
const NOISE: Range =
    Range { words: "0 <= noise_scale <= 1e12 (0: a fixed global batch)", ok: |v| (0.0..=MAX_NOISE_SCALE).contains(&v) };
const BATCH: Range =
    Range { words: "1 <= batch_per_worker <= 1e9 when noise_scale > 0", ok: |v| (1.0..=1e9).contains(&v) };

/// Parses a jobs CSV. A first line starting with `submit_s` is a header naming the columns (any
/// order, optional ones left out); without one the columns are `COLUMNS` in order. Every field is
/// checked against its range, and every error names the line, the field and the range.
pub fn parse_csv(text: &str) -> Result<Vec<JobSpec>, SchedError> {
    let mut jobs: Vec<JobSpec> = Vec::new();
    let mut first_line_of: std::collections::HashMap<String, usize> = Default::default();
    let mut header: Option<Vec<usize>> = None;
    let mut seen_first = false;
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: String| SchedError::BadCsv { line: line_no, why };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if !seen_first {
            seen_first = true;
            if line.starts_with("submit_s") {
                header = Some(parse_header(&fields).map_err(bad)?);
                continue;
            }
        }
        // column index (into COLUMNS) -> field text
        let mut by_column: [Option<&str>; COLUMNS.len()] = [None; COLUMNS.len()];
        match &header {
            Some(columns) => {
                if fields.len() > columns.len() {
                    return Err(bad(format!("{} fields; the header names {}", fields.len(), columns.len())));
                }
                for (&column, &field) in columns.iter().zip(&fields) {
                    by_column[column] = Some(field);
                }
            }
            None => {
                if !(REQUIRED..=POSITIONAL).contains(&fields.len()) || fields.len() == POSITIONAL - 1 {
                    return Err(bad(format!(
                        "{} fields; expected submit_s,name,work,min_workers,max_workers,scaling[,resize_s[,priority[,noise_scale,batch_per_worker]]]",
                        fields.len()
                    )));
                }
                for (column, &field) in fields.iter().enumerate() {
                    by_column[column] = Some(field);
                }
            }
        }
        let field = |column: usize| by_column[column].filter(|f| !f.is_empty());
        let float = |column: usize, range: &Range, default: f64| -> Result<f64, SchedError> {
            let name = COLUMNS[column];
            let Some(text) = field(column) else { return Ok(default) };
            let value = text
                .parse::<f64>()
                .map_err(|_| bad(format!("{name} `{text}` is not a number; needs {}", range.words)))?;
            if !value.is_finite() || !(range.ok)(value) {
                return Err(bad(format!("{name} `{text}` is out of range; needs {}", range.words)));
            }
            Ok(value)
        };
        let workers = |column: usize| -> Result<usize, SchedError> {
            let name = COLUMNS[column];
            let text = field(column).ok_or_else(|| bad(format!("{name} is missing")))?;
            let range = format!("a whole number, 1 <= {name} <= {MAX_WORKERS}");
            let value = text.parse::<usize>().map_err(|_| bad(format!("{name} `{text}` is not {range}")))?;
            if !(1..=MAX_WORKERS).contains(&value) {
                return Err(bad(format!("{name} `{text}` is out of range; needs {range}")));
            }
            Ok(value)
        };
        for required in (0..REQUIRED).filter(|&c| c != SCALING || field(STEP_TABLE).is_none()) {
            if field(required).is_none() {
                return Err(bad(format!("{} is missing", COLUMNS[required])));
            }
        }
        let name = field(1).unwrap_or_default().to_string();
        if let Some(first) = first_line_of.get(&name) {
            return Err(bad(format!("name `{name}` is taken by the job on line {first}; names must be unique")));
        }
        first_line_of.insert(name.clone(), line_no);
        let (min_workers, max_workers) = (workers(3)?, workers(4)?);
        if let Some(asked) = field(16) {
            let asked: usize = asked.parse().unwrap_or(0);
            if !(min_workers..=max_workers).contains(&asked) {
                return Err(bad(format!(
                    "workers `{asked}` is out of range; needs min_workers <= workers <= max_workers"
                )));
            }
        }
        if min_workers > max_workers {
            return Err(bad(format!(
                "min_workers {min_workers} > max_workers {max_workers}; needs min_workers <= max_workers"
            )));
        }
        let batch = match field(STEP_TABLE) {
            Some(_) => Some(batch_model(&field, &float).map_err(bad)?),
            None => None,
        };
        let scaling = match (field(SCALING), &batch) {
            (Some(text), _) => Scaling::parse(text).map_err(|e| bad(format!("scaling: {e}")))?,
            // The asked batch's throughput per worker count, for what reads `scaling`.
            (None, Some(model)) => Scaling::Points(
                (1..=max_workers.min(256))
                    .map(|w| (w, model.throughput(model.workers_for_asked(w), model.batch).unwrap_or(MIN_RATE)))
                    .collect(),
            ),
            (None, None) => return Err(bad("scaling is missing".into())),
        };
        let noise = float(8, &NOISE, 0.0)?;
        let efficiency = if noise > 0.0 {
            if field(9).is_none() {
                return Err(bad(format!("batch_per_worker is missing; needs {}", BATCH.words)));
            }
            Efficiency { b0: float(9, &BATCH, 1.0)?, batch_grows: true, noise }
        } else {
            Efficiency::FIXED_BATCH
        };
        jobs.push(JobSpec {
            submit_s: float(0, &SUBMIT, 0.0)?,
            name,
            work: float(2, &WORK, 0.0)?,
            min_workers,
            max_workers,
            scaling,
            resize_s: float(6, &RESIZE, 30.0)?,
            start_s: float(17, &START, 0.0)?,
            priority: float(7, &PRIORITY, 1.0)?,
            efficiency,
            batch,
            asked_workers: match field(16) {
                Some(_) => Some(workers(16)?),
                None => None,
            },
        });
    }
    Ok(jobs)
}

/// The batch model of a row with a `step_table`: `batch` (asked, required), `batch_range`
/// `MIN-MAX` (default: the asked batch alone), `micro_max` (default: the largest micro-batch in
/// the table), `noise_schedule` `F=N;...` (default: `noise_scale` throughout).
fn batch_model<'a>(
    field: &dyn Fn(usize) -> Option<&'a str>,
    float: &dyn Fn(usize, &Range, f64) -> Result<f64, SchedError>,
) -> Result<BatchModel, String> {
    let table = StepTable::parse(field(STEP_TABLE).unwrap_or_default())?;
    let asked = field(10).ok_or("batch is missing; a step_table needs the global batch the job asks for")?;
    let batch: f64 = asked.parse().map_err(|_| format!("batch `{asked}` is not a number; needs 1 <= batch <= 1e9"))?;
    let (batch_min, batch_max) = match field(11) {
        Some(range) => {
            let bad = || format!("batch_range `{range}`: expected MIN-MAX with 1 <= MIN <= batch <= MAX <= 1e9");
            let (lo, hi) = range.split_once('-').ok_or_else(bad)?;
            (lo.trim().parse::<f64>().map_err(|_| bad())?, hi.trim().parse::<f64>().map_err(|_| bad())?)
        }
        None => (batch, batch),
    };
    let micro_max = match field(12) {
        Some(text) => text.parse::<f64>().map_err(|_| format!("micro_max `{text}` is not a number; needs >= 1"))?,
        None => table.max_micro(),
    };
    let (noise, noise_by_batch) = match field(14) {
        Some(text) if text.contains('@') => {
            let by_batch = BatchModel::parse_noise_by_batch(text)?;
            // The asked batch's schedule, for what reads one: the nearest batch measured.
            let nearest = by_batch.iter().min_by(|a, b| (a.0 - batch).abs().total_cmp(&(b.0 - batch).abs()));
            (nearest.map(|n| n.1.clone()).unwrap_or_default(), by_batch)
        }
        Some(text) => (BatchModel::parse_noise(text)?, Vec::new()),
        None => (vec![(0.0, float(8, &NOISE, 0.0).map_err(|e| e.to_string())?)], Vec::new()),
    };
    let b0 = match field(15) {
        Some(text) => text.parse::<f64>().map_err(|_| format!("b0 `{text}` is not a number; needs 1 <= b0 <= 1e9"))?,
        None => batch_min,
    };
    let model = BatchModel { table, batch, batch_min, batch_max, b0, micro_max, noise, noise_by_batch };
    model.check()?;
    Ok(model)
}

fn parse_header(fields: &[&str]) -> Result<Vec<usize>, String> {
    let mut columns = Vec::new();
    for field in fields {
        let column = COLUMNS
            .iter()
            .position(|c| c == field)
            .ok_or_else(|| format!("header: unknown column `{field}`; columns: {}", COLUMNS.join(",")))?;
        if columns.contains(&column) {
            return Err(format!("header: column `{field}` twice"));
        }
        columns.push(column);
    }
    if let Some(missing) = (0..REQUIRED).find(|c| !columns.contains(c)) {
        return Err(format!("header: no column `{}`; required: {}", COLUMNS[missing], COLUMNS[..REQUIRED].join(",")));
    }
    Ok(columns)
}

pub fn to_csv(jobs: &[JobSpec]) -> String {
    let mut out = COLUMNS.join(",") + "\n";
    for j in jobs {
        let scaling = match &j.scaling {
            Scaling::Amdahl { t1, p } => format!("amdahl:{t1}:{p}"),
            Scaling::Points(points) => {
                format!("points:{}", points.iter().map(|(w, t)| format!("{w}={t}")).collect::<Vec<_>>().join(";"))
            }
        };
        let (noise, batch) = if j.efficiency.batch_grows { (j.efficiency.noise, j.efficiency.b0) } else { (0.0, 1.0) };
        let model = match &j.batch {
            Some(m) => format!(
                "{},{}-{},{},{},{},{}",
                m.batch,
                m.batch_min,
                m.batch_max,
                m.micro_max,
                m.table.to_text(),
                m.noise_text(),
                m.b0
            ),
            None => ",,,,,".into(),
        };
        let asked = j.asked_workers.map_or(String::new(), |w| w.to_string());
        let start = j.start_s;
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{model},{asked},{start}\n",
            j.submit_s, j.name, j.work, j.min_workers, j.max_workers, scaling, j.resize_s, j.priority, noise, batch
        ));
    }
    out
}

/// A synthetic workload's knobs. Its shape follows what Jeon et al. (USENIX ATC 2019, "Analysis
/// of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads") report for Microsoft's
/// Philly cluster: most jobs ask for one device and few for many, and run times are heavy-tailed
/// (minutes to days). The numbers here are this generator's own choices, not fitted to that trace:
/// Poisson arrivals, log-normal single-device run times, requested sizes from `SIZES`, Amdahl
/// scaling with a parallel fraction drawn uniformly from `parallel`.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub jobs: usize,
    pub mean_interarrival_s: f64,
    /// Median run time on one device, and the log-normal's sigma.
    pub median_run_s: f64,
    pub sigma: f64,
    pub parallel: (f64, f64),
    pub resize_s: f64,
    pub max_slots: usize,
}

/// Requested devices and their probabilities.
pub const SIZES: &[(usize, f64)] = &[(1, 0.5), (2, 0.2), (4, 0.15), (8, 0.1), (16, 0.05)];

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            jobs: 160,
            mean_interarrival_s: 240.0,
            median_run_s: 3600.0,
            sigma: 1.2,
            parallel: (0.85, 0.99),
            resize_s: 60.0,
            max_slots: 16,
        }
    }
}

/// SplitMix64: small, seedable, good enough for workloads.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()
    }
}

pub fn generate(spec: &WorkloadSpec, seed: u64) -> Vec<JobSpec> {
    let mut rng = Rng(seed ^ 0x5EED);
    let mut t = 0.0;
    (0..spec.jobs)
        .map(|i| {
            t += -spec.mean_interarrival_s * rng.uniform().ln();
            let run_s = spec.median_run_s * (spec.sigma * rng.normal()).exp();
            let mut pick = rng.uniform();
            let asked = SIZES
                .iter()
                .find(|&&(_, p)| {
                    pick -= p;
                    pick <= 0.0
                })
                .map_or(1, |&(size, _)| size)
                .min(spec.max_slots);
            let p = spec.parallel.0 + (spec.parallel.1 - spec.parallel.0) * rng.uniform();
            let t1 = 100.0;
            JobSpec {
                name: format!("job{i:03}"),
                submit_s: t,
                // Work sized so that the job runs `run_s` on the devices it asked for.
                work: run_s * Scaling::Amdahl { t1, p }.throughput(asked),
                min_workers: 1,
                max_workers: asked,
                scaling: Scaling::Amdahl { t1, p },
                efficiency: Efficiency::FIXED_BATCH,
                resize_s: spec.resize_s,
                start_s: 0.0,
                priority: 1.0,
                batch: None,
                asked_workers: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trips_and_names_bad_lines() {
        let text = "submit_s,name,work,min_workers,max_workers,scaling,resize_s\n# a comment\n0,a,100,1,4,amdahl:10:0.9,20\n5,b,50,2,2,points:1=5;2=9\n";
        let jobs = parse_csv(text).unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0].resize_s, 20.0);
        assert_eq!(jobs[1].resize_s, 30.0);
        assert_eq!(parse_csv(&to_csv(&jobs)).unwrap(), jobs);
        let err = parse_csv("submit_s,name,work,min_workers,max_workers,scaling\n0,a,x,1,4,linear:1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("work `x`"), "{err}");
        let err = parse_csv("0,a,1,1,4,cubic:1\n").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn the_generator_is_seeded_and_mostly_small() {
        let spec = WorkloadSpec::default();
        let (a, b) = (generate(&spec, 1), generate(&spec, 1));
        assert_eq!(a, b);
        assert_ne!(a, generate(&spec, 2));
        let single = a.iter().filter(|j| j.max_workers == 1).count();
        assert!(single > a.len() / 3 && single < a.len() * 2 / 3, "{single} of {}", a.len());
        assert!(a.windows(2).all(|w| w[0].submit_s <= w[1].submit_s));
    }
}

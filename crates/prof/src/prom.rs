//! Live metrics: a `prometheus-client` registry updated every step, served as Prometheus text
//! (exposition format 0.0.4) at `GET /metrics` by stoke-http's server.
//!
//! Metric names (the Grafana dashboard in `dashboards/stoke-grafana.json` plots these):
//! `stoke_steps_total`, `stoke_tokens_total`, `stoke_phase_seconds_total{phase}` (additive phases),
//! `stoke_comm_seconds_total`, `stoke_step_seconds`, `stoke_loss`, `stoke_learning_rate`,
//! `stoke_tokens_per_second`, `stoke_effective_compute_ratio`, `stoke_mfu`, `stoke_memory_peak_bytes`.
//! Every series carries the labels `rank` and `world` (`rank="0",world="1"` on one process): in a
//! data-parallel run each rank serves its own endpoint, and a scraper that reads them all keeps the
//! ranks apart by these labels.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::input::StepSample;
use crate::vocab::Phase;

type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;

/// The run's live metrics.
pub struct LiveMetrics {
    registry: Registry,
    steps: Counter,
    tokens: Counter,
    phase_seconds: Family<Vec<(String, String)>, FloatCounter>,
    /// One counter per phase, looked up once so that a step costs no label hashing.
    phase_counters: Vec<FloatCounter>,
    comm_seconds: FloatCounter,
    step_seconds: FloatGauge,
    loss: FloatGauge,
    learning_rate: FloatGauge,
    tokens_per_second: FloatGauge,
    /// The job's rate: this rank's times the ranks (they train the same rows per step in lockstep).
    job_tokens_per_second: FloatGauge,
    world_size: usize,
    compute_ratio: FloatGauge,
    mfu: FloatGauge,
    memory_peak: FloatGauge,
    /// Per GPU, labelled `device` and `metric`: NVML's readings (`set_gpus`).
    gpu: Family<Vec<(String, String)>, FloatGauge>,
}

impl Default for LiveMetrics {
    fn default() -> Self {
        LiveMetrics::new()
    }
}

impl LiveMetrics {
    /// The metrics of a single-process run (rank 0 of 1).
    pub fn new() -> LiveMetrics {
        LiveMetrics::for_rank(0, 1)
    }

    /// The metrics of rank `rank` of a `world_size`-process run.
    pub fn for_rank(rank: usize, world_size: usize) -> LiveMetrics {
        let labels = [("rank", rank.to_string()), ("world", world_size.to_string())];
        let mut registry = Registry::with_labels(labels.into_iter().map(|(k, v)| (k.into(), v.into())));
        let m = LiveMetrics {
            steps: Counter::default(),
            tokens: Counter::default(),
            phase_seconds: Family::default(),
            phase_counters: Vec::new(),
            comm_seconds: FloatCounter::default(),
            step_seconds: FloatGauge::default(),
            loss: FloatGauge::default(),
            learning_rate: FloatGauge::default(),
            tokens_per_second: FloatGauge::default(),
            job_tokens_per_second: FloatGauge::default(),
            world_size: world_size.max(1),
            compute_ratio: FloatGauge::default(),
            mfu: FloatGauge::default(),
            memory_peak: FloatGauge::default(),
            gpu: Family::default(),
            registry: Registry::default(),
        };
        registry.register("stoke_steps", "Optimizer steps completed", m.steps.clone());
        registry.register("stoke_tokens", "Tokens trained on by this process", m.tokens.clone());
        registry.register(
            "stoke_phase_seconds",
            "Seconds spent per step phase (the phases add up to the wall time)",
            m.phase_seconds.clone(),
        );
        registry.register("stoke_comm_seconds", "Seconds of communication, hidden or exposed", m.comm_seconds.clone());
        registry.register("stoke_step_seconds", "Wall time of the last step", m.step_seconds.clone());
        registry.register("stoke_loss", "Loss of the last logged step", m.loss.clone());
        registry.register("stoke_learning_rate", "Learning rate of the last step", m.learning_rate.clone());
        registry.register(
            "stoke_tokens_per_second",
            "Tokens per second of this rank's last step",
            m.tokens_per_second.clone(),
        );
        registry.register(
            "stoke_job_tokens_per_second",
            "Tokens per second of the whole job at this rank's last step (the rank's rate times the ranks)",
            m.job_tokens_per_second.clone(),
        );
        registry.register(
            "stoke_effective_compute_ratio",
            "The step's matrix multiplies timed alone over the wall time of the last step",
            m.compute_ratio.clone(),
        );
        registry.register("stoke_mfu", "Model FLOPs utilization of the last step", m.mfu.clone());
        registry.register("stoke_memory_peak_bytes", "Peak memory of the run so far", m.memory_peak.clone());
        registry.register(
            "stoke_gpu",
            "NVML's reading of a GPU: utilization and memory_utilization (0..1), memory_used_bytes, \
             memory_total_bytes, power_watts, temperature_celsius, sm_clock_mhz, memory_clock_mhz",
            m.gpu.clone(),
        );
        let phase_counters = Phase::ALL
            .iter()
            .map(|phase| m.phase_seconds.get_or_create(&vec![("phase".to_string(), phase.name().to_string())]).clone())
            .collect();
        LiveMetrics { registry, phase_counters, ..m }
    }

    /// Records one step. `flops_per_token` and `peak_flops` give the MFU gauge; `gemm_ms`, the
    /// step's matrix multiplies timed alone, the effective compute ratio's (else the compute phases'
    /// share stands in).
    pub fn observe(&self, sample: &StepSample, lr: f64, flops_per_token: f64, peak_flops: f64, gemm_ms: Option<f64>) {
        self.steps.inc();
        self.tokens.inc_by(sample.tokens);
        for (counter, (_, ms)) in self.phase_counters.iter().zip(sample.phases.iter()) {
            counter.inc_by(ms / 1e3);
        }
        self.comm_seconds.inc_by(sample.comm_total_ms / 1e3);
        self.step_seconds.set(sample.wall_ms / 1e3);
        if sample.loss.is_finite() {
            self.loss.set(sample.loss);
        }
        self.learning_rate.set(lr);
        let tokens_per_s = crate::stats::tokens_per_s(sample.tokens as f64, sample.wall_ms);
        self.tokens_per_second.set(tokens_per_s);
        self.job_tokens_per_second.set(tokens_per_s * self.world_size as f64);
        let compute = sample.phases.compute();
        let numerator = gemm_ms.unwrap_or(compute);
        self.compute_ratio.set(if sample.wall_ms > 0.0 { numerator / sample.wall_ms } else { 0.0 });
        self.mfu.set(if peak_flops > 0.0 { flops_per_token * tokens_per_s / peak_flops } else { 0.0 });
    }

    /// The latest NVML readings, one gauge per device and metric.
    pub fn set_gpus(&self, samples: &[crate::GpuSample]) {
        for s in samples {
            let values = [
                ("utilization", s.utilization),
                ("memory_utilization", s.memory_utilization),
                ("memory_used_bytes", s.memory_used_bytes as f64),
                ("memory_total_bytes", s.memory_total_bytes as f64),
                ("power_watts", s.power_w),
                ("temperature_celsius", s.temperature_c),
                ("sm_clock_mhz", s.sm_clock_mhz),
                ("memory_clock_mhz", s.memory_clock_mhz),
            ];
            for (metric, value) in values {
                let labels =
                    vec![("device".to_string(), s.index.to_string()), ("metric".to_string(), metric.to_string())];
                self.gpu.get_or_create(&labels).set(value);
            }
        }
    }

    pub fn set_memory_peak(&self, bytes: u64) {
        self.memory_peak.set(bytes as f64);
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Serves `GET /metrics` (stoke-http's server) until stopped or dropped.
pub struct MetricsServer {
    server: stoke_http::HttpServer,
}

impl MetricsServer {
    /// Binds `host:port` (port 0 picks a free one) and serves `metrics`.
    pub fn start(host: &str, port: u16, metrics: Arc<LiveMetrics>) -> std::io::Result<MetricsServer> {
        let server = stoke_http::HttpServer::start(host, port, stoke_http::ServerConfig::default(), move |request| {
            if request.method() == "GET" && request.path() == "/metrics" {
                stoke_http::Response::new(200, prometheus_text::CONTENT_TYPE, metrics.encode())
            } else {
                stoke_http::Response::new(404, "text/plain; charset=utf-8", "only /metrics is served here\n")
            }
        })
        .map_err(std::io::Error::other)?;
        Ok(MetricsServer { server })
    }

    /// The address it listens on (with the port the system picked when asked for 0).
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Stops serving; returns once the port is released (dropping it does the same).
    pub fn stop(self) {
        self.server.stop();
    }
}

/// Checks Prometheus text exposition format 0.0.4: `# HELP name text`, `# TYPE name type` with a
/// known type, and samples `name{label="value",...} number`, with metric and label names of the
/// allowed characters and every sample's family typed. Returns the number of samples.
pub fn validate_exposition(text: &str) -> Result<usize, crate::ProfError> {
    check_exposition(text).map_err(|reason| crate::ProfError::InvalidExposition { reason })
}

fn check_exposition(text: &str) -> Result<usize, String> {
    fn is_name(s: &str, colon: bool) -> bool {
        let mut chars = s.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
    }
    let mut typed = std::collections::BTreeSet::new();
    let mut samples = 0;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) if is_name(name, true) => {}
                (Some("TYPE"), Some(name), Some(kind)) if is_name(name, true) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        return Err(format!("line {n}: unknown type {kind:?}"));
                    }
                    typed.insert(name.to_string());
                }
                (Some("HELP" | "TYPE"), _, _) => return Err(format!("line {n}: malformed {line:?}")),
                _ => {}
            }
            continue;
        }
        let (name_labels, value) = match line.rfind('}') {
            Some(close) => (&line[..=close], line[close + 1..].trim()),
            None => line.split_once(' ').map(|(a, b)| (a, b.trim())).ok_or(format!("line {n}: no value"))?,
        };
        let (name, labels) = match name_labels.find('{') {
            Some(open) => (&name_labels[..open], Some(&name_labels[open + 1..name_labels.len() - 1])),
            None => (name_labels, None),
        };
        if !is_name(name, true) {
            return Err(format!("line {n}: bad metric name {name:?}"));
        }
        if let Some(labels) = labels.filter(|l| !l.is_empty()) {
            for pair in labels.split(',') {
                let (key, quoted) = pair.split_once('=').ok_or(format!("line {n}: bad label {pair:?}"))?;
                let is_quoted = quoted.len() >= 2 && quoted.starts_with('"') && quoted.ends_with('"');
                if !is_name(key, false) || !is_quoted {
                    return Err(format!("line {n}: bad label {pair:?}"));
                }
            }
        }
        let number = value.split_whitespace().next().unwrap_or("");
        let ok = number.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&number);
        if !ok {
            return Err(format!("line {n}: value {number:?} is not a number"));
        }
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix).filter(|base| typed.contains(*base)))
            .unwrap_or(name);
        if !typed.contains(family) && !typed.contains(name) {
            return Err(format!("line {n}: sample {name} has no # TYPE line"));
        }
        samples += 1;
    }
    Ok(samples)
}

/// Fetches `http://addr/metrics` with a plain HTTP/1.1 GET and returns the body (for tests and
/// `stoke doctor`'s self-check); any status but 200 is an error.
pub fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    match stoke_http::get(addr, "/metrics", Duration::from_secs(5)).map_err(std::io::Error::other)? {
        (200, body) => Ok(body),
        (status, _) => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("status: {status}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::step;

    #[test]
    fn a_scrape_over_loopback_is_valid_exposition_format() {
        let metrics = Arc::new(LiveMetrics::new());
        let server = MetricsServer::start("127.0.0.1", 0, Arc::clone(&metrics)).unwrap();
        for i in 1..=3 {
            metrics.observe(
                &step(i, &[(Phase::DataWait, 1.0), (Phase::Forward, 2.0), (Phase::Backward, 3.0)]),
                1e-3,
                6e5,
                1e12,
                Some(3.0),
            );
        }
        metrics.set_memory_peak(1 << 20);
        let body = scrape(server.addr()).unwrap();
        let samples = validate_exposition(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
        assert!(samples >= 9 + 10, "{body}");
        assert!(body.contains("stoke_steps_total{rank=\"0\",world=\"1\"} 3"), "{body}");
        assert!(body.contains("stoke_phase_seconds_total{rank=\"0\",world=\"1\",phase=\"backward\"} 0.009"), "{body}");
        drop(server);
        // A rank of a data-parallel run labels every series with its rank and the world size.
        let metrics = LiveMetrics::for_rank(2, 3);
        metrics.observe(&step(1, &[(Phase::Forward, 2.0)]), 1e-3, 6e5, 1e12, None);
        let body = metrics.encode();
        validate_exposition(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
        let samples: Vec<&str> = body.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).collect();
        assert!(samples.len() >= 9 + 10, "{body}");
        for sample in samples {
            assert!(sample.contains("rank=\"2\",world=\"3\""), "{sample}");
        }
    }

    #[test]
    fn the_grafana_dashboard_names_only_metrics_we_export() {
        let dashboard = include_str!("../../../dashboards/stoke-grafana.json");
        // A run on a GPU, which also exports NVML's readings.
        let metrics = LiveMetrics::new();
        metrics.set_gpus(&[crate::GpuSample {
            index: 0,
            name: "H200".into(),
            utilization: 0.9,
            memory_utilization: 0.4,
            memory_used_bytes: 1 << 30,
            memory_total_bytes: 141 << 30,
            power_w: 600.0,
            temperature_c: 60.0,
            sm_clock_mhz: 1980.0,
            memory_clock_mhz: 3201.0,
        }]);
        let exported = metrics.encode();
        let mut names: Vec<&str> = dashboard
            .match_indices("stoke_")
            .map(|(i, _)| {
                let rest = &dashboard[i..];
                &rest[..rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len())]
            })
            .filter(|name| name.len() > "stoke_".len())
            .collect();
        names.sort_unstable();
        names.dedup();
        assert!(names.len() >= 8, "{names:?}");
        for name in names {
            assert!(exported.contains(&format!("# TYPE {name} ")), "the dashboard plots {name}, which is not exported");
        }
    }

    #[test]
    fn the_validator_rejects_bad_lines() {
        for (text, expected) in [
            ("# TYPE a gauge\na{x=1} 3\n", "bad label"),
            ("# TYPE a gauge\na 3x\n", "not a number"),
            ("b 1\n", "no # TYPE"),
            ("# TYPE a widget\n", "unknown type"),
            ("# TYPE 1a gauge\n", "malformed"),
        ] {
            let err = validate_exposition(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }
}

//! `trace.json`: a Chrome trace (the Trace Event Format that Perfetto and chrome://tracing open)
//! with one span per step and one per phase per step, per rank: each rank is a process (`pid` = rank,
//! named "rank N") with a steps, a phases and a comm_total thread.
//!
//! The trainer reports a step's phases as sums (a step with several micro-batches alternates
//! data_wait, h2d, forward and backward), so phase spans are laid end to end in loop order inside
//! the step's span: their lengths are exact, their order within a step is canonical. Events are
//! streamed to the file as steps end, so memory stays flat however long the run.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::input::StepSample;

/// Thread ids inside a rank's process.
const TID_STEPS: u32 = 0;
const TID_PHASES: u32 = 1;
const TID_COMM: u32 = 2;

/// Streams a Chrome trace to a file.
pub struct ChromeTraceWriter {
    out: BufWriter<File>,
    rank: u32,
    /// No event written yet (the next one needs no comma).
    first: bool,
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

impl ChromeTraceWriter {
    /// Creates `path` and writes the header and the names of rank `rank`'s tracks.
    pub fn create(path: &Path, rank: u32) -> std::io::Result<ChromeTraceWriter> {
        // A large buffer: one write system call per few thousand steps, not per step.
        let out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        let mut writer = ChromeTraceWriter { out, rank, first: true };
        write!(writer.out, "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
        writer.add_rank(rank)?;
        Ok(writer)
    }

    /// Names the tracks of rank `rank` (its process, "rank N", with the steps, phases and
    /// comm_total threads), so that events written with `rank_step` show on their own rows.
    pub fn add_rank(&mut self, rank: u32) -> std::io::Result<()> {
        let meta = |name: &str, tid: u32, args: String| {
            format!("{{\"name\":{},\"ph\":\"M\",\"pid\":{rank},\"tid\":{tid},\"args\":{args}}}", json_str(name))
        };
        let named = |value: &str| format!("{{\"name\":{}}}", json_str(value));
        for event in [
            meta("process_name", 0, named(&format!("rank {rank}"))),
            // Perfetto orders processes by this index: rank order.
            meta("process_sort_index", 0, format!("{{\"sort_index\":{rank}}}")),
            meta("thread_name", TID_STEPS, named("steps")),
            meta("thread_name", TID_PHASES, named("phases")),
            meta("thread_name", TID_COMM, named("comm_total")),
        ] {
            self.event(&event)?;
        }
        Ok(())
    }

    fn event(&mut self, event: &str) -> std::io::Result<()> {
        let sep = if std::mem::take(&mut self.first) { "" } else { "," };
        write!(self.out, "{sep}\n{event}")
    }

    fn span(&mut self, pid: u32, name: &str, tid: u32, ts_us: f64, dur_us: f64, step: u64) -> std::io::Result<()> {
        let event = format!(
            "{{\"name\":{},\"cat\":\"stoke\",\"ph\":\"X\",\"ts\":{ts_us:.3},\"dur\":{dur_us:.3},\"pid\":{pid},\"tid\":{tid},\"args\":{{\"step\":{step}}}}}",
            json_str(name)
        );
        self.event(&event)
    }

    /// Writes a step of this writer's rank that started `start_us` microseconds after the run began.
    pub fn step(&mut self, start_us: f64, sample: &StepSample) -> std::io::Result<()> {
        self.rank_step(self.rank, start_us, sample)
    }

    /// Writes a step of rank `rank` (named first with `add_rank`) that started `start_us`
    /// microseconds after the run's common start: every rank measures from the moment it left the
    /// barrier before the first step, on its own monotonic clock.
    pub fn rank_step(&mut self, rank: u32, start_us: f64, sample: &StepSample) -> std::io::Result<()> {
        self.span(rank, &format!("step {}", sample.step), TID_STEPS, start_us, sample.wall_ms * 1e3, sample.step)?;
        let mut ts = start_us;
        for (phase, ms) in sample.phases.iter() {
            if ms > 0.0 {
                self.span(rank, phase.name(), TID_PHASES, ts, ms * 1e3, sample.step)?;
                ts += ms * 1e3;
            }
        }
        if sample.comm_total_ms > 0.0 {
            self.span(rank, "comm_total", TID_COMM, start_us, sample.comm_total_ms * 1e3, sample.step)?;
        }
        Ok(())
    }

    /// Closes the JSON and flushes. A trace that is never finished (a crash) still opens in
    /// Perfetto, which accepts a missing end.
    pub fn finish(mut self) -> std::io::Result<()> {
        write!(self.out, "\n]}}\n")?;
        self.out.flush()
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Checks that `text` is a Chrome trace in the object form: `traceEvents` is an array of events,
/// each with a string `name` and `ph`, integer `pid` and `tid`, and (except metadata) a numeric
/// `ts`; complete events (`X`) carry a non-negative `dur`. Returns the number of `X` events.
pub fn validate_chrome_trace(text: &str) -> Result<usize, crate::ProfError> {
    check_chrome_trace(text).map_err(|reason| crate::ProfError::InvalidChromeTrace { reason })
}

fn check_chrome_trace(text: &str) -> Result<usize, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let events = value.get("traceEvents").and_then(|v| v.as_array()).ok_or("no traceEvents array")?;
    let mut complete = 0;
    for (i, event) in events.iter().enumerate() {
        let field = |key: &str| event.get(key).ok_or_else(|| format!("event {i} has no {key}: {event}"));
        field("name")?.as_str().ok_or_else(|| format!("event {i}: name is not a string"))?;
        let ph = field("ph")?.as_str().ok_or_else(|| format!("event {i}: ph is not a string"))?;
        for key in ["pid", "tid"] {
            field(key)?.as_u64().ok_or_else(|| format!("event {i}: {key} is not an integer"))?;
        }
        if ph != "M" {
            field("ts")?.as_f64().ok_or_else(|| format!("event {i}: ts is not a number"))?;
        }
        if ph == "X" {
            let dur = field("dur")?.as_f64().ok_or_else(|| format!("event {i}: dur is not a number"))?;
            if dur < 0.0 {
                return Err(format!("event {i}: negative dur {dur}"));
            }
            complete += 1;
        }
    }
    Ok(complete)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::step;
    use crate::vocab::Phase;

    #[test]
    fn a_written_trace_is_valid_and_the_trace_analyzer_reads_it() {
        let dir = std::env::temp_dir().join(format!("stoke-chrome-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let mut writer = ChromeTraceWriter::create(&path, 0).unwrap();
        let mut start = 0.0;
        for i in 1..=3 {
            let mut s = step(
                i,
                &[(Phase::DataWait, 1.0), (Phase::Forward, 2.0), (Phase::Backward, 3.0), (Phase::Optimizer, 0.5)],
            );
            s.comm_total_ms = 1.5;
            writer.step(start, &s).unwrap();
            start += s.wall_ms * 1e3;
        }
        writer.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        // Per step: the step span, four phases and comm_total.
        assert_eq!(validate_chrome_trace(&text).unwrap(), 18);
        let loaded = crate::load_trace(&path).expect("the Kineto ingester parses it");
        assert_eq!(loaded.events.len(), 18);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_rank_gets_its_own_named_process() {
        let dir = std::env::temp_dir().join(format!("stoke-chrome-ranks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let mut writer = ChromeTraceWriter::create(&path, 0).unwrap();
        let s = step(1, &[(Phase::Forward, 2.0), (Phase::CommExposed, 1.0)]);
        writer.step(0.0, &s).unwrap();
        for rank in [1, 2] {
            writer.add_rank(rank).unwrap();
            writer.rank_step(rank, 10.0 * rank as f64, &s).unwrap();
        }
        writer.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        // Per rank: the step span and two phases.
        assert_eq!(validate_chrome_trace(&text).unwrap(), 9);
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let events = value["traceEvents"].as_array().unwrap();
        for rank in 0..3u64 {
            let name = events
                .iter()
                .find(|e| e["name"] == "process_name" && e["pid"] == rank)
                .map(|e| e["args"]["name"].as_str().unwrap().to_string());
            assert_eq!(name.as_deref(), Some(format!("rank {rank}").as_str()));
            let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X" && e["pid"] == rank).collect();
            let names: Vec<&str> = spans.iter().map(|e| e["name"].as_str().unwrap()).collect();
            assert_eq!(names, ["step 1", "forward", "comm_exposed"], "rank {rank}");
            assert_eq!(spans[0]["ts"].as_f64().unwrap(), 10.0 * rank as f64);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn invalid_traces_are_rejected() {
        for (text, expected) in [
            ("[", "not JSON"),
            ("{}", "no traceEvents"),
            (r#"{"traceEvents":[{"name":"a","ph":"X","ts":0,"pid":0,"tid":0}]}"#, "no dur"),
            (r#"{"traceEvents":[{"name":"a","ph":"X","ts":0,"dur":-1,"pid":0,"tid":0}]}"#, "negative dur"),
        ] {
            let err = validate_chrome_trace(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }
}

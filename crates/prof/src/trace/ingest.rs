//! Reading Chrome-trace JSON (`.json` or gzip, detected by content) into `RankTrace`s, streaming:
//! memory grows with the number of kept events, not with the file. Gzip is inflated on its own
//! thread so that inflating and parsing overlap; several files are read in parallel.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use super::error::{ScanError, TraceError};
use super::event::{DeviceInfo, Event, FxBuild, IngestStats, Interner, Kind, MemorySample, RankTrace};
use super::scan::{micros_to_nanos, parse_i64, parse_id, Result, Scanner};

/// Expands files and directories (their `*.json` and `*.json.gz` files, sorted by name) into a
/// list of trace files.
pub fn find_trace_files(inputs: &[PathBuf]) -> std::result::Result<Vec<PathBuf>, TraceError> {
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(|source| TraceError::Io { path: input.clone(), source })?;
        if meta.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(input)
                .map_err(|source| TraceError::Io { path: input.clone(), source })?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| {
                    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    p.is_file() && (name.ends_with(".json") || name.ends_with(".json.gz"))
                })
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(TraceError::NoTraces { path: input.clone() });
            }
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    Ok(files)
}

/// Reads several trace files in parallel (up to the number of CPUs) and assigns ranks: from
/// `distributedInfo`, else from a `rank<N>` / `rank-<N>` / `rank_<N>` in the file name, else the
/// lowest free rank in file order. Two files with the same rank are an error.
pub fn load_traces(files: &[PathBuf]) -> std::result::Result<Vec<RankTrace>, TraceError> {
    use rayon::prelude::*;
    let loaded: Vec<std::result::Result<RankTrace, TraceError>> = files.par_iter().map(|p| load_trace(p)).collect();
    // The first file's error in file order, as reading them one by one would report.
    let mut traces = loaded.into_iter().collect::<std::result::Result<Vec<RankTrace>, TraceError>>()?;
    let paths: Vec<PathBuf> = traces.iter().map(|t| t.path.clone()).collect();
    let mut slots: Vec<RankSlot<'_>> = traces
        .iter_mut()
        .zip(&paths)
        .map(|(t, path)| RankSlot { rank: &mut t.rank, source: &mut t.rank_source, path: path.as_path() })
        .collect();
    assign_ranks(&mut slots)?;
    traces.sort_by_key(|t| t.rank);
    Ok(traces)
}

/// A rank and where it came from, to be completed from the file name or the file order.
pub(crate) struct RankSlot<'a> {
    pub(crate) rank: &'a mut u32,
    pub(crate) source: &'a mut &'static str,
    pub(crate) path: &'a Path,
}

pub(crate) fn assign_ranks(slots: &mut [RankSlot<'_>]) -> std::result::Result<(), TraceError> {
    for slot in slots.iter_mut() {
        if *slot.source == "unknown" {
            if let Some(rank) = rank_from_file_name(slot.path) {
                *slot.rank = rank;
                *slot.source = "file name";
            }
        }
    }
    let mut taken: HashMap<u32, PathBuf> = HashMap::new();
    for slot in slots.iter().filter(|s| *s.source != "unknown") {
        if let Some(first) = taken.insert(*slot.rank, slot.path.to_path_buf()) {
            return Err(TraceError::DuplicateRank { rank: *slot.rank, first, second: slot.path.to_path_buf() });
        }
    }
    let mut candidate = 0u32;
    for slot in slots.iter_mut().filter(|s| *s.source == "unknown") {
        while taken.contains_key(&candidate) {
            candidate += 1;
        }
        *slot.rank = candidate;
        *slot.source = "file order";
        taken.insert(candidate, slot.path.to_path_buf());
    }
    Ok(())
}

/// `rank3`, `rank-3`, `rank_3` (any case) in the file name.
pub(crate) fn rank_from_file_name(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    let mut search = name.as_str();
    while let Some(at) = search.find("rank") {
        let rest = search[at + 4..].trim_start_matches(['-', '_', '.']);
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() {
            return digits.parse().ok();
        }
        search = &search[at + 4..];
    }
    None
}

/// Reads one trace file (plain or gzip JSON).
pub fn load_trace(path: &Path) -> std::result::Result<RankTrace, TraceError> {
    let io_err = |source| TraceError::Io { path: path.to_path_buf(), source };
    let mut file = File::open(path).map_err(io_err)?;
    let mut magic = [0u8; 2];
    let n_magic = read_up_to(&mut file, &mut magic).map_err(io_err)?;
    let head = std::io::Cursor::new(magic[..n_magic].to_vec());
    let trace = if n_magic == 2 && magic == [0x1f, 0x8b] {
        let reader = InflateThread::spawn(head.chain(file));
        parse_trace(path, reader)
    } else {
        parse_trace(path, head.chain(file))
    };
    trace.map_err(|e| e.with_path(path))
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Inflates gzip on a separate thread and hands over chunks through a bounded channel, so that
/// inflating and parsing run on two cores with bounded memory.
struct InflateThread {
    chunks: mpsc::Receiver<std::io::Result<Vec<u8>>>,
    current: Vec<u8>,
    pos: usize,
}

impl InflateThread {
    fn spawn<R: Read + Send + 'static>(src: R) -> InflateThread {
        let (tx, rx) = mpsc::sync_channel(4);
        std::thread::spawn(move || {
            let mut decoder = flate2::read::MultiGzDecoder::new(std::io::BufReader::with_capacity(1 << 16, src));
            loop {
                let mut chunk = vec![0u8; 1 << 20];
                let mut filled = 0;
                let result = loop {
                    match decoder.read(&mut chunk[filled..]) {
                        Ok(0) => break Ok(()),
                        Ok(n) => {
                            filled += n;
                            if filled == chunk.len() {
                                break Ok(());
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => break Err(e),
                    }
                };
                chunk.truncate(filled);
                let done = filled == 0 || result.is_err();
                if filled > 0 && tx.send(Ok(chunk)).is_err() {
                    return;
                }
                if let Err(e) = result {
                    let _ = tx.send(Err(e));
                    return;
                }
                if done {
                    return;
                }
            }
        });
        InflateThread { chunks: rx, current: Vec::new(), pos: 0 }
    }
}

impl Read for InflateThread {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pos >= self.current.len() {
            match self.chunks.recv() {
                Ok(Ok(chunk)) => {
                    self.current = chunk;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len() - self.pos);
        buf[..n].copy_from_slice(&self.current[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Parses a whole trace from a reader; `path` only names the trace in the result.
pub(crate) fn parse_trace<R: Read>(path: &Path, src: R) -> Result<RankTrace> {
    let mut parser = Parser::new(Scanner::new(src));
    let mut trace = RankTrace {
        rank: 0,
        rank_source: "unknown",
        path: path.to_path_buf(),
        world_size: None,
        base_time_ns: 0,
        devices: Vec::new(),
        names: Vec::new(),
        events: Vec::new(),
        memory: Vec::new(),
        stats: IngestStats::default(),
    };
    match parser.sc.peek_token_or_eof()? {
        Some(b'[') => parser.event_array(&mut trace)?,
        Some(b'{') => parser.top_object(&mut trace)?,
        Some(_) | None => {
            return Err(ScanError::Syntax { offset: 0, what: "not a Chrome trace: expected '{' or '['".into() })
        }
    }
    if let Some(b) = parser.sc.peek_token_or_eof()? {
        return Err(parser.sc.syntax(format!("unexpected {} after the end of the trace", super::scan::describe(b))));
    }
    trace.stats.bytes = parser.sc.offset();
    trace.names = std::mem::take(&mut parser.names.names);
    // Sort by start, longer first, so that parents precede their children.
    trace.events.sort_unstable_by(|a, b| a.ts.cmp(&b.ts).then(b.dur.cmp(&a.dur)));
    trace.memory.sort_unstable_by_key(|m| m.ts);
    Ok(trace)
}

struct Parser<R> {
    sc: Scanner<R>,
    names: Interner,
    threads: HashMap<(i64, i64), u32, FxBuild>,
    key: Vec<u8>,
    value: Vec<u8>,
    name: Vec<u8>,
    args_key: Vec<u8>,
    saw_events: bool,
}

/// The fields of one `traceEvents` entry that the analyses use.
#[derive(Default)]
struct Fields {
    ph: u8,
    kind: Option<Kind>,
    has_name: bool,
    pid: Option<i64>,
    tid: Option<i64>,
    ts: Option<i64>,
    dur: Option<i64>,
    correlation: u64,
    bytes: u64,
    stream: Option<i64>,
    device: Option<i64>,
    device_type: Option<i64>,
    total_allocated: Option<i64>,
    total_reserved: Option<i64>,
}

impl<R: Read> Parser<R> {
    fn new(sc: Scanner<R>) -> Self {
        Parser {
            sc,
            names: Interner::default(),
            threads: HashMap::default(),
            key: Vec::new(),
            value: Vec::new(),
            name: Vec::new(),
            args_key: Vec::new(),
            saw_events: false,
        }
    }

    fn top_object(&mut self, trace: &mut RankTrace) -> Result<()> {
        self.sc.expect(b'{', "the trace object")?;
        if self.sc.peek_token("the trace object")? == b'}' {
            self.sc.bump();
            return Err(self.sc.syntax("not a Chrome trace: the object has no \"traceEvents\""));
        }
        loop {
            self.sc.key(&mut self.key, "the trace object")?;
            match self.key.as_slice() {
                b"traceEvents" => self.event_array(trace)?,
                b"distributedInfo" => self.distributed_info(trace)?,
                b"deviceProperties" => self.device_properties(trace)?,
                b"baseTimeNanoseconds" => {
                    self.sc.number(&mut self.value, "baseTimeNanoseconds")?;
                    trace.base_time_ns = parse_i64(&self.value).ok_or_else(|| ScanError::OutOfRange {
                        offset: self.sc.offset(),
                        field: "baseTimeNanoseconds",
                        value: String::from_utf8_lossy(&self.value).into_owned(),
                    })?;
                }
                _ => self.sc.skip_value("the trace object")?,
            }
            if !self.sc.comma_or_close(b'}', "the trace object")? {
                break;
            }
        }
        if !self.saw_events {
            return Err(self.sc.syntax("not a Chrome trace: the object has no \"traceEvents\""));
        }
        Ok(())
    }

    fn distributed_info(&mut self, trace: &mut RankTrace) -> Result<()> {
        if self.sc.peek_token("distributedInfo")? != b'{' {
            return self.sc.skip_value("distributedInfo");
        }
        self.sc.bump();
        if self.sc.peek_token("distributedInfo")? == b'}' {
            self.sc.bump();
            return Ok(());
        }
        loop {
            self.sc.key(&mut self.key, "distributedInfo")?;
            let which = match self.key.as_slice() {
                b"rank" => 1,
                b"world_size" => 2,
                _ => 0,
            };
            if which == 0 {
                self.sc.skip_value("distributedInfo")?;
            } else if self.sc.scalar(&mut self.value, "distributedInfo")?.is_some() {
                let parsed = std::str::from_utf8(&self.value).ok().and_then(|s| s.trim().parse::<u32>().ok());
                match (which, parsed) {
                    (1, Some(rank)) => {
                        trace.rank = rank;
                        trace.rank_source = "distributedInfo";
                    }
                    (2, Some(size)) => trace.world_size = Some(size),
                    _ => {}
                }
            }
            if !self.sc.comma_or_close(b'}', "distributedInfo")? {
                return Ok(());
            }
        }
    }

    fn device_properties(&mut self, trace: &mut RankTrace) -> Result<()> {
        if self.sc.peek_token("deviceProperties")? != b'[' {
            return self.sc.skip_value("deviceProperties");
        }
        self.sc.bump();
        if self.sc.peek_token("deviceProperties")? == b']' {
            self.sc.bump();
            return Ok(());
        }
        loop {
            if self.sc.peek_token("deviceProperties")? == b'{' {
                self.sc.bump();
                let mut device = DeviceInfo::default();
                if self.sc.peek_token("deviceProperties")? == b'}' {
                    self.sc.bump();
                } else {
                    loop {
                        self.sc.key(&mut self.key, "deviceProperties")?;
                        let field = self.key.clone();
                        match self.sc.scalar(&mut self.value, "deviceProperties")? {
                            Some(true) if field == b"name" => {
                                device.name = String::from_utf8_lossy(&self.value).into_owned()
                            }
                            Some(_) => {
                                let v = parse_i64(&self.value);
                                match field.as_slice() {
                                    b"id" => device.id = v.unwrap_or(0),
                                    b"totalGlobalMem" => device.total_memory_bytes = v.unwrap_or(0).max(0) as u64,
                                    b"computeMajor" => device.compute_major = v.unwrap_or(0),
                                    b"computeMinor" => device.compute_minor = v.unwrap_or(0),
                                    _ => {}
                                }
                            }
                            None => {}
                        }
                        if !self.sc.comma_or_close(b'}', "deviceProperties")? {
                            break;
                        }
                    }
                }
                trace.devices.push(device);
            } else {
                self.sc.skip_value("deviceProperties")?;
            }
            if !self.sc.comma_or_close(b']', "deviceProperties")? {
                return Ok(());
            }
        }
    }

    fn event_array(&mut self, trace: &mut RankTrace) -> Result<()> {
        self.saw_events = true;
        self.sc.expect(b'[', "traceEvents")?;
        if self.sc.peek_token("traceEvents")? == b']' {
            self.sc.bump();
            return Ok(());
        }
        loop {
            trace.stats.n_entries += 1;
            if self.sc.peek_token("traceEvents")? == b'{' {
                self.event(trace)?;
            } else {
                // Not an object (a trailing `{}`-less entry written by a crashed writer): skip it.
                self.sc.skip_value("traceEvents")?;
                trace.stats.n_skipped += 1;
            }
            if !self.sc.comma_or_close(b']', "traceEvents")? {
                return Ok(());
            }
        }
    }

    fn event(&mut self, trace: &mut RankTrace) -> Result<()> {
        self.sc.bump();
        let mut f = Fields::default();
        if self.sc.peek_token("an event")? == b'}' {
            self.sc.bump();
            trace.stats.n_skipped += 1;
            return Ok(());
        }
        loop {
            self.sc.key(&mut self.key, "an event")?;
            match self.key.as_slice() {
                b"ph" => {
                    if self.sc.scalar(&mut self.value, "an event")?.is_some() {
                        f.ph = self.value.first().copied().unwrap_or(0);
                    }
                }
                b"cat" => {
                    if self.sc.scalar(&mut self.value, "an event")?.is_some() {
                        f.kind = Some(Kind::from_cat(&self.value));
                    }
                }
                b"name" => {
                    if self.sc.scalar(&mut self.name, "an event")?.is_some() {
                        f.has_name = true;
                    }
                }
                b"pid" => f.pid = self.id_field()?,
                b"tid" => f.tid = self.id_field()?,
                b"ts" => f.ts = self.time_field("ts")?,
                b"dur" => f.dur = self.time_field("dur")?,
                b"args" => self.args(&mut f)?,
                _ => self.sc.skip_value("an event")?,
            }
            if !self.sc.comma_or_close(b'}', "an event")? {
                break;
            }
        }
        self.keep(trace, f);
        Ok(())
    }

    fn keep(&mut self, trace: &mut RankTrace, f: Fields) {
        match f.ph {
            b'X' => {}
            b'i' | b'I' if f.has_name && self.name == b"[memory]" => {
                if let (Some(ts), Some(total_allocated)) = (f.ts, f.total_allocated) {
                    // Device Type 1 is CUDA (and ROCm through the CUDA API); 0 is the CPU.
                    let device = if f.device_type == Some(1) { f.device.unwrap_or(0) as i16 } else { -1 };
                    trace.memory.push(MemorySample {
                        ts,
                        device,
                        total_allocated,
                        total_reserved: f.total_reserved.unwrap_or(total_allocated),
                    });
                    return;
                }
                trace.stats.n_skipped += 1;
                return;
            }
            _ => {
                trace.stats.n_skipped += 1;
                return;
            }
        }
        let (Some(ts), Some(dur)) = (f.ts, f.dur) else {
            trace.stats.n_without_time += 1;
            return;
        };
        if dur < 0 {
            trace.stats.n_negative_duration += 1;
            return;
        }
        let kind = f.kind.unwrap_or(Kind::Other);
        let name = if f.has_name { self.names.intern(&self.name) } else { self.names.intern(b"") };
        let pid = f.pid.unwrap_or(-1);
        let tid = f.tid.unwrap_or(-1);
        let (stream, device, thread) =
            if matches!(kind, Kind::Kernel | Kind::Memcpy | Kind::Memset | Kind::Sync | Kind::GpuAnnotation) {
                // Kineto puts the device in pid and the stream in tid; newer traces also have args.
                (
                    f.stream.unwrap_or(tid).clamp(-1, i64::from(i32::MAX)) as i32,
                    f.device.unwrap_or(pid).clamp(-1, 4096) as i16,
                    0,
                )
            } else {
                let n = self.threads.len() as u32;
                (-1, -1, *self.threads.entry((pid, tid)).or_insert(n))
            };
        trace.events.push(Event {
            ts,
            dur,
            correlation: f.correlation,
            bytes: f.bytes,
            name,
            thread,
            stream,
            device,
            kind,
        });
        trace.stats.n_events += 1;
    }

    /// A pid or tid: a number, a numeric string, a string ending in digits (`"stream 7"`), or
    /// another string (hashed to a negative value so it cannot collide with real ids).
    fn id_field(&mut self) -> Result<Option<i64>> {
        Ok(match self.sc.scalar(&mut self.value, "an event")? {
            Some(false) => parse_i64(&self.value),
            Some(true) => {
                let text = &self.value;
                let digits_start = text.iter().rposition(|b| !b.is_ascii_digit()).map_or(0, |i| i + 1);
                if digits_start < text.len() && text.len() - digits_start <= 18 {
                    parse_i64(&text[digits_start..])
                } else {
                    let mut h = super::event::FxHasher::default();
                    std::hash::Hasher::write(&mut h, text);
                    Some(-((std::hash::Hasher::finish(&h) >> 2) as i64) - 2)
                }
            }
            None => None,
        })
    }

    fn time_field(&mut self, field: &'static str) -> Result<Option<i64>> {
        match self.sc.scalar(&mut self.value, "an event")? {
            Some(_) if self.value.is_empty() => Ok(None),
            Some(_) => match micros_to_nanos(&self.value) {
                Some(ns) => Ok(Some(ns)),
                None if self.value.iter().all(|b| b.is_ascii_digit() || b"+-.eE".contains(b)) => {
                    Err(ScanError::OutOfRange {
                        offset: self.sc.offset(),
                        field,
                        value: String::from_utf8_lossy(&self.value).chars().take(64).collect(),
                    })
                }
                // A string that is not a number: treat as absent.
                None => Ok(None),
            },
            None => Ok(None),
        }
    }

    fn args(&mut self, f: &mut Fields) -> Result<()> {
        if self.sc.peek_token("an event's args")? != b'{' {
            return self.sc.skip_value("an event's args");
        }
        self.sc.bump();
        if self.sc.peek_token("an event's args")? == b'}' {
            self.sc.bump();
            return Ok(());
        }
        loop {
            self.sc.key(&mut self.args_key, "an event's args")?;
            let slot: Option<u8> = match self.args_key.as_slice() {
                b"correlation" => Some(0),
                b"bytes" | b"Bytes" => Some(1),
                b"stream" => Some(2),
                b"device" | b"Device Id" => Some(3),
                b"Device Type" => Some(4),
                b"Total Allocated" => Some(5),
                b"Total Reserved" => Some(6),
                _ => None,
            };
            match slot {
                None => self.sc.skip_value("an event's args")?,
                Some(slot) => {
                    if self.sc.scalar(&mut self.value, "an event's args")?.is_some() {
                        let v = &self.value;
                        match slot {
                            0 => f.correlation = parse_id(v).unwrap_or(0),
                            1 => f.bytes = parse_id(v).unwrap_or(0),
                            2 => f.stream = parse_i64(v),
                            3 => f.device = parse_i64(v),
                            4 => f.device_type = parse_i64(v),
                            5 => f.total_allocated = parse_i64(v),
                            _ => f.total_reserved = parse_i64(v),
                        }
                    }
                }
            }
            if !self.sc.comma_or_close(b'}', "an event's args")? {
                return Ok(());
            }
        }
    }
}

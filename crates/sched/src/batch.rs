//! Jobs whose global batch the scheduler may choose, as Pollux models them: step times measured
//! per (workers, micro-batch), the global batches the job accepts, and its gradient noise scale
//! as training goes (a schedule over the fraction of its work done).
//!
//! A global batch `B` on `w` workers is `w` local batches of `B / w`; a local batch larger than
//! the job's largest micro-batch is split into `a + 1` micro-batches (gradient accumulation), and
//! a step then takes `step + a * (step - sync)`: the synchronisation is paid once. Statistical
//! efficiency is McCandlish et al.'s `(noise + b0) / (noise + B)` with `b0` the job's reference
//! batch (its work is counted in samples at that batch's efficiency).

/// One measured step: (workers, micro-batch, step_s, sync_s).
type Row = (usize, f64, f64, f64);

/// A schedule over the fraction of the work done: (from this fraction, the value), sorted.
pub type Schedule = Vec<(f64, f64)>;

/// Seconds of one step per (workers, micro-batch per worker): the whole step, and the part spent
/// synchronising gradients; on the fewest nodes the workers fit (packed), and optionally on more
/// nodes (spread), where synchronisation crosses more of the network.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTable {
    packed: Grid,
    /// (nodes, the steps of workers spread over that many nodes), sorted by nodes.
    spread: Vec<(usize, Grid)>,
}

/// Rows sorted by workers then micro-batch.
#[derive(Debug, Clone, PartialEq)]
struct Grid(Vec<Row>);

impl StepTable {
    /// Parses `WxM=STEP/SYNC;...` (workers x micro-batch = step seconds / sync seconds, packed)
    /// and `WxM@N=STEP/SYNC` (the same workers spread over N nodes).
    pub fn parse(text: &str) -> Result<StepTable, String> {
        let mut packed = Vec::new();
        let mut spread: std::collections::BTreeMap<usize, Vec<Row>> = Default::default();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || format!("step_table entry `{entry}`: expected WxM[@N]=STEP/SYNC with 0 <= SYNC < STEP");
            let (key, times) = entry.split_once('=').ok_or_else(bad)?;
            let (key, nodes) = match key.split_once('@') {
                Some((key, nodes)) => (key, Some(nodes.trim().parse::<usize>().map_err(|_| bad())?)),
                None => (key, None),
            };
            let (w, m) = key.split_once('x').ok_or_else(bad)?;
            let (step, sync) = times.split_once('/').ok_or_else(bad)?;
            let w: usize = w.trim().parse().map_err(|_| bad())?;
            let m: f64 = m.trim().parse().map_err(|_| bad())?;
            let (step, sync): (f64, f64) =
                (step.trim().parse().map_err(|_| bad())?, sync.trim().parse().map_err(|_| bad())?);
            let ok = (1..=crate::limits::MAX_WORKERS).contains(&w)
                && nodes.is_none_or(|n| (1..=w).contains(&n))
                && m.is_finite()
                && m >= 1.0
                && step.is_finite()
                && step > 0.0
                && step <= 1e6
                && sync.is_finite()
                && sync >= 0.0
                && sync < step;
            if !ok {
                return Err(bad());
            }
            match nodes {
                Some(n) => spread.entry(n).or_default().push((w, m, step, sync)),
                None => packed.push((w, m, step, sync)),
            }
        }
        if packed.is_empty() {
            return Err("step_table: no packed entry; expected WxM=STEP/SYNC;...".into());
        }
        let packed = Grid::new(packed)?;
        let spread = spread.into_iter().map(|(n, rows)| Ok((n, Grid::new(rows)?))).collect::<Result<_, String>>()?;
        Ok(StepTable { packed, spread })
    }

    pub fn to_text(&self) -> String {
        let row = |(w, m, s, y): &Row, at: String| format!("{w}x{m}{at}={s}/{y}");
        let packed = self.packed.0.iter().map(|r| row(r, String::new()));
        let spread = self.spread.iter().flat_map(|(n, g)| g.0.iter().map(move |r| row(r, format!("@{n}"))));
        packed.chain(spread).collect::<Vec<_>>().join(";")
    }

    /// The least micro-batch measured on every worker count (smaller ones are not modelled).
    pub fn micro_min(&self) -> f64 {
        self.packed.by_workers().map(|(_, rows)| rows[0].1).fold(0.0, f64::max)
    }

    /// The largest micro-batch measured.
    pub fn max_micro(&self) -> f64 {
        self.packed.0.iter().map(|r| r.1).fold(1.0, f64::max)
    }

    /// Whether it has steps measured on spread placements.
    pub fn knows_spread(&self) -> bool {
        !self.spread.is_empty()
    }

    /// (step_s, sync_s) of one micro-batch `micro` on `workers`, packed (`spread_over` None) or
    /// spread over that many nodes: the spread measurements of the nearest node count (the larger
    /// on a tie), the packed ones where none covers it. Linear between measured micro-batches,
    /// then between measured worker counts (the nearest one outside them); `None` outside the
    /// micro-batches measured.
    pub fn step(&self, workers: usize, micro: f64, spread_over: Option<usize>) -> Option<(f64, f64)> {
        let spread = spread_over.and_then(|n| {
            self.spread.iter().min_by_key(|(k, _)| (k.abs_diff(n), std::cmp::Reverse(*k))).map(|(_, grid)| grid)
        });
        spread.and_then(|grid| grid.step(workers, micro)).or_else(|| self.packed.step(workers, micro))
    }
}

impl Grid {
    fn new(mut rows: Vec<Row>) -> Result<Grid, String> {
        rows.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        if rows.windows(2).any(|p| p[0].0 == p[1].0 && p[0].1 == p[1].1) {
            return Err("step_table: one entry per (workers, micro-batch, nodes)".into());
        }
        Ok(Grid(rows))
    }

    fn by_workers(&self) -> impl Iterator<Item = (usize, &[Row])> {
        self.0.chunk_by(|a, b| a.0 == b.0).map(|rows| (rows[0].0, rows))
    }

    fn step(&self, workers: usize, micro: f64) -> Option<(f64, f64)> {
        let at = |rows: &[Row]| -> Option<(f64, f64)> {
            let first = rows[0];
            if micro < first.1 * (1.0 - 1e-9) {
                return None;
            }
            if rows.len() == 1 || micro <= first.1 {
                return (micro <= first.1 * (1.0 + 1e-9)).then_some((first.2, first.3));
            }
            let pair = rows.windows(2).find(|p| micro <= p[1].1 * (1.0 + 1e-9))?;
            let (a, b) = (pair[0], pair[1]);
            let f = ((micro - a.1) / (b.1 - a.1)).clamp(0.0, 1.0);
            Some((a.2 + f * (b.2 - a.2), a.3 + f * (b.3 - a.3)))
        };
        let groups: Vec<(usize, &[Row])> = self.by_workers().collect();
        let upper = groups.iter().position(|g| g.0 >= workers);
        match upper {
            None => at(groups[groups.len() - 1].1),
            Some(0) => at(groups[0].1),
            Some(i) if groups[i].0 == workers => at(groups[i].1),
            Some(i) => {
                let ((wa, ra), (wb, rb)) = (groups[i - 1], groups[i]);
                let (a, b) = (at(ra)?, at(rb)?);
                let f = (workers - wa) as f64 / (wb - wa) as f64;
                Some((a.0 + f * (b.0 - a.0), a.1 + f * (b.1 - a.1)))
            }
        }
    }
}

/// The value of a schedule `(fraction, value)` (sorted, the first at 0) at `fraction`.
fn at_fraction(schedule: &[(f64, f64)], fraction: f64) -> f64 {
    schedule.iter().rev().find(|e| e.0 <= fraction).map_or(schedule[0].1, |e| e.1)
}

/// Candidate global batches tried per worker count when the scheduler chooses the batch.
const BATCH_CANDIDATES: usize = 24;

/// A job whose batch may be chosen: its step table, the batches it accepts and asks for, its
/// largest micro-batch and its noise-scale schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchModel {
    pub table: StepTable,
    /// The global batch the job asks for (policies that do not choose batches run it).
    pub batch: f64,
    /// The global batches it accepts.
    pub batch_min: f64,
    pub batch_max: f64,
    /// The batch whose efficiency is 1: its work counts samples at this batch's efficiency.
    pub b0: f64,
    /// The largest micro-batch per worker; a larger local batch accumulates.
    pub micro_max: f64,
    /// (fraction of the work done, noise scale from there on), sorted, the first at 0.
    pub noise: Vec<(f64, f64)>,
    /// Where gradient statistics were measured at several batches: (batch, its schedule), sorted
    /// by batch; the noise scale at a batch between two is linear between theirs (outside them,
    /// the nearest). Empty: `noise` at every batch.
    pub noise_by_batch: Vec<(f64, Schedule)>,
}

impl BatchModel {
    /// Parses a noise schedule at several batches, `B@F=N;...` (at batch B, from fraction F of
    /// the work done, noise scale N): the schedules by batch, sorted.
    pub fn parse_noise_by_batch(text: &str) -> Result<Vec<(f64, Schedule)>, String> {
        let mut by_batch: Vec<(f64, String)> = Vec::new();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let (batch, rest) = entry
                .split_once('@')
                .ok_or_else(|| format!("noise_schedule entry `{entry}`: expected B@F=N in a schedule by batch"))?;
            let batch: f64 = batch
                .trim()
                .parse()
                .ok()
                .filter(|b: &f64| (1.0..=1e9).contains(b))
                .ok_or_else(|| format!("noise_schedule entry `{entry}`: batch `{batch}` needs 1 <= B <= 1e9"))?;
            match by_batch.iter_mut().find(|(b, _)| *b == batch) {
                Some((_, text)) => text.push_str(&format!(";{rest}")),
                None => by_batch.push((batch, rest.to_string())),
            }
        }
        let mut out = by_batch
            .into_iter()
            .map(|(b, text)| Ok((b, Self::parse_noise(&text)?)))
            .collect::<Result<Vec<_>, String>>()?;
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(out)
    }

    /// Parses a noise schedule `F=N;F=N;...` (from fraction F of the work done, noise scale N).
    pub fn parse_noise(text: &str) -> Result<Vec<(f64, f64)>, String> {
        let mut out = Vec::new();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || format!("noise_schedule entry `{entry}`: expected F=N with 0 <= F < 1 and 0 <= N <= 1e12");
            let (f, n) = entry.split_once('=').ok_or_else(bad)?;
            let (f, n): (f64, f64) = (f.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
            if !((0.0..1.0).contains(&f) && (0.0..=1e12).contains(&n)) {
                return Err(bad());
            }
            out.push((f, n));
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        if out.first().map(|e| e.0) != Some(0.0) {
            return Err("noise_schedule: needs an entry at fraction 0".into());
        }
        if out.windows(2).any(|p| p[0].0 == p[1].0) {
            return Err("noise_schedule: one entry per fraction".into());
        }
        Ok(out)
    }

    pub fn noise_text(&self) -> String {
        if !self.noise_by_batch.is_empty() {
            let entries =
                self.noise_by_batch.iter().flat_map(|(b, s)| s.iter().map(move |(f, n)| format!("{b}@{f}={n}")));
            return entries.collect::<Vec<_>>().join(";");
        }
        self.noise.iter().map(|(f, n)| format!("{f}={n}")).collect::<Vec<_>>().join(";")
    }

    /// Refuses batches out of order or that no worker count can run.
    pub fn check(&self) -> Result<(), String> {
        let (lo, hi) = (self.batch_min, self.batch_max);
        if !(lo.is_finite() && hi.is_finite() && 1.0 <= lo && lo <= self.batch && self.batch <= hi && hi <= 1e9) {
            return Err(format!("batch {} in {lo}-{hi}: needs 1 <= min <= batch <= max <= 1e9", self.batch));
        }
        if !(self.b0.is_finite() && (1.0..=1e9).contains(&self.b0)) {
            return Err(format!("b0 {}: needs 1 <= b0 <= 1e9", self.b0));
        }
        if !(self.micro_max.is_finite() && self.micro_max >= self.table.micro_min()) {
            return Err(format!(
                "micro_max {}: needs at least the least micro-batch measured on every worker count, {}",
                self.micro_max,
                self.table.micro_min()
            ));
        }
        if self.throughput(1, self.batch).is_none() {
            return Err(format!("batch {} on one worker is outside the step table's micro-batches", self.batch));
        }
        Ok(())
    }

    /// The noise scale once `fraction` of the work is done (at the asked batch's statistics
    /// where there is one schedule).
    pub fn noise_at(&self, fraction: f64) -> f64 {
        at_fraction(&self.noise, fraction)
    }

    /// The noise scale at `batch` once `fraction` of the work is done.
    pub fn noise_at_batch(&self, batch: f64, fraction: f64) -> f64 {
        let by = &self.noise_by_batch;
        match by.iter().position(|(b, _)| *b >= batch) {
            None if by.is_empty() => self.noise_at(fraction),
            None => at_fraction(&by[by.len() - 1].1, fraction),
            Some(0) => at_fraction(&by[0].1, fraction),
            Some(i) => {
                let ((ba, sa), (bb, sb)) = (&by[i - 1], &by[i]);
                let (na, nb) = (at_fraction(sa, fraction), at_fraction(sb, fraction));
                na + (nb - na) * (batch - ba) / (bb - ba)
            }
        }
    }

    /// The next fraction of the work at which the noise scale changes, after `fraction`.
    pub fn next_change(&self, fraction: f64) -> Option<f64> {
        let all = self.noise.iter().chain(self.noise_by_batch.iter().flat_map(|(_, s)| s.iter()));
        all.map(|e| e.0).filter(|&f| f > fraction).min_by(f64::total_cmp)
    }

    /// Samples per second of global batch `batch` on `workers`, packed; `None` when the local
    /// batch is below the micro-batches measured.
    pub fn throughput(&self, workers: usize, batch: f64) -> Option<f64> {
        self.throughput_placed(workers, batch, None)
    }

    /// The same, spread over `spread_over` nodes where that is given.
    pub fn throughput_placed(&self, workers: usize, batch: f64, spread_over: Option<usize>) -> Option<f64> {
        let local = batch / workers as f64;
        let accum = ((local / self.micro_max) - 1e-9).ceil().max(1.0) - 1.0;
        let micro = local / (accum + 1.0);
        let (step, sync) = self.table.step(workers, micro, spread_over)?;
        Some(batch / (step + accum * (step - sync)))
    }

    pub fn efficiency(&self, batch: f64, fraction: f64) -> f64 {
        let noise = self.noise_at_batch(batch, fraction);
        (noise + self.b0) / (noise + batch)
    }

    /// Useful samples per second of `batch` on `workers` (0 when it cannot run there), packed or
    /// spread over `spread_over` nodes.
    pub fn goodput(&self, workers: usize, batch: f64, fraction: f64, spread_over: Option<usize>) -> f64 {
        self.throughput_placed(workers, batch, spread_over).map_or(0.0, |t| t * self.efficiency(batch, fraction))
    }

    /// The most workers the asked batch spreads over (more would leave a local batch below the
    /// measured micro-batches): extra workers beyond it sit idle.
    pub fn workers_for_asked(&self, workers: usize) -> usize {
        let most = (self.batch / self.table.micro_min()).floor().max(1.0) as usize;
        workers.min(most)
    }

    /// The best goodput on `workers` (packed or spread) over the batches the job accepts, and
    /// that batch.
    pub fn best(&self, workers: usize, fraction: f64) -> (f64, f64) {
        self.best_placed(workers, fraction, None)
    }

    pub fn best_placed(&self, workers: usize, fraction: f64, spread_over: Option<usize>) -> (f64, f64) {
        let lo = self.batch_min.max(workers as f64 * self.table.micro_min());
        let hi = self.batch_max;
        if lo > hi {
            return (0.0, self.batch);
        }
        let mut best = (0.0, lo);
        let grid = (0..=BATCH_CANDIDATES).map(|k| lo * (hi / lo).powf(k as f64 / BATCH_CANDIDATES as f64));
        for batch in grid.chain([self.batch].into_iter().filter(|&b| (lo..=hi).contains(&b))) {
            let rate = self.goodput(workers, batch, fraction, spread_over);
            if rate > best.0 {
                best = (rate, batch);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> BatchModel {
        BatchModel {
            table: StepTable::parse("1x32=0.1/0;1x64=0.15/0;2x32=0.12/0.02;2x64=0.17/0.02;4x32=0.2/0.1;4x64=0.25/0.1")
                .unwrap(),
            batch: 64.0,
            batch_min: 32.0,
            b0: 32.0,
            batch_max: 512.0,
            micro_max: 64.0,
            noise: BatchModel::parse_noise("0=100;0.5=1000").unwrap(),
            noise_by_batch: Vec::new(),
        }
    }

    #[test]
    fn steps_interpolate_and_accumulate() {
        let m = model();
        assert_eq!(m.table.step(1, 48.0, None), Some((0.125, 0.0)));
        assert_eq!(m.table.step(1, 16.0, None), None);
        let (s, y) = m.table.step(3, 32.0, None).unwrap();
        assert!((s - 0.16).abs() < 1e-12 && (y - 0.06).abs() < 1e-12);
        // 256 on 2 workers: local 128, two micro-batches of 64: 0.17 + 0.15 s.
        assert!((m.throughput(2, 256.0).unwrap() - 256.0 / 0.32).abs() < 1e-9);
        assert!(m.check().is_ok());
    }

    #[test]
    fn the_best_batch_grows_as_the_noise_does() {
        let m = model();
        let (early, late) = (m.best(4, 0.0).1, m.best(4, 0.9).1);
        assert!(late > early, "{early} {late}");
        assert_eq!(m.noise_at(0.7), 1000.0);
        assert_eq!(m.next_change(0.1), Some(0.5));
        assert_eq!(m.workers_for_asked(8), 2);
        assert!(BatchModel::parse_noise("0.5=1").is_err());
        // Measured at 32 and 128: 64 lies between, a third of the way.
        let by = BatchModel::parse_noise_by_batch("32@0=100;128@0=400;32@0.5=1000;128@0.5=1000").unwrap();
        let m = BatchModel { noise_by_batch: by, ..m };
        assert!((m.noise_at_batch(64.0, 0.1) - 200.0).abs() < 1e-9);
        assert_eq!(m.noise_at_batch(1000.0, 0.1), 400.0);
        assert_eq!(m.noise_at_batch(64.0, 0.6), 1000.0);
        assert_eq!(BatchModel::parse_noise_by_batch(&m.noise_text()).unwrap(), m.noise_by_batch);
        assert!(StepTable::parse("1x32=0.1/0.2").is_err());
        // Spread over 2 nodes, 2 workers sync slower; 4 workers on 3 nodes read the nearest, 2.
        let t = StepTable::parse("2x32=0.12/0.02;2x32@2=0.2/0.1;4x32@2=0.3/0.2;4x32=0.2/0.1").unwrap();
        assert_eq!(t.step(2, 32.0, Some(2)), Some((0.2, 0.1)));
        assert_eq!(t.step(4, 32.0, Some(3)), Some((0.3, 0.2)));
        assert_eq!(t.step(4, 32.0, None), Some((0.2, 0.1)));
        assert_eq!(StepTable::parse(&t.to_text()).unwrap(), t);
    }
}

//! Parameters and their gradients as views of two flat fp32 buffers, laid out unit by unit.
//!
//! A model is a sequence of units (embedding, blocks, head). Every parameter is a leaf tensor that
//! shares storage with `flat`, and its gradient is a view of `flat_grad` at the same offset, so
//! libtorch's autograd accumulates every gradient straight into one persistent buffer: no
//! per-step concatenation, and a unit's gradients are one contiguous range (the communication
//! bucket of a later data-parallel step). The optimizer walks ranges of the same buffers; weight
//! decay is a property of each parameter's range, not of its place in the buffer.

use std::ops::Range;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal {
        std: f64,
    },
    /// U(-bound, bound): PEFT's LoRA A matrices (PyTorch's `kaiming_uniform_(a=sqrt(5))`, whose
    /// bound is 1/sqrt(fan_in)).
    Uniform {
        bound: f64,
    },
    Zeros,
    Ones,
}

/// One parameter's declaration.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
    pub decay: bool,
}

/// A unit's declaration: its name (for errors and reports) and its parameters, in order.
#[derive(Debug, Clone)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

/// One parameter's place in the flat buffers.
#[derive(Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: i64,
    pub numel: i64,
    pub decay: bool,
    /// The factor on the learning rate for this parameter (`train.lr_multipliers`; 1 unless set).
    pub lr_scale: f64,
    /// The unit this parameter belongs to (index into `FlatParams::units`).
    pub unit: usize,
    /// A leaf view of `flat` that requires grad; its `.grad` is a view of `flat_grad`. In a
    /// shard, the piece's values (a view of the model's buffer when the shard maps it).
    pub tensor: Tensor,
    /// Where the entry's elements are in the model's flat buffers: `offset` for the model's own
    /// entries; in a shard, the piece's place in the model.
    pub source: i64,
}

impl ParamEntry {
    pub fn range(&self) -> Range<i64> {
        self.offset..self.offset + self.numel
    }
}

/// A unit's contiguous range of the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitRange {
    pub name: String,
    pub range: Range<i64>,
    /// Its parameters, as indices into `FlatParams::entries`.
    pub entries: Range<usize>,
}

#[derive(Debug)]
pub struct FlatParams {
    flat: Tensor,
    flat_grad: Tensor,
    entries: Vec<ParamEntry>,
    units: Vec<UnitRange>,
    /// Pages behind `flat` / `flat_grad` that `release` can hand back to the kernel (ZeRO 2 and 3
    /// on a CPU); None: ordinary libtorch storage.
    released_params: Option<Arc<Pages>>,
    released_grads: Option<Arc<Pages>>,
    /// Elements (of a mapped shard too, whose own buffers are empty).
    len: i64,
    /// A shard that maps its parameters (gradients) to the model's buffer instead of holding
    /// them: entries' elements are at `source` there (`FlatParams::shard`).
    mapped_params: Option<Tensor>,
    mapped_grads: Option<Tensor>,
    /// Parameters `freeze` took out of training: no gradient, no optimizer state, no reduction,
    /// no checkpoint (their values are a function of the config: the seed's init or
    /// `model.from`). Their `offset` is into `frozen_flat`.
    frozen: Vec<ParamEntry>,
    /// The buffer the frozen parameters still live in (the model's first `flat`).
    frozen_flat: Option<Tensor>,
}

/// Which of a shard's buffers are the model's own memory (`FlatParams::shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardMap {
    pub params: bool,
    pub grads: bool,
}

/// Releases ranges of one flat buffer (`FlatParams::releaser`): zeroes them, and gives their whole
/// pages back to the kernel when the buffer is releasable.
#[derive(Debug)]
pub struct Releaser {
    pages: Option<Arc<Pages>>,
    tensor: Tensor,
}

impl Releaser {
    /// Sets `range` to zero and releases its whole pages. The caller guarantees nothing is reading
    /// or writing the range.
    pub fn release(&self, range: Range<i64>) {
        match &self.pages {
            Some(pages) => pages.release(range.start as usize * 4, range.end as usize * 4),
            None => tch::no_grad(|| {
                let _ = self.tensor.narrow(0, range.start, range.end - range.start).zero_();
            }),
        }
    }

    /// Faults `range`'s released pages back in, in one call (`MADV_POPULATE_WRITE`), before the
    /// range is filled: cheaper than a page fault per page as the writes arrive. Nothing where
    /// the buffer is not releasable or the kernel lacks it (before Linux 5.14).
    pub fn populate(&self, range: Range<i64>) {
        if let Some(pages) = &self.pages {
            pages.populate(range.start as usize * 4, range.end as usize * 4);
        }
    }

    /// The buffer's whole pages are given back by `release` (false: it only zeroes).
    pub fn releases_pages(&self) -> bool {
        self.pages.is_some()
    }
}

/// Which flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    Params,
    Grads,
}

/// An anonymous private mapping that backs a flat buffer whose parts are released and filled
/// again every step: `MADV_DONTNEED` gives a released range's whole pages back to the kernel (the
/// resident set shrinks) while every address stays valid, and the next write faults in zeroed
/// pages. libtorch tensors (views, autograd's saved tensors) keep pointing at the same memory, the
/// way PyTorch FSDP frees a gathered parameter's storage and gathers into it again before
/// backward. The mapping is never unmapped: a tensor that outlives the model would otherwise
/// point at nothing. Only its address space outlives it; the pages are released on drop.
#[derive(Debug)]
struct Pages {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: `Pages` is an address range; all access goes through tensors or `release`, which the
// owner (FlatParams, itself used from one thread at a time) sequences.
unsafe impl Send for Pages {}
// SAFETY: as above: `release` is the only method, and its callers guarantee nothing else touches
// the range it is given.
unsafe impl Sync for Pages {}

impl Pages {
    fn map(bytes: usize) -> std::io::Result<Pages> {
        let len = bytes.max(1);
        let huge = huge_pages();
        // One huge page more than asked, so the buffer can start on a huge-page boundary.
        let reserve = if huge { len + HUGE_PAGE } else { len };
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let mut ptr = base as *mut u8;
        if huge {
            let skip = (HUGE_PAGE - (base as usize) % HUGE_PAGE) % HUGE_PAGE;
            // SAFETY: `skip` < HUGE_PAGE, so `ptr..ptr + len` stays inside the reservation; the
            // advice concerns only our own fresh mapping (a kernel without transparent huge pages
            // answers EINVAL, and the buffer keeps small pages).
            unsafe {
                ptr = ptr.add(skip);
                libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
        Ok(Pages { ptr, bytes: len })
    }

    /// Faults in the pages that bytes `start..end` touch, as zeros where they were released.
    fn populate(&self, start: usize, end: usize) {
        debug_assert!(start <= end && end <= self.bytes);
        let page = page_size();
        let first = (start / page) * page;
        let last = end.div_ceil(page).saturating_mul(page).min(self.bytes.div_ceil(page) * page);
        if first < last {
            // SAFETY: the pages lie inside the mapping; populating writes nothing the program can
            // see (a present page is left as it is, a released one becomes a zero page, which is
            // what the next access would fault in anyway). An old kernel answers EINVAL: ignored.
            unsafe {
                libc::madvise(self.ptr.add(first) as *mut libc::c_void, last - first, libc::MADV_POPULATE_WRITE);
            }
        }
    }

    /// Zeroes bytes `start..end` and gives the whole pages among them back to the kernel.
    fn release(&self, start: usize, end: usize) {
        debug_assert!(start <= end && end <= self.bytes);
        let page = page_size();
        let first = start.div_ceil(page) * page;
        let last = (end / page) * page;
        // SAFETY: both ranges lie inside the mapping (checked above); the caller guarantees that
        // no libtorch kernel reads or writes them now.
        unsafe {
            if first < last {
                std::ptr::write_bytes(self.ptr.add(start), 0, first - start);
                std::ptr::write_bytes(self.ptr.add(last), 0, end - last);
                libc::madvise(self.ptr.add(first) as *mut libc::c_void, last - first, libc::MADV_DONTNEED);
            } else {
                std::ptr::write_bytes(self.ptr.add(start), 0, end - start);
            }
        }
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: the whole mapping is ours; tensors that may still point into it read zeros.
        unsafe {
            libc::madvise(self.ptr as *mut libc::c_void, self.bytes, libc::MADV_DONTNEED);
        }
    }
}

/// The x86-64 (and common arm64) transparent huge page: 2 MiB.
const HUGE_PAGE: usize = 2 << 20;

/// Whether released buffers ask for transparent huge pages (`MADV_HUGEPAGE`): yes, unless
/// `STOKE_HUGEPAGES=0`. A unit's gather at ZeRO stage 3 and its gradient at stages 2 and 3 fault
/// their released memory in again every step; in 2 MiB pages that is 512 times fewer faults,
/// memory-cgroup charges and LRU insertions than in 4 KiB ones (measured: a stage-3 step of a
/// 38 M-parameter model on 2 processes, 822 ms with small pages, 700 ms with huge ones). Releases
/// stay at small-page granularity, so a unit's edges are kept exactly as before and the resident
/// set follows the same formula (the kernel splits a huge page that is released in part).
fn huge_pages() -> bool {
    std::env::var("STOKE_HUGEPAGES").map_or(true, |v| v != "0")
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

impl FlatParams {
    /// Lays the parameters out unit by unit, in declaration order, initializes them from
    /// libtorch's RNG (which the caller seeds), and binds each parameter's gradient to its view of
    /// the flat gradient buffer.
    pub fn new(units: Vec<UnitSpec>, device: Device) -> FlatParams {
        let total: i64 = units.iter().flat_map(|u| &u.params).map(|s| s.shape.iter().product::<i64>()).sum();
        let flat = Tensor::zeros([total], (Kind::Float, device));
        let flat_grad = Tensor::zeros([total], (Kind::Float, device));
        let mut entries = Vec::new();
        let mut unit_ranges = Vec::with_capacity(units.len());
        let mut offset = 0i64;
        for (unit_idx, unit) in units.into_iter().enumerate() {
            let (first_offset, first_entry) = (offset, entries.len());
            for spec in unit.params {
                let numel: i64 = spec.shape.iter().product();
                let mut view = flat.narrow(0, offset, numel).view(spec.shape.as_slice());
                tch::no_grad(|| match spec.init {
                    Init::Normal { std } => {
                        let _ = view.normal_(0.0, std);
                    }
                    Init::Uniform { bound } => {
                        let _ = view.uniform_(-bound, bound);
                    }
                    Init::Zeros => {
                        let _ = view.zero_();
                    }
                    Init::Ones => {
                        let _ = view.fill_(1.0);
                    }
                });
                // A leaf of its own whose data is the view, rather than the view itself: a view's
                // autograd record keeps its base (the whole buffer) alive, which would keep a
                // buffer `make_releasable` replaced.
                let mut tensor = Tensor::empty([0], (Kind::Float, device)).set_requires_grad(true);
                tensor.set_data(&view.detach());
                entries.push(ParamEntry {
                    name: spec.name,
                    shape: spec.shape,
                    offset,
                    numel,
                    decay: spec.decay,
                    lr_scale: 1.0,
                    unit: unit_idx,
                    tensor,
                    source: offset,
                });
                offset += numel;
            }
            unit_ranges.push(UnitRange {
                name: unit.name,
                range: first_offset..offset,
                entries: first_entry..entries.len(),
            });
        }
        let params = FlatParams {
            flat,
            flat_grad,
            entries,
            units: unit_ranges,
            released_params: None,
            released_grads: None,
            len: total,
            mapped_params: None,
            mapped_grads: None,
            frozen: Vec::new(),
            frozen_flat: None,
        };
        params.bind_grads();
        params
    }

    /// Takes the parameters `frozen` names out of training (`train.freeze`, a LoRA's base): they
    /// stop requiring gradients and stay where they are, in the old buffer, while the others move
    /// to new flat buffers, laid out unit by unit as before (a unit may end up empty). So the
    /// optimizer, data-parallel reductions, ZeRO and checkpoints, which walk the flat buffers,
    /// never see a frozen parameter. Handles to a parameter taken before keep working (the
    /// parameter's data is rebound in place). Returns the number of parameters frozen.
    pub fn freeze(&mut self, frozen: &dyn Fn(&str) -> bool) -> usize {
        assert!(
            self.mapped_params.is_none() && self.released_params.is_none() && self.frozen_flat.is_none(),
            "freeze a model's own buffers, once, before sharding them"
        );
        let (frozen, kept): (Vec<ParamEntry>, Vec<ParamEntry>) =
            std::mem::take(&mut self.entries).into_iter().partition(|e| frozen(&e.name));
        let n_frozen = frozen.len();
        let total: i64 = kept.iter().map(|e| e.numel).sum();
        let device = self.flat.device();
        let flat = Tensor::zeros([total], (Kind::Float, device));
        let flat_grad = Tensor::zeros([total], (Kind::Float, device));
        let mut offset = 0i64;
        let mut units = Vec::with_capacity(self.units.len());
        let mut kept = kept.into_iter().peekable();
        for (unit_idx, unit) in self.units.iter().enumerate() {
            let (first_offset, first_entry) = (offset, self.entries.len());
            while let Some(mut entry) = kept.next_if(|e| e.unit == unit_idx) {
                let view = flat.narrow(0, offset, entry.numel).view(entry.shape.as_slice());
                tch::no_grad(|| view.shallow_clone().copy_(&entry.tensor));
                entry.tensor.set_data(&view.detach());
                (entry.offset, entry.source) = (offset, offset);
                offset += entry.numel;
                self.entries.push(entry);
            }
            units.push(UnitRange {
                name: unit.name.clone(),
                range: first_offset..offset,
                entries: first_entry..self.entries.len(),
            });
        }
        for entry in &frozen {
            let _ = entry.tensor.set_requires_grad(false);
            // Its gradient was a view of the old gradient buffer, which would stay alive for it.
            let mut grad = entry.tensor.grad();
            if grad.defined() {
                grad.set_data(&Tensor::zeros([0], (Kind::Float, device)));
            }
        }
        self.frozen_flat = Some(std::mem::replace(&mut self.flat, flat));
        self.flat_grad = flat_grad;
        self.units = units;
        self.len = total;
        self.frozen = frozen;
        self.bind_grads();
        n_frozen
    }

    /// Sets each trained parameter's factor on the learning rate to `scale(name)` (call before
    /// sharding: a shard's pieces take their parameter's factor).
    pub fn set_lr_scales(&mut self, scale: &dyn Fn(&str) -> f64) {
        for entry in &mut self.entries {
            entry.lr_scale = scale(&entry.name);
        }
    }

    /// The parameters `freeze` took out of training (offsets into their own buffer).
    pub fn frozen_entries(&self) -> &[ParamEntry] {
        &self.frozen
    }

    /// Moves `buffer` into memory whose ranges `release` can give back to the kernel (a CPU only;
    /// elsewhere nothing changes and `release` only zeroes). Every parameter, or its gradient, is
    /// rebound to the same offset of the new buffer; the values are kept.
    pub fn make_releasable(&mut self, buffer: Buffer) -> std::io::Result<()> {
        if self.flat.device() != Device::Cpu {
            return Ok(());
        }
        let already = match buffer {
            Buffer::Params => self.released_params.is_some(),
            Buffer::Grads => self.released_grads.is_some(),
        };
        if already {
            return Ok(());
        }
        let n = self.n_elements();
        let pages = Pages::map(n as usize * 4)?;
        // SAFETY: the mapping holds n f32 and is never unmapped (see `Pages`), so the tensor's
        // memory stays valid for as long as any tensor may point into it.
        let fresh = unsafe { Tensor::from_blob(pages.ptr, &[n], &[1], Kind::Float, Device::Cpu) };
        tch::no_grad(|| {
            let old = match buffer {
                Buffer::Params => &self.flat,
                Buffer::Grads => &self.flat_grad,
            };
            fresh.shallow_clone().copy_(old);
        });
        for entry in &mut self.entries {
            let view = fresh.narrow(0, entry.offset, entry.numel).view(entry.shape.as_slice());
            match buffer {
                Buffer::Params => entry.tensor.set_data(&view),
                Buffer::Grads => {
                    let mut grad = entry.tensor.grad();
                    grad.set_data(&view);
                }
            }
        }
        match buffer {
            Buffer::Params => {
                self.flat = fresh;
                self.released_params = Some(Arc::new(pages));
            }
            Buffer::Grads => {
                self.flat_grad = fresh;
                self.released_grads = Some(Arc::new(pages));
                debug_assert!(self.grads_are_bound());
            }
        }
        Ok(())
    }

    /// What releases ranges of `buffer` (see `make_releasable`).
    pub fn releaser(&self, buffer: Buffer) -> Releaser {
        match buffer {
            Buffer::Params => Releaser { pages: self.released_params.clone(), tensor: self.flat.shallow_clone() },
            Buffer::Grads => Releaser { pages: self.released_grads.clone(), tensor: self.flat_grad.shallow_clone() },
        }
    }

    /// A shard of these parameters: `segments` (ranges of this buffer, in order) one after the
    /// other, with one entry per part of a parameter inside a segment (named like the parameter,
    /// 1-D, not a leaf) and one unit per segment (named like the unit the segment lies in). The
    /// optimizer of a ZeRO rank runs on it. Its parameters (gradients) are new buffers, values
    /// copied (gradients zero), or with `map.params` (`map.grads`) this model's own memory at
    /// each entry's `source`; only the fused CPU kernel updates a mapped shard.
    pub fn shard(&self, segments: &[Range<i64>], map: ShardMap) -> FlatParams {
        let total: i64 = segments.iter().map(|s| s.end - s.start).sum();
        let device = self.flat.device();
        let own = |mapped: bool| Tensor::zeros([if mapped { 0 } else { total }], (Kind::Float, device));
        let (flat, flat_grad) = (own(map.params), own(map.grads));
        let mut entries = Vec::new();
        let mut units = Vec::with_capacity(segments.len());
        let mut local = 0i64;
        for segment in segments {
            let first_entry = entries.len();
            let unit = self.units.iter().position(|u| u.range.start <= segment.start && segment.end <= u.range.end);
            for entry in &self.entries {
                let (lo, hi) = (entry.offset.max(segment.start), (entry.offset + entry.numel).min(segment.end));
                if lo >= hi {
                    continue;
                }
                let offset = local + (lo - segment.start);
                let tensor =
                    if map.params { self.flat.narrow(0, lo, hi - lo) } else { flat.narrow(0, offset, hi - lo) };
                entries.push(ParamEntry {
                    name: entry.name.clone(),
                    shape: vec![hi - lo],
                    offset,
                    numel: hi - lo,
                    decay: entry.decay,
                    lr_scale: entry.lr_scale,
                    unit: units.len(),
                    tensor,
                    source: lo,
                });
            }
            let len = segment.end - segment.start;
            if !map.params {
                tch::no_grad(|| {
                    flat.narrow(0, local, len).copy_(&self.flat.narrow(0, segment.start, len));
                });
            }
            units.push(UnitRange {
                name: unit.map_or_else(|| "segment".to_string(), |u| self.units[u].name.clone()),
                range: local..local + len,
                entries: first_entry..entries.len(),
            });
            local += len;
        }
        FlatParams {
            flat,
            flat_grad,
            entries,
            units,
            released_params: None,
            released_grads: None,
            len: total,
            mapped_params: map.params.then(|| self.flat.shallow_clone()),
            mapped_grads: map.grads.then(|| self.flat_grad.shallow_clone()),
            frozen: Vec::new(),
            frozen_flat: None,
        }
    }

    /// The buffer the parameters' elements live in, and whether it is a model's (a mapped shard:
    /// elements at each entry's `source`) rather than `flat` (at `offset`).
    pub fn param_memory(&self) -> (&Tensor, bool) {
        match &self.mapped_params {
            Some(t) => (t, true),
            None => (&self.flat, false),
        }
    }

    /// As `param_memory`, for the gradients.
    pub fn grad_memory(&self) -> (&Tensor, bool) {
        match &self.mapped_grads {
            Some(t) => (t, true),
            None => (&self.flat_grad, false),
        }
    }

    /// The device the buffers are on.
    pub fn device(&self) -> Device {
        self.param_memory().0.device()
    }

    /// Makes every parameter's `.grad` a view of `flat_grad`. Autograd then accumulates into it
    /// in place (it adds to a defined gradient rather than replacing it), so the flat buffer is
    /// the only copy of the gradients.
    fn bind_grads(&self) {
        // A zero-weighted use of every parameter gives each one a defined `.grad` to rebind.
        let touch = self.entries.iter().fold(Tensor::zeros([], (Kind::Float, self.flat.device())), |acc, e| {
            acc + e.tensor.view([-1]).narrow(0, 0, 1).sum(Kind::Float) * 0.0
        });
        touch.backward();
        for entry in &self.entries {
            let mut grad = entry.tensor.grad();
            grad.set_data(&self.flat_grad.narrow(0, entry.offset, entry.numel).view(entry.shape.as_slice()));
        }
        tch::no_grad(|| {
            let _ = self.flat_grad.shallow_clone().zero_();
        });
        // Invariant: each gradient shares storage with `flat_grad` at its own offset.
        debug_assert!(self.grads_are_bound());
    }

    /// True when every parameter's gradient still lives in `flat_grad` at its offset.
    pub fn grads_are_bound(&self) -> bool {
        let base = self.flat_grad.data_ptr() as usize;
        self.entries.iter().all(|e| {
            let grad = e.tensor.grad();
            grad.defined() && grad.data_ptr() as usize == base + 4 * e.offset as usize
        })
    }

    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// The gradients of every parameter, laid out like `flat`.
    pub fn flat_grad(&self) -> &Tensor {
        &self.flat_grad
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn units(&self) -> &[UnitRange] {
        &self.units
    }

    pub fn n_elements(&self) -> i64 {
        self.len
    }

    /// The parameter called `name`: resolved once when a model is built, not on every use.
    pub fn get(&self, name: &str) -> &Tensor {
        match self.entries.iter().chain(&self.frozen).find(|e| e.name == name) {
            Some(entry) => &entry.tensor,
            None => panic!("model asked for parameter {name:?}, which it never declared"),
        }
    }

    /// Sets every gradient to zero (in place, so they stay bound to `flat_grad`; a shard that
    /// maps its gradients zeroes its pieces of the model's).
    pub fn zero_grad(&self) {
        tch::no_grad(|| match &self.mapped_grads {
            Some(model) => {
                for e in &self.entries {
                    let _ = model.narrow(0, e.source, e.numel).zero_();
                }
            }
            None => {
                let _ = self.flat_grad.shallow_clone().zero_();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: Vec<i64>, decay: bool) -> ParamSpec {
        ParamSpec { name: name.into(), shape, init: Init::Normal { std: 0.1 }, decay }
    }

    #[test]
    fn gradients_accumulate_into_the_flat_buffer() {
        let params = FlatParams::new(
            vec![
                UnitSpec { name: "a".into(), params: vec![spec("w", vec![3, 2], true), spec("b", vec![2], false)] },
                UnitSpec { name: "c".into(), params: vec![spec("v", vec![4], true)] },
            ],
            Device::Cpu,
        );
        assert!(params.grads_are_bound());
        assert_eq!(params.units()[1].range, 8..12);
        for _ in 0..2 {
            let loss = params.get("w").sum(Kind::Float) * 2.0 + params.get("v").square().sum(Kind::Float);
            loss.backward();
        }
        assert!(params.grads_are_bound(), "backward replaced a bound gradient");
        let grad = Vec::<f32>::try_from(params.flat_grad()).unwrap();
        assert!(grad[..6].iter().all(|&g| g == 4.0), "{grad:?}");
        assert!(grad[6..8].iter().all(|&g| g == 0.0), "{grad:?}");
        let v = Vec::<f32>::try_from(params.get("v").detach()).unwrap();
        for (g, v) in grad[8..].iter().zip(v) {
            assert!((g - 4.0 * v).abs() < 1e-6);
        }
        params.zero_grad();
        assert!(params.grads_are_bound());
        assert_eq!(params.flat_grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    }

    /// Frozen parameters keep their values and handles, get no gradient, and leave the flat
    /// buffers; the others keep theirs, bound to the new buffers, unit by unit.
    #[test]
    fn freezing_moves_the_frozen_out_of_the_flat_buffers() {
        let mut params = FlatParams::new(
            vec![
                UnitSpec { name: "a".into(), params: vec![spec("w", vec![3, 2], true), spec("b", vec![2], false)] },
                UnitSpec { name: "c".into(), params: vec![spec("v", vec![4], true)] },
            ],
            Device::Cpu,
        );
        let handle = params.get("w").shallow_clone();
        let (w, v) = (handle.detach().copy(), params.get("v").detach().copy());
        assert_eq!(params.freeze(&|name| name == "w"), 1);
        assert_eq!(params.n_elements(), 6);
        assert_eq!(params.units()[0].range, 0..2);
        assert_eq!(params.units()[1].range, 2..6);
        assert!(params.grads_are_bound());
        assert!(!handle.requires_grad() && handle.equal(&w), "the old handle still reads the frozen values");
        assert!(params.get("v").equal(&v));
        assert_eq!(params.frozen_entries().len(), 1);
        let loss = (params.get("w").sum(Kind::Float) + params.get("v").sum(Kind::Float)) * 2.0;
        loss.backward();
        let grad = Vec::<f32>::try_from(params.flat_grad()).unwrap();
        assert_eq!(grad, [0.0, 0.0, 2.0, 2.0, 2.0, 2.0]);
    }
}

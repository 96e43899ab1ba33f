//! Frame augmentation at training time: a random resized crop (torchvision's RandomResizedCrop:
//! an area fraction and an aspect ratio drawn, the crop resized to the output side) and colour
//! jitter (brightness, contrast, saturation factors around 1). No flips: mirroring a scene changes
//! what an action means. Every draw comes from the generator it is given, so a sample's
//! augmentation is a pure function of (seed, epoch, sample, camera).
//!
//! Applying a draw runs on the loader's worker threads for every frame, so it is written for the
//! compiler to vectorize, in 16-bit fixed point (`pmulhw` multiplies 16 lanes at once): the resize
//! is separable (each source row the output needs is interpolated across once, output rows blend
//! two of those), with 15-bit weights and 6 fractional bits kept between the passes, and the
//! colour jitter is one affine map per byte over whole rows. Buffers live per thread. The same code
//! is compiled twice, for AVX2 (picked at run time; the column gather then shuffles bytes with
//! `pshufb`) and for the baseline instruction set. Integer arithmetic rounds alike however it is
//! vectorized, so a draw gives the same bytes on every machine.

use std::cell::RefCell;
use std::ops::Deref;

use image::{ImageBuffer, Rgb};

use crate::rng::SplitMix64;

/// What to draw from. Plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct AugmentConfig {
    /// Smallest and largest fraction of the frame's area a crop covers. Default (0.8, 1.0).
    pub crop_area: (f64, f64),
    /// Smallest and largest aspect ratio (width / height) of a crop. Default (3/4, 4/3).
    pub crop_ratio: (f64, f64),
    /// Largest change of brightness, contrast and saturation, as a fraction, at most 1 (factors
    /// within [0, 2]). Default 0.2.
    pub jitter: f64,
}

impl Default for AugmentConfig {
    fn default() -> AugmentConfig {
        AugmentConfig { crop_area: (0.8, 1.0), crop_ratio: (0.75, 4.0 / 3.0), jitter: 0.2 }
    }
}

/// One draw of the augmentation, applied alike to every frame of one sample and camera (the
/// history frames must move together).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// Crop (x, y, width, height) as fractions of the frame.
    crop: [f64; 4],
    brightness: f32,
    contrast: f32,
    saturation: f32,
}

fn uniform(rng: &mut SplitMix64, low: f64, high: f64) -> f64 {
    low + (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * (high - low)
}

/// ITU-R BT.601 luma weights (torchvision's `rgb_to_grayscale`).
const GREY: [f64; 3] = [0.299, 0.587, 0.114];

impl Draw {
    /// No augmentation: the whole frame, colours as they are (evaluation).
    pub const IDENTITY: Draw = Draw { crop: [0.0, 0.0, 1.0, 1.0], brightness: 1.0, contrast: 1.0, saturation: 1.0 };

    pub fn new(config: &AugmentConfig, rng: &mut SplitMix64) -> Draw {
        let area = uniform(rng, config.crop_area.0, config.crop_area.1);
        let log_ratio = uniform(rng, config.crop_ratio.0.ln(), config.crop_ratio.1.ln());
        let ratio = log_ratio.exp();
        let (w, h) = ((area * ratio).sqrt().min(1.0), (area / ratio).sqrt().min(1.0));
        let (x, y) = (uniform(rng, 0.0, 1.0 - w), uniform(rng, 0.0, 1.0 - h));
        let mut factor = || uniform(rng, 1.0 - config.jitter, 1.0 + config.jitter) as f32;
        Draw { crop: [x, y, w, h], brightness: factor(), contrast: factor(), saturation: factor() }
    }

    /// `frame` cropped, resized to `side` x `side` (bilinear, pixel centres aligned as
    /// torchvision's `antialias=False` resize) and jittered, as HWC uint8 appended to `out`. The
    /// three colour adjustments are one linear map per pixel (brightness, then contrast toward the
    /// crop's mean grey, then saturation toward each pixel's grey, torchvision's order), clamped
    /// once at the end. Values are within one level of the same computed exactly (the tests hold
    /// an `f64` reference). The identity colours leave a plain resize, and a same-size identity
    /// crop a copy.
    /// The frame may borrow its pixels (a decoded frame straight from a memory-mapped shard).
    pub fn apply<C: Deref<Target = [u8]>>(&self, frame: &ImageBuffer<Rgb<u8>, C>, side: u32, out: &mut Vec<u8>) {
        let window = self.window(frame.width(), frame.height());
        let source = Source { raw: frame.as_raw(), stride: frame.width() as usize * 3 };
        let jitter = Jitter::of(self);
        out.reserve((side as usize).pow(2) * 3);
        if side == 0 {
            return;
        }
        if jitter.is_none() && (window[2], window[3]) == (side, side) {
            source.copy_window(window, out);
            return;
        }
        SCRATCH.with_borrow_mut(|scratch| resize_and_jitter(scratch, &source, window, side, jitter.as_ref(), out));
    }

    /// The crop in pixels of a `width` x `height` frame: `[x, y, w, h]`, at least one pixel.
    fn window(&self, width: u32, height: u32) -> [u32; 4] {
        let (fw, fh) = (width as f64, height as f64);
        let [x, y, w, h] = self.crop;
        let (cx, cy) = ((x * fw) as u32, (y * fh) as u32);
        let cw = ((w * fw).round() as u32).clamp(1, width - cx);
        let ch = ((h * fh).round() as u32).clamp(1, height - cy);
        [cx, cy, cw, ch]
    }
}

/// The colour factors of a draw that changes colours.
#[derive(Debug, Clone, Copy)]
struct Jitter {
    brightness: f64,
    contrast: f64,
    saturation: f64,
}

impl Jitter {
    /// None when every factor is exactly 1 (nothing to do).
    fn of(draw: &Draw) -> Option<Jitter> {
        let (brightness, contrast, saturation) = (draw.brightness, draw.contrast, draw.saturation);
        if (brightness, contrast, saturation) == (1.0, 1.0, 1.0) {
            return None;
        }
        Some(Jitter { brightness: brightness as f64, contrast: contrast as f64, saturation: saturation as f64 })
    }

    /// Whether the map needs the frame's mean grey (contrast pulls toward it).
    fn needs_mean(&self) -> bool {
        self.contrast != 1.0
    }
}

/// The pixels of a frame, rows `stride` bytes apart.
struct Source<'a> {
    raw: &'a [u8],
    stride: usize,
}

impl Source<'_> {
    fn copy_window(&self, [x0, y0, w, h]: [u32; 4], out: &mut Vec<u8>) {
        for row_idx in 0..h as usize {
            let begin = (y0 as usize + row_idx) * self.stride + x0 as usize * 3;
            out.extend_from_slice(&self.raw[begin..begin + w as usize * 3]);
        }
    }
}

/// Fractional bits of the bilinear weights, held as `i16` in `0..1 << 15`.
const WEIGHT_BITS: u32 = 15;
/// Fractional bits of the values between the passes, held as `i16`: 255 << 6 leaves room for the
/// difference of two values doubled.
const VALUE_BITS: u32 = 6;

/// `a * b / 2^16`, rounded down: one instruction on 16 lanes (`pmulhw`), which is why the passes
/// work in 16-bit fixed point.
#[inline(always)]
fn mulhi(a: i16, b: i16) -> i16 {
    ((a as i32 * b as i32) >> 16) as i16
}

thread_local! {
    /// Buffers of the last frame this thread augmented, reused so that a frame allocates nothing.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

#[derive(Default)]
struct Scratch {
    resizer: Resizer,
    /// One output row with `VALUE_BITS` fractional bits, and as bytes.
    row: Vec<i16>,
    row_bytes: Vec<u8>,
    /// The whole resized frame with `VALUE_BITS` fractional bits, while its mean grey is summed.
    image: Vec<i16>,
    /// Each output byte's column summed over the rows.
    column_sums: Vec<u32>,
    colour: ColourMap,
}

/// The separable resize of one window: source rows interpolated across into row buffers, output
/// rows blended from two of those.
#[derive(Default)]
struct Resizer {
    window: [u32; 4],
    columns: Taps,
    rows: Taps,
    groups: Vec<ShuffleGroup>,
    /// Each output byte's weight of the right source pixel (a column's weight three times).
    column_weights: Vec<i16>,
    /// The left and right source pixels of each output column, and 16 spare bytes a group's
    /// store may run into.
    left: Vec<u8>,
    right: Vec<u8>,
    /// Two source rows interpolated across and which rows of the window they are.
    upper: Vec<i16>,
    lower: Vec<i16>,
    upper_row: Option<u32>,
    lower_row: Option<u32>,
}

/// Where each output index along one axis samples its source window: the lower source index and
/// the weight of the next one, in `WEIGHT_BITS` fixed point.
#[derive(Default)]
struct Taps {
    low: Vec<u32>,
    weight: Vec<i16>,
}

impl Taps {
    /// Pixel centres aligned, clamped at the window's edges (torchvision's `align_corners=False`):
    /// output index `i` samples source coordinate `(i + 0.5) * len / side - 0.5`, computed in
    /// integers as `((2i + 1) * len - side) / (2 * side)`.
    fn compute(&mut self, len: u32, side: u32) {
        let (len, side) = (len as i64, side as i64);
        let denominator = 2 * side;
        self.low.clear();
        self.weight.clear();
        for i in 0..side {
            let numerator = (2 * i + 1) * len - side;
            let (mut low, remainder) = (numerator.max(0) / denominator, numerator.max(0) % denominator);
            // The fraction rounded to `WEIGHT_BITS`; none past the last index.
            let mut weight =
                if low < len - 1 { ((remainder << (WEIGHT_BITS + 1)) + denominator) / (2 * denominator) } else { 0 };
            low = low.min(len - 1);
            if weight == 1 << WEIGHT_BITS {
                (low, weight) = (low + 1, 0);
            }
            // Invariant: a weight on the next index only where there is one, so the next index
            // may be read past the window (weight 0) without changing the result.
            debug_assert!(weight == 0 || low + 1 < len);
            self.low.push(low as u32);
            self.weight.push(weight as i16);
        }
    }
}

/// Consecutive output columns whose left and right source pixels all lie in 16 bytes of a frame
/// row: one 16-byte load and a byte shuffle each for their left and right pixels.
struct ShuffleGroup {
    /// Byte offset in a frame row of the 16 bytes.
    source: usize,
    /// Byte offset of the group's first column in the left and right rows.
    out: usize,
    /// For each output byte, the index of its source byte in the 16 (0x80: none, 0).
    left: [u8; 16],
    right: [u8; 16],
}

impl ShuffleGroup {
    /// Columns grouped greedily: at most five (15 output bytes) spanning at most five source
    /// pixels (15 bytes), left pixels and their right neighbours.
    fn group(x0: u32, columns: &Taps, groups: &mut Vec<ShuffleGroup>) {
        groups.clear();
        let low = &columns.low;
        let mut first = 0;
        while first < low.len() {
            let mut len = 1;
            while first + len < low.len() && len < 5 && low[first + len] + 1 - low[first] < 5 {
                len += 1;
            }
            let mut group = ShuffleGroup {
                source: (x0 + low[first]) as usize * 3,
                out: first * 3,
                left: [0x80; 16],
                right: [0x80; 16],
            };
            for column in 0..len {
                let pixel = (low[first + column] - low[first]) as u8 * 3;
                for channel in 0..3 {
                    group.left[column * 3 + channel] = pixel + channel as u8;
                    group.right[column * 3 + channel] = pixel + 3 + channel as u8;
                }
            }
            groups.push(group);
            first += len;
        }
    }
}

/// Colour jitter of one frame as an affine map per byte in 16-bit fixed point: output byte `j`
/// (channel `j % 3`) is `v[j] + sum_d taps[d][j] * v[j + d - 2] + offset`, `d` in `0..5` (the
/// pixel's other channels sit up to two bytes away), `v` the resized values. The sum is kept with
/// `out_bits` fractional bits, as many as leave the largest possible value and every tap in an
/// `i16`: 5 for the default jitter, an error of a few hundredths of a level.
#[derive(Default)]
struct ColourMap {
    taps: [Vec<i16>; 5],
    out_bits: u32,
    /// Offset, rounding half and the mean truncation of the products, in output units.
    constant: i16,
    /// Saturation 1: each channel on its own (only `taps[2]`).
    diagonal: bool,
    /// One row of values and two spare values either side (read only by taps of 0).
    padded: Vec<i16>,
}

impl ColourMap {
    /// The map `jitter` makes with the frame's mean grey (levels, before brightness):
    /// out_k = s*c*b*v_k + (1-s)*c*b*grey(v) + b*mean_grey*(1-c), torchvision's order of
    /// brightness, contrast, saturation folded into one matrix and an offset.
    fn set(&mut self, jitter: &Jitter, mean_grey: f64, side: u32) {
        let Jitter { brightness: b, contrast: c, saturation: s } = *jitter;
        let (own, mix) = (s * c * b, (1.0 - s) * c * b);
        let matrix = |row: usize, col: usize| mix * GREY[col] + if row == col { own } else { 0.0 };
        let offset = b * mean_grey * (1.0 - c);
        // Taps as multiples of one value unit, less the identity that `v[j]` carries.
        let tap = |channel: usize, d: usize| match (channel + d).checked_sub(2) {
            Some(other) if other < 3 => matrix(channel, other) - if d == 2 { 1.0 } else { 0.0 },
            _ => 0.0,
        };
        let largest_value = (0..3).map(|row| (0..3).map(|col| matrix(row, col).abs()).sum::<f64>()).fold(0.0, f64::max)
            * 255.0
            + offset.abs();
        let largest_tap = (0..3).flat_map(|channel| (0..5).map(move |d| tap(channel, d).abs())).fold(0.0, f64::max);
        let fits = |bits: u32| {
            (largest_value + 4.0) * (1 << bits) as f64 <= i16::MAX as f64
                && largest_tap * (1u32 << (bits + 16 - VALUE_BITS)) as f64 <= i16::MAX as f64
        };
        let out_bits = (0..=VALUE_BITS)
            .rev()
            .find(|&bits| fits(bits))
            .expect("colour factors within [0, 2] (AugmentConfig::jitter at most 1)");
        let tap_scale = (1u32 << (out_bits + 16 - VALUE_BITS)) as f64;
        for (d, taps) in self.taps.iter_mut().enumerate() {
            let pixel: [i16; 3] = std::array::from_fn(|channel| (tap(channel, d) * tap_scale).round() as i16);
            taps.clear();
            taps.extend(std::iter::repeat_n(pixel, side as usize).flatten());
        }
        self.diagonal = s == 1.0;
        // Each product and the identity's shift round down by half a unit on average.
        let n_products = if self.diagonal { 1.0 } else { 5.0 };
        let truncation = 0.5 * n_products + 0.5 * (1.0 - 0.5f64.powi((VALUE_BITS - out_bits) as i32));
        let scale = (1u32 << out_bits) as f64;
        self.constant = (offset * scale + truncation + 0.5 * scale).floor() as i16;
        self.out_bits = out_bits;
        self.padded.resize(side as usize * 3 + 4, 0);
    }
}

/// The bilinear resize of `window` to `side` x `side`, jittered, appended to `out` (not the
/// same-size identity, which is a copy).
fn resize_and_jitter(
    scratch: &mut Scratch,
    source: &Source,
    window: [u32; 4],
    side: u32,
    jitter: Option<&Jitter>,
    out: &mut Vec<u8>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above; nothing else is required of the caller.
        unsafe { resize_and_jitter_avx2(scratch, source, window, side, jitter, out) };
        return;
    }
    resize_and_jitter_baseline(scratch, source, window, side, jitter, out);
}

/// [`resize_and_jitter`] compiled for AVX2: the loops vectorize 16 lanes wide, and the column
/// gather shuffles bytes (SSSE3, which AVX2 implies).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn resize_and_jitter_avx2(
    scratch: &mut Scratch,
    source: &Source,
    window: [u32; 4],
    side: u32,
    jitter: Option<&Jitter>,
    out: &mut Vec<u8>,
) {
    resize_and_jitter_body::<true>(scratch, source, window, side, jitter, out);
}

/// [`resize_and_jitter`] for any CPU; the same bytes as the AVX2 copy.
fn resize_and_jitter_baseline(
    scratch: &mut Scratch,
    source: &Source,
    window: [u32; 4],
    side: u32,
    jitter: Option<&Jitter>,
    out: &mut Vec<u8>,
) {
    resize_and_jitter_body::<false>(scratch, source, window, side, jitter, out);
}

/// The work of [`resize_and_jitter`], inlined into each instruction set's copy. `SSSE3`: shuffle
/// bytes with `pshufb` (only where the caller is compiled with it).
#[inline(always)]
fn resize_and_jitter_body<const SSSE3: bool>(
    scratch: &mut Scratch,
    source: &Source,
    window: [u32; 4],
    side: u32,
    jitter: Option<&Jitter>,
    out: &mut Vec<u8>,
) {
    let width = side as usize * 3;
    let Scratch { resizer, row, row_bytes, image, column_sums, colour } = scratch;
    resizer.prepare(window, side);
    row.resize(width, 0);
    row_bytes.resize(width, 0);
    let Some(jitter) = jitter else {
        for out_row in 0..side {
            let (upper, lower, weight) = resizer.source_rows::<SSSE3>(source, out_row);
            blend_rows_to_bytes(upper, lower, weight, row_bytes);
            out.extend_from_slice(row_bytes);
        }
        return;
    };
    if !jitter.needs_mean() {
        colour.set(jitter, 0.0, side);
        for out_row in 0..side {
            let (upper, lower, weight) = resizer.source_rows::<SSSE3>(source, out_row);
            blend_rows(upper, lower, weight, row);
            colour_row(row, colour, row_bytes);
            out.extend_from_slice(row_bytes);
        }
        return;
    }
    // Contrast pulls toward the mean grey of the resized frame: resize it all first.
    image.resize(width * side as usize, 0);
    column_sums.clear();
    column_sums.resize(width, 0);
    for (out_row, row) in (0..side).zip(image.chunks_exact_mut(width)) {
        let (upper, lower, weight) = resizer.source_rows::<SSSE3>(source, out_row);
        blend_rows(upper, lower, weight, row);
        add_columns(column_sums, row);
    }
    let mut channel_sums = [0u64; 3];
    for (j, &sum) in column_sums.iter().enumerate() {
        channel_sums[j % 3] += sum as u64;
    }
    let grey_sum: f64 = channel_sums.iter().zip(GREY).map(|(&sum, weight)| sum as f64 * weight).sum();
    let mean_grey = grey_sum / (side as f64).powi(2) / (1u32 << VALUE_BITS) as f64;
    colour.set(jitter, mean_grey, side);
    for row in image.chunks_exact(width) {
        colour_row(row, colour, row_bytes);
        out.extend_from_slice(row_bytes);
    }
}

impl Resizer {
    /// Taps and buffers for resizing `window` to `side` x `side`.
    fn prepare(&mut self, window: [u32; 4], side: u32) {
        let [x0, _, w, h] = window;
        let width = side as usize * 3;
        self.window = window;
        self.columns.compute(w, side);
        self.rows.compute(h, side);
        ShuffleGroup::group(x0, &self.columns, &mut self.groups);
        self.column_weights.clear();
        self.column_weights.extend(self.columns.weight.iter().flat_map(|&weight| [weight; 3]));
        self.left.resize(width + 16, 0);
        self.right.resize(width + 16, 0);
        self.upper.resize(width, 0);
        self.lower.resize(width, 0);
        (self.upper_row, self.lower_row) = (None, None);
    }

    /// The two source rows, interpolated across, that output row `out_row` blends, and the
    /// weight of the lower one. Each source row is interpolated once while consecutive output
    /// rows need it.
    #[inline(always)]
    fn source_rows<const SSSE3: bool>(&mut self, source: &Source, out_row: u32) -> (&[i16], &[i16], i16) {
        let (top, weight) = (self.rows.low[out_row as usize], self.rows.weight[out_row as usize]);
        if self.upper_row != Some(top) {
            if self.lower_row == Some(top) {
                std::mem::swap(&mut self.upper, &mut self.lower);
                self.lower_row = None;
            } else {
                self.interpolate_across::<SSSE3>(source, top, Row::Upper);
            }
            self.upper_row = Some(top);
        }
        // A zero weight leaves the lower row unread: the upper one stands in for it.
        if weight == 0 {
            return (&self.upper, &self.upper, 0);
        }
        if self.lower_row != Some(top + 1) {
            self.interpolate_across::<SSSE3>(source, top + 1, Row::Lower);
            self.lower_row = Some(top + 1);
        }
        (&self.upper, &self.lower, weight)
    }

    /// Row `window_row` of the window interpolated to the output columns.
    #[inline(always)]
    fn interpolate_across<const SSSE3: bool>(&mut self, source: &Source, window_row: u32, into: Row) {
        let row_start = (self.window[1] + window_row) as usize * source.stride;
        for group in &self.groups {
            let at = row_start + group.source;
            let block: [u8; 16] = match source.raw.get(at..at + 16) {
                Some(bytes) => bytes.try_into().unwrap(),
                None => last_bytes(&source.raw[at..]),
            };
            let (left, right) = (&mut self.left[group.out..][..16], &mut self.right[group.out..][..16]);
            shuffle::<SSSE3>(&block, &group.left, left.try_into().unwrap());
            shuffle::<SSSE3>(&block, &group.right, right.try_into().unwrap());
        }
        let dst = match into {
            Row::Upper => &mut self.upper,
            Row::Lower => &mut self.lower,
        };
        blend_columns(&self.left, &self.right, &self.column_weights, dst);
    }
}

#[derive(Clone, Copy)]
enum Row {
    Upper,
    Lower,
}

/// A frame's last bytes, fewer than 16, and zeros after them.
#[cold]
fn last_bytes(tail: &[u8]) -> [u8; 16] {
    let mut block = [0; 16];
    block[..tail.len()].copy_from_slice(tail);
    block
}

/// `out[i] = block[mask[i]]`, 0 where the mask's high bit is set: `pshufb`, or as much of it as
/// the group's columns read.
#[inline(always)]
fn shuffle<const SSSE3: bool>(block: &[u8; 16], mask: &[u8; 16], out: &mut [u8; 16]) {
    #[cfg(target_arch = "x86_64")]
    if SSSE3 {
        use std::arch::x86_64::{_mm_loadu_si128, _mm_shuffle_epi8, _mm_storeu_si128};
        // SAFETY: SSSE3 is true only inside `resize_and_jitter_avx2`, run where the CPU has AVX2
        // (so SSSE3); the loads and the store touch exactly the 16 bytes of the arrays given.
        unsafe {
            let (block, mask) = (_mm_loadu_si128(block.as_ptr().cast()), _mm_loadu_si128(mask.as_ptr().cast()));
            _mm_storeu_si128(out.as_mut_ptr().cast(), _mm_shuffle_epi8(block, mask));
        }
        return;
    }
    // Column by column: three consecutive source bytes each, up to the first absent one (the
    // bytes after it are overwritten by the next group or never read).
    for (pixel, &index) in out.chunks_exact_mut(3).zip(mask.iter().step_by(3)) {
        if index & 0x80 != 0 {
            break;
        }
        pixel.copy_from_slice(&block[index as usize..index as usize + 3]);
    }
}

/// `out[j] = left[j] + (right[j] - left[j]) * weights[j]`, with `VALUE_BITS` fractional bits.
#[inline(always)]
fn blend_columns(left: &[u8], right: &[u8], weights: &[i16], out: &mut [i16]) {
    const SHIFT: u32 = VALUE_BITS + 16 - WEIGHT_BITS;
    let n = out.len();
    let (left, right, weights) = (&left[..n], &right[..n], &weights[..n]);
    for j in 0..n {
        let (l, r) = (left[j] as i16, right[j] as i16);
        out[j] = (l << VALUE_BITS) + mulhi((r - l) << SHIFT, weights[j]);
    }
}

/// `upper + (lower - upper) * weight`, with `VALUE_BITS` fractional bits.
#[inline(always)]
fn blend(upper: i16, lower: i16, weight: i16) -> i16 {
    upper + mulhi((lower - upper) << (16 - WEIGHT_BITS), weight)
}

/// Two interpolated rows blended.
#[inline(always)]
fn blend_rows(upper: &[i16], lower: &[i16], weight: i16, out: &mut [i16]) {
    let n = out.len();
    let (upper, lower) = (&upper[..n], &lower[..n]);
    for j in 0..n {
        out[j] = blend(upper[j], lower[j], weight);
    }
}

/// Two interpolated rows blended, rounded to whole levels.
#[inline(always)]
fn blend_rows_to_bytes(upper: &[i16], lower: &[i16], weight: i16, out: &mut [u8]) {
    let n = out.len();
    let (upper, lower) = (&upper[..n], &lower[..n]);
    for j in 0..n {
        out[j] = ((blend(upper[j], lower[j], weight) + (1 << (VALUE_BITS - 1))) >> VALUE_BITS) as u8;
    }
}

/// Column sums of the resized frame; exact integers, so any order of additions gives the same.
#[inline(always)]
fn add_columns(sums: &mut [u32], row: &[i16]) {
    let n = sums.len();
    let row = &row[..n];
    for j in 0..n {
        sums[j] += row[j] as u32;
    }
}

/// One row of resized values through the colour map, clamped and rounded to bytes. Partial sums
/// may wrap around; the whole sum fits (`ColourMap::set` chose the scale).
#[inline(always)]
fn colour_row(row: &[i16], map: &mut ColourMap, out: &mut [u8]) {
    let n = out.len();
    let (bits, constant) = (map.out_bits, map.constant);
    let identity_shift = VALUE_BITS - bits;
    let to_byte = |sum: i16| (sum.wrapping_add(constant) >> bits).clamp(0, 255) as u8;
    if map.diagonal {
        let (row, own) = (&row[..n], &map.taps[2][..n]);
        for j in 0..n {
            out[j] = to_byte((row[j] >> identity_shift).wrapping_add(mulhi(row[j], own[j])));
        }
        return;
    }
    let padded = &mut map.padded[..n + 4];
    padded[2..n + 2].copy_from_slice(&row[..n]);
    let [t0, t1, t2, t3, t4] = &map.taps;
    let (t0, t1, t2, t3, t4) = (&t0[..n], &t1[..n], &t2[..n], &t3[..n], &t4[..n]);
    let (v0, v1, v2, v3, v4) =
        (&padded[..n], &padded[1..n + 1], &padded[2..n + 2], &padded[3..n + 3], &padded[4..n + 4]);
    for j in 0..n {
        let sum = (v2[j] >> identity_shift)
            .wrapping_add(mulhi(v0[j], t0[j]))
            .wrapping_add(mulhi(v1[j], t1[j]))
            .wrapping_add(mulhi(v2[j], t2[j]))
            .wrapping_add(mulhi(v3[j], t3[j]))
            .wrapping_add(mulhi(v4[j], t4[j]));
        out[j] = to_byte(sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_keeps_a_frame_and_draws_are_reproducible() {
        let frame = image::RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8 * 10, y as u8 * 10, 77]));
        let mut out = Vec::new();
        Draw::IDENTITY.apply(&frame, 16, &mut out);
        assert_eq!(out, frame.as_raw().as_slice());
        let config = AugmentConfig::default();
        let (a, b) = (Draw::new(&config, &mut SplitMix64::new(9)), Draw::new(&config, &mut SplitMix64::new(9)));
        assert_eq!(a, b);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        a.apply(&frame, 8, &mut x);
        b.apply(&frame, 8, &mut y);
        assert_eq!((x.len(), &x), (8 * 8 * 3, &y));
        let c = Draw::new(&config, &mut SplitMix64::new(10));
        assert_ne!(a, c, "another seed draws another augmentation");
    }

    /// `draw` applied to `frame` computed plainly in `f64`: each output pixel sampled from its
    /// four neighbours, the colour map per pixel, rounded once.
    fn reference(draw: &Draw, frame: &image::RgbImage, side: u32) -> Vec<u8> {
        let [x0, y0, w, h] = draw.window(frame.width(), frame.height());
        let taps = |len: u32, i: u32| {
            let src = ((i as f64 + 0.5) * len as f64 / side as f64 - 0.5).clamp(0.0, (len - 1) as f64);
            let low = src.floor();
            (low as u32, (low as u32 + 1).min(len - 1), src - low)
        };
        let pixel = |x: u32, y: u32, k: usize| frame.get_pixel(x0 + x, y0 + y).0[k] as f64;
        let mut resized = Vec::new();
        for i in 0..side {
            let (top, bottom, wy) = taps(h, i);
            for j in 0..side {
                let (left, right, wx) = taps(w, j);
                for k in 0..3 {
                    let upper = pixel(left, top, k) * (1.0 - wx) + pixel(right, top, k) * wx;
                    let lower = pixel(left, bottom, k) * (1.0 - wx) + pixel(right, bottom, k) * wx;
                    resized.push(upper * (1.0 - wy) + lower * wy);
                }
            }
        }
        let (b, c, s) = (draw.brightness as f64, draw.contrast as f64, draw.saturation as f64);
        let grey = |p: &[f64]| p.iter().zip(GREY).map(|(v, g)| v * g).sum::<f64>();
        let mean_grey = resized.chunks_exact(3).map(grey).sum::<f64>() / (side * side) as f64;
        let mut out = Vec::new();
        for p in resized.chunks_exact(3) {
            for &v in p {
                let value = s * c * b * v + (1.0 - s) * c * b * grey(p) + b * mean_grey * (1.0 - c);
                out.push(value.clamp(0.0, 255.0).round() as u8);
            }
        }
        out
    }

    /// Random bytes, so that neighbouring pixels differ as much as they can.
    fn noise(width: u32, height: u32, seed: u64) -> image::RgbImage {
        let mut rng = SplitMix64::new(seed);
        image::RgbImage::from_fn(width, height, |_, _| {
            let bits = rng.next_u64();
            image::Rgb([bits as u8, (bits >> 8) as u8, (bits >> 16) as u8])
        })
    }

    fn check(draw: &Draw, frame: &image::RgbImage, side: u32) {
        let mut out = vec![7];
        draw.apply(frame, side, &mut out);
        assert_eq!((out.len(), out[0]), (1 + (side * side * 3) as usize, 7), "appends {side}x{side}x3 bytes");
        let expected = reference(draw, frame, side);
        let difference = out[1..].iter().zip(&expected).map(|(&a, &b)| a.abs_diff(b)).max().unwrap();
        let size = (frame.width(), frame.height());
        assert!(difference <= 1, "{draw:?} of {size:?} to {side}: off by {difference}");
    }

    #[test]
    fn draws_are_within_a_level_of_the_exact_computation() {
        let sizes =
            [((224, 224), 224), ((64, 64), 224), ((224, 224), 64), ((37, 53), 29), ((53, 37), 101), ((5, 3), 2)];
        for (idx, ((width, height), side)) in sizes.into_iter().enumerate() {
            let frame = noise(width, height, idx as u64);
            check(&Draw::IDENTITY, &frame, side);
            for jitter in [0.2, 0.5, 1.0] {
                let config = AugmentConfig { jitter, ..AugmentConfig::default() };
                for seed in 0..8 {
                    let draw = Draw::new(&config, &mut SplitMix64::new(seed * 31 + idx as u64));
                    check(&draw, &frame, side);
                    // A neutral factor takes a shorter path: saturation (no mixing), contrast
                    // (no mean), or all but the crop (a plain resize).
                    check(&Draw { saturation: 1.0, ..draw }, &frame, side);
                    check(&Draw { contrast: 1.0, ..draw }, &frame, side);
                    check(&Draw { brightness: 1.0, contrast: 1.0, saturation: 1.0, ..draw }, &frame, side);
                }
            }
        }
    }

    #[test]
    fn the_vectorized_and_the_baseline_copies_give_the_same_bytes() {
        let config = AugmentConfig::default();
        for (idx, ((width, height), side)) in
            [((224, 224), 224), ((64, 64), 224), ((37, 53), 29)].into_iter().enumerate()
        {
            let frame = noise(width, height, idx as u64);
            let source = Source { raw: frame.as_raw(), stride: width as usize * 3 };
            for seed in 0..16 {
                let drawn = Draw::new(&config, &mut SplitMix64::new(seed));
                let neutral = [Draw::IDENTITY, Draw { saturation: 1.0, ..drawn }, Draw { contrast: 1.0, ..drawn }];
                let draw = if seed < 3 { neutral[seed as usize] } else { drawn };
                let (window, jitter) = (draw.window(width, height), Jitter::of(&draw));
                let mut scratch = Scratch::default();
                let (mut baseline, mut dispatched) = (Vec::new(), Vec::new());
                resize_and_jitter_baseline(&mut scratch, &source, window, side, jitter.as_ref(), &mut baseline);
                resize_and_jitter(&mut scratch, &source, window, side, jitter.as_ref(), &mut dispatched);
                assert_eq!(baseline, dispatched, "{draw:?}");
            }
        }
    }
}

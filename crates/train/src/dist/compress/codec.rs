//! The compressor's kernels: encoding fp32 values (plus an error-feedback residual) into int8,
//! bf16 or fp32 payloads, decoding them, and the fused pass of a reduction's finish.
//!
//! Two implementations of every kernel give the same bits:
//! - `scalar`: one value at a time, the definition (and the fallback on CPUs without AVX2).
//! - `lanes`: the same arithmetic restructured for vector units, compiled twice on x86-64, for
//!   AVX-512 (F and BW) and for AVX2, and picked at run time like the fused optimizer's kernel.
//!   bf16 and fp32 are plain loops the compiler vectorizes (bit moves and selections, no branch
//!   per value); int8's block loops are explicit intrinsics (`avx512`, `avx2`: the block maximum
//!   over the magnitudes' bit patterns as integers, the level's byte by truncation), since the
//!   compiler's own vectorization of them gathered and scattered; the reduction's finish is
//!   tiled, so that it reads and writes memory once.
//!
//! Every step is one IEEE operation on one value (an add, a multiply, a divide, bit moves), never
//! contracted or reassociated, so the two give the same bits whatever the vector width: the unit
//! tests check each variant the CPU has against `scalar`, bit for bit, on odd sizes and blocks,
//! zero, tiny, infinite and NaN values.

use super::Compression;

/// 1.5 x 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer.
const ROUNDER: f32 = 12_582_912.0;
/// An f32's exponent bits: a magnitude's bits at or above this are inf or NaN.
const EXPONENT: u32 = 0x7f80_0000;
/// Values per tile of the fused reduction pass for bf16 and fp32 payloads (int8 tiles are its
/// blocks): small enough to stay in L1 between the tile's steps.
const TILE: usize = 2048;

/// Which implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// One value at a time; no instruction set beyond the target's baseline.
    Scalar,
    /// The lanes code compiled for AVX2.
    Avx2,
    /// The lanes code compiled for AVX-512 (F and BW).
    Avx512,
}

impl Isa {
    /// The best this CPU runs (checked once per call; the standard library caches the answer).
    pub(crate) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every implementation this CPU can run, `Scalar` first.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }
}

/// The second half of an all-reduce's fused pass: the averaged shard (plus `residual`) encoded
/// into `payload`, and the shard replaced by what that payload decodes to.
pub(crate) struct Reencode<'a> {
    pub(crate) payload: &'a mut [u8],
    pub(crate) residual: Option<&'a mut [f32]>,
}

/// Generates the dispatching entry point of a kernel: the `lanes` module's function compiled
/// for AVX-512 and for AVX2 (each a `#[target_feature]` wrapper that inlines it), or `scalar`'s.
macro_rules! dispatch {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        $(#[$doc])*
        pub(crate) fn $name(isa: Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx2")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    lanes::$name::<avx512::Avx512>($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    lanes::$name::<avx2::Avx2>($($arg),*)
                }
                match isa {
                    // SAFETY: `Isa::Avx512` comes from `Isa::best` or `Isa::available`, which
                    // checked that the CPU has these features.
                    Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above, for AVX2.
                    Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    Isa::Scalar => {}
                }
            }
            scalar::$name($($arg),*)
        }
    };
}

dispatch! {
    /// Encodes `values` plus `residual` into `payload` and leaves in `residual` what decoding
    /// will lose (see [`Compression::encode`]; lengths checked by the caller).
    fn encode(codec: Compression, values: &[f32], payload: &mut [u8], residual: Option<&mut [f32]>)
}

dispatch! {
    /// Adds what `payload` encodes to `acc` (lengths checked by the caller).
    fn decode_add(codec: Compression, payload: &[u8], acc: &mut [f32])
}

dispatch! {
    /// Writes what `payload` encodes into `out` (lengths checked by the caller).
    fn decode(codec: Compression, payload: &[u8], out: &mut [f32])
}

dispatch! {
    /// A reduction's finish on one shard: `out` becomes the sum, in order from 0.0, of what each
    /// of `payloads` encodes, divided by `divisor`; with `reencode`, that average is then encoded
    /// (error feedback included) and replaced by its decoded value, which is what every other
    /// rank will decode from the payload.
    fn reduce(codec: Compression, payloads: &[&[u8]], divisor: f32, out: &mut [f32], reencode: Option<Reencode<'_>>)
}

fn finite_or_zero(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// One value at a time: the definition of every kernel.
mod scalar {
    use super::{finite_or_zero, Compression, Reencode, ROUNDER};
    use stoke_comm::bf16;

    pub(super) fn encode(codec: Compression, values: &[f32], payload: &mut [u8], residual: Option<&mut [f32]>) {
        match (codec, residual) {
            (Compression::None, None) => {
                for (out, v) in payload.chunks_exact_mut(4).zip(values) {
                    out.copy_from_slice(&v.to_le_bytes());
                }
            }
            (Compression::None, Some(residual)) => {
                for ((out, v), r) in payload.chunks_exact_mut(4).zip(values).zip(residual.iter_mut()) {
                    out.copy_from_slice(&(v + *r).to_le_bytes());
                    *r = 0.0;
                }
            }
            (Compression::Bf16, None) => {
                for (out, v) in payload.chunks_exact_mut(2).zip(values) {
                    out.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
                }
            }
            (Compression::Bf16, Some(residual)) => {
                for ((out, v), r) in payload.chunks_exact_mut(2).zip(values).zip(residual.iter_mut()) {
                    let x = v + *r;
                    let encoded = bf16::from_f32(x);
                    out.copy_from_slice(&encoded.to_bits().to_le_bytes());
                    *r = finite_or_zero(x - encoded.to_f32());
                }
            }
            (Compression::Int8 { block }, residual) => encode_int8(block, values, payload, residual),
        }
    }

    pub(super) fn decode_add(codec: Compression, payload: &[u8], acc: &mut [f32]) {
        match codec {
            Compression::None => {
                for (a, b) in acc.iter_mut().zip(payload.chunks_exact(4)) {
                    *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Compression::Bf16 => {
                for (a, b) in acc.iter_mut().zip(payload.chunks_exact(2)) {
                    *a += bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            Compression::Int8 { block } => decode_int8(block, payload, acc, true),
        }
    }

    pub(super) fn decode(codec: Compression, payload: &[u8], out: &mut [f32]) {
        match codec {
            Compression::Int8 { block } => decode_int8(block, payload, out, false),
            _ => {
                out.fill(0.0);
                decode_add(codec, payload, out);
            }
        }
    }

    pub(super) fn reduce(
        codec: Compression,
        payloads: &[&[u8]],
        divisor: f32,
        out: &mut [f32],
        reencode: Option<Reencode<'_>>,
    ) {
        out.fill(0.0);
        for payload in payloads {
            decode_add(codec, payload, out);
        }
        for v in out.iter_mut() {
            *v /= divisor;
        }
        if let Some(Reencode { payload, residual }) = reencode {
            encode(codec, out, payload, residual);
            decode(codec, payload, out);
        }
    }

    /// Int8 payload: the blocks' scales (f32, little-endian), then one i8 per value.
    fn encode_int8(block: usize, values: &[f32], payload: &mut [u8], mut residual: Option<&mut [f32]>) {
        let n_blocks = values.len().div_ceil(block);
        let (scales, quantized) = payload.split_at_mut(4 * n_blocks);
        for (b, chunk) in values.chunks(block).enumerate() {
            let span = b * block..b * block + chunk.len();
            let carried = residual.as_deref_mut().map(|r| &mut r[span.clone()]);
            let (max, finite) = match carried.as_deref() {
                Some(r) => max_abs(chunk.len(), |i| chunk[i] + r[i]),
                None => max_abs(chunk.len(), |i| chunk[i]),
            };
            let scale = if finite { max / 127.0 } else { f32::NAN };
            scales[4 * b..4 * b + 4].copy_from_slice(&scale.to_le_bytes());
            let inverse = if finite && max > 0.0 { 127.0 / max } else { 0.0 };
            let out = &mut quantized[span];
            // Round to nearest (ties to even) by adding 1.5 x 2^23: for |y| <= 127 the sum's bits
            // are 0x4B40_0000 + round(y), so its low byte is round(y) as an i8, and no
            // float-to-int conversion is needed. A non-finite block's bytes are arbitrary (but
            // the same in every implementation): its NaN scale decodes them all to NaN.
            let level = |x: f32| (x * inverse + ROUNDER).to_bits() as u8;
            match carried {
                None => {
                    for (q, v) in out.iter_mut().zip(chunk) {
                        *q = level(*v);
                    }
                }
                Some(r) => {
                    for ((q, v), r) in out.iter_mut().zip(chunk).zip(r.iter_mut()) {
                        let x = v + *r;
                        *q = level(x);
                        let kept = f32::from(*q as i8) * scale;
                        *r = if finite { x - kept } else { 0.0 };
                    }
                }
            }
        }
    }

    /// The largest |x(i)| over `0..len` and whether every x(i) is finite.
    fn max_abs(len: usize, x: impl Fn(usize) -> f32) -> (f32, bool) {
        let mut max = 0f32;
        let mut finite = true;
        for i in 0..len {
            let v = x(i);
            // f32::max ignores NaN; a NaN or inf is caught by the exponent test instead.
            max = max.max(v.abs());
            finite &= v.to_bits() & 0x7f80_0000 != 0x7f80_0000;
        }
        (max, finite)
    }

    fn decode_int8(block: usize, payload: &[u8], out: &mut [f32], add: bool) {
        let n_blocks = out.len().div_ceil(block);
        let (scales, quantized) = payload.split_at(4 * n_blocks);
        for (b, chunk) in out.chunks_mut(block).enumerate() {
            let scale = f32::from_le_bytes([scales[4 * b], scales[4 * b + 1], scales[4 * b + 2], scales[4 * b + 3]]);
            let q = &quantized[b * block..b * block + chunk.len()];
            if add {
                for (o, q) in chunk.iter_mut().zip(q) {
                    *o += f32::from(*q as i8) * scale;
                }
            } else {
                for (o, q) in chunk.iter_mut().zip(q) {
                    *o = f32::from(*q as i8) * scale;
                }
            }
        }
    }
}

/// The same kernels restructured for vector units: bf16 and fp32 as plain loops the compiler
/// vectorizes (bit moves and selections, no branch per value), int8's block loops through the
/// explicit AVX-512 or AVX2 code of [`Int8Ops`], the fused reduction tiled. Every function is
/// `#[inline(always)]` so that it is compiled inside the dispatching `#[target_feature]`
/// wrappers.
#[cfg(target_arch = "x86_64")]
mod lanes {
    use super::{Compression, Reencode, EXPONENT, ROUNDER, TILE};

    #[inline(always)]
    fn finite_or_zero(x: f32) -> f32 {
        if x.to_bits() & EXPONENT != EXPONENT {
            x
        } else {
            0.0
        }
    }

    /// bf16 bits of `x`, rounded to nearest even; a NaN keeps its upper bits and is made quiet
    /// (the conversion of the `half` crate, without branches).
    #[inline(always)]
    fn to_bf16(x: f32) -> u16 {
        let bits = x.to_bits();
        let nan = bits & 0x7fff_ffff > EXPONENT;
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        (if nan { (bits >> 16) | 0x40 } else { rounded }) as u16
    }

    /// The f32 of bf16 bits `h` (a NaN is made quiet, as the `half` crate does).
    #[inline(always)]
    fn from_bf16(h: u16) -> f32 {
        let h = u32::from(h);
        let nan = h & 0x7fff > 0x7f80;
        f32::from_bits((if nan { h | 0x40 } else { h }) << 16)
    }

    #[inline(always)]
    fn load_bf16(b: &[u8]) -> f32 {
        from_bf16(u16::from_le_bytes([b[0], b[1]]))
    }

    #[inline(always)]
    fn load_f32(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// A block's int8 step: its scale, the factor that maps a value to its level, and whether
    /// the block is finite.
    #[derive(Clone, Copy)]
    pub(super) struct Step {
        pub(super) scale: f32,
        pub(super) inverse: f32,
        pub(super) finite: bool,
    }

    impl Step {
        /// From the largest magnitude's bits (as integers, magnitudes order as their bits do, and
        /// inf and NaN lie above every finite value).
        #[inline(always)]
        fn of(max_bits: u32) -> Step {
            let finite = max_bits < EXPONENT;
            let max = f32::from_bits(max_bits);
            Step {
                scale: if finite { max / 127.0 } else { f32::NAN },
                inverse: if finite && max > 0.0 { 127.0 / max } else { 0.0 },
                finite,
            }
        }
    }

    /// The level of `x` as a byte (its i8; see the definition's comment), and the value that
    /// level decodes to with `scale`.
    #[inline(always)]
    pub(super) fn level(x: f32, inverse: f32, scale: f32) -> (u8, f32) {
        let byte = (x * inverse + ROUNDER).to_bits() as u8;
        (byte, f32::from(byte as i8) * scale)
    }

    /// The int8 block loops, one value at a time; the vector implementations run these on their
    /// tails (fewer values than a register holds), and every implementation on a non-finite
    /// block (rare: it only has to be right).
    pub(super) mod one_by_one {
        use super::level;

        #[inline(always)]
        pub(in super::super) fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
            match r {
                None => x.iter().fold(0, |m, v| m.max(v.to_bits() & 0x7fff_ffff)),
                Some(r) => x.iter().zip(r).fold(0, |m, (v, r)| m.max((v + r).to_bits() & 0x7fff_ffff)),
            }
        }

        /// Quantizes `x` (plus `r`) into `q`; `r` becomes what decoding loses (0 in a non-finite
        /// block); with `back`, `x` is replaced by its decoded value (NaN in a non-finite block,
        /// as decoding its NaN scale gives).
        #[inline(always)]
        pub(in super::super) fn quantize(
            x: &mut [f32],
            mut r: Option<&mut [f32]>,
            q: &mut [u8],
            scale: f32,
            inverse: f32,
            finite: bool,
            back: bool,
        ) {
            for (i, (x, q)) in x.iter_mut().zip(q.iter_mut()).enumerate() {
                let value = match r.as_deref() {
                    Some(r) => *x + r[i],
                    None => *x,
                };
                let (byte, kept) = level(value, inverse, scale);
                *q = byte;
                if let Some(r) = r.as_deref_mut() {
                    r[i] = if finite { value - kept } else { 0.0 };
                }
                if back {
                    *x = if finite { kept } else { f32::NAN };
                }
            }
        }

        #[inline(always)]
        pub(in super::super) fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
            for (o, q) in out.iter_mut().zip(q) {
                let d = f32::from(*q as i8) * scale;
                *o = if ADD { *o + d } else { d };
            }
        }
    }

    /// The int8 block loops of one instruction set. `quantize*` are called on finite blocks only.
    pub(super) trait Int8Ops {
        /// The largest magnitude's bits of `x` (plus `r`).
        unsafe fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32;
        /// `q` = the levels of `values` (`x` plus `r`), `r` = value minus decoded value.
        unsafe fn quantize(x: &[f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32);
        /// As `quantize`, and `x` replaced by its decoded value.
        unsafe fn quantize_in_place(x: &mut [f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32);
        /// `out (+)= (q as i8) x scale`.
        unsafe fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]);
    }

    /// One block of an int8 encoding (its scale into `scale_out`, its levels into `q`).
    #[inline(always)]
    fn encode_block<O: Int8Ops>(x: &[f32], r: Option<&mut [f32]>, q: &mut [u8], scale_out: &mut [u8]) {
        // SAFETY: the dispatcher only instantiates `O` for an instruction set the CPU has.
        let step = Step::of(unsafe { O::max_bits(x, r.as_deref()) });
        scale_out.copy_from_slice(&step.scale.to_le_bytes());
        if step.finite {
            // SAFETY: as above; the block is finite.
            unsafe { O::quantize(x, r, q, step.scale, step.inverse) };
        } else {
            // The values are only read; a copy keeps `one_by_one::quantize` to one signature.
            let mut copy = x.to_vec();
            one_by_one::quantize(&mut copy, r, q, step.scale, step.inverse, false, false);
        }
    }

    /// One block of the fused pass's second encoding: levels into `q`, `x` replaced by decoded.
    #[inline(always)]
    fn reencode_block<O: Int8Ops>(x: &mut [f32], r: Option<&mut [f32]>, q: &mut [u8], scale_out: &mut [u8]) {
        // SAFETY: the dispatcher only instantiates `O` for an instruction set the CPU has.
        let step = Step::of(unsafe { O::max_bits(x, r.as_deref()) });
        scale_out.copy_from_slice(&step.scale.to_le_bytes());
        if step.finite {
            // SAFETY: as above; the block is finite.
            unsafe { O::quantize_in_place(x, r, q, step.scale, step.inverse) };
        } else {
            one_by_one::quantize(x, r, q, step.scale, step.inverse, false, true);
        }
    }

    /// The scale of block `b` of an int8 payload whose scales are `scales`.
    #[inline(always)]
    fn scale_of(scales: &[u8], b: usize) -> f32 {
        load_f32(&scales[4 * b..4 * b + 4])
    }

    #[inline(always)]
    pub(super) fn encode<O: Int8Ops>(
        codec: Compression,
        values: &[f32],
        payload: &mut [u8],
        residual: Option<&mut [f32]>,
    ) {
        match (codec, residual) {
            (Compression::None, None) => {
                for (out, v) in payload.chunks_exact_mut(4).zip(values) {
                    out.copy_from_slice(&v.to_le_bytes());
                }
            }
            (Compression::None, Some(residual)) => {
                for ((out, v), r) in payload.chunks_exact_mut(4).zip(values).zip(residual.iter_mut()) {
                    out.copy_from_slice(&(v + *r).to_le_bytes());
                    *r = 0.0;
                }
            }
            (Compression::Bf16, None) => {
                for (out, v) in payload.chunks_exact_mut(2).zip(values) {
                    out.copy_from_slice(&to_bf16(*v).to_le_bytes());
                }
            }
            (Compression::Bf16, Some(residual)) => {
                for ((out, v), r) in payload.chunks_exact_mut(2).zip(values).zip(residual.iter_mut()) {
                    let x = v + *r;
                    let h = to_bf16(x);
                    out.copy_from_slice(&h.to_le_bytes());
                    *r = finite_or_zero(x - from_bf16(h));
                }
            }
            (Compression::Int8 { block }, mut residual) => {
                let n_blocks = values.len().div_ceil(block);
                let (scales, quantized) = payload.split_at_mut(4 * n_blocks);
                for (b, (x, q)) in values.chunks(block).zip(quantized.chunks_mut(block)).enumerate() {
                    let span = b * block..b * block + x.len();
                    let r = residual.as_deref_mut().map(|r| &mut r[span]);
                    encode_block::<O>(x, r, q, &mut scales[4 * b..4 * b + 4]);
                }
            }
        }
    }

    #[inline(always)]
    pub(super) fn decode_add<O: Int8Ops>(codec: Compression, payload: &[u8], acc: &mut [f32]) {
        match codec {
            Compression::None => {
                for (a, b) in acc.iter_mut().zip(payload.chunks_exact(4)) {
                    *a += load_f32(b);
                }
            }
            Compression::Bf16 => {
                for (a, b) in acc.iter_mut().zip(payload.chunks_exact(2)) {
                    *a += load_bf16(b);
                }
            }
            Compression::Int8 { block } => {
                let (scales, quantized) = payload.split_at(4 * acc.len().div_ceil(block));
                for (b, (o, q)) in acc.chunks_mut(block).zip(quantized.chunks(block)).enumerate() {
                    // SAFETY: the dispatcher only instantiates `O` for an instruction set the CPU has.
                    unsafe { O::dequantize::<true>(q, scale_of(scales, b), o) };
                }
            }
        }
    }

    #[inline(always)]
    pub(super) fn decode<O: Int8Ops>(codec: Compression, payload: &[u8], out: &mut [f32]) {
        match codec {
            Compression::None => {
                for (o, b) in out.iter_mut().zip(payload.chunks_exact(4)) {
                    // 0.0 + x, as the definition's fill-then-add (a -0.0 decodes to 0.0).
                    *o = 0.0 + load_f32(b);
                }
            }
            Compression::Bf16 => {
                for (o, b) in out.iter_mut().zip(payload.chunks_exact(2)) {
                    *o = 0.0 + load_bf16(b);
                }
            }
            Compression::Int8 { block } => {
                let (scales, quantized) = payload.split_at(4 * out.len().div_ceil(block));
                for (b, (o, q)) in out.chunks_mut(block).zip(quantized.chunks(block)).enumerate() {
                    // SAFETY: the dispatcher only instantiates `O` for an instruction set the CPU has.
                    unsafe { O::dequantize::<false>(q, scale_of(scales, b), o) };
                }
            }
        }
    }

    #[inline(always)]
    pub(super) fn reduce<O: Int8Ops>(
        codec: Compression,
        payloads: &[&[u8]],
        divisor: f32,
        out: &mut [f32],
        reencode: Option<Reencode<'_>>,
    ) {
        // Invariant: each tile is summed over the payloads in order from 0.0, divided, then
        // re-encoded before the next tile is touched, so every value goes through exactly the
        // definition's operations, in its order, while the tile stays in L1.
        let len = out.len();
        let (mut send, mut residual) = match reencode {
            Some(Reencode { payload, residual }) => (Some(payload), residual),
            None => (None, None),
        };
        let tile = match codec {
            Compression::Int8 { block } => block,
            _ => TILE,
        };
        let n_blocks = len.div_ceil(tile);
        for (t, o) in out.chunks_mut(tile).enumerate() {
            let span = t * tile..t * tile + o.len();
            o.fill(0.0);
            for payload in payloads {
                match codec {
                    Compression::None => decode_add::<O>(codec, &payload[4 * span.start..4 * span.end], o),
                    Compression::Bf16 => decode_add::<O>(codec, &payload[2 * span.start..2 * span.end], o),
                    Compression::Int8 { .. } => {
                        let q = &payload[4 * n_blocks + span.start..4 * n_blocks + span.end];
                        // SAFETY: the dispatcher only instantiates `O` for an instruction set the CPU has.
                        unsafe { O::dequantize::<true>(q, scale_of(payload, t), o) };
                    }
                }
            }
            for v in o.iter_mut() {
                *v /= divisor;
            }
            let Some(send) = send.as_deref_mut() else { continue };
            let r = residual.as_deref_mut().map(|r| &mut r[span.clone()]);
            match codec {
                Compression::None | Compression::Bf16 => {
                    let bytes = if codec == Compression::None { 4 } else { 2 };
                    let payload = &mut send[bytes * span.start..bytes * span.end];
                    encode::<O>(codec, o, payload, r);
                    decode::<O>(codec, payload, o);
                }
                Compression::Int8 { .. } => {
                    let (scales, quantized) = send.split_at_mut(4 * n_blocks);
                    reencode_block::<O>(o, r, &mut quantized[span], &mut scales[4 * t..4 * t + 4]);
                }
            }
        }
    }
}

/// Int8's block loops in AVX-512 (F and BW) intrinsics, 16 values per step. Each step is the
/// definition's operation on every lane: the same IEEE adds and multiplies, the level's byte by
/// truncation (`vpmovdb`) and its i8 sign-extended back, so the bits equal the scalar code's.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::lanes::{one_by_one, Int8Ops};
    use super::ROUNDER;

    pub(super) struct Avx512;

    impl Int8Ops for Avx512 {
        #[inline(always)]
        unsafe fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
            // SAFETY: the caller runs on a CPU with AVX-512 F and BW.
            unsafe { max_bits(x, r) }
        }
        #[inline(always)]
        unsafe fn quantize(x: &[f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
            // SAFETY: as above.
            unsafe { quantize(x, r, q, scale, inverse) }
        }
        #[inline(always)]
        unsafe fn quantize_in_place(x: &mut [f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
            // SAFETY: as above.
            unsafe { quantize_in_place(x, r, q, scale, inverse) }
        }
        #[inline(always)]
        unsafe fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { dequantize::<ADD>(q, scale, out) }
        }
    }

    const W: usize = 16;

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
        let main = x.len() / W * W;
        let magnitude = _mm512_set1_epi32(0x7fff_ffff);
        let mut acc = _mm512_setzero_si512();
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main <= x.len() (and r.len() == x.len()).
            let v = unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                match r {
                    Some(r) => _mm512_add_ps(v, _mm512_loadu_ps(r.as_ptr().add(i))),
                    None => v,
                }
            };
            acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
        }
        let tail = one_by_one::max_bits(&x[main..], r.map(|r| &r[main..]));
        _mm512_reduce_max_epu32(acc).max(tail)
    }

    /// The 16 levels of `values` as bytes, and their decoded values.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn levels(values: __m512, inverse: __m512, scale: __m512) -> (__m128i, __m512) {
        let t = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(values, inverse), _mm512_set1_ps(ROUNDER)));
        let bytes = _mm512_cvtepi32_epi8(t);
        let whole = _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(t)));
        (bytes, _mm512_mul_ps(whole, scale))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn quantize(x: &[f32], mut r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
        let main = x.len() / W * W;
        let (inv, sc) = (_mm512_set1_ps(inverse), _mm512_set1_ps(scale));
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within x, q and r (all of x.len()).
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                match r.as_deref_mut() {
                    Some(r) => {
                        let value = _mm512_add_ps(v, _mm512_loadu_ps(r.as_ptr().add(i)));
                        let (bytes, kept) = levels(value, inv, sc);
                        _mm_storeu_si128(q.as_mut_ptr().add(i).cast(), bytes);
                        _mm512_storeu_ps(r.as_mut_ptr().add(i), _mm512_sub_ps(value, kept));
                    }
                    None => _mm_storeu_si128(q.as_mut_ptr().add(i).cast(), levels(v, inv, sc).0),
                }
            }
        }
        let mut tail = x[main..].to_vec();
        one_by_one::quantize(&mut tail, r.map(|r| &mut r[main..]), &mut q[main..], scale, inverse, true, false);
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn quantize_in_place(x: &mut [f32], mut r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
        let main = x.len() / W * W;
        let (inv, sc) = (_mm512_set1_ps(inverse), _mm512_set1_ps(scale));
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within x, q and r (all of x.len()).
            unsafe {
                let mut value = _mm512_loadu_ps(x.as_ptr().add(i));
                if let Some(r) = r.as_deref() {
                    value = _mm512_add_ps(value, _mm512_loadu_ps(r.as_ptr().add(i)));
                }
                let (bytes, kept) = levels(value, inv, sc);
                _mm_storeu_si128(q.as_mut_ptr().add(i).cast(), bytes);
                if let Some(r) = r.as_deref_mut() {
                    _mm512_storeu_ps(r.as_mut_ptr().add(i), _mm512_sub_ps(value, kept));
                }
                _mm512_storeu_ps(x.as_mut_ptr().add(i), kept);
            }
        }
        one_by_one::quantize(&mut x[main..], r.map(|r| &mut r[main..]), &mut q[main..], scale, inverse, true, true);
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
        let main = out.len() / W * W;
        let sc = _mm512_set1_ps(scale);
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within out and q (q.len() == out.len()).
            unsafe {
                let levels = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().add(i).cast()));
                let d = _mm512_mul_ps(_mm512_cvtepi32_ps(levels), sc);
                let o = out.as_mut_ptr().add(i);
                _mm512_storeu_ps(o, if ADD { _mm512_add_ps(_mm512_loadu_ps(o), d) } else { d });
            }
        }
        one_by_one::dequantize::<ADD>(&q[main..], scale, &mut out[main..]);
    }
}

/// Int8's block loops in AVX2 intrinsics, 8 values per step (as `avx512`; the level's byte is
/// picked by a byte shuffle).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::lanes::{one_by_one, Int8Ops};
    use super::ROUNDER;

    pub(super) struct Avx2;

    impl Int8Ops for Avx2 {
        #[inline(always)]
        unsafe fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
            // SAFETY: the caller runs on a CPU with AVX2.
            unsafe { max_bits(x, r) }
        }
        #[inline(always)]
        unsafe fn quantize(x: &[f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
            // SAFETY: as above.
            unsafe { quantize(x, r, q, scale, inverse) }
        }
        #[inline(always)]
        unsafe fn quantize_in_place(x: &mut [f32], r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
            // SAFETY: as above.
            unsafe { quantize_in_place(x, r, q, scale, inverse) }
        }
        #[inline(always)]
        unsafe fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { dequantize::<ADD>(q, scale, out) }
        }
    }

    const W: usize = 8;

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
        let main = x.len() / W * W;
        let magnitude = _mm256_set1_epi32(0x7fff_ffff);
        let mut acc = _mm256_setzero_si256();
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main <= x.len() (and r.len() == x.len()).
            let v = unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                match r {
                    Some(r) => _mm256_add_ps(v, _mm256_loadu_ps(r.as_ptr().add(i))),
                    None => v,
                }
            };
            acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
        }
        let mut lanes = [0u32; W];
        // SAFETY: `lanes` holds 32 bytes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
        let tail = one_by_one::max_bits(&x[main..], r.map(|r| &r[main..]));
        lanes.iter().fold(tail, |m, l| m.max(*l))
    }

    /// The 8 levels of `values` as the low 8 bytes of a register, and their decoded values.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn levels(values: __m256, inverse: __m256, scale: __m256) -> (__m128i, __m256) {
        let t = _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(values, inverse), _mm256_set1_ps(ROUNDER)));
        // Byte 0 of each 32-bit lane to the front of its 128-bit half, then both halves' first
        // dwords together.
        let picked = _mm256_shuffle_epi8(
            t,
            _mm256_setr_epi8(
                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1,
                -1, -1, -1, -1, -1,
            ),
        );
        let bytes =
            _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0)));
        let whole = _mm256_cvtepi32_ps(_mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(t)));
        (bytes, _mm256_mul_ps(whole, scale))
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn quantize(x: &[f32], mut r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
        let main = x.len() / W * W;
        let (inv, sc) = (_mm256_set1_ps(inverse), _mm256_set1_ps(scale));
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within x, q and r (all of x.len()).
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                match r.as_deref_mut() {
                    Some(r) => {
                        let value = _mm256_add_ps(v, _mm256_loadu_ps(r.as_ptr().add(i)));
                        let (bytes, kept) = levels(value, inv, sc);
                        _mm_storel_epi64(q.as_mut_ptr().add(i).cast(), bytes);
                        _mm256_storeu_ps(r.as_mut_ptr().add(i), _mm256_sub_ps(value, kept));
                    }
                    None => _mm_storel_epi64(q.as_mut_ptr().add(i).cast(), levels(v, inv, sc).0),
                }
            }
        }
        let mut tail = x[main..].to_vec();
        one_by_one::quantize(&mut tail, r.map(|r| &mut r[main..]), &mut q[main..], scale, inverse, true, false);
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn quantize_in_place(x: &mut [f32], mut r: Option<&mut [f32]>, q: &mut [u8], scale: f32, inverse: f32) {
        let main = x.len() / W * W;
        let (inv, sc) = (_mm256_set1_ps(inverse), _mm256_set1_ps(scale));
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within x, q and r (all of x.len()).
            unsafe {
                let mut value = _mm256_loadu_ps(x.as_ptr().add(i));
                if let Some(r) = r.as_deref() {
                    value = _mm256_add_ps(value, _mm256_loadu_ps(r.as_ptr().add(i)));
                }
                let (bytes, kept) = levels(value, inv, sc);
                _mm_storel_epi64(q.as_mut_ptr().add(i).cast(), bytes);
                if let Some(r) = r.as_deref_mut() {
                    _mm256_storeu_ps(r.as_mut_ptr().add(i), _mm256_sub_ps(value, kept));
                }
                _mm256_storeu_ps(x.as_mut_ptr().add(i), kept);
            }
        }
        one_by_one::quantize(&mut x[main..], r.map(|r| &mut r[main..]), &mut q[main..], scale, inverse, true, true);
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
        let main = out.len() / W * W;
        let sc = _mm256_set1_ps(scale);
        for i in (0..main).step_by(W) {
            // SAFETY: i + W <= main, within out and q (q.len() == out.len()).
            unsafe {
                let levels = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.as_ptr().add(i).cast()));
                let d = _mm256_mul_ps(_mm256_cvtepi32_ps(levels), sc);
                let o = out.as_mut_ptr().add(i);
                _mm256_storeu_ps(o, if ADD { _mm256_add_ps(_mm256_loadu_ps(o), d) } else { d });
            }
        }
        one_by_one::dequantize::<ADD>(&q[main..], scale, &mut out[main..]);
    }
}

#[cfg(test)]
mod tests {
    use super::{decode, decode_add, encode, reduce, Compression, Isa, Reencode};

    /// Values of every kind the kernels must treat alike: magnitudes from subnormal to near
    /// f32::MAX in blocks of their own, signed zeros, a block of zeros, and (with `specials`)
    /// an inf and a NaN.
    fn values(seed: u64, len: usize, specials: bool) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut v: Vec<f32> = (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let magnitude = [1e-3f32, 30.0, 1e-37, 1e-40, 3e37, 1.0, 0.0][(i / 37) % 7];
                unit * magnitude
            })
            .collect();
        for (i, x) in v.iter_mut().enumerate() {
            if i % 101 == 3 {
                *x = -0.0;
            }
        }
        if specials && len > 40 {
            v[len / 3] = f32::INFINITY;
            v[len / 2] = f32::NAN;
            v[len - 5] = f32::NEG_INFINITY;
            v[len - 1] = f32::from_bits(0x7fa0_0001); // a signalling NaN with a payload
        }
        v
    }

    /// Each value's bits, every NaN as the one quiet NaN: which of two NaN operands' payloads an
    /// addition keeps depends on the operands' order, which the compiler may swap (an addition
    /// commutes), so an optimized build's scalar code gave 0x7fe00001 where AVX2 gave 0x7fe00000
    /// for the same two NaNs. Every other value must match bit for bit.
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() }).collect()
    }

    const CODECS: [Compression; 9] = [
        Compression::None,
        Compression::Bf16,
        Compression::Int8 { block: 1 },
        Compression::Int8 { block: 7 },
        Compression::Int8 { block: 16 },
        Compression::Int8 { block: 33 },
        Compression::Int8 { block: 64 },
        Compression::Int8 { block: 256 },
        Compression::Int8 { block: 1000 },
    ];
    const LENS: [usize; 11] = [0, 1, 15, 16, 17, 255, 256, 257, 1000, 2049, 4099];

    /// One implementation's outputs for one case, to compare with the scalar's.
    #[derive(Debug, PartialEq, Eq)]
    struct Outputs {
        payload: Vec<u8>,
        residual: Vec<u32>,
        plain_payload: Vec<u8>,
        decoded: Vec<u32>,
        added: Vec<u32>,
        reduced: Vec<u32>,
        scattered: Vec<u32>,
        second_payload: Vec<u8>,
        second_residual: Vec<u32>,
        unfed: Vec<u32>,
        unfed_payload: Vec<u8>,
    }

    fn run(isa: Isa, codec: Compression, len: usize, specials: bool, n: usize) -> Outputs {
        let bytes = codec.payload_bytes(len);
        let input = values(1, len, specials);
        // A residual carried from an earlier step.
        let mut residual: Vec<f32> = values(2, len, false).iter().map(|x| x * 1e-3).collect();
        let mut payload = vec![0u8; bytes];
        encode(isa, codec, &input, &mut payload, Some(&mut residual));
        let mut plain_payload = vec![0u8; bytes];
        encode(isa, codec, &input, &mut plain_payload, None);
        let mut decoded = vec![7f32; len];
        decode(isa, codec, &payload, &mut decoded);
        let mut added = values(3, len, specials);
        decode_add(isa, codec, &payload, &mut added);

        // n ranks' payloads of one shard, reduced with and without the second encoding.
        let payloads: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                let mut p = vec![0u8; bytes];
                encode(Isa::Scalar, codec, &values(10 + r as u64, len, specials && r == 1), &mut p, None);
                p
            })
            .collect();
        let views: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
        let mut scattered = vec![1f32; len];
        reduce(isa, codec, &views, n as f32, &mut scattered, None);
        let mut reduced = vec![1f32; len];
        let mut second_payload = vec![0u8; bytes];
        let mut second_residual: Vec<f32> = values(4, len, false).iter().map(|x| x * 1e-2).collect();
        let reencode = Reencode { payload: &mut second_payload, residual: Some(&mut second_residual) };
        reduce(isa, codec, &views, n as f32, &mut reduced, Some(reencode));
        let mut unfed = vec![1f32; len];
        let mut unfed_payload = vec![0u8; bytes];
        reduce(
            isa,
            codec,
            &views,
            n as f32,
            &mut unfed,
            Some(Reencode { payload: &mut unfed_payload, residual: None }),
        );
        Outputs {
            payload,
            residual: bits(&residual),
            plain_payload,
            decoded: bits(&decoded),
            added: bits(&added),
            reduced: bits(&reduced),
            scattered: bits(&scattered),
            second_payload,
            second_residual: bits(&second_residual),
            unfed: bits(&unfed),
            unfed_payload,
        }
    }

    #[test]
    fn every_vector_implementation_gives_the_scalar_bits() {
        let isas = Isa::available();
        eprintln!("implementations on this CPU: {isas:?} (best {:?})", Isa::best());
        for codec in CODECS {
            for len in LENS {
                for specials in [false, true] {
                    for n in [1usize, 2, 3] {
                        let want = run(Isa::Scalar, codec, len, specials, n);
                        for &isa in &isas[1..] {
                            let got = run(isa, codec, len, specials, n);
                            assert!(
                                got == want,
                                "{isa:?} differs from the scalar code: {codec:?}, {len} values, specials {specials}, \
                                 {n} payloads:\n{}",
                                first_difference(&got, &want)
                            );
                        }
                    }
                }
            }
        }
    }

    fn first_difference(got: &Outputs, want: &Outputs) -> String {
        fn at<T: PartialEq + std::fmt::Debug>(name: &str, a: &[T], b: &[T]) -> Option<String> {
            let i = a.iter().zip(b).position(|(x, y)| x != y)?;
            Some(format!("{name}[{i}]: {:?} against the scalar's {:?}", a[i], b[i]))
        }
        [
            at("payload", &got.payload, &want.payload),
            at("residual", &got.residual, &want.residual),
            at("plain_payload", &got.plain_payload, &want.plain_payload),
            at("decoded", &got.decoded, &want.decoded),
            at("added", &got.added, &want.added),
            at("reduced", &got.reduced, &want.reduced),
            at("scattered", &got.scattered, &want.scattered),
            at("second_payload", &got.second_payload, &want.second_payload),
            at("second_residual", &got.second_residual, &want.second_residual),
            at("unfed", &got.unfed, &want.unfed),
            at("unfed_payload", &got.unfed_payload, &want.unfed_payload),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("\n")
    }

    #[test]
    fn special_blocks_decode_as_defined() {
        // Checked on the best implementation; the test above ties the others to it.
        let isa = Isa::best();
        let codec = Compression::Int8 { block: 4 };
        let values = [0.0, -0.0, 0.0, 0.0, 1.0, f32::INFINITY, 2.0, 3.0, 1e-38, 5e-39, -1e-38, 0.0];
        let mut payload = vec![0u8; codec.payload_bytes(values.len())];
        let mut residual = vec![0f32; values.len()];
        encode(isa, codec, &values, &mut payload, Some(&mut residual));
        let mut decoded = vec![1f32; values.len()];
        decode(isa, codec, &payload, &mut decoded);
        assert_eq!(bits(&decoded[..4]), [0; 4], "a zero block decodes to +0.0");
        assert!(decoded[4..8].iter().all(|v| v.to_bits() == f32::NAN.to_bits()), "{decoded:?}");
        assert_eq!(&residual[..8], &[0.0; 8], "no residual from zero and non-finite blocks");
        // A block too small for its inverse step (127 / max overflows) sends zeros and keeps
        // everything in its residual, as the definition does.
        assert_eq!(&decoded[8..], &[0.0; 4]);
        assert_eq!(bits(&residual[8..]), bits(&values[8..]));
    }
}

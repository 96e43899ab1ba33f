//! The compressor's kernels: encoding fp32 values (plus an error-feedback residual) into int8,
//! bf16 or fp32 payloads, decoding them, and the fused pass of a reduction's finish.
//!
//! Two implementations of every kernel give the same bits:
//! - `scalar`: one value at a time, the definition (and the fallback on CPUs without AVX2).
//! - `lanes`: the same arithmetic restructured for vector units (16 independent lanes, the block
//!   maximum taken over the magnitudes' bit patterns as integers, selections instead of branches,
//!   the fused pass tiled so that it reads and writes memory once), compiled twice on x86-64, for
//!   AVX-512 (with BW) and for AVX2, and picked at run time like the fused optimizer's kernel.
//!
//! Every step is one IEEE operation on one value (an add, a multiply, a divide, bit moves), never
//! contracted or reassociated, so the two give the same bits whatever the vector width: the unit
//! tests check each variant the CPU has against `scalar`, bit for bit, on odd sizes and blocks,
//! zero, infinite and NaN values.

use super::Compression;

/// 1.5 x 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer.
const ROUNDER: f32 = 12_582_912.0;
/// An f32's exponent bits: a magnitude's bits at or above this are inf or NaN.
const EXPONENT: u32 = 0x7f80_0000;
/// Lanes of the restructured loops: one AVX-512 register of f32.
const LANES: usize = 16;
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
                #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    lanes::$name($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    lanes::$name($($arg),*)
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

/// The same kernels in 16 independent lanes, written so that the compiler vectorizes every loop
/// (fixed-width chunks, no data-dependent branch inside a chunk). Every function is
/// `#[inline(always)]` so that it is compiled inside the dispatching `#[target_feature]`
/// wrappers.
mod lanes {
    use super::{Compression, Reencode, EXPONENT, LANES, ROUNDER, TILE};

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
    struct Step {
        scale: f32,
        inverse: f32,
        finite: bool,
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

    /// The largest magnitude's bits of `x` (plus `r`, when given).
    #[inline(always)]
    fn max_bits(x: &[f32], r: Option<&[f32]>) -> u32 {
        let mut lanes = [0u32; LANES];
        let mut tail = 0u32;
        match r {
            None => {
                let chunks = x.chunks_exact(LANES);
                for v in chunks.remainder() {
                    tail = tail.max(v.to_bits() & 0x7fff_ffff);
                }
                for c in chunks {
                    for k in 0..LANES {
                        lanes[k] = lanes[k].max(c[k].to_bits() & 0x7fff_ffff);
                    }
                }
            }
            Some(r) => {
                let (chunks, carried) = (x.chunks_exact(LANES), r.chunks_exact(LANES));
                for (v, r) in chunks.remainder().iter().zip(carried.remainder()) {
                    tail = tail.max((v + r).to_bits() & 0x7fff_ffff);
                }
                for (c, d) in chunks.zip(carried) {
                    for k in 0..LANES {
                        lanes[k] = lanes[k].max((c[k] + d[k]).to_bits() & 0x7fff_ffff);
                    }
                }
            }
        }
        lanes.iter().fold(tail, |m, l| m.max(*l))
    }

    /// The level of `x` as a byte (its i8; see the definition's comment), and the value that
    /// level decodes to with `scale`.
    #[inline(always)]
    fn level(x: f32, inverse: f32, scale: f32) -> (u8, f32) {
        let byte = (x * inverse + ROUNDER).to_bits() as u8;
        (byte, f32::from(byte as i8) * scale)
    }

    /// Quantizes one int8 block of `x` (plus `r`) into `q`; `r` becomes what decoding loses.
    #[inline(always)]
    fn quantize(x: &[f32], r: Option<&mut [f32]>, q: &mut [u8], step: Step) {
        let Step { scale, inverse, finite } = step;
        match r {
            None => {
                let (xs, qs) = (x.chunks_exact(LANES), q.chunks_exact_mut(LANES));
                for (v, q) in xs.remainder().iter().zip(qs.into_remainder()) {
                    *q = level(*v, inverse, scale).0;
                }
                for (v, q) in x.chunks_exact(LANES).zip(q.chunks_exact_mut(LANES)) {
                    for k in 0..LANES {
                        q[k] = level(v[k], inverse, scale).0;
                    }
                }
            }
            Some(r) => {
                let one = |v: f32, r: &mut f32, q: &mut u8| {
                    let x = v + *r;
                    let (byte, kept) = level(x, inverse, scale);
                    *q = byte;
                    *r = if finite { x - kept } else { 0.0 };
                };
                let split = x.len() / LANES * LANES;
                let (x_main, x_tail) = x.split_at(split);
                let (r_main, r_tail) = r.split_at_mut(split);
                let (q_main, q_tail) = q.split_at_mut(split);
                for ((v, r), q) in x_tail.iter().zip(r_tail).zip(q_tail) {
                    one(*v, r, q);
                }
                for ((v, r), q) in
                    x_main.chunks_exact(LANES).zip(r_main.chunks_exact_mut(LANES)).zip(q_main.chunks_exact_mut(LANES))
                {
                    for k in 0..LANES {
                        one(v[k], &mut r[k], &mut q[k]);
                    }
                }
            }
        }
    }

    /// As [`quantize`], and `x` replaced by the decoded value ((q as i8) x scale; NaN in a
    /// non-finite block, as decoding its NaN scale gives).
    #[inline(always)]
    fn quantize_in_place(x: &mut [f32], r: Option<&mut [f32]>, q: &mut [u8], step: Step) {
        let Step { scale, inverse, finite } = step;
        let one = |x: &mut f32, r: Option<&mut f32>, q: &mut u8| {
            let value = match &r {
                Some(r) => *x + **r,
                None => *x,
            };
            let (byte, kept) = level(value, inverse, scale);
            *q = byte;
            if let Some(r) = r {
                *r = if finite { value - kept } else { 0.0 };
            }
            *x = if finite { kept } else { f32::NAN };
        };
        let split = x.len() / LANES * LANES;
        let (x_main, x_tail) = x.split_at_mut(split);
        let (q_main, q_tail) = q.split_at_mut(split);
        match r {
            None => {
                for (x, q) in x_tail.iter_mut().zip(q_tail) {
                    one(x, None, q);
                }
                for (x, q) in x_main.chunks_exact_mut(LANES).zip(q_main.chunks_exact_mut(LANES)) {
                    for k in 0..LANES {
                        one(&mut x[k], None, &mut q[k]);
                    }
                }
            }
            Some(r) => {
                let (r_main, r_tail) = r.split_at_mut(split);
                for ((x, r), q) in x_tail.iter_mut().zip(r_tail).zip(q_tail) {
                    one(x, Some(r), q);
                }
                for ((x, r), q) in
                    x_main.chunks_exact_mut(LANES).zip(r_main.chunks_exact_mut(LANES)).zip(q_main.chunks_exact_mut(LANES))
                {
                    for k in 0..LANES {
                        one(&mut x[k], Some(&mut r[k]), &mut q[k]);
                    }
                }
            }
        }
    }

    /// `out[i] (+)= (q[i] as i8) x scale` over one block.
    #[inline(always)]
    fn dequantize<const ADD: bool>(q: &[u8], scale: f32, out: &mut [f32]) {
        let one = |o: &mut f32, q: u8| {
            let d = f32::from(q as i8) * scale;
            *o = if ADD { *o + d } else { d };
        };
        let split = out.len() / LANES * LANES;
        let (o_main, o_tail) = out.split_at_mut(split);
        let (q_main, q_tail) = q.split_at(split);
        for (o, q) in o_tail.iter_mut().zip(q_tail) {
            one(o, *q);
        }
        for (o, q) in o_main.chunks_exact_mut(LANES).zip(q_main.chunks_exact(LANES)) {
            for k in 0..LANES {
                one(&mut o[k], q[k]);
            }
        }
    }

    /// The scale of block `b` of an int8 payload whose scales are `scales`.
    #[inline(always)]
    fn scale_of(scales: &[u8], b: usize) -> f32 {
        load_f32(&scales[4 * b..4 * b + 4])
    }

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
                    let step = Step::of(max_bits(x, r.as_deref()));
                    scales[4 * b..4 * b + 4].copy_from_slice(&step.scale.to_le_bytes());
                    quantize(x, r, q, step);
                }
            }
        }
    }

    pub(super) fn decode_add(codec: Compression, payload: &[u8], acc: &mut [f32]) {
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
                    dequantize::<true>(q, scale_of(scales, b), o);
                }
            }
        }
    }

    pub(super) fn decode(codec: Compression, payload: &[u8], out: &mut [f32]) {
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
                    dequantize::<false>(q, scale_of(scales, b), o);
                }
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
                    Compression::None => decode_add(codec, &payload[4 * span.start..4 * span.end], o),
                    Compression::Bf16 => decode_add(codec, &payload[2 * span.start..2 * span.end], o),
                    Compression::Int8 { .. } => {
                        let q = &payload[4 * n_blocks + span.start..4 * n_blocks + span.end];
                        dequantize::<true>(q, scale_of(payload, t), o);
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
                    encode(codec, o, payload, r);
                    decode(codec, payload, o);
                }
                Compression::Int8 { .. } => {
                    let step = Step::of(max_bits(o, r.as_deref()));
                    send[4 * t..4 * t + 4].copy_from_slice(&step.scale.to_le_bytes());
                    let q = &mut send[4 * n_blocks + span.start..4 * n_blocks + span.end];
                    quantize_in_place(o, r, q, step);
                }
            }
        }
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

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
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
        reduce(isa, codec, &views, n as f32, &mut unfed, Some(Reencode { payload: &mut unfed_payload, residual: None }));
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

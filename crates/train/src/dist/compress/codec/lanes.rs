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
pub(super) fn encode<O: Int8Ops>(codec: Compression, values: &[f32], payload: &mut [u8], residual: Option<&mut [f32]>) {
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

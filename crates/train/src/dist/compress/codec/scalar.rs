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

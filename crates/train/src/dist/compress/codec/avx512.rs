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

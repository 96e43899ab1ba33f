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
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
            -1, -1, -1, -1,
        ),
    );
    let bytes = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0)));
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

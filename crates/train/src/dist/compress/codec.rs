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

mod format;

/// One value at a time: the definition of every kernel.
mod scalar;

/// The same kernels restructured for vector units: bf16 and fp32 as plain loops the compiler
/// vectorizes (bit moves and selections, no branch per value), int8's block loops through the
/// explicit AVX-512 or AVX2 code of `Int8Ops`, the fused reduction tiled. Every function is
/// `#[inline(always)]` so that it is compiled inside the dispatching `#[target_feature]`
/// wrappers.
#[cfg(target_arch = "x86_64")]
mod lanes;

/// Int8's block loops in AVX-512 (F and BW) intrinsics, 16 values per step. Each step is the
/// definition's operation on every lane: the same IEEE adds and multiplies, the level's byte by
/// truncation (`vpmovdb`) and its i8 sign-extended back, so the bits equal the scalar code's.
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Int8's block loops in AVX2 intrinsics, 8 values per step (as `avx512`; the level's byte is
/// picked by a byte shuffle).
#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests;

pub use format::Compression;
pub(crate) use format::Reencode;

use format::{finite_or_zero, EXPONENT, ROUNDER, TILE};

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

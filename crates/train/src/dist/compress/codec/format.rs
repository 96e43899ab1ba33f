//! What a payload is: the formats values travel in, their sizes, and the constants and
//! helpers every implementation of the kernels shares.

/// How values travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// fp32, 4 bytes per value: lossless.
    None,
    /// bf16, 2 bytes per value, rounded to nearest even.
    Bf16,
    /// Per block of `block` values an f32 scale (max |x| / 127) and one i8 per value.
    Int8 { block: usize },
}

impl Compression {
    /// Bytes of the payload that encodes `values` values.
    pub fn payload_bytes(self, values: usize) -> usize {
        match self {
            Compression::None => 4 * values,
            Compression::Bf16 => 2 * values,
            Compression::Int8 { block } => 4 * values.div_ceil(block.max(1)) + values,
        }
    }
}

/// 1.5 x 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer.
pub(super) const ROUNDER: f32 = 12_582_912.0;
/// An f32's exponent bits: a magnitude's bits at or above this are inf or NaN.
pub(super) const EXPONENT: u32 = 0x7f80_0000;
/// Values per tile of the fused reduction pass for bf16 and fp32 payloads (int8 tiles are its
/// blocks): small enough to stay in L1 between the tile's steps.
pub(super) const TILE: usize = 2048;

/// The second half of an all-reduce's fused pass: the averaged shard (plus `residual`) encoded
/// into `payload`, and the shard replaced by what that payload decodes to.
pub(crate) struct Reencode<'a> {
    pub(crate) payload: &'a mut [u8],
    pub(crate) residual: Option<&'a mut [f32]>,
}

/// A value as itself, or 0 when it is not finite (what a residual keeps of an inf or a NaN).
pub(super) fn finite_or_zero(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

//! The manifests' CRC-32, taken 32 bytes at a time from AVX2 registers: for a kernel that already
//! holds the bytes it saves in registers (the optimizer's update, which streams the old values
//! into a snapshot's rooms), so the checksum costs no load of its own.
//!
//! Carry-less multiplication folding (VPCLMULQDQ), the method of Intel's "Fast CRC Computation for
//! Generic Polynomials Using PCLMULQDQ": the accumulator holds the last 32 bytes, as two 128-bit
//! lanes, and each new 32 bytes are added after multiplying each lane by x^256 mod P (which moves
//! it 32 bytes on). At the end the first lane is folded onto the second (x^128), and the 128 bits
//! are reduced to 32 (x^64, then Barrett). The constants are x^k mod P, bit-reflected and shifted
//! left by one, for the reflected CRC-32 (IEEE 802.3, what `crc32fast` computes); the test
//! derives them from the polynomial and checks the whole against `crc32fast`.

use std::arch::x86_64::*;

/// Lane constants to fold by 256 bits: low qword x^(256+32) mod P, high qword x^(256-32) mod P.
const FOLD_256: (u64, u64) = (0x0_f1da_05aa, 0x1_5a54_6366);
/// To fold by 128 bits: x^(128+32) and x^(128-32) mod P.
const FOLD_128: (u64, u64) = (0x1_7519_97d0, 0x0_ccaa_009e);
/// x^64 mod P: from 64 bits to 32.
const FOLD_64: u64 = 0x1_63cd_6124;
/// Barrett reduction: the polynomial P (reflected, low qword) and floor(x^64 / P) (high qword).
const BARRETT: (u64, u64) = (0x1_db71_0641, 0x1_f701_1641);

/// Whether this CPU runs `Crc32x256` (AVX2 with 256-bit VPCLMULQDQ).
pub fn crc32x256_available() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("pclmulqdq")
        && std::is_x86_feature_detected!("vpclmulqdq")
        && std::is_x86_feature_detected!("sse4.1")
}

/// A CRC-32 being computed over bytes handed in 32 at a time, in order (`absorb`); `finish` gives
/// what `crc32fast::hash` gives for those bytes. Only where `crc32x256_available`.
#[derive(Clone, Copy)]
pub struct Crc32x256 {
    acc: __m256i,
    /// The CRC's initial value, still to be added into the first bytes (zero after them).
    pending: __m256i,
    bytes: u64,
}

impl Crc32x256 {
    /// # Safety
    /// The CPU must have what `crc32x256_available` checks.
    #[inline]
    #[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq,sse4.1")]
    pub unsafe fn new() -> Crc32x256 {
        // The register's initial value, all ones, goes into the first four bytes.
        Crc32x256 { acc: _mm256_setzero_si256(), pending: _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, -1), bytes: 0 }
    }

    /// Adds the next 32 bytes (in memory order: the register as `_mm256_loadu_*` loads them).
    ///
    /// # Safety
    /// The CPU must have what `crc32x256_available` checks.
    #[inline]
    #[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq,sse4.1")]
    pub unsafe fn absorb(&mut self, data: __m256i) {
        let k = _mm256_set_epi64x(FOLD_256.1 as i64, FOLD_256.0 as i64, FOLD_256.1 as i64, FOLD_256.0 as i64);
        // The accumulator is zero before the first bytes, so folding it then adds nothing.
        let low = _mm256_clmulepi64_epi128(self.acc, k, 0x00);
        let high = _mm256_clmulepi64_epi128(self.acc, k, 0x11);
        self.acc = _mm256_xor_si256(_mm256_xor_si256(low, high), _mm256_xor_si256(data, self.pending));
        self.pending = _mm256_setzero_si256();
        self.bytes += 32;
    }

    /// Bytes absorbed so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The CRC-32 of the bytes absorbed (0 for none), as `crc32fast::hash` computes it.
    ///
    /// # Safety
    /// The CPU must have what `crc32x256_available` checks.
    #[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq,sse4.1")]
    pub unsafe fn finish(self) -> u32 {
        if self.bytes == 0 {
            return 0;
        }
        let first = _mm256_castsi256_si128(self.acc);
        let second = _mm256_extracti128_si256(self.acc, 1);
        // The first lane moved on by 128 bits, onto the second.
        let k128 = _mm_set_epi64x(FOLD_128.1 as i64, FOLD_128.0 as i64);
        let x = _mm_xor_si128(
            _mm_xor_si128(_mm_clmulepi64_si128(first, k128, 0x00), _mm_clmulepi64_si128(first, k128, 0x11)),
            second,
        );
        // 128 bits to 64: the low qword times x^(128-32) mod P, added to the high qword.
        let x = _mm_xor_si128(_mm_clmulepi64_si128(x, k128, 0x10), _mm_srli_si128(x, 8));
        // 64 bits to 32.
        let mask32 = _mm_set_epi32(0, 0, 0, -1);
        let k64 = _mm_set_epi64x(0, FOLD_64 as i64);
        let x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, mask32), k64, 0x00));
        // Barrett: q = (x mod x^32) * mu, then x - (q mod x^32) * P; the CRC is the second dword.
        let barrett = _mm_set_epi64x(BARRETT.1 as i64, BARRETT.0 as i64);
        let q = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x, mask32), barrett, 0x10), mask32);
        let x = _mm_xor_si128(x, _mm_clmulepi64_si128(q, barrett, 0x00));
        !(_mm_extract_epi32(x, 1) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x^n mod P for the CRC-32 polynomial, bit-reflected and shifted left by one.
    fn constant(n: u32) -> u64 {
        let mut r: u64 = 1;
        for _ in 0..n {
            r <<= 1;
            if r >> 32 & 1 == 1 {
                r ^= 0x1_04c1_1db7;
            }
        }
        u64::from((r as u32).reverse_bits()) << 1
    }

    #[test]
    fn the_constants_are_the_polynomials_powers() {
        assert_eq!(FOLD_256, (constant(256 + 32), constant(256 - 32)));
        assert_eq!(FOLD_128, (constant(128 + 32), constant(128 - 32)));
        assert_eq!(FOLD_64, constant(64));
        // P reflected to 33 bits, and floor(x^64 / P) reflected.
        assert_eq!(BARRETT.0, u64::from(0x04c1_1db7u32.reverse_bits()) << 1 | 1);
        let mut mu: u128 = 0;
        let mut rest: u128 = 1 << 64;
        while rest >> 32 != 0 {
            let shift = (127 - rest.leading_zeros()) - 32;
            mu |= 1 << shift;
            rest ^= 0x1_04c1_1db7u128 << shift;
        }
        assert_eq!(BARRETT.1, (mu as u64).reverse_bits() >> 31);
    }

    #[test]
    fn gives_crc32fasts_value_for_every_length() {
        if !crc32x256_available() {
            eprintln!("skipped: this CPU has no 256-bit VPCLMULQDQ");
            return;
        }
        let bytes: Vec<u8> = (0..32 * 300).map(|i: usize| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        for vectors in (0..300).step_by(7).chain([1, 2, 3]) {
            let data = &bytes[..32 * vectors];
            // SAFETY: checked above; each load reads 32 bytes inside `data`.
            let crc = unsafe {
                let mut crc = Crc32x256::new();
                for chunk in data.chunks_exact(32) {
                    crc.absorb(_mm256_loadu_si256(chunk.as_ptr().cast()));
                }
                assert_eq!(crc.bytes(), data.len() as u64);
                crc.finish()
            };
            assert_eq!(crc, crc32fast::hash(data), "{vectors} vectors");
        }
    }
}

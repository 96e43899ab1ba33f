//! Frame augmentation at training time: a random resized crop (torchvision's RandomResizedCrop:
//! an area fraction and an aspect ratio drawn, the crop resized to the output side) and colour
//! jitter (brightness, contrast, saturation factors around 1). No flips: mirroring a scene changes
//! what an action means. Every draw comes from the generator it is given, so a sample's
//! augmentation is a pure function of (seed, epoch, sample, camera).

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
    /// Largest change of brightness, contrast and saturation, as a fraction. Default 0.2.
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
    /// once at the end.
    /// The frame may borrow its pixels (a decoded frame straight from a memory-mapped shard).
    pub fn apply<C: Deref<Target = [u8]>>(&self, frame: &ImageBuffer<Rgb<u8>, C>, side: u32, out: &mut Vec<u8>) {
        let (fw, fh) = (frame.width() as f64, frame.height() as f64);
        let [x, y, w, h] = self.crop;
        let (cx, cy) = ((x * fw) as u32, (y * fh) as u32);
        let cw = ((w * fw).round() as u32).clamp(1, frame.width() - cx);
        let ch = ((h * fh).round() as u32).clamp(1, frame.height() - cy);
        let start = out.len();
        out.resize(start + (side * side * 3) as usize, 0);
        let pixels = &mut out[start..];
        resize_bilinear(frame, [cx, cy, cw, ch], side, pixels);
        if (self.brightness, self.contrast, self.saturation) == (1.0, 1.0, 1.0) {
            return;
        }
        let (b, c, s) = (self.brightness, self.contrast, self.saturation);
        const GREY: [f32; 3] = [0.299, 0.587, 0.114];
        let sum: f32 =
            pixels.chunks_exact(3).map(|p| GREY[0] * p[0] as f32 + GREY[1] * p[1] as f32 + GREY[2] * p[2] as f32).sum();
        let mean_grey = b * sum / (pixels.len() / 3) as f32;
        // out_k = s*c*b*v_k + (1-s)*c*b*grey(v) + mean_grey*(1-c): a 3x3 matrix and an offset.
        let (own, mix, offset) = (s * c * b, (1.0 - s) * c * b, mean_grey * (1.0 - c));
        let matrix: [[f32; 3]; 3] =
            std::array::from_fn(|row| std::array::from_fn(|col| mix * GREY[col] + if row == col { own } else { 0.0 }));
        for p in pixels.chunks_exact_mut(3) {
            let v = [p[0] as f32, p[1] as f32, p[2] as f32];
            for (dst, row) in p.iter_mut().zip(&matrix) {
                let value = row[0] * v[0] + row[1] * v[1] + row[2] * v[2] + offset;
                // Clamped to [0, 255], then rounded half up by the cast (no libm call per value).
                *dst = (value.clamp(0.0, 255.0) + 0.5) as u8;
            }
        }
    }
}

/// Bilinear resize of the `[x, y, w, h]` window of `frame` to `side` x `side` RGB into `out`,
/// separably: each source row the output needs is interpolated across once (kept while the next
/// output row still needs it), then output rows blend two of those.
fn resize_bilinear<C: Deref<Target = [u8]>>(
    frame: &ImageBuffer<Rgb<u8>, C>,
    [x0, y0, w, h]: [u32; 4],
    side: u32,
    out: &mut [u8],
) {
    let (raw, stride): (&[u8], usize) = (frame.as_raw(), frame.width() as usize * 3);
    if (w, h) == (side, side) {
        // Same size: the window's rows as they are.
        for (row_idx, row_out) in out.chunks_exact_mut(side as usize * 3).enumerate() {
            let begin = (y0 as usize + row_idx) * stride + x0 as usize * 3;
            row_out.copy_from_slice(&raw[begin..begin + side as usize * 3]);
        }
        return;
    }
    // Source coordinate of each output index along one axis: (low, high, weight of high), pixel
    // centres aligned, clamped at the window's edges.
    let taps = |len: u32| -> Vec<(usize, usize, f32)> {
        let scale = len as f32 / side as f32;
        (0..side)
            .map(|i| {
                let src = ((i as f32 + 0.5) * scale - 0.5).clamp(0.0, (len - 1) as f32);
                let low = src.floor() as u32;
                (low as usize, (low + 1).min(len - 1) as usize, src - low as f32)
            })
            .collect()
    };
    let (columns, rows) = (taps(w), taps(h));
    let width = side as usize * 3;
    let across = |source_row: usize, dst: &mut [f32]| {
        let begin = (y0 as usize + source_row) * stride + x0 as usize * 3;
        let src = &raw[begin..begin + w as usize * 3];
        for (pixel, &(left, right, wx)) in dst.chunks_exact_mut(3).zip(&columns) {
            for k in 0..3 {
                let (l, r) = (src[left * 3 + k] as f32, src[right * 3 + k] as f32);
                pixel[k] = l + (r - l) * wx;
            }
        }
    };
    // Two interpolated source rows and which they are.
    let (mut upper, mut lower) = (vec![0f32; width], vec![0f32; width]);
    let (mut upper_row, mut lower_row) = (usize::MAX, usize::MAX);
    for (row_out, &(top, bottom, wy)) in out.chunks_exact_mut(width).zip(&rows) {
        if upper_row != top {
            if lower_row == top {
                std::mem::swap(&mut upper, &mut lower);
                lower_row = usize::MAX;
            } else {
                across(top, &mut upper);
            }
            upper_row = top;
        }
        if lower_row != bottom {
            across(bottom, &mut lower);
            lower_row = bottom;
        }
        for ((dst, &a), &b) in row_out.iter_mut().zip(&upper).zip(&lower) {
            *dst = (a + (b - a) * wy + 0.5) as u8;
        }
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
}

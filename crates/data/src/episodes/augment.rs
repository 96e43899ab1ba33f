//! Frame augmentation at training time: a random resized crop (torchvision's RandomResizedCrop:
//! an area fraction and an aspect ratio drawn, the crop resized to the output side) and colour
//! jitter (brightness, contrast, saturation factors around 1). No flips: mirroring a scene changes
//! what an action means. Every draw comes from the generator it is given, so a sample's
//! augmentation is a pure function of (seed, epoch, sample, camera).

use image::RgbImage;

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

    /// `frame` cropped, resized to `side` x `side` and jittered, as HWC uint8 appended to `out`.
    pub fn apply(&self, frame: &RgbImage, side: u32, out: &mut Vec<u8>) {
        let (fw, fh) = (frame.width() as f64, frame.height() as f64);
        let [x, y, w, h] = self.crop;
        let (cx, cy) = ((x * fw) as u32, (y * fh) as u32);
        let cw = ((w * fw).round() as u32).clamp(1, frame.width() - cx);
        let ch = ((h * fh).round() as u32).clamp(1, frame.height() - cy);
        let cropped = image::imageops::crop_imm(frame, cx, cy, cw, ch).to_image();
        let resized = if (cw, ch) == (side, side) {
            cropped
        } else {
            image::imageops::resize(&cropped, side, side, image::imageops::FilterType::Triangle)
        };
        let start = out.len();
        out.extend_from_slice(resized.as_raw());
        if (self.brightness, self.contrast, self.saturation) == (1.0, 1.0, 1.0) {
            return;
        }
        let pixels = &mut out[start..];
        // Contrast blends toward the frame's mean grey, saturation toward each pixel's grey
        // (torchvision's order: brightness, contrast, saturation).
        let grey = |p: &[f32; 3]| 0.299 * p[0] + 0.587 * p[1] + 0.114 * p[2];
        let n = (pixels.len() / 3) as f32;
        let mean_grey: f32 =
            pixels.chunks_exact(3).map(|p| grey(&[p[0] as f32, p[1] as f32, p[2] as f32])).sum::<f32>() / n;
        for p in pixels.chunks_exact_mut(3) {
            let mut v = [p[0] as f32, p[1] as f32, p[2] as f32].map(|c| c * self.brightness);
            let m = mean_grey * self.brightness;
            v = v.map(|c| m + (c - m) * self.contrast);
            let g = grey(&v);
            v = v.map(|c| g + (c - g) * self.saturation);
            for (dst, c) in p.iter_mut().zip(v) {
                *dst = c.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_keeps_a_frame_and_draws_are_reproducible() {
        let frame = RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8 * 10, y as u8 * 10, 77]));
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

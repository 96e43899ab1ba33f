//! GPU health through NVML (the `nvml-wrapper` binding, which loads `libnvidia-ml.so.1` at run
//! time): per device utilisation, memory, power, temperature and clocks, sampled by the profiler
//! of a run on a GPU, served in `/metrics` and summarised in report.json's `gpus`. A binary built
//! with it runs anywhere; opening it where the driver's library is missing is an error naming it.

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

use crate::ProfError;

/// NVML's library, as the driver installs it.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// One reading of one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// The device's NVML index (its index among all the machine's devices, not the visible ones).
    pub index: u32,
    pub name: String,
    /// Share of the last sample period a kernel ran (0..1).
    pub utilization: f64,
    /// Share of the period device memory was read or written (0..1).
    pub memory_utilization: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub power_w: f64,
    pub temperature_c: f64,
    pub sm_clock_mhz: f64,
    pub memory_clock_mhz: f64,
}

/// A run's readings of one device, for report.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSummary {
    pub index: u32,
    pub name: String,
    pub samples: u64,
    pub utilization_mean: f64,
    pub memory_used_peak_bytes: u64,
    pub memory_total_bytes: u64,
    pub power_mean_w: f64,
    pub temperature_max_c: f64,
    pub sm_clock_mean_mhz: f64,
}

impl GpuSummary {
    fn start(sample: &GpuSample) -> GpuSummary {
        GpuSummary {
            index: sample.index,
            name: sample.name.clone(),
            samples: 0,
            utilization_mean: 0.0,
            memory_used_peak_bytes: 0,
            memory_total_bytes: sample.memory_total_bytes,
            power_mean_w: 0.0,
            temperature_max_c: f64::MIN,
            sm_clock_mean_mhz: 0.0,
        }
    }

    fn add(&mut self, sample: &GpuSample) {
        let n = self.samples as f64;
        let mean = |old: f64, new: f64| (old * n + new) / (n + 1.0);
        self.utilization_mean = mean(self.utilization_mean, sample.utilization);
        self.power_mean_w = mean(self.power_mean_w, sample.power_w);
        self.sm_clock_mean_mhz = mean(self.sm_clock_mean_mhz, sample.sm_clock_mhz);
        self.memory_used_peak_bytes = self.memory_used_peak_bytes.max(sample.memory_used_bytes);
        self.temperature_max_c = self.temperature_max_c.max(sample.temperature_c);
        self.samples += 1;
    }
}

/// Summaries of every device seen in `samples`, by index.
pub fn summarize(samples: &[GpuSample]) -> Vec<GpuSummary> {
    let mut summaries = Vec::new();
    accumulate(&mut summaries, samples);
    summaries
}

/// Adds `samples` to running `summaries` (kept sorted by device index).
pub fn accumulate(summaries: &mut Vec<GpuSummary>, samples: &[GpuSample]) {
    for sample in samples {
        let at = match summaries.iter().position(|s| s.index == sample.index) {
            Some(at) => at,
            None => {
                summaries.push(GpuSummary::start(sample));
                summaries.len() - 1
            }
        };
        summaries[at].add(sample);
    }
    summaries.sort_by_key(|s| s.index);
}

/// The NVML index of CUDA device `cuda_index`: NVML counts every device of the machine, CUDA
/// only those `CUDA_VISIBLE_DEVICES` (`visible`) lists, in its order. None when `visible` names
/// devices by UUID or does not list that many.
pub fn nvml_index(cuda_index: u32, visible: Option<&str>) -> Option<u32> {
    match visible.map(str::trim) {
        None | Some("") => Some(cuda_index),
        Some(list) => list.split(',').nth(cuda_index as usize)?.trim().parse().ok(),
    }
}

/// NVML, opened, and the devices to read.
pub struct GpuHealth {
    nvml: Nvml,
    devices: Vec<u32>,
}

impl GpuHealth {
    /// Loads NVML from the driver's library and checks that every device in `devices` exists.
    pub fn open(devices: &[u32]) -> Result<GpuHealth, ProfError> {
        GpuHealth::open_library(NVML_LIBRARY, devices)
    }

    /// [`GpuHealth::open`] from the library at `library` (a name the loader searches, or a path).
    pub fn open_library(library: &str, devices: &[u32]) -> Result<GpuHealth, ProfError> {
        let unavailable = |reason: String| ProfError::GpuHealth { library: library.to_string(), reason };
        let nvml = Nvml::builder()
            .lib_path(std::ffi::OsStr::new(library))
            .init()
            .map_err(|err| unavailable(format!("cannot load or initialise NVML: {err}")))?;
        let count = nvml.device_count().map_err(|err| unavailable(format!("cannot count the devices: {err}")))?;
        if let Some(missing) = devices.iter().find(|&&d| d >= count) {
            return Err(unavailable(format!("device {missing} does not exist; NVML sees {count}")));
        }
        Ok(GpuHealth { nvml, devices: devices.to_vec() })
    }

    /// A reading of every device; a field NVML cannot give on a device reads 0 (power on some
    /// boards, clocks under virtualisation).
    pub fn sample(&self) -> Vec<GpuSample> {
        self.devices
            .iter()
            .filter_map(|&index| {
                let device = self.nvml.device_by_index(index).ok()?;
                let utilization = device.utilization_rates().ok();
                let memory = device.memory_info().ok();
                Some(GpuSample {
                    index,
                    name: device.name().unwrap_or_default(),
                    utilization: utilization.as_ref().map_or(0.0, |u| f64::from(u.gpu) / 100.0),
                    memory_utilization: utilization.as_ref().map_or(0.0, |u| f64::from(u.memory) / 100.0),
                    memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
                    memory_total_bytes: memory.as_ref().map_or(0, |m| m.total),
                    power_w: device.power_usage().map_or(0.0, |mw| f64::from(mw) / 1e3),
                    temperature_c: device.temperature(TemperatureSensor::Gpu).map_or(0.0, f64::from),
                    sm_clock_mhz: device.clock_info(Clock::SM).map_or(0.0, f64::from),
                    memory_clock_mhz: device.clock_info(Clock::Memory).map_or(0.0, f64::from),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: u32, utilization: f64, used: u64, temperature_c: f64) -> GpuSample {
        GpuSample {
            index,
            name: "H200".into(),
            utilization,
            memory_utilization: 0.5,
            memory_used_bytes: used,
            memory_total_bytes: 141 << 30,
            power_w: 500.0,
            temperature_c,
            sm_clock_mhz: 1980.0,
            memory_clock_mhz: 3201.0,
        }
    }

    #[test]
    fn a_missing_driver_library_is_named() {
        let err = GpuHealth::open_library("/nonexistent/libnvidia-ml.so.1", &[0]).err().expect("no such library");
        let text = err.to_string();
        assert!(text.contains("/nonexistent/libnvidia-ml.so.1") && text.contains("NVML"), "{text}");
    }

    #[test]
    fn cuda_visible_devices_maps_cuda_indices_to_nvml_ones() {
        assert_eq!(nvml_index(1, None), Some(1));
        assert_eq!(nvml_index(1, Some("4,6")), Some(6));
        assert_eq!(nvml_index(2, Some("4,6")), None);
        assert_eq!(nvml_index(0, Some("GPU-8f3a")), None);
    }

    #[test]
    fn readings_are_served_as_one_gauge_per_device_and_metric() {
        let metrics = crate::LiveMetrics::new();
        metrics.set_gpus(&[sample(0, 0.9, 1 << 30, 61.0), sample(3, 0.4, 2 << 30, 58.0)]);
        let text = metrics.encode();
        crate::validate_exposition(&text).unwrap();
        assert!(text.contains(r#"device="3",metric="temperature_celsius"} 58"#), "{text}");
        assert!(text.contains(r#"device="0",metric="utilization"} 0.9"#), "{text}");
    }

    #[test]
    fn summaries_are_per_device_means_and_peaks() {
        let samples =
            [sample(1, 0.5, 10, 60.0), sample(0, 1.0, 5, 70.0), sample(1, 1.0, 30, 65.0), sample(0, 0.0, 7, 50.0)];
        let summaries = summarize(&samples);
        assert_eq!(summaries.len(), 2);
        assert_eq!((summaries[0].index, summaries[0].samples), (0, 2));
        assert_eq!(summaries[0].utilization_mean, 0.5);
        assert_eq!(summaries[0].memory_used_peak_bytes, 7);
        assert_eq!(summaries[1].utilization_mean, 0.75);
        assert_eq!(summaries[1].temperature_max_c, 65.0);
        assert_eq!(summaries[1].memory_used_peak_bytes, 30);
    }
}

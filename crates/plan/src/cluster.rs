//! The machines a plan runs on: devices, their memory and peak FLOPs, the links between them, and
//! the efficiencies that turn peaks into predictions.

use serde::{Deserialize, Serialize};

use crate::PlanError;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Arithmetic precision of the matrix multiplies and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 everywhere: 4-byte weights, gradients and activations, Adam's two moments (K = 8).
    Fp32,
    /// Mixed precision: 2-byte weights, gradients and activations, an fp32 master copy plus Adam's
    /// moments (K = 12, the ZeRO paper's accounting).
    Bf16,
}

impl Precision {
    /// Bytes of one weight, one gradient, or one activation element.
    pub fn element_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Bf16 => 2.0,
        }
    }

    /// Optimizer-state bytes per parameter, the ZeRO paper's K.
    pub fn optimizer_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 8.0,
            Precision::Bf16 => 12.0,
        }
    }

    /// Parses "fp32" or "bf16".
    pub fn parse(text: &str) -> Result<Precision, PlanError> {
        match text {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(PlanError::InvalidConfig {
                key: "precision",
                message: format!("must be fp32 or bf16; got {other:?}"),
            }),
        }
    }
}

/// How much of each peak a real step reaches. A preset carries a prior; `stoke plan --calibrate`
/// fits the first five from measured runs of this machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Efficiency {
    /// Share of peak FLOP/s that the matrix multiplies reach. Default 0.6.
    pub compute: f64,
    /// Share of memory bandwidth that element-wise work (norms, activations, softmax) and the
    /// weights' traffic reach. Default 0.7.
    pub memory: f64,
    /// Share of memory bandwidth the optimizer's update reaches (counting the 28 bytes per
    /// parameter an ideal fused Adam moves; an unfused one lands lower). Default 0.7.
    pub optimizer: f64,
    /// Seconds of framework overhead per block per micro-batch, forward and backward together
    /// (kernel launches, dispatch). Default 0.
    pub layer_overhead_s: f64,
    /// Fixed seconds per optimizer step (host work, synchronisation). Default 0.
    pub step_overhead_s: f64,
    /// Share of link bandwidth that collectives reach. Default 0.75.
    pub comm: f64,
    /// Share of the last micro-batch's backward that data-parallel communication can run under
    /// (bucketed all-reduce as gradients become final); 0 means the reduction starts after the
    /// backward. Default 0.8.
    pub dp_overlap: f64,
    /// Relative error of step-time predictions, one standard deviation: the spread of the
    /// calibration's residuals, or a prior for an uncalibrated machine. Default 0.25.
    pub relative_error: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency {
            compute: 0.6,
            memory: 0.7,
            optimizer: 0.7,
            layer_overhead_s: 0.0,
            step_overhead_s: 0.0,
            comm: 0.75,
            dp_overlap: 0.8,
            relative_error: 0.25,
        }
    }
}

impl Efficiency {
    /// Checks that shares are in (0, 1] (overlap in [0, 1]) and overheads are not negative.
    pub fn validate(&self) -> Result<(), PlanError> {
        let shares =
            [("efficiency.compute", self.compute), ("efficiency.memory", self.memory), ("efficiency.comm", self.comm)];
        for (key, value) in shares {
            if !(value > 0.0 && value <= 1.0) {
                return Err(PlanError::InvalidConfig { key, message: format!("must be in (0, 1]; got {value}") });
            }
        }
        if !(0.0..=1.0).contains(&self.dp_overlap) {
            return Err(PlanError::InvalidConfig {
                key: "efficiency.dp_overlap",
                message: format!("must be in [0, 1]; got {}", self.dp_overlap),
            });
        }
        let non_negative = [
            ("efficiency.layer_overhead_s", self.layer_overhead_s),
            ("efficiency.step_overhead_s", self.step_overhead_s),
            ("efficiency.relative_error", self.relative_error),
        ];
        for (key, value) in non_negative {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(PlanError::InvalidConfig { key, message: format!("must be >= 0; got {value}") });
            }
        }
        Ok(())
    }
}

/// A cluster of identical devices in identical nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Name shown in reports. Default "cpu".
    pub name: String,
    /// Devices to plan for, in all. Default 1.
    pub n_devices: usize,
    /// Devices per node; groups within a node use the intra-node link. Default 1.
    pub devices_per_node: usize,
    /// Memory of one device in bytes. Default 24 GiB.
    pub memory_bytes: f64,
    /// Bytes of each device the framework holds for itself (context, allocator slack). Default 2 GiB.
    pub reserved_bytes: f64,
    /// Peak fp32 FLOP/s of one device. Default 205e9 (this CPU, measured).
    pub peak_flops_fp32: f64,
    /// Peak bf16 FLOP/s of one device. Default 800e9 (this CPU, measured).
    pub peak_flops_bf16: f64,
    /// Memory bandwidth of one device in bytes/s. Default 15e9 (this CPU, a measured copy).
    pub memory_bandwidth: f64,
    /// Bandwidth of one device's link inside a node, one direction, bytes/s. Default 10e9.
    pub intra_node_bandwidth: f64,
    /// Latency of one step of a collective inside a node, seconds. Default 5e-6.
    pub intra_node_latency_s: f64,
    /// Bandwidth of one device's share of the network between nodes, bytes/s. Default 1.25e9.
    pub inter_node_bandwidth: f64,
    /// Latency of one step of a collective between nodes, seconds. Default 50e-6.
    pub inter_node_latency_s: f64,
    /// How much of each peak a step reaches. Default: [`Efficiency::default`] with a CPU's 0 overlap.
    pub efficiency: Efficiency,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            name: "cpu".into(),
            n_devices: 1,
            devices_per_node: 1,
            memory_bytes: 24.0 * GIB,
            reserved_bytes: 2.0 * GIB,
            peak_flops_fp32: 205e9,
            peak_flops_bf16: 800e9,
            memory_bandwidth: 15e9,
            intra_node_bandwidth: 10e9,
            intra_node_latency_s: 5e-6,
            inter_node_bandwidth: 1.25e9,
            inter_node_latency_s: 50e-6,
            efficiency: Efficiency { dp_overlap: 0.0, ..Efficiency::default() },
        }
    }
}

/// Names accepted by [`ClusterConfig::preset`].
pub const CLUSTER_PRESETS: &[&str] = &["a100-80g", "h100", "h200", "cpu"];

impl ClusterConfig {
    /// A named cluster of `n_devices`. GPU presets are DGX-style nodes of 8 with NVLink inside and
    /// one InfiniBand port per GPU between nodes (HDR 200 Gb/s for A100, NDR 400 Gb/s for H100 and
    /// H200); peaks are the dense figures of NVIDIA's data sheets. "cpu" is the machine stoke is
    /// developed on (2 cores, 24 GiB; 205 GFLOP/s fp32 and 800 GFLOP/s bf16 measured with a
    /// matmul), one device per node.
    pub fn preset(name: &str, n_devices: usize) -> Result<ClusterConfig, PlanError> {
        let gpu = |memory_bytes: f64, bf16: f64, fp32: f64, hbm: f64, nvlink: f64, network: f64| ClusterConfig {
            name: name.to_string(),
            n_devices,
            devices_per_node: 8,
            memory_bytes,
            reserved_bytes: 1.0 * GIB,
            peak_flops_fp32: fp32,
            peak_flops_bf16: bf16,
            memory_bandwidth: hbm,
            intra_node_bandwidth: nvlink,
            intra_node_latency_s: 5e-6,
            inter_node_bandwidth: network,
            inter_node_latency_s: 10e-6,
            efficiency: Efficiency::default(),
        };
        Ok(match name {
            "a100-80g" => gpu(80.0 * GIB, 312e12, 19.5e12, 2.039e12, 300e9, 25e9),
            "h100" => gpu(80.0 * GIB, 989e12, 67e12, 3.35e12, 450e9, 50e9),
            "h200" => gpu(141e9, 989e12, 67e12, 4.8e12, 450e9, 50e9),
            "cpu" => ClusterConfig { n_devices, ..ClusterConfig::default() },
            other => {
                return Err(PlanError::UnknownPreset {
                    kind: "cluster",
                    name: other.to_string(),
                    known: CLUSTER_PRESETS.join(", "),
                })
            }
        })
    }

    /// Peak FLOP/s of one device at `precision`.
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Fp32 => self.peak_flops_fp32,
            Precision::Bf16 => self.peak_flops_bf16,
        }
    }

    /// Checks sizes and rates are positive and the devices fill whole nodes.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.n_devices == 0 {
            return Err(PlanError::InvalidConfig { key: "cluster.n_devices", message: "must be positive".into() });
        }
        if self.devices_per_node == 0 {
            return Err(PlanError::InvalidConfig {
                key: "cluster.devices_per_node",
                message: "must be positive".into(),
            });
        }
        let rates = [
            ("cluster.memory_bytes", self.memory_bytes),
            ("cluster.peak_flops_fp32", self.peak_flops_fp32),
            ("cluster.peak_flops_bf16", self.peak_flops_bf16),
            ("cluster.memory_bandwidth", self.memory_bandwidth),
            ("cluster.intra_node_bandwidth", self.intra_node_bandwidth),
            ("cluster.inter_node_bandwidth", self.inter_node_bandwidth),
        ];
        for (key, value) in rates {
            if !(value > 0.0 && value.is_finite()) {
                return Err(PlanError::InvalidConfig { key, message: format!("must be positive; got {value}") });
            }
        }
        self.efficiency.validate()
    }
}

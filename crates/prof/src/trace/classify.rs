//! What an event is, by its name: HTA's kernel classes, communication, data loading and
//! checkpoint saves, tensor-core kernels, profiler steps, and the peak FLOP/s of known devices.

/// HTA's kernel classes, by name (its regular expressions, restated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelType {
    Communication,
    Memory,
    Compute,
    Other,
}

impl KernelType {
    pub fn key(self) -> &'static str {
        match self {
            KernelType::Communication => "communication",
            KernelType::Memory => "memory",
            KernelType::Compute => "compute",
            KernelType::Other => "other",
        }
    }
}

pub fn kernel_type(name: &str) -> KernelType {
    if name.starts_with("nccl") && name[4..].contains("Kernel") {
        KernelType::Communication
    } else if name.starts_with("Memcpy") || name.starts_with("Memset") || name.starts_with("dma") {
        KernelType::Memory
    } else if name.contains("Memcpy") || name.contains("Sync") {
        KernelType::Other
    } else {
        KernelType::Compute
    }
}

pub(super) fn is_comm_op(name: &str) -> bool {
    name.starts_with("nccl:") || name.starts_with("c10d::") || name.starts_with("gloo:") || name == "record_param_comms"
}

pub(super) fn is_dataloader(name: &str) -> bool {
    name.contains("DataLoader")
}

pub(super) fn is_ckpt_save(name: &str) -> bool {
    // torch.save, torch.distributed.checkpoint (dcp.save, save_state_dict) and common wrappers;
    // activation checkpointing (CheckpointFunction, torch.utils.checkpoint) is not a save.
    let lower = name.to_ascii_lowercase();
    (lower.contains("torch.save")
        || lower.contains("save_state_dict")
        || lower.contains("dcp.save")
        || lower.contains("save_checkpoint")
        || lower.contains("checkpoint.save")
        || lower == "aten::_save")
        && !lower.contains("checkpointfunction")
}

pub(super) fn is_tensor_core(lower: &str) -> bool {
    ["tensorop", "xmma", "hmma", "wmma", "gmma", "mfma", "884gemm", "1688gemm", "16816", "_mma", "mma_"]
        .iter()
        .any(|p| lower.contains(p))
        || (lower.contains("sm80_") || lower.contains("sm90_") || lower.contains("sm100_")) && lower.contains("gemm")
}

pub(super) fn is_tensor_core_eligible(lower: &str) -> bool {
    ["gemm", "conv", "matmul", "cutlass", "cijk_", "flash"].iter().any(|p| lower.contains(p))
}

/// A matrix multiply or convolution kernel (cuBLAS, cuBLASLt, CUTLASS, cuDNN, rocBLAS/Tensile): the
/// kernels the effective compute ratio counts. Attention, normalization and element-wise kernels
/// are compute but not these.
pub(super) fn is_gemm(lower: &str) -> bool {
    ["gemm", "conv", "matmul", "cutlass", "cijk_", "xmma", "hmma", "wgmma"].iter().any(|p| lower.contains(p))
        && !lower.contains("flash")
}

pub(super) fn step_number(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("ProfilerStep")?.trim_start().strip_prefix('#')?.trim_start();
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// Peak dense bf16/fp16 FLOP/s of known devices, from their vendors' datasheets.
pub fn peak_flops_for(device_name: &str) -> Option<f64> {
    let n = device_name.to_ascii_uppercase();
    let table: [(&str, f64); 9] = [
        ("H200", 989e12),
        ("H100", 989e12),
        ("B200", 2250e12),
        ("A100", 312e12),
        ("A10G", 70e12),
        ("L4", 121e12),
        ("V100", 125e12),
        ("MI300", 1307e12),
        ("MI250", 362e12),
    ];
    table.iter().find(|(key, _)| n.contains(key)).map(|&(_, v)| v)
}

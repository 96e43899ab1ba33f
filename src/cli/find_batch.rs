//! `stoke train --find-batch [--memory-budget BYTES]`.

use std::process::ExitCode;

use super::UsageError;
use crate::config::StokeConfig;

/// Micro-batches above this are not searched.
const MAX_MICRO_BATCH: usize = 4096;

pub fn run(config: &StokeConfig, budget: Option<&str>) -> anyhow::Result<ExitCode> {
    if config.run.device != "cpu" && stoke_train::parse_device(&config.run.device)? != tch::Device::Cpu {
        return Err(UsageError(format!(
            "--find-batch measures host memory and runs on the CPU; run.device is {:?} (set run.device=cpu)",
            config.run.device
        ))
        .into());
    }
    let asked = match budget {
        Some(text) => Some(parse_bytes(text).ok_or_else(|| {
            UsageError(format!("--memory-budget: {text:?} is not a byte count (e.g. 8000000000, 512M, 16G)"))
        })?),
        None => None,
    };
    // A budget beyond what this process can have would let the probes grow until the kernel
    // kills the process: it is clamped to 80% of the limit (the default budget's share, leaving
    // room for the probes' own overshoot), and the model must fit at micro-batch 1.
    let limit = stoke_train::memory_limit(tch::Device::Cpu, 1)
        .ok_or_else(|| anyhow::anyhow!("cannot read this machine's available memory from /proc/meminfo"))?;
    let ceiling = limit.bytes / 5 * 4;
    let budget_bytes = match asked {
        None => ceiling,
        Some(asked) if asked > ceiling => {
            eprintln!(
                "note: --memory-budget {asked} bytes is more than 80% of what this process can have ({} bytes, {}); \
             using {ceiling}",
                limit.bytes, limit.source
            );
            ceiling
        }
        Some(asked) => asked,
    };
    let one = stoke_train::TrainConfig { micro_batch: 1, ..config.train.clone() };
    let device = stoke_train::parse_device(&config.run.device)?;
    let estimate = stoke_train::estimate_step_memory(&config.model, &one, 1, 0, device)?;
    stoke_train::check_fits(&estimate, &stoke_train::MemoryLimit { bytes: budget_bytes, source: "the budget" })
        .map_err(|err| UsageError(err.to_string().replace(", or pass --force to try anyway", "")))?;
    let fit = stoke_train::find_micro_batch(&config.model, &config.train, budget_bytes, MAX_MICRO_BATCH)?;
    for (micro_batch, bytes) in &fit.probes {
        println!("probe: micro_batch {micro_batch:>5} peaks at {:>8.1} MiB", *bytes as f64 / (1 << 20) as f64);
    }
    println!(
        "largest micro-batch that fits: {} (peak {:.1} MiB of a {:.1} MiB budget), assuming train.recompute = \"{}\"; \
         set --set train.micro_batch={}",
        fit.micro_batch,
        fit.peak_bytes as f64 / (1 << 20) as f64,
        fit.budget_bytes as f64 / (1 << 20) as f64,
        fit.recompute,
        fit.micro_batch
    );
    Ok(ExitCode::SUCCESS)
}

/// "123", "512K", "64M", "16G", "1T" (powers of 1024; an optional trailing "B" or "iB").
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, shift) = match text.chars().last()? {
        'K' | 'k' => (&text[..text.len() - 1], 10),
        'M' | 'm' => (&text[..text.len() - 1], 20),
        'G' | 'g' => (&text[..text.len() - 1], 30),
        'T' | 't' => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("512M"), Some(512 << 20));
        assert_eq!(parse_bytes("16GiB"), Some(16 << 30));
        assert_eq!(parse_bytes("lots"), None);
    }
}

//! `train.precision = "auto"`, resolved when a run's config is loaded.

use super::{ConfigError, RunConfig};

/// `train.precision = "auto"` becomes the precision the run's device multiplies fastest in
/// (`stoke_train::auto_precision`), before the table is read: the run folder's config.toml, the
/// report and a checkpoint's meta hold the one taken, and a resume keeps it.
pub(super) fn resolve_auto_precision(table: &mut toml::Table) -> Result<(), ConfigError> {
    if table.get("train").and_then(|t| t.get("precision")).and_then(|v| v.as_str()) != Some("auto") {
        return Ok(());
    }
    let device_name = table
        .get("run")
        .and_then(|r| r.get("device"))
        .and_then(|d| d.as_str())
        .map_or_else(|| RunConfig::default().device, str::to_string);
    let device = stoke_train::parse_device(&device_name)
        .map_err(|e| ConfigError::Invalid { key: "run.device".into(), message: e.to_string() })?;
    let precision = stoke_train::auto_precision(device);
    if let Some(train) = table.get_mut("train").and_then(|t| t.as_table_mut()) {
        train.insert("precision".into(), toml::Value::String(precision.name().into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::StokeConfig;

    #[test]
    fn auto_precision_is_resolved_when_loaded_and_kept_on_resume() {
        let load = |overrides: &[&str]| {
            let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
            StokeConfig::load(None, &overrides).unwrap()
        };
        let on_cpu = load(&["train.precision=\"auto\"", "run.device=\"cpu\""]);
        let expected =
            if stoke_train::cpu_has_bf16() { stoke_train::Precision::Bf16 } else { stoke_train::Precision::Fp32 };
        assert_eq!(on_cpu.train.precision, expected);
        // The run folder's config holds the precision taken, so a resume reads no "auto".
        let saved = toml::to_string(&on_cpu).unwrap();
        assert!(saved.contains(&format!("precision = \"{}\"", expected.name())), "{saved}");
        let resumed = StokeConfig::load_resumed(&on_cpu, None, &[]).unwrap();
        assert_eq!(resumed.train.precision, expected);
        // Named explicitly, a precision is taken as it is.
        assert_eq!(
            load(&["train.precision=\"fp16\"", "run.device=\"cpu\""]).train.precision,
            stoke_train::Precision::Fp16
        );
    }
}

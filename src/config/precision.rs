//! `train.precision = "auto"`, resolved when a run's config is loaded. A leaf: `config.rs` maps
//! its error to the config's.

/// `train.precision = "auto"` in the merged config `table` becomes the precision the run's device
/// multiplies fastest in (`stoke_train::auto_precision`), before the table is read: the run
/// folder's config.toml, the report and a checkpoint's meta hold the one taken, and a resume
/// keeps it. `default_device` is `run.device`'s default; an unusable `run.device` is the error.
pub(super) fn resolve_auto_precision(table: &mut toml::Table, default_device: &str) -> Result<(), String> {
    if table.get("train").and_then(|t| t.get("precision")).and_then(|v| v.as_str()) != Some("auto") {
        return Ok(());
    }
    let device_name = table.get("run").and_then(|r| r.get("device")).and_then(|d| d.as_str()).unwrap_or(default_device);
    let device = stoke_train::parse_device(device_name).map_err(|e| e.to_string())?;
    let precision = stoke_train::auto_precision(device);
    if let Some(train) = table.get_mut("train").and_then(|t| t.as_table_mut()) {
        train.insert("precision".into(), toml::Value::String(precision.name().into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(text: &str) -> Result<toml::Table, String> {
        let mut table: toml::Table = text.parse().unwrap();
        resolve_auto_precision(&mut table, "auto").map(|_| table)
    }

    #[test]
    fn auto_is_the_precision_the_device_is_fast_in_and_a_named_one_stays() {
        let expected = if stoke_train::cpu_has_bf16() { "bf16" } else { "fp32" };
        let table = resolved("[train]\nprecision = \"auto\"\n[run]\ndevice = \"cpu\"\n").unwrap();
        assert_eq!(table["train"]["precision"].as_str(), Some(expected));
        let table = resolved("[train]\nprecision = \"fp16\"\n").unwrap();
        assert_eq!(table["train"]["precision"].as_str(), Some("fp16"));
        let err = resolved("[train]\nprecision = \"auto\"\n[run]\ndevice = \"tpu\"\n").unwrap_err();
        assert!(err.contains("run.device"), "{err}");
    }
}

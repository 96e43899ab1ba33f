//! Where a run's configuration comes from: an optional TOML file and `section.key=value`
//! overrides, applied in order over the defaults.

use std::path::PathBuf;

use crate::config::StokeConfig;

/// A config file and the overrides on top of it, as the command line gave them (plus those the
/// binary adds, such as the run name every rank agreed on).
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// A TOML file with the keys to change; none for the defaults.
    pub file: Option<PathBuf>,
    /// `section.key=value` overrides, applied after the file, later ones winning.
    pub overrides: Vec<String>,
}

impl ConfigSource {
    /// The resolved configuration; a file or override that does not load is a usage error.
    pub fn load(&self) -> anyhow::Result<StokeConfig> {
        StokeConfig::load(self.file.as_deref(), &self.overrides).map_err(crate::exit::config_error)
    }

    /// The configuration saved in a checkpoint with this source's file and overrides on top.
    pub fn load_over(&self, saved: &StokeConfig) -> anyhow::Result<StokeConfig> {
        StokeConfig::load_resumed(saved, self.file.as_deref(), &self.overrides).map_err(crate::exit::config_error)
    }

    /// Adds an override after the others.
    pub fn push(&mut self, override_: String) {
        self.overrides.push(override_);
    }
}

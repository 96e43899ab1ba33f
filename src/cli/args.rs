//! Arguments shared by the subcommands that run a configuration.

use std::path::PathBuf;

use crate::config::StokeConfig;
use crate::run::ConfigSource;

/// The config file and overrides, shared by every subcommand that runs a configuration.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// A TOML file with the keys to change (see `stoke config --defaults`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key: `--set train.steps=20` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArgs {
    /// The file and overrides, with `extra` overrides after the command line's.
    pub fn source(&self, extra: &[String]) -> ConfigSource {
        let mut overrides = self.overrides.clone();
        overrides.extend_from_slice(extra);
        ConfigSource { file: self.config.clone(), overrides }
    }

    /// The resolved configuration (a usage error when it does not load).
    pub fn load(&self, extra: &[String]) -> anyhow::Result<StokeConfig> {
        self.source(extra).load()
    }
}

//! `stoke config`: print the resolved configuration, or the documented defaults.

use std::process::ExitCode;

use super::args::ConfigArgs;

#[derive(Debug, clap::Args)]
pub struct ConfigCmdArgs {
    /// Print every key with its default and what it means.
    #[arg(long)]
    pub defaults: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub fn run(args: ConfigCmdArgs) -> anyhow::Result<ExitCode> {
    if args.defaults {
        print!("{}", crate::config::DEFAULTS_TOML);
    } else {
        print!("{}", args.config.load(&[])?.to_toml());
    }
    Ok(ExitCode::SUCCESS)
}

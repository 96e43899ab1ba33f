//! `stoke env`: the versions and performance-relevant variables a run here would record.

use std::process::ExitCode;

use crate::environment::Environment;

#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// Print JSON (the form each run writes to environment.json and report.json).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: EnvArgs) -> anyhow::Result<ExitCode> {
    let env = Environment::capture();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&env.to_json())?);
    } else {
        print!("{}", env.to_text());
    }
    Ok(ExitCode::SUCCESS)
}

//! Prints `stoke trace analyze`'s table (or JSON with `--json`) without building the `stoke`
//! binary (which links libtorch): `cargo run -p stoke-prof --release --example trace_table -- FILES`.

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").map(|i| args.remove(i)).is_some();
    let paths: Vec<std::path::PathBuf> = args.into_iter().map(Into::into).collect();
    match stoke_prof::analyze_paths(&paths, &stoke_prof::AnalyzeOptions::default()) {
        Ok(a) if json => println!("{}", serde_json::to_string_pretty(&a).expect("serializes")),
        Ok(a) => print!("{}", stoke_prof::table(&a)),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

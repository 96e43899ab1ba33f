//! The libtorch boundary: only `crates/train` and the `stoke` binary may depend on `tch` or
//! `torch-sys`, directly or through another crate, so every other crate builds and tests without
//! libtorch. Read from `cargo metadata`'s resolved graph (normal and build dependencies; tests may
//! use anything).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

const LIBTORCH: [&str; 2] = ["tch", "torch-sys"];
const MAY_LINK_LIBTORCH: [&str; 2] = ["stoke", "stoke-train"];

/// Package id -> (name, ids of its normal and build dependencies).
fn resolved_graph(metadata: &Value) -> BTreeMap<String, (String, Vec<String>)> {
    let names: BTreeMap<&str, &str> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().expect("id"), p["name"].as_str().expect("name")))
        .collect();
    let mut graph = BTreeMap::new();
    for node in metadata["resolve"]["nodes"].as_array().expect("resolve.nodes") {
        let id = node["id"].as_str().expect("node id");
        let deps = node["deps"]
            .as_array()
            .expect("deps")
            .iter()
            .filter(|dep| {
                dep["dep_kinds"].as_array().expect("dep_kinds").iter().any(|kind| kind["kind"].as_str() != Some("dev"))
            })
            .map(|dep| dep["pkg"].as_str().expect("pkg").to_string())
            .collect();
        graph.insert(id.to_string(), (names[id].to_string(), deps));
    }
    graph
}

/// Names of the libtorch packages reachable from `id`.
fn libtorch_reachable(graph: &BTreeMap<String, (String, Vec<String>)>, id: &str) -> BTreeSet<String> {
    let (mut seen, mut stack, mut found) = (BTreeSet::new(), vec![id.to_string()], BTreeSet::new());
    while let Some(current) = stack.pop() {
        if !seen.insert(current.clone()) {
            continue;
        }
        let (name, deps) = &graph[&current];
        if LIBTORCH.contains(&name.as_str()) {
            found.insert(name.clone());
        }
        stack.extend(deps.iter().cloned());
    }
    found
}

#[test]
fn only_crates_train_and_the_binary_depend_on_libtorch() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // This machine's target only: the graph that builds here, and all of it already downloaded
    // (other targets' dependencies, such as object_store's for wasm, are not).
    let rustc = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into())).arg("-vV").output();
    let rustc = String::from_utf8_lossy(&rustc.expect("rustc -vV runs").stdout).into_owned();
    let host = rustc.lines().find_map(|l| l.strip_prefix("host: ")).expect("rustc -vV names the host").to_string();
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline", "--filter-platform", &host])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let metadata: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let graph = resolved_graph(&metadata);
    let mut checked = Vec::new();
    for member in metadata["workspace_members"].as_array().expect("workspace_members") {
        let id = member.as_str().expect("member id");
        let name = &graph[id].0;
        let reachable = libtorch_reachable(&graph, id);
        if MAY_LINK_LIBTORCH.contains(&name.as_str()) {
            assert!(!reachable.is_empty(), "{name} is expected to link libtorch; the check would be blind");
        } else {
            assert!(reachable.is_empty(), "{name} depends on {reachable:?}: only crates/train and the binary may");
        }
        checked.push(name.clone());
    }
    for crate_name in ["stoke-data", "stoke-ckpt", "stoke-prof", "stoke-plan", "stoke-comm", "stoke-sched", "xtask"] {
        assert!(checked.iter().any(|c| c == crate_name), "{crate_name} not among the workspace members {checked:?}");
    }
}

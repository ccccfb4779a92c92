//! The crates' dependencies point down: each stowage crate depends only on
//! crates of a lower layer (docs/architecture.md, "Crates and layers").
//! Read from `cargo metadata`, so a new edge that points up or sideways
//! fails here before it lands.

use std::collections::BTreeMap;
use std::process::Command;

/// Each crate's layer; a crate may depend only on crates of lower layers.
const LAYERS: &[(&str, u32)] = &[
    ("stowage-core", 0),
    ("stowage-shm", 0),
    ("stowage-wire", 1),
    ("stowage-nixl", 1),
    ("stowage-config", 2),
    ("stowage-unit", 3),
    ("stowage-client", 3),
    ("stowage-cluster", 3),
    ("stowage-local", 4),
    ("stowage-cli", 5),
    ("stowage-python", 6),
];

#[test]
fn crate_dependencies_point_down() {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut edges = Vec::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        if !name.starts_with("stowage-") {
            continue;
        }
        let Some(&layer) = layers.get(name) else {
            panic!("{name} is a workspace crate without a layer: add it to LAYERS and docs/architecture.md");
        };
        for d in p["dependencies"].as_array().unwrap() {
            let dep = d["name"].as_str().unwrap();
            // Dev-dependencies (tests) may reach anywhere.
            if !dep.starts_with("stowage-") || d["kind"].as_str() == Some("dev") {
                continue;
            }
            edges.push((name.to_string(), dep.to_string()));
            let dl = layers.get(dep).copied().unwrap_or(u32::MAX);
            assert!(dl < layer, "{name} (layer {layer}) depends on {dep} (layer {dl}): dependencies must point down");
        }
    }
    // The edges the reshaping removed stay removed: ids come from wire,
    // configuration from config, the local plane from local.
    for (from, to) in [
        ("stowage-client", "stowage-core"),
        ("stowage-cluster", "stowage-unit"),
    ] {
        assert!(
            !edges.iter().any(|(f, t)| f == from && t == to),
            "{from} must not depend on {to}"
        );
    }
    assert!(
        edges.len() > 10,
        "read too few edges ({}): is the metadata right?",
        edges.len()
    );
}

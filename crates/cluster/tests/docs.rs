//! The config documentation cannot rot: docs/config.md's TOML blocks and
//! examples/stowage.toml parse, the example sets every key there is, the
//! docs' tables list exactly those keys, and each documented default is
//! what a file that leaves the key out gets.

use std::collections::BTreeSet;
use std::path::PathBuf;

use stowage_cluster::config::Config;

fn repo_file(rel: &str) -> (PathBuf, String) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    (path, text)
}

/// The dotted paths of every value (not table) in `table`.
fn leaf_keys(prefix: &str, table: &toml::Table, out: &mut BTreeSet<String>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => leaf_keys(&key, t, out),
            _ => {
                out.insert(key);
            }
        }
    }
}

fn keys_of(text: &str) -> BTreeSet<String> {
    let table: toml::Table = toml::from_str(text).unwrap();
    let mut keys = BTreeSet::new();
    leaf_keys("", &table, &mut keys);
    keys
}

/// The ```toml blocks of a markdown text.
fn toml_blocks(md: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in md.lines() {
        match &mut current {
            None if line.trim() == "```toml" => current = Some(String::new()),
            Some(_) if line.trim() == "```" => blocks.extend(current.take()),
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    assert!(current.is_none(), "an unclosed ```toml block");
    blocks
}

/// The rows of the docs' key tables: (key, default cell).
fn doc_rows(md: &str) -> Vec<(String, String)> {
    md.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            // | `key` | default | meaning |
            if cells.len() < 4 || !cells[1].starts_with('`') {
                return None;
            }
            let key = cells[1].trim_matches('`').to_string();
            Some((key, cells[2].to_string()))
        })
        .collect()
}

#[test]
fn the_example_file_parses_and_sets_every_key() {
    let (path, text) = repo_file("examples/stowage.toml");
    let cfg = Config::from_file(&path).unwrap();
    // Every key the config has (the example sets the optional ones too,
    // so its serialization has them all).
    let all = keys_of(&cfg.to_toml_string());
    let example = keys_of(&text);
    assert_eq!(example, all, "examples/stowage.toml must set every key");
    // And it is not the default config in disguise.
    assert_ne!(cfg, Config::default());
}

#[test]
fn the_docs_toml_blocks_parse() {
    let (_, md) = repo_file("docs/config.md");
    let blocks = toml_blocks(&md);
    assert!(!blocks.is_empty(), "docs/config.md shows no ```toml block");
    for b in &blocks {
        let cfg = Config::from_toml_str(b).unwrap_or_else(|e| panic!("{e}\nin:\n{b}"));
        assert_ne!(
            cfg,
            Config::default(),
            "a docs example that sets nothing:\n{b}"
        );
    }
}

#[test]
fn the_docs_list_exactly_the_keys() {
    let (_, md) = repo_file("docs/config.md");
    let (_, example) = repo_file("examples/stowage.toml");
    let documented: BTreeSet<String> = doc_rows(&md).into_iter().map(|(k, _)| k).collect();
    let keys = keys_of(&example);
    let undocumented: Vec<_> = keys.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&keys).collect();
    assert!(
        undocumented.is_empty(),
        "keys docs/config.md does not list: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/config.md lists keys there are not: {unknown:?}"
    );
}

/// A default written as a TOML value (`"1GiB"`, `0.9`, `false`) is what a
/// file that leaves the key out gets: setting the key to it changes
/// nothing.
#[test]
fn the_documented_defaults_are_the_defaults() {
    let (_, md) = repo_file("docs/config.md");
    let mut checked = 0;
    for (key, default) in doc_rows(&md) {
        let Some(literal) = default
            .strip_prefix('`')
            .and_then(|d| d.strip_suffix('`'))
            .filter(|d| !d.contains('`'))
        else {
            continue;
        };
        // Keys of [units.disk] need the table's required root.
        let base = if key.starts_with("units.disk.") {
            "units.disk.root = \"/d\"\n"
        } else {
            ""
        };
        let with = format!("{base}{key} = {literal}\n");
        let got = Config::from_toml_str(&with).unwrap_or_else(|e| panic!("{e}\nin:\n{with}"));
        let want = Config::from_toml_str(base).unwrap();
        assert_eq!(got, want, "docs/config.md: {key} defaults to {literal}?");
        checked += 1;
    }
    // Every key but those without a default value (count, the optional
    // paths and wait_for_memory, the disk root) has one to check.
    assert!(checked >= 20, "only {checked} documented defaults found");
}

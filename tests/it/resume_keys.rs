//! The keys `stoke train --resume` may change (`src/run/resume_keys.rs`) against the keys of
//! `src/defaults.toml`: every key classified, no name classified that the defaults lack, none
//! classified both ways.

#[allow(dead_code)]
#[path = "../../src/run/resume_keys.rs"]
mod resume_keys;

use std::collections::BTreeSet;

use resume_keys::{classify, ResumeKey, FIXED_KEYS, FIXED_SECTIONS, MAY_CHANGE_KEYS, MAY_CHANGE_SECTIONS};

/// Every `section.key` of the documented defaults.
fn default_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/defaults.toml"))
        .expect("src/defaults.toml is readable");
    let table: toml::Table = toml::from_str(&text).expect("src/defaults.toml parses");
    let mut keys = BTreeSet::new();
    flatten(&table, "", &mut keys);
    keys
}

fn flatten(table: &toml::Table, prefix: &str, keys: &mut BTreeSet<String>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        match value {
            toml::Value::Table(inner) => flatten(inner, &key, keys),
            _ => {
                keys.insert(key);
            }
        }
    }
}

#[test]
fn every_default_key_is_classified() {
    let keys = default_keys();
    assert!(keys.len() > 50, "only {} keys read from src/defaults.toml", keys.len());
    let unclassified: Vec<&String> = keys.iter().filter(|key| classify(key).is_none()).collect();
    assert!(unclassified.is_empty(), "keys --resume neither allows nor refuses: {unclassified:?}");
}

#[test]
fn every_classified_name_is_a_default_key_or_section() {
    let keys = default_keys();
    let sections: BTreeSet<&str> = keys.iter().filter_map(|key| key.split('.').next()).collect();
    for key in MAY_CHANGE_KEYS.iter().chain(FIXED_KEYS) {
        assert!(keys.contains(*key), "{key} is classified but src/defaults.toml has no such key");
    }
    for section in MAY_CHANGE_SECTIONS.iter().chain(FIXED_SECTIONS) {
        assert!(sections.contains(section), "section {section} is classified but src/defaults.toml has none");
    }
}

#[test]
fn no_key_is_classified_both_ways() {
    let may_change = |key: &str| {
        MAY_CHANGE_SECTIONS.contains(&key.split('.').next().unwrap_or("")) || MAY_CHANGE_KEYS.contains(&key)
    };
    let fixed = |key: &str| FIXED_SECTIONS.contains(&key.split('.').next().unwrap_or("")) || FIXED_KEYS.contains(&key);
    let both: Vec<String> = default_keys().into_iter().filter(|key| may_change(key) && fixed(key)).collect();
    assert!(both.is_empty(), "keys classified both as changeable and as fixed: {both:?}");
    assert_eq!(classify("train.steps"), Some(ResumeKey::MayChange));
    assert_eq!(classify("model.n_layer"), Some(ResumeKey::Fixed));
    assert_eq!(classify("no_such.key"), None);
}

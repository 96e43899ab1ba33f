//! The built-in default data: a deterministic, learnable text corpus.
//!
//! A small probabilistic grammar (agreeing subjects and verbs, adjectives, prepositional phrases)
//! interleaved with arithmetic lines (`37+45=82.`). Byte-level, so the vocabulary is 256. A model
//! that learns the grammar and the carries drives its loss far below the unigram entropy of the
//! bytes, which is what the default run shows.

use crate::rng::SplitMix64;

const DETERMINERS: &[&str] = &["the", "a", "every", "some", "this", "that"];
const ADJECTIVES: &[&str] = &["small", "quick", "lazy", "red", "bright", "quiet", "old", "young", "happy", "strange"];
const SINGULAR_NOUNS: &[&str] =
    &["cat", "dog", "bird", "child", "teacher", "robot", "farmer", "river", "city", "engine"];
const PLURAL_NOUNS: &[&str] =
    &["cats", "dogs", "birds", "children", "teachers", "robots", "farmers", "rivers", "cities", "engines"];
/// Verbs as (singular subject form, plural subject form).
const VERBS: &[(&str, &str)] = &[
    ("sees", "see"),
    ("follows", "follow"),
    ("likes", "like"),
    ("builds", "build"),
    ("watches", "watch"),
    ("finds", "find"),
    ("helps", "help"),
    ("carries", "carry"),
];
const PREPOSITIONS: &[&str] = &["near", "behind", "under", "beside", "over"];
const NAMES: &[&str] = &["alice", "bob", "carol", "dave"];

/// Generates `n_bytes` of corpus text from `seed`; the same seed always gives the same bytes.
pub fn builtin_corpus(seed: u64, n_bytes: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed ^ 0x5170_4b45_c0de);
    let mut text = String::with_capacity(n_bytes + 128);
    while text.len() < n_bytes {
        match rng.below(10) {
            0..=5 => sentence(&mut rng, &mut text),
            6..=8 => arithmetic(&mut rng, &mut text),
            _ => name_fact(&mut rng, &mut text),
        }
        text.push('\n');
    }
    text.truncate(n_bytes);
    text.into_bytes()
}

fn pick<'a>(rng: &mut SplitMix64, words: &[&'a str]) -> &'a str {
    words[rng.below(words.len() as u64) as usize]
}

fn noun_phrase(rng: &mut SplitMix64, text: &mut String) -> bool {
    let plural = rng.below(2) == 0;
    if plural {
        text.push_str(if rng.below(2) == 0 { "the" } else { "some" });
    } else {
        text.push_str(pick(rng, DETERMINERS));
    }
    text.push(' ');
    if rng.below(3) == 0 {
        text.push_str(pick(rng, ADJECTIVES));
        text.push(' ');
    }
    text.push_str(pick(rng, if plural { PLURAL_NOUNS } else { SINGULAR_NOUNS }));
    plural
}

fn sentence(rng: &mut SplitMix64, text: &mut String) {
    let plural = noun_phrase(rng, text);
    let (singular_verb, plural_verb) = VERBS[rng.below(VERBS.len() as u64) as usize];
    text.push(' ');
    text.push_str(if plural { plural_verb } else { singular_verb });
    text.push(' ');
    noun_phrase(rng, text);
    if rng.below(3) == 0 {
        text.push(' ');
        text.push_str(pick(rng, PREPOSITIONS));
        text.push(' ');
        noun_phrase(rng, text);
    }
    text.push_str(" .");
}

fn arithmetic(rng: &mut SplitMix64, text: &mut String) {
    let a = rng.below(100);
    let b = rng.below(100);
    if rng.below(2) == 0 {
        text.push_str(&format!("{a}+{b}={}.", a + b));
    } else {
        let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
        text.push_str(&format!("{hi}-{lo}={}.", hi - lo));
    }
}

fn name_fact(rng: &mut SplitMix64, text: &mut String) {
    let name = pick(rng, NAMES);
    let (singular_verb, _) = VERBS[rng.below(VERBS.len() as u64) as usize];
    text.push_str(name);
    text.push(' ');
    text.push_str(singular_verb);
    text.push(' ');
    noun_phrase(rng, text);
    text.push_str(" .");
}

/// Unigram (byte) entropy of `bytes` in nats: the loss of the best model that ignores context.
pub fn unigram_entropy_nats(bytes: &[u8]) -> f64 {
    let mut counts = [0u64; 256];
    for &b in bytes {
        counts[b as usize] += 1;
    }
    let total = bytes.len() as f64;
    counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / total).map(|p| -p * p.ln()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_is_deterministic_and_sized() {
        let a = builtin_corpus(7, 10_000);
        let b = builtin_corpus(7, 10_000);
        let c = builtin_corpus(8, 10_000);
        assert_eq!(a.len(), 10_000);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn arithmetic_lines_are_correct() {
        let text = String::from_utf8(builtin_corpus(1, 50_000)).unwrap();
        let mut checked = 0;
        for line in text.lines().filter(|l| l.contains('=') && l.ends_with('.')) {
            let (lhs, rhs) = line.trim_end_matches('.').split_once('=').unwrap();
            let value: i64 = rhs.parse().unwrap();
            let expected = if let Some((a, b)) = lhs.split_once('+') {
                a.parse::<i64>().unwrap() + b.parse::<i64>().unwrap()
            } else {
                let (a, b) = lhs.split_once('-').unwrap();
                a.parse::<i64>().unwrap() - b.parse::<i64>().unwrap()
            };
            assert_eq!(value, expected, "{line}");
            checked += 1;
        }
        assert!(checked > 100);
    }

    #[test]
    fn unigram_entropy_is_between_bounds() {
        let h = unigram_entropy_nats(&builtin_corpus(3, 100_000));
        // Text over a few dozen symbols: well under ln(256) = 5.55, well over zero.
        assert!(h > 2.0 && h < 3.5, "{h}");
    }
}

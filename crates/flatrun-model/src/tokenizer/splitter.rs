//! One pre-tokenizer regex, run on the fastest engine that gives the same
//! matches.
//!
//! llama.cpp's pre-tokenizer regexes are written for a backtracking engine;
//! the `tokenizers` crate runs them on Oniguruma (`SysRegex`), which costs
//! about a microsecond per search even on a three-byte piece, and the
//! byte-level BPE pipeline searches every piece with every regex of the
//! vocabulary's list (five for deepseek-coder). Most of those regexes are
//! plain character classes with `?` and `+`, which the `regex` crate runs as
//! a DFA with the same leftmost-first semantics at a fraction of the cost.
//! A pattern goes to the `regex` crate only when it has no look-around (the
//! crate refuses those) and no `^`/`$` (Oniguruma's are line anchors); the
//! Unicode classes of both engines are checked against each other over
//! every code point by `classes_agree_with_oniguruma` below.

use tokenizers::utils::SysRegex;

/// A compiled split regex.
pub(crate) enum Splitter {
    /// The `regex` crate (no look-around, no anchors).
    Dfa(regex::Regex),
    /// Oniguruma, for everything else.
    Oniguruma(SysRegex),
}

impl Splitter {
    /// Compile `pattern` on the `regex` crate when it can match it exactly
    /// like Oniguruma, on Oniguruma otherwise.
    pub fn new(pattern: &str) -> Result<Splitter, String> {
        if only_escaped_anchors(pattern)
            && let Ok(regex) = regex::Regex::new(pattern)
        {
            return Ok(Splitter::Dfa(regex));
        }
        SysRegex::new(pattern)
            .map(Splitter::Oniguruma)
            .map_err(|e| e.to_string())
    }

    /// Call `found(start, end)` for each match in `text`, left to right.
    pub fn for_each_match(&self, text: &str, mut found: impl FnMut(usize, usize)) {
        match self {
            Splitter::Dfa(regex) => {
                for m in regex.find_iter(text) {
                    found(m.start(), m.end());
                }
            }
            Splitter::Oniguruma(regex) => {
                for (start, end) in regex.find_iter(text) {
                    found(start, end);
                }
            }
        }
    }
}

/// Whether every `^` and `$` in `pattern` is escaped (`\^`, `\$`) or inside a
/// character class, i.e. a literal character rather than an anchor.
fn only_escaped_anchors(pattern: &str) -> bool {
    let mut escaped = false;
    let mut in_class = false;
    for c in pattern.chars() {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, '\\') => escaped = true,
            (false, '[') => in_class = true,
            (false, ']') => in_class = false,
            (false, '^' | '$') if !in_class => return false,
            _ => {}
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte ranges of matches.
    type Matches = Vec<(usize, usize)>;

    /// Matches of `regex` on `text` with both engines.
    fn both(pattern: &str, text: &str) -> (Matches, Matches) {
        let mut dfa = Vec::new();
        Splitter::Dfa(regex::Regex::new(pattern).unwrap())
            .for_each_match(text, |s, e| dfa.push((s, e)));
        let mut onig = Vec::new();
        Splitter::Oniguruma(SysRegex::new(pattern).unwrap())
            .for_each_match(text, |s, e| onig.push((s, e)));
        (dfa, onig)
    }

    /// Every regex the pre-tokenizers hand to the `regex` crate, on every
    /// Unicode scalar value (`all_planes`) or on the Basic Multilingual Plane,
    /// glued together with each of `glues`.
    fn check_against_oniguruma(all_planes: bool, glues: &[&str]) {
        let mut patterns: Vec<String> = Vec::new();
        for pre in [
            "default",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "starcoder",
            "bloom",
            "viking",
        ] {
            let spec = super::super::pre_tokenizer::spec_for(pre).unwrap();
            for pattern in spec.regexes {
                if matches!(Splitter::new(&pattern), Ok(Splitter::Dfa(_)))
                    && !patterns.contains(&pattern)
                {
                    patterns.push(pattern);
                }
            }
        }
        assert!(patterns.len() >= 8, "{patterns:?}");
        let last = if all_planes { 0x10FFFF } else { 0xFFFF };
        let scalars: Vec<char> = (0..=last).filter_map(char::from_u32).collect();
        for glue in glues {
            let mut text = String::new();
            for &c in &scalars {
                text.push_str(glue);
                text.push(c);
            }
            for pattern in &patterns {
                let (dfa, onig) = both(pattern, &text);
                if dfa != onig {
                    let at = dfa
                        .iter()
                        .zip(&onig)
                        .position(|(a, b)| a != b)
                        .unwrap_or(dfa.len().min(onig.len()));
                    let from = dfa.get(at).or(onig.get(at)).map_or(0, |m| m.0);
                    let context: String = text[from..].chars().take(8).collect();
                    panic!("{pattern:?} with glue {glue:?} differs at match {at}: {context:?}");
                }
            }
        }
    }

    /// The Basic Multilingual Plane, alone and after a space.
    #[test]
    fn classes_agree_with_oniguruma() {
        check_against_oniguruma(false, &["", " "]);
    }

    /// Every code point, alone and after a space, a letter, a digit, a
    /// punctuation mark and an ideographic space (class boundaries, `\s?`
    /// prefixes and runs): about 25 s in release, so run on demand with
    /// `cargo test --release -p flatrun-model --lib splitter -- --ignored`.
    #[test]
    #[ignore = "25 s in release; run on demand"]
    fn classes_agree_with_oniguruma_on_every_code_point() {
        check_against_oniguruma(true, &["", " ", "a", "1", "!", "\u{3000}"]);
    }

    #[test]
    fn anchors_stay_on_oniguruma() {
        assert!(matches!(Splitter::new(r"\s+$"), Ok(Splitter::Oniguruma(_))));
        assert!(matches!(
            Splitter::new(r"\s+(?!\S)"),
            Ok(Splitter::Oniguruma(_))
        ));
        assert!(matches!(
            Splitter::new(r"[\p{P}\$\+<=>\^~\|]+"),
            Ok(Splitter::Dfa(_))
        ));
    }
}

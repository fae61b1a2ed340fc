//! Streaming text pieces: stop strings over arbitrary splits of the text
//! (property test against a plain reference), and the incremental
//! detokenizer over multi-byte characters.

use flatrun_server::detokenize::IncrementalDecoder;
use flatrun_server::mock::{MockConfig, MockText};
use flatrun_server::stop::{StopMatcher, StopOutcome};
use flatrun_server::TextModel;
use proptest::prelude::*;

/// Feeds `pieces` through a matcher; returns the released text and the stop hit.
fn run_matcher(stops: &[String], pieces: &[&str]) -> (String, Option<String>) {
    let mut matcher = StopMatcher::new(stops);
    let mut out = String::new();
    for piece in pieces {
        match matcher.push(piece) {
            StopOutcome::Continue { released } => out.push_str(&released),
            StopOutcome::Stopped { released, stop } => {
                out.push_str(&released);
                return (out, Some(stop));
            }
        }
    }
    out.push_str(&matcher.flush());
    (out, None)
}

/// Splits `text` at the given byte positions (clamped to char boundaries).
fn split_at<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut cuts: Vec<usize> = cuts
        .iter()
        .map(|&c| c.min(text.len()))
        .filter(|&c| text.is_char_boundary(c))
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut pieces = Vec::new();
    let mut start = 0;
    for cut in cuts {
        pieces.push(&text[start..cut]);
        start = cut;
    }
    pieces.push(&text[start..]);
    pieces
}

proptest! {
    #[test]
    fn stop_matcher_equals_cutting_at_the_first_stop(
        text in "[abé ]{0,40}",
        cuts in proptest::collection::vec(0usize..60, 0..8),
        stops in proptest::collection::vec("[abé]{1,3}", 0..3),
    ) {
        // Reference: the earliest occurrence of any stop string.
        let first = stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|p| (p, s.clone())))
            .min_by_key(|(p, _)| *p);
        let expected = match &first {
            Some((p, _)) => (text[..*p].to_string(), true),
            None => (text.clone(), false),
        };
        let (out, stopped) = run_matcher(&stops, &split_at(&text, &cuts));
        prop_assert_eq!(out, expected.0);
        prop_assert_eq!(stopped.is_some(), expected.1);
    }
}

#[test]
fn decoder_waits_for_a_whole_character() {
    let text = MockText::new(MockConfig::default());
    let tokens = text.tokenize("aé€!", false).unwrap();
    let mut decoder = IncrementalDecoder::new();
    let pieces: Vec<String> = tokens
        .iter()
        .map(|&t| decoder.push(&text, t).unwrap())
        .collect();
    // 'a', then é split over 2 tokens, € over 3, then '!'.
    assert_eq!(pieces, ["a", "", "é", "", "", "€", "!"]);
    assert_eq!(decoder.flush(&text).unwrap(), "");
}

#[test]
fn decoder_flushes_an_incomplete_character_at_the_end() {
    let text = MockText::new(MockConfig::default());
    let mut decoder = IncrementalDecoder::new();
    assert_eq!(decoder.push(&text, u32::from(b'x')).unwrap(), "x");
    assert_eq!(decoder.push(&text, 0xE2).unwrap(), "");
    assert_eq!(decoder.flush(&text).unwrap(), "\u{FFFD}");
}

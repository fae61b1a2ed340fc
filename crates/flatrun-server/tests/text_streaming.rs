//! Streaming text through the scheduler: stop strings over any reply (a
//! property test of the whole path — sampling, the streaming decoder,
//! `flatrun_model`'s stop matcher, the reported `stop_sequence` — against
//! cutting the text at the first stop string), and the mock's streaming
//! decoder over multi-byte characters.

use flatrun_server::mock::{MockConfig, MockText, mock_engine};
use flatrun_server::{
    Engine, FinishReason, GenerationEvent, GenerationRequest, SamplingParams, SchedulerConfig,
    TextModel,
};
use proptest::prelude::*;

/// Greedy generation of the mock's `reply` with `stops`: the streamed text,
/// the text of the final event, and the finish reason.
fn generate(reply: &str, stops: &[String]) -> (String, FinishReason) {
    let mock = MockConfig {
        reply: reply.to_string(),
        ..MockConfig::default()
    };
    let (engine, _stats) = mock_engine(mock, SchedulerConfig::default()).expect("engine");
    let request = GenerationRequest {
        prompt: engine.tokenize("Hi", true).expect("tokenize"),
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens: 200,
        stop: stops.to_vec(),
        ..GenerationRequest::default()
    };
    let mut stream = engine.submit(request).expect("submit");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let mut text = String::new();
        loop {
            match stream.next_event().await {
                Some(GenerationEvent::Token { text: piece, .. }) => text.push_str(&piece),
                Some(GenerationEvent::Finished {
                    reason, text: rest, ..
                }) => {
                    text.push_str(&rest);
                    return (text, reason);
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn the_answer_is_cut_at_the_first_stop_string_which_is_reported(
        reply in "[abé ]{0,30}",
        stops in proptest::collection::vec("[abé]{1,3}", 0..3),
    ) {
        // Reference: the reply grows a character at a time; generation stops
        // as soon as a stop string appears (the longest of those ending
        // there), and the text is cut where it starts.
        let first = reply
            .char_indices()
            .map(|(i, c)| i + c.len_utf8())
            .find_map(|end| {
                stops
                    .iter()
                    .filter(|s| reply[..end].ends_with(s.as_str()))
                    .max_by_key(|s| s.len())
                    .map(|s| (end - s.len(), s.clone()))
            });
        let (text, reason) = generate(&reply, &stops);
        match first {
            Some((at, stop)) => {
                prop_assert_eq!(text, reply[..at].to_string());
                prop_assert_eq!(reason, FinishReason::Stop(stop));
            }
            None => {
                prop_assert_eq!(text, reply);
                prop_assert_eq!(reason, FinishReason::Eos);
            }
        }
    }
}

#[test]
fn mock_decoder_waits_for_a_whole_character() {
    let text = MockText::new(MockConfig::default());
    let tokens = text.tokenize("aé€!", false).unwrap();
    let mut decoder = text.stream_decoder();
    let pieces: Vec<String> = tokens.iter().map(|&t| decoder.push(t)).collect();
    // 'a', then é split over 2 tokens, € over 3, then '!'.
    assert_eq!(pieces, ["a", "", "é", "", "", "€", "!"]);
    assert_eq!(decoder.finish(), "");
}

#[test]
fn mock_decoder_flushes_an_incomplete_character_at_the_end() {
    let text = MockText::new(MockConfig::default());
    let mut decoder = text.stream_decoder();
    assert_eq!(decoder.push(u32::from(b'x')), "x");
    assert_eq!(decoder.push(0xE2), "");
    assert_eq!(decoder.finish(), "\u{FFFD}");
}

//! Speculative decoding in the batch scheduler, on the mock model: prompt
//! lookup and a draft model give the answer decoding alone gives, in fewer
//! passes; rejected proposals are dropped from the cache; a request can turn
//! it off; and with sampling the tokens keep the target's distribution.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use flatrun_server::mock::{BOS, MockConfig, MockStats, mock_engine};
use flatrun_server::{
    BatchEngine, Engine, GenerationRequest, SamplingParams, SchedulerConfig, Speculation,
};

fn request(prompt: &str, max_tokens: usize, temperature: f32, seed: u64) -> GenerationRequest {
    let mut tokens = vec![BOS];
    tokens.extend(prompt.bytes().map(u32::from));
    GenerationRequest {
        prompt: tokens,
        sampling: SamplingParams {
            temperature,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        max_tokens,
        ..GenerationRequest::default()
    }
}

fn engine(
    mock: MockConfig,
    speculation: Option<Speculation>,
) -> (BatchEngine, std::sync::Arc<MockStats>) {
    let scheduler = SchedulerConfig {
        max_seqs: 4,
        prefill_chunk: 16,
        speculation,
        ..SchedulerConfig::default()
    };
    mock_engine(mock, scheduler).expect("mock engine")
}

fn answers(engine: &BatchEngine, requests: Vec<GenerationRequest>) -> Vec<Vec<u32>> {
    common::answer_ids(engine, requests)
}

fn endless() -> MockConfig {
    MockConfig {
        repeat: true,
        context_length: 4096,
        ..MockConfig::default()
    }
}

/// Prompts of several lengths, so that some are still read in chunks while
/// others decode.
fn prompts(max_tokens: usize) -> Vec<GenerationRequest> {
    [
        "Hi",
        "A longer prompt, read in several chunks of sixteen tokens.",
        "x",
    ]
    .iter()
    .map(|p| request(p, max_tokens, 0.0, 1))
    .collect()
}

#[test]
fn prompt_lookup_gives_the_same_answers_in_fewer_passes() {
    let (plain, plain_stats) = engine(endless(), None);
    let expected = answers(&plain, prompts(300));
    let (fast, stats) = engine(endless(), Some(Speculation::lookup(8)));
    let got = answers(&fast, prompts(300));
    assert_eq!(got, expected);
    let (steps, plain_steps) = (
        stats.steps.load(Ordering::SeqCst),
        plain_stats.steps.load(Ordering::SeqCst),
    );
    let s = fast.stats();
    eprintln!(
        "{steps} steps with lookup, {plain_steps} without; {} of {} proposals accepted",
        s.speculative_accepted_total, s.speculative_proposed_total
    );
    // The reply repeats: once it has been said, lookup predicts it (8
    // tokens and the target's own per pass).
    assert!(s.speculative_passes_total > 0, "{s:?}");
    assert!(
        s.speculative_accepted_total * 10 >= s.speculative_proposed_total * 8,
        "{s:?}"
    );
    assert!(
        steps * 5 < plain_steps * 2,
        "{steps} steps with lookup, {plain_steps} without"
    );
    // Alone too.
    assert_eq!(answers(&fast, prompts(300)[..1].to_vec()), expected[..1]);
    let s = fast.stats();
    assert_eq!(s.generated_tokens_total, 3 * 300 + 300);
}

#[test]
fn a_draft_with_rejections_gives_the_same_answers() {
    let mock = MockConfig {
        draft: true,
        ..MockConfig::default()
    };
    let (plain, _) = engine(mock.clone(), None);
    // Up to the reply's end (then `</s>`), and cut by max_tokens.
    let requests = || {
        let mut r = prompts(64);
        r.push(request("short", 7, 0.0, 1));
        r
    };
    let expected = answers(&plain, requests());
    let (fast, stats) = engine(mock, Some(Speculation::draft(6)));
    assert_eq!(answers(&fast, requests()), expected);
    let s = fast.stats();
    // The draft is wrong at every fifth position: rejections were dropped
    // from the cache.
    assert!(s.speculative_accepted_total > 0, "{s:?}");
    assert!(
        s.speculative_accepted_total < s.speculative_proposed_total,
        "{s:?}"
    );
    assert!(stats.truncations.load(Ordering::SeqCst) > 0);
}

#[test]
fn a_request_can_turn_speculation_off() {
    let (fast, stats) = engine(endless(), Some(Speculation::lookup(8)));
    let mut off = request("Hi", 100, 0.0, 1);
    off.draft_max = Some(0);
    let ids = answers(&fast, vec![off]);
    assert_eq!(ids[0].len(), 100);
    assert_eq!(fast.stats().speculative_passes_total, 0);
    // One pass for the prompt, one per token after the first.
    assert_eq!(stats.steps.load(Ordering::SeqCst), 100);
    // A shorter draft than the server's.
    let mut short = request("Hi", 100, 0.0, 1);
    short.draft_max = Some(2);
    assert_eq!(answers(&fast, vec![short]), ids);
    let s = fast.stats();
    assert!(s.speculative_passes_total > 0);
    assert!(s.speculative_proposed_total <= 2 * s.speculative_passes_total);
}

/// The chi-square critical value at p = 0.001 (Wilson–Hilferty).
fn chi2_critical_001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090_232;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Two-sample chi-square statistic over the categories seen, with those
/// seen fewer than 10 times in all pooled; and its degrees of freedom.
fn chi_square(a: &BTreeMap<u32, u64>, b: &BTreeMap<u32, u64>) -> (f64, usize) {
    let mut cells: Vec<(u64, u64)> = Vec::new();
    let mut rare = (0, 0);
    let keys: std::collections::BTreeSet<u32> = a.keys().chain(b.keys()).copied().collect();
    for key in keys {
        let cell = (
            a.get(&key).copied().unwrap_or(0),
            b.get(&key).copied().unwrap_or(0),
        );
        if cell.0 + cell.1 < 10 {
            rare = (rare.0 + cell.0, rare.1 + cell.1);
        } else {
            cells.push(cell);
        }
    }
    if rare.0 + rare.1 > 0 {
        cells.push(rare);
    }
    let (na, nb) = (
        cells.iter().map(|c| c.0).sum::<u64>() as f64,
        cells.iter().map(|c| c.1).sum::<u64>() as f64,
    );
    let statistic = cells
        .iter()
        .map(|&(x, y)| {
            let total = (x + y) as f64;
            let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
            (x as f64 - ea).powi(2) / ea + (y as f64 - eb).powi(2) / eb
        })
        .sum();
    (statistic, cells.len() - 1)
}

#[test]
fn speculative_sampling_keeps_the_target_distribution() {
    // Temperature 1.5 spreads the mock's distribution: its favoured byte
    // takes about half; the draft proposes that byte (wrong at every fifth
    // position), which plain acceptance of every proposal would overweight.
    let mock = MockConfig {
        draft: true,
        ..MockConfig::default()
    };
    let draws = 1500;
    let sample = |speculation: Option<Speculation>| {
        let (engine, _) = engine(mock.clone(), speculation);
        let mut by_position = vec![BTreeMap::new(); 4];
        for chunk in (0..draws).collect::<Vec<u64>>().chunks(4) {
            let requests = chunk
                .iter()
                .map(|&seed| request("Hi", 4, 1.5, seed))
                .collect();
            for ids in answers(&engine, requests) {
                for (counts, &id) in by_position.iter_mut().zip(&ids) {
                    *counts.entry(id).or_insert(0u64) += 1;
                }
            }
        }
        (by_position, engine.stats())
    };
    let (plain, _) = sample(None);
    let (speculative, stats) = sample(Some(Speculation::draft(3)));
    assert!(stats.speculative_passes_total > 0, "{stats:?}");
    // Positions 1–3 come from verification passes.
    for position in 1..4 {
        let (statistic, df) = chi_square(&plain[position], &speculative[position]);
        eprintln!(
            "position {position}: chi-square {statistic:.1} over {df} degrees of freedom (critical {:.1})",
            chi2_critical_001(df)
        );
        assert!(df >= 5, "too few categories at {position}");
        assert!(
            statistic < chi2_critical_001(df),
            "position {position}: chi-square {statistic:.1} ≥ {:.1}",
            chi2_critical_001(df)
        );
    }
}

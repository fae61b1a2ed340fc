//! Logit fixtures and comparing a run's logits to them.
//!
//! A fixture (`tests/fixtures/**/<model>.logits.json`, written by the
//! `scripts/gen_*_fixtures*` generators from llama.cpp) holds, for each
//! teacher-forced prompt, its token ids and the reference's top-k ids and
//! logits at every position (`teacher_forced[i].{tokens, top_ids,
//! top_logits}`), and optionally greedy continuations (`greedy`, whose shape
//! differs between fixture families and is left to each test as JSON).
//!
//! [`teacher_forced`] runs every prompt through a model in one step with all
//! logits and gathers an [`Agreement`]: arg-max agreement (overall and at the
//! *decisive* positions, whose reference top-2 gap is at least
//! [`Bounds::decisive_gap`]), the share of positions whose reference top-k
//! logits are all matched within [`Bounds::top10_tolerance`], and the mean and
//! largest |ours − reference|. [`Agreement::assert_within`] checks it.

use std::path::{Path, PathBuf};

use flatrun_runtime::{Model, StepOptions, argmax};
use serde_json::Value;

/// The token ids in a JSON array (non-integers are skipped).
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// The numbers in a JSON array, as f32 (non-numbers are skipped).
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_f64())
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

/// One teacher-forced prompt of a fixture.
pub struct TeacherForcedCase {
    /// The prompt text, when the fixture records it.
    pub prompt: Option<String>,
    /// The prompt's token ids (as the reference tokenized it).
    pub tokens: Vec<u32>,
    /// The reference's top-k token ids at each position, best first.
    pub top_ids: Vec<Vec<u32>>,
    /// The logits of `top_ids`.
    pub top_logits: Vec<Vec<f32>>,
}

/// A logit fixture: its teacher-forced cases, and the whole JSON document
/// for the parts a test reads itself (`greedy`, `model`, …).
pub struct LogitFixture {
    /// Where it was read from.
    pub path: PathBuf,
    /// The teacher-forced prompts.
    pub teacher_forced: Vec<TeacherForcedCase>,
    /// The whole document.
    pub json: Value,
}

impl LogitFixture {
    /// Reads and parses the fixture at `path` (panics with the path on error:
    /// fixtures are committed files).
    pub fn load(path: &Path) -> Self {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()));
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("parsing fixture {}: {e}", path.display()));
        let teacher_forced = json["teacher_forced"]
            .as_array()
            .unwrap_or_else(|| panic!("{}: no teacher_forced array", path.display()))
            .iter()
            .map(|case| TeacherForcedCase {
                prompt: case["prompt"].as_str().map(str::to_string),
                tokens: ids(&case["tokens"]),
                top_ids: case["top_ids"]
                    .as_array()
                    .map(|a| a.iter().map(ids).collect())
                    .unwrap_or_default(),
                top_logits: case["top_logits"]
                    .as_array()
                    .map(|a| a.iter().map(floats).collect())
                    .unwrap_or_default(),
            })
            .collect::<Vec<_>>();
        for (i, case) in teacher_forced.iter().enumerate() {
            assert_eq!(
                case.top_ids.len(),
                case.top_logits.len(),
                "{}: case {i}: top_ids and top_logits differ in length",
                path.display()
            );
        }
        Self {
            path: path.to_path_buf(),
            teacher_forced,
            json,
        }
    }

    /// The total number of teacher-forced positions.
    pub fn positions(&self) -> usize {
        self.teacher_forced.iter().map(|c| c.top_ids.len()).sum()
    }
}

/// What a run must reach against a fixture.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Share of all positions whose arg-max must agree.
    pub argmax_share: f64,
    /// A position is decisive when the reference's top-2 gap is at least this…
    pub decisive_gap: f32,
    /// …and at least this share of the decisive positions must agree.
    pub decisive_share: f64,
    /// Largest tolerated |ours − reference| on a top-k logit…
    pub top10_tolerance: f32,
    /// …at at least this share of the positions.
    pub top10_share: f64,
    /// Largest tolerated mean |ours − reference| over all top-k logits.
    pub mean_tolerance: f32,
    /// Fewest teacher-forced positions the fixture must hold.
    pub min_positions: usize,
}

/// An arg-max disagreement.
#[derive(Clone, Debug)]
pub struct Flip {
    /// Index of the teacher-forced case.
    pub case: usize,
    /// Position within the case.
    pub position: usize,
    /// Our arg-max.
    pub ours: u32,
    /// The reference's arg-max.
    pub reference: u32,
    /// The reference's top-2 gap there.
    pub gap: f32,
}

/// The agreement of a run's logits with a fixture, gathered position by position.
#[derive(Clone, Debug)]
pub struct Agreement {
    /// Names the run in messages (model, backend, …).
    pub label: String,
    /// The bounds the counts below were gathered with.
    pub bounds: Bounds,
    /// Positions compared.
    pub positions: usize,
    /// Positions whose arg-max agrees.
    pub argmax_ok: usize,
    /// Decisive positions.
    pub decisive: usize,
    /// Decisive positions whose arg-max agrees.
    pub decisive_ok: usize,
    /// Positions whose top-k logits are all within `top10_tolerance`.
    pub top10_ok: usize,
    /// Sum of |ours − reference| over all top-k logits.
    pub sum_abs: f64,
    /// Number of top-k logits compared.
    pub n_abs: usize,
    /// Largest |ours − reference|.
    pub worst: f32,
    /// Every arg-max disagreement.
    pub flips: Vec<Flip>,
}

impl Agreement {
    /// An empty tally for the run `label`.
    pub fn new(label: impl Into<String>, bounds: Bounds) -> Self {
        Self {
            label: label.into(),
            bounds,
            positions: 0,
            argmax_ok: 0,
            decisive: 0,
            decisive_ok: 0,
            top10_ok: 0,
            sum_abs: 0.0,
            n_abs: 0,
            worst: 0.0,
            flips: Vec::new(),
        }
    }

    /// Adds one position: our logits `row` against the reference's top-k.
    pub fn add_position(
        &mut self,
        case: usize,
        position: usize,
        row: &[f32],
        top_ids: &[u32],
        top_logits: &[f32],
    ) {
        let Some(&reference) = top_ids.first() else {
            return;
        };
        self.positions += 1;
        // Arg-max, overall and at decisive positions.
        let ours = argmax(row);
        let gap = match top_logits {
            [a, b, ..] => a - b,
            _ => f32::INFINITY,
        };
        let agree = ours == reference;
        self.argmax_ok += agree as usize;
        if gap >= self.bounds.decisive_gap {
            self.decisive += 1;
            self.decisive_ok += agree as usize;
        }
        if !agree {
            self.flips.push(Flip {
                case,
                position,
                ours,
                reference,
                gap,
            });
        }
        // Each of the reference's top-k logits.
        let mut within = true;
        for (&id, &want) in top_ids.iter().zip(top_logits) {
            let diff = row
                .get(id as usize)
                .map_or(f32::INFINITY, |&got| (got - want).abs());
            self.sum_abs += diff as f64;
            self.n_abs += 1;
            self.worst = self.worst.max(diff);
            within &= diff <= self.bounds.top10_tolerance;
        }
        self.top10_ok += within as usize;
    }

    /// Mean |ours − reference| over all top-k logits.
    pub fn mean_abs(&self) -> f32 {
        (self.sum_abs / self.n_abs.max(1) as f64) as f32
    }

    /// One line summing the run up.
    pub fn report(&self) -> String {
        let n = self.positions;
        format!(
            "{}: {n} positions, argmax {}/{n} (decisive {}/{}), top-10 within {}: {}/{n}, \
             mean |diff| {:.4}, max {:.3}",
            self.label,
            self.argmax_ok,
            self.decisive_ok,
            self.decisive,
            self.bounds.top10_tolerance,
            self.top10_ok,
            self.mean_abs(),
            self.worst
        )
    }

    /// Prints every flip and the summary line to stderr.
    pub fn print(&self) {
        for f in &self.flips {
            eprintln!(
                "  {}: argmax differs at case {} position {}: ours {}, reference {} (reference gap {:.3})",
                self.label, f.case, f.position, f.ours, f.reference, f.gap
            );
        }
        eprintln!("{}", self.report());
    }

    /// Panics (with the summary line) unless every bound holds.
    pub fn assert_within(&self) {
        let b = &self.bounds;
        let n = self.positions as f64;
        let report = self.report();
        assert!(
            self.positions >= b.min_positions,
            "{report}: the fixture holds fewer than {} positions",
            b.min_positions
        );
        assert!(
            self.decisive_ok as f64 >= b.decisive_share * self.decisive as f64,
            "{report}: decisive arg-max agreement below {}",
            b.decisive_share
        );
        assert!(
            self.argmax_ok as f64 >= b.argmax_share * n,
            "{report}: arg-max agreement below {}",
            b.argmax_share
        );
        assert!(
            self.top10_ok as f64 >= b.top10_share * n,
            "{report}: top-10 agreement below {}",
            b.top10_share
        );
        assert!(
            self.mean_abs() <= b.mean_tolerance,
            "{report}: mean |diff| above {}",
            b.mean_tolerance
        );
    }
}

/// All logits of `tokens` run through a fresh session in one step
/// (`tokens.len() × vocab`, row-major).
pub fn all_logits(model: &mut Model, tokens: &[u32]) -> Vec<f32> {
    let vocab = model.executor().vocab_size();
    let out = model
        .session()
        .step_with(
            tokens,
            StepOptions {
                all_logits: true,
                ..Default::default()
            },
        )
        .expect("step");
    let all = out.all_logits.expect("all logits");
    assert_eq!(all.len(), tokens.len() * vocab, "all_logits size");
    all
}

/// Runs every teacher-forced case of `fixture` through `model` and tallies
/// its agreement (printed; check it with [`Agreement::assert_within`]).
pub fn teacher_forced(
    model: &mut Model,
    fixture: &LogitFixture,
    label: impl Into<String>,
    bounds: Bounds,
) -> Agreement {
    let mut agreement = Agreement::new(label, bounds);
    let vocab = model.executor().vocab_size();
    for (c, case) in fixture.teacher_forced.iter().enumerate() {
        let all = all_logits(model, &case.tokens);
        for (p, (rid, rl)) in case.top_ids.iter().zip(&case.top_logits).enumerate() {
            let row = &all[p * vocab..(p + 1) * vocab];
            agreement.add_position(c, p, row, rid, rl);
        }
    }
    agreement.print();
    agreement
}

/// Greedy decoding of a synthetic-family fixture's `greedy` case (prompt
/// ids, the reference's continuation and its top-2 at each step): prefill,
/// then one token per step. Each token must equal the reference's, except
/// that the run may leave the reference's path at a near-tie (reference top-2
/// gap below `near_tie`) by taking its second choice; the comparison stops
/// there. Returns our tokens up to that point.
pub fn greedy_on_reference_path(
    model: &mut Model,
    fixture: &LogitFixture,
    label: &str,
    near_tie: f32,
) -> Vec<u32> {
    let greedy = &fixture.json["greedy"];
    let prompt = ids(&greedy["prompt_tokens"]);
    let want = ids(&greedy["tokens"]);
    let rows = |key: &str| greedy[key].as_array().expect(key).clone();
    let top2_ids: Vec<Vec<u32>> = rows("top2_ids").iter().map(ids).collect();
    let top2_logits: Vec<Vec<f32>> = rows("top2_logits").iter().map(floats).collect();
    assert_eq!(top2_ids.len(), want.len());
    let mut session = model.session();
    let mut logits = session.step(&prompt).expect("prefill");
    let mut got = Vec::with_capacity(want.len());
    for step in 0..want.len() {
        let next = argmax(&logits);
        got.push(next);
        if next != want[step] {
            let (gap, second) = (
                top2_logits[step][0] - top2_logits[step][1],
                top2_ids[step][1],
            );
            eprintln!(
                "{label} greedy leaves the reference at step {step}: ours {next}, \
                 reference {} (second {second}, gap {gap:.3})",
                want[step]
            );
            assert!(
                gap < near_tie && next == second,
                "{label}: greedy continuation differs at step {step} \
                 (ours {got:?}, reference {want:?})"
            );
            break;
        }
        logits = session.step(&[next]).expect("decode");
    }
    eprintln!(
        "{label} greedy: {} of {} tokens on the reference's path",
        got.iter().zip(&want).take_while(|(a, b)| a == b).count(),
        want.len()
    );
    got
}

/// Assert that two runs gave the same logits bit for bit: `ours[i]` against
/// `theirs[i]` for every output `i` (`what` names the two runs in the message).
pub fn assert_bit_identical(ours: &[Vec<f32>], theirs: &[Vec<f32>], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: different output counts");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: output {i}: different lengths");
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: output {i}: {differ} logits differ");
    }
}

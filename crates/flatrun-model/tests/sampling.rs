//! Sampling: greedy, seeded reproducibility, the filters, penalties, stop strings.

use flatrun_model::sampling::{Sampler, SamplingParams, StopMatcher, argmax};

fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = flatrun_model::sampling::Xoshiro256::seed_from_u64(seed);
    (0..n)
        .map(|_| (rng.next_f64() * 10.0 - 5.0) as f32)
        .collect()
}

#[test]
fn greedy_is_argmax() {
    let l = logits(151_936, 1);
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample(&mut l.clone(), &[]), argmax(&l));
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(42),
        ..Default::default()
    };
    let l = logits(1000, 2);
    let run = |params: SamplingParams| {
        let mut s = Sampler::new(params);
        (0..50)
            .map(|_| s.sample(&mut l.clone(), &[]))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(params.clone()), run(params.clone()));
    assert_ne!(
        run(params.clone()),
        run(SamplingParams {
            seed: Some(43),
            ..params
        })
    );
}

#[test]
fn top_k_top_p_min_p_restrict_the_candidates() {
    let l = logits(5000, 3);
    let mut order: Vec<u32> = (0..5000).collect();
    order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));
    let top3 = &order[..3];
    let mut s = Sampler::new(SamplingParams {
        temperature: 5.0,
        top_k: 3,
        seed: Some(1),
        ..Default::default()
    });
    for _ in 0..200 {
        assert!(top3.contains(&s.sample(&mut l.clone(), &[])));
    }
    // One dominant token: top-p 0.5 and min-p 0.5 keep only it.
    let mut peaked = l.clone();
    peaked[17] = 100.0;
    for params in [
        SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: Some(1),
            ..Default::default()
        },
    ] {
        let mut s = Sampler::new(params);
        for _ in 0..50 {
            assert_eq!(s.sample(&mut peaked.clone(), &[]), 17);
        }
    }
}

#[test]
fn penalties_only_touch_the_window() {
    let mut l = vec![2.0f32, 1.9, -1.0, 0.0];
    let params = SamplingParams {
        repeat_penalty: 2.0,
        penalty_window: 2,
        ..Default::default()
    };
    let mut s = Sampler::new(params);
    // Token 0 is in the window: 2.0 / 2 = 1.0 < 1.9, so greedy picks 1.
    assert_eq!(s.sample(&mut l, &[3, 0]), 1);
    assert_eq!(l, vec![1.0, 1.9, -1.0, 0.0]);
    // Token 0 outside the window of 2: untouched.
    let mut l = vec![2.0f32, 1.9, -1.0, 0.0];
    assert_eq!(s.sample(&mut l, &[0, 3, 2]), 0);
    assert_eq!(l[2], -2.0);
    let mut l = vec![1.0f32, 0.0];
    let mut s = Sampler::new(SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    });
    s.sample(&mut l, &[0, 0, 0]);
    assert_eq!(l[0], 1.0 - 0.5 - 0.75);
}

#[test]
fn stop_strings_across_token_boundaries() {
    let mut m = StopMatcher::new(["</answer>", "STOP"]);
    let mut shown = String::new();
    let mut stopped = false;
    for piece in ["The result", " is 4.</", "ans", "wer> and more"] {
        let r = m.push(piece);
        shown.push_str(&r.emit);
        if r.stopped {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert_eq!(shown, "The result is 4.");
    // A partial match that does not complete is released.
    let mut m = StopMatcher::new(["STOP"]);
    assert_eq!(m.push("ST").emit, "");
    assert_eq!(m.push("AR").emit, "STAR");
    assert_eq!(m.push("ST").emit, "");
    assert_eq!(m.finish(), "ST");
    let mut m = StopMatcher::new(["é!"]);
    assert_eq!(m.push("café").emit, "caf");
    assert!(m.push("!").stopped);
}

#[test]
fn logit_bias_adds_to_the_logits_after_the_penalties() {
    // Greedy picks 1; a bias of +3 on 2 makes 2 win, -100 on 1 bans it.
    let logits = vec![0.0f32, 2.0, 0.5, 1.5];
    let pick = |bias: Vec<(u32, f32)>| {
        let mut s = Sampler::new(SamplingParams {
            logit_bias: bias,
            ..Default::default()
        });
        s.sample(&mut logits.clone(), &[])
    };
    assert_eq!(pick(vec![]), 1);
    assert_eq!(pick(vec![(2, 3.0)]), 2);
    assert_eq!(pick(vec![(1, -100.0)]), 3);
    // Out-of-vocabulary ids are ignored.
    assert_eq!(pick(vec![(99, 100.0)]), 1);
}

#[test]
fn the_allowed_mask_restricts_every_mode() {
    let logits = vec![5.0f32; 100];
    // Only 37 and 70 allowed.
    let mut mask = vec![0u32; 4];
    mask[1] |= 1 << 5;
    mask[2] |= 1 << 6;
    for params in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(1),
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 10,
            top_p: 0.9,
            seed: Some(2),
            ..Default::default()
        },
    ] {
        let mut s = Sampler::new(params);
        for _ in 0..50 {
            let t = s.sample_allowed(&mut logits.clone(), &[], Some(&mask));
            assert!(t == 37 || t == 70, "{t}");
        }
    }
    // Allowed tokens the model rules out (-inf) still win over the others.
    let mut ruled_out = logits.clone();
    ruled_out[37] = f32::NEG_INFINITY;
    ruled_out[70] = f32::NEG_INFINITY;
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample_allowed(&mut ruled_out, &[], Some(&mask)), 37);
    // A mask that allows nothing is ignored.
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample_allowed(&mut logits.clone(), &[], Some(&[0; 4])), 0);
}

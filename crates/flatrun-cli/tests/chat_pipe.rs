//! `flatrun chat` driven through a pipe (no terminal): the KV cache is kept
//! between turns, so turn 2 prefills only its new tokens; `/reset` empties
//! the cache; answers go to stdout, everything else to stderr.

mod common;

use common::{flatrun, smollm2, stderr_of, stdout_of};

/// `(prefilled, reused)` of every `last turn: prefilled P tok, reused R cached tok` line.
fn turn_counts(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter(|l| l.starts_with("last turn: prefilled "))
        .map(|l| {
            let n: Vec<usize> = l
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            (n[0], n[1])
        })
        .collect()
}

#[test]
fn turn_two_prefills_only_its_new_tokens() {
    let Some(model) = smollm2() else { return };
    let input =
        "What is the capital of France?\n/stats\nAnd of Germany?\n/stats\n/reset\n/stats\nexit\n";
    let out = flatrun()
        .arg("chat")
        .arg("--model")
        .arg(&model)
        .args(["--max-new", "24", "--ctx", "1024"])
        .write_stdin(input)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    let counts = turn_counts(&err);
    assert_eq!(counts.len(), 3, "{err}");
    // Turn 1: everything is new.
    let (first_prefill, first_reused) = counts[0];
    assert!(first_prefill > 10 && first_reused == 0, "{err}");
    // Turn 2: the history is reused; only the new message (and its template) is fed.
    let (second_prefill, second_reused) = counts[1];
    assert!(
        second_reused >= first_prefill && second_prefill < 30,
        "turn 2 prefilled {second_prefill}, reused {second_reused}:\n{err}"
    );
    // After /reset the cache is empty.
    assert!(err.contains("cached 0 of 1024 tokens"), "{err}");
    // The answers (and nothing else) are on stdout.
    let text = stdout_of(&out);
    assert!(!text.trim().is_empty());
    assert!(
        !text.contains("prefilled") && !text.contains(">>>"),
        "{text}"
    );
}

//! `flatrun tokenize`, `flatrun bench` and `flatrun inspect --layer` / the
//! memory plan, on SmolLM2.

mod common;

use common::{flatrun, smollm2, stderr_of, stdout_of};

#[test]
fn tokenize_prints_ids_and_pieces() {
    let Some(model) = smollm2() else { return };
    let out = flatrun()
        .arg("tokenize")
        .arg("--model")
        .arg(&model)
        .args(["--text", "Hello world"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    // llama-tokenize style: `    id -> 'piece'`.
    assert!(text.lines().any(|l| l.ends_with("-> 'Hello'")), "{text}");
    assert!(text.lines().any(|l| l.ends_with("-> ' world'")), "{text}");

    let json = |extra: &[&str]| -> serde_json::Value {
        let out = flatrun()
            .arg("tokenize")
            .arg("--model")
            .arg(&model)
            .args(extra)
            .arg("--json")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = json(&["--text", "Hello world"]);
    assert_eq!(plain["count"], plain["ids"].as_array().unwrap().len());
    // Special tokens are recognized unless --no-special.
    let special = json(&["--text", "<|im_start|>user"]);
    let literal = json(&["--text", "<|im_start|>user", "--no-special"]);
    assert!(special["ids"].as_array().unwrap().len() < literal["ids"].as_array().unwrap().len());
    // --chat wraps the text in the template.
    let chat = json(&["--text", "Hello world", "--chat"]);
    assert!(
        chat["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == "<|im_start|>")
    );
    // --file reads the same text.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.txt");
    std::fs::write(&file, "Hello world").unwrap();
    let out = flatrun()
        .arg("tokenize")
        .arg("--model")
        .arg(&model)
        .arg("--file")
        .arg(&file)
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["ids"],
        plain["ids"]
    );
}

#[test]
fn bench_reports_each_residency_mode() {
    let Some(model) = smollm2() else { return };
    let out = flatrun()
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args([
            "-p",
            "16",
            "-n",
            "4",
            "-r",
            "2",
            "--residency",
            "resident",
            "--residency",
            "stream",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["residency"].as_str().unwrap().to_string(),
                r["test"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("resident", "pp16"),
            ("resident", "tg4"),
            ("stream", "pp16"),
            ("stream", "tg4")
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    for r in &rows {
        let (min, med, max) = (
            r["min_tok_s"].as_f64().unwrap(),
            r["median_tok_s"].as_f64().unwrap(),
            r["max_tok_s"].as_f64().unwrap(),
        );
        assert!(min > 0.0 && min <= med && med <= max, "{r}");
        assert_eq!(r["samples_tok_s"].as_array().unwrap().len(), 2);
        assert!(r["peak_rss_bytes"].as_u64().unwrap() > 0);
    }
    // The markdown table.
    let out = flatrun()
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args(["-p", "8", "-n", "2", "-r", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let table = stdout_of(&out);
    assert!(table.starts_with("| model | residency | test |"), "{table}");
    assert!(
        table.contains("| pp8 |") && table.contains("| tg2 |"),
        "{table}"
    );
}

#[test]
fn inspect_memory_plan_and_layer() {
    let Some(model) = smollm2() else { return };
    let out = flatrun().arg("inspect").arg(&model).output().unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    for needle in [
        "memory plan",
        "embedding",
        "output head",
        "layers        30 ×",
        "resident",
        "stream",
        "cap=",
    ] {
        assert!(text.contains(needle), "`{needle}` not in:\n{text}");
    }
    let out = flatrun()
        .arg("inspect")
        .arg(&model)
        .args(["--json", "--layer", "3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = &v["memory_plan"];
    assert_eq!(plan["layer_bytes"].as_array().unwrap().len(), 30);
    let modes = plan["modes"].as_array().unwrap();
    let peak = |name: &str| {
        modes
            .iter()
            .find(|m| m["residency"].as_str().unwrap().starts_with(name))
            .unwrap()["peak_bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(
        peak("stream") < peak("cap=") && peak("cap=") < peak("resident"),
        "{modes:?}"
    );
    let layer = &plan["layer"];
    assert_eq!(layer["index"], 3);
    let names: Vec<&str> = layer["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"layers.3.attn.q") && names.contains(&"layers.3.ffn.down"),
        "{names:?}"
    );
    let total: u64 = layer["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(total, layer["bytes"].as_u64().unwrap());

    let out = flatrun()
        .arg("inspect")
        .arg(&model)
        .args(["--layer", "99"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("30 layers"), "{}", stderr_of(&out));
}

#[test]
fn bench_batch_decodes_sequences_together_and_reports_the_plan() {
    let Some(model) = smollm2() else { return };
    let out = flatrun()
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args([
            "-p",
            "4",
            "-n",
            "3",
            "-r",
            "1",
            "--batch",
            "3",
            "--no-warmup",
            "--residency",
            "cap=20M",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["batch"], 3);
        // The context is sized to the test: 4 prompt (8 for the warm-up) + 3 + 1.
        assert_eq!(r["ctx"], 16);
        let kept = r["resident_weight_bytes"].as_u64().unwrap();
        let streamed = r["streamed_bytes_per_token"].as_u64().unwrap();
        assert!(kept > 0 && kept <= 20 << 20, "kept {kept}");
        assert!(streamed > 0);
        assert!(r["anon_after_bytes"].as_u64().unwrap() > 0);
    }
}

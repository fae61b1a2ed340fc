//! `flatrun serve` on SmolLM2: the official `openai` and `anthropic` Python
//! SDK tests of the server crate (`crates/flatrun-server/tests/sdk/test_sdk.py`)
//! against the real runtime, including "the greedy answer equals
//! `flatrun run --chat` with the same prompt"; then a clean SIGTERM shutdown.

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use std::path::PathBuf;
use std::process::Command;

use common::{flatrun, python_with, smollm2, stderr_of, stdout_of};
use serve_process::ServeProcess;

const API_KEY: &str = "serve-test-key";
const CONTEXT: usize = 1024;
const MAX_BODY: usize = 64 * 1024;
const GREEDY_PROMPT: &str = "What is the capital of France?";
const GREEDY_MAX: usize = 24;

#[test]
fn official_sdks_against_flatrun_serve() {
    let Some(model) = smollm2() else { return };
    let Some(python) = python_with("openai, anthropic") else {
        return;
    };

    // The reference: `flatrun run --chat` with the same prompt, greedy.
    let reference = flatrun()
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args([
            "--chat",
            "-q",
            "--ctx",
            &CONTEXT.to_string(),
            "--max-new",
            &GREEDY_MAX.to_string(),
        ])
        .args(["--prompt", GREEDY_PROMPT])
        .output()
        .unwrap();
    assert!(reference.status.success(), "{}", stderr_of(&reference));
    let expected = stdout_of(&reference);
    let expected = expected.strip_suffix('\n').unwrap_or(&expected).to_string();
    assert!(!expected.is_empty());

    let (context, max_body) = (CONTEXT.to_string(), MAX_BODY.to_string());
    let mut server = ServeProcess::start(
        &model,
        &[
            "--api-key",
            API_KEY,
            "--max-body",
            &max_body,
            "--ctx",
            &context,
            "--max-seqs",
            "4",
            "-q",
        ],
        &[],
    );
    server.wait_healthy();
    let name = model
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_end_matches(".gguf")
        .to_string();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../flatrun-server/tests/sdk/test_sdk.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg("-v")
        .env("FLATRUN_BASE_URL", format!("http://{}", server.address))
        .env("FLATRUN_SDK_MODEL", &name)
        .env("FLATRUN_SDK_API_KEY", API_KEY)
        .env("FLATRUN_SDK_CONTEXT", CONTEXT.to_string())
        .env("FLATRUN_SDK_MAX_BODY", MAX_BODY.to_string())
        .env("FLATRUN_SDK_GREEDY_PROMPT", GREEDY_PROMPT)
        .env("FLATRUN_SDK_GREEDY_EXPECTED", &expected)
        .env("FLATRUN_SDK_GREEDY_MAX", GREEDY_MAX.to_string())
        .output()
        .expect("run the SDK tests");
    let report = format!("{}{}", stdout_of(&output), stderr_of(&output));
    eprintln!("{report}");
    assert!(
        output.status.success(),
        "the SDK tests failed against flatrun serve (see above)"
    );
    assert!(
        report.lines().any(
            |l| l.starts_with("test_greedy_answer_matches_the_reference") && l.ends_with("... ok")
        ),
        "the greedy check did not run"
    );

    // SIGTERM: a clean, successful exit.
    let status = server.terminate();
    assert!(status.success(), "flatrun serve exited with {status}");
}

#[test]
fn serve_reports_a_busy_port() {
    let Some(model) = smollm2() else { return };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let out = flatrun()
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .args(["--port", &port])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("--port"), "{}", stderr_of(&out));
}

#[test]
fn serve_speculates_with_prompt_lookup_and_keeps_the_greedy_answer() {
    let Some(model) = smollm2() else { return };
    let Some(python) = python_with("openai") else {
        return;
    };
    let prompt = "Copy this line twice: alpha beta gamma delta epsilon zeta eta theta iota kappa";
    let max = "48";
    let reference = flatrun()
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args(["--chat", "-q", "--ctx", "1024", "--max-new", max])
        .args(["--prompt", prompt])
        .output()
        .unwrap();
    assert!(reference.status.success(), "{}", stderr_of(&reference));
    let expected = stdout_of(&reference);
    let expected = expected.strip_suffix('\n').unwrap_or(&expected).to_string();

    let mut server = ServeProcess::start(&model, &["--ctx", "1024", "--lookup", "-q"], &[]);
    server.wait_healthy();
    // The same request with speculation (the server's default) and with a
    // request's `speculative.n_max: 0`, through the official SDK.
    let script = r#"
import json, os, sys, urllib.request
import openai
base = os.environ["BASE"]
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
def ask(extra):
    r = client.chat.completions.create(
        model=os.environ["NAME"], messages=[{"role": "user", "content": os.environ["PROMPT"]}],
        max_tokens=int(os.environ["MAX"]), temperature=0, extra_body=extra)
    return r.choices[0].message.content
spec = ask({"cache_prompt": False})
metrics = urllib.request.urlopen(base + "/metrics").read().decode()
plain = ask({"cache_prompt": False, "speculative.n_max": 0})
counters = {l.split()[0]: float(l.split()[1]) for l in metrics.splitlines()
            if l.startswith("flatrun_speculative_")}
print(json.dumps({"spec": spec, "plain": plain, "counters": counters}))
"#;
    let output = Command::new(&python)
        .args(["-c", script])
        .env("BASE", format!("http://{}", server.address))
        .env("PROMPT", prompt)
        .env("MAX", max)
        .env(
            "NAME",
            model
                .file_name()
                .unwrap()
                .to_string_lossy()
                .trim_end_matches(".gguf"),
        )
        .output()
        .expect("run the SDK client");
    assert!(output.status.success(), "{}", stderr_of(&output));
    let report: serde_json::Value = serde_json::from_str(stdout_of(&output).trim()).unwrap();
    eprintln!("{report}");
    assert_eq!(report["spec"], expected.as_str());
    assert_eq!(report["plain"], expected.as_str());
    let counters = &report["counters"];
    assert!(counters["flatrun_speculative_passes_total"].as_f64() > Some(0.0));
    assert!(counters["flatrun_speculative_accepted_tokens_total"].as_f64() > Some(0.0));
    assert!(server.terminate().success());
}

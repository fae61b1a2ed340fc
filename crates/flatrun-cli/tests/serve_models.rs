//! `flatrun serve` with two real models: each request is answered by the
//! model its `model` field names, `/v1/models` lists both, an unknown name
//! is a 404.

mod common;
#[path = "common/serve_process.rs"]
mod serve_process;

use serde_json::{Value, json};
use serve_process::ServeProcess;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Status and JSON body of a request.
fn request(address: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut socket = TcpStream::connect(address).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        socket,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).unwrap().parse().unwrap();
    let json = response
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    (status, json)
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release only: runs two real models")]
fn two_real_models_are_routed_by_name() {
    let (Some(smollm2), Some(qwen)) = (
        common::smollm2(),
        common::model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ) else {
        return;
    };
    let qwen_arg = qwen.to_string_lossy().into_owned();
    let mut server = ServeProcess::start(
        &smollm2,
        &[
            "--model",
            &qwen_arg,
            "--residency",
            "stream",
            "--ctx",
            "512",
        ],
        &[],
    );
    server.wait_healthy();
    let ask = |model: &str| {
        let body = json!({"model": model, "prompt": "The capital of France is",
                          "max_tokens": 4, "temperature": 0});
        request(&server.address, "POST", "/v1/completions", Some(&body))
    };
    // The second model loads after the first: 503 until then.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (status, reply) = loop {
        let (status, reply) = ask("qwen2.5-coder-0.5b-instruct-q4_k_m");
        if status != 503 || Instant::now() > deadline {
            break (status, reply);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["model"], "qwen2.5-coder-0.5b-instruct-q4_k_m");
    let qwen_text = reply["choices"][0]["text"].as_str().unwrap().to_string();
    let (status, reply) = ask("SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["model"], "SmolLM2-135M-Instruct.Q4_1");
    let smol_text = reply["choices"][0]["text"].as_str().unwrap().to_string();
    assert_ne!(qwen_text, smol_text, "both answers came from one model");
    let (status, reply) = ask("nope");
    assert_eq!(status, 404, "{reply}");
    assert_eq!(reply["error"]["code"], "model_not_found");
    let (status, list) = request(&server.address, "GET", "/v1/models", None);
    assert_eq!(status, 200);
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(
        ids,
        [
            "SmolLM2-135M-Instruct.Q4_1",
            "qwen2.5-coder-0.5b-instruct-q4_k_m"
        ]
    );
    server.terminate();
}

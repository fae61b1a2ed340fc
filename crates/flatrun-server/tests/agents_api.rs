//! Tool calls, structured output, logprobs, sampling fields and `n` of both
//! APIs against the mock model, whose template takes tools and whose reply
//! is set per test (e.g. a Hermes `<tool_call>` block), and every refusal
//! with its API's status and shape.

mod common;

use common::{TestServer, config, parse_sse};
use flatrun_server::SchedulerConfig;
use flatrun_server::mock::MockConfig;
use serde_json::{Value, json};

const CALL: &str = "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

async fn server_replying(reply: &str) -> TestServer {
    let mock = MockConfig {
        reply: reply.to_string(),
        ..MockConfig::default()
    };
    TestServer::start(mock, SchedulerConfig::default(), config()).await
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }})
}

fn openai_error(response: &common::HttpResponse, needle: &str) {
    assert_eq!(response.status, 400, "{}", response.body);
    let body = response.json();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{message}");
}

fn anthropic_error(response: &common::HttpResponse, needle: &str) {
    assert_eq!(response.status, 400, "{}", response.body);
    let body = response.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{message}");
}

#[tokio::test]
async fn openai_tool_calls_whole_and_streamed() {
    let server = server_replying(CALL).await;
    let request = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [weather_tool()], "temperature": 0});
    let body = server
        .post_json("/v1/chat/completions", &request)
        .await
        .json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert_eq!(choice["message"]["content"], "Checking.");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // Streamed: content deltas, then the call as OpenAI streams it (id,
    // type, name and empty arguments, then the arguments), then the finish.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let response = server.post_json("/v1/chat/completions", &streamed).await;
    let chunks: Vec<Value> = parse_sse(&response.body)
        .into_iter()
        .filter(|(_, data)| data != "[DONE]")
        .map(|(_, data)| serde_json::from_str(&data).unwrap())
        .collect();
    let mut content = String::new();
    let mut name = String::new();
    let mut arguments = String::new();
    let mut finish = Value::Null;
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], 0);
            if let Some(n) = call["function"]["name"].as_str() {
                assert!(call["id"].as_str().unwrap().starts_with("call_"));
                assert_eq!(call["function"]["arguments"], "");
                name.push_str(n);
            }
            arguments.push_str(call["function"]["arguments"].as_str().unwrap_or_default());
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(content.trim(), "Checking.");
    assert_eq!(name, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&arguments).unwrap(), args);
    assert_eq!(finish, "tool_calls");
    server.wait_all_freed().await;
}

#[tokio::test]
async fn openai_tool_results_reach_the_template() {
    let server = server_replying("It is sunny.").await;
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]);
    let body = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": messages, "tools": [weather_tool()], "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(body["choices"][0]["message"]["content"], "It is sunny.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // The mock renders the tools, the call and the result: all are counted.
    let tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(tokens > 200, "{body}");
}

#[tokio::test]
async fn tool_requests_the_apis_refuse() {
    let server = TestServer::default().await;
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (
            json!({"messages": user, "tools": [weather_tool()],
                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "not one of the tools",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": "oops"}}]}),
            "must be a JSON object",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f",
                   "parameters": {"type": "object", "required": "city"}}}]}),
            "required must be a list",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
            "tool name",
        ),
        (
            json!({"messages": user, "tools": [weather_tool(), weather_tool()]}),
            "more than one tool",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "tool", "tool_call_id": "call_x", "content": "42"}]}),
            "does not answer any tool call",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                   "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "not valid JSON",
        ),
        (
            json!({"messages": user, "tool_choice": "required"}),
            "tools is empty",
        ),
        (
            json!({"messages": user, "audio": {"voice": "alloy", "format": "wav"}}),
            "audio",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            "only text parts",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            "name is required",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": {"type": 5}}}}),
            "type must be a string",
        ),
        (
            json!({"messages": user, "grammar": "start: (", }),
            "invalid grammar",
        ),
        (
            json!({"messages": user, "regex": "a", "grammar": "start: \"a\""}),
            "cannot be used together",
        ),
        (
            json!({"messages": user, "stop": ["a", "b", "c", "d", "e"]}),
            "at most 4",
        ),
        (
            json!({"messages": user, "top_logprobs": 3}),
            "requires logprobs",
        ),
        (
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "between 0 and 20",
        ),
        (
            json!({"messages": user, "logit_bias": {"999999": 5}}),
            "outside the vocabulary",
        ),
        (
            json!({"messages": user, "logit_bias": {"65": 500}}),
            "[-100, 100]",
        ),
        (json!({"messages": user, "frequency_penalty": 3}), "[-2, 2]"),
        (json!({"messages": user, "min_p": 1.5}), "min_p"),
        (json!({"messages": user, "n": 0}), "n must be"),
    ];
    for (request, needle) in cases {
        let response = server.post_json("/v1/chat/completions", &request).await;
        openai_error(&response, needle);
    }
    let cases = [
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                   "tool_choice": {"type": "tool", "name": "g"}}),
            "not one of the tools",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f"}]}),
            "input_schema",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f", "input_schema": [1]}]}),
            "must be a JSON object",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "server tools",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_x", "content": "42"}]}]}),
            "no matching tool_use",
        ),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}),
            "`image` are not supported",
        ),
        (
            json!({"max_tokens": 8, "messages": user, "stop_sequences": [""]}),
            "must not be empty",
        ),
    ];
    for (request, needle) in cases {
        let response = server.post_json("/v1/messages", &request).await;
        anthropic_error(&response, needle);
    }
    server.wait_all_freed().await;
}

#[tokio::test]
async fn anthropic_tool_use_whole_and_streamed() {
    let server = server_replying(CALL).await;
    let tools = json!([{"name": "get_weather", "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let request = json!({"max_tokens": 200, "temperature": 0, "tools": tools,
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let body = server.post_json("/v1/messages", &request).await.json();
    assert_eq!(body["stop_reason"], "tool_use", "{body}");
    assert_eq!(
        body["content"][0],
        json!({"type": "text", "text": "Checking."})
    );
    let block = &body["content"][1];
    assert_eq!(block["type"], "tool_use");
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(block["name"], "get_weather");
    assert_eq!(block["input"], json!({"city": "Paris"}));

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let response = server.post_json("/v1/messages", &streamed).await;
    let events: Vec<(String, Value)> = parse_sse(&response.body)
        .into_iter()
        .filter(|(name, _)| name.as_deref() != Some("ping"))
        .map(|(name, data)| {
            (
                name.unwrap_or_default(),
                serde_json::from_str(&data).unwrap(),
            )
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let starts: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, e)| e)
        .collect();
    assert_eq!(starts.len(), 2);
    assert_eq!(starts[0]["content_block"]["type"], "text");
    assert_eq!(starts[1]["index"], 1);
    assert_eq!(starts[1]["content_block"]["type"], "tool_use");
    assert_eq!(starts[1]["content_block"]["name"], "get_weather");
    let partial: String = events
        .iter()
        .filter(|(_, e)| e["delta"]["type"] == "input_json_delta")
        .map(|(_, e)| e["delta"]["partial_json"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        json!({"city": "Paris"})
    );
    let delta = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");

    // The second turn: the call and its result go back as blocks.
    let second = json!({"max_tokens": 20, "temperature": 0, "tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
    ]});
    let response = server.post_json("/v1/messages", &second).await;
    assert_eq!(response.status, 200, "{}", response.body);
    server.wait_all_freed().await;
}

#[tokio::test]
async fn anthropic_thinking_blocks_when_asked() {
    let server = server_replying("<think>Two and two.</think>Four.").await;
    let request = |thinking: Value| {
        json!({"max_tokens": 100, "temperature": 0, "thinking": thinking,
               "messages": [{"role": "user", "content": "2+2?"}]})
    };
    let body = server
        .post_json(
            "/v1/messages",
            &request(json!({"type": "enabled", "budget_tokens": 50})),
        )
        .await
        .json();
    assert_eq!(body["content"][0]["type"], "thinking", "{body}");
    assert_eq!(body["content"][0]["thinking"], "Two and two.");
    assert_eq!(body["content"][1], json!({"type": "text", "text": "Four."}));
    let body = server
        .post_json("/v1/messages", &request(json!({"type": "disabled"})))
        .await
        .json();
    assert_eq!(
        body["content"][0]["text"],
        "<think>Two and two.</think>Four."
    );
    // OpenAI: reasoning_content.
    let body = server
        .post_json(
            "/v1/chat/completions",
            &json!({"temperature": 0, "messages": [{"role": "user", "content": "2+2?"}]}),
        )
        .await
        .json();
    let message = &body["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Two and two.");
    assert_eq!(message["content"], "Four.");
}

#[tokio::test]
async fn logprobs_n_and_logit_bias() {
    let server = TestServer::default().await;
    let request = json!({"temperature": 0, "max_tokens": 5, "logprobs": true, "top_logprobs": 3, "n": 2,
        "messages": [{"role": "user", "content": "Hi"}]});
    let body = server
        .post_json("/v1/chat/completions", &request)
        .await
        .json();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(body["usage"]["completion_tokens"], 10);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["message"]["content"], "Hello");
        let content = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 5);
        let first = &content[0];
        assert_eq!(first["token"], "H");
        assert_eq!(first["bytes"], json!([72]));
        let lp = first["logprob"].as_f64().unwrap();
        assert!(lp < 0.0 && lp > -1.0, "{first}");
        let top = first["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], "H");
        assert!(top[1]["logprob"].as_f64().unwrap() <= top[0]["logprob"].as_f64().unwrap());
    }
    // logit_bias -100 on "H" (72) moves greedy off it; +100 on "Z" makes every token "Z".
    let biased = |bias: Value| {
        json!({"temperature": 0, "max_tokens": 3, "logit_bias": bias,
               "messages": [{"role": "user", "content": "Hi"}]})
    };
    let body = server
        .post_json("/v1/chat/completions", &biased(json!({"72": -100})))
        .await
        .json();
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.starts_with('H'), "{text}");
    let body = server
        .post_json("/v1/chat/completions", &biased(json!({"90": 100})))
        .await
        .json();
    assert_eq!(body["choices"][0]["message"]["content"], "ZZZ");

    // Streamed logprobs ride on the chunks of their tokens.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(1);
    let response = server.post_json("/v1/chat/completions", &streamed).await;
    let entries: usize = parse_sse(&response.body)
        .into_iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str::<Value>(&d).unwrap())
        .map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .map_or(0, Vec::len)
        })
        .sum();
    assert_eq!(entries, 5);

    // Completions: the legacy shape, and echo.
    let body = server
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "logprobs": 2}),
        )
        .await
        .json();
    let logprobs = &body["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"], json!(["H", "e"]));
    assert_eq!(logprobs["text_offset"], json!([0, 1]));
    assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 2);
    let body = server
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "echo": true}),
        )
        .await
        .json();
    assert_eq!(body["choices"][0]["text"], "HiHe");
    server.wait_all_freed().await;
}

/// The prompt's own tokens, scored: the mock's logits at a position favour
/// "H", so after BOS "H" is likely and the "i" after it is not.
#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt() {
    let server = TestServer::default().await;
    let request =
        json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 2});
    let body = server.post_json("/v1/completions", &request).await.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["text"], "HiHe", "{body}");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["<s>", "H", "i", "H", "e"]), "{lp}");
    // BOS takes no room in the text: "H" at 0, "i" at 1, the answer after "Hi".
    assert_eq!(lp["text_offset"], json!([0, 0, 1, 2, 3]));
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let h = lp["token_logprobs"][1].as_f64().unwrap();
    let i = lp["token_logprobs"][2].as_f64().unwrap();
    assert!(h > -1.0 && h < 0.0, "{lp}");
    assert!(i < -5.0, "{lp}");
    let top = lp["top_logprobs"][2].as_object().unwrap();
    assert_eq!(top.len(), 2);
    assert!(top.contains_key("H"), "{lp}");
    assert_eq!(body["usage"]["prompt_tokens"], 3);

    // max_tokens 0: the prompt and its scores only (how harnesses score text).
    let mut only = request.clone();
    only["max_tokens"] = json!(0);
    let body = server.post_json("/v1/completions", &only).await.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["text"], "Hi", "{body}");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["logprobs"]["tokens"], json!(["<s>", "H", "i"]));
    assert_eq!(choice["logprobs"]["token_logprobs"][1].as_f64().unwrap(), h);
    assert_eq!(body["usage"]["completion_tokens"], 0);

    // Streamed: the first chunk carries the prompt and its logprobs.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let response = server.post_json("/v1/completions", &streamed).await;
    let chunks: Vec<Value> = parse_sse(&response.body)
        .into_iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(&d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["text"], "Hi");
    assert_eq!(
        chunks[0]["choices"][0]["logprobs"]["token_logprobs"][1]
            .as_f64()
            .unwrap(),
        h
    );
    let offsets: Vec<Value> = chunks[1..]
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["text_offset"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(offsets, vec![json!(2), json!(3)]);
    only["stream"] = json!(true);
    let response = server.post_json("/v1/completions", &only).await;
    let events = parse_sse(&response.body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let first: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(first["choices"][0]["text"], "Hi");

    // max_tokens 0 without echo generates nothing and says so.
    openai_error(
        &server
            .post_json("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 0}))
            .await,
        "max_tokens",
    );
    server.wait_all_freed().await;
}

#[tokio::test]
async fn grammars_constrain_the_mock() {
    let server = TestServer::default().await;
    // The mock favours "Hello…"; a regex forces digits, then the end.
    let body = server
        .post_json(
            "/v1/chat/completions",
            &json!({"temperature": 0, "max_tokens": 20, "regex": "[0-9]{3}",
                    "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await
        .json();
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.len() == 3 && text.bytes().all(|b| b.is_ascii_digit()),
        "{body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // json_schema at temperature 1: valid JSON of the schema every time.
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"], "additionalProperties": false});
    for seed in 0..5 {
        let body = server
            .post_json(
                "/v1/chat/completions",
                &json!({"temperature": 1, "seed": seed, "max_tokens": 40,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": true, "schema": schema}},
                        "messages": [{"role": "user", "content": "Hi"}]}),
            )
            .await
            .json();
        let text = body["choices"][0]["message"]["content"].as_str().unwrap();
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(value["ok"].is_boolean(), "{text}");
    }
    // A forced call follows the syntax and the tool's schema.
    let body = server
        .post_json(
            "/v1/chat/completions",
            &json!({"temperature": 1, "seed": 3, "max_tokens": 100, "tools": [{"type": "function", "function": {
                        "name": "get_weather",
                        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                       "required": ["city"], "additionalProperties": false}}}],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                    "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await
        .json();
    let call = &body["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{body}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"] == "Paris" || args["city"] == "Rome", "{args}");
    server.wait_all_freed().await;
}

#[tokio::test]
async fn sampling_fields_have_their_effect() {
    let server = server_replying("abababababababab").await;
    let ask = |extra: Value| {
        let mut request =
            json!({"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            request[k] = v.clone();
        }
        request
    };
    let text = |body: Value| {
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let greedy = text(
        server
            .post_json("/v1/chat/completions", &ask(json!({"temperature": 0})))
            .await
            .json(),
    );
    assert_eq!(greedy, "abababababababab");
    // min_p = 1 keeps only the most likely token: greedy at any temperature and seed.
    for seed in 0..3 {
        let body = server
            .post_json(
                "/v1/chat/completions",
                &ask(json!({"temperature": 1.5, "min_p": 1.0, "seed": seed})),
            )
            .await
            .json();
        assert_eq!(text(body), greedy);
    }
    // The mock favours each reply byte by 8 logits over the others; a
    // presence penalty of 2 per seen token does not overturn that, but a
    // frequency penalty of 2 per occurrence does once a token was seen 4+ times.
    let presence = text(
        server
            .post_json(
                "/v1/chat/completions",
                &ask(json!({"temperature": 0, "presence_penalty": 2})),
            )
            .await
            .json(),
    );
    assert_eq!(presence, greedy);
    let frequency = text(
        server
            .post_json(
                "/v1/chat/completions",
                &ask(json!({"temperature": 0, "frequency_penalty": 2})),
            )
            .await
            .json(),
    );
    assert_ne!(frequency, greedy);
    assert!(frequency.starts_with("abababab"), "{frequency}");
    // repeat_penalty divides the positive logit 8 of a seen token: 8 / 9 < the others' logits.
    let repeat = text(
        server
            .post_json(
                "/v1/chat/completions",
                &ask(json!({"temperature": 0, "repeat_penalty": 9})),
            )
            .await
            .json(),
    );
    assert!(repeat.starts_with("ab"), "{repeat}");
    assert_ne!(&repeat[2..4], "ab", "{repeat}");
    server.wait_all_freed().await;
}

#[tokio::test]
async fn embeddings_are_normalized_in_both_encodings() {
    let server = TestServer::default().await;
    let body = server
        .post_json(
            "/v1/embeddings",
            &json!({"input": ["Hello", "Hello", "other"]}),
        )
        .await
        .json();
    assert_eq!(body["object"], "list", "{body}");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let vector = |i: usize| -> Vec<f64> {
        data[i]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let norm: f64 = vector(0).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    assert_eq!(vector(0), vector(1));
    assert_ne!(vector(0), vector(2));
    // "Hello" is BOS + 5 bytes in the mock: 6 tokens each, 12 + 6.
    assert_eq!(body["usage"]["prompt_tokens"], 18);
    let b64 = server
        .post_json(
            "/v1/embeddings",
            &json!({"input": "Hello", "encoding_format": "base64"}),
        )
        .await
        .json();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let floats: Vec<f32> = vector(0).iter().map(|&x| x as f32).collect();
    assert_eq!(decoded, floats);
    let tokens = server
        .post_json(
            "/v1/embeddings",
            &json!({"input": [[256, 72, 101, 108, 108, 111]]}),
        )
        .await
        .json();
    assert_eq!(tokens["data"][0]["embedding"], data[0]["embedding"]);
    for (request, needle) in [
        (json!({"input": "x", "dimensions": 4}), "dimensions"),
        (
            json!({"input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": [[9999]]}), "outside the vocabulary"),
        (json!({"input": []}), "1 to 256"),
    ] {
        openai_error(&server.post_json("/v1/embeddings", &request).await, needle);
    }
}

//! The fuzz targets' bodies, one function per target: each takes the raw
//! input and panics only on a real defect. The `cargo fuzz` binaries in
//! `fuzz_targets/` call these; so does the workspace test
//! `crates/flatrun-server/tests/fuzz_corpus.rs`, which replays every committed
//! corpus and regression input on stable Rust.

pub mod gguf_header {
    //! Fuzz the GGUF parser: any bytes must give `Ok` or a typed error.
    use flatrun_format::gguf::{check_tensor_extents, parse_header};
    use flatrun_format::names::canonical_layer_index;
    use std::path::Path;

    /// One input.
    pub fn run(data: &[u8]) {
        let path = Path::new("fuzz.gguf");
        let Ok(header) = parse_header(path, data) else {
            return;
        };
        let _ = check_tensor_extents(path, &header.tensors, data.len() as u64);
        // Exercise the typed getters on every key.
        for (key, _) in header.metadata.iter() {
            let _ = header.metadata.get_u64(key);
            let _ = header.metadata.get_f32(key);
            let _ = header.metadata.get_str_array(key);
            let _ = header.metadata.get_i32_array(key);
            let _ = header.metadata.require_f32_array(key);
        }
        for t in &header.tensors {
            let _ = canonical_layer_index(&t.name);
            let _ = t.n_elements();
        }
    }
}
pub mod safetensors_mlx {
    //! Fuzz the SafeTensors header parser and the MLX triple folding: the first
    //! byte picks the MLX quantization (bits, group size); the rest is a
    //! safetensors file.
    use flatrun_format::mlx_backend::{
        MLX_BITS, MlxQuantConfig, MlxQuantization, fold_quantized_tensors,
    };
    use flatrun_format::safetensors_backend::parse_header;
    use std::path::Path;

    /// One input.
    pub fn run(data: &[u8]) {
        let Some((&selector, file)) = data.split_first() else {
            return;
        };
        let path = Path::new("fuzz.safetensors");
        let Ok(header) = parse_header(path, file) else {
            return;
        };
        let quant = MlxQuantConfig {
            default: Some(MlxQuantization {
                bits: MLX_BITS[(selector & 7) as usize % MLX_BITS.len()],
                group_size: [32, 64, 128, 0][(selector >> 3) as usize & 3],
            }),
            overrides: Default::default(),
        };
        let _ = fold_quantized_tensors(Path::new("fuzz-dir"), &header.tensors, &quant);
    }
}
pub mod tokenize {
    //! Tokenization of arbitrary text and decoding of arbitrary ids, for each
    //! supported tokenizer family: must never panic, ids stay in the vocabulary,
    //! and decoding what was encoded gives the text back.
    use flatrun_format::{MetaValue, Metadata};
    use flatrun_model::tokenizer::{StreamDecoder, Tokenizer};
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// A tiny synthetic vocabulary of each family, plus the llama.cpp vocab
    /// files of `$FLATRUN_VOCAB` when they are present.
    fn tokenizers() -> &'static [Tokenizer] {
        static ALL: OnceLock<Vec<Tokenizer>> = OnceLock::new();
        ALL.get_or_init(|| {
            let mut all = vec![synthetic_bpe(), synthetic_spm()];
            let dir = std::env::var_os("FLATRUN_VOCAB")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/flatrun/vocab")
                });
            for name in [
                "llama-spm",
                "qwen2",
                "llama-bpe",
                "gpt-2",
                "deepseek-llm",
                "deepseek-coder",
                "falcon",
                "starcoder",
                "phi-3",
            ] {
                let path = dir.join(format!("ggml-vocab-{name}.gguf"));
                let tok = flatrun_format::open(&path)
                    .ok()
                    .and_then(|backend| Tokenizer::from_gguf_metadata(backend.metadata()).ok());
                all.extend(tok);
            }
            all
        })
    }

    fn strings(items: &[&str]) -> MetaValue {
        MetaValue::Array(
            items
                .iter()
                .map(|s| MetaValue::String(s.to_string()))
                .collect(),
        )
    }

    fn synthetic_bpe() -> Tokenizer {
        // Every byte as a GPT-2 character, a few merges and a control token.
        let mut tokens: Vec<String> = (0u32..256)
            .map(|b| {
                let printable = (0x21..=0x7e).contains(&b)
                    || (0xa1..=0xac).contains(&b)
                    || (0xae..=0xff).contains(&b);
                if printable {
                    char::from_u32(b).unwrap().to_string()
                } else {
                    String::new()
                }
            })
            .collect();
        for (shifted, t) in (0x100..).zip(tokens.iter_mut().filter(|t| t.is_empty())) {
            *t = char::from_u32(shifted).unwrap().to_string();
        }
        tokens.extend(["Ġt", "he", "Ġthe", "<|im_start|>"].map(String::from));
        let mut types = vec![MetaValue::I32(1); tokens.len()];
        types[tokens.len() - 1] = MetaValue::I32(3);
        let md = Metadata {
            entries: vec![
                (
                    "tokenizer.ggml.model".into(),
                    MetaValue::String("gpt2".into()),
                ),
                (
                    "tokenizer.ggml.pre".into(),
                    MetaValue::String("qwen2".into()),
                ),
                (
                    "tokenizer.ggml.tokens".into(),
                    MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
                ),
                ("tokenizer.ggml.token_type".into(), MetaValue::Array(types)),
                (
                    "tokenizer.ggml.merges".into(),
                    strings(&["Ġ t", "h e", "Ġt he"]),
                ),
            ],
        };
        Tokenizer::from_gguf_metadata(&md).expect("synthetic BPE")
    }

    fn synthetic_spm() -> Tokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
        tokens.extend(["▁", "a", "b", "▁a", "ab", "▁ab", "<start_of_turn>"].map(String::from));
        let n = tokens.len();
        let types: Vec<MetaValue> = (0..n)
            .map(|i| {
                MetaValue::I32(if i < 3 || i == n - 1 {
                    3
                } else if i < 259 {
                    6
                } else {
                    1
                })
            })
            .collect();
        let scores: Vec<MetaValue> = (0..n).map(|i| MetaValue::F32(-(i as f32))).collect();
        let md = Metadata {
            entries: vec![
                (
                    "tokenizer.ggml.model".into(),
                    MetaValue::String("llama".into()),
                ),
                (
                    "tokenizer.ggml.tokens".into(),
                    MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
                ),
                ("tokenizer.ggml.token_type".into(), MetaValue::Array(types)),
                ("tokenizer.ggml.scores".into(), MetaValue::Array(scores)),
            ],
        };
        Tokenizer::from_gguf_metadata(&md).expect("synthetic SPM")
    }

    /// Work done once, outside the per-input timeout.
    pub fn init() {
        // Load the vocabularies once, outside the per-input timeout.
        tokenizers();
    }
    /// One input.
    pub fn run(data: &[u8]) {
        let Some((&selector, rest)) = data.split_first() else {
            return;
        };
        let all = tokenizers();
        let tok = &all[selector as usize % all.len()];
        let add_special = selector & 0x40 != 0;
        let parse_special = selector & 0x80 != 0;
        let text = String::from_utf8_lossy(rest);
        let ids = tok
            .encode(&text, add_special, parse_special)
            .expect("encode never fails on text");
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        // Round trip, for vocabularies that can spell every byte (falcon, for
        // one, has no token for some control bytes and drops them, like llama.cpp;
        // SentencePiece reads a literal `▁` back as a space, like llama.cpp).
        if !add_special
            && !parse_special
            && (selector as usize % all.len()) < 6
            && !text.contains('\u{2581}')
        {
            assert_eq!(tok.decode(&ids, false).expect("decode"), text, "round trip");
        }
        // Arbitrary ids: decoding may refuse out-of-range ids but never panics.
        let raw: Vec<u32> = rest
            .chunks(2)
            .map(|c| c.iter().fold(0u32, |a, &b| a << 8 | b as u32))
            .collect();
        let _ = tok.decode(&raw, selector & 1 == 0);
        let mut stream = StreamDecoder::new(tok);
        for &id in &raw {
            let _ = stream.push(id);
            let _ = tok.token_to_piece(id);
        }
        let _ = stream.finish();
    }
}
pub mod template {
    //! Rendering arbitrary chat templates with arbitrary messages: must never
    //! panic, hang or grow without bound (fuel, recursion, output, string,
    //! sequence and total-bytes limits, captured blocks and macro output).
    use flatrun_model::chat_template::{ChatMessage, ChatTemplate, TemplateLimits};

    /// One input.
    pub fn run(data: &[u8]) {
        let text = String::from_utf8_lossy(data);
        // Template source, then messages separated by NUL: "role\u{1}content".
        let mut parts = text.split('\0');
        let source = parts.next().unwrap_or_default();
        let messages: Vec<ChatMessage> = parts
            .map(|m| {
                let (role, content) = m.split_once('\u{1}').unwrap_or(("user", m));
                ChatMessage::new(role, content)
            })
            .collect();
        let limits = TemplateLimits {
            fuel: 50_000,
            recursion: 32,
            max_output_bytes: 1 << 16,
            max_string_bytes: 1 << 16,
            max_items: 1 << 12,
            max_total_bytes: 1 << 20,
        };
        if let Ok(template) = ChatTemplate::from_source("fuzz", source) {
            let template = template.with_limits(limits);
            if let Ok(out) = template.render(&messages, data.len().is_multiple_of(2), "<s>", "</s>")
            {
                assert!(out.len() <= limits.max_output_bytes);
            }
        }
    }
}
pub mod server_request {
    //! Fuzz the HTTP request handling of both APIs end to end: the first byte
    //! picks the endpoint (and a header variant), the rest is the request body.
    //! Every request gets an answer that is not a 5xx (the mock model cannot
    //! fail), error answers are JSON in the endpoint's API shape, and streams
    //! end properly.
    use axum::Router;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use flatrun_server::metrics::Metrics;
    use flatrun_server::mock::{MockConfig, mock_engine};
    use flatrun_server::{AppState, EngineSlot, SchedulerConfig, ServerConfig};
    use std::sync::{Arc, OnceLock};
    use tower::ServiceExt;

    const ROUTES: &[&str] = &[
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
    ];

    struct Harness {
        runtime: tokio::runtime::Runtime,
        app: Router,
    }

    fn harness() -> &'static Harness {
        static HARNESS: OnceLock<Harness> = OnceLock::new();
        HARNESS.get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let (engine, _stats) = mock_engine(
                MockConfig {
                    context_length: 256,
                    ..MockConfig::default()
                },
                SchedulerConfig::default(),
            )
            .expect("mock engine");
            let config = ServerConfig {
                port: 0,
                max_body_bytes: 1 << 16,
                max_tokens_limit: Some(64),
                ..ServerConfig::default()
            };
            let slot = EngineSlot::default();
            let state = AppState {
                models: flatrun_server::ModelSet::new(config.model_policy, slot.clone()),
                config: Arc::new(config),
                metrics: Arc::new(Metrics::default()),
            };
            slot.set(Arc::new(engine));
            Harness {
                runtime,
                app: flatrun_server::router(state),
            }
        })
    }

    /// Work done once, outside the per-input timeout.
    pub fn init() {
        harness();
    }
    /// One input.
    pub fn run(data: &[u8]) {
        let Some((&selector, body)) = data.split_first() else {
            return;
        };
        let path = ROUTES[selector as usize % ROUTES.len()];
        let mut request = Request::post(path);
        if selector & 0x80 == 0 {
            request = request.header("content-type", "application/json");
        }
        let request = request.body(Body::from(body.to_vec())).expect("request");
        let h = harness();
        h.runtime.block_on(async {
            let response = h.app.clone().oneshot(request).await.expect("infallible");
            let status = response.status();
            let streaming = response
                .headers()
                .get("content-type")
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 24)
                .await
                .expect("the body completes");
            assert!(
                !status.is_server_error(),
                "{path}: {status} for {:?}: {}",
                String::from_utf8_lossy(body),
                String::from_utf8_lossy(&bytes)
            );
            if streaming {
                assert_eq!(status, StatusCode::OK);
                let text = String::from_utf8_lossy(&bytes);
                assert!(
                    text.contains("data: [DONE]") || text.contains("event: message_stop"),
                    "{path}: unterminated stream: {text}"
                );
            } else if !status.is_success() {
                let error: serde_json::Value =
                    serde_json::from_slice(&bytes).expect("error bodies are JSON");
                assert!(error.get("error").is_some(), "{path}: {error}");
            }
        });
    }
}
pub mod dequant {
    //! Fuzz the block decoders and the fused kernels over arbitrary block bytes:
    //! the first byte picks the format, the second the shape (rows, tokens), the
    //! rest are the blocks. The scalar reference decoder never panics; where it
    //! decodes to finite values, the native kernels at every SIMD level this host
    //! supports give the reference's rows exactly and its matmul within the
    //! bound of 8-bit activations.
    use flatrun_format::GgmlType;
    use flatrun_kernels::{
        Kernels, NativeKernels, ReferenceKernels, Weight, WeightFormat, supported_levels,
    };

    /// Relative to Σ|w|·max|x| per output: int8 activations (≤ 1/254 of the
    /// block maximum each) plus f32 accumulation order.
    const BUDGET: f32 = 1e-2;

    fn activations(n: usize, seed: u8) -> Vec<f32> {
        let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(seed);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// One input.
    pub fn run(data: &[u8]) {
        let [format, shape, blocks @ ..] = data else {
            return;
        };
        let types = GgmlType::ALL;
        let t = types[*format as usize % types.len()];
        let _ = flatrun_dequant::validate(t, blocks);
        let Ok(values) = flatrun_dequant::dequantize_to_vec(t, blocks) else {
            return;
        };
        let mut halves = vec![half::f16::ZERO; values.len()];
        let _ = flatrun_dequant::dequantize_to_f16(t, blocks, &mut halves);
        // A matrix of `rows` rows over all the bytes that were decoded.
        let rows = 1 + (*shape as usize & 3);
        if values.is_empty() || values.len() % rows != 0 {
            return;
        }
        let cols = values.len() / rows;
        let Ok(w) = Weight::new(WeightFormat::Ggml(t), rows, cols, blocks, None, None) else {
            return;
        };
        if values.iter().any(|v| !v.is_finite() || v.abs() > 1e15) {
            return;
        }
        let mut want_rows = vec![0f32; rows * cols];
        if ReferenceKernels
            .dequantize_rows(&w, 0..rows, &mut want_rows)
            .is_err()
        {
            return;
        }
        assert_eq!(
            want_rows, values,
            "{t:?}: the reference kernel is the scalar decoder"
        );
        let n_tokens = 1 + (*shape as usize >> 2 & 3);
        let x = activations(n_tokens * cols, *shape);
        let mut want = vec![0f32; n_tokens * rows];
        if ReferenceKernels
            .matmul(&w, &x, n_tokens, &mut want)
            .is_err()
        {
            return;
        }
        for level in supported_levels() {
            let native = NativeKernels::new(level);
            let mut got_rows = vec![f32::NAN; rows * cols];
            native
                .dequantize_rows(&w, 0..rows, &mut got_rows)
                .expect("native rows");
            assert_eq!(
                got_rows, values,
                "{t:?} at {level}: rows differ from the reference"
            );
            let mut got = vec![f32::NAN; n_tokens * rows];
            native
                .matmul(&w, &x, n_tokens, &mut got)
                .expect("native matmul");
            for tok in 0..n_tokens {
                let xs = &x[tok * cols..(tok + 1) * cols];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                for r in 0..rows {
                    let wsum: f32 = values[r * cols..(r + 1) * cols]
                        .iter()
                        .map(|v| v.abs())
                        .sum();
                    let bound = BUDGET * wsum * amax + 1e-30;
                    let (g, e) = (got[tok * rows + r], want[tok * rows + r]);
                    assert!(
                        (g - e).abs() <= bound,
                        "{t:?} at {level}: [{rows} x {cols}] token {tok} row {r}: native {g} reference {e} (bound {bound:e})"
                    );
                }
            }
        }
    }
}

/// The server's output parsing (reasoning tags, harmony channels, tool calls
/// in every syntax) of arbitrary generated text: never a panic, and a stream
/// cut into pieces anywhere gives the answer that the whole text gives — the
/// same calls, the same content, the same reasoning — so streamed and
/// non-streamed responses agree.
pub mod tool_calls {
    use flatrun_model::chat_template::tools::ToolSyntax;
    use flatrun_server::output::{OutputEvent, OutputParser, ParsedAnswer, parse_answer};

    const SYNTAXES: [Option<ToolSyntax>; 5] = [
        None,
        Some(ToolSyntax::Hermes),
        Some(ToolSyntax::Llama3),
        Some(ToolSyntax::Mistral),
        Some(ToolSyntax::Harmony),
    ];

    /// `text` cut into pieces of `step` bytes, each ending on a char boundary.
    fn pieces(text: &str, step: usize) -> Vec<&str> {
        let mut out = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let mut end = (start + step).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            out.push(&text[start..end]);
            start = end;
        }
        out
    }

    pub fn run(data: &[u8]) {
        let [selector, step, rest @ ..] = data else {
            return;
        };
        let syntax = SYNTAXES[*selector as usize % SYNTAXES.len()];
        let reasoning = selector & 0x80 != 0;
        let text = String::from_utf8_lossy(rest);
        let whole = parse_answer(&text, reasoning, syntax);

        let mut parser = OutputParser::new(reasoning, syntax);
        let mut events = Vec::new();
        for piece in pieces(&text, 1 + *step as usize % 16) {
            events.extend(parser.push(piece));
        }
        events.extend(parser.finish());
        let mut streamed = ParsedAnswer::default();
        for event in events {
            match event {
                OutputEvent::Reasoning(r) => streamed
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(&r),
                OutputEvent::Content(c) => streamed.content.push_str(&c),
                OutputEvent::ToolCall(call) => streamed.tool_calls.push(call),
            }
        }
        if !streamed.tool_calls.is_empty() {
            streamed.content = streamed.content.trim().to_string();
        }
        assert_eq!(
            streamed.tool_calls, whole.tool_calls,
            "calls differ when streamed"
        );
        assert_eq!(
            streamed.content, whole.content,
            "content differs when streamed"
        );
        assert_eq!(
            streamed.reasoning, whole.reasoning,
            "reasoning differs when streamed"
        );
    }
}

/// Structured output: hostile JSON schemas, regexes and Lark grammars
/// compiled for a small byte vocabulary, then walked token by token along
/// the mask. Never a panic; compiling either works or is an error; a token
/// the mask allows is always accepted.
pub mod grammar {
    use flatrun_model::sampling::{ConstraintFactory, Vocabulary};
    use flatrun_server::grammar::{Grammar, GrammarSpec};
    use std::sync::{Arc, OnceLock};

    /// 256 single bytes, some multi-byte pieces, a special token and the end.
    fn vocabulary() -> Arc<Vocabulary> {
        static VOCAB: OnceLock<Arc<Vocabulary>> = OnceLock::new();
        VOCAB
            .get_or_init(|| {
                let mut tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
                for piece in [
                    "{\"",
                    "\":",
                    "\"}",
                    "true",
                    "false",
                    "null",
                    "name",
                    "  ",
                    "\n",
                    "[{",
                    "}]",
                    "\"a",
                    "12",
                    "é",
                    "\u{1F600}",
                ] {
                    tokens.push(piece.as_bytes().to_vec());
                }
                tokens.push(vec![Vocabulary::SPECIAL, b'<', b'|', b'>']);
                let eos = tokens.len() as u32;
                tokens.push(vec![Vocabulary::SPECIAL, b'e', b'o', b's']);
                Arc::new(Vocabulary { tokens, eos })
            })
            .clone()
    }

    pub fn run(data: &[u8]) {
        let [selector, steps, rest @ ..] = data else {
            return;
        };
        // The grammar text, then (after a NUL) the bytes that choose tokens.
        let split = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let (text, choices) = (&rest[..split], rest.get(split + 1..).unwrap_or(&[]));
        let text = String::from_utf8_lossy(text).into_owned();
        let spec = match selector % 4 {
            0 => match serde_json::from_str(&text) {
                Ok(schema) => GrammarSpec::JsonSchema(schema),
                Err(_) => return,
            },
            1 => GrammarSpec::Regex(text),
            2 => GrammarSpec::Lark(text),
            _ => GrammarSpec::JsonObject,
        };
        let vocab = vocabulary();
        let Ok(grammar) = Grammar::compile(&spec, &vocab) else {
            return;
        };
        let Ok(mut state) = grammar.start() else {
            return;
        };
        let n = vocab.tokens.len();
        for i in 0..(*steps as usize % 24) {
            if state.is_finished() || state.compute_mask().is_err() {
                return;
            }
            let allowed: Vec<u32> = match state.mask() {
                Some(mask) => (0..n as u32)
                    .filter(|&t| {
                        mask.get(t as usize / 32)
                            .is_some_and(|w| w >> (t % 32) & 1 == 1)
                    })
                    .collect(),
                None => (0..n as u32).collect(),
            };
            if allowed.is_empty() {
                return;
            }
            let pick = choices.get(i).copied().unwrap_or(0) as usize;
            let token = allowed[pick * 7919 % allowed.len()];
            if token == vocab.eos {
                return;
            }
            assert!(
                state.accept(token).is_ok(),
                "token {token} was allowed by the mask but refused"
            );
        }
    }
}

//! Chat templates: the models' own templates rendered like Python jinja2
//! (fixtures from `scripts/gen_tokenizer_fixtures.py chat`), fallbacks by
//! architecture, Hugging Face helpers, and hostile templates that must fail
//! with a clear error instead of running away.

use std::path::Path;

use flatrun_model::chat_template::{ChatMessage, ChatTemplate, TemplateError, TemplateLimits};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    bos_token: String,
    eos_token: String,
    rendered: String,
}

#[derive(Deserialize)]
struct Fixture {
    template: String,
    cases: Vec<Case>,
}

fn check_fixture(file: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(file);
    let fixture: Fixture =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("parse");
    let template =
        ChatTemplate::from_source("custom (from file)", &fixture.template).expect("compile");
    for case in &fixture.cases {
        let got = template
            .render(
                &case.messages,
                case.add_generation_prompt,
                &case.bos_token,
                &case.eos_token,
            )
            .expect("render");
        assert_eq!(
            got,
            case.rendered,
            "{file}: {} messages",
            case.messages.len()
        );
    }
}

#[test]
fn smollm2_template_matches_jinja2() {
    check_fixture("chat_smollm2.json");
}

#[test]
fn qwen25_template_matches_jinja2() {
    check_fixture("chat_qwen2.5.json");
}

#[test]
fn real_gguf_templates_load_from_metadata() {
    let models = std::env::var_os("FLATRUN_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    for (file, arch, name) in [
        (
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "llama",
            "custom (from file)",
        ),
        (
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "qwen2",
            "custom (from file)",
        ),
        ("gemma-3-270m-q4_k_m.gguf", "gemma3", "Gemma"),
    ] {
        let path = models.join(file);
        if !path.exists() {
            assert_ne!(
                std::env::var("FLATRUN_REQUIRE_MODELS").as_deref(),
                Ok("1"),
                "{} missing",
                path.display()
            );
            eprintln!("skipping {file}: missing");
            continue;
        }
        let backend = flatrun_format::open(&path).expect("open");
        let template =
            ChatTemplate::from_gguf_metadata(backend.metadata(), arch).expect("template");
        assert_eq!(template.name(), name, "{file}");
        let prompt = template
            .render(&[ChatMessage::new("user", "Hi")], true, "<bos>", "<eos>")
            .expect("render");
        assert!(prompt.contains("Hi"), "{file}: {prompt:?}");
    }
}

#[test]
fn fallbacks_by_architecture() {
    let conv = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "Bye"),
    ];
    let chatml = ChatTemplate::builtin_for_arch("qwen3", false);
    assert_eq!(chatml.name(), "ChatML");
    assert_eq!(
        chatml.render(&conv[1..2], true, "", "").unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        ChatTemplate::builtin_for_arch("llama", true).name(),
        "ChatML"
    );
    let gemma = ChatTemplate::builtin_for_arch("gemma3", false);
    assert_eq!(gemma.name(), "Gemma");
    assert_eq!(
        gemma.render(&conv, true, "<bos>", "<eos>").unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let llama3 = ChatTemplate::builtin_for_arch("llama3", false);
    assert_eq!(llama3.name(), "Llama 3");
    assert_eq!(
        llama3
            .render(&conv[1..2], true, "<|begin_of_text|>", "")
            .unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let llama2 = ChatTemplate::builtin_for_arch("llama", false);
    assert_eq!(llama2.name(), "Llama 2");
    assert_eq!(
        llama2.render(&conv, false, "<s>", "</s>").unwrap(),
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]"
    );
}

#[test]
fn hugging_face_helpers() {
    let t = ChatTemplate::from_source(
        "t",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if m.content.startswith('x') %}{{ m.content.strip().upper() }}{% endif %}{% endfor %}{{ ns.n }}|{{ messages[0] | tojson }}|{{ strftime_now('%Y')|length }}",
    )
    .unwrap();
    let out = t
        .render(&[ChatMessage::new("user", "x é ")], false, "", "")
        .unwrap();
    assert_eq!(out, r#"X É1|{"role": "user", "content": "x é "}|4"#);
    let raising = ChatTemplate::from_source(
        "t",
        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}ok",
    )
    .unwrap();
    let err = raising
        .render(
            &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
            false,
            "",
            "",
        )
        .unwrap_err();
    assert!(
        matches!(&err, TemplateError::Raised { message, .. } if message == "only one message"),
        "{err}"
    );
}

#[test]
fn hostile_infinite_loop_runs_out_of_fuel() {
    // `range` is capped, so nest loops to get ~10^15 iterations.
    let t = ChatTemplate::from_source("evil", "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}").unwrap();
    let start = std::time::Instant::now();
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(matches!(err, TemplateError::Limit { .. }), "{err}");
    assert!(err.to_string().contains("fuel"), "{err}");
    assert!(start.elapsed().as_secs() < 10);
}

#[test]
fn hostile_deep_recursion_is_stopped() {
    let t = ChatTemplate::from_source(
        "evil",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    )
    .unwrap();
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(matches!(err, TemplateError::Limit { .. }), "{err}");
    let t = ChatTemplate::from_source(
        "evil",
        "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    )
    .unwrap();
    let err = t
        .render(&[ChatMessage::new("user", "x")], false, "", "")
        .unwrap_err();
    assert!(matches!(err, TemplateError::Limit { .. }), "{err}");
}

#[test]
fn hostile_huge_output_is_stopped() {
    let limits = TemplateLimits {
        max_output_bytes: 1 << 20,
        ..TemplateLimits::default()
    };
    let t = ChatTemplate::from_source(
        "evil",
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    )
    .unwrap()
    .with_limits(limits);
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(matches!(err, TemplateError::Limit { .. }), "{err}");
    assert!(err.to_string().contains("output exceeds"), "{err}");
    // One gigantic string in a single operation (a constant: refused
    // before minijinja's constant folding would build it).
    let err = ChatTemplate::from_source("evil", "{{ 'x' * 100000000000 }}").unwrap_err();
    assert!(matches!(err, TemplateError::Limit { .. }), "{err}");
}

#[test]
fn syntax_errors_are_reported() {
    let err = ChatTemplate::from_source("broken", "{% for m in messages %}").unwrap_err();
    assert!(matches!(err, TemplateError::Syntax { .. }), "{err}");
}

/// Compile and render `source` and expect a size-limit error (from the
/// compile-time check of constants or from rendering), quickly and without
/// allocating more than the limits allow. Returns the error and the time taken.
fn expect_size_limit(source: &str) -> (TemplateError, std::time::Duration) {
    let start = std::time::Instant::now();
    let err = match ChatTemplate::from_source("evil", source) {
        Err(err) => err,
        Ok(t) => t
            .render(&[ChatMessage::new("user", "hello")], true, "<s>", "</s>")
            .unwrap_err(),
    };
    let elapsed = start.elapsed();
    assert!(
        matches!(err, TemplateError::Limit { .. }),
        "{source}: {err}"
    );
    assert!(elapsed.as_secs() < 10, "{source}: too slow");
    (err, elapsed)
}

#[test]
fn hostile_string_doubling_is_stopped() {
    // Doubling through a namespace in a loop: 2^64 bytes without the guards.
    expect_size_limit(
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    );
    expect_size_limit(
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    );
    // Straight-line doubling, nested and parenthesized operators.
    let doubling = "{% set s = 'xxxxxxxx' %}".to_string()
        + &"{% set s = (s ~ s) ~ (s ~ s) %}".repeat(40)
        + "{{ s|length }}";
    expect_size_limit(&doubling);
    // Repetition, sequences and inflating filters and methods.
    expect_size_limit("{% set s = 'x' * 3000000 %}{{ (s * 2)|length }}");
    expect_size_limit(
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    );
    expect_size_limit("{{ ([1] * 100000000)|length }}");
    expect_size_limit("{% set s = 'x' * 1000 %}{{ (s|replace('x', s))|replace('x', s)|length }}");
    expect_size_limit("{% set s = 'x' * 1000 %}{{ s.replace('x', s).replace('x', s)|length }}");
    expect_size_limit("{{ ['x' * 3000000, 'y' * 3000000]|join('')|length }}");
    expect_size_limit("{{ 'a\nb'|indent(100000000000) }}");
    expect_size_limit("{{ [1, 2]|batch(1000000000000)|list|length }}");
    expect_size_limit("{{ [1, 2]|slice(1000000000000)|list|length }}");
    expect_size_limit("{{ 'x'.center(100000000000) }}");
    expect_size_limit("{{ messages|tojson(indent=1000000000000) }}");
}

#[test]
fn guarded_operators_keep_their_meaning() {
    let t = ChatTemplate::from_source(
        "ops",
        "{{ 1 + 2 * 3 }}|{{ 'a' ~ (1 + 2) }}|{{ (messages[0]['content']) + ('!') }}|{{ messages[0].content ~ messages[0]['role'] }}|{{ ('a' ~ 'b') * 2 }}|{{ [1] + [2] }}|{{ 2 * [0] }}|{{ 'x' + 'y' ~ 3 }}|{{ -2 * -3 }}|{{ 1.5 + 1 }}|{{ 'ab' * 0 }}|{% if 'a' ~ 'b' == 'ab' %}yes{% endif %}|{{ messages[0]['content'] ~
 '!' }}|{{ undefined_name ~ 'u' }}",
    )
    .unwrap();
    let out = t
        .render(&[ChatMessage::new("user", "hi")], false, "", "")
        .unwrap();
    assert_eq!(
        out,
        "7|a3|hi!|hiuser|abab|[1, 2]|[0, 0]|xy3|6|2.5||yes|hi!|u"
    );
    // Line numbers survive the rewrite.
    let t = ChatTemplate::from_source("lines", "{{ 'a' ~\n'b' }}\n{{ raise_exception('boom') }}")
        .unwrap();
    let err = t.render(&[], false, "", "").unwrap_err();
    assert!(matches!(err, TemplateError::Raised { .. }), "{err}");
}

/// One hostile template per route around the operator guards: strings
/// grown inside captured blocks, macro output, `{% call %}` bodies,
/// `{% filter %}` blocks, loops and recursive macros, plus the routes that
/// build many or amplified strings. Each must stop with the limit error,
/// naming what grew, within a fraction of a second.
#[test]
fn hostile_captures_are_stopped() {
    let straight = |setup: &str, step: &str, times: usize, tail: &str| {
        format!("{setup}{}{tail}", step.repeat(times))
    };
    let routes: Vec<(&str, String, &str)> = vec![
        (
            "set-block doubling",
            straight(
                "{% set s %}xxxxxxxx{% endset %}",
                "{% set s %}{{ s }}{{ s }}{% endset %}",
                40,
                "{{ s|length }}",
            ),
            "captured block",
        ),
        (
            "macro doubling in a loop",
            "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = twice(ns.s) %}{% endfor %}{{ ns.s|length }}".into(),
            "macro output",
        ),
        (
            "call-block doubling",
            straight(
                "{% macro twice() %}{{ caller() }}{{ caller() }}{% endmacro %}{% set s %}xxxxxxxx{% endset %}",
                "{% set s %}{% call twice() %}{{ s }}{% endcall %}{% endset %}",
                40,
                "{{ s|length }}",
            ),
            "macro output",
        ),
        (
            "filter-block doubling",
            straight(
                "{% set s %}xxxxxxxx{% endset %}",
                "{% set s %}{% filter trim %}{{ s }}{{ s }}{% endfilter %}{% endset %}",
                40,
                "{{ s|length }}",
            ),
            "captured block",
        ),
        (
            "filter block fed by a loop",
            "{% set s = 'x' * 1000000 %}{% filter upper %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endfilter %}".into(),
            "captured block",
        ),
        (
            "nested loops of raw text in a capture",
            format!(
                "{{% set s %}}{{% for a in range(1000) %}}{{% for b in range(1000) %}}{}{{% endfor %}}{{% endfor %}}{{% endset %}}{{{{ s|length }}}}",
                "x".repeat(100)
            ),
            "captured block",
        ),
        (
            "nested loops of values in a capture",
            "{% set s = 'x' * 100000 %}{% set out %}{% for a in range(1000) %}{% for b in range(1000) %}{{ s }}{% endfor %}{% endfor %}{% endset %}{{ out|length }}".into(),
            "captured block",
        ),
        (
            "recursion via macros",
            "{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% else %}{{ 'x' * 1000000 }}{% endif %}{% endmacro %}{{ d(6)|length }}".into(),
            "macro output",
        ),
        (
            "many large strings kept in a list",
            "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + [('x' * 4000000) ~ i] %}{% endfor %}{{ ns.l|length }}".into(),
            "",
        ),
        (
            "many large strings kept in a namespace",
            "{% set ns = namespace(a='', b='', c='', d='', e='', f='', g='', h='', i='', j='', k='', l='', m='', n='', o='', p='', q='', r='') %}{% set s = 'x' * 4000000 %}{% for i in range(1000) %}{% set ns.a = s ~ i %}{% set ns.b = s ~ i %}{% set ns.c = s ~ i %}{% set ns.d = s ~ i %}{% set ns.e = s ~ i %}{% set ns.f = s ~ i %}{% set ns.g = s ~ i %}{% set ns.h = s ~ i %}{% set ns.i = s ~ i %}{% set ns.j = s ~ i %}{% set ns.k = s ~ i %}{% set ns.l = s ~ i %}{% set ns.m = s ~ i %}{% set ns.n = s ~ i %}{% set ns.o = s ~ i %}{% set ns.p = s ~ i %}{% set ns.q = s ~ i %}{% set ns.r = s ~ i %}{% endfor %}".into(),
            "in total",
        ),
        (
            "one string shared a million times, then stringified",
            "{% set s = 'x' * 4000000 %}{{ ([s] * 1000000)|upper|length }}".into(),
            "`*`",
        ),
        (
            "lazy list doubling, then stringified",
            "{% set ns = namespace(l=['x' * 4000000]) %}{% for i in range(20) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|string|length }}".into(),
            "`+`",
        ),
        (
            "str.format repeating one argument",
            "{% set s = 'x' * 4000000 %}{{ ('{0}' * 1000000).format(s)|length }}".into(),
            "`format`",
        ),
        (
            "printf width",
            "{{ '%999999999999s'|format('x')|length }}".into(),
            "`format`",
        ),
        (
            "a folded constant",
            "{{ ('x' * 90000000)|length }}".into(),
            "constant",
        ),
    ];
    for (route, source, what) in routes {
        let (err, elapsed) = expect_size_limit(&source);
        eprintln!("{route}: stopped in {elapsed:.2?}: {err}");
        assert!(err.to_string().contains(what), "{route}: {err}");
        // Tens of milliseconds in a debug build; generous for loaded CI machines.
        assert!(elapsed.as_millis() < 5000, "{route}: took {elapsed:?}");
    }
}

/// The output limit holds however the output is written: raw text in loops,
/// values, macro output.
#[test]
fn output_limit_counts_every_byte() {
    let limits = TemplateLimits {
        max_output_bytes: 1000,
        ..TemplateLimits::default()
    };
    for source in [
        "{% for i in range(1001) %}x{% endfor %}",
        "{% for i in range(101) %}{{ 'x' * 10 }}{% endfor %}",
        "{% macro m() %}{{ 'x' * 600 }}{% endmacro %}{{ m() }}{{ m() }}",
    ] {
        let t = ChatTemplate::from_source("evil", source)
            .unwrap()
            .with_limits(limits);
        let err = t.render(&[], false, "", "").unwrap_err();
        assert!(
            err.to_string().contains("output exceeds 1000 bytes"),
            "{source}: {err}"
        );
    }
    // Exactly at the limit is fine.
    let t = ChatTemplate::from_source("ok", "{% for i in range(1000) %}x{% endfor %}")
        .unwrap()
        .with_limits(limits);
    assert_eq!(t.render(&[], false, "", "").unwrap().len(), 1000);
}

#[test]
fn sandbox_names_are_reserved() {
    let err = ChatTemplate::from_source("evil", "{% set __flatrun_concat = 1 %}").unwrap_err();
    assert!(matches!(err, TemplateError::Syntax { .. }), "{err}");
}

/// Captures, macros, call blocks, filter blocks, recursive loops and
/// blocks still render what they always rendered under the sandbox.
#[test]
fn instrumented_templates_keep_their_output() {
    let t = ChatTemplate::from_source(
        "features",
        "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}\
         {% macro wrap() %}[{{ caller() }}]{% endmacro %}\
         {% set block %}{{ greet('a') }} {{ greet('b', '?') }}{% endset %}\
         {{ block }}|{% call wrap() %}in {{ 1 + 1 }}{% endcall %}|\
         {% filter upper %}up {{ 'x' ~ 'y' }}{% endfilter %}|\
         {% for m in messages if m.role == 'user' %}{{ loop.index }}:{{ m.content }}{% if not loop.last %},{% endif %}{% else %}none{% endfor %}|\
         {% for node in [{'name': 'a', 'children': [{'name': 'b'}, {'name': 'c'}]}, {'name': 'd'}] recursive %}{{ node.name }}{% if node.children %}({{ loop(node.children) }}){% endif %}{% endfor %}|\
         {% block b %}blk{% endblock %}|\
         {% with w = 'with' %}{{ w }}{% endwith %}|\
         {% raw %}{{ raw }}{% endraw %}|{{ [1, 2] + [3] }}|{{ 'ab' * 2 }}|{{ {'k': 'v'}|tojson }}",
    )
    .unwrap();
    let out = t
        .render(
            &[
                ChatMessage::new("system", "s"),
                ChatMessage::new("user", "u1"),
                ChatMessage::new("user", "u2"),
            ],
            false,
            "",
            "",
        )
        .unwrap();
    assert_eq!(
        out,
        "Hi a! Hi b?|[in 2]|UP XY|1:u1,2:u2|a(bc)d|blk|with|{{ raw }}|[1, 2, 3]|abab|{\"k\": \"v\"}"
    );
}

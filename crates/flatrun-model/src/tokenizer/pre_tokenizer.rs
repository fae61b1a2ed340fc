//! Pre-tokenizer regexes of byte-level BPE vocabularies, selected by the GGUF
//! key `tokenizer.ggml.pre` exactly as llama.cpp selects them
//! (`src/llama-vocab.cpp`). Each list is applied in order: every regex splits
//! every piece left by the previous ones into matches and the gaps between
//! them, which is the `tokenizers` crate's `Split` with `Isolated` behaviour.

/// Contractions, case-insensitively, as llama.cpp spells them for std::regex.
const CONTRACTIONS_ANY_CASE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";

/// The GPT-2 word regex.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// How one `pre` value tokenizes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PreTokenizerSpec {
    /// The llama.cpp family name this `pre` maps to (for `kind()`).
    pub family: &'static str,
    /// Split regexes, applied in order.
    pub regexes: Vec<String>,
    /// Whether a whole pre-token that is itself a vocabulary entry skips the merges.
    pub ignore_merges: bool,
    /// Whether BOS is added when the GGUF has no `add_bos_token` (llama.cpp's default).
    pub add_bos_default: bool,
}

/// The regexes for a `tokenizer.ggml.pre` value, or `None` when it is unknown.
pub(crate) fn spec_for(pre: &str) -> Option<PreTokenizerSpec> {
    let llama3 = format!(
        r"{CONTRACTIONS_ANY_CASE}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let qwen2 = format!(
        r"{CONTRACTIONS_ANY_CASE}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let spec = |family: &'static str, regexes: Vec<String>, ignore_merges: bool| {
        Some(PreTokenizerSpec {
            family,
            regexes,
            ignore_merges,
            add_bos_default: false,
        })
    };
    match pre {
        "default" | "" => spec("default", default_regexes(), false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "jina-v5-nano" => {
            spec("llama-bpe", vec![llama3], true).map(|s| PreTokenizerSpec { add_bos_default: true, ..s })
        }
        "dbrx" | "smaug-bpe" => spec("llama-bpe", vec![llama3], false),
        "chatglm-bpe" => spec("chatglm-bpe", vec![llama3], false),
        "glm4" | "glm5" => spec("chatglm-bpe", vec![llama3], true),
        "deepseek-llm" => spec(
            "deepseek-llm",
            vec![
                "[\r\n]".into(),
                r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+".into(),
                r"\s?[!-/:-~！-／：-～‘-‟　-。]+".into(),
                r"\s+$".into(),
                r"[一-龥ࠀ-一가-퟿]+".into(),
                r"\p{N}+".into(),
            ],
            false,
        ),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => spec(
            "deepseek-v3",
            vec![
                r"\p{N}{1,3}".into(),
                r"[一-龥぀-ゟ゠-ヿ]+".into(),
                "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+".into(),
            ],
            false,
        ),
        "deepseek-coder" => spec(
            "deepseek-coder",
            vec!["[\r\n]".into(), r"\s?\p{L}+".into(), r"\s?\p{P}+".into(), r"[一-龥ࠀ-一가-퟿]+".into(), r"\p{N}".into()],
            false,
        ),
        "falcon" => spec("falcon", vec![r"[\p{P}\$\+<=>\^~\|`]+".into(), GPT2.into(), "[0-9][0-9][0-9]".into()], false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            let family = match pre {
                "command-r" => "command-r",
                "smollm" => "smollm",
                "refact" => "refact",
                _ => "starcoder",
            };
            spec(family, vec![r"\p{N}".into(), GPT2.into()], false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "exaone4" => {
            spec("gpt-2", vec![GPT2.into()], false)
        }
        "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" => spec("mpt", vec![GPT2.into()], false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan" | "solar-open" => spec("qwen2", vec![qwen2], false),
        "qwen35" => spec(
            "qwen35",
            vec![format!(r"{CONTRACTIONS_ANY_CASE}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")],
            false,
        ),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec("bloom", vec![r" ?[^(\s|.,!?…。，、।۔،)]+".into()], false),
        "viking" => spec("viking", vec![r" ?[^(\s|.,!?…。，、।۔،)]+".into(), r"\p{N}".into()], false),
        "tekken" => spec(
            "tekken",
            vec![r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+".into()],
            true,
        )
        .map(|s| PreTokenizerSpec { add_bos_default: true, ..s }),
        "gpt-4o" | "minimax-m2" => spec(
            "gpt-4o",
            vec![format!(r"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+{CONTRACTIONS_ANY_CASE}?|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*{CONTRACTIONS_ANY_CASE}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")],
            false,
        ),
        "seed-coder" => spec(
            "seed-coder",
            vec![format!(r"{CONTRACTIONS_ANY_CASE}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1}}| ?[^\s\p{{L}}\p{{N}}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")],
            false,
        ),
        _ => None,
    }
}

/// llama.cpp's regexes for `pre = default` (and for unknown values).
pub(crate) fn default_regexes() -> Vec<String> {
    vec![
        r"[\p{P}\$\+<=>\^~\|]+".into(),
        GPT2.into(),
        r"\p{N}+".into(),
        "[0-9][0-9][0-9]".into(),
    ]
}

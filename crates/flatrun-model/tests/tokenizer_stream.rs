//! Streaming detokenization holds back partial UTF-8 sequences (checked on
//! the vocab-only Llama SentencePiece and Llama 3 BPE files, whose emoji are
//! spelled in byte tokens / split byte-level pieces).

use std::path::PathBuf;

use flatrun_model::tokenizer::{StreamDecoder, Tokenizer};

fn vocab(name: &str) -> Option<Tokenizer> {
    let dir = std::env::var_os("FLATRUN_VOCAB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/flatrun/vocab")
        });
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    if !path.exists() {
        if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("{} missing", path.display());
        }
        eprintln!("skipping: {} missing", path.display());
        return None;
    }
    let backend = flatrun_format::open(&path).expect("open");
    Some(Tokenizer::from_gguf_metadata(backend.metadata()).expect("tokenizer"))
}

#[test]
fn stream_never_emits_broken_utf8() {
    let text = "Llamas 🦙🦙 say 你好 and ünïcödé — 👨‍👩‍👧";
    for name in ["llama-spm", "llama-bpe"] {
        let Some(tok) = vocab(name) else { continue };
        let ids = tok.encode(text, true, false).expect("encode");
        let mut stream = StreamDecoder::new(&tok);
        let mut out = String::new();
        let mut held_back = 0;
        for &id in &ids {
            match stream.push(id) {
                Some(piece) => {
                    assert!(
                        !piece.contains('\u{fffd}'),
                        "{name}: broken sequence emitted"
                    );
                    out.push_str(&piece);
                }
                None => held_back += 1,
            }
        }
        out.push_str(&stream.finish());
        assert_eq!(out, text, "{name}");
        assert!(
            held_back > 0,
            "{name}: expected some tokens to be partial UTF-8"
        );
    }
}

#[test]
fn sentencepiece_leading_space_rule() {
    let Some(tok) = vocab("llama-spm") else {
        return;
    };
    let ids = tok.encode("Hello world", false, false).expect("encode");
    // The encoder prefixes a space; the first piece is "▁Hello".
    assert_eq!(tok.token_to_piece(ids[0]), b" Hello");
    assert_eq!(tok.decode(&ids, false).expect("decode"), "Hello world");
    let mut stream = StreamDecoder::new(&tok);
    assert_eq!(stream.push(ids[0]).as_deref(), Some("Hello"));
    assert_eq!(stream.push(ids[1]).as_deref(), Some(" world"));
}

//! Grammar-constrained decoding with `llguidance`: JSON Schema
//! (`response_format`, forced tool calls), regular expressions and Lark
//! grammars (the `regex` / `grammar` extension fields), compiled against
//! the model's vocabulary into a [`TokenConstraint`] per sequence.
//!
//! The token trie of a vocabulary is built once per model (about a
//! second for 150k tokens) and kept. A request's grammar is compiled when
//! the request arrives, so a bad schema is a 400 before any work; each
//! sequence then starts from a copy of the compiled matcher. The scheduler
//! computes a sequence's next mask on another thread while the layers run.

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use flatrun_model::sampling::{ConstraintFactory, TokenConstraint, Vocabulary};

/// What the output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A JSON Schema (`json_schema`, tool arguments).
    JsonSchema(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect, with `%json{…}` for schemas).
    Lark(String),
}

impl GrammarSpec {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// The most vocabularies whose parser factories are kept (one per model
/// a server holds, models of one family sharing theirs).
const MAX_FACTORIES: usize = 8;

/// Parser factories by vocabulary, the most recently used last.
static FACTORIES: Mutex<Vec<(Arc<Vocabulary>, Arc<ParserFactory>)>> = Mutex::new(Vec::new());

fn factory(vocabulary: &Arc<Vocabulary>) -> Result<Arc<ParserFactory>, String> {
    let mut cache = FACTORIES
        .lock()
        .map_err(|_| "grammar cache poisoned".to_string())?;
    if let Some(at) = cache
        .iter()
        .position(|(v, _)| Arc::ptr_eq(v, vocabulary) || **v == **vocabulary)
    {
        let entry = cache.remove(at);
        let f = entry.1.clone();
        cache.push(entry);
        return Ok(f);
    }
    let info = TokRxInfo::new(vocabulary.tokens.len() as u32, vocabulary.eos);
    let trie = TokTrie::from(&info, &vocabulary.tokens);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    let factory = Arc::new(factory);
    if cache.len() >= MAX_FACTORIES {
        cache.remove(0);
    }
    cache.push((vocabulary.clone(), factory.clone()));
    Ok(factory)
}

/// A compiled grammar: each sequence starts from a copy of its matcher.
pub struct Grammar {
    initial: Matcher,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// Compiles `spec` for `vocabulary`; the error says what is wrong with
    /// the grammar.
    pub fn compile(spec: &GrammarSpec, vocabulary: &Arc<Vocabulary>) -> Result<Grammar, String> {
        let factory = factory(vocabulary)?;
        let parser = factory
            .create_parser(spec.top_level())
            .map_err(|e| e.to_string())?;
        let initial = Matcher::new(Ok(parser));
        if let Some(error) = initial.get_error() {
            return Err(error);
        }
        Ok(Grammar { initial })
    }
}

impl ConstraintFactory for Grammar {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(GrammarState {
            matcher: self.initial.deep_clone(),
            mask: None,
        }))
    }
}

/// One sequence's position in its grammar.
struct GrammarState {
    matcher: Matcher,
    mask: Option<llguidance::toktrie::SimpleVob>,
}

impl TokenConstraint for GrammarState {
    fn compute_mask(&mut self) -> Result<(), String> {
        // A finished grammar allows only the end of generation.
        self.mask = Some(
            self.matcher
                .compute_mask_or_eos()
                .map_err(|e| e.to_string())?,
        );
        Ok(())
    }

    fn mask(&self) -> Option<&[u32]> {
        self.mask.as_ref().map(|m| m.as_slice())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.mask = None;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_vocabulary() -> Arc<Vocabulary> {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push(b"\xFF</s>".to_vec());
        Arc::new(Vocabulary { tokens, eos: 256 })
    }

    /// Greedy under the mask over a model that prefers the end, then the
    /// bytes of `{"a":1}`, then the lowest byte.
    fn first_allowed(spec: GrammarSpec, limit: usize) -> String {
        let preferred = [
            256u32,
            b'}' as u32,
            b'"' as u32,
            b'a' as u32,
            b':' as u32,
            b'1' as u32,
            b'{' as u32,
        ];
        let grammar = Grammar::compile(&spec, &bytes_vocabulary()).unwrap();
        let mut state = grammar.start().unwrap();
        let mut out = Vec::new();
        for _ in 0..limit {
            state.compute_mask().unwrap();
            let mask = state.mask().unwrap();
            let allowed = |i: u32| mask[i as usize / 32] >> (i % 32) & 1 == 1;
            let token = preferred
                .into_iter()
                .chain(0..257)
                .find(|&i| allowed(i))
                .unwrap();
            if token == 256 {
                break;
            }
            state.accept(token).unwrap();
            out.push(token as u8);
            if state.is_finished() {
                break;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn regex_and_schema_constrain_the_tokens() {
        assert_eq!(
            first_allowed(GrammarSpec::Regex("ab[0-9]{2}".into()), 20),
            "ab11"
        );
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
        let text = first_allowed(GrammarSpec::JsonSchema(schema), 50);
        let value: Value = serde_json::from_str(&text).unwrap();
        assert!(value["a"].is_i64(), "{text}");
    }

    #[test]
    fn a_bad_grammar_is_an_error() {
        let vocabulary = bytes_vocabulary();
        assert!(Grammar::compile(&GrammarSpec::Lark("start: (".into()), &vocabulary).is_err());
        let bad = serde_json::json!({"type": "no-such-type"});
        assert!(Grammar::compile(&GrammarSpec::JsonSchema(bad), &vocabulary).is_err());
    }
}

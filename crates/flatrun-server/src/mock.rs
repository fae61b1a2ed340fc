//! A deterministic stand-in model for testing the HTTP layer and the
//! scheduler without weights.
//!
//! - Vocabulary: one token per byte (ids 0–255), then `<s>` (256, BOS) and
//!   `</s>` (257, end of generation). Tokenizing is exact and cheap.
//! - Chat template: `<|system|>\n…\n<|user|>\n…\n<|assistant|>\n`.
//! - "Weights": after the prompt, the logits favour the bytes of a fixed
//!   reply, one byte per generated token, then `</s>` (unless the reply
//!   repeats forever). The favoured token gets logit 8, printable ASCII gets
//!   a small pseudo-random logit, everything else −∞, so greedy decoding
//!   returns the reply exactly and sampling with a seed is reproducible.
//! - Speculative decoding: [`BatchModel::verify`] returns every position's
//!   logits and [`BatchModel::truncate`] drops positions; with
//!   [`MockConfig::draft`] a "draft model" proposes the reply.
//! - Each step sleeps `step_delay` once, whatever the batch size, like a
//!   streaming runtime whose cost is loading the layers.
//!
//! ```
//! use flatrun_server::mock::{MockConfig, mock_engine};
//! use flatrun_server::{Engine, GenerationRequest, SamplingParams, SchedulerConfig};
//!
//! let (engine, _stats) = mock_engine(MockConfig::default(), SchedulerConfig::default()).unwrap();
//! let prompt = engine.tokenize("Hi", true).unwrap();
//! let request = GenerationRequest {
//!     prompt,
//!     sampling: SamplingParams { temperature: 0.0, ..Default::default() },
//!     max_tokens: 5,
//!     ..Default::default()
//! };
//! let stream = engine.submit(request).unwrap();
//! let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! let (text, _reason, usage) = runtime.block_on(stream.collect_text()).unwrap();
//! assert_eq!(text, "Hello");
//! assert_eq!(usage.completion_tokens, 5);
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::batch_model::{
    BatchModel, ModelError, Residency, SeqId, StepInput, TextModel, TokenTextStream,
};
use crate::scheduler::{BatchEngine, SchedulerConfig};
use flatrun_model::Pooling;
use flatrun_model::chat_template::ChatMessage;
use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::sampling::{TokenLogprobs, Vocabulary, token_logprobs};

/// Beginning-of-sequence token of the mock vocabulary.
pub const BOS: u32 = 256;
/// End-of-generation token of the mock vocabulary.
pub const EOS: u32 = 257;
/// Size of the mock vocabulary.
pub const VOCAB_SIZE: usize = 258;

/// How the mock behaves.
#[derive(Clone, Debug)]
pub struct MockConfig {
    pub model_name: String,
    pub context_length: usize,
    /// The text every answer is made of.
    pub reply: String,
    /// Repeat the reply forever instead of ending with `</s>`.
    pub repeat: bool,
    /// Sleep of each step (one pass through the "layers").
    pub step_delay: Duration,
    /// Fork sequences at a prefix (prompt reuse; off by default, so that
    /// finished sequences are freed at once).
    pub prefix_reuse: bool,
    /// Give the mock a draft model ([`BatchModel::propose`]) that proposes
    /// the reply's next bytes but gets every fifth position wrong.
    pub draft: bool,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            model_name: "mock".to_string(),
            context_length: 512,
            reply: "Hello from the Flatrun mock model.".to_string(),
            repeat: false,
            step_delay: Duration::ZERO,
            prefix_reuse: false,
            draft: false,
        }
    }
}

/// What the mock observed, for tests.
#[derive(Debug, Default)]
pub struct MockStats {
    /// Sequences opened and not yet freed.
    pub live_sequences: AtomicUsize,
    /// Sequences ever opened.
    pub sequences_opened: AtomicUsize,
    /// Steps run.
    pub steps: AtomicU64,
    /// Largest batch seen in one step.
    pub max_batch: AtomicUsize,
    /// Tokens fed to steps (prompt and generated), since start.
    pub tokens_fed: AtomicU64,
    /// Calls of [`BatchModel::truncate`] (rejected proposals dropped).
    pub truncations: AtomicU64,
}

/// The text side of the mock.
#[derive(Clone, Debug)]
pub struct MockText {
    config: MockConfig,
}

impl MockText {
    pub fn new(config: MockConfig) -> Self {
        MockText { config }
    }
}

impl TextModel for MockText {
    fn model_name(&self) -> &str {
        &self.config.model_name
    }

    fn context_length(&self) -> usize {
        self.config.context_length
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ModelError> {
        let mut tokens = Vec::with_capacity(text.len() + 1);
        if add_special {
            tokens.push(BOS);
        }
        tokens.extend(text.bytes().map(u32::from));
        Ok(tokens)
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, ModelError> {
        let mut bytes = Vec::with_capacity(tokens.len());
        for &token in tokens {
            match token {
                0..=255 => bytes.push(token as u8),
                BOS | EOS => {}
                _ => {
                    return Err(ModelError(format!(
                        "token id {token} is outside the vocabulary of {VOCAB_SIZE}"
                    )));
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        let mut out = String::new();
        for message in messages {
            out.push_str(&format!("<|{}|>\n{}\n", message.role, message.content));
        }
        out.push_str("<|assistant|>\n");
        Ok(out)
    }

    /// Tools come first as `<|tools|>` and their JSON; assistant tool calls
    /// as Hermes `<tool_call>` blocks.
    fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Option<Result<String, ModelError>> {
        let mut out = format!("<|tools|>\n{tools}\n");
        for message in messages {
            out.push_str(&format!("<|{}|>\n{}\n", message.role, message.content));
            for call in message
                .tool_calls
                .iter()
                .flat_map(|c| c.as_array().into_iter().flatten())
            {
                out.push_str(&format!("<tool_call>{}</tool_call>\n", call["function"]));
            }
        }
        out.push_str("<|assistant|>\n");
        Some(Ok(out))
    }

    fn tool_syntax(&self) -> Option<ToolSyntax> {
        Some(ToolSyntax::Hermes)
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(VOCAB_SIZE)
    }

    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push(b"\xFF<s>".to_vec());
        tokens.push(b"\xFF</s>".to_vec());
        Some(Arc::new(Vocabulary { tokens, eos: EOS }))
    }

    fn is_end_of_generation(&self, token: u32) -> bool {
        token == EOS
    }

    fn stream_decoder(&self) -> Box<dyn TokenTextStream + '_> {
        Box::new(MockStreamDecoder::default())
    }
}

/// The mock's streaming detokenizer: bytes in, whole characters out.
#[derive(Debug, Default)]
struct MockStreamDecoder {
    /// Bytes of an incomplete character.
    pending: Vec<u8>,
}

impl TokenTextStream for MockStreamDecoder {
    fn push(&mut self, token: u32) -> String {
        if let Ok(byte) = u8::try_from(token) {
            self.pending.push(byte);
        }
        // Everything but an incomplete character at the very end.
        let complete = match std::str::from_utf8(&self.pending) {
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            _ => self.pending.len(),
        };
        let text = String::from_utf8_lossy(&self.pending[..complete]).into_owned();
        self.pending.drain(..complete);
        text
    }

    fn finish(self: Box<Self>) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// Per-sequence state of the mock: how many tokens it was fed.
#[derive(Debug, Default)]
struct MockSequence {
    fed: usize,
    /// Positions the scheduler said this sequence would need at most.
    capacity: usize,
    /// Tokens fed when logits were first asked for (the prompt length).
    prompt_len: Option<usize>,
}

/// The compute side of the mock.
#[derive(Debug)]
pub struct MockModel {
    config: MockConfig,
    sequences: HashMap<SeqId, MockSequence>,
    next_id: u64,
    stats: Arc<MockStats>,
}

impl MockModel {
    pub fn new(config: MockConfig, stats: Arc<MockStats>) -> Self {
        MockModel {
            config,
            sequences: HashMap::new(),
            next_id: 0,
            stats,
        }
    }

    /// One "pass through the layers" for the whole batch: the logits of
    /// each input's last position, or with `all` of every position.
    fn pass(&mut self, batch: &[StepInput<'_>], all: bool) -> Result<Vec<Vec<f32>>, ModelError> {
        // One "pass through the layers" for the whole batch.
        if !self.config.step_delay.is_zero() {
            std::thread::sleep(self.config.step_delay);
        }
        self.stats.steps.fetch_add(1, Ordering::SeqCst);
        self.stats
            .max_batch
            .fetch_max(batch.len(), Ordering::SeqCst);
        let mut out = Vec::with_capacity(batch.len());
        for input in batch {
            let sequence = self
                .sequences
                .get_mut(&input.seq)
                .ok_or_else(|| ModelError(format!("unknown sequence {}", input.seq.0)))?;
            sequence.fed += input.tokens.len();
            self.stats
                .tokens_fed
                .fetch_add(input.tokens.len() as u64, Ordering::SeqCst);
            // Like a KV cache sized at `new_sequence`: no room past it.
            let room = sequence.capacity.min(self.config.context_length);
            if sequence.fed > room {
                return Err(ModelError(format!(
                    "sequence {} overflows its {room} positions",
                    input.seq.0
                )));
            }
            let fed = sequence.fed;
            if all {
                // Every position fed, as one-token steps would see them.
                let first = fed - input.tokens.len() + 1;
                let prompt_len = *sequence.prompt_len.get_or_insert(first);
                let rows = (first..=fed)
                    .flat_map(|f| self.logits(f.saturating_sub(prompt_len), f))
                    .collect();
                out.push(rows);
                continue;
            }
            if !input.logits_needed {
                out.push(Vec::new());
                continue;
            }
            let prompt_len = *sequence.prompt_len.get_or_insert(fed);
            out.push(self.logits(fed - prompt_len, fed));
        }
        Ok(out)
    }

    /// The favoured token after `generated` answer tokens.
    fn target(&self, generated: usize) -> u32 {
        let reply = self.config.reply.as_bytes();
        if reply.is_empty() {
            EOS
        } else if self.config.repeat {
            u32::from(reply[generated % reply.len()])
        } else {
            reply.get(generated).map_or(EOS, |&b| u32::from(b))
        }
    }

    /// Logits after `generated` answer tokens of a sequence whose `fed`
    /// tokens so far are known.
    fn logits(&self, generated: usize, fed: usize) -> Vec<f32> {
        let target = self.target(generated);
        let mut logits = vec![f32::NEG_INFINITY; VOCAB_SIZE];
        for (id, logit) in logits.iter_mut().enumerate().take(127).skip(32) {
            *logit = noise(fed as u64, id as u64) * 2.0;
        }
        logits[target as usize] = 8.0;
        logits
    }
}

/// Deterministic pseudo-random value in [0, 1).
fn noise(a: u64, b: u64) -> f32 {
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z >> 40) as f32) / (1u64 << 24) as f32
}

impl BatchModel for MockModel {
    fn new_sequence(&mut self, positions: usize) -> Result<SeqId, ModelError> {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let sequence = MockSequence {
            capacity: positions,
            ..MockSequence::default()
        };
        self.sequences.insert(id, sequence);
        self.stats.live_sequences.fetch_add(1, Ordering::SeqCst);
        self.stats.sequences_opened.fetch_add(1, Ordering::SeqCst);
        Ok(id)
    }

    /// Mean pooled hidden states of eight pseudo-random values per
    /// position, from the token and position.
    fn embed(&mut self, inputs: &[Vec<u32>]) -> Option<Result<Vec<Vec<f32>>, ModelError>> {
        let pooled = inputs.iter().map(|tokens| {
            let states: Vec<f32> = tokens
                .iter()
                .enumerate()
                .flat_map(|(p, &t)| {
                    (0..8).map(move |k| noise(u64::from(t) * 8 + k, p as u64) - 0.5)
                })
                .collect();
            Pooling::Mean
                .pool(&states, 8)
                .ok_or_else(|| ModelError("empty input".into()))
        });
        Some(pooled.collect())
    }

    /// The logits the mock gives at each position of a fresh sequence.
    fn score(
        &mut self,
        tokens: &[u32],
        top: usize,
    ) -> Option<Result<Vec<TokenLogprobs>, ModelError>> {
        Some(Ok(tokens
            .windows(2)
            .enumerate()
            .map(|(p, pair)| token_logprobs(&self.logits(0, p + 1), pair[1], top))
            .collect()))
    }

    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.pass(batch, false)
    }

    fn speculates(&self) -> bool {
        true
    }

    fn verify(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.pass(batch, true)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), ModelError> {
        let sequence = self
            .sequences
            .get_mut(&seq)
            .ok_or_else(|| ModelError(format!("unknown sequence {}", seq.0)))?;
        if len > sequence.fed {
            return Err(ModelError(format!(
                "sequence {} holds {} positions, not {len}",
                seq.0, sequence.fed
            )));
        }
        sequence.fed = len;
        self.stats.truncations.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn has_draft(&self) -> bool {
        self.config.draft
    }

    fn propose(&mut self, seq: SeqId, context: &[u32], max: usize) -> Result<Vec<u32>, ModelError> {
        let sequence = self
            .sequences
            .get(&seq)
            .ok_or_else(|| ModelError(format!("unknown sequence {}", seq.0)))?;
        let prompt_len = sequence.prompt_len.unwrap_or(context.len());
        Ok((context.len()..context.len() + max)
            .map(|position| {
                if position % 5 == 0 {
                    u32::from(b'#')
                } else {
                    self.target(position - prompt_len)
                }
            })
            .collect())
    }

    fn free(&mut self, seq: SeqId) {
        if self.sequences.remove(&seq).is_some() {
            self.stats.live_sequences.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn reuses_prefixes(&self) -> bool {
        self.config.prefix_reuse
    }

    /// A sequence that has been fed `len` tokens: the mock's answer only
    /// depends on the position, so this is exactly what feeding them gives.
    fn fork(
        &mut self,
        source: SeqId,
        len: usize,
        positions: usize,
    ) -> Option<Result<SeqId, ModelError>> {
        if !self.config.prefix_reuse || self.sequences.get(&source)?.fed < len {
            return None;
        }
        let id = SeqId(self.next_id);
        let result = self.new_sequence(positions.max(len));
        if let Some(sequence) = self.sequences.get_mut(&id) {
            sequence.fed = len;
        }
        Some(result)
    }

    /// 64 bytes per position fed.
    fn kv_bytes(&self, seq: SeqId) -> u64 {
        self.sequences.get(&seq).map_or(0, |s| 64 * s.fed as u64)
    }

    fn residency(&self) -> Option<Residency> {
        Some(Residency {
            resident_bytes: 1 << 20,
            total_bytes: 1 << 20,
        })
    }
}

/// A [`BatchEngine`] over the mock, and the mock's counters.
pub fn mock_engine(
    config: MockConfig,
    scheduler: SchedulerConfig,
) -> std::io::Result<(BatchEngine, Arc<MockStats>)> {
    let stats = Arc::new(MockStats::default());
    let text = Arc::new(MockText::new(config.clone()));
    let model = MockModel::new(config, stats.clone());
    Ok((BatchEngine::start(model, text, scheduler)?, stats))
}

//! OpenAI- and Anthropic-compatible HTTP server for Flatrun.
//!
//! The HTTP layer is a thin translation of the two wire formats onto the
//! [`Engine`] trait. The usual engine is a [`BatchEngine`]: a scheduler that
//! advances every running sequence with **one** [`BatchModel::step`] (one
//! pass through the layers) per decode step, with a bounded admission queue
//! beyond [`SchedulerConfig::max_seqs`]. A runtime plugs in by implementing
//! [`TextModel`] (tokenizer, chat template) and [`BatchModel`] (sequences,
//! batched step); see [`batch_model`] for the contract. The Flatrun runtime's
//! implementation is `runtime` (feature `runtime`, on by default):
//! `runtime::engine(model, scheduler)` is the whole of `flatrun serve`'s
//! model side.
//!
//! Features: `runtime` (default) adds the adapter over `flatrun-runtime`;
//! `testing` adds `mock`, a deterministic byte-level model for testing the
//! HTTP layer and the scheduler without weights.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `POST /v1/messages`, `POST /v1/messages/count_tokens`,
//! `GET /health`, `GET /metrics`, `POST /tokenize`, `POST /detokenize`
//! (see `docs/serve.md`).
//!
//! # Example
//!
//! Serve the deterministic `mock` model (feature `testing`) on a free
//! loopback port, ask it for a chat completion over plain TCP, and shut down:
//!
//! ```
//! use std::sync::Arc;
//! use flatrun_server::mock::{mock_engine, MockConfig};
//! use flatrun_server::{SchedulerConfig, Server, ServerConfig};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Runtime::new()?;
//! runtime.block_on(async {
//!     let (engine, _stats) = mock_engine(MockConfig::default(), SchedulerConfig::default())?;
//!     let config = ServerConfig { port: 0, ..ServerConfig::default() };
//!     let server = Server::bind(config).await?;
//!     let address = server.local_addr()?;
//!     server.engine_slot().set(Arc::new(engine));
//!     let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//!     let serving = tokio::spawn(server.run_until(async { let _ = stopped.await; }));
//!
//!     let body = r#"{"messages":[{"role":"user","content":"Hi"}],"temperature":0,"max_tokens":5}"#;
//!     let mut socket = tokio::net::TcpStream::connect(address).await?;
//!     let request = format!(
//!         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
//!          Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
//!         body.len()
//!     );
//!     socket.write_all(request.as_bytes()).await?;
//!     let mut response = String::new();
//!     socket.read_to_string(&mut response).await?;
//!     assert!(response.starts_with("HTTP/1.1 200"));
//!     assert!(response.contains(r#""content":"Hello""#));
//!
//!     let _ = stop.send(());
//!     serving.await??;
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })?;
//! # Ok(())
//! # }
//! ```

pub mod anthropic;
pub mod api_error;
pub mod args;
pub mod batch_model;
pub mod config;
pub mod engine;
pub mod grammar;
pub mod metrics;
#[cfg(feature = "testing")]
pub mod mock;
pub mod models;
pub mod openai;
pub mod output;
pub mod overflow;
mod prefix_cache;
pub mod request_body;
pub mod request_fields;
#[cfg(feature = "runtime")]
pub mod runtime;
pub mod scheduler;
pub mod server;
pub mod state;
pub mod tool_defs;

pub use api_error::{ApiError, ApiFlavor, ErrorKind};
pub use args::ServeArgs;
pub use batch_model::{
    BatchModel, ModelError, Residency, SeqId, Shifted, StepInput, TextModel, TokenTextStream,
};
pub use config::{ServerConfig, api_default_sampling};
pub use engine::{
    Engine, EngineError, EngineStats, GenerationEvent, GenerationRequest, GenerationStream, Usage,
};
pub use models::{Footprint, LoadedModel, ModelLoader, ModelPolicy, ModelSet};
pub use scheduler::{BatchEngine, SchedulerConfig};
pub use server::{Server, ServerError, router, serve, serve_loading, shutdown_signal};
pub use state::{AppState, EngineSlot};

// The model crate's types that cross the engine interface.
pub use flatrun_model::chat_template::ChatMessage;
pub use flatrun_model::sampling::{FinishReason, ProposerKind, SamplingParams, Speculation};

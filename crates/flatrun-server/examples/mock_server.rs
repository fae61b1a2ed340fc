//! Serves the deterministic mock model over HTTP, for trying the API with
//! curl or the SDKs without a real model; also shows how `flatrun serve`
//! wires [`ServeArgs`] into the server:
//!
//! ```sh
//! cargo run -p flatrun-server --features testing --example mock_server -- --port 8080
//! curl -s localhost:8080/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}]}'
//! ```
//!
//! Prints `listening on http://ADDR` once bound (use `--port 0` for a free
//! port), then serves until SIGINT/SIGTERM.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use flatrun_server::mock::{MockConfig, mock_engine};
use flatrun_server::{ServeArgs, Server, api_default_sampling};

/// Serve the Flatrun mock model.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    /// Context length of the mock, in tokens.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Milliseconds each batched step sleeps (a stand-in for loading layers).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// The text every answer is made of.
    #[arg(long, default_value = "Hello from the Flatrun mock model.")]
    reply: String,
    /// Repeat the reply forever instead of ending it.
    #[arg(long)]
    repeat: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let mock = MockConfig {
        context_length: cli.ctx,
        step_delay: Duration::from_millis(cli.step_delay_ms),
        reply: cli.reply.clone(),
        repeat: cli.repeat,
        ..MockConfig::default()
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let (engine, _stats) = mock_engine(mock, cli.serve.scheduler_config())?;
        let server = Server::bind(cli.serve.server_config(api_default_sampling())).await?;
        println!("listening on http://{}", server.local_addr()?);
        std::io::stdout().flush()?;
        server.engine_slot().set(Arc::new(engine));
        server.run().await?;
        Ok(())
    })
}

//! Serves the deterministic mock model over HTTP, for trying the API with
//! curl or the SDKs without a real model:
//!
//! ```sh
//! cargo run -p flatrun-server --example mock_server -- --port 8080
//! curl -s localhost:8080/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}]}'
//! ```
//!
//! Flags: `--host H`, `--port N` (0 picks a free port), `--api-key K`,
//! `--max-seqs N`, `--max-queue N`, `--ctx N`, `--step-delay-ms N`,
//! `--max-body BYTES`, `--reply TEXT`, `--repeat`. Prints
//! `listening on http://ADDR` once bound, then serves until SIGINT/SIGTERM.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use flatrun_server::mock::{mock_engine, MockConfig};
use flatrun_server::{SchedulerConfig, Server, ServerConfig};

fn parse<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .parse()
        .map_err(|_| format!("{flag}: cannot parse `{value}`"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = ServerConfig::default();
    let mut mock = MockConfig::default();
    let mut scheduler = SchedulerConfig::default();
    config.api_key = std::env::var("FLATRUN_API_KEY").ok().filter(|k| !k.is_empty());
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--host" => config.host = parse(&flag, args.next())?,
            "--port" => config.port = parse(&flag, args.next())?,
            "--api-key" => config.api_key = Some(parse(&flag, args.next())?),
            "--max-seqs" => scheduler.max_seqs = parse(&flag, args.next())?,
            "--max-queue" => scheduler.max_queue = parse(&flag, args.next())?,
            "--max-body" => config.max_body_bytes = parse(&flag, args.next())?,
            "--ctx" => mock.context_length = parse(&flag, args.next())?,
            "--step-delay-ms" => {
                mock.step_delay = Duration::from_millis(parse(&flag, args.next())?)
            }
            "--reply" => mock.reply = parse(&flag, args.next())?,
            "--repeat" => mock.repeat = true,
            other => return Err(format!("unknown flag `{other}`").into()),
        }
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let (engine, _stats) = mock_engine(mock, scheduler)?;
        let server = Server::bind(config).await?;
        println!("listening on http://{}", server.local_addr()?);
        std::io::stdout().flush()?;
        server.engine_slot().set(Arc::new(engine));
        server.run().await?;
        Ok(())
    })
}

//! [`ServeArgs`]: the server's command-line flags, for `flatrun serve` to
//! `#[command(flatten)]` and turn into a [`ServerConfig`] and a
//! [`SchedulerConfig`].

use std::time::Duration;

use crate::config::{ContextOverflow, ServerConfig};
use crate::models::ModelPolicy;
use crate::scheduler::SchedulerConfig;
use flatrun_model::sampling::SamplingParams;

/// The flags of `flatrun serve` that belong to the HTTP server.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to bind; use 0.0.0.0 to expose the server beyond this machine.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0 picks a free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY`.
    #[arg(long, env = "FLATRUN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Sequences decoded together in one batch.
    #[arg(long, default_value_t = 4)]
    pub max_seqs: usize,
    /// Requests that may wait beyond --max-seqs; more get 429/529 at once.
    #[arg(long, default_value_t = 32)]
    pub max_queue: usize,
    /// Prompt tokens fed per sequence per step.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// KV bytes of finished sequences kept so that later prompts sharing a
    /// prefix reuse it (0: keep none).
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub prompt_cache: usize,
    /// A prompt plus `max_tokens` longer than the context: refuse it
    /// (`error`), drop the oldest turns after the system prompt
    /// (`truncate-middle`), or generate on past the end by dropping the
    /// oldest tokens after the system prompt (`shift`).
    #[arg(long, default_value = "error", value_parser = parse_overflow)]
    pub context_overflow: ContextOverflow,
    /// Largest request body (bytes, or with a K/M/G suffix).
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub max_body: usize,
    /// Serve the model under this name instead of its own.
    #[arg(long)]
    pub served_name: Option<String>,
    /// Seconds without output after which Anthropic streams send a `ping`
    /// event and OpenAI streams an SSE comment (keep-alive).
    #[arg(long, default_value_t = 1.0)]
    pub ping_interval: f64,
    /// Seconds in-flight requests get to finish on SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace: f64,
    /// Serve `/metrics` without the API key (for a scraper inside the
    /// trusted network).
    #[arg(long)]
    pub public_metrics: bool,
    /// Largest `max_tokens` a request may ask for; requests that do not say
    /// get this many at most.
    #[arg(long)]
    pub max_tokens_limit: Option<u64>,
    /// Seconds a request may take from its first byte to its last answer
    /// byte (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    pub request_timeout: f64,
    /// Seconds a client may take to send its request head; slower clients
    /// are disconnected.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Largest request head (request line and headers).
    #[arg(long, default_value = "64K", value_parser = parse_size)]
    pub max_header: usize,
    /// Allow browsers from this origin (repeatable; `*` for any). Without
    /// it the server sends no CORS headers.
    #[arg(long = "cors", value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// Memory the served models may plan for together (weights kept,
    /// KV caches, buffers; K/M/G suffixes): each model loads on its first
    /// request, resident while it fits, capped or streamed beyond; idle
    /// models are unloaded, least recently used first, to make room.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_resident: Option<usize>,
    /// Unload a model after this many seconds without requests (`5m`,
    /// `1h` and `30s` work too; default: keep it until room is needed).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub keep_alive: Option<Duration>,
}

impl ServeArgs {
    /// The server settings, with `sampling` (from the shared sampling flags)
    /// as the request defaults.
    pub fn server_config(&self, sampling: SamplingParams) -> ServerConfig {
        ServerConfig {
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            max_body_bytes: self.max_body,
            served_model_name: self.served_name.clone(),
            default_sampling: sampling,
            ping_interval: seconds(self.ping_interval),
            shutdown_grace: seconds(self.shutdown_grace),
            public_metrics: self.public_metrics,
            max_tokens_limit: self.max_tokens_limit,
            request_timeout: (self.request_timeout > 0.0).then(|| seconds(self.request_timeout)),
            header_timeout: seconds(self.header_timeout),
            max_header_bytes: self.max_header,
            cors_origins: self.cors.clone(),
            context_overflow: self.context_overflow,
            model_policy: ModelPolicy {
                max_resident: self.max_resident.map(|b| b as u64),
                keep_alive: self.keep_alive,
            },
        }
    }

    /// The batch scheduler settings.
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_seqs: self.max_seqs,
            max_queue: self.max_queue,
            prefill_chunk: self.prefill_chunk,
            prompt_cache_bytes: self.prompt_cache as u64,
            speculation: None,
        }
    }
}

fn parse_overflow(text: &str) -> Result<ContextOverflow, String> {
    text.parse()
}

fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// Parses `90` (seconds), `30s`, `5m`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim().to_ascii_lowercase();
    let (digits, unit) = match t.chars().last() {
        Some('s') => (&t[..t.len() - 1], 1.0),
        Some('m') => (&t[..t.len() - 1], 60.0),
        Some('h') => (&t[..t.len() - 1], 3600.0),
        _ => (t.as_str(), 1.0),
    };
    let value: f64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (use 90, 30s, 5m or 1h)"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!(
            "`{text}` is not a duration (use 90, 30s, 5m or 1h)"
        ));
    }
    Ok(seconds(value * unit))
}

/// Parses `4096`, `512K`, `4M`, `1G` (powers of 1024; `B`/`iB` suffixes allowed).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let lower = text.trim().to_ascii_lowercase();
    let lower = lower.trim_end_matches("ib").trim_end_matches('b');
    let (digits, multiplier) = match lower.chars().last() {
        Some('k') => (&lower[..lower.len() - 1], 1usize << 10),
        Some('m') => (&lower[..lower.len() - 1], 1 << 20),
        Some('g') => (&lower[..lower.len() - 1], 1 << 30),
        _ => (lower, 1),
    };
    digits
        .trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| format!("`{text}` is not a size (e.g. 65536, 512K, 4M)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::api_default_sampling;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 * 1024));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("0.5h"), Ok(Duration::from_secs(1800)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1").is_err());
        let cli = Cli::parse_from(["serve", "--max-resident", "20G", "--keep-alive", "5m"]);
        let policy = cli.serve.server_config(api_default_sampling()).model_policy;
        assert_eq!(policy.max_resident, Some(20 << 30));
        assert_eq!(policy.keep_alive, Some(Duration::from_secs(300)));
    }

    #[test]
    fn defaults_bind_loopback() {
        let cli = Cli::parse_from(["serve"]);
        let config = cli.serve.server_config(api_default_sampling());
        assert_eq!(config.host, "127.0.0.1");
        assert_eq!(config.port, 8080);
        assert_eq!(config.max_body_bytes, 4 << 20);
        assert_eq!(cli.serve.scheduler_config(), SchedulerConfig::default());
    }

    #[test]
    fn flags_are_read() {
        let cli = Cli::parse_from([
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--max-seqs",
            "8",
            "--max-body",
            "1M",
            "--shutdown-grace",
            "0.5",
            "--prompt-cache",
            "0",
            "--context-overflow",
            "shift",
        ]);
        let config = cli.serve.server_config(api_default_sampling());
        assert_eq!(config.host, "0.0.0.0");
        assert_eq!(config.port, 9000);
        assert_eq!(config.api_key.as_deref(), Some("k"));
        assert_eq!(config.max_body_bytes, 1 << 20);
        assert_eq!(config.shutdown_grace, Duration::from_millis(500));
        assert_eq!(cli.serve.scheduler_config().max_seqs, 8);
        assert_eq!(cli.serve.scheduler_config().prompt_cache_bytes, 0);
        assert_eq!(config.context_overflow, ContextOverflow::Shift);
    }
}

//! Loading a model for a command: friendly checks of the path, a spinner on
//! a terminal, and the "what was detected" header.

use crate::flags::{EngineFlags, human_bytes, residency_name, weight_bytes};
use crate::progress::{Progress, on_terminal};
use anyhow::{Context, Result, bail};
use flatrun_runtime::{LoadOptions, Model, WeightsMode};
use std::path::Path;
use std::time::{Duration, Instant};

/// A loaded model and how long loading took.
pub struct Loaded {
    pub model: Model,
    pub load_time: Duration,
    pub options: LoadOptions,
}

/// Check that `path` looks like a checkpoint before handing it to the runtime.
pub fn check_model_path(path: &Path) -> Result<()> {
    if !path.exists() {
        if let Some(why) = crate::hub::not_found(&path.to_string_lossy()) {
            bail!("model not found: {}: {why}", path.display());
        }
        bail!(
            "model not found: {}\nhint: pass a .gguf file or a SafeTensors/MLX directory (models are cached in $FLATRUN_MODELS)",
            path.display()
        );
    }
    if path.is_dir() {
        let has_weights = std::fs::read_dir(path)
            .with_context(|| format!("cannot read directory {}", path.display()))?
            .filter_map(|e| e.ok())
            .any(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.ends_with(".safetensors")
                    || name.ends_with(".gguf")
                    || name.ends_with(".safetensors.index.json")
            });
        if !has_weights {
            bail!(
                "{} holds no weights (no .safetensors or .gguf file)\nhint: point --model at a .gguf file or a directory with model*.safetensors and config.json",
                path.display()
            );
        }
    }
    Ok(())
}

/// Load `path` with `flags`, showing a spinner on a terminal.
pub fn load(path: &Path, flags: &EngineFlags, quiet: bool) -> Result<Loaded> {
    check_model_path(path)?;
    load_with(path, flags.load_options(path)?, quiet)
}

/// Load `path` with `options` (made from the flags), showing a spinner on
/// a terminal.
pub fn load_with(path: &Path, options: LoadOptions, quiet: bool) -> Result<Loaded> {
    let mut what = format!(
        "mapping {} ({})",
        path.display(),
        human_bytes(weight_bytes(path))
    );
    if options.weights != WeightsMode::Keep {
        what.push_str(&format!(
            " and dequantizing its layers to {}",
            options.weights
        ));
    }
    let bar = Progress::spinner(on_terminal(quiet), &what);
    let started = Instant::now();
    let result = Model::load(path, options.clone());
    bar.finish();
    let model = result.map_err(|e| anyhow::anyhow!("cannot load {}: {e}", path.display()))?;
    Ok(Loaded {
        model,
        load_time: started.elapsed(),
        options,
    })
}

/// The detection header: format, architecture, layers, tokenizer, template, load time.
pub fn header(loaded: &Loaded) -> String {
    let model = &loaded.model;
    let cfg = model.config();
    let exec = model.executor();
    let tokenizer = match model.tokenizer() {
        Ok(t) => format!("{} ({} tokens)", t.kind(), t.vocab_size()),
        Err(e) => format!("unavailable ({e})"),
    };
    let template = match model.chat_template() {
        Ok(t) => t.name().to_string(),
        Err(_) => "none".to_string(),
    };
    let plan = exec.residency();
    let mut extra = String::new();
    if loaded.options.weights != WeightsMode::Keep {
        extra.push_str(&format!(
            "\nweights:   layers dequantized to {} ({})",
            loaded.options.weights,
            human_bytes(exec.dense_weight_bytes())
        ));
    }
    if let Some(cached) = exec.streams_through_page_cache() {
        extra.push_str(if cached {
            "\nreads:     streamed layers through the page cache (memory is plentiful; --stream-reads)"
        } else {
            "\nreads:     streamed layers with O_DIRECT, around the page cache (--stream-reads)"
        });
    }
    if let Some(c) = exec.manifest().experts {
        let (_, budget) = exec.expert_cache();
        extra.push_str(&if plan.keeps_experts_whole() {
            format!(
                "\nexperts:   top-{} of {} per layer, all kept",
                c.n_used, c.n_expert
            )
        } else {
            format!(
                "\nexperts:   top-{} of {} per layer, read once routed ({} per token uncached); expert cache {} ({}; --expert-cache, --expert-policy)",
                c.n_used,
                c.n_expert,
                human_bytes(exec.manifest().used_expert_bytes_per_token()),
                human_bytes(budget),
                loaded.options.expert_policy
            )
        });
    }
    extra.push('\n');
    extra.push_str(&model.memory_plan().summary());
    if let Some(layers) = &loaded.options.layers {
        extra.push_str(&format!(
            "\nlayers:    {layers} only ({} of {})",
            layers.count(cfg.n_layer),
            cfg.n_layer
        ));
    }
    format!(
        "model:     {}\nformat:    {}\narch:      {} ({} layers, width {}, {} heads / {} kv)\ntokenizer: {}\ntemplate:  {}\ncontext:   {} tokens\nresidency: {} ({} resident, {} streamed per token){extra}\nloaded in  {:.2} s",
        model.path().display(),
        exec.backend().name(),
        cfg.arch.name(),
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_head,
        cfg.n_kv_head,
        tokenizer,
        template,
        exec.context_size(),
        residency_name(loaded.options.residency),
        human_bytes(plan.resident_bytes),
        human_bytes(plan.streamed_bytes_per_token),
        loaded.load_time.as_secs_f64(),
    )
}

/// Peak resident set of this process so far.
pub fn peak_rss() -> u64 {
    flatrun_runtime::rss().peak
}

/// Print the profile summary / write the trace, as the flags ask.
pub fn finish_profile(model: &Model, flags: &EngineFlags) -> Result<()> {
    let profiler = model.profiler();
    if flags.profile || flags.profile_detailed {
        eprintln!("{}", profiler.summary().trim_end());
    }
    if flags.profile_detailed {
        eprintln!(
            "{}",
            crate::profile_table::layer_table(profiler, model.executor().layer_selection())
                .trim_end()
        );
    }
    if let Some(path) = &flags.profile_save {
        profiler
            .write_chrome_trace(path)
            .with_context(|| format!("cannot write the profile to {}", path.display()))?;
        eprintln!("profile written to {}", path.display());
    }
    Ok(())
}

//! Dump the teacher-forced logits of a token list as `[positions, vocab]` f32 `.npy`
//! (for comparing with other runtimes).
//!
//! ```sh
//! cargo run --release -p flatrun-examples --example dump_logits -- MODEL.gguf 1,2,3 out.npy [reference|native] [f16|f32]
//! ```

use flatrun_runtime::{LoadOptions, Model, StepOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, ids, out, rest @ ..] = args.as_slice() else {
        return Err("usage: dump_logits MODEL IDS OUT.npy [BACKEND] [KV_TYPE]".into());
    };
    let tokens: Vec<u32> = ids.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let backend = rest.first().map_or(Ok(Default::default()), |s| s.parse())?;
    let kv_type = rest.get(1).map_or(Ok(Default::default()), |s| s.parse())?;
    let mut model = Model::load(
        path,
        LoadOptions {
            backend,
            kv_type,
            ..LoadOptions::default()
        },
    )?;
    let vocab = model.executor().vocab_size();
    let mut session = model.session();
    let step = session.step_with(
        &tokens,
        StepOptions {
            all_logits: true,
            ..Default::default()
        },
    )?;
    let all = step.all_logits.unwrap_or_default();
    flatrun_runtime::write_f32_matrix(std::path::Path::new(out), &all, tokens.len(), vocab)?;
    Ok(())
}

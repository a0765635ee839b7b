//! `dspec serve`: loads a target and its drafter and serves them over an
//! OpenAI-compatible HTTP API (see the engine's `serve` module), speculation always on.

use std::io::IsTerminal;

use anyhow::{Context, Result};
use clap::Args;

use dspec_engine::decoding::drafting::load_drafter;
use dspec_engine::decoding::prompt_cache::PromptCache;
use dspec_engine::loading::load_model;
use dspec_engine::runtime::Backend;
use dspec_engine::serve::worker::Engine;
use dspec_engine::serve::{run as serve, ServerConfig};
use dspec_engine::EngineError;

use super::args::{parse_byte_size, DraftTuning, ModelArgs, PluginArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The drafter every request speculates with: `ngram` (prompt lookup), a DFlash or
    /// DSpark checkpoint (directory or cached hub id), or `model:DIR` (a smaller model
    /// with the target's tokenizer).
    #[arg(long)]
    drafter: String,
    #[command(flatten)]
    tuning: DraftTuning,
    /// Address to listen on; 0.0.0.0 serves other machines too (there is no
    /// authentication).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait while one is generated; more are answered 429.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    queue_size: u32,
    /// Tokens generated for a request that gives no `max_tokens` (fewer when the
    /// context has less room).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// The model id clients send and `/v1/models` lists (default: --target as given).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Larger request bodies are answered 413.
    #[arg(long, default_value_t = 4 << 20, value_parser = clap::value_parser!(u32).range(1024..))]
    max_body_bytes: u32,
    /// Memory for the target's caches of earlier requests, so that a prompt sharing a
    /// prefix with one (a chat's next turn) reads only the rest: bytes, or with a KB, MB
    /// or GB suffix; 0 turns the prompt cache off.
    #[arg(long, value_name = "SIZE", default_value = "2GB", value_parser = parse_byte_size)]
    prompt_cache_bytes: u64,
}

pub fn run(args: ServeArgs, plugins: &PluginArgs) -> Result<()> {
    // The other ranks would have to follow every request rank 0 takes (docs/distributed.md).
    if dspec_engine::loading::distributed::launch_environment()?.is_some_and(|l| l.size != Some(1))
    {
        anyhow::bail!(
            "dspec serve runs on one process, and MLX's distributed environment (MLX_RANK, ...) \
             is set: serving a target split across a group is not supported yet; start \
             `dspec serve` without mlx.launch, or use `dspec generate`/`bench` in the group"
        );
    }
    let backend = Backend::detect();
    let options = args.model.load_options(backend);
    let registry = plugins.registry()?;
    let max_tokens = args.max_tokens as usize;
    let max_draft = args.tuning.max_draft;
    let prompt_cache_bytes = usize::try_from(args.prompt_cache_bytes).unwrap_or(usize::MAX);
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_id: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.target.clone()),
        queue_size: args.queue_size as usize,
        max_body_bytes: args.max_body_bytes as usize,
    };
    let show_progress = std::io::stderr().is_terminal();
    // Runs on the model thread: the arrays it makes must stay there.
    let load = Box::new(move || -> Result<Engine, EngineError> {
        let loaded = load_model(&args.model.target, &registry, &options, show_progress)?;
        let drafter_options = args
            .tuning
            .options(loaded.model.info().dtype, max_tokens)
            .map_err(|e| EngineError::Invalid(format!("{e:#}")))?;
        let drafter = load_drafter(
            &args.drafter,
            &loaded,
            &registry,
            &options,
            &drafter_options,
        )
        .map_err(|e| EngineError::Invalid(format!("loading --drafter {}: {e}", args.drafter)))?;
        Ok(Engine {
            loaded,
            drafter,
            max_draft: max_draft.max,
            adaptive: max_draft.adaptive,
            default_max_tokens: max_tokens,
            prompt_cache: PromptCache::new(prompt_cache_bytes),
        })
    });
    serve(config, load).context("dspec serve")
}

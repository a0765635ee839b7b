//! `dspec serve`: loads a target and its drafter and serves them over an
//! OpenAI-compatible HTTP API (see the engine's `serve` module), speculation always on;
//! alone, or as one rank of an MLX distributed group, where rank 0 serves and the other
//! ranks follow its jobs (see the engine's `serve::group`).

use std::io::IsTerminal;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use dspec_engine::decoding::prompt_cache::PromptCache;
use dspec_engine::loading::distributed::Distributed;
use dspec_engine::loading::drafting::{drafts_with_a_model, load_drafter};
use dspec_engine::loading::{load_model, load_model_in_group};
use dspec_engine::runtime::Backend;
use dspec_engine::serve::group::{check_settings, follow as follow_jobs};
use dspec_engine::serve::worker::Engine;
use dspec_engine::serve::{run as serve, ServerConfig};
use dspec_engine::EngineError;
use dspec_plugin_api::AdapterRegistry;

use super::args::{parse_byte_size, DistributedArgs, DraftTuning, ModelArgs, PluginArgs};

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
    /// Address to listen on; 0.0.0.0 serves other machines too (then give --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Requests must carry `Authorization: Bearer KEY` (all but /health); without one,
    /// anyone who reaches the address may use the server.
    #[arg(
        long,
        env = "DSPEC_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    api_key: Option<String>,
    /// Seconds a client has to send a request's headers, and then its body; a slower
    /// one is cut off (1 to 3600).
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=3600))]
    read_timeout: u32,
    /// Connections open at once; more wait to be accepted until one closes (1 to 65536).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// Port to listen on, 0 to 65535; 0 picks a free one (the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests decoded together, 1 to 256 (default: 32 on a GPU, 16 on the CPU): each step
    /// is one forward over all of them, and requests join and leave between steps. Each
    /// request drafts for itself (DFlash and DSpark from the step's states of its own
    /// positions, a draft model (`model:DIR`) on a thread of its own over the same
    /// weights); how many drafts a step verifies follows the load. With a plugin's model
    /// family (as target or as draft model) or a distributed group, requests are served
    /// one at a time.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    max_batch: Option<u32>,
    /// Requests that may wait while the batch is full (1 to 4096); more are answered 429.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    queue_size: u32,
    /// Tokens generated for a request that gives no `max_tokens`, 1 to 2^32 − 1 (fewer
    /// when the context has less room).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// The model id clients send and `/v1/models` lists (default: --target as given).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Larger request bodies are answered 413 (1024 to 2^32 − 1 bytes).
    #[arg(long, default_value_t = 4 << 20, value_parser = clap::value_parser!(u32).range(1024..))]
    max_body_bytes: u32,
    /// Memory for the target's caches of earlier requests, so that a prompt sharing a
    /// prefix with one (a chat's next turn) reads only the rest: bytes, or with a KB, MB
    /// or GB suffix; 0 turns the prompt cache off.
    #[arg(long, value_name = "SIZE", default_value = "2GB", value_parser = parse_byte_size)]
    prompt_cache_bytes: u64,
    #[command(flatten)]
    distributed: DistributedArgs,
}

pub fn run(args: ServeArgs, plugins: &PluginArgs) -> Result<()> {
    dspec_engine::runtime::settings_for_a_long_lived_process();
    // First: joining starts MLX's backend, which must happen before any thread uses MLX.
    match args.distributed.join()? {
        None => serve_http(args, plugins, None),
        Some(group) => {
            let group = Arc::new(group);
            let served = match group.is_root() {
                true => serve_http(args, plugins, Some(group.clone())),
                false => follow(args, plugins, &group),
            };
            served.with_context(|| group.describe_failure())
        }
    }
}

/// Rank 0, or a server alone: loads on the model thread and serves HTTP. In a group, the
/// model thread sends the other ranks every job and, at the end, tells them to stop.
fn serve_http(
    args: ServeArgs,
    plugins: &PluginArgs,
    group: Option<Arc<Distributed>>,
) -> Result<()> {
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_id: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.target.clone()),
        queue_size: args.queue_size as usize,
        max_body_bytes: args.max_body_bytes as usize,
        api_key: args.api_key.clone(),
        read_timeout: std::time::Duration::from_secs(args.read_timeout.into()),
        max_connections: args.max_connections as usize,
    };
    if let Some(key) = &config.api_key {
        if key.trim().is_empty() || key.trim() != key {
            anyhow::bail!("--api-key (or DSPEC_API_KEY) is empty or has spaces around it; give the key itself");
        }
    } else if !is_loopback(&config.host) {
        eprintln!(
            "[dspec] warning: serving on {} without --api-key: anyone who can reach this address can use the model",
            config.host
        );
    }
    let registry = plugins.registry()?;
    let show_progress = std::io::stderr().is_terminal();
    // Runs on the model thread: the arrays it makes must stay there.
    let load = Box::new(move || -> Result<Engine, EngineError> {
        load_engine(args, &registry, group, show_progress)
            .map_err(|e| EngineError::Invalid(format!("{e:#}")))
    });
    serve(config, load).context("dspec serve")
}

/// Whether `host` only takes connections from this machine.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A rank other than 0: loads its share of the target and the drafter, then generates
/// every job rank 0 sends, in step with it, until rank 0 stops.
fn follow(args: ServeArgs, plugins: &PluginArgs, group: &Arc<Distributed>) -> Result<()> {
    let registry = plugins.registry()?;
    let mut engine = load_engine(args, &registry, Some(group.clone()), false)?;
    ignore_interrupts();
    eprintln!(
        "[dspec] {}: following rank 0, which serves HTTP",
        group.describe()
    );
    follow_jobs(&mut engine, group)?;
    // Every rank ends here only once all have stopped.
    group.finish()?;
    eprintln!("[dspec] {}: rank 0 stopped serving", group.describe());
    Ok(())
}

/// A follower leaves Ctrl-C to rank 0: in a terminal it reaches every rank `mlx.launch`
/// started there, and a follower that died of it would turn rank 0's graceful stop (which
/// stops the followers in turn) into an error about a lost rank. SIGTERM still ends a
/// follower at once, and rank 0 with it, naming it.
fn ignore_interrupts() {
    #[cfg(unix)]
    // SAFETY: sets the disposition of SIGINT to "ignore", which involves no handler code.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
}

/// `--max-batch` when not given: a GPU's step barely grows with a few dozen sequences;
/// a CPU's grows by about a third of a lone step per 8 more (SmolLM2-135M on 2 cores),
/// so past 16 a request waits longer for each token than the batch gains.
fn default_max_batch(backend: Backend) -> usize {
    match backend {
        Backend::Cpu => 16,
        _ => 32,
    }
}

/// The target (this rank's share of it in a group) and the drafter, every setting the
/// ranks must share checked once all have loaded.
fn load_engine(
    mut args: ServeArgs,
    registry: &AdapterRegistry,
    group: Option<Arc<Distributed>>,
    show_progress: bool,
) -> Result<Engine> {
    if group.is_some() {
        args.tuning.for_group()?;
    }
    let backend = Backend::detect();
    let mut options = args.model.load_options(backend);
    // Long-lived: the kernels' one-off compile is paid once for every request.
    options.verify_kernels = true;
    options.verifies_waited_on = drafts_with_a_model(&args.drafter)?;
    let max_tokens = args.max_tokens as usize;
    let loaded = match group.as_deref() {
        None => load_model(&args.model.target, registry, &options, show_progress)?,
        Some(g) => load_model_in_group(
            &args.model.target,
            registry,
            &options,
            g.group(),
            show_progress,
        )?,
    };
    let drafter_options = args.tuning.options(loaded.model.info().dtype, max_tokens)?;
    let drafter = load_drafter(&args.drafter, &loaded, registry, &options, &drafter_options)
        .with_context(|| format!("loading --drafter {}", args.drafter))?;
    let engine = Engine {
        loaded,
        drafter,
        max_draft: args.tuning.max_draft.max,
        adaptive: args.tuning.max_draft.adaptive,
        verify_ahead: args.tuning.verify_ahead(),
        default_max_tokens: max_tokens,
        prompt_cache: PromptCache::new(
            usize::try_from(args.prompt_cache_bytes).unwrap_or(usize::MAX),
        ),
        group,
        max_batch: args
            .max_batch
            .map_or(default_max_batch(backend), |n| n as usize),
    };
    if let Some(g) = engine.group.as_deref() {
        // Loaded before the ranks meet: loading takes each rank its own time.
        g.rendezvous()?;
        check_settings(g, &engine)?;
    }
    Ok(engine)
}

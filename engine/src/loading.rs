//! Loads a target: resolve the directory, pick the adapter from the registry, load
//! the weights (with a progress bar on a terminal) and the tokenizer.

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

use dspec_plugin_api::{AdapterRegistry, LoadOptions, LoadRequest, TargetModel};

use crate::error::EngineError;
use crate::model_source::resolve_model_dir;
use crate::tokenizer::TextTokenizer;

pub struct LoadedModel {
    pub model: Box<dyn TargetModel>,
    pub tokenizer: TextTokenizer,
    pub dir: PathBuf,
    /// Adapter name and why it was chosen.
    pub adapter: String,
    pub reason: String,
}

/// The registry of every built-in family.
pub fn builtin_registry() -> Result<AdapterRegistry, EngineError> {
    dspec_adapters::link();
    Ok(AdapterRegistry::builtin()?)
}

/// Loads model and tokenizer from `arg` (a directory or a cached hub id).
pub fn load_model(
    arg: &str,
    registry: &AdapterRegistry,
    options: &LoadOptions,
    show_progress: bool,
) -> Result<LoadedModel, EngineError> {
    let dir = resolve_model_dir(arg)?;
    let found = registry.detect(&dir)?;
    // The tokenizer first: a missing tokenizer.json should not cost a weight load.
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let bar = if show_progress {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(found.adapter.name.clone());
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let req = LoadRequest {
        dir: &dir,
        config: &found.config,
        options,
        progress: &progress,
    };
    let model = (found.adapter.load)(&req)?;
    bar.finish_and_clear();
    Ok(LoadedModel {
        model,
        tokenizer,
        dir: dir.clone(),
        adapter: found.adapter.name.clone(),
        reason: found.reason,
    })
}

//! Loads a target: resolve the directory, pick the adapter from the registry, load
//! the weights (with a progress bar on a terminal) and the tokenizer; optionally with
//! a LoRA adapter attached. `model_source` resolves a `--target` (`hub` downloads hub
//! models into the cache); `plugins` adds plugin families to the registry the loader
//! picks from; `distributed` joins an MLX group, whose ranks each load their share of a
//! target with [`load_model_in_group`]; `drafting` loads the drafter that fits a target.

pub mod distributed;
pub mod drafting;
pub mod hub;
pub mod model_source;
pub mod plugins;

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use dspec_adapters::lora::{load_adapted, LoraAdapter, LoraMode, LoraSwitch};
use dspec_plugin_api::registry::AdapterEntry;
use dspec_plugin_api::{
    AdapterRegistry, AdapterSource, LoadOptions, LoadRequest, ModelError, TargetModel,
};

use crate::error::EngineError;
use crate::loading::model_source::resolve_model_dir;
use crate::text::tokenizer::TextTokenizer;

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
    load_with(arg, registry, options, show_progress, |entry, req| {
        Ok((entry.load)(req)?)
    })
}

/// Loads model and tokenizer as [`load_model`] does, but only this rank's share of the
/// target's decoder layers (tensor parallelism over `group`; see
/// `dspec_adapters::tensor_parallel`). Built-in decoder families only: a plugin's model
/// or a hybrid family is refused with what to do instead.
pub fn load_model_in_group(
    arg: &str,
    registry: &AdapterRegistry,
    options: &LoadOptions,
    group: &dspec_runtime::distributed::Group,
    show_progress: bool,
) -> Result<LoadedModel, EngineError> {
    let tp = dspec_adapters::tensor_parallel::TensorParallel::new(group.clone());
    load_with(arg, registry, options, show_progress, |entry, req| {
        if let AdapterSource::Plugin { path, .. } = &entry.source {
            return Err(ModelError::Unsupported(format!(
                "`{}` models come from the plugin {}, and only built-in families split across a \
                 distributed group; run this model on one process",
                entry.name,
                path.display()
            ))
            .into());
        }
        Ok(dspec_adapters::tensor_parallel::load(
            req,
            &entry.name,
            &tp,
        )?)
    })
}

/// A LoRA adapter loaded with its target.
pub struct LoadedLora {
    pub dir: PathBuf,
    /// Format, module count, ranks and scales, for people.
    pub summary: String,
    /// Turns the adapter on and off; `None` when it was fused into the weights.
    pub switch: Option<LoraSwitch>,
    /// Things worth telling the user that do not stop the load (base model name).
    pub warnings: Vec<String>,
}

/// Loads model and tokenizer as [`load_model`] does, with the LoRA adapter in
/// `lora_dir` attached to its linear layers (`mode`: switchable or fused). Only
/// built-in families take adapters; a plugin's model is refused.
pub fn load_model_with_lora(
    arg: &str,
    registry: &AdapterRegistry,
    options: &LoadOptions,
    lora_dir: &Path,
    mode: LoraMode,
    show_progress: bool,
) -> Result<(LoadedModel, LoadedLora), EngineError> {
    // The adapter first: a broken adapter should not cost a weight load.
    let adapter = LoraAdapter::open(lora_dir)?;
    let mut switch = None;
    let mut warnings = Vec::new();
    let loaded = load_with(arg, registry, options, show_progress, |entry, req| {
        if let AdapterSource::Plugin { path, .. } = &entry.source {
            return Err(ModelError::Unsupported(format!(
                "--lora: `{}` models come from the plugin {}, and LoRA adapters apply to built-in families only; drop --lora or use a built-in family",
                entry.name,
                path.display()
            ))
            .into());
        }
        warnings.extend(adapter.base_model_warning(req.dir, req.config));
        let adapted = load_adapted(req, &entry.name, &adapter, mode)?;
        switch = adapted.switch;
        Ok(adapted.model)
    })?;
    let lora = LoadedLora {
        dir: lora_dir.to_path_buf(),
        summary: adapter.summary(),
        switch,
        warnings,
    };
    Ok((loaded, lora))
}

/// Resolves `arg`, detects its adapter, loads the tokenizer, then builds the model with
/// `build` under a progress bar.
fn load_with(
    arg: &str,
    registry: &AdapterRegistry,
    options: &LoadOptions,
    show_progress: bool,
    build: impl FnOnce(&AdapterEntry, &LoadRequest) -> Result<Box<dyn TargetModel>, EngineError>,
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
    let model = build(found.adapter, &req)?;
    bar.finish_and_clear();
    Ok(LoadedModel {
        model,
        tokenizer,
        dir: dir.clone(),
        adapter: found.adapter.name.clone(),
        reason: found.reason,
    })
}

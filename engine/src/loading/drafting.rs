//! Turns `--drafter` into a loaded drafter that fits the target:
//!
//! - a kind chosen by name alone (`ngram`);
//! - `model:DIR` (a directory or cached hub id): that model drafts for the target;
//! - `replay:FILE`: an earlier `dspec generate --json` answer, drafted back (see
//!   [`dspec_drafters::replay`]);
//! - a checkpoint directory or cached hub id: its config.json says its kind
//!   (`dflash`, `dspark`, …); a plain model checkpoint becomes a draft model.
//!
//! Every drafter is loaded against the target's `ModelInfo`, so a mismatch is an
//! error before decoding starts; a draft model must also share the target's tokenizer.

use std::path::Path;

use dspec_plugin_api::{
    detect_drafter_kind, drafter_kind_by_name, drafter_kinds, AdapterRegistry, Drafter,
    DrafterLoadRequest, DrafterOptions, DrafterRegistration, LoadOptions, LoadRequest, ModelError,
    TargetModel,
};

use dspec_drafters::replay::ReplayDrafter;
use dspec_plugin_api::registry::read_json;

use crate::error::EngineError;
use crate::loading::model_source::resolve_model_dir;
use crate::loading::LoadedModel;
use crate::text::tokenizer::TextTokenizer;

/// Every drafter kind compiled in: (kind, summary).
pub fn available_drafters() -> Result<Vec<(&'static str, &'static str)>, EngineError> {
    dspec_drafters::link();
    Ok(drafter_kinds()?
        .into_iter()
        .map(|k| (k.kind, k.summary))
        .collect())
}

fn kind_list() -> String {
    available_drafters()
        .map(|kinds| kinds.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", "))
        .unwrap_or_default()
}

/// Whether the drafter `spec` names runs a model (a checkpoint: DFlash, DSpark, a draft
/// model), as opposed to a lookup in the tokens (`ngram`, `replay:FILE`): its rounds then
/// wait on every verify, since the next drafts come from the verify's answer. Known before
/// the target loads, so that the target can load for it (`LoadOptions::verifies_waited_on`).
pub fn drafts_with_a_model(spec: &str) -> Result<bool, EngineError> {
    dspec_drafters::link();
    Ok(drafter_kind_by_name(spec)?.is_none() && !spec.starts_with("replay:"))
}

/// Loads the drafter `spec` names for `target`. `target_options` are the target's
/// load options (the draft model takes its dtype; `--drafter-bits` its quantization).
pub fn load_drafter(
    spec: &str,
    target: &LoadedModel,
    registry: &AdapterRegistry,
    target_options: &LoadOptions,
    options: &DrafterOptions,
) -> Result<Box<dyn Drafter>, EngineError> {
    dspec_drafters::link();
    let options = &DrafterOptions {
        kernels: target_options.verify_kernels,
        ..options.clone()
    };
    // Validated here for every kind, so `--drafter-bits 3 --drafter ngram` is refused
    // too; a draft model is full precision unless asked.
    let draft_model_options = LoadOptions {
        dtype: target_options.dtype.or(Some(target.model.info().dtype)),
        quantize: options.quantization(0).map_err(EngineError::Invalid)?,
        rowwise_verify: target_options.rowwise_verify,
        // The draft model's catch-up forwards of a few tokens take the same kernels.
        verify_kernels: target_options.verify_kernels,
        verifies_waited_on: false,
    };
    let load_model = |dir: &Path| -> Result<Box<dyn TargetModel>, ModelError> {
        let found = registry.detect(dir)?;
        (found.adapter.load)(&LoadRequest {
            dir,
            config: &found.config,
            options: &draft_model_options,
            progress: &|_, _| {},
        })
    };
    let run = |kind: &DrafterRegistration, dir: Option<&Path>, config: &serde_json::Value| {
        let request = DrafterLoadRequest {
            dir,
            config,
            target: target.model.info(),
            options,
            load_model: &load_model,
        };
        (kind.load)(&request).map_err(EngineError::from)
    };

    if let Some(kind) = drafter_kind_by_name(spec)? {
        return run(kind, None, &serde_json::Value::Null);
    }
    if let Some(file) = spec.strip_prefix("replay:") {
        let vocab = target.model.info().vocab_size;
        return Ok(Box::new(ReplayDrafter::from_file(Path::new(file), vocab)?));
    }
    let (model_only, location) = match spec.strip_prefix("model:") {
        Some(rest) => (true, rest),
        None => (false, spec),
    };
    let dir = resolve_model_dir(location).map_err(|e| {
        EngineError::Invalid(format!(
            "--drafter `{spec}`: not a drafter kind ({}) and not a usable checkpoint: {e}",
            kind_list()
        ))
    })?;
    let config_path = dir.join("config.json");
    let config = read_json(&config_path)?;
    if !model_only {
        if let Some(kind) = detect_drafter_kind(&config)? {
            return run(kind, Some(&dir), &config);
        }
    }
    // A plain model: it drafts for the target when an adapter loads it.
    if let Err(e) = registry.detect(&dir) {
        return Err(EngineError::Invalid(format!(
            "--drafter {}: its config.json is not a drafter checkpoint of any known kind ({}) nor a model an adapter loads ({e})",
            dir.display(),
            kind_list()
        )));
    }
    check_same_tokenizer(&dir, &target.tokenizer)?;
    let kind = drafter_kinds()?
        .into_iter()
        .find(|k| k.kind == "draft-model")
        .ok_or_else(|| EngineError::Invalid("the draft-model drafter is not compiled in".into()))?;
    run(kind, Some(&dir), &config)
}

/// A draft model's tokens mean nothing to the target unless both tokenizers map every
/// token to the same id.
fn check_same_tokenizer(dir: &Path, target: &TextTokenizer) -> Result<(), EngineError> {
    let draft = TextTokenizer::from_dir(dir)?;
    let (a, b) = (
        target.inner().get_vocab(true),
        draft.inner().get_vocab(true),
    );
    let differs = |what: String| {
        EngineError::Invalid(format!(
            "--drafter {}: its tokenizer differs from the target's ({what}); a draft model must share the target's tokenizer — pick one of the same family and version",
            dir.display()
        ))
    };
    if a.len() != b.len() {
        return Err(differs(format!(
            "{} tokens vs the target's {}",
            b.len(),
            a.len()
        )));
    }
    if let Some((token, id)) = a.iter().find(|(t, id)| b.get(*t) != Some(id)) {
        return Err(differs(format!(
            "token {token:?} is id {id} in the target but {:?} in the draft model",
            b.get(token)
        )));
    }
    Ok(())
}

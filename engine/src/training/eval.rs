//! A drafter's acceptance measured the way users meet it: the checkpoint as written,
//! loaded by the drafter registry, drafting for the target in real greedy speculative
//! decoding. Token accuracy alone can look good while a train/inference mismatch keeps
//! every draft from being accepted.

use std::path::Path;

use dspec_plugin_api::{DrafterOptions, LoadOptions};
use serde::Serialize;

use crate::decoding::drafting::load_drafter;
use crate::decoding::generate::GenerationConfig;
use crate::decoding::sampling::SamplingParams;
use crate::decoding::speculative::{generate_speculative, ServingOptions, Speculation};
use crate::decoding::verify_ahead::VerifyAheadMode;
use crate::error::EngineError;
use crate::loading::{builtin_registry, LoadedModel};

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Acceptance {
    /// Tokens committed per verify forward, over all prompts.
    pub tau: f64,
    pub prompts: usize,
    pub generated_tokens: usize,
    pub verify_forwards: usize,
}

/// τ of the drafter in `dir` over `prompts` (token ids), `max_tokens` each, drafting
/// up to `max_draft` per round, at full precision (as trained; a DSpark drafter is
/// quantized by default where it runs elsewhere, `--drafter-bits` says).
pub fn acceptance(
    loaded: &LoadedModel,
    dir: &Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    max_draft: usize,
) -> Result<Acceptance, EngineError> {
    let registry = builtin_registry()?;
    let spec = dir.to_string_lossy();
    let mut drafter = load_drafter(
        &spec,
        loaded,
        &registry,
        &LoadOptions::default(),
        &DrafterOptions {
            bits: Some(0),
            ..DrafterOptions::default()
        },
    )?;
    let config = GenerationConfig {
        max_tokens,
        sampling: SamplingParams::default(),
        stop_strings: Vec::new(),
        eos_ids: loaded.tokenizer.eos_token_ids().to_vec(),
    };
    let (mut committed, mut forwards, mut generated) = (0, 0, 0);
    for prompt in prompts {
        let out = generate_speculative(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            prompt,
            &config,
            Speculation {
                drafter: drafter.as_mut(),
                max_draft,
                adaptive: false,
                trace: None,
                verify_ahead: VerifyAheadMode::Off,
            },
            &mut |_| {},
            ServingOptions::default(),
        )?;
        let s = &out.speculative;
        committed += s.accepted_tokens + s.target_forwards;
        forwards += s.target_forwards;
        generated += out.tokens.len();
    }
    Ok(Acceptance {
        tau: committed as f64 / forwards.max(1) as f64,
        prompts: prompts.len(),
        generated_tokens: generated,
        verify_forwards: forwards,
    })
}

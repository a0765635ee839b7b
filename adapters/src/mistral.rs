//! Mistral: the llama layout plus an optional sliding attention window on every layer.

use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::Result;

use crate::config::parse_config;
use crate::llama::llama_spec;
use crate::transformer::DecoderSpec;

#[derive(Debug, Deserialize)]
struct MistralWindow {
    sliding_window: Option<i32>,
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let window: MistralWindow = parse_config(config, dir)?;
    llama_spec(config, dir, "mistral", window.sliding_window)
}

crate::decoder_family! {
    name: "mistral",
    model_types: ["mistral"],
    aliases: ["ministral"],
    architectures: ["MistralForCausalLM"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use crate::fixtures::{check_family, with, TINY_LLAMA};

    #[test]
    fn tiny_mistral_with_a_window_shorter_than_the_probe_conforms() {
        check_family(&with(
            TINY_LLAMA,
            r#"{"model_type": "mistral", "sliding_window": 4}"#,
        ));
    }
}

//! dspec as a library: load a model directory and generate greedily, streaming.
//! `cargo run --release -p dspec-examples --example generate -- MODEL_DIR "prompt"`

use std::io::Write;

use dspec_engine::decoding::generate::{generate, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::loading::{builtin_registry, load_model};
use dspec_engine::runtime::Backend;
use dspec_plugin_api::LoadOptions;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: generate MODEL_DIR [PROMPT]"))?;
    let prompt = args.next().unwrap_or_else(|| "Once upon a time".into());

    let options = LoadOptions {
        dtype: Backend::detect().auto_dtype(),
        quantize: None,
        rowwise_verify: false,
        verify_kernels: false,
        verifies_waited_on: false,
    };
    let loaded = load_model(&dir, &builtin_registry()?, &options, false)?;
    let ids = loaded.tokenizer.encode_prompt(&prompt, false)?;
    let config = GenerationConfig {
        max_tokens: 32,
        sampling: SamplingParams::default(),
        stop_strings: vec![],
        eos_ids: loaded.tokenizer.eos_token_ids().to_vec(),
    };
    let out = generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &ids,
        &config,
        &mut |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        },
    )?;
    println!(
        "\n{} tokens at {:.1} tok/s",
        out.stats.generated_tokens, out.stats.decode_tokens_per_second
    );
    Ok(())
}

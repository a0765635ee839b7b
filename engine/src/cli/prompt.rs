//! The prompt as token ids, shared by the subcommands that generate; the encoding itself
//! is the engine's ([`dspec_engine::text::prompt`]), which `train-drafter` shares too.

use anyhow::Result;

use dspec_engine::text::tokenizer::TextTokenizer;

/// The prompt as the model expects it: through its chat template (when it has one and
/// `use_template`), else as raw text.
pub fn encode_prompt(
    tokenizer: &TextTokenizer,
    text: &str,
    system: Option<&str>,
    use_template: bool,
    enable_thinking: Option<bool>,
) -> Result<Vec<u32>> {
    Ok(dspec_engine::text::prompt::encode_prompt(
        tokenizer,
        text,
        system,
        use_template,
        enable_thinking,
    )?)
}

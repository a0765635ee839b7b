//! The prompt as token ids, shared by the subcommands that generate.

use anyhow::Result;

use dspec_engine::text::chat_template::{ChatMessage, ChatTemplate};
use dspec_engine::text::tokenizer::TextTokenizer;

/// The prompt as the model expects it: through its chat template (when it has one
/// and `use_template`), else as raw text.
pub fn encode_prompt(
    tokenizer: &TextTokenizer,
    text: &str,
    system: Option<&str>,
    use_template: bool,
    enable_thinking: Option<bool>,
) -> Result<Vec<u32>> {
    let Some(source) = tokenizer.chat_template().filter(|_| use_template) else {
        return Ok(tokenizer.encode_prompt(text, false)?);
    };
    let template = ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token())?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", text));
    let mut extra = serde_json::Map::new();
    if let Some(thinking) = enable_thinking {
        extra.insert("enable_thinking".into(), thinking.into());
    }
    let rendered = template.render(&messages, true, &extra)?;
    Ok(tokenizer.encode_prompt(&rendered, true)?)
}

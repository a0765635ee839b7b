//! A prompt as the token ids a model reads: a user text or a conversation through the
//! model's chat template, ready for the assistant's answer, or raw text without one.

use crate::error::EngineError;
use crate::text::chat_template::{ChatMessage, ChatTemplate};
use crate::text::tokenizer::TextTokenizer;

/// Encodes prompts for one tokenizer, its chat template compiled once for all of them.
pub struct PromptEncoder<'a> {
    tokenizer: &'a TextTokenizer,
    /// `None` when the tokenizer has no template or templates are off: prompts go raw.
    template: Option<ChatTemplate>,
    extra: serde_json::Map<String, serde_json::Value>,
}

impl<'a> PromptEncoder<'a> {
    /// `use_template` false feeds every prompt as raw text; `enable_thinking` is passed
    /// to templates that read it (Qwen3's thinking switch).
    pub fn new(
        tokenizer: &'a TextTokenizer,
        use_template: bool,
        enable_thinking: Option<bool>,
    ) -> Result<Self, EngineError> {
        let template = match tokenizer.chat_template().filter(|_| use_template) {
            Some(source) => Some(ChatTemplate::new(
                source,
                tokenizer.bos_token(),
                tokenizer.eos_token(),
            )?),
            None => None,
        };
        let mut extra = serde_json::Map::new();
        if let Some(thinking) = enable_thinking {
            extra.insert("enable_thinking".into(), thinking.into());
        }
        Ok(Self {
            tokenizer,
            template,
            extra,
        })
    }

    /// Whether prompts go through a chat template (conversations need one).
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// `text` as the user's turn, after `system` when given, through the template; raw
    /// text (and no system message) without one, as `dspec generate --no-chat-template`.
    pub fn encode_user(&self, text: &str, system: Option<&str>) -> Result<Vec<u32>, EngineError> {
        if self.template.is_none() {
            return Ok(self.tokenizer.encode_prompt(text, false)?);
        }
        let mut messages = Vec::new();
        if let Some(system) = system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", text));
        self.encode_conversation(&messages)
    }

    /// A conversation through the template, followed by the generation prompt, so that
    /// what the model writes next is the assistant's turn.
    pub fn encode_conversation(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        let Some(template) = &self.template else {
            return Err(EngineError::Invalid(
                "a conversation needs the model's chat template, and none is in use".into(),
            ));
        };
        let rendered = template.render(messages, true, &self.extra)?;
        Ok(self.tokenizer.encode_prompt(&rendered, true)?)
    }
}

/// One prompt as the model expects it: through its chat template (when it has one and
/// `use_template`), else as raw text.
pub fn encode_prompt(
    tokenizer: &TextTokenizer,
    text: &str,
    system: Option<&str>,
    use_template: bool,
    enable_thinking: Option<bool>,
) -> Result<Vec<u32>, EngineError> {
    PromptEncoder::new(tokenizer, use_template, enable_thinking)?.encode_user(text, system)
}

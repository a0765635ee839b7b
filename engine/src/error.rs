//! The engine's error type: every failure a user can cause, with what to do about it.

use dspec_plugin_api::ModelError;

use crate::loading::model_source::SourceError;
use crate::text::chat_template::ChatTemplateError;
use crate::text::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("MLX error: {0}")]
    Mlx(String),
    #[error("the prompt is empty after tokenization; give a non-empty --prompt")]
    EmptyPrompt,
    #[error(
        "the prompt has token id {id}, past the model's {rows} embedding rows (config.json's vocab_size): its tokenizer.json knows more tokens than the model has; use the tokenizer that came with the checkpoint"
    )]
    TokenPastVocabulary { id: u32, rows: usize },
    #[error(
        "the prompt has {prompt} tokens but the model's context is {limit}; shorten the prompt"
    )]
    PromptTooLong { prompt: usize, limit: usize },
    #[error(
        "the model's logits at position {position} ({what}) are not finite numbers: its \
         weights may be corrupt (re-download or re-convert them), a config.json value may be \
         wrong for this checkpoint, or its activations overflow the dtype (try --dtype f32)"
    )]
    NonFiniteLogits { position: usize, what: &'static str },
    #[error("{0}")]
    Invalid(String),
}

impl From<mlx_rs::error::Exception> for EngineError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        EngineError::Mlx(e.to_string())
    }
}

//! Text in and out of a model: tokenizer and chat template turn a prompt into token ids;
//! the streaming detokenizer, stop strings and tool-call parser turn ids back into text.

pub mod chat_template;
pub mod detokenize;
pub mod prompt;
pub mod stop;
pub mod tokenizer;
pub mod tool_calls;

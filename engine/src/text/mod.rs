//! Text in and out of a model: the tokenizer and chat template that turn a prompt into
//! token ids, and the streaming detokenizer and stop strings that turn ids back into text.

pub mod chat_template;
pub mod detokenize;
pub mod stop;
pub mod tokenizer;

//! Model files in other formats than a Hugging Face directory: reading GGUF, and
//! `dspec convert`'s GGUF → safetensors directory. Nothing at generation time uses them.

pub mod convert;
pub mod gguf;

//! Errors of model loading and execution, carrying what a user needs to fix them
//! (the file, the tensor, the model_type).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{path}: not a valid safetensors file ({reason}); re-download or re-convert the model"
    )]
    CorruptWeights { path: PathBuf, reason: String },

    #[error("tensor `{name}` is missing from the weights in {dir} (expected shape {expected:?}); the checkpoint does not match its config.json")]
    MissingTensor {
        name: String,
        dir: PathBuf,
        expected: Vec<i32>,
    },

    #[error(
        "tensor `{name}` in {file} has shape {actual:?}, but config.json implies {expected:?}"
    )]
    ShapeMismatch {
        name: String,
        file: PathBuf,
        expected: Vec<i32>,
        actual: Vec<i32>,
    },

    #[error("tensor `{name}` in {file} has dtype {dtype}, which dspec cannot load as {wanted}")]
    UnsupportedDtype {
        name: String,
        file: PathBuf,
        dtype: String,
        wanted: String,
    },

    #[error("{0}")]
    Unsupported(String),

    #[error(
        "cannot roll the cache back {asked} positions: it holds {held} and can go back at most \
         {limit} (layers with recurrent state keep their states for a bounded window of recent \
         positions); trim no more than that, or start a new cache and run the sequence again"
    )]
    CannotRollBack {
        asked: usize,
        held: usize,
        limit: usize,
    },

    #[error(
        "no adapter for model_type `{model_type}` (from {path}).\nRegistered model types: {registered}.\n\
         To add one, write a family file in adapters/src/ (copy the closest one) or load a plugin with --plugin."
    )]
    UnknownModelType {
        model_type: String,
        path: PathBuf,
        registered: String,
    },

    #[error("model_type `{key}` is registered twice: by {first} and by {second}")]
    DuplicateRegistration {
        key: String,
        first: String,
        second: String,
    },

    #[error("plugin {path}: {message}")]
    Plugin { path: PathBuf, message: String },

    #[error("drafter {path} does not fit the target: {message}")]
    DrafterMismatch { path: PathBuf, message: String },

    #[error("MLX error: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),

    #[error("MLX I/O error on {path}: {message}")]
    MlxIo { path: PathBuf, message: String },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ModelError::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}

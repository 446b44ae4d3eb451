//! What can go wrong loading a model or scoring a pair.

use std::path::PathBuf;

/// An error from loading a model directory, embedding, or the scorer's queue.
#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    /// A file the model directory needs is not there.
    #[error("{}: missing (a sentence-transformers directory needs config.json, tokenizer.json, model.safetensors and modules.json)", .0.display())]
    MissingFile(PathBuf),
    /// A file is there but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// A configuration file is malformed, or describes something this crate does not run.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The tokenizer failed to load or to encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The weights do not fit the configuration (a missing tensor, a wrong shape), or the
    /// forward pass failed.
    #[error("model: {0}")]
    Model(String),
    /// A text to embed is empty or only whitespace: it has no meaning to compare.
    #[error("{0} is empty")]
    EmptyText(String),
    /// The scorer's queue is full; the pair was not scored.
    #[error("topic scorer is busy: its queue is full")]
    Busy,
    /// The scorer's worker is gone; nothing more will be scored.
    #[error("topic scorer is closed")]
    Closed,
}

impl From<candle_core::Error> for TopicError {
    fn from(error: candle_core::Error) -> Self {
        TopicError::Model(error.to_string())
    }
}

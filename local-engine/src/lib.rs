//! canarygate-engine: the bundled local prefill/decode engine.
//!
//! A Llama / Mistral / Qwen2 model on candle with a paged KV pool that cannot leak one
//! request's KV into another's attention:
//!
//! - the advertised context window never exceeds what the KV pool holds ([`Capacity`]);
//! - admission is typed: a rejected request gets an [`AdmissionError`] and allocates nothing;
//! - every KV page records its owner and written positions, and attention reads only positions
//!   its own request wrote ([`kv`]);
//! - prefill hands decode a [`transfer::Manifest`] that decode verifies before decoding.
//!
//! ```no_run
//! use canarygate_engine::{Engine, EngineConfig, Event, GenerationRequest};
//!
//! let engine = Engine::start(EngineConfig::new("/models/tiny"))?;
//! let prompt = engine.encode("Hello")?;
//! for event in engine.submit(GenerationRequest::greedy(prompt, 16))? {
//!     if let Event::Token { text, .. } = event {
//!         print!("{text}");
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod config;
mod cpu_matmul;
mod detokenize;
mod engine;
pub mod kv;
mod model;
pub mod openai;
mod prompt;

mod sampling;
mod server;
mod text;
mod tiny;
pub mod transfer;

pub use engine::{
    Capacity, Completion, DeviceKind, Engine, EngineConfig, EngineHandle, Event, FinishReason,
    Generation, GenerationRequest, Precision, Stats, Usage,
};
pub use sampling::{InvalidSampling, SamplingParams};
pub use server::serve;
pub use text::{ChatMessage, ChatTemplate};
pub use tiny::{TinyModel, TinyTokenizer, write_tiny_model};

/// Why a request was not admitted. Nothing was allocated or queued for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// Prompt plus `max_tokens` exceeds the context window the engine serves.
    #[error(
        "this engine's maximum context length is {limit} tokens, but {requested} tokens were \
         requested ({prompt_tokens} in the prompt, {} to generate)",
        requested - prompt_tokens
    )]
    ContextLengthExceeded {
        /// Prompt plus completion tokens asked for.
        requested: usize,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Tokens that fit.
        limit: usize,
    },
    /// The request is malformed (empty prompt, unknown token id, bad sampling values).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    Unavailable,
}

/// Errors of the engine and of individual generations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The model directory or its weights are unusable.
    #[error("model: {0}")]
    Model(String),
    /// Engine settings are inconsistent.
    #[error("configuration: {0}")]
    Config(String),
    /// Tokenizer failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Chat template failure.
    #[error("chat template: {0}")]
    Template(String),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(String),
    /// A KV page would have been read or written by a request that does not own it.
    #[error("KV provenance violated: {0}")]
    Provenance(#[from] kv::ProvenanceError),
    /// Decode refused prefill's manifest.
    #[error("prefill/decode transfer refused: {0}")]
    Transfer(#[from] transfer::TransferError),
    /// The engine stopped before the request finished.
    #[error("the engine shut down")]
    ShutDown,
    /// The caller gave up waiting ([`Generation::wait_unless`]).
    #[error("the caller went away")]
    Abandoned,
    /// A bug: an invariant the engine maintains did not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        Self::Tensor(e.to_string())
    }
}

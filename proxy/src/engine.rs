//! The bundled local engine inside the proxy: started from `[local]`, held
//! for the local path ([`crate::paths::local`]).

use std::sync::Arc;

use canarygate_engine::{Engine, EngineConfig, EngineError, EngineHandle};
use canarygate_policies::local_config::LocalConfig;

/// The engine `[local]` describes could not start.
#[derive(Debug, thiserror::Error)]
#[error("[local] engine with model {model_dir}: {source}")]
pub struct LocalEngineError {
    /// `[local] model_dir`.
    pub model_dir: String,
    /// Why it did not start.
    #[source]
    pub source: EngineError,
}

/// The running engine and what `serve` reports about it.
pub struct LocalEngine {
    handle: Arc<EngineHandle>,
}

impl LocalEngine {
    /// Starts the engine `[local]` describes; `Ok(None)` when no model is
    /// configured. Blocking: it loads the weights.
    pub fn start(config: &LocalConfig) -> Result<Option<Self>, LocalEngineError> {
        let Some(model_dir) = config.model_dir() else {
            return Ok(None);
        };
        let mut engine = EngineConfig::new(model_dir);
        engine.kv_budget_bytes =
            usize::try_from(config.kv_budget_mib.get_ref().saturating_mul(1 << 20))
                .unwrap_or(usize::MAX);
        engine.kv_margin = *config.kv_margin.get_ref();
        engine.max_context = config
            .max_context_tokens
            .map(|tokens| usize::try_from(tokens).unwrap_or(usize::MAX));
        engine.max_batch = *config.max_batch.get_ref();
        let handle = Engine::start(engine).map_err(|source| LocalEngineError {
            model_dir: model_dir.to_owned(),
            source,
        })?;
        Ok(Some(Self {
            handle: Arc::new(handle),
        }))
    }

    /// The context window the engine serves, in tokens of its own tokenizer.
    pub fn context_window(&self) -> usize {
        self.handle.context_window()
    }

    /// KV pool capacity, in tokens.
    pub fn pool_tokens(&self) -> usize {
        self.handle.capacity().pool_tokens
    }

    /// The engine, for generating.
    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }
}

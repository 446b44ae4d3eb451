//! `[local]` (the bundled local engine and when requests go to it) and
//! `[probe]` (scheduled context probing).

use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

/// Model name reported in locally served answers when neither the route's
/// `local_model` nor `[local] model_name` is set.
pub const DEFAULT_LOCAL_MODEL_NAME: &str = "canarygate-local";

/// What happens to a request whose prompt plus `max_tokens` exceeds the
/// provider's trusted context limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UntrustedContext {
    /// Serve it from the local engine; nothing is sent upstream.
    Local,
    /// Answer HTTP 400 `context_length_exceeded`; nothing is sent upstream.
    Reject,
}

/// `[local]`: the bundled engine, started in-process by `serve`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalConfig {
    /// Hugging Face model directory (config.json, *.safetensors,
    /// tokenizer.json). Unset: no local engine, and nothing can fall back.
    pub model_dir: Option<Spanned<String>>,
    /// `model` reported in locally served answers (a route's `local_model`
    /// overrides it).
    pub model_name: String,
    /// Memory for the engine's KV pool, in MiB.
    pub kv_budget_mib: Spanned<u64>,
    /// The KV pool must hold this many times the context window the engine
    /// serves (>= 1.0).
    pub kv_margin: Spanned<f64>,
    /// Serve at most this context window (tokens), below the model's own.
    pub max_context_tokens: Option<u64>,
    /// Most requests decoded in one batch.
    pub max_batch: Spanned<usize>,
    /// Requests over the trusted context limit: `"local"` or `"reject"`.
    /// Default: `"local"` when `model_dir` is set, else `"reject"`.
    pub on_untrusted_context: Option<Spanned<UntrustedContext>>,
    /// Serve from the local engine when the provider cannot be reached,
    /// answers 5xx, or times out before its first byte.
    pub on_upstream_unavailable: Spanned<bool>,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            model_dir: None,
            model_name: DEFAULT_LOCAL_MODEL_NAME.to_owned(),
            kv_budget_mib: Spanned::new(0..0, 512),
            kv_margin: Spanned::new(0..0, 1.0),
            max_context_tokens: None,
            max_batch: Spanned::new(0..0, 16),
            on_untrusted_context: None,
            on_upstream_unavailable: Spanned::new(0..0, false),
        }
    }
}

impl LocalConfig {
    /// Whether a local engine is configured.
    pub fn enabled(&self) -> bool {
        self.model_dir.is_some()
    }

    /// The configured model directory.
    pub fn model_dir(&self) -> Option<&str> {
        self.model_dir.as_ref().map(|dir| dir.get_ref().as_str())
    }

    /// What to do with a request over the trusted context limit.
    pub fn untrusted_context(&self) -> UntrustedContext {
        match &self.on_untrusted_context {
            Some(choice) => *choice.get_ref(),
            None if self.enabled() => UntrustedContext::Local,
            None => UntrustedContext::Reject,
        }
    }

    /// Whether an unreachable provider falls back to the local engine.
    pub fn on_upstream_unavailable(&self) -> bool {
        *self.on_upstream_unavailable.get_ref()
    }

    pub(crate) fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        if let Some(dir) = &self.model_dir
            && dir.get_ref().trim().is_empty()
        {
            return Err((Some(dir.span()), "local.model_dir is empty".into()));
        }
        if self.model_name.trim().is_empty() {
            return Err((None, "local.model_name is empty".into()));
        }
        if *self.kv_budget_mib.get_ref() == 0 {
            return Err((
                Some(self.kv_budget_mib.span()),
                "local.kv_budget_mib must be greater than 0".into(),
            ));
        }
        let margin = *self.kv_margin.get_ref();
        if !(margin.is_finite() && margin >= 1.0) {
            return Err((
                Some(self.kv_margin.span()),
                "local.kv_margin must be at least 1.0 (the pool must hold the whole window)".into(),
            ));
        }
        if *self.max_batch.get_ref() == 0 {
            return Err((
                Some(self.max_batch.span()),
                "local.max_batch must be greater than 0".into(),
            ));
        }
        if self.max_context_tokens == Some(0) {
            return Err((
                None,
                "local.max_context_tokens must be greater than 0".into(),
            ));
        }
        if !self.enabled() {
            if let Some(choice) = &self.on_untrusted_context
                && *choice.get_ref() == UntrustedContext::Local
            {
                return Err((
                    Some(choice.span()),
                    "local.on_untrusted_context = \"local\" needs local.model_dir (a model for \
                     the local engine)"
                        .into(),
                ));
            }
            if self.on_upstream_unavailable() {
                return Err((
                    Some(self.on_upstream_unavailable.span()),
                    "local.on_upstream_unavailable = true needs local.model_dir (a model for \
                     the local engine)"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

/// `[probe]`: re-measuring what providers really serve, on a schedule.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProbeConfig {
    /// Hours between probes of each provider by `serve`; 0 (default) never
    /// probes on its own (run `canarygate probe`).
    pub every_hours: Spanned<f64>,
    /// Most prompt tokens one probe may spend.
    pub budget_tokens: u64,
}

/// Token budget of one probe when none is given.
pub const DEFAULT_PROBE_BUDGET_TOKENS: u64 = 2_000_000;

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            every_hours: Spanned::new(0..0, 0.0),
            budget_tokens: DEFAULT_PROBE_BUDGET_TOKENS,
        }
    }
}

impl ProbeConfig {
    /// The interval between scheduled probes, if any.
    pub fn interval(&self) -> Option<std::time::Duration> {
        let hours = *self.every_hours.get_ref();
        (hours > 0.0).then(|| std::time::Duration::from_secs_f64(hours * 3600.0))
    }

    pub(crate) fn validate(&self) -> Result<(), (Option<Range<usize>>, String)> {
        let hours = *self.every_hours.get_ref();
        if !(hours.is_finite() && hours >= 0.0) || (hours > 0.0 && hours * 3600.0 < 60.0) {
            return Err((
                Some(self.every_hours.span()),
                "probe.every_hours must be 0 (never) or at least one minute (0.0167)".into(),
            ));
        }
        if self.budget_tokens == 0 {
            return Err((None, "probe.budget_tokens must be greater than 0".into()));
        }
        Ok(())
    }
}

//! Model configuration: `config.json` of a Hugging Face model directory, parsed by our own code.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::EngineError;

/// Architectures the engine implements. All three share one decoder graph (see `model.rs`);
/// they differ in attention biases and the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3, including Llama 3 RoPE scaling).
    Llama,
    /// `MistralForCausalLM` (optional sliding window).
    Mistral,
    /// `Qwen2ForCausalLM` (bias on the q, k and v projections).
    Qwen2,
}

/// Llama 3 RoPE frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// Divisor applied to low frequencies.
    pub factor: f32,
    /// Wavelength bound (as a divisor of the original context) below which frequencies are scaled.
    pub low_freq_factor: f32,
    /// Wavelength bound above which frequencies are kept.
    pub high_freq_factor: f32,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// The parts of `config.json` the engine uses, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which decoder variant.
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Number of token ids.
    pub vocab_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads (grouped-query attention when smaller than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, when configured.
    pub rope_scaling: Option<Llama3Scaling>,
    /// The model's own context window.
    pub max_position_embeddings: usize,
    /// Attention window in tokens, `None` for full attention.
    pub sliding_window: Option<usize>,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// The output projection carries a bias (Llama `attention_bias`).
    pub o_bias: bool,
    /// Token ids that end a generation.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    vocab_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    eos_token_id: Option<Value>,
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| EngineError::Model(format!("cannot read {}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| EngineError::Model(format!("{}: {e}", path.display())))
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text).map_err(ConfigError)
    }

    fn parse(text: &str) -> Result<Self, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let architecture = architecture(&raw)?;
        if raw.num_attention_heads == 0 || raw.hidden_size == 0 || raw.num_hidden_layers == 0 {
            return Err(
                "hidden_size, num_attention_heads and num_hidden_layers must be > 0".into(),
            );
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({num_kv_heads})",
                raw.num_attention_heads
            ));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim must be even and > 0, got {head_dim}"));
        }
        let (rope_theta, rope_scaling) = rope(&raw)?;
        let sliding_window = match architecture {
            Architecture::Llama => None,
            Architecture::Mistral => raw.sliding_window,
            Architecture::Qwen2 if raw.use_sliding_window == Some(true) => raw.sliding_window,
            Architecture::Qwen2 => None,
        };
        let attention_bias = raw.attention_bias.unwrap_or(false);
        Ok(Self {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            vocab_size: raw.vocab_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            sliding_window,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2 || attention_bias,
            o_bias: architecture != Architecture::Qwen2 && attention_bias,
            eos_token_ids: eos_ids(raw.eos_token_id.as_ref())?,
        })
    }

    /// RoPE inverse frequencies, one per pair of head dimensions, with Llama 3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1f32 / self.rope_theta.powf(i as f32 / d as f32))
            .collect();
        let Some(s) = self.rope_scaling else {
            return base;
        };
        let original = s.original_max_position_embeddings as f32;
        let low_freq_wavelen = original / s.low_freq_factor;
        let high_freq_wavelen = original / s.high_freq_factor;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_freq_wavelen {
                    freq
                } else if wavelen > low_freq_wavelen {
                    freq / s.factor
                } else {
                    let smooth = (original / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                }
            })
            .collect()
    }
}

/// A `config.json` the engine cannot serve: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

fn architecture(raw: &RawConfig) -> Result<Architecture, String> {
    let names: Vec<&str> = raw
        .architectures
        .iter()
        .flatten()
        .map(String::as_str)
        .chain(raw.model_type.as_deref())
        .collect();
    for name in &names {
        match *name {
            "LlamaForCausalLM" | "llama" => return Ok(Architecture::Llama),
            "MistralForCausalLM" | "mistral" => return Ok(Architecture::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => return Ok(Architecture::Qwen2),
            _ => {}
        }
    }
    Err(format!(
        "unsupported architecture {names:?}: supported are LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    ))
}

/// RoPE base and scaling from either `rope_theta` + `rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5).
fn rope(raw: &RawConfig) -> Result<(f32, Option<Llama3Scaling>), String> {
    let params = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
    let theta = raw
        .rope_theta
        .or_else(|| {
            params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .unwrap_or(10_000.0);
    let Some(params) = params.filter(|p| !p.is_null()) else {
        return Ok((theta as f32, None));
    };
    let rope_type = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match rope_type {
        "default" => Ok((theta as f32, None)),
        "llama3" => {
            let field = |name: &str| {
                params
                    .get(name)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| format!("llama3 rope scaling lacks a numeric `{name}`"))
            };
            let scaling = Llama3Scaling {
                factor: field("factor")? as f32,
                low_freq_factor: field("low_freq_factor")? as f32,
                high_freq_factor: field("high_freq_factor")? as f32,
                original_max_position_embeddings: field("original_max_position_embeddings")?
                    as usize,
            };
            if scaling.high_freq_factor <= scaling.low_freq_factor || scaling.factor <= 0.0 {
                return Err(
                    "llama3 rope scaling needs high_freq_factor > low_freq_factor and factor > 0"
                        .into(),
                );
            }
            Ok((theta as f32, Some(scaling)))
        }
        other => Err(format!(
            "unsupported rope_type {other:?}: supported are \"default\" and \"llama3\""
        )),
    }
}

fn eos_ids(value: Option<&Value>) -> Result<Vec<u32>, String> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| format!("eos_token_id must be a token id, got {v}"))
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) => ids.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "vocab_size": 300,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2"#;

    #[test]
    fn transformers5_rope_parameters_and_null_window() {
        let cfg = ModelConfig::from_json(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": null,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 500000.0}}}}"#
        ))
        .unwrap();
        assert_eq!(cfg.architecture, Architecture::Mistral);
        assert_eq!(cfg.rope_theta, 500000.0);
        assert_eq!(cfg.sliding_window, None);
        assert_eq!(cfg.head_dim, 16);
    }

    #[test]
    fn llama3_scaling_changes_low_frequencies_only() {
        let cfg = ModelConfig::from_json(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 500000.0, "eos_token_id": [1, 2],
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        let scaled = cfg.rope_inv_freq();
        let plain = ModelConfig {
            rope_scaling: None,
            ..cfg.clone()
        }
        .rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[7] - plain[7] / 8.0).abs() < 1e-12);
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn unknown_architecture_and_rope_type_are_clear_errors() {
        let err = ModelConfig::from_json(&format!(
            r#"{{"architectures": ["GPT2LMHeadModel"], {BASE}}}"#
        ))
        .unwrap_err();
        assert!(
            err.to_string().contains("unsupported architecture"),
            "{err}"
        );
        let err = ModelConfig::from_json(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "rope_scaling": {{"type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err();
        assert!(
            err.to_string().contains("unsupported rope_type \"yarn\""),
            "{err}"
        );
    }
}

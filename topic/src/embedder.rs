//! A sentence-transformers directory run with candle: BERT, mean pooling, L2 normalisation.
//!
//! The directory layout is the one sentence-transformers saves (all-MiniLM-L6-v2 has it):
//! `config.json` (a Hugging Face BERT config), `tokenizer.json`, `model.safetensors`,
//! `modules.json` (the pipeline: Transformer, Pooling, optionally Normalize),
//! `sentence_bert_config.json` (`max_seq_length`) and the pooling module's `config.json`.
//! Only the pipeline this file computes is accepted: a pooling other than the mean, or a
//! module it does not know (a Dense projection), is refused rather than silently skipped.

use std::path::{Path, PathBuf};

use candle_core::{D, DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde::Deserialize;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams, TruncationStrategy};

use crate::TopicError;

/// sentence-transformers' own default when `sentence_bert_config.json` does not say.
const DEFAULT_MAX_SEQ_LENGTH: usize = 256;

/// A sentence-embedding model loaded from a sentence-transformers directory.
pub struct Embedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    normalize: bool,
    max_seq_length: usize,
    name: String,
}

/// One entry of `modules.json`.
#[derive(Deserialize)]
struct Module {
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

/// The pooling module's `config.json`: which of its modes are on.
#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

impl Embedder {
    /// Loads a sentence-transformers directory: its BERT weights, tokenizer and pipeline.
    ///
    /// Texts are truncated to `max_seq_length` tokens (from `sentence_bert_config.json`,
    /// 256 when absent) by the tokenizer, whatever truncation `tokenizer.json` itself carries.
    pub fn load(dir: &Path) -> Result<Self, TopicError> {
        let config_path = dir.join("config.json");
        let config_value: serde_json::Value = read_json(&config_path)?;
        check_is_bert(&config_path, &config_value)?;
        let config: Config =
            serde_json::from_value(config_value).map_err(|error| TopicError::Config {
                path: config_path.clone(),
                message: format!("not a BERT configuration: {error}"),
            })?;

        let modules_path = dir.join("modules.json");
        let modules: Vec<Module> = read_json(&modules_path)?;
        let normalize = check_pipeline(dir, &modules_path, &modules)?;

        let sbert_path = dir.join("sentence_bert_config.json");
        let max_seq_length = if sbert_path.exists() {
            let sbert: SentenceBertConfig = read_json(&sbert_path)?;
            sbert.max_seq_length.unwrap_or(DEFAULT_MAX_SEQ_LENGTH)
        } else {
            DEFAULT_MAX_SEQ_LENGTH
        };
        if max_seq_length == 0 || max_seq_length > config.max_position_embeddings {
            return Err(TopicError::Config {
                path: sbert_path,
                message: format!(
                    "max_seq_length {max_seq_length} must be between 1 and the model's \
                     max_position_embeddings ({})",
                    config.max_position_embeddings
                ),
            });
        }

        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"), &config, max_seq_length)?;

        let weights_path = dir.join("model.safetensors");
        let weights = read_file(&weights_path)?;
        let device = Device::Cpu;
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &device)
            .map_err(|error| TopicError::Model(format!("{}: {error}", weights_path.display())))?;
        let model = BertModel::load(vb, &config).map_err(|error| {
            TopicError::Model(format!(
                "{}: the weights do not fit config.json: {error}",
                weights_path.display()
            ))
        })?;

        let name = dir
            .canonicalize()
            .ok()
            .as_deref()
            .unwrap_or(dir)
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        Ok(Self {
            model,
            tokenizer,
            device,
            normalize,
            max_seq_length,
            name,
        })
    }

    /// Embeds `texts` as one padded batch: one vector per text, in order.
    ///
    /// Each text is truncated to the model's `max_seq_length` tokens. A text that is empty or
    /// only whitespace is refused ([`TopicError::EmptyText`]): its embedding would be that of
    /// the special tokens alone, a vector close to many unrelated texts.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, TopicError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(index) = texts.iter().position(|text| text.trim().is_empty()) {
            return Err(TopicError::EmptyText(format!("text {index}")));
        }
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|error| TopicError::Tokenizer(error.to_string()))?;
        let batch = encodings.len();
        let length = encodings.first().map_or(0, |encoding| encoding.len());
        let mut ids = Vec::with_capacity(batch * length);
        let mut type_ids = Vec::with_capacity(batch * length);
        let mut mask = Vec::with_capacity(batch * length);
        for encoding in &encodings {
            if encoding.len() != length {
                return Err(TopicError::Tokenizer(
                    "the batch came back unpadded".to_string(),
                ));
            }
            ids.extend_from_slice(encoding.get_ids());
            type_ids.extend_from_slice(encoding.get_type_ids());
            mask.extend(encoding.get_attention_mask().iter().map(|&m| m as f32));
        }
        let ids = Tensor::from_vec(ids, (batch, length), &self.device)?;
        let type_ids = Tensor::from_vec(type_ids, (batch, length), &self.device)?;
        let mask = Tensor::from_vec(mask, (batch, length), &self.device)?;

        // hidden: [batch, length, hidden]
        let hidden = self.model.forward(&ids, &type_ids, Some(&mask))?;
        // Mean over the real tokens: sum(hidden * mask) / sum(mask), per text.
        let mask3 = mask.unsqueeze(2)?; // [batch, length, 1]
        let summed = hidden.broadcast_mul(&mask3)?.sum(1)?; // [batch, hidden]
        let counts = mask3.sum(1)?.clamp(1e-9f32, f32::MAX)?; // [batch, 1]
        let mut pooled = summed.broadcast_div(&counts)?;
        if self.normalize {
            // x / max(|x|, 1e-12), as torch.nn.functional.normalize.
            let norms = pooled
                .sqr()?
                .sum_keepdim(D::Minus1)?
                .sqrt()?
                .clamp(1e-12f32, f32::MAX)?;
            pooled = pooled.broadcast_div(&norms)?;
        }
        Ok(pooled.to_vec2::<f32>()?)
    }

    /// The model's name: the last component of its directory.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The most tokens of a text the model reads; the rest is cut off.
    pub fn max_seq_length(&self) -> usize {
        self.max_seq_length
    }
}

/// Refuses a config.json that names another architecture: its weights would load into BERT
/// only by accident, and its embeddings would mean nothing.
fn check_is_bert(path: &Path, config: &serde_json::Value) -> Result<(), TopicError> {
    let model_type = config.get("model_type").and_then(|value| value.as_str());
    match model_type {
        Some("bert") => Ok(()),
        other => Err(TopicError::Config {
            path: path.to_path_buf(),
            message: format!(
                "model_type is {}: only BERT models (\"bert\") are supported",
                other.map_or_else(|| "missing".to_string(), |kind| format!("{kind:?}"))
            ),
        }),
    }
}

/// Checks the pipeline in modules.json is one this file computes (a Transformer, a mean
/// Pooling, optionally a Normalize) and says whether it normalises.
fn check_pipeline(dir: &Path, path: &Path, modules: &[Module]) -> Result<bool, TopicError> {
    let refuse = |message: String| TopicError::Config {
        path: path.to_path_buf(),
        message,
    };
    let kind_of = |module: &Module| {
        module
            .kind
            .rsplit('.')
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let kinds: Vec<String> = modules.iter().map(kind_of).collect();
    let expected_prefix = ["Transformer", "Pooling"];
    if kinds.len() < 2 || kinds[..2] != expected_prefix {
        return Err(refuse(format!(
            "the pipeline is {kinds:?}: expected Transformer, Pooling and optionally Normalize"
        )));
    }
    let normalize = match &kinds[2..] {
        [] => false,
        [last] if last == "Normalize" => true,
        rest => {
            return Err(refuse(format!(
                "modules after Pooling are {rest:?}: only Normalize is supported"
            )));
        }
    };
    let pooling_path = dir.join(&modules[1].path).join("config.json");
    let pooling: PoolingConfig = read_json(&pooling_path)?;
    let other_modes = pooling.pooling_mode_cls_token
        || pooling.pooling_mode_max_tokens
        || pooling.pooling_mode_mean_sqrt_len_tokens
        || pooling.pooling_mode_weightedmean_tokens
        || pooling.pooling_mode_lasttoken;
    if !pooling.pooling_mode_mean_tokens || other_modes {
        return Err(TopicError::Config {
            path: pooling_path,
            message: "only mean pooling is supported (pooling_mode_mean_tokens alone)".to_string(),
        });
    }
    Ok(normalize)
}

/// Loads tokenizer.json with truncation at `max_seq_length` and padding to the batch's
/// longest text, replacing whatever fixed lengths the file itself sets.
fn load_tokenizer(
    path: &Path,
    config: &Config,
    max_seq_length: usize,
) -> Result<Tokenizer, TopicError> {
    if !path.exists() {
        return Err(TopicError::MissingFile(path.to_path_buf()));
    }
    let mut tokenizer = Tokenizer::from_file(path)
        .map_err(|error| TopicError::Tokenizer(format!("{}: {error}", path.display())))?;
    let vocab = tokenizer.get_vocab_size(true);
    if vocab > config.vocab_size {
        return Err(TopicError::Config {
            path: path.to_path_buf(),
            message: format!(
                "the tokenizer has {vocab} tokens but the model's vocab_size is {}",
                config.vocab_size
            ),
        });
    }
    let padding = match tokenizer.get_padding() {
        Some(padding) => PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            pad_to_multiple_of: None,
            ..padding.clone()
        },
        None => PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            pad_id: config.pad_token_id as u32,
            ..PaddingParams::default()
        },
    };
    tokenizer.with_padding(Some(padding));
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: max_seq_length,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            ..TruncationParams::default()
        }))
        .map_err(|error| TopicError::Tokenizer(format!("{}: {error}", path.display())))?;
    Ok(tokenizer)
}

fn read_file(path: &Path) -> Result<Vec<u8>, TopicError> {
    std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TopicError::MissingFile(path.to_path_buf())
        } else {
            TopicError::Io {
                path: PathBuf::from(path),
                source,
            }
        }
    })
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TopicError> {
    let bytes = read_file(path)?;
    serde_json::from_slice(&bytes).map_err(|error| TopicError::Config {
        path: path.to_path_buf(),
        message: error.to_string(),
    })
}

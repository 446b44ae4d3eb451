//! Small random model directories for tests, demos and benchmarks (`canarygate engine init-tiny`).
//!
//! The tokenizer is a byte-level BPE over the 256 byte symbols plus Llama-3-style special
//! tokens; ids beyond those up to `vocab_size` are reserved special tokens.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{Value, json};

use crate::EngineError;
use crate::config::Architecture;

/// Shape and seed of a random model.
#[derive(Debug, Clone)]
pub struct TinyModel {
    /// Llama (default) or Qwen2 (with q/k/v biases); Mistral writes a Llama-shaped model.
    pub architecture: Architecture,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Token ids (at least 261: 256 bytes + 5 special tokens).
    pub vocab_size: usize,
    /// Context window written to config.json.
    pub max_position_embeddings: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Write a Llama 3 `rope_scaling` block (factor 8, original context 32).
    pub llama3_rope_scaling: bool,
    /// Share embedding and lm_head.
    pub tie_word_embeddings: bool,
    /// Seed of the weights.
    pub seed: u64,
    /// Tokenizer kind.
    pub tokenizer: TinyTokenizer,
}

/// The tokenizer written with a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TinyTokenizer {
    /// Byte-level BPE without merges: one token per byte of text.
    #[default]
    Bytes,
    /// Word level over 255 English words (anything else is `<unk>`): about
    /// one token per word, so long prompts stay cheap for demos.
    Words,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self {
            architecture: Architecture::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            vocab_size: 288,
            max_position_embeddings: 512,
            rope_theta: 10_000.0,
            llama3_rope_scaling: false,
            tie_word_embeddings: false,
            seed: 0,
            tokenizer: TinyTokenizer::Bytes,
        }
    }
}

const SPECIAL: [&str; 5] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

pub(crate) const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";

/// Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json of a random
/// model into `dir` (created if missing).
pub fn write_tiny_model(dir: &Path, spec: &TinyModel) -> Result<(), EngineError> {
    let s = spec;
    if s.vocab_size < 256 + SPECIAL.len() {
        return Err(EngineError::Config(format!(
            "vocab_size must be at least {}",
            256 + SPECIAL.len()
        )));
    }
    if s.num_heads == 0
        || s.num_kv_heads == 0
        || !s.num_heads.is_multiple_of(s.num_kv_heads)
        || !s.hidden_size.is_multiple_of(s.num_heads)
        || !(s.hidden_size / s.num_heads).is_multiple_of(2)
    {
        return Err(EngineError::Config(
            "hidden_size / num_heads must be even and num_heads a multiple of num_kv_heads".into(),
        ));
    }
    let io = |e: std::io::Error| EngineError::Model(format!("writing {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("config.json"), config_json(s).to_string()).map_err(io)?;
    std::fs::write(
        dir.join("tokenizer.json"),
        match s.tokenizer {
            TinyTokenizer::Bytes => tokenizer_json(s.vocab_size),
            TinyTokenizer::Words => word_tokenizer_json(s.vocab_size),
        }
        .to_string(),
    )
    .map_err(io)?;
    let tokenizer_config = json!({
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[4],
        "chat_template": CHAT_TEMPLATE,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .map_err(io)?;
    candle_core::safetensors::save(&weights(s)?, dir.join("model.safetensors"))?;
    Ok(())
}

fn config_json(s: &TinyModel) -> Value {
    let (arch, model_type) = match s.architecture {
        Architecture::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Architecture::Llama | Architecture::Mistral => ("LlamaForCausalLM", "llama"),
    };
    let mut config = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": s.tie_word_embeddings,
        "bos_token_id": 256,
        "eos_token_id": [257, 260],
        "hidden_act": "silu",
        "sliding_window": s.max_position_embeddings,
        "max_window_layers": s.num_layers,
        "use_sliding_window": false,
    });
    if s.llama3_rope_scaling {
        config["rope_scaling"] = json!({
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        });
    }
    config
}

/// GPT-2's byte → printable character map used by byte-level BPE.
fn byte_symbols() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

pub(crate) fn tokenizer_json(vocab_size: usize) -> Value {
    let vocab: serde_json::Map<String, Value> = byte_symbols()
        .into_iter()
        .enumerate()
        .map(|(id, c)| (c.to_string(), json!(id)))
        .collect();
    let special = SPECIAL
        .iter()
        .map(|s| s.to_string())
        .chain((256 + SPECIAL.len()..vocab_size).map(|id| format!("<|reserved_{id}|>")));
    let added: Vec<Value> = special
        .enumerate()
        .map(|(i, content)| {
            json!({"id": 256 + i, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": []
        }
    })
}

/// Vocabulary of the word-level tokenizer: ids 0..255 (255 is `<unk>`).
const WORDS: &str = "the of and to in is was for on that with as by at from it his an were are which \
    this be has or had first one their its new after who they two her she been other when there all \
    during into school time may years more most only over city some world would where later up such \
    used many can state about national out known university united then made team people than film \
    year both under him three well part between however second american game also these de house \
    called series season we being war you through several album before became until against while \
    last each before north south river music early long since group any government because name \
    even number same high work four born company local them five home age did make same west best \
    family end place our main area original like found use including because left play now great \
    record way both life day took small what within old won so much will day led set few show \
    following around became went based book another just own station built began take served \
    same along times very good final line near large water still power public system open general \
    back order town while major field being form although released third light plan report survey \
    valley spring bridge farmer barley stone wall clear sky storm quiet again answer question model \
    token context window memory page cache request session canary engine local proxy provider audit";

fn word_tokenizer_json(vocab_size: usize) -> Value {
    let mut vocab = serde_json::Map::new();
    for word in WORDS.split_whitespace() {
        if vocab.len() == 255 {
            break;
        }
        if !vocab.contains_key(word) {
            let id = vocab.len();
            vocab.insert(word.to_owned(), json!(id));
        }
    }
    while vocab.len() < 255 {
        let id = vocab.len();
        vocab.insert(format!("w{id}"), json!(id));
    }
    vocab.insert("<unk>".to_owned(), json!(255));
    let mut tokenizer = tokenizer_json(vocab_size);
    tokenizer["pre_tokenizer"] = json!({"type": "Whitespace"});
    tokenizer["decoder"] = json!({"type": "WordPiece", "prefix": "##", "cleanup": true});
    tokenizer["model"] = json!({"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"});
    tokenizer
}

/// Deterministic uniform weights in `[-scale, scale]` (SplitMix64).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self, n: usize, center: f32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = self.0;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                let u = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                center + scale * (2.0 * u - 1.0)
            })
            .collect()
    }
}

fn weights(s: &TinyModel) -> Result<HashMap<String, Tensor>, EngineError> {
    let mut rng = Rng(s.seed ^ 0x5eed_0fca_9a27);
    let head_dim = s.hidden_size / s.num_heads;
    let (h, q, kv, i) = (
        s.hidden_size,
        s.num_heads * head_dim,
        s.num_kv_heads * head_dim,
        s.intermediate_size,
    );
    let mut w = HashMap::new();
    let mut put =
        |name: String, shape: &[usize], center: f32, scale: f32| -> Result<(), EngineError> {
            let data = rng.uniform(shape.iter().product(), center, scale);
            w.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?);
            Ok(())
        };
    // Uniform(-a, a) has std a / sqrt(3): a = sqrt(3 / fan_in) keeps activations O(1).
    let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    put(
        "model.embed_tokens.weight".into(),
        &[s.vocab_size, h],
        0.0,
        1.0,
    )?;
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        put(format!("{p}.input_layernorm.weight"), &[h], 1.0, 0.2)?;
        put(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            1.0,
            0.2,
        )?;
        for (name, out) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            put(
                format!("{p}.self_attn.{name}.weight"),
                &[out, h],
                0.0,
                lin(h),
            )?;
            if s.architecture == Architecture::Qwen2 {
                put(format!("{p}.self_attn.{name}.bias"), &[out], 0.0, 0.5)?;
            }
        }
        put(format!("{p}.self_attn.o_proj.weight"), &[h, q], 0.0, lin(q))?;
        put(format!("{p}.mlp.gate_proj.weight"), &[i, h], 0.0, lin(h))?;
        put(format!("{p}.mlp.up_proj.weight"), &[i, h], 0.0, lin(h))?;
        put(format!("{p}.mlp.down_proj.weight"), &[h, i], 0.0, lin(i))?;
    }
    put("model.norm.weight".into(), &[h], 1.0, 0.2)?;
    if !s.tie_word_embeddings {
        put("lm_head.weight".into(), &[s.vocab_size, h], 0.0, lin(h))?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn tiny_model_round_trips_through_our_loaders() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), &TinyModel::default()).unwrap();
        let cfg = ModelConfig::from_file(&dir.path().join("config.json")).unwrap();
        assert_eq!(cfg.vocab_size, 288);
        assert_eq!(cfg.eos_token_ids, vec![257, 260]);
        let tok = crate::text::load_tokenizer(dir.path()).unwrap();
        let ids = tok
            .encode("héllo <|eot_id|>", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(*ids.last().unwrap(), 260);
        assert_eq!(tok.decode(&ids, true).unwrap(), "héllo ");
        assert_eq!(tok.get_vocab_size(true), 288);
    }

    #[test]
    fn rejects_bad_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let bad = TinyModel {
            vocab_size: 100,
            ..TinyModel::default()
        };
        assert!(write_tiny_model(dir.path(), &bad).is_err());
    }
}

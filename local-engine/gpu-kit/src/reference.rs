//! The kit's correctness model and its CPU reference (`prepare`, run at build time).
//!
//! The model is a small random Llama (grouped-query attention, Llama 3 RoPE scaling) written by
//! the engine's own [`write_tiny_model`], with a planted next-token rule
//! ([`plant_successor_map`]) that makes its greedy choices confident. The reference is the
//! engine on the CPU in f32, which `tests/reference.rs` holds against candle-transformers'
//! Llama. For each prompt length the build takes the first prompt whose greedy generation keeps
//! a lead of the top logit of at least twice the bf16 tolerance at every compared step
//! ([`compare::relative_margin`]): there, any run within tolerance picks the same tokens, so
//! "identical greedy tokens" tests the device and not the luck of near-ties.

use std::path::Path;

use canarygate_engine::{Engine, EngineConfig, GenerationRequest, TinyModel, write_tiny_model};
use serde::{Deserialize, Serialize};

use crate::compare::{self, BF16};

/// Prompt lengths of the correctness checks: a single token, short ones, and one longer than
/// the engine's 512-token prefill chunk.
pub const PROMPT_LENGTHS: [usize; 6] = [1, 7, 33, 130, 300, 700];

/// Greedy steps generated and compared per prompt.
pub const STEPS: usize = 32;

/// Candidate prompts tried per length before the build gives up.
const CANDIDATES: u32 = 64;

/// The correctness model: small enough to travel (3.4 MB), shaped like the real thing.
pub fn correctness_model() -> TinyModel {
    TinyModel {
        hidden_size: 128,
        intermediate_size: 384,
        num_layers: 3,
        num_heads: 8,
        num_kv_heads: 2,
        vocab_size: 1024,
        max_position_embeddings: 2048,
        llama3_rope_scaling: true,
        seed: 23,
        ..TinyModel::default()
    }
}

/// Scale of the attention and MLP outputs added to the residual stream (see
/// [`plant_successor_map`]).
const BLOCK_OUTPUT_SCALE: f64 = 0.3;

/// A deterministic cyclic permutation of `0..n` (one cycle through every id), SplitMix64-driven.
fn successor_cycle(n: usize, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    // Visit order: a Fisher-Yates shuffle; each id's successor is the next one in that order.
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut successor = vec![0u32; n];
    for (i, &id) in order.iter().enumerate() {
        successor[id as usize] = order[(i + 1) % n];
    }
    successor
}

/// Gives the random model a confident next-token rule, so that bf16's rounding cannot flip its
/// greedy choices.
///
/// A purely random model's top two logits are often within 1 % of each other (the best of 64
/// random one-token prompts kept a lead of 2.9 % over 32 steps), while bf16 moves its logits by
/// about 2 %: no prompt keeps a lead of twice the tolerance. So the lm_head row of token
/// `successor[t]` becomes token `t`'s embedding: the residual stream, which starts as the
/// embedding of the current token, points at its successor, and greedy decoding walks one long
/// cycle through the vocabulary (leads of 52-60 %). Attention and MLP outputs are scaled by
/// [`BLOCK_OUTPUT_SCALE`], so that they still make up a large part of every logit without
/// drowning the rule: zeroing every attention output moves the logits by 56 % of their largest
/// value, zeroing every MLP output by 28 %, against a bf16 tolerance of 3 % (measured with the
/// kit's checks on the CPU).
fn plant_successor_map(model_dir: &Path, seed: u64) -> candle_core::Result<()> {
    use candle_core::{Device, Tensor};
    let path = model_dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let embeddings = tensors["model.embed_tokens.weight"].clone();
    let (vocab, hidden) = embeddings.dims2()?;
    let successor = successor_cycle(vocab, seed);
    // Row successor[t] of lm_head = embedding of t, i.e. row j = embedding of predecessor(j).
    let mut predecessor = vec![0u32; vocab];
    for (t, &s) in successor.iter().enumerate() {
        predecessor[s as usize] = t as u32;
    }
    let index = Tensor::from_vec(predecessor, vocab, &Device::Cpu)?;
    // Divided by sqrt(hidden): logits of a few units, as a trained model's.
    let lm_head = (embeddings.index_select(&index, 0)? / (hidden as f64).sqrt())?;
    tensors.insert("lm_head.weight".into(), lm_head);
    for (name, weight) in tensors.iter_mut() {
        if name.ends_with("self_attn.o_proj.weight") || name.ends_with("mlp.down_proj.weight") {
            *weight = (&*weight * BLOCK_OUTPUT_SCALE)?;
        }
    }
    candle_core::safetensors::save(&tensors, &path)
}

/// Deterministic prompt `salt` of `len` token ids below `vocab`.
pub fn prompt(len: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| ((i * 131 + u64::from(salt) * 7919 + 3) % vocab as u64) as u32)
        .collect()
}

/// One prompt and what the CPU reference made of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReferencePrompt {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Greedy tokens, [`STEPS`] of them.
    pub generated: Vec<u32>,
    /// Logits each generated token was picked from.
    pub logits: Vec<Vec<f32>>,
    /// Smallest [`compare::relative_margin`] over the steps.
    pub min_margin: f32,
}

/// `reference.json` of a kit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reference {
    /// Model directory, relative to the kit.
    pub model: String,
    /// Margin every step of every prompt has (twice the bf16 tolerance).
    pub required_margin: f32,
    /// Prompts, in [`PROMPT_LENGTHS`] order.
    pub prompts: Vec<ReferencePrompt>,
}

impl Reference {
    /// Reads `reference.json` of `kit`.
    pub fn load(kit: &Path) -> Result<Self, String> {
        let path = kit.join("reference.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Writes the correctness model into `kit/model` and its reference into `kit/reference.json`.
pub fn prepare(kit: &Path) -> Result<Reference, String> {
    let spec = correctness_model();
    let model_dir = kit.join("model");
    write_tiny_model(&model_dir, &spec).map_err(|e| e.to_string())?;
    plant_successor_map(&model_dir, spec.seed)
        .map_err(|e| format!("planting the successor map: {e}"))?;
    let engine = Engine::start(EngineConfig {
        kv_budget_bytes: 64 << 20,
        ..EngineConfig::new(&model_dir)
    })
    .map_err(|e| e.to_string())?;
    let required_margin = 2.0 * BF16.max_relative_error;
    let mut prompts = Vec::new();
    for len in PROMPT_LENGTHS {
        let mut best: Option<ReferencePrompt> = None;
        for salt in 0..CANDIDATES {
            let tokens = prompt(len, salt, spec.vocab_size);
            let request = GenerationRequest {
                return_logits: true,
                ..GenerationRequest::greedy(tokens.clone(), STEPS)
            };
            let completion = engine
                .submit(request)
                .map_err(|e| e.to_string())?
                .wait()
                .map_err(|e| e.to_string())?;
            if completion.token_ids.len() < STEPS {
                continue; // ended early (end-of-sequence token)
            }
            let min_margin = completion
                .logits
                .iter()
                .map(|row| compare::relative_margin(row))
                .fold(f32::INFINITY, f32::min);
            let candidate = ReferencePrompt {
                tokens,
                generated: completion.token_ids,
                logits: completion.logits,
                min_margin,
            };
            if best.as_ref().is_none_or(|b| min_margin > b.min_margin) {
                best = Some(candidate);
            }
            if min_margin >= required_margin {
                break;
            }
        }
        match best {
            Some(p) if p.min_margin >= required_margin => prompts.push(p),
            Some(p) => {
                return Err(format!(
                    "no prompt of {len} tokens among {CANDIDATES} keeps a top-logit margin of \
                     {required_margin} for {STEPS} steps (best: {})",
                    p.min_margin
                ));
            }
            None => return Err(format!("every prompt of {len} tokens ended early")),
        }
    }
    let reference = Reference {
        model: "model".into(),
        required_margin,
        prompts,
    };
    let path = kit.join("reference.json");
    let text = serde_json::to_string(&reference).map_err(|e| e.to_string())?;
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(reference)
}

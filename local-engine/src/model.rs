//! The decoder-only transformer shared by Llama, Mistral and Qwen2, with attention over the
//! paged KV pool.
//!
//! One forward pass runs a *batch of segments*: each segment is a run of consecutive tokens of
//! one request (a prefill chunk, or the single new token of a decode step). Tokens of all
//! segments are stacked into `T` rows so that every projection is one matmul for the whole
//! batch; only attention is done per segment, against that segment's own KV slots.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Embedding, Linear, Module, RmsNorm, VarBuilder};

use crate::EngineError;
use crate::config::ModelConfig;
use crate::cpu_matmul::{self, SmallBatchLinear};
use crate::kv::KvPool;

/// Where one segment's tokens go in the pool and what its attention may read.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// Token ids of this segment, at positions `start..start + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Position of the first token.
    pub start: usize,
    /// Pool slot of each new token (from [`KvPool::write_slots`]).
    pub write_slots: Vec<u32>,
    /// Pool slots of positions `0..start + tokens.len()` (from [`KvPool::read_slots`]).
    pub read_slots: Vec<u32>,
}

struct Attention {
    /// q, k and v projections stacked into one matmul: `[q_dim + 2 * kv_dim, hidden]`.
    qkv_proj: Linear,
    o_proj: Linear,
}

struct Mlp {
    /// gate and up projections stacked into one matmul: `[2 * intermediate, hidden]`.
    gate_up_proj: Linear,
    down_proj: Linear,
}

/// Stacks linear layers that read the same input into one (rows of the weights, then biases),
/// so a batch pays for one matmul instead of several.
fn stack(parts: &[Linear]) -> candle_core::Result<Linear> {
    let weights: Vec<&Tensor> = parts.iter().map(Linear::weight).collect();
    let biases: Option<Vec<&Tensor>> = parts.iter().map(Linear::bias).collect();
    let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
    Ok(Linear::new(Tensor::cat(&weights, 0)?, bias))
}

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attention_norm: RmsNorm,
    mlp: Mlp,
}

/// A loaded model. Weights are memory-mapped from the safetensors files.
pub struct Model {
    config: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// `[positions, head_dim / 2]` RoPE tables.
    cos: Tensor,
    sin: Tensor,
    device: Device,
    dtype: DType,
}

fn linear(
    vb: &VarBuilder,
    name: &str,
    in_dim: usize,
    out_dim: usize,
    bias: bool,
) -> candle_core::Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb.pp(name))
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb.pp(name))
    }
}

impl Model {
    /// Loads the weights of `config` from `files` (safetensors), with RoPE tables for
    /// `max_positions` positions.
    pub fn load(
        config: &ModelConfig,
        files: &[impl AsRef<Path>],
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, EngineError> {
        // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we rely
        // on nobody truncating or rewriting the model files while the engine runs.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(files, dtype, device)? };
        Self::from_var_builder(config, vb, max_positions)
            .map_err(|e| EngineError::Model(format!("loading weights: {e}")))
    }

    fn from_var_builder(
        config: &ModelConfig,
        vb: VarBuilder,
        max_positions: usize,
    ) -> candle_core::Result<Self> {
        let c = config;
        let (h, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let embed_tokens = candle_nn::embedding(c.vocab_size, h, vb.pp("model.embed_tokens"))?;
        let layers = (0..c.num_layers)
            .map(|i| {
                let vb = vb.pp(format!("model.layers.{i}"));
                let a = vb.pp("self_attn");
                let m = vb.pp("mlp");
                Ok(Layer {
                    input_norm: candle_nn::rms_norm(h, c.rms_norm_eps, vb.pp("input_layernorm"))?,
                    attn: Attention {
                        qkv_proj: stack(&[
                            linear(&a, "q_proj", h, q_dim, c.qkv_bias)?,
                            linear(&a, "k_proj", h, kv_dim, c.qkv_bias)?,
                            linear(&a, "v_proj", h, kv_dim, c.qkv_bias)?,
                        ])?,
                        o_proj: linear(&a, "o_proj", q_dim, h, c.o_bias)?,
                    },
                    post_attention_norm: candle_nn::rms_norm(
                        h,
                        c.rms_norm_eps,
                        vb.pp("post_attention_layernorm"),
                    )?,
                    mlp: Mlp {
                        gate_up_proj: stack(&[
                            linear(&m, "gate_proj", h, c.intermediate_size, false)?,
                            linear(&m, "up_proj", h, c.intermediate_size, false)?,
                        ])?,
                        down_proj: linear(&m, "down_proj", c.intermediate_size, h, false)?,
                    },
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = candle_nn::rms_norm(h, c.rms_norm_eps, vb.pp("model.norm"))?;
        let lm_head = if c.tie_word_embeddings && !vb.contains_tensor("lm_head.weight") {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(h, c.vocab_size, vb.pp("lm_head"))?
        };
        // angle[p, i] = p * inv_freq[i]   [positions, head_dim / 2]
        let inv_freq = c.rope_inv_freq();
        let half = inv_freq.len();
        let angles: Vec<f32> = (0..max_positions)
            .flat_map(|p| inv_freq.iter().map(move |f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (max_positions, half), vb.device())?;
        Ok(Self {
            config: c.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            cos: angles.cos()?.to_dtype(vb.dtype())?,
            sin: angles.sin()?.to_dtype(vb.dtype())?,
            device: vb.device().clone(),
            dtype: vb.dtype(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Number of positions the RoPE tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// Runs `segments` through the model, writing their K and V into `pool`, and returns the
    /// logits of the last token of each segment, `[segments, vocab]` in f32.
    pub(crate) fn forward(
        &self,
        segments: &[Segment],
        pool: &KvPool,
    ) -> Result<Tensor, EngineError> {
        let c = &self.config;
        let dev = &self.device;
        let tokens: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let positions: Vec<u32> = segments
            .iter()
            .flat_map(|s| (s.start..s.start + s.tokens.len()).map(|p| p as u32))
            .collect();
        if let Some(&p) = positions.iter().max()
            && p as usize >= self.max_positions()
        {
            return Err(EngineError::Internal(format!(
                "position {p} is beyond the RoPE table ({} positions)",
                self.max_positions()
            )));
        }
        let t = tokens.len();
        let kv_row = c.num_kv_heads * c.head_dim;
        let tokens = Tensor::from_vec(tokens, t, dev)?;
        let positions = Tensor::from_vec(positions, t, dev)?;
        // Per-token RoPE rows   [T, 1, head_dim / 2]
        let cos = self.cos.index_select(&positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(&positions, 0)?.unsqueeze(1)?;
        // Scatter index for KV writes: every element of row i goes to slot i   [T, kv_row]
        let write_slots: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.write_slots.iter().copied())
            .collect();
        let write_index = Tensor::from_vec(write_slots, (t, 1), dev)?
            .broadcast_as((t, kv_row))?
            .contiguous()?;
        let read_index: Vec<Tensor> = segments
            .iter()
            .map(|s| Tensor::from_slice(&s.read_slots, s.read_slots.len(), dev))
            .collect::<candle_core::Result<_>>()?;
        let masks: Vec<Option<Tensor>> = segments
            .iter()
            .map(|s| {
                attention_mask(
                    s.start,
                    s.tokens.len(),
                    self.config.sliding_window,
                    &self.device,
                )
            })
            .collect::<candle_core::Result<_>>()?;

        // x: [T, hidden]
        let mut x = self.embed_tokens.forward(&tokens)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let residual = x.clone();
            let h = layer.input_norm.forward(&x)?;
            let a = &layer.attn;
            // qkv: [T, q_dim + 2 * kv_row]
            let qkv = project(&a.qkv_proj, &h)?;
            let q_dim = c.num_heads * c.head_dim;
            // q: [T, heads, 1, head_dim], k: [T, kv_heads, 1, head_dim] (rope wants 4D), v: [T, kv_row]
            let q = qkv
                .narrow(1, 0, q_dim)?
                .reshape((t, c.num_heads, 1, c.head_dim))?;
            let k = qkv
                .narrow(1, q_dim, kv_row)?
                .reshape((t, c.num_kv_heads, 1, c.head_dim))?;
            let v = qkv.narrow(1, q_dim + kv_row, kv_row)?;
            let q = candle_nn::rotary_emb::rope(&q.contiguous()?, &cos, &sin)?;
            let k =
                candle_nn::rotary_emb::rope(&k.contiguous()?, &cos, &sin)?.reshape((t, kv_row))?;
            let (pool_k, pool_v) = pool.layer(l);
            pool_k.scatter_set(&write_index, &k, 0)?;
            pool_v.scatter_set(&write_index, &v.contiguous()?, 0)?;
            // q rows: [T, heads * head_dim]
            let q = q.reshape((t, c.num_heads * c.head_dim))?;
            let mut outputs = Vec::with_capacity(segments.len());
            let mut row = 0;
            for (s, seg) in segments.iter().enumerate() {
                let n = seg.tokens.len();
                let q_s = q.narrow(0, row, n)?;
                outputs.push(self.attend(
                    &q_s,
                    pool_k,
                    pool_v,
                    &read_index[s],
                    masks[s].as_ref(),
                )?);
                row += n;
            }
            // attn: [T, heads * head_dim]
            let attn = Tensor::cat(&outputs, 0)?;
            x = (project(&a.o_proj, &attn)? + residual)?;
            let residual = x.clone();
            let h = layer.post_attention_norm.forward(&x)?;
            let m = &layer.mlp;
            // gate_up: [T, 2 * intermediate]
            let gate_up = project(&m.gate_up_proj, &h)?;
            let i = c.intermediate_size;
            let gated =
                (candle_nn::ops::silu(&gate_up.narrow(1, 0, i)?)? * gate_up.narrow(1, i, i)?)?;
            x = (project(&m.down_proj, &gated)? + residual)?;
        }
        // Last row of each segment   [segments, hidden]
        let mut last = Vec::with_capacity(segments.len());
        let mut end = 0u32;
        for seg in segments {
            end += seg.tokens.len() as u32;
            last.push(end - 1);
        }
        let last = Tensor::from_vec(last, segments.len(), dev)?;
        let x = self.norm.forward(&x.index_select(&last, 0)?)?;
        Ok(project(&self.lm_head, &x)?.to_dtype(DType::F32)?)
    }

    /// Scaled dot-product attention of one segment's queries over its own KV slots.
    ///
    /// q: `[n, heads * head_dim]`; returns `[n, heads * head_dim]`.
    fn attend(
        &self,
        q: &Tensor,
        pool_k: &Tensor,
        pool_v: &Tensor,
        read_index: &Tensor,
        mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let (kvh, hd) = (c.num_kv_heads, c.head_dim);
        let group = c.num_heads / kvh;
        let n = q.dim(0)?;
        let len = read_index.dim(0)?;
        // k, v: [kv_heads, len, head_dim]
        let k = pool_k
            .index_select(read_index, 0)?
            .reshape((len, kvh, hd))?
            .transpose(0, 1)?;
        let v = pool_v
            .index_select(read_index, 0)?
            .reshape((len, kvh, hd))?
            .transpose(0, 1)?;
        let k = k.to_dtype(DType::F32)?.contiguous()?;
        let v = v.to_dtype(DType::F32)?.contiguous()?;
        // q: [n, kv_heads, group, hd] -> [kv_heads, group * n, hd] (query heads of a group share K/V)
        let q = q
            .to_dtype(DType::F32)?
            .reshape((n, kvh, group, hd))?
            .permute((1, 2, 0, 3))?
            .reshape((kvh, group * n, hd))?
            .contiguous()?;
        // scores: [kv_heads, group * n, len]
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let scores = match mask {
            // mask: [n, len], broadcast over kv heads and groups
            Some(mask) => scores
                .reshape((kvh, group, n, len))?
                .broadcast_add(mask)?
                .reshape((kvh, group * n, len))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        // out: [kv_heads, group * n, hd] -> [n, heads * hd]
        probs
            .matmul(&v)?
            .reshape((kvh, group, n, hd))?
            .permute((2, 0, 1, 3))?
            .reshape((n, c.num_heads * hd))?
            .to_dtype(self.dtype)
    }
}

/// `linear(x)` for `x: [rows, in]`: through [`SmallBatchLinear`] for a few f32 rows on the CPU
/// (decode steps), through candle's matmul otherwise (prefill chunks, GPUs).
fn project(linear: &Linear, x: &Tensor) -> candle_core::Result<Tensor> {
    let w = linear.weight();
    if x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.dim(0)? <= cpu_matmul::MAX_ROWS
        && w.is_contiguous()
    {
        let y = x.contiguous()?.apply_op2_no_bwd(w, &SmallBatchLinear)?;
        return match linear.bias() {
            Some(bias) => y.broadcast_add(bias),
            None => Ok(y),
        };
    }
    linear.forward(x)
}

/// Additive mask `[n, len]` (0 or -inf) for `n` queries at positions `start..start + n` over
/// keys `0..start + n`: causal, and with a sliding window of `w` a query at `p` sees only keys
/// `p - w < j <= p` (Hugging Face Mistral semantics). `None` when nothing is masked.
fn attention_mask(
    start: usize,
    n: usize,
    window: Option<usize>,
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    let len = start + n;
    let window = window.unwrap_or(usize::MAX);
    if n == 1 && len <= window {
        return Ok(None);
    }
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            let pos = start + i;
            (0..len).map(move |j| {
                if j > pos || pos - j >= window {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(mask, (n, len), device)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(start: usize, n: usize, window: Option<usize>) -> Vec<Vec<usize>> {
        let Some(mask) = attention_mask(start, n, window, &Device::Cpu).unwrap() else {
            return vec![(0..start + n).collect()];
        };
        mask.to_vec2::<f32>()
            .unwrap()
            .into_iter()
            .map(|row| (0..row.len()).filter(|&j| row[j] == 0.0).collect())
            .collect()
    }

    #[test]
    fn causal_and_sliding_window_masks() {
        // A chunk of 3 queries at positions 2..5: causal.
        assert_eq!(
            visible(2, 3, None),
            vec![vec![0, 1, 2], vec![0, 1, 2, 3], vec![0, 1, 2, 3, 4]]
        );
        // Window 2: each query sees itself and one earlier position.
        assert_eq!(visible(2, 2, Some(2)), vec![vec![1, 2], vec![2, 3]]);
        // A single decode token inside the window needs no mask; past it, it does.
        assert_eq!(visible(3, 1, None), vec![vec![0, 1, 2, 3]]);
        assert_eq!(visible(5, 1, Some(3)), vec![vec![3, 4, 5]]);
    }
}

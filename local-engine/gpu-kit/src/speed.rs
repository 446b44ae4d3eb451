//! The speed measurements (`speed`): a Llama-shaped model of about 1.24 B parameters (the
//! shape of Llama 3.2 1B: hidden 2048, 16 layers, 32 query / 8 KV heads, vocabulary 128256, tied
//! embeddings) with random bf16 weights drawn on the device, so nothing large travels.
//!
//! The model directory is written to the run's work folder: config.json (also read by the
//! PyTorch anchor, so both run the same shapes), model.safetensors (weights drawn with cuRAND
//! on the GPU, copied out once) and the correctness model's tokenizer files. Then the engine
//! loads it like any model and the kit measures, in this order:
//!
//! - prefill: time to the first token of one request (chunked prefill, manifest checksum and
//!   handoff to decode included), as tokens/s, median of a few repeats;
//! - decode at batch 1, 8 and 32: tokens/s while all requests of the batch decode together
//!   (after the last one joined, until the first one stops);
//! - the device's copy bandwidth, and the fraction of it (and of the datasheet peak, where the
//!   kit knows the GPU) that batch-1 decode reaches: bytes of weights and KV read per token
//!   times tokens/s.
//!
//! The CPU dry run measures the same on a small model with smaller prompts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use canarygate_engine::{DeviceKind, Engine, EngineConfig, EngineHandle, Event, GenerationRequest};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Shape of the speed model, as config.json states it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shape {
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
    /// Token ids.
    pub vocab_size: usize,
}

impl Shape {
    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Parameters, embedding and lm_head tied (counted once).
    pub fn parameters(&self) -> usize {
        let (h, kv, i) = (
            self.hidden_size,
            self.num_kv_heads * self.head_dim(),
            self.intermediate_size,
        );
        let layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h;
        self.vocab_size * h + self.num_layers * layer + h
    }

    /// KV bytes one token occupies in the pool (all layers, K and V).
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim() * dtype_bytes
    }
}

/// What is measured, and on which model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// `cuda` or `cpu`.
    pub device: String,
    /// `bfloat16` or `float32`.
    pub dtype: String,
    /// The model directory (config.json, model.safetensors).
    pub model_dir: PathBuf,
    /// Its shape.
    pub shape: Shape,
    /// Prompt lengths of the prefill measurements.
    pub prefill_lengths: Vec<usize>,
    /// Repeats of each prefill measurement (the median is reported).
    pub prefill_repeats: usize,
    /// Batch sizes of the decode measurements.
    pub decode_batches: Vec<usize>,
    /// Prompt length of each decode request.
    pub decode_prompt: usize,
    /// Decode steps measured with the whole batch running.
    pub decode_steps: usize,
}

/// The GPU's shape (Llama 3.2 1B) and workload.
fn gpu_workload(model_dir: PathBuf) -> Workload {
    Workload {
        device: "cuda".into(),
        dtype: "bfloat16".into(),
        model_dir,
        shape: Shape {
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 16,
            num_heads: 32,
            num_kv_heads: 8,
            vocab_size: 128_256,
        },
        prefill_lengths: vec![512, 8192],
        prefill_repeats: 3,
        decode_batches: vec![1, 8, 32],
        decode_prompt: 128,
        decode_steps: 64,
    }
}

/// The dry run's: same structure, sized for two CPU cores. The longer prompt still spans two
/// prefill chunks.
fn cpu_workload(model_dir: PathBuf) -> Workload {
    Workload {
        device: "cpu".into(),
        dtype: "float32".into(),
        model_dir,
        shape: Shape {
            hidden_size: 256,
            intermediate_size: 768,
            num_layers: 4,
            num_heads: 8,
            num_kv_heads: 2,
            vocab_size: 2048,
        },
        prefill_lengths: vec![64, 640],
        prefill_repeats: 2,
        decode_batches: vec![1, 8, 32],
        decode_prompt: 32,
        decode_steps: 16,
    }
}

/// A prefill measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prefill {
    /// Prompt tokens.
    pub tokens: usize,
    /// Seconds to the first token, per repeat.
    pub seconds: Vec<f64>,
    /// Tokens per second of the median repeat.
    pub tokens_per_s: f64,
}

/// A decode measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decode {
    /// Requests decoding together.
    pub batch: usize,
    /// Generated tokens per second over the window, all requests together.
    pub tokens_per_s: f64,
    /// Milliseconds per decode step (one token for every request).
    pub step_ms: f64,
    /// Tokens counted in the window.
    pub window_tokens: usize,
    /// Mean context (prompt + generated) of a request during the window.
    pub mean_context: f64,
}

/// Memory traffic of batch-1 decode against the device's bandwidth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bandwidth {
    /// Device-to-device copy, bytes read plus written per second.
    pub copy_bytes_per_s: f64,
    /// Datasheet peak of the GPU, where the kit knows it.
    pub peak_bytes_per_s: Option<f64>,
    /// Where that peak comes from.
    pub peak_source: Option<String>,
    /// Weight bytes plus KV bytes read per batch-1 decode token.
    pub bytes_per_token: f64,
    /// `bytes_per_token` times batch-1 tokens/s.
    pub decode_bytes_per_s: f64,
    /// `decode_bytes_per_s / copy_bytes_per_s`.
    pub fraction_of_copy: f64,
    /// `decode_bytes_per_s / peak_bytes_per_s`.
    pub fraction_of_peak: Option<f64>,
}

/// `speed.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Speed {
    /// What was measured.
    pub workload: Workload,
    /// Parameters of the model.
    pub parameters: usize,
    /// Bytes of its weights as stored.
    pub weight_bytes: usize,
    /// Seconds to draw and write the weights.
    pub write_seconds: f64,
    /// Seconds for the engine to load them and start.
    pub load_seconds: f64,
    /// Prefill measurements.
    pub prefill: Vec<Prefill>,
    /// Decode measurements.
    pub decode: Vec<Decode>,
    /// Bandwidth of batch-1 decode.
    pub bandwidth: Option<Bandwidth>,
    /// Wall time of the whole phase.
    pub seconds: f64,
}

/// Datasheet memory bandwidth by GPU name: NVIDIA H200 Tensor Core GPU datasheet, 4.8 TB/s
/// (HBM3e, 141 GB).
fn datasheet_peak(gpu_name: &str) -> Option<(f64, &'static str)> {
    gpu_name
        .contains("H200")
        .then_some((4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s"))
}

/// config.json of the speed model: a standard Hugging Face Llama config (Llama 3 RoPE scaling
/// as Llama 3.2 1B has it), with no end-of-sequence token so that no measured request stops
/// early.
fn config_json(shape: &Shape, dtype: &str) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim(),
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": true,
        "attention_bias": false,
        "mlp_bias": false,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    })
}

/// Draws the weights on `device` (uniform, scaled by fan-in so activations stay O(1)), casts
/// them to `dtype` there and writes them to `dir/model.safetensors`. Returns their bytes.
fn write_weights(
    dir: &Path,
    shape: &Shape,
    device: &Device,
    dtype: DType,
) -> Result<usize, String> {
    let s = shape;
    let (h, q, kv, i) = (
        s.hidden_size,
        s.num_heads * s.head_dim(),
        s.num_kv_heads * s.head_dim(),
        s.intermediate_size,
    );
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut put =
        |name: String, dims: &[usize], fan_in: Option<usize>| -> candle_core::Result<()> {
            let t = match fan_in {
                // Uniform(-a, a) has std a / sqrt(3): a = sqrt(3 / fan_in) gives std 1 / sqrt(fan_in).
                Some(fan_in) => {
                    let a = (3.0 / fan_in as f64).sqrt();
                    Tensor::rand(-a as f32, a as f32, dims, device)?.to_dtype(dtype)?
                }
                // Norm weights.
                None => Tensor::ones(dims, dtype, device)?,
            };
            tensors.insert(name, t);
            Ok(())
        };
    let mut build = || -> candle_core::Result<()> {
        put(
            "model.embed_tokens.weight".into(),
            &[s.vocab_size, h],
            Some(h),
        )?;
        for l in 0..s.num_layers {
            let p = format!("model.layers.{l}");
            put(format!("{p}.input_layernorm.weight"), &[h], None)?;
            put(format!("{p}.post_attention_layernorm.weight"), &[h], None)?;
            put(format!("{p}.self_attn.q_proj.weight"), &[q, h], Some(h))?;
            put(format!("{p}.self_attn.k_proj.weight"), &[kv, h], Some(h))?;
            put(format!("{p}.self_attn.v_proj.weight"), &[kv, h], Some(h))?;
            put(format!("{p}.self_attn.o_proj.weight"), &[h, q], Some(q))?;
            put(format!("{p}.mlp.gate_proj.weight"), &[i, h], Some(h))?;
            put(format!("{p}.mlp.up_proj.weight"), &[i, h], Some(h))?;
            put(format!("{p}.mlp.down_proj.weight"), &[h, i], Some(i))?;
        }
        put("model.norm.weight".into(), &[h], None)?;
        Ok(())
    };
    build().map_err(|e| format!("drawing weights: {e}"))?;
    let bytes = tensors
        .values()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))
        .map_err(|e| format!("writing weights: {e}"))?;
    Ok(bytes)
}

/// Writes the speed model into `dir`: config, weights drawn on `device`, the tokenizer files of
/// the kit's correctness model.
fn write_model(
    dir: &Path,
    kit_model: &Path,
    shape: &Shape,
    device: &Device,
    dtype: DType,
    dtype_name: &str,
) -> Result<usize, String> {
    let io = |e: std::io::Error| format!("writing {}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(
        dir.join("config.json"),
        config_json(shape, dtype_name).to_string(),
    )
    .map_err(io)?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(kit_model.join(file), dir.join(file)).map_err(io)?;
    }
    write_weights(dir, shape, device, dtype)
}

fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7_919 + salt * 104_729 + 11) % vocab) as u32)
        .collect()
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds from submission to the first token of one request of `len` tokens.
fn time_to_first_token(
    engine: &EngineHandle,
    len: usize,
    salt: usize,
    vocab: usize,
) -> Result<f64, String> {
    let started = Instant::now();
    let generation = engine
        .submit(GenerationRequest::greedy(prompt(len, salt, vocab), 1))
        .map_err(|e| e.to_string())?;
    // The first event is the first token, unless the request failed or ended without one.
    match generation.into_iter().next() {
        Some(Event::Token { .. }) => Ok(started.elapsed().as_secs_f64()),
        Some(Event::Failed(e)) => Err(e.to_string()),
        Some(Event::Done { .. }) | None => Err("the request ended without a token".into()),
    }
}

/// Decode tokens/s with `batch` requests of `prompt_len` tokens running together.
///
/// The window opens when the last request has its first token (every prefill done) and
/// closes when the request that joined last has produced `steps` more; requests are long
/// enough not to end before. Then every request is dropped, which ends it in the engine.
fn decode(
    engine: &EngineHandle,
    batch: usize,
    prompt_len: usize,
    steps: usize,
    vocab: usize,
) -> Result<Decode, String> {
    let (tx, rx) = mpsc::channel::<Result<usize, String>>();
    let stop = Arc::new(AtomicBool::new(false));
    // Long enough for every prefill of the batch to finish while the first requests decode.
    let max_tokens = steps * 4 + batch * 16;
    let mut readers = Vec::new();
    for b in 0..batch {
        let generation = engine
            .submit(GenerationRequest::greedy(
                prompt(prompt_len, b, vocab),
                max_tokens,
            ))
            .map_err(|e| e.to_string())?;
        let (tx, stop) = (tx.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            for event in generation {
                if stop.load(Ordering::Relaxed) {
                    return; // dropping the generation ends the request
                }
                let message = match event {
                    Event::Token { .. } => Ok(b),
                    Event::Done { .. } => Err(format!("request {b} ended inside the window")),
                    Event::Failed(e) => Err(e.to_string()),
                };
                let end = message.is_err();
                if tx.send(message).is_err() || end {
                    return;
                }
            }
        }));
    }
    drop(tx);
    let mut generated = vec![0usize; batch];
    let mut window: Option<(Instant, usize)> = None; // (opened at, joined last)
    let mut counted = 0;
    let mut context_sum = 0usize;
    let mut outcome = Err("every request ended before the window closed".to_string());
    for message in rx.iter() {
        let b = match message {
            Ok(b) => b,
            Err(e) => {
                outcome = Err(e);
                break;
            }
        };
        generated[b] += 1;
        match window {
            None if generated.iter().all(|&g| g > 0) => window = Some((Instant::now(), b)),
            None => {}
            Some((opened, last)) => {
                counted += 1;
                context_sum += prompt_len + generated[b];
                if b == last && generated[b] > steps {
                    let seconds = opened.elapsed().as_secs_f64();
                    let tokens_per_s = counted as f64 / seconds;
                    outcome = Ok(Decode {
                        batch,
                        tokens_per_s,
                        step_ms: 1e3 * batch as f64 / tokens_per_s,
                        window_tokens: counted,
                        mean_context: context_sum as f64 / counted as f64,
                    });
                    break;
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(rx);
    for reader in readers {
        let _ = reader.join();
    }
    outcome
}

/// Device-to-device copy bandwidth (bytes read plus written per second) of a large buffer.
fn copy_bandwidth(device: &Device) -> Result<f64, String> {
    let run = || -> candle_core::Result<f64> {
        let elements = if device.is_cpu() { 64 << 20 } else { 512 << 20 };
        let x = Tensor::zeros(elements, DType::F32, device)?;
        let bytes = 2.0 * (elements * 4) as f64;
        let _warm = x.copy()?;
        device.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let started = Instant::now();
            let y = x.copy()?;
            device.synchronize()?;
            best = best.min(started.elapsed().as_secs_f64());
            drop(y);
        }
        Ok(bytes / best)
    };
    run().map_err(|e| format!("copy bandwidth: {e}"))
}

/// Runs the speed phase: writes the model into `work/speed-model` and its workload into
/// `work/speed-workload.json` (for the PyTorch anchor), then measures.
pub fn run(
    kit: &Path,
    work: &Path,
    device_kind: DeviceKind,
    gpu_name: &str,
) -> Result<Speed, String> {
    let started = Instant::now();
    let model_dir = work.join("speed-model");
    let (workload, device, dtype) = match device_kind {
        DeviceKind::Cpu => (cpu_workload(model_dir.clone()), Device::Cpu, DType::F32),
        DeviceKind::Cuda(ordinal) => (
            gpu_workload(model_dir.clone()),
            Device::new_cuda(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?,
            DType::BF16,
        ),
    };
    let text = serde_json::to_string_pretty(&workload).map_err(|e| e.to_string())?;
    std::fs::write(work.join("speed-workload.json"), text).map_err(|e| e.to_string())?;
    let shape = workload.shape.clone();
    let vocab = shape.vocab_size;

    let t = Instant::now();
    let weight_bytes = write_model(
        &model_dir,
        &kit.join("model"),
        &shape,
        &device,
        dtype,
        &workload.dtype,
    )?;
    let write_seconds = t.elapsed().as_secs_f64();
    eprintln!(
        "speed model: {:.2} B parameters, {:.2} GB of weights written in {write_seconds:.1} s",
        shape.parameters() as f64 / 1e9,
        weight_bytes as f64 / 1e9
    );

    let longest = workload.prefill_lengths.iter().copied().max().unwrap_or(0);
    let dtype_bytes = dtype.size_in_bytes();
    // Room for the longest prompt and for every decode batch at once, twice over.
    let decode_tokens = workload.decode_batches.iter().copied().max().unwrap_or(1)
        * (workload.decode_prompt + workload.decode_steps * 4 + 32 * 16);
    let pool_tokens = 2 * longest.max(decode_tokens);
    let t = Instant::now();
    let engine = Engine::start(EngineConfig {
        device: device_kind,
        kv_budget_bytes: pool_tokens * shape.kv_bytes_per_token(dtype_bytes),
        max_batch: workload.decode_batches.iter().copied().max().unwrap_or(1),
        ..EngineConfig::new(&model_dir)
    })
    .map_err(|e| format!("engine start: {e}"))?;
    let load_seconds = t.elapsed().as_secs_f64();
    eprintln!(
        "engine loaded in {load_seconds:.1} s; window {}",
        engine.context_window()
    );

    // Warm-up: every kernel the measurements use (chunked prefill, batched decode).
    time_to_first_token(&engine, 600.min(engine.context_window() - 1), 99, vocab)?;
    decode(&engine, 2, 16, 4, vocab)?;

    let mut prefill = Vec::new();
    for &len in &workload.prefill_lengths {
        let seconds = (0..workload.prefill_repeats)
            .map(|r| time_to_first_token(&engine, len, r, vocab))
            .collect::<Result<Vec<f64>, String>>()?;
        let tokens_per_s = len as f64 / median(&seconds);
        eprintln!("prefill {len} tokens: {tokens_per_s:.0} tokens/s ({seconds:.3?} s)");
        prefill.push(Prefill {
            tokens: len,
            seconds,
            tokens_per_s,
        });
    }
    let mut decodes = Vec::new();
    for &batch in &workload.decode_batches {
        let d = decode(
            &engine,
            batch,
            workload.decode_prompt,
            workload.decode_steps,
            vocab,
        )?;
        eprintln!(
            "decode batch {batch}: {:.1} tokens/s, {:.2} ms per step",
            d.tokens_per_s, d.step_ms
        );
        decodes.push(d);
    }
    drop(engine);

    let bandwidth = match decodes.iter().find(|d| d.batch == 1) {
        Some(d) => {
            let copy = copy_bandwidth(&device)?;
            let kv_read = d.mean_context * shape.kv_bytes_per_token(dtype_bytes) as f64;
            let bytes_per_token = weight_bytes as f64 + kv_read;
            let decode_bytes_per_s = bytes_per_token * d.tokens_per_s;
            let peak = datasheet_peak(gpu_name).filter(|_| !device.is_cpu());
            Some(Bandwidth {
                copy_bytes_per_s: copy,
                peak_bytes_per_s: peak.map(|p| p.0),
                peak_source: peak.map(|p| p.1.to_string()),
                bytes_per_token,
                decode_bytes_per_s,
                fraction_of_copy: decode_bytes_per_s / copy,
                fraction_of_peak: peak.map(|p| decode_bytes_per_s / p.0),
            })
        }
        None => None,
    };
    let _ = std::fs::remove_file(model_dir.join("model.safetensors"));
    Ok(Speed {
        parameters: shape.parameters(),
        workload,
        weight_bytes,
        write_seconds,
        load_seconds,
        prefill,
        decode: decodes,
        bandwidth,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_model_is_llama_3_2_1b_sized() {
        let w = gpu_workload(PathBuf::new());
        // Llama 3.2 1B: 1.236 B parameters with tied embeddings.
        assert_eq!(w.shape.parameters(), 1_235_814_400);
        // 16 layers x K and V x 8 heads x 64 dims x 2 bytes.
        assert_eq!(w.shape.kv_bytes_per_token(2), 32_768);
        let config = config_json(&w.shape, "bfloat16");
        let parsed =
            canarygate_engine::config::ModelConfig::from_json(&config.to_string()).unwrap();
        assert_eq!(parsed.head_dim, 64);
        assert!(parsed.tie_word_embeddings && parsed.eos_token_ids.is_empty());
        assert!(parsed.rope_scaling.is_some());
    }

    #[test]
    fn only_known_gpus_get_a_datasheet_peak() {
        assert_eq!(datasheet_peak("NVIDIA H200").map(|p| p.0), Some(4.8e12));
        assert_eq!(datasheet_peak("NVIDIA A10G"), None);
    }
}

//! Throughput of the engine against candle-transformers' Llama on the same random ~100M
//! parameter model, CPU f32, measured in the same run.
//!
//! `cargo bench -p canarygate-engine` (set `BENCH_DECODE_STEPS` / `BENCH_PROMPT` to change the
//! workload). Prints tokens/s and ratios against the reference:
//! - prefill tokens/s (engine: one request of `BENCH_PROMPT` tokens, including the manifest
//!   checksum and handoff; reference: one forward over the prompt);
//! - decode tokens/s at batch 1 and batch 8 (engine) vs the reference's sequential decode.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use canarygate_engine::{
    Engine, EngineConfig, EngineHandle, Event, GenerationRequest, TinyModel, write_tiny_model,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 131 + salt * 7919 + 3) % 30_000)
        .collect()
}

fn argmax(xs: &[f32]) -> u32 {
    xs.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0 as u32
}

/// Reference: prefill time and sequential greedy decode tokens/s.
fn reference(dir: &Path, prompt: &[u32], steps: usize) -> (Duration, f64) {
    let dev = Device::Cpu;
    let cfg: llama::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    // SAFETY: the bench owns the files and does not modify them while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &dev)
            .unwrap()
    };
    let model = llama::Llama::load(vb, &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &dev).unwrap();
    let input = Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap();
    let t = Instant::now();
    let logits = model.forward(&input, 0, &mut cache).unwrap();
    let prefill = t.elapsed();
    let mut next = argmax(&logits.squeeze(0).unwrap().to_vec1().unwrap());
    let t = Instant::now();
    for i in 0..steps {
        let input = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        let logits = model.forward(&input, prompt.len() + i, &mut cache).unwrap();
        next = argmax(&logits.squeeze(0).unwrap().to_vec1().unwrap());
    }
    (prefill, steps as f64 / t.elapsed().as_secs_f64())
}

/// Engine: submits `batch` requests at once and returns (time to the first token of the first
/// request, decode tokens/s while all `batch` requests decode together). The decode window opens
/// when every request has its first token (all prefills done, so prefill does not compete for
/// the CPU) and closes when the last request to join has produced `steps` more tokens; requests
/// are long enough that none finishes inside the window, so the batch stays at `batch`.
fn engine_run(
    engine: &EngineHandle,
    prompt_len: usize,
    batch: usize,
    steps: usize,
) -> (Duration, f64) {
    let (tx, rx) = mpsc::channel::<(usize, Instant)>();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let workers: Vec<_> = (0..batch)
        .map(|b| {
            let request =
                GenerationRequest::greedy(prompt(prompt_len, b as u32), 8 * steps + batch * 64);
            let generation = engine.submit(request).unwrap();
            let (tx, stop) = (tx.clone(), stop.clone());
            std::thread::spawn(move || {
                // Dropping `generation` when told to stop ends the request in the engine.
                for event in generation {
                    match event {
                        Event::Token { .. } if stop.load(Ordering::Relaxed) => return,
                        Event::Token { .. } => tx.send((b, Instant::now())).unwrap(),
                        // An end-of-sequence token ends a request early: the batch shrinks.
                        Event::Done { .. } => return,
                        Event::Failed(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    drop(tx);
    let mut first: Vec<Option<Instant>> = vec![None; batch];
    let mut window_start = None;
    let mut in_window = 0;
    let mut last_joined = 0;
    let mut last_joined_tokens = 0;
    let mut window_end = start;
    for (b, t) in rx.iter() {
        if first[b].is_none() {
            first[b] = Some(t);
            if first.iter().all(Option::is_some) {
                window_start = Some(t);
                last_joined = b;
            }
            continue;
        }
        if window_start.is_some() {
            in_window += 1;
            window_end = t;
            if b == last_joined {
                last_joined_tokens += 1;
                if last_joined_tokens == steps {
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
    for w in workers {
        w.join().unwrap();
    }
    let ttft = first[0].unwrap() - start;
    let window = window_end - window_start.unwrap();
    (ttft, in_window as f64 / window.as_secs_f64())
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: skip the slow run there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("throughput: skipped (run with `cargo bench -p canarygate-engine`)");
        return;
    }
    let prompt_len = env_usize("BENCH_PROMPT", 128);
    let steps = env_usize("BENCH_DECODE_STEPS", 32);
    let spec = TinyModel {
        hidden_size: 768,
        intermediate_size: 2048,
        num_layers: 12,
        num_heads: 12,
        num_kv_heads: 4,
        vocab_size: 32_000,
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        seed: 1,
        ..TinyModel::default()
    };
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &spec).unwrap();
    let h = spec.hidden_size;
    let params = spec.vocab_size * h
        + spec.num_layers
            * (2 * h * h
                + 2 * h * (h / spec.num_heads * spec.num_kv_heads)
                + 3 * h * spec.intermediate_size);
    println!(
        "model: random Llama, {:.1}M parameters, CPU f32, {} threads",
        params as f64 / 1e6,
        candle_core::utils::get_num_threads()
    );
    println!("workload: prompt {prompt_len} tokens, {steps} decode steps");

    let (ref_prefill, ref_decode) = reference(dir.path(), &prompt(prompt_len, 0), steps);
    let ref_prefill_tps = prompt_len as f64 / ref_prefill.as_secs_f64();

    let engine = Engine::start(EngineConfig {
        kv_budget_bytes: 256 << 20,
        ..EngineConfig::new(dir.path())
    })
    .unwrap();
    // Warm up allocations and caches once.
    engine_run(&engine, 16, 1, 4);
    let (ttft, decode_1) = engine_run(&engine, prompt_len, 1, steps);
    let prefill_tps = prompt_len as f64 / ttft.as_secs_f64();
    let (_, decode_8) = engine_run(&engine, prompt_len, 8, steps);

    println!();
    println!("| measurement | canarygate engine | candle-transformers llama | ratio | target |");
    println!("|---|---|---|---|---|");
    println!(
        "| prefill tokens/s ({prompt_len}-token prompt) | {prefill_tps:.0} | {ref_prefill_tps:.0} | {:.2}x | |",
        prefill_tps / ref_prefill_tps
    );
    println!(
        "| decode tokens/s, batch 1 | {decode_1:.1} | {ref_decode:.1} (sequential) | {:.2}x | >= 0.8x |",
        decode_1 / ref_decode
    );
    println!(
        "| decode tokens/s, batch 8 | {decode_8:.1} | {ref_decode:.1} (sequential) | {:.2}x | >= 3x |",
        decode_8 / ref_decode
    );
}

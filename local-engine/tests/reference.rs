//! Logits of the engine (paged KV, batched decode, preemption) against candle-transformers'
//! own Llama and Qwen2 on tiny random models.

use std::path::Path;

use canarygate_engine::config::Architecture;
use canarygate_engine::{
    Completion, Engine, EngineConfig, GenerationRequest, TinyModel, write_tiny_model,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2};

/// A reference model's forward: (new token ids, position of the first) -> last logits.
type Forward = Box<dyn FnMut(&[u32], usize) -> Vec<f32>>;

/// Greedy decoding with a reference model: logits after the prompt and after each generated
/// token, `steps` rows.
fn reference_logits(dir: &Path, arch: Architecture, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let dev = Device::Cpu;
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    // SAFETY: test-owned files, not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &dev)
            .unwrap()
    };
    let mut forward: Forward = match arch {
        Architecture::Qwen2 => {
            let cfg: qwen2::Config = serde_json::from_str(&config).unwrap();
            let mut model = qwen2::ModelForCausalLM::new(&cfg, vb).unwrap();
            Box::new(move |ids, pos| {
                let input = Tensor::new(ids, &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let logits = model.forward(&input, pos).unwrap();
                logits.flatten_all().unwrap().to_vec1().unwrap()
            })
        }
        _ => {
            let cfg: llama::LlamaConfig = serde_json::from_str(&config).unwrap();
            let cfg = cfg.into_config(false);
            let model = llama::Llama::load(vb, &cfg).unwrap();
            let mut cache = llama::Cache::new(true, DType::F32, &cfg, &dev).unwrap();
            Box::new(move |ids, pos| {
                let input = Tensor::new(ids, &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let logits = model.forward(&input, pos, &mut cache).unwrap();
                logits.flatten_all().unwrap().to_vec1().unwrap()
            })
        }
    };
    let mut rows = vec![forward(prompt, 0)];
    let mut pos = prompt.len();
    while rows.len() < steps {
        let last = rows.last().unwrap();
        let next = argmax(last);
        rows.push(forward(&[next], pos));
        pos += 1;
    }
    rows
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

/// max |a - b| / max |b| over one row.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    diff / scale
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 31 + salt * 17 + 5) % 250)
        .collect()
}

/// Runs `prompts` concurrently through one engine and checks every generated position's logits
/// against the reference.
fn check_against_reference(
    spec: TinyModel,
    config: impl Fn(&Path) -> EngineConfig,
    lens: &[usize],
    steps: usize,
) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &spec).unwrap();
    let engine = Engine::start(config(dir.path())).unwrap();
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, i as u32))
        .collect();
    let generations: Vec<_> = prompts
        .iter()
        .map(|p| {
            let request = GenerationRequest {
                return_logits: true,
                ..GenerationRequest::greedy(p.clone(), steps)
            };
            engine.submit(request).unwrap()
        })
        .collect();
    let completions: Vec<Completion> = generations.into_iter().map(|g| g.wait().unwrap()).collect();
    assert!(
        completions.iter().any(|c| c.token_ids.len() == steps),
        "every request stopped early; the comparison would cover too few decode steps"
    );
    for (p, c) in prompts.iter().zip(&completions) {
        let reference = reference_logits(dir.path(), spec.architecture, p, c.logits.len());
        assert!(!c.logits.is_empty());
        for (step, (ours, theirs)) in c.logits.iter().zip(&reference).enumerate() {
            let err = relative_error(ours, theirs);
            assert!(
                err < 1e-4,
                "prompt of {} tokens, step {step}: relative error {err}",
                p.len()
            );
        }
        let greedy: Vec<u32> = reference.iter().map(|r| argmax(r)).collect();
        assert_eq!(
            c.token_ids,
            greedy[..c.token_ids.len()],
            "prompt of {} tokens",
            p.len()
        );
    }
    let stats = engine.stats();
    assert_eq!(stats.free_pages, stats.total_pages, "pages leaked");
    stats.preemptions
}

fn roomy(dir: &Path) -> EngineConfig {
    EngineConfig {
        page_size: 4,
        kv_budget_bytes: 4 << 20,
        max_context: Some(512),
        ..EngineConfig::new(dir)
    }
}

#[test]
fn llama_batched_paged_matches_reference() {
    check_against_reference(TinyModel::default(), roomy, &[1, 3, 17, 40, 9], 24);
}

#[test]
fn llama3_rope_scaling_tied_embeddings_matches_reference() {
    let spec = TinyModel {
        llama3_rope_scaling: true,
        tie_word_embeddings: true,
        num_kv_heads: 1,
        seed: 3,
        ..TinyModel::default()
    };
    check_against_reference(spec, roomy, &[5, 70, 33], 40);
}

#[test]
fn qwen2_batched_paged_matches_reference() {
    let spec = TinyModel {
        architecture: Architecture::Qwen2,
        seed: 5,
        ..TinyModel::default()
    };
    check_against_reference(spec, roomy, &[2, 25, 50, 7], 24);
}

#[test]
fn chunked_prefill_and_preemption_match_reference() {
    // 2 layers x (K, V) x 4 positions x 2 kv heads x 16 dims x 4 bytes = 2 KiB per page;
    // 24 pages hold 96 tokens, so the four requests (up to 70 tokens each) cannot all be
    // resident: decode must preempt and recompute.
    let small = |dir: &Path| EngineConfig {
        page_size: 4,
        kv_budget_bytes: 48 << 10,
        prefill_chunk: 7,
        ..EngineConfig::new(dir)
    };
    let preemptions = check_against_reference(
        TinyModel {
            seed: 9,
            ..TinyModel::default()
        },
        small,
        &[10, 20, 30, 45],
        25,
    );
    assert!(preemptions > 0, "the pool was meant to force preemption");
}

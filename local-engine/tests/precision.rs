//! `EngineConfig::precision`: bf16 on the CPU (the GPU kit's dry run runs its bf16 checks so).

use canarygate_engine::{
    Engine, EngineConfig, GenerationRequest, Precision, TinyModel, write_tiny_model,
};

/// max |a - b| / max |b| over one row.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    diff / b.iter().map(|y| y.abs()).fold(0.0, f32::max)
}

#[test]
fn bf16_halves_the_kv_per_token_and_stays_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(
        dir.path(),
        &TinyModel {
            seed: 31,
            ..TinyModel::default()
        },
    )
    .unwrap();
    let start = |precision| {
        Engine::start(EngineConfig {
            kv_budget_bytes: 1 << 20,
            precision,
            ..EngineConfig::new(dir.path())
        })
        .unwrap()
    };
    let f32_engine = start(None);
    let bf16_engine = start(Some(Precision::Bf16));
    // Same budget, half the bytes per position.
    assert_eq!(
        bf16_engine.capacity().pool_tokens,
        2 * f32_engine.capacity().pool_tokens
    );
    let request = || GenerationRequest {
        return_logits: true,
        ..GenerationRequest::greedy((1..40).collect(), 1)
    };
    let exact = f32_engine.submit(request()).unwrap().wait().unwrap();
    let rounded = bf16_engine.submit(request()).unwrap().wait().unwrap();
    let error = relative_error(&rounded.logits[0], &exact.logits[0]);
    // bf16 really is in use (the logits are not f32's), and it stays within a few percent.
    assert!(
        error > 1e-5,
        "bf16 logits equal f32's: precision ignored ({error})"
    );
    assert!(error < 5e-2, "bf16 logits too far from f32's ({error})");
    // An explicit F32 is the CPU's default.
    let explicit = start(Some(Precision::F32));
    let same = explicit.submit(request()).unwrap().wait().unwrap();
    assert_eq!(same.logits, exact.logits);
}

//! Isolation between requests: rejected requests change nothing, freed pages leak nothing.

use std::path::Path;

use canarygate_engine::{
    AdmissionError, Engine, EngineConfig, EngineHandle, GenerationRequest, TinyModel,
    write_tiny_model,
};

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(
        dir.path(),
        &TinyModel {
            seed: 11,
            ..TinyModel::default()
        },
    )
    .unwrap();
    dir
}

/// 16 pages of 4 positions (2 KiB each): the pool (and so the context window) holds 64 tokens.
fn small_pool(dir: &Path) -> EngineConfig {
    EngineConfig {
        page_size: 4,
        kv_budget_bytes: 32 << 10,
        ..EngineConfig::new(dir)
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + salt * 13 + 1) % 250)
        .collect()
}

fn greedy_with_logits(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        return_logits: true,
        ..GenerationRequest::greedy(prompt, max_tokens)
    }
}

/// Submits `prompts` (greedy, 12 tokens) and returns each result's token ids, or the admission
/// error.
fn run_all(engine: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Result<Vec<u32>, AdmissionError>> {
    let submitted: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(GenerationRequest::greedy(p.clone(), 12)))
        .collect();
    submitted
        .into_iter()
        .map(|s| s.map(|g| g.wait().unwrap().token_ids))
        .collect()
}

#[test]
fn oversized_request_is_rejected_and_changes_nothing_for_others() {
    let dir = model_dir();
    let engine = Engine::start(small_pool(dir.path())).unwrap();
    assert_eq!(engine.capacity().pool_tokens, 64);
    assert_eq!(engine.context_window(), 64);
    let a = prompt(20, 1);
    let too_big = prompt(100, 2);
    let c = prompt(9, 3);

    let with = run_all(&engine, &[a.clone(), too_big, c.clone()]);
    match &with[1] {
        Err(AdmissionError::ContextLengthExceeded {
            requested,
            prompt_tokens,
            limit,
        }) => {
            assert_eq!((*requested, *prompt_tokens, *limit), (112, 100, 64));
            let message = with[1].as_ref().unwrap_err().to_string();
            assert!(
                message.contains("112") && message.contains("64"),
                "{message}"
            );
        }
        other => panic!("expected a context-length rejection, got {other:?}"),
    }
    // Rejection allocated nothing; everything admitted was freed.
    let stats = engine.stats();
    assert_eq!(stats.free_pages, stats.total_pages);

    let fresh = Engine::start(small_pool(dir.path())).unwrap();
    let without = run_all(&fresh, &[a, c]);
    assert_eq!(with[0], without[0]);
    assert_eq!(with[2], without[1]);
}

#[test]
fn pages_reused_after_free_do_not_leak() {
    let dir = model_dir();
    // Request A fills 15 of the 16 pages with its KV, finishes, and frees them.
    let engine = Engine::start(small_pool(dir.path())).unwrap();
    let a = engine
        .submit(greedy_with_logits(prompt(50, 4), 10))
        .unwrap()
        .wait()
        .unwrap();
    assert!(!a.token_ids.is_empty());
    let stats = engine.stats();
    assert_eq!(stats.free_pages, stats.total_pages);

    // Request B now runs on A's old pages; its logits must equal those of a fresh engine.
    let b_prompt = prompt(30, 5);
    let reused = engine
        .submit(greedy_with_logits(b_prompt.clone(), 20))
        .unwrap()
        .wait()
        .unwrap();
    let fresh = Engine::start(small_pool(dir.path())).unwrap();
    let clean = fresh
        .submit(greedy_with_logits(b_prompt, 20))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(reused.token_ids, clean.token_ids);
    assert_eq!(reused.logits.len(), clean.logits.len());
    for (step, (x, y)) in reused.logits.iter().zip(&clean.logits).enumerate() {
        assert!(
            x.iter().all(|v| v.is_finite()),
            "step {step}: non-finite logits (stale page read)"
        );
        assert_eq!(x, y, "step {step}: logits differ after page reuse");
    }
}

#[test]
fn context_window_never_exceeds_the_pool() {
    let dir = model_dir();
    // With margin 2.0 the 64-token pool may only advertise 32 tokens.
    let engine = Engine::start(EngineConfig {
        kv_margin: 2.0,
        ..small_pool(dir.path())
    })
    .unwrap();
    assert_eq!(engine.context_window(), 32);
    let err = engine
        .submit(GenerationRequest::greedy(prompt(30, 0), 3))
        .unwrap_err();
    assert!(matches!(
        err,
        AdmissionError::ContextLengthExceeded {
            requested: 33,
            limit: 32,
            ..
        }
    ));
    // Asking for more context than the pool can hold refuses to start.
    let refused = Engine::start(EngineConfig {
        max_context: Some(100),
        ..small_pool(dir.path())
    });
    let message = refused.err().expect("start must fail").to_string();
    assert!(
        message.contains("100") && message.contains("64"),
        "{message}"
    );
}

#[test]
fn bad_requests_get_clear_errors() {
    let dir = model_dir();
    let engine = Engine::start(small_pool(dir.path())).unwrap();
    assert!(matches!(
        engine.submit(GenerationRequest::greedy(vec![], 3)),
        Err(AdmissionError::Invalid(_))
    ));
    assert!(matches!(
        engine.submit(GenerationRequest::greedy(vec![99_999], 3)),
        Err(AdmissionError::Invalid(_))
    ));
    assert!(matches!(
        engine.submit(GenerationRequest::greedy(vec![1], 0)),
        Err(AdmissionError::Invalid(_))
    ));
    let unknown = tempfile::tempdir().unwrap();
    std::fs::write(unknown.path().join("config.json"), r#"{"architectures": ["BertModel"], "hidden_size": 8,
        "intermediate_size": 8, "vocab_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}"#).unwrap();
    let err = Engine::start(EngineConfig::new(unknown.path()))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("unsupported architecture"), "{err}");
}

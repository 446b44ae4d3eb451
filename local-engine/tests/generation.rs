//! Generation behaviour: stop strings, streaming, seeded sampling, chat prompts.

use canarygate_engine::{
    ChatMessage, Engine, EngineConfig, EngineHandle, Event, FinishReason, GenerationRequest,
    SamplingParams, TinyModel, write_tiny_model,
};

fn engine() -> (tempfile::TempDir, EngineHandle) {
    engine_of(
        TinyModel {
            seed: 21,
            ..TinyModel::default()
        },
        1 << 20,
    )
}

/// An engine serving `model` with a KV pool of `kv_budget_bytes`.
fn engine_of(model: TinyModel, kv_budget_bytes: usize) -> (tempfile::TempDir, EngineHandle) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &model).unwrap();
    let engine = Engine::start(EngineConfig {
        kv_budget_bytes,
        ..EngineConfig::new(dir.path())
    })
    .unwrap();
    (dir, engine)
}

/// ASCII prompt bytes are token ids in the tiny tokenizer.
fn ids(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[test]
fn stop_string_truncates_text_and_stream_matches() {
    let (_dir, engine) = engine();
    let full = engine
        .submit(GenerationRequest::greedy(ids("The quick brown fox"), 40))
        .unwrap()
        .wait()
        .unwrap();
    let chars: Vec<char> = full.text.chars().collect();
    assert!(
        chars.len() >= 8,
        "too little text to pick a stop string: {:?}",
        full.text
    );
    let stop: String = chars[4..6].iter().collect();
    let expected = &full.text[..full.text.find(&stop).unwrap()];

    let request = GenerationRequest {
        stop: vec![stop.clone()],
        ..GenerationRequest::greedy(ids("The quick brown fox"), 40)
    };
    let mut streamed = String::new();
    let mut finish = None;
    for event in engine.submit(request).unwrap() {
        match event {
            Event::Token { text, .. } => streamed.push_str(&text),
            Event::Done { finish_reason, .. } => finish = Some(finish_reason),
            Event::Failed(e) => panic!("{e}"),
        }
    }
    assert_eq!(streamed, expected, "stop {stop:?}");
    assert_eq!(finish, Some(FinishReason::StopString(0)));
    assert_eq!(full.finish_reason, FinishReason::Length);
    assert_eq!(full.usage.completion_tokens, 40);
}

#[test]
fn seeded_sampling_is_reproducible_under_concurrency() {
    let (_dir, engine) = engine();
    let request = |seed| GenerationRequest {
        prompt: ids("sampling"),
        max_tokens: Some(30),
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 50,
            seed,
        },
        stop: Vec::new(),
        return_logits: false,
    };
    let alone = engine.submit(request(7)).unwrap().wait().unwrap();
    // The same request again, now batched with others.
    let batch: Vec<_> = [7, 8, 7]
        .into_iter()
        .map(|s| engine.submit(request(s)).unwrap())
        .collect();
    let results: Vec<_> = batch
        .into_iter()
        .map(|g| g.wait().unwrap().token_ids)
        .collect();
    assert_eq!(results[0], alone.token_ids);
    assert_eq!(results[2], alone.token_ids);
    assert_ne!(
        results[1], alone.token_ids,
        "a different seed should sample differently"
    );
}

#[test]
fn chat_prompt_uses_the_model_template() {
    let (_dir, engine) = engine();
    let prompt = engine
        .chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }])
        .unwrap();
    let text = engine.tokenizer().decode(&prompt, false).unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

/// A caller that stops waiting for a whole answer stops its generation:
/// the KV pages come back at once, not when `max_tokens` is reached. The
/// same request run to its end first shows how long that would take.
#[test]
fn a_whole_answer_nobody_waits_for_stops_and_frees_its_pages() {
    use std::time::{Duration, Instant};

    let (_dir, engine) = engine_of(
        TinyModel {
            // Greedy, this one writes 3,000 tokens without an end of text.
            seed: 1,
            max_position_embeddings: 4096,
            ..TinyModel::default()
        },
        4 << 20,
    );
    let body = serde_json::json!({"model": "tiny", "max_tokens": 3000, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell a long story"}]});
    let all_free = |engine: &EngineHandle| {
        let stats = engine.stats();
        stats.free_pages == stats.total_pages
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    let started = Instant::now();
    let whole = runtime
        .block_on(
            canarygate_engine::openai::start_chat(&engine, &body, "tiny")
                .unwrap()
                .complete(),
        )
        .unwrap();
    let takes = started.elapsed();
    assert_eq!(whole["choices"][0]["finish_reason"], "length", "{whole}");
    assert!(all_free(&engine));

    // The same request, its caller gone after a tenth of that.
    runtime.block_on(async {
        let call = canarygate_engine::openai::start_chat(&engine, &body, "tiny").unwrap();
        let waited = tokio::time::timeout(takes / 10, call.complete()).await;
        assert!(waited.is_err(), "done within a tenth of {takes:?}");
    });
    let dropped = Instant::now();
    while !all_free(&engine) {
        assert!(
            dropped.elapsed() < takes / 3,
            "pages still held {:?} after the caller left (the whole answer takes {takes:?})",
            dropped.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "whole answer {takes:?}; pages back {:?} after the caller left",
        dropped.elapsed()
    );
}

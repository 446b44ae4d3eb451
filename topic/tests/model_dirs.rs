//! Loading model directories: a tiny valid one written here, then each way one can be broken.
//! Every broken directory is a typed error, never a panic.

use std::collections::HashMap;
use std::path::Path;

use canarygate_topic::{Embedder, TopicError};
use candle_core::{DType, Device, Tensor};

const HIDDEN: usize = 8;
const INTERMEDIATE: usize = 16;
const VOCAB: usize = 6;

fn config(model_type: &str, hidden: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["BertModel"], "model_type": model_type,
        "vocab_size": VOCAB, "hidden_size": hidden, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": INTERMEDIATE, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "max_position_embeddings": 16, "type_vocab_size": 2,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0
    })
}

/// A word-level tokenizer over `words`, with BERT's [CLS] ... [SEP] template.
fn tokenizer(words: &[&str]) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(id, word)| (word.to_string(), id.into()))
        .collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

const WORDS: [&str; VOCAB] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world"];

/// Random BERT weights for `hidden`-wide layers, named as Hugging Face saves them.
fn weights(path: &Path, hidden: usize) {
    let device = Device::Cpu;
    let mut tensors = HashMap::new();
    let mut add = |name: &str, shape: &[usize]| {
        let tensor = Tensor::randn(0f32, 0.5, shape, &device).unwrap();
        tensors.insert(name.to_string(), tensor);
    };
    add("embeddings.word_embeddings.weight", &[VOCAB, hidden]);
    add("embeddings.position_embeddings.weight", &[16, hidden]);
    add("embeddings.token_type_embeddings.weight", &[2, hidden]);
    add("embeddings.LayerNorm.weight", &[hidden]);
    add("embeddings.LayerNorm.bias", &[hidden]);
    let layer = "encoder.layer.0";
    for part in ["query", "key", "value"] {
        add(
            &format!("{layer}.attention.self.{part}.weight"),
            &[hidden, hidden],
        );
        add(&format!("{layer}.attention.self.{part}.bias"), &[hidden]);
    }
    add(
        &format!("{layer}.attention.output.dense.weight"),
        &[hidden, hidden],
    );
    add(&format!("{layer}.attention.output.dense.bias"), &[hidden]);
    add(
        &format!("{layer}.attention.output.LayerNorm.weight"),
        &[hidden],
    );
    add(
        &format!("{layer}.attention.output.LayerNorm.bias"),
        &[hidden],
    );
    add(
        &format!("{layer}.intermediate.dense.weight"),
        &[INTERMEDIATE, hidden],
    );
    add(&format!("{layer}.intermediate.dense.bias"), &[INTERMEDIATE]);
    add(
        &format!("{layer}.output.dense.weight"),
        &[hidden, INTERMEDIATE],
    );
    add(&format!("{layer}.output.dense.bias"), &[hidden]);
    add(&format!("{layer}.output.LayerNorm.weight"), &[hidden]);
    add(&format!("{layer}.output.LayerNorm.bias"), &[hidden]);
    candle_core::safetensors::save(&tensors, path).unwrap();
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

fn modules(with_normalize: bool) -> serde_json::Value {
    let mut modules = vec![
        serde_json::json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
        serde_json::json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}),
    ];
    if with_normalize {
        modules.push(serde_json::json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    serde_json::Value::Array(modules)
}

/// A complete, tiny sentence-transformers directory in `dir/name`.
fn tiny_model(dir: &Path, name: &str) -> std::path::PathBuf {
    let dir = dir.join(name);
    write_json(&dir.join("config.json"), &config("bert", HIDDEN));
    write_json(&dir.join("tokenizer.json"), &tokenizer(&WORDS));
    write_json(&dir.join("modules.json"), &modules(true));
    write_json(
        &dir.join("sentence_bert_config.json"),
        &serde_json::json!({"max_seq_length": 8, "do_lower_case": false}),
    );
    write_json(
        &dir.join("1_Pooling/config.json"),
        &serde_json::json!({"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": true}),
    );
    weights(&dir.join("model.safetensors"), HIDDEN);
    dir
}

fn load_error(dir: &Path) -> TopicError {
    match Embedder::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(error) => error,
    }
}

#[test]
fn a_tiny_valid_directory_loads_and_embeds() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "tiny-bert");
    let embedder = Embedder::load(&dir).unwrap();
    assert_eq!(embedder.name(), "tiny-bert");
    assert_eq!(embedder.max_seq_length(), 8);
    // Three texts of different lengths in one padded batch; unknown words map to [UNK].
    let vectors = embedder
        .embed(&["hello", "hello world world", "Zürich ünïcödé"])
        .unwrap();
    assert_eq!(vectors.len(), 3);
    for vector in &vectors {
        assert_eq!(vector.len(), HIDDEN);
        let norm: f32 = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "normalised: {norm}");
    }
    // Padding must not change a text's embedding: alone or beside a longer text, the same.
    let alone = embedder.embed(&["hello"]).unwrap();
    for (x, y) in alone[0].iter().zip(&vectors[0]) {
        assert!(
            (x - y).abs() < 1e-5,
            "padding changed the embedding: {x} vs {y}"
        );
    }
    // Past max_seq_length (8 with [CLS]/[SEP]) the rest is cut off.
    let long = embedder
        .embed(&[
            "hello world hello world hello world hello world",
            "hello world hello world hello world world world",
        ])
        .unwrap();
    assert_eq!(long[0], long[1]);
    assert!(embedder.embed(&[]).unwrap().is_empty());
}

#[test]
fn without_normalize_the_vectors_are_raw_means() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "raw");
    write_json(&dir.join("modules.json"), &modules(false));
    let vectors = Embedder::load(&dir)
        .unwrap()
        .embed(&["hello world"])
        .unwrap();
    let norm: f32 = vectors[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!(
        (norm - 1.0).abs() > 1e-3,
        "not normalised, yet the norm is {norm}"
    );
}

#[test]
fn empty_text_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let embedder = Embedder::load(&tiny_model(root.path(), "m")).unwrap();
    for texts in [&["hello", ""][..], &[" \n\t"][..]] {
        match embedder.embed(texts) {
            Err(TopicError::EmptyText(what)) => assert!(what.starts_with("text ")),
            other => panic!("{texts:?}: {other:?}"),
        }
    }
}

#[test]
fn each_missing_file_is_named() {
    for file in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "modules.json",
        "1_Pooling/config.json",
    ] {
        let root = tempfile::tempdir().unwrap();
        let dir = tiny_model(root.path(), "m");
        std::fs::remove_file(dir.join(file)).unwrap();
        match load_error(&dir) {
            TopicError::MissingFile(path) => assert!(path.ends_with(file), "{path:?}"),
            other => panic!("without {file}: {other:?}"),
        }
    }
    // sentence_bert_config.json is optional, its default 256 tokens; this tiny model has only
    // 16 positions, so the default does not fit and is refused clearly.
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    std::fs::remove_file(dir.join("sentence_bert_config.json")).unwrap();
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("max_seq_length 256")),
        "{error:?}"
    );
    assert!(matches!(
        load_error(&root.path().join("no-such-dir")),
        TopicError::MissingFile(_)
    ));
}

#[test]
fn a_config_that_is_not_bert_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    write_json(&dir.join("config.json"), &config("gpt2", HIDDEN));
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("\"gpt2\"")),
        "{error:?}"
    );
    // A BERT model_type with BERT's fields missing.
    write_json(
        &dir.join("config.json"),
        &serde_json::json!({"model_type": "bert", "hidden_size": 8}),
    );
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("not a BERT configuration")),
        "{error:?}"
    );
    // Not JSON at all.
    std::fs::write(dir.join("config.json"), b"{ this is not json").unwrap();
    assert!(matches!(load_error(&dir), TopicError::Config { .. }));
}

#[test]
fn a_pooling_other_than_the_mean_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    write_json(
        &dir.join("1_Pooling/config.json"),
        &serde_json::json!({"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}),
    );
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("only mean pooling")),
        "{error:?}"
    );
    // Mean and max together is not the mean either.
    write_json(
        &dir.join("1_Pooling/config.json"),
        &serde_json::json!({"pooling_mode_max_tokens": true, "pooling_mode_mean_tokens": true}),
    );
    assert!(matches!(load_error(&dir), TopicError::Config { .. }));
}

#[test]
fn an_unknown_module_in_the_pipeline_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let mut pipeline = modules(false);
    pipeline.as_array_mut().unwrap().push(serde_json::json!(
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    ));
    write_json(&dir.join("modules.json"), &pipeline);
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("Dense")),
        "{error:?}"
    );
    write_json(&dir.join("modules.json"), &serde_json::json!([]));
    assert!(matches!(load_error(&dir), TopicError::Config { .. }));
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    // Weights for 4-wide layers under a config that says 8.
    weights(&dir.join("model.safetensors"), 4);
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Model(message) if message.contains("do not fit")),
        "{error:?}"
    );
    // A truncated or garbage file.
    std::fs::write(dir.join("model.safetensors"), b"\x10\0\0\0\0\0\0\0{}").unwrap();
    assert!(matches!(load_error(&dir), TopicError::Model(_)));
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    assert!(matches!(load_error(&dir), TopicError::Model(_)));
    // A valid file holding only one of the tensors.
    let mut tensors = HashMap::new();
    tensors.insert(
        "embeddings.word_embeddings.weight".to_string(),
        Tensor::zeros((VOCAB, HIDDEN), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    assert!(matches!(load_error(&dir), TopicError::Model(_)));
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = tiny_model(root.path(), "m");
    let mut words = WORDS.to_vec();
    words.push("extra");
    write_json(&dir.join("tokenizer.json"), &tokenizer(&words));
    let error = load_error(&dir);
    assert!(
        matches!(&error, TopicError::Config { message, .. } if message.contains("vocab_size")),
        "{error:?}"
    );
    std::fs::write(dir.join("tokenizer.json"), b"[]").unwrap();
    assert!(matches!(load_error(&dir), TopicError::Tokenizer(_)));
}

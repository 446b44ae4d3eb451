//! Where the tests and benchmarks find the real model, all-MiniLM-L6-v2.

use std::path::PathBuf;

/// The model directory: `CANARYGATE_TOPIC_MODEL`, else the default path that
/// `scripts/embedding-model.sh` fills; a missing model is a failure naming the script.
pub fn model_dir() -> PathBuf {
    if let Ok(path) = std::env::var("CANARYGATE_TOPIC_MODEL") {
        return PathBuf::from(path);
    }
    let default =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/all-MiniLM-L6-v2");
    assert!(
        default.join("model.safetensors").exists(),
        "{} is missing: run scripts/embedding-model.sh (scripts/test.sh does) \
         or set CANARYGATE_TOPIC_MODEL",
        default.display()
    );
    default
}

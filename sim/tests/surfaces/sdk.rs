//! The real clients as the judge: the official openai and anthropic Python
//! SDKs (pinned in scripts/requirements-test.txt) against the simulator on
//! a real socket, every surface plain and streamed (`sdk_surfaces.py`).

use std::path::PathBuf;
use std::process::Command;

use crate::common::Sim;
use canarygate_sim::SimConfig;

/// The Python with both SDKs: `CANARYGATE_PYTHON` (scripts/test.sh sets
/// it), else the workspace's `.venv`.
fn python() -> PathBuf {
    if let Ok(path) = std::env::var("CANARYGATE_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run scripts/test.sh (it creates the venv with the SDKs) or set \
         CANARYGATE_PYTHON",
        venv.display()
    );
    venv
}

#[test]
fn the_official_sdks_speak_every_surface() {
    let sim = Sim::start(SimConfig::default());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/surfaces/sdk_surfaces.py");
    let output = Command::new(python())
        .arg(&script)
        .arg(&sim.url)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let results: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    for surface in [
        "responses",
        "completions",
        "embeddings",
        "messages",
        "errors",
    ] {
        assert_eq!(results[surface], "ok", "{stdout}");
    }
}

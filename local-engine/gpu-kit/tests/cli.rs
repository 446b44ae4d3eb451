//! The kit's binary as `scripts/gpu-kit.sh` calls it: a kit that is missing
//! or damaged is an error that names what is wrong (exit 2), not a panic and
//! not a report that passed. (It also makes `cargo test --workspace` build
//! the binary, which the CPU dry run in `scripts/test.sh` reuses.)

use std::process::{Command, Output};

fn kit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canarygate-gpu-kit"))
        .args(args)
        .output()
        .expect("the kit's binary runs")
}

#[test]
fn a_missing_kit_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let kit_dir = dir.path().join("no-kit");
    let kit_path = kit_dir.to_str().unwrap();
    let out = dir.path().join("correctness.json");
    for args in [
        vec!["correctness", "--kit", kit_path, "--device", "cpu"],
        vec!["report", "--kit", kit_path, "--mode", "cpu"],
    ] {
        let mut args = args.clone();
        args.extend(["--out", out.to_str().unwrap()]);
        if args[0] == "report" {
            args.extend(["--work", dir.path().to_str().unwrap()]);
        }
        let output = kit(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("no-kit"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!out.exists(), "{args:?} wrote a result");
    }
}

#[test]
fn a_damaged_kit_json_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kit.json"), "{not json").unwrap();
    let path = dir.path().to_str().unwrap();
    let output = kit(&[
        "report", "--kit", path, "--work", path, "--mode", "cpu", "--out", path,
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("kit.json"), "{stderr}");
    assert!(!dir.path().join("gpu-report.md").exists());
}

//! The report (`report`): what the phases wrote, merged into `gpu-report.json` and
//! `gpu-report.md`.
//!
//! A phase that did not finish leaves no file; the report says so and fails. The run passes
//! when every correctness check passed and the speed phase finished; the PyTorch anchor is
//! reported, never required (it needs torch, which the dry run's machines lack).

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::correctness::Correctness;
use crate::speed::Speed;

/// `kit.json`: how the kit was built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KitInfo {
    /// `cuda` or `cpu`.
    pub mode: String,
    /// `git describe` of the tree it was built from.
    pub git: String,
    /// nvcc version that compiled the kernels (`none` for a CPU build).
    pub nvcc: String,
    /// What the kernels were compiled for.
    pub kernels: String,
    /// When it was built (UTC).
    pub built: String,
}

/// One PyTorch prefill measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnchorPrefill {
    /// Prompt tokens.
    pub tokens: usize,
    /// Tokens per second of the median repeat.
    pub tokens_per_s: f64,
}

/// One PyTorch decode measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnchorDecode {
    /// Batch size.
    pub batch: usize,
    /// Generated tokens per second, all sequences together.
    pub tokens_per_s: f64,
}

/// `anchor.json`, written by `local-engine/gpu-kit/torch_anchor.py`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Anchor {
    /// `ok`, `skipped` or `failed`.
    pub status: String,
    /// Why it was skipped or failed.
    #[serde(default)]
    pub reason: Option<String>,
    /// torch version.
    #[serde(default)]
    pub torch: Option<String>,
    /// transformers version.
    #[serde(default)]
    pub transformers: Option<String>,
    /// Attention implementation transformers used.
    #[serde(default)]
    pub attn_implementation: Option<String>,
    /// Prefill measurements.
    #[serde(default)]
    pub prefill: Vec<AnchorPrefill>,
    /// Decode measurements.
    #[serde(default)]
    pub decode: Vec<AnchorDecode>,
}

/// Everything the report is made of. `None`: that phase left no file.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The kit.
    pub kit: KitInfo,
    /// `cuda` or `cpu`: how the kit was run.
    pub mode: String,
    /// When it ran (UTC).
    pub date: String,
    /// Seconds the run had taken when the report was written.
    pub elapsed_seconds: f64,
    /// The GPU as nvidia-smi names it (empty without one).
    pub gpu: String,
    /// Directories the CUDA libraries were loaded from.
    pub library_path: String,
    /// The correctness phase.
    pub correctness: Option<Correctness>,
    /// The speed phase.
    pub speed: Option<Speed>,
    /// The PyTorch anchor.
    pub anchor: Option<Anchor>,
}

/// One row of the engine-against-PyTorch table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// What was measured.
    pub measurement: String,
    /// The engine's tokens/s.
    pub engine: f64,
    /// PyTorch's tokens/s on the same shapes, if it ran.
    pub pytorch: Option<f64>,
    /// engine / PyTorch.
    pub ratio: Option<f64>,
}

fn rows(speed: &Speed, anchor: Option<&Anchor>) -> Vec<Row> {
    let anchor = anchor.filter(|a| a.status == "ok");
    let row = |measurement: String, engine: f64, pytorch: Option<f64>| Row {
        measurement,
        engine,
        pytorch,
        ratio: pytorch.filter(|&p| p > 0.0).map(|p| engine / p),
    };
    let mut rows = Vec::new();
    for p in &speed.prefill {
        let theirs = anchor.and_then(|a| a.prefill.iter().find(|x| x.tokens == p.tokens));
        rows.push(row(
            format!("prefill tokens/s, {}-token prompt", p.tokens),
            p.tokens_per_s,
            theirs.map(|x| x.tokens_per_s),
        ));
    }
    for d in &speed.decode {
        let theirs = anchor.and_then(|a| a.decode.iter().find(|x| x.batch == d.batch));
        rows.push(row(
            format!("decode tokens/s, batch {}", d.batch),
            d.tokens_per_s,
            theirs.map(|x| x.tokens_per_s),
        ));
    }
    rows
}

/// What the dry run leaves out, and why.
fn skipped(inputs: &Inputs) -> Vec<String> {
    let mut skipped = Vec::new();
    if inputs.mode == "cpu" {
        skipped.push(
            "GPU: this is the dry run; every check ran on the CPU (f32, and bf16 in candle's CPU \
             kernels), not in CUDA kernels"
                .to_string(),
        );
        if let Some(s) = &inputs.speed {
            let w = &s.workload;
            skipped.push(format!(
                "1.24 B-parameter model: the dry run's speed model has {} parameters \
                 (hidden {}, {} layers) in {}, and prompts of {:?} tokens instead of 512 and \
                 8192",
                parameters(s.parameters),
                w.shape.hidden_size,
                w.shape.num_layers,
                w.dtype,
                w.prefill_lengths,
            ));
        }
        skipped.push(
            "memory bandwidth: the dry run's model fits in the CPU's caches, so its fraction of \
             the copy bandwidth means nothing, and there is no datasheet peak"
                .to_string(),
        );
    }
    match &inputs.anchor {
        Some(a) if a.status == "ok" => {}
        Some(a) => skipped.push(format!(
            "PyTorch anchor: {} ({})",
            a.status,
            a.reason.as_deref().unwrap_or("no reason given")
        )),
        None => skipped.push("PyTorch anchor: it left no result (see gpu-kit.log)".to_string()),
    }
    skipped
}

fn problems(inputs: &Inputs) -> Vec<String> {
    let mut problems = Vec::new();
    match &inputs.correctness {
        None => problems.push("the correctness phase did not finish (see gpu-kit.log)".into()),
        Some(c) => {
            for check in c.checks.iter().filter(|c| !c.passed) {
                problems.push(format!("check `{}` failed: {}", check.name, check.detail));
            }
            if c.checks.is_empty() {
                problems.push("the correctness phase ran no check".into());
            }
        }
    }
    if inputs.speed.is_none() {
        problems.push("the speed phase did not finish (see gpu-kit.log)".into());
    }
    if inputs.kit.mode != inputs.mode && inputs.mode == "cuda" {
        problems.push(format!("a {} kit was run on a GPU", inputs.kit.mode));
    }
    problems
}

fn parameters(n: usize) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.1} M", n as f64 / 1e6)
    }
}

fn si(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e12 {
        format!("{:.2} TB/s", bytes_per_s / 1e12)
    } else {
        format!("{:.1} GB/s", bytes_per_s / 1e9)
    }
}

fn tokens_per_s(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// The report as JSON and as Markdown.
pub fn render(inputs: &Inputs) -> (Value, String) {
    let problems = problems(inputs);
    let skipped = skipped(inputs);
    let passed = problems.is_empty();
    let table = inputs
        .speed
        .as_ref()
        .map(|s| rows(s, inputs.anchor.as_ref()))
        .unwrap_or_default();
    let json = json!({
        "passed": passed,
        "date": inputs.date,
        "mode": inputs.mode,
        "elapsed_seconds": inputs.elapsed_seconds,
        "gpu": inputs.gpu,
        "library_path": inputs.library_path,
        "kit": inputs.kit,
        "correctness": inputs.correctness,
        "speed": inputs.speed,
        "anchor": inputs.anchor,
        "engine_vs_pytorch": table,
        "skipped": skipped,
        "problems": problems,
    });

    let mut md = String::new();
    let title = if inputs.mode == "cpu" {
        "Local engine GPU kit: CPU dry run"
    } else {
        "Local engine on a GPU: kit report"
    };
    let _ = writeln!(md, "# {title}\n");
    let _ = writeln!(
        md,
        "**{}**, {}, {:.0} s in all.\n",
        if passed { "PASSED" } else { "FAILED" },
        inputs.date,
        inputs.elapsed_seconds
    );
    let device = if inputs.gpu.is_empty() {
        "no GPU (CPU)"
    } else {
        &inputs.gpu
    };
    let _ = writeln!(md, "- device: {device}");
    let k = &inputs.kit;
    if k.mode == "cuda" {
        let _ = writeln!(
            md,
            "- kit: CUDA build of {}, kernels {} by nvcc {}, built {}",
            k.git, k.kernels, k.nvcc, k.built
        );
    } else {
        let _ = writeln!(
            md,
            "- kit: {} build of {}, built {}",
            k.mode, k.git, k.built
        );
    }
    if !inputs.library_path.is_empty() {
        let _ = writeln!(
            md,
            "- CUDA libraries searched in: `{}`",
            inputs.library_path
        );
    }

    let _ = writeln!(md, "\n## Correctness\n");
    match &inputs.correctness {
        Some(c) => {
            let _ = writeln!(
                md,
                "Against the CPU f32 reference built with the kit, on {} ({:.0} s).\n",
                c.device, c.seconds
            );
            let _ = writeln!(md, "| check | result | detail |\n|---|---|---|");
            for check in &c.checks {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} |",
                    check.name,
                    if check.passed { "pass" } else { "**FAIL**" },
                    check.detail.replace('|', "\\|")
                );
            }
        }
        None => {
            let _ = writeln!(md, "Did not finish: see gpu-kit.log.");
        }
    }

    let _ = writeln!(md, "\n## Speed\n");
    match &inputs.speed {
        Some(s) => {
            let w = &s.workload;
            let _ = writeln!(
                md,
                "Llama-shaped model, {} parameters (hidden {}, {} layers, {} / {} heads, \
                 vocabulary {}), {}, random weights drawn on the device. Decode requests have \
                 {}-token prompts; {} steps measured with the whole batch running.\n",
                parameters(s.parameters),
                w.shape.hidden_size,
                w.shape.num_layers,
                w.shape.num_heads,
                w.shape.num_kv_heads,
                w.shape.vocab_size,
                w.dtype,
                w.decode_prompt,
                w.decode_steps
            );
            let anchor = inputs.anchor.as_ref().filter(|a| a.status == "ok");
            let anchor_name = match anchor {
                Some(a) => format!(
                    "PyTorch eager (torch {}, transformers {}, {} attention)",
                    a.torch.as_deref().unwrap_or("?"),
                    a.transformers.as_deref().unwrap_or("?"),
                    a.attn_implementation.as_deref().unwrap_or("?")
                ),
                None => "PyTorch eager (did not run)".to_string(),
            };
            let _ = writeln!(
                md,
                "| measurement | canarygate engine | {anchor_name} | engine / PyTorch |\n|---|---|---|---|"
            );
            for row in &table {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} |",
                    row.measurement,
                    tokens_per_s(row.engine),
                    row.pytorch.map_or("—".to_string(), tokens_per_s),
                    row.ratio.map_or("—".to_string(), |r| format!("{r:.2}x"))
                );
            }
            if let Some(b) = &s.bandwidth {
                let _ = write!(
                    md,
                    "\nBatch-1 decode reads {:.2} GB per token (weights and KV): {}, {:.1} % of \
                     the measured copy bandwidth ({})",
                    b.bytes_per_token / 1e9,
                    si(b.decode_bytes_per_s),
                    100.0 * b.fraction_of_copy,
                    si(b.copy_bytes_per_s)
                );
                match (b.fraction_of_peak, &b.peak_source) {
                    (Some(f), Some(source)) => {
                        let _ = writeln!(
                            md,
                            " and {:.1} % of the datasheet peak ({source}).",
                            100.0 * f
                        );
                    }
                    _ => {
                        let _ = writeln!(md, ".");
                    }
                }
            }
            let _ = writeln!(
                md,
                "\nWeights drawn and written in {:.1} s, loaded in {:.1} s; the phase took {:.0} s.",
                s.write_seconds, s.load_seconds, s.seconds
            );
        }
        None => {
            let _ = writeln!(md, "Did not finish: see gpu-kit.log.");
        }
    }
    if !skipped.is_empty() {
        let _ = writeln!(md, "\n## Not measured in this run\n");
        for s in &skipped {
            let _ = writeln!(md, "- {s}");
        }
    }
    if !problems.is_empty() {
        let _ = writeln!(md, "\n## Problems\n");
        for p in &problems {
            let _ = writeln!(md, "- {p}");
        }
    }
    (json, md)
}

/// Reads a phase's JSON file; `None` when the phase left none (or an unreadable one, which is
/// reported on stderr).
pub fn read_optional<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    let text = std::fs::read_to_string(path).ok()?;
    match serde_json::from_str(&text) {
        Ok(v) => Some(v),
        Err(e) => {
            eprintln!("gpu-kit report: {} is unreadable: {e}", path.display());
            None
        }
    }
}

/// Writes `gpu-report.json` and `gpu-report.md` into `out`; returns whether the run passed.
pub fn write(inputs: &Inputs, out: &Path) -> Result<bool, String> {
    let (json, md) = render(inputs);
    let io = |e: std::io::Error| format!("writing the report into {}: {e}", out.display());
    std::fs::create_dir_all(out).map_err(io)?;
    let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    std::fs::write(out.join("gpu-report.json"), text).map_err(io)?;
    std::fs::write(out.join("gpu-report.md"), md).map_err(io)?;
    Ok(json["passed"] == Value::Bool(true))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::correctness::Check;
    use crate::speed::{Bandwidth, Decode, Prefill, Shape, Workload};

    fn kit(mode: &str) -> KitInfo {
        KitInfo {
            mode: mode.into(),
            git: "abc1234".into(),
            nvcc: "13.0.88".into(),
            kernels: "compute_90a PTX".into(),
            built: "2026-12-01T00:00:00Z".into(),
        }
    }

    fn check(name: &str, passed: bool) -> Check {
        Check {
            name: name.into(),
            passed,
            detail: format!("{name} detail"),
            metrics: Value::Null,
        }
    }

    fn speed() -> Speed {
        Speed {
            workload: Workload {
                device: "cuda".into(),
                dtype: "bfloat16".into(),
                model_dir: PathBuf::from("/tmp/m"),
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
                decode_batches: vec![1, 8],
                decode_prompt: 128,
                decode_steps: 64,
            },
            parameters: 1_235_814_400,
            weight_bytes: 2_471_628_800,
            write_seconds: 4.0,
            load_seconds: 2.0,
            prefill: vec![
                Prefill {
                    tokens: 512,
                    seconds: vec![0.05],
                    tokens_per_s: 10_240.0,
                },
                Prefill {
                    tokens: 8192,
                    seconds: vec![1.0],
                    tokens_per_s: 8192.0,
                },
            ],
            decode: vec![
                Decode {
                    batch: 1,
                    tokens_per_s: 200.0,
                    step_ms: 5.0,
                    window_tokens: 64,
                    mean_context: 160.0,
                },
                Decode {
                    batch: 8,
                    tokens_per_s: 1000.0,
                    step_ms: 8.0,
                    window_tokens: 512,
                    mean_context: 170.0,
                },
            ],
            bandwidth: Some(Bandwidth {
                copy_bytes_per_s: 4.0e12,
                peak_bytes_per_s: Some(4.8e12),
                peak_source: Some("NVIDIA H200 datasheet: 4.8 TB/s".into()),
                bytes_per_token: 2.5e9,
                decode_bytes_per_s: 5.0e11,
                fraction_of_copy: 0.125,
                fraction_of_peak: Some(5.0e11 / 4.8e12),
            }),
            seconds: 30.0,
        }
    }

    fn anchor() -> Anchor {
        Anchor {
            status: "ok".into(),
            reason: None,
            torch: Some("2.11.0".into()),
            transformers: Some("5.17.0".into()),
            attn_implementation: Some("sdpa".into()),
            prefill: vec![AnchorPrefill {
                tokens: 512,
                tokens_per_s: 20_480.0,
            }],
            decode: vec![AnchorDecode {
                batch: 1,
                tokens_per_s: 50.0,
            }],
        }
    }

    fn inputs() -> Inputs {
        Inputs {
            kit: kit("cuda"),
            mode: "cuda".into(),
            date: "2026-12-02T10:00:00Z".into(),
            elapsed_seconds: 150.0,
            gpu: "NVIDIA H200, 143771 MiB, 580.159.04".into(),
            library_path: "/opt/nvidia/cu13/lib".into(),
            correctness: Some(Correctness {
                device: "cuda:0".into(),
                checks: vec![check("f32", true), check("bf16", true)],
                seconds: 12.0,
            }),
            speed: Some(speed()),
            anchor: Some(anchor()),
        }
    }

    #[test]
    fn a_complete_run_passes_with_ratios_against_pytorch() {
        let (json, md) = render(&inputs());
        assert_eq!(json["passed"], true);
        assert_eq!(json["problems"].as_array().unwrap().len(), 0);
        let table = json["engine_vs_pytorch"].as_array().unwrap();
        assert_eq!(table.len(), 4);
        assert_eq!(table[0]["ratio"], 0.5);
        assert_eq!(table[2]["ratio"], 4.0);
        // PyTorch has no 8192-token or batch-8 figure here: no ratio, not a zero.
        assert_eq!(table[1]["ratio"], Value::Null);
        assert!(md.contains("**PASSED**"), "{md}");
        assert!(
            md.contains("| prefill tokens/s, 512-token prompt | 10240 | 20480 | 0.50x |"),
            "{md}"
        );
        assert!(
            md.contains("| decode tokens/s, batch 1 | 200 | 50.0 | 4.00x |"),
            "{md}"
        );
        assert!(
            md.contains("| decode tokens/s, batch 8 | 1000 | — | — |"),
            "{md}"
        );
        assert!(md.contains("transformers 5.17.0, sdpa attention"), "{md}");
        assert!(
            md.contains("12.5 % of the measured copy bandwidth (4.00 TB/s)"),
            "{md}"
        );
        assert!(md.contains("10.4 % of the datasheet peak"), "{md}");
        assert!(md.contains("| f32 | pass | f32 detail |"), "{md}");
        assert!(!md.contains("## Problems"), "{md}");
    }

    #[test]
    fn a_failed_check_or_an_unfinished_phase_fails_the_run() {
        let mut failing = inputs();
        failing.correctness.as_mut().unwrap().checks[1] = check("bf16", false);
        let (json, md) = render(&failing);
        assert_eq!(json["passed"], false);
        assert!(
            md.contains("**FAILED**") && md.contains("| bf16 | **FAIL** |"),
            "{md}"
        );
        assert!(md.contains("check `bf16` failed: bf16 detail"), "{md}");

        let mut unfinished = inputs();
        unfinished.speed = None;
        let (json, md) = render(&unfinished);
        assert_eq!(json["passed"], false);
        assert!(md.contains("the speed phase did not finish"), "{md}");

        let mut no_checks = inputs();
        no_checks.correctness = None;
        assert_eq!(render(&no_checks).0["passed"], false);
    }

    #[test]
    fn a_dry_run_says_what_it_skipped() {
        let mut dry = inputs();
        dry.mode = "cpu".into();
        dry.kit = kit("cpu");
        dry.gpu = String::new();
        dry.anchor = Some(Anchor {
            status: "skipped".into(),
            reason: Some("torch is not importable".into()),
            ..anchor()
        });
        let (json, md) = render(&dry);
        assert_eq!(json["passed"], true);
        assert!(
            md.starts_with("# Local engine GPU kit: CPU dry run"),
            "{md}"
        );
        assert!(md.contains("device: no GPU (CPU)"), "{md}");
        assert!(
            md.contains("PyTorch anchor: skipped (torch is not importable)"),
            "{md}"
        );
        assert!(md.contains("every check ran on the CPU"), "{md}");
        assert!(md.contains("PyTorch eager (did not run)"), "{md}");
        // A skipped anchor leaves no ratios.
        assert!(
            json["engine_vs_pytorch"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["ratio"].is_null())
        );
    }

    #[test]
    fn the_report_files_are_written() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write(&inputs(), dir.path()).unwrap());
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("gpu-report.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(json["kit"]["nvcc"], "13.0.88");
        assert_eq!(json["speed"]["decode"][1]["batch"], 8);
        let md = std::fs::read_to_string(dir.path().join("gpu-report.md")).unwrap();
        assert!(md.contains("Local engine on a GPU"));
        assert_eq!(
            read_optional::<Anchor>(&dir.path().join("missing.json")),
            None
        );
    }
}

//! `canarygate-gpu-kit`: validates the local engine on a GPU in one short device window.
//!
//! `scripts/gpu-kit.sh` drives it; each subcommand is one phase and writes one JSON file:
//!
//! ```text
//! build machine (no GPU)                 GPU machine (no toolchain, no network)
//! prepare ─> kit/model, kit/reference.json, kit/kit.json
//!                                        correctness ─> correctness.json   (correctness.rs)
//!                                        speed ───────> speed.json         (speed.rs)
//!                                        torch_anchor.py ─> anchor.json    (PyTorch, if any)
//!                                        report ──────> gpu-report.json, gpu-report.md
//! ```
//!
//! `compare.rs` holds the tolerances and the comparison with the reference, `reference.rs` the
//! correctness model and how its prompts are chosen, `report.rs` the report.

mod compare;
mod correctness;
mod reference;
mod report;
mod speed;

use std::path::PathBuf;
use std::process::ExitCode;

use canarygate_engine::DeviceKind;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(about = "The local engine's GPU validation kit (see scripts/gpu-kit.sh)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// CUDA device 0.
    Cuda,
    /// The CPU (the dry run).
    Cpu,
}

impl Mode {
    fn device(self) -> DeviceKind {
        match self {
            Mode::Cuda => DeviceKind::Cuda(0),
            Mode::Cpu => DeviceKind::Cpu,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Cuda => "cuda",
            Mode::Cpu => "cpu",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build time: write the correctness model, its CPU reference and kit.json into the kit.
    Prepare {
        /// Kit directory.
        #[arg(long)]
        kit: PathBuf,
        /// What the kit's binary was built for.
        #[arg(long, value_enum)]
        mode: Mode,
        /// `git describe` of the tree.
        #[arg(long, default_value = "unknown")]
        git: String,
        /// nvcc version that compiled the kernels.
        #[arg(long, default_value = "none")]
        nvcc: String,
        /// What the kernels were compiled for.
        #[arg(long, default_value = "none")]
        kernels: String,
        /// Build time (UTC).
        #[arg(long, default_value = "unknown")]
        built: String,
    },
    /// Run the correctness checks on the device; exits 1 if one failed.
    Correctness {
        /// Kit directory.
        #[arg(long)]
        kit: PathBuf,
        /// Where to run.
        #[arg(long, value_enum)]
        device: Mode,
        /// Output JSON.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the speed model into the work folder and measure the engine on it.
    Speed {
        /// Kit directory (for the tokenizer files).
        #[arg(long)]
        kit: PathBuf,
        /// Work folder: the speed model and speed-workload.json go there.
        #[arg(long)]
        work: PathBuf,
        /// Where to run.
        #[arg(long, value_enum)]
        device: Mode,
        /// The GPU's name (nvidia-smi), for its datasheet bandwidth.
        #[arg(long, default_value = "")]
        gpu_name: String,
        /// Output JSON.
        #[arg(long)]
        out: PathBuf,
    },
    /// Merge the phases' files into gpu-report.json and gpu-report.md; exits 1 if the run failed.
    Report {
        /// Kit directory.
        #[arg(long)]
        kit: PathBuf,
        /// Work folder holding correctness.json, speed.json and anchor.json.
        #[arg(long)]
        work: PathBuf,
        /// How the kit was run.
        #[arg(long, value_enum)]
        mode: Mode,
        /// Report directory.
        #[arg(long)]
        out: PathBuf,
        /// When the run started (UTC).
        #[arg(long, default_value = "unknown")]
        date: String,
        /// Seconds the run has taken so far.
        #[arg(long, default_value_t = 0.0)]
        elapsed: f64,
        /// The GPU as nvidia-smi describes it.
        #[arg(long, default_value = "")]
        gpu: String,
        /// Where the CUDA libraries were looked for.
        #[arg(long, default_value = "")]
        library_path: String,
    },
}

fn write_json<T: serde::Serialize>(path: &std::path::Path, value: &T) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn run(command: Command) -> Result<bool, String> {
    match command {
        Command::Prepare {
            kit,
            mode,
            git,
            nvcc,
            kernels,
            built,
        } => {
            let reference = reference::prepare(&kit)?;
            for p in &reference.prompts {
                eprintln!(
                    "reference: prompt of {} tokens, {} greedy tokens, smallest top-logit margin {:.3}",
                    p.tokens.len(),
                    p.generated.len(),
                    p.min_margin
                );
            }
            let info = report::KitInfo {
                mode: mode.name().into(),
                git,
                nvcc,
                kernels,
                built,
            };
            write_json(&kit.join("kit.json"), &info)?;
            Ok(true)
        }
        Command::Correctness { kit, device, out } => {
            let result = correctness::run(&kit, device.device())?;
            write_json(&out, &result)?;
            Ok(result.passed())
        }
        Command::Speed {
            kit,
            work,
            device,
            gpu_name,
            out,
        } => {
            let result = speed::run(&kit, &work, device.device(), &gpu_name)?;
            write_json(&out, &result)?;
            Ok(true)
        }
        Command::Report {
            kit,
            work,
            mode,
            out,
            date,
            elapsed,
            gpu,
            library_path,
        } => {
            let kit_info: report::KitInfo = report::read_optional(&kit.join("kit.json"))
                .ok_or_else(|| format!("no readable kit.json in {}", kit.display()))?;
            let inputs = report::Inputs {
                kit: kit_info,
                mode: mode.name().into(),
                date,
                elapsed_seconds: elapsed,
                gpu,
                library_path,
                correctness: report::read_optional(&work.join("correctness.json")),
                speed: report::read_optional(&work.join("speed.json")),
                anchor: report::read_optional(&work.join("anchor.json")),
            };
            report::write(&inputs, &out)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("canarygate-gpu-kit: {e}");
            ExitCode::from(2)
        }
    }
}

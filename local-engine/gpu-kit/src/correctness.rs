//! The correctness checks (`correctness`): the engine on the device against the kit's CPU
//! reference.
//!
//! | check | engine | passes when |
//! |---|---|---|
//! | `f32` | f32, roomy pool, all prompts at once | every prompt within [`compare::F32`] |
//! | `bf16` | bf16, roomy pool, all prompts at once | every prompt within [`compare::BF16`] |
//! | `preemption f32` / `bf16` | a 200-token pool of 4-token pages, 48-token prefill chunks | preemptions happened, tokens equal the roomy run's, within tolerance, no page leaked |
//! | `page reuse` | bf16, the small pool after that run | a prompt on recycled pages gets the tokens and logits of a fresh engine |
//! | `admission` | f32, roomy pool | one token over the window is refused with the typed error, nothing allocated, the next request is served |

use std::path::Path;
use std::time::Instant;

use canarygate_engine::config::ModelConfig;
use canarygate_engine::{
    AdmissionError, Completion, DeviceKind, Engine, EngineConfig, EngineHandle, GenerationRequest,
    Precision,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::compare::{self, Agreement, BF16, F32, Tolerance};
use crate::reference::{Reference, ReferencePrompt, STEPS};

/// Tokens the small pool holds: all short prompts fit at once, their generations do not.
const SMALL_POOL_TOKENS: usize = 200;

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// Short name (`f32`, `bf16`, `preemption bf16`, ...).
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// One line for the report: what was measured, or what went wrong.
    pub detail: String,
    /// Numbers behind the detail.
    pub metrics: Value,
}

/// `correctness.json`: every check, in order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Correctness {
    /// Device the checks ran on (`cuda:0`, `cpu`).
    pub device: String,
    /// The checks.
    pub checks: Vec<Check>,
    /// Wall time of all checks.
    pub seconds: f64,
}

impl Correctness {
    /// Whether every check passed (and there was at least one).
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }
}

#[derive(Clone, Copy)]
enum Pool {
    /// 64 MiB: nothing is ever preempted.
    Roomy,
    /// [`SMALL_POOL_TOKENS`] in 4-token pages, prefill in 48-token chunks.
    Small,
}

fn start(
    model: &Path,
    device: DeviceKind,
    precision: Precision,
    pool: Pool,
) -> Result<EngineHandle, String> {
    let base = EngineConfig {
        device,
        precision: Some(precision),
        ..EngineConfig::new(model)
    };
    let config = match pool {
        Pool::Roomy => EngineConfig {
            kv_budget_bytes: 64 << 20,
            ..base
        },
        Pool::Small => {
            let c =
                ModelConfig::from_file(&model.join("config.json")).map_err(|e| e.to_string())?;
            let dtype_bytes = match precision {
                Precision::F32 => 4,
                Precision::Bf16 => 2,
            };
            let per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes;
            EngineConfig {
                kv_budget_bytes: SMALL_POOL_TOKENS * per_token,
                page_size: 4,
                prefill_chunk: 48,
                ..base
            }
        }
    };
    Engine::start(config).map_err(|e| format!("engine start: {e}"))
}

/// Submits every prompt at once (they share decode batches) and collects the completions.
fn run_together(
    engine: &EngineHandle,
    prompts: &[&ReferencePrompt],
) -> Result<Vec<Completion>, String> {
    let generations = prompts
        .iter()
        .map(|p| {
            engine.submit(GenerationRequest {
                return_logits: true,
                ..GenerationRequest::greedy(p.tokens.clone(), STEPS)
            })
        })
        .collect::<Result<Vec<_>, AdmissionError>>()
        .map_err(|e| format!("admission: {e}"))?;
    generations
        .into_iter()
        .map(|g| g.wait().map_err(|e| format!("generation: {e}")))
        .collect()
}

fn agreements(prompts: &[&ReferencePrompt], completions: &[Completion]) -> Vec<Agreement> {
    prompts
        .iter()
        .zip(completions)
        .map(|(p, c)| compare::agreement(&p.generated, &p.logits, &c.token_ids, &c.logits))
        .collect()
}

/// The verdict over several prompts: the first miss, or a summary of the worst.
fn judge(
    tolerance: &Tolerance,
    prompts: &[&ReferencePrompt],
    agreements: &[Agreement],
) -> (bool, String) {
    for (p, a) in prompts.iter().zip(agreements) {
        if let Err(miss) = tolerance.verdict(a) {
            return (
                false,
                format!("prompt of {} tokens: {miss}", p.tokens.len()),
            );
        }
    }
    let worst = agreements
        .iter()
        .map(|a| a.max_relative_error)
        .fold(0.0f32, f32::max);
    let lengths: Vec<usize> = prompts.iter().map(|p| p.tokens.len()).collect();
    (
        true,
        format!(
            "{} prompts ({lengths:?} tokens), {STEPS} greedy tokens each identical, max logits \
             relative error {worst:.2e} (limit {:.0e})",
            prompts.len(),
            tolerance.max_relative_error
        ),
    )
}

fn tolerance_of(precision: Precision) -> Tolerance {
    match precision {
        Precision::F32 => F32,
        Precision::Bf16 => BF16,
    }
}

fn precision_name(precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
    }
}

/// A check that could not run is a failed check that says why.
fn failed(name: &str, why: String) -> Check {
    Check {
        name: name.into(),
        passed: false,
        detail: why,
        metrics: Value::Null,
    }
}

/// Roomy-pool run of every prompt; returns the check and the completions (for later checks).
fn roomy_check(
    model: &Path,
    device: DeviceKind,
    precision: Precision,
    reference: &Reference,
) -> (Check, Option<Vec<Completion>>) {
    let name = precision_name(precision);
    let prompts: Vec<&ReferencePrompt> = reference.prompts.iter().collect();
    let run = start(model, device, precision, Pool::Roomy).and_then(|e| run_together(&e, &prompts));
    let completions = match run {
        Ok(c) => c,
        Err(why) => return (failed(name, why), None),
    };
    let agreements = agreements(&prompts, &completions);
    let (passed, detail) = judge(&tolerance_of(precision), &prompts, &agreements);
    let check = Check {
        name: name.into(),
        passed,
        detail,
        metrics: json!({ "tolerance": tolerance_of(precision), "prompts": agreements }),
    };
    (check, Some(completions))
}

/// Runs of the small-pool check before one without a preemption fails it.
const PREEMPTION_ATTEMPTS: usize = 3;

/// Small-pool run of the prompts that fit it, against the reference and the roomy run.
fn preemption_check(
    model: &Path,
    device: DeviceKind,
    precision: Precision,
    reference: &Reference,
    roomy: Option<&[Completion]>,
) -> (Check, Option<EngineHandle>) {
    let name = format!("preemption {}", precision_name(precision));
    let fits: Vec<usize> = (0..reference.prompts.len())
        .filter(|&i| reference.prompts[i].tokens.len() + STEPS <= SMALL_POOL_TOKENS)
        .collect();
    let prompts: Vec<&ReferencePrompt> = fits.iter().map(|&i| &reference.prompts[i]).collect();
    let engine = match start(model, device, precision, Pool::Small) {
        Ok(e) => e,
        Err(why) => return (failed(&name, why), None),
    };
    // The prompts overflow the pool only while they run together; a
    // submitting thread descheduled long enough (a loaded host) lets the
    // first ones finish alone. Such a run proves nothing, so it is run again.
    let mut completions = Vec::new();
    for _ in 0..PREEMPTION_ATTEMPTS {
        completions = match run_together(&engine, &prompts) {
            Ok(c) => c,
            Err(why) => return (failed(&name, why), Some(engine)),
        };
        if engine.stats().preemptions > 0 {
            break;
        }
    }
    let stats = engine.stats();
    let agreements = agreements(&prompts, &completions);
    let (mut passed, mut detail) = judge(&tolerance_of(precision), &prompts, &agreements);
    if let Some(roomy) = roomy {
        for (&i, c) in fits.iter().zip(&completions) {
            if passed && roomy[i].token_ids != c.token_ids {
                passed = false;
                detail = format!(
                    "prompt of {} tokens: tokens differ from the roomy pool's",
                    reference.prompts[i].tokens.len()
                );
            }
        }
    }
    if passed && stats.preemptions == 0 {
        passed = false;
        detail = format!(
            "no request was preempted in {PREEMPTION_ATTEMPTS} runs: the check proved nothing"
        );
    }
    if passed && stats.free_pages != stats.total_pages {
        passed = false;
        detail = format!(
            "{} of {} pages still owned after every request ended",
            stats.total_pages - stats.free_pages,
            stats.total_pages
        );
    }
    if passed {
        detail = format!(
            "{} preemptions in a {}-page pool; {detail}; same tokens as the roomy pool",
            stats.preemptions, stats.total_pages
        );
    }
    let check = Check {
        name,
        passed,
        detail,
        metrics: json!({
            "preemptions": stats.preemptions,
            "pages": stats.total_pages,
            "prompts": agreements,
        }),
    };
    (check, Some(engine))
}

/// A prompt run alone on the small pool's recycled pages against a fresh roomy engine.
fn page_reuse_check(
    model: &Path,
    device: DeviceKind,
    recycled: &EngineHandle,
    reference: &Reference,
) -> Check {
    let name = "page reuse";
    let Some(p) = reference
        .prompts
        .iter()
        .filter(|p| p.tokens.len() + STEPS <= SMALL_POOL_TOKENS)
        .max_by_key(|p| p.tokens.len())
    else {
        return failed(name, "no prompt fits the small pool".into());
    };
    let fresh = start(model, device, Precision::Bf16, Pool::Roomy);
    let runs = fresh.and_then(|fresh| {
        let a = run_together(recycled, &[p])?;
        let b = run_together(&fresh, &[p])?;
        Ok((a, b))
    });
    let (on_recycled, on_fresh) = match runs {
        Ok((mut a, mut b)) => (a.remove(0), b.remove(0)),
        Err(why) => return failed(name, why),
    };
    let a = compare::agreement(
        &on_fresh.token_ids,
        &on_fresh.logits,
        &on_recycled.token_ids,
        &on_recycled.logits,
    );
    let bit_identical = on_recycled.logits == on_fresh.logits;
    let verdict = BF16.verdict(&a);
    let stats = recycled.stats();
    let (passed, detail) = match verdict {
        Err(miss) => (false, format!("against a fresh engine: {miss}")),
        Ok(()) if stats.free_pages != stats.total_pages => {
            (false, "pages still owned after the request ended".into())
        }
        Ok(()) => (
            true,
            format!(
                "prompt of {} tokens on pages freed by earlier requests: same {} tokens as a \
                 fresh engine, logits {}",
                p.tokens.len(),
                a.steps,
                if bit_identical {
                    "bit-identical".to_string()
                } else {
                    format!("within {:.2e}", a.max_relative_error)
                }
            ),
        ),
    };
    Check {
        name: name.into(),
        passed,
        detail,
        metrics: json!({ "bit_identical": bit_identical, "agreement": a }),
    }
}

/// One token over the window must be refused with the typed error and change nothing.
fn admission_check(model: &Path, device: DeviceKind, reference: &Reference) -> Check {
    let name = "admission";
    let engine = match start(model, device, Precision::F32, Pool::Roomy) {
        Ok(e) => e,
        Err(why) => return failed(name, why),
    };
    let window = engine.context_window();
    let prompt_tokens = window - 8;
    let over = GenerationRequest::greedy(vec![1; prompt_tokens], 9);
    let outcome = engine.submit(over).map(|_| ());
    let expected = AdmissionError::ContextLengthExceeded {
        requested: window + 1,
        prompt_tokens,
        limit: window,
    };
    let stats = engine.stats();
    let (mut passed, mut detail) = match &outcome {
        Err(e) if *e == expected => (true, format!("refused: {e}")),
        Err(e) => (false, format!("refused with the wrong error: {e}")),
        Ok(()) => (
            false,
            format!("a request of {} tokens was admitted", window + 1),
        ),
    };
    if passed && stats.free_pages != stats.total_pages {
        passed = false;
        detail = "the refused request holds pages".into();
    }
    if passed {
        // The engine still serves: the shortest prompt gives the reference's tokens.
        let p = &reference.prompts[0];
        match run_together(&engine, &[p]) {
            Ok(c) if c[0].token_ids == p.generated => {
                detail = format!("{detail}; the next request got the reference's tokens");
            }
            Ok(_) => {
                passed = false;
                detail = "after the refusal, a request got other tokens than the reference".into();
            }
            Err(why) => {
                passed = false;
                detail = format!("after the refusal: {why}");
            }
        }
    }
    Check {
        name: name.into(),
        passed,
        detail,
        metrics: json!({ "window": window, "requested": window + 1 }),
    }
}

/// Runs every check on `device` with the kit's model and reference.
pub fn run(kit: &Path, device: DeviceKind) -> Result<Correctness, String> {
    let started = Instant::now();
    let reference = Reference::load(kit)?;
    let model = kit.join(&reference.model);
    let mut checks = Vec::new();
    let log = |check: Check, checks: &mut Vec<Check>| {
        eprintln!(
            "{} {}: {}",
            if check.passed { "PASS" } else { "FAIL" },
            check.name,
            check.detail
        );
        checks.push(check);
    };
    let mut roomy = Vec::new();
    for precision in [Precision::F32, Precision::Bf16] {
        let (check, completions) = roomy_check(&model, device, precision, &reference);
        log(check, &mut checks);
        roomy.push(completions);
    }
    let mut recycled = None;
    for (precision, roomy) in [Precision::F32, Precision::Bf16].into_iter().zip(&roomy) {
        let (check, engine) =
            preemption_check(&model, device, precision, &reference, roomy.as_deref());
        log(check, &mut checks);
        if precision == Precision::Bf16 {
            recycled = engine;
        }
    }
    let reuse = match &recycled {
        Some(engine) => page_reuse_check(&model, device, engine, &reference),
        None => failed("page reuse", "the small-pool engine did not start".into()),
    };
    log(reuse, &mut checks);
    drop(recycled);
    log(admission_check(&model, device, &reference), &mut checks);
    Ok(Correctness {
        device: match device {
            DeviceKind::Cpu => "cpu".into(),
            DeviceKind::Cuda(i) => format!("cuda:{i}"),
        },
        checks,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;
    use crate::reference::{PROMPT_LENGTHS, prepare};

    /// One kit for the tests of this module (preparing it runs the reference).
    fn kit() -> &'static Path {
        static KIT: OnceLock<tempfile::TempDir> = OnceLock::new();
        KIT.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            prepare(dir.path()).unwrap();
            dir
        })
        .path()
    }

    #[test]
    fn the_prepared_reference_has_confident_prompts_of_every_length() {
        let reference = Reference::load(kit()).unwrap();
        let lengths: Vec<usize> = reference.prompts.iter().map(|p| p.tokens.len()).collect();
        assert_eq!(lengths, PROMPT_LENGTHS);
        for p in &reference.prompts {
            assert_eq!((p.generated.len(), p.logits.len()), (STEPS, STEPS));
            assert!(p.min_margin >= reference.required_margin);
            assert_eq!(reference.required_margin, 2.0 * BF16.max_relative_error);
        }
    }

    #[test]
    fn checks_fail_where_the_run_leaves_the_reference() {
        let kit = kit();
        let model = kit.join("model");
        let mut reference = Reference::load(kit).unwrap();
        let (check, _) = roomy_check(&model, DeviceKind::Cpu, Precision::F32, &reference);
        assert!(check.passed, "{}", check.detail);

        // One logit moved by 1 % of its row's largest: beyond f32's tolerance, within bf16's.
        let row = &mut reference.prompts[2].logits[5];
        let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        row[0] += 0.01 * scale;
        let (check, _) = roomy_check(&model, DeviceKind::Cpu, Precision::F32, &reference);
        assert!(!check.passed);
        assert!(
            check.detail.contains("33 tokens") && check.detail.contains("step 5"),
            "{}",
            check.detail
        );
        let (check, _) = roomy_check(&model, DeviceKind::Cpu, Precision::Bf16, &reference);
        assert!(check.passed, "{}", check.detail);

        // A reference token the run does not produce fails every precision.
        reference.prompts[1].generated[3] ^= 1;
        for precision in [Precision::F32, Precision::Bf16] {
            let (check, _) = roomy_check(&model, DeviceKind::Cpu, precision, &reference);
            assert!(
                !check.passed && check.detail.contains("greedy token 3"),
                "{}",
                check.detail
            );
        }
    }

    #[test]
    fn every_check_passes_on_the_cpu() {
        let result = run(kit(), DeviceKind::Cpu).unwrap();
        let names: Vec<&str> = result.checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "f32",
                "bf16",
                "preemption f32",
                "preemption bf16",
                "page reuse",
                "admission"
            ]
        );
        for check in &result.checks {
            assert!(check.passed, "{}: {}", check.name, check.detail);
        }
        assert!(result.passed());
    }
}

//! Each shipped preset loads and behaves as its description says, and the
//! `[verify]` section is validated with located errors.

mod common;

use canarygate_policies::config::{PRESETS, ProviderApi};
use canarygate_policies::registry_config::OnUnavailable;
use canarygate_policies::{Decision, EchoMode, FailureAction, Policy, ReleasePolicy, Verifier};
use common::*;

const ANSWER: &str =
    "Buckets hold the entries. Keys are hashed; a lookup hashes the key to find its bucket.";

/// Streams an honest answer and a failing one (no echo) under `name`.
/// Returns (honest released before finish, honest text, failing text,
/// failing stopped early, failing decision).
fn exercise(name: &str) -> (bool, String, String, bool, Decision) {
    let policy = Policy::preset(name).unwrap();
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    // Longer than the echo's preamble window, so a missing echo is decided
    // before the answer ends.
    let answer = ANSWER;
    let chunks = |text: &str| -> Vec<(u32, String)> {
        text.split_inclusive(' ')
            .map(|w| (0, w.to_owned()))
            .collect()
    };

    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let honest = feed(
        &mut verifier,
        &registry,
        &chunks(&format!("{}\n{answer}", echo_of(&injection))),
        &honest_facts(&injection, 1),
    );
    assert!(honest.finished.verdict.passed(), "{name}");
    assert_eq!(
        honest
            .finished
            .verdict
            .decide(policy.verify.action(), 0, honest.released_before_finish),
        Decision::Deliver
    );

    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let failing = feed(
        &mut verifier,
        &registry,
        &chunks(answer),
        &honest_facts(&injection, 1),
    );
    let decision =
        failing
            .finished
            .verdict
            .decide(policy.verify.action(), 0, failing.released_before_finish);
    (
        honest.released_before_finish,
        honest.released[0].clone(),
        failing.released[0].clone(),
        failing.stopped_at.is_some(),
        decision,
    )
}

#[test]
fn default_is_echo_first_and_blocks() {
    let policy = Policy::preset("default").unwrap();
    assert_eq!(policy.verify.echo, EchoMode::HeadTail);
    assert_eq!(policy.verify.release, ReleasePolicy::EchoFirst);
    assert_eq!(policy.verify.action(), FailureAction::Block);
    assert_eq!(policy.registry.on_unavailable, OnUnavailable::Degrade);
    let (streamed, honest, failing, stopped, decision) = exercise("default");
    assert!(streamed, "echo-first streams once the echo passed");
    assert_eq!(honest, ANSWER);
    assert_eq!(failing, "", "nothing of an answer whose echo failed");
    assert!(stopped);
    assert_eq!(decision, Decision::Block);
}

#[test]
fn strict_is_verdict_first_and_blocks() {
    let policy = Policy::preset("strict").unwrap();
    assert_eq!(policy.verify.release, ReleasePolicy::VerdictFirst);
    assert_eq!(policy.registry.on_unavailable, OnUnavailable::FailClosed);
    let (streamed, honest, failing, stopped, decision) = exercise("strict");
    assert!(!streamed, "verdict-first releases nothing before the end");
    assert_eq!(honest, ANSWER);
    assert_eq!(failing, "");
    assert!(stopped);
    assert_eq!(decision, Decision::Block);
}

#[test]
fn observe_flags_and_never_changes_an_answer() {
    let policy = Policy::preset("observe").unwrap();
    assert_eq!(policy.verify.action(), FailureAction::Flag);
    let (streamed, honest, failing, stopped, decision) = exercise("observe");
    assert!(streamed);
    assert_eq!(honest, ANSWER);
    assert_eq!(failing, ANSWER);
    assert!(!stopped);
    assert_eq!(decision, Decision::Flag);
}

#[test]
fn every_preset_has_a_behaviour_test() {
    let names: Vec<_> = PRESETS.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["default", "strict", "observe"]);
}

const BASE: &str = r#"
[[providers]]
name = "sim"
base_url = "http://127.0.0.1:9/v1"
context_window = 1000

[[routes]]
model = "*"
provider = "sim"

[verify]
"#;

fn error_of(verify: &str) -> canarygate_policies::PolicyError {
    Policy::from_toml_str(&format!("{BASE}{verify}"), "t.toml").unwrap_err()
}

#[test]
fn verify_section_errors_are_located() {
    let fallback = error_of("action = \"fallback\"\n");
    assert_eq!(fallback.position.unwrap().0, 12, "{fallback}");
    assert!(
        fallback.message.contains("needs the local engine"),
        "{fallback}"
    );
    let with_engine = format!("{BASE}action = \"fallback\"\n[local]\nmodel_dir = \"/models/m\"\n");
    let policy = Policy::from_toml_str(&with_engine, "t.toml").unwrap();
    assert_eq!(
        policy.local.untrusted_context(),
        canarygate_policies::local_config::UntrustedContext::Local
    );

    let unknown = error_of("eccho = \"head\"\n");
    assert_eq!(unknown.position.unwrap().0, 12, "{unknown}");
    assert!(unknown.message.contains("eccho"), "{unknown}");

    let bad_mode = error_of("echo = \"tail\"\n");
    assert_eq!(bad_mode.position.unwrap().0, 12, "{bad_mode}");

    let ratio = error_of("estimate_min_ratio = 1.5\n");
    assert!(ratio.message.contains("estimate_min_ratio"), "{ratio}");
    assert_eq!(ratio.position.unwrap().0, 12);

    let rate = error_of("[verify.max_prefill_tokens_per_second]\nnope = 1000.0\n");
    assert!(rate.message.contains("`nope`"), "{rate}");
    assert_eq!(rate.position.unwrap().0, 13);

    let zero = error_of("[verify.max_prefill_tokens_per_second]\nsim = 0.0\n");
    assert!(zero.message.contains("greater than 0"), "{zero}");

    let ok = Policy::from_toml_str(
        &format!("{BASE}echo = \"head\"\naction = \"retry\"\n"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(ok.verify.echo, EchoMode::Head);
    assert_eq!(ok.verify.action(), FailureAction::Retry);
}

fn local_error_of(local: &str) -> canarygate_policies::PolicyError {
    Policy::from_toml_str(&format!("{BASE}\n[local]\n{local}"), "t.toml").unwrap_err()
}

#[test]
fn local_section_is_validated_with_located_errors() {
    use canarygate_policies::local_config::UntrustedContext;

    let default = Policy::from_toml_str(BASE, "t.toml").unwrap();
    assert!(!default.local.enabled());
    assert_eq!(default.local.untrusted_context(), UntrustedContext::Reject);

    let needs_model = local_error_of("on_untrusted_context = \"local\"\n");
    assert_eq!(needs_model.position.unwrap().0, 14, "{needs_model}");
    assert!(needs_model.message.contains("model_dir"), "{needs_model}");

    let unavailable = local_error_of("on_upstream_unavailable = true\n");
    assert!(unavailable.message.contains("model_dir"), "{unavailable}");

    let margin = local_error_of("model_dir = \"/m\"\nkv_margin = 0.5\n");
    assert_eq!(margin.position.unwrap().0, 15, "{margin}");
    assert!(margin.message.contains("kv_margin"), "{margin}");

    let unknown = local_error_of("model_dri = \"/m\"\n");
    assert!(unknown.message.contains("model_dri"), "{unknown}");

    let choice = local_error_of("on_untrusted_context = \"maybe\"\n");
    assert!(choice.message.contains("maybe"), "{choice}");

    let reject = Policy::from_toml_str(
        &format!("{BASE}\n[local]\nmodel_dir = \"/m\"\non_untrusted_context = \"reject\"\n"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(reject.local.untrusted_context(), UntrustedContext::Reject);
}

#[test]
fn routes_resolve_context_caps_and_local_model_names() {
    let text = r#"
[[providers]]
name = "a"
base_url = "http://127.0.0.1:9/v1"
context_window = 1000
max_context_tokens = 700

[[routes]]
model = "capped"
provider = "a"
max_context_tokens = 300
local_model = "tiny-local"

[[routes]]
model = "*"
provider = "a"

[local]
model_dir = "/m"
model_name = "fallback-model"
"#;
    let policy = Policy::from_toml_str(text, "t.toml").unwrap();
    let capped = policy.route("capped", ProviderApi::Openai).unwrap();
    assert_eq!(capped.max_context_tokens, Some(300));
    assert_eq!(capped.local_model, "tiny-local");
    let other = policy.route("other", ProviderApi::Openai).unwrap();
    assert_eq!(other.max_context_tokens, Some(700));
    assert_eq!(other.local_model, "fallback-model");
}

#[test]
fn probe_schedule_is_validated() {
    let every =
        Policy::from_toml_str(&format!("{BASE}\n[probe]\nevery_hours = 24.0\n"), "t.toml").unwrap();
    assert_eq!(
        every.probe.interval(),
        Some(std::time::Duration::from_secs(24 * 3600))
    );
    let too_often =
        Policy::from_toml_str(&format!("{BASE}\n[probe]\nevery_hours = 0.001\n"), "t.toml")
            .unwrap_err();
    assert!(too_often.message.contains("every_hours"), "{too_often}");
}

//! Failure modes and honest answers through the verifier, per release policy
//! and action.

mod common;

use canarygate_policies::canary::find_canaries;
use canarygate_policies::verify::{
    Check, ECHO_GAP_CHARS, ECHO_PREAMBLE_CHARS, EchoOutcome, Evidence, FinishProblem, Part, Status,
    Verdict,
};
use canarygate_policies::{
    Decision, Facts, FailureAction, Injection, Policy, ProviderUsage, ReleasePolicy, Verifier,
};
use common::*;
use serde_json::json;

const ANSWER: &str = "A hash map stores key/value pairs in buckets.\n\n```rust\nlet mut m = HashMap::new();\nm.insert(\"k\", 1);\n```\nLookups hash the key.";

fn policy(release: ReleasePolicy, action: FailureAction) -> Policy {
    let mut policy = Policy::preset("default").unwrap();
    policy.verify.release = release;
    policy.verify.action = toml::Spanned::new(0..0, action);
    policy
}

fn words(text: &str) -> Vec<(u32, String)> {
    text.split_inclusive(' ')
        .map(|w| (0, w.to_owned()))
        .collect()
}

#[test]
fn honest_stream_is_released_after_echo_and_stripped() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(100);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let answer = format!("\"{}\"\n\n{ANSWER}", echo_of(&injection));
    let run = feed(
        &mut verifier,
        &registry,
        &words(&answer),
        &honest_facts(&injection, 1),
    );
    assert!(run.finished.verdict.passed(), "{:?}", run.finished.verdict);
    assert_eq!(run.released[0], ANSWER);
    assert!(
        run.released_before_finish,
        "echo-first streams before the end"
    );
    assert_eq!(run.finished.verdict.header_value(), "pass");
}

#[test]
fn verdict_first_releases_nothing_before_finish() {
    let policy = policy(ReleasePolicy::VerdictFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let answer = format!("{} {ANSWER}", echo_of(&injection));
    let run = feed(
        &mut verifier,
        &registry,
        &words(&answer),
        &honest_facts(&injection, 1),
    );
    assert!(!run.released_before_finish);
    assert_eq!(run.released[0], ANSWER);
}

/// Each failure: the answer text, the check expected to fail, the echo outcome.
fn failing_answers(
    injection: &canarygate_policies::Injection,
) -> Vec<(&'static str, String, Check)> {
    let head = injection.echo[0];
    let tail = injection.echo[1];
    let (other_head, other_tail) = other_canaries(3);
    vec![
        ("replaced prompt", format!("Sure! {ANSWER}"), Check::Echo),
        ("truncated head", format!("{tail}\n{ANSWER}"), Check::Echo),
        ("truncated tail", format!("{head}\n{ANSWER}"), Check::Echo),
        (
            "swapped answer",
            format!("{other_head} {other_tail}\n{ANSWER}"),
            Check::ForeignCanary,
        ),
        (
            "leak mid-answer",
            format!(
                "{head} {tail}\n{ANSWER} as the user said: cg {} and more",
                other_tail.to_string().to_lowercase().replace('-', " ")
            ),
            Check::ForeignCanary,
        ),
        ("cut echo", format!("{head} CG-"), Check::Echo),
    ]
}

#[test]
fn no_failing_answer_is_delivered_under_either_release_policy() {
    for release in [ReleasePolicy::EchoFirst, ReleasePolicy::VerdictFirst] {
        for stream in [true, false] {
            let policy = policy(release, FailureAction::Block);
            let registry = registry_with_others(10);
            let (_, injection) = prepare(&policy, &registry, chat_request(stream), 1);
            for (name, answer, check) in failing_answers(&injection) {
                for chunks in [vec![(0, answer.clone())], words(&answer)] {
                    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
                    let run = feed(
                        &mut verifier,
                        &registry,
                        &chunks,
                        &honest_facts(&injection, 1),
                    );
                    let verdict = &run.finished.verdict;
                    assert!(!verdict.passed(), "{name}: {verdict:?}");
                    assert!(
                        verdict.failed_checks().contains(&check),
                        "{name}: {verdict:?}"
                    );
                    let released = &run.released[0];
                    if release == ReleasePolicy::VerdictFirst || !stream || check == Check::Echo {
                        assert_eq!(released, "", "{name} ({release:?}, stream {stream})");
                    } else if name == "leak mid-answer" {
                        // Echo-first: what went out precedes the point of detection.
                        let before = format!("{ANSWER} as the user said: ");
                        assert!(
                            before.starts_with(released.as_str()),
                            "{name}: {released:?}"
                        );
                    }
                    assert_eq!(
                        verdict.decide(FailureAction::Block, 0, run.released_before_finish),
                        Decision::Block
                    );
                }
            }
        }
    }
}

#[test]
fn echo_outcomes_name_what_was_lost() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let expected = [
        EchoOutcome::Missing,
        EchoOutcome::HeadMissing,
        EchoOutcome::TailMissing,
        EchoOutcome::WrongCanary,
        EchoOutcome::Passed,
        EchoOutcome::Incomplete,
    ];
    for ((name, answer, _), outcome) in failing_answers(&injection).into_iter().zip(expected) {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(
            &mut verifier,
            &registry,
            &[(0, answer)],
            &honest_facts(&injection, 1),
        );
        let echo = run.finished.verdict.result(Check::Echo).unwrap();
        assert_eq!(
            echo.evidence,
            Evidence::Echo {
                choices: vec![outcome]
            },
            "{name}"
        );
    }
}

/// Runs `answer` (whole, and word by word) through a fresh verifier of
/// `injection`; returns the echo outcome and what was delivered.
fn echo_outcome(
    policy: &Policy,
    registry: &canarygate_policies::MemoryRegistry,
    injection: &canarygate_policies::Injection,
    answer: &str,
) -> (EchoOutcome, String) {
    let mut outcomes = Vec::new();
    for chunks in [
        vec![(0, answer.to_owned())],
        words(answer),
        split_chars(answer),
    ] {
        let mut verifier = Verifier::new(injection, &policy.verify, "openai", None);
        let run = feed(
            &mut verifier,
            registry,
            &chunks,
            &honest_facts(injection, 1),
        );
        let Evidence::Echo { choices } =
            &run.finished.verdict.result(Check::Echo).unwrap().evidence
        else {
            panic!("echo evidence");
        };
        outcomes.push((choices[0], run.released[0].clone()));
    }
    assert!(
        outcomes.windows(2).all(|pair| pair[0] == pair[1]),
        "split points changed the outcome of {answer:?}: {outcomes:?}"
    );
    outcomes.remove(0)
}

fn split_chars(text: &str) -> Vec<(u32, String)> {
    text.chars().map(|c| (0, c.to_string())).collect()
}

#[test]
fn echo_variations_real_models_write_pass_and_are_removed() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (head, tail) = (injection.echo[0].to_string(), injection.echo[1].to_string());
    let spaced = |canary: &str| {
        let digits = &canary[2..];
        let groups: Vec<&str> = (0..5).map(|g| &digits[3 * g..3 * g + 3]).collect();
        format!("CG {}", groups.join(" "))
    };
    let preamble_max = "p".repeat(ECHO_PREAMBLE_CHARS);
    let gap_max = "-".repeat(ECHO_GAP_CHARS);
    let variations = [
        format!("{head} {tail}\n"),
        format!("{head} {tail}\n\n"),
        format!("{head} {tail} "),
        format!("Sure! {head} {tail}\n\n"),
        format!("Sure, here are the codes:\n\n{head} {tail}\n\n"),
        format!("\"{head} {tail}\"\n"),
        format!("`{head}` `{tail}`\n"),
        format!("```\n{head} {tail}\n```\n"),
        format!("**{head} {tail}**\n\n"),
        format!("**{head}** **{tail}**\n"),
        format!("\u{201C}{head} {tail}\u{201D}\n"),
        format!("[{head}] [{tail}]\n"),
        format!("({head}, {tail}).\n"),
        format!("{head}{tail}\n"),
        format!("{head}   {tail}\n"),
        format!("{head}\n{tail}\n\n"),
        format!("{head} and {tail}:\n"),
        format!("{} {}\n", head.to_lowercase(), tail.to_lowercase()),
        format!("Cg{} cG{}\n", &head[2..], &tail[2..]),
        format!("{} {}\n", spaced(&head), spaced(&tail)),
        format!("CG-{} CG-{}\n", &head[2..], &tail[2..]),
        format!("{preamble_max}{head}{gap_max}{tail}\r\n"),
        format!("> {head} {tail}\n"),
    ];
    for echo in variations {
        let answer = format!("{echo}{ANSWER}");
        let (outcome, delivered) = echo_outcome(&policy, &registry, &injection, &answer);
        assert_eq!(outcome, EchoOutcome::Passed, "{answer:?}");
        // Everything of the echo is removed; the answer arrives untouched.
        assert_eq!(delivered, ANSWER, "{echo:?}");
    }
}

#[test]
fn echo_tolerance_lets_no_answer_from_another_context_pass() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (head, tail) = (injection.echo[0].to_string(), injection.echo[1].to_string());
    let (other_head, other_tail) = other_canaries(3);
    let preamble_over = "p".repeat(ECHO_PREAMBLE_CHARS + 1);
    let gap_over = "-".repeat(ECHO_GAP_CHARS + 1);
    let cases = [
        // Another request's canaries, or ours mixed with another's.
        (
            format!("{other_head} {other_tail}\n"),
            EchoOutcome::WrongCanary,
        ),
        (
            format!("Sure! {other_head} {tail}\n"),
            EchoOutcome::WrongCanary,
        ),
        (format!("{head} {other_tail}\n"), EchoOutcome::TailMissing),
        // Ours, out of order or alone.
        (format!("{tail} {head}\n"), EchoOutcome::HeadMissing),
        (format!("{tail}\n"), EchoOutcome::HeadMissing),
        (format!("{head}\n"), EchoOutcome::TailMissing),
        // Partial canaries: a digit lost, a digit changed, the prefix lost.
        (
            format!("{} {tail}\n", &head[..16]),
            EchoOutcome::HeadMissing,
        ),
        (
            format!("{head} {}\n", &tail[..16]),
            EchoOutcome::TailMissing,
        ),
        (
            format!(
                "{}{} {tail}\n",
                &head[..16],
                if head.ends_with('1') { '2' } else { '1' }
            ),
            EchoOutcome::WrongCanary,
        ),
        (
            format!("{} {}\n", &head[2..], &tail[2..]),
            EchoOutcome::Missing,
        ),
        // Ours, later in the text than the echo allows.
        (
            format!("{preamble_over}{head} {tail}\n"),
            EchoOutcome::Missing,
        ),
        (
            format!("{head}{gap_over}{tail}\n"),
            EchoOutcome::TailMissing,
        ),
        (
            format!(
                "Here is an answer about something else entirely, which at its end quotes {head} {tail}\n"
            ),
            EchoOutcome::Missing,
        ),
        // No canary at all; a cut canary followed by text.
        ("Sure! Here you go.\n".to_owned(), EchoOutcome::Missing),
        (format!("{head} {}", &tail[..9]), EchoOutcome::TailMissing),
    ];
    for (echo, outcome) in cases {
        let answer = format!("{echo}{ANSWER}");
        let (found, delivered) = echo_outcome(&policy, &registry, &injection, &answer);
        assert_eq!(found, outcome, "{answer:?}");
        assert_eq!(delivered, "", "a failed echo releases nothing: {answer:?}");
    }
    // An answer that ends inside the echo.
    for cut in [format!("{head} {}", &tail[..9]), head[..5].to_owned()] {
        let (found, delivered) = echo_outcome(&policy, &registry, &injection, &cut);
        assert_eq!(found, EchoOutcome::Incomplete, "{cut:?}");
        assert_eq!(delivered, "");
    }
}

#[test]
fn echo_first_stops_at_the_foreign_canary() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (foreign, _) = other_canaries(7);
    let before = "First part of the answer. ";
    let answer = format!(
        "{} {before}{foreign} secret of another customer",
        echo_of(&injection)
    );
    // Every split of the answer into two chunks.
    for cut in 0..=answer.len() {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(
            &mut verifier,
            &registry,
            &split_at(&answer, &[cut]),
            &honest_facts(&injection, 1),
        );
        assert!(run.stopped_at.is_some(), "cut {cut}");
        assert!(
            before.starts_with(&run.released[0]),
            "cut {cut}: {:?}",
            run.released[0]
        );
        let verdict = &run.finished.verdict;
        assert_eq!(verdict.failed_checks(), [Check::ForeignCanary], "cut {cut}");
        let Evidence::ForeignCanary { foreign, hits, .. } =
            &verdict.result(Check::ForeignCanary).unwrap().evidence
        else {
            panic!("evidence");
        };
        assert_eq!(*foreign, 1);
        assert_eq!(hits[0].session, "other-7");
    }
}

#[test]
fn flag_delivers_failing_answers_unchanged_and_marks_them() {
    let policy = Policy::preset("observe").unwrap();
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (foreign, _) = other_canaries(2);
    let leaked = format!("{} text with {foreign} inside", echo_of(&injection));
    let replaced = "No echo at all.".to_owned();
    for (answer, delivered) in [
        (leaked, format!("text with {foreign} inside")),
        (replaced.clone(), replaced),
    ] {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(
            &mut verifier,
            &registry,
            &words(&answer),
            &honest_facts(&injection, 1),
        );
        assert_eq!(run.stopped_at, None);
        assert_eq!(run.released[0], delivered);
        let verdict = &run.finished.verdict;
        assert!(!verdict.passed());
        assert_eq!(
            verdict.decide(policy.verify.action(), 0, true),
            Decision::Flag
        );
        assert!(verdict.header_value().starts_with("fail; checks="));
    }
}

#[test]
fn prompt_tokens_estimate_and_exact() {
    let policy = policy(ReleasePolicy::VerdictFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    let (_, injection) = prepare(&policy, &registry, chat_request(false), 1);
    let answer = format!("{} ok", echo_of(&injection));
    let counted = injection.prompt_tokens_estimate;
    // The answer with the provider reporting `reported` prompt tokens, our
    // count exact or not.
    let run = |exact: Option<u64>, reported: u64| {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", exact);
        let mut facts = honest_facts(&injection, 1);
        facts.usage = Some(ProviderUsage {
            prompt_tokens: reported,
            completion_tokens: Some(20),
            cached_prompt_tokens: None,
        });
        feed(&mut verifier, &registry, &[(0, answer.clone())], &facts)
    };
    for (exact, reported, pass) in [
        (None, 1, false),
        (None, counted / 5, false),
        (None, counted / 3, true),
        (None, counted * 3, true),
        (Some(10_000), 10_000 + 200 + 8, true),
        (Some(10_000), 10_000 + 200 + 9, false),
        (Some(10_000), 9_792, true),
        (Some(10_000), 9_791, false),
    ] {
        let run = run(exact, reported);
        let result = run
            .finished
            .verdict
            .result(Check::PromptTokens)
            .unwrap()
            .clone();
        assert_eq!(
            result.status == Status::Pass,
            pass,
            "{exact:?} {reported}: {result:?}"
        );
        assert_eq!(run.released[0] == "ok", pass);
    }
    // A count of 0 is none (Ollama's for a cached prompt): skipped, and the
    // answer goes out; 1 is the incident's, and fails.
    for (reported, status) in [(0, Status::Skip), (1, Status::Fail)] {
        let run = run(None, reported);
        let verdict = &run.finished.verdict;
        assert_eq!(verdict.result(Check::PromptTokens).unwrap().status, status);
        assert_eq!(verdict.passed(), status == Status::Skip, "{reported}");
    }
}

#[test]
fn ttft_faster_than_prefill_fails_early() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    let big = "word ".repeat(400_000);
    let request =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": big}]});
    let (_, injection) = prepare(&policy, &registry, request, 1);
    // 400k tokens at 200k tokens/s: at least 2 s.
    let mut slow = Verifier::new(&injection, &policy.verify, "openai", None);
    assert!(!slow.observe_ttft(2_500));
    let mut fast = Verifier::new(&injection, &policy.verify, "openai", None);
    assert!(fast.observe_ttft(40));
    let step = fast.push(0, &format!("{} leaked", echo_of(&injection)), &registry);
    assert!(step.stop && step.release.is_empty());
    let finished = fast.finish(&honest_facts(&injection, 1), &registry);
    assert_eq!(finished.verdict.failed_checks(), [Check::Ttft]);
    assert_eq!(finished.release, [""]);
    // A provider without a configured rate skips the check.
    let mut unknown = Verifier::new(&injection, &policy.verify, "elsewhere", None);
    assert!(!unknown.observe_ttft(1));
}

/// A long stable system prompt and a question, as a job sends them.
fn cached_job_request(system_words: usize, question_words: usize) -> serde_json::Value {
    json!({"model": "m", "stream": true, "messages": [
        {"role": "system", "content": "rule ".repeat(system_words)},
        {"role": "user", "content": format!("Which rule applies? {}", "detail ".repeat(question_words))},
    ]})
}

fn usage_with_cache(injection: &canarygate_policies::Injection, cached: Option<u64>) -> Facts {
    let mut facts = honest_facts(injection, 1);
    facts.usage = Some(ProviderUsage {
        prompt_tokens: injection.prompt_tokens_estimate,
        completion_tokens: Some(20),
        cached_prompt_tokens: cached,
    });
    facts
}

fn ttft_result(
    injection: &canarygate_policies::Injection,
    registry: &canarygate_policies::MemoryRegistry,
    ttft_ms: u64,
    facts: &Facts,
) -> (
    bool,
    Option<usize>,
    canarygate_policies::verify::CheckResult,
) {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let mut verifier = Verifier::new(injection, &policy.verify, "openai", None);
    let stopped_at_once = verifier.observe_ttft(ttft_ms);
    let run = feed(
        &mut verifier,
        registry,
        &words(&format!("{} {ANSWER}", echo_of(injection))),
        facts,
    );
    let result = run.finished.verdict.result(Check::Ttft).unwrap().clone();
    (stopped_at_once, run.stopped_at, result)
}

#[test]
fn ttft_counts_only_uncached_prompt_tokens() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    // 400k tokens of system prompt before the head canary, a short question.
    let (_, injection) = prepare(&policy, &registry, cached_job_request(400_000, 0), 1);
    let cacheable = injection.cacheable_prompt_tokens;
    assert!(
        cacheable > 399_000 && cacheable < injection.prompt_tokens_estimate,
        "{cacheable} of {}",
        injection.prompt_tokens_estimate
    );
    // Served from a cache in 128-token blocks: 40 ms is plenty for the rest,
    // although prefilling the whole prompt at 200k tokens/s takes 2 s.
    let cached = cacheable / 128 * 128;
    let (stopped, _, result) = ttft_result(
        &injection,
        &registry,
        40,
        &usage_with_cache(&injection, Some(cached)),
    );
    assert!(!stopped);
    assert_eq!(result.status, Status::Pass, "{result:?}");
    let Evidence::Ttft {
        prompt_tokens,
        cached_tokens,
        min_plausible_ms,
        ..
    } = result.evidence
    else {
        panic!("{result:?}")
    };
    assert_eq!(cached_tokens, Some(cached));
    assert_eq!(prompt_tokens, injection.prompt_tokens_estimate - cached);
    assert!(min_plausible_ms.unwrap() <= 1);

    // The same timing without the cache field: impossibly fast.
    for facts in [
        usage_with_cache(&injection, None),
        usage_with_cache(&injection, Some(0)),
    ] {
        let (_, _, result) = ttft_result(&injection, &registry, 40, &facts);
        assert_eq!(result.status, Status::Fail, "{result:?}");
        assert!(
            result
                .reason
                .as_deref()
                .unwrap()
                .contains("uncached prompt tokens"),
            "{result:?}"
        );
    }
    // No usage at all (a stream cut before it): nothing says it was cached.
    let mut no_usage = honest_facts(&injection, 1);
    no_usage.usage = None;
    let (_, _, result) = ttft_result(&injection, &registry, 40, &no_usage);
    assert_eq!(result.status, Status::Fail, "{result:?}");
    // Slow enough for the whole prompt: passes whatever the usage says.
    let (_, _, result) = ttft_result(&injection, &registry, 2_500, &no_usage);
    assert_eq!(result.status, Status::Pass, "{result:?}");
}

#[test]
fn ttft_credits_no_cache_past_the_head_canary() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    // 300k cacheable tokens, then a 100k-token question no cache can hold
    // (it follows the fresh head canary): at least 0.5 s at 200k tokens/s.
    let (_, injection) = prepare(&policy, &registry, cached_job_request(300_000, 100_000), 1);
    let all = Some(injection.prompt_tokens_estimate);
    // A claim that the whole prompt was cached is credited up to the canary.
    let (stopped, _, result) = ttft_result(
        &injection,
        &registry,
        600,
        &usage_with_cache(&injection, all),
    );
    assert!(!stopped);
    assert_eq!(result.status, Status::Pass, "{result:?}");
    let (_, _, result) = ttft_result(
        &injection,
        &registry,
        480,
        &usage_with_cache(&injection, all),
    );
    assert_eq!(result.status, Status::Fail, "{result:?}");
    assert!(
        result.reason.as_deref().unwrap().contains("no cache holds"),
        "{result:?}"
    );
    // Too fast for the part after the canary: stopped at once, before any
    // text, whatever the usage will say.
    let (stopped, stopped_at, result) = ttft_result(
        &injection,
        &registry,
        40,
        &usage_with_cache(&injection, all),
    );
    assert!(stopped);
    assert_eq!(stopped_at, Some(0));
    assert_eq!(result.status, Status::Fail, "{result:?}");
    // A cached count above the reported prompt is not credited beyond it.
    let mut facts = usage_with_cache(&injection, all);
    facts.usage.as_mut().unwrap().prompt_tokens = 1;
    let (_, _, result) = ttft_result(&injection, &registry, 1_000, &facts);
    assert_eq!(result.status, Status::Fail, "{result:?}");
    assert!(
        result
            .reason
            .as_deref()
            .unwrap()
            .contains("of them possible"),
        "{result:?}"
    );
}

#[test]
fn usage_is_read_in_openai_deepseek_and_anthropic_shapes() {
    let read = |usage: serde_json::Value| ProviderUsage::from_usage(&usage);
    let openai = read(json!({"prompt_tokens": 2006, "completion_tokens": 300,
        "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0}}));
    assert_eq!(
        openai,
        Some(ProviderUsage {
            prompt_tokens: 2006,
            completion_tokens: Some(300),
            cached_prompt_tokens: Some(1920),
        })
    );
    let plain = read(json!({"prompt_tokens": 12, "completion_tokens": 3}));
    assert_eq!(plain.unwrap().cached_prompt_tokens, None);
    let deepseek = read(json!({"prompt_tokens": 1100, "completion_tokens": 5,
        "prompt_cache_hit_tokens": 1024, "prompt_cache_miss_tokens": 76}));
    assert_eq!(deepseek.unwrap().cached_prompt_tokens, Some(1024));
    // Anthropic's input_tokens leaves out what was read from or written to
    // the cache.
    let anthropic = read(json!({"input_tokens": 50, "output_tokens": 9,
        "cache_read_input_tokens": 100_000, "cache_creation_input_tokens": 248}));
    assert_eq!(
        anthropic,
        Some(ProviderUsage {
            prompt_tokens: 100_298,
            completion_tokens: Some(9),
            cached_prompt_tokens: Some(100_000),
        })
    );
    assert_eq!(read(json!({"prompt_tokens": "7"})), None);
    assert_eq!(read(json!({"completion_tokens": 7})), None);
    assert_eq!(read(json!("usage")), None);
}

#[test]
fn finish_problems() {
    let policy = policy(ReleasePolicy::VerdictFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    let mut request = chat_request(true);
    request["max_tokens"] = json!(500);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let answer = format!("{} x", echo_of(&injection));
    let cases: Vec<(Facts, Vec<FinishProblem>)> = vec![
        (
            Facts {
                finish_reasons: vec![Some("length".into())],
                usage: Some(ProviderUsage {
                    prompt_tokens: injection.prompt_tokens_estimate,
                    completion_tokens: Some(1),
                    cached_prompt_tokens: None,
                }),
                done_marker: Some(true),
            },
            vec![FinishProblem::LengthWithoutOutput(0)],
        ),
        (
            Facts {
                finish_reasons: vec![],
                usage: None,
                done_marker: Some(true),
            },
            vec![FinishProblem::EmptyChoices],
        ),
        (
            Facts {
                finish_reasons: vec![Some("stop".into())],
                usage: None,
                done_marker: Some(false),
            },
            vec![FinishProblem::NoDoneMarker],
        ),
        (
            Facts {
                finish_reasons: vec![None],
                usage: None,
                done_marker: Some(true),
            },
            vec![FinishProblem::NoFinishReason(0)],
        ),
    ];
    for (facts, problems) in cases {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let run = feed(&mut verifier, &registry, &[(0, answer.clone())], &facts);
        let result = run.finished.verdict.result(Check::Finish).unwrap();
        let Evidence::Finish {
            problems: found, ..
        } = &result.evidence
        else {
            panic!()
        };
        assert_eq!(found, &problems);
        assert_eq!(run.released[0], "");
    }
    // A client that asked for 2 tokens gets a 2-token length finish.
    let mut request = chat_request(false);
    request["max_tokens"] = json!(2);
    let (_, injection) = prepare(&policy, &registry, request, 2);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let facts = Facts {
        finish_reasons: vec![Some("length".into())],
        usage: Some(ProviderUsage {
            prompt_tokens: injection.prompt_tokens_estimate,
            completion_tokens: Some(2),
            cached_prompt_tokens: None,
        }),
        done_marker: None,
    };
    let run = feed(
        &mut verifier,
        &registry,
        &[(0, format!("{} Hi", echo_of(&injection)))],
        &facts,
    );
    assert!(run.finished.verdict.passed(), "{:?}", run.finished.verdict);
}

#[test]
fn several_choices_keep_separate_state() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(1);
    let mut request = chat_request(true);
    request["n"] = json!(2);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let echo = echo_of(&injection);
    let (a, b) = (
        format!("{echo} first answer"),
        format!("{echo}\nsecond answer"),
    );
    let mut chunks = Vec::new();
    for (wa, wb) in a
        .split_inclusive(' ')
        .zip(b.split_inclusive(' ').chain(std::iter::repeat("")))
    {
        chunks.push((0, wa.to_owned()));
        chunks.push((1, wb.to_owned()));
    }
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let run = feed(
        &mut verifier,
        &registry,
        &chunks,
        &honest_facts(&injection, 2),
    );
    assert!(run.finished.verdict.passed(), "{:?}", run.finished.verdict);
    assert_eq!(run.released, ["first answer", "second answer"]);

    // A choice the request did not ask for fails the finish check.
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let step = verifier.push(5, "x", &registry);
    assert!(step.stop);
    let finished = verifier.finish(&honest_facts(&injection, 2), &registry);
    assert!(finished.verdict.failed_checks().contains(&Check::Finish));
}

#[test]
fn passive_requests_skip_echo_and_say_so() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let mut request = chat_request(true);
    request["response_format"] = json!({"type": "json_object"});
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let body = "{\"answer\": 42}";
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let run = feed(
        &mut verifier,
        &registry,
        &words(body),
        &honest_facts(&injection, 1),
    );
    let verdict = &run.finished.verdict;
    assert!(verdict.passed());
    assert_eq!(verdict.result(Check::Echo).unwrap().status, Status::Skip);
    assert_eq!(verdict.header_value(), "pass; passive=json_mode");
    assert_eq!(run.released[0], body);
    // A leak into a passive answer is still caught.
    let (foreign, _) = other_canaries(4);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let leaked = format!("{{\"answer\": \"{foreign}\"}}");
    let run = feed(
        &mut verifier,
        &registry,
        &words(&leaked),
        &honest_facts(&injection, 1),
    );
    assert_eq!(run.finished.verdict.failed_checks(), [Check::ForeignCanary]);
    assert_eq!(find_canaries(&run.released[0]).count(), 0);
}

#[test]
fn a_reply_the_provider_withheld_is_not_an_echo_failure() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let finish = |reason: &str, text: &str| {
        let mut facts = honest_facts(&injection, 1);
        facts.finish_reasons = vec![Some(reason.into())];
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        feed(&mut verifier, &registry, &words(text), &facts)
            .finished
            .verdict
    };
    // No text and a content filter's (or Anthropic's refusal) finish: passed.
    for reason in ["content_filter", "refusal", "failed", "cancelled"] {
        let verdict = finish(reason, "");
        assert!(verdict.passed(), "{reason}: {verdict:?}");
        assert_eq!(
            verdict.result(Check::Echo).unwrap().evidence,
            Evidence::Echo {
                choices: vec![EchoOutcome::Withheld]
            },
            "{reason}"
        );
    }
    // Text without the echo fails whatever the finish; so does a reply
    // that ends with no text for any other reason.
    assert_eq!(
        finish("content_filter", "Partial answer").failed_checks(),
        [Check::Echo]
    );
    assert_eq!(finish("stop", "").failed_checks(), [Check::Echo]);
}

#[test]
fn a_reply_that_is_only_a_refusal_may_open_it_with_the_echo() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let echo = echo_of(&injection);
    let refused = |refusal: &str| {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        // A stream's first chunk: the role and an empty content.
        verifier.push(0, "", &registry);
        let mut shown = String::new();
        for piece in refusal.split_inclusive(' ') {
            shown += &verifier
                .push_part(0, Part::Refusal, piece, &registry)
                .release;
        }
        let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
        let rest = finished
            .parts
            .iter()
            .filter(|part| part.part == Part::Refusal)
            .map(|part| part.text.as_str())
            .collect::<String>();
        (shown + &rest, finished.verdict)
    };
    let (shown, verdict) = refused(&format!("{echo} I can't help with that."));
    assert!(verdict.passed(), "{verdict:?}");
    assert_eq!(shown.trim_start(), "I can't help with that.");
    // Without the echo, nothing vouches for it: it fails as before.
    let (_, verdict) = refused(&"I can't help with that, sorry. ".repeat(4));
    assert_eq!(verdict.failed_checks(), [Check::Echo]);
}

#[test]
fn a_stream_the_provider_ended_with_its_error_is_not_a_failed_answer() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    // The error event came instead of an end: no finish, no usage, no
    // `[DONE]`.
    let facts = Facts {
        finish_reasons: vec![None],
        usage: None,
        done_marker: Some(false),
    };
    let echo = echo_of(&injection);
    let (foreign, _) = other_canaries(3);
    let ended_by_error = |text: &str| {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let step = verifier.push(0, text, &registry);
        verifier.ended_by_provider_error();
        let finished = verifier.finish(&facts, &registry);
        (step.release + &finished.release[0], finished.verdict)
    };
    let result = |verdict: &Verdict, check| verdict.result(check).unwrap().status;
    // Before any text, inside the echo, and after it: nothing fails, the
    // echo (never seen) and the finish are skipped, and what an echo did
    // not vouch for stays held.
    for text in [String::new(), echo[..echo.len() / 2].to_owned()] {
        let (released, verdict) = ended_by_error(&text);
        assert!(verdict.passed(), "{text:?}: {verdict:?}");
        assert_eq!(released, "", "{text:?}");
        assert_eq!(
            verdict.result(Check::Echo).unwrap().evidence,
            Evidence::Echo {
                choices: vec![EchoOutcome::EndedByProviderError]
            },
            "{text:?}"
        );
        assert_eq!(result(&verdict, Check::Echo), Status::Skip, "{text:?}");
        assert_eq!(result(&verdict, Check::Finish), Status::Skip, "{text:?}");
    }
    // The same inside an echo that opens a refusal: nothing of it is kept.
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    verifier.push(0, "", &registry);
    let opening = format!("Sure. {}", &echo[..echo.len() / 2 + 4]);
    verifier.push_part(0, Part::Refusal, &opening, &registry);
    verifier.ended_by_provider_error();
    let finished = verifier.finish(&facts, &registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    assert!(
        finished.parts.iter().all(|part| part.text.is_empty()),
        "{:?}",
        finished.parts
    );
    let (released, verdict) = ended_by_error(&format!("{echo} Mercury, Venus"));
    assert!(verdict.passed(), "{verdict:?}");
    assert_eq!(released, "Mercury, Venus");
    assert_eq!(result(&verdict, Check::Echo), Status::Pass);
    assert_eq!(result(&verdict, Check::Finish), Status::Skip);
    // What it sent before its error is still judged: another session's
    // canary fails, and so does a reply that did not open with the echo
    // (past the preamble an echo may follow).
    let (_, verdict) = ended_by_error(&format!("{echo} the other one: {foreign}"));
    assert_eq!(verdict.failed_checks(), [Check::ForeignCanary]);
    let (_, verdict) = ended_by_error(&"Mercury, Venus and then ".repeat(ECHO_PREAMBLE_CHARS));
    assert_eq!(verdict.failed_checks(), [Check::Echo]);
    // The same stream without the error's word fails its finish.
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    verifier.push(0, &format!("{echo} Mercury"), &registry);
    let verdict = verifier.finish(&facts, &registry).verdict;
    assert_eq!(verdict.failed_checks(), [Check::Finish]);
}

#[test]
fn a_reply_cut_before_any_text_is_not_an_echo_failure() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let mut facts = honest_facts(&injection, 1);
    facts.finish_reasons = vec![Some("length".into())];
    let echo_of_run = |reasoning: &str, content: &str| {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        if !reasoning.is_empty() {
            verifier.push_part(0, Part::Reasoning, reasoning, &registry);
        }
        if !content.is_empty() {
            verifier.push(0, content, &registry);
        }
        let verdict = verifier.finish(&facts, &registry).verdict;
        (
            verdict.failed_checks(),
            verdict.result(Check::Echo).unwrap().evidence.clone(),
        )
    };
    // Hidden reasoning spent the whole budget: no text at all.
    assert_eq!(
        echo_of_run("", ""),
        (
            Vec::new(),
            Evidence::Echo {
                choices: vec![EchoOutcome::CutBeforeText]
            }
        )
    );
    // Reasoning that is shown and cut before the reply: nothing vouches
    // for it, so it is withheld, and the reply passes as a hidden one does.
    let withheld = (
        Vec::new(),
        Evidence::Echo {
            choices: vec![EchoOutcome::ReasoningWithheld],
        },
    );
    assert_eq!(echo_of_run("Let me think", ""), withheld);
    // Any text after the reasoning needs the echo.
    assert_eq!(echo_of_run("", "The answer").0, [Check::Echo]);
    // Unless the reasoning quoted every canary the echo asks for (the model
    // saw both ends of the prompt) and the limit cut it before any answer.
    let (head, tail) = (injection.canaries.head, injection.canaries.tail);
    let quoting = format!("I must begin my reply with \"{head} {tail}\", so I will");
    assert_eq!(
        echo_of_run(&quoting, ""),
        (
            Vec::new(),
            Evidence::Echo {
                choices: vec![EchoOutcome::QuotedInReasoning]
            }
        )
    );
    // Quoting one end vouches for nothing: withheld.
    assert_eq!(
        echo_of_run(&format!("I must begin with \"{head}\""), ""),
        withheld
    );
    assert_eq!(echo_of_run(&quoting, "The answer").0, [Check::Echo]);
    // Another request's canaries quoted in the reasoning vouch for nothing.
    let (others, _) = other_canaries(2);
    let borrowed = format!("I must begin my reply with \"{others}\"");
    assert!(!echo_of_run(&borrowed, "").0.is_empty());
    // What is withheld is the whole reasoning, and the verdict says so.
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let step = verifier.push_part(0, Part::Reasoning, "Let me think about ", &registry);
    assert!(step.release.is_empty());
    verifier.push_part(0, Part::Reasoning, "rivers", &registry);
    let finished = verifier.finish(&facts, &registry);
    assert_eq!(finished.part(0, Part::Reasoning), Some(""));
    let release = verifier.release_of(0, Part::Reasoning);
    assert_eq!(release.through, 25);
    assert_eq!(release.removed, std::slice::from_ref(&(0..25)));
    assert!(release.withheld && !verifier.release_of(0, Part::Content).withheld);
    assert_eq!(finished.verdict.header_value(), "pass; withheld=reasoning");
    // A limit that did not cut it: the echo is still owed.
    let mut stopped = honest_facts(&injection, 1);
    stopped.finish_reasons = vec![Some("stop".into())];
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    verifier.push_part(0, Part::Reasoning, &quoting, &registry);
    let verdict = verifier.finish(&stopped, &registry).verdict;
    assert_eq!(verdict.failed_checks(), [Check::Echo]);
}

/// Reasoning withheld is decided per choice, under whichever name the
/// reasoning came, and whatever the failure action (it passes).
#[test]
fn withheld_reasoning_holds_per_choice_and_under_every_name() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Flag);
    let registry = registry_with_others(2);
    let mut request = chat_request(true);
    request["n"] = json!(2);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let thought = "Thinking it over";
    verifier.push_part(0, Part::ReasoningAlias, thought, &registry);
    verifier.push(
        1,
        &format!("{} The answer.", echo_of(&injection)),
        &registry,
    );
    let mut facts = honest_facts(&injection, 2);
    facts.finish_reasons = vec![Some("length".into()), Some("stop".into())];
    let finished = verifier.finish(&facts, &registry);
    assert_eq!(finished.verdict.header_value(), "pass; withheld=reasoning");
    assert_eq!(
        finished.verdict.result(Check::Echo).unwrap().evidence,
        Evidence::Echo {
            choices: vec![EchoOutcome::ReasoningWithheld, EchoOutcome::Passed]
        }
    );
    let withheld = verifier.release_of(0, Part::ReasoningAlias);
    assert!(withheld.withheld);
    assert_eq!(withheld.removed, std::slice::from_ref(&(0..thought.len())));
    assert!(!verifier.release_of(1, Part::Content).withheld);
    assert!(verifier.withholds_reasoning(0) && !verifier.withholds_reasoning(1));
}

#[test]
fn retry_once_then_block_naming_the_failed_checks() {
    let policy = policy(ReleasePolicy::VerdictFirst, FailureAction::Retry);
    let registry = registry_with_others(1);
    let (_, injection) = prepare(&policy, &registry, chat_request(false), 1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let run = feed(
        &mut verifier,
        &registry,
        &[(0, "no echo".into())],
        &honest_facts(&injection, 1),
    );
    let verdict = &run.finished.verdict;
    assert_eq!(
        verdict.decide(FailureAction::Retry, 0, false),
        Decision::Retry
    );
    assert_eq!(
        verdict.decide(FailureAction::Retry, 1, false),
        Decision::Block
    );
    assert_eq!(
        verdict.decide(FailureAction::Retry, 0, true),
        Decision::Block
    );
    assert_eq!(
        verdict.decide(FailureAction::Fallback, 0, false),
        Decision::Fallback
    );
    assert_eq!(
        verdict.decide(FailureAction::Fallback, 1, false),
        Decision::Fallback
    );
    assert_eq!(
        verdict.decide(FailureAction::Fallback, 0, true),
        Decision::Block
    );

    assert_eq!(verdict.failed_check_names(), ["echo"]);
    assert!(
        verdict.failure_message().ends_with("(failed checks: echo)"),
        "{}",
        verdict.failure_message()
    );
    let audit = serde_json::to_value(verdict).unwrap();
    assert_eq!(audit["checks"][0]["check"], "echo");
    assert_eq!(audit["checks"][0]["status"], "fail");
    assert_eq!(
        audit["checks"][0]["evidence"]["choices"],
        json!(["missing"])
    );
}

#[test]
fn tool_call_arguments_are_scanned_and_held_to_the_end() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let mut request = chat_request(true);
    request["tools"] = json!([{"type": "function", "function": {"name": "lookup"}}]);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    assert!(injection.echo.is_empty());
    let own = injection.canaries.tail;

    // Honest arguments, with the model having copied its own passive marker.
    let arguments = format!("{{\"query\": \"hash map {own}\"}}");
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    for cut in arguments.as_bytes().chunks(5) {
        let piece = std::str::from_utf8(cut).unwrap();
        assert!(!verifier.push_tool_arguments(0, 0, piece, &registry));
    }
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    assert_eq!(finished.parts.len(), 1);
    assert_eq!(
        finished.part(0, Part::ToolArguments(0)),
        Some("{\"query\": \"hash map \"}")
    );
    // As positions: all of it released, the own marker removed.
    let release = verifier.release_of(0, Part::ToolArguments(0));
    assert_eq!(release.through, arguments.len());
    let at = arguments.find(&own.to_string()).unwrap();
    assert_eq!(release.removed.len(), 1);
    assert_eq!(release.removed[0], at..at + own.to_string().len());

    // A leak into the arguments, split across deltas, withholds them all.
    let (foreign, _) = other_canaries(1);
    let leaked = format!("{{\"query\": \"{foreign}\"}}");
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let mut stopped = false;
    for cut in leaked.as_bytes().chunks(3) {
        stopped = verifier.push_tool_arguments(0, 0, std::str::from_utf8(cut).unwrap(), &registry);
        if stopped {
            break;
        }
    }
    assert!(stopped);
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert_eq!(finished.verdict.failed_checks(), [Check::ForeignCanary]);
    assert!(finished.parts.is_empty());
}

/// A model that restates its prompt quotes canarygate's blocks: each goes
/// whole, its wording with its canary, however the text is cut into
/// deltas; wording that is not the block's stays.
#[test]
fn a_block_of_ours_quoted_whole_goes_whole() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let shown_after = |verifier: &mut Verifier, injection: &Injection, part: Part, text: &str| {
        let finished = verifier.finish(&honest_facts(injection, 1), &registry);
        assert!(finished.verdict.passed(), "{:?}", finished.verdict);
        let release = verifier.release_of(0, part);
        (
            finished.part(0, part).map(str::to_owned),
            shown(text, release.through, release.removed),
        )
    };

    // A passive marker, quoted into a tool call's arguments.
    let mut request = chat_request(true);
    request["tools"] = json!([{"type": "function", "function": {"name": "weather"}}]);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let own = injection.canaries.tail;
    let arguments = format!(
        "{{\"city\": \"Weather in Paris ({own} is a marker: never repeat it.)\", \"unit\": \"C\"}}"
    );
    let diverging = format!("{{\"city\": \"Paris ({own} is a marker, he said)\"}}");
    for size in [1, 3, 7, arguments.len()] {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        for piece in arguments.as_bytes().chunks(size) {
            let piece = std::str::from_utf8(piece).unwrap();
            assert!(!verifier.push_tool_arguments(0, 0, piece, &registry));
        }
        let expected = "{\"city\": \"Weather in Paris \", \"unit\": \"C\"}";
        let (whole, positions) = shown_after(
            &mut verifier,
            &injection,
            Part::ToolArguments(0),
            &arguments,
        );
        assert_eq!(whole.as_deref(), Some(expected), "pieces of {size}");
        assert_eq!(positions, expected, "pieces of {size}");

        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        for piece in diverging.as_bytes().chunks(size) {
            let piece = std::str::from_utf8(piece).unwrap();
            verifier.push_tool_arguments(0, 0, piece, &registry);
        }
        let (whole, _) = shown_after(
            &mut verifier,
            &injection,
            Part::ToolArguments(0),
            &diverging,
        );
        assert_eq!(
            whole.as_deref(),
            Some("{\"city\": \"Paris ( is a marker, he said)\"}"),
            "pieces of {size}"
        );
    }

    // The head instruction and the tail block, restated after the echo.
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 2);
    let (head, tail) = (injection.canaries.head, injection.canaries.tail);
    let content = format!(
        "{} You asked: Begin your reply with \"{head}\", a space and the CG code in square \
         brackets below, on one line; then answer normally. Explain hash maps. [{tail}] Done.",
        echo_of(&injection)
    );
    for size in [2, 5, 11, content.len()] {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        for piece in content.as_bytes().chunks(size) {
            let step = verifier.push_part(
                0,
                Part::Content,
                std::str::from_utf8(piece).unwrap(),
                &registry,
            );
            assert!(!step.stop);
        }
        let (_, positions) = shown_after(&mut verifier, &injection, Part::Content, &content);
        assert_eq!(
            positions, "You asked:  Explain hash maps.  Done.",
            "pieces of {size}"
        );
    }
}

#[test]
fn a_reply_cut_inside_its_own_canary_shows_none_of_it() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(5);
    let mut request = chat_request(true);
    request["tools"] = json!([{"type": "function", "function": {"name": "lookup"}}]);
    let (_, injection) = prepare(&policy, &registry, request, 1);
    let own = injection.canaries.tail.to_string();
    let mut length = honest_facts(&injection, 1);
    length.finish_reasons = vec![Some("length".into())];
    // Cut at the client's limit ten digits into the marker it quoted.
    for cut in [3, 12, own.len() - 1] {
        let arguments = format!("{{\"a\": \"hi ({}", &own[..cut]);
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        for piece in arguments.as_bytes().chunks(4) {
            verifier.push_tool_arguments(0, 0, std::str::from_utf8(piece).unwrap(), &registry);
        }
        let finished = verifier.finish(&length, &registry);
        assert_eq!(
            finished.part(0, Part::ToolArguments(0)),
            Some("{\"a\": \"hi ("),
            "cut after {cut} characters"
        );
    }
    // A code that is no prefix of this request's canaries stays (odds that
    // a drawn canary starts with fourteen nines: 10^-14).
    let other = format!("{{\"a\": \"part CG{}", "9".repeat(14));
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    verifier.push_tool_arguments(0, 0, &other, &registry);
    let finished = verifier.finish(&length, &registry);
    assert_eq!(
        finished.part(0, Part::ToolArguments(0)),
        Some(other.as_str())
    );
}

/// The client's view of `received` under `release`: the released bytes
/// without the removed spans.
fn shown(received: &str, through: usize, removed: &[std::ops::Range<usize>]) -> String {
    let mut text = String::new();
    let mut at = 0;
    for span in removed.iter().filter(|span| span.start < through) {
        text.push_str(&received[at..span.start]);
        at = span.end;
    }
    if at < through {
        text.push_str(&received[at..through]);
    }
    text
}

#[test]
fn reasoning_is_held_until_the_echo_passes_and_positions_follow_the_text() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let head = injection.canaries.head.to_string();
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);

    // The model thinks first, quoting its instructions (the head canary).
    let reasoning = format!("The system asks me to begin with \"{head}\". Then explain.");
    for piece in reasoning.as_bytes().chunks(7) {
        let step = verifier.push_part(
            0,
            Part::Reasoning,
            std::str::from_utf8(piece).unwrap(),
            &registry,
        );
        assert!(!step.stop);
        assert!(step.release.is_empty(), "reasoning shown before the echo");
        assert_eq!(verifier.release_of(0, Part::Reasoning).through, 0);
    }
    assert!(!verifier.released_any());
    let content = format!("{} {ANSWER}", echo_of(&injection));
    let mut shown_content = String::new();
    for piece in content.split_inclusive(' ') {
        shown_content.push_str(&verifier.push(0, piece, &registry).release);
    }
    // Once the echo passed, the reasoning is released as positions, its own
    // canary removed.
    let release = verifier.release_of(0, Part::Reasoning);
    assert_eq!(release.through, reasoning.len());
    assert_eq!(
        shown(&reasoning, release.through, release.removed),
        "The system asks me to begin with \"\". Then explain."
    );
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    shown_content.push_str(&finished.release[0]);
    assert_eq!(shown_content, ANSWER);
    let release = verifier.release_of(0, Part::Content);
    assert_eq!(release.through, content.len());
    assert_eq!(shown(&content, release.through, release.removed), ANSWER);
    assert_eq!(
        finished.part(0, Part::Reasoning),
        Some("The system asks me to begin with \"\". Then explain.")
    );

    // A foreign canary in the reasoning fails the answer: nothing released.
    let (foreign, _) = other_canaries(1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    let step = verifier.push_part(0, Part::Reasoning, &format!("recall {foreign}"), &registry);
    assert!(step.stop);
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert_eq!(finished.verdict.failed_checks(), [Check::ForeignCanary]);
    assert_eq!(verifier.release_of(0, Part::Reasoning).through, 0);
    assert!(finished.parts.is_empty());
}

/// Feeds `pieces` to two verifiers, one taking releases as strings
/// (`push_part`), one as positions only (`push_part_positions`), and checks
/// they agree after every piece and at the finish.
fn assert_positions_agree(
    policy: &Policy,
    registry: &canarygate_policies::MemoryRegistry,
    injection: &canarygate_policies::Injection,
    pieces: &[(Part, &str)],
) {
    let mut strings = Verifier::new(injection, &policy.verify, "openai", None);
    let mut positions = Verifier::new(injection, &policy.verify, "openai", None);
    for (at, (part, piece)) in pieces.iter().enumerate() {
        let step = strings.push_part(0, *part, piece, registry);
        let stop = positions.push_part_positions(0, *part, piece, registry);
        assert_eq!(step.stop, stop, "piece {at} of {pieces:?}");
        assert_eq!(
            strings.released_any(),
            positions.released_any(),
            "piece {at}"
        );
        for part in [Part::Content, Part::Reasoning] {
            let (string, position) = (strings.release_of(0, part), positions.release_of(0, part));
            assert_eq!(string.through, position.through, "piece {at}, {part:?}");
            assert_eq!(string.removed, position.removed, "piece {at}, {part:?}");
        }
        if stop {
            break;
        }
    }
    let facts = honest_facts(injection, 1);
    let (strings, positions) = (
        strings.finish(&facts, registry),
        positions.finish(&facts, registry),
    );
    assert_eq!(strings.verdict, positions.verdict, "{pieces:?}");
    assert_eq!(strings.release, positions.release, "{pieces:?}");
    assert_eq!(strings.parts, positions.parts, "{pieces:?}");
}

#[test]
fn releasing_as_positions_decides_what_releasing_as_strings_does() {
    let registry = registry_with_others(10);
    let (foreign, _) = other_canaries(3);
    for release in [ReleasePolicy::EchoFirst, ReleasePolicy::VerdictFirst] {
        let policy = policy(release, FailureAction::Block);
        let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
        let head = injection.canaries.head.to_string();
        let reasoning = format!("I am to begin with {head}, then answer.");
        let honest = format!("{} {ANSWER}", echo_of(&injection));
        let leaking = format!("{} Part one. {foreign} and the rest.", echo_of(&injection));
        for content in [&honest, &leaking] {
            // Reasoning then content, each cut once at every byte.
            for cut in (0..=content.len()).filter(|&cut| content.is_char_boundary(cut)) {
                let (first, second) = content.split_at(cut);
                let pieces = [
                    (Part::Reasoning, &reasoning[..10]),
                    (Part::Reasoning, &reasoning[10..]),
                    (Part::Content, first),
                    (Part::Content, second),
                ];
                assert_positions_agree(&policy, &registry, &injection, &pieces);
            }
            // Small pieces, the parts interleaved.
            let mut pieces = Vec::new();
            for (index, piece) in content.as_bytes().chunks(5).enumerate() {
                pieces.push((Part::Content, std::str::from_utf8(piece).unwrap()));
                if let Some(thought) = reasoning.as_bytes().chunks(5).nth(index) {
                    pieces.push((Part::Reasoning, std::str::from_utf8(thought).unwrap()));
                }
            }
            assert_positions_agree(&policy, &registry, &injection, &pieces);
        }
    }
}

/// A registry that answers like another and records every question.
struct Recording<'a> {
    inner: &'a canarygate_policies::MemoryRegistry,
    asked: std::sync::Mutex<Vec<canarygate_policies::Canary>>,
}

impl canarygate_policies::CanaryRegistry for Recording<'_> {
    fn owner(
        &self,
        canary: &canarygate_policies::Canary,
    ) -> Option<canarygate_policies::Registration> {
        self.asked.lock().unwrap().push(*canary);
        self.inner.owner(canary)
    }
}

/// A registry that answers asynchronously resolves, before each push, the
/// spans `spans_to_look_up` names: every span the push then asks about must
/// be among them, wherever the answer is cut (a canary split across deltas,
/// separators inside, several in a row), and the push's verdict is the same
/// as with a synchronous registry.
#[test]
fn spans_to_look_up_names_every_span_a_push_asks_about() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Flag);
    let registry = registry_with_others(8);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (first, second) = other_canaries(2);
    let spaced: String = second.to_string().chars().flat_map(|c| [c, ' ']).collect();
    let answer = format!(
        "{} Sure. {first} and {spaced}; also CG12 cg{}x, {first}{first}.",
        echo_of(&injection),
        &first.to_string()[2..]
    );
    for cut in 1..answer.len() {
        for width in [1, 3, 7] {
            let cuts: Vec<usize> = (cut..answer.len()).step_by(width).collect();
            let chunks = split_at(&answer, &cuts);
            let recording = Recording {
                inner: &registry,
                asked: std::sync::Mutex::new(Vec::new()),
            };
            let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
            for (choice, text) in &chunks {
                let named = verifier.spans_to_look_up(*choice, Part::Content, text);
                recording.asked.lock().unwrap().clear();
                verifier.push(*choice, text, &recording);
                for asked in recording.asked.lock().unwrap().iter() {
                    assert!(
                        named.contains(asked),
                        "cut {cut} width {width}: the push asked about {asked} \
                         but spans_to_look_up named {named:?}"
                    );
                }
            }
            recording.asked.lock().unwrap().clear();
            let finished = verifier.finish(&honest_facts(&injection, 1), &recording);
            assert!(
                recording.asked.lock().unwrap().is_empty(),
                "finish asked about a span no push had named"
            );
            let foreign = finished.verdict.result(Check::ForeignCanary).unwrap();
            assert_eq!(foreign.status, Status::Fail, "cut {cut} width {width}");
            let Evidence::ForeignCanary { foreign, .. } = &foreign.evidence else {
                panic!("foreign evidence");
            };
            // `first` four times (bare, after `cg`, twice run together) and
            // `second` spaced out, `C G` included.
            assert_eq!(
                foreign, &5,
                "cut {cut} width {width}: each foreign span counted"
            );
        }
    }
}

#[test]
fn an_unreachable_registry_degrades_the_verdict_or_fails_it_closed() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(2);
    let (_, injection) = prepare(&policy, &registry, chat_request(false), 1);
    let answer = format!("{} {ANSWER}", echo_of(&injection));
    for (unresolved, fail, passed) in [
        (0, false, true),
        (2, false, true),
        (2, true, false),
        (0, true, true),
    ] {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        verifier.registry_degraded(unresolved, fail);
        let run = feed(
            &mut verifier,
            &registry,
            &[(0, answer.clone())],
            &honest_facts(&injection, 1),
        );
        let verdict = &run.finished.verdict;
        let case = format!("unresolved {unresolved} fail {fail}: {verdict:?}");
        assert!(verdict.registry_degraded, "{case}");
        assert_eq!(verdict.passed(), passed, "{case}");
        assert!(
            verdict.header_value().ends_with("; registry_degraded"),
            "{case}"
        );
        let foreign = verdict.result(Check::ForeignCanary).unwrap();
        let Evidence::ForeignCanary {
            unresolved: seen, ..
        } = &foreign.evidence
        else {
            panic!("foreign evidence");
        };
        assert_eq!(seen, &unresolved, "{case}");
        if passed {
            assert_eq!(run.released[0], ANSWER, "{case}");
            assert!(
                foreign
                    .reason
                    .as_deref()
                    .unwrap_or_default()
                    .contains("registry_degraded")
            );
        } else {
            assert_eq!(
                run.released[0], "",
                "{case}: a fail-closed answer is withheld"
            );
            assert_eq!(verdict.failed_check_names(), ["foreign_canary"], "{case}");
        }
    }
}

/// The same across parts: reasoning that ends inside a canary-shaped span
/// (decided when the content starts), then content, then tool-call
/// arguments: every span a push asks about was named before it.
#[test]
fn spans_to_look_up_covers_part_switches() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Flag);
    let registry = registry_with_others(4);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (first, second) = other_canaries(1);
    let reasoning = format!("I must not say {first}, nor CG1234");
    let content = format!("{} fine, {second}", echo_of(&injection));
    let arguments = format!("{{\"q\": \"{first}\"}}");
    for cut in 1..reasoning.len() {
        let recording = Recording {
            inner: &registry,
            asked: std::sync::Mutex::new(Vec::new()),
        };
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        let mut pushes: Vec<(Part, String)> = split_at(&reasoning, &[cut])
            .into_iter()
            .map(|(_, text)| (Part::Reasoning, text))
            .collect();
        pushes.push((Part::Content, content.clone()));
        pushes.push((Part::ToolArguments(0), arguments.clone()));
        // And the reasoning resumed around another text: its held span,
        // carried, is looked at with what resumes it.
        let resumed = split_at(&reasoning, &[cut]);
        pushes.push((Part::Reasoning, resumed[0].1.clone()));
        pushes.push((Part::Refusal, "no".to_owned()));
        pushes.push((Part::Reasoning, resumed[1].1.clone()));
        for (part, text) in &pushes {
            let named = verifier.spans_to_look_up(0, *part, text);
            recording.asked.lock().unwrap().clear();
            verifier.push_part(0, *part, text, &recording);
            for asked in recording.asked.lock().unwrap().iter() {
                assert!(
                    named.contains(asked),
                    "cut {cut}: a {part:?} push asked about {asked}, named {named:?}"
                );
            }
        }
        recording.asked.lock().unwrap().clear();
        verifier.finish(&honest_facts(&injection, 1), &recording);
        assert!(recording.asked.lock().unwrap().is_empty(), "cut {cut}");
    }
}

#[test]
fn a_kept_conversation_accepts_the_sessions_earlier_canaries_only() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    // An earlier turn of the same session ("me"), and another session's.
    let (_, earlier) = prepare(&policy, &registry, chat_request(true), 2);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let old = earlier.canaries.tail;
    let (foreign, _) = other_canaries(3);
    let repeated = format!("{} As before ({old}), the answer.", echo_of(&injection));
    let leaked = format!("{} As before ({foreign}), the answer.", echo_of(&injection));
    for (accepting, answer, passes) in [
        (false, &repeated, false),
        (true, &repeated, true),
        (true, &leaked, false),
    ] {
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        if accepting {
            verifier.accept_session_canaries("me");
        }
        let run = feed(
            &mut verifier,
            &registry,
            &words(answer),
            &honest_facts(&injection, 1),
        );
        assert_eq!(
            run.finished.verdict.passed(),
            passes,
            "{accepting} {answer}: {:?}",
            run.finished.verdict
        );
        if passes {
            assert_eq!(run.released[0], "As before (), the answer.");
        }
    }
}

/// A provider that interleaves another text between the pieces of a
/// canary (a transcript, reasoning) cannot have the canary's first piece
/// decided on its own: the pieces still join, and another request's canary
/// fails the answer.
#[test]
fn a_canary_split_around_another_part_is_still_joined() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (foreign, _) = other_canaries(2);
    let foreign = foreign.to_string();
    for between in [Part::Transcript, Part::Reasoning, Part::Refusal] {
        for cut in 3..foreign.len() - 1 {
            let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
            verifier.push(0, &format!("{} Fine. ", echo_of(&injection)), &registry);
            verifier.push(0, &format!("Here: {}", &foreign[..cut]), &registry);
            verifier.push_part(0, between, "x", &registry);
            verifier.push(0, &format!("{} done.", &foreign[cut..]), &registry);
            let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
            assert_eq!(
                finished.verdict.failed_checks(),
                [Check::ForeignCanary],
                "cut at {cut}, {between:?} between"
            );
        }
    }
}

/// Another string's pieces pushed under one number (a stream's unknown
/// delta field, which SDKs join across chunks) are joined at a canary
/// split between them: another request's fails the answer. Under two
/// numbers they are two strings; and a request's own canary so split is
/// no failure.
#[test]
fn other_strings_under_one_number_join_at_a_split_canary() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let (foreign, _) = other_canaries(2);
    let foreign = foreign.to_string();
    let own = injection.canaries.head.to_string();
    for cut in 1..foreign.len() {
        for (canary, numbers, fails) in [
            (&foreign, [7, 7], true),
            (&foreign, [7, 8], false),
            (&own, [7, 7], false),
        ] {
            let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
            verifier.push(0, &format!("{} Fine.", echo_of(&injection)), &registry);
            let first = format!("note {}", &canary[..cut]);
            let second = format!("{} end", &canary[cut..]);
            for (number, text) in numbers.into_iter().zip([first, second]) {
                let named = verifier.spans_to_look_up(0, Part::Other(number), &text);
                verifier.push_part(0, Part::Other(number), &text, &registry);
                if fails && number == 7 && text.ends_with("end") {
                    let (found, _) = other_canaries(2);
                    assert!(named.contains(&found), "cut {cut}: named {named:?}");
                }
            }
            let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
            let failed = finished.verdict.failed_checks() == [Check::ForeignCanary];
            assert_eq!(failed, fails, "cut {cut}, {numbers:?}, {canary}");
            assert!(fails || finished.verdict.passed(), "cut {cut}");
        }
    }
}

/// A caller that reads releases as positions gets no other string kept
/// for the end: a stream may send one under the same number in every
/// event, and the verifier would hold all of them.
#[test]
fn other_strings_pushed_as_positions_are_not_kept() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    verifier.push_part_positions(0, Part::Content, &echo_of(&injection), &registry);
    let piece = "x".repeat(1024);
    for _ in 0..1000 {
        verifier.push_part_positions(0, Part::Other(7), &piece, &registry);
    }
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    let kept: usize = finished
        .parts
        .iter()
        .filter(|part| matches!(part.part, Part::Other(_)))
        .map(|part| part.text.len())
        .sum();
    assert_eq!(kept, 0);
}

/// A server that sends its reasoning under both names in every delta
/// (`reasoning_content` and `reasoning`) has each name's pieces joined:
/// the model quoting its own canary across deltas gets it removed from
/// both, and another request's canary so split fails the answer.
#[test]
fn reasoning_sent_under_two_names_joins_each_names_pieces() {
    let policy = policy(ReleasePolicy::EchoFirst, FailureAction::Block);
    let registry = registry_with_others(10);
    let (_, injection) = prepare(&policy, &registry, chat_request(true), 1);
    let head = injection.canaries.head.to_string();
    let reasoning = format!("I must begin with {head} and then answer.");
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    for piece in reasoning.as_bytes().chunks(4) {
        let piece = std::str::from_utf8(piece).unwrap();
        verifier.push_part(0, Part::Reasoning, piece, &registry);
        verifier.push_part(0, Part::ReasoningAlias, piece, &registry);
    }
    verifier.push(0, &format!("{} {ANSWER}", echo_of(&injection)), &registry);
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    for part in [Part::Reasoning, Part::ReasoningAlias] {
        let release = verifier.release_of(0, part);
        assert_eq!(
            shown(&reasoning, release.through, release.removed),
            "I must begin with  and then answer.",
            "{part:?}"
        );
    }

    let (foreign, _) = other_canaries(3);
    let leaking = format!("Recall {foreign} from before.");
    let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
    for piece in leaking.as_bytes().chunks(4) {
        let piece = std::str::from_utf8(piece).unwrap();
        verifier.push_part(0, Part::Reasoning, piece, &registry);
        verifier.push_part(0, Part::ReasoningAlias, piece, &registry);
    }
    verifier.push(0, &format!("{} {ANSWER}", echo_of(&injection)), &registry);
    let finished = verifier.finish(&honest_facts(&injection, 1), &registry);
    assert_eq!(finished.verdict.failed_checks(), [Check::ForeignCanary]);
}

/// A stored text read back loses what canarygate put there for the
/// caller's own canaries, and nothing else.
#[test]
fn own_text_is_taken_out_of_a_stored_text() {
    use canarygate_policies::canary::Canary;
    use canarygate_policies::inject::{RequestCanaries, inject};
    use canarygate_policies::verify::{own_text_removals, without_own_text};
    use canarygate_policies::{EchoCost, EchoMode};
    let canaries = RequestCanaries {
        head: canary(1),
        tail: canary(2),
    };
    let (head, tail) = (canaries.head, canaries.tail);
    let ours = |found: Canary| found == head || found == tail;
    // The blocks of a request, whole, with the separators before them.
    let mut body = json!({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a joke"}]});
    inject(
        &mut body,
        EchoMode::HeadTail,
        EchoCost::DIGIT_BY_DIGIT,
        canaries,
    )
    .unwrap();
    for (index, client) in [(0, "Be brief."), (1, "Tell me a joke")] {
        let placed = body["messages"][index]["content"].as_str().unwrap();
        assert_eq!(without_own_text(placed, &ours, false).unwrap(), client);
    }
    // The echo a reply opened with, written as models write it.
    for reply in [
        format!("{head} {tail} Why did"),
        format!("{head}\nWhy did"),
        format!("**{head} {tail}**\n\nWhy did"),
        format!("`{head}` `{tail}`\nWhy did"),
    ] {
        assert_eq!(
            without_own_text(&reply, &ours, true).unwrap(),
            "Why did",
            "{reply}"
        );
    }
    // In a text that does not open the reply: the span alone.
    let quoted = format!("The code was {head}.");
    assert_eq!(
        without_own_text(&quoted, &ours, false).unwrap(),
        "The code was ."
    );
    // Canary-shaped text that is not the caller's stays, a ticket in a
    // tail block's brackets too.
    let other = canary(3);
    let ticket = format!("Ticket [{other}] is open.\n\n[{tail}]");
    assert_eq!(
        without_own_text(&ticket, &ours, false).unwrap(),
        format!("Ticket [{other}] is open.")
    );
    assert_eq!(
        without_own_text(&format!("{other} first"), &ours, true),
        None
    );
    // Blocks, the echo and spans together, around characters of several
    // bytes: each removal is found in the text as it came.
    let mixed = format!("é{head} quoted.\n\n[{tail}] ünd {head}");
    assert_eq!(
        without_own_text(&mixed, &ours, false).unwrap(),
        "é quoted. ünd "
    );
    let reply = format!("{head} {tail}\nAnswer [ref] {head}\n\n[{tail}]");
    assert_eq!(
        own_text_removals(&reply, &ours, true)
            .iter()
            .map(|range| &reply[range.clone()])
            .collect::<Vec<_>>(),
        // Removals that meet are one.
        [format!("{head} {tail}\n"), format!("{head}\n\n[{tail}]")]
    );
}

//! Shared helpers for the verifier tests: a registry with other live
//! requests, injection into a chat request, and feeding answers in chunks.
#![allow(dead_code)]

pub mod strict;

use canarygate_policies::EchoCost;
use canarygate_policies::inject::RequestCanaries;
use canarygate_policies::verify::Finished;
use canarygate_policies::{
    Canary, Facts, Injection, MemoryRegistry, Policy, ProviderUsage, Registration, Verifier, inject,
};
use serde_json::{Value, json};

/// Deterministic canary number `n` (tests must not depend on the OS RNG).
pub fn canary(n: u64) -> Canary {
    let mut bytes = [0u8; 10];
    bytes[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
    bytes[8..].copy_from_slice(&(n as u16).to_be_bytes());
    Canary::from_random(bytes)
}

/// A registry holding `others` live requests (session `other-i`), two
/// canaries each, numbered from 1_000_000.
pub fn registry_with_others(others: u64) -> MemoryRegistry {
    let registry = MemoryRegistry::new(b"test secret");
    for index in 0..others {
        for half in 0..2 {
            registry.insert(
                &canary(1_000_000 + 2 * index + half),
                Registration {
                    session: format!("other-{index}"),
                    request: format!("req-{index}"),
                    expires_at_ms: u64::MAX,
                },
            );
        }
    }
    registry
}

/// Canaries of the live request `index` of [`registry_with_others`].
pub fn other_canaries(index: u64) -> (Canary, Canary) {
    (canary(1_000_000 + 2 * index), canary(1_000_001 + 2 * index))
}

/// A chat request with a system prompt and a user question.
pub fn chat_request(stream: bool) -> Value {
    json!({
        "model": "m",
        "stream": stream,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Explain how a hash map works, with an example in Rust."}
        ]
    })
}

/// Injects request `id`'s canaries (numbers `2 * id`, `2 * id + 1`) and
/// registers them. Both the client's conversation and the injected one must
/// render under the strict chat template.
pub fn prepare(
    policy: &Policy,
    registry: &MemoryRegistry,
    mut request: Value,
    id: u64,
) -> (Value, Injection) {
    let canaries = RequestCanaries {
        head: canary(2 * id),
        tail: canary(2 * id + 1),
    };
    strict::assert_renders(&request);
    let injection = inject(
        &mut request,
        policy.verify.echo,
        EchoCost::DIGIT_BY_DIGIT,
        canaries,
    )
    .expect("valid request");
    strict::assert_renders(&request);
    for own in [canaries.head, canaries.tail] {
        registry.insert(
            &own,
            Registration {
                session: "me".into(),
                request: format!("mine-{id}"),
                expires_at_ms: u64::MAX,
            },
        );
    }
    (request, injection)
}

/// The echo an obedient model writes for `injection`: the canaries, a space
/// between them.
pub fn echo_of(injection: &Injection) -> String {
    injection
        .echo
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Result of feeding an answer.
pub struct Run {
    /// Everything released to the client, per choice.
    pub released: Vec<String>,
    /// Chunk index at which the verifier said stop, if it did.
    pub stopped_at: Option<usize>,
    /// Verdict and final release.
    pub finished: Finished,
    /// Whether text went out before finish.
    pub released_before_finish: bool,
}

/// Facts of an honest single-choice answer.
pub fn honest_facts(injection: &Injection, choices: usize) -> Facts {
    Facts {
        finish_reasons: vec![Some("stop".into()); choices],
        usage: Some(ProviderUsage {
            prompt_tokens: injection.prompt_tokens_estimate,
            completion_tokens: Some(50),
            cached_prompt_tokens: None,
        }),
        done_marker: injection.stream.then_some(true),
    }
}

/// Feeds `chunks` (choice, text) in order, then finishes with `facts`.
pub fn feed(
    verifier: &mut Verifier,
    registry: &MemoryRegistry,
    chunks: &[(u32, String)],
    facts: &Facts,
) -> Run {
    let mut released = Vec::new();
    let mut stopped_at = None;
    for (index, (choice, text)) in chunks.iter().enumerate() {
        let step = verifier.push(*choice, text, registry);
        let slot = *choice as usize;
        if released.len() <= slot {
            released.resize(slot + 1, String::new());
        }
        released[slot].push_str(&step.release);
        if step.stop {
            stopped_at = Some(index);
            break;
        }
    }
    let released_before_finish = verifier.released_any();
    let finished = verifier.finish(facts, registry);
    for (slot, text) in finished.release.iter().enumerate() {
        if released.len() <= slot {
            released.resize(slot + 1, String::new());
        }
        released[slot].push_str(text);
    }
    Run {
        released,
        stopped_at,
        finished,
        released_before_finish,
    }
}

/// Splits `text` into chunks at the given byte cut points (moved to char
/// boundaries), all on choice 0.
pub fn split_at(text: &str, cuts: &[usize]) -> Vec<(u32, String)> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|&cut| {
            let mut cut = cut.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            cut
        })
        .collect();
    points.push(0);
    points.push(text.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|pair| (0, text[pair[0]..pair[1]].to_owned()))
        .collect()
}

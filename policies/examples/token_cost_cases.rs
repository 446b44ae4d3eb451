//! Prints, one JSON object per line, what canarygate adds to a set of
//! realistic short requests: the client's messages, the injected messages and
//! the echo an obedient model writes, in today's format (`after`) and in the
//! format canarygate used before issue 16 (`before`, rebuilt here as the
//! baseline: a system message first with the head canary, a system message
//! after the last user message with the tail, base32 canaries
//! `CG-XXXX-XXXX-XXXX-XXXX`). Each line also gives the output tokens
//! canarygate adds to the client's limit for the echo of an OpenAI or Llama 3
//! model (`allowance`). `policies/benches/token_cost/run.sh` counts them
//! with real tokenizers.
//!
//! `cargo run -q -p canarygate-policies --example token_cost_cases`

use canarygate_policies::EchoCost;
use canarygate_policies::inject::{RequestCanaries, inject, obedient_echo};
use canarygate_policies::{Canary, EchoMode};
use serde_json::{Value, json};

/// Short single-message prompts of the kind cron jobs and services send.
const PROMPTS: &[&str] = &[
    "What is the capital of Australia?",
    "Summarise this ticket in one line: the nightly export job failed twice with a timeout.",
    "Translate 'good morning, see you at the meeting' into German.",
    "Write a haiku about autumn rain.",
    "Fix this SQL: SELECT name FROM users WHERE id = ;",
    "Give me three name ideas for a small bakery.",
    "Is 1,234,567 a prime number?",
    "Explain what a mutex is in one sentence.",
    "Classify the sentiment of this review: 'The delivery was late again.'",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "List the planets of the solar system.",
    "Extract the date from: 'Invoice issued on 3 March 2025, due in 30 days.'",
];

/// A system prompt, for the rows that have one.
const SYSTEM: &str = "You are a concise assistant for an operations team. Answer in plain text.";

/// Answers the completion overhead is measured against.
const ANSWERS: &[&str] = &[
    "Canberra.",
    "The nightly export timed out twice.",
    "Guten Morgen, wir sehen uns im Meeting.",
    "Sure! Here is a short answer with **bold** text and a list:\n\n- one\n- two",
];

/// Canaries drawn per prompt (the baseline's base32 symbols tokenize
/// unevenly, so several draws give its typical cost).
const DRAWS: u64 = 5;

fn random_bytes(seed: u64) -> [u8; 10] {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut bytes = [0u8; 10];
    for byte in &mut bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *byte = (state >> 24) as u8;
    }
    bytes
}

/// The model the requests name: OpenAI's, whose tokenizer family (digits in
/// groups of three) Llama 3 shares.
const MODEL: &str = "gpt-4o";

/// A base32 canary as canarygate wrote them before: `CG-` and 16 Crockford
/// symbols in groups of four.
fn legacy_canary(bytes: [u8; 10]) -> String {
    const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let value = bytes
        .iter()
        .fold(0u128, |value, &byte| (value << 8) | u128::from(byte));
    let mut out = String::from("CG");
    for index in 0..16 {
        if index % 4 == 0 {
            out.push('-');
        }
        out.push(char::from(
            ALPHABET[((value >> (75 - 5 * index)) & 31) as usize],
        ));
    }
    out
}

/// The injection canarygate did before (head+tail echo), and its echo.
fn legacy_inject(messages: &[Value], head: &str, tail: &str) -> (Vec<Value>, String) {
    let head_text = format!(
        "canarygate verification, part 1 of 2. Begin your reply with \"{head}\" then a space and \
         the code given in part 2 at the end of the conversation, on one line, then answer \
         normally."
    );
    let tail_text = format!(
        "canarygate verification, part 2 of 2. Right after the code from part 1, write \"{tail}\" \
         on the same line, then a new line, then answer normally."
    );
    let mut messages = messages.to_vec();
    let after_last_user = messages
        .iter()
        .rposition(|message| message["role"] == "user")
        .map_or(messages.len(), |index| index + 1);
    messages.insert(
        after_last_user,
        json!({"role": "system", "content": tail_text}),
    );
    messages.insert(0, json!({"role": "system", "content": head_text}));
    (messages, format!("{head} {tail}"))
}

fn main() {
    for (index, prompt) in PROMPTS.iter().enumerate() {
        for with_system in [false, true] {
            let mut client = Vec::new();
            if with_system {
                client.push(json!({"role": "system", "content": SYSTEM}));
            }
            client.push(json!({"role": "user", "content": prompt}));
            for draw in 0..DRAWS {
                let seed = (index as u64) << 8 | draw;
                let (before, before_echo) = legacy_inject(
                    &client,
                    &legacy_canary(random_bytes(2 * seed)),
                    &legacy_canary(random_bytes(2 * seed + 1)),
                );
                let mut request = json!({"model": MODEL, "messages": client});
                let canaries = RequestCanaries {
                    head: Canary::from_random(random_bytes(2 * seed)),
                    tail: Canary::from_random(random_bytes(2 * seed + 1)),
                };
                let cost = EchoCost::for_model(MODEL);
                let injection = inject(&mut request, EchoMode::HeadTail, cost, canaries)
                    .unwrap_or_else(|error| panic!("{error}"));
                let after_echo = obedient_echo(&request).unwrap_or_default();
                let answer = ANSWERS[(index + draw as usize) % ANSWERS.len()];
                println!(
                    "{}",
                    json!({
                        "prompt": index,
                        "system": with_system,
                        "draw": draw,
                        "client": client,
                        "answer": answer,
                        "before": {"messages": before, "echo": before_echo},
                        "after": {"messages": request["messages"], "echo": after_echo},
                        "allowance": cost.allowance(injection.echo.len()),
                    })
                );
            }
        }
    }
}

//! Zero false alarms over 10,000 synthetic honest answers: prose, code,
//! canary lookalikes, JSON bodies and very short answers, echoed in the ways
//! models write it, split into random chunks, with 10,000 other requests'
//! canaries live in the registry.

mod common;

use canarygate_policies::verify::Check;
use canarygate_policies::{Canary, Decision, Policy, ReleasePolicy, Verifier};
use common::*;
use serde_json::json;

/// splitmix64: a deterministic generator, so a failure names a reproducible case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const PROSE: &[&str] = &[
    "A hash map stores entries in buckets indexed by the key's hash.",
    "The CG prefix in graphics code usually means Core Graphics, as in CGRect.",
    "Use `cgroups` to limit CPU: cg create, cg set, cg exec.",
    "Sure. Here is the summary you asked for:",
    "The tracking code is CG-ABCD-EFGH-JKMN-PQRS, as printed on the label.",
    "Part CG482937105662831 (unregistered) and cg 2024-12-01 10:15:00,123 in the log.",
    "Call 0800 123 456 789 or cg-12, CG 1, 2, 3; costs 1,234,567.89 CG$.",
    "Résumé: naïve café, 中文, emoji \u{1F600} and a no-break\u{a0}space.",
    "Order #CG1234567890ABCDEF shipped; invoice cg-0000-1111-2222-3333-444.",
    "\"Quoted\" text, *bold*, _italic_ and a > blockquote.",
    "**Answer:** it depends on the load factor.",
    "`code` first, then words.",
    "_Note_: \u{201C}smart quotes\u{201D} too.",
];

const CODE: &[&str] = &[
    "```rust\nlet rect = CGRect::new(0.0, 0.0, 10.0, 10.0);\nprintln!(\"{rect:?}\");\n```",
    "```python\nimport uuid\nprint(uuid.uuid4())  # 3f2b8c1e-9a4d-4e5f-8b6a-1c2d3e4f5a6b\n```",
    "```\nCG_FLAGS=-O2 -g\ncc $CG_FLAGS main.c -o main\n```",
    "    indented code\n    CGContextRef ctx = UIGraphicsGetCurrentContext();",
    "```sql\nSELECT cg_id, 'CG-' || lpad(id::text, 16, '0') FROM t;\n```",
];

const SHORT: &[&str] = &["OK", "4", "Yes.", "No", ".", "", "CG", "cg-", "C"];

fn lookalike(rng: &mut Rng) -> String {
    // A fresh, unregistered value in canary format (what a model might
    // invent when talking about canarygate itself).
    let mut bytes = [0u8; 10];
    for byte in &mut bytes {
        *byte = rng.next() as u8;
    }
    copy(rng, Canary::from_random(bytes))
}

/// `canary` as a model may copy it.
fn copy(rng: &mut Rng, canary: Canary) -> String {
    let text = canary.to_string();
    let digits = &text[2..];
    let groups = || (0..5).map(|g| &digits[3 * g..3 * g + 3]);
    match rng.below(6) {
        0 => text.to_lowercase(),
        1 => format!("CG-{digits}"),
        2 => format!("CG {}", groups().collect::<Vec<_>>().join(" ")),
        3 => format!("Cg{}", groups().collect::<Vec<_>>().join(",")),
        _ => text,
    }
}

fn answer(rng: &mut Rng) -> String {
    match rng.below(5) {
        0 => SHORT[rng.below(SHORT.len())].to_owned(),
        1 => format!("{} {}", rng.pick(PROSE), rng.pick(PROSE)),
        2 => format!("{}\n\n{}\n", rng.pick(PROSE), rng.pick(CODE)),
        3 => format!(
            "{} {} and {}.",
            rng.pick(PROSE),
            lookalike(rng),
            lookalike(rng)
        ),
        _ => {
            let mut text = String::new();
            for _ in 0..rng.below(20) {
                text.push_str(rng.pick(PROSE));
                text.push(if rng.below(4) == 0 { '\n' } else { ' ' });
            }
            text.push_str(rng.pick(CODE));
            text
        }
    }
}

fn json_answer(rng: &mut Rng) -> String {
    json!({
        "id": rng.next(),
        "code": lookalike(rng),
        "note": rng.pick(PROSE),
        "items": [rng.pick(SHORT), rng.pick(SHORT)],
    })
    .to_string()
}

/// How a model may write the echo before the answer: a short preamble,
/// quotes, backticks, bold or brackets around each canary or both, a gap
/// between them, copy variations of each, closing punctuation, line breaks.
fn echoed(rng: &mut Rng, canaries: &[Canary], answer: &str) -> String {
    let preamble = [
        "",
        "",
        "Sure! ",
        "Sure, here you go:\n\n",
        "Of course. Here are the codes: ",
        "> ",
        "Codes:\n",
        " ",
    ][rng.below(8)];
    let (open, close) = [
        ("", ""),
        ("\"", "\""),
        ("`", "`"),
        ("**", "**"),
        ("\u{201C}", "\u{201D}"),
        ("[", "]"),
        ("(", ")"),
    ][rng.below(7)];
    let each = rng.below(2) == 0;
    let between = [" ", ", ", "  ", "\n", " and ", " | ", "", " - "][rng.below(8)];
    let after = ["\n", "\n\n", " ", "\r\n", "\n\r\n", ".\n\n", ":\n", "!\n"][rng.below(8)];
    let canaries: Vec<String> = canaries
        .iter()
        .map(|canary| {
            let text = copy(rng, *canary);
            if each {
                format!("{open}{text}{close}")
            } else {
                text
            }
        })
        .collect();
    let line = canaries.join(between);
    if each {
        format!("{preamble}{line}{after}{answer}")
    } else {
        format!("{preamble}{open}{line}{close}{after}{answer}")
    }
}

fn random_chunks(rng: &mut Rng, text: &str) -> Vec<(u32, String)> {
    let cuts: Vec<usize> = (0..rng.below(12))
        .map(|_| rng.below(text.len() + 1))
        .collect();
    split_at(text, &cuts)
}

#[test]
fn ten_thousand_honest_answers_pass_unchanged() {
    let registry = registry_with_others(10_000);
    let mut rng = Rng(0x00C0_FFEE);
    let mut passive = 0;
    for id in 0..10_000u64 {
        let mut policy = Policy::preset(["default", "strict", "observe"][rng.below(3)]).unwrap();
        if rng.below(2) == 0 {
            policy.verify.release = ReleasePolicy::VerdictFirst;
        }
        let stream = rng.below(4) != 0;
        let json_mode = rng.below(8) == 0;
        let mut request = chat_request(stream);
        if json_mode {
            request["response_format"] = json!({"type": "json_object"});
        }
        let (_, injection) = prepare(&policy, &registry, request, id);
        let expected = if json_mode {
            json_answer(&mut rng)
        } else {
            answer(&mut rng).trim_start().to_owned()
        };
        let text = if injection.echo.is_empty() {
            passive += 1;
            expected.clone()
        } else {
            echoed(&mut rng, &injection.echo, &expected)
        };
        let mut verifier = Verifier::new(&injection, &policy.verify, "openai", None);
        if stream {
            assert!(!verifier.observe_ttft(50 + rng.below(2000) as u64));
        }
        let run = feed(
            &mut verifier,
            &registry,
            &random_chunks(&mut rng, &text),
            &honest_facts(&injection, 1),
        );
        let verdict = &run.finished.verdict;
        assert!(verdict.passed(), "request {id}: {text:?}\n{verdict:?}");
        assert_eq!(
            verdict.decide(policy.verify.action(), 0, run.released_before_finish),
            Decision::Deliver
        );
        assert_eq!(run.released[0], expected, "request {id}: {text:?}");
        let foreign = verdict.result(Check::ForeignCanary).unwrap();
        assert_eq!(
            serde_json::to_value(foreign).unwrap()["evidence"]["foreign"],
            0,
            "request {id}"
        );
    }
    assert!(passive >= 1000, "JSON mode exercised: {passive}");
}

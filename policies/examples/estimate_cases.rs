//! Prints, one JSON object per line, sample texts of many kinds with
//! canarygate's two token estimates of each, for
//! `policies/benches/token_cost/estimate.mjs` to compare with real
//! tokenizers: the high completion-token estimate ([`count_text_high`]),
//! which must never count fewer, and the prompt estimate ([`count_text`]),
//! which must not count so many more that an honest provider's
//! `prompt_tokens` falls below the check's floor.
//!
//! `cargo run -q -p canarygate-policies --example estimate_cases`

use canarygate_policies::tokens::{count_text, count_text_high};
use serde_json::json;

/// Files of this repository read as samples (prose, code, JSON).
const FILES: &[(&str, &str)] = &[
    ("english prose (README)", "README.md"),
    ("rust", "policies/src/verify.rs"),
    ("rust, few comments", "proxy/src/wire/chat/request.rs"),
    ("python", "tests/python/sdk_client.py"),
    ("json", "policies/benches/token_cost/package-lock.json"),
];

fn main() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut samples: Vec<(String, String)> = FILES
        .iter()
        .map(|(name, path)| {
            let text = std::fs::read_to_string(format!("{root}/{path}"))
                .unwrap_or_else(|error| panic!("{path}: {error}"));
            let end = (0..=text.len().min(20_000))
                .rev()
                .find(|at| text.is_char_boundary(*at))
                .unwrap_or(0);
            ((*name).to_owned(), text[..end].to_owned())
        })
        .collect();
    let numbers: Vec<String> = (0..400u64)
        .map(|i| (i * 7919 * 104_729 % 1_000_003).to_string())
        .collect();
    let generated = [
        ("numbers", numbers.join(", ")),
        (
            "english prose",
            "The quick brown fox jumps over the lazy dog. It was the best of times, it was the \
             worst of times; a hash map stores key/value pairs in buckets. "
                .repeat(20),
        ),
        (
            "german compounds",
            "Die Donaudampfschifffahrtsgesellschaftskapitänswitwe besuchte gestern die \
             Universitätsbibliothek, um Forschungsergebnisse über Verschlüsselungsverfahren \
             nachzuschlagen. "
                .repeat(10),
        ),
        (
            "cjk",
            "人工智能是计算机科学的一个分支，它企图了解智能的实质。日本語のテキストです。한국어 문장도 있습니다. "
                .repeat(10),
        ),
        (
            "urls and paths",
            "See https://example.com/path/to/resource?id=12345&sort=desc#section-2 and \
             C:\\Users\\name\\AppData\\Local\\Temp\\file_0042.tmp "
                .repeat(20),
        ),
        (
            "emoji",
            "🎉🚀✨ Great job! 👍🏽 Let us celebrate 🥳🎊 with some ❤️ and 🔥🔥🔥. ".repeat(20),
        ),
        // Runs of one symbol, which BPE vocabularies hold whole.
        (
            "log lines between = rules",
            format!("{}\nINFO job 17 finished\n", "=".repeat(80)).repeat(100),
        ),
        (
            "markdown with - rules",
            format!("Heading\n{}\n\nA short paragraph of text.\n\n", "-".repeat(40)).repeat(50),
        ),
        (
            "dot leaders",
            format!("Chapter one{} 12\n", ".".repeat(60)).repeat(50),
        ),
        (
            "ascii table",
            "+--------+--------+\n|  x     |   y    |\n+========+========+\n".repeat(50),
        ),
        (
            "markdown table",
            "| a | b | c |\n|---|---:|:---|\n| 1 | 2 | 3 |\n".repeat(50),
        ),
        (
            "minified json",
            r#"{"id":"a1","tags":["x","y"],"n":[1,2,3],"ok":true,"sub":{"k":null,"v":[{"w":0.5}]}}"#
                .repeat(100),
        ),
        (
            "html",
            "<div class=\"row\"><span id=\"x-1\">Hello</span></div>\n".repeat(100),
        ),
    ];
    samples.extend(generated.map(|(name, text)| (name.to_owned(), text)));
    for (name, text) in samples {
        let estimate = count_text_high(&text);
        let prompt_estimate = count_text(&text);
        println!(
            "{}",
            json!({"name": name, "text": text, "estimate": estimate,
                   "prompt_estimate": prompt_estimate})
        );
    }
}

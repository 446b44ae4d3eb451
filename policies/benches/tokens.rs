//! Prompt-token estimation: `tokens::count_text` against counting the
//! pieces one by one (`tokens::pieces(text).count()`, the definition it must
//! agree with), measured in one run.
//!
//! `cargo bench -p canarygate-policies --bench tokens`
//!
//! Two prompts of about 4.7 KB: ASCII prose (the load generator's, about 670
//! tokens), and the same with an accented word in every sentence (no ASCII
//! fast path). Each method runs round-robin and keeps its best round.

use std::hint::black_box;
use std::time::{Duration, Instant};

use canarygate_policies::tokens::{count_text, pieces};

const ROUNDS: usize = 30;
const CALLS_PER_ROUND: usize = 200;

fn prose(accented: bool) -> String {
    let words = [
        "lorem",
        "ipsum",
        "dolor",
        "sit",
        "amet,",
        "consectetur",
        "adipiscing",
        "elit.",
    ];
    (0..670)
        .map(|i| match (accented, i % 8) {
            (true, 3) => "café",
            (_, n) => words[n],
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Best time per call of `count` on `text`, over `ROUNDS` rounds.
fn best(text: &str, count: impl Fn(&str) -> u64, best: &mut Duration) -> u64 {
    let started = Instant::now();
    let mut total = 0;
    for _ in 0..CALLS_PER_ROUND {
        total += count(black_box(text));
    }
    *best = (*best).min(started.elapsed() / CALLS_PER_ROUND as u32);
    total
}

fn main() {
    println!("| prompt | bytes | count_text | pieces().count() | speed-up |");
    println!("|---|---:|---:|---:|---:|");
    for (name, text) in [("ASCII", prose(false)), ("non-ASCII", prose(true))] {
        let (mut fast, mut slow) = (Duration::MAX, Duration::MAX);
        for _ in 0..ROUNDS {
            let a = best(&text, count_text, &mut fast);
            let b = best(&text, |text| pieces(text).count() as u64, &mut slow);
            assert_eq!(a, b, "count_text disagrees with the pieces");
        }
        println!(
            "| {name} | {} | {:.1} µs | {:.1} µs | {:.2}x |",
            text.len(),
            fast.as_secs_f64() * 1e6,
            slow.as_secs_f64() * 1e6,
            slow.as_secs_f64() / fast.as_secs_f64()
        );
    }
}

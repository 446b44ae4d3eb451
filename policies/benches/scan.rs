//! Scan throughput of the streaming verifier with 1, 10,000 and 1,000,000
//! live canaries, measured in one run so the ratios are comparable.
//!
//! `cargo bench -p canarygate-policies --bench scan`
//!
//! The answer is 2 MiB of prose, code and log lines (many `c`/`C` and `CG`
//! words, `cg` followed by digits, which the scanner must look at) with an unregistered canary-shaped span every
//! [`LOOKALIKE_EVERY`] bytes, so every size does real registry lookups. It is
//! fed to `Verifier::push` in 1 KiB deltas. Sizes are measured round-robin and
//! the best of several rounds is kept, so drift on a shared machine hits all
//! sizes alike. Target: the 1,000,000 figure within 10% of the 1 figure.
//!
//! The scan itself does not depend on the registry size; each lookup does, by
//! memory latency (a 1,000,000-entry table does not fit in cache). The second
//! table prints the cost of one lookup per size, so the effect of a denser
//! stream of canary-shaped spans can be computed from it.

use std::hint::black_box;
use std::time::{Duration, Instant};

use canarygate_policies::EchoCost;
use canarygate_policies::inject::RequestCanaries;
use canarygate_policies::verify::Facts;
use canarygate_policies::{
    Canary, EchoMode, MemoryRegistry, Registration, Verifier, VerifyConfig, inject,
};
use serde_json::json;

const SIZES: [u64; 3] = [1, 10_000, 1_000_000];
const TEXT_BYTES: usize = 2 << 20;
const DELTA_BYTES: usize = 1024;
const ROUNDS: usize = 40;
/// Bytes of answer per canary-shaped span.
const LOOKALIKE_EVERY: usize = 16 * 1024;

fn canary(n: u64) -> Canary {
    let mut bytes = [0u8; 10];
    bytes[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
    bytes[8..].copy_from_slice(&(n as u16).to_be_bytes());
    Canary::from_random(bytes)
}

fn registry(live: u64) -> MemoryRegistry {
    let registry = MemoryRegistry::new(b"bench secret");
    for n in 0..live {
        registry.insert(
            &canary(1_000 + n),
            Registration {
                session: "s".into(),
                request: "r".into(),
                expires_at_ms: u64::MAX,
            },
        );
    }
    registry
}

fn answer() -> String {
    let paragraphs = [
        "A hash map stores entries in buckets chosen by the hash of the key; collisions chain. ",
        "```rust\nlet rect = CGRect::new(0.0, 0.0, 10.0, 10.0); // Core Graphics\n```\n",
        "Concurrency control in databases commonly uses locks or multiversioning, according to the workload. ",
        "The cgroup controller accounts CPU and memory; check /sys/fs/cgroup for its configuration.\n",
        "Log: cg 2024-12-01 10:15:00,123 CG 1,234,567 bytes, cg7 up 99.9%, CG-48 of 512 ok.\n",
    ];
    let mut text = String::with_capacity(TEXT_BYTES + 4096);
    let mut n = 10_000_000u64;
    while text.len() < TEXT_BYTES {
        let block_end = text.len() + LOOKALIKE_EVERY;
        for paragraph in paragraphs.iter().cycle() {
            if text.len() >= block_end {
                break;
            }
            text.push_str(paragraph);
        }
        // An unregistered canary-shaped span, as a model might invent one.
        n += 1;
        text.push_str(&format!("Reference {} noted.\n", canary(n)));
    }
    text
}

/// Feeds the whole answer; returns the bytes released (kept live).
fn scan(text: &str, registry: &MemoryRegistry, config: &VerifyConfig) -> usize {
    let mut request =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let canaries = RequestCanaries {
        head: canary(1),
        tail: canary(2),
    };
    let injection = inject(
        &mut request,
        EchoMode::Off,
        EchoCost::DIGIT_BY_DIGIT,
        canaries,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut verifier = Verifier::new(&injection, config, "bench", None);
    let mut released = 0;
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + DELTA_BYTES).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        released += verifier.push(0, &text[start..end], registry).release.len();
        start = end;
    }
    let facts = Facts {
        finish_reasons: vec![Some("stop".into())],
        usage: None,
        done_marker: Some(true),
    };
    let finished = verifier.finish(&facts, registry);
    assert!(finished.verdict.passed(), "{:?}", finished.verdict);
    released + finished.release.iter().map(String::len).sum::<usize>()
}

fn main() {
    let text = answer();
    let config = VerifyConfig::default();
    println!(
        "building registries ({} live canaries at most)...",
        SIZES[SIZES.len() - 1]
    );
    let registries: Vec<_> = SIZES.iter().map(|&live| registry(live)).collect();
    let mut best = [Duration::MAX; SIZES.len()];
    for _ in 0..ROUNDS {
        for (slot, registry) in registries.iter().enumerate() {
            let started = Instant::now();
            let released = black_box(scan(black_box(&text), registry, &config));
            best[slot] = best[slot].min(started.elapsed());
            assert_eq!(released, text.len());
        }
    }
    let mib = text.len() as f64 / (1024.0 * 1024.0);
    let spans = canarygate_policies::canary::find_canaries(&text).count();
    let base = mib / best[0].as_secs_f64();
    println!(
        "scan of {mib:.1} MiB in {DELTA_BYTES}-byte deltas, {spans} canary-shaped spans \
         (one per {} KiB), best of {ROUNDS} rounds:",
        LOOKALIKE_EVERY / 1024
    );
    for (live, time) in SIZES.iter().zip(best) {
        let throughput = mib / time.as_secs_f64();
        println!(
            "  {live:>9} live canaries: {throughput:8.1} MiB/s  (ratio to 1 live: {:.3})",
            throughput / base
        );
    }
    println!("registry lookup (HMAC key + table probe), per canary-shaped span:");
    for (live, cost) in SIZES.iter().zip(lookup_costs(&registries)) {
        println!("  {live:>9} live canaries: {cost:8.0} ns");
    }
    let ratio = (mib / best[2].as_secs_f64()) / base;
    println!(
        "1,000,000 vs 1: {ratio:.3} ({})",
        if ratio >= 0.9 {
            "within 10%"
        } else {
            "NOT within 10%"
        }
    );
}

/// Nanoseconds per lookup of an unregistered canary, per registry, best of
/// three passes over 100,000 probes.
fn lookup_costs(registries: &[MemoryRegistry]) -> Vec<f64> {
    use canarygate_policies::CanaryRegistry;
    let probes: Vec<Canary> = (0..100_000).map(|n| canary(50_000_000 + n)).collect();
    registries
        .iter()
        .map(|registry| {
            (0..3)
                .map(|_| {
                    let started = Instant::now();
                    let hits = probes
                        .iter()
                        .filter(|canary| registry.owner(black_box(canary)).is_some())
                        .count();
                    assert_eq!(hits, 0);
                    started.elapsed().as_nanos() as f64 / probes.len() as f64
                })
                .fold(f64::MAX, f64::min)
        })
        .collect()
}

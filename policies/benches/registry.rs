//! Canary registry upkeep: what a once-a-minute purge costs, with the expiry
//! index (`MemoryRegistry::purge_expired`) against the full scan it replaced
//! (`HashMap::retain` over every entry, the baseline), and what the index
//! costs each registration. Measured in one run.
//!
//! `cargo bench -p canarygate-policies --bench registry`
//!
//! The registry holds an hour of canaries (the default TTL) at a steady rate;
//! one second of them (the sweeper's interval) or one minute has expired when
//! the purge runs. Each method runs several rounds on a fresh copy and keeps
//! its best. A shard stays locked for about 1/16 of a purge.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use canarygate_policies::canary::CanaryKey;
use canarygate_policies::registry::{MemoryRegistry, Registration};

const ROUNDS: usize = 3;
/// Canaries registered per second (two per request at 400 requests/s).
const PER_SECOND: u64 = 800;
const TTL_MS: u64 = 3_600_000;

/// An hour of registrations, oldest first: `(key, registration)`.
fn hour() -> Vec<(CanaryKey, Registration)> {
    let count = PER_SECOND * TTL_MS / 1000;
    (0..count)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
            key[8..].copy_from_slice(&i.to_le_bytes());
            let registration = Registration {
                session: "cron-nightly".to_owned(),
                request: format!("req-{i:016x}"),
                expires_at_ms: TTL_MS + i * 1000 / PER_SECOND,
            };
            (CanaryKey(key), registration)
        })
        .collect()
}

type Entries = [(CanaryKey, Registration)];

/// Best times over `ROUNDS` fresh copies of filling a registry with `fill`
/// and purging it at `now_ms` with `purge`, which must drop `expiring`.
fn measure<R>(
    entries: &Entries,
    now_ms: u64,
    expiring: usize,
    fill: impl Fn(&Entries) -> R,
    purge: impl Fn(&mut R, u64) -> usize,
) -> (Duration, Duration) {
    let (mut filling, mut purging) = (Duration::MAX, Duration::MAX);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let mut registry = fill(entries);
        filling = filling.min(started.elapsed());
        let started = Instant::now();
        let removed = purge(&mut registry, black_box(now_ms));
        purging = purging.min(started.elapsed());
        assert_eq!(removed, expiring);
    }
    (filling, purging)
}

/// The registry with its expiry index.
fn indexed(entries: &Entries) -> MemoryRegistry {
    let registry = MemoryRegistry::new(b"bench secret");
    for (key, registration) in entries {
        registry.restore(*key, registration.clone());
    }
    registry
}

/// A plain map, purged by a full scan (the baseline).
fn plain(entries: &Entries) -> HashMap<CanaryKey, Registration> {
    // One insert at a time, growing as it goes, like the registry's shards.
    let mut map = HashMap::new();
    for (key, registration) in entries {
        map.insert(*key, registration.clone());
    }
    map
}

fn scan(map: &mut HashMap<CanaryKey, Registration>, now_ms: u64) -> usize {
    let before = map.len();
    map.retain(|_, registration| registration.expires_at_ms > now_ms);
    before - map.len()
}

fn main() {
    let entries = hour();
    println!(
        "{} live canaries (an hour at {PER_SECOND}/s)",
        entries.len()
    );
    println!();
    println!("| purge after | expired | expiry index | full scan (baseline) | speed-up |");
    println!("|---|---:|---:|---:|---:|");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut fills = (Duration::MAX, Duration::MAX);
    for interval_ms in [1_000, 60_000] {
        let now_ms = TTL_MS + interval_ms;
        let expiring = entries
            .iter()
            .filter(|(_, r)| r.expires_at_ms <= now_ms)
            .count();
        let (fill_indexed, purge_indexed) =
            measure(&entries, now_ms, expiring, indexed, |registry, now_ms| {
                registry.purge_expired(now_ms)
            });
        let (fill_plain, purge_plain) = measure(&entries, now_ms, expiring, plain, scan);
        fills = (fills.0.min(fill_indexed), fills.1.min(fill_plain));
        println!(
            "| {} s | {expiring} | {:.2} ms | {:.2} ms | {:.1}x |",
            interval_ms / 1000,
            ms(purge_indexed),
            ms(purge_plain),
            purge_plain.as_secs_f64() / purge_indexed.as_secs_f64()
        );
    }
    let per_entry = |d: Duration| d.as_secs_f64() * 1e9 / entries.len() as f64;
    println!();
    println!(
        "registration: {:.0} ns per canary with the index, {:.0} ns without ({:.2}x)",
        per_entry(fills.0),
        per_entry(fills.1),
        fills.0.as_secs_f64() / fills.1.as_secs_f64()
    );
}

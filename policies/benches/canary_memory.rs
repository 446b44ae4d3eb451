//! Memory per live canary in the registry the proxy uses
//! (`MemoryRegistry`): resident memory of this process before and after
//! minting canaries the way each request does (two per request,
//! `RequestCanaries::mint_registered`, both registered to the request's
//! session and id), at 10,000 and at 1,000,000 live canaries.
//!
//! `cargo bench -p canarygate-policies --bench canary_memory`
//! (`bench/growth.sh` runs it and reads the `canary_memory` JSON line).
//!
//! Resident memory is `VmRSS` of `/proc/self/status`: what the registry
//! costs the process, its allocator's overhead and spare capacity (hash
//! tables grow by doubling) included. The sessions and request ids have the
//! proxy's lengths: a 32-hex-digit session id, `cg-` and a 32-hex-digit
//! UUID for the request.

use canarygate_policies::inject::RequestCanaries;
use canarygate_policies::registry::{MemoryRegistry, Registration};

/// `VmRSS` of this process, bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// Mints the canaries of requests `from..to`: two each, registered.
fn mint_requests(registry: &MemoryRegistry, from: u64, to: u64) {
    for i in from..to {
        let registration = Registration {
            // 100 sessions, as a handful of jobs with a few labels each.
            session: format!("{:032x}", (i % 100).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            request: format!("cg-{:032x}", i.wrapping_mul(0x2545_F491_4F6C_DD1D)),
            expires_at_ms: 3_600_000 + i,
        };
        RequestCanaries::mint_registered(registry, &registration);
    }
}

fn main() {
    // cargo passes `--bench`; nothing to parse.
    let registry = MemoryRegistry::new(b"bench secret");
    let base = rss();
    let mut requests = 0;
    let mut rows = Vec::new();
    println!("live canaries | RSS growth | bytes per canary");
    println!("---:|---:|---:");
    for canaries in [10_000u64, 1_000_000] {
        let target = canaries / 2;
        mint_requests(&registry, requests, target);
        requests = target;
        assert_eq!(registry.len() as u64, canaries);
        let grown = rss().saturating_sub(base);
        let per_canary = grown as f64 / canaries as f64;
        println!(
            "{canaries} | {:.1} MiB | {per_canary:.0}",
            grown as f64 / 1048576.0
        );
        rows.push(format!(
            "{{\"canaries\":{canaries},\"rss_growth_bytes\":{grown},\"bytes_per_canary\":{per_canary:.1}}}"
        ));
    }
    println!(
        "canary_memory {{\"base_rss_bytes\":{base},\"points\":[{}]}}",
        rows.join(",")
    );
}

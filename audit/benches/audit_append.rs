//! Durable audit appends: throughput and latency with 1 and 64 concurrent
//! writers, for the journal (`AuditLog::record` under `durability =
//! "before_answer"`, what `serve` does: one sync per batch) against a store
//! commit per batch (`AuditLog::append`: redb's two syncs) and one store
//! commit per record, beside the disk's own write + `fdatasync` latency,
//! all measured in the same run on the same disk. Every append is on disk
//! before it returns in every case.
//!
//! `cargo bench -p canarygate-audit --bench audit_append [-- SECONDS]`
//! (default 2 s per case, three interleaved rounds, medians). Set
//! `CANARYGATE_BENCH_DIR` to measure another disk.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use canarygate_audit::{
    Action, AuditLog, AuditOptions, CheckRecord, CommitMode, Latency, NewRecord, Outcome,
    RequestRecord, Route, VerdictSummary, sha256_hex,
};
use canarygate_policies::verify::Status;
fn record(n: u64) -> RequestRecord {
    RequestRecord {
        request_id: format!("01JBENCH{n:018}"),
        started_at_ms: 1_764_504_000_000 + n,
        session: "ab".repeat(32),
        credential: Some("cd".repeat(32)),
        provider: "openai".into(),
        model: "gpt-4o-mini".into(),
        endpoint: None,
        route: Route::Upstream,
        prompt_tokens_ours: Some(1234),
        prompt_tokens_provider: Some(1230),
        provider_request_id: None,
        overhead_tokens: None,
        canary_ids: vec!["c1".into(), "c2".into()],
        instance: None,
        registry_degraded: false,
        topic: None,
        checks: ["echo", "foreign_canary", "prompt_tokens", "ttft", "finish"]
            .iter()
            .map(|name| CheckRecord {
                name: (*name).into(),
                result: Status::Pass,
                evidence: serde_json::json!({"observed": 1230, "expected": 1234}).into(),
            })
            .collect(),
        verdict: VerdictSummary::Pass,
        action: Action::Forward,
        outcome: Outcome::Complete,
        latency: Latency {
            ttfb_ms: Some(420),
            total_ms: 2100,
            overhead_ms: 2,
        },
        bytes_in: 5000,
        bytes_out: 2000,
        request_sha256: sha256_hex(b"request"),
        response_sha256: sha256_hex(b"response"),
    }
}

/// How appends reach the disk.
#[derive(Clone, Copy)]
enum AppendPath {
    /// `record`: journaled, one sync per batch; indexed afterwards.
    Journal,
    /// `append`: one store transaction per batch, redb's two syncs.
    StoreGroup,
    /// `append` with one store transaction per record.
    StorePerRecord,
}

/// Appends/s and every append's latency.
struct Measured {
    rate: f64,
    latencies_us: Vec<u64>,
}

fn private_dir(base: &std::path::Path) -> tempfile::TempDir {
    // Owner-only, as AuditLog::open requires (tempfile's default is 0777
    // less the umask).
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(base)
        .expect("temporary directory")
}

fn measure(base: &std::path::Path, path: AppendPath, writers: u64, seconds: f64) -> Measured {
    let dir = private_dir(base);
    let options = AuditOptions {
        commit: match path {
            AppendPath::StorePerRecord => CommitMode::PerRecord,
            AppendPath::Journal | AppendPath::StoreGroup => CommitMode::Group,
        },
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), options).expect("open audit log");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    runtime.block_on(async {
        let tasks: Vec<_> = (0..writers)
            .map(|writer| {
                let (log, latencies) = (log.clone(), Arc::clone(&latencies));
                tokio::spawn(async move {
                    let mut n = writer << 32;
                    let mut mine = Vec::new();
                    while Instant::now() < deadline {
                        let new = NewRecord {
                            record: record(n),
                            sample: None,
                        };
                        let sent = Instant::now();
                        match path {
                            AppendPath::Journal => drop(log.record(new).await.expect("record")),
                            AppendPath::StoreGroup | AppendPath::StorePerRecord => {
                                log.append(new).await.expect("append");
                            }
                        }
                        mine.push(sent.elapsed().as_micros() as u64);
                        n += 1;
                    }
                    latencies.lock().expect("latencies").extend(mine);
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("writer task");
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    let latencies_us = std::mem::take(&mut *latencies.lock().expect("latencies"));
    Measured {
        rate: latencies_us.len() as f64 / elapsed,
        latencies_us,
    }
}

/// The disk's floor: 4 KiB appended and `fdatasync`ed, `samples` times.
fn fsync_latencies(base: &std::path::Path, samples: usize) -> Vec<u64> {
    let dir = private_dir(base);
    let mut file = std::fs::File::create(dir.path().join("probe")).expect("probe file");
    let block = [0x5a_u8; 4096];
    (0..samples)
        .map(|_| {
            let sent = Instant::now();
            file.write_all(&block).expect("probe write");
            file.sync_data().expect("probe sync");
            sent.elapsed().as_micros() as u64
        })
        .collect()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`) run
    // a short smoke pass so the bench stays cheap to check.
    let benching = std::env::args().any(|arg| arg == "--bench");
    let seconds = std::env::args()
        .skip(1)
        .find_map(|arg| arg.parse::<f64>().ok())
        .unwrap_or(if benching { 2.0 } else { 0.2 });
    let base = std::env::var_os("CANARYGATE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&base).expect("bench directory");
    let cases = [
        ("journal", AppendPath::Journal, 1),
        ("store, group", AppendPath::StoreGroup, 1),
        ("store, per-record", AppendPath::StorePerRecord, 1),
        ("journal", AppendPath::Journal, 64),
        ("store, group", AppendPath::StoreGroup, 64),
        ("store, per-record", AppendPath::StorePerRecord, 64),
    ];
    // fsync latency on shared disks drifts: interleave the cases over several
    // rounds and report each case's median rate and p50/p99.
    let rounds = if benching { 3 } else { 1 };
    let probes = if benching { 300 } else { 30 };
    println!(
        "durable audit appends in {} (median of {rounds} rounds of {seconds} s per case)",
        base.display()
    );
    let mut rates = vec![Vec::new(); cases.len()];
    let mut p50s = vec![Vec::new(); cases.len()];
    let mut p99s = vec![Vec::new(); cases.len()];
    let mut fsync_p50 = Vec::new();
    let mut fsync_p99 = Vec::new();
    for _ in 0..rounds {
        let mut probe = fsync_latencies(&base, probes);
        probe.sort_unstable();
        fsync_p50.push(percentile(&probe, 50.0) as f64);
        fsync_p99.push(percentile(&probe, 99.0) as f64);
        for (index, (_, path, writers)) in cases.iter().enumerate() {
            let mut measured = measure(&base, *path, *writers, seconds);
            measured.latencies_us.sort_unstable();
            rates[index].push(measured.rate);
            p50s[index].push(percentile(&measured.latencies_us, 50.0) as f64);
            p99s[index].push(percentile(&measured.latencies_us, 99.0) as f64);
        }
    }
    let (fsync_p50, fsync_p99) = (median(&mut fsync_p50), median(&mut fsync_p99));
    println!(
        "disk: 4 KiB write + fdatasync p50 {fsync_p50:.0} µs, p99 {fsync_p99:.0} µs ({probes} per round)"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10} {:>10} {:>14}",
        "path", "writers", "appends/s", "p50 µs", "p99 µs", "p99 - fsync p99"
    );
    let mut medians = Vec::new();
    for (index, (name, _, writers)) in cases.iter().enumerate() {
        let rate = median(&mut rates[index]);
        let p50 = median(&mut p50s[index]);
        let p99 = median(&mut p99s[index]);
        medians.push((rate, p99));
        println!(
            "{name:<18} {writers:>8} {rate:>12.0} {p50:>10.0} {p99:>10.0} {:>14.0}",
            p99 - fsync_p99
        );
    }
    println!(
        "journal / store group: {:.2}x appends/s and {:.2}x p99 with 1 writer, {:.2}x and {:.2}x with 64",
        medians[0].0 / medians[1].0,
        medians[0].1 / medians[1].1,
        medians[3].0 / medians[4].0,
        medians[3].1 / medians[4].1,
    );
    println!(
        "store group / per-record, 64 writers: {:.2}x appends/s",
        medians[4].0 / medians[5].0
    );
}

//! Durable audit appends per second: 1 and 64 concurrent writers, group
//! commit against one commit per record, measured in the same run on the same
//! disk. Every append is fsync'd before it returns in both modes.
//!
//! `cargo bench -p canarygate-audit --bench audit_append [-- SECONDS]`
//! (default 2 s per case, three interleaved rounds, medians). Set
//! `CANARYGATE_BENCH_DIR` to measure another disk.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
                evidence: serde_json::json!({"observed": 1230, "expected": 1234}),
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

fn measure(base: &std::path::Path, mode: CommitMode, writers: u64, seconds: f64) -> f64 {
    // Owner-only, as AuditLog::open requires (tempfile's default is 0777
    // less the umask).
    let dir = {
        use std::os::unix::fs::PermissionsExt;
        tempfile::Builder::new()
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(base)
            .expect("temporary directory")
    };
    let options = AuditOptions {
        commit: mode,
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), options).expect("open audit log");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    runtime.block_on(async {
        let tasks: Vec<_> = (0..writers)
            .map(|writer| {
                let (log, done) = (log.clone(), Arc::clone(&done));
                tokio::spawn(async move {
                    let mut n = writer << 32;
                    while Instant::now() < deadline {
                        let new = NewRecord {
                            record: record(n),
                            sample: None,
                        };
                        log.append(new).await.expect("append");
                        done.fetch_add(1, Ordering::Relaxed);
                        n += 1;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("writer task");
        }
    });
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
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
        ("per-record", CommitMode::PerRecord, 1),
        ("group", CommitMode::Group, 1),
        ("per-record", CommitMode::PerRecord, 64),
        ("group", CommitMode::Group, 64),
    ];
    // fsync latency on shared disks drifts: interleave the cases over several
    // rounds and report each case's median.
    let rounds = if benching { 3 } else { 1 };
    println!(
        "durable audit appends/s in {} (median of {rounds} rounds of {seconds} s per case)",
        base.display()
    );
    let mut samples = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for (index, (_, mode, writers)) in cases.iter().enumerate() {
            samples[index].push(measure(&base, *mode, *writers, seconds));
        }
    }
    let medians: Vec<f64> = samples
        .iter_mut()
        .map(|rates| {
            rates.sort_by(f64::total_cmp);
            rates[rates.len() / 2]
        })
        .collect();
    println!("{:<12} {:>8} {:>14}", "commit", "writers", "appends/s");
    for ((name, _, writers), rate) in cases.iter().zip(&medians) {
        println!("{name:<12} {writers:>8} {rate:>14.0}");
    }
    println!(
        "group / per-record: {:.2}x with 1 writer, {:.2}x with 64 writers",
        medians[1] / medians[0],
        medians[3] / medians[2]
    );
    println!(
        "group, 64 writers / 1 writer: {:.2}x",
        medians[3] / medians[1]
    );
}

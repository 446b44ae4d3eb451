//! `canarygate audit` as a real process, on a store written by this process.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use canarygate_proxy::audit::{
    Action, AuditLog, AuditOptions, Latency, NewRecord, Outcome, RequestRecord, Route, STORE_FILE,
    Sample, Verdict, sha256_hex,
};

fn record(request_id: String) -> RequestRecord {
    RequestRecord {
        request_id,
        started_at_ms: 0,
        session: "ab".repeat(32),
        credential: None,
        provider: "sim".into(),
        model: "small".into(),
        route: Route::Upstream,
        prompt_tokens_ours: Some(12),
        prompt_tokens_provider: Some(12),
        canary_ids: vec![],
        checks: vec![],
        verdict: Verdict::Pass,
        action: Action::Forward,
        outcome: Outcome::Complete,
        latency: Latency {
            ttfb_ms: Some(5),
            total_ms: 9,
            overhead_ms: 1,
        },
        bytes_in: 10,
        bytes_out: 20,
        request_sha256: sha256_hex(b"in"),
        response_sha256: sha256_hex(b"out"),
    }
}

async fn append(log: &AuditLog, request_id: String) -> u64 {
    let new = NewRecord {
        record: record(request_id),
        sample: None,
    };
    log.append(new).await.unwrap()
}

fn canarygate(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .arg("audit")
        .arg("--data")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_fails_naming_a_record_changed_in_the_raw_file() {
    let dir = tempfile::tempdir().unwrap();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    for n in 1..=20 {
        assert_eq!(append(&log, format!("req-{n:04}")).await, n);
    }
    drop(log);
    let ok = canarygate(dir.path(), &["verify"]);
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    assert!(
        text(&ok.stdout).starts_with("ok: 20 records verified"),
        "{}",
        text(&ok.stdout)
    );

    // Edit record 13's request id in every copy of it in the file (redb
    // copies pages on write, so older versions may linger in free space).
    let path = dir.path().join(STORE_FILE);
    let mut file = std::fs::read(&path).unwrap();
    let needle = b"req-0013";
    let mut hits = 0;
    for at in 0..file.len() - needle.len() {
        if &file[at..at + needle.len()] == needle {
            file[at + needle.len() - 1] = b'9';
            hits += 1;
        }
    }
    assert!(hits > 0, "record text not found in the store file");
    std::fs::write(&path, &file).unwrap();

    let bad = canarygate(dir.path(), &["verify"]);
    let stderr = text(&bad.stderr);
    assert_eq!(bad.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("record 13"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_files_give_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    for n in 1..=50 {
        append(&log, format!("req-{n:04}")).await;
    }
    drop(log);
    let pristine = std::fs::read(dir.path().join(STORE_FILE)).unwrap();
    // Damage one spot at a time, spread over the whole file (header, tree
    // pages, free space): verify either passes (the byte was unused), or
    // fails with a message; it never crashes.
    let header = (0..4096.min(pristine.len())).step_by(61);
    let spread = (0..64).map(|step| step * pristine.len() / 64 + 7);
    let mut failures = 0;
    for at in header.chain(spread) {
        let damaged_dir = tempfile::tempdir().unwrap();
        let mut damaged = pristine.clone();
        damaged[at] ^= 0x5a;
        std::fs::write(damaged_dir.path().join(STORE_FILE), &damaged).unwrap();
        let data = damaged_dir.path().to_owned();
        let out = tokio::task::spawn_blocking(move || canarygate(&data, &["verify"]))
            .await
            .unwrap();
        let stderr = text(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "byte {at}: {:?} {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "byte {at}: {stderr}");
        if !out.status.success() {
            assert!(stderr.starts_with("canarygate: "), "byte {at}: {stderr}");
            failures += 1;
        }
    }
    assert!(failures > 0, "no damaged spot was noticed at all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_verify_and_review_run_while_another_process_appends() {
    let dir = tempfile::tempdir().unwrap();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    for n in 0..10 {
        append(&log, format!("warm-{n}")).await;
    }
    let sampled = log
        .append(NewRecord {
            record: record("sampled-request".into()),
            sample: Some(Sample {
                request_text: "question".into(),
                response_text: "answer".into(),
            }),
        })
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // Records committed so far (10 warm-up records and the sampled one).
    let written = Arc::new(AtomicU64::new(11));
    let writer = {
        let (log, stop, written) = (log.clone(), Arc::clone(&stop), Arc::clone(&written));
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                append(&log, format!("load-{n}")).await;
                written.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        })
    };

    let mut follower = Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .args(["audit", "--data"])
        .arg(dir.path())
        .args(["tail", "-n", "1", "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    let mut last_count = 0;
    for _ in 0..3 {
        // Each verify must see records committed after the previous one ran
        // (the shared disk may be slow: wait for the writer, not a fixed time).
        let waited = Instant::now();
        while written.load(Ordering::Relaxed) <= last_count {
            assert!(
                waited.elapsed() < Duration::from_secs(30),
                "the writer stalled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = written.load(Ordering::Relaxed);
        let data = dir.path().to_owned();
        let verify = tokio::task::spawn_blocking(move || canarygate(&data, &["verify"]))
            .await
            .unwrap();
        assert!(verify.status.success(), "{}", text(&verify.stderr));
        let stdout = text(&verify.stdout);
        let count: u64 = stdout
            .strip_prefix("ok: ")
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected verify output {stdout}"));
        assert!(count >= before, "{count} records, {before} written before");
        last_count = count;
        let data = dir.path().to_owned();
        let tail = tokio::task::spawn_blocking(move || canarygate(&data, &["tail", "-n", "3"]))
            .await
            .unwrap();
        assert!(tail.status.success(), "{}", text(&tail.stderr));
        assert_eq!(text(&tail.stdout).lines().count(), 3);
    }

    // A second process appends a review while this one keeps appending: the
    // chain must not fork.
    let data = dir.path().to_owned();
    let id = sampled.to_string();
    let mark = tokio::task::spawn_blocking(move || {
        canarygate(
            &data,
            &["spot-check", "--mark", &id, "ok", "--note", "fine"],
        )
    })
    .await
    .unwrap();
    assert!(mark.status.success(), "{}", text(&mark.stderr));
    assert!(text(&mark.stdout).contains(&format!("record {sampled} marked ok")));

    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    let verify = canarygate(dir.path(), &["verify"]);
    assert!(verify.status.success(), "{}", text(&verify.stderr));
    append(&log, "the-marker-request".into()).await;
    let stdout = follower.stdout.take().unwrap();
    let seen = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        for line in BufReader::new(stdout).lines() {
            if line.unwrap().contains("the-marker-request") {
                return true;
            }
            if Instant::now() > deadline {
                break;
            }
        }
        false
    });
    let seen = tokio::time::timeout(Duration::from_secs(30), seen).await;
    follower.kill().unwrap();
    let status = follower.wait().unwrap();
    assert!(
        matches!(seen, Ok(Ok(true))),
        "tail --follow never printed the new record ({status})"
    );
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let missing = canarygate(dir.path(), &["verify"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing.stderr).contains("no audit log at"),
        "{}",
        text(&missing.stderr)
    );

    let no_data = Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .args(["audit", "verify"])
        .env_remove("CANARYGATE_DATA")
        .output()
        .unwrap();
    assert_eq!(no_data.status.code(), Some(1));
    assert!(
        text(&no_data.stderr).contains("--data DIR is required"),
        "{}",
        text(&no_data.stderr)
    );

    std::fs::write(dir.path().join(STORE_FILE), b"this is not a redb file").unwrap();
    let garbage = canarygate(dir.path(), &["tail"]);
    assert_eq!(garbage.status.code(), Some(1), "{}", text(&garbage.stderr));
    assert!(
        !text(&garbage.stderr).contains("panicked"),
        "{}",
        text(&garbage.stderr)
    );

    let bad_time = canarygate(dir.path(), &["export", "--since", "last tuesday"]);
    assert_eq!(bad_time.status.code(), Some(1));
    assert!(
        text(&bad_time.stderr).contains("cannot read time"),
        "{}",
        text(&bad_time.stderr)
    );
}

//! `canarygate audit` as a real process, on a store written by this process.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use canarygate_audit::{
    Action, AuditLog, AuditOptions, CheckRecord, GENESIS_HASH, Latency, NewRecord, Outcome,
    RequestRecord, Route, STORE_FILE, Sample, SampleKey, VerdictSummary, chain_hash, sha256_hex,
};
use canarygate_policies::verify::Status;

/// A temporary data directory, owner-only as the audit log requires
/// (tempfile's own default is 0777 less the umask).
fn private_tempdir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .unwrap()
}

fn record(request_id: String) -> RequestRecord {
    RequestRecord {
        request_id,
        started_at_ms: 0,
        session: "ab".repeat(32),
        credential: None,
        provider: "sim".into(),
        model: "small".into(),
        endpoint: None,
        route: Route::Upstream,
        prompt_tokens_ours: Some(12),
        prompt_tokens_provider: Some(12),
        provider_request_id: None,
        overhead_tokens: None,
        canary_ids: vec![],
        instance: None,
        registry_degraded: false,
        topic: None,
        checks: vec![],
        verdict: VerdictSummary::Pass,
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

/// Record `n` of a varied log: every tenth (n % 10 == 3) failed its
/// prompt-token check and was blocked, every fifth was served locally, every
/// third keeps a sample.
fn varied(n: u64) -> NewRecord {
    let failed = n % 10 == 3;
    let check = |name: &str, result| CheckRecord {
        name: name.into(),
        result,
        evidence: serde_json::json!({"n": n}).into(),
    };
    let record = RequestRecord {
        route: if n.is_multiple_of(5) {
            Route::Local
        } else {
            Route::Upstream
        },
        checks: vec![
            check("echo", Status::Pass),
            check(
                "prompt_tokens",
                if failed { Status::Fail } else { Status::Pass },
            ),
        ],
        verdict: if failed {
            VerdictSummary::Fail
        } else {
            VerdictSummary::Pass
        },
        action: if failed {
            Action::Block
        } else {
            Action::Forward
        },
        latency: Latency {
            ttfb_ms: Some(10 + n % 7),
            total_ms: 50 + n % 13,
            overhead_ms: 1,
        },
        ..record(format!("req-{n:06}"))
    };
    let sample = n.is_multiple_of(3).then(|| Sample {
        request_text: format!("please summarise report {n} [canary redacted]"),
        response_text: format!("summary of report {n}"),
        provider_text: None,
    });
    NewRecord { record, sample }
}

/// Appends records `first..first + count` of [`varied`], in order.
async fn fill(log: &AuditLog, count: u64, first: u64) {
    for n in first..first + count {
        log.append(varied(n)).await.unwrap();
    }
}

fn canarygate(dir: &Path, args: &[&str]) -> Output {
    canarygate_with_input(dir, args, "")
}

/// `canarygate audit --data DIR ARGS` with `input` on its standard input.
fn canarygate_with_input(dir: &Path, args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .arg("audit")
        .arg("--data")
        .arg(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, input.as_bytes()).unwrap();
    drop(stdin);
    child.wait_with_output().unwrap()
}

/// Standard output of a run that must succeed.
fn ok(output: Output) -> String {
    assert!(output.status.success(), "{}", text(&output.stderr));
    text(&output.stdout)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_fails_naming_a_record_changed_in_the_raw_file() {
    let dir = private_tempdir();
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
    let dir = private_tempdir();
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
        let damaged_dir = private_tempdir();
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
    let dir = private_tempdir();
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
                provider_text: None,
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
    let dir = private_tempdir();
    let missing = canarygate(dir.path(), &["verify"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing.stderr).contains("no audit log at"),
        "{}",
        text(&missing.stderr)
    );

    // The commands that write (reviews, prunes) never create a store where
    // --data points wrong: they fail as the readers do.
    let nowhere = dir.path().join("nowhere");
    for args in [
        &["spot-check"][..],
        &["spot-check", "--mark", "1", "ok"],
        &["prune", "--before", "2026-01-01T00:00:00Z"],
    ] {
        let output = canarygate(&nowhere, args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        assert!(
            text(&output.stderr).contains("no audit log at"),
            "{args:?}: {}",
            text(&output.stderr)
        );
        assert!(!nowhere.exists(), "{args:?} created {}", nowhere.display());
    }

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_show_stats_and_export_print_what_is_stored() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 30, 0).await;
    let tail = ok(canarygate(dir.path(), &["tail", "-n", "5"]));
    let lines: Vec<_> = tail.lines().collect();
    assert_eq!(lines.len(), 5);
    assert!(
        lines[0].starts_with("#26 ") && lines[4].starts_with("#30 "),
        "{tail}"
    );
    let show = ok(canarygate(dir.path(), &["show", "4"]));
    assert!(
        show.contains("\"prev_hash\"") && show.contains("\"kind\": \"request\""),
        "{show}"
    );
    let stats = ok(canarygate(dir.path(), &["stats"]));
    assert!(stats.contains("requests: 30 (10 sampled)"), "{stats}");
    let later = ok(canarygate(dir.path(), &["stats", "--since", "2999-01-01"]));
    assert!(
        later.contains("requests: 0 (0 sampled)") && later.contains("latency total: n/a"),
        "{later}"
    );
    assert!(stats.contains("verdict: fail 3, pass 27"), "{stats}");
    assert!(stats.contains("route: local 6, upstream 24"), "{stats}");
    assert!(
        stats.contains("check prompt_tokens: fail 3, pass 27"),
        "{stats}"
    );
    assert!(stats.contains("latency total: p50"), "{stats}");
    let export = ok(canarygate(dir.path(), &["export"]));
    let lines: Vec<_> = export.lines().collect();
    assert_eq!(lines.len(), 30);
    let mut prev = hex(&GENESIS_HASH);
    for (index, line) in lines.iter().enumerate() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["id"], index as u64 + 1);
        assert_eq!(value["prev_hash"], prev.as_str());
        // The line minus its leading hash member is exactly the hashed body.
        let hash = value["hash"].as_str().unwrap();
        let body = format!("{{{}", &line[("{\"hash\":\"".len() + 64 + 2)..]);
        assert_eq!(hex(&chain_hash(body.as_bytes())), hash);
        prev = hash.to_owned();
    }
    let future = ok(canarygate(dir.path(), &["export", "--since", "2999-01-01"]));
    assert!(future.is_empty());
    let past = ok(canarygate(
        dir.path(),
        &["export", "--until", "2000-01-01T00:00:00Z"],
    ));
    assert!(past.is_empty());
    let recent = ok(canarygate(dir.path(), &["export", "--since", "1h"]));
    assert_eq!(recent.lines().count(), 30);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_argument_is_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 3, 0).await;
    for (args, expected) in [
        (&["show", "99"][..], "no record 99"),
        (&["export", "--since", "yesterday"], "cannot read time"),
        (&["spot-check", "--mark", "x", "ok"], "not a record id"),
        (
            &["spot-check", "--mark", "1", "maybe"],
            "must be `ok` or `bad`",
        ),
        (&["spot-check", "--mark", "77", "ok"], "no record 77"),
        (&["tail", "-n", "many"], "invalid value"),
    ] {
        let out = canarygate(dir.path(), args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_check_reviews_are_chained_records() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 9, 1).await; // samples at n = 3, 6, 9: records 3, 6 and 9
    let sampled = [3, 6, 9];
    // Interactive: the first fits, the second is skipped after a bad answer, the third is bad.
    let out = ok(canarygate_with_input(
        dir.path(),
        &["spot-check"],
        "y\nlooks right\nmaybe\ns\nn\nother customer's text\n",
    ));
    assert!(out.contains("fits this session? [y/n/s]"), "{out}");
    assert!(out.contains("summary of report"), "{out}");
    assert!(
        out.contains("answer y (fits), n (does not) or s (skip)"),
        "{out}"
    );
    assert!(out.contains("2 reviewed, 1 skipped, 1 left"), "{out}");
    let skipped = sampled[1].to_string();
    let marked = ok(canarygate(
        dir.path(),
        &[
            "spot-check",
            "--mark",
            &skipped,
            "ok",
            "--note",
            "checked by hand",
        ],
    ));
    assert!(
        marked.contains(&format!("record {skipped} marked ok")),
        "{marked}"
    );
    let again = canarygate(dir.path(), &["spot-check", "--mark", &skipped, "bad"]);
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("already reviewed"),
        "{}",
        text(&again.stderr)
    );
    let out = ok(canarygate(dir.path(), &["spot-check"]));
    assert!(out.contains("0 reviewed, 0 skipped, 0 left"), "{out}");
    let verify = ok(canarygate(dir.path(), &["verify"]));
    assert!(verify.starts_with("ok: 12 records verified"), "{verify}");
    let tail = ok(canarygate(dir.path(), &["tail", "-n", "3"]));
    assert!(
        tail.contains("review of #") && tail.contains("bad (other customer's text)"),
        "{tail}"
    );
    let stats = ok(canarygate(dir.path(), &["stats"]));
    assert!(stats.contains("review: bad 1, ok 2"), "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_prints_an_encrypted_sample_only_with_its_key() {
    let dir = private_tempdir();
    let key_hex = "5a".repeat(32);
    let options = AuditOptions {
        sample_key: Some(SampleKey::parse(&key_hex).unwrap()),
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), options).unwrap();
    log.append(varied(0)).await.unwrap();
    drop(log);
    let var = "CANARYGATE_TEST_SHOW_KEY";
    let without = Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .args(["audit", "--key-env", var, "--data"])
        .arg(dir.path())
        .args(["show", "1"])
        .env_remove(var)
        .output()
        .unwrap();
    let without = ok(without);
    assert!(without.contains("sample is encrypted"), "{without}");
    assert!(!without.contains("summary of report 0"), "{without}");
    let with = Command::new(env!("CARGO_BIN_EXE_canarygate"))
        .args(["audit", "--key-env", var, "--data"])
        .arg(dir.path())
        .args(["show", "1"])
        .env(var, &key_hex)
        .output()
        .unwrap();
    let with = ok(with);
    assert!(
        with.contains("please summarise report 0") && with.contains("summary of report 0"),
        "{with}"
    );
}

/// `canarygate audit ARGS` with one `--data` per directory.
fn canarygate_dirs(dirs: &[&Path], args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_canarygate"));
    command.arg("audit");
    for dir in dirs {
        command.arg("--data").arg(dir);
    }
    command.args(args).output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_instances_logs_export_merged_and_verify_each() {
    let (a, b) = (private_tempdir(), private_tempdir());
    let options = |name: &str| AuditOptions {
        instance: Some(name.to_owned()),
        ..AuditOptions::default()
    };
    let log_a = AuditLog::open(a.path(), options("a")).unwrap();
    let log_b = AuditLog::open(b.path(), options("b")).unwrap();
    // Interleaved in time: a1 b1 b2 a2 a3 b3 (records are stamped on append,
    // in milliseconds: a pause keeps the order unambiguous).
    for (log, id) in [
        (&log_a, "a1"),
        (&log_b, "b1"),
        (&log_b, "b2"),
        (&log_a, "a2"),
        (&log_a, "a3"),
        (&log_b, "b3"),
    ] {
        append(log, id.to_owned()).await;
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    drop((log_a, log_b));

    let merged = ok(canarygate_dirs(&[a.path(), b.path()], &["export"]));
    let order: Vec<String> = merged
        .lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            value["request_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(order, ["a1", "b1", "b2", "a2", "a3", "b3"], "{merged}");
    let since_b2: u64 = merged
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .find(|value| value["request_id"] == "b2")
        .and_then(|value| value["recorded_at_ms"].as_u64())
        .unwrap();
    let since = canarygate_audit::time::format_rfc3339(since_b2);
    let later = ok(canarygate_dirs(
        &[a.path(), b.path()],
        &["export", "--since", &since],
    ));
    assert_eq!(later.lines().count(), 4, "{later}");

    let verified = ok(canarygate_dirs(&[a.path(), b.path()], &["verify"]));
    assert_eq!(verified.matches("ok: ").count(), 2, "{verified}");

    // Break b's chain: verify checks both, names b, fails.
    let path = b.path().join(STORE_FILE);
    let mut file = std::fs::read(&path).unwrap();
    // Every copy of it (redb copies pages on write).
    let needle = b"\"b2\"";
    let hits: Vec<usize> = (0..file.len() - needle.len())
        .filter(|&at| &file[at..at + needle.len()] == needle)
        .collect();
    assert!(!hits.is_empty(), "b2 not found in the store file");
    for at in hits {
        file[at + 2] = b'9';
    }
    std::fs::write(&path, &file).unwrap();
    let broken = canarygate_dirs(&[a.path(), b.path()], &["verify"]);
    let (stdout, stderr) = (text(&broken.stdout), text(&broken.stderr));
    assert_eq!(broken.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!("ok: {}", a.path().display())),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("FAILED: {}", b.path().display())),
        "{stdout}"
    );
    assert!(stderr.contains("1 of 2 chains"), "{stderr}");

    // The other commands read one directory and say so.
    let tail = canarygate_dirs(&[a.path(), b.path()], &["tail"]);
    assert!(!tail.status.success());
    assert!(
        text(&tail.stderr).contains("several --data"),
        "{}",
        text(&tail.stderr)
    );
}

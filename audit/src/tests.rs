//! Store-level tests: real files, real processes.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use canarygate_policies::CanaryKey;
use canarygate_policies::verify::Status;
use redb::{ReadableDatabase, TableDefinition};

use crate::log::BACKGROUND_COMMIT_INTERVAL;
use crate::store::{CACHE_BYTES, RedbStore, Store};
use crate::time::now_ms;
use crate::verify::verify_chain;
use crate::*;

const RECORDS: TableDefinition<u64, &[u8]> = TableDefinition::new("records");
const SAMPLES: TableDefinition<u64, &[u8]> = TableDefinition::new("samples");
const API_KEY: &str = "sk-live-THIS-KEY-MUST-NEVER-BE-STORED";
const CANARY: &str = "CG482937105662831";

/// A temporary data directory, owner-only as `AuditLog::open` requires
/// (tempfile's own default is 0777 less the umask).
pub(crate) fn private_tempdir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .unwrap()
}

/// A request record as the proxy would fill it.
pub(crate) fn request(log: &AuditLog, n: u64, failed: bool) -> RequestRecord {
    RequestRecord {
        request_id: format!("req-{n:06}"),
        started_at_ms: now_ms(),
        session: hex::encode(hmac_sha256(&log.secrets().secret("session"), b"cron-1")),
        credential: Some(log.secrets().hash_credential(API_KEY)),
        provider: "sim".into(),
        model: "small".into(),
        endpoint: None,
        route: if n.is_multiple_of(5) {
            Route::Local
        } else {
            Route::Upstream
        },
        prompt_tokens_ours: Some(100 + n),
        prompt_tokens_provider: Some(if failed { 1 } else { 100 + n }),
        provider_request_id: None,
        overhead_tokens: None,
        canary_ids: vec![format!("c{n}")],
        instance: None,
        registry_degraded: false,
        topic: None,
        checks: vec![
            CheckRecord {
                name: "echo".into(),
                result: Status::Pass,
                evidence: serde_json::json!({"offset": 0}).into(),
            },
            CheckRecord {
                name: "prompt_tokens".into(),
                result: if failed { Status::Fail } else { Status::Pass },
                evidence: serde_json::json!({"ours": 100 + n, "provider": 1}).into(),
            },
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
        outcome: Outcome::Complete,
        latency: Latency {
            ttfb_ms: Some(10 + n % 7),
            total_ms: 50 + n % 13,
            overhead_ms: 1,
        },
        bytes_in: 200,
        bytes_out: 400,
        request_sha256: sha256_hex(format!("request {n}").as_bytes()),
        response_sha256: sha256_hex(format!("response {n}").as_bytes()),
    }
}

fn sample(n: u64) -> Sample {
    Sample {
        request_text: format!("please summarise report {n} [canary redacted]"),
        response_text: format!("summary of report {n}"),
        provider_text: None,
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Appends `count` records from `count` concurrent tasks; every third is sampled.
fn fill(log: &AuditLog, count: u64, first: u64) -> Vec<RecordId> {
    runtime().block_on(async {
        let tasks: Vec<_> = (first..first + count)
            .map(|n| {
                let log = log.clone();
                tokio::spawn(async move {
                    let record = request(&log, n, n % 10 == 3);
                    let sample = (n.is_multiple_of(3)).then(|| sample(n));
                    log.append(NewRecord { record, sample }).await.unwrap()
                })
            })
            .collect();
        let mut ids = Vec::new();
        for task in tasks {
            ids.push(task.await.unwrap());
        }
        ids
    })
}

fn verify(dir: &Path) -> Result<u64, AuditError> {
    Archive::open_read_only(dir)?
        .verify()
        .map(|report| report.records)
}

fn prune(dir: &Path, before_ms: u64) -> Result<Pruned, AuditError> {
    Archive::open_writable(dir)?.prune(before_ms)
}

/// Rewrites the stored value of `id` through redb, as an attacker with the file could.
fn edit_records(dir: &Path, edit: impl FnOnce(&mut redb::Table<u64, &[u8]>)) {
    let store = RedbStore::open_writable(dir).unwrap();
    let RedbStore::Writable(db) = &store else {
        unreachable!()
    };
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(RECORDS).unwrap();
        edit(&mut table);
    }
    txn.commit().unwrap();
}

fn stored(dir: &Path, id: u64) -> Vec<u8> {
    let store = RedbStore::open_read_only(dir).unwrap();
    let RedbStore::ReadOnly(db) = &store else {
        unreachable!()
    };
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(RECORDS).unwrap();
    table.get(id).unwrap().unwrap().value().to_vec()
}

#[test]
fn concurrent_appends_get_consecutive_ids_and_verify() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let mut ids = fill(&log, 200, 0);
    ids.sort_unstable();
    assert_eq!(ids, (1..=200).collect::<Vec<_>>());
    let report = Archive::open_read_only(dir.path())
        .unwrap()
        .verify()
        .unwrap();
    assert_eq!((report.records, report.range), (200, Some((1, 200))));
}

#[test]
fn the_page_cache_is_reported_and_bounded() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let before = log.cache_bytes();
    fill(&log, 200, 0);
    // The index lands within one pacing interval of the journal.
    let deadline = Instant::now() + Duration::from_secs(5);
    while log.cache_bytes() == before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = log.cache_bytes();
    assert!(after > before, "{before} -> {after} bytes");
    assert!(after <= CACHE_BYTES, "{after} bytes");
}

#[test]
fn group_commit_shares_transactions_and_per_record_does_not() {
    for (mode, shares) in [(CommitMode::Group, true), (CommitMode::PerRecord, false)] {
        let dir = private_tempdir();
        let options = AuditOptions {
            commit: mode,
            ..AuditOptions::default()
        };
        let log = AuditLog::open(dir.path(), options).unwrap();
        let before = log.commit_count();
        fill(&log, 200, 0);
        let commits = log.commit_count() - before;
        if shares {
            assert!(
                commits < 200,
                "{mode:?}: {commits} commits for 200 concurrent appends"
            );
        } else {
            assert_eq!(commits, 200, "{mode:?}");
        }
        assert_eq!(verify(dir.path()), Ok(200));
    }
}

/// An audit log with `[audit] durability = "background"`.
fn open_background(dir: &Path) -> AuditLog {
    let options = AuditOptions {
        durability: canarygate_policies::config::Durability::Background,
        ..AuditOptions::default()
    };
    AuditLog::open(dir, options).unwrap()
}

/// Records request `n` as the log's durability says, without a sample.
async fn record_unsampled(log: &AuditLog, n: u64) {
    let record = request(log, n, false);
    log.record(NewRecord {
        record,
        sample: None,
    })
    .await
    .unwrap();
}

/// Appends request `n` durably, without a sample.
async fn append_unsampled(log: &AuditLog, n: u64) {
    let record = request(log, n, false);
    log.append(NewRecord {
        record,
        sample: None,
    })
    .await
    .unwrap();
}

#[test]
fn background_records_and_canaries_land_in_order_with_the_next_commit() {
    let dir = private_tempdir();
    let log = open_background(dir.path());
    runtime().block_on(async {
        for n in 0..100 {
            record_unsampled(&log, n).await;
        }
        let entry = CanaryEntry {
            key: CanaryKey([7; 16]),
            session: "s".into(),
            request_id: "r".into(),
            expires_at_ms: u64::MAX,
        };
        log.register_canaries_soon(vec![entry]).unwrap();
        // One durable append after them: the writer works in queue order, so
        // everything queued before it is on disk when it returns.
        append_unsampled(&log, 100).await;
    });
    assert_eq!(verify(dir.path()), Ok(101));
    assert_eq!(log.live_canaries(0).unwrap().len(), 1);
    assert_eq!(log.background_failures(), 0);
}

#[test]
fn each_journal_sync_is_observed_and_the_background_audit_has_none() {
    let observed = |log: &AuditLog| {
        let syncs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = syncs.clone();
        assert!(log.observe_journal_syncs(Box::new(move |took| {
            seen.lock().unwrap().push(took);
        })));
        assert!(!log.observe_journal_syncs(Box::new(|_| {})), "one observer");
        syncs
    };
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let syncs = observed(&log);
    runtime().block_on(async {
        // One at a time: each record is its own batch, with its own sync.
        for n in 0..20 {
            record_unsampled(&log, n).await;
        }
    });
    let syncs = syncs.lock().unwrap().clone();
    assert_eq!(syncs.len(), 20, "{syncs:?}");
    assert!(
        syncs
            .iter()
            .all(|took| *took > Duration::ZERO && *took < Duration::from_secs(10))
    );

    let dir = private_tempdir();
    let log = open_background(dir.path());
    let syncs = observed(&log);
    runtime().block_on(async {
        for n in 0..20 {
            record_unsampled(&log, n).await;
        }
    });
    assert!(syncs.lock().unwrap().is_empty(), "nothing is journaled");
}

#[test]
fn background_commits_start_at_most_once_per_interval() {
    let dir = private_tempdir();
    let log = open_background(dir.path());
    let before = log.commit_count();
    let started = Instant::now();
    runtime().block_on(async {
        // One record a millisecond: unpaced, nearly each would get its own commit.
        for n in 0..150 {
            record_unsampled(&log, n).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // A durable append waits for everything queued before it.
        append_unsampled(&log, 150).await;
    });
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let commits = log.commit_count() - before;
    assert!(
        commits <= elapsed_ms / BACKGROUND_COMMIT_INTERVAL.as_millis() as u64 + 2,
        "{commits} commits in {elapsed_ms} ms: commits are not paced"
    );
    assert_eq!(verify(dir.path()), Ok(151));
}

#[test]
fn flipped_byte_is_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 20, 0);
    let mut value = stored(dir.path(), 7);
    let at = value.len() - 10;
    value[at] ^= 1;
    edit_records(dir.path(), |table| {
        table.insert(7, value.as_slice()).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error.to_string().contains("record 7: contents changed"),
        "{error}"
    );
}

#[test]
fn rehashed_edit_breaks_the_link_to_the_next_record() {
    // An attacker who also fixes the stored hash of the record they edited is
    // caught by the next record's prev_hash.
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 20, 0);
    let value = stored(dir.path(), 7);
    let body = String::from_utf8(value[32..].to_vec()).unwrap();
    let edited = body.replace("\"verdict\":\"fail\"", "\"verdict\":\"pass\"");
    let edited = if edited == body {
        body.replace("\"bytes_out\":400", "\"bytes_out\":401")
    } else {
        edited
    };
    assert_ne!(edited, body);
    let mut value = chain_hash(edited.as_bytes()).to_vec();
    value.extend_from_slice(edited.as_bytes());
    edit_records(dir.path(), |table| {
        table.insert(7, value.as_slice()).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("record 8: does not chain onto record 7"),
        "{error}"
    );
}

#[test]
fn deleted_record_is_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 20, 0);
    edit_records(dir.path(), |table| {
        table.remove(12).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(error.to_string().contains("record 12: missing"), "{error}");
    // Deleting the first record is caught too (no checkpoint explains it).
    edit_records(dir.path(), |table| {
        table.remove(1).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(error.to_string().contains("record 1: missing"), "{error}");
}

#[test]
fn swapped_records_are_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 20, 0);
    let (five, six) = (stored(dir.path(), 5), stored(dir.path(), 6));
    edit_records(dir.path(), |table| {
        table.insert(5, six.as_slice()).unwrap();
        table.insert(6, five.as_slice()).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error.to_string().contains("record 5: holds record 6"),
        "{error}"
    );
}

#[test]
fn inserted_record_is_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 10, 0);
    // Renumber 6..=10 to 7..=11 and put a copy of record 3 at 6.
    let moved: Vec<_> = (6..=10).map(|id| stored(dir.path(), id)).collect();
    let copy = stored(dir.path(), 3);
    edit_records(dir.path(), |table| {
        for (offset, value) in moved.iter().enumerate() {
            table.insert(7 + offset as u64, value.as_slice()).unwrap();
        }
        table.insert(6, copy.as_slice()).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error.to_string().contains("record 6: holds record 3"),
        "{error}"
    );
}

#[test]
fn changed_or_deleted_sample_is_named() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 10, 0);
    let sampled = RedbStore::open_read_only(dir.path())
        .unwrap()
        .read()
        .unwrap()
        .sampled_ids()
        .unwrap();
    let id = sampled[1];
    let original = RedbStore::open_read_only(dir.path())
        .unwrap()
        .read()
        .unwrap()
        .sample(id)
        .unwrap()
        .unwrap();
    let store = RedbStore::open_writable(dir.path()).unwrap();
    let RedbStore::Writable(db) = &store else {
        unreachable!()
    };
    let txn = db.begin_write().unwrap();
    txn.open_table(SAMPLES)
        .unwrap()
        .insert(
            id,
            b"\0{\"request_text\":\"x\",\"response_text\":\"y\"}".as_slice(),
        )
        .unwrap();
    txn.commit().unwrap();
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("record {id}: its sample was changed")),
        "{error}"
    );
    let txn = db.begin_write().unwrap();
    txn.open_table(SAMPLES).unwrap().remove(id).unwrap();
    txn.commit().unwrap();
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("record {id}: its sample was deleted")),
        "{error}"
    );
    // A sample slipped in for a record that was not sampled is caught too.
    let txn = db.begin_write().unwrap();
    txn.open_table(SAMPLES)
        .unwrap()
        .insert(id, original.as_slice())
        .unwrap();
    let unsampled = (1..=10).find(|id| !sampled.contains(id)).unwrap();
    txn.open_table(SAMPLES)
        .unwrap()
        .insert(unsampled, b"\0{}".as_slice())
        .unwrap();
    txn.commit().unwrap();
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("record {unsampled}: a sample was added")),
        "{error}"
    );
}

#[test]
fn prune_leaves_a_checkpoint_that_keeps_verify_meaningful() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 30, 0);
    std::thread::sleep(Duration::from_millis(20));
    let cut = now_ms();
    std::thread::sleep(Duration::from_millis(20));
    fill(&log, 10, 30);
    assert_eq!(
        prune(dir.path(), cut),
        Ok(Pruned {
            removed: 30,
            checkpoint: Some(41)
        })
    );
    assert_eq!(verify(dir.path()), Ok(11));
    // The log goes on after a prune, and a second prune chains the same way.
    fill(&log, 5, 40);
    assert_eq!(verify(dir.path()), Ok(16));
    assert_eq!(
        prune(dir.path(), cut),
        Ok(Pruned {
            removed: 0,
            checkpoint: None
        })
    );
    // Deleting the checkpoint, or more records at the start, is caught.
    edit_records(dir.path(), |table| {
        table.remove(31).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(error.to_string().contains("record 31: missing"), "{error}");
}

#[test]
fn deleting_a_checkpoint_is_caught() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 5, 0);
    std::thread::sleep(Duration::from_millis(5));
    prune(dir.path(), now_ms()).unwrap();
    fill(&log, 3, 5);
    assert_eq!(verify(dir.path()), Ok(4));
    edit_records(dir.path(), |table| {
        table.remove(6).unwrap();
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(error.to_string().contains("record 6: missing"), "{error}");
    // Removing everything from the checkpoint on leaves a start marker that
    // no checkpoint record backs.
    edit_records(dir.path(), |table| {
        for id in 7..=9 {
            table.remove(id).unwrap();
        }
    });
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error.to_string().contains("no checkpoint record explains"),
        "{error}"
    );
}

#[test]
fn prune_refuses_a_broken_chain() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 5, 0);
    edit_records(dir.path(), |table| {
        table.remove(2).unwrap();
    });
    let error = prune(dir.path(), now_ms()).unwrap_err();
    assert!(matches!(error, AuditError::Tampered(_)), "{error}");
}

#[test]
fn dropping_the_last_handle_writes_what_was_queued_and_frees_the_directory() {
    let dir = private_tempdir();
    let now = now_ms();
    for round in 0..20u8 {
        let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap_or_else(|error| {
            panic!("round {round}: reopening right after the drop: {error}")
        });
        assert_eq!(log.live_canaries(now).unwrap().len(), usize::from(round));
        // Queued for the next commit, nobody waiting for it.
        log.register_canaries_soon(vec![CanaryEntry {
            key: CanaryKey([round; 16]),
            session: "ab".repeat(32),
            request_id: format!("r{round}"),
            expires_at_ms: now + 60_000,
        }])
        .unwrap();
    }
}

#[test]
fn canary_registry_persists_and_expires() {
    let dir = private_tempdir();
    let now = now_ms();
    {
        let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
        let entry = |n: u8, request: &str, expires: u64| CanaryEntry {
            key: CanaryKey([n; 16]),
            session: "ab".repeat(32),
            request_id: request.into(),
            expires_at_ms: expires,
        };
        runtime().block_on(async {
            log.register_canaries(vec![
                entry(1, "r1", now + 60_000),
                entry(2, "r1", now + 60_000),
                entry(3, "r2", now + 60_000),
                entry(4, "r3", now - 1),
                entry(5, "r4", now + 60_000),
            ])
            .await
            .unwrap();
            assert_eq!(log.live_canaries(now).unwrap().len(), 4);
            assert_eq!(
                log.retire_canaries(Retire::Request("r1".into())).await,
                Ok(2)
            );
            assert_eq!(
                log.retire_canaries(Retire::Keys(vec![CanaryKey([5; 16]), CanaryKey([9; 16])]))
                    .await,
                Ok(1)
            );
            assert_eq!(log.sweep_canaries(now).await, Ok(1));
        });
    }
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let live = log.live_canaries(now).unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(
        (live[0].key, live[0].request_id.as_str()),
        (CanaryKey([3; 16]), "r2")
    );
    assert_eq!(log.live_canaries(now + 120_000).unwrap().len(), 0);
}

#[test]
fn canaries_of_an_older_store_move_to_the_expiry_ordered_table() {
    let dir = private_tempdir();
    let now = now_ms();
    // The layout before 2026-12: rows keyed by the 16-byte canary key alone.
    {
        let store = RedbStore::open_writable(dir.path()).unwrap();
        let RedbStore::Writable(db) = &store else {
            unreachable!()
        };
        let txn = db.begin_write().unwrap();
        {
            let by_key: TableDefinition<&[u8], &[u8]> = TableDefinition::new("canaries");
            let mut table = txn.open_table(by_key).unwrap();
            for (n, expires) in [(7u8, now + 60_000), (8, now - 1), (9, now + 30_000)] {
                let value = format!(
                    r#"{{"session":"s{n}","request_id":"r{n}","expires_at_ms":{expires}}}"#
                );
                table.insert([n; 16].as_slice(), value.as_bytes()).unwrap();
            }
        }
        txn.commit().unwrap();
    }
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let mut live = log.live_canaries(now).unwrap();
    live.sort_by_key(|entry| entry.key.0);
    let seen: Vec<_> = live
        .iter()
        .map(|entry| (entry.key, entry.session.as_str(), entry.expires_at_ms))
        .collect();
    assert_eq!(
        seen,
        [
            (CanaryKey([7; 16]), "s7", now + 60_000),
            (CanaryKey([9; 16]), "s9", now + 30_000)
        ]
    );
    // Sweeping after the move drops exactly the expired row, and the old table is gone.
    assert_eq!(runtime().block_on(log.sweep_canaries(now)), Ok(1));
    assert_eq!(runtime().block_on(log.sweep_canaries(now + 30_000)), Ok(1));
    assert_eq!(log.live_canaries(0).unwrap().len(), 1);
    drop(log);
    let store = RedbStore::open_read_only(dir.path()).unwrap();
    let RedbStore::ReadOnly(db) = &store else {
        unreachable!()
    };
    let txn = db.begin_read().unwrap();
    let by_key: TableDefinition<&[u8], &[u8]> = TableDefinition::new("canaries");
    assert!(matches!(
        txn.open_table(by_key),
        Err(redb::TableError::TableDoesNotExist(_))
    ));
}

#[test]
fn sampling_draws_with_the_given_chance() {
    assert!((0..1000).all(|_| should_sample(1.0)));
    assert!((0..1000).all(|_| !should_sample(0.0)));
    assert!((0..1000).all(|_| !should_sample(f64::NAN)));
    let kept = (0..10_000).filter(|_| should_sample(0.1)).count();
    assert!((700..1300).contains(&kept), "kept {kept} of 10000 at 10%");
}

#[test]
fn store_holds_no_credential_key_or_canary_value() {
    let dir = private_tempdir();
    let key_hex = "5a".repeat(32);
    let options = AuditOptions {
        sample_key: Some(SampleKey::parse(&key_hex).unwrap()),
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), options).unwrap();
    runtime().block_on(async {
        let canary_key = canarygate_policies::Canary::parse(CANARY)
            .expect("a canary")
            .key(&log.secrets().secret("canary"));
        log.register_canaries(vec![CanaryEntry {
            key: canary_key,
            session: "cd".repeat(32),
            request_id: "req-x".into(),
            expires_at_ms: now_ms() + 60_000,
        }])
        .await
        .unwrap();
        for n in 0..20 {
            log.append(NewRecord {
                record: request(&log, n, false),
                sample: Some(Sample {
                    request_text: "the quarterly numbers, confidential".into(),
                    response_text: "answer text".into(),
                    provider_text: None,
                }),
            })
            .await
            .unwrap();
        }
    });
    drop(log);
    let file = std::fs::read(dir.path().join(STORE_FILE)).unwrap();
    let contains = |needle: &[u8]| file.windows(needle.len()).any(|w| w == needle);
    assert!(contains(b"req-000007"), "the scan must see record text");
    for secret in [
        API_KEY.as_bytes(),
        CANARY.as_bytes(),
        key_hex.as_bytes(),
        b"quarterly numbers",
        b"cron-1",
    ] {
        assert!(
            !contains(secret),
            "{} found in the store",
            String::from_utf8_lossy(secret)
        );
    }
    // Encrypted samples read back only with the key.
    let snapshot = Archive::open_read_only(dir.path())
        .unwrap()
        .snapshot()
        .unwrap();
    let request_id = request_id_of(&snapshot, 1);
    let without = snapshot.sample(1, &request_id, None).unwrap_err();
    assert!(matches!(without, AuditError::Key(_)), "{without}");
    assert!(
        without.to_string().contains("sample is encrypted"),
        "{without}"
    );
    let key = SampleKey::parse(&key_hex).unwrap();
    let with = snapshot
        .sample(1, &request_id, Some(&key))
        .unwrap()
        .unwrap();
    assert_eq!(with.request_text, "the quarterly numbers, confidential");
}

/// The request id of request record `id`.
fn request_id_of(snapshot: &Snapshot, id: RecordId) -> String {
    match snapshot.get(id).unwrap().unwrap().record.entry {
        Entry::Request(request) => request.record.request_id,
        other => panic!("record {id} is not a request: {other:?}"),
    }
}

#[test]
fn opening_a_missing_store_read_only_is_not_found() {
    let dir = private_tempdir();
    let missing = verify(dir.path()).unwrap_err();
    assert!(matches!(missing, AuditError::NotFound(_)), "{missing}");
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 3, 0);
    assert_eq!(verify(dir.path()), Ok(3));
    std::fs::write(dir.path().join("secret.key"), b"bad").unwrap();
    drop(log);
    assert!(AuditLog::open(dir.path(), AuditOptions::default()).is_err());
}

#[test]
fn reviews_are_chained_records_and_each_record_is_reviewed_once() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 9, 1); // samples at n = 3, 6, 9: ids are in arrival order
    let archive = Archive::open_writable(dir.path()).unwrap();
    let sampled = archive.snapshot().unwrap().sampled_ids().unwrap();
    assert_eq!(sampled.len(), 3);
    let review = archive
        .review(sampled[0], ReviewVerdict::Bad, Some("other text".into()))
        .unwrap();
    assert_eq!(review, 10);
    let again = archive
        .review(sampled[0], ReviewVerdict::Ok, None)
        .unwrap_err();
    assert!(again.to_string().contains("already reviewed"), "{again}");
    let not_a_request = archive.review(review, ReviewVerdict::Ok, None).unwrap_err();
    assert!(
        not_a_request.to_string().contains("not a request record"),
        "{not_a_request}"
    );
    let snapshot = archive.snapshot().unwrap();
    assert_eq!(snapshot.review_of(sampled[0]), Ok(Some(review)));
    let stored = snapshot.get(review).unwrap().unwrap();
    assert!(matches!(stored.record.entry, Entry::Review(_)));
    assert_eq!(verify(dir.path()), Ok(10));
}

#[test]
fn readers_in_another_handle_follow_the_writer() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    fill(&log, 5, 0);
    let reader = RedbStore::open_read_only(dir.path()).unwrap();
    assert_eq!(
        verify_chain(reader.read().unwrap().as_ref())
            .unwrap()
            .records,
        5
    );
    let snapshot = reader.read().unwrap();
    fill(&log, 5, 5);
    // An open snapshot keeps its view; a new one sees the new commits.
    assert_eq!(verify_chain(snapshot.as_ref()).unwrap().records, 5);
    assert_eq!(
        verify_chain(reader.read().unwrap().as_ref())
            .unwrap()
            .records,
        10
    );
}

const CHILD_DIR: &str = "CANARYGATE_AUDIT_CRASH_DIR";

/// Body of the crash test's child process: appends from 32 tasks until
/// killed, printing `acked ID REQUEST_ID` after each append returns.
#[test]
#[ignore = "child process of store_survives_sigkill_under_load; does nothing alone"]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let round: u64 = std::env::var("CANARYGATE_AUDIT_CRASH_ROUND")
        .unwrap()
        .parse()
        .unwrap();
    let log = AuditLog::open(Path::new(&dir), AuditOptions::default()).unwrap();
    runtime().block_on(async {
        let (acks, mut acked) = tokio::sync::mpsc::unbounded_channel();
        for task in 0..32u64 {
            let (log, acks) = (log.clone(), acks.clone());
            tokio::spawn(async move {
                for n in 0.. {
                    let serial = round * 1_000_000_000 + task * 1_000_000 + n;
                    let record = request(&log, serial, false);
                    let request_id = record.request_id.clone();
                    let sample = (n.is_multiple_of(4)).then(|| sample(serial));
                    let id = log.append(NewRecord { record, sample }).await.unwrap();
                    acks.send(format!("acked {id} {request_id}")).unwrap();
                }
            });
        }
        drop(acks);
        use std::io::Write;
        let stdout = std::io::stdout();
        while let Some(line) = acked.recv().await {
            let mut out = stdout.lock();
            writeln!(out, "{line}").unwrap();
            out.flush().unwrap();
        }
    });
}

#[test]
fn store_survives_sigkill_under_load() {
    let dir = private_tempdir();
    let mut acked: Vec<(u64, String)> = Vec::new();
    let mut seed = now_ms();
    for round in 0..4 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "tests::crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .env("CANARYGATE_AUDIT_CRASH_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("acked ") {
                    let (id, request_id) = rest.split_once(' ').unwrap();
                    lines.push((id.parse::<u64>().unwrap(), request_id.to_owned()));
                }
            }
            lines
        });
        // Kill at a pseudo-random moment once appends are flowing.
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let started = Instant::now();
        let delay = Duration::from_millis(300 + (seed >> 33) % 700);
        while started.elapsed() < delay {
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let round_acked = reader.join().unwrap();
        assert!(
            !round_acked.is_empty(),
            "round {round}: the child acknowledged no append"
        );
        acked.extend(round_acked);

        // The CLI may be the first to open the file after the crash: its
        // read-only open must cope (it repairs through a writable open).
        let records = verify(dir.path()).unwrap();
        assert!(
            records as usize >= acked.len(),
            "round {round}: {records} records < {} acked",
            acked.len()
        );
        // Reopen as serve would after a crash: verify again, and every
        // acknowledged record is there with its request id.
        let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
        let records = verify(dir.path()).unwrap();
        assert!(
            records as usize >= acked.len(),
            "round {round}: {records} records < {} acked",
            acked.len()
        );
        let store = RedbStore::open_read_only(dir.path()).unwrap();
        let view = store.read().unwrap();
        for (id, request_id) in &acked {
            let raw = view
                .record(*id)
                .unwrap()
                .unwrap_or_else(|| panic!("acked record {id} lost"));
            let Entry::Request(entry) = raw.parse().unwrap().entry else {
                panic!("record {id} is not a request")
            };
            assert_eq!(&entry.record.request_id, request_id);
        }
        drop(log);
    }
}

#[test]
fn options_from_policy_require_the_named_key_to_be_set() {
    let policy = |audit: &str| {
        let text = format!(
            "{audit}\n[[providers]]\nname = \"sim\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
             context_window = 1000\n[[routes]]\nmodel = \"*\"\nprovider = \"sim\"\n"
        );
        canarygate_policies::Policy::from_toml_str(&text, "test.toml").unwrap()
    };
    let plain = AuditOptions::from_policy(&policy("[audit]\nsample_rate = 0.25\n").audit).unwrap();
    assert_eq!(plain.sample_rate, 0.25);
    assert!(plain.sample_key.is_none());

    let var = "CANARYGATE_TEST_KEY_FROM_POLICY";
    let keyed = policy(&format!("[audit]\nencryption_key_env = \"{var}\"\n"));
    let error = AuditOptions::from_policy(&keyed.audit).unwrap_err();
    assert!(error.to_string().contains("not set"), "{error}");
    // SAFETY: set_var is unsafe in edition 2024; this variable is unique to this test.
    unsafe { std::env::set_var(var, "not a key") };
    let error = AuditOptions::from_policy(&keyed.audit).unwrap_err();
    assert!(error.to_string().contains(var), "{error}");
    unsafe { std::env::set_var(var, "ab".repeat(32)) };
    let options = AuditOptions::from_policy(&keyed.audit).unwrap();
    assert!(options.sample_key.is_some());
    assert_eq!(options.sample_rate, DEFAULT_SAMPLE_RATE);
}

fn score(similarity: Option<f32>) -> TopicScore {
    TopicScore {
        similarity,
        skipped: similarity.is_none().then(|| "timeout".to_owned()),
        min_similarity: 0.2,
        model: "all-MiniLM-L6-v2".into(),
    }
}

#[test]
fn topic_scores_follow_their_request_and_carry_the_sample_it_lacked() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let runtime = runtime();
    let (fits, low, unscored) = runtime.block_on(async {
        let mut ids = Vec::new();
        for n in 0..3 {
            let recorded = log
                .record(NewRecord {
                    record: request(&log, n, false),
                    sample: None,
                })
                .await
                .unwrap();
            ids.push(recorded.id().await.unwrap());
        }
        log.append_topic(ids[0], "req-000000", score(Some(0.71)), None)
            .await
            .unwrap();
        let kept = sample(1);
        log.append_topic(ids[1], "req-000001", score(Some(0.05)), Some(&kept))
            .await
            .unwrap();
        log.append_topic(ids[2], "req-000002", score(None), None)
            .await
            .unwrap();
        (ids[0], ids[1], ids[2])
    });
    drop(log);
    let archive = Archive::open_read_only(dir.path()).unwrap();
    assert_eq!(archive.verify().unwrap().records, 6);
    let snapshot = archive.snapshot().unwrap();
    let (found, topic_id) = snapshot.topic_of(fits).unwrap().unwrap();
    assert_eq!(found.similarity, Some(0.71));
    assert!(!found.low());
    assert!(matches!(
        snapshot
            .get(topic_id.unwrap())
            .unwrap()
            .unwrap()
            .record
            .entry,
        Entry::Topic(_)
    ));
    assert!(snapshot.topic_of(low).unwrap().unwrap().0.low());
    assert_eq!(
        snapshot.topic_of(unscored).unwrap().unwrap().0.similarity,
        None
    );
    // The low answer's sample lives with its topic record and is found
    // through the request; the one that fits kept none.
    assert_eq!(
        snapshot
            .request_sample(low, "req-000001", None)
            .unwrap()
            .unwrap(),
        sample(1)
    );
    assert_eq!(
        snapshot.request_sample(fits, "req-000000", None).unwrap(),
        None
    );
    assert_eq!(snapshot.review_queue().unwrap(), vec![low]);
    // Reviewing it reviews the request record.
    drop(snapshot);
    drop(archive);
    let writable = Archive::open_writable(dir.path()).unwrap();
    writable.review(low, ReviewVerdict::Bad, None).unwrap();
    assert!(
        writable
            .snapshot()
            .unwrap()
            .review_of(low)
            .unwrap()
            .is_some()
    );
    assert_eq!(writable.verify().unwrap().records, 7);
}

#[test]
fn the_review_queue_puts_the_most_suspicious_first() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let ids = runtime().block_on(async {
        let mut ids = Vec::new();
        // 0: passed, sampled at random, scored 0.8; 1: failed; 2: passed,
        // scored 0.3 in the record itself (flag mode); 3: passed, scored
        // 0.1 (low) later; 4: passed, sampled, never scored.
        for n in 0..5 {
            let mut record = request(&log, n, n == 1);
            if n == 2 {
                record.topic = Some(score(Some(0.3)));
            }
            let sampled = n != 3;
            let recorded = log
                .record(NewRecord {
                    record,
                    sample: sampled.then(|| sample(n)),
                })
                .await
                .unwrap();
            ids.push(recorded.id().await.unwrap());
        }
        log.append_topic(ids[0], "req-000000", score(Some(0.8)), None)
            .await
            .unwrap();
        log.append_topic(ids[3], "req-000003", score(Some(0.1)), Some(&sample(3)))
            .await
            .unwrap();
        ids
    });
    drop(log);
    let snapshot = Archive::open_read_only(dir.path())
        .unwrap()
        .snapshot()
        .unwrap();
    assert_eq!(
        snapshot.review_queue().unwrap(),
        vec![ids[1], ids[3], ids[2], ids[0], ids[4]]
    );
}

#[test]
fn a_topic_sample_is_covered_by_the_chain() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let topic_id = runtime().block_on(async {
        let id = log
            .append(NewRecord {
                record: request(&log, 0, false),
                sample: None,
            })
            .await
            .unwrap();
        log.append_topic(id, "req-000000", score(Some(0.01)), Some(&sample(0)))
            .await
            .unwrap()
    });
    drop(log);
    assert_eq!(verify(dir.path()).unwrap(), 2);
    let store = RedbStore::open_writable(dir.path()).unwrap();
    let RedbStore::Writable(db) = &store else {
        unreachable!()
    };
    let txn = db.begin_write().unwrap();
    txn.open_table(SAMPLES)
        .unwrap()
        .insert(topic_id, b"{}".as_slice())
        .unwrap();
    txn.commit().unwrap();
    drop(store);
    let error = verify(dir.path()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("record {topic_id}: its sample was changed")),
        "{error}"
    );
}

#[test]
fn a_background_record_reports_its_id_once_committed() {
    let dir = private_tempdir();
    let log = open_background(dir.path());
    let ids = runtime().block_on(async {
        let first = log
            .record(NewRecord {
                record: request(&log, 0, false),
                sample: None,
            })
            .await
            .unwrap();
        let second = log
            .record(NewRecord {
                record: request(&log, 1, false),
                sample: None,
            })
            .await
            .unwrap();
        (first.id().await.unwrap(), second.id().await.unwrap())
    });
    assert_eq!(ids, (1, 2));
}

/// The nice value in a `/proc/.../stat` file (field 19), if it is readable.
#[cfg(target_os = "linux")]
fn nice_in_stat(path: &Path) -> Option<i32> {
    let stat = std::fs::read_to_string(path).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(16)?.parse().ok()
}

/// Nice values of this process's threads named `name`.
#[cfg(target_os = "linux")]
fn nice_of_threads(name: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path();
        // A thread that ended meanwhile has no files left.
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue;
        };
        if comm.trim_end() == name {
            found.extend(nice_in_stat(&path.join("stat")));
        }
    }
    found
}

#[cfg(target_os = "linux")]
#[test]
fn the_journal_thread_runs_at_the_asked_priority_where_the_os_allows() {
    // The journal thread starts at the nice value of the thread that opens the log.
    let base = nice_in_stat(Path::new("/proc/thread-self/stat")).unwrap();
    // Whether this process may raise a thread's priority, tried on a thread
    // of its own.
    let may_raise = std::thread::spawn(move || {
        // SAFETY: changes this short-lived thread's scheduling only.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, base - 1) == 0
        }
    })
    .join()
    .unwrap();

    let dir = private_tempdir();
    let options = AuditOptions {
        journal_nice: -7,
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), options).unwrap();
    let journal_threads = nice_of_threads("audit-journal");
    match log.journal_priority() {
        JournalPriority::Raised { nice } => {
            assert!(may_raise);
            assert_eq!(*nice, (base - 7).max(-20));
            assert!(journal_threads.contains(nice), "{journal_threads:?}");
        }
        JournalPriority::Refused(reason) => {
            assert!(!may_raise, "refused although allowed: {reason}");
            assert!(!journal_threads.is_empty());
        }
        JournalPriority::Unchanged => panic!("asked for a change"),
    }
    // Durable records still go through.
    runtime().block_on(record_unsampled(&log, 0));

    let dir = private_tempdir();
    let unchanged = AuditOptions {
        journal_nice: 0,
        ..AuditOptions::default()
    };
    let log = AuditLog::open(dir.path(), unchanged).unwrap();
    assert_eq!(log.journal_priority(), &JournalPriority::Unchanged);

    for outside in [1, -21] {
        let dir = private_tempdir();
        let options = AuditOptions {
            journal_nice: outside,
            ..AuditOptions::default()
        };
        let error = AuditLog::open(dir.path(), options).err().unwrap();
        assert!(
            matches!(&error, AuditError::InvalidArgument(m) if m.contains("nice")),
            "{error}"
        );
    }
}

#[test]
fn a_verifier_check_is_recorded_as_its_reason_and_evidence_and_reads_back_equal() {
    use canarygate_policies::verify::{Check, CheckResult, Evidence};
    let check = CheckResult {
        check: Check::PromptTokens,
        status: Status::Fail,
        reason: Some("reported 1 prompt token, counted 117".into()),
        evidence: Evidence::PromptTokens {
            reported: Some(1),
            counted: 117,
            exact: false,
            min_allowed: 29,
            max_allowed: None,
        },
    };
    let recorded = CheckRecord::from(&check);
    let expected = serde_json::json!({"reason": check.reason, "seen": check.evidence});
    assert_eq!(recorded.evidence.value(), expected);
    assert_eq!(recorded.evidence.json(), expected.to_string());
    assert_eq!(
        serde_json::to_value(&recorded).unwrap()["evidence"],
        expected,
        "a tree of the record holds the evidence as a tree, not as text"
    );
    let skipped = CheckRecord::from(&CheckResult {
        status: Status::Skip,
        reason: None,
        ..check.clone()
    });
    assert_eq!(skipped.evidence.value()["reason"], serde_json::Value::Null);

    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let mut record = request(&log, 1, true);
    record.checks = vec![recorded.clone(), skipped];
    let id = runtime()
        .block_on(log.append(NewRecord {
            record: record.clone(),
            sample: None,
        }))
        .unwrap();
    drop(log);
    let stored = Archive::open_read_only(dir.path())
        .unwrap()
        .snapshot()
        .unwrap()
        .get(id)
        .unwrap()
        .unwrap();
    let Entry::Request(entry) = stored.record.entry else {
        panic!("a request entry");
    };
    assert_eq!(entry.record.checks, record.checks);
    assert_eq!(entry.record.checks[0].evidence.value(), expected);
}

//! The journal as the durable point: what a crash leaves is indexed once,
//! in order, by whoever opens the data directory next.

use std::fs;

use crate::journal::{self, JOURNAL_DIR, Journal};
use crate::record::RecordRef;
use crate::store::{RedbStore, SerializedEntry, Store};
use crate::tests::{private_tempdir, request, runtime};
use crate::time::now_ms;
use crate::*;

fn segment_files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir.join(JOURNAL_DIR))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".wal"))
        .collect();
    names.sort();
    names
}

/// Journals `count` request records the way the journal writer does, then
/// stops without indexing them: what a SIGKILL between the journal's sync
/// and the index commit leaves. Returns their request ids.
fn journal_without_indexing(dir: &std::path::Path, count: u64, first: u64) -> Vec<String> {
    let store = RedbStore::open_writable(dir).unwrap();
    let mut journal = Journal::open(dir, &store).unwrap();
    // A log elsewhere only to fill the records' keyed hashes.
    let other = private_tempdir();
    let filler = AuditLog::open(other.path(), AuditOptions::default()).unwrap();
    let mut frames = Vec::new();
    let mut ids = Vec::new();
    for n in first..first + count {
        let record = request(&filler, n, false);
        ids.push(record.request_id.clone());
        let entry = Entry::Request(Box::new(RequestEntry {
            record,
            sample: None,
        }));
        let json = SerializedEntry::new(&entry).unwrap();
        let seq = journal.take_seq();
        journal::encode(seq, now_ms(), json.json(), None, &mut frames);
    }
    journal.append(&frames).unwrap();
    ids
}

fn request_ids(dir: &std::path::Path) -> Vec<String> {
    let snapshot = Archive::open_read_only(dir).unwrap().snapshot().unwrap();
    snapshot
        .from_id(1, usize::MAX)
        .unwrap()
        .into_iter()
        .filter_map(|stored| match stored.record.entry {
            Entry::Request(request) => Some(request.record.request_id),
            _ => None,
        })
        .collect()
}

#[test]
fn record_bodies_are_the_bytes_serde_writes() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let entries = [
        Entry::Request(Box::new(RequestEntry {
            record: request(&log, 7, true),
            sample: Some(SampleRef {
                encrypted: false,
                sha256: sha256_hex(b"x"),
            }),
        })),
        Entry::Review(ReviewEntry {
            reviewed_id: 3,
            verdict: ReviewVerdict::Bad,
            note: Some("ops \"night\" shift\n".into()),
        }),
        Entry::Checkpoint(CheckpointEntry {
            first_kept_id: 9,
            first_kept_prev_hash: hex::encode([7; 32]),
            pruned: 8,
            before_ms: 1_700_000_000_000,
        }),
    ];
    for entry in &entries {
        let expected = serde_json::to_vec(&RecordRef {
            v: crate::record::SCHEMA_VERSION,
            id: 42,
            prev_hash: hex::encode([0xab; 32]),
            recorded_at_ms: 1_765_000_000_123,
            entry,
        })
        .unwrap();
        let built = SerializedEntry::new(entry).unwrap().record_body_for_test(
            42,
            &[0xab; 32],
            1_765_000_000_123,
        );
        assert_eq!(
            String::from_utf8(built).unwrap(),
            String::from_utf8(expected).unwrap()
        );
    }
}

#[test]
fn journaled_records_left_by_a_crash_are_indexed_once_in_order() {
    let dir = private_tempdir();
    let first = journal_without_indexing(dir.path(), 5, 1);
    // The next log indexes them before anything else...
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let later = runtime().block_on(async {
        let recorded = log
            .record(NewRecord {
                record: request(&log, 6, false),
                sample: None,
            })
            .await
            .unwrap();
        recorded.id().await.unwrap()
    });
    assert_eq!(later, 6, "the replayed records took ids 1 to 5");
    drop(log);
    let mut expected = first;
    expected.push("req-000006".into());
    assert_eq!(request_ids(dir.path()), expected);
    // ...and only once: opening again replays nothing.
    drop(AuditLog::open(dir.path(), AuditOptions::default()).unwrap());
    assert_eq!(request_ids(dir.path()).len(), 6);
    let report = Archive::open_read_only(dir.path())
        .unwrap()
        .verify()
        .unwrap();
    assert_eq!(report.records, 6);
}

#[test]
fn an_audit_command_indexes_what_a_dead_writer_left() {
    let dir = private_tempdir();
    let ids = journal_without_indexing(dir.path(), 3, 1);
    // No writer holds the lock: the read-only open indexes, then reads.
    assert_eq!(request_ids(dir.path()), ids);
    assert_eq!(
        segment_files(dir.path()),
        Vec::<String>::new(),
        "indexed segments are removed"
    );
}

#[test]
fn a_torn_last_frame_is_dropped_and_writing_goes_on() {
    let dir = private_tempdir();
    let ids = journal_without_indexing(dir.path(), 2, 1);
    let segment = dir
        .path()
        .join(JOURNAL_DIR)
        .join(&segment_files(dir.path())[0]);
    let mut bytes = fs::read(&segment).unwrap();
    let whole = bytes.len();
    // Half of a third frame: the crash interrupted its write.
    let mut third = Vec::new();
    journal::encode(3, now_ms(), br#"{"kind":"request"}"#, None, &mut third);
    bytes.extend_from_slice(&third[..third.len() / 2]);
    fs::write(&segment, &bytes).unwrap();
    assert!(bytes.len() > whole);
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let id = runtime().block_on(async {
        log.record(NewRecord {
            record: request(&log, 9, false),
            sample: None,
        })
        .await
        .unwrap()
        .id()
        .await
        .unwrap()
    });
    assert_eq!(id, 3);
    drop(log);
    let mut expected = ids;
    expected.push("req-000009".into());
    assert_eq!(request_ids(dir.path()), expected);
}

#[test]
fn one_writer_per_data_directory() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    let error = AuditLog::open(dir.path(), AuditOptions::default()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("one canarygate serve per data directory"),
        "{error}"
    );
    drop(log);
}

#[test]
fn a_reader_sees_every_record_acknowledged_before_it_opened() {
    let dir = private_tempdir();
    let log = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
    runtime().block_on(async {
        for n in 1..=20 {
            // Acknowledged once journaled; the index commit may be later.
            log.record(NewRecord {
                record: request(&log, n, false),
                sample: None,
            })
            .await
            .unwrap();
            let seen = request_ids(dir.path());
            assert_eq!(seen.len() as u64, n, "after record {n}");
        }
    });
    // The store's journal position covers the journal, so nothing is replayed twice.
    let store = RedbStore::open_read_only(dir.path()).unwrap();
    assert_eq!(store.read().unwrap().journal_indexed().unwrap(), 20);
}

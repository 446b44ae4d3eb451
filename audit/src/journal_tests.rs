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
    let mut records = Records::new();
    let mut frames = Vec::new();
    let ids = (first..first + count)
        .map(|n| records.encode(&mut journal, n, &mut frames))
        .collect();
    journal.append(&frames).unwrap();
    ids
}

/// Request records to journal, their keyed hashes filled by a log elsewhere.
struct Records {
    _dir: tempfile::TempDir,
    filler: AuditLog,
}

impl Records {
    fn new() -> Self {
        let dir = private_tempdir();
        let filler = AuditLog::open(dir.path(), AuditOptions::default()).unwrap();
        Self { _dir: dir, filler }
    }

    /// Appends request record `n`'s frame to `frames`; returns its id.
    fn encode(&mut self, journal: &mut Journal, n: u64, frames: &mut Vec<u8>) -> String {
        let record = request(&self.filler, n, false);
        let id = record.request_id.clone();
        let entry = Entry::Request(Box::new(RequestEntry {
            record,
            sample: None,
        }));
        let json = SerializedEntry::new(&entry).unwrap();
        let seq = journal.take_seq();
        journal::encode(seq, now_ms(), json.json(), None, frames);
        id
    }
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
fn a_busy_journal_overwrites_a_preallocated_segment_that_a_crash_keeps() {
    let dir = private_tempdir();
    let store = RedbStore::open_writable(dir.path()).unwrap();
    let mut journal = Journal::open(dir.path(), &store).unwrap();
    let mut records = Records::new();
    let mut ids = Vec::new();
    let mut frames = Vec::new();
    let mut journal_one = |journal: &mut Journal, ids: &mut Vec<String>| {
        ids.push(records.encode(journal, ids.len() as u64 + 1, &mut frames));
        journal.append(&frames).unwrap();
        frames.clear();
        // Nothing indexed: every segment stays.
        journal.maintain(0).unwrap();
    };
    // The first segment is appended; past the threshold a spare is made,
    // and the batch after it is ready goes to it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while segment_files(dir.path()).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no preallocated segment"
        );
        journal_one(&mut journal, &mut ids);
        if ids.len() > 100 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let names = segment_files(dir.path());
    let [sealed, current] =
        [&names[0], &names[1]].map(|name| dir.path().join(JOURNAL_DIR).join(name));
    assert!(fs::metadata(&sealed).unwrap().len() >= journal::PREPARE_SPARE_AFTER);
    let before = ids.len();
    for _ in 0..20 {
        journal_one(&mut journal, &mut ids);
    }
    // Written over the zeros: the file did not grow, and holds the frames.
    assert_eq!(
        fs::metadata(&current).unwrap().len(),
        journal::SEGMENT_BYTES
    );
    let bytes = fs::read(&current).unwrap();
    assert_ne!(&bytes[..4], &[0; 4], "the first frame is at the start");
    assert!(ids.len() > before);
    // A crash: nothing indexed. The zero tail ends the newest segment
    // cleanly, and every record comes back once, in order.
    drop(journal);
    drop(store);
    assert_eq!(request_ids(dir.path()), ids);
    assert_eq!(segment_files(dir.path()), Vec::<String>::new());
}

/// A data directory removed while its writer runs: a batch synced into
/// the deleted segment is not durable, so it fails, and so does every
/// later one.
#[test]
fn a_deleted_segment_fails_its_batch_and_every_later_one() {
    let dir = private_tempdir();
    let store = RedbStore::open_writable(dir.path()).unwrap();
    let mut journal = Journal::open(dir.path(), &store).unwrap();
    let mut records = Records::new();
    let mut frames = Vec::new();
    records.encode(&mut journal, 1, &mut frames);
    journal.append(&frames).unwrap();
    fs::remove_dir_all(dir.path().join(JOURNAL_DIR)).unwrap();
    for n in 2..4 {
        frames.clear();
        records.encode(&mut journal, n, &mut frames);
        let error = journal.append(&frames).unwrap_err();
        assert!(error.to_string().contains("was deleted"), "{error}");
    }
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

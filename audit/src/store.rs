//! The storage behind the audit log: a small trait, and its redb implementation.
//!
//! Everything lives in one redb file, `DIR/canarygate.redb`, opened in redb's
//! `MultiWriter` concurrency mode: `serve` keeps it open for writing while the
//! `audit` commands open it read-only (they follow its commits) or, for the
//! few commands that write (`spot-check --mark`, `prune`), for writing too.
//! redb serialises write transactions across processes with a byte-range
//! lock, and every append reads the chain head inside its own transaction, so
//! two writing processes cannot fork the chain.

use std::io::Write as _;
use std::path::Path;

use canarygate_policies::CanaryKey;
use redb::{
    ConcurrencyMode, Database, DatabaseError, Durability, ReadTransaction, ReadableDatabase,
    ReadableTable, TableDefinition,
};
use serde::{Deserialize, Serialize};

use crate::AuditError;
use crate::record::{
    CheckpointEntry, Entry, GENESIS_HASH, RawRecord, RecordId, SCHEMA_VERSION, seal_body,
};
use crate::time::now_ms;

/// Most operations committed in one transaction (and journaled in one write).
pub(crate) const MAX_BATCH: usize = 4096;

/// File name of the store inside the data directory.
pub const STORE_FILE: &str = "canarygate.redb";

const RECORDS: TableDefinition<u64, &[u8]> = TableDefinition::new("records");
const SAMPLES: TableDefinition<u64, &[u8]> = TableDefinition::new("samples");
const REVIEWS: TableDefinition<u64, u64> = TableDefinition::new("reviews");
/// Request record id -> the topic record that scored it.
const TOPICS: TableDefinition<u64, u64> = TableDefinition::new("topics");
/// Live canaries, keyed by [`canary_row_key`]: expiry first, so registering
/// appends at the end of the tree and sweeping drops a prefix.
const CANARIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("canaries_by_expiry");
/// The canary table of stores written before 2026-12: keyed by the canary key
/// alone (random, so each registration rewrote a page in the middle of the
/// tree). Moved into [`CANARIES`] when the store is opened for writing.
const CANARIES_BY_KEY: TableDefinition<&[u8], &[u8]> = TableDefinition::new("canaries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// `META` key: where the chain starts (8-byte big-endian id, then its `prev_hash`).
const CHAIN_START: &str = "chain_start";
/// `META` key: the last journal sequence number indexed (8 bytes, big-endian).
const JOURNAL_INDEXED: &str = "journal_indexed";

/// One live canary, keyed by a keyed hash of its value (never the value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanaryEntry {
    /// Keyed hash of the canary value, computed by the caller.
    pub key: CanaryKey,
    /// Keyed hash (hex) of the session it was minted for.
    pub session: String,
    /// Request it was minted for.
    pub request_id: String,
    /// When it stops being live, unix milliseconds.
    pub expires_at_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct CanaryValue {
    session: String,
    request_id: String,
    expires_at_ms: u64,
}

/// Which canaries to retire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retire {
    /// Every canary minted for this request.
    Request(String),
    /// These keys.
    Keys(Vec<CanaryKey>),
}

/// A record's entry serialised once, in the task that made it, with what
/// the index tables need from it.
#[derive(Debug, Clone)]
pub(crate) struct SerializedEntry {
    /// The entry as JSON: an object whose first member is its `kind`.
    json: Vec<u8>,
    /// The index row it adds besides the record.
    index: EntryIndex,
}

#[derive(Debug, Clone, Copy)]
enum EntryIndex {
    None,
    /// A review of this record.
    Review(RecordId),
    /// The topic score of this record.
    Topic(RecordId),
}

impl SerializedEntry {
    /// Serialises `entry`.
    pub(crate) fn new(entry: &Entry) -> Result<Self, AuditError> {
        let json = serde_json::to_vec(entry)
            .map_err(|error| AuditError::Corrupt(format!("cannot serialise record: {error}")))?;
        let index = match entry {
            Entry::Review(review) => EntryIndex::Review(review.reviewed_id),
            Entry::Topic(topic) => EntryIndex::Topic(topic.scored_id),
            Entry::Request(_) | Entry::Checkpoint(_) => EntryIndex::None,
        };
        Ok(Self { json, index })
    }

    /// A request entry read back from the journal (only request records
    /// are journaled, and they add no index row).
    pub(crate) fn journaled(json: Vec<u8>) -> Self {
        Self {
            json,
            index: EntryIndex::None,
        }
    }

    /// The JSON bytes.
    pub(crate) fn json(&self) -> &[u8] {
        &self.json
    }

    /// [`Self::record_body`], for tests.
    #[cfg(test)]
    pub(crate) fn record_body_for_test(
        &self,
        id: RecordId,
        prev_hash: &[u8; 32],
        at_ms: u64,
    ) -> Vec<u8> {
        self.record_body(id, prev_hash, at_ms).unwrap()
    }

    /// The record body: the chain fields, then the entry's members. The
    /// same bytes `serde_json` writes for a [`RecordRef`] of this entry.
    fn record_body(
        &self,
        id: RecordId,
        prev_hash: &[u8; 32],
        at_ms: u64,
    ) -> Result<Vec<u8>, AuditError> {
        let members = self
            .json
            .strip_prefix(b"{")
            .filter(|rest| rest.len() > 1)
            .ok_or_else(|| AuditError::Corrupt("a record entry is not a JSON object".into()))?;
        let mut body = Vec::with_capacity(self.json.len() + 160);
        write!(
            body,
            "{{\"v\":{SCHEMA_VERSION},\"id\":{id},\"prev_hash\":\"{}\",\"recorded_at_ms\":{at_ms},",
            hex::encode(prev_hash)
        )
        .expect("writing to a Vec");
        body.extend_from_slice(members);
        Ok(body)
    }
}

/// Where a journaled record sits in the journal.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JournalIndex {
    /// Its journal sequence number.
    pub seq: u64,
    /// When it was journaled, unix milliseconds.
    pub at_ms: u64,
}

/// One change, applied inside a write transaction.
#[derive(Debug)]
pub(crate) enum WriteOp {
    /// Append a record; `sample` is the stored sample bytes, if any;
    /// `journal` is set for a record indexed from the journal.
    Append {
        entry: SerializedEntry,
        sample: Option<Vec<u8>>,
        journal: Option<JournalIndex>,
    },
    Register(Vec<CanaryEntry>),
    Retire(Retire),
    Sweep {
        now_ms: u64,
    },
    /// Remove records written before `before_ms` and append a checkpoint.
    Prune {
        before_ms: u64,
    },
}

/// What one [`WriteOp`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    Appended(RecordId),
    Count(u64),
    Pruned {
        removed: u64,
        checkpoint: Option<RecordId>,
    },
}

/// Durable storage for the audit log. Implementations apply a batch in one
/// transaction that is durable when `write` returns, and give readers a
/// consistent snapshot that does not block writers.
pub(crate) trait Store: Send + Sync + 'static {
    /// Applies `ops` in order, in one durable transaction. On error nothing is applied.
    fn write(&self, ops: &[WriteOp]) -> Result<Vec<WriteOutcome>, AuditError>;
    /// A consistent read-only view of the latest commit.
    fn read(&self) -> Result<Box<dyn ReadView>, AuditError>;
    /// Bytes held in the store's page cache (bounded by its cache size).
    fn cache_bytes(&self) -> usize;
}

/// A consistent snapshot of the store.
pub(crate) trait ReadView {
    /// First id of the chain and the `prev_hash` it must carry.
    fn chain_start(&self) -> Result<(RecordId, [u8; 32]), AuditError>;
    /// Up to `limit` records with id `>= from`, ascending.
    fn records_from(&self, from: RecordId, limit: usize) -> Result<Vec<RawRecord>, AuditError>;
    /// The last `n` records, ascending.
    fn last_records(&self, n: usize) -> Result<Vec<RawRecord>, AuditError>;
    /// One record.
    fn record(&self, id: RecordId) -> Result<Option<RawRecord>, AuditError>;
    /// The stored sample bytes of a request record.
    fn sample(&self, id: RecordId) -> Result<Option<Vec<u8>>, AuditError>;
    /// Ids of records that have a stored sample, ascending.
    fn sampled_ids(&self) -> Result<Vec<RecordId>, AuditError>;
    /// The review record of a sampled record, if reviewed.
    fn review_of(&self, id: RecordId) -> Result<Option<RecordId>, AuditError>;
    /// The topic record that scored request record `id`, if any.
    fn topic_of(&self, id: RecordId) -> Result<Option<RecordId>, AuditError>;
    /// The last journal sequence number indexed (0: none yet).
    fn journal_indexed(&self) -> Result<u64, AuditError>;
    /// Every registered canary, live or expired.
    fn canaries(&self) -> Result<Vec<CanaryEntry>, AuditError>;
}

fn storage(error: impl Into<redb::Error>) -> AuditError {
    AuditError::Storage(error.into().to_string())
}

/// The redb-backed [`Store`].
pub(crate) enum RedbStore {
    /// Opened for reading and writing.
    Writable(Database),
    /// Opened read-only, following another process's commits.
    ReadOnly(redb::ReadOnlyDatabase),
}

/// redb's page cache per handle. Its default, 1 GiB, fills with the pages
/// every append writes and every sweep reads, so `serve`'s memory grew by
/// about 55 MiB a minute under steady load (`bench/growth.sh --soak`).
/// Appends touch the trees' right edges and the newest canary rows; reads
/// walk ranges once: a small cache serves both.
pub(crate) const CACHE_BYTES: usize = 32 << 20;

fn builder() -> redb::Builder {
    let mut builder = Database::builder();
    builder
        .set_concurrency_mode(ConcurrencyMode::MultiWriter)
        .set_cache_size(CACHE_BYTES);
    builder
}

impl RedbStore {
    /// Opens (creating when missing) the store for writing, repairing it after a crash.
    pub(crate) fn open_writable(dir: &Path) -> Result<Self, AuditError> {
        Self::open_writable_with(dir, false)
    }

    /// Opens the store in `dir` for writing; an error when there is none.
    pub(crate) fn open_existing_writable(dir: &Path) -> Result<Self, AuditError> {
        existing_store(dir)?;
        Self::open_writable(dir)
    }

    /// Like [`Self::open_writable`], but with `verify_pages` redb checks the
    /// checksum of every page first, so a file damaged outside redb is an
    /// error rather than a possible panic later. Reads the whole file.
    pub(crate) fn open_writable_with(dir: &Path, verify_pages: bool) -> Result<Self, AuditError> {
        crate::files::create_private_dir_all(dir).map_err(|error| {
            AuditError::Io(format!(
                "cannot create data directory {}: {error}",
                dir.display()
            ))
        })?;
        let path = dir.join(STORE_FILE);
        // redb would create a missing file with the umask's mode: create it
        // owner-only first (redb initialises an empty file).
        crate::files::ensure_private_file(&path).map_err(|error| {
            AuditError::Io(format!("cannot create {}: {error}", path.display()))
        })?;
        let db = builder()
            .set_check_integrity_on_open(verify_pages)
            .create(&path)
            .map_err(|error| open_error(&path, error))?;
        let txn = db.begin_write().map_err(storage)?;
        {
            txn.open_table(RECORDS).map_err(storage)?;
            txn.open_table(SAMPLES).map_err(storage)?;
            txn.open_table(REVIEWS).map_err(storage)?;
            txn.open_table(TOPICS).map_err(storage)?;
            txn.open_table(META).map_err(storage)?;
            let mut canaries = txn.open_table(CANARIES).map_err(storage)?;
            move_canaries_by_key(&txn, &mut canaries)?;
        }
        txn.commit().map_err(storage)?;
        Ok(Self::Writable(db))
    }

    /// Opens an existing store read-only; works while another process writes.
    pub(crate) fn open_read_only(dir: &Path) -> Result<Self, AuditError> {
        let path = existing_store(dir)?;
        match builder().open_read_only(&path) {
            Ok(db) => Ok(Self::ReadOnly(db)),
            // A store left by a crash needs repair, which a read-only open
            // cannot do: repair it with a writable open, then read.
            Err(DatabaseError::RepairAborted) => {
                drop(Self::open_writable(dir)?);
                let db = builder()
                    .open_read_only(&path)
                    .map_err(|error| open_error(&path, error))?;
                Ok(Self::ReadOnly(db))
            }
            Err(error) => Err(open_error(&path, error)),
        }
    }
}

/// Moves the canaries of an older store ([`CANARIES_BY_KEY`]) into `canaries`.
fn move_canaries_by_key(
    txn: &redb::WriteTransaction,
    canaries: &mut redb::Table<'_, &'static [u8], &'static [u8]>,
) -> Result<(), AuditError> {
    let old = match txn.open_table(CANARIES_BY_KEY) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(()),
        Err(error) => return Err(storage(error)),
    };
    for item in old.iter().map_err(storage)? {
        let (key, value) = item.map_err(storage)?;
        let key = canary_key(key.value())?;
        let parsed = parse_canary_value(value.value())?;
        canaries
            .insert(
                canary_row_key(parsed.expires_at_ms, &key).as_slice(),
                value.value(),
            )
            .map_err(storage)?;
    }
    drop(old);
    txn.delete_table(CANARIES_BY_KEY).map_err(storage)?;
    Ok(())
}

/// Row key of a canary in [`CANARIES`]: expiry (big-endian ms), then its key.
fn canary_row_key(expires_at_ms: u64, key: &CanaryKey) -> [u8; 24] {
    let mut row = [0; 24];
    row[..8].copy_from_slice(&expires_at_ms.to_be_bytes());
    row[8..].copy_from_slice(&key.0);
    row
}

fn canary_key(bytes: &[u8]) -> Result<CanaryKey, AuditError> {
    bytes
        .try_into()
        .map(CanaryKey)
        .map_err(|_| AuditError::Corrupt("canary key is not 16 bytes".into()))
}

/// The canary key of a [`CANARIES`] row key.
fn canary_key_of_row(row: &[u8]) -> Result<CanaryKey, AuditError> {
    match row.len() {
        24 => canary_key(&row[8..]),
        _ => Err(AuditError::Corrupt("canary row key is not 24 bytes".into())),
    }
}

fn parse_canary_value(bytes: &[u8]) -> Result<CanaryValue, AuditError> {
    serde_json::from_slice(bytes)
        .map_err(|error| AuditError::Corrupt(format!("canary entry: {error}")))
}

/// The store file of `dir`, which must exist: a missing one is
/// [`AuditError::NotFound`] (a wrong `--data`), one that cannot be looked
/// at (a directory of another user's) says why.
fn existing_store(dir: &Path) -> Result<std::path::PathBuf, AuditError> {
    let path = dir.join(STORE_FILE);
    match std::fs::metadata(&path) {
        Ok(_) => Ok(path),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Err(AuditError::NotFound(
            format!("no audit log at {} (is --data right?)", path.display()),
        )),
        Err(error) => Err(AuditError::Io(format!(
            "cannot read the audit log at {}: {error}",
            path.display()
        ))),
    }
}

fn open_error(path: &Path, error: DatabaseError) -> AuditError {
    AuditError::Storage(format!("cannot open {}: {error}", path.display()))
}

impl Store for RedbStore {
    fn write(&self, ops: &[WriteOp]) -> Result<Vec<WriteOutcome>, AuditError> {
        let Self::Writable(db) = self else {
            return Err(AuditError::Storage("the store was opened read-only".into()));
        };
        let mut txn = db.begin_write().map_err(storage)?;
        // redb's default, made explicit: the commit is fsync'd before it returns.
        txn.set_durability(Durability::Immediate)
            .map_err(|error| AuditError::Storage(error.to_string()))?;
        let mut outcomes = Vec::with_capacity(ops.len());
        {
            let mut tables = Tables {
                records: txn.open_table(RECORDS).map_err(storage)?,
                samples: txn.open_table(SAMPLES).map_err(storage)?,
                reviews: txn.open_table(REVIEWS).map_err(storage)?,
                topics: txn.open_table(TOPICS).map_err(storage)?,
                canaries: txn.open_table(CANARIES).map_err(storage)?,
                meta: txn.open_table(META).map_err(storage)?,
                head: None,
            };
            for op in ops {
                outcomes.push(tables.apply(op)?);
            }
            let indexed = ops.iter().filter_map(|op| match op {
                WriteOp::Append {
                    journal: Some(journal),
                    ..
                } => Some(journal.seq),
                _ => None,
            });
            if let Some(last) = indexed.max() {
                tables
                    .meta
                    .insert(JOURNAL_INDEXED, last.to_be_bytes().as_slice())
                    .map_err(storage)?;
            }
        }
        txn.commit().map_err(storage)?;
        Ok(outcomes)
    }

    fn cache_bytes(&self) -> usize {
        match self {
            Self::Writable(db) => db.cache_stats().used_bytes(),
            Self::ReadOnly(db) => db.cache_stats().used_bytes(),
        }
    }

    fn read(&self) -> Result<Box<dyn ReadView>, AuditError> {
        let txn = match self {
            Self::Writable(db) => db.begin_read(),
            Self::ReadOnly(db) => db.begin_read(),
        }
        .map_err(storage)?;
        Ok(Box::new(RedbView { txn }))
    }
}

struct Tables<'txn> {
    records: redb::Table<'txn, u64, &'static [u8]>,
    samples: redb::Table<'txn, u64, &'static [u8]>,
    reviews: redb::Table<'txn, u64, u64>,
    topics: redb::Table<'txn, u64, u64>,
    canaries: redb::Table<'txn, &'static [u8], &'static [u8]>,
    meta: redb::Table<'txn, &'static str, &'static [u8]>,
    /// Next id, its `prev_hash` and the last record's time, once known in
    /// this transaction (saves re-reading the record just appended).
    head: Option<(RecordId, [u8; 32], u64)>,
}

impl Tables<'_> {
    fn apply(&mut self, op: &WriteOp) -> Result<WriteOutcome, AuditError> {
        match op {
            WriteOp::Append {
                entry,
                sample,
                journal,
            } => self.append(
                entry,
                sample.as_deref(),
                journal.map(|journal| journal.at_ms),
            ),
            WriteOp::Register(entries) => {
                for entry in entries {
                    let value = serde_json::to_vec(&CanaryValue {
                        session: entry.session.clone(),
                        request_id: entry.request_id.clone(),
                        expires_at_ms: entry.expires_at_ms,
                    })
                    .map_err(|error| AuditError::Corrupt(error.to_string()))?;
                    self.canaries
                        .insert(
                            canary_row_key(entry.expires_at_ms, &entry.key).as_slice(),
                            value.as_slice(),
                        )
                        .map_err(storage)?;
                }
                Ok(WriteOutcome::Count(entries.len() as u64))
            }
            WriteOp::Retire(Retire::Keys(keys)) => {
                self.remove_canaries_where(|key, _| keys.contains(key))
            }
            WriteOp::Retire(Retire::Request(request_id)) => {
                self.remove_canaries_where(|_, value| value.request_id == *request_id)
            }
            WriteOp::Sweep { now_ms } => {
                // Rows sort by expiry: the expired ones are the rows before
                // the first possible row of `now_ms + 1`.
                let first_live = now_ms.saturating_add(1).to_be_bytes();
                let mut removed = 0;
                self.canaries
                    .retain_in::<&[u8], _>(..first_live.as_slice(), |_, _| {
                        removed += 1;
                        false
                    })
                    .map_err(storage)?;
                Ok(WriteOutcome::Count(removed))
            }
            WriteOp::Prune { before_ms } => self.prune(*before_ms),
        }
    }

    /// The id and hash the next record chains onto.
    fn head(&self) -> Result<(RecordId, [u8; 32], u64), AuditError> {
        if let Some(head) = self.head {
            return Ok(head);
        }
        match self.records.last().map_err(storage)? {
            Some((key, value)) => {
                let raw = RawRecord::from_stored(key.value(), value.value())?;
                let record = raw.parse()?;
                Ok((raw.key + 1, raw.hash, record.recorded_at_ms))
            }
            None => {
                let (start, prev) = chain_start(self.meta.get(CHAIN_START).map_err(storage)?)?;
                Ok((start, prev, 0))
            }
        }
    }

    /// Appends `entry` at the chain's head, timed `at_ms` (a journaled
    /// record's time) or now.
    fn append(
        &mut self,
        entry: &SerializedEntry,
        sample: Option<&[u8]>,
        at_ms: Option<u64>,
    ) -> Result<WriteOutcome, AuditError> {
        let (id, prev_hash, last_ms) = self.head()?;
        // Never behind the previous record, so time ranges are id ranges.
        let recorded_at_ms = at_ms.unwrap_or_else(now_ms).max(last_ms);
        let (value, hash) = seal_body(entry.record_body(id, &prev_hash, recorded_at_ms)?);
        self.records.insert(id, value.as_slice()).map_err(storage)?;
        self.head = Some((id + 1, hash, recorded_at_ms));
        if let Some(sample) = sample {
            self.samples.insert(id, sample).map_err(storage)?;
        }
        match entry.index {
            EntryIndex::Review(reviewed_id) => {
                self.reviews.insert(reviewed_id, id).map_err(storage)?;
            }
            EntryIndex::Topic(scored_id) => {
                self.topics.insert(scored_id, id).map_err(storage)?;
            }
            EntryIndex::None => {}
        }
        Ok(WriteOutcome::Appended(id))
    }

    /// Removes the canaries `matches` picks, reading every row (retiring
    /// canaries is rare; the hot paths are registering and sweeping).
    fn remove_canaries_where(
        &mut self,
        matches: impl Fn(&CanaryKey, &CanaryValue) -> bool,
    ) -> Result<WriteOutcome, AuditError> {
        let mut doomed = Vec::new();
        for item in self.canaries.iter().map_err(storage)? {
            let (row, value) = item.map_err(storage)?;
            let key = canary_key_of_row(row.value())?;
            if matches(&key, &parse_canary_value(value.value())?) {
                doomed.push(row.value().to_vec());
            }
        }
        for key in &doomed {
            self.canaries.remove(key.as_slice()).map_err(storage)?;
        }
        Ok(WriteOutcome::Count(doomed.len() as u64))
    }

    fn prune(&mut self, before_ms: u64) -> Result<WriteOutcome, AuditError> {
        let mut last_removed: Option<(RecordId, [u8; 32])> = None;
        let mut removed = 0;
        for item in self.records.iter().map_err(storage)? {
            let (key, value) = item.map_err(storage)?;
            let raw = RawRecord::from_stored(key.value(), value.value())?;
            if raw.parse()?.recorded_at_ms >= before_ms {
                break;
            }
            last_removed = Some((raw.key, raw.hash));
            removed += 1;
        }
        let Some((last_id, last_hash)) = last_removed else {
            return Ok(WriteOutcome::Pruned {
                removed: 0,
                checkpoint: None,
            });
        };
        self.records
            .retain_in(..=last_id, |_, _| false)
            .map_err(storage)?;
        self.samples
            .retain_in(..=last_id, |_, _| false)
            .map_err(storage)?;
        self.reviews
            .retain_in(..=last_id, |_, _| false)
            .map_err(storage)?;
        self.topics
            .retain_in(..=last_id, |_, _| false)
            .map_err(storage)?;
        let mut start = (last_id + 1).to_be_bytes().to_vec();
        start.extend_from_slice(&last_hash);
        self.meta
            .insert(CHAIN_START, start.as_slice())
            .map_err(storage)?;
        let checkpoint = Entry::Checkpoint(CheckpointEntry {
            first_kept_id: last_id + 1,
            first_kept_prev_hash: hex::encode(last_hash),
            pruned: removed,
            before_ms,
        });
        let WriteOutcome::Appended(id) =
            self.append(&SerializedEntry::new(&checkpoint)?, None, None)?
        else {
            unreachable!("append returns Appended")
        };
        Ok(WriteOutcome::Pruned {
            removed,
            checkpoint: Some(id),
        })
    }
}

fn chain_start(
    stored: Option<redb::AccessGuard<'_, &'static [u8]>>,
) -> Result<(RecordId, [u8; 32]), AuditError> {
    let Some(stored) = stored else {
        return Ok((1, GENESIS_HASH));
    };
    let bytes = stored.value();
    if bytes.len() != 40 {
        return Err(AuditError::Corrupt(
            "the chain start marker is damaged".into(),
        ));
    }
    let id = u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"));
    let hash = bytes[8..].try_into().expect("32 bytes");
    Ok((id, hash))
}

struct RedbView {
    txn: ReadTransaction,
}

impl RedbView {
    fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        definition: TableDefinition<K, V>,
    ) -> Result<redb::ReadOnlyTable<K, V>, AuditError> {
        self.txn.open_table(definition).map_err(storage)
    }
}

impl ReadView for RedbView {
    fn chain_start(&self) -> Result<(RecordId, [u8; 32]), AuditError> {
        chain_start(self.table(META)?.get(CHAIN_START).map_err(storage)?)
    }

    fn records_from(&self, from: RecordId, limit: usize) -> Result<Vec<RawRecord>, AuditError> {
        let table = self.table(RECORDS)?;
        let mut out = Vec::new();
        for item in table.range(from..).map_err(storage)?.take(limit) {
            let (key, value) = item.map_err(storage)?;
            out.push(RawRecord::from_stored(key.value(), value.value())?);
        }
        Ok(out)
    }

    fn last_records(&self, n: usize) -> Result<Vec<RawRecord>, AuditError> {
        let table = self.table(RECORDS)?;
        let mut out = Vec::new();
        for item in table.iter().map_err(storage)?.rev().take(n) {
            let (key, value) = item.map_err(storage)?;
            out.push(RawRecord::from_stored(key.value(), value.value())?);
        }
        out.reverse();
        Ok(out)
    }

    fn record(&self, id: RecordId) -> Result<Option<RawRecord>, AuditError> {
        match self.table(RECORDS)?.get(id).map_err(storage)? {
            Some(value) => Ok(Some(RawRecord::from_stored(id, value.value())?)),
            None => Ok(None),
        }
    }

    fn sample(&self, id: RecordId) -> Result<Option<Vec<u8>>, AuditError> {
        Ok(self
            .table(SAMPLES)?
            .get(id)
            .map_err(storage)?
            .map(|value| value.value().to_vec()))
    }

    fn sampled_ids(&self) -> Result<Vec<RecordId>, AuditError> {
        let mut ids = Vec::new();
        for item in self.table(SAMPLES)?.iter().map_err(storage)? {
            ids.push(item.map_err(storage)?.0.value());
        }
        Ok(ids)
    }

    fn review_of(&self, id: RecordId) -> Result<Option<RecordId>, AuditError> {
        Ok(self
            .table(REVIEWS)?
            .get(id)
            .map_err(storage)?
            .map(|value| value.value()))
    }

    fn topic_of(&self, id: RecordId) -> Result<Option<RecordId>, AuditError> {
        // Stores written before topic scores have no such table.
        let table = match self.txn.open_table(TOPICS) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(error) => return Err(storage(error)),
        };
        Ok(table.get(id).map_err(storage)?.map(|value| value.value()))
    }

    fn journal_indexed(&self) -> Result<u64, AuditError> {
        let Some(stored) = self.table(META)?.get(JOURNAL_INDEXED).map_err(storage)? else {
            return Ok(0);
        };
        let bytes: [u8; 8] = stored
            .value()
            .try_into()
            .map_err(|_| AuditError::Corrupt("the journal position marker is damaged".into()))?;
        Ok(u64::from_be_bytes(bytes))
    }

    fn canaries(&self) -> Result<Vec<CanaryEntry>, AuditError> {
        let mut out = Vec::new();
        for item in self.table(CANARIES)?.iter().map_err(storage)? {
            let (row, value) = item.map_err(storage)?;
            let key = canary_key_of_row(row.value())?;
            let value = parse_canary_value(value.value())?;
            out.push(CanaryEntry {
                key,
                session: value.session,
                request_id: value.request_id,
                expires_at_ms: value.expires_at_ms,
            });
        }
        Ok(out)
    }
}

//! A stored log as the `canarygate audit` commands see it: snapshots of the
//! records with their samples and reviews, the chain check, and the two
//! writes a reviewer makes (a review, a prune).
//!
//! An [`Archive`] works while `serve` appends to the same file: read-only it
//! follows the writer's commits; opened for writing, its appends chain onto
//! the writer's (see [`crate::store`]).

use std::path::Path;

use crate::AuditError;
use crate::record::{
    Entry, RawRecord, Record, RecordId, ReviewEntry, ReviewVerdict, Sample, TopicEntry, TopicScore,
};
use crate::secret::{SampleKey, open_sample};
use crate::store::{ReadView, RedbStore, SerializedEntry, Store, WriteOp, WriteOutcome};
use crate::verify::{ChainReport, verify_chain};

/// Records read per page when walking the whole log.
const PAGE: usize = 1024;

/// An audit store opened outside `serve`.
pub struct Archive {
    store: RedbStore,
}

/// A consistent view of the store at one commit.
pub struct Snapshot {
    view: Box<dyn ReadView>,
}

/// One record as stored: its parsed body and the exact bytes that are hashed.
pub struct StoredRecord {
    raw: RawRecord,
    /// The parsed body.
    pub record: Record,
}

/// What a prune removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// Records removed.
    pub removed: u64,
    /// The checkpoint record appended, when anything was removed.
    pub checkpoint: Option<RecordId>,
}

impl Archive {
    /// Opens the store in `dir` read-only (repairing it first after a crash).
    /// [`AuditError::NotFound`] when there is none.
    pub fn open_read_only(dir: &Path) -> Result<Self, AuditError> {
        crate::journal::catch_up(dir)?;
        RedbStore::open_read_only(dir).map(|store| Self { store })
    }

    /// Opens the store in `dir` for reviews and prunes; a missing store is
    /// [`AuditError::NotFound`] (a wrong `--data`), never created.
    pub fn open_writable(dir: &Path) -> Result<Self, AuditError> {
        crate::journal::catch_up(dir)?;
        RedbStore::open_existing_writable(dir).map(|store| Self { store })
    }

    /// The latest commit.
    pub fn snapshot(&self) -> Result<Snapshot, AuditError> {
        Ok(Snapshot {
            view: self.store.read()?,
        })
    }

    /// Walks the whole chain; [`AuditError::Tampered`] names the first
    /// record that does not fit.
    pub fn verify(&self) -> Result<ChainReport, AuditError> {
        verify_chain(self.store.read()?.as_ref())
    }

    /// Appends a review of request record `id`; returns the review's id.
    /// A record is reviewed once.
    pub fn review(
        &self,
        id: RecordId,
        verdict: ReviewVerdict,
        note: Option<String>,
    ) -> Result<RecordId, AuditError> {
        let view = self.store.read()?;
        let raw = view
            .record(id)?
            .ok_or_else(|| AuditError::NotFound(format!("no record {id}")))?;
        if !matches!(raw.parse()?.entry, Entry::Request(_)) {
            return Err(AuditError::InvalidArgument(format!(
                "record {id} is not a request record"
            )));
        }
        if let Some(existing) = view.review_of(id)? {
            return Err(AuditError::InvalidArgument(format!(
                "record {id} was already reviewed in record {existing}"
            )));
        }
        let entry = Entry::Review(ReviewEntry {
            reviewed_id: id,
            verdict,
            note: note.filter(|note| !note.trim().is_empty()),
        });
        match self.store.write(&[WriteOp::Append {
            entry: SerializedEntry::new(&entry)?,
            sample: None,
            journal: None,
        }])?[..]
        {
            [WriteOutcome::Appended(review)] => Ok(review),
            _ => Err(AuditError::Storage("append did not return an id".into())),
        }
    }

    /// Removes the records written before `before_ms` (unix ms) and leaves a
    /// chained checkpoint. Verifies the chain first: pruning a broken chain
    /// would destroy the evidence of the break.
    pub fn prune(&self, before_ms: u64) -> Result<Pruned, AuditError> {
        self.verify()?;
        match self.store.write(&[WriteOp::Prune { before_ms }])?[..] {
            [
                WriteOutcome::Pruned {
                    removed,
                    checkpoint,
                },
            ] => Ok(Pruned {
                removed,
                checkpoint,
            }),
            _ => Err(AuditError::Storage("prune did not report".into())),
        }
    }
}

impl Snapshot {
    /// The last `n` records, ascending.
    pub fn last(&self, n: usize) -> Result<Vec<StoredRecord>, AuditError> {
        self.view.last_records(n)?.into_iter().map(parsed).collect()
    }

    /// Up to `limit` records with id `>= from`, ascending.
    pub fn from_id(&self, from: RecordId, limit: usize) -> Result<Vec<StoredRecord>, AuditError> {
        self.view
            .records_from(from, limit)?
            .into_iter()
            .map(parsed)
            .collect()
    }

    /// Calls `each` for every record, in id order.
    pub fn for_each(
        &self,
        mut each: impl FnMut(StoredRecord) -> Result<(), AuditError>,
    ) -> Result<(), AuditError> {
        let mut from = 0;
        loop {
            let page = self.from_id(from, PAGE)?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            from = last.id() + 1;
            for record in page {
                each(record)?;
            }
        }
    }

    /// One record.
    pub fn get(&self, id: RecordId) -> Result<Option<StoredRecord>, AuditError> {
        self.view.record(id)?.map(parsed).transpose()
    }

    /// The sample of request record `id` (`request_id` is its associated
    /// data), decrypted with `key` when it is encrypted.
    pub fn sample(
        &self,
        id: RecordId,
        request_id: &str,
        key: Option<&SampleKey>,
    ) -> Result<Option<Sample>, AuditError> {
        let Some(stored) = self.view.sample(id)? else {
            return Ok(None);
        };
        let plain = open_sample(&stored, key, request_id)?;
        serde_json::from_slice(&plain)
            .map(Some)
            .map_err(|error| AuditError::Corrupt(format!("record {id}: sample: {error}")))
    }

    /// Ids of the records that keep a sample, ascending.
    pub fn sampled_ids(&self) -> Result<Vec<RecordId>, AuditError> {
        self.view.sampled_ids()
    }

    /// The review record of `id`, if it was reviewed.
    pub fn review_of(&self, id: RecordId) -> Result<Option<RecordId>, AuditError> {
        self.view.review_of(id)
    }

    /// The topic score of request record `id`: in the record itself (`flag`
    /// and `block`), or in the topic record that followed it (`record`),
    /// with that record's id.
    pub fn topic_of(
        &self,
        id: RecordId,
    ) -> Result<Option<(TopicScore, Option<RecordId>)>, AuditError> {
        if let Some(stored) = self.get(id)?
            && let Entry::Request(request) = &stored.record.entry
            && let Some(score) = &request.record.topic
        {
            return Ok(Some((score.clone(), None)));
        }
        Ok(self
            .topic_entry(id)?
            .map(|(topic_id, entry)| (entry.score, Some(topic_id))))
    }

    /// The sample kept for request record `id` (whose `request_id` is
    /// `request_id`): its own, or the one its topic record kept.
    pub fn request_sample(
        &self,
        id: RecordId,
        request_id: &str,
        key: Option<&SampleKey>,
    ) -> Result<Option<Sample>, AuditError> {
        if let Some(sample) = self.sample(id, request_id, key)? {
            return Ok(Some(sample));
        }
        match self.topic_entry(id)? {
            Some((topic_id, entry)) if entry.sample.is_some() => {
                self.sample(topic_id, request_id, key)
            }
            _ => Ok(None),
        }
    }

    /// The request records that kept a sample (their own or through their
    /// topic record), most suspicious first: failed verdicts, then flagged
    /// answers, then by topic similarity, lowest first, then unscored ones;
    /// oldest first within each (nothing waits forever behind newer ones). What `audit spot-check` and the review
    /// page show a reviewer first.
    pub fn review_queue(&self) -> Result<Vec<RecordId>, AuditError> {
        let mut queue = Vec::new();
        for sampled in self.sampled_ids()? {
            let Some(stored) = self.get(sampled)? else {
                continue;
            };
            let (request_id, topic) = match &stored.record.entry {
                Entry::Request(request) => (
                    sampled,
                    request
                        .record
                        .topic
                        .clone()
                        .or(self.topic_entry(sampled)?.map(|(_, entry)| entry.score)),
                ),
                Entry::Topic(entry) => (entry.scored_id, Some(entry.score.clone())),
                _ => continue,
            };
            let Some(request) = self.get(request_id)? else {
                continue;
            };
            let Entry::Request(request) = &request.record.entry else {
                continue;
            };
            let rank = match request.record.verdict {
                crate::VerdictSummary::Fail => 0,
                _ if request.record.action == crate::Action::Flag => 1,
                _ if topic.as_ref().is_some_and(TopicScore::low) => 2,
                _ => 3,
            };
            let similarity = topic
                .and_then(|score| score.similarity)
                .unwrap_or(f32::INFINITY);
            queue.push((rank, similarity, request_id));
        }
        queue.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
        queue.dedup_by_key(|entry| entry.2);
        Ok(queue.into_iter().map(|(_, _, id)| id).collect())
    }

    /// The topic record that scored request record `id`.
    fn topic_entry(&self, id: RecordId) -> Result<Option<(RecordId, TopicEntry)>, AuditError> {
        let Some(topic_id) = self.view.topic_of(id)? else {
            return Ok(None);
        };
        match self.get(topic_id)? {
            Some(stored) => match stored.record.entry {
                Entry::Topic(entry) if entry.scored_id == id => Ok(Some((topic_id, entry))),
                _ => Err(AuditError::Corrupt(format!(
                    "record {topic_id} is indexed as the topic score of record {id} but is not"
                ))),
            },
            None => Ok(None),
        }
    }
}

impl StoredRecord {
    /// The record's id.
    pub fn id(&self) -> RecordId {
        self.raw.key
    }

    /// The record as one export line: its hashed body with `"hash"` first (no newline).
    pub fn export_line(&self) -> Result<String, AuditError> {
        self.raw.export_line()
    }
}

fn parsed(raw: RawRecord) -> Result<StoredRecord, AuditError> {
    let record = raw.parse()?;
    Ok(StoredRecord { raw, record })
}

/// Runs `work` on a store that may have been altered behind redb's back.
///
/// redb documents that reading such a file may panic. A tamper-checking tool
/// must answer it with an error, so a panic inside `work` is caught and
/// reported as [`AuditError::Corrupt`] (the panic message is not printed).
pub fn catch_damage<T>(work: impl FnOnce() -> Result<T, AuditError>) -> Result<T, AuditError> {
    let quiet_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    std::panic::set_hook(quiet_hook);
    outcome.unwrap_or_else(|payload| {
        let detail = payload
            .downcast_ref::<&str>()
            .map(|text| (*text).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown failure".into());
        Err(AuditError::Corrupt(format!(
            "the store file is damaged and cannot be read ({detail})"
        )))
    })
}

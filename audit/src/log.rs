//! The audit log handle used by `serve`: group-committed, durable appends.
//!
//! Two threads write, each behind a queue. Under `durability =
//! "before_answer"` a request record goes to the journal writer, which
//! appends the records it finds queued to the journal ([`crate::journal`])
//! with one sync, answers their callers, and hands them on in order to the
//! index writer. Everything else (canary registrations, sweeps, topic
//! scores, records under the background audit) needs no journal and goes
//! straight to the index writer's queue, so it never wakes the journal
//! thread. The index writer applies what it is handed to the redb store in
//! one transaction per batch, and the chain takes that order. An answer
//! waits for the journal's sync only; the index commit's two syncs happen
//! beside the next batches.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use canarygate_policies::config::{DataReaders, Durability};
use tokio::sync::{mpsc, oneshot};

use crate::AuditError;
use crate::journal::{self, Journal};
use crate::linger::Linger;
use crate::priority::{self, JournalPriority};
use crate::record::{
    Entry, NewRecord, RecordId, RequestEntry, Sample, SampleRef, TopicEntry, TopicScore, sha256_hex,
};
use crate::secret::{SampleKey, Secrets, seal_sample};
use crate::store::{
    CanaryEntry, JournalIndex, MAX_BATCH, RedbStore, Retire, SerializedEntry, Store, WriteOp,
    WriteOutcome,
};
use crate::time::now_ms;

/// How appends are committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommitMode {
    /// Everything queued when the writer becomes free shares one transaction
    /// and one fsync; each caller still waits for its own record. The default.
    #[default]
    Group,
    /// One transaction and fsync per record (for comparison).
    PerRecord,
}

/// Options for [`AuditLog::open`].
#[derive(Debug, Clone)]
pub struct AuditOptions {
    /// Share of passing requests whose text is kept for review (0.0 to 1.0).
    pub sample_rate: f64,
    /// Key that encrypts samples at rest; without one they are stored in clear.
    pub sample_key: Option<SampleKey>,
    /// Group commit (default) or one commit per record.
    pub commit: CommitMode,
    /// Whether [`AuditLog::record`] waits for the disk.
    pub durability: Durability,
    /// The access to the data directory that [`AuditLog::open`] accepts.
    pub data_readable_by: DataReaders,
    /// The name of the instance writing the log, stamped on its records.
    pub instance: Option<String>,
    /// Change to the journal writer's nice value, −20..=0 (0: none;
    /// [`JournalPriority`]).
    pub journal_nice: i32,
}

impl Default for AuditOptions {
    fn default() -> Self {
        Self {
            sample_rate: DEFAULT_SAMPLE_RATE,
            sample_key: None,
            commit: CommitMode::Group,
            durability: Durability::BeforeAnswer,
            data_readable_by: DataReaders::Owner,
            instance: None,
            journal_nice: DEFAULT_JOURNAL_NICE,
        }
    }
}

/// Journal writer's nice change when the policy sets none.
pub const DEFAULT_JOURNAL_NICE: i32 = canarygate_policies::config::DEFAULT_AUDIT_JOURNAL_NICE;

/// Sample rate when the policy sets none.
pub const DEFAULT_SAMPLE_RATE: f64 = canarygate_policies::config::DEFAULT_AUDIT_SAMPLE_RATE;

impl AuditOptions {
    /// Options from the policy's `[audit]` section, reading the sample key
    /// from the environment variable it names.
    pub fn from_policy(
        config: &canarygate_policies::config::AuditConfig,
    ) -> Result<Self, AuditError> {
        let sample_key = match &config.encryption_key_env {
            Some(var) => Some(SampleKey::from_env(var.get_ref())?.ok_or_else(|| {
                AuditError::Key(format!(
                    "audit.encryption_key_env names ${}, which is not set",
                    var.get_ref()
                ))
            })?),
            None => None,
        };
        Ok(Self {
            sample_rate: *config.sample_rate.get_ref(),
            sample_key,
            commit: CommitMode::Group,
            durability: config.durability,
            data_readable_by: config.data_readable_by,
            instance: None,
            journal_nice: *config.journal_nice.get_ref(),
        })
    }
}

/// Appends queued before callers wait for room.
const QUEUE: usize = 8192;
/// With `[audit] durability = "background"`, the least time from one commit's
/// start to the next. No answer waits for those commits, so the writer lets
/// records gather: each commit rewrites the tree's edge pages and the
/// allocator state and syncs the file twice whatever its size. At 10 ms the
/// bytes written per record fell about threefold; 50 ms saves another ~6 %
/// of the process's CPU per request (fewer fsyncs), for a crash-loss window
/// of about 50 ms (README Performance). The few writes that are awaited
/// (canary sweeps) wait at most that much longer.
pub(super) const BACKGROUND_COMMIT_INTERVAL: Duration = Duration::from_millis(50);
/// With `durability = "before_answer"`, the least time between index
/// commits. Answers wait for the journal, not for these commits, so they
/// can gather records too: committing back to back took 15 % of `serve`'s
/// CPU when streaming at saturation (`perf record`, bench/README.md); going
/// from 10 ms to 50 ms took another 7 % (whole answers) to 10 % (streams)
/// off the CPU per request, against the 10 ms build in the same bench run.
/// Nothing on the request path waits for these commits; the few callers
/// that do (record ids for topic scores, canary sweeps, `append`) wait at
/// most this much longer, and so do `audit` commands started while `serve`
/// runs.
pub(super) const JOURNALED_INDEX_INTERVAL: Duration = Duration::from_millis(50);

/// A request record for the journal writer (`durability = "before_answer"`).
struct ToJournal {
    op: WriteOp,
    /// Answered with the record's id once it is indexed.
    reply: oneshot::Sender<Result<WriteOutcome, AuditError>>,
    /// Answered once the record is on disk in the journal.
    on_disk: oneshot::Sender<Result<(), AuditError>>,
}

/// A request record handed to the log by [`AuditLog::record`]: on disk in
/// the journal, or (background durability) queued for the next commit.
#[derive(Debug)]
pub struct Recorded(oneshot::Receiver<Result<WriteOutcome, AuditError>>);

impl Recorded {
    /// The record's id in the chain, once the store has indexed it.
    pub async fn id(self) -> Result<RecordId, AuditError> {
        match self.0.await.map_err(|_| AuditError::Closed)?? {
            WriteOutcome::Appended(id) => Ok(id),
            other => Err(unexpected(other)),
        }
    }
}

/// Handle on the audit store of one data directory. Cheap to clone.
/// Dropping the last clone waits until the writer threads have written
/// what was queued and stopped (at most 10 s), so the directory can be
/// opened again as soon as it returns.
#[derive(Clone)]
pub struct AuditLog {
    inner: Arc<Inner>,
}

struct Inner {
    writers: Writers,
    store: Arc<dyn Store>,
    secrets: Secrets,
    options: AuditOptions,
    commits: Arc<AtomicU64>,
    background_failures: Arc<AtomicU64>,
    journal_syncs: Arc<OnceLock<JournalSyncObserver>>,
    journal_priority: JournalPriority,
}

/// The queues of the two writer threads. Dropped with the last
/// [`AuditLog`] handle: it closes both queues and waits until both threads
/// have written what was queued and let go of the directory (the journal's
/// lock, the store), so that the directory can be opened again at once. A
/// writer stuck on a failing disk is waited for at most
/// [`WRITERS_EXIT_WAIT`].
struct Writers {
    /// Request records to journal.
    journal: mpsc::Sender<ToJournal>,
    /// Everything else, straight to the index writer.
    index: mpsc::Sender<Indexable>,
    /// Disconnected once both threads have ended (each holds a sender); in
    /// a mutex only because a receiver is not `Sync`.
    ended: Mutex<std_mpsc::Receiver<()>>,
}

/// Longest wait, when the last handle is dropped, for the writer threads.
const WRITERS_EXIT_WAIT: Duration = Duration::from_secs(10);

impl Drop for Writers {
    fn drop(&mut self) {
        // Ours are the last senders but the journal writer's own to the
        // index writer: swapping in senders of dead channels drops them.
        self.journal = mpsc::channel(1).0;
        self.index = mpsc::channel(1).0;
        if let Ok(ended) = self.ended.get_mut() {
            let _ = ended.recv_timeout(WRITERS_EXIT_WAIT);
        }
    }
}

/// Told how long each journal write took, its `fdatasync` included: the
/// disk's sync latency under the process's own load, which a durable
/// answer waits for ([`AuditLog::observe_journal_syncs`]).
pub type JournalSyncObserver = Box<dyn Fn(Duration) + Send + Sync>;

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("sample_rate", &self.inner.options.sample_rate)
            .field(
                "encrypted_samples",
                &self.inner.options.sample_key.is_some(),
            )
            .field("commit", &self.inner.options.commit)
            .finish()
    }
}

impl AuditLog {
    /// Opens (creating when missing) `dir/canarygate.redb` and `dir/secret.key`,
    /// checks every page of the store (repairing it after a crash; a damaged
    /// file is an error), takes the journal's lock, indexes what a crash
    /// left in the journal, and starts the writer threads. Blocking; it
    /// reads the whole store. A second log on the same `dir` is refused
    /// while this one is open. A missing `dir` is created owner-only; an existing one
    /// open to more users than `options.data_readable_by` allows is an
    /// [`AuditError::Exposed`].
    pub fn open(dir: &Path, options: AuditOptions) -> Result<Self, AuditError> {
        if !(0.0..=1.0).contains(&options.sample_rate) {
            return Err(AuditError::InvalidArgument(format!(
                "sample rate {} is outside 0.0..=1.0",
                options.sample_rate
            )));
        }
        let nice_range = canarygate_policies::config::AUDIT_JOURNAL_NICE_RANGE;
        if !nice_range.contains(&options.journal_nice) {
            return Err(AuditError::InvalidArgument(format!(
                "journal nice change {} is outside {nice_range:?}",
                options.journal_nice
            )));
        }
        crate::files::prepare_data_dir(dir, options.data_readable_by)?;
        let redb = RedbStore::open_writable_with(dir, true)?;
        let journal = Journal::open(dir, &redb)?;
        let store: Arc<dyn Store> = Arc::new(redb);
        let secrets = Secrets::load_or_create(dir)?;
        let (journal_sender, journal_receiver) = mpsc::channel(QUEUE);
        let (index_sender, mut index_receiver) = mpsc::channel(QUEUE);
        let journal_index_sender = index_sender.clone();
        let (index_ended, ended) = std_mpsc::channel::<()>();
        let journal_ended = index_ended.clone();
        let indexed = Arc::new(AtomicU64::new(store.read()?.journal_indexed()?));
        let journal_indexed = Arc::clone(&indexed);
        let writer_store = Arc::clone(&store);
        let commit = options.commit;
        let pace = match options.durability {
            Durability::BeforeAnswer => JOURNALED_INDEX_INTERVAL,
            Durability::Background => BACKGROUND_COMMIT_INTERVAL,
        };
        let commits = Arc::new(AtomicU64::new(0));
        let writer_commits = Arc::clone(&commits);
        let background_failures = Arc::new(AtomicU64::new(0));
        let writer_failures = Arc::clone(&background_failures);
        let limit = match commit {
            CommitMode::Group => MAX_BATCH,
            CommitMode::PerRecord => 1,
        };
        std::thread::Builder::new()
            .name("audit-index".into())
            .spawn(move || {
                let _ended = index_ended;
                run_index_writer(
                    writer_store.as_ref(),
                    &mut index_receiver,
                    limit,
                    pace,
                    &indexed,
                    &writer_commits,
                    &writer_failures,
                )
            })
            .map_err(|error| AuditError::Io(format!("cannot start the audit writer: {error}")))?;
        let journal_syncs = Arc::new(OnceLock::new());
        let observer = Arc::clone(&journal_syncs);
        let journal_nice = options.journal_nice;
        let (priority_sender, priority) = std_mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("audit-journal".into())
            .spawn(move || {
                let _ended = journal_ended;
                let priority = priority::raise_current_thread(journal_nice);
                // The wait after a batch balances the raised priority's
                // small batches; at the process's priority it is not needed.
                let linger = Linger::new(matches!(priority, JournalPriority::Raised { .. }));
                let _ = priority_sender.send(priority);
                run_journal_writer(
                    journal,
                    journal_receiver,
                    &journal_index_sender,
                    limit,
                    &journal_indexed,
                    &observer,
                    linger,
                )
            })
            .map_err(|error| AuditError::Io(format!("cannot start the audit journal: {error}")))?;
        // The thread's first act; it cannot block.
        let journal_priority = priority
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| AuditError::Io("the audit journal did not start".into()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                writers: Writers {
                    journal: journal_sender,
                    index: index_sender,
                    ended: Mutex::new(ended),
                },
                store,
                secrets,
                options,
                commits,
                background_failures,
                journal_syncs,
                journal_priority,
            }),
        })
    }

    /// Records one request as `[audit] durability` says: journaled (on disk
    /// when this returns `Ok`; concurrent records share one sync), or queued
    /// for the next commit (`Ok` once queued).
    pub async fn record(&self, new: NewRecord) -> Result<Recorded, AuditError> {
        let op = self.append_op(new)?;
        let (reply, answer) = oneshot::channel();
        if self.inner.options.durability == Durability::Background {
            self.enqueue(Indexable {
                op,
                reply: Some(reply),
                background: true,
            })
            .await?;
            return Ok(Recorded(answer));
        }
        let (on_disk_reply, on_disk) = oneshot::channel();
        self.inner
            .writers
            .journal
            .send(ToJournal {
                op,
                reply,
                on_disk: on_disk_reply,
            })
            .await
            .map_err(|_| AuditError::Closed)?;
        on_disk.await.map_err(|_| AuditError::Closed)??;
        Ok(Recorded(answer))
    }

    /// Queues `indexable` for the index writer, waiting for room.
    async fn enqueue(&self, indexable: Indexable) -> Result<(), AuditError> {
        self.inner
            .writers
            .index
            .send(indexable)
            .await
            .map_err(|_| AuditError::Closed)
    }

    /// Appends the topic score of request record `scored_id` (whose
    /// `request_id` is `request_id`), with the sample the score made worth
    /// keeping; durable when this returns `Ok`.
    pub async fn append_topic(
        &self,
        scored_id: RecordId,
        request_id: &str,
        score: TopicScore,
        sample: Option<&Sample>,
    ) -> Result<RecordId, AuditError> {
        let sealed = self.seal(sample, request_id)?;
        let entry = Entry::Topic(TopicEntry {
            scored_id,
            request_id: request_id.to_owned(),
            score,
            sample: self.sample_ref(sealed.as_deref()),
        });
        match self
            .submit(WriteOp::Append {
                entry: SerializedEntry::new(&entry)?,
                sample: sealed,
                journal: None,
            })
            .await?
        {
            WriteOutcome::Appended(id) => Ok(id),
            other => Err(unexpected(other)),
        }
    }

    /// Appends one record; when this returns `Ok`, the record (and its sample)
    /// is on disk. Concurrent calls share a transaction and an fsync.
    pub async fn append(&self, new: NewRecord) -> Result<RecordId, AuditError> {
        let op = self.append_op(new)?;
        match self.submit(op).await? {
            WriteOutcome::Appended(id) => Ok(id),
            other => Err(unexpected(other)),
        }
    }

    /// The write of one record: its sample sealed, its entry built and
    /// serialised (here, in the caller's task, not on the writer threads).
    fn append_op(&self, new: NewRecord) -> Result<WriteOp, AuditError> {
        let sample = self.seal(new.sample.as_ref(), &new.record.request_id)?;
        let entry = Entry::Request(Box::new(RequestEntry {
            record: new.record,
            sample: self.sample_ref(sample.as_deref()),
        }));
        Ok(WriteOp::Append {
            entry: SerializedEntry::new(&entry)?,
            sample,
            journal: None,
        })
    }

    /// The stored bytes of `sample` (encrypted when a key is configured),
    /// bound to `request_id`.
    fn seal(
        &self,
        sample: Option<&Sample>,
        request_id: &str,
    ) -> Result<Option<Vec<u8>>, AuditError> {
        let Some(sample) = sample else {
            return Ok(None);
        };
        let plain =
            serde_json::to_vec(sample).map_err(|error| AuditError::Corrupt(error.to_string()))?;
        seal_sample(&plain, self.inner.options.sample_key.as_ref(), request_id).map(Some)
    }

    fn sample_ref(&self, stored: Option<&[u8]>) -> Option<SampleRef> {
        stored.map(|stored| SampleRef {
            encrypted: self.inner.options.sample_key.is_some(),
            sha256: sha256_hex(stored),
        })
    }

    /// Registers live canaries; durable when it returns.
    pub async fn register_canaries(&self, entries: Vec<CanaryEntry>) -> Result<(), AuditError> {
        self.submit(WriteOp::Register(entries)).await.map(drop)
    }

    /// Queues live canaries for the next commit without waiting for it.
    /// Errors only when the queue is full or the writer has stopped.
    pub fn register_canaries_soon(&self, entries: Vec<CanaryEntry>) -> Result<(), AuditError> {
        self.inner
            .writers
            .index
            .try_send(Indexable {
                op: WriteOp::Register(entries),
                reply: None,
                background: true,
            })
            .map_err(|error| match error {
                mpsc::error::TrySendError::Full(_) => {
                    AuditError::Storage("the audit write queue is full".into())
                }
                mpsc::error::TrySendError::Closed(_) => AuditError::Closed,
            })
    }

    /// Writes that failed in the background (nobody was waiting for them).
    pub fn background_failures(&self) -> u64 {
        self.inner.background_failures.load(Ordering::Relaxed)
    }

    /// From now on, tells `observer` how long each journal write and its
    /// sync took (`durability = "before_answer"`; the background audit
    /// journals nothing). One observer per log: a second is refused (`false`).
    pub fn observe_journal_syncs(&self, observer: JournalSyncObserver) -> bool {
        self.inner.journal_syncs.set(observer).is_ok()
    }

    /// Bytes held in the store's page cache: part of the process's memory
    /// that grows with the audit file up to the cache's fixed bound.
    pub fn cache_bytes(&self) -> usize {
        self.inner.store.cache_bytes()
    }

    /// Retires canaries; returns how many were removed.
    pub async fn retire_canaries(&self, which: Retire) -> Result<u64, AuditError> {
        count(self.submit(WriteOp::Retire(which)).await?)
    }

    /// Removes canaries expired at `now_ms`; returns how many.
    pub async fn sweep_canaries(&self, now_ms: u64) -> Result<u64, AuditError> {
        count(self.submit(WriteOp::Sweep { now_ms }).await?)
    }

    /// Canaries still live at `now_ms` (e.g. to rebuild the scanner at start).
    pub fn live_canaries(&self, now_ms: u64) -> Result<Vec<CanaryEntry>, AuditError> {
        let mut entries = self.inner.store.read()?.canaries()?;
        entries.retain(|entry| entry.expires_at_ms > now_ms);
        Ok(entries)
    }

    /// The install's secrets (session, canary and credential hashing keys).
    pub fn secrets(&self) -> &Secrets {
        &self.inner.secrets
    }

    /// The name of the instance writing the log, if it has one.
    pub fn instance(&self) -> Option<&str> {
        self.inner.options.instance.as_deref()
    }

    /// The configured sample rate, for [`should_sample`](crate::should_sample).
    pub fn sample_rate(&self) -> f64 {
        self.inner.options.sample_rate
    }

    /// Whether samples are encrypted at rest (a sample key is configured).
    pub fn encrypts_samples(&self) -> bool {
        self.inner.options.sample_key.is_some()
    }

    /// How the journal writer's priority came out (`[audit] journal_nice`).
    pub fn journal_priority(&self) -> &JournalPriority {
        &self.inner.journal_priority
    }

    /// Transactions committed so far by this log's writer (for metrics: with
    /// group commit this grows slower than the number of appends).
    pub fn commit_count(&self) -> u64 {
        self.inner.commits.load(Ordering::Relaxed)
    }

    async fn submit(&self, op: WriteOp) -> Result<WriteOutcome, AuditError> {
        let (reply, answer) = oneshot::channel();
        self.enqueue(Indexable {
            op,
            reply: Some(reply),
            background: false,
        })
        .await?;
        answer.await.map_err(|_| AuditError::Closed)?
    }
}

fn count(outcome: WriteOutcome) -> Result<u64, AuditError> {
    match outcome {
        WriteOutcome::Count(n) => Ok(n),
        other => Err(unexpected(other)),
    }
}

fn unexpected(outcome: WriteOutcome) -> AuditError {
    AuditError::Storage(format!("unexpected write outcome {outcome:?}"))
}

/// What the index writer applies: an operation and whoever waits for its
/// outcome.
struct Indexable {
    op: WriteOp,
    /// `None`: nobody waits (canary registrations).
    reply: Option<oneshot::Sender<Result<WriteOutcome, AuditError>>>,
    /// Acknowledged before it is durable (`durability = "background"`):
    /// a failed commit is counted in [`AuditLog::background_failures`].
    background: bool,
}

/// The journal writer: journals the request records of each batch with one
/// sync, answers their callers, and hands the batch on to the index writer
/// in order; after a batch of several records it lets the next ones gather
/// ([`Linger`]). Stops when every [`AuditLog`] handle is gone.
fn run_journal_writer(
    mut journal: Journal,
    mut receiver: mpsc::Receiver<ToJournal>,
    index: &mpsc::Sender<Indexable>,
    limit: usize,
    indexed: &AtomicU64,
    observer: &OnceLock<JournalSyncObserver>,
    mut linger: Linger,
) {
    let mut batch = Vec::new();
    let mut frames = Vec::new();
    while let Some(first) = receiver.blocking_recv() {
        batch.push(first);
        while batch.len() < limit {
            match receiver.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let records = batch.len();
        let at_ms = now_ms();
        for record in &mut batch {
            if let WriteOp::Append {
                entry,
                sample,
                journal: position,
            } = &mut record.op
            {
                let seq = journal.take_seq();
                journal::encode(seq, at_ms, entry.json(), sample.as_deref(), &mut frames);
                *position = Some(JournalIndex { seq, at_ms });
            }
        }
        let written = if frames.is_empty() {
            Ok(())
        } else {
            let started = Instant::now();
            let written = journal.append(&frames);
            let took = started.elapsed();
            linger.observe_sync(took);
            if let Some(observe) = observer.get() {
                observe(took);
            }
            written
        };
        frames.clear();
        for record in batch.drain(..) {
            if let Err(error) = &written {
                // Not on disk: the caller answers with an error, and the
                // record is not indexed either.
                let _ = record.on_disk.send(Err(error.clone()));
                continue;
            }
            let _ = record.on_disk.send(Ok(()));
            let handed = index.blocking_send(Indexable {
                op: record.op,
                reply: Some(record.reply),
                background: false,
            });
            if handed.is_err() {
                return;
            }
        }
        if let Err(error) = &written {
            tracing::error!(%error, "audit journal write failed");
        }
        if let Err(error) = journal.maintain(indexed.load(Ordering::Acquire)) {
            tracing::warn!(%error, "audit journal upkeep failed");
        }
        linger.wait(records, || receiver.len());
    }
}

/// The index writer: applies what it is handed (by the journal writer, or
/// straight from the log's callers) to the store, one transaction per batch.
/// A batch holding journaled records that fails to commit is retried: those
/// records are on disk and acknowledged, and the journal position the store
/// keeps must not pass them.
fn run_index_writer(
    store: &dyn Store,
    receiver: &mut mpsc::Receiver<Indexable>,
    limit: usize,
    pace: Duration,
    indexed: &AtomicU64,
    commits: &AtomicU64,
    background_failures: &AtomicU64,
) {
    let mut ops = Vec::new();
    let mut replies = Vec::new();
    let mut last_commit = Instant::now();
    let mut failures_in_a_row = 0u32;
    loop {
        if ops.is_empty() {
            let Some(first) = receiver.blocking_recv() else {
                return;
            };
            ops.push(first.op);
            replies.push((first.reply, first.background));
        }
        // `pace` after the last commit started, or now when that is past.
        if let Some(wait) = (last_commit + pace).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        last_commit = Instant::now();
        while ops.len() < limit {
            match receiver.try_recv() {
                Ok(next) => {
                    ops.push(next.op);
                    replies.push((next.reply, next.background));
                }
                Err(_) => break,
            }
        }
        match store.write(&ops) {
            Ok(outcomes) => {
                failures_in_a_row = 0;
                commits.fetch_add(1, Ordering::Relaxed);
                if let Some(last) = ops.iter().filter_map(journal_seq).max() {
                    indexed.store(last, Ordering::Release);
                }
                for ((reply, _), outcome) in replies.drain(..).zip(outcomes) {
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(outcome));
                    }
                }
                ops.clear();
            }
            Err(error) => {
                tracing::error!(%error, records = ops.len(), "audit commit failed");
                // Everything but the journaled records fails now; those stay
                // queued, in order, for the next attempt.
                let mut kept_ops = Vec::new();
                let mut kept_replies = Vec::new();
                for (op, (reply, background)) in ops.drain(..).zip(replies.drain(..)) {
                    if journal_seq(&op).is_some() {
                        kept_ops.push(op);
                        kept_replies.push((reply, background));
                        continue;
                    }
                    if background {
                        background_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(reply) = reply {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
                ops = kept_ops;
                replies = kept_replies;
                if !ops.is_empty() {
                    failures_in_a_row = failures_in_a_row.saturating_add(1);
                    let backoff = 10u64 << failures_in_a_row.min(7);
                    std::thread::sleep(Duration::from_millis(backoff));
                }
            }
        }
    }
}

fn journal_seq(op: &WriteOp) -> Option<u64> {
    match op {
        WriteOp::Append {
            journal: Some(journal),
            ..
        } => Some(journal.seq),
        _ => None,
    }
}

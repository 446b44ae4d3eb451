//! The audit log handle used by `serve`: group-committed, durable appends.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use canarygate_policies::config::{DataReaders, Durability};
use tokio::sync::{mpsc, oneshot};

use crate::AuditError;
use crate::record::{
    Entry, NewRecord, RecordId, RequestEntry, Sample, SampleRef, TopicEntry, TopicScore, sha256_hex,
};
use crate::secret::{SampleKey, Secrets, seal_sample};
use crate::store::{CanaryEntry, RedbStore, Retire, Store, WriteOp, WriteOutcome};

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
        }
    }
}

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
        })
    }
}

/// Most operations committed in one transaction.
const MAX_BATCH: usize = 4096;
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

struct Pending {
    op: WriteOp,
    /// `None`: nobody waits (canary registrations).
    reply: Option<oneshot::Sender<Result<WriteOutcome, AuditError>>>,
    /// Acknowledged before it is durable (`durability = "background"`):
    /// a failed commit is counted in [`AuditLog::background_failures`].
    background: bool,
}

/// A request record handed to the log by [`AuditLog::record`]: durable
/// already, or queued for the next commit.
#[derive(Debug)]
pub struct Recorded(RecordedState);

#[derive(Debug)]
enum RecordedState {
    Durable(RecordId),
    Queued(oneshot::Receiver<Result<WriteOutcome, AuditError>>),
}

impl Recorded {
    /// The record's id, once its commit is done (at once when it is
    /// durable already).
    pub async fn id(self) -> Result<RecordId, AuditError> {
        match self.0 {
            RecordedState::Durable(id) => Ok(id),
            RecordedState::Queued(answer) => {
                match answer.await.map_err(|_| AuditError::Closed)?? {
                    WriteOutcome::Appended(id) => Ok(id),
                    other => Err(unexpected(other)),
                }
            }
        }
    }
}

/// Handle on the audit store of one data directory. Cheap to clone; the
/// writer thread stops when the last clone is dropped.
#[derive(Clone)]
pub struct AuditLog {
    inner: Arc<Inner>,
}

struct Inner {
    sender: mpsc::Sender<Pending>,
    store: Arc<dyn Store>,
    secrets: Secrets,
    options: AuditOptions,
    commits: Arc<AtomicU64>,
    background_failures: Arc<AtomicU64>,
}

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
    /// file is an error), and starts the writer thread. Blocking; it reads the
    /// whole store. A missing `dir` is created owner-only; an existing one
    /// open to more users than `options.data_readable_by` allows is an
    /// [`AuditError::Exposed`].
    pub fn open(dir: &Path, options: AuditOptions) -> Result<Self, AuditError> {
        if !(0.0..=1.0).contains(&options.sample_rate) {
            return Err(AuditError::InvalidArgument(format!(
                "sample rate {} is outside 0.0..=1.0",
                options.sample_rate
            )));
        }
        crate::files::prepare_data_dir(dir, options.data_readable_by)?;
        let store: Arc<dyn Store> = Arc::new(RedbStore::open_writable_with(dir, true)?);
        let secrets = Secrets::load_or_create(dir)?;
        let (sender, receiver) = mpsc::channel(QUEUE);
        let writer_store = Arc::clone(&store);
        let commit = options.commit;
        let pace = match options.durability {
            Durability::BeforeAnswer => Duration::ZERO,
            Durability::Background => BACKGROUND_COMMIT_INTERVAL,
        };
        let commits = Arc::new(AtomicU64::new(0));
        let writer_commits = Arc::clone(&commits);
        let background_failures = Arc::new(AtomicU64::new(0));
        let writer_failures = Arc::clone(&background_failures);
        std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn(move || {
                run_writer(
                    writer_store.as_ref(),
                    receiver,
                    commit,
                    pace,
                    &writer_commits,
                    &writer_failures,
                )
            })
            .map_err(|error| AuditError::Io(format!("cannot start the audit writer: {error}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                sender,
                store,
                secrets,
                options,
                commits,
                background_failures,
            }),
        })
    }

    /// Records one request as `[audit] durability` says: [`Self::append`]
    /// (on disk when this returns `Ok`), or queued for the next commit
    /// (`Ok` once queued).
    pub async fn record(&self, new: NewRecord) -> Result<Recorded, AuditError> {
        match self.inner.options.durability {
            Durability::BeforeAnswer => self
                .append(new)
                .await
                .map(|id| Recorded(RecordedState::Durable(id))),
            Durability::Background => {
                let op = self.append_op(new)?;
                let (reply, answer) = oneshot::channel();
                self.inner
                    .sender
                    .send(Pending {
                        op,
                        reply: Some(reply),
                        background: true,
                    })
                    .await
                    .map_err(|_| AuditError::Closed)?;
                Ok(Recorded(RecordedState::Queued(answer)))
            }
        }
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
                entry,
                sample: sealed,
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

    /// The write of one record: its sample sealed, its entry built.
    fn append_op(&self, new: NewRecord) -> Result<WriteOp, AuditError> {
        let sample = self.seal(new.sample.as_ref(), &new.record.request_id)?;
        let entry = Entry::Request(Box::new(RequestEntry {
            record: new.record,
            sample: self.sample_ref(sample.as_deref()),
        }));
        Ok(WriteOp::Append { entry, sample })
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
            .sender
            .try_send(Pending {
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

    /// Transactions committed so far by this log's writer (for metrics: with
    /// group commit this grows slower than the number of appends).
    pub fn commit_count(&self) -> u64 {
        self.inner.commits.load(Ordering::Relaxed)
    }

    async fn submit(&self, op: WriteOp) -> Result<WriteOutcome, AuditError> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .sender
            .send(Pending {
                op,
                reply: Some(reply),
                background: false,
            })
            .await
            .map_err(|_| AuditError::Closed)?;
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

fn run_writer(
    store: &dyn Store,
    mut receiver: mpsc::Receiver<Pending>,
    commit: CommitMode,
    pace: Duration,
    commits: &AtomicU64,
    background_failures: &AtomicU64,
) {
    let limit = match commit {
        CommitMode::Group => MAX_BATCH,
        CommitMode::PerRecord => 1,
    };
    let mut ops = Vec::new();
    let mut replies = Vec::new();
    let mut last_commit = Instant::now();
    while let Some(first) = receiver.blocking_recv() {
        // `pace` after the last commit started, or now when that is past.
        if let Some(wait) = (last_commit + pace).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        last_commit = Instant::now();
        ops.push(first.op);
        replies.push((first.reply, first.background));
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
                commits.fetch_add(1, Ordering::Relaxed);
                for ((reply, _), outcome) in replies.drain(..).zip(outcomes) {
                    if let Some(reply) = reply {
                        let _ = reply.send(Ok(outcome));
                    }
                }
            }
            Err(error) => {
                tracing::error!(%error, records = ops.len(), "audit commit failed");
                for (reply, background) in replies.drain(..) {
                    if background {
                        background_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(reply) = reply {
                        let _ = reply.send(Err(error.clone()));
                    }
                }
            }
        }
        ops.clear();
    }
}

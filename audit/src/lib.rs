//! canarygate-audit: the durable, hash-chained audit log and the persisted
//! canary registry.
//!
//! Two ways in. [`AuditLog`] is the writer `serve` holds: one record per
//! request through [`AuditLog::record`], durable when it returns: in the
//! journal (`DIR/journal/`), concurrent records sharing one sync, then chained
//! into the store by the index writer ([`AuditLog::append`] waits for that
//! commit too); plus the live canaries that must survive a restart. [`Archive`]
//! is what the `canarygate audit` commands open, read-only or for the two
//! commands that write (reviews, prune): snapshots of the records, their
//! samples and reviews, [`Archive::verify`] of the chain.
//!
//! Records (`record`) form a SHA-256 chain (`verify`); sampled requests
//! keep their (canary-redacted) text for spot-check review, encrypted at rest
//! when a key is configured (`secret`). Everything is stored in one redb
//! file, `DIR/canarygate.redb`, behind a two-method trait (`store`); the
//! per-install secret is `DIR/secret.key`. The directory and every file in it
//! are created owner-only ([`files`]). No I/O but files: no network, no
//! command line (that lives in the `canarygate` binary).
//!
//! See this crate's `README.md` for the export schema and the storage choice.

mod archive;
pub mod files;
mod journal;
mod linger;
mod log;
mod priority;
mod record;
mod secret;
mod store;
pub mod time;
mod verify;

#[cfg(test)]
mod journal_tests;
#[cfg(test)]
mod tests;

pub use archive::{Archive, Pruned, Snapshot, StoredRecord, catch_damage};
pub use journal::JOURNAL_DIR;
pub use log::{
    AuditLog, AuditOptions, CommitMode, DEFAULT_JOURNAL_NICE, DEFAULT_SAMPLE_RATE,
    JournalSyncObserver, Recorded,
};
pub use priority::JournalPriority;
pub use record::{
    Action, CheckEvidence, CheckRecord, CheckpointEntry, Entry, GENESIS_HASH, Latency, NewRecord,
    Outcome, Record, RecordId, RequestEntry, RequestRecord, ReviewEntry, ReviewVerdict, Route,
    Sample, SampleRef, TokenOverhead, TopicEntry, TopicScore, VerdictSummary, chain_hash,
    sha256_hex,
};
pub use secret::{SampleKey, Secrets, hmac_sha256, parse_key};
pub use store::{CanaryEntry, Retire, STORE_FILE};
pub use verify::ChainReport;

/// Why an audit operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuditError {
    /// The store could not be opened, read or committed.
    #[error("audit store: {0}")]
    Storage(String),
    /// A file other than the store could not be read or written.
    #[error("{0}")]
    Io(String),
    /// The data directory or a file in it is open to more users than the
    /// policy allows ([`files::check_data_dir`]).
    #[error("{0}")]
    Exposed(String),
    /// Stored data is malformed.
    #[error("audit store is corrupt: {0}")]
    Corrupt(String),
    /// Something asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A sample key is missing, malformed or wrong.
    #[error("sample key: {0}")]
    Key(String),
    /// A bad argument.
    #[error("{0}")]
    InvalidArgument(String),
    /// The chain does not verify; the message names the first bad record.
    #[error("audit chain broken: {0}")]
    Tampered(String),
    /// The writer thread is gone (the log was closed or a commit panicked).
    #[error("the audit writer has stopped")]
    Closed,
}

/// Whether to keep the text of a request for review, drawn with
/// probability `chance` (see `canarygate_policies::topic::sample_chance`:
/// always for failed verdicts and low topic scores, the sample rate for the
/// rest).
pub fn should_sample(chance: f64) -> bool {
    if chance >= 1.0 {
        return true;
    }
    if chance <= 0.0 || chance.is_nan() {
        return false;
    }
    // 53 random bits give a uniform float in [0, 1). The thread's CSPRNG
    // costs no system call per request.
    let bits = rand::Rng::next_u64(&mut rand::rng());
    let unit = (bits >> 11) as f64 / (1u64 << 53) as f64;
    unit < chance
}

//! Durable, hash-chained audit log, canary registry and probe store.
//!
//! One record per request is appended through [`AuditLog::append`], durable
//! when it returns; concurrent appends share a transaction (group commit).
//! Records form a SHA-256 chain that `canarygate audit verify` recomputes.
//! Sampled requests keep their (canary-redacted) text for spot-check review,
//! encrypted at rest when a key is configured. Everything is stored in one
//! redb file, `DIR/canarygate.redb`; the per-install secret is `DIR/secret.key`.
//!
//! See `README.md` in this directory for the CLI, the export schema and the
//! storage choice.

pub mod cli;
mod log;
mod record;
mod secret;
mod store;
pub mod time;
mod verify;

#[cfg(test)]
mod tests;

pub use log::{AuditLog, AuditOptions, CommitMode, DEFAULT_SAMPLE_RATE};
pub use record::{
    Action, CheckRecord, CheckResult, Latency, NewRecord, Outcome, RecordId, RequestRecord, Route,
    Sample, Verdict, sha256_hex,
};
pub use secret::{SampleKey, Secrets, hmac_sha256};
pub use store::{CanaryEntry, Retire, STORE_FILE};

/// Why an audit operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuditError {
    /// The store could not be opened, read or committed.
    #[error("audit store: {0}")]
    Storage(String),
    /// A file other than the store could not be read or written.
    #[error("{0}")]
    Io(String),
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

/// Whether to keep the text of a request for review: always when its verdict
/// failed, otherwise with probability `rate`.
pub fn should_sample(rate: f64, verdict_failed: bool) -> bool {
    if verdict_failed {
        return true;
    }
    if rate <= 0.0 {
        return false;
    }
    let mut bytes = [0; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return false;
    }
    // 53 random bits give a uniform float in [0, 1).
    let unit = (u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64;
    unit < rate
}

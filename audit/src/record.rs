//! Record types and the hash chain.
//!
//! A stored record is its body, a JSON object written once at append time,
//! preceded by its 32-byte hash. The body carries its own `id` and the
//! previous record's hash (`prev_hash`), and the hash is
//! `SHA-256("canarygate-audit-v1\n" || body)`. The stored body bytes *are* the
//! canonical serialisation: nothing is re-serialised to verify, so the chain
//! does not depend on JSON key order or number formatting.

use canarygate_policies::verify::{CheckResult, Evidence, Status, Verdict};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::AuditError;

/// Identifier of a record: 1, 2, 3, ... in append order, never reused.
pub type RecordId = u64;

/// Schema version written into every record body (`"v"`).
pub const SCHEMA_VERSION: u32 = 1;

/// `prev_hash` of the very first record of a log.
pub const GENESIS_HASH: [u8; 32] = [0; 32];

const HASH_DOMAIN: &[u8] = b"canarygate-audit-v1\n";

/// Where the answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// Forwarded to the provider.
    Upstream,
    /// Served by the bundled local engine.
    Local,
}

/// How the exchange with the client ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The client received the whole answer.
    Complete,
    /// The client went away before the answer ended.
    InterruptedByClient,
    /// The provider's stream broke off or timed out.
    InterruptedByUpstream,
    /// The request failed before an answer could be given.
    Error,
}

/// Overall result of the checks, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerdictSummary {
    /// Every check that ran passed.
    Pass,
    /// At least one check failed.
    Fail,
    /// No check could judge the answer (local route, error before an answer).
    Unchecked,
    /// The endpoint has no answer text to check (embeddings, a passthrough
    /// path): forwarded and recorded only.
    Unverifiable,
}

impl VerdictSummary {
    /// The summary of the verifier's verdict; `Unchecked` when there is none.
    pub fn of(verdict: Option<&Verdict>) -> Self {
        match verdict {
            None => Self::Unchecked,
            Some(verdict) if verdict.passed() => Self::Pass,
            Some(_) => Self::Fail,
        }
    }
}

/// What the proxy did with the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The answer was delivered as verified.
    Forward,
    /// The answer was withheld and the client got an error.
    Block,
    /// The request was (re)served by the local engine.
    Fallback,
    /// The answer was delivered but marked as suspicious.
    Flag,
    /// canarygate refused the request itself (bad input, auth, limits).
    Reject,
}

/// One check that ran on the answer, with its evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckRecord {
    /// Check name, e.g. `echo`, `foreign_canary`, `prompt_tokens`.
    pub name: String,
    /// What it concluded: pass, fail or skip.
    pub result: Status,
    /// What it saw (numbers, canary ids, offsets). Never canary values.
    pub evidence: CheckEvidence,
}

impl From<&CheckResult> for CheckRecord {
    /// The verifier's result of one check, as recorded: its reason and
    /// evidence under `reason` and `seen`.
    fn from(check: &CheckResult) -> Self {
        #[derive(Serialize)]
        struct Seen<'a> {
            reason: &'a Option<String>,
            seen: &'a Evidence,
        }
        Self {
            name: check.check.name().to_owned(),
            result: check.status,
            evidence: CheckEvidence::of(&Seen {
                reason: &check.reason,
                seen: &check.evidence,
            }),
        }
    }
}

/// A check's evidence: any JSON value, kept as its serialised text, so
/// that a record made on the request path serialises the verifier's
/// evidence once, straight into the record's bytes, without building a
/// tree of it ([`Self::value`] builds one for a reader).
#[derive(Debug, Clone)]
pub struct CheckEvidence(Box<RawValue>);

impl CheckEvidence {
    /// The evidence `seen` serialises to (`null` for a value JSON cannot
    /// hold, such as a map with non-string keys).
    pub fn of(seen: &impl Serialize) -> Self {
        Self(serde_json::value::to_raw_value(seen).unwrap_or_else(|_| RawValue::NULL.to_owned()))
    }

    /// The evidence as a JSON tree.
    pub fn value(&self) -> Value {
        serde_json::from_str(self.0.get()).unwrap_or(Value::Null)
    }

    /// The evidence as JSON text.
    pub fn json(&self) -> &str {
        self.0.get()
    }
}

impl From<Value> for CheckEvidence {
    fn from(value: Value) -> Self {
        Self::of(&value)
    }
}

impl PartialEq for CheckEvidence {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

impl std::fmt::Display for CheckEvidence {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.0.get())
    }
}

impl Serialize for CheckEvidence {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for CheckEvidence {
    /// Through a tree: a record's body is read through its flattened entry,
    /// which hands its members over as buffered values, never as raw text.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(Self::from)
    }
}

/// Latencies of one request, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Time to the first byte of the answer, when one arrived.
    pub ttfb_ms: Option<u64>,
    /// Time from the request's arrival to the end of the answer.
    pub total_ms: u64,
    /// Time spent in the proxy itself (total minus waiting on the provider).
    pub overhead_ms: u64,
}

/// canarygate's own tokens in one exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenOverhead {
    /// Prompt tokens it added (the canaries and their instructions), by its
    /// estimate.
    pub prompt: u64,
    /// Completion tokens the provider generated that the client did not get:
    /// the echo and canaries removed, the tokens cut at the client's limit.
    pub completion: u64,
}

/// What is recorded about one request. Every string here must already be
/// safe to store: hashes for sessions and credentials, ids for canaries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The id the client saw in `x-canarygate-request-id`.
    pub request_id: String,
    /// When the request arrived, unix milliseconds.
    pub started_at_ms: u64,
    /// Keyed hash of the session (hex).
    pub session: String,
    /// HMAC of the client credential (hex, see `AuditLog::hash_credential`); `None` when absent.
    pub credential: Option<String>,
    /// Provider name from the policy (`local` for the local engine).
    pub provider: String,
    /// Model name the client asked for.
    pub model: String,
    /// The API endpoint the client called (`chat_completions`, `responses`,
    /// `messages`, `completions`, `embeddings`, or a passthrough path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Upstream or local.
    pub route: Route,
    /// Our own prompt-token count.
    pub prompt_tokens_ours: Option<u64>,
    /// The provider's `usage.prompt_tokens`, when it reported one.
    pub prompt_tokens_provider: Option<u64>,
    /// The provider's own id for the request (its `x-request-id` or
    /// `request-id` header), when it sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_request_id: Option<String>,
    /// canarygate's own tokens in the exchange, when it verified an answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_tokens: Option<TokenOverhead>,
    /// Ids of the canaries minted for this request (never their values).
    pub canary_ids: Vec<String>,
    /// The instance that served the request (`serve --instance`), when it
    /// named one: several instances' logs merge into one export.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The shared canary registry could not be asked for this request:
    /// its canaries were registered, or the answer's spans looked up, in
    /// this instance only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub registry_degraded: bool,
    /// The topic check's score, when it ran before this record was written
    /// (`[topic] action = "flag"` or `"block"`). With `action = "record"` the
    /// score follows in a [`TopicEntry`] of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<TopicScore>,
    /// Checks that ran, in order.
    pub checks: Vec<CheckRecord>,
    /// Overall verdict.
    pub verdict: VerdictSummary,
    /// What was done.
    pub action: Action,
    /// How the exchange ended.
    pub outcome: Outcome,
    /// Latencies.
    pub latency: Latency,
    /// Request body bytes received from the client.
    pub bytes_in: u64,
    /// Response body bytes sent to the client.
    pub bytes_out: u64,
    /// SHA-256 (hex) of the request body as received.
    pub request_sha256: String,
    /// SHA-256 (hex) of the response body as sent.
    pub response_sha256: String,
}

/// Full text kept for spot-check review. The caller redacts canaries first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// Request text (e.g. the messages), canaries redacted.
    pub request_text: String,
    /// Response text as the client received it, canaries redacted.
    pub response_text: String,
    /// What the provider sent, canaries redacted, when it differs from what
    /// the client received: kept for every failed verdict, so a blocked
    /// answer's text can still be reviewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_text: Option<String>,
}

/// How well an answer fits what was asked: the topic check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopicScore {
    /// Cosine similarity of the embeddings of the question and the answer
    /// (-1 to 1, four decimals); `None` when it could not be scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub similarity: Option<f32>,
    /// Why it was not scored (`no_text`, `busy`, `timeout`, an error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// The policy's threshold when it was scored.
    pub min_similarity: f32,
    /// The embedding model (its directory's name).
    pub model: String,
}

impl TopicScore {
    /// The answer scored below the threshold.
    pub fn low(&self) -> bool {
        self.similarity
            .is_some_and(|similarity| similarity < self.min_similarity)
    }
}

/// The topic score of a request scored after its record was written
/// (`[topic] action = "record"`: off the request's critical path).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopicEntry {
    /// The request record scored.
    pub scored_id: RecordId,
    /// Its `request_id` (the samples' associated data).
    pub request_id: String,
    /// The score.
    pub score: TopicScore,
    /// The sample kept because of the score, when the request record kept
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<SampleRef>,
}

/// One request to record: what happened, and optionally the sampled text.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRecord {
    /// The record fields.
    pub record: RequestRecord,
    /// Text kept for review; see [`should_sample`](crate::should_sample).
    pub sample: Option<Sample>,
}

/// Reference from a request record to its stored sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleRef {
    /// Whether the sample is encrypted at rest.
    pub encrypted: bool,
    /// SHA-256 (hex) of the stored sample bytes, so `verify` covers them.
    pub sha256: String,
}

/// A stored request record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestEntry {
    /// The fields the proxy supplied.
    #[serde(flatten)]
    pub record: RequestRecord,
    /// The stored sample, when this request was sampled.
    pub sample: Option<SampleRef>,
}

/// A reviewer's judgement of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReviewVerdict {
    /// The answer fits the session that asked.
    Ok,
    /// The answer does not fit: a leak or a wrong answer.
    Bad,
}

/// A spot-check review of a sampled record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReviewEntry {
    /// The reviewed request record.
    pub reviewed_id: RecordId,
    /// The reviewer's judgement.
    pub verdict: ReviewVerdict,
    /// Free-text note.
    pub note: Option<String>,
}

/// Left by `prune`: where the remaining chain starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    /// Records with a lower id than this were removed.
    pub first_kept_id: RecordId,
    /// Hash of the last removed record: the `prev_hash` of `first_kept_id`.
    pub first_kept_prev_hash: String,
    /// Number of records removed by this prune.
    pub pruned: u64,
    /// The `--before` bound of the prune, unix milliseconds.
    pub before_ms: u64,
}

/// What a record is about.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// One proxied request.
    Request(Box<RequestEntry>),
    /// A spot-check review.
    Review(ReviewEntry),
    /// A topic score that followed its request record.
    Topic(TopicEntry),
    /// A prune checkpoint.
    Checkpoint(CheckpointEntry),
}

impl Entry {
    /// The sample this record lists, if any.
    pub fn sample(&self) -> Option<&SampleRef> {
        match self {
            Self::Request(request) => request.sample.as_ref(),
            Self::Topic(topic) => topic.sample.as_ref(),
            Self::Review(_) | Self::Checkpoint(_) => None,
        }
    }
}

/// A record body as stored and hashed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Schema version (`SCHEMA_VERSION`).
    pub v: u32,
    /// Position in the chain.
    pub id: RecordId,
    /// Hash (hex) of the record before this one.
    pub prev_hash: String,
    /// When the record was written, unix milliseconds (writer's clock).
    pub recorded_at_ms: u64,
    /// The content.
    #[serde(flatten)]
    pub entry: Entry,
}

/// A [`Record`] that borrows its entry. Serialises to exactly the same
/// bytes; the store builds record bodies by hand and tests them against it.
#[cfg(test)]
#[derive(Debug, Serialize)]
pub(crate) struct RecordRef<'a> {
    pub v: u32,
    pub id: RecordId,
    pub prev_hash: String,
    pub recorded_at_ms: u64,
    #[serde(flatten)]
    pub entry: &'a Entry,
}

/// A record as read from the store: the hash kept next to it and the body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    /// The id it is stored under.
    pub key: RecordId,
    /// The stored hash.
    pub hash: [u8; 32],
    /// The stored body (JSON).
    pub body: Vec<u8>,
}

impl RawRecord {
    /// Splits a stored value (`hash || body`).
    pub(crate) fn from_stored(key: RecordId, value: &[u8]) -> Result<Self, AuditError> {
        if value.len() < 32 {
            return Err(AuditError::Corrupt(format!(
                "record {key}: stored value is {} bytes, shorter than its hash",
                value.len()
            )));
        }
        let mut hash = [0; 32];
        hash.copy_from_slice(&value[..32]);
        Ok(Self {
            key,
            hash,
            body: value[32..].to_vec(),
        })
    }

    /// Parses the body.
    pub fn parse(&self) -> Result<Record, AuditError> {
        serde_json::from_slice(&self.body).map_err(|error| {
            AuditError::Corrupt(format!(
                "record {}: body is not a valid record: {error}",
                self.key
            ))
        })
    }

    /// The body with the hash as first member: one export line (no newline).
    pub fn export_line(&self) -> Result<String, AuditError> {
        let body = std::str::from_utf8(&self.body)
            .map_err(|_| AuditError::Corrupt(format!("record {}: body is not UTF-8", self.key)))?;
        let rest = body.strip_prefix('{').ok_or_else(|| {
            AuditError::Corrupt(format!("record {}: body is not a JSON object", self.key))
        })?;
        Ok(format!("{{\"hash\":\"{}\",{rest}", hex::encode(self.hash)))
    }
}

/// The stored value of a record body (`hash || body`) and the hash.
pub(crate) fn seal_body(body: Vec<u8>) -> (Vec<u8>, [u8; 32]) {
    let hash = chain_hash(&body);
    let mut value = Vec::with_capacity(32 + body.len());
    value.extend_from_slice(&hash);
    value.extend_from_slice(&body);
    (value, hash)
}

/// The chain hash of a record body.
pub fn chain_hash(body: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(HASH_DOMAIN);
    hasher.update(body);
    hasher.finalize().into()
}

/// Lowercase hex SHA-256 of `bytes` (request and response bodies).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Parses a 64-character hex hash.
pub(crate) fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let mut out = [0; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

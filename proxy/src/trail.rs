//! The audit trail of one chat request: facts gathered as the request goes,
//! appended as one durable record ([`crate::audit`]) before the client gets
//! the last byte of its answer.

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;

use canarygate_policies::canary::find_canaries;
use canarygate_policies::verify::{Status, Verdict};
use sha2::{Digest, Sha256};

use crate::audit::{
    self, Action, AuditError, AuditLog, CheckRecord, CheckResult, Latency, NewRecord, Outcome,
    RequestRecord, Route, Sample,
};
use crate::clock::RequestClock;
use crate::metrics::Metrics;

/// Most response bytes kept for a spot-check sample.
const MAX_SAMPLE_BYTES: usize = 256 * 1024;

/// Placeholder for a canary in sampled text.
const REDACTED: &str = "[canary]";

/// What is known so far about one request.
pub(crate) struct Trail {
    log: AuditLog,
    /// The request's clock (overhead metric, in-flight gauge).
    pub(crate) clock: RequestClock,
    /// The request was sent to the provider (whatever came back).
    pub(crate) forwarded: bool,
    /// How the exchange ended, when the path knows better than the status.
    pub(crate) outcome: Option<Outcome>,
    /// Who answered: the provider or the local engine.
    pub(crate) route: Route,
    /// Checks decided outside the verifier (the context preflight).
    pub(crate) extra_checks: Vec<CheckRecord>,
    started: Instant,
    started_at_ms: u64,
    request_id: String,
    pub(crate) session: Option<String>,
    pub(crate) credential: Option<String>,
    pub(crate) provider: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) prompt_tokens_ours: Option<u64>,
    pub(crate) prompt_tokens_provider: Option<u64>,
    pub(crate) canary_ids: Vec<String>,
    verdict: Option<Verdict>,
    pub(crate) ttfb_ms: Option<u64>,
    request_bytes: Vec<u8>,
    response_hash: Sha256,
    response_len: u64,
    response_kept: Vec<u8>,
}

impl Trail {
    /// Starts the trail of request `request_id`, arriving now.
    pub(crate) fn start(log: AuditLog, request_id: &str, metrics: Arc<Metrics>) -> Self {
        Self {
            log,
            clock: RequestClock::start(metrics),
            forwarded: false,
            outcome: None,
            route: Route::Upstream,
            extra_checks: Vec::new(),
            started: Instant::now(),
            started_at_ms: crate::verified::now_ms(),
            request_id: request_id.to_owned(),
            session: None,
            credential: None,
            provider: None,
            model: None,
            prompt_tokens_ours: None,
            prompt_tokens_provider: None,
            canary_ids: Vec::new(),
            verdict: None,
            ttfb_ms: None,
            request_bytes: Vec::new(),
            response_hash: Sha256::new(),
            response_len: 0,
            response_kept: Vec::new(),
        }
    }

    /// Records the request body as received.
    pub(crate) fn request_body(&mut self, bytes: &[u8]) {
        self.request_bytes = bytes.to_vec();
    }

    /// Records the verdict of the attempt whose answer the client gets.
    pub(crate) fn verdict(&mut self, verdict: &Verdict) {
        self.verdict = Some(verdict.clone());
    }

    /// Records bytes sent to the client.
    pub(crate) fn sent(&mut self, bytes: &[u8]) {
        self.response_hash.update(bytes);
        self.response_len += bytes.len() as u64;
        let room = MAX_SAMPLE_BYTES.saturating_sub(self.response_kept.len());
        self.response_kept
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// Outcome and action of a request answered with one whole response of `status`.
    pub(crate) fn conclude(&self, status: StatusCode) -> (Outcome, Action) {
        let outcome = self.outcome.unwrap_or(if status.is_success() {
            Outcome::Complete
        } else {
            Outcome::Error
        });
        let failed = self
            .verdict
            .as_ref()
            .is_some_and(|verdict| !verdict.passed());
        let action = match (failed, status.is_success()) {
            _ if self.route == Route::Local => Action::Fallback,
            (true, true) => Action::Flag,
            (true, false) => Action::Block,
            (false, true) => Action::Forward,
            (false, false) if self.forwarded => Action::Forward,
            (false, false) => Action::Reject,
        };
        (outcome, action)
    }

    /// Appends the record; durable when this returns `Ok` (queued, with
    /// `[audit] durability = "background"`).
    pub(crate) async fn commit(self, outcome: Outcome, action: Action) -> Result<(), AuditError> {
        let overhead_ms = self.clock.overhead().as_millis() as u64;
        let failed = self
            .verdict
            .as_ref()
            .is_some_and(|verdict| !verdict.passed());
        let verdict = match &self.verdict {
            None => audit::Verdict::Unchecked,
            Some(verdict) if verdict.passed() => audit::Verdict::Pass,
            Some(_) => audit::Verdict::Fail,
        };
        let mut checks: Vec<CheckRecord> = self
            .verdict
            .as_ref()
            .map(|verdict| {
                verdict
                    .checks
                    .iter()
                    .map(|check| CheckRecord {
                        name: check.check.name().to_owned(),
                        result: match check.status {
                            Status::Pass => CheckResult::Pass,
                            Status::Fail => CheckResult::Fail,
                            Status::Skip => CheckResult::Skip,
                        },
                        evidence: serde_json::json!({
                            "reason": check.reason,
                            "seen": check.evidence,
                        }),
                    })
                    .collect()
            })
            .unwrap_or_default();
        checks.extend(self.extra_checks);
        let sample = audit::should_sample(self.log.sample_rate(), failed).then(|| Sample {
            request_text: redact(&String::from_utf8_lossy(&self.request_bytes)),
            response_text: redact(&String::from_utf8_lossy(&self.response_kept)),
        });
        let record = RequestRecord {
            request_id: self.request_id,
            started_at_ms: self.started_at_ms,
            session: self.session.unwrap_or_else(|| "-".to_owned()),
            credential: self.credential,
            provider: self.provider.unwrap_or_else(|| "-".to_owned()),
            model: self.model.unwrap_or_default(),
            route: self.route,
            prompt_tokens_ours: self.prompt_tokens_ours,
            prompt_tokens_provider: self.prompt_tokens_provider,
            canary_ids: self.canary_ids,
            checks,
            verdict,
            action,
            outcome,
            latency: Latency {
                ttfb_ms: self.ttfb_ms,
                total_ms: self.started.elapsed().as_millis() as u64,
                overhead_ms,
            },
            bytes_in: self.request_bytes.len() as u64,
            bytes_out: self.response_len,
            request_sha256: audit::sha256_hex(&self.request_bytes),
            response_sha256: hex::encode(self.response_hash.finalize()),
        };
        self.log.record(NewRecord { record, sample }).await
    }
}

/// Holds a request's [`Trail`] while the handler works on it. When the
/// handler is dropped before the trail is handed on (the client went away
/// while the provider was still thinking, so hyper cancelled the handler),
/// the request is still recorded, as interrupted by the client.
pub(crate) struct PendingTrail(Option<Trail>);

impl PendingTrail {
    /// Guards `trail`.
    pub(crate) fn new(trail: Trail) -> Self {
        Self(Some(trail))
    }

    /// The guarded trail.
    pub(crate) fn get(&mut self) -> &mut Trail {
        self.0.as_mut().expect("the trail is guarded until taken")
    }

    /// Hands the trail on; whoever takes it records the request.
    pub(crate) fn take(mut self) -> Trail {
        self.0.take().expect("the trail is guarded until taken")
    }
}

impl Drop for PendingTrail {
    fn drop(&mut self) {
        let Some(trail) = self.0.take() else {
            return;
        };
        let failed = trail
            .verdict
            .as_ref()
            .is_some_and(|verdict| !verdict.passed());
        // Nothing reached the client; a failed answer would not have either.
        let action = if failed {
            Action::Block
        } else {
            Action::Forward
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = trail.commit(Outcome::InterruptedByClient, action).await {
                    tracing::error!("audit append of an abandoned request failed: {error}");
                }
            });
        }
    }
}

/// `text` with every canary-shaped span replaced by [`REDACTED`].
fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    for found in find_canaries(text) {
        if found.start < copied {
            continue; // overlaps a span already redacted
        }
        out.push_str(&text[copied..found.start]);
        out.push_str(REDACTED);
        copied = found.end;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_removes_canaries_and_keeps_the_rest() {
        let text = "before CG482937105662831 mid cg 482 937 105 662 831 after";
        assert_eq!(redact(text), "before [canary] mid [canary] after");
        assert_eq!(redact("no canary here"), "no canary here");
    }
}

//! The audit trail of one request: facts gathered as the request goes,
//! concluded in one place ([`Trail::conclude`]) and appended as one durable
//! record ([`canarygate_audit`]) before the client gets the last byte of
//! its answer.

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use canarygate_audit::{
    Action, AuditError, AuditLog, CheckRecord, Latency, NewRecord, Outcome, RequestRecord, Route,
    TokenOverhead, TopicScore, VerdictSummary, sha256_hex, should_sample,
};
use canarygate_policies::topic::{TopicAction, sample_chance};
use canarygate_policies::verify::Verdict;
use sha2::{Digest, Sha256};

mod sample;

use sample::{KeptBytes, SampleTexts, ScoreLater};

use crate::clock::{RequestClock, now_ms};
use crate::identity::{Caller, CallerSecret};
use crate::metrics::Metrics;
use crate::topic::TopicCheck;

/// How the exchange with the client ended, as the path that served it saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// One whole response with this status went out.
    Whole(StatusCode),
    /// A stream ended: `blocked` when it ended with canarygate's own
    /// verification error instead of the answer's end.
    Stream {
        /// The answer failed after part of it went out and was cut off.
        blocked: bool,
    },
    /// The client went away before the end.
    ClientLeft,
}

/// What is known so far about one request.
pub struct Trail {
    log: AuditLog,
    clock: RequestClock,
    /// The request was sent to the provider (whatever came back).
    forwarded: bool,
    /// The provider broke off, stalled or closed early.
    upstream_interrupted: bool,
    /// Who answered: the provider or the local engine.
    route: Route,
    /// Checks decided outside the verifier (the context preflight).
    extra_checks: Vec<CheckRecord>,
    started: Instant,
    started_at_ms: u64,
    request_id: String,
    session: Option<String>,
    credential: Option<String>,
    /// The caller's credential itself, to take out of a sample's texts.
    secret: Option<CallerSecret>,
    provider: Option<String>,
    model: Option<String>,
    endpoint: Option<String>,
    unverifiable: bool,
    prompt_tokens_ours: Option<u64>,
    prompt_tokens_provider: Option<u64>,
    provider_request_id: Option<String>,
    overhead_tokens: Option<TokenOverhead>,
    canary_ids: Vec<String>,
    registry_degraded: bool,
    verdict: Option<Verdict>,
    ttfb_ms: Option<u64>,
    request_bytes: Vec<u8>,
    response_hash: Sha256,
    response_len: u64,
    response_kept: KeptBytes,
    /// The texts the provider sent in the attempt whose verdict is
    /// recorded, labelled by part.
    provider_text: Option<String>,
    /// The topic check, when it runs for this request.
    topic: Option<Arc<TopicCheck>>,
    /// What the client asked, for the topic check.
    question: Option<String>,
    /// What the answer said, for the topic check.
    answer: Option<String>,
    /// The topic score taken before the answer was delivered.
    topic_score: Option<TopicScore>,
}

impl Trail {
    /// Starts the trail of request `request_id`, arriving now.
    pub fn start(log: AuditLog, request_id: &str, metrics: Arc<Metrics>) -> Self {
        Self {
            log,
            clock: RequestClock::start(metrics),
            forwarded: false,
            upstream_interrupted: false,
            route: Route::Upstream,
            extra_checks: Vec::new(),
            started: Instant::now(),
            started_at_ms: now_ms(),
            request_id: request_id.to_owned(),
            session: None,
            credential: None,
            secret: None,
            provider: None,
            model: None,
            endpoint: None,
            unverifiable: false,
            prompt_tokens_ours: None,
            prompt_tokens_provider: None,
            provider_request_id: None,
            overhead_tokens: None,
            canary_ids: Vec::new(),
            registry_degraded: false,
            verdict: None,
            ttfb_ms: None,
            request_bytes: Vec::new(),
            response_hash: Sha256::new(),
            response_len: 0,
            response_kept: KeptBytes::default(),
            provider_text: None,
            topic: None,
            question: None,
            answer: None,
            topic_score: None,
        }
    }

    /// The request's clock (the proxy's own time).
    pub fn clock(&mut self) -> &mut RequestClock {
        &mut self.clock
    }

    /// Records who sent the request (keyed hashes only; the credential is
    /// held to be taken out of a sample's texts).
    pub fn caller(&mut self, caller: &Caller) {
        self.session = Some(caller.session_id.clone());
        self.credential = Some(caller.credential_hash.clone());
        self.secret = Some(caller.secret());
    }

    /// Records the request body as received.
    pub fn request_body(&mut self, bytes: &[u8]) {
        self.request_bytes = bytes.to_vec();
    }

    /// Records the endpoint the client called.
    pub fn surface(&mut self, endpoint: &str) {
        self.endpoint = Some(endpoint.to_owned());
    }

    /// Records that the endpoint's answer has nothing to verify.
    pub fn unverifiable(&mut self) {
        self.unverifiable = true;
    }

    /// Records the model the client asked for.
    pub fn model(&mut self, model: &str) {
        self.model = Some(model.to_owned());
    }

    /// Records the provider the route leads to.
    pub fn provider(&mut self, provider: &str) {
        self.provider = Some(provider.to_owned());
    }

    /// Records that the request went to the provider.
    pub fn forwarded(&mut self) {
        self.forwarded = true;
    }

    /// Records the time to the provider's response head.
    pub fn first_byte(&mut self, ttfb_ms: u64) {
        self.ttfb_ms = Some(ttfb_ms);
    }

    /// Records that the provider broke off, stalled or closed early.
    pub fn upstream_interrupted(&mut self) {
        self.upstream_interrupted = true;
    }

    /// Records that the local engine answers.
    pub fn served_locally(&mut self) {
        self.route = Route::Local;
    }

    /// Records our count of the prompt's tokens.
    pub fn prompt_tokens_ours(&mut self, tokens: u64) {
        self.prompt_tokens_ours = Some(tokens);
    }

    /// Records the prompt tokens the answering side reports.
    pub fn prompt_tokens_provider(&mut self, tokens: Option<u64>) {
        self.prompt_tokens_provider = tokens;
    }

    /// Records the provider's own id for the request.
    pub fn provider_request_id(&mut self, id: Option<String>) {
        self.provider_request_id = id;
    }

    /// Records canarygate's own tokens in the answer (and counts them in
    /// the metrics, once per request).
    pub fn overhead_tokens(&mut self, prompt: u64, completion: u64) {
        if self.overhead_tokens.is_none() {
            self.clock
                .metrics()
                .count_overhead_tokens(prompt, completion);
        }
        self.overhead_tokens = Some(TokenOverhead { prompt, completion });
    }

    /// Records the id (never the value) of a canary of this request.
    pub fn canary(&mut self, id: String) {
        self.canary_ids.push(id);
    }

    /// Records that the shared canary registry could not be asked for this
    /// request (served with local-only detection).
    pub fn registry_degraded(&mut self) {
        self.registry_degraded = true;
    }

    /// Records a check decided outside the verifier.
    pub fn check(&mut self, check: CheckRecord) {
        self.extra_checks.push(check);
    }

    /// Records the verdict of the attempt whose answer the client gets.
    pub fn verdict(&mut self, verdict: &Verdict) {
        self.verdict = Some(verdict.clone());
    }

    /// Sets the topic check for this request, and what the client asked.
    pub fn topic(&mut self, check: Arc<TopicCheck>, question: Option<String>) {
        self.topic = Some(check);
        self.question = question;
    }

    /// Whether the answer's topic is scored after its record (`[topic]
    /// action = "record"`), so its text must be kept.
    pub fn scores_later(&self) -> bool {
        self.topic
            .as_ref()
            .is_some_and(|check| check.action() == TopicAction::Record)
    }

    /// What the client asked, when the topic check runs.
    pub fn question(&self) -> Option<&str> {
        self.question.as_deref()
    }

    /// Starts recording a new upstream attempt's answer (a retry's
    /// replaces the first one's).
    pub fn new_attempt(&mut self) {
        self.answer = None;
        self.provider_text = None;
    }

    /// Records what the answer says so far: its text for the topic check,
    /// and every text the provider sent, kept when the verdict fails.
    pub fn provider_answer(&mut self, answer: Option<String>, sent: Option<String>) {
        self.answer = answer;
        self.provider_text = sent;
    }

    /// Records the topic score taken before the answer was delivered.
    pub fn topic_score(&mut self, score: TopicScore) {
        self.topic_score = Some(score);
    }

    /// Records bytes sent to the client.
    pub fn sent(&mut self, bytes: &[u8]) {
        self.response_hash.update(bytes);
        self.response_len += bytes.len() as u64;
        self.response_kept.push(bytes);
    }

    fn failed(&self) -> bool {
        self.verdict
            .as_ref()
            .is_some_and(|verdict| !verdict.passed())
    }

    /// The record's outcome and action: how the exchange ended, and what was
    /// done with the answer. The one place these are decided.
    ///
    /// | | outcome | action |
    /// |---|---|---|
    /// | local engine answered | as below | `fallback` |
    /// | client left | `interrupted_by_client` | `block` if the verdict failed, else `forward` |
    /// | provider broke off | `interrupted_by_upstream` | as below |
    /// | stream cut by a failed verdict | `complete` | `block` |
    /// | stream ended | `complete` | `flag` if the verdict failed (and the provider did not break off), else `forward` |
    /// | whole response | `complete` (2xx) or `error` | failed: `flag` (2xx) / `block`; passed or unchecked: `forward` (2xx, or anything the provider answered) / `reject` |
    pub fn conclude(&self, ending: Ending) -> (Outcome, Action) {
        let failed = self.failed();
        let outcome = match ending {
            Ending::ClientLeft => Outcome::InterruptedByClient,
            _ if self.upstream_interrupted => Outcome::InterruptedByUpstream,
            Ending::Whole(status) if !status.is_success() => Outcome::Error,
            Ending::Whole(_) | Ending::Stream { .. } => Outcome::Complete,
        };
        let action = match ending {
            _ if self.route == Route::Local => Action::Fallback,
            Ending::ClientLeft if failed => Action::Block,
            Ending::ClientLeft => Action::Forward,
            Ending::Stream { blocked: true } => Action::Block,
            Ending::Stream { blocked: false } if failed && !self.upstream_interrupted => {
                Action::Flag
            }
            Ending::Stream { blocked: false } => Action::Forward,
            Ending::Whole(status) => match (failed, status.is_success()) {
                (true, true) => Action::Flag,
                (true, false) => Action::Block,
                (false, true) => Action::Forward,
                (false, false) if self.forwarded => Action::Forward,
                (false, false) => Action::Reject,
            },
        };
        (outcome, action)
    }

    /// Concludes and appends the record; durable when this returns `Ok`
    /// (queued, with `[audit] durability = "background"`). With `[topic]
    /// action = "record"`, the answer's topic score follows in a record of
    /// its own, from a task that does not hold up the client.
    pub async fn commit(mut self, ending: Ending) -> Result<(), AuditError> {
        let (outcome, action) = self.conclude(ending);
        let overhead_ms = self.clock.overhead().as_millis() as u64;
        let failed = self.failed();
        let mut checks: Vec<CheckRecord> = self
            .verdict
            .iter()
            .flat_map(|verdict| verdict.checks.iter().map(CheckRecord::from))
            .collect();
        checks.extend(std::mem::take(&mut self.extra_checks));
        let rate = self.log.sample_rate();
        let min_similarity = self
            .topic
            .as_ref()
            .map_or(0.0, |check| check.min_similarity());
        let similarity = self.topic_score.as_ref().and_then(|score| score.similarity);
        let sampled = should_sample(sample_chance(rate, failed, similarity, min_similarity));
        let texts = SampleTexts {
            request: std::mem::take(&mut self.request_bytes),
            response: std::mem::take(&mut self.response_kept),
            provider: self.provider_text.take().filter(|_| failed),
            secret: self.secret.take(),
        };
        let scored_later = self
            .topic
            .clone()
            .filter(|check| check.action() == TopicAction::Record && self.verdict.is_some());
        let record = RequestRecord {
            request_id: self.request_id,
            started_at_ms: self.started_at_ms,
            session: self.session.unwrap_or_else(|| "-".to_owned()),
            credential: self.credential,
            provider: self.provider.unwrap_or_else(|| "-".to_owned()),
            model: self.model.unwrap_or_default(),
            endpoint: self.endpoint,
            route: self.route,
            prompt_tokens_ours: self.prompt_tokens_ours,
            prompt_tokens_provider: self.prompt_tokens_provider,
            provider_request_id: self.provider_request_id,
            overhead_tokens: self.overhead_tokens,
            canary_ids: self.canary_ids,
            instance: self.log.instance().map(str::to_owned),
            registry_degraded: self.registry_degraded
                || self
                    .verdict
                    .as_ref()
                    .is_some_and(|verdict| verdict.registry_degraded),
            topic: self.topic_score,
            checks,
            verdict: match self.verdict.as_ref() {
                None if self.unverifiable => VerdictSummary::Unverifiable,
                verdict => VerdictSummary::of(verdict),
            },
            action,
            outcome,
            latency: Latency {
                ttfb_ms: self.ttfb_ms,
                total_ms: self.started.elapsed().as_millis() as u64,
                overhead_ms,
            },
            bytes_in: texts.request.len() as u64,
            bytes_out: self.response_len,
            request_sha256: sha256_hex(&texts.request),
            response_sha256: hex::encode(self.response_hash.finalize()),
        };
        let request_id = record.request_id.clone();
        let sample = sampled.then(|| texts.sample());
        let handed = Instant::now();
        let recorded = self.log.record(NewRecord { record, sample }).await;
        self.clock
            .metrics()
            .observe_audit_record_wait(handed.elapsed().as_secs_f64());
        let recorded = recorded?;
        if let Some(check) = scored_later {
            // The texts wait with the score only when no sample was kept and
            // the waiting answers' bytes allow.
            let texts = (!sampled)
                .then(|| check.hold(texts.len()).map(|held| (texts, held)))
                .flatten();
            let later = ScoreLater {
                log: self.log,
                check,
                request_id,
                question: self.question,
                answer: self.answer,
                texts,
                rate,
            };
            tokio::spawn(later.run(recorded));
        }
        Ok(())
    }

    /// Appends the record from a task of its own, for a request whose
    /// handler or body is going away; failures are logged.
    pub fn commit_later(self, ending: Ending) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Err(error) = self.commit(ending).await {
                tracing::error!("audit append of an interrupted request failed: {error}");
            }
        });
    }
}

/// Holds a request's [`Trail`] while the handler works on it. When the
/// handler is dropped before the trail is handed on (the client went away
/// while the provider was still thinking, so hyper cancelled the handler),
/// the request is still recorded, as interrupted by the client.
pub struct PendingTrail(Option<Trail>);

impl PendingTrail {
    /// Guards `trail`.
    pub fn new(trail: Trail) -> Self {
        Self(Some(trail))
    }

    /// The guarded trail.
    pub fn get(&mut self) -> &mut Trail {
        self.0.as_mut().expect("the trail is guarded until taken")
    }

    /// Hands the trail on; whoever takes it records the request.
    pub fn take(mut self) -> Trail {
        self.0.take().expect("the trail is guarded until taken")
    }
}

impl Drop for PendingTrail {
    fn drop(&mut self) {
        if let Some(trail) = self.0.take() {
            trail.commit_later(Ending::ClientLeft);
        }
    }
}

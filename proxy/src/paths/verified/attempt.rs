//! What the whole-answer and the stream halves of the verified path share:
//! one attempt's state, its decision, and the block response.

use std::time::Instant;

use axum::response::Response;
use canarygate_policies::inject::{Injection, MAX_CHOICES};
use canarygate_policies::verify::{Verdict, Verifier};

use crate::body::Served;
use crate::context::RequestContext;
use crate::error::ApiError;
use crate::wire::WireFormat;
use crate::wire::edit::Delivery;

/// What became of one upstream attempt.
pub enum Decided {
    /// Answer the client with this.
    Served(Served),
    /// Discard the answer and try upstream again.
    Retry,
    /// Discard the answer and serve from the local engine.
    Fallback,
}

/// One upstream attempt's verification state.
pub struct Attempt {
    /// What the canaries' placement asks of the answer.
    pub injection: Injection,
    /// The verifier of this attempt's answer.
    pub verifier: Verifier,
    /// When the request was sent.
    pub sent_at: Instant,
    /// Attempts before this one.
    pub attempt: u32,
    /// How the verified answer reaches the client.
    pub delivery: Delivery,
}

pub fn elapsed_ms(since: Instant) -> u64 {
    since.elapsed().as_millis().try_into().unwrap_or(u64::MAX)
}

/// HTTP 502 naming the failed checks of `verdict`.
pub fn blocked<W: WireFormat>(context: &RequestContext<'_, W>, verdict: &Verdict) -> Response {
    tracing::warn!(
        request_id = %context.request_id,
        provider = %context.upstream.name,
        verdict = %verdict.header_value(),
        "answer blocked"
    );
    context.error_response(
        &ApiError::verification_failed(verdict),
        Some(&verdict.header_value()),
    )
}

/// Records `reason` as the finish reason of choice `index`, and that the
/// answer has at least `index + 1` choices.
pub fn set_reason(reasons: &mut Vec<Option<String>>, index: u32, reason: Option<&str>) {
    if u64::from(index) >= MAX_CHOICES {
        // No request asks for that many choices (its text fails the
        // verifier); never size a list by an index the provider sent.
        return;
    }
    let index = index as usize;
    if reasons.len() <= index {
        reasons.resize(index + 1, None);
    }
    if let Some(reason) = reason {
        reasons[index] = Some(reason.to_owned());
    }
}

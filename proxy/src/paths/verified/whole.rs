//! A non-streamed answer: read whole, verify, and deliver the provider's
//! own answer edited (the wire format's [`WireFormat::deliver_answer`]).

use axum::body::Body;
use axum::http::HeaderValue;
use canarygate_policies::verify::{Decision, Facts};
use serde_json::Value;

use super::attempt::{Attempt, Decided, blocked, elapsed_ms};
use crate::body::Served;
use crate::context::{OVERHEAD_HEADER, RequestContext};
use crate::error::{ApiError, ErrorCode};
use crate::trail::Trail;
use crate::upstream_client::UpstreamResponse;
use crate::wire::WireFormat;

/// Verifies the whole answer in `response` and decides.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    response: UpstreamResponse,
    mut attempt: Attempt,
    trail: &mut Trail,
) -> Result<Decided, ApiError> {
    let book = &context.state.registry;
    let stop = attempt.verifier.observe_ttft(elapsed_ms(attempt.sent_at));
    let status = response.status();
    let bytes = context
        .upstream
        .read_whole(trail.clock(), response, context.idle_timeout())
        .await?;
    let mut answer: Value = serde_json::from_slice(&bytes).map_err(|error| {
        ApiError::new(
            ErrorCode::UpstreamInvalidJson,
            format!(
                "Provider `{}` answered with invalid JSON: {error}",
                context.upstream.name
            ),
        )
    })?;
    let view = W::read_answer(&answer);
    let mut finish_reasons = Vec::new();
    // Each field's span of its part, in the order of the view's fields. A
    // stop here (ttft) withholds the answer, so nothing is read.
    let spans = if stop {
        Default::default()
    } else {
        let (spans, _) = attempt
            .feed(book, &view.choices, &answer, &mut finish_reasons, |_| false)
            .await;
        spans
    };
    let mut finished = attempt.verifier.finish(
        &Facts {
            finish_reasons,
            usage: view.usage,
            done_marker: None,
        },
        &book.lookup(&attempt.fetched),
    );
    if let Some(score) = attempt.judge_topic(&mut finished.verdict).await {
        trail.topic_score(score);
    }
    let verdict = &finished.verdict;
    trail.verdict(verdict);
    trail.prompt_tokens_provider(view.usage.map(|usage| usage.prompt_tokens));
    attempt.record_answer(trail, Some(verdict), stop);
    let action = context.state.policy.verify.action();
    Ok(match attempt.decide(verdict, action, false) {
        Decision::Retry => Decided::Retry,
        Decision::Fallback => Decided::Fallback,
        Decision::Block => Decided::Served(Served::Whole(blocked(context, verdict))),
        Decision::Deliver | Decision::Flag => {
            let delivery = &mut attempt.delivery;
            W::deliver_answer(&mut answer, &view, &spans, &attempt.verifier, delivery);
            trail.overhead_tokens(delivery.overhead_prompt(), delivery.overhead_completion());
            // Written straight into bytes (a `Value`'s `to_string` goes
            // through the formatter a few bytes at a time), sized by the
            // provider's answer: the edits mostly shorten it.
            let mut body = Vec::with_capacity(bytes.len());
            serde_json::to_writer(&mut body, &answer).map_err(|error| {
                ApiError::internal(format!("encoding the answer failed: {error}"))
            })?;
            let mut response =
                context.json_response(status, Body::from(body), Some(&verdict.header_value()));
            if let Ok(value) = HeaderValue::from_str(&delivery.overhead_header()) {
                response.headers_mut().insert(OVERHEAD_HEADER, value);
            }
            Decided::Served(Served::Whole(response))
        }
    })
}

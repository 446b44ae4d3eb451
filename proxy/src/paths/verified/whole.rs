//! A non-streamed answer: read whole, verify, and deliver the provider's
//! own answer edited: in place when the wire format reads its shape so
//! ([`WireFormat::read_answer_light`], [`LightAnswer::deliver`]), else in
//! its tree ([`WireFormat::deliver_answer`]).

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
use crate::wire::{AnswerView, LightAnswer, WireFormat, drop_read_only};

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
        .read_whole(trail.clock(), response, context.body_deadlines())
        .await?;
    // Read in place when the format knows the answer's shape and nothing
    // but its texts and finish reasons may change; else from its tree.
    let light = std::str::from_utf8(&bytes)
        .ok()
        .filter(|_| !attempt.delivery.rewrites_usage())
        .and_then(|answer| Some((answer, W::read_answer_light(answer)?)));
    let mut read = match light {
        Some((answer, light)) => Read::Light { answer, light },
        None => {
            let answer: Value = serde_json::from_slice(&bytes).map_err(|error| {
                ApiError::new(
                    ErrorCode::UpstreamInvalidJson,
                    format!(
                        "Provider `{}` answered with invalid JSON: {error}",
                        context.upstream.name
                    ),
                )
            })?;
            let view = W::read_answer(&answer);
            Read::Tree { answer, view }
        }
    };
    // An error the provider answered with a 2xx (some gateways do) is its
    // error, with the status its type stands for, as if it had said so: not
    // an answer that fails the checks. Only an answer without a text is
    // parsed again to tell: an answer's reading stays one pass.
    let textless = read
        .view()
        .choices
        .iter()
        .all(|choice| choice.texts.is_empty());
    if textless
        && W::is_error_body(&bytes)
        && let Some(error_status) = std::str::from_utf8(&bytes)
            .ok()
            .and_then(W::error_event_status)
    {
        tracing::warn!(
            request_id = %context.request_id,
            provider = %context.upstream.name,
            "the provider answered {status} with an error body: passed on as {error_status}"
        );
        return Ok(Decided::Served(Served::Whole(
            context.provider_error_response(error_status, bytes.clone()),
        )));
    }
    let mut finish_reasons = Vec::new();
    // Each field's span of its part, in the order of the view's fields. A
    // stop here (ttft) withholds the answer, so nothing is read.
    let mut spans = if stop {
        Default::default()
    } else {
        let (spans, _) = match &read {
            Read::Light { answer, light } => {
                let texts = light.texts(answer);
                attempt
                    .feed(
                        book,
                        &light.view.choices,
                        &texts,
                        &mut finish_reasons,
                        |_| false,
                    )
                    .await
            }
            Read::Tree { answer, view } => {
                attempt
                    .feed(book, &view.choices, answer, &mut finish_reasons, |_| false)
                    .await
            }
        };
        spans
    };
    let usage = read.view().usage;
    let mut finished = attempt.verifier.finish(
        &Facts {
            finish_reasons,
            usage,
            done_marker: None,
        },
        &book.lookup(&attempt.fetched),
    );
    if let Some(score) = attempt.judge_topic(&mut finished.verdict).await {
        trail.topic_score(score);
    }
    let verdict = &finished.verdict;
    trail.verdict(verdict);
    trail.prompt_tokens_provider(usage.map(|usage| usage.prompt_tokens));
    attempt.record_answer(trail, Some(verdict), stop);
    let action = context.state.policy.verify.action();
    Ok(match attempt.decide(verdict, action, false) {
        Decision::Retry => Decided::Retry,
        Decision::Fallback => Decided::Fallback,
        Decision::Block => Decided::Served(Served::Whole(blocked(context, verdict))),
        Decision::Deliver | Decision::Flag => {
            let echo_tokens = attempt.echo_tokens_counted(verdict);
            let delivery = &mut attempt.delivery;
            delivery.fits_the_limit(usage.and_then(|usage| usage.completion_tokens), echo_tokens);
            let verifier = &attempt.verifier;
            let body = match &mut read {
                Read::Light { answer, light } => light.deliver(answer, &spans, verifier, delivery),
                Read::Tree { answer, view } => {
                    drop_read_only(&mut view.choices, &mut spans);
                    W::deliver_answer(answer, view, &spans, verifier, delivery);
                    // Written straight into bytes (a `Value`'s `to_string`
                    // goes through the formatter a few bytes at a time),
                    // sized by the provider's answer: the edits mostly
                    // shorten it.
                    let mut body = Vec::with_capacity(bytes.len());
                    serde_json::to_writer(&mut body, &*answer).map_err(|error| {
                        ApiError::internal(format!("encoding the answer failed: {error}"))
                    })?;
                    body
                }
            };
            trail.overhead_tokens(delivery.overhead_prompt(), delivery.overhead_completion());
            let mut response =
                context.json_response(status, Body::from(body), Some(&verdict.header_value()));
            if let Ok(value) = HeaderValue::from_str(&delivery.overhead_header()) {
                response.headers_mut().insert(OVERHEAD_HEADER, value);
            }
            Decided::Served(Served::Whole(response))
        }
    })
}

/// A provider's whole answer, as it was read.
enum Read<'a> {
    /// In place, from its bytes ([`WireFormat::read_answer_light`]).
    Light { answer: &'a str, light: LightAnswer },
    /// As its tree.
    Tree { answer: Value, view: AnswerView },
}

impl Read<'_> {
    /// What the verifier reads of it.
    fn view(&self) -> &AnswerView {
        match self {
            Read::Light { light, .. } => &light.view,
            Read::Tree { view, .. } => view,
        }
    }
}

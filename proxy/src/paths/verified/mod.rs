//! The verified path: canaries in, verdict out, for any wire format.
//!
//! Per upstream attempt: mint two canaries, live at once and unique
//! ([`crate::registry`]), place them in the request where the format puts
//! them ([`WireFormat::place_canaries`]), register them, send, feed every piece of the answer to a
//! [`Verifier`], and act on its verdict: deliver, flag, retry once, block,
//! or hand the request back for the local engine ([`Verified::Fallback`];
//! the pipeline decides what that means).
//!
//! A whole answer is read, verified and rewritten at once ([`whole`]). A
//! stream is verified as it is relayed ([`stream`]).
//!
//! The output limit is raised by what the echo costs
//! ([`EchoCost::allowance`]). A client that asks for the model's whole
//! output cap gets a 400 for the raised limit; that refusal
//! ([`Sent::LimitRefused`]) sends the request once more with the echo
//! written within the client's own limit. A provider whose chat template
//! refuses the system message canarygate added ([`Sent::SystemRefused`]) gets
//! the request once more with the head canary in the first user message,
//! and the model is remembered ([`crate::system_role`]).

mod attempt;
mod canaries;
mod stream;
mod whole;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use attempt::{Attempt, Decided, elapsed_ms};
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use canaries::Prepared;
use canarygate_policies::EchoCost;
use canarygate_policies::inject::Injection;
use canarygate_policies::topic::TopicAction;
use canarygate_policies::verify::Verifier;
use canarygate_policies::verify_config::UsageReport;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::Served;
use crate::context::RequestContext;
use crate::error::ApiError;
use crate::system_role::refuses_system_message;
use crate::topic::AnswerTexts;
use crate::trail::Trail;
use crate::upstream::is_event_stream;
use crate::upstream_client::UpstreamResponse;
use crate::wire::edit::{Delivery, UsageOptions};
use crate::wire::{ClientRequest, WireFormat};

/// What became of a verified request.
pub enum Verified {
    /// Answer the client with this (the verified answer, a block, or the
    /// provider's own error).
    Served(Served),
    /// The answer failed and the policy serves locally; nothing of it reached
    /// the client.
    Fallback,
}

/// Serves one request on the verified path.
///
/// `request` is the client's request (model renamed for the provider); its
/// body gets the canaries in place. `original` is the body as received: a
/// retry parses it again rather than every request paying for a deep copy.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: ClientRequest,
    original: &Bytes,
    trail: &mut Trail,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> Result<Verified, ApiError> {
    let mut unused = Some(request);
    let mut cost = context.echo_cost();
    // Answers verified so far (one retry), and whether the provider refused
    // the raised limit or the system message (one resend each, which is no
    // verification retry).
    let mut verified = 0;
    let mut limit_refused = false;
    let mut system_refused = false;
    while verified < 2 {
        let request = match unused.take() {
            Some(request) => request,
            None => context.reparse(original)?,
        };
        let sent = send(context, request, original, verified, cost, trail).await?;
        let (attempt, mut response) = match sent {
            Sent::Answer(attempt, response) => (*attempt, response),
            Sent::LimitRefused(_) if !limit_refused => {
                // The same request, the echo written within the client's
                // own limit.
                limit_refused = true;
                cost = cost.within_client_limit();
                tracing::info!(
                    request_id = %context.request_id,
                    "the provider refused the limit raised for the echo; sending the client's own"
                );
                continue;
            }
            Sent::SystemRefused(_) if !system_refused => {
                // The same request, the head canary in the first user
                // message; this model's later requests go that way at once.
                system_refused = true;
                context.remember_system_refused();
                tracing::info!(
                    request_id = %context.request_id,
                    "the provider refused the system message canarygate added; \
                     placing the head canary in the first user message"
                );
                continue;
            }
            Sent::ProviderError(response)
            | Sent::LimitRefused(response)
            | Sent::SystemRefused(response) => {
                return Ok(Verified::Served(Served::Whole(response)));
            }
        };
        verified += 1;
        let wait = context.body_deadlines().whole;
        let streamed = attempt.injection.stream
            && trail
                .clock()
                .wait(reads_as_event_stream(&mut response, wait))
                .await;
        let decided = if streamed {
            stream::serve(context, response, attempt, trail, permit).await
        } else {
            whole::serve(context, response, attempt, trail).await?
        };
        match decided {
            Decided::Served(served) => return Ok(Verified::Served(served)),
            Decided::Fallback => return Ok(Verified::Fallback),
            Decided::Retry => tracing::warn!(
                request_id = %context.request_id,
                "verification failed; retrying upstream once with fresh canaries"
            ),
        }
    }
    Err(ApiError::internal(
        "verification retry loop ended without a decision",
    ))
}

/// Whether a streamed request's answer is an event stream: as its
/// `Content-Type` says, or, when that says JSON, as its first bytes say
/// (read ahead until `wait` after its head, the deadline reading it whole
/// has too, and kept; the wait is the provider's): some OpenAI-compatible servers
/// label their streams `application/json`, which the SDKs read as SSE
/// whatever the label. A JSON answer (an error with a 200, or a client's
/// stream the provider answered whole) opens with `{`.
async fn reads_as_event_stream(response: &mut UpstreamResponse, wait: Duration) -> bool {
    if is_event_stream(response.headers()) {
        return true;
    }
    let first = response.body_mut().first_byte(wait).await;
    first.is_some_and(|byte| byte != b'{' && byte != b'[')
}

/// What the provider answered one attempt with.
enum Sent {
    /// A 2xx answer, to verify (the attempt's state is large: boxed).
    Answer(Box<Attempt>, UpstreamResponse),
    /// The provider's error, read whole, as the client gets it.
    ProviderError(Response),
    /// The provider's 400 refusing the output limit canarygate raised for
    /// the echo ([`refuses_raised_limit`]), as the client would get it.
    LimitRefused(Response),
    /// The provider's refusal of the system message canarygate added
    /// ([`refuses_system_message`]), as the client would get it.
    SystemRefused(Response),
}

/// Whether `body`, a provider's 400 to a request whose output limit was
/// raised for the echo, refuses that limit: it names the limit's field
/// (`max_tokens: 64036 > 64000, which is the maximum allowed...`, `max_tokens
/// is too large`, `Invalid 'max_output_tokens'`). The client's own limit may
/// be the model's cap, which the raised one passes.
fn refuses_raised_limit(status: StatusCode, body: &[u8]) -> bool {
    const LIMIT_FIELDS: [&[u8]; 3] = [
        b"max_tokens",
        b"max_completion_tokens",
        b"max_output_tokens",
    ];
    status == StatusCode::BAD_REQUEST
        && LIMIT_FIELDS
            .iter()
            .any(|field| body.windows(field.len()).any(|window| window == *field))
}

/// Places fresh canaries in `request` (the echo costed at `cost`),
/// registers them, and sends it.
async fn send<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: ClientRequest,
    original: &Bytes,
    attempt: u32,
    cost: EchoCost,
    trail: &mut Trail,
) -> Result<Sent, ApiError> {
    let config = &context.state.policy.verify;
    let continues = W::carries_earlier_canaries(&request.body);
    let Prepared {
        bytes,
        injection,
        exact_prompt_tokens,
        registered,
    } = canaries::prepare(context, request.body, original, cost).await?;
    for id in registered.ids {
        trail.canary(id);
    }
    trail.prompt_tokens_ours(exact_prompt_tokens.unwrap_or(injection.prompt_tokens_estimate));
    let mut verifier = Verifier::new(
        &injection,
        config,
        &context.upstream.name,
        exact_prompt_tokens,
    );
    if continues {
        verifier.accept_session_canaries(&context.caller.session_id);
    }
    if registered.degraded {
        verifier.registry_degraded(0, false);
        trail.registry_degraded();
        context.state.metrics.registry_unavailable("degraded");
    }
    let delivery = delivery_of(context, &injection, exact_prompt_tokens);
    let sent_at = Instant::now();
    trail.new_attempt();
    trail.forwarded();
    let response = context.send(trail.clock(), bytes, injection.stream).await?;
    trail.first_byte(elapsed_ms(sent_at));
    trail.provider_request_id(context.provider_request_id());
    let status = response.status();
    if !status.is_success() {
        let body = context
            .upstream
            .read_whole(trail.clock(), response, context.body_deadlines())
            .await?;
        let limit_refused = injection.echo_allowance > 0 && refuses_raised_limit(status, &body);
        let system_refused = injection.system_inserted && refuses_system_message(status, &body);
        let response = context.provider_error_response(status, body);
        return Ok(if system_refused {
            Sent::SystemRefused(response)
        } else if limit_refused {
            Sent::LimitRefused(response)
        } else {
            Sent::ProviderError(response)
        });
    }
    Ok(Sent::Answer(
        Box::new(Attempt {
            injection,
            verifier,
            sent_at,
            attempt,
            delivery,
            fetched: HashMap::new(),
            lookups_degraded: registered.degraded,
            answer: AnswerTexts::default(),
            topic: context
                .state
                .topic
                .clone()
                .filter(|check| check.action() != TopicAction::Record)
                .map(|check| (check, trail.question().map(str::to_owned))),
        }),
        response,
    ))
}

/// How the answer to `injection` reaches the client: cut at the client's
/// `max_tokens` when canarygate raised the provider's limit for the echo,
/// usage as the policy says, canarygate's prompt tokens (its estimate,
/// scaled to the provider's tokenizer when there is one).
fn delivery_of<W: WireFormat>(
    context: &RequestContext<'_, W>,
    injection: &Injection,
    exact_prompt_tokens: Option<u64>,
) -> Delivery {
    let overhead_prompt =
        injection.scaled_to_exact(injection.prompt_tokens_added, exact_prompt_tokens);
    let raised = !injection.echo.is_empty();
    Delivery::new(
        context.upstream.token_counter(),
        injection.client_max_tokens.filter(|_| raised),
        UsageOptions {
            client_wants_usage: injection.client_wants_usage,
            without_canarygate: context.state.policy.verify.usage == UsageReport::WithoutCanarygate,
            overhead_prompt,
        },
        injection.choices,
    )
    .with_prompt_chars_appended(injection.prompt_chars_appended.clone())
    .with_repeated_fields(injection.repeated_fields.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_400_naming_the_output_limit_refuses_the_raised_one() {
        for body in [
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 64036 > 64000, which is the maximum allowed number of output tokens for claude-sonnet-4-5"}}"#,
            r#"{"error":{"message":"max_tokens is too large: 16420. This model supports at most 16384 completion tokens, whereas you provided 16420.","type":"invalid_request_error","param":"max_tokens","code":"invalid_value"}}"#,
            r#"{"error":{"message":"Invalid 'max_output_tokens': integer above maximum value.","param":"max_output_tokens"}}"#,
        ] {
            assert!(
                refuses_raised_limit(StatusCode::BAD_REQUEST, body.as_bytes()),
                "{body}"
            );
        }
        let other = r#"{"error":{"message":"messages: roles must alternate","param":"messages"}}"#;
        assert!(!refuses_raised_limit(
            StatusCode::BAD_REQUEST,
            other.as_bytes()
        ));
        let limited = r#"{"error":{"message":"Rate limit on max_tokens per minute"}}"#;
        assert!(!refuses_raised_limit(
            StatusCode::TOO_MANY_REQUESTS,
            limited.as_bytes()
        ));
    }
}

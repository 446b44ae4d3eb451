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

mod attempt;
mod canaries;
mod stream;
mod whole;

use std::collections::HashMap;
use std::time::Instant;

use attempt::{Attempt, Decided, elapsed_ms};
use axum::body::Bytes;
use axum::response::Response;
use canaries::Prepared;
use canarygate_policies::inject::Injection;
use canarygate_policies::topic::TopicAction;
use canarygate_policies::verify::Verifier;
use canarygate_policies::verify_config::UsageReport;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::Served;
use crate::context::RequestContext;
use crate::error::ApiError;
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
    for attempt in 0..2 {
        let request = match unused.take() {
            Some(request) => request,
            None => context.reparse(original)?,
        };
        let (attempt, response) = match send(context, request, original, attempt, trail).await? {
            Sent::Answer(attempt, response) => (*attempt, response),
            Sent::ProviderError(response) => {
                return Ok(Verified::Served(Served::Whole(response)));
            }
        };
        let decided = if attempt.injection.stream && is_event_stream(response.headers()) {
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

/// What the provider answered one attempt with.
enum Sent {
    /// A 2xx answer, to verify (the attempt's state is large: boxed).
    Answer(Box<Attempt>, UpstreamResponse),
    /// The provider's error, read whole, as the client gets it.
    ProviderError(Response),
}

/// Places fresh canaries in `request`, registers them, and sends it.
async fn send<W: WireFormat>(
    context: &RequestContext<'_, W>,
    request: ClientRequest,
    original: &Bytes,
    attempt: u32,
    trail: &mut Trail,
) -> Result<Sent, ApiError> {
    let config = &context.state.policy.verify;
    let continues = W::continues_stored_conversation(&request.body);
    let Prepared {
        bytes,
        injection,
        exact_prompt_tokens,
        registered,
    } = canaries::prepare(context, request.body, original).await?;
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
            .read_whole(trail.clock(), response, context.idle_timeout())
            .await?;
        return Ok(Sent::ProviderError(
            context.provider_error_response(status, body),
        ));
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
}

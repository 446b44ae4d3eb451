//! A non-streamed answer: read whole, verify, put the verified text back
//! where it came from.

use axum::body::Body;
use canarygate_policies::verify::{Decision, Facts, Finished};
use serde_json::Value;

use super::attempt::{Attempt, Decided, blocked, elapsed_ms, set_reason};
use crate::body::Served;
use crate::context::RequestContext;
use crate::error::{ApiError, ErrorCode};
use crate::trail::Trail;
use crate::wire::{TextField, TextKind, WireFormat, put_text};

/// Verifies the whole answer in `response` and decides.
pub async fn serve<W: WireFormat>(
    context: &RequestContext<'_, W>,
    response: reqwest::Response,
    mut attempt: Attempt,
    trail: &mut Trail,
) -> Result<Decided, ApiError> {
    let registry = context.state.registry.lookup();
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
    if !stop {
        for choice in &view.choices {
            for field in &choice.texts {
                match field.kind {
                    TextKind::Content => {
                        attempt
                            .verifier
                            .push(field.choice, field.text(&answer), registry);
                    }
                    TextKind::ToolArguments { call } => {
                        attempt.verifier.push_tool_arguments(
                            field.choice,
                            call,
                            field.text(&answer),
                            registry,
                        );
                    }
                }
            }
            set_reason(
                &mut finish_reasons,
                choice.index,
                choice.finish_reason.as_deref(),
            );
        }
    }
    let finished = attempt.verifier.finish(
        &Facts {
            finish_reasons,
            usage: view.usage,
            done_marker: None,
        },
        registry,
    );
    let verdict = &finished.verdict;
    trail.verdict(verdict);
    trail.prompt_tokens_provider(view.usage.map(|usage| usage.prompt_tokens));
    let action = context.state.policy.verify.action();
    Ok(match verdict.decide(action, attempt.attempt, false) {
        Decision::Retry => Decided::Retry,
        Decision::Fallback => Decided::Fallback,
        Decision::Block => Decided::Served(Served::Whole(blocked(context, verdict))),
        Decision::Deliver | Decision::Flag => {
            for field in view.choices.iter().flat_map(|choice| &choice.texts) {
                if let Some(text) = verified_text(&finished, field) {
                    put_text(&mut answer, field, text);
                }
            }
            Decided::Served(Served::Whole(context.json_response(
                status,
                Body::from(answer.to_string()),
                Some(&verdict.header_value()),
            )))
        }
    })
}

/// The verified text for `field`: the choice's released content (empty when
/// nothing was released), or the scanned arguments of its tool call.
fn verified_text<'a>(finished: &'a Finished, field: &TextField) -> Option<&'a str> {
    match field.kind {
        TextKind::Content => Some(
            finished
                .release
                .get(field.choice as usize)
                .map_or("", String::as_str),
        ),
        TextKind::ToolArguments { call } => finished
            .tool_arguments
            .iter()
            .find(|tool| tool.choice == field.choice && tool.tool_call == call)
            .map(|tool| tool.arguments.as_str()),
    }
}

//! `POST /v1/chat/completions`: the request is the conversation as it
//! stands; the answer's body and chunks are built in [`crate::answer`].

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::json;

use super::exchange::{Sim, begin, finish, openai_key};
use crate::answer::Answer;
use crate::conversation::{Conversation, Turn};
use crate::delivery::{Frames, Rendered, data_frame, deliver};
use crate::error::{OVERLOADED_MESSAGE, SimError};
use crate::headers::RateSnapshot;
use crate::request::ChatRequest;
use crate::surface::Surface;

/// The handler.
pub async fn chat_completions(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let mut exchange = begin(&sim, Surface::Chat);
    let result = serve(&sim, &headers, &body, &mut exchange.rate).await;
    finish(&sim, exchange, result)
}

async fn serve(
    sim: &Sim,
    headers: &HeaderMap,
    body: &[u8],
    rate: &mut Option<RateSnapshot>,
) -> Result<Response, SimError> {
    openai_key(sim, headers)?;
    let request = ChatRequest::parse(body)?;
    let turn = Turn {
        surface: Surface::Chat,
        generation: request.generation,
        conversations: vec![Conversation::chat(request.messages)],
    };
    let run = sim.run(headers, &turn, rate).await?;
    let answer = run.answers(&turn.generation).remove(0);
    let rendered = if turn.generation.stream {
        Rendered::Stream(frames(&answer))
    } else {
        Rendered::Whole {
            body: answer.body().to_string(),
            decode_steps: answer.decode_steps(),
        }
    };
    Ok(deliver(sim, &run, rendered).await)
}

/// The chunks of a streamed chat answer, ending with `[DONE]`.
fn frames(answer: &Answer) -> Frames {
    let plan = answer.stream_plan();
    let encode = |chunks: &[serde_json::Value]| -> Vec<Bytes> {
        chunks
            .iter()
            .map(|chunk| data_frame(&chunk.to_string()))
            .collect()
    };
    let mut closing = encode(&plan.closing);
    closing.extend(
        plan.usage
            .iter()
            .map(|usage| data_frame(&usage.to_string())),
    );
    closing.push(data_frame("[DONE]"));
    Frames {
        opening: encode(&plan.opening),
        steps: plan.steps.iter().map(|step| encode(step)).collect(),
        closing,
        failure: vec![openai_stream_error()],
        content_type: "text/event-stream",
    }
}

/// The error a chat or legacy completion stream ends with when the
/// provider is overloaded mid-stream: a `data:` event holding an `error`
/// object (the openai SDK raises it as an `APIError`).
pub fn openai_stream_error() -> Bytes {
    let error = json!({"error": {
        "message": OVERLOADED_MESSAGE, "type": "server_error", "param": null, "code": null,
    }});
    data_frame(&error.to_string())
}

//! OpenAI's Responses API: `POST /v1/responses`, and the stored responses
//! at `GET` and `DELETE /v1/responses/{id}`.
//!
//! The model reads `instructions` as the system message, then the stored
//! conversation `previous_response_id` continues (every earlier input and
//! output, not their instructions), then this request's input. With
//! `store` (the default) the response and its turn are kept
//! ([`crate::store`]). An unknown `previous_response_id` is a 400
//! `previous_response_not_found`; an unknown id to `GET` or `DELETE` a 404.

mod render;
mod request;

use std::sync::{Arc, PoisonError};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::Mode;
use crate::answer::{Answer, Said};
use crate::conversation::{Conversation, Turn};
use crate::delivery::{Rendered, deliver};
use crate::error::SimError;
use crate::headers::RateSnapshot;
use crate::store::{Stored, Thread};
use crate::surface::Surface;
use crate::surfaces::exchange::{Sim, begin, begin_uncounted, finish, openai_key};
pub use render::Rendering;
pub use request::ResponsesRequest;

/// `POST /v1/responses`.
pub async fn create(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    let mut exchange = begin(&sim, Surface::Responses);
    let result = serve(&sim, &headers, &body, &mut exchange.rate).await;
    finish(&sim, exchange, result)
}

/// `GET /v1/responses/{id}`: the stored response.
pub async fn retrieve(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let exchange = begin_uncounted(&sim, Surface::Responses);
    let result = openai_key(&sim, &headers).and_then(|()| {
        let store = sim.responses.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = store.get(&id).ok_or_else(|| not_found(&id))?;
        Ok(Json(stored.body.clone()).into_response())
    });
    finish(&sim, exchange, result)
}

/// `DELETE /v1/responses/{id}`: forgets the stored response.
pub async fn delete(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let exchange = begin_uncounted(&sim, Surface::Responses);
    let result = openai_key(&sim, &headers).and_then(|()| {
        let removed = sim
            .responses
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        if !removed {
            return Err(not_found(&id));
        }
        Ok(Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response())
    });
    finish(&sim, exchange, result)
}

fn not_found(id: &str) -> SimError {
    SimError::not_found(format!("Response with id '{id}' not found."))
}

async fn serve(
    sim: &Sim,
    headers: &HeaderMap,
    body: &[u8],
    rate: &mut Option<RateSnapshot>,
) -> Result<Response, SimError> {
    openai_key(sim, headers)?;
    let request = ResponsesRequest::parse(body)?;
    let earlier = match &request.previous_response_id {
        Some(id) => Some(
            sim.responses
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(id)
                .map(|stored| stored.thread.clone())
                .ok_or_else(|| {
                    SimError::invalid_request(
                        Some("previous_response_not_found"),
                        format!("Previous response with id '{id}' not found."),
                    )
                    .with_param("previous_response_id")
                })?,
        ),
        None => None,
    };
    let mut messages = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    if let Some(thread) = &earlier {
        messages.extend(thread.conversation());
    }
    messages.extend(request.input.iter().cloned());
    let turn = Turn {
        surface: Surface::Responses,
        generation: request.generation.clone(),
        conversations: vec![Conversation::chat(messages)],
    };
    let run = sim.run(headers, &turn, rate).await?;
    let answer = run.answers(&turn.generation).remove(0);
    let rendering = Rendering {
        id: &run.id,
        created_at: run.created,
        request: &request,
        answer: &answer,
    };
    if request.store {
        let body = if run.mode == Mode::Overloaded {
            rendering.failed()
        } else {
            rendering.response()
        };
        let mut turn_messages = request.input.clone();
        turn_messages.extend(output_messages(&answer));
        let thread = Arc::new(Thread {
            messages: turn_messages,
            earlier,
        });
        sim.responses
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(run.id.clone(), Stored { body, thread });
    }
    let rendered = if request.generation.stream {
        Rendered::Stream(rendering.frames())
    } else {
        Rendered::Whole {
            body: rendering.response().to_string(),
            decode_steps: answer.decode_steps(),
        }
    };
    Ok(deliver(sim, &run, rendered).await)
}

/// What the model said, as the chat-shaped messages a later turn reads.
fn output_messages(answer: &Answer) -> Vec<Value> {
    answer
        .choices()
        .iter()
        .map(|choice| match &choice.said {
            Said::Content(tokens) => json!({"role": "assistant", "content": tokens.concat()}),
            Said::Calls { calls, .. } => {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|call| {
                        json!({"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments()}})
                    })
                    .collect();
                json!({"role": "assistant", "content": null, "tool_calls": calls})
            }
        })
        .collect()
}

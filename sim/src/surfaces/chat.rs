//! `POST /v1/chat/completions`: the request is the conversation as it
//! stands; the answer's body and chunks are built in [`crate::answer`].
//!
//! With `store: true` the completion and the request's messages are kept
//! ([`crate::store::CompletionStore`]), as OpenAI keeps them for its
//! stored-completion endpoints: `GET /v1/chat/completions` lists them
//! (`model`, `metadata[KEY]=VALUE`, `limit`, `order`, `after`), and
//! `/v1/chat/completions/{id}` reads (`GET`), updates its `metadata`
//! (`POST`) or forgets one (`DELETE`), its `/messages` the messages.

use std::collections::HashMap;
use std::sync::PoisonError;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::exchange::{Sim, begin, begin_uncounted, finish, openai_key};
use crate::answer::Answer;
use crate::conversation::{Conversation, Turn};
use crate::delivery::{Frames, Rendered, data_frame, deliver};
use crate::error::{OVERLOADED_MESSAGE, SimError};
use crate::headers::RateSnapshot;
use crate::request::ChatRequest;
use crate::store::StoredCompletion;
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
    store(sim, body, answer.body());
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

/// Keeps `completion`, the answer to `body`, when `body` asks to store it.
fn store(sim: &Sim, body: &[u8], mut completion: Value) {
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if request["store"] != true {
        return;
    }
    let Some(id) = completion["id"].as_str().map(str::to_owned) else {
        return;
    };
    completion["metadata"] = match &request["metadata"] {
        Value::Object(metadata) => Value::Object(metadata.clone()),
        _ => json!({}),
    };
    let messages = request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, message)| {
            json!({"id": format!("{id}-{index}"), "role": message["role"],
                   "content": message["content"], "name": message["name"],
                   "content_parts": null})
        })
        .collect();
    sim.completions
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(
            id,
            StoredCompletion {
                completion,
                messages,
            },
        );
}

/// A page of `items` (OpenAI's list object), the first `limit` after the
/// one whose id is `after`.
fn page(items: Vec<Value>, query: &HashMap<String, String>) -> Value {
    let limit = query
        .get("limit")
        .and_then(|limit| limit.parse().ok())
        .unwrap_or(20usize);
    let start = query
        .get("after")
        .and_then(|after| items.iter().position(|item| item["id"] == after.as_str()))
        .map_or(0, |at| at + 1);
    let rest = items.len().saturating_sub(start);
    let data: Vec<Value> = items.into_iter().skip(start).take(limit).collect();
    json!({"object": "list", "first_id": data.first().map(|item| item["id"].clone()),
           "last_id": data.last().map(|item| item["id"].clone()),
           "has_more": rest > data.len(), "data": data})
}

/// `GET /v1/chat/completions`: the stored completions, filtered by
/// `model` and `metadata[KEY]=VALUE`.
pub async fn list(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let exchange = begin_uncounted(&sim, Surface::Chat);
    let result = openai_key(&sim, &headers).map(|()| {
        let store = sim
            .completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let wanted = |stored: &&StoredCompletion| {
            let completion = &stored.completion;
            query
                .iter()
                .all(|(key, value)| match key.strip_prefix("metadata[") {
                    Some(name) => {
                        let name = name.strip_suffix(']').unwrap_or(name);
                        completion["metadata"][name] == value.as_str()
                    }
                    None if key == "model" => completion["model"] == value.as_str(),
                    None => true,
                })
        };
        let mut items: Vec<Value> = store
            .in_order()
            .filter(wanted)
            .map(|stored| stored.completion.clone())
            .collect();
        if query.get("order").map(String::as_str) == Some("desc") {
            items.reverse();
        }
        Json(page(items, &query)).into_response()
    });
    finish(&sim, exchange, result)
}

/// Answers a request about the stored completion `id` with what `answer`
/// makes of it (a 404 when it is not stored), as a lookup: nothing is
/// generated.
fn about_stored(
    sim: &Sim,
    headers: &HeaderMap,
    id: &str,
    answer: impl FnOnce(&mut StoredCompletion) -> Result<Value, SimError>,
) -> Response {
    let exchange = begin_uncounted(sim, Surface::Chat);
    let result = openai_key(sim, headers).and_then(|()| {
        let mut store = sim
            .completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let stored = store.get_mut(id).ok_or_else(|| not_found(id))?;
        Ok(Json(answer(stored)?).into_response())
    });
    finish(sim, exchange, result)
}

/// `GET /v1/chat/completions/{id}`.
pub async fn retrieve(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    about_stored(&sim, &headers, &id, |stored| Ok(stored.completion.clone()))
}

/// `POST /v1/chat/completions/{id}`: sets the completion's `metadata`.
pub async fn update(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    about_stored(&sim, &headers, &id, |stored| {
        let request: Value = serde_json::from_slice(&body).map_err(|error| {
            SimError::invalid_request(None, format!("invalid JSON body: {error}"))
        })?;
        let Value::Object(metadata) = &request["metadata"] else {
            return Err(SimError::invalid_request(
                None,
                "`metadata` must be an object",
            ));
        };
        stored.completion["metadata"] = Value::Object(metadata.clone());
        Ok(stored.completion.clone())
    })
}

/// `DELETE /v1/chat/completions/{id}`.
pub async fn delete(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let exchange = begin_uncounted(&sim, Surface::Chat);
    let result = openai_key(&sim, &headers).and_then(|()| {
        let removed = sim
            .completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        if !removed {
            return Err(not_found(&id));
        }
        Ok(
            Json(json!({"object": "chat.completion.deleted", "id": id, "deleted": true}))
                .into_response(),
        )
    });
    finish(&sim, exchange, result)
}

/// `GET /v1/chat/completions/{id}/messages`: the request's messages.
pub async fn messages(
    State(sim): State<Sim>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    about_stored(&sim, &headers, &id, |stored| {
        Ok(page(stored.messages.clone(), &query))
    })
}

fn not_found(id: &str) -> SimError {
    SimError::not_found(format!("Completion with id '{id}' not found."))
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

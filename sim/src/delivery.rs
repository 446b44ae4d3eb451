//! Sending an answer, whatever its surface: paced as the model would
//! produce it, and broken the way the failure mode says.
//!
//! A surface renders its answer as a whole body or as [`Frames`], the
//! encoded SSE events of a stream: an opening sent at once, then after the
//! prefill one step per decode step (the events that token produced), then
//! a closing. [`deliver`] is the same for every surface:
//!
//! - `cut`: a stream stops after half its steps and the connection closes
//!   (no closing events, no `[DONE]`); a whole body is half sent, then the
//!   connection is reset;
//! - `stall-mid-stream`: the same half, then silence with the connection
//!   open until the client gives up;
//! - `no-end-marker`: a stream sends everything but its end marker
//!   (`data: [DONE]`, `message_stop`);
//! - `overloaded`: a stream sends half its steps, then the surface's error
//!   event ([`Frames::failure`]) and ends (a whole answer never gets here: it
//!   is refused with 503 or 529 before it is generated).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use canarygate_policies::sse::encode_data;
use futures_util::StreamExt;
use serde_json::Value;

use crate::provider::{Run, SimProvider};
use crate::{CONTEXT_FROM_HEADER, CONTEXT_HEADER, Mode};

/// The events of a stream, encoded, in the order they are sent.
#[derive(Debug, Default)]
pub struct Frames {
    /// Sent at once, before the prefill.
    pub opening: Vec<Bytes>,
    /// One decode step (one token time) each; a step may send nothing (a
    /// hidden reasoning token).
    pub steps: Vec<Vec<Bytes>>,
    /// After the last step.
    pub closing: Vec<Bytes>,
    /// In `overloaded` mode, sent after the first [`midpoint`] steps in
    /// place of the rest: the surface's error event.
    pub failure: Vec<Bytes>,
    /// The `content-type` of the stream.
    pub content_type: &'static str,
}

/// An answer ready to send.
pub enum Rendered {
    /// A JSON body; pacing takes `decode_steps` token times.
    Whole {
        body: String,
        decode_steps: usize,
    },
    Stream(Frames),
}

/// How many steps of `steps` a stream broken mid-way sends.
pub fn midpoint(steps: usize) -> usize {
    steps / 2
}

/// `data: <data>` (OpenAI's chat and legacy completion streams).
pub fn data_frame(data: &str) -> Bytes {
    let mut bytes = Vec::with_capacity(data.len() + 8);
    encode_data(data, &mut bytes);
    Bytes::from(bytes)
}

/// `event: <event>` then `data: <json>` (the Responses and Messages APIs).
pub fn event_frame(event: &str, data: &Value) -> Bytes {
    let mut bytes = format!("event: {event}\n").into_bytes();
    encode_data(&data.to_string(), &mut bytes);
    Bytes::from(bytes)
}

/// Sends `rendered`, the answer to `run`, with the ground-truth headers.
pub async fn deliver(sim: &Arc<SimProvider>, run: &Run, rendered: Rendered) -> Response {
    let mut response = match rendered {
        Rendered::Whole { body, decode_steps } => {
            let steps = u32::try_from(decode_steps).unwrap_or(u32::MAX);
            pace(run.prefill + run.per_token * steps).await;
            whole(sim, run.mode, body)
        }
        Rendered::Stream(frames) => stream(sim.clone(), run, frames),
    };
    let (label, from) = run.context_label();
    let headers = response.headers_mut();
    headers.insert(
        HeaderName::from_static(CONTEXT_HEADER),
        HeaderValue::from_static(label),
    );
    if !from.is_empty()
        && let Ok(value) = HeaderValue::from_str(&from.join(","))
    {
        headers.insert(HeaderName::from_static(CONTEXT_FROM_HEADER), value);
    }
    response
}

fn whole(sim: &SimProvider, mode: Mode, body: String) -> Response {
    if matches!(mode, Mode::Cut | Mode::StallMidStream) {
        // Half the body, then a reset (cut) or silence with the connection open (stall).
        let half = Bytes::from(body.as_bytes()[..body.len() / 2].to_vec());
        let rest = futures_util::stream::once(async move {
            if mode == Mode::StallMidStream {
                std::future::pending::<()>().await;
            }
            Err::<Bytes, _>(std::io::Error::other("sim: cut mid-body"))
        });
        let body = futures_util::stream::once(async move { Ok(half) }).chain(rest);
        let mut response = Response::new(Body::from_stream(body));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return response;
    }
    sim.stats.completed.fetch_add(1, Ordering::Relaxed);
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn stream(sim: Arc<SimProvider>, run: &Run, frames: Frames) -> Response {
    let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
    let (mode, prefill, per_token) = (run.mode, run.prefill, run.per_token);
    let content_type = frames.content_type;
    tokio::spawn(async move {
        let mut guard = CancelGuard {
            sim: sim.clone(),
            finished: false,
        };
        if send_frames(&frames, mode, prefill, per_token, &sender)
            .await
            .is_ok()
        {
            guard.finished = true;
            let counter = match mode {
                Mode::Cut | Mode::StallMidStream => None,
                Mode::Overloaded => Some(&sim.stats.overloaded),
                _ => Some(&sim.stats.completed),
            };
            if let Some(counter) = counter {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    });
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = StatusCode::OK;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Counts a stream the client abandoned: dropped before it was finished.
struct CancelGuard {
    sim: Arc<SimProvider>,
    finished: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.sim.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

type Sender = tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>;

/// Sends `frames` as `mode` says; `Err` when the client went away.
async fn send_frames(
    frames: &Frames,
    mode: Mode,
    prefill: Duration,
    per_token: Duration,
    sender: &Sender,
) -> Result<(), ()> {
    async fn send(sender: &Sender, frames: &[Bytes]) -> Result<(), ()> {
        for frame in frames {
            sender.send(Ok(frame.clone())).await.map_err(|_| ())?;
        }
        Ok(())
    }

    send(sender, &frames.opening).await?;
    pace(prefill).await;
    let broken = matches!(mode, Mode::Cut | Mode::StallMidStream | Mode::Overloaded);
    let sent = if broken {
        midpoint(frames.steps.len())
    } else {
        frames.steps.len()
    };
    for step in &frames.steps[..sent] {
        pace(per_token).await;
        send(sender, step).await?;
    }
    match mode {
        Mode::Cut => Ok(()),
        Mode::StallMidStream => {
            // Hold the connection open and silent until the client gives up.
            sender.closed().await;
            Err(())
        }
        Mode::Overloaded => send(sender, &frames.failure).await,
        Mode::NoEndMarker => {
            let closing: Vec<Bytes> = frames
                .closing
                .iter()
                .filter(|frame| !is_end_marker(frame))
                .cloned()
                .collect();
            send(sender, &closing).await
        }
        _ => send(sender, &frames.closing).await,
    }
}

/// Whether `frame` is a stream's end marker: `data: [DONE]` (Chat, legacy
/// completions) or the `message_stop` event (Messages).
fn is_end_marker(frame: &[u8]) -> bool {
    frame == b"data: [DONE]\n\n" || frame.starts_with(b"event: message_stop\n")
}

/// Waits `duration`; returns at once for zero. (A zero `tokio::time::sleep`
/// still waits for the next timer tick, up to a millisecond, which would make
/// an "instant" provider pace every token.)
pub async fn pace(duration: Duration) {
    if !duration.is_zero() {
        tokio::time::sleep(duration).await;
    }
}

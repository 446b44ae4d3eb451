//! What a stream writer holds back: each provider event, read, until its
//! text is released by the verifier and the client's limit lets it out
//! ([`HeldEvents`]), in the order the events came.
//!
//! Every format's writer keeps one queue. It says, per event, whether the
//! event is ready ([`Held`] and the verifier are all a format's rule
//! reads); the queue adds the client's limit ([`LimitHold`]) and hands the
//! events back in order, each once it may go.

use std::collections::VecDeque;

use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::Verifier;

use crate::wire::edit::Delivery;
use crate::wire::format::{Chunk, Spans};

/// One provider event waiting for its text to be verified.
#[derive(Debug)]
pub struct Held {
    /// The event, read.
    pub chunk: Chunk,
    /// The event as received.
    pub event: SseEvent,
    /// The span of its part each text field carried.
    pub spans: Spans,
    /// It ends a choice or the answer (a finish reason, a usage chunk, a
    /// Messages `message_delta`): it waits for the verdict.
    pub ends: bool,
}

/// A stream writer's held events, and its hold for the client's limit.
#[derive(Debug, Default)]
pub struct HeldEvents {
    queue: VecDeque<Held>,
    limit: LimitHold,
}

impl HeldEvents {
    /// Holds `held` behind every event already held.
    pub fn push(&mut self, held: Held) {
        self.queue.push_back(held);
    }

    /// Whether no event is held.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The last event held, taken back.
    pub fn pop_last(&mut self) -> Option<Held> {
        self.queue.pop_back()
    }

    /// The first held event, taken if it may go out now: at the stream's
    /// end (`at_end`) whatever it holds, before it once the format's rule
    /// says it is `ready` and the client's limit lets it out.
    pub fn pop_ready(
        &mut self,
        at_end: bool,
        ready: impl Fn(&Held, &Verifier) -> bool,
        delivery: &mut Delivery,
        verifier: &Verifier,
    ) -> Option<Held> {
        let held = self.queue.front()?;
        let goes = at_end
            || (ready(held, verifier)
                && self.limit.lets_out(
                    &held.chunk,
                    &held.event.data,
                    &held.spans,
                    delivery,
                    verifier,
                ));
        if goes { self.queue.pop_front() } else { None }
    }
}

/// A stream's hold for the client's limit: from the first chunk whose text
/// the count as it goes would cut ([`Delivery::would_cut`]), that chunk and
/// every one after it wait for the stream's end, where the provider's own
/// count says whether the answer fits ([`Delivery::fits_the_limit`]).
#[derive(Debug, Default)]
struct LimitHold {
    /// A chunk would have been cut: the rest waits for the end.
    holding: bool,
}

impl LimitHold {
    /// Whether `chunk` (read from `data`, its fields having carried
    /// `spans`), ready to go out before the stream's end, may go now.
    fn lets_out(
        &mut self,
        chunk: &Chunk,
        data: &str,
        spans: &Spans,
        delivery: &mut Delivery,
        verifier: &Verifier,
    ) -> bool {
        if self.holding {
            return false;
        }
        let texts = chunk.with_data(data);
        self.holding = chunk.texts().zip(spans).any(|(field, span)| {
            delivery.would_cut(
                field.choice,
                field.kind,
                texts.text(field),
                span.clone(),
                || verifier.release_of(field.choice, field.kind),
            )
        });
        !self.holding
    }
}

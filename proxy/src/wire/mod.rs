//! Wire formats: what differs between the APIs a job calls, behind one trait.
//!
//! Chat Completions, the Responses API, Anthropic Messages and legacy
//! completions differ in where text lives in a request and an answer, how an
//! answer streams and how an error is written; the checks, the registry, the
//! audit trail and the local fallback are the same for all of them. A format
//! is one [`WireFormat`] implementation: [`chat::Chat`] is the first.
//!
//! What the verified path asks of a format:
//!
//! 1. [`WireFormat::parse_request`]: the client's bytes into a
//!    [`ClientRequest`]: model, stream, the client's limits; bad input is a
//!    400 in the format's own shape.
//! 2. [`WireFormat::place_canaries`]: where the canaries go in this format,
//!    and what the verifier must expect ([`Injection`]: echo, passive reason,
//!    choices, the client's `max_tokens`).
//! 3. [`WireFormat::read_answer`] and [`WireFormat::read_event`]: the
//!    provider's whole answer, or one event of its stream, as text for the
//!    verifier: every text field with its [`TextKind`] and its place
//!    ([`TextField::at`], a [`Location`](format::Location) in the provider's own JSON), so
//!    the verified text can be put back where it came from
//!    ([`put_text`]), plus finish reasons and usage.
//! 4. [`WireFormat::StreamWriter`]: the client-facing stream, fed the
//!    provider's events as they are read and the verified text as it is
//!    released. Chat Completions rebuilds its chunks from the verified text
//!    today; a writer that edits the provider's own events in place (every
//!    field passes through, only canary text is replaced at
//!    [`TextField::at`]) fits the same calls.
//! 5. [`WireFormat::error_body`]: every error in the format's shape.

pub mod chat;
mod format;

pub use format::{
    ClientRequest, EventView, StreamEnd, StreamWriter, TextField, TextKind, WireFormat, put_text,
};

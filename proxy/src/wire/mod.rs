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
//!    verifier: every text field with its
//!    [`Part`](canarygate_policies::verify::Part) and its place
//!    ([`TextField::at`](format::TextField::at), a [`Location`](location::Location) in the provider's own JSON), so
//!    the verified text can be put back where it came from
//!    ([`put_text`](format::put_text)), plus finish reasons and usage.
//!    A format may read an event of a shape it knows without building its
//!    JSON tree ([`Chunk::light`](format::Chunk::light): Chat's common
//!    chunk, Messages' text and thinking deltas, the Responses API's
//!    deltas): its text is read in place from the event's data
//!    ([`Chunk::with_data`](format::Chunk::with_data), a [`TextSource`]),
//!    and the tree is built only if an edit needs it. A stream's reader
//!    keeps a [`StreamMemo`] across its events
//!    ([`WireFormat::read_stream_event`]): Chat reads a chunk from after
//!    the prefix the stream's chunks share, or, when the chunk has the
//!    same bytes around its text as an earlier one, as that one was read
//!    with its own text. Likewise a whole
//!    answer of a shape it knows ([`WireFormat::read_answer_light`], Chat's
//!    common answer): its text fields' string literals are located in the
//!    provider's bytes ([`LightAnswer`]) and no tree is built at all.
//! 4. [`WireFormat::deliver_answer`] and [`WireFormat::StreamWriter`]: the
//!    client gets the provider's own answer and events, edited, not rebuilt:
//!    each text field becomes what the verifier's release leaves of it
//!    ([`edit`]: the echo and canaries removed, the client's token limit
//!    applied), and what follows the text (logprobs, finish reasons, usage)
//!    is edited to match; every other field passes as the provider sent it.
//!    A whole answer read in place is delivered as the provider's bytes
//!    with the edited literals spliced in ([`LightAnswer::deliver`]).
//!    A stream's events are held until the verifier lets their text out,
//!    and an event nothing changed goes out as the provider's own bytes.
//! 5. [`WireFormat::error_body`]: every error in the format's shape.

pub mod chat;
pub mod completions;
pub mod edit;
mod format;
mod held;
mod json_str;
mod light_answer;
mod location;
pub mod messages;
mod positions;
pub mod responses;
pub mod stored;

pub use format::{
    AnswerView, ChoiceView, ClientRequest, EventView, LightAnswer, LocalStream, Spans, StreamMemo,
    StreamWriter, TextSource, WireFormat, drop_read_only,
};

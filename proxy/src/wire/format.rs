//! The wire-format seam itself: the [`WireFormat`] trait and the views of
//! requests, answers and stream events that it hands the verified path (see
//! the parent module's docs).
//!
//! Longer than 500 lines: it is the one place every format's obligations are
//! written down, each method of the two traits with its contract.

use std::borrow::Cow;
use std::collections::HashSet;
use std::ops::Range;

use axum::http::StatusCode;
use canarygate_policies::EchoCost;
use canarygate_policies::canary::{CANONICAL_LEN, find_canaries};
use canarygate_policies::config::ProviderApi;
use canarygate_policies::inject::{Injection, RequestCanaries, SystemRole};
use canarygate_policies::sse::SseEvent;
use canarygate_policies::verify::{Part, ProviderUsage, Verdict, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde_json::Value;
use smallvec::SmallVec;

use crate::error::ApiError;
use crate::wire::edit::Delivery;
use crate::wire::location::Location;

/// What the pipeline needs of a client request, whatever its format.
#[derive(Debug)]
pub struct ClientRequest {
    /// The whole body, as parsed; every field passes through to the provider.
    pub body: Value,
    /// The model the client asked for.
    pub model: String,
    /// The client asked for a stream.
    pub stream: bool,
    /// The client's own limit on generated tokens, if any.
    pub max_tokens: Option<u64>,
}

/// One piece of model output in the provider's JSON: what the verifier reads
/// and where the verified text goes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextField {
    /// Choice index.
    pub choice: u32,
    /// Which text of the choice it is part of.
    pub kind: Part,
    /// Where the string sits in the provider's answer or event.
    pub at: Location,
}

impl TextField {
    /// The text in `value` (the answer or event the field was read from).
    pub fn text<'a>(&self, value: &'a Value) -> &'a str {
        self.at.text(value).unwrap_or("")
    }
}

/// A choice's text fields: a stream event's choice mostly has one, kept
/// inline.
pub type TextFields = SmallVec<[TextField; 1]>;

/// The choices of an answer or event: a stream event mostly carries one,
/// kept inline.
pub type Choices = SmallVec<[ChoiceView; 1]>;

/// The span of its part that each text field of an event carried, in the
/// order of [`Chunk::texts`].
pub type Spans = SmallVec<[Range<usize>; 2]>;

/// One choice of an answer or of a stream event, as the verifier reads it.
#[derive(Debug, Default, Clone)]
pub struct ChoiceView {
    /// Choice index.
    pub index: u32,
    /// Where the choice sits in the answer's or event's `choices`.
    pub position: usize,
    /// Its text fields, in order.
    pub texts: TextFields,
    /// Its `finish_reason`, when set.
    pub finish_reason: Option<String>,
}

/// A provider's whole answer, as the verifier reads it.
#[derive(Debug, Default)]
pub struct AnswerView {
    /// Every choice, in order.
    pub choices: Choices,
    /// The provider's usage, if reported.
    pub usage: Option<ProviderUsage>,
}

/// A whole answer read in place, without its tree: its reading and its
/// delivery are in [`crate::wire::light_answer`].
#[derive(Debug)]
pub struct LightAnswer {
    /// The answer as the verifier reads it.
    pub view: AnswerView,
    /// Each text field of `view`, in the view's order, with its literal.
    pub(super) fields: Vec<(TextField, LightField)>,
    /// Per choice of `view`: its finish reason's literal, when it is a
    /// string.
    pub(super) finish_reasons: Vec<Option<Range<usize>>>,
    /// The finish reason of a choice that the client's limit cut.
    pub(super) cut_reason: &'static str,
}

/// A text field's JSON string literal in the answer, and its text.
#[derive(Debug)]
pub struct LightField {
    /// The literal's bytes in the answer, quotes included.
    pub(super) literal: Range<usize>,
    /// Its text.
    pub(super) text: LightText,
}

/// One event of a provider's stream, as the verifier reads it.
#[derive(Debug)]
pub enum EventView {
    /// The provider's end-of-stream marker, carrying nothing the client
    /// needs (Chat's `[DONE]`): the writer's [`StreamWriter::done`] ends the
    /// client's stream.
    Done,
    /// The event that ends the answer and carries its last facts (the
    /// Responses API's `response.completed` with the whole response and its
    /// usage): read like a chunk (its text fields, if any, are not pushed:
    /// they repeat what the stream carried), handed to the writer, and then
    /// the stream ends as on [`EventView::Done`].
    Final(Chunk),
    /// The provider reported an error mid-stream (its message).
    Error(String),
    /// Not an event of this format (e.g. not JSON).
    Malformed,
    /// An event that may carry text.
    Chunk(Chunk),
}

/// An event of a provider's stream: the event itself and what it carries.
///
/// Most events of a stream are passed on exactly as the provider sent them,
/// so a format may read an event of a shape it knows without building its
/// JSON tree ([`Chunk::light`]): the chunk then holds only where its one
/// text is (in the event's data, or unescaped), and `event` stays null
/// until an edit needs the tree ([`Chunk::build_tree`]). Its strings are
/// read with the event's data ([`Chunk::with_data`]).
#[derive(Debug)]
pub struct Chunk {
    /// The provider's event, parsed; null for a light chunk whose tree
    /// was not needed yet.
    pub event: Value,
    /// The choices it carries, in order.
    pub choices: Choices,
    /// Usage it reports.
    pub usage: Option<ProviderUsage>,
    /// What a light chunk holds instead of its tree; `None` once `event`
    /// holds the tree.
    light: Option<Light>,
    /// Where its text goes, for a format that addresses a stream's texts.
    pub place: Option<TextPlace>,
}

/// Where a stream event's text goes in the answer a client assembles, for
/// formats that address their texts: Messages' block `index`, the Responses
/// API's `output_index` with its content or summary index. SDKs join a
/// stream's texts by place, the verifier as they arrive, so the two read
/// the same text only while no text goes back to an earlier place
/// ([`StreamMemo::keeps_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TextPlace {
    /// The block or output item.
    pub item: u64,
    /// Which list of the item the text is in (a reasoning item's summary
    /// or content, below [`TextPlace::LISTS`]): lists are not ordered
    /// between them.
    pub list: u8,
    /// Its index in that list.
    pub index: u64,
}

impl TextPlace {
    /// How many lists an item may have.
    pub const LISTS: usize = 2;
}

/// What a light chunk holds instead of its tree.
#[derive(Debug)]
struct Light {
    /// The string of its one text field, when it has one.
    text: Option<LightText>,
    /// Some choice's delta carries something besides its text: a role, a
    /// tool call.
    keeps_other_fields: bool,
}

/// What the earlier events of one stream tell the reading of the next
/// ([`WireFormat::read_stream_event`]); each stream's reader keeps one.
#[derive(Debug, Default)]
pub struct StreamMemo {
    /// The bytes an earlier event of the stream, read in place, began
    /// with, up to the first member that is read, when they hold only
    /// members the reading skips (Chat: `{"id":…,"object":…,"model":…,` before
    /// `"choices"`): a later event that begins with the same bytes is read
    /// from where they end.
    pub(crate) skipped_prefix: String,
    /// Times a prefix was looked for; the search stops after a few, for a
    /// provider whose events never begin alike.
    pub(crate) prefix_searches: u8,
    /// An event without that prefix, kept for its capacity.
    pub(crate) scratch: String,
    /// The last event read in place whose one text held no escape, framed
    /// around that text: a later event with the same bytes around a text
    /// without escapes reads as it did, with its own text.
    pub(crate) text_frame: Option<TextFrame>,
    /// Times a frame was learnt; the learning stops after a few, for a
    /// provider whose events never repeat their frame.
    pub(crate) frames_learnt: u8,
    /// The prompt's usage an opening event reported (Messages'
    /// `message_start`), which a later event's output count alone completes.
    pub(crate) opening_usage: Option<ProviderUsage>,
    /// The furthest item a text came from, and the furthest index in each
    /// of its lists ([`StreamMemo::keeps_order`]).
    furthest_place: Option<(u64, [u64; TextPlace::LISTS])>,
    /// Every place a text came from ([`StreamMemo::has_text_at`]), and
    /// the last one noted (texts come a place at a time: one comparison
    /// per text, a set insert per place).
    text_places: HashSet<TextPlace>,
    last_text_place: Option<TextPlace>,
}

impl StreamMemo {
    /// Whether a text at `place` keeps the order of the stream's texts so
    /// far (no earlier item than the furthest, no earlier index in its list
    /// of that item); it is then the furthest.
    pub fn keeps_order(&mut self, place: TextPlace) -> bool {
        let list = usize::from(place.list).min(TextPlace::LISTS - 1);
        if self.last_text_place != Some(place) {
            self.last_text_place = Some(place);
            self.text_places.insert(place);
        }
        match &mut self.furthest_place {
            Some((item, _)) if place.item < *item => false,
            Some((item, indices)) if place.item == *item => {
                let in_order = place.index >= indices[list];
                indices[list] = indices[list].max(place.index);
                in_order
            }
            furthest => {
                let mut indices = [0; TextPlace::LISTS];
                indices[list] = place.index;
                *furthest = Some((place.item, indices));
                true
            }
        }
    }

    /// Whether a text came from `place` ([`StreamMemo::keeps_order`] was
    /// asked about it).
    pub fn has_text_at(&self, place: TextPlace) -> bool {
        self.text_places.contains(&place)
    }
}

/// An event's bytes around its one text, and what the event read as
/// ([`StreamMemo::text_frame`]).
#[derive(Debug)]
pub(crate) struct TextFrame {
    /// The bytes up to the text's opening quote, included.
    pub(crate) before: String,
    /// From the text's closing quote, included, to the end of the member
    /// that holds every text (Chat: `choices`).
    pub(crate) after: String,
    /// The event's choices, its one text field included.
    pub(crate) choices: Choices,
    /// [`Chunk::light_keeps_other_fields`] of the event.
    pub(crate) keeps_other_fields: bool,
}

/// The string of a light chunk's one text field.
#[derive(Debug)]
pub enum LightText {
    /// These bytes of the event's data: the JSON string held no escape,
    /// so its text is its bytes.
    InData(Range<usize>),
    /// The string, unescaped.
    Unescaped(String),
}

impl Chunk {
    /// A chunk read from its JSON tree.
    pub fn parsed(event: Value, choices: Choices, usage: Option<ProviderUsage>) -> Self {
        Self {
            event,
            choices,
            usage,
            light: None,
            place: None,
        }
    }

    /// A chunk read without its tree, with at most one text field in
    /// `choices`: `text` is that field's string (read with the event's
    /// data, [`Chunk::with_data`]); `keeps_other_fields`: some choice's
    /// delta carries something besides its text (a role, a tool call).
    pub fn light(choices: Choices, text: Option<LightText>, keeps_other_fields: bool) -> Self {
        debug_assert!(
            choices
                .iter()
                .map(|choice| choice.texts.len())
                .sum::<usize>()
                == usize::from(text.is_some()),
            "a light chunk's one text field and its string go together"
        );
        Self {
            event: Value::Null,
            choices,
            usage: None,
            light: Some(Light {
                text,
                keeps_other_fields,
            }),
            place: None,
        }
    }

    /// Whether the chunk was read without its tree and still has none.
    pub fn is_light(&self) -> bool {
        self.light.is_some()
    }

    /// Whether some choice of a light chunk carries something besides its
    /// text, a role or a tool call (false for any other chunk).
    pub fn light_keeps_other_fields(&self) -> bool {
        self.light
            .as_ref()
            .is_some_and(|light| light.keeps_other_fields)
    }

    /// Where a light chunk's one text lies in the event's data, when its
    /// string held no escape.
    pub(crate) fn light_text_in_data(&self) -> Option<Range<usize>> {
        match self.light.as_ref()?.text.as_ref()? {
            LightText::InData(range) => Some(range.clone()),
            LightText::Unescaped(_) => None,
        }
    }

    /// Gives a light chunk its tree, parsed from `data` (the event's data).
    /// False when the tree cannot be built (a number no `Value` holds,
    /// which the light reading skipped unread): the chunk then has none.
    pub fn build_tree(&mut self, data: &str) -> bool {
        if self.light.take().is_some() {
            match serde_json::from_str(data) {
                Ok(tree) => self.event = tree,
                Err(_) => return false,
            }
        }
        true
    }

    /// Every text field of the chunk, choice by choice.
    pub fn texts(&self) -> impl Iterator<Item = &TextField> {
        self.choices.iter().flat_map(|choice| &choice.texts)
    }

    /// The chunk with `data`, the data of the event it was read from: what
    /// the strings of its text fields are read from.
    pub fn with_data<'a>(&'a self, data: &'a str) -> ChunkTexts<'a> {
        ChunkTexts { chunk: self, data }
    }
}

/// A chunk and the data of the event it was read from ([`Chunk::with_data`]).
#[derive(Debug, Clone, Copy)]
pub struct ChunkTexts<'a> {
    chunk: &'a Chunk,
    data: &'a str,
}

/// What the strings of text fields are read from: a whole answer's tree,
/// or a stream's chunk (light or not).
pub trait TextSource {
    /// The string `field` points at ("" when there is none).
    fn text_of(&self, field: &TextField) -> &str;
}

impl TextSource for Value {
    fn text_of(&self, field: &TextField) -> &str {
        field.text(self)
    }
}

impl<'a> ChunkTexts<'a> {
    /// The string `field` points at ("" when there is none): [`TextSource`]
    /// for the chunk's lifetime.
    pub fn text(self, field: &TextField) -> &'a str {
        let chunk = self.chunk;
        let Some(light) = &chunk.light else {
            return field.text(&chunk.event);
        };
        match (chunk.texts().next(), &light.text) {
            (Some(only), Some(text)) if only == field => match text {
                LightText::InData(range) => self.data.get(range.clone()).unwrap_or(""),
                LightText::Unescaped(text) => text,
            },
            _ => "",
        }
    }
}

impl TextSource for ChunkTexts<'_> {
    fn text_of(&self, field: &TextField) -> &str {
        self.text(field)
    }
}

/// The client-facing side of one verified stream: the provider's events,
/// held until the verifier lets their text out, then passed on edited (the
/// echo and canaries removed, the client's token limit applied), every
/// other field as the provider sent it.
pub trait StreamWriter: Send + 'static {
    /// Takes one provider event, already fed to the verifier: `spans[i]` is
    /// the span of its part that text field `i` of [`Chunk::texts`] carried.
    /// `event` is the event as received (its name and data), for events
    /// passed unchanged.
    fn take(&mut self, chunk: Chunk, event: SseEvent, spans: Spans);
    /// Writes to `out`, in order, every event held that `verifier` now lets
    /// out. `at_end`: the answer was verified and is delivered, so the
    /// events that end it (finish reasons, usage) go too.
    fn flush(&mut self, verifier: &Verifier, at_end: bool, out: &mut Vec<u8>);
    /// Why an event could not be passed on, once one could not (it had to
    /// change and could not be edited): nothing more is written, and the
    /// stream must end with an error rather than go on without it.
    fn failure(&self) -> Option<&str> {
        None
    }
    /// A buffer of an event written out, for the parser to read a later
    /// event into (`SseParser::recycle`); `None` when none is kept.
    fn spent(&mut self) -> Option<String> {
        None
    }
    /// What was delivered so far: budgets, cuts, canarygate's own tokens.
    fn delivery(&self) -> &Delivery;
    /// The same, to give it the provider's own count at the end
    /// ([`Delivery::fits_the_limit`]) before the last flush.
    fn delivery_mut(&mut self) -> &mut Delivery;
    /// The end marker, carrying the final verdict and canarygate's token
    /// overhead where the format can.
    fn done(&self, verdict: &Verdict) -> Vec<u8>;
    /// Whether the provider's last event was its own error event, written
    /// out, after which the stream may end without its end marker (a
    /// Responses stream's `error`): that end is the provider's, and gets no
    /// error event of canarygate's on top. (One still held is
    /// [`StreamWriter::take_unsent_provider_error`]'s.)
    fn ended_by_provider_error(&self) -> bool {
        false
    }
    /// The provider's own error event and its message, taken back when it
    /// was the last event taken and is still held (behind text not yet
    /// verified): the stream's end is then that error's, as had it come
    /// as [`EventView::Error`].
    fn take_unsent_provider_error(&mut self) -> Option<(SseEvent, String)> {
        None
    }
    /// `error` as the event that ends this stream, where it differs from
    /// the format's [`WireFormat::error_event`] (a Responses stream numbers
    /// its events); `None` for that one.
    fn error_event(&self, _error: &ApiError) -> Option<Vec<u8>> {
        None
    }
}

/// Turns the local engine's Chat Completions stream into a format's events.
pub trait LocalStream: Send + 'static {
    /// Writes to `out` what one event of the engine's stream (a chunk, an
    /// error, `[DONE]`) becomes in this format.
    fn translate(&mut self, event: &SseEvent, out: &mut Vec<u8>);
}

/// A wire format: see the module docs.
pub trait WireFormat: Send + Sync + 'static {
    /// The client-facing stream of a verified answer.
    type StreamWriter: StreamWriter;

    /// The local engine's stream in this format.
    type LocalStream: LocalStream;

    /// The endpoint's name in metrics, logs and audit records (the surface
    /// that served a request), e.g. `chat_completions`.
    const ENDPOINT: &'static str;

    /// The provider's endpoint, relative to its `base_url`.
    const PATH: &'static str;

    /// The API a provider must speak to serve this format.
    const API: ProviderApi;

    /// Request headers of the client's passed on to the provider (besides
    /// its key, which goes in the header the provider's API expects).
    const FORWARDED_HEADERS: &'static [&'static str];

    /// The request field that holds the prompt (`messages`, `input`,
    /// `prompt`): the `param` of an error about the prompt as a whole.
    const PROMPT_PARAM: &'static str;

    /// The request field that limits the answer's tokens (`max_tokens`,
    /// `max_output_tokens`): the `param` of an error about that limit.
    const LIMIT_PARAM: &'static str;

    /// Parses and validates the client's request.
    fn parse_request(bytes: &[u8]) -> Result<ClientRequest, ApiError>;

    /// Sets the model sent upstream.
    fn set_model(body: &mut Value, model: &str);

    /// The prompt as chat messages, for token counts.
    fn prompt_messages(body: &Value) -> Cow<'_, [Value]>;

    /// Whether earlier turns' canaries, the caller's own, come back in this
    /// request's context and so are not foreign: the provider adds a
    /// conversation it keeps (the Responses API's `previous_response_id`),
    /// or the request replays signed reasoning that keeps them (Anthropic's
    /// `thinking` blocks, delivered unedited).
    fn carries_earlier_canaries(_body: &Value) -> bool {
        false
    }

    /// Places `canaries` in `body` per `echo`, raising the client's output
    /// limit by what the echo costs the provider (`cost`), for a model whose
    /// chat template takes a system message or not (`system_role`: only
    /// Chat's prompt is a list of messages the format may add one to).
    fn place_canaries(
        body: &mut Value,
        echo: EchoMode,
        cost: EchoCost,
        canaries: RequestCanaries,
        system_role: SystemRole,
    ) -> Result<Injection, ApiError>;

    /// The choices (text fields, finish reasons) and usage of a whole answer.
    fn read_answer(answer: &Value) -> AnswerView;

    /// Usage as reported in a whole answer's bytes (without reading the rest).
    fn usage_in(answer: &[u8]) -> Option<ProviderUsage>;

    /// A whole answer read without its tree, when it has a shape this
    /// format reads that way ([`LightAnswer`]); `None` (the default) when
    /// it is to be read from its tree ([`Self::read_answer`]) and edited
    /// there ([`Self::deliver_answer`]).
    fn read_answer_light(_answer: &str) -> Option<LightAnswer> {
        None
    }

    /// One event of the provider's stream.
    fn read_event(event: &SseEvent) -> EventView;

    /// One event of the provider's stream, as [`Self::read_event`] reads
    /// it, with what the stream's earlier events taught (`memo`, which this
    /// may update) to read it sooner. The default forgets the memo.
    fn read_stream_event(event: &SseEvent, memo: &mut StreamMemo) -> EventView {
        let _ = memo;
        Self::read_event(event)
    }

    /// Whether `event` is the format's end-of-stream marker (a stream that
    /// ends without it was cut off).
    fn is_end_marker(event: &SseEvent) -> bool;

    /// A fresh writer for one verified stream, delivering by `delivery`.
    fn stream_writer(delivery: Delivery) -> Self::StreamWriter;

    /// Edits a verified whole answer for the client: each text field of
    /// `view` (whose span of its part is `spans[i]`, in the order of the
    /// view's fields) becomes what `verifier` and `delivery` leave of it,
    /// with what follows the text (logprobs, finish reasons, usage).
    fn deliver_answer(
        answer: &mut Value,
        view: &AnswerView,
        spans: &[Range<usize>],
        verifier: &Verifier,
        delivery: &mut Delivery,
    );

    /// Whether a provider's error body is already in this format (it is
    /// then passed on unchanged).
    fn is_error_body(body: &[u8]) -> bool;

    /// `error` in this format's shape.
    fn error_body(error: &ApiError) -> Vec<u8>;

    /// `error` as the event that ends a stream.
    fn error_event(error: &ApiError) -> Vec<u8>;

    /// The HTTP status a provider's error event (`data`) stands for, when it
    /// is an error in this format's shape, which is then its body: the
    /// answer the client gets when the provider fails its stream before
    /// anything of it went out, as had it failed before the stream began.
    fn error_event_status(_data: &str) -> Option<StatusCode> {
        None
    }

    /// The body of the answer a provider's error event (`data`) becomes
    /// ([`WireFormat::error_event_status`]): the event's data, where the
    /// format's error events are error bodies.
    fn error_event_body(data: &str) -> Vec<u8> {
        data.as_bytes().to_vec()
    }

    /// The client's request (as received, without canaries) as a Chat
    /// Completions request for the local engine; a request the engine
    /// cannot serve is an error in this format.
    fn local_request(body: &Value) -> Result<Value, ApiError>;

    /// The local engine's whole Chat Completions answer to
    /// [`WireFormat::local_request`] of `request`, in this format.
    fn local_answer(chat: Value, request: &Value) -> Value;

    /// A translator for the local engine's stream answering `request`,
    /// whose prompt the engine counts at `prompt_tokens`.
    fn local_stream(request: &Value, prompt_tokens: u64) -> Self::LocalStream;
}

/// Pushes onto `texts`, as [`Part::Other`] fields of choice `choice`, the
/// name of every member anywhere under `value` (at `at`) that holds a
/// canary-shaped span. A name is read, never edited: another request's
/// canary there fails the answer, and the request's own stays (no provider
/// names a member after a marker it was sent). Names shorter than a canary
/// are not searched, nor anything deeper than a [`Location`] reaches.
pub fn canary_shaped_names(value: &Value, at: Location, choice: u32, texts: &mut TextFields) {
    if !at.has_room() {
        return;
    }
    match value {
        Value::Object(members) => {
            for (position, (name, inner)) in members.iter().enumerate() {
                if name.len() >= CANONICAL_LEN && find_canaries(name).next().is_some() {
                    let n = texts.len() as u32;
                    texts.push(TextField {
                        choice,
                        kind: Part::Other(n),
                        at: at.name(position),
                    });
                }
                canary_shaped_names(inner, at.member(position), choice, texts);
            }
        }
        Value::Array(items) => {
            for (position, item) in items.iter().enumerate() {
                canary_shaped_names(item, at.index(position), choice, texts);
            }
        }
        _ => {}
    }
}

/// Takes out of `choices` the fields that are read only (a member's name,
/// [`canary_shaped_names`]; a token of logprobs: [`Location::read_only`]),
/// with their spans (`spans` in the order of the choices' fields): the
/// verifier reads them, the delivery never writes them, and the edits of
/// the texts around them may move them.
pub fn drop_read_only(choices: &mut [ChoiceView], spans: &mut Spans) {
    let is_read_only = |field: &TextField| field.at.is_read_only();
    if !choices
        .iter()
        .flat_map(|choice| &choice.texts)
        .any(is_read_only)
    {
        return;
    }
    let mut kept = Spans::new();
    let mut next = 0;
    for choice in choices {
        choice.texts.retain(|field| {
            let span = spans.get(next).cloned();
            next += 1;
            let keep = !is_read_only(field);
            if keep && let Some(span) = span {
                kept.push(span);
            }
            keep
        });
    }
    *spans = kept;
}

/// Puts `text` at `field.at` in `value` (the provider's answer or event).
pub fn put_text(value: &mut Value, field: &TextField, text: String) {
    if let Some(slot) = field.at.get_mut(value) {
        *slot = Value::String(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streams_texts_keep_their_places_order() {
        let place = |item, list, index| TextPlace { item, list, index };
        let mut memo = StreamMemo::default();
        for (at, in_order) in [
            (place(0, 0, 0), true),
            (place(0, 0, 0), true),
            (place(0, 1, 2), true),
            // Content and summary lists of one item are not ordered
            // between them; each is in itself.
            (place(0, 0, 1), true),
            (place(0, 1, 1), false),
            (place(0, 0, 0), false),
            (place(2, 0, 0), true),
            // Back to an earlier item, or its list's earlier index.
            (place(1, 0, 5), false),
            (place(2, 0, 3), true),
            (place(2, 0, 2), false),
            (place(3, 0, 0), true),
        ] {
            assert_eq!(memo.keeps_order(at), in_order, "{at:?}");
        }
    }
}

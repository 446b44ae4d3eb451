//! Incremental Server-Sent Events parser (WHATWG event-stream rules).
//!
//! Bytes arrive in arbitrary TCP-sized pieces; [`SseParser::feed`] buffers partial
//! lines and yields complete events. Handled: `\n`, `\r\n` and `\r` line endings
//! (including a `\r\n` split across two chunks), `data:` with and without the
//! space, comment lines (`:keep-alive`), multi-line `data` joined with `\n`,
//! `event:` and `id:` fields, and events split anywhere, even inside a UTF-8 character.
//! A consumer done with an event hands its buffers back ([`SpentBuffers`],
//! [`SseParser::recycle`]) and later events are read into them, so a
//! stream's events cost no allocation once it runs.

use std::borrow::Cow;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The `id:` field, if any.
    pub id: Option<String>,
}

impl SseEvent {
    /// True when this is the OpenAI end-of-stream marker `data: [DONE]`
    /// (read as the openai SDK reads it: data that starts with `[DONE]`).
    pub fn is_done(&self) -> bool {
        self.data.starts_with("[DONE]")
    }
}

/// Streaming parser state. Feed it bytes, collect events.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the current, incomplete line.
    line: Vec<u8>,
    /// The previous chunk ended with `\r`: a leading `\n` in the next chunk belongs to it.
    after_cr: bool,
    data: String,
    has_data: bool,
    event: Option<String>,
    id: Option<String>,
    /// Comment lines seen since the last reset (keep-alives).
    comments: u64,
    /// Buffers of events the caller is done with ([`SseParser::recycle`]):
    /// the next events' data and names are read into them.
    spares: Vec<String>,
}

/// The buffers of events a consumer is done with, held until they go back
/// to the parser ([`SseParser::recycle`]).
#[derive(Debug, Default)]
pub struct SpentBuffers(Vec<String>);

impl SpentBuffers {
    /// Keeps `event`'s data and name buffers (a few at most).
    pub fn keep(&mut self, event: SseEvent) {
        self.keep_data(event.data);
        if let Some(name) = event.event {
            self.keep_data(name);
        }
    }

    /// Keeps one buffer (a few at most).
    fn keep_data(&mut self, data: String) {
        if self.0.len() < SPARES {
            self.0.push(data);
        }
    }

    /// A buffer kept, if any.
    pub fn pop(&mut self) -> Option<String> {
        self.0.pop()
    }
}

/// Most buffers [`SseParser::recycle`] keeps.
const SPARES: usize = 8;
/// Largest buffer [`SseParser::recycle`] keeps: an event's data is mostly
/// one JSON chunk of a few hundred bytes.
const SPARE_BYTES: usize = 4096;

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of comment lines (e.g. `: keep-alive`) seen so far.
    pub fn comments_seen(&self) -> u64 {
        self.comments
    }

    /// True when bytes of an unfinished line or event are buffered.
    pub fn has_partial(&self) -> bool {
        !self.line.is_empty() || self.has_data || self.event.is_some()
    }

    /// Takes back a buffer (data or name) of an event the caller is done
    /// with, so a later event is read into it instead of a new one. Keeps
    /// a few buffers, none over a few KiB.
    pub fn recycle(&mut self, mut data: String) {
        if self.spares.len() < SPARES && (1..=SPARE_BYTES).contains(&data.capacity()) {
            data.clear();
            self.spares.push(data);
        }
    }

    /// Consumes `chunk` and appends every event it completes to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) {
        let mut rest = chunk;
        if self.after_cr {
            self.after_cr = false;
            if let Some(b'\n') = rest.first() {
                rest = &rest[1..];
            }
        }
        while let Some(pos) = memchr::memchr2(b'\n', b'\r', rest) {
            let (line, terminator) = (&rest[..pos], rest[pos]);
            rest = &rest[pos + 1..];
            if terminator == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            if self.line.is_empty() {
                // The whole line is in this chunk: read it where it is.
                self.process_line(line, out);
            } else {
                // Kept for its capacity: the next partial line reuses it.
                let mut whole = std::mem::take(&mut self.line);
                whole.extend_from_slice(line);
                self.process_line(&whole, out);
                whole.clear();
                self.line = whole;
            }
        }
        self.line.extend_from_slice(rest);
    }

    /// At the end of the stream, dispatches into `out` an event whose lines
    /// all ended but whose blank line never came: the SDKs take the end of
    /// the stream as its end (the spec discards it). A line cut before its
    /// end stays unfinished ([`SseParser::finish`] says so).
    pub fn flush_last_event(&mut self, out: &mut Vec<SseEvent>) {
        if self.line.is_empty() && self.has_data {
            self.process_line(&[], out);
        }
    }

    /// Ends the stream. Per the spec an unterminated event is discarded; the
    /// return value says whether anything was left unfinished, which for an
    /// OpenAI stream means it was cut.
    pub fn finish(&mut self) -> bool {
        let partial = self.has_partial();
        *self = Self {
            comments: self.comments,
            ..Self::default()
        };
        partial
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if self.has_data {
                let spare = self.spares.pop().unwrap_or_default();
                let mut data = std::mem::replace(&mut self.data, spare);
                if data.ends_with('\n') {
                    data.pop();
                }
                out.push(SseEvent {
                    event: self.event.take(),
                    data,
                    id: self.id.clone(),
                });
            } else {
                self.event = None;
            }
            self.has_data = false;
            return;
        }
        if line[0] == b':' {
            self.comments += 1;
            return;
        }
        // Valid UTF-8 is the rule: checked by `from_utf8`'s fast path, the
        // lossy decoding only for a line that is not.
        let line = match std::str::from_utf8(line) {
            Ok(line) => Cow::Borrowed(line),
            Err(_) => String::from_utf8_lossy(line),
        };
        let (field, value) = match line.find(':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(' ').unwrap_or(value))
            }
            None => (&line[..], ""),
        };
        match field {
            "data" => {
                // One allocation for the common one-line event.
                self.data.reserve(value.len() + 1);
                self.data.push_str(value);
                self.data.push('\n');
                self.has_data = true;
            }
            "event" => {
                let mut name = self.spares.pop().unwrap_or_default();
                name.push_str(value);
                self.event = Some(name);
            }
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {} // `retry` and unknown fields are ignored, as the spec says.
        }
    }
}

/// Encodes `value` as one SSE event's data, serialized straight into `out`:
/// compact JSON holds no line break, so it is one `data:` line.
pub fn encode_json(value: &serde_json::Value, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut *out, value).is_err() {
        // A `Value` always serializes; should it not, nothing half-written
        // goes out.
        out.truncate(start);
        return;
    }
    out.extend_from_slice(b"\n\n");
}

/// Encodes `data` as one SSE event (`data: ...` lines and a blank line).
/// SSE data cannot carry a carriage return: `\r\n`, `\r` and `\n` all end a
/// line, so the event decodes with every line break as `\n`.
pub fn encode_data(data: &str, out: &mut Vec<u8>) {
    if memchr::memchr2(b'\n', b'\r', data.as_bytes()).is_none() {
        // One line: JSON data, nearly always.
        out.reserve(data.len() + 8);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(data.as_bytes());
        out.extend_from_slice(b"\n\n");
        return;
    }
    for line in data.split("\r\n").flat_map(|part| part.split(['\r', '\n'])) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut out);
        }
        out
    }

    #[test]
    fn invalid_utf8_is_replaced_not_dropped() {
        let events = parse_all(&[b"data: caf\xe9 ok\n\n", b"data: \xc3\xa9t\xc3", b"\xa9\n\n"]);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "caf\u{fffd} ok");
        assert_eq!(events[1].data, "\u{e9}t\u{e9}");
    }

    #[test]
    fn data_with_and_without_space() {
        let events = parse_all(&[b"data: a\n\ndata:b\n\n"]);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "a");
        assert_eq!(events[1].data, "b");
    }

    #[test]
    fn multi_line_data_and_comments() {
        let events = parse_all(&[b": keep-alive\ndata: one\ndata: two\n\n:ping\n\n"]);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].data, "one\ntwo");
    }

    #[test]
    fn the_last_event_ends_with_the_stream_when_its_lines_did() {
        // Its line ended, its blank line never came: dispatched at the end.
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        parser.feed(b"data: one\n\ndata: [DONE] \n", &mut out);
        assert_eq!(out.len(), 1);
        parser.flush_last_event(&mut out);
        assert_eq!(out.len(), 2);
        assert!(out[1].is_done(), "read as the SDK reads it: {:?}", out[1]);
        assert!(!parser.finish());
        // A line cut before its end stays unfinished.
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        parser.feed(b"data: {\"cut\": tr", &mut out);
        parser.flush_last_event(&mut out);
        assert!(out.is_empty());
        assert!(parser.finish());
    }

    #[test]
    fn crlf_split_across_chunks() {
        let events = parse_all(&[b"data: x\r", b"\n\r", b"\ndata: [DONE]\r\n\r\n"]);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].data, "x");
        assert!(events[1].is_done());
    }

    #[test]
    fn utf8_split_inside_character() {
        let text = "data: h\u{e9}llo\n\n".as_bytes();
        let events = parse_all(&[&text[..8], &text[8..]]);
        assert_eq!(events[0].data, "h\u{e9}llo");
    }

    #[test]
    fn event_and_id_fields() {
        let events = parse_all(&[b"event: error\nid: 7\ndata: {}\n\n"]);
        assert_eq!(events[0].event.as_deref(), Some("error"));
        assert_eq!(events[0].id.as_deref(), Some("7"));
    }

    #[test]
    fn unterminated_event_is_reported_by_finish() {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        parser.feed(b"data: partial", &mut out);
        assert!(out.is_empty());
        assert!(parser.finish());
        assert!(!parser.finish());
    }

    #[test]
    fn recycled_buffers_hold_the_next_events() {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        parser.feed(b"data: first, a longer one\n\n", &mut events);
        let first = events.pop().expect("one event");
        let buffer = first.data.as_ptr();
        parser.recycle(first.data);
        parser.feed(b"data: second\n\ndata: third\n\n", &mut events);
        assert_eq!(
            events
                .iter()
                .map(|event| event.data.as_str())
                .collect::<Vec<_>>(),
            ["second", "third"],
            "a recycled buffer carries nothing over"
        );
        assert_eq!(
            events[1].data.as_ptr(),
            buffer,
            "the next event but one reuses it"
        );
        // Large buffers are not kept.
        parser.recycle(String::with_capacity(SPARE_BYTES + 1));
        assert!(parser.spares.is_empty());
    }

    #[test]
    fn json_is_encoded_as_its_text_is() {
        let value = serde_json::json!({"text": "two\nlines\r", "n": [1, 2.5, null]});
        let (mut direct, mut via_text) = (b"kept".to_vec(), b"kept".to_vec());
        encode_json(&value, &mut direct);
        encode_data(&value.to_string(), &mut via_text);
        assert_eq!(direct, via_text);
        assert_eq!(parse_all(&[&direct[4..]])[0].data, value.to_string());
    }

    #[test]
    fn encode_round_trips() {
        let mut bytes = Vec::new();
        encode_data("a\nb", &mut bytes);
        assert_eq!(parse_all(&[&bytes])[0].data, "a\nb");
    }
}

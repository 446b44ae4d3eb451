//! The simulated provider's shared paged KV pool.
//!
//! Every request's prompt is written here, position by position, into pages
//! of `page_tokens` positions, and the model's context is read back from
//! here. A position stores what a real KV entry encodes, in readable form:
//! the role of its message, whether it opens the message, and the text of the
//! token (empty for framing tokens); plus the id of the request that wrote it,
//! for the simulator's own bookkeeping (the model never looks at it).
//!
//! Pages are never cleared. Freeing a page only returns it to the free list,
//! so its positions keep the previous request's content (stale KV) until a
//! later request overwrites them. The free list is a stack: an allocation
//! takes the most recently freed pages first, in the order their request held
//! them, so a reservation larger than what it writes exposes the content of
//! the most recent requests first, then older ones.
//!
//! A request holds its pages only while its reply is computed: the simulated
//! model computes a whole reply at once, under the pool lock, and the pacing
//! of the response afterwards is presentation. So the pool never runs out of
//! pages while it has at least as many positions as the largest prompt
//! reserved ([`KvPool::run`] answers `None` otherwise).
//!
//! [`KvPool::run`] is one request's life: reserve pages for `reserved`
//! positions, write the given positions from the start, read `reserved`
//! positions back (attention over the whole reservation), free the pages.
//! Honest serving writes the whole prompt and reads exactly it back. The
//! `leak-on-overflow` mode reserves for the whole prompt but writes a
//! one-position placeholder, as SGLang did (issue #30233): the rest of what
//! it reads is stale.

use std::collections::BTreeSet;
use std::sync::Arc;

use canarygate_policies::tokens::{
    TOKENS_PER_MESSAGE, TOKENS_REPLY_PRIMING, content_text, count_text,
};
use serde_json::Value;

use super::model::{Segment, tokenize_keeping_spaces};

/// One KV position, in readable form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Position {
    /// A token of a chat message.
    Message {
        /// The role of its message.
        role: Arc<str>,
        /// It is the first position of its message.
        opens: bool,
        /// The text it decodes to; empty for framing (role markers, names).
        text: Box<str>,
    },
    /// A token that belongs to no message: reply priming, a placeholder.
    Control,
}

/// One written position and the request that wrote it.
#[derive(Debug, Clone)]
struct Slot {
    writer: u64,
    position: Position,
}

/// What a request read back from the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBack {
    /// The context the model sees: message-sized segments, in pool order.
    pub context: Vec<Segment>,
    /// Other requests whose positions were read, in ascending id order.
    pub other_writers: Vec<u64>,
}

/// A paged KV pool shared by all requests (see the module docs).
#[derive(Debug)]
pub struct KvPool {
    page_tokens: usize,
    /// Pages in the pool.
    capacity: usize,
    /// Each page's written positions, for pages used at least once (memory
    /// grows with use); never cleared, only overwritten.
    pages: Vec<Vec<Slot>>,
    /// Freed page indices; the next allocation pops from the end, then takes
    /// pages never used, in index order.
    free: Vec<usize>,
}

impl KvPool {
    /// A pool of at least `capacity_tokens` positions in pages of
    /// `page_tokens` positions (0 is taken as 1).
    pub fn new(capacity_tokens: u64, page_tokens: u32) -> Self {
        let page_tokens = page_tokens.max(1) as usize;
        let capacity = usize::try_from(capacity_tokens).unwrap_or(usize::MAX);
        Self {
            page_tokens,
            capacity: capacity.div_ceil(page_tokens).max(1),
            pages: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Positions per page.
    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.capacity
    }

    /// Pages free for a reservation now.
    pub fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.pages.len())
    }

    /// One request's life in the pool (see the module docs): `request`
    /// reserves pages for `reserved` positions, writes `written` from the
    /// first position (no more than the reservation holds), reads `reserved`
    /// positions back, and frees its pages. `None` when the pool has too few
    /// free pages for the reservation.
    pub fn run(&mut self, request: u64, reserved: u64, written: &[Position]) -> Option<ReadBack> {
        let reserved = usize::try_from(reserved).ok()?;
        let pages = self.reserve(reserved.div_ceil(self.page_tokens))?;
        self.write(&pages, request, written);
        let read = self.read(&pages, reserved, request);
        self.release(pages);
        Some(read)
    }

    /// Takes `count` pages: most recently freed first, then never used.
    fn reserve(&mut self, count: usize) -> Option<Vec<usize>> {
        if count > self.available() {
            return None;
        }
        let reused = count.min(self.free.len());
        let mut pages = self.free.split_off(self.free.len() - reused);
        pages.reverse();
        while pages.len() < count {
            pages.push(self.pages.len());
            self.pages.push(Vec::new());
        }
        Some(pages)
    }

    /// Returns `pages` so that the next reservation gets them in this order.
    fn release(&mut self, pages: Vec<usize>) {
        self.free.extend(pages.into_iter().rev());
    }

    fn write(&mut self, pages: &[usize], writer: u64, positions: &[Position]) {
        for (page, chunk) in pages.iter().zip(positions.chunks(self.page_tokens)) {
            let slots = &mut self.pages[*page];
            for (index, position) in chunk.iter().enumerate() {
                let slot = Slot {
                    writer,
                    position: position.clone(),
                };
                match slots.get_mut(index) {
                    Some(stale) => *stale = slot,
                    None => slots.push(slot),
                }
            }
        }
    }

    /// Reads the first `count` positions of `pages` as segments. Positions
    /// never written hold nothing and separate segments, as control
    /// positions do.
    fn read(&self, pages: &[usize], count: usize, reader: u64) -> ReadBack {
        let mut context = Vec::new();
        let mut others = BTreeSet::new();
        let mut current: Option<Segment> = None;
        let mut remaining = count;
        for page in pages {
            let slots = &self.pages[*page];
            let span = remaining.min(self.page_tokens);
            remaining -= span;
            for index in 0..span {
                let Some(slot) = slots.get(index) else {
                    context.extend(current.take());
                    continue;
                };
                let Position::Message { role, opens, text } = &slot.position else {
                    context.extend(current.take());
                    continue;
                };
                // Control positions carry no data: only message positions
                // count as reading another request.
                if slot.writer != reader {
                    others.insert(slot.writer);
                }
                match &mut current {
                    Some(segment) if !opens && segment.role == **role => {
                        segment.text.push_str(text);
                    }
                    _ => {
                        context.extend(current.take());
                        current = Some(Segment {
                            role: role.to_string(),
                            text: text.to_string(),
                        });
                    }
                }
            }
        }
        context.extend(current);
        ReadBack {
            context,
            other_writers: others.into_iter().collect(),
        }
    }
}

/// The KV positions of a chat `messages` array, one per prompt token as
/// [`canarygate_policies::tokens::count_chat_messages`] counts them: per
/// message the framing, the role, the content tokens, the name and tool
/// calls; then the reply priming.
pub fn prompt_positions(messages: &[Value]) -> Vec<Position> {
    let mut positions = Vec::new();
    for message in messages {
        let role_name = message.get("role").and_then(Value::as_str);
        let role: Arc<str> = Arc::from(role_name.unwrap_or("user"));
        let framing = |count: u64, positions: &mut Vec<Position>| {
            for _ in 0..count {
                positions.push(Position::Message {
                    role: role.clone(),
                    opens: false,
                    text: Box::from(""),
                });
            }
        };
        positions.push(Position::Message {
            role: role.clone(),
            opens: true,
            text: Box::from(""),
        });
        framing(TOKENS_PER_MESSAGE - 1, &mut positions);
        framing(role_name.map_or(0, count_text), &mut positions);
        if let Some(content) = message.get("content") {
            for token in tokenize_keeping_spaces(&content_text(content)) {
                positions.push(Position::Message {
                    role: role.clone(),
                    opens: false,
                    text: token.into_boxed_str(),
                });
            }
        }
        if let Some(name) = message.get("name").and_then(Value::as_str) {
            framing(count_text(name), &mut positions);
        }
        if let Some(tool_calls) = message.get("tool_calls") {
            framing(count_text(&tool_calls.to_string()), &mut positions);
        }
    }
    positions.extend((0..TOKENS_REPLY_PRIMING).map(|_| Position::Control));
    positions
}

/// The KV positions of a raw text prompt (legacy completions, embeddings):
/// its tokens, with no message framing and no reply priming; one `user`
/// segment when read back.
pub fn text_positions(text: &str) -> Vec<Position> {
    let role: Arc<str> = Arc::from("user");
    tokenize_keeping_spaces(text)
        .into_iter()
        .enumerate()
        .map(|(index, token)| Position::Message {
            role: role.clone(),
            opens: index == 0,
            text: token.into_boxed_str(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::tokens::count_chat_messages;
    use serde_json::json;

    fn messages(user: &str) -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": user}),
        ]
    }

    fn segment(role: &str, text: &str) -> Segment {
        Segment {
            role: role.into(),
            text: text.into(),
        }
    }

    #[test]
    fn positions_match_prompt_token_count() {
        let messages = vec![
            json!({"role": "system", "content": "  Be brief, please.\n"}),
            json!({"role": "user", "name": "ann", "content": [
                {"type": "text", "text": "first part"},
                {"type": "text", "text": "second"}
            ]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1"}]}),
            json!({"content": "no role"}),
        ];
        assert_eq!(
            prompt_positions(&messages).len() as u64,
            count_chat_messages(&messages)
        );
    }

    #[test]
    fn honest_request_reads_back_exactly_its_messages() {
        let mut pool = KvPool::new(64, 4);
        let messages = messages("Count the boats, all   of them.");
        let positions = prompt_positions(&messages);
        let read = pool
            .run(1, positions.len() as u64, &positions)
            .expect("fits");
        assert_eq!(
            read.context,
            [
                segment("system", "Be brief."),
                segment("user", "Count the boats, all   of them.")
            ]
        );
        assert!(read.other_writers.is_empty());

        // A shorter request over the same pages sees only itself, not the
        // stale positions after its own.
        let positions = prompt_positions(&[json!({"role": "user", "content": "hi"})]);
        let read = pool.run(2, positions.len() as u64, &positions).unwrap();
        assert_eq!(read.context, [segment("user", "hi")]);
        assert!(read.other_writers.is_empty());
    }

    #[test]
    fn placeholder_over_a_full_reservation_reads_stale_pages() {
        let mut pool = KvPool::new(256, 4);
        let first = "alpha report on tides and currents near the harbour";
        for (request, text) in [(1, first), (2, "beta notes")] {
            let positions = prompt_positions(&messages(text));
            pool.run(request, positions.len() as u64, &positions)
                .unwrap();
        }
        // Reserve for 40 positions, write one placeholder.
        let read = pool.run(3, 40, &[Position::Control]).unwrap();
        assert_eq!(read.other_writers, [1, 2]);
        // Request 2 wrote the most recently freed pages, read first; request
        // 1's positions past the end of request 2's prompt follow.
        assert_eq!(read.context[0], segment("system", "Be brief."));
        assert_eq!(read.context[1], segment("user", "beta notes"));
        let rest: String = read.context[2..]
            .iter()
            .map(|segment| segment.text.as_str())
            .collect();
        assert!(
            rest.contains("currents near the harbour"),
            "{:?}",
            read.context
        );
    }

    #[test]
    fn first_position_overwritten_keeps_rest_of_message() {
        let mut pool = KvPool::new(64, 8);
        let positions = prompt_positions(&messages("gamma"));
        pool.run(1, positions.len() as u64, &positions).unwrap();
        let read = pool
            .run(2, positions.len() as u64, &[Position::Control])
            .unwrap();
        assert_eq!(
            read.context,
            [segment("system", "Be brief."), segment("user", "gamma")]
        );
        assert_eq!(read.other_writers, [1]);
    }

    #[test]
    fn free_list_is_most_recent_first_and_never_loses_pages() {
        let mut pool = KvPool::new(40, 4);
        assert_eq!(pool.pages(), 10);
        let first = pool.reserve(3).unwrap();
        assert_eq!(first, [0, 1, 2]);
        let second = pool.reserve(2).unwrap();
        assert_eq!(second, [3, 4]);
        pool.release(second);
        pool.release(first);
        assert_eq!(pool.reserve(4).unwrap(), [0, 1, 2, 3]);
        assert_eq!(pool.reserve(7), None, "only 6 pages left");
        assert_eq!(pool.reserve(5).unwrap().len(), 5);
        assert_eq!(pool.available(), 1);
    }

    #[test]
    fn oversized_reservation_is_refused_without_panic() {
        let mut pool = KvPool::new(16, 4);
        assert_eq!(pool.run(1, 17, &[Position::Control]), None);
        assert_eq!(pool.run(1, u64::MAX, &[]), None);
        assert_eq!(pool.available(), 4, "a refused reservation takes nothing");
        // Writing more than the reservation holds stores what fits.
        let positions = prompt_positions(&messages("a long enough user message here"));
        let read = pool.run(2, 8, &positions).unwrap();
        assert_eq!(
            read.context,
            [segment("system", "Be brief."), segment("user", "")]
        );
        let zero = KvPool::new(0, 0);
        assert_eq!((zero.pages(), zero.page_tokens()), (1, 1));
        // Memory grows with use, not with the claimed capacity.
        let mut huge = KvPool::new(u64::MAX, 16);
        let positions = prompt_positions(&messages("tiny"));
        assert!(huge.run(1, positions.len() as u64, &positions).is_some());
        assert_eq!(huge.pages.len(), 1);
    }
}

//! What the model reads, in the simulator's own terms: every surface's
//! request becomes a [`Turn`], a [`Generation`] and one or more
//! [`Conversation`]s of chat-shaped messages, framed into prompt tokens,
//! truncated and cached as the provider does it.

use canarygate_policies::tokens::{
    TOKENS_PER_MESSAGE, TOKENS_REPLY_PRIMING, content_text, count_chat_messages, count_text,
};
use serde_json::{Value, json};

use crate::model::{Segment, tokenize_keeping_spaces};
use crate::pool::{Position, prompt_positions, text_positions};
use crate::request::Generation;
use crate::surface::Surface;

/// How a conversation becomes prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Chat messages: per-message framing and role, reply priming (OpenAI's
    /// accounting, [`count_chat_messages`]).
    Chat,
    /// One raw text (legacy completions, embeddings): its tokens only.
    Text,
}

/// How many messages before a breakpoint a cache hit is looked for
/// (Anthropic, "Prompt caching": the system checks for hits at up to 20
/// block boundaries before each explicit breakpoint).
pub const LOOKBACK_MESSAGES: usize = 20;

/// Which prompt prefixes the provider caches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheRule {
    /// Every long enough prefix, automatically (OpenAI's rules).
    Automatic,
    /// Only the prefixes ending at these breakpoints (Anthropic's
    /// `cache_control`); what is not read is written up to the last one.
    Breakpoints(Vec<Breakpoint>),
    /// Nothing (embeddings).
    Off,
}

/// Where a `cache_control` breakpoint ends a prefix: in message `message`
/// (an index into [`Conversation::messages`]), after `within` tokens of
/// its content, or after the whole message when `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakpoint {
    pub message: usize,
    pub within: Option<u64>,
}

/// One conversation the model reads: chat-shaped messages (`role`, text or
/// part `content`, `tool_calls`), which every surface's request comes down
/// to.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub messages: Vec<Value>,
    pub framing: Framing,
    pub cache: CacheRule,
}

impl Conversation {
    /// Chat messages, cached automatically.
    pub fn chat(messages: Vec<Value>) -> Self {
        Self {
            messages,
            framing: Framing::Chat,
            cache: CacheRule::Automatic,
        }
    }

    /// One raw text prompt.
    pub fn text(text: String, cache: CacheRule) -> Self {
        Self {
            messages: vec![json!({"role": "user", "content": text})],
            framing: Framing::Text,
            cache,
        }
    }

    /// Its prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        match self.framing {
            Framing::Chat => count_chat_messages(&self.messages),
            Framing::Text => self.messages.iter().map(|m| count_text(&text_of(m))).sum(),
        }
    }

    pub fn positions(&self, messages: &[Value]) -> Vec<Position> {
        match self.framing {
            Framing::Chat => prompt_positions(messages),
            Framing::Text => {
                let text: Vec<String> = messages.iter().map(|m| text_of(m).into_owned()).collect();
                text_positions(&text.concat())
            }
        }
    }

    /// What is left of it in a `truncate-*` mode: the first or last third
    /// of its messages dropped (at least one, never all); a text loses a
    /// third of its tokens instead. `None` when nothing can be dropped.
    /// The second value is how many messages went from the head.
    pub fn truncated(&self, head: bool) -> Option<(Vec<Value>, usize)> {
        let messages = &self.messages;
        if self.framing == Framing::Text {
            let tokens = tokenize_keeping_spaces(&text_of(messages.first()?));
            let drop = (tokens.len() / 3).max(1);
            if tokens.len() < 2 {
                return None;
            }
            let kept = if head {
                tokens[drop..].concat().trim_start().to_owned()
            } else {
                tokens[..tokens.len() - drop].concat()
            };
            return Some((vec![json!({"role": "user", "content": kept})], 0));
        }
        let drop = (messages.len() / 3)
            .max(1)
            .min(messages.len().saturating_sub(1));
        if drop == 0 {
            return None;
        }
        Some(if head {
            (messages[drop..].to_vec(), drop)
        } else {
            (messages[..messages.len() - drop].to_vec(), 0)
        })
    }

    /// The prefix lengths, in tokens, of the breakpoints that fall in
    /// `messages` (this conversation with `dropped` messages gone from its
    /// head).
    pub fn breakpoint_lengths(
        breakpoints: &[Breakpoint],
        messages: &[Value],
        dropped: usize,
    ) -> Vec<u64> {
        breakpoints
            .iter()
            .filter_map(|breakpoint| {
                let index = breakpoint.message.checked_sub(dropped)?;
                let message = messages.get(index)?;
                let before = count_chat_messages(&messages[..index]) - TOKENS_REPLY_PRIMING;
                let whole =
                    count_chat_messages(std::slice::from_ref(message)) - TOKENS_REPLY_PRIMING;
                let role = message["role"].as_str().map_or(0, count_text);
                Some(
                    before
                        + match breakpoint.within {
                            Some(tokens) => (TOKENS_PER_MESSAGE + role + tokens).min(whole),
                            None => whole,
                        },
                )
            })
            .collect()
    }

    /// The prefix lengths, in tokens, a hit may also end at besides the
    /// breakpoints: the ends of the [`LOOKBACK_MESSAGES`] messages before
    /// each breakpoint's (Anthropic looks back up to 20 blocks; here a
    /// message stands for a block).
    pub fn lookback_lengths(
        breakpoints: &[Breakpoint],
        messages: &[Value],
        dropped: usize,
    ) -> Vec<u64> {
        let mut lengths = Vec::new();
        for breakpoint in breakpoints {
            // A breakpoint the truncation took away looks back from nowhere.
            let Some(index) = breakpoint
                .message
                .checked_sub(dropped)
                .filter(|index| *index < messages.len())
            else {
                continue;
            };
            for end in index.saturating_sub(LOOKBACK_MESSAGES)..index {
                lengths.push(
                    count_chat_messages(&messages[..=end]).saturating_sub(TOKENS_REPLY_PRIMING),
                );
            }
        }
        lengths
    }
}

/// The text of a chat-shaped message's content.
pub fn text_of(message: &Value) -> std::borrow::Cow<'_, str> {
    message.get("content").map(content_text).unwrap_or_default()
}

/// One request in the simulator's own terms, from whatever surface.
#[derive(Debug, Clone)]
pub struct Turn {
    pub surface: Surface,
    pub generation: Generation,
    /// One per prompt (legacy completions and embeddings take several).
    pub conversations: Vec<Conversation>,
}

/// The messages of a conversation as the model would see them.
pub fn segments(messages: &[Value]) -> Vec<Segment> {
    messages
        .iter()
        .map(|message| Segment {
            role: message["role"].as_str().unwrap_or("user").to_owned(),
            text: text_of(message).into_owned(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_prompts_lose_a_third_of_their_tokens_when_truncated() {
        let text = Conversation::text("one two three four five six".into(), CacheRule::Automatic);
        assert_eq!(text.prompt_tokens(), 6);
        let (head, _) = text.truncated(true).unwrap();
        assert_eq!(head[0]["content"], "three four five six");
        let (tail, _) = text.truncated(false).unwrap();
        assert_eq!(tail[0]["content"], "one two three four");
        assert!(
            Conversation::text("one".into(), CacheRule::Off)
                .truncated(true)
                .is_none()
        );
        let chat = Conversation::chat(vec![json!({"role": "user", "content": "hi"})]);
        assert!(chat.truncated(true).is_none(), "never all of it");
    }

    #[test]
    fn breakpoints_end_where_their_block_ends() {
        let messages = vec![
            json!({"role": "system", "content": "alpha beta gamma"}),
            json!({"role": "user", "content": "one two\nthree"}),
        ];
        let conversation = Conversation::chat(messages.clone());
        let positions = conversation.positions(&messages);
        // system: 3 framing + 1 role + 3 words; user: 3 + 1 + 3.
        let lengths = Conversation::breakpoint_lengths(
            &[
                Breakpoint {
                    message: 0,
                    within: None,
                },
                Breakpoint {
                    message: 1,
                    within: Some(2),
                },
                Breakpoint {
                    message: 1,
                    within: None,
                },
            ],
            &messages,
            0,
        );
        assert_eq!(lengths, [7, 13, 14]);
        assert_eq!(positions.len() as u64, 14 + TOKENS_REPLY_PRIMING);
        // The head dropped: the system breakpoint is gone, the others move.
        let lengths = Conversation::breakpoint_lengths(
            &[
                Breakpoint {
                    message: 0,
                    within: None,
                },
                Breakpoint {
                    message: 1,
                    within: None,
                },
            ],
            &messages[1..],
            1,
        );
        assert_eq!(lengths, [7]);
    }
}

//! Which API a request came in on: its ids, its error shape, its
//! context-window error; and the tag that names a request in the KV pool.

use crate::error::{ErrorShape, SimError};

/// The wire format a request came in, and its answer goes out, in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages,
    /// `POST /v1/completions` (OpenAI's legacy completions).
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
}

impl Surface {
    /// Every surface, in the order of their stats.
    pub const ALL: [Self; 5] = [
        Self::Chat,
        Self::Responses,
        Self::Messages,
        Self::Completions,
        Self::Embeddings,
    ];

    /// The name in `/sim/stats`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
        }
    }

    /// Its position in [`Surface::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The id of the answer to request `number` on this surface (embeddings
    /// have none on the wire; theirs names them in ground-truth headers).
    pub fn answer_id(self, number: u64) -> String {
        match self {
            Self::Chat => format!("chatcmpl-sim-{number}"),
            Self::Responses => format!("resp_sim{number:012}"),
            Self::Messages => format!("msg_sim{number:012}"),
            Self::Completions => format!("cmpl-sim-{number}"),
            Self::Embeddings => format!("embd-sim-{number}"),
        }
    }

    /// The error format of this surface.
    pub fn error_shape(self) -> ErrorShape {
        match self {
            Self::Messages => ErrorShape::Anthropic,
            _ => ErrorShape::OpenAi,
        }
    }

    /// The 400 for a conversation of `prompt` tokens that, with `completion`
    /// tokens to generate, does not fit a window of `window` tokens.
    pub fn context_error(self, window: u64, prompt: u64, completion: u64) -> SimError {
        let requested = prompt.saturating_add(completion);
        let message = match self {
            Self::Chat => format!(
                "This model's maximum context length is {window} tokens. However, you \
                 requested {requested} tokens ({prompt} in the messages, {completion} in the \
                 completion). Please reduce the length of the messages or completion."
            ),
            Self::Responses => format!(
                "Your input exceeds the context window of this model ({window} tokens): \
                 {prompt} input tokens and {completion} for the output. Please adjust your \
                 input and try again."
            ),
            Self::Messages => format!("prompt is too long: {requested} tokens > {window} maximum"),
            Self::Completions | Self::Embeddings => format!(
                "This model's maximum context length is {window} tokens, however you requested \
                 {requested} tokens ({prompt} in your prompt; {completion} for the completion). \
                 Please reduce your prompt; or completion length."
            ),
        };
        let error = SimError::invalid_request(Some("context_length_exceeded"), message);
        match self {
            Self::Chat => error.with_param("messages"),
            Self::Responses | Self::Embeddings => error.with_param("input"),
            Self::Completions => error.with_param("prompt"),
            Self::Messages => error,
        }
    }

    /// The 400 for asking `model` for `asked` output tokens where it writes
    /// at most `cap`, worded as each API words it.
    pub fn output_cap_error(self, model: &str, cap: u64, asked: u64) -> SimError {
        match self {
            Self::Messages => SimError::invalid_request(
                None,
                format!(
                    "max_tokens: {asked} > {cap}, which is the maximum allowed number of output \
                     tokens for {model}"
                ),
            ),
            Self::Responses => SimError::invalid_request(
                Some("integer_above_max_value"),
                format!(
                    "Invalid 'max_output_tokens': integer above maximum value. Expected a value \
                     <= {cap}, but got {asked} instead."
                ),
            )
            .with_param("max_output_tokens"),
            Self::Chat | Self::Completions | Self::Embeddings => SimError::invalid_request(
                Some("invalid_value"),
                format!(
                    "max_tokens is too large: {asked}. This model supports at most {cap} \
                     completion tokens, whereas you provided {asked}."
                ),
            )
            .with_param("max_tokens"),
        }
    }
}

/// A request's number and surface in one `u64` (number × 8 + surface), the
/// writer id the KV pool keeps: ordered like the numbers, and enough to
/// name the answer of whoever wrote a stale position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RequestTag(u64);

impl RequestTag {
    /// The tag of request `number`, come in on `surface`.
    pub fn new(number: u64, surface: Surface) -> Self {
        Self(number.saturating_mul(8) + surface.index() as u64)
    }

    /// The tag a KV pool position names as its writer.
    pub fn from_writer(writer: u64) -> Self {
        Self(writer)
    }

    /// The KV pool's writer id.
    pub fn writer(self) -> u64 {
        self.0
    }

    /// The request's number (the `N` of its answer's id).
    pub fn number(self) -> u64 {
        self.0 / 8
    }

    fn surface(self) -> Surface {
        Surface::ALL[(self.0 % 8) as usize % Surface::ALL.len()]
    }

    /// The id of this request's answer.
    pub fn answer_id(self) -> String {
        self.surface().answer_id(self.number())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_name_the_answer_of_each_surface() {
        for surface in Surface::ALL {
            let tag = RequestTag::new(41, surface);
            assert_eq!(tag.number(), 41);
            assert_eq!(tag.answer_id(), surface.answer_id(41));
            assert!(
                RequestTag::new(40, Surface::Embeddings) < tag,
                "ordered by number"
            );
        }
        assert_eq!(
            RequestTag::new(7, Surface::Chat).answer_id(),
            "chatcmpl-sim-7"
        );
        assert_eq!(
            RequestTag::new(7, Surface::Messages).answer_id(),
            "msg_sim000000000007"
        );
    }
}

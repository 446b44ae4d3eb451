//! Placing a request's canaries into its chat completion request.
//!
//! Two canaries per request, placed so that every strict chat template still
//! accepts the conversation and the client's stable prefix stays
//! byte-identical (provider prompt caches keep hitting):
//!
//! - head: an instruction appended to the client's leading system (or
//!   `developer`) message after its own text, or a system message inserted
//!   first when there is none (for a model whose chat template refuses a
//!   system message, [`SystemRole::Refused`], appended to the first user
//!   message instead):
//!   `Begin your reply with "HEAD", a space and the CG code in square brackets
//!   below, on one line; then answer normally.` ([`ECHO_PHRASE`]). When the
//!   client's stable prefix runs past its system prompt (a conversation with
//!   earlier turns, or a cache breakpoint it marked in its turns:
//!   [`prefix_spans_turns`]), the head goes at the end of the last user
//!   message instead, before the tail, so the whole history stays cacheable;
//! - tail: a block `[TAIL]` appended to the last user message (to its last
//!   text part, or a new one, when its content is an array of parts:
//!   [`append_to_content`]).
//!
//! No message is added but that one system message, no role changes, and
//! assistant turns are never touched. Each block carries only its own
//! canary, so a prompt that lost its system message (when the head is there)
//! or its last user message loses one of them and the echo fails. Everything
//! before the head canary is the client's text and fixed text of ours.
//!
//! Passive markers (below) in a conversation that ends with a `tool`
//! message, a tool loop's newest round trip, both go at the end of it
//! ([`tool_loop_end`]) instead: the loop's earlier turns, resent with each
//! request, stay the client's own prefix. An echo instruction never goes
//! there: a model takes no orders from tool output.
//!
//! An obedient model opens its reply with `HEAD TAIL`; [`obedient_opening`] is
//! that rule, for simulated providers. In `head` echo mode the tail is a
//! passive marker. Requests in JSON mode, with tools, with a prefilled reply,
//! with a stop sequence that could cut the echo off or for a spoken reply
//! (and echo `off`) get
//! both canaries as passive markers ([`PassiveReason`]) (`(CANARY is a marker: never repeat it.)`):
//! no echo is asked, but a leak of this prompt into another answer is still
//! recognised. A conversation without a user message gets the tail after the
//! head, in the system message.

use serde::Serialize;
use serde_json::{Value, json};

use crate::canary::{CANONICAL_LEN, Canary, CanaryKey, find_canaries};
use crate::echo_cost::EchoCost;
use crate::registry::{MemoryRegistry, Registration};
use crate::tokens::{
    TOKENS_PER_MESSAGE, TOKENS_REPLY_PRIMING, content_text, count_chat_messages, count_text,
};
use crate::verify_config::EchoMode;

/// Opens the head instruction; the head canary and `"` follow. An obedient
/// model follows any instruction of this form, canarygate's or a client's.
pub const ECHO_PHRASE: &str = "Begin your reply with \"";

/// Follows the head canary's closing `"` in the head+tail instruction: what
/// asks for the tail too.
const ASKS_FOR_TAIL: &str = "\", a space and the CG code in square brackets below";

/// Ends the head instruction after its canary when the tail is echoed too.
const HEAD_TAIL_CLOSE: &str =
    "\", a space and the CG code in square brackets below, on one line; then answer normally.";

/// Ends the head instruction after its canary when the head alone is echoed.
const HEAD_ONLY_CLOSE: &str = "\" on its own line; then answer normally.";

/// Ends a passive marker after its canary.
const MARKER_CLOSE: &str = " is a marker: never repeat it.)";

/// The wording around the canary of each block of ours, before and after
/// it: what goes with the canary when a model quotes a block whole.
pub(crate) const BLOCK_WORDINGS: [(&str, &str); 4] = [
    (ECHO_PHRASE, HEAD_TAIL_CLOSE),
    (ECHO_PHRASE, HEAD_ONLY_CLOSE),
    ("[", "]"),
    ("(", MARKER_CLOSE),
];

/// What separates a block of ours from the client's text in the same string.
pub const BLOCK_SEPARATOR: &str = "\n\n";

/// Most choices (`n`) a verified request may ask for.
pub const MAX_CHOICES: u64 = 128;

/// The two canaries of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCanaries {
    /// Placed after the client's system prompt (in a conversation, at the
    /// end of its last user message, before the tail).
    pub head: Canary,
    /// Placed at the end of the last user message.
    pub tail: Canary,
}

impl RequestCanaries {
    /// Two fresh canaries ([`Canary::mint`]), not registered anywhere (see
    /// [`RequestCanaries::mint_registered`]).
    pub fn mint() -> Self {
        Self {
            head: Canary::mint(),
            tail: Canary::mint(),
        }
    }

    /// Two fresh canaries, both registered in `registry` to `registration`
    /// as they are drawn; values already live are refused and drawn again
    /// ([`MemoryRegistry::mint`]), so they are unique among live canaries and
    /// differ from each other. Returns their registry keys, head first.
    pub fn mint_registered(
        registry: &MemoryRegistry,
        registration: &Registration,
    ) -> (Self, [CanaryKey; 2]) {
        let (head, head_key) = registry.mint(registration);
        let (tail, tail_key) = registry.mint(registration);
        (Self { head, tail }, [head_key, tail_key])
    }
}

/// Why a request gets passive checks only (no echo).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PassiveReason {
    /// The policy sets `echo = "off"`.
    EchoOff,
    /// `response_format` asks for JSON: an echo would break it.
    JsonMode,
    /// The request offers tools or functions.
    Tools,
    /// The conversation ends with an assistant turn the model continues (a
    /// prefill): the reply goes on from the client's text, so it cannot
    /// open with the echo.
    Prefill,
    /// A stop sequence of the client's could end the reply inside the echo
    /// or right after it ([`stop_may_cut_echo`]).
    StopSequence,
    /// The reply is spoken (Chat's `modalities` with `"audio"`): the echo
    /// would be read aloud, and canarygate cannot take it out of the audio.
    Audio,
}

/// What in a request an echo would break, or be broken by; each is a
/// [`PassiveReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EchoObstacles {
    /// The request asks for JSON output.
    pub json_mode: bool,
    /// The request offers tools or functions.
    pub tools: bool,
    /// The model continues the conversation's last (assistant) turn.
    pub prefill: bool,
    /// One of the client's stop sequences could cut the echo off.
    pub stop_sequence: bool,
    /// The reply is spoken as well as written.
    pub audio: bool,
}

/// What [`inject`] did and what the verifier must expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injection {
    /// Both canaries; register both as belonging to this request.
    pub canaries: RequestCanaries,
    /// Canaries the reply must open with, in order (empty when passive).
    pub echo: Vec<Canary>,
    /// Set when no echo is asked.
    pub passive: Option<PassiveReason>,
    /// The request asked for a stream.
    pub stream: bool,
    /// Choices asked for (`n`, default 1).
    pub choices: u32,
    /// The client's own `max_tokens` / `max_completion_tokens`, if any.
    pub client_max_tokens: Option<u64>,
    /// Output tokens added to the client's limit for the echo
    /// ([`EchoCost::allowance`]); 0 when the limit was not raised.
    pub echo_allowance: u64,
    /// The fewest output tokens the echo costs the provider
    /// ([`EchoCost::least`]): what its count of an answer that echoed holds
    /// beside the text the client gets.
    pub echo_tokens_least: u64,
    /// The client asked for the usage chunk of a stream itself; when false the
    /// proxy added `stream_options.include_usage` and should not forward it.
    pub client_wants_usage: bool,
    /// Our prompt-token estimate of the modified request ([`crate::tokens`]).
    pub prompt_tokens_estimate: u64,
    /// Of those, the tokens canarygate added (the blocks and any message of
    /// ours), by the same estimate.
    pub prompt_tokens_added: u64,
    /// Our estimate of the prompt tokens before the head canary: the longest
    /// prefix this request can share with an earlier one, so the most a
    /// provider's prompt cache can honestly hold of it (the canary is fresh,
    /// and a cache matches prefixes only).
    pub cacheable_prompt_tokens: u64,
    /// Characters canarygate appended to the prompt text each choice
    /// continues, by choice index, for a format whose answers count
    /// positions from the start of the prompt (legacy completions'
    /// `text_offset`); empty for the others.
    pub prompt_chars_appended: Vec<usize>,
    /// Request fields canarygate changed that the provider's answer repeats
    /// (the Responses API's `instructions` and `max_output_tokens`), as the
    /// client sent them (`Null` for one it did not send): the answer gets
    /// them back. Empty for the formats whose answers repeat none.
    pub repeated_fields: Vec<(String, Value)>,
    /// A system message of canarygate's leads the conversation (the client
    /// sent none): a provider that refuses it refuses the template's
    /// system role ([`SystemRole`]), not the client's request.
    pub system_inserted: bool,
}

impl Injection {
    /// `tokens`, a count of part of this prompt by our estimate, in the units
    /// of `exact_prompt_tokens` (the whole prompt by the provider's tokenizer)
    /// when there is one: scaled by the ratio of the two whole-prompt counts.
    pub fn scaled_to_exact(&self, tokens: u64, exact_prompt_tokens: Option<u64>) -> u64 {
        match exact_prompt_tokens {
            Some(exact) if self.prompt_tokens_estimate > 0 => {
                let scaled = u128::from(tokens) * u128::from(exact)
                    / u128::from(self.prompt_tokens_estimate);
                u64::try_from(scaled).unwrap_or(u64::MAX)
            }
            _ => tokens,
        }
    }
}

/// A request the verifier cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    /// The body is not a JSON object.
    #[error("request body is not a JSON object")]
    NotAnObject,
    /// `messages` is missing, not an array, or empty.
    #[error("request has no `messages` array")]
    NoMessages,
    /// `n` is not a positive integer up to [`MAX_CHOICES`].
    #[error("`n` must be an integer from 1 to {MAX_CHOICES}")]
    BadChoiceCount,
    /// A message is not an object, or the content of a message the canaries
    /// go into is neither a string nor an array of content parts.
    #[error("`messages[{0}]` must be an object whose `content` is a string or an array of parts")]
    BadMessage(usize),
}

/// Whether the chat template a model is served through takes a system
/// message: most do; some refuse one (Gemma's raise `System role not
/// supported`, Mistral's first ones require the conversation to open with
/// a user turn). Most open-weight templates have no `developer` role: they
/// drop such a message, so without a system role it takes no block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SystemRole {
    /// A system message may lead the conversation.
    #[default]
    Accepted,
    /// No system message: the head block goes into the first user message
    /// when the client sent no system message of its own (the last one when
    /// [`prefix_spans_turns`]).
    Refused,
}

/// Places `canaries` into `request` (a chat completion body) per `echo`,
/// raising the client's limit by what the echo costs (`cost`), for a model
/// whose template takes a system message. On error the request is left as
/// it was.
pub fn inject(
    request: &mut Value,
    echo: EchoMode,
    cost: EchoCost,
    canaries: RequestCanaries,
) -> Result<Injection, InjectError> {
    inject_for(request, echo, cost, canaries, SystemRole::Accepted)
}

/// [`inject`] for a model whose template takes a system message or not
/// (`system_role`).
pub fn inject_for(
    request: &mut Value,
    echo: EchoMode,
    cost: EchoCost,
    canaries: RequestCanaries,
    system_role: SystemRole,
) -> Result<Injection, InjectError> {
    let body = request.as_object_mut().ok_or(InjectError::NotAnObject)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|messages| !messages.is_empty())
        .ok_or(InjectError::NoMessages)?;
    let prefill = continues_last_turn(messages, body);
    let choices = match body.get("n") {
        None | Some(Value::Null) => 1,
        Some(n) => n
            .as_u64()
            .filter(|n| (1..=MAX_CHOICES).contains(n))
            .ok_or(InjectError::BadChoiceCount)?,
    };
    let json_mode = body
        .get("response_format")
        .and_then(|format| format.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|kind| kind == "json_object" || kind == "json_schema");
    let has_tools = ["tools", "functions"].iter().any(|field| {
        body.get(*field)
            .and_then(Value::as_array)
            .is_some_and(|list| !list.is_empty())
    });
    let obstacles = EchoObstacles {
        json_mode,
        tools: has_tools,
        prefill,
        stop_sequence: stops_may_cut_echo(body.get("stop")),
        audio: speaks(body),
    };
    let passive = passive_reason(echo, obstacles);
    let placement = Placement::of(messages, system_role, passive.is_some())?;
    let Blocks {
        head: head_block,
        tail: tail_block,
        echo: expected,
    } = Blocks::new(echo, passive, canaries);

    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut client_wants_usage = true;
    if stream {
        let options = body.entry("stream_options").or_insert_with(|| json!({}));
        if !options.is_object() {
            *options = json!({});
        }
        client_wants_usage = options
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        options["include_usage"] = Value::Bool(true);
    }
    let mut client_max_tokens = None;
    let mut echo_allowance = 0;
    let allowance = cost.allowance(expected.len());
    let echo_tokens_least = cost.least(expected.len());
    for field in ["max_tokens", "max_completion_tokens"] {
        if let Some(limit) = body.get_mut(field)
            && let Some(value) = limit.as_u64()
        {
            client_max_tokens = Some(value);
            // A limit of 0, which providers refuse, goes as it came.
            if allowance > 0 && value > 0 {
                *limit = Value::from(value.saturating_add(allowance));
                echo_allowance = allowance;
            }
        }
    }

    let messages = body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .ok_or(InjectError::NoMessages)?;
    let prompt_tokens_before = count_chat_messages(messages);
    let added = placement.apply(messages, head_block, tail_block);
    let estimate =
        PromptEstimate::counted(prompt_tokens_before + added, added, messages, canaries.head);

    Ok(Injection {
        system_inserted: placement.inserts_system(),
        canaries,
        echo: expected,
        passive,
        stream,
        choices: choices as u32,
        client_max_tokens,
        echo_allowance,
        echo_tokens_least,
        client_wants_usage,
        prompt_tokens_estimate: estimate.total,
        prompt_tokens_added: estimate.added,
        cacheable_prompt_tokens: estimate.cacheable,
        prompt_chars_appended: Vec::new(),
        repeated_fields: Vec::new(),
    })
}

/// Why `echo` and the request's shape leave it passive checks only, if they
/// do: the policy turned the echo off, or an echo would break JSON output, a
/// tool call or a prefilled reply, or could be cut off by a stop sequence.
pub fn passive_reason(echo: EchoMode, obstacles: EchoObstacles) -> Option<PassiveReason> {
    if echo == EchoMode::Off {
        Some(PassiveReason::EchoOff)
    } else if obstacles.json_mode {
        Some(PassiveReason::JsonMode)
    } else if obstacles.tools {
        Some(PassiveReason::Tools)
    } else if obstacles.prefill {
        Some(PassiveReason::Prefill)
    } else if obstacles.stop_sequence {
        Some(PassiveReason::StopSequence)
    } else if obstacles.audio {
        Some(PassiveReason::Audio)
    } else {
        None
    }
}

/// Whether `stop`, one of the client's stop sequences, could end the reply
/// inside the echo or at its end, before any of the answer: it is empty
/// after trimming, or made only of what an echo and the text around it are
/// written with (digits, `CG` in either case, brackets, quotes, emphasis,
/// punctuation, spaces and line breaks). A stop sequence with any other
/// character (`User:`, `</answer>`, `###`) cannot occur there.
pub fn stop_may_cut_echo(stop: &str) -> bool {
    stop.chars().all(|c| {
        c.is_whitespace()
            || c.is_ascii_digit()
            || matches!(
                c,
                'C' | 'G'
                    | 'c'
                    | 'g'
                    | '['
                    | ']'
                    | '('
                    | ')'
                    | '"'
                    | '\''
                    | '`'
                    | '*'
                    | '_'
                    | '>'
                    | '.'
                    | ','
                    | ';'
                    | ':'
                    | '!'
                    | '-'
            )
    })
}

/// Whether any of the stop sequences in `stop` (a string or an array of
/// strings, as the APIs take them; anything else is left to the provider
/// to refuse) could cut the echo off ([`stop_may_cut_echo`]).
pub fn stops_may_cut_echo(stop: Option<&Value>) -> bool {
    match stop {
        Some(Value::String(stop)) => stop_may_cut_echo(stop),
        Some(Value::Array(stops)) => stops
            .iter()
            .filter_map(Value::as_str)
            .any(stop_may_cut_echo),
        _ => false,
    }
}

/// The echo to ask of a request whose body, as the client sent it, is
/// `client_request`. The head+tail instruction names the head and asks for
/// "the CG code in square brackets below": a prompt holding a `[CG` block of
/// its own (a ticket number, a pasted transcript) would give that phrase two
/// codes to choose from. Such a request's echo asks for the head alone,
/// which the instruction names, and its tail is a passive marker.
pub fn echo_for_request(echo: EchoMode, client_request: &[u8]) -> EchoMode {
    match echo {
        EchoMode::HeadTail if memchr::memmem::find(client_request, b"[CG").is_some() => {
            EchoMode::Head
        }
        echo => echo,
    }
}

/// The two texts a request's canaries are placed as, whatever the wire
/// format: the head goes with the system text (in a conversation, before
/// the tail: [`prefix_spans_turns`]), the tail at the end of the last user
/// text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocks {
    /// The head block: the echo instruction, or a passive marker.
    pub head: String,
    /// The tail block: `[TAIL]`, or a passive marker.
    pub tail: String,
    /// Canaries the reply must open with, in order (empty when passive).
    pub echo: Vec<Canary>,
}

impl Blocks {
    /// The blocks of `canaries` under `echo`, passive when `passive` says so.
    pub fn new(echo: EchoMode, passive: Option<PassiveReason>, canaries: RequestCanaries) -> Self {
        let RequestCanaries { head, tail } = canaries;
        let (head_block, tail_block, expected) = match (passive, echo) {
            (None, EchoMode::HeadTail) => (
                format!("{ECHO_PHRASE}{head}{HEAD_TAIL_CLOSE}"),
                tail_block(tail),
                vec![head, tail],
            ),
            (None, _) => (
                format!("{ECHO_PHRASE}{head}{HEAD_ONLY_CLOSE}"),
                passive_marker(tail),
                vec![head],
            ),
            (Some(_), _) => (passive_marker(head), passive_marker(tail), Vec::new()),
        };
        Self {
            head: head_block,
            tail: tail_block,
            echo: expected,
        }
    }
}

/// Our token estimates of a prompt whose canaries were placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptEstimate {
    /// The whole prompt.
    pub total: u64,
    /// What canarygate added.
    pub added: u64,
    /// What comes before the head canary: the most a prompt cache can hold.
    pub cacheable: u64,
}

impl PromptEstimate {
    /// The estimates for `messages` (the prompt as chat messages, after the
    /// placement; a wire format converts its own prompt), which counted
    /// `before` tokens without canarygate's blocks, `head` its head canary.
    pub fn of(before: u64, messages: &[Value], head: Canary) -> Self {
        let total = count_chat_messages(messages);
        Self::counted(total, total.saturating_sub(before), messages, head)
    }

    /// The estimates for `messages` (after the placement), known to count
    /// `total` tokens of which canarygate added `added`.
    fn counted(total: u64, added: u64, messages: &[Value], head: Canary) -> Self {
        let canary = head.to_string();
        let holds_head = messages.iter().position(|message| {
            message
                .get("content")
                .is_some_and(|content| content_text(content).contains(&canary))
        });
        let cacheable = match holds_head {
            Some(index) => {
                count_chat_messages(&messages[..index]).saturating_sub(TOKENS_REPLY_PRIMING)
                    + tokens_before(&messages[index], head)
            }
            None => total,
        };
        Self {
            total,
            added,
            cacheable,
        }
    }
}

/// Appends `block` to a content slot after the client's own text: to a
/// string after [`BLOCK_SEPARATOR`]; to an array of parts, at the end of its
/// last part's text when that part is a plain text part (`type` and `text`
/// alone: published templates that read a system message's first part only,
/// such as Gemma 3's and Mistral Small's, then still show it), else as a
/// new part `{"type": part_type, "text": ...}` (a part with `cache_control`
/// stays byte-identical, so the provider's cache still holds it); a missing
/// (`Null`) or empty content becomes the block. Returns false, changing
/// nothing, when the content is something else.
pub fn append_to_content(content: &mut Value, block: &str, part_type: &str) -> bool {
    match content {
        Value::String(text) if !text.is_empty() => {
            text.push_str(BLOCK_SEPARATOR);
            text.push_str(block);
        }
        Value::Array(parts) => match parts
            .last_mut()
            .and_then(|last| plain_text(last, part_type))
        {
            Some(text) => {
                text.push_str(BLOCK_SEPARATOR);
                text.push_str(block);
            }
            None => parts.push(json!({
                "type": part_type,
                "text": format!("{BLOCK_SEPARATOR}{block}"),
            })),
        },
        Value::Null | Value::String(_) => *content = Value::String(block.to_owned()),
        _ => return false,
    }
    true
}

/// The text of `part` when it is a plain text part of type `part_type`: its
/// `type` and a string `text`, nothing else.
fn plain_text<'a>(part: &'a mut Value, part_type: &str) -> Option<&'a mut String> {
    let part = part.as_object_mut()?;
    if part.len() != 2 || part.get("type")?.as_str()? != part_type {
        return None;
    }
    match part.get_mut("text")? {
        Value::String(text) => Some(text),
        _ => None,
    }
}

/// Our estimate of the prompt tokens before `canary` within `message`, the
/// message holding it: that message's framing and role, and its text up to
/// the canary.
fn tokens_before(message: &Value, canary: Canary) -> u64 {
    let role = message.get("role").and_then(Value::as_str).unwrap_or("");
    let text = message.get("content").map(content_text).unwrap_or_default();
    let canary = canary.to_string();
    let before = text.find(&canary).map_or(text.as_ref(), |at| &text[..at]);
    TOKENS_PER_MESSAGE + count_text(role) + count_text(before)
}

/// Whether the model is asked to continue the conversation's last message,
/// an assistant turn, instead of answering after it: the turn says so
/// (`prefix: true`, DeepSeek's and Mistral's prefill), or the request does
/// (`continue_final_message: true` or `add_generation_prompt: false`, as
/// vLLM and SGLang take them). OpenAI's API answers after an assistant turn.
fn continues_last_turn(messages: &[Value], body: &serde_json::Map<String, Value>) -> bool {
    let Some(last) = messages.last() else {
        return false;
    };
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return false;
    }
    last.get("prefix").and_then(Value::as_bool) == Some(true)
        || body.get("continue_final_message").and_then(Value::as_bool) == Some(true)
        || body.get("add_generation_prompt").and_then(Value::as_bool) == Some(false)
}

/// Whether a conversation's stable prefix, the part a provider's prompt
/// cache can hold across requests, runs past its system prompt: an
/// assistant turn comes before the last user message (the earlier turns of
/// a chat, few-shot examples, the history before a user's newest request;
/// not a tool loop's turns after that message, which stay untouched and new
/// to the cache), or a user message up to the last one marks a cache
/// breakpoint in its parts (`cache_control`, as Anthropic's API and the
/// gateways that take its caching read it). The head canary, fresh in every
/// request, then goes with the tail at the end of the last user message: a
/// head after the system prompt would make every turn after it new to the
/// cache. `messages` are chat-shaped (`role`, `content`), as Chat
/// Completions and Anthropic's Messages both send them.
pub fn prefix_spans_turns(messages: &[Value]) -> bool {
    fn role(message: &Value) -> Option<&str> {
        message.get("role").and_then(Value::as_str)
    }
    let Some(last_user) = messages.iter().rposition(|m| role(m) == Some("user")) else {
        return false;
    };
    let marks_cache = |message: &Value| {
        message
            .get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| {
                parts.iter().any(|part| {
                    part.get("cache_control")
                        .is_some_and(|marker| !marker.is_null())
                })
            })
    };
    let turns = &messages[..=last_user];
    turns.iter().any(|m| role(m) == Some("assistant"))
        || turns
            .iter()
            .any(|m| role(m) == Some("user") && marks_cache(m))
}

/// Whether a Chat request asks for a spoken reply: `"audio"` among its
/// `modalities`, or an `audio` output format.
fn speaks(body: &serde_json::Map<String, Value>) -> bool {
    let modalities = body.get("modalities").and_then(Value::as_array);
    modalities.is_some_and(|list| list.iter().any(|m| m.as_str() == Some("audio")))
        || body.get("audio").is_some_and(Value::is_object)
}

/// The index of the tool output that ends a conversation, if one does: a
/// tool loop's newest round trip (`tool` messages after the assistant turn
/// that called them), which the loop's next request resends whole before
/// its own. Passive markers go there: anywhere earlier, fresh in every
/// request, they would make the loop's turns new to the provider's cache
/// each time. An echo instruction does not: models are taught to take no
/// orders from tool output. Nor do markers go into a legacy `function`
/// message: most published chat templates have no such role and drop the
/// message, markers and all.
pub fn tool_loop_end(messages: &[Value]) -> Option<usize> {
    let last = messages.len().checked_sub(1)?;
    let role = messages[last].get("role").and_then(Value::as_str);
    (role == Some("tool")).then_some(last)
}

/// Which messages the blocks go into, checked before anything changes.
struct Placement {
    /// The first message is a system or developer message (the head joins it
    /// unless a later turn takes it).
    leading_system: bool,
    /// The turn the head joins, if one does: the tool output ending a tool
    /// loop when the blocks are passive ([`tool_loop_end`]); the last user
    /// message when the stable prefix spans turns ([`prefix_spans_turns`]);
    /// else the first user message when there is no leading system message
    /// and the template takes none ([`SystemRole::Refused`]).
    head_turn: Option<usize>,
    /// The turn the tail joins, if any: that tool output, else the last user
    /// message.
    tail_turn: Option<usize>,
}

impl Placement {
    /// Where the blocks of a request go; `passive` when they ask no echo.
    fn of(messages: &[Value], system_role: SystemRole, passive: bool) -> Result<Self, InjectError> {
        let role = |index: usize| messages[index].get("role").and_then(Value::as_str);
        // A template without a system role has no `developer` role either:
        // most published ones drop such a message (and a head in it).
        let leading_system = match role(0) {
            Some("system") => true,
            Some("developer") => system_role == SystemRole::Accepted,
            _ => false,
        };
        let last_user = (0..messages.len()).rev().find(|&i| role(i) == Some("user"));
        let tool_output = if passive {
            tool_loop_end(messages)
        } else {
            None
        };
        let head_turn = match system_role {
            _ if tool_output.is_some() => tool_output,
            _ if prefix_spans_turns(messages) => last_user,
            SystemRole::Refused if !leading_system => {
                (0..messages.len()).find(|&i| role(i) == Some("user"))
            }
            _ => None,
        };
        let tail_turn = tool_output.or(last_user);
        let system_takes_head = leading_system && head_turn.is_none();
        for index in [system_takes_head.then_some(0), head_turn, tail_turn]
            .into_iter()
            .flatten()
        {
            let message = messages[index]
                .as_object()
                .ok_or(InjectError::BadMessage(index))?;
            match message.get("content") {
                None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
                Some(_) => return Err(InjectError::BadMessage(index)),
            }
        }
        Ok(Self {
            leading_system,
            head_turn,
            tail_turn,
        })
    }

    /// Whether [`Self::apply`] inserts a system message of its own.
    fn inserts_system(&self) -> bool {
        !self.leading_system && self.head_turn.is_none()
    }

    /// Places the blocks; returns the tokens that adds to the prompt's
    /// [`count_chat_messages`]. Counted from the blocks alone, not by
    /// counting the prompt again: a block joins a text after
    /// [`BLOCK_SEPARATOR`] (or a newline, between parts), whitespace that
    /// ends the text's last piece, so a text's count grows by exactly the
    /// block's; a content that was not a string or parts counted nothing
    /// ([`Self::of`] refused any other shape), and a new system message
    /// adds its framing and role.
    fn apply(&self, messages: &mut Vec<Value>, head_block: String, tail_block: String) -> u64 {
        let mut added = count_text(&head_block) + count_text(&tail_block);
        if let (Some(first), Some(last)) = (self.head_turn, self.tail_turn) {
            // The same message when there is one user turn, the prefix
            // spans turns or a tool loop's output takes both: the head, then
            // the tail block it points to.
            append_block(&mut messages[first], head_block);
            append_block(&mut messages[last], tail_block);
            return added;
        }
        let mut system_blocks = vec![head_block];
        match self.tail_turn {
            Some(index) => append_block(&mut messages[index], tail_block),
            None => system_blocks.push(tail_block),
        }
        if self.leading_system {
            for block in system_blocks {
                append_block(&mut messages[0], block);
            }
        } else {
            let content = system_blocks.join(BLOCK_SEPARATOR);
            messages.insert(0, json!({"role": "system", "content": content}));
            added += TOKENS_PER_MESSAGE + count_text("system");
        }
        added
    }
}

/// Appends `block` to `message`'s content after the client's own text, as
/// [`append_to_content`] does with text parts. Missing or null content
/// becomes the block.
fn append_block(message: &mut Value, block: String) {
    let Some(message) = message.as_object_mut() else {
        return;
    };
    let content = message.entry("content").or_insert(Value::Null);
    if !append_to_content(content, &block, "text") {
        *content = Value::String(block);
    }
}

fn tail_block(canary: Canary) -> String {
    format!("[{canary}]")
}

fn passive_marker(canary: Canary) -> String {
    format!("({canary}{MARKER_CLOSE}")
}

/// The kinds of text canarygate places into prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    /// `Begin your reply with "CANARY"...`
    Head,
    /// `[CANARY]`
    Tail,
    /// `(CANARY is a marker...`
    Marker,
}

/// Every block of ours in `text`: where it starts, what it is, its canary.
fn blocks(text: &str) -> impl Iterator<Item = (usize, BlockKind, Canary)> + '_ {
    find_canaries(text)
        .filter(|found| found.end - found.start == CANONICAL_LEN)
        .filter_map(move |found| {
            let (before, after) = (&text[..found.start], &text[found.end..]);
            let phrase = ECHO_PHRASE.len();
            if before.ends_with(ECHO_PHRASE) && after.starts_with('"') {
                Some((found.start - phrase, BlockKind::Head, found.canary))
            } else if before.ends_with('[') && after.starts_with(']') {
                Some((found.start - 1, BlockKind::Tail, found.canary))
            } else if before.ends_with('(') && after.starts_with(" is a marker") {
                Some((found.start - 1, BlockKind::Marker, found.canary))
            } else {
                None
            }
        })
}

/// The client's own part of a message text canarygate injected into: the
/// text before the first block of ours, without the separator.
pub fn client_text(text: &str) -> &str {
    match blocks(text).next() {
        Some((start, _, _)) => {
            let before = &text[..start];
            before.strip_suffix(BLOCK_SEPARATOR).unwrap_or(before)
        }
        None => text,
    }
}

/// What an obedient model opens its reply with, given the texts of the
/// messages it sees, in order: `head tail`, `head`, `tail`, or `None`.
///
/// - head: the text quoted after the last [`ECHO_PHRASE`] of the first text
///   that has one (canarygate's instruction, or a client's own `Begin your
///   reply with "..."`; a later instruction in the same message overrides an
///   earlier one). Empty or unterminated quotes do not count;
/// - tail: the canary of the first tail block `[CANARY]`, when the head's
///   instruction asks for it (or there is none).
///
/// For simulated providers, which follow whatever canarygate asks.
pub fn obedient_opening<'a>(texts: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut head: Option<&str> = None;
    let mut asks_for_tail = true;
    let mut tail = None;
    for text in texts {
        if head.is_none()
            && let Some((quoted, after)) = last_quoted_after(text, ECHO_PHRASE)
        {
            head = Some(quoted);
            asks_for_tail = after.starts_with(ASKS_FOR_TAIL);
        }
        if tail.is_none() {
            tail = blocks(text)
                .find(|(_, kind, _)| *kind == BlockKind::Tail)
                .map(|(_, _, canary)| canary);
        }
    }
    match (head, tail.filter(|_| asks_for_tail)) {
        (Some(head), Some(tail)) => Some(format!("{head} {tail}")),
        (Some(head), None) => Some(head.to_owned()),
        (None, tail) => tail.map(|tail| tail.to_string()),
    }
}

/// [`obedient_opening`] of a conversation's turns, `(role, text)` in order:
/// the turns after its last assistant turn decide when one of them asks for
/// an opening (an instruction there is for this reply; one in an earlier
/// turn was for the reply that followed it, as the history of a
/// conversation the provider keeps holds them), else all of them do.
pub fn obedient_opening_of_turns(turns: &[(&str, &str)]) -> Option<String> {
    let newest = turns
        .iter()
        .rposition(|(role, _)| *role == "assistant")
        .map_or(0, |last| last + 1);
    let asks = turns[newest..]
        .iter()
        .any(|(_, text)| last_quoted_after(text, ECHO_PHRASE).is_some());
    let from = if asks { newest } else { 0 };
    obedient_opening(turns[from..].iter().map(|(_, text)| *text))
}

/// [`obedient_opening_of_turns`] of a chat completion request's messages.
pub fn obedient_echo(request: &Value) -> Option<String> {
    let messages = request.get("messages")?.as_array()?;
    let texts: Vec<_> = messages
        .iter()
        .map(|message| {
            let role = message.get("role").and_then(Value::as_str).unwrap_or("");
            let text = message.get("content").map(content_text).unwrap_or_default();
            (role, text)
        })
        .collect();
    let turns: Vec<(&str, &str)> = texts
        .iter()
        .map(|(role, text)| (*role, text.as_ref()))
        .collect();
    obedient_opening_of_turns(&turns)
}

/// The non-empty text between the last `phrase` of `text` that has one and
/// the next `"`, and the rest of `text` from that `"` on.
fn last_quoted_after<'a>(text: &'a str, phrase: &str) -> Option<(&'a str, &'a str)> {
    text.match_indices(phrase)
        .filter_map(|(start, _)| {
            let rest = &text[start + phrase.len()..];
            let (quoted, after) = rest.split_at(rest.find('"')?);
            Some((quoted, after)).filter(|(quoted, _)| !quoted.is_empty())
        })
        .last()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    fn canaries() -> RequestCanaries {
        RequestCanaries {
            head: Canary::from_random([1; 10]),
            tail: Canary::from_random([2; 10]),
        }
    }

    fn request() -> Value {
        json!({
            "model": "m",
            "max_tokens": 100,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me a joke"}
            ]
        })
    }

    fn text(message: &Value) -> String {
        content_text(&message["content"]).into_owned()
    }

    #[test]
    fn head_joins_the_system_message_and_tail_ends_the_last_user_message() {
        let original = request();
        let mut body = original.clone();
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2, "no message added");
        let (head, tail) = (canaries().head.to_string(), canaries().tail.to_string());
        let system = text(&messages[0]);
        assert!(system.starts_with(&format!("Be brief.{BLOCK_SEPARATOR}{ECHO_PHRASE}{head}\"")));
        assert!(!system.contains(&tail));
        let last = text(&messages[1]);
        assert_eq!(last, format!("Tell me a joke{BLOCK_SEPARATOR}[{tail}]"));
        assert_eq!(injection.echo, [canaries().head, canaries().tail]);
        assert_eq!(injection.passive, None);
        assert_eq!(injection.client_max_tokens, Some(100));
        let allowance = COST.allowance(2);
        assert_eq!(injection.echo_allowance, allowance);
        assert_eq!(body["max_tokens"], 100 + allowance);
        assert_eq!(obedient_echo(&body).unwrap(), format!("{head} {tail}"));
        assert_eq!(client_text(&system), "Be brief.");
        assert_eq!(client_text(&last), "Tell me a joke");
        assert_eq!(client_text("no block here"), "no block here");
    }

    #[test]
    fn a_conversation_keeps_its_history_before_the_head() {
        let (head, tail) = (canaries().head.to_string(), canaries().tail.to_string());
        let history = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Tell me a joke"}
        ]);
        // Earlier turns: everything before the last user message is the
        // client's, byte for byte; both blocks end that message.
        let mut body = json!({"messages": history.clone()});
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages[..3], history.as_array().unwrap()[..3]);
        let last = text(&messages[3]);
        assert_eq!(
            last,
            format!(
                "Tell me a joke{BLOCK_SEPARATOR}{ECHO_PHRASE}{head}{HEAD_TAIL_CLOSE}{BLOCK_SEPARATOR}[{tail}]"
            )
        );
        assert!(!injection.system_inserted);
        assert_eq!(obedient_echo(&body).unwrap(), format!("{head} {tail}"));
        assert_eq!(
            injection.cacheable_prompt_tokens,
            count_chat_messages(&messages[..3]) - TOKENS_REPLY_PRIMING
                + TOKENS_PER_MESSAGE
                + count_text("user")
                + count_text(&format!("Tell me a joke{BLOCK_SEPARATOR}{ECHO_PHRASE}"))
        );
        assert_eq!(
            injection.prompt_tokens_estimate,
            count_chat_messages(messages)
        );
        // Without a system message of the client's, none is added.
        let mut body = json!({"messages": history.as_array().unwrap()[1..]});
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(body["messages"].as_array().unwrap().len(), 3);
        assert!(!injection.system_inserted);
        assert!(text(&body["messages"][2]).contains(&head));

        // One turn that marks a cache breakpoint in its parts: the head
        // follows the marked part, which stays byte-identical.
        let marked = json!({"type": "text", "text": "Long document.", "cache_control": {"type": "ephemeral"}});
        let mut body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [marked.clone(), {"type": "text", "text": "Question?"}]}
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(text(&body["messages"][0]), "Be brief.");
        assert_eq!(body["messages"][1]["content"][0], marked);
        let last = text(&body["messages"][1]);
        assert!(
            last.find(&head).unwrap() < last.find(&tail).unwrap(),
            "{last}"
        );

        // A mark on the system message alone, a single turn: the system
        // prompt is the stable prefix, the head follows it as before.
        let mut body = json!({"messages": [
            {"role": "system", "content": [marked.clone()]},
            {"role": "user", "content": "Question?"}
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(body["messages"][0]["content"][0], marked);
        assert!(text(&body["messages"][0]).contains(&head));
        assert!(!text(&body["messages"][1]).contains(&head));

        // A tool loop after the last user message, asked for an echo (no
        // tools offered): the head follows the system prompt (a model takes
        // no orders from tool output), the tool turns are untouched.
        let mut body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}
        ]});
        let original = body.clone();
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert!(text(&body["messages"][0]).contains(&head));
        assert_eq!(
            body["messages"].as_array().unwrap()[2..],
            original["messages"].as_array().unwrap()[2..]
        );
    }

    #[test]
    fn a_tool_loop_keeps_its_turns_before_passive_markers() {
        let (head, tail) = (canaries().head.to_string(), canaries().tail.to_string());
        let call = |id: &str| {
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": "w", "arguments": "{}"}}]})
        };
        let loop_turns = json!([
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather?"},
            call("c1"),
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
            call("c2"),
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "Warm"}]}
        ]);
        let tools = json!([{"type": "function", "function": {"name": "w"}}]);
        let mut body = json!({"messages": loop_turns.clone(), "tools": tools.clone()});
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(injection.passive, Some(PassiveReason::Tools));
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 6, "no message added");
        // Every turn before the newest output is the client's, byte for
        // byte; both markers end that output, in its own text part.
        assert_eq!(messages[..5], loop_turns.as_array().unwrap()[..5]);
        let parts = messages[5]["content"].as_array().unwrap();
        assert_eq!(parts.len(), 1);
        let output = parts[0]["text"].as_str().unwrap();
        assert_eq!(
            output,
            format!(
                "Warm{BLOCK_SEPARATOR}({head}{MARKER_CLOSE}{BLOCK_SEPARATOR}({tail}{MARKER_CLOSE}"
            )
        );
        assert_eq!(client_text(output), "Warm");
        assert!(!injection.system_inserted);
        assert_eq!(
            injection.cacheable_prompt_tokens,
            count_chat_messages(&messages[..5]) - TOKENS_REPLY_PRIMING
                + TOKENS_PER_MESSAGE
                + count_text("tool")
                + count_text(&format!("Warm{BLOCK_SEPARATOR}("))
        );

        // Without a system message, or in a template without a system
        // role, none is added and the output still takes both.
        for role in [SystemRole::Accepted, SystemRole::Refused] {
            let mut body =
                json!({"messages": loop_turns.as_array().unwrap()[1..], "tools": tools.clone()});
            let injection =
                inject_for(&mut body, EchoMode::HeadTail, COST, canaries(), role).unwrap();
            let messages = body["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 5, "{role:?}");
            assert!(!injection.system_inserted, "{role:?}");
            assert_eq!(
                messages[..4],
                loop_turns.as_array().unwrap()[1..5],
                "{role:?}"
            );
            let output = text(&messages[4]);
            assert!(
                output.contains(&head) && output.contains(&tail),
                "{role:?}: {output}"
            );
        }

        // A legacy `function` result, which most templates drop: placed as
        // a single turn, the function message untouched.
        let function = json!({"role": "function", "name": "w", "content": "Sunny"});
        let mut body = json!({"functions": [{"name": "w"}], "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "function_call": {"name": "w", "arguments": "{}"}},
            function.clone()
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert!(
            text(&body["messages"][0]).contains(&head),
            "a system message of ours"
        );
        assert!(text(&body["messages"][1]).contains(&tail));
        assert_eq!(body["messages"][3], function);

        // A user turn after the loop's output: placed as in any
        // conversation, at the end of that turn.
        let mut turns = loop_turns.as_array().unwrap().clone();
        turns.push(json!({"role": "user", "content": "And tomorrow?"}));
        let mut body = json!({"messages": turns.clone(), "tools": tools.clone()});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(body["messages"].as_array().unwrap()[..6], turns[..6]);
        let last = text(&body["messages"][6]);
        assert!(last.contains(&head) && last.contains(&tail), "{last}");

        // An output that cannot take text is refused, the request unchanged.
        let mut turns = loop_turns.as_array().unwrap().clone();
        turns[5]["content"] = json!(7);
        let bad = json!({"messages": turns, "tools": tools});
        let mut body = bad.clone();
        assert_eq!(
            inject(&mut body, EchoMode::HeadTail, COST, canaries()),
            Err(InjectError::BadMessage(5))
        );
        assert_eq!(body, bad);
    }

    #[test]
    fn the_limit_grows_by_what_the_echo_costs_and_only_when_one_is_asked() {
        let cases = [
            (EchoMode::HeadTail, EchoCost::DIGITS_IN_THREES, 2),
            (EchoMode::HeadTail, COST, 2),
            (EchoMode::Head, EchoCost::DIGITS_IN_THREES, 1),
            (EchoMode::Off, COST, 0),
        ];
        for (echo, cost, echoed) in cases {
            for field in ["max_tokens", "max_completion_tokens"] {
                let mut body = request();
                body.as_object_mut().unwrap().remove("max_tokens");
                body[field] = json!(100);
                let injection = inject(&mut body, echo, cost, canaries()).unwrap();
                assert_eq!(injection.echo.len(), echoed);
                assert_eq!(injection.echo_allowance, cost.allowance(echoed));
                assert_eq!(
                    body[field],
                    100 + cost.allowance(echoed),
                    "{echo:?} {field}"
                );
                assert_eq!(injection.client_max_tokens, Some(100));
            }
        }
        let mut body = request();
        body.as_object_mut().unwrap().remove("max_tokens");
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(
            injection.echo_allowance, 0,
            "no limit of the client's, none raised"
        );
        assert!(body.get("max_tokens").is_none());
    }

    /// A message's content as clients send it: text (ASCII, other scripts,
    /// edge whitespace), parts with and without text, null, or missing.
    fn any_content() -> impl proptest::strategy::Strategy<Value = Option<Value>> {
        use proptest::prelude::*;
        let text = "[a-zA-Z0-9 ,.!?\n\t]{0,40}|[ \u{e9}\u{4e2d}\u{1f600}a-z\n]{0,12}";
        prop_oneof![
            text.prop_map(|text| Some(Value::String(text))),
            proptest::collection::vec(
                prop_oneof![
                    text.prop_map(|text| json!({"type": "text", "text": text})),
                    Just(json!({"type": "image_url", "image_url": {"url": "x"}})),
                ],
                0..3
            )
            .prop_map(|parts| Some(Value::Array(parts))),
            Just(Some(Value::Null)),
            Just(None),
        ]
    }

    proptest::proptest! {
        /// The estimate is counted from the blocks placed, not by counting
        /// the prompt again: it must equal a count of the placed prompt.
        #[test]
        fn the_estimate_is_the_count_of_the_placed_prompt(
            messages in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["system", "developer", "user", "assistant", "tool"]),
                    any_content(),
                ),
                1..5,
            ),
            echo in proptest::sample::select(vec![EchoMode::HeadTail, EchoMode::Head, EchoMode::Off]),
            json_mode: bool,
        ) {
            let messages: Vec<Value> = messages
                .into_iter()
                .map(|(role, content)| match content {
                    Some(content) => json!({"role": role, "content": content}),
                    None => json!({"role": role}),
                })
                .collect();
            let before = count_chat_messages(&messages);
            let mut body = json!({"messages": messages});
            if json_mode {
                body["response_format"] = json!({"type": "json_object"});
            }
            let injection = inject(&mut body, echo, COST, canaries()).unwrap();
            let after = count_chat_messages(body["messages"].as_array().unwrap());
            proptest::prop_assert_eq!(injection.prompt_tokens_estimate, after);
            proptest::prop_assert_eq!(injection.prompt_tokens_added, after - before);
        }
    }

    #[test]
    fn cacheable_tokens_are_those_before_the_head_canary() {
        let long_system = "Follow the house rules. ".repeat(300);
        let request = |question: &str, system: &str| {
            json!({"messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]})
        };
        let fresh = || RequestCanaries::mint();
        let mut first = request("What is rule 1?", &long_system);
        let mut second = request("And rule two, in detail, please?", &long_system);
        let a = inject(&mut first, EchoMode::HeadTail, COST, fresh()).unwrap();
        let b = inject(&mut second, EchoMode::HeadTail, COST, fresh()).unwrap();
        let before_head = format!("{long_system}{BLOCK_SEPARATOR}{ECHO_PHRASE}");
        let expected = TOKENS_PER_MESSAGE + count_text("system") + count_text(&before_head);
        assert_eq!(a.cacheable_prompt_tokens, expected);
        assert_eq!(
            b.cacheable_prompt_tokens, expected,
            "the same for every request"
        );
        assert!(a.prompt_tokens_estimate > expected);

        // Without a system prompt only our fixed phrase precedes the canary;
        // passive markers start with the canary.
        let mut body = request("Hi", "");
        body["messages"].as_array_mut().unwrap().remove(0);
        let injection = inject(&mut body, EchoMode::HeadTail, COST, fresh()).unwrap();
        assert_eq!(
            injection.cacheable_prompt_tokens,
            TOKENS_PER_MESSAGE + count_text("system") + count_text(ECHO_PHRASE)
        );
        let mut body = request("Hi", "Be brief.");
        body["response_format"] = json!({"type": "json_object"});
        let injection = inject(&mut body, EchoMode::HeadTail, COST, fresh()).unwrap();
        assert_eq!(
            injection.cacheable_prompt_tokens,
            TOKENS_PER_MESSAGE
                + count_text("system")
                + count_text(&format!("Be brief.{BLOCK_SEPARATOR}("))
        );
    }

    #[test]
    fn a_system_message_is_added_first_only_when_there_is_none() {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["role"], "system");
        assert!(text(&messages[0]).starts_with(ECHO_PHRASE));
        assert_eq!(client_text(&text(&messages[0])), "");

        // A leading developer message plays the system role.
        let mut body = json!({"messages": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Hi"}
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["role"], "developer");
        assert!(text(&messages[0]).contains(&canaries().head.to_string()));
    }

    #[test]
    fn each_block_is_written_in_the_wording_that_removes_it_whole() {
        // The verifier removes a quoted block by this wording
        // (BLOCK_WORDINGS): every block must be written with it.
        assert!(HEAD_TAIL_CLOSE.starts_with(ASKS_FOR_TAIL));
        let RequestCanaries { head, tail } = canaries();
        for echo in [EchoMode::HeadTail, EchoMode::Head] {
            for passive in [None, Some(PassiveReason::Tools)] {
                let blocks = Blocks::new(echo, passive, canaries());
                for (block, canary) in [(&blocks.head, head), (&blocks.tail, tail)] {
                    assert!(
                        BLOCK_WORDINGS
                            .iter()
                            .any(|(open, close)| { *block == format!("{open}{canary}{close}") }),
                        "{block}"
                    );
                }
            }
        }
    }

    #[test]
    fn without_a_system_role_the_head_joins_the_first_user_message() {
        let refused = |body: &mut Value| {
            inject_for(
                body,
                EchoMode::HeadTail,
                COST,
                canaries(),
                SystemRole::Refused,
            )
            .unwrap()
        };
        let (head, tail) = (canaries().head.to_string(), canaries().tail.to_string());
        // One user turn: the client's text, the head's instruction, then the
        // tail block it points to, in that message; no message added.
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        let injection = refused(&mut body);
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1);
        let user = text(&messages[0]);
        assert_eq!(client_text(&user), "Hi");
        assert!(
            user.find(&head).unwrap() < user.find(&tail).unwrap(),
            "{user}"
        );
        assert!(!injection.system_inserted);
        assert_eq!(obedient_echo(&body).unwrap(), format!("{head} {tail}"));
        assert_eq!(
            injection.prompt_tokens_estimate,
            count_chat_messages(messages)
        );
        assert_eq!(
            injection.cacheable_prompt_tokens,
            TOKENS_PER_MESSAGE
                + count_text("user")
                + count_text(&format!("Hi{BLOCK_SEPARATOR}{ECHO_PHRASE}"))
        );

        // Several turns: the history is the stable prefix, so both blocks
        // end the last user message; the earlier turns are untouched.
        let mut body = json!({"messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer"},
            {"role": "user", "content": [{"type": "text", "text": "Second question"}]}
        ]});
        let original = body.clone();
        let injection = refused(&mut body);
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[..2], original["messages"].as_array().unwrap()[..2]);
        let last = text(&messages[2]);
        assert!(
            last.find(&head).unwrap() < last.find(&tail).unwrap(),
            "{last}"
        );
        assert!(!injection.system_inserted);
        assert_eq!(obedient_echo(&body).unwrap(), format!("{head} {tail}"));

        // A leading developer message in a conversation: the head ends the
        // newest turn, the developer message keeps its text.
        let mut body = json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"}
        ]});
        let injection = refused(&mut body);
        assert_eq!(text(&body["messages"][0]), "Be brief.");
        assert!(text(&body["messages"][3]).contains(&head));
        assert!(!injection.system_inserted);

        // A leading developer message, which such templates drop, does not
        // take the head.
        let mut body = json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"}
        ]});
        refused(&mut body);
        assert_eq!(text(&body["messages"][0]), "Be brief.");
        assert!(text(&body["messages"][1]).contains(&head));

        // The client's own system message still takes the head; a
        // conversation without a user turn still gets a system message.
        let mut body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}
        ]});
        refused(&mut body);
        assert!(text(&body["messages"][0]).contains(&head));
        let mut body = json!({"messages": [{"role": "assistant", "content": "Hello"}]});
        let injection = refused(&mut body);
        assert_eq!(body["messages"][0]["role"], "system");
        assert!(injection.system_inserted);

        // With the system role taken, a system message is inserted.
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        assert!(
            inject(&mut body, EchoMode::HeadTail, COST, canaries())
                .unwrap()
                .system_inserted
        );
    }

    #[test]
    fn parts_end_in_the_block_and_keep_their_own() {
        let mut body = json!({"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            ]}
        ]});
        let original = body.clone();
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        // A plain last text part takes the block at the end of its text: a
        // template that reads a system message's first part still shows it.
        let system = body["messages"][0]["content"].as_array().unwrap();
        assert_eq!(system.len(), 1);
        let system_text = system[0]["text"].as_str().unwrap();
        assert!(system_text.starts_with(&format!("Be brief.{BLOCK_SEPARATOR}{ECHO_PHRASE}")));
        assert_eq!(system[0]["type"], "text");
        // After another kind of part, the block is a new text part.
        let user = body["messages"][1]["content"].as_array().unwrap();
        assert_eq!(user.len(), 3);
        assert_eq!(
            user[..2],
            original["messages"][1]["content"].as_array().unwrap()[..]
        );
        assert_eq!(
            user[2]["text"],
            format!("{BLOCK_SEPARATOR}[{}]", canaries().tail)
        );
        assert_eq!(
            obedient_echo(&body).unwrap(),
            format!("{} {}", canaries().head, canaries().tail)
        );

        // A part with anything besides its text (a cache breakpoint) stays
        // as the client wrote it, byte for byte: the block follows it.
        let cached =
            json!({"type": "text", "text": "Long rules.", "cache_control": {"type": "ephemeral"}});
        let mut body = json!({"messages": [
            {"role": "system", "content": [cached.clone()]},
            {"role": "user", "content": "Hi"}
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let system = body["messages"][0]["content"].as_array().unwrap();
        assert_eq!(system.len(), 2);
        assert_eq!(system[0], cached);
        assert!(
            system[1]["text"]
                .as_str()
                .unwrap()
                .contains(&canaries().head.to_string())
        );
    }

    #[test]
    fn without_a_user_message_the_tail_follows_the_head() {
        let mut body = json!({"messages": [{"role": "system", "content": "Say hello."}]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1);
        let system = text(&messages[0]);
        assert!(system.ends_with(&format!("[{}]", canaries().tail)));
        assert_eq!(client_text(&system), "Say hello.");
        assert_eq!(
            obedient_echo(&body).unwrap(),
            format!("{} {}", canaries().head, canaries().tail)
        );
    }

    #[test]
    fn a_prompt_that_lost_a_message_loses_one_canary() {
        let mut body = request();
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let mut head_cut = body.clone();
        head_cut["messages"].as_array_mut().unwrap().remove(0);
        assert_eq!(
            obedient_echo(&head_cut).unwrap(),
            canaries().tail.to_string()
        );
        let mut tail_cut = body;
        tail_cut["messages"].as_array_mut().unwrap().pop();
        assert_eq!(
            obedient_echo(&tail_cut).unwrap(),
            canaries().head.to_string()
        );
    }

    #[test]
    fn the_last_instruction_of_the_first_message_that_has_one_wins() {
        // A client's own instruction before ours in the system message, and
        // another in the user message: an obedient model follows ours.
        let mut body = json!({"messages": [
            {"role": "system", "content": "Begin your reply with \"Hello\" always."},
            {"role": "user", "content": "Begin your reply with \"Sure\" then list fruits"}
        ]});
        inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(
            obedient_echo(&body).unwrap(),
            format!("{} {}", canaries().head, canaries().tail)
        );
        // Without canarygate, the client's own instruction is followed.
        let plain = json!({"messages": [
            {"role": "user", "content": "Begin your reply with \"\", no: Begin your reply with \"OK-42\" please"}
        ]});
        assert_eq!(obedient_echo(&plain).unwrap(), "OK-42");
        assert_eq!(
            obedient_opening(["Begin your reply with \"never closed"]),
            None
        );
    }

    #[test]
    fn the_newest_turns_instruction_wins_over_earlier_turns() {
        // A kept conversation's history: each earlier turn's instruction and
        // the reply that obeyed it; the newest turn asks for its own.
        let turns = [
            (
                "user",
                "q1\n\nBegin your reply with \"CG-1\" on its own line; then answer normally.",
            ),
            ("assistant", "CG-1\nfirst"),
            (
                "user",
                "q2\n\nBegin your reply with \"CG-2\" on its own line; then answer normally.",
            ),
        ];
        assert_eq!(obedient_opening_of_turns(&turns).as_deref(), Some("CG-2"));
        // Nothing asked after the last reply (a tool loop's outputs): the
        // whole conversation decides, as for a single turn.
        let turns = [
            (
                "system",
                "Begin your reply with \"CG-1\" on its own line; then answer normally.",
            ),
            ("user", "Weather?"),
            ("assistant", ""),
            ("tool", "Sunny"),
        ];
        assert_eq!(obedient_opening_of_turns(&turns).as_deref(), Some("CG-1"));
        assert_eq!(obedient_opening_of_turns(&[]), None);
    }

    #[test]
    fn a_prompt_with_a_cg_block_of_its_own_is_asked_for_the_head_alone() {
        let own = br#"{"messages":[{"role":"user","content":"File ticket [CG123456789012345]"}]}"#;
        assert_eq!(echo_for_request(EchoMode::HeadTail, own), EchoMode::Head);
        assert_eq!(
            echo_for_request(EchoMode::HeadTail, br#"{"messages":[]}"#),
            EchoMode::HeadTail
        );
        assert_eq!(echo_for_request(EchoMode::Off, own), EchoMode::Off);
        // Asked for the head alone, an obedient model writes it alone: the
        // client's block is no tail of ours.
        let mut body = json!({"messages": [
            {"role": "user", "content": "File ticket [CG123456789012345]"}
        ]});
        let injection = inject(&mut body, EchoMode::Head, COST, canaries()).unwrap();
        assert_eq!(injection.echo, [canaries().head]);
        assert_eq!(obedient_echo(&body).unwrap(), canaries().head.to_string());
    }

    #[test]
    fn a_prefilled_reply_is_passive_an_answer_after_an_assistant_turn_is_not() {
        let prefilled = |edit: &dyn Fn(&mut Value)| {
            let mut body = request();
            body["messages"]
                .as_array_mut()
                .unwrap()
                .push(json!({"role": "assistant", "content": "{\"answer\":"}));
            edit(&mut body);
            inject(&mut body, EchoMode::HeadTail, COST, canaries())
                .unwrap()
                .passive
        };
        // OpenAI answers after a trailing assistant turn: the echo still works.
        assert_eq!(prefilled(&|_| {}), None);
        for (what, edit) in [
            (
                "prefix",
                &(|body: &mut Value| body["messages"][2]["prefix"] = json!(true))
                    as &dyn Fn(&mut Value),
            ),
            ("continue_final_message", &|body: &mut Value| {
                body["continue_final_message"] = json!(true)
            }),
            ("add_generation_prompt", &|body: &mut Value| {
                body["add_generation_prompt"] = json!(false)
            }),
        ] {
            assert_eq!(prefilled(edit), Some(PassiveReason::Prefill), "{what}");
        }
        // The flags mean nothing when the last turn is the user's.
        let mut body = request();
        body["continue_final_message"] = json!(true);
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(injection.passive, None);
    }

    #[test]
    fn a_stop_sequence_that_could_cut_the_echo_makes_it_passive() {
        for stop in ["\n", "\n\n", " ", "]", "\"", "```", "CG", "1", ".\n"] {
            assert!(stop_may_cut_echo(stop), "{stop:?}");
        }
        for stop in ["User:", "</answer>", "###", "\nHuman:", "END"] {
            assert!(!stop_may_cut_echo(stop), "{stop:?}");
        }
        for (stop, passive) in [
            (json!("\n"), Some(PassiveReason::StopSequence)),
            (json!(["END", "\n\n"]), Some(PassiveReason::StopSequence)),
            (json!(["END", "User:"]), None),
            (json!(null), None),
        ] {
            let mut body = request();
            body["stop"] = stop.clone();
            let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
            assert_eq!(injection.passive, passive, "{stop}");
            assert_eq!(injection.echo.is_empty(), passive.is_some(), "{stop}");
            let raised = if passive.is_some() {
                100
            } else {
                100 + COST.allowance(2)
            };
            assert_eq!(body["max_tokens"], raised, "{stop}");
        }
    }

    #[test]
    fn a_spoken_reply_is_passive() {
        for (field, value) in [
            ("modalities", json!(["text", "audio"])),
            ("audio", json!({"voice": "alloy", "format": "wav"})),
        ] {
            let mut body = request();
            body[field] = value;
            let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
            assert_eq!(injection.passive, Some(PassiveReason::Audio), "{field}");
        }
        let mut body = request();
        body["modalities"] = json!(["text"]);
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(injection.passive, None);
    }

    #[test]
    fn a_limit_of_zero_goes_as_it_came() {
        let mut body = request();
        body["max_tokens"] = json!(0);
        let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        assert_eq!(body["max_tokens"], 0);
        assert_eq!(injection.client_max_tokens, Some(0));
        assert_eq!(injection.echo_allowance, 0);
    }

    #[test]
    fn head_mode_asks_for_the_head_only() {
        let mut body = request();
        let injection = inject(&mut body, EchoMode::Head, COST, canaries()).unwrap();
        assert_eq!(injection.echo, [canaries().head]);
        assert_eq!(obedient_echo(&body).unwrap(), canaries().head.to_string());
        let last = text(&body["messages"][1]);
        assert!(last.contains(&canaries().tail.to_string()));
        assert_eq!(client_text(&last), "Tell me a joke");
    }

    #[test]
    fn json_mode_and_tools_are_passive() {
        for (field, value, reason) in [
            (
                "response_format",
                json!({"type": "json_object"}),
                PassiveReason::JsonMode,
            ),
            ("tools", json!([{"type": "function"}]), PassiveReason::Tools),
        ] {
            let mut body = request();
            body[field] = value;
            let injection = inject(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
            assert_eq!(injection.passive, Some(reason));
            assert!(injection.echo.is_empty());
            assert_eq!(body["max_tokens"], 100);
            assert_eq!(obedient_echo(&body), None);
            assert_eq!(body["messages"].as_array().unwrap().len(), 2);
            let system = text(&body["messages"][0]);
            let last = text(&body["messages"][1]);
            assert!(system.contains(&canaries().head.to_string()));
            assert!(last.contains(&canaries().tail.to_string()));
            assert_eq!(client_text(&system), "Be brief.");
            assert_eq!(client_text(&last), "Tell me a joke");
        }
    }

    #[test]
    fn stream_usage_is_requested() {
        let mut body = request();
        body["stream"] = json!(true);
        let injection = inject(&mut body, EchoMode::Head, COST, canaries()).unwrap();
        assert!(injection.stream);
        assert!(!injection.client_wants_usage);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(injection.echo, [canaries().head]);
    }

    #[test]
    fn malformed_requests_are_errors_and_left_unchanged() {
        assert_eq!(
            inject(&mut json!([]), EchoMode::Head, COST, canaries()),
            Err(InjectError::NotAnObject)
        );
        assert_eq!(
            inject(
                &mut json!({"messages": []}),
                EchoMode::Head,
                COST,
                canaries()
            ),
            Err(InjectError::NoMessages)
        );
        let mut body = request();
        body["n"] = json!(0);
        assert_eq!(
            inject(&mut body, EchoMode::Head, COST, canaries()),
            Err(InjectError::BadChoiceCount)
        );
        for (index, bad) in [
            (
                0,
                json!({"messages": [{"role": "system", "content": 7}, {"role": "user", "content": "x"}]}),
            ),
            (
                1,
                json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": {"text": "x"}}]}),
            ),
        ] {
            let mut body = bad.clone();
            assert_eq!(
                inject(&mut body, EchoMode::HeadTail, COST, canaries()),
                Err(InjectError::BadMessage(index))
            );
            assert_eq!(body, bad);
        }
    }

    #[test]
    fn registered_canaries_are_live_and_distinct() {
        let registry = MemoryRegistry::new(b"secret");
        let registration = Registration {
            session: "s".into(),
            request: "r".into(),
            expires_at_ms: 1,
        };
        let (canaries, keys) = RequestCanaries::mint_registered(&registry, &registration);
        assert_ne!(canaries.head, canaries.tail);
        assert_eq!(
            keys,
            [registry.key(&canaries.head), registry.key(&canaries.tail)]
        );
        assert_eq!(registry.len(), 2);
    }
}

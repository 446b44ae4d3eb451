//! Placing a request's canaries into its chat completion request.
//!
//! Two canaries per request. The head canary goes in a system message placed
//! first; the tail canary in a system message right after the last user
//! message. Each message carries only its own canary, so a prompt truncated
//! at either end loses one of them and the echo fails:
//!
//! - head: `... Begin your reply with "HEAD" then a space and the code from
//!   part 2 at the end of the conversation ...` ([`ECHO_PHRASE`])
//! - tail: `... Right after the code from part 1, write "TAIL" ...`
//!   ([`TAIL_PHRASE`])
//!
//! An obedient model opens its reply with `HEAD TAIL`; [`obedient_echo`] is
//! that rule, for simulated providers. In `head` echo mode the tail message
//! is a passive marker. Requests in JSON mode or with tools (and echo `off`)
//! get both canaries as passive markers: no echo is asked, but a leak of this
//! prompt into another answer is still recognised.

use serde::Serialize;
use serde_json::{Value, json};

use crate::canary::Canary;
use crate::tokens::count_chat_messages;
use crate::verify_config::EchoMode;

/// Phrase of the head instruction, followed by the head canary and `"`.
pub const ECHO_PHRASE: &str = "Begin your reply with \"";

/// Phrase of the tail instruction, followed by the tail canary and `"`.
pub const TAIL_PHRASE: &str = "Right after the code from part 1, write \"";

/// Output tokens added to a client's `max_tokens` when an echo is asked, so
/// the echo does not eat the client's budget.
pub const ECHO_TOKEN_ALLOWANCE: u64 = 32;

/// Most choices (`n`) a verified request may ask for.
pub const MAX_CHOICES: u64 = 128;

/// The two canaries of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCanaries {
    /// Placed in the first message.
    pub head: Canary,
    /// Placed after the last user message.
    pub tail: Canary,
}

impl RequestCanaries {
    /// Two fresh canaries from the OS CSPRNG.
    pub fn mint() -> Result<Self, getrandom::Error> {
        Ok(Self {
            head: Canary::mint()?,
            tail: Canary::mint()?,
        })
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
    /// The client asked for the usage chunk of a stream itself; when false the
    /// proxy added `stream_options.include_usage` and should not forward it.
    pub client_wants_usage: bool,
    /// Our prompt-token estimate of the modified request ([`crate::tokens`]).
    pub prompt_tokens_estimate: u64,
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
}

/// Places `canaries` into `request` (a chat completion body) per `echo`.
pub fn inject(
    request: &mut Value,
    echo: EchoMode,
    canaries: RequestCanaries,
) -> Result<Injection, InjectError> {
    let body = request.as_object_mut().ok_or(InjectError::NotAnObject)?;
    if body
        .get("messages")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        return Err(InjectError::NoMessages);
    }
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
    let passive = if echo == EchoMode::Off {
        Some(PassiveReason::EchoOff)
    } else if json_mode {
        Some(PassiveReason::JsonMode)
    } else if has_tools {
        Some(PassiveReason::Tools)
    } else {
        None
    };
    let RequestCanaries { head, tail } = canaries;
    let (head_text, tail_text, expected) = match (passive, echo) {
        (None, EchoMode::HeadTail) => (
            format!(
                "canarygate verification, part 1 of 2. {ECHO_PHRASE}{head}\" then a space and \
                 the code given in part 2 at the end of the conversation, on one line, then \
                 answer normally."
            ),
            format!(
                "canarygate verification, part 2 of 2. {TAIL_PHRASE}{tail}\" on the same line, \
                 then a new line, then answer normally."
            ),
            vec![head, tail],
        ),
        (None, _) => (
            format!(
                "canarygate verification. {ECHO_PHRASE}{head}\" on its own line, then answer \
                 normally."
            ),
            passive_marker(tail),
            vec![head],
        ),
        (Some(_), _) => (passive_marker(head), passive_marker(tail), Vec::new()),
    };

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
    for field in ["max_tokens", "max_completion_tokens"] {
        if let Some(limit) = body.get_mut(field)
            && let Some(value) = limit.as_u64()
        {
            client_max_tokens = Some(value);
            if !expected.is_empty() {
                *limit = Value::from(value.saturating_add(ECHO_TOKEN_ALLOWANCE));
            }
        }
    }

    let messages = body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .filter(|messages| !messages.is_empty())
        .ok_or(InjectError::NoMessages)?;
    let after_last_user = messages
        .iter()
        .rposition(|message| message.get("role").and_then(Value::as_str) == Some("user"))
        .map_or(messages.len(), |index| index + 1);
    messages.insert(
        after_last_user,
        json!({"role": "system", "content": tail_text}),
    );
    messages.insert(0, json!({"role": "system", "content": head_text}));
    let prompt_tokens_estimate = count_chat_messages(messages);

    Ok(Injection {
        canaries,
        echo: expected,
        passive,
        stream,
        choices: choices as u32,
        client_max_tokens,
        client_wants_usage,
        prompt_tokens_estimate,
    })
}

fn passive_marker(canary: Canary) -> String {
    format!("canarygate marker {canary}: ignore it and never repeat it.")
}

/// What an obedient model opens its reply with, given the request it sees:
/// the string after [`ECHO_PHRASE`], then a space and the string after
/// [`TAIL_PHRASE`], each found in the first message that has it. `None` when
/// neither instruction is present. For simulated providers.
pub fn obedient_echo(request: &Value) -> Option<String> {
    let messages = request.get("messages")?.as_array()?;
    let quoted_after = |phrase: &str| {
        messages.iter().find_map(|message| {
            let content = message.get("content")?.as_str()?;
            let rest = &content[content.find(phrase)? + phrase.len()..];
            Some(rest[..rest.find('"')?].to_owned())
        })
    };
    match (quoted_after(ECHO_PHRASE), quoted_after(TAIL_PHRASE)) {
        (Some(head), Some(tail)) => Some(format!("{head} {tail}")),
        (head, tail) => head.or(tail),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Tell me a joke"}
            ]
        })
    }

    #[test]
    fn head_first_tail_after_last_user() {
        let mut body = request();
        let injection = inject(&mut body, EchoMode::HeadTail, canaries()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 6);
        let head = messages[0]["content"].as_str().unwrap();
        let tail = messages[5]["content"].as_str().unwrap();
        assert!(head.contains(&canaries().head.to_string()));
        assert!(!head.contains(&canaries().tail.to_string()));
        assert!(tail.contains(&canaries().tail.to_string()));
        assert!(!tail.contains(&canaries().head.to_string()));
        assert_eq!(injection.echo, [canaries().head, canaries().tail]);
        assert_eq!(injection.passive, None);
        assert_eq!(injection.client_max_tokens, Some(100));
        assert_eq!(body["max_tokens"], 100 + ECHO_TOKEN_ALLOWANCE);
        assert_eq!(
            obedient_echo(&body).unwrap(),
            format!("{} {}", canaries().head, canaries().tail)
        );
    }

    #[test]
    fn truncated_prompt_loses_one_canary() {
        let mut body = request();
        inject(&mut body, EchoMode::HeadTail, canaries()).unwrap();
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
            let injection = inject(&mut body, EchoMode::HeadTail, canaries()).unwrap();
            assert_eq!(injection.passive, Some(reason));
            assert!(injection.echo.is_empty());
            assert_eq!(body["max_tokens"], 100);
            assert_eq!(obedient_echo(&body), None);
            let text = body.to_string();
            assert!(text.contains(&canaries().head.to_string()));
            assert!(text.contains(&canaries().tail.to_string()));
        }
    }

    #[test]
    fn stream_usage_is_requested() {
        let mut body = request();
        body["stream"] = json!(true);
        let injection = inject(&mut body, EchoMode::Head, canaries()).unwrap();
        assert!(injection.stream);
        assert!(!injection.client_wants_usage);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(injection.echo, [canaries().head]);
    }

    #[test]
    fn malformed_requests_are_errors() {
        assert_eq!(
            inject(&mut json!([]), EchoMode::Head, canaries()),
            Err(InjectError::NotAnObject)
        );
        assert_eq!(
            inject(&mut json!({"messages": []}), EchoMode::Head, canaries()),
            Err(InjectError::NoMessages)
        );
        let mut body = request();
        body["n"] = json!(0);
        assert_eq!(
            inject(&mut body, EchoMode::Head, canaries()),
            Err(InjectError::BadChoiceCount)
        );
    }
}

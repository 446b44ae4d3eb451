//! Parsing a legacy completions request, its prompt as chat messages for
//! the token counts, and where the canaries go in its prompt text.

use canarygate_policies::EchoCost;
use canarygate_policies::inject::{
    BLOCK_SEPARATOR, Blocks, EchoObstacles, Injection, MAX_CHOICES, PromptEstimate,
    RequestCanaries, passive_reason, stops_may_cut_echo,
};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Map, Value, json};

use crate::error::{ApiError, ErrorCode};
use crate::wire::chat::{check_stream_options, json_object, model_of, stream_of};
use crate::wire::format::ClientRequest;

/// `max_tokens` when the request sets none (OpenAI's API reference for
/// `POST /v1/completions`; SGLang's protocol defaults to the same).
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// What a request's `prompt` is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompts<'a> {
    /// One text or a list of texts.
    Texts(Vec<&'a str>),
    /// Token ids: one list per prompt, each given as its number of tokens.
    TokenIds(Vec<usize>),
}

/// The prompts of `body` (validated by [`parse`]).
pub fn prompts(body: &Value) -> Prompts<'_> {
    read_prompts(body.get("prompt")).unwrap_or(Prompts::Texts(Vec::new()))
}

/// Parses and validates a completions request: only what canarygate relies
/// on; every other field is the provider's to judge.
pub fn parse(bytes: &[u8]) -> Result<ClientRequest, ApiError> {
    let body = json_object(bytes)?;
    let object = body.as_object().expect("json_object returns an object");
    let model = model_of(object)?;
    read_prompts(object.get("prompt"))?;
    let stream = stream_of(object)?;
    check_stream_options(object)?;
    for field in COUNT_FIELDS {
        match object.get(field) {
            None | Some(Value::Null) => {}
            Some(value) if value.as_u64().is_some() => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    field,
                    format!("`{field}` must be a non-negative integer."),
                ));
            }
        }
    }
    if !matches!(
        object.get("echo"),
        None | Some(Value::Null | Value::Bool(_))
    ) {
        return Err(ApiError::invalid_param("echo", "`echo` must be a boolean."));
    }
    if !matches!(
        object.get("suffix"),
        None | Some(Value::Null | Value::String(_))
    ) {
        return Err(ApiError::invalid_param(
            "suffix",
            "`suffix` must be a string.",
        ));
    }
    let max_tokens = object
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    Ok(ClientRequest {
        body,
        model,
        stream,
        max_tokens: Some(max_tokens),
    })
}

/// Fields that must be non-negative integers when set.
const COUNT_FIELDS: [&str; 4] = ["max_tokens", "n", "best_of", "logprobs"];

/// `prompt`: a string, a non-empty list of strings, a non-empty list of
/// token ids, or a non-empty list of non-empty lists of token ids.
fn read_prompts(prompt: Option<&Value>) -> Result<Prompts<'_>, ApiError> {
    let invalid = || {
        ApiError::invalid_param(
            "prompt",
            "`prompt` must be a string, an array of strings, an array of token ids or an array \
             of arrays of token ids.",
        )
    };
    let ids = |list: &[Value]| list.iter().all(|id| id.as_u64().is_some());
    match prompt {
        None | Some(Value::Null) => Err(ApiError::invalid_param(
            "prompt",
            "Missing required parameter: `prompt`.",
        )),
        Some(Value::String(text)) => Ok(Prompts::Texts(vec![text])),
        Some(Value::Array(list)) if list.is_empty() => Err(ApiError::invalid_param(
            "prompt",
            "`prompt` must not be an empty array.",
        )),
        Some(Value::Array(list)) if list.iter().all(Value::is_string) => Ok(Prompts::Texts(
            list.iter().filter_map(Value::as_str).collect(),
        )),
        Some(Value::Array(list)) if ids(list) => Ok(Prompts::TokenIds(vec![list.len()])),
        Some(Value::Array(lists)) => lists
            .iter()
            .map(|list| match list {
                Value::Array(list) if !list.is_empty() && ids(list) => Ok(list.len()),
                _ => Err(invalid()),
            })
            .collect::<Result<_, _>>()
            .map(Prompts::TokenIds),
        Some(_) => Err(invalid()),
    }
}

/// The prompt as chat messages, one user message per prompt, for the
/// shared token counts and the context preflight: each prompt's text with
/// the `suffix` the provider reads after it; token ids as one counted
/// piece per id.
pub fn messages(body: &Value) -> Vec<Value> {
    let suffix = body.get("suffix").and_then(Value::as_str).unwrap_or("");
    let message = |content: String| json!({"role": "user", "content": content});
    match prompts(body) {
        Prompts::Texts(texts) => texts
            .into_iter()
            .map(|text| message(format!("{text}{suffix}")))
            .collect(),
        Prompts::TokenIds(lengths) => lengths
            .into_iter()
            .map(|length| message(format!("{}{suffix}", "0 ".repeat(length))))
            .collect(),
    }
}

/// Places `canaries` at the end of every prompt text of `body` (see the
/// module docs), raises `max_tokens` when an echo is asked, asks for a
/// stream's usage, and says what the verifier must expect. On error the
/// body is left as it was.
pub fn place(
    body: &mut Value,
    echo: EchoMode,
    cost: EchoCost,
    canaries: RequestCanaries,
) -> Result<Injection, ApiError> {
    if body.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::invalid_param(
            "echo",
            "`echo: true` returns the prompt as the provider saw it, canarygate's canaries \
             included; it is not served on the verified path.",
        ));
    }
    let count = match prompts(body) {
        Prompts::Texts(texts) => texts.len() as u64,
        Prompts::TokenIds(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "A prompt of token ids cannot carry canarygate's canaries; send the prompt as \
                 text (a string or an array of strings) on the verified path.",
            ));
        }
    };
    let n = match body.get("n") {
        None | Some(Value::Null) => 1,
        Some(n) => n
            .as_u64()
            .filter(|n| (1..=MAX_CHOICES).contains(n))
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "n",
                    format!("`n` must be an integer from 1 to {MAX_CHOICES}."),
                )
            })?,
    };
    let choices = count.saturating_mul(n);
    if choices > MAX_CHOICES {
        return Err(ApiError::invalid_param(
            // The prompts alone ask for too many, or `n` makes them.
            if n == 1 { "prompt" } else { "n" },
            format!(
                "{count} prompts with `n` = {n} ask for {choices} choices; a verified request \
                 may ask for at most {MAX_CHOICES}."
            ),
        ));
    }
    let before = count_chat_messages(&messages(body));
    let obstacles = EchoObstacles {
        stop_sequence: stops_may_cut_echo(body.get("stop")),
        ..EchoObstacles::default()
    };
    let passive = passive_reason(echo, obstacles);
    let blocks = Blocks::new(echo, passive, canaries);
    let ours = format!(
        "{}{BLOCK_SEPARATOR}{}{BLOCK_SEPARATOR}",
        blocks.head, blocks.tail
    );
    let object = body.as_object_mut().ok_or_else(|| {
        ApiError::new(
            ErrorCode::InvalidJson,
            "The request body must be a JSON object.",
        )
    })?;
    // The characters appended to each prompt, repeated for each of its `n`
    // choices (indexed prompt-major).
    let appended: Vec<usize> = match object.get_mut("prompt") {
        Some(Value::String(text)) => vec![append(text, &ours)],
        Some(Value::Array(texts)) => texts
            .iter_mut()
            .filter_map(|text| match text {
                Value::String(text) => Some(append(text, &ours)),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let prompt_chars_appended = appended
        .iter()
        .flat_map(|chars| std::iter::repeat_n(*chars, n as usize))
        .collect();
    let stream = object
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let client_wants_usage = !stream || ask_for_usage(object);
    let client_limit = object
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let echo_allowance = cost.allowance(blocks.echo.len());
    if echo_allowance > 0 {
        object.insert(
            "max_tokens".into(),
            Value::from(client_limit.saturating_add(echo_allowance)),
        );
    }
    let estimate = PromptEstimate::of(before, &messages(body), canaries.head);
    let echo_tokens_least = cost.least(blocks.echo.len());
    Ok(Injection {
        canaries,
        system_inserted: false,
        echo: blocks.echo,
        passive,
        stream,
        choices: choices as u32,
        client_max_tokens: Some(client_limit),
        echo_allowance,
        echo_tokens_least,
        client_wants_usage,
        prompt_tokens_estimate: estimate.total,
        prompt_tokens_added: estimate.added,
        cacheable_prompt_tokens: estimate.cacheable,
        prompt_chars_appended,
        repeated_fields: Vec::new(),
    })
}

/// `text` followed by `ours`, after a separator unless `text` is empty;
/// returns the characters appended.
fn append(text: &mut String, ours: &str) -> usize {
    let before = text.len();
    if !text.is_empty() {
        text.push_str(BLOCK_SEPARATOR);
    }
    text.push_str(ours);
    text[before..].chars().count()
}

/// Sets `stream_options.include_usage` (canarygate reads the usage chunk);
/// returns whether the client had asked for it itself.
fn ask_for_usage(object: &mut Map<String, Value>) -> bool {
    let options = object.entry("stream_options").or_insert_with(|| json!({}));
    if !options.is_object() {
        *options = json!({});
    }
    let asked = options
        .get("include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    options["include_usage"] = Value::Bool(true);
    asked
}

#[cfg(test)]
mod tests {
    use super::*;
    use canarygate_policies::canary::Canary;
    use canarygate_policies::inject::{ECHO_PHRASE, client_text, obedient_opening};
    use canarygate_policies::tokens::count_text;

    /// What an echo is costed at in these tests: a token per digit.
    const COST: EchoCost = EchoCost::DIGIT_BY_DIGIT;

    fn canaries() -> RequestCanaries {
        RequestCanaries {
            head: Canary::from_random([3; 10]),
            tail: Canary::from_random([4; 10]),
        }
    }

    fn param(body: Value) -> Option<&'static str> {
        parse(body.to_string().as_bytes()).unwrap_err().param
    }

    #[test]
    fn every_documented_prompt_shape_parses() {
        for (prompt, expected) in [
            (json!("hi"), Prompts::Texts(vec!["hi"])),
            (json!(["a", "b"]), Prompts::Texts(vec!["a", "b"])),
            (json!([1, 2, 3]), Prompts::TokenIds(vec![3])),
            (json!([[1], [2, 3]]), Prompts::TokenIds(vec![1, 2])),
        ] {
            let request = parse(
                json!({"model": "m", "prompt": prompt})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap();
            assert_eq!(prompts(&request.body), expected);
            assert_eq!(
                request.max_tokens,
                Some(DEFAULT_MAX_TOKENS),
                "OpenAI's default"
            );
        }
        for bad in [
            json!(null),
            json!([]),
            json!(5),
            json!(["a", 1]),
            json!([[1], []]),
        ] {
            assert_eq!(
                param(json!({"model": "m", "prompt": bad})),
                Some("prompt"),
                "{bad}"
            );
        }
        assert_eq!(param(json!({"prompt": "x"})), Some("model"));
        for (field, value) in [
            ("stream", json!("yes")),
            ("max_tokens", json!(-1)),
            ("n", json!(1.5)),
            ("best_of", json!("2")),
            ("logprobs", json!(true)),
            ("echo", json!(1)),
            ("suffix", json!(3)),
        ] {
            let mut body = json!({"model": "m", "prompt": "x"});
            body[field] = value;
            assert_eq!(param(body), Some(field));
        }
        let error = parse(b"{nope").unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidJson);
    }

    #[test]
    fn the_blocks_follow_each_prompt_which_stays_a_byte_identical_prefix() {
        let mut body = json!({"model": "m", "prompt": ["Once upon a time", ""], "n": 3,
                              "max_tokens": 50});
        let injection = place(&mut body, EchoMode::HeadTail, COST, canaries()).unwrap();
        let texts: Vec<&str> = body["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|text| text.as_str().unwrap())
            .collect();
        let (head, tail) = (canaries().head.to_string(), canaries().tail.to_string());
        assert!(texts[0].starts_with(&format!(
            "Once upon a time{BLOCK_SEPARATOR}{ECHO_PHRASE}{head}\""
        )));
        assert!(texts[0].ends_with(&format!("[{tail}]{BLOCK_SEPARATOR}")));
        assert!(
            texts[1].starts_with(ECHO_PHRASE),
            "no separator before an empty prompt"
        );
        assert_eq!(client_text(texts[0]), "Once upon a time");
        for text in &texts {
            assert_eq!(obedient_opening([*text]).unwrap(), format!("{head} {tail}"));
        }
        assert_eq!(injection.choices, 6, "prompts × n");
        // Each choice's prompt grew by what follows the client's text.
        let appended = |text: &str, client: &str| text.chars().count() - client.chars().count();
        let first = appended(texts[0], "Once upon a time");
        let second = appended(texts[1], "");
        assert!(
            first > second,
            "the separator is appended to a non-empty prompt only"
        );
        assert_eq!(
            injection.prompt_chars_appended,
            [first, first, first, second, second, second]
        );
        assert_eq!(injection.echo, [canaries().head, canaries().tail]);
        assert_eq!(injection.client_max_tokens, Some(50));
        assert_eq!(body["max_tokens"], 50 + COST.allowance(2));
        assert!(injection.prompt_tokens_added > 0);
        assert!(injection.cacheable_prompt_tokens < injection.prompt_tokens_estimate);
        assert!(
            injection.cacheable_prompt_tokens
                >= count_text(&format!("Once upon a time{BLOCK_SEPARATOR}{ECHO_PHRASE}"))
        );
    }

    #[test]
    fn the_default_limit_is_raised_for_the_echo_and_kept_for_the_client() {
        let mut body = json!({"model": "m", "prompt": "Say hi", "stream": true});
        let injection = place(&mut body, EchoMode::Head, COST, canaries()).unwrap();
        assert_eq!(injection.client_max_tokens, Some(DEFAULT_MAX_TOKENS));
        assert_eq!(body["max_tokens"], DEFAULT_MAX_TOKENS + COST.allowance(1));
        assert_eq!(injection.echo_allowance, COST.allowance(1));
        assert_eq!(injection.echo, [canaries().head]);
        assert!(injection.stream);
        assert!(!injection.client_wants_usage);
        assert_eq!(body["stream_options"]["include_usage"], true);

        // No echo asked: the limit passes as the client set it (or not).
        let mut body = json!({"model": "m", "prompt": "Say hi", "stream": true,
                              "stream_options": {"include_usage": true}});
        let injection = place(&mut body, EchoMode::Off, COST, canaries()).unwrap();
        assert!(injection.echo.is_empty() && injection.passive.is_some());
        assert!(body.get("max_tokens").is_none());
        assert!(injection.client_wants_usage);
        let prompt = body["prompt"].as_str().unwrap();
        assert!(prompt.contains(&canaries().head.to_string()));
        assert!(prompt.contains(&canaries().tail.to_string()));
    }

    #[test]
    fn what_cannot_carry_canaries_is_a_400_about_its_field() {
        for (body, field) in [
            (json!({"model": "m", "prompt": "x", "echo": true}), "echo"),
            (json!({"model": "m", "prompt": [1, 2]}), "prompt"),
            (json!({"model": "m", "prompt": [[1], [2]]}), "prompt"),
            (json!({"model": "m", "prompt": "x", "n": 0}), "n"),
            (json!({"model": "m", "prompt": vec!["x"; 65], "n": 2}), "n"),
            (json!({"model": "m", "prompt": vec!["x"; 129]}), "prompt"),
        ] {
            let mut placed = body.clone();
            let error = place(&mut placed, EchoMode::HeadTail, COST, canaries()).unwrap_err();
            assert_eq!(error.param, Some(field), "{body}");
            assert_eq!(error.code, ErrorCode::InvalidValue);
            assert_eq!(placed, body, "nothing placed on failure");
        }
        let mut fine = json!({"model": "m", "prompt": "x", "echo": false});
        assert!(place(&mut fine, EchoMode::HeadTail, COST, canaries()).is_ok());
    }

    #[test]
    fn messages_count_each_prompt_its_suffix_and_token_ids() {
        let body = json!({"prompt": ["def f(", "class A"], "suffix": "\n    return x"});
        let messages = messages(&body);
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[1]["content"], "class A\n    return x");
        assert_eq!(messages[0]["role"], "user");
        let ids = json!({"prompt": [[5, 6, 7], [8]]});
        let messages = super::messages(&ids);
        assert_eq!(count_text(messages[0]["content"].as_str().unwrap()), 3);
        assert_eq!(count_text(messages[1]["content"].as_str().unwrap()), 1);
    }
}

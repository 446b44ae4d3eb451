//! Stored chat completions read back (`store: true`; `GET
//! /v1/chat/completions`, `GET`/`POST /v1/chat/completions/{id}`, its
//! `/messages`): the provider kept the request canarygate sent (its head
//! in a system message it added or appended to the client's, its tail at
//! the end of the last user message) and the reply that opened with the
//! echo. [`scrub`] takes out what belongs to the caller's own canaries
//! ([`crate::wire::stored`]): a completion's content (its annotations and
//! logprobs following), and in the messages every block, a system message
//! that held only canarygate's head going whole.

use canarygate_policies::canary::Canary;
use serde_json::Value;

use super::logprobs::followed;
use crate::wire::positions::follow_annotations;
use crate::wire::stored::{scrub_strings, scrub_text};

/// Takes the text of the canaries `ours` owns out of `body`: a stored
/// completion, a list of them, or a list of a completion's messages.
/// Returns whether anything changed.
pub fn scrub(body: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    if body["object"] == "chat.completion" {
        return scrub_completion(body, ours);
    }
    let Some(items) = body.get_mut("data").and_then(Value::as_array_mut) else {
        return scrub_strings(body, ours);
    };
    let mut changed = false;
    items.retain_mut(|item| {
        if item["object"] == "chat.completion" {
            changed |= scrub_completion(item, ours);
            return true;
        }
        // A message. A system message that held text and holds none now
        // held only canarygate's head, which it added whole; a client's
        // message keeps its place whatever is left of it.
        let added_whole = matches!(item["role"].as_str(), Some("system" | "developer"))
            && has_text(&item["content"]);
        changed |= scrub_strings(item, ours);
        !added_whole || has_text(&item["content"])
    });
    changed
}

/// Scrubs one completion: each choice's reply as one that opened with the
/// echo (its content, or its refusal when the content has no text, as the
/// verifier reads it), its logprobs following, then every other string.
fn scrub_completion(completion: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    let mut changed = false;
    let choices = completion
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten();
    for choice in choices {
        let Some(message) = choice.get_mut("message") else {
            continue;
        };
        let opening = match has_text(&message["content"]) {
            true => "content",
            false => "refusal",
        };
        let Some(scrubbed) = scrub_text(message, opening, ours, true) else {
            continue;
        };
        changed = true;
        if let Some(annotations) = message.get_mut("annotations") {
            follow_annotations(annotations, &scrubbed.chars);
        }
        let logprobs = format!("/logprobs/{opening}");
        if let Some(Value::Array(entries)) = choice.pointer_mut(&logprobs) {
            let taken = std::mem::take(entries);
            *entries = followed(taken, &scrubbed.original, &scrubbed.kept);
        }
    }
    scrub_strings(completion, ours) | changed
}

/// Whether a message's content holds text: a string that is not empty, or
/// parts of which one is.
fn has_text(content: &Value) -> bool {
    match content {
        Value::String(text) => !text.is_empty(),
        Value::Array(parts) => parts
            .iter()
            .any(|part| part["text"].as_str().is_some_and(|text| !text.is_empty())),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::{RequestCanaries, SystemRole};
    use canarygate_policies::verify_config::EchoMode;
    use serde_json::json;

    use super::*;
    use crate::wire::WireFormat;
    use crate::wire::chat::Chat;
    use crate::wire::stored::canaries_in;

    /// `request`'s messages as canarygate sends them.
    fn as_sent(request: &Value, canaries: RequestCanaries, role: SystemRole) -> Value {
        let mut body = Chat::parse_request(request.to_string().as_bytes())
            .unwrap()
            .body;
        Chat::place_canaries(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
            role,
        )
        .unwrap();
        body
    }

    /// The messages list the provider serves for `sent`.
    fn listed(sent: &Value) -> Value {
        let data: Vec<Value> = sent["messages"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(index, message)| {
                json!({"id": format!("chatcmpl-1-{index}"), "role": message["role"],
                       "content": message["content"], "name": null, "content_parts": null})
            })
            .collect();
        json!({"object": "list", "data": data, "has_more": false})
    }

    #[test]
    fn a_stored_completion_reads_back_as_sent_and_delivered() {
        let canaries = RequestCanaries::mint();
        let (head, tail) = (canaries.head, canaries.tail);
        let ours = |canary: Canary| canary == head || canary == tail;
        let ticket = RequestCanaries::mint().head;
        let reply = format!("{head} {tail}\n\nMercury, for ticket {ticket}.");
        // One logprob a word (and the space before it), as a provider
        // spells the reply it stored.
        let logprobs: Vec<Value> = reply
            .split_inclusive(' ')
            .map(|token| {
                json!({"token": token, "logprob": -0.5, "bytes": token.as_bytes(),
                                "top_logprobs": []})
            })
            .collect();
        let mut completion = json!({"id": "chatcmpl-1", "object": "chat.completion",
            "model": "m", "metadata": {"job": "nightly"}, "choices": [{"index": 0,
                "message": {"role": "assistant", "content": reply, "annotations": [
                    {"type": "url_citation", "url_citation": {"start_index": 37,
                     "end_index": 44, "url": "https://example.com"}}]},
                "logprobs": {"content": logprobs, "refusal": null},
                "finish_reason": "stop"}]});
        let mut found = canaries_in(&completion);
        found.sort_by_key(ToString::to_string);
        let mut expected = vec![head, tail, ticket];
        expected.sort_by_key(ToString::to_string);
        assert_eq!(found, expected);
        let mut list = json!({"object": "list", "data": [completion.clone()]});
        assert!(scrub(&mut completion, &ours));
        let content = completion["choices"][0]["message"]["content"]
            .as_str()
            .unwrap();
        assert_eq!(content, format!("Mercury, for ticket {ticket}."));
        let citation = &completion["choices"][0]["message"]["annotations"][0]["url_citation"];
        let cited: String = content
            .chars()
            .skip(citation["start_index"].as_u64().unwrap() as usize)
            .take(7)
            .collect();
        assert_eq!(cited, "Mercury");
        // The logprobs spell what is left.
        let spelled: String = completion["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect();
        assert_eq!(spelled, content);
        // Listed, the same.
        assert!(scrub(&mut list, &ours));
        assert_eq!(list["data"][0], completion);

        // Its messages: as the client sent them, with a system message of
        // its own or none, whether the head went in a system message or in
        // the first user message.
        let with_system = json!({"model": "m", "store": true, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Name a planet"}]}]});
        let without = json!({"model": "m", "store": true, "messages": [
            {"role": "user", "content": format!("Name a planet (ticket {ticket})")}]});
        for request in [with_system, without] {
            for role in [SystemRole::Accepted, SystemRole::Refused] {
                let sent = as_sent(&request, canaries, role);
                assert_ne!(sent["messages"], request["messages"]);
                let mut messages = listed(&sent);
                assert!(scrub(&mut messages, &ours));
                let read: Vec<Value> = messages["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|message| json!({"role": message["role"], "content": message["content"]}))
                    .collect();
                assert_eq!(
                    read,
                    request["messages"].as_array().unwrap().clone(),
                    "{role:?}"
                );
            }
        }

        // An image-only question keeps its place, its added tail gone.
        let image = json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
        let mut messages = listed(&as_sent(&image, canaries, SystemRole::Accepted));
        assert!(scrub(&mut messages, &ours));
        let kept: Vec<&Value> = messages["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|message| &message["content"])
            .collect();
        assert_eq!(kept, [&image["messages"][0]["content"]]);

        // A reply that is only a refusal, opened with the echo.
        let mut refused = json!({"object": "chat.completion", "choices": [{"message": {
            "content": null, "refusal": format!("{head} {tail}\n\nI can't help.")}}]});
        assert!(scrub(&mut refused, &ours));
        assert_eq!(refused["choices"][0]["message"]["refusal"], "I can't help.");
        assert!(refused["choices"][0]["message"]["content"].is_null());

        // Nothing of the caller's: unchanged, and said so.
        let mut plain = json!({"object": "chat.completion", "choices": [
            {"message": {"content": format!("ticket {ticket}")}}]});
        assert!(!scrub(&mut plain, &ours));
    }
}

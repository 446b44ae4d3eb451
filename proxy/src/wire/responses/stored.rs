//! A stored response read back (`GET /v1/responses/{id}`, its
//! `input_items`, a `cancel`): the provider kept what canarygate sent it
//! and what the model answered, so the response holds canarygate's blocks
//! (in `instructions` and the input) and the echo the reply opened with.
//! [`scrub`] takes out what belongs to the caller's own canaries, so the
//! client reads back what it sent and what it was delivered; canary-shaped
//! text that is not the caller's (a ticket number of its own) stays.

use std::collections::HashSet;

use canarygate_policies::canary::{Canary, find_canaries};
use canarygate_policies::verify::without_own_text;
use serde_json::Value;

/// Every canary-shaped span in the strings of `body`, once each: what to
/// ask the registry about before [`scrub`].
pub fn canaries_in(body: &Value) -> Vec<Canary> {
    fn walk(value: &Value, found: &mut HashSet<Canary>) {
        match value {
            Value::String(text) => found.extend(find_canaries(text).map(|span| span.canary)),
            Value::Array(items) => items.iter().for_each(|item| walk(item, found)),
            Value::Object(members) => members.values().for_each(|member| walk(member, found)),
            _ => {}
        }
    }
    let mut found = HashSet::new();
    walk(body, &mut found);
    found.into_iter().collect()
}

/// Takes the text of the canaries `ours` owns out of a stored response (or
/// a list of its input items), by [`without_own_text`]: the echo from the
/// reply's first text, the blocks from wherever they were placed, a text
/// part canarygate added dropped whole. An `instructions` that held only
/// canarygate's head (the client sent none) is `null` again. Returns
/// whether anything changed.
pub fn scrub(body: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    let mut changed = false;
    if let Some(Value::String(opening)) = reply_opening(body)
        && let Some(clean) = without_own_text(opening, ours, true)
    {
        *opening = clean;
        changed = true;
    }
    changed |= scrub_strings(body, ours);
    if changed
        && let Some(instructions) = body.get_mut("instructions")
        && instructions.as_str() == Some("")
    {
        *instructions = Value::Null;
    }
    changed
}

/// The text the reply opened with: the first `output_text` of the first
/// message in `output`.
fn reply_opening(body: &mut Value) -> Option<&mut Value> {
    body.get_mut("output")?
        .as_array_mut()?
        .iter_mut()
        .find(|item| item.get("type").and_then(Value::as_str) == Some("message"))?
        .get_mut("content")?
        .as_array_mut()?
        .iter_mut()
        .find(|part| part.get("type").and_then(Value::as_str) == Some("output_text"))?
        .get_mut("text")
}

/// Scrubs every string in `value` (none as a reply's opening); whether any
/// changed. A plain text part (`type` and `text` alone) left empty was
/// canarygate's, and goes.
fn scrub_strings(value: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    match value {
        Value::String(text) => match without_own_text(text, ours, false) {
            Some(clean) => {
                *text = clean;
                true
            }
            None => false,
        },
        Value::Array(items) => {
            let mut changed = false;
            items.retain_mut(|item| {
                let was_text = plain_text(item).is_some_and(|text| !text.is_empty());
                changed |= scrub_strings(item, ours);
                !(was_text && plain_text(item) == Some(""))
            });
            changed
        }
        Value::Object(members) => members.values_mut().fold(false, |changed, member| {
            scrub_strings(member, ours) | changed
        }),
        _ => false,
    }
}

/// The text of a plain text part: an object of `type` and a string `text`
/// alone, as canarygate adds one.
fn plain_text(part: &Value) -> Option<&str> {
    let part = part.as_object()?;
    (part.len() == 2 && part.get("type").is_some_and(Value::is_string))
        .then(|| part.get("text")?.as_str())
        .flatten()
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::RequestCanaries;
    use canarygate_policies::verify_config::EchoMode;
    use serde_json::json;

    use super::*;
    use crate::wire::responses::request::{parse, place};

    /// `request` (a Responses request body) as canarygate sends it.
    fn as_sent(request: &Value, canaries: RequestCanaries) -> Value {
        let mut body = parse(request.to_string().as_bytes()).unwrap().body;
        place(
            &mut body,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .unwrap();
        body
    }

    #[test]
    fn a_stored_response_reads_back_as_sent_and_delivered() {
        let canaries = RequestCanaries::mint();
        let (head, tail) = (canaries.head, canaries.tail);
        let ours = |canary: Canary| canary == head || canary == tail;
        let ticket = RequestCanaries::mint().head;
        // What the provider kept of a request placed by canarygate, and the
        // reply that echoed it. The client's own ticket, canary-shaped,
        // stays wherever it is.
        let sent = json!({"model": "m", "input": [
            {"role": "user", "content": format!("first, ticket {ticket}")},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": [
                {"type": "input_text", "text": "second"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]});
        let placed = as_sent(&sent, canaries);
        let mut stored = json!({
            "id": "resp_1", "object": "response", "status": "completed",
            "instructions": placed["instructions"].clone(),
            "output": [
                {"type": "reasoning", "summary": [{"type": "summary_text",
                  "text": format!("They ask me to begin with {head}.")}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": format!("**{head} {tail}**\n\nSecond it is."),
                     "annotations": []}]}],
            "metadata": {"ticket": ticket.to_string()},
        });
        let mut found = canaries_in(&stored);
        found.sort_by_key(ToString::to_string);
        let mut expected = vec![head, tail, ticket];
        expected.sort_by_key(ToString::to_string);
        assert_eq!(found, expected);
        assert!(scrub(&mut stored, &ours));
        assert_eq!(stored["output"][1]["content"][0]["text"], "Second it is.");
        assert_eq!(
            stored["output"][0]["summary"][0]["text"],
            "They ask me to begin with ."
        );
        assert_eq!(stored["metadata"]["ticket"], ticket.to_string());
        // The head went with the tail into the newest turn: the client sent
        // no instructions, and canarygate set none.
        assert_eq!(stored["instructions"], Value::Null);

        // Its input items, listed: the text part canarygate added is gone.
        let mut items = json!({"object": "list", "data": placed["input"].clone()});
        assert!(scrub(&mut items, &ours));
        assert_eq!(items["data"], sent["input"]);

        // A single turn's instructions, set by canarygate alone: `null`;
        // the client's own: as sent.
        for (client, expected) in [(None, Value::Null), (Some("Be brief."), json!("Be brief."))] {
            let mut request = json!({"model": "m", "input": "hi"});
            if let Some(client) = client {
                request["instructions"] = json!(client);
            }
            let placed = as_sent(&request, canaries);
            let mut stored = json!({"instructions": placed["instructions"].clone(),
                "output": [], "input": placed["input"].clone()});
            assert!(scrub(&mut stored, &ours));
            assert_eq!(stored["instructions"], expected, "{client:?}");
            assert_eq!(stored["input"], "hi");
        }

        // Nothing of the caller's: unchanged, and said so.
        let mut plain = json!({"instructions": "", "output": [{"text": format!("{ticket}")}]});
        assert!(!scrub(&mut plain, &ours));
        assert_eq!(plain["instructions"], "");
    }
}

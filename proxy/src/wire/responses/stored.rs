//! A stored response read back (`GET /v1/responses/{id}`, its
//! `input_items`, a `cancel`): the provider kept what canarygate sent it
//! and what the model answered, so the response holds canarygate's blocks
//! (in `instructions` and the input) and the echo the reply opened with.
//! [`scrub`] takes out what belongs to the caller's own canaries
//! ([`crate::wire::stored`]).

use canarygate_policies::canary::Canary;
use serde_json::Value;

use crate::wire::chat::followed_logprobs;
use crate::wire::positions::follow_annotations;
use crate::wire::stored::{scrub_strings, scrub_text};

/// Takes the text of the canaries `ours` owns out of a stored response (or
/// a list of its input items), by [`own_text_removals`]: the echo from the
/// reply's first text, the blocks from wherever they were placed, a text
/// part canarygate added dropped whole. The annotations of an output text
/// follow what was removed before the spans they cite, as a delivered
/// answer's do. An `instructions` that held only canarygate's head (the
/// client sent none) is `null` again. Returns whether anything changed.
pub fn scrub(body: &mut Value, ours: &dyn Fn(Canary) -> bool) -> bool {
    let mut changed = false;
    if let Some(Value::Array(items)) = body.get_mut("output") {
        let mut opening = true;
        let messages = items
            .iter_mut()
            .filter(|item| item.get("type").and_then(Value::as_str) == Some("message"));
        for part in messages
            .filter_map(|item| item.get_mut("content")?.as_array_mut())
            .flatten()
        {
            // The reply opens with its first text or refusal, as the
            // verifier reads it.
            let opens_reply = opening
                && matches!(
                    part.get("type").and_then(Value::as_str),
                    Some("output_text" | "refusal")
                );
            opening &= !opens_reply;
            changed |= scrub_output_text(part, ours, opens_reply);
        }
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

/// Scrubs the `text` of an output content part (a refusal part's
/// `refusal`), its `annotations` and `logprobs` following; whether it
/// changed.
fn scrub_output_text(part: &mut Value, ours: &dyn Fn(Canary) -> bool, opens_reply: bool) -> bool {
    let key = match part.get("type").and_then(Value::as_str) {
        Some("refusal") => "refusal",
        _ => "text",
    };
    let Some(scrubbed) = scrub_text(part, key, ours, opens_reply) else {
        return false;
    };
    if let Some(annotations) = part.get_mut("annotations") {
        follow_annotations(annotations, &scrubbed.chars);
    }
    if let Some(Value::Array(entries)) = part.get_mut("logprobs") {
        let taken = std::mem::take(entries);
        *entries = followed_logprobs(taken, &scrubbed.original, &scrubbed.kept);
    }
    true
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::RequestCanaries;
    use canarygate_policies::verify_config::EchoMode;
    use serde_json::json;

    use super::*;
    use crate::wire::responses::request::{parse, place};
    use crate::wire::stored::canaries_in;

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
        // A citation of "Second", counted in characters as the provider does.
        let reply = format!("**{head} {tail}**\n\nSecond it is.");
        let cited = reply.chars().count() - "Second it is.".len();
        let mut stored = json!({
            "id": "resp_1", "object": "response", "status": "completed",
            "instructions": placed["instructions"].clone(),
            "output": [
                {"type": "reasoning", "summary": [{"type": "summary_text",
                  "text": format!("They ask me to begin with {head}.")}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": reply,
                     "annotations": [{"type": "url_citation", "url": "https://example.com",
                        "start_index": cited, "end_index": cited + 6}],
                     "logprobs": reply.split_inclusive(' ').map(|token| json!({
                        "token": token, "logprob": -0.1, "bytes": token.as_bytes(),
                        "top_logprobs": []})).collect::<Vec<_>>()}]}],
            "metadata": {"ticket": ticket.to_string()},
        });
        let mut found = canaries_in(&stored);
        found.sort_by_key(ToString::to_string);
        let mut expected = vec![head, tail, ticket];
        expected.sort_by_key(ToString::to_string);
        assert_eq!(found, expected);
        assert!(scrub(&mut stored, &ours));
        assert_eq!(stored["output"][1]["content"][0]["text"], "Second it is.");
        // Its logprobs spell what is left of it.
        let spelled: String = stored["output"][1]["content"][0]["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["token"].as_str().unwrap())
            .collect();
        assert_eq!(spelled, "Second it is.");
        // The citation of "Second" still cites it.
        let citation = &stored["output"][1]["content"][0]["annotations"][0];
        assert_eq!(
            (&citation["start_index"], &citation["end_index"]),
            (&json!(0), &json!(6))
        );
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

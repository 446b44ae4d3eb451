//! A stored response read back (`GET /v1/responses/{id}`, its
//! `input_items`, a `cancel`): the provider kept what canarygate sent it
//! and what the model answered, so the response holds canarygate's blocks
//! (in `instructions` and the input) and the echo the reply opened with.
//! [`scrub`] takes them out, so the client reads back what it sent and what
//! it was delivered.

use canarygate_policies::inject::without_canarygate_text;
use serde_json::Value;

/// Takes canarygate's text out of every string of a stored response (or a
/// list of its input items), by shape ([`without_canarygate_text`]); an
/// `instructions` that was canarygate's alone (the client sent none) is
/// `null` again. Returns whether anything changed.
pub fn scrub(body: &mut Value) -> bool {
    let changed = scrub_strings(body);
    if let Some(instructions) = body.get_mut("instructions")
        && instructions.as_str() == Some("")
        && changed
    {
        *instructions = Value::Null;
    }
    changed
}

/// Scrubs every string in `value`; whether any changed.
fn scrub_strings(value: &mut Value) -> bool {
    match value {
        Value::String(text) => match without_canarygate_text(text) {
            Some(clean) => {
                *text = clean;
                true
            }
            None => false,
        },
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| scrub_strings(item) | changed),
        Value::Object(members) => members
            .values_mut()
            .fold(false, |changed, member| scrub_strings(member) | changed),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use canarygate_policies::EchoCost;
    use canarygate_policies::inject::RequestCanaries;
    use canarygate_policies::verify_config::EchoMode;
    use serde_json::json;

    use super::*;
    use crate::wire::responses::request::{parse, place};

    #[test]
    fn a_stored_response_reads_back_as_sent_and_delivered() {
        let canaries = RequestCanaries::mint();
        let (head, tail) = (canaries.head, canaries.tail);
        // What the provider kept of a request placed by canarygate, and the
        // reply that echoed it.
        let sent = json!({"model": "m", "input": [
            {"role": "user", "content": "first"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "second"}]}]});
        let mut placed = parse(sent.to_string().as_bytes()).unwrap().body;
        place(
            &mut placed,
            EchoMode::HeadTail,
            EchoCost::DIGIT_BY_DIGIT,
            canaries,
        )
        .unwrap();
        let mut stored = json!({
            "id": "resp_1", "object": "response", "status": "completed",
            "instructions": placed["instructions"].clone(),
            "output": [
                {"type": "reasoning", "summary": [{"type": "summary_text",
                  "text": format!("They ask me to begin with {head}.")}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": format!("{head} {tail} Second it is."),
                     "annotations": []}]}],
            "metadata": {"job": "CG-nightly"},
        });
        assert!(scrub(&mut stored));
        assert_eq!(stored["output"][1]["content"][0]["text"], "Second it is.");
        assert_eq!(
            stored["output"][0]["summary"][0]["text"],
            "They ask me to begin with ."
        );
        assert_eq!(stored["metadata"]["job"], "CG-nightly");
        // The head went with the tail into the newest turn: the client sent
        // no instructions, and canarygate set none.
        assert_eq!(stored["instructions"], Value::Null);

        // Its input items, listed.
        let mut items = json!({"object": "list", "data": placed["input"].clone()});
        assert!(scrub(&mut items));
        assert_eq!(items["data"], sent["input"]);

        // A single turn's instructions, set by canarygate alone: `null`;
        // the client's own: as sent.
        for (client, expected) in [(None, Value::Null), (Some("Be brief."), json!("Be brief."))] {
            let mut request = json!({"model": "m", "input": "hi"});
            if let Some(client) = client {
                request["instructions"] = json!(client);
            }
            let mut placed = parse(request.to_string().as_bytes()).unwrap().body;
            place(
                &mut placed,
                EchoMode::HeadTail,
                EchoCost::DIGIT_BY_DIGIT,
                canaries,
            )
            .unwrap();
            let mut stored = json!({"instructions": placed["instructions"].clone(),
                "output": [], "input": placed["input"].clone()});
            assert!(scrub(&mut stored));
            assert_eq!(stored["instructions"], expected, "{client:?}");
            assert_eq!(stored["input"], "hi");
        }

        // Nothing of canarygate's: unchanged, and said so.
        let mut plain = json!({"instructions": "", "output": [{"text": "CG12"}]});
        assert!(!scrub(&mut plain));
        assert_eq!(plain["instructions"], "");
    }
}

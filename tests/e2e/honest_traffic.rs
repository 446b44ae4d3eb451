//! Zero false alarms over 10,000 honest requests through canarygate: answers
//! that quote code, hold canary look-alikes, JSON mode, very short answers,
//! streamed and not.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::common::*;

const REQUESTS: usize = 10_000;
const IN_FLIGHT: usize = 48;

/// The `index`-th honest request body. The simulated model restates the user's
/// text, so what the prompt holds, the answer holds.
fn body(index: usize) -> Value {
    // Canary-shaped, never registered.
    let lookalike = format!(
        "CG{:015}",
        (index as u64).wrapping_mul(7_919_000_013) % 10u64.pow(15)
    );
    let text = match index % 8 {
        0 => format!("Review this: ```python\nprint('CG')  # {lookalike}\n```"),
        1 => format!("My parcel id is {lookalike}, is it valid?"),
        2 => format!(
            "cg {} {} {} {} {} spelled out",
            &lookalike[2..5],
            &lookalike[5..8],
            &lookalike[8..11],
            &lookalike[11..14],
            &lookalike[14..]
        ),
        3 => "ok".to_owned(),
        4 => format!("Translate 'Grüße, {index}' — and the dash – too"),
        5 => "Begin your reply with \"Sure\" then list two fruits".to_owned(),
        6 => format!("{{\"order\": {index}, \"code\": \"{lookalike}\"}}"),
        _ => format!("Summarise ticket {index}: the export job failed twice"),
    };
    let mut body = json!({
        "model": "m",
        "stream": index % 2 == 1,
        "messages": [{"role": "user", "content": text}],
    });
    match index % 5 {
        0 => {
            // OpenAI refuses JSON mode unless a message asks for JSON.
            body["response_format"] = json!({"type": "json_object"});
            body["messages"][0]["content"] = json!(format!("{text} Reply in JSON."));
        }
        1 => body["max_tokens"] = json!(1 + index % 3), // very short answers
        _ => {}
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_honest_requests_raise_no_false_alarm() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &sim.url);
    let client = client();
    let url = format!("{}/v1/chat/completions", proxy.url);
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = Vec::with_capacity(REQUESTS);
    for index in 0..REQUESTS {
        let permit = slots.clone().acquire_owned().await.unwrap();
        let client = client.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let body = body(index);
            let stream = body["stream"] == true;
            let response = client
                .post(&url)
                .bearer_auth(format!("sk-honest-{}", index % 17))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let verdict = response
                .headers()
                .get("x-canarygate-verdict")
                .map(|v| v.to_str().unwrap().to_owned());
            let text = response.text().await.unwrap();
            let (content, clean_end) = if stream {
                let events = sse_data(&text);
                let errors = events.iter().any(|data| data.contains("\"error\""));
                let verdict_comment = text.contains(": x-canarygate-verdict pass");
                (
                    stream_content(&text),
                    !errors && verdict_comment && events.last().is_some_and(|d| d == "[DONE]"),
                )
            } else {
                let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                let content = value["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                (
                    content,
                    verdict.as_deref().is_some_and(|v| v.starts_with("pass")),
                )
            };
            (index, status, clean_end, content, text)
        }));
    }
    let mut false_alarms = Vec::new();
    for task in tasks {
        let (index, status, clean_end, content, text) = task.await.unwrap();
        if status != 200 || !clean_end || content.is_empty() {
            false_alarms.push(format!(
                "{index}: {status} {}",
                &text[..text.len().min(300)]
            ));
        }
    }
    assert!(
        false_alarms.is_empty(),
        "{} false alarms out of {REQUESTS}, first: {:?}",
        false_alarms.len(),
        &false_alarms[..false_alarms.len().min(5)]
    );
}

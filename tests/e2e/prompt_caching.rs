//! Provider prompt caching through canarygate: a job sending the same long
//! system prompt with different questions gets the same cached share of its
//! prompt tokens through canarygate as directly (the canaries come after the
//! client's stable prefix), and the `ttft` check does not take the fast
//! first tokens of cached answers for an impossibly fast prefill.

use serde_json::{Value, json};

use crate::common::*;

/// Requests per path (direct, through canarygate).
const REQUESTS: usize = 6;

/// Cached prefixes grow in steps of this many tokens (the sim's default,
/// OpenAI's).
const INCREMENT: u64 = 128;

/// A system prompt of about 40,000 tokens: over the default policy's
/// `ttft_min_prompt_tokens` (4,096), so the check applies, well over the
/// caching minimum (1,024), and long enough that the whole prompt's ttft
/// bound (200 ms at 200,000 tokens/s) leaves a cache hit on a loaded
/// machine plenty of time to come sooner.
fn system_prompt() -> String {
    let mut text = String::from("You are the ledger assistant. House rules:");
    for rule in 0..20_000 {
        text.push_str(&format!(" r{rule}."));
    }
    text
}

/// Request `index` of the job: the same system prompt, a new question;
/// streams ask for the usage chunk.
fn request(system: &str, index: usize) -> Value {
    let stream = index % 2 == 1;
    let mut body = json!({
        "model": "sim-model",
        "stream": stream,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question {index}: which rule covers entry q{index}?")},
        ],
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// (prompt tokens, cached tokens) the client was told, and the verdict header.
async fn send(client: &reqwest::Client, url: &str, body: &Value) -> (u64, u64, Option<String>) {
    let response = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth("sk-test")
        .json(body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200, "{body}");
    let verdict = response
        .headers()
        .get("x-canarygate-verdict")
        .map(|value| value.to_str().unwrap().to_owned());
    let text = response.text().await.expect("body");
    let usage = if body["stream"] == true {
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        sse_data(&text)
            .iter()
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .map(|chunk| chunk["usage"].clone())
            .find(Value::is_object)
            .expect("a usage chunk")
    } else {
        serde_json::from_str::<Value>(&text).expect("JSON")["usage"].clone()
    };
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    (prompt, cached, verdict)
}

#[tokio::test]
async fn a_job_keeps_its_cached_share_through_canarygate_and_passes_ttft() {
    // Two identical caching providers, one per path, so neither path warms
    // the other's cache. 100,000 tokens/s: slower than the fastest prefill
    // the default policy believes (200,000 tokens/s for `openai`), so only a
    // cache hit makes the first token come sooner than the ttft bound of the
    // whole prompt.
    let sim_args = ["--prefill-tps", "100000"];
    let direct_sim = start_sim(&sim_args);
    let proxied_sim = start_sim(&sim_args);
    let dir = ProxyDir::new();
    let proxy = start_proxy(&dir, &proxied_sim.url);
    let client = client();
    let system = system_prompt();

    let mut direct = Vec::new();
    let mut proxied = Vec::new();
    for index in 0..REQUESTS {
        let body = request(&system, index);
        direct.push(send(&client, &direct_sim.url, &body).await);
        proxied.push(send(&client, &proxy.url, &body).await);
    }

    let share = |runs: &[(u64, u64, Option<String>)]| {
        let prompt: u64 = runs.iter().map(|run| run.0).sum();
        let cached: u64 = runs.iter().map(|run| run.1).sum();
        cached as f64 / prompt as f64
    };
    let (direct_share, proxied_share) = (share(&direct), share(&proxied));
    for (index, (direct, proxied)) in direct.iter().zip(&proxied).enumerate() {
        assert!(
            direct.1.abs_diff(proxied.1) <= INCREMENT,
            "request {index}: {} cached direct, {} through canarygate",
            direct.1,
            proxied.1
        );
        if index > 0 {
            assert!(
                proxied.1 * 10 >= proxied.0 * 9,
                "request {index}: {proxied:?}"
            );
        }
        // `pass`, or `pending; ...` for a stream released under echo-first.
        let verdict = proxied.2.as_deref().unwrap_or("none");
        assert!(
            verdict == "pass" || verdict.starts_with("pending"),
            "request {index}: {verdict}"
        );
    }
    let allowed =
        INCREMENT as f64 * REQUESTS as f64 / direct.iter().map(|run| run.0).sum::<u64>() as f64;
    assert!(
        (direct_share - proxied_share).abs() <= allowed,
        "cached share {direct_share:.4} direct, {proxied_share:.4} through canarygate"
    );
    assert!(direct_share > 0.75, "{direct_share}");

    // Every answer passed every check; the cached ones passed `ttft` on
    // their uncached tokens (the whole prompt's bound is 200 ms; a hit
    // prefills about 100 tokens).
    let records = audit_export(&dir.data());
    assert_eq!(records.len(), REQUESTS, "{records:?}");
    for (index, record) in records.iter().enumerate() {
        let checks = record["checks"].as_array().expect("checks");
        for check in checks {
            assert_ne!(check["result"], "fail", "request {index}: {check}");
        }
        let ttft = checks
            .iter()
            .find(|check| check["name"] == "ttft")
            .expect("a ttft check");
        assert_eq!(ttft["result"], "pass", "request {index}: {ttft}");
        let seen = &ttft["evidence"]["seen"];
        // Decided on the uncached tokens only when the first token came
        // sooner than the whole prompt allows: then credited the cache hit.
        if let Some(cached) = seen["cached_tokens"].as_u64() {
            assert_eq!(cached, proxied[index].1, "request {index}: {ttft}");
        }
    }
    let cached_and_fast = records
        .iter()
        .filter(|record| {
            record["checks"].as_array().unwrap().iter().any(|check| {
                check["name"] == "ttft"
                    && check["evidence"]["seen"]["cached_tokens"].as_u64() > Some(0)
            })
        })
        .count();
    assert!(
        cached_and_fast > 0,
        "no cached answer came sooner than the whole prompt's bound: {records:?}"
    );
}

/// A conversation's turns, as its client sends them each time: the same
/// history, one more exchange per turn.
struct Conversation {
    /// (user text, assistant reply) of the earlier turns.
    history: Vec<(String, String)>,
}

impl Conversation {
    /// The user text of turn `turn`: long enough (about 1,600 tokens) that
    /// every turn adds a cacheable stretch, and its own on each surface (the
    /// simulator's cache is shared by its surfaces).
    fn question(surface: &str, turn: usize) -> String {
        let mut text = format!("{surface} turn {turn}: the harbour log so far.");
        for line in 0..800 {
            text.push_str(&format!(" t{turn}l{line}."));
        }
        text
    }

    fn reply(turn: usize) -> String {
        format!("Logged turn {turn}.")
    }

    /// The body of the next turn on `surface`.
    fn next(&self, surface: &str) -> Value {
        let turn = self.history.len();
        match surface {
            "chat" => {
                let mut messages = vec![json!({"role": "system", "content": "Keep the log."})];
                for (user, assistant) in &self.history {
                    messages.push(json!({"role": "user", "content": user}));
                    messages.push(json!({"role": "assistant", "content": assistant}));
                }
                messages.push(json!({"role": "user", "content": Self::question(surface, turn)}));
                json!({"model": "sim-model", "max_tokens": 20, "messages": messages})
            }
            "responses" => {
                let mut input = Vec::new();
                for (user, assistant) in &self.history {
                    input.push(json!({"role": "user", "content": user}));
                    input.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": assistant}]}));
                }
                input.push(json!({"role": "user", "content": Self::question(surface, turn)}));
                // Not kept by the provider: a kept conversation's head stays
                // in `instructions`.
                json!({"model": "sim-model", "max_output_tokens": 20, "store": false,
                    "instructions": "Keep the log.", "input": input})
            }
            // Anthropic's multi-turn pattern: the breakpoint on the newest
            // turn, so the next one reads everything before it.
            _ => {
                let mut messages = Vec::new();
                for (user, assistant) in &self.history {
                    messages.push(json!({"role": "user", "content": user}));
                    messages.push(json!({"role": "assistant", "content": assistant}));
                }
                messages.push(json!({"role": "user", "content": [{"type": "text",
                    "text": Self::question(surface, turn), "cache_control": {"type": "ephemeral"}}]}));
                json!({"model": "sim-model", "max_tokens": 20, "system": "Keep the log.",
                    "messages": messages})
            }
        }
    }
}

/// (prompt tokens, cached tokens) of one turn on `surface`, and the verdict.
async fn send_turn(
    client: &reqwest::Client,
    url: &str,
    surface: &str,
    body: &Value,
) -> (u64, u64, Option<String>) {
    let path = match surface {
        "chat" => "/v1/chat/completions",
        "responses" => "/v1/responses",
        _ => "/v1/messages",
    };
    let response = client
        .post(format!("{url}{path}"))
        .header("authorization", "Bearer sk-test")
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("send");
    let verdict = response
        .headers()
        .get("x-canarygate-verdict")
        .map(|value| value.to_str().unwrap().to_owned());
    let answer: Value = response.json().await.expect("JSON");
    let usage = &answer["usage"];
    let number = |pointer: &str| {
        usage
            .pointer(pointer)
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("{surface}: no {pointer} in {answer}"))
    };
    let (prompt, cached) = match surface {
        "chat" => (
            number("/prompt_tokens"),
            number("/prompt_tokens_details/cached_tokens"),
        ),
        "responses" => (
            number("/input_tokens"),
            number("/input_tokens_details/cached_tokens"),
        ),
        _ => {
            let read = number("/cache_read_input_tokens");
            let prompt = number("/input_tokens") + read + number("/cache_creation_input_tokens");
            (prompt, read)
        }
    };
    (prompt, cached, verdict)
}

/// Turn `turn` on `surface` read from the provider's cache through
/// canarygate what it read direct, to within one increment, and at least
/// 90 % of its prompt's `earlier` parts in `parts` (the share its earlier
/// turns make of it). Each side is (prompt tokens, cached tokens, verdict).
fn assert_cached_as_direct(
    surface: &str,
    turn: usize,
    direct: &(u64, u64, Option<String>),
    proxied: &(u64, u64, Option<String>),
    (earlier, parts): (u64, u64),
) {
    assert!(
        direct.1.abs_diff(proxied.1) <= INCREMENT,
        "{surface} turn {turn}: {} cached direct, {} through canarygate",
        direct.1,
        proxied.1
    );
    assert!(
        proxied.1 * parts * 10 >= proxied.0 * earlier * 9,
        "{surface} turn {turn}: {proxied:?}"
    );
}

/// Two caching providers, one reached directly and one through a
/// canarygate that routes `sim-model` on OpenAI's and Anthropic's APIs:
/// (direct, proxied provider, canarygate's directory, canarygate).
fn direct_and_proxied() -> (Running, Running, ProxyDir, Running) {
    let direct_sim = start_sim(&[]);
    let proxied_sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = format!(
        r#"
[[providers]]
name = "openai"
base_url = "{url}/v1"
context_window = 200000

[[providers]]
name = "anthropic"
api = "anthropic"
base_url = "{url}/v1"
context_window = 200000

[[routes]]
model = "sim-model"
provider = "openai"

[[routes]]
model = "sim-model"
provider = "anthropic"
"#,
        url = proxied_sim.url
    );
    let proxy = start_proxy_with_policy(&dir, &dir.policy(&policy), &[]);
    (direct_sim, proxied_sim, dir, proxy)
}

/// A conversation resent with each new turn keeps its provider cache hits
/// through canarygate on every surface: the head canary joins the tail in
/// the newest user turn, so the whole history is the client's own prefix
/// (with the head after the system prompt, each turn would have read only
/// that much from the cache). Responses: a request the provider does not
/// keep (`store: false`).
#[tokio::test]
async fn a_conversation_keeps_its_cached_share_on_every_surface() {
    let (direct_sim, _proxied_sim, _dir, proxy) = direct_and_proxied();
    let client = client();
    for surface in ["chat", "responses", "messages"] {
        let mut conversation = Conversation {
            history: Vec::new(),
        };
        for turn in 0..4 {
            let body = conversation.next(surface);
            let direct = send_turn(&client, &direct_sim.url, surface, &body).await;
            let proxied = send_turn(&client, &proxy.url, surface, &body).await;
            conversation.history.push((
                Conversation::question(surface, turn),
                Conversation::reply(turn),
            ));
            assert_eq!(proxied.2.as_deref(), Some("pass"), "{surface} turn {turn}");
            // The first turn, one user message and nothing marked, has the
            // head after the system prompt: the second reads no more than
            // that (here too short to cache) through canarygate. From the
            // third on, every earlier turn is read, as direct.
            if turn == 1 && surface != "messages" {
                continue;
            }
            // Turn k's earlier turns are about k/(k+1) of its prompt.
            let k = turn as u64;
            assert_cached_as_direct(surface, turn, &direct, &proxied, (k, k + 1));
        }
    }
}

/// An agent's tool loop: one question, then one tool call and its (long)
/// output per turn, the whole loop resent each time, tools offered.
struct ToolLoop {
    /// The turns' tool outputs so far.
    outputs: Vec<String>,
}

impl ToolLoop {
    /// Tool output `turn`: about 1,600 tokens, its own on each surface.
    fn output(surface: &str, turn: usize) -> String {
        let mut text = format!("{surface} page {turn} of the harbour log:");
        for line in 0..800 {
            text.push_str(&format!(" p{turn}l{line}."));
        }
        text
    }

    /// The body of the next request of the loop on `surface`.
    fn next(&self, surface: &str) -> Value {
        let question = format!("{surface}: summarise the harbour log, page by page.");
        let arguments = |turn: usize| format!("{{\"page\":{turn}}}");
        match surface {
            "chat" => {
                let mut messages = vec![
                    json!({"role": "system", "content": "Keep the log."}),
                    json!({"role": "user", "content": question}),
                ];
                for (turn, output) in self.outputs.iter().enumerate() {
                    let id = format!("call_{turn}");
                    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                        {"id": id, "type": "function",
                         "function": {"name": "read_log", "arguments": arguments(turn)}}]}));
                    messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                }
                json!({"model": "sim-model", "max_tokens": 20, "messages": messages,
                    "tools": [{"type": "function", "function": {"name": "read_log",
                        "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}}}}]})
            }
            "responses" => {
                let mut input = vec![json!({"role": "user", "content": question})];
                for (turn, output) in self.outputs.iter().enumerate() {
                    let id = format!("call_{turn}");
                    input.push(json!({"type": "function_call", "call_id": id,
                        "name": "read_log", "arguments": arguments(turn)}));
                    input.push(json!({"type": "function_call_output", "call_id": id,
                        "output": output}));
                }
                json!({"model": "sim-model", "max_output_tokens": 20, "store": false,
                    "instructions": "Keep the log.", "input": input,
                    "tools": [{"type": "function", "name": "read_log",
                        "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}}}]})
            }
            // Anthropic's agent pattern: the breakpoint on the newest block.
            _ => {
                let mut messages = vec![json!({"role": "user", "content": question})];
                for (turn, output) in self.outputs.iter().enumerate() {
                    let id = format!("toolu_{turn}");
                    messages.push(json!({"role": "assistant", "content": [
                        {"type": "tool_use", "id": id, "name": "read_log",
                         "input": {"page": turn}}]}));
                    messages.push(json!({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": id, "content": output}]}));
                }
                let newest = messages.last_mut().unwrap();
                match &mut newest["content"] {
                    Value::Array(blocks) => {
                        blocks.last_mut().unwrap()["cache_control"] = json!({"type": "ephemeral"})
                    }
                    content => {
                        *content = json!([{"type": "text", "text": content.clone(),
                            "cache_control": {"type": "ephemeral"}}])
                    }
                }
                json!({"model": "sim-model", "max_tokens": 20, "system": "Keep the log.",
                    "messages": messages,
                    "tools": [{"name": "read_log", "input_schema": {"type": "object",
                        "properties": {"page": {"type": "integer"}}}}]})
            }
        }
    }
}

/// An agent's tool loop, resent whole with each new tool output, keeps its
/// provider cache hits through canarygate on every surface: tools make the
/// canaries passive markers, and in Chat and Responses (`store: false`)
/// both end the newest tool output, so every earlier call and output is
/// the client's own prefix (after the last user message, the loop would
/// have read only the system prompt and question from the cache). Messages
/// carries tool results in user turns, which take both already.
#[tokio::test]
async fn a_tool_loop_keeps_its_cached_share_on_every_surface() {
    let (direct_sim, _proxied_sim, _dir, proxy) = direct_and_proxied();
    let client = client();
    for surface in ["chat", "responses", "messages"] {
        let mut tool_loop = ToolLoop {
            outputs: Vec::new(),
        };
        for turn in 0..4 {
            let body = tool_loop.next(surface);
            let direct = send_turn(&client, &direct_sim.url, surface, &body).await;
            let proxied = send_turn(&client, &proxy.url, surface, &body).await;
            tool_loop.outputs.push(ToolLoop::output(surface, turn));
            assert_eq!(
                proxied.2.as_deref(),
                Some("pass; passive=tools"),
                "{surface} turn {turn}"
            );
            // From the second output on, the earlier outputs are about
            // (k-1)/k of the prompt, and all read from the cache.
            let k = turn as u64;
            let earlier = if k >= 2 { (k - 1, k) } else { (0, 1) };
            assert_cached_as_direct(surface, turn, &direct, &proxied, earlier);
        }
    }
}

/// A Responses conversation the provider keeps, continued turn by turn with
/// `previous_response_id` (each request sends only its new question), keeps
/// its cache hits through canarygate: the head joins the tail in the new
/// question, `instructions` stay the client's, and the kept history (with
/// each earlier turn's blocks and the echo that obeyed them) is the same
/// prefix in every later request. From the third turn on, each reads every
/// earlier turn, as direct; every turn's echo is its own head.
#[tokio::test]
async fn a_kept_responses_conversation_keeps_its_cached_share() {
    let (direct_sim, _proxied_sim, _dir, proxy) = direct_and_proxied();
    let client = client();
    let mut previous: [Option<String>; 2] = [None, None];
    for turn in 0..4 {
        let mut turns = Vec::new();
        for (path, url) in [&direct_sim.url, &proxy.url].into_iter().enumerate() {
            let mut body = json!({"model": "sim-model", "max_output_tokens": 20,
                "instructions": "Keep the log.",
                "input": Conversation::question("kept", turn)});
            if let Some(id) = &previous[path] {
                body["previous_response_id"] = json!(id);
            }
            let response = client
                .post(format!("{url}/v1/responses"))
                .bearer_auth("sk-test")
                .json(&body)
                .send()
                .await
                .expect("send");
            assert_eq!(response.status(), 200, "turn {turn}");
            let verdict = response
                .headers()
                .get("x-canarygate-verdict")
                .map(|value| value.to_str().unwrap().to_owned());
            let answer: Value = response.json().await.expect("JSON");
            let text = answer["output"].to_string();
            assert!(!holds_canary(&text), "turn {turn}: {text}");
            previous[path] = Some(answer["id"].as_str().expect("id").to_owned());
            let usage = &answer["usage"];
            turns.push((
                usage["input_tokens"].as_u64().expect("input_tokens"),
                usage["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .expect("cached_tokens"),
                verdict,
            ));
        }
        let (direct, proxied) = (&turns[0], &turns[1]);
        assert_eq!(proxied.2.as_deref(), Some("pass"), "turn {turn}");
        // The second turn reads only what came before the first's head (the
        // instructions, too short to cache here).
        if turn == 1 {
            continue;
        }
        let k = turn as u64;
        assert_cached_as_direct("kept", turn, direct, proxied, (k, k + 1));
    }
}

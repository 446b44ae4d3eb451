//! The review page (`canarygate audit ui`) in a real browser: headless
//! Chromium driven by selenium (tests/python/review_page.py) over an audit
//! log that `canarygate serve` wrote from real traffic to the simulator,
//! one of whose answers leaked another session's prompt, which holds
//! `<script>` text: the blocked answer's sample keeps what the provider
//! sent, and the page shows it beside what the client received. The page reviews through the same audit API as the CLI:
//! `audit show` reports the review and `audit verify` still passes.
//!
//! A second test runs the page inside `serve` (`--review-listen`).
//!
//! Chromium and chromedriver are the Debian packages `chromium` and
//! `chromium-driver` (scripts/test.sh installs them), or the binaries named
//! by `CANARYGATE_CHROMIUM` and `CANARYGATE_CHROMEDRIVER`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

const TOKEN: &str = "review-page-e2e-token-7f3a9c";
const SCRIPT: &str = "<script>document.title='pwned'</script>";
const NOTE: &str = "leak: the victim's prompt reached another session";

fn browser_binary(var: &str, default: &str) -> PathBuf {
    let path = std::env::var(var).map_or_else(|_| PathBuf::from(default), PathBuf::from);
    assert!(
        path.exists(),
        "{} is missing: run scripts/test.sh (it installs the Debian packages chromium and \
         chromium-driver) or set {var}",
        path.display()
    );
    path
}

/// One chat request in session `session`; returns status, request id and
/// the verdict header.
async fn ask(proxy: &Running, model: &str, session: &str, text: &str) -> (u16, String, String) {
    let response = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-review-test")
        .header("x-canarygate-session", session)
        .json(&chat_body(model, text, false))
        .send()
        .await
        .expect("request");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|value| value.to_str().unwrap_or_default().to_owned())
            .unwrap_or_default()
    };
    let (request_id, verdict) = (
        header("x-canarygate-request-id"),
        header("x-canarygate-verdict"),
    );
    let status = response.status().as_u16();
    let _ = response.text().await;
    (status, request_id, verdict)
}

fn audit(data: &Path, args: &[&str]) -> (bool, String, String) {
    let output = Command::new(binary())
        .arg("audit")
        .arg("--data")
        .arg(data)
        .args(args)
        .output()
        .expect("run canarygate audit");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `audit ui` without a usable token refuses to start, naming the variable.
fn ui_refuses(data: &Path, token: Option<&str>) -> String {
    let mut command = Command::new(binary());
    command
        .args(["audit", "--data"])
        .arg(data)
        .args(["ui", "--listen", "127.0.0.1:0"])
        .env_remove("CANARYGATE_ADMIN_TOKEN");
    if let Some(token) = token {
        command.env("CANARYGATE_ADMIN_TOKEN", token);
    }
    let output = command.output().expect("run audit ui");
    assert!(!output.status.success(), "audit ui started with {token:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn review_page_in_a_real_browser() {
    let started = Instant::now();
    let honest = start_sim(&[]);
    let swap = start_sim(&["--mode", "swap"]);
    let dir = ProxyDir::new();
    let policy = dir.policy(&format!(
        r#"
[[providers]]
name = "honest"
base_url = "{}/v1"
context_window = 128000

[[providers]]
name = "swap"
base_url = "{}/v1"
context_window = 128000

[[routes]]
model = "swap"
provider = "swap"

[[routes]]
model = "*"
provider = "honest"

[audit]
sample_rate = 1.0
"#,
        honest.url, swap.url
    ));
    let proxy = start_proxy_with_policy(&dir, &policy, &[]);

    for n in 0..3 {
        let (status, _, verdict) = ask(
            &proxy,
            "sim-model",
            "nightly",
            &format!("Summarise report {n}"),
        )
        .await;
        assert_eq!((status, verdict.as_str()), (200, "pass"));
    }
    // The victim's prompt holds script text; the swapping provider then
    // answers the thief with the victim's context.
    let (status, victim_request, verdict) = ask(
        &proxy,
        "swap",
        "victim",
        &format!("Quarterly numbers for Halvorsen {SCRIPT}"),
    )
    .await;
    assert_eq!(
        (status, verdict.as_str()),
        (200, "pass"),
        "nobody to swap with yet"
    );
    let (status, thief_request, verdict) = ask(&proxy, "swap", "thief", "Name three rivers.").await;
    assert_ne!(status, 200, "the leak is blocked");
    assert!(
        verdict.starts_with("fail;") && verdict.contains("foreign_canary"),
        "{verdict}"
    );

    let data = dir.data();
    let records = audit_export(&data);
    let failed_id = records
        .iter()
        .find(|record| record["request_id"] == thief_request.as_str())
        .and_then(|record| record["id"].as_u64())
        .expect("the thief's record");

    // No token, or a short one: the page does not start.
    assert!(ui_refuses(&data, None).contains("CANARYGATE_ADMIN_TOKEN"));
    assert!(ui_refuses(&data, Some("too-short")).contains("at least 16"));
    let nowhere = dir.dir.path().join("no-such-data");
    assert!(ui_refuses(&nowhere, Some(TOKEN)).contains("no audit log at"));
    assert!(!nowhere.exists(), "audit ui creates no store");

    // The page runs beside `serve`, which keeps the store open for writing.
    let mut command = Command::new(binary());
    command
        .args(["audit", "--data"])
        .arg(&data)
        .args(["ui", "--listen", "127.0.0.1:0"]);
    let ui = Running::start_command(command, &[("CANARYGATE_ADMIN_TOKEN", TOKEN)]);

    // Wrong and missing credentials are refused outside the browser too.
    for bearer in [None, Some("review-page-e2e-token-7f3a9d")] {
        let mut request = client().get(format!("{}/records/{failed_id}", ui.url));
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        let response = request.send().await.expect("ui");
        assert_eq!(response.status(), 401, "{bearer:?}");
        let body = response.text().await.unwrap();
        assert!(!body.contains(&thief_request), "{bearer:?}: no data");
    }

    let browser_started = Instant::now();
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(python())
            .arg(workspace_root().join("tests/python/review_page.py"))
            .args([ui.url.as_str(), TOKEN, NOTE])
            .env(
                "CANARYGATE_CHROMIUM",
                browser_binary("CANARYGATE_CHROMIUM", "/usr/bin/chromium"),
            )
            .env(
                "CANARYGATE_CHROMEDRIVER",
                browser_binary("CANARYGATE_CHROMEDRIVER", "/usr/bin/chromedriver"),
            )
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the browser run finished within 120 s")
    .expect("run review_page.py");
    let browser_seconds = browser_started.elapsed().as_secs_f64();
    assert!(
        output.status.success(),
        "review_page.py failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");

    // Before login: the form, no records; a wrong token changes nothing.
    assert_eq!(seen["before_login_rows"], 0, "{seen}");
    assert_eq!(seen["before_login_form"], true, "{seen}");
    assert_eq!(seen["wrong_token_rows"], 0, "{seen}");
    assert!(
        seen["wrong_token_error"]
            .as_str()
            .is_some_and(|e| e.contains("not the admin token")),
        "{seen}"
    );

    // The list, then only the failed verdict.
    let all = seen["all_rows"].as_array().expect("rows");
    assert_eq!(all.len(), 5, "{seen}");
    assert!(
        seen["failed_url"]
            .as_str()
            .unwrap()
            .contains("verdict=fail")
    );
    assert_eq!(
        seen["failed_rows"],
        serde_json::json!([failed_id.to_string()]),
        "{seen}"
    );
    assert_eq!(
        seen["failed_verdicts"],
        serde_json::json!(["fail"]),
        "{seen}"
    );

    // The record: the owner of the exposed canary is named.
    let exposed = seen["exposed"].as_str().expect("exposed banner");
    assert!(exposed.contains(&victim_request), "{exposed}");
    assert!(
        seen["checks"].as_str().unwrap().contains("foreign_canary"),
        "{seen}"
    );
    assert!(
        seen["failed_request_text"]
            .as_str()
            .unwrap()
            .contains("Name three rivers.")
    );
    // What the thief's client got is canarygate's error; what the provider
    // sent, kept beside it, is the victim's prompt with its script text.
    let received = seen["failed_response_text"]
        .as_str()
        .expect("response text");
    assert!(
        received.contains("canarygate_verification_failed"),
        "{received}"
    );
    assert!(!received.contains("Halvorsen"), "{received}");
    let sent = seen["failed_provider_text"]
        .as_str()
        .expect("provider text");
    assert!(
        sent.contains("Halvorsen") && sent.contains(SCRIPT),
        "{sent}"
    );

    // The review landed and replaced the form.
    assert!(
        seen["after_review_url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/records/{failed_id}")),
        "{seen}"
    );
    let review = seen["review_text"].as_str().expect("review shown");
    assert!(review.contains("bad") && review.contains(NOTE), "{review}");
    assert_eq!(seen["form_after_review"], false);

    // The victim's record, reached from the exposed session's link: its
    // script text is shown as text, and no script exists or ran.
    assert_eq!(
        seen["victim_rows"].as_array().map(Vec::len),
        Some(1),
        "{seen}"
    );
    for field in ["victim_request_text", "victim_response_text"] {
        assert!(
            seen[field]
                .as_str()
                .is_some_and(|text| text.contains(SCRIPT)),
            "{field}: {seen}"
        );
    }
    assert_eq!(seen["script_elements"], 0, "{seen}");
    assert_eq!(seen["alerts"], 0, "{seen}");
    for title in seen["titles"].as_array().unwrap() {
        let title = title.as_str().unwrap();
        assert!(
            title.ends_with("canarygate review") && !title.contains("pwned"),
            "{title}"
        );
    }
    for message in seen["console"].as_array().unwrap() {
        let message = message.as_str().unwrap();
        assert!(
            !message.contains("Content Security Policy") && !message.contains("Refused"),
            "{message}"
        );
    }
    assert_eq!(seen["chart_svgs"], 3, "{seen}");
    let charts = seen["chart_text"].as_str().unwrap();
    assert!(
        charts.contains("pass 4") && charts.contains("fail 1"),
        "{charts}"
    );
    assert!(charts.contains("foreign_canary 1"), "{charts}");

    // The CLI sees the review, and the chain (serve's records, the page's
    // review) still verifies.
    let (ok, shown, stderr) = audit(&data, &["show", &failed_id.to_string()]);
    assert!(ok, "{stderr}");
    let review_id: u64 = shown
        .lines()
        .find_map(|line| line.strip_prefix("--- reviewed in record "))
        .and_then(|id| id.trim().parse().ok())
        .unwrap_or_else(|| panic!("no review in audit show:\n{shown}"));
    let (ok, review, stderr) = audit(&data, &["show", &review_id.to_string()]);
    assert!(ok, "{stderr}");
    assert!(review.contains("\"kind\": \"review\""), "{review}");
    assert!(review.contains("\"verdict\": \"bad\""), "{review}");
    assert!(review.contains(NOTE), "{review}");
    let (ok, verified, stderr) = audit(&data, &["verify"]);
    assert!(ok, "audit verify: {stderr}");
    assert!(verified.starts_with("ok: 6 records verified"), "{verified}");

    // serve keeps appending after the page's review.
    let (status, _, _) = ask(&proxy, "sim-model", "nightly", "One more").await;
    assert_eq!(status, 200);
    let (ok, verified, stderr) = audit(&data, &["verify"]);
    assert!(
        ok && verified.starts_with("ok: 7 records verified"),
        "{verified}{stderr}"
    );
    eprintln!(
        "review_page: browser run {browser_seconds:.1} s, whole test {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `serve --review-listen` runs the page in the proxy's process, its store
/// handle beside the proxy's audit log: it shows the proxy's records, its
/// reviews chain with them, and the proxy keeps appending after.
#[tokio::test]
async fn serve_runs_the_review_page_beside_the_proxy() {
    let sim = start_sim(&[]);
    let dir = ProxyDir::new();
    let policy = plain_policy(&dir, &sim.url, "[audit]\nsample_rate = 1.0\n");
    let data = dir.data();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("local addr").port()
    };
    let review_listen = format!("127.0.0.1:{port}");

    // Without a token, serve does not start at all.
    let refused = Command::new(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(&data)
        .arg("--config")
        .arg(&policy)
        .args(["--review-listen", &review_listen])
        .env_remove("CANARYGATE_ADMIN_TOKEN")
        .output()
        .expect("run serve");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("CANARYGATE_ADMIN_TOKEN"));

    let proxy = start_proxy_with_args(
        &dir,
        &policy,
        &["--review-listen", &review_listen],
        &[("CANARYGATE_ADMIN_TOKEN", TOKEN)],
    );
    let (status, request_id, _) =
        ask(&proxy, "sim-model", "nightly", "Summarise <b>this</b>").await;
    assert_eq!(status, 200);

    let page = format!("http://{review_listen}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let record = loop {
        let sent = client()
            .get(format!("{page}/records/1"))
            .bearer_auth(TOKEN)
            .send()
            .await;
        // The answer was sent once its record was journaled; the page shows
        // the record once the store has indexed it, an index commit later.
        if let Ok(response) = sent
            && response.status() != 404
        {
            assert_eq!(response.status(), 200);
            break response.text().await.unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the review page never showed the record"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(record.contains(&request_id), "{record}");
    assert!(
        record.contains("Summarise &lt;b&gt;this&lt;/b&gt;"),
        "{record}"
    );
    let at = record.find("name=\"csrf\" value=\"").expect("csrf field") + 19;
    let csrf = &record[at..at + 64];
    let no_redirects = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let reviewed = no_redirects
        .post(format!("{page}/records/1/review"))
        .bearer_auth(TOKEN)
        .form(&[("verdict", "ok"), ("note", "fits"), ("csrf", csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(reviewed.status(), 303);
    assert_eq!(reviewed.headers()["location"], "/records/1");

    let (status, _, _) = ask(&proxy, "sim-model", "nightly", "And this").await;
    assert_eq!(status, 200);
    let (ok, verified, stderr) = audit(&data, &["verify"]);
    assert!(
        ok && verified.starts_with("ok: 3 records verified"),
        "{verified}{stderr}"
    );
    let (ok, shown, _) = audit(&data, &["show", "1"]);
    assert!(ok && shown.contains("--- reviewed in record 2"), "{shown}");
}

//! The router on a real store: auth, CSRF, filters, escaping, reviews. The
//! store is written by an [`AuditLog`] that stays open in this process while
//! the page's own [`Archive`] handle reads and reviews (what `serve` running
//! the page in-process would do), and the chain still verifies after both
//! appended.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use canarygate_audit::time::now_ms;
use canarygate_audit::{
    Action, Archive, AuditLog, AuditOptions, CheckRecord, Latency, NewRecord, Outcome,
    RequestRecord, Route, Sample, TopicScore, VerdictSummary, sha256_hex,
};
use canarygate_policies::verify::Status;
use tower::ServiceExt;

use crate::auth::{AdminToken, COOKIE};
use crate::server::{self, AppState, CSP, MAX_FORM_BYTES};

const TOKEN: &str = "review-token-for-tests-0123";
const SCRIPT: &str = "<script>document.title='pwned'</script>";

fn request(n: u64, verdict: VerdictSummary, checks: Vec<CheckRecord>) -> RequestRecord {
    RequestRecord {
        request_id: format!("req-{n}"),
        started_at_ms: now_ms(),
        session: format!("{n:02}ab").repeat(8),
        credential: None,
        provider: "sim".into(),
        model: "small".into(),
        endpoint: Some(
            if n == 3 {
                "messages"
            } else {
                "chat_completions"
            }
            .into(),
        ),
        route: Route::Upstream,
        prompt_tokens_ours: Some(10),
        prompt_tokens_provider: Some(10),
        provider_request_id: None,
        overhead_tokens: None,
        canary_ids: vec![format!("c{n}")],
        instance: None,
        registry_degraded: false,
        topic: None,
        checks,
        verdict,
        action: if verdict == VerdictSummary::Fail {
            Action::Block
        } else {
            Action::Forward
        },
        outcome: Outcome::Complete,
        latency: Latency {
            ttfb_ms: Some(5),
            total_ms: 20 + n,
            overhead_ms: n,
        },
        bytes_in: 100,
        bytes_out: 200,
        request_sha256: sha256_hex(b"in"),
        response_sha256: sha256_hex(b"out"),
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    data: std::path::PathBuf,
    log: AuditLog,
    router: Router,
    runtime: tokio::runtime::Runtime,
}

/// Five records: request 1 passes with `<script>` in its sample, 2 fails
/// `foreign_canary` naming the owner of request 1 (the provider's text,
/// which the client never got, holds the script), 3 passes unsampled; 4 is
/// request 1's topic score, 5 request 3's, low, with the sample it kept.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let log = AuditLog::open(&data, AuditOptions::default()).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pass = |name: &str| CheckRecord {
        name: name.into(),
        result: Status::Pass,
        evidence: serde_json::json!({"reason": "ok", "seen": {}}).into(),
    };
    let first_session = request(1, VerdictSummary::Pass, vec![]).session;
    runtime.block_on(async {
        log.append(NewRecord {
            record: request(1, VerdictSummary::Pass, vec![pass("echo")]),
            sample: Some(Sample {
                request_text: format!("user: {SCRIPT}"),
                response_text: format!("You wrote: {SCRIPT}"),
                provider_text: None,
            }),
        })
        .await
        .unwrap();
        log.append(NewRecord {
            record: request(
                2,
                VerdictSummary::Fail,
                vec![CheckRecord {
                    name: "foreign_canary".into(),
                    result: Status::Fail,
                    evidence: serde_json::json!({
                        "reason": "1 canary of another request",
                        "seen": {"foreign": 1, "lookalikes": 0,
                                 "hits": [{"choice": 0, "session": first_session, "request": "req-1"}]}
                    })
                    .into(),
                }],
            ),
            sample: Some(Sample {
                request_text: "user: name three rivers".into(),
                response_text: "{\"error\":\"blocked\"}".into(),
                provider_text: Some(format!("You wrote: {SCRIPT}")),
            }),
        })
        .await
        .unwrap();
        log.append(NewRecord {
            record: request(3, VerdictSummary::Pass, vec![pass("echo")]),
            sample: None,
        })
        .await
        .unwrap();
        let score = |similarity: f32| TopicScore {
            similarity: Some(similarity),
            skipped: None,
            min_similarity: 0.1,
            model: "all-MiniLM-L6-v2".into(),
        };
        log.append_topic(1, "req-1", score(0.62), None).await.unwrap();
        let kept = Sample {
            request_text: "user: the weather in Oslo".into(),
            response_text: "Bananas are berries.".into(),
            provider_text: None,
        };
        log.append_topic(3, "req-3", score(0.03), Some(&kept))
            .await
            .unwrap();
    });
    // The page's own handle, beside the log's, in the same process.
    let archive = Archive::open_writable(&data).unwrap();
    let router = server::router(Arc::new(AppState {
        archive,
        token: AdminToken::new(TOKEN).unwrap(),
        sample_key: None,
        key_env: "CANARYGATE_AUDIT_KEY".into(),
    }));
    Fixture {
        _dir: dir,
        data,
        log,
        router,
        runtime,
    }
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

impl Fixture {
    fn send(&self, request: Request<Body>) -> Reply {
        self.runtime.block_on(async {
            let response = self.router.clone().oneshot(request).await.unwrap();
            let status = response.status();
            let headers = response.headers().clone();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            Reply {
                status,
                headers,
                body: String::from_utf8(bytes.to_vec()).unwrap(),
            }
        })
    }

    /// Logs in through the form; returns the `Cookie` header value.
    fn login(&self) -> String {
        let reply = self.send(form("/login", &format!("token={}", TOKEN), None));
        assert_eq!(reply.status, StatusCode::SEE_OTHER, "{}", reply.body);
        let set = reply.headers[header::SET_COOKIE].to_str().unwrap();
        set.split(';').next().unwrap().to_owned()
    }

    fn get(&self, path: &str, cookie: Option<&str>) -> Reply {
        let mut request = Request::get(path);
        if let Some(cookie) = cookie {
            request = request.header(header::COOKIE, cookie);
        }
        self.send(request.body(Body::empty()).unwrap())
    }

    /// The CSRF token from a page's forms.
    fn csrf(&self, cookie: &str) -> String {
        let page = self.get("/", Some(cookie)).body;
        let at = page.find("name=\"csrf\" value=\"").unwrap() + 19;
        page[at..at + 64].to_owned()
    }
}

fn form(path: &str, body: &str, cookie: Option<&str>) -> Request<Body> {
    let mut request =
        Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

#[test]
fn pages_need_the_token_and_carry_the_security_headers() {
    let fx = fixture();
    for path in ["/", "/charts", "/records/1", "/nowhere"] {
        let reply = fx.get(path, None);
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}");
        assert!(reply.body.contains("name=\"token\""), "{path}: login form");
        assert!(
            !reply.body.contains("req-1"),
            "{path}: no data before login"
        );
    }
    let reply = fx.get("/", None);
    assert_eq!(reply.headers[header::CONTENT_SECURITY_POLICY], CSP);
    assert!(!CSP.contains("script-src"), "no script is allowed at all");
    assert_eq!(reply.headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    assert_eq!(reply.headers[header::REFERRER_POLICY], "no-referrer");
    assert_eq!(reply.headers[header::CACHE_CONTROL], "no-store");

    let wrong = fx.send(form("/login", "token=review-token-for-tests-0124", None));
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.headers.get(header::SET_COOKIE).is_none());
    assert!(wrong.body.contains("not the admin token"));
    let empty = fx.send(form("/login", "", None));
    assert_eq!(empty.status, StatusCode::UNAUTHORIZED);

    let cookie = fx.login();
    assert!(cookie.starts_with(&format!("{COOKIE}=")));
    assert!(!cookie.contains(TOKEN));
    assert_eq!(fx.get("/", Some(&cookie)).status, StatusCode::OK);
    assert_eq!(
        fx.get("/?x=1", Some(&format!("{COOKIE}=00"))).status,
        StatusCode::UNAUTHORIZED
    );

    let bearer = fx.send(
        Request::get("/records/1")
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .body(Body::empty())
            .unwrap(),
    );
    assert_eq!(bearer.status, StatusCode::OK);
    let stylesheet = fx.get("/style.css", None);
    assert_eq!(stylesheet.status, StatusCode::OK);
    assert_eq!(
        stylesheet.headers[header::CONTENT_TYPE],
        "text/css; charset=utf-8"
    );
}

#[test]
fn the_list_filters_and_refuses_bad_filters() {
    let fx = fixture();
    let cookie = fx.login();
    let all = fx.get("/", Some(&cookie));
    assert_eq!(
        all.body.matches("class=\"record\"").count(),
        3,
        "{}",
        all.body
    );
    assert!(all.body.contains("3 of 3 request records"));
    assert!(all.body.contains("0.0300 low"), "{}", all.body);
    let ids = |body: &str| -> Vec<String> {
        body.match_indices("class=\"record\" data-id=\"")
            .map(|(at, m)| body[at + m.len()..].split('"').next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(ids(&all.body), ["3", "2", "1"], "newest first");
    for (query, expected) in [
        ("verdict=fail", vec!["2"]),
        ("check=foreign_canary", vec!["2"]),
        ("verdict=pass&endpoint=messages", vec!["3"]),
        ("session=01AB", vec!["1"]),
        ("route=local", vec![]),
        ("reviewed=no&order=suspicious", vec!["2", "3", "1"]),
        ("topic=low", vec!["3"]),
        ("request=req-3", vec!["3"]),
        ("since=1h", vec!["3", "2", "1"]),
        ("until=2020-01-01", vec![]),
        ("verdict=&check=", vec!["3", "2", "1"]),
    ] {
        let reply = fx.get(&format!("/?{query}"), Some(&cookie));
        assert_eq!(reply.status, StatusCode::OK, "{query}: {}", reply.body);
        assert_eq!(ids(&reply.body), expected, "{query}");
    }
    for (query, message) in [
        ("verdict=%3Cscript%3E", "verdict `&lt;script&gt;` must be"),
        ("route=moon", "route `moon`"),
        ("since=tomorrow-ish", "cannot read time"),
        ("page=0", "page `0`"),
        ("colour=red", "unknown filter `colour`"),
        ("session=zz", "hex prefix"),
    ] {
        let reply = fx.get(&format!("/?{query}"), Some(&cookie));
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(reply.body.contains(message), "{query}: {}", reply.body);
        assert!(!reply.body.contains("<script>"), "{query}");
    }
    let charts = fx.get("/charts?verdict=fail", Some(&cookie));
    assert_eq!(charts.status, StatusCode::OK);
    assert_eq!(charts.body.matches("<svg").count(), 3, "{}", charts.body);
    assert!(charts.body.contains("foreign_canary 1"), "{}", charts.body);
    assert_eq!(
        fx.get("/charts?verdict=nope", Some(&cookie)).status,
        StatusCode::BAD_REQUEST
    );
}

#[test]
fn records_render_untrusted_text_as_text() {
    let fx = fixture();
    let cookie = fx.login();
    let one = fx.get("/records/1", Some(&cookie));
    assert_eq!(one.status, StatusCode::OK);
    assert!(
        one.body
            .contains("You wrote: &lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;"),
        "{}",
        one.body
    );
    assert!(!one.body.contains("<script"), "{}", one.body);
    assert!(one.body.contains("id=\"review-form\""));

    let two = fx.get("/records/2", Some(&cookie));
    assert!(two.body.contains("id=\"exposed\""), "{}", two.body);
    assert!(
        two.body.contains(
            "<pre id=\"provider-text\">You wrote: &lt;script&gt;document.title=&#39;pwned&#39;"
        ),
        "{}",
        two.body
    );
    assert!(!two.body.contains("<script"));
    let owner = request(1, VerdictSummary::Pass, vec![]).session;
    assert!(
        two.body.contains(&format!("/?session={owner}")),
        "{}",
        two.body
    );
    assert!(two.body.contains("/?request=req-1"));
    assert!(
        !fx.get("/records/1", Some(&cookie))
            .body
            .contains("id=\"exposed\"")
    );

    // Request 3's sample and low score live in its topic record, 5.
    let three = fx.get("/records/3", Some(&cookie)).body;
    assert!(three.contains("Bananas are berries."), "{three}");
    assert!(
        three.contains("similarity 0.0300 against a threshold of 0.1000: LOW"),
        "{three}"
    );
    assert!(three.contains("href=\"/records/5\""), "{three}");
    assert!(!three.contains("id=\"provider-text\""));
    let one = fx.get("/records/1", Some(&cookie)).body;
    assert!(
        one.contains("similarity 0.6200") && one.contains(": fits"),
        "{one}"
    );
    let topic = fx.get("/records/4", Some(&cookie)).body;
    assert!(
        topic.contains("The topic score of <a href=\"/records/1\">"),
        "{topic}"
    );
    assert_eq!(
        fx.get("/records/99", Some(&cookie)).status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        fx.get("/records/x", Some(&cookie)).status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        fx.get("/records/-1", Some(&cookie)).status,
        StatusCode::BAD_REQUEST
    );
}

#[test]
fn reviews_need_csrf_and_keep_the_chain_valid() {
    let fx = fixture();
    let cookie = fx.login();
    let csrf = fx.csrf(&cookie);

    let missing = fx.send(form(
        "/records/2/review",
        "verdict=bad&note=x",
        Some(&cookie),
    ));
    assert_eq!(missing.status, StatusCode::FORBIDDEN, "{}", missing.body);
    let wrong = fx.send(form(
        "/records/2/review",
        &format!("verdict=bad&csrf={}", "ab".repeat(32)),
        Some(&cookie),
    ));
    assert_eq!(wrong.status, StatusCode::FORBIDDEN);
    // The CSRF token alone is not a session.
    let no_cookie = fx.send(form(
        "/records/2/review",
        &format!("verdict=bad&csrf={csrf}"),
        None,
    ));
    assert_eq!(no_cookie.status, StatusCode::UNAUTHORIZED);
    let no_verdict = fx.send(form(
        "/records/2/review",
        &format!("csrf={csrf}"),
        Some(&cookie),
    ));
    assert_eq!(no_verdict.status, StatusCode::BAD_REQUEST);
    let too_big = fx.send(form(
        "/records/2/review",
        &format!(
            "csrf={csrf}&verdict=bad&note={}",
            "x".repeat(MAX_FORM_BYTES)
        ),
        Some(&cookie),
    ));
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE);

    let note = "leak: <b>answer</b> of another session";
    let done = fx.send(form(
        "/records/2/review",
        &format!(
            "verdict=bad&note={}&csrf={csrf}",
            crate::html::url_encode(note)
        ),
        Some(&cookie),
    ));
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(done.headers[header::LOCATION], "/records/2");
    let page = fx.get("/records/2", Some(&cookie)).body;
    assert!(page.contains("Reviewed in"), "{page}");
    assert!(page.contains("leak: &lt;b&gt;answer&lt;/b&gt; of another session"));
    assert!(!page.contains("id=\"review-form\""));
    let again = fx.send(form(
        "/records/2/review",
        &format!("verdict=ok&csrf={csrf}"),
        Some(&cookie),
    ));
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
    assert!(again.body.contains("already reviewed"));
    let review_of_review = fx.send(form(
        "/records/4/review",
        &format!("verdict=ok&csrf={csrf}"),
        Some(&cookie),
    ));
    assert_eq!(review_of_review.status, StatusCode::CONFLICT);
    assert_eq!(
        fx.send(form(
            "/records/77/review",
            &format!("verdict=ok&csrf={csrf}"),
            Some(&cookie)
        ))
        .status,
        StatusCode::NOT_FOUND
    );
    let reviewed = fx.get("/?reviewed=yes", Some(&cookie)).body;
    assert!(reviewed.contains("data-id=\"2\"") && reviewed.contains("r-bad"));

    // The log, still open in this process, appends after the page's review.
    fx.runtime.block_on(async {
        fx.log
            .append(NewRecord {
                record: request(5, VerdictSummary::Pass, vec![]),
                sample: None,
            })
            .await
            .unwrap();
    });
    let report = Archive::open_read_only(&fx.data).unwrap().verify().unwrap();
    assert_eq!(report.records, 7);
    let snapshot = Archive::open_read_only(&fx.data)
        .unwrap()
        .snapshot()
        .unwrap();
    assert_eq!(snapshot.review_of(2).unwrap(), Some(6));

    // Logging out needs the CSRF token too, and ends the cookie.
    let refused = fx.send(form("/logout", "", Some(&cookie)));
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    let out = fx.send(form("/logout", &format!("csrf={csrf}"), Some(&cookie)));
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(
        out.headers[header::SET_COOKIE]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    // The server ends it too: a copy of the cookie kept by anyone is refused.
    assert_eq!(fx.get("/", Some(&cookie)).status, StatusCode::UNAUTHORIZED);
}

#[test]
fn the_server_answers_on_a_real_socket_and_needs_a_store() {
    let fx = fixture();
    fx.runtime.block_on(async {
        let options = |data_dir: std::path::PathBuf| crate::ReviewOptions {
            data_dir,
            listen: "127.0.0.1:0".parse().unwrap(),
            token: AdminToken::new(TOKEN).unwrap(),
            sample_key: None,
            key_env: "CANARYGATE_AUDIT_KEY".into(),
        };
        let missing = crate::ReviewServer::bind(options(fx.data.join("nothing-here")))
            .await
            .err()
            .expect("no store, no page");
        assert!(missing.to_string().contains("no audit log at"), "{missing}");
        assert!(!fx.data.join("nothing-here").exists());

        let server = crate::ReviewServer::bind(options(fx.data.clone()))
            .await
            .unwrap();
        let address = server.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
        socket
            .write_all(
                format!(
                    "GET /records/2 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\
                     Connection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            socket.read_to_string(&mut answer),
        )
        .await
        .expect("answered in time")
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("id=\"exposed\""));
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("content-security-policy: default-src 'none'")
        );
        stop.send(()).unwrap();
        serving.await.unwrap().unwrap();
    });
}

#[test]
fn the_list_pages_through_many_records() {
    let fx = fixture();
    fx.runtime.block_on(async {
        for n in 10..70 {
            fx.log
                .append(NewRecord {
                    record: request(n, VerdictSummary::Pass, vec![]),
                    sample: None,
                })
                .await
                .unwrap();
        }
    });
    let cookie = fx.login();
    let rows = |body: &str| body.matches("class=\"record\"").count();
    let first = fx.get("/", Some(&cookie)).body;
    assert_eq!(rows(&first), crate::filter::PAGE_SIZE);
    assert!(
        first.contains("63 of 63 request records match; page 1 of 2"),
        "{first}"
    );
    assert!(first.contains("href=\"/?page=2\">older</a>"), "{first}");
    assert!(!first.contains(">newer</a>"));
    let second = fx.get("/?page=2", Some(&cookie)).body;
    assert_eq!(rows(&second), 13);
    assert!(second.contains(">newer</a>") && !second.contains(">older</a>"));
    // Past the end: the last page.
    assert_eq!(rows(&fx.get("/?page=9", Some(&cookie)).body), 13);
    // Filters survive paging.
    let filtered = fx.get("/?verdict=pass&page=2", Some(&cookie)).body;
    assert!(
        filtered.contains("href=\"/?verdict=pass\">newer</a>"),
        "{filtered}"
    );
}

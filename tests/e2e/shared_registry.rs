//! Several instances on one canary registry, on a real `redis-server`: a
//! canary minted by instance A and slipped into instance B's answer (the
//! simulator's `swap` mode answers from the most recent other request's
//! context) is caught by B as foreign, naming A's request; with Redis
//! killed, a fail-closed instance refuses requests before sending them and
//! a degrading one serves them marked `registry_degraded`; Redis back on the
//! same port, both recover without a restart. The instances' audit logs
//! merge into one export and each chain verifies.
//!
//! `redis-server` comes from `PATH` (or `$CANARYGATE_REDIS_SERVER`);
//! `scripts/test.sh` installs the Debian package when it is missing.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{
    ProxyDir, Running, audit_export, binary, chat_body, client, make_pki, start_proxy_with_args,
    start_sim,
};

/// The deployment's shared registry key, as an operator would provision it.
const REGISTRY_KEY: &str = "5d1c0e8f3b2a49c7a6e1f0d9c8b7a6e5f4d3c2b1a0918273645f6e7d8c9b0a1f";

/// The password every test Redis requires.
const REDIS_PASSWORD: &str = "test-registry-password";

/// A `redis-server` on a fixed port, killed when dropped.
struct Redis {
    child: Child,
    port: u16,
    tls: bool,
}

impl Redis {
    /// A plain-TCP server on `port`.
    fn start(port: u16) -> Self {
        let port_text = port.to_string();
        let args = ["--port", &port_text, "--requirepass", REDIS_PASSWORD];
        Self::start_with(port, &args, false)
    }

    /// A TLS-only server on `port` with the certificate and key given.
    fn start_tls(port: u16, cert: &str, key: &str, ca: &str) -> Self {
        let port_text = port.to_string();
        let args = [
            "--port",
            "0",
            "--tls-port",
            &port_text,
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            ca,
            "--tls-auth-clients",
            "no",
            "--requirepass",
            REDIS_PASSWORD,
        ];
        Self::start_with(port, &args, true)
    }

    fn start_with(port: u16, args: &[&str], tls: bool) -> Self {
        let program = std::env::var_os("CANARYGATE_REDIS_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("redis-server"));
        let child = Command::new(&program)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run {}: {error}. Install redis-server (scripts/test.sh does: \
                     apt-get install redis-server) or set CANARYGATE_REDIS_SERVER",
                    program.display()
                )
            });
        let redis = Self { child, port, tls };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !redis.answers_ping() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        redis
    }

    /// Whether the server accepts connections (and, over plain TCP,
    /// answers: `-NOAUTH` until a client authenticates).
    fn answers_ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if self.tls {
            return true;
        }
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let mut reply = [0u8; 1];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && reply[0] == b'-'
    }

    /// The first line of the server's reply to the inline `command`, sent
    /// after authenticating (plain TCP only).
    fn command(&self, command: &str) -> String {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect to redis");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        write!(stream, "AUTH {REDIS_PASSWORD}\r\n{command}\r\n").expect("send to redis");
        let mut reader = std::io::BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).expect("AUTH reply");
        assert_eq!(line, "+OK\r\n", "AUTH");
        line.clear();
        reader.read_line(&mut line).expect("reply");
        line.trim_end().to_owned()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("local addr").port()
}

/// A policy on the shared registry at `port`: model `swap` goes to the
/// swapping simulator, every other model to the honest one.
fn policy(dir: &ProxyDir, honest: &str, swap: &str, port: u16, on_unavailable: &str) -> PathBuf {
    let registry = format!(
        r#"backend = "redis"
url = "redis://127.0.0.1:{port}/0"
key_prefix = "test-deployment:"
timeout_ms = 300
on_unavailable = "{on_unavailable}""#
    );
    policy_with(dir, honest, swap, &registry)
}

/// The policy of [`policy`] with `registry` as the `[registry]` section
/// (the key and password variables are added).
fn policy_with(dir: &ProxyDir, honest: &str, swap: &str, registry: &str) -> PathBuf {
    dir.policy(&format!(
        r#"
[[providers]]
name = "honest"
base_url = "{honest}/v1"
context_window = 128000

[[providers]]
name = "swap"
base_url = "{swap}/v1"
context_window = 128000

[[routes]]
model = "swap"
provider = "swap"

[[routes]]
model = "*"
provider = "honest"

[registry]
key_env = "CANARYGATE_REGISTRY_KEY"
password_env = "CANARYGATE_REDIS_PASSWORD"
{registry}
"#
    ))
}

fn start_instance(dir: &ProxyDir, policy: &std::path::Path, name: &str) -> Running {
    start_instance_with(dir, policy, name, REDIS_PASSWORD)
}

fn start_instance_with(
    dir: &ProxyDir,
    policy: &std::path::Path,
    name: &str,
    password: &str,
) -> Running {
    start_proxy_with_args(
        dir,
        policy,
        &["--instance", name],
        &[
            ("CANARYGATE_REGISTRY_KEY", REGISTRY_KEY),
            ("CANARYGATE_REDIS_PASSWORD", password),
        ],
    )
}

/// Status, verdict header, request id and body of one chat request.
async fn ask(proxy: &Running, model: &str, stream: bool) -> (u16, String, String, String) {
    let response = client()
        .post(format!("{}/v1/chat/completions", proxy.url))
        .bearer_auth("sk-test")
        .json(&chat_body(model, "Name three rivers.", stream))
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
    let verdict = header("x-canarygate-verdict");
    let request_id = header("x-canarygate-request-id");
    let status = response.status().as_u16();
    let body = response.text().await.expect("body");
    (status, verdict, request_id, body)
}

async fn health(proxy: &Running) -> (u16, Value) {
    let response = client()
        .get(format!("{}/healthz", proxy.url))
        .send()
        .await
        .expect("healthz");
    (
        response.status().as_u16(),
        response.json().await.expect("healthz JSON"),
    )
}

/// Waits until `proxy`'s `/healthz` says `status`.
async fn wait_health(proxy: &Running, status: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = health(proxy).await;
        if body["status"] == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "healthz never said {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn record<'a>(records: &'a [Value], request_id: &str) -> &'a Value {
    records
        .iter()
        .find(|record| record["request_id"] == request_id)
        .unwrap_or_else(|| panic!("no record of {request_id}"))
}

fn check<'a>(record: &'a Value, name: &str) -> &'a Value {
    record["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|check| check["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {record}"))
}

/// The foreign-canary evidence of a record (the check's `seen` numbers).
fn foreign_evidence(record: &Value) -> &Value {
    let evidence = &check(record, "foreign_canary")["evidence"];
    evidence.get("seen").unwrap_or(evidence)
}

async fn requests_seen(sim: &Running) -> u64 {
    crate::common::sim_stats(sim).await["requests"]
        .as_u64()
        .expect("sim stats count requests")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_canaries_and_behave_as_configured_without_redis() {
    let port = free_port();
    let mut redis = Redis::start(port);
    let honest = start_sim(&[]);
    let swap = start_sim(&["--mode", "swap"]);
    let (dir_a, dir_b) = (ProxyDir::new(), ProxyDir::new());
    let policy_a = policy(&dir_a, &honest.url, &swap.url, port, "degrade");
    let policy_b = policy(&dir_b, &honest.url, &swap.url, port, "fail-closed");
    let a = start_instance(&dir_a, &policy_a, "instance-a");
    let b = start_instance(&dir_b, &policy_b, "instance-b");

    // Both healthy; an honest answer passes on each.
    for proxy in [&a, &b] {
        wait_health(proxy, "ok").await;
        let (status, verdict, _, body) = ask(proxy, "m", false).await;
        assert_eq!((status, verdict.as_str()), (200, "pass"), "{body}");
    }

    // A's canaries in B's answer, non-streamed then streamed: B names A's
    // request. B's memory never held them: only the shared registry did.
    for stream in [false, true] {
        // Whatever A gets (after the first, the swapping sim answers it from
        // B's last request), its canaries are now live in the registry.
        let (_, _, minted_by_a, _) = ask(&a, "swap", false).await;
        let (status, verdict, leaked_to_b, body) = ask(&b, "swap", stream).await;
        assert!(
            !body.contains("CG"),
            "B delivered a canary-shaped span (stream={stream}): {body}"
        );
        if !stream {
            assert_eq!(status, 502, "{body}");
            assert!(verdict.contains("foreign_canary"), "{verdict}");
        }
        let records = audit_export(&dir_b.data());
        let leaked = record(&records, &leaked_to_b);
        assert_eq!(
            check(leaked, "foreign_canary")["result"],
            "fail",
            "{leaked}"
        );
        let evidence = foreign_evidence(leaked);
        assert_eq!(
            evidence["hits"][0]["request"], minted_by_a,
            "B names the request whose canary leaked (stream={stream}): {evidence}"
        );
        assert_eq!(leaked["instance"], "instance-b");
    }

    // Redis goes away. B fails closed: 503 in OpenAI's shape, nothing sent
    // upstream, /healthz 503. A degrades: served, marked.
    redis.kill();
    wait_health(&a, "degraded").await;
    wait_health(&b, "unavailable").await;
    assert_eq!(health(&b).await.0, 503);
    let sent_before = requests_seen(&honest).await;
    let (status, _, _, body) = ask(&b, "m", false).await;
    assert_eq!(status, 503, "{body}");
    let error: Value = serde_json::from_str(&body).expect("an OpenAI-shaped error");
    assert_eq!(
        error["error"]["code"], "canarygate_registry_unavailable",
        "{error}"
    );
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    assert_eq!(
        requests_seen(&honest).await,
        sent_before,
        "a fail-closed instance sent a request while its registry was down"
    );
    let (status, verdict, degraded_id, body) = ask(&a, "m", false).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(verdict, "pass; registry_degraded");
    // B's canaries (its last swap request) in A's answer: A cannot ask who
    // minted them, and says so.
    let (_, _, unresolved_id, _) = ask(&a, "swap", false).await;
    let metrics = client()
        .get(format!("{}/metrics", a.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(metrics.contains("canarygate_registry_up 0"), "{metrics}");
    assert!(
        metrics.contains("canarygate_registry_unavailable_requests_total{what=\"degraded\"}"),
        "{metrics}"
    );

    // Neither secret reaches /healthz while it explains the outage.
    for proxy in [&a, &b] {
        let (_, body) = health(proxy).await;
        let text = body.to_string();
        assert!(
            !text.contains(REDIS_PASSWORD) && !text.contains(REGISTRY_KEY),
            "{text}"
        );
    }

    // Redis back on the same port, empty: both recover by themselves, and A
    // claims again the canaries it registered while Redis was away. The
    // swapping sim's most recent request is A's from the outage: its
    // canaries in B's answer are caught, naming that request.
    let _redis = Redis::start(port);
    wait_health(&a, "ok").await;
    wait_health(&b, "ok").await;
    let (status, _, reclaimed_leak, body) = ask(&b, "swap", false).await;
    assert_eq!(status, 502, "{body}");
    let records_b = audit_export(&dir_b.data());
    let evidence = foreign_evidence(record(&records_b, &reclaimed_leak));
    assert_eq!(
        evidence["hits"][0]["request"], unresolved_id,
        "a canary registered during the outage is known to B once Redis is back: {evidence}"
    );

    // An instance keyed differently cannot use the registry, and says so.
    let dir_c = ProxyDir::new();
    let policy_c = policy(&dir_c, &honest.url, &swap.url, port, "degrade");
    let other_key = "0f".repeat(32);
    let c = start_proxy_with_args(
        &dir_c,
        &policy_c,
        &[],
        &[
            ("CANARYGATE_REGISTRY_KEY", other_key.as_str()),
            ("CANARYGATE_REDIS_PASSWORD", REDIS_PASSWORD),
        ],
    );
    wait_health(&c, "degraded").await;
    let (_, body) = health(&c).await;
    assert!(
        body["registry"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("different registry key"),
        "{body}"
    );
    drop(c);
    for proxy in [&a, &b] {
        let (status, verdict, _, body) = ask(proxy, "m", true).await;
        assert_eq!(
            (status, verdict.as_str()),
            (200, "pending; release=echo-first"),
            "{body}"
        );
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
        let (status, verdict, _, body) = ask(proxy, "m", false).await;
        assert_eq!((status, verdict.as_str()), (200, "pass"), "{body}");
    }

    let records_a = audit_export(&dir_a.data());
    let degraded = record(&records_a, &degraded_id);
    assert_eq!(degraded["registry_degraded"], true, "{degraded}");
    let unresolved = foreign_evidence(record(&records_a, &unresolved_id));
    assert!(
        unresolved["unresolved"].as_u64().unwrap_or(0) >= 1,
        "A's lookup of B's canary could not be made: {unresolved}"
    );

    // One export of both logs, in time order, each record naming its
    // instance; both chains verify.
    let merged = Command::new(binary())
        .args(["audit", "export", "--data"])
        .arg(dir_a.data())
        .arg("--data")
        .arg(dir_b.data())
        .output()
        .expect("audit export");
    assert!(
        merged.status.success(),
        "{}",
        String::from_utf8_lossy(&merged.stderr)
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&merged.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("JSON line"))
        .collect();
    assert_eq!(
        lines.len(),
        records_a.len() + audit_export(&dir_b.data()).len()
    );
    let times: Vec<u64> = lines
        .iter()
        .map(|line| line["recorded_at_ms"].as_u64().expect("recorded_at_ms"))
        .collect();
    assert!(
        times.is_sorted(),
        "merged export out of time order: {times:?}"
    );
    for name in ["instance-a", "instance-b"] {
        assert!(
            lines.iter().any(|line| line["instance"] == name),
            "no record of {name} in the merged export"
        );
    }
    let verify = Command::new(binary())
        .args(["audit", "verify", "--data"])
        .arg(dir_a.data())
        .arg("--data")
        .arg(dir_b.data())
        .output()
        .expect("audit verify");
    let report = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.status.success(), "{report}");
    assert_eq!(report.matches("ok: ").count(), 2, "{report}");
}

/// A server that loses its data (a flush, a restart without persistence)
/// loses every instance's live canaries. Each instance notices on its own
/// and claims its own again, whichever noticed first: after a flush, each
/// instance's canaries from before it are caught in the other's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_server_loses_its_data_every_instance_claims_its_canaries_again() {
    let port = free_port();
    let redis = Redis::start(port);
    let honest = start_sim(&[]);
    // One swapping sim per instance: each answers with the context of the
    // request it served before.
    let (swap_a, swap_b) = (
        start_sim(&["--mode", "swap"]),
        start_sim(&["--mode", "swap"]),
    );
    let registry = format!(
        "backend = \"redis\"\nurl = \"redis://127.0.0.1:{port}/0\"\n\
         key_prefix = \"test-deployment:\"\ntimeout_ms = 300\n\n\
         [[providers]]\nname = \"swap-b\"\nbase_url = \"{}/v1\"\ncontext_window = 128000\n\n\
         [[routes]]\nmodel = \"swap-b\"\nprovider = \"swap-b\"\n",
        swap_b.url
    );
    let (dir_a, dir_b) = (ProxyDir::new(), ProxyDir::new());
    // `swap` goes to swap_a, `swap-b` to swap_b (routes before the wildcard
    // match first: the policy's `swap-b` route is moved ahead of it).
    let text = |dir: &ProxyDir| {
        let path = policy_with(dir, &honest.url, &swap_a.url, &registry);
        let text = std::fs::read_to_string(&path).unwrap();
        let wildcard = "[[routes]]\nmodel = \"*\"\nprovider = \"honest\"\n";
        let moved = text.replacen(wildcard, "", 1) + "\n" + wildcard;
        dir.policy(&moved)
    };
    let a = start_instance(&dir_a, &text(&dir_a), "instance-a");
    let b = start_instance(&dir_b, &text(&dir_b), "instance-b");
    wait_health(&a, "ok").await;
    wait_health(&b, "ok").await;
    let (_, _, minted_by_a, _) = ask(&a, "swap", false).await;
    let (_, _, minted_by_b, _) = ask(&b, "swap-b", false).await;
    let canaries = || {
        let reply = redis.command("KEYS test-deployment:canary:*");
        reply
            .strip_prefix('*')
            .and_then(|count| count.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("KEYS answered {reply}"))
    };
    assert_eq!(canaries(), 4, "two canaries per request");

    assert_eq!(redis.command("FLUSHALL"), "+OK");
    let deadline = Instant::now() + Duration::from_secs(10);
    while canaries() < 4 {
        assert!(
            Instant::now() < deadline,
            "after a flush, {} of 4 live canaries were claimed again",
            canaries()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (proxy, model, minted, dir) in [
        (&b, "swap", &minted_by_a, &dir_b),
        (&a, "swap-b", &minted_by_b, &dir_a),
    ] {
        let (status, verdict, leaked, body) = ask(proxy, model, false).await;
        assert_eq!(status, 502, "{body}");
        assert!(verdict.contains("foreign_canary"), "{verdict}");
        let records = audit_export(&dir.data());
        let evidence = foreign_evidence(record(&records, &leaked));
        assert_eq!(evidence["hits"][0]["request"], *minted, "{evidence}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_registry_behind_a_private_ca_with_a_password() {
    let pki = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = make_pki(pki.path());
    let port = free_port();
    let _redis = Redis::start_tls(port, &cert, &key, &ca);
    let honest = start_sim(&[]);
    let registry = |on_unavailable: &str| {
        format!(
            r#"backend = "redis"
url = "rediss://localhost:{port}/0"
ca_file = "{ca}"
on_unavailable = "{on_unavailable}""#
        )
    };
    let dir = ProxyDir::new();
    let tls = start_instance(
        &dir,
        &policy_with(&dir, &honest.url, &honest.url, &registry("fail-closed")),
        "tls",
    );
    wait_health(&tls, "ok").await;
    let (status, verdict, _, body) = ask(&tls, "m", false).await;
    assert_eq!((status, verdict.as_str()), (200, "pass"), "{body}");

    // The wrong password: the registry never answers, and the instance says
    // so (degrading: it serves, marked).
    let wrong_dir = ProxyDir::new();
    let wrong = start_instance_with(
        &wrong_dir,
        &policy_with(&wrong_dir, &honest.url, &honest.url, &registry("degrade")),
        "wrong-password",
        "not-the-password",
    );
    wait_health(&wrong, "degraded").await;
    let (_, body) = health(&wrong).await;
    let error = body["registry"]["error"].as_str().unwrap_or_default();
    assert!(!error.contains("not-the-password"), "{body}");
    let (status, verdict, _, body) = ask(&wrong, "m", false).await;
    assert_eq!(
        (status, verdict.as_str()),
        (200, "pass; registry_degraded"),
        "{body}"
    );

    // Without ca_file, the private CA is not trusted: certificates are
    // checked.
    let untrusted_dir = ProxyDir::new();
    let untrusted_registry = format!(
        r#"backend = "redis"
url = "rediss://localhost:{port}/0"
on_unavailable = "degrade""#
    );
    let untrusted = start_instance(
        &untrusted_dir,
        &policy_with(
            &untrusted_dir,
            &honest.url,
            &honest.url,
            &untrusted_registry,
        ),
        "untrusted",
    );
    wait_health(&untrusted, "degraded").await;
}

/// A registry that takes claims but refuses lookups (an ACL without `MGET`):
/// under `fail-closed`, an answer whose canary-shaped spans cannot be
/// looked up fails `foreign_canary` and is blocked, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_that_fails_fails_the_answer_closed() {
    let port = free_port();
    let port_text = port.to_string();
    let acl = format!(">{REDIS_PASSWORD}");
    // `--requirepass` is replaced by an ACL for the default user: every
    // command but MGET.
    let _redis = Redis::start_with(
        port,
        &[
            "--port", &port_text, "--user", "default", "on", &acl, "~*", "+@all", "-mget",
        ],
        false,
    );
    let honest = start_sim(&[]);
    let swap = start_sim(&["--mode", "swap"]);
    let (dir_a, dir_b) = (ProxyDir::new(), ProxyDir::new());
    let a = start_instance(
        &dir_a,
        &policy(&dir_a, &honest.url, &swap.url, port, "degrade"),
        "a",
    );
    let b = start_instance(
        &dir_b,
        &policy(&dir_b, &honest.url, &swap.url, port, "fail-closed"),
        "b",
    );
    wait_health(&a, "ok").await;
    wait_health(&b, "ok").await;
    let (_, _, minted_by_a, _) = ask(&a, "swap", false).await;
    let (status, verdict, leaked, body) = ask(&b, "swap", false).await;
    assert_eq!(status, 502, "{body}");
    assert!(verdict.contains("foreign_canary"), "{verdict}");
    assert!(verdict.ends_with("registry_degraded"), "{verdict}");
    assert!(!body.contains(&minted_by_a), "{body}");
    let records = audit_export(&dir_b.data());
    let leaked = record(&records, &leaked);
    let check = check(leaked, "foreign_canary");
    assert_eq!(check["result"], "fail", "{check}");
    assert!(
        check["evidence"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("could not be looked up"),
        "{check}"
    );
    assert_eq!(leaked["registry_degraded"], true, "{leaked}");
    let metrics = client()
        .get(format!("{}/metrics", b.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(
        metrics.contains("canarygate_registry_unavailable_requests_total{what=\"failed\"} 1"),
        "{metrics}"
    );
}

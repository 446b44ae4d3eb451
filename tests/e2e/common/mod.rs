//! Shared helpers for end-to-end tests: real processes on real sockets.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// Path of the `canarygate` binary under test.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_canarygate")
}

/// A child process that is killed when dropped.
pub struct Running {
    child: Child,
    /// Base URL it announced, e.g. `http://127.0.0.1:41234`.
    pub url: String,
}

impl Running {
    /// Starts `canarygate <args>` and waits for its "listening on URL" line.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary());
        command.args(args);
        Self::start_command(command, envs)
    }

    /// Starts `command` (which runs canarygate, perhaps through a wrapper)
    /// and waits for its "listening on URL" line.
    pub fn start_command(mut command: Command, envs: &[(&str, &str)]) -> Self {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("CANARYGATE_LOG", "warn");
        for (key, value) in envs {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn canarygate");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = match lines.next() {
            Some(Ok(line)) => line,
            other => {
                let status = child.wait().ok();
                panic!("{command:?} exited before listening: {other:?}, status {status:?}");
            }
        };
        let url = line
            .rsplit(' ')
            .next()
            .filter(|url| url.starts_with("http"))
            .unwrap_or_else(|| panic!("unexpected first line: {line}"))
            .to_owned();
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Self { child, url }
    }

    /// Sends `signal` (`TERM`, `HUP`, ...) with `kill(1)`.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill(1)");
        assert!(sent.success(), "kill -{signal}");
    }

    /// Its exit status once it exits within `within`; `None` while it runs.
    pub fn exited_within(
        &mut self,
        within: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Sends SIGKILL and waits.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts a simulated provider on a free port with extra arguments.
pub fn start_sim(extra: &[&str]) -> Running {
    let mut args = vec!["sim-provider", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Running::start(&args, &[])
}

/// A temporary data directory and policy for one proxy.
pub struct ProxyDir {
    /// Holds the files; removed when dropped.
    pub dir: tempfile::TempDir,
}

impl ProxyDir {
    /// A fresh directory.
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// Writes `text` as `policy.toml` and returns its path.
    pub fn policy(&self, text: &str) -> PathBuf {
        let path = self.dir.path().join("policy.toml");
        std::fs::write(&path, text).expect("write policy");
        path
    }

    /// The data directory path.
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }
}

/// Starts `canarygate serve` with the default preset pointed at `upstream`.
pub fn start_proxy(dir: &ProxyDir, upstream: &str) -> Running {
    let data = dir.data();
    Running::start(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data",
            data.to_str().unwrap(),
            "--upstream",
            &format!("{upstream}/v1"),
        ],
        &[],
    )
}

/// Starts `canarygate serve --config <policy>`.
pub fn start_proxy_with_policy(dir: &ProxyDir, policy: &Path, envs: &[(&str, &str)]) -> Running {
    start_proxy_with_args(dir, policy, &[], envs)
}

/// [`start_proxy_with_policy`] with `extra` arguments to `serve`.
pub fn start_proxy_with_args(
    dir: &ProxyDir,
    policy: &Path,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Running {
    let data = dir.data();
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data",
        data.to_str().unwrap(),
        "--config",
        policy.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Running::start(&args, envs)
}

/// An HTTP client with a generous timeout (tests must never hang).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

/// A chat request body with one user message.
pub fn chat_body(model: &str, text: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    })
}

/// Parses an SSE body into the `data` payloads (simple, for test assertions).
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Concatenated `delta.content` of a chat completion stream body.
pub fn stream_content(body: &str) -> String {
    sse_data(body)
        .iter()
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Whether `text` holds anything canary-shaped (any copy variation the
/// verifier's scanner recognises).
pub fn holds_canary(text: &str) -> bool {
    canarygate_policies::canary::find_canaries(text)
        .next()
        .is_some()
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python interpreter with the `openai` SDK, installed by `scripts/test.sh`.
pub fn python() -> PathBuf {
    if let Ok(path) = std::env::var("CANARYGATE_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = workspace_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run scripts/test.sh (it creates the venv with the openai SDK) \
         or set CANARYGATE_PYTHON",
        venv.display()
    );
    venv
}

/// Writes a policy that verifies every model's answers from provider `sim`
/// at `upstream`, with `extra` sections (`[verify]`, `[limits]`, `[audit]`)
/// appended.
pub fn verified_policy(dir: &ProxyDir, upstream: &str, extra: &str) -> PathBuf {
    dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{upstream}/v1"
context_window = 1048576

[[routes]]
model = "*"
provider = "sim"

{extra}"#
    ))
}

/// Serves `app` as a provider on a free port; returns its base URL.
pub async fn serve_upstream(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// Every file under `dir`, its subdirectories' included (none when it
/// cannot be read).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                files.extend(files_under(&path));
            } else {
                files.push(path);
            }
        }
    }
    files
}

/// Writes a policy for a plain proxy (`[verify] enabled = false`) to
/// `upstream`, with `extra` sections (`[limits]`, `[audit]`) appended.
pub fn plain_policy(dir: &ProxyDir, upstream: &str, extra: &str) -> PathBuf {
    dir.policy(&format!(
        r#"
[[providers]]
name = "sim"
base_url = "{upstream}/v1"
context_window = 128000

[[routes]]
model = "*"
provider = "sim"

[verify]
enabled = false

{extra}
"#
    ))
}

/// Starts `canarygate serve` as a plain proxy (`[verify] enabled = false`) to `upstream`.
pub fn start_plain_proxy(dir: &ProxyDir, upstream: &str) -> Running {
    start_plain_proxy_with(dir, upstream, "")
}

/// [`start_plain_proxy`] with `extra` policy sections (`[limits]`, `[audit]`).
pub fn start_plain_proxy_with(dir: &ProxyDir, upstream: &str, extra: &str) -> Running {
    let policy = plain_policy(dir, upstream, extra);
    start_proxy_with_policy(dir, &policy, &[])
}

/// Every record of the audit log in `data`, via `canarygate audit export`.
pub fn audit_export(data: &Path) -> Vec<serde_json::Value> {
    let output = Command::new(binary())
        .args(["audit", "--data"])
        .arg(data)
        .arg("export")
        .output()
        .expect("run audit export");
    assert!(
        output.status.success(),
        "audit export failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON record per line"))
        .collect()
}

/// Writes a tiny random Llama model with a word-level tokenizer (about one
/// token per word) and a `context`-token window into `dir`/`name`.
pub fn tiny_model(dir: &Path, name: &str, context: usize) -> PathBuf {
    let model = dir.join(name);
    let status = Command::new(binary())
        .args(["engine", "init-tiny", "--word-tokenizer", "--context"])
        .arg(context.to_string())
        .arg(&model)
        .stderr(Stdio::null())
        .status()
        .expect("run engine init-tiny");
    assert!(status.success(), "engine init-tiny failed");
    model
}

/// Starts `canarygate engine serve` on `model` (reference answers).
pub fn start_engine_server(model: &Path) -> Running {
    let mut child = Command::new(binary())
        .args(["engine", "serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(model)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn engine serve");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut lines = BufReader::new(stderr).lines();
    let url = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(url) = line.split("listening on ").nth(1) {
                    break url.trim().to_owned();
                }
            }
            other => panic!("engine serve exited before listening: {other:?}"),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Running { child, url }
}

/// `/sim/stats` of a simulated provider.
pub async fn sim_stats(sim: &Running) -> serde_json::Value {
    client()
        .get(format!("{}/sim/stats", sim.url))
        .send()
        .await
        .expect("sim stats")
        .json()
        .await
        .expect("sim stats JSON")
}

/// `http://127.0.0.1:PORT` of a port nothing listens on (bound, then closed).
pub fn closed_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    format!("http://{}", listener.local_addr().expect("local addr"))
}

/// Writes a CA and a server certificate for 127.0.0.1/localhost into `dir`;
/// returns (ca.pem, server.pem, server.key).
pub fn make_pki(dir: &std::path::Path) -> (String, String, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "canarygate test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

    let server_key = KeyPair::generate().unwrap();
    let server_params =
        CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    let server = server_params.signed_by(&server_key, &ca).unwrap();

    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    (
        write("ca.pem", ca.pem()),
        write("server.pem", server.pem()),
        write("server.key", server_key.serialize_pem()),
    )
}

//! The command line itself: `check-config`, argument errors.

use std::process::Command;

use crate::common::*;

#[test]
fn check_config_accepts_presets_and_reports_file_line_and_problem() {
    let ok = Command::new(binary())
        .args(["check-config", "policies/presets/default.toml"])
        .current_dir(workspace_root())
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains(": ok"));

    let preset = Command::new(binary())
        .args(["check-config", "preset:default"])
        .output()
        .unwrap();
    assert!(preset.status.success());

    let dir = ProxyDir::new();
    let path = dir.policy(
        "[[providers]]\nname = \"p\"\nbase_url = \"http://x\"\ncontext_window = 10\n\n\
         [[routes]]\nmodel = \"*\"\nprovider = \"q\"\n",
    );
    let bad = Command::new(binary())
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains(&format!("{}:8:", path.display())) && stderr.contains("`q`"),
        "{stderr}"
    );

    let unknown_field = dir.policy("[limits]\nmax_body_byte = 3\n");
    let bad = Command::new(binary())
        .arg("check-config")
        .arg(&unknown_field)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        stderr.contains(":2:") && stderr.contains("max_body_byte"),
        "{stderr}"
    );
}

/// `check-config` refuses what `serve` would refuse at start: a provider's
/// CA file that cannot be read, and a base URL with a password (named
/// without it) or a query.
#[test]
fn check_config_refuses_what_serve_would() {
    let dir = ProxyDir::new();
    let provider = |line: &str| {
        format!(
            "[[providers]]\nname = \"p\"\n{line}\ncontext_window = 10\n\n\
             [[routes]]\nmodel = \"*\"\nprovider = \"p\"\n"
        )
    };
    for (line, said) in [
        (
            "base_url = \"https://x/v1\"\nextra_ca_file = \"/nonexistent/ca.pem\"",
            "extra_ca_file /nonexistent/ca.pem cannot be read",
        ),
        (
            "base_url = \"https://gwuser:S3cretPassw0rd@x/v1\"",
            "user name or password",
        ),
        (
            "base_url = \"https://x/openai?api-version=1\"",
            "query or fragment",
        ),
    ] {
        let path = dir.policy(&provider(line));
        let bad = Command::new(binary())
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success(), "{line}: {stderr}");
        assert!(stderr.contains(said), "{line}: {stderr}");
        assert!(!stderr.contains("S3cret"), "{stderr}");
    }
}

#[test]
fn serve_refuses_a_second_provider_override_and_a_missing_managed_key() {
    let dir = ProxyDir::new();
    let two = dir.policy(
        "[[providers]]\nname = \"a\"\nbase_url = \"http://x\"\ncontext_window = 10\n\
         [[providers]]\nname = \"b\"\nbase_url = \"http://y\"\ncontext_window = 10\n\
         [[routes]]\nmodel = \"*\"\nprovider = \"a\"\n",
    );
    let output = Command::new(binary())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://z/v1",
            "--config",
        ])
        .arg(&two)
        .arg("--data")
        .arg(dir.data())
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("several providers of api"));

    let managed = dir.policy(&format!(
        "[auth]\nmode = \"managed\"\nclient_keys = [{{ name = \"c\", sha256 = \"{}\" }}]\n\
         [[providers]]\nname = \"a\"\nbase_url = \"http://x\"\ncontext_window = 10\n\
         api_key_env = \"CANARYGATE_TEST_UNSET_KEY\"\n[[routes]]\nmodel = \"*\"\nprovider = \"a\"\n",
        "0".repeat(64)
    ));
    let output = Command::new(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&managed)
        .arg("--data")
        .arg(dir.data())
        .env_remove("CANARYGATE_TEST_UNSET_KEY")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("CANARYGATE_TEST_UNSET_KEY"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A `serve` on a free port calling `upstream`, logging at info level, with
/// `args` after its own: the process, its URL, and its log lines as they come.
fn serve_with_log(
    dir: &ProxyDir,
    upstream: &str,
    args: &[&std::ffi::OsStr],
    envs: &[(&str, &str)],
) -> (
    std::process::Child,
    String,
    std::sync::mpsc::Receiver<String>,
) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let mut child = Command::new(binary())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--data",
        ])
        .arg(dir.data())
        .args(args)
        .env("CANARYGATE_LOG", "info")
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let first = BufReader::new(stdout).lines().next().unwrap().unwrap();
    let url = first.rsplit(' ').next().unwrap().to_owned();
    let (lines, seen) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    (child, url, seen)
}

/// The log read from `seen` until `done` holds for it (within 20 s; else
/// a panic saying `waited_for`).
fn log_until(
    seen: &std::sync::mpsc::Receiver<String>,
    done: impl Fn(&str) -> bool,
    waited_for: &str,
) -> String {
    use std::time::{Duration, Instant};

    let mut log = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(&log) {
        let left = deadline.saturating_duration_since(Instant::now());
        match seen.recv_timeout(left) {
            Ok(line) => {
                log.push_str(&line);
                log.push('\n');
            }
            Err(_) => panic!("serve did not say {waited_for}:\n{log}"),
        }
    }
    log
}

/// `serve` with the default policy and no provider reachable still starts,
/// says what is missing, and serves models, health and metrics.
#[test]
fn serve_without_a_reachable_provider_starts_and_says_what_is_missing() {
    let closed = format!("{}/v1", closed_url());
    let dir = ProxyDir::new();
    let (mut child, url, seen) = serve_with_log(&dir, &closed, &[], &[]);
    let log = log_until(
        &seen,
        |log| log.contains("local engine: none") && log.contains("is not reachable"),
        "what is missing",
    );
    assert!(log.contains("provider `openai`"), "{log}");
    assert!(
        !log.contains("the journal thread"),
        "left alone by default:\n{log}"
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        for path in ["/healthz", "/v1/models", "/metrics"] {
            let response = client().get(format!("{url}{path}")).send().await.unwrap();
            assert_eq!(response.status(), 200, "{path}");
        }
        let failed = client()
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth("sk-test")
            .json(&chat_body("gpt-4o", "hello", false))
            .send()
            .await
            .unwrap();
        assert_eq!(failed.status(), 502);
        let body: serde_json::Value = failed.json().await.unwrap();
        assert_eq!(body["error"]["code"], "upstream_unreachable");
    });
    let _ = child.kill();
    let _ = child.wait();
}

/// `serve --worker-threads` (or `$CANARYGATE_WORKER_THREADS`) sizes the
/// runtime that serves requests, and a count outside 1..=1024 is refused.
#[test]
fn serve_runs_as_many_worker_threads_as_asked() {
    let dir = ProxyDir::new();
    let closed = format!("{}/v1", closed_url());
    for refused in ["0", "1025"] {
        let output = Command::new(binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--upstream", &closed])
            .args(["--worker-threads", refused, "--data"])
            .arg(dir.data())
            .output()
            .unwrap();
        assert!(!output.status.success(), "{refused} accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("--worker-threads"), "{stderr}");
    }

    // Not this machine's CPU count, so the default cannot pass.
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let asked = if cpus == 3 { 5 } else { 3 };
    let (mut child, _, seen) = serve_with_log(
        &dir,
        &closed,
        &[],
        &[("CANARYGATE_WORKER_THREADS", &asked.to_string())],
    );
    const SAID: &str = "worker threads serving requests: ";
    let log = log_until(
        &seen,
        |log| log.contains(SAID),
        "how many worker threads it runs",
    );
    let _ = child.kill();
    let _ = child.wait();
    let workers = log.split(SAID).nth(1).and_then(|rest| rest.lines().next());
    assert_eq!(
        workers.map(str::trim),
        Some(asked.to_string().as_str()),
        "{log}"
    );
}

/// `[audit] journal_nice` raises the journal thread's priority where the OS
/// allows it, and `serve` says how it came out either way.
#[test]
fn serve_says_how_the_journal_thread_priority_came_out() {
    let closed = format!("{}/v1", closed_url());
    let dir = ProxyDir::new();
    let policy = dir.policy(
        "[[providers]]\nname = \"sim\"\nbase_url = \"http://x\"\ncontext_window = 1000\n\
         [[routes]]\nmodel = \"*\"\nprovider = \"sim\"\n[audit]\njournal_nice = -10\n",
    );
    let (mut child, _, seen) = serve_with_log(
        &dir,
        &closed,
        &["--config".as_ref(), policy.as_os_str()],
        &[],
    );
    let log = log_until(
        &seen,
        |log| log.contains("the journal thread"),
        "how the journal thread's priority came out",
    );
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        log.contains("the journal thread runs at a raised priority")
            || log.contains("the journal thread keeps the process's priority"),
        "{log}"
    );
}

//! Context probing against a real provider, and the probe results `serve`
//! reads ([`ProbeBook`]).
//!
//! The search, the needles and the result format are pure logic in
//! [`canarygate_policies::probe`]; this module sends the requests. Each one
//! carries needles and the usual canaries, is checked by the same
//! [`Verifier`] as proxied answers (echo, foreign canaries, prompt tokens,
//! ttft, finish), and must recall every needle. Results are stored as JSON in
//! `DATA_DIR/probes/`, one file per provider and model, written atomically so
//! a running `serve` can pick them up.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::http::{HeaderValue, header};
use canarygate_policies::config::Policy;
use canarygate_policies::inject::{RequestCanaries, inject};
use canarygate_policies::probe::{
    LengthSearch, Needle, OVER_WINDOW_TOKENS, PROBE_COMPLETION_TOKENS, PROBE_MAX_TOKENS, ProbeCost,
    ProbeResult, ProbeStep, conclude, needle_text, recalled,
};
use canarygate_policies::registry::{MemoryRegistry, Registration};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify::{Facts, Usage, Verifier};
use canarygate_policies::verify_config::EchoMode;
use serde_json::{Value, json};

use crate::error::error_chain;
use crate::upstream::{Upstream, build_upstreams};

/// Folder of probe results inside the data directory.
pub const PROBES_DIR: &str = "probes";

/// Needles hidden in every probe prompt.
const NEEDLES_PER_PROMPT: usize = 3;

/// Most requests of one probe (a guard; the search needs far fewer).
const MAX_STEPS: usize = 48;

/// Longest a single probe request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// What to probe.
#[derive(Debug, Clone)]
pub struct ProbeTarget {
    /// Provider name in the policy.
    pub provider: String,
    /// Model name sent upstream.
    pub model: String,
    /// The window the policy says the provider advertises for it.
    pub advertised_window_tokens: u64,
}

impl ProbeTarget {
    /// The target for `provider` (optional when the policy has one) and
    /// `model` (optional when one named route leads to that provider).
    pub fn from_policy(
        policy: &Policy,
        provider: Option<&str>,
        model: Option<&str>,
    ) -> Result<Self, String> {
        let provider = match provider {
            Some(name) => policy
                .providers
                .iter()
                .find(|p| p.name.get_ref() == name)
                .ok_or_else(|| format!("the policy has no provider `{name}`"))?,
            None => match policy.providers.as_slice() {
                [only] => only,
                providers => {
                    return Err(format!(
                        "the policy has {} providers; name one with --provider",
                        providers.len()
                    ));
                }
            },
        };
        let name = provider.name.get_ref().as_str();
        let (model, advertised) = match model {
            Some(model) => match policy.route(model).filter(|route| route.provider == name) {
                Some(route) => (route.upstream_model.to_owned(), route.context_window),
                None => (model.to_owned(), *provider.context_window.get_ref()),
            },
            None => {
                let routes: Vec<_> = policy
                    .named_models()
                    .filter_map(|model| policy.route(model))
                    .filter(|route| route.provider == name)
                    .collect();
                match routes.as_slice() {
                    [route] => (route.upstream_model.to_owned(), route.context_window),
                    [] => {
                        return Err(format!(
                            "no named route leads to provider `{name}`; say which model to \
                             probe with --model"
                        ));
                    }
                    _ => {
                        return Err(format!(
                            "several routes lead to provider `{name}`; say which model to probe \
                             with --model"
                        ));
                    }
                }
            }
        };
        Ok(Self {
            provider: name.to_owned(),
            model,
            advertised_window_tokens: advertised,
        })
    }

    /// The most a probe of this target can cost.
    pub fn cost_bound(&self) -> ProbeCost {
        LengthSearch::for_window(self.advertised_window_tokens).cost_bound()
    }
}

/// Runs a probe of `target` through the policy's client for its provider,
/// spending at most `budget_tokens` prompt tokens. `api_key` is sent as the
/// bearer token when the policy does not manage one. `on_step` sees every
/// request as it completes.
pub async fn run(
    policy: &Policy,
    target: &ProbeTarget,
    api_key: Option<&str>,
    budget_tokens: u64,
    mut on_step: impl FnMut(&ProbeStep),
) -> Result<ProbeResult, String> {
    let upstreams = build_upstreams(policy)?;
    let upstream = upstreams
        .into_iter()
        .find(|upstream| upstream.name == target.provider)
        .ok_or_else(|| format!("the policy has no provider `{}`", target.provider))?;
    let authorization = match (upstream.managed_key(), api_key) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(key)) => {
            Some(crate::identity::bearer(key).map_err(|_| "the API key is not valid header text")?)
        }
        (None, None) => None,
    };
    let mut secret = [0; 32];
    getrandom::fill(&mut secret).map_err(|error| format!("no OS randomness: {error}"))?;
    let mut prober = Prober {
        policy,
        upstream: &upstream,
        target,
        authorization,
        registry: MemoryRegistry::new(&secret),
        spent: 0,
    };

    let advertised = target.advertised_window_tokens;
    let mut search = LengthSearch::for_window(advertised);
    let mut steps = Vec::new();
    let mut complete = true;
    while let Some(length) = search.next() {
        if steps.len() >= MAX_STEPS || prober.spent + length > budget_tokens {
            complete = false;
            break;
        }
        let step = prober.step(length, PROBE_MAX_TOKENS).await?;
        search.record(step.prompt_tokens, step.ok);
        on_step(&step);
        steps.push(step);
    }
    // Prompt plus completion ends OVER_WINDOW_TOKENS past the window.
    let over = advertised.saturating_sub(PROBE_COMPLETION_TOKENS) + OVER_WINDOW_TOKENS;
    let over_window_status = if prober.spent + over <= budget_tokens {
        let step = prober.step(over, PROBE_MAX_TOKENS).await?;
        on_step(&step);
        let status = step.status;
        steps.push(step);
        Some(status)
    } else {
        complete = false;
        None
    };
    let (effective_limit_tokens, trusted) =
        conclude(&search, advertised, over_window_status, complete);
    Ok(ProbeResult {
        provider: target.provider.clone(),
        model: target.model.clone(),
        advertised_window_tokens: advertised,
        effective_limit_tokens,
        over_window_status,
        trusted,
        complete,
        tokens_spent: prober.spent,
        probed_at_ms: crate::verified::now_ms(),
        steps,
    })
}

/// State of one probe run.
struct Prober<'a> {
    policy: &'a Policy,
    upstream: &'a Upstream,
    target: &'a ProbeTarget,
    authorization: Option<HeaderValue>,
    /// This probe's canaries, so a later answer echoing an earlier one fails.
    registry: MemoryRegistry,
    spent: u64,
}

impl Prober<'_> {
    /// Sends one needle prompt of about `length` prompt tokens (injection
    /// included) and judges the answer.
    async fn step(&mut self, length: u64, max_tokens: u64) -> Result<ProbeStep, String> {
        let needles =
            Needle::mint(NEEDLES_PER_PROMPT).map_err(|e| format!("no OS randomness: {e}"))?;
        let canaries = RequestCanaries::mint().map_err(|e| format!("no OS randomness: {e}"))?;
        // Build, measure, and correct for what injection adds until the
        // prompt is no longer than `length` (an overshoot would push the
        // largest probe past the window with its completion allowance).
        let mut text_target = length;
        let (body, injection, prompt_tokens, exact) = loop {
            let mut body = json!({
                "model": self.target.model,
                "messages": [{"role": "user", "content": needle_text(text_target, &needles)}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": false,
            });
            let injection = inject(&mut body, EchoMode::HeadTail, canaries)
                .map_err(|error| format!("building the probe request: {error}"))?;
            let messages = body["messages"].as_array().map_or(&[][..], Vec::as_slice);
            let exact = self.upstream.count_prompt_tokens(messages);
            let counted = exact.unwrap_or_else(|| count_chat_messages(messages));
            if counted <= length || text_target == 0 {
                break (body, injection, counted, exact);
            }
            text_target = text_target.saturating_sub(counted - length);
        };
        for canary in [canaries.head, canaries.tail] {
            self.registry.insert(
                &canary,
                Registration {
                    session: "probe".into(),
                    request: "probe".into(),
                    expires_at_ms: u64::MAX,
                },
            );
        }
        self.spent += prompt_tokens;

        let mut request = self
            .upstream
            .chat_completions()
            .header(header::CONTENT_TYPE, "application/json")
            .timeout(REQUEST_TIMEOUT)
            .body(body.to_string());
        if let Some(authorization) = &self.authorization {
            request = request.header(header::AUTHORIZATION, authorization.clone());
        }
        let sent_at = Instant::now();
        let response = request.send().await.map_err(|error| {
            format!(
                "provider `{}` did not answer the probe: {}",
                self.target.provider,
                error_chain(&error)
            )
        })?;
        let ttft_ms = sent_at.elapsed().as_millis() as u64;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.map_err(|error| {
            format!(
                "reading the probe answer of `{}`: {}",
                self.target.provider,
                error_chain(&error)
            )
        })?;
        let mut step = ProbeStep {
            prompt_tokens,
            status,
            ok: false,
            needles: NEEDLES_PER_PROMPT as u32,
            recalled: 0,
            prompt_tokens_reported: None,
            problem: None,
        };
        match status {
            200 => {}
            400 | 413 | 422 => {
                let excerpt: String = String::from_utf8_lossy(&bytes).chars().take(160).collect();
                step.problem = Some(format!("refused: {excerpt}"));
                return Ok(step);
            }
            _ => {
                let excerpt: String = String::from_utf8_lossy(&bytes).chars().take(300).collect();
                return Err(format!(
                    "provider `{}` answered the probe with HTTP {status} (not a context \
                     answer); nothing stored: {excerpt}",
                    self.target.provider
                ));
            }
        }
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|error| format!("the probe answer is not JSON: {error}"))?;
        let content = answer
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or("");
        let usage = answer.get("usage").and_then(|usage| {
            Some(Usage {
                prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
                completion_tokens: usage.get("completion_tokens").and_then(Value::as_u64),
            })
        });
        step.prompt_tokens_reported = usage.map(|usage| usage.prompt_tokens);
        step.recalled = recalled(content, &needles) as u32;

        let mut verifier = Verifier::new(
            &injection,
            &self.policy.verify,
            &self.target.provider,
            exact,
        );
        if !verifier.observe_ttft(ttft_ms) {
            verifier.push(0, content, &self.registry);
        }
        let finish = answer
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let verdict = verifier
            .finish(
                &Facts {
                    finish_reasons: vec![finish],
                    usage,
                    done_marker: None,
                },
                &self.registry,
            )
            .verdict;
        let mut problems = Vec::new();
        if !verdict.passed() {
            let names: Vec<_> = verdict
                .failed_checks()
                .into_iter()
                .map(|check| check.name())
                .collect();
            problems.push(format!("checks failed: {}", names.join(",")));
        }
        if step.recalled < step.needles {
            problems.push(format!(
                "recalled {} of {} needles",
                step.recalled, step.needles
            ));
        }
        step.ok = problems.is_empty();
        step.problem = (!problems.is_empty()).then(|| problems.join("; "));
        Ok(step)
    }
}

/// File name of the result for `provider` and `model`.
fn result_file(data_dir: &Path, provider: &str, model: &str) -> PathBuf {
    let clean = |text: &str| -> String {
        text.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    data_dir
        .join(PROBES_DIR)
        .join(format!("{}--{}.json", clean(provider), clean(model)))
}

/// Writes `result` into `data_dir` (atomically) and returns the file.
pub fn store(data_dir: &Path, result: &ProbeResult) -> Result<PathBuf, String> {
    let path = result_file(data_dir, &result.provider, &result.model);
    let dir = data_dir.join(PROBES_DIR);
    std::fs::create_dir_all(&dir)
        .map_err(|error| format!("cannot create {}: {error}", dir.display()))?;
    let temporary = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(result).map_err(|error| error.to_string())?;
    std::fs::write(&temporary, text)
        .and_then(|()| std::fs::rename(&temporary, &path))
        .map_err(|error| format!("cannot write {}: {error}", path.display()))?;
    Ok(path)
}

/// The probe results of a data directory, as `serve` uses them.
pub struct ProbeBook {
    dir: PathBuf,
    /// Provider name, then model name.
    results: RwLock<HashMap<String, HashMap<String, Arc<ProbeResult>>>>,
}

impl ProbeBook {
    /// Reads every result in `data_dir` (none is fine).
    pub fn open(data_dir: &Path) -> Self {
        let book = Self {
            dir: data_dir.join(PROBES_DIR),
            results: RwLock::new(HashMap::new()),
        };
        book.reload();
        book
    }

    /// Re-reads the results from disk; unreadable files are skipped with a warning.
    pub fn reload(&self) {
        let mut results = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().is_none_or(|extension| extension != "json") {
                    continue;
                }
                match std::fs::read(&path)
                    .map_err(|error| error.to_string())
                    .and_then(|bytes| {
                        serde_json::from_slice::<ProbeResult>(&bytes).map_err(|e| e.to_string())
                    }) {
                    Ok(result) => {
                        results
                            .entry(result.provider.clone())
                            .or_insert_with(HashMap::new)
                            .insert(result.model.clone(), Arc::new(result));
                    }
                    Err(error) => {
                        tracing::warn!("skipping probe result {}: {error}", path.display());
                    }
                }
            }
        }
        *self.results.write().unwrap_or_else(|e| e.into_inner()) = results;
    }

    /// The stored result for `provider` and `model`.
    pub fn get(&self, provider: &str, model: &str) -> Option<Arc<ProbeResult>> {
        self.results
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(provider)?
            .get(model)
            .cloned()
    }

    /// Every stored result.
    pub fn all(&self) -> Vec<Arc<ProbeResult>> {
        self.results
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flat_map(|models| models.values().cloned())
            .collect()
    }
}

//! Context probing against a real provider.
//!
//! The search, the needles and the result format are pure logic in
//! [`canarygate_policies::probe`]; this module sends the requests, through
//! the same upstream client as proxied ones (`Upstream::request`). Each
//! one carries needles and the usual canaries, is checked by the same
//! [`Verifier`] as proxied answers (echo, foreign canaries, prompt tokens,
//! ttft, finish), and must recall every needle. Results are stored with
//! [`crate::probe_results::store`], where a running `serve` picks them up.

use std::time::{Duration, Instant};

use axum::http::{HeaderValue, Method};
use canarygate_policies::config::{Policy, ProviderApi, ProviderConfig};
use canarygate_policies::inject::{Injection, RequestCanaries};
use canarygate_policies::probe::{
    LengthSearch, Needle, OVER_WINDOW_TOKENS, PROBE_COMPLETION_TOKENS, PROBE_MAX_TOKENS, ProbeCost,
    ProbeResult, ProbeStep, conclude, needle_text, recalled,
};
use canarygate_policies::registry::{MemoryRegistry, Registration};
use canarygate_policies::tokens::count_chat_messages;
use canarygate_policies::verify::{Facts, Verifier};
use canarygate_policies::verify_config::EchoMode;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use crate::clock::now_ms;
use crate::error::error_chain;
use crate::identity::key_value;
use crate::upstream::{Upstream, UpstreamError, Upstreams};
use crate::wire::WireFormat;
use crate::wire::chat::Chat;
use crate::wire::messages::Messages;

/// Needles hidden in every probe prompt.
const NEEDLES_PER_PROMPT: usize = 3;

/// Most requests of one probe (a guard; the search needs far fewer).
const MAX_STEPS: usize = 48;

/// Longest a single probe request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// Why a probe could not run or finish; nothing is stored then.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The policy names no such provider, or the providers' clients failed.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// `--provider` is needed to choose.
    #[error("the policy has {0} providers; name one with --provider")]
    WhichProvider(usize),
    /// `--model` is needed to choose.
    #[error("{0} routes lead to provider `{1}`; say which model to probe with --model")]
    WhichModel(&'static str, String),
    /// The OS gave no randomness for needles or canaries.
    #[error("no OS randomness: {0}")]
    Randomness(#[from] getrandom::Error),
    /// The API key cannot be sent as a header.
    #[error("the API key is not valid header text")]
    BadKey,
    /// The probe request could not be built.
    #[error("building the probe request: {0}")]
    Request(String),
    /// The provider did not answer, or broke off.
    #[error("provider `{provider}` {what}: {detail}")]
    Transport {
        /// The provider.
        provider: String,
        /// What failed.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// The provider answered with a status that is no context answer
    /// (401, 403, 429, 5xx).
    #[error(
        "provider `{provider}` answered the probe with HTTP {status} (not a context answer); \
         nothing stored: {excerpt}"
    )]
    Status {
        /// The provider.
        provider: String,
        /// Its status.
        status: u16,
        /// The start of its body.
        excerpt: String,
    },
    /// The provider's answer is not JSON.
    #[error("the probe answer is not JSON: {0}")]
    NotJson(String),
}

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
    ) -> Result<Self, ProbeError> {
        let provider = match provider {
            Some(name) => policy
                .provider(name)
                .ok_or_else(|| UpstreamError::NoSuchProvider(name.to_owned()))?,
            None => match policy.providers.as_slice() {
                [only] => only,
                providers => return Err(ProbeError::WhichProvider(providers.len())),
            },
        };
        let name = provider.name.get_ref().as_str();
        let (model, advertised) = match model {
            Some(model) => match policy
                .route(model, provider.api)
                .filter(|route| route.provider == name)
            {
                Some(route) => (route.upstream_model.to_owned(), route.context_window),
                None => (model.to_owned(), *provider.context_window.get_ref()),
            },
            None => single_route(policy, provider)?,
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

/// The model and window of the one named route that leads to `provider`.
fn single_route(policy: &Policy, provider: &ProviderConfig) -> Result<(String, u64), ProbeError> {
    let name = provider.name.get_ref();
    let routes: Vec<_> = policy
        .named_routes()
        .map(|(_, route, _)| route)
        .filter(|route| route.provider == name)
        .collect();
    match routes.as_slice() {
        [route] => Ok((route.upstream_model.to_owned(), route.context_window)),
        [] => Err(ProbeError::WhichModel("no named", name.clone())),
        _ => Err(ProbeError::WhichModel("several", name.clone())),
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
    on_step: impl FnMut(&ProbeStep),
) -> Result<ProbeResult, ProbeError> {
    let upstreams = Upstreams::build(policy)?;
    let upstream = upstreams.named(&target.provider)?;
    let authorization = match (upstream.managed_key(), api_key) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(key)) => Some(key_value(key).map_err(|_| ProbeError::BadKey)?),
        (None, None) => None,
    };
    let mut secret = [0; 32];
    getrandom::fill(&mut secret)?;
    let registry = MemoryRegistry::new(&secret);
    match upstream.api {
        ProviderApi::Openai => {
            let prober = Prober::<Chat> {
                policy,
                upstream,
                target,
                authorization,
                registry,
                spent: 0,
                wire: std::marker::PhantomData,
            };
            search(prober, budget_tokens, on_step).await
        }
        // The probe's body (model, messages, max_tokens, temperature,
        // stream) is a valid Messages request too.
        ProviderApi::Anthropic => {
            let prober = Prober::<Messages> {
                policy,
                upstream,
                target,
                authorization,
                registry,
                spent: 0,
                wire: std::marker::PhantomData,
            };
            search(prober, budget_tokens, on_step).await
        }
    }
}

/// The probe's search, run by `prober`: see [`run`].
async fn search<W: WireFormat>(
    mut prober: Prober<'_, W>,
    budget_tokens: u64,
    mut on_step: impl FnMut(&ProbeStep),
) -> Result<ProbeResult, ProbeError> {
    let target = prober.target;

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
        probed_at_ms: now_ms(),
        steps,
    })
}

/// State of one probe run, speaking wire format `W` (the provider's API).
struct Prober<'a, W> {
    policy: &'a Policy,
    upstream: &'a Upstream,
    target: &'a ProbeTarget,
    authorization: Option<HeaderValue>,
    /// This probe's canaries, so a later answer echoing an earlier one fails.
    registry: MemoryRegistry,
    spent: u64,
    wire: std::marker::PhantomData<W>,
}

/// One probe prompt, built and measured.
struct Prompt {
    body: Value,
    injection: Injection,
    needles: Vec<Needle>,
    /// Prompt tokens, canarygate's additions included.
    tokens: u64,
    /// The same by the provider's tokenizer, when configured.
    exact_tokens: Option<u64>,
}

impl<W: WireFormat> Prober<'_, W> {
    /// Sends one needle prompt of about `length` prompt tokens (injection
    /// included) and judges the answer.
    async fn step(&mut self, length: u64, max_tokens: u64) -> Result<ProbeStep, ProbeError> {
        let prompt = self.prompt(length, max_tokens)?;
        for canary in [
            prompt.injection.canaries.head,
            prompt.injection.canaries.tail,
        ] {
            self.registry.insert(
                &canary,
                Registration {
                    session: "probe".into(),
                    request: "probe".into(),
                    expires_at_ms: u64::MAX,
                },
            );
        }
        self.spent += prompt.tokens;

        let sent_at = Instant::now();
        let transport = |what: &'static str, detail: String| ProbeError::Transport {
            provider: self.target.provider.clone(),
            what,
            detail,
        };
        let url = self
            .upstream
            .endpoint_url(W::PATH)
            .map_err(|error| ProbeError::NotJson(error.to_string()))?;
        let mut request = self.upstream.request(
            Method::POST,
            url,
            Some(prompt.body.to_string().into()),
            self.authorization.as_ref(),
            false,
        );
        request.headers_mut().extend(self.upstream.api_headers());
        let exchange =
            async {
                let response =
                    self.upstream.send(request).await.map_err(|error| {
                        transport("did not answer the probe", error_chain(&error))
                    })?;
                let ttft_ms = sent_at.elapsed().as_millis() as u64;
                let status = response.status().as_u16();
                let body = response.into_body().collect().await.map_err(|error| {
                    transport("broke off its probe answer", error_chain(&error))
                })?;
                Ok::<_, ProbeError>((ttft_ms, status, body.to_bytes()))
            };
        let (ttft_ms, status, bytes) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                transport(
                    "did not answer the probe",
                    format!("no whole answer within {} s", REQUEST_TIMEOUT.as_secs()),
                )
            })??;
        let mut step = ProbeStep {
            prompt_tokens: prompt.tokens,
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
                return Err(ProbeError::Status {
                    provider: self.target.provider.clone(),
                    status,
                    excerpt: String::from_utf8_lossy(&bytes).chars().take(300).collect(),
                });
            }
        }
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|error| ProbeError::NotJson(error.to_string()))?;
        self.judge(&prompt, &answer, ttft_ms, &mut step);
        Ok(step)
    }

    /// A needle prompt whose count, canaries included, is no more than
    /// `length` tokens: built, measured, and corrected for what the
    /// injection adds until it fits (an overshoot would push the largest
    /// probe past the window with its completion allowance).
    fn prompt(&self, length: u64, max_tokens: u64) -> Result<Prompt, ProbeError> {
        let needles = Needle::mint(NEEDLES_PER_PROMPT)?;
        let canaries = RequestCanaries::mint();
        let mut text_target = length;
        loop {
            let mut body = json!({
                "model": self.target.model,
                "messages": [{"role": "user", "content": needle_text(text_target, &needles)}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": false,
            });
            let cost = self.upstream.echo_cost(&self.target.model);
            let system_role = self.upstream.system_role(&self.target.model);
            let injection =
                W::place_canaries(&mut body, EchoMode::HeadTail, cost, canaries, system_role)
                    .map_err(|error| ProbeError::Request(error.message))?;
            let messages = W::prompt_messages(&body);
            let exact_tokens = self.upstream.count_prompt_tokens(&messages);
            let tokens = exact_tokens.unwrap_or_else(|| count_chat_messages(&messages));
            drop(messages);
            if tokens <= length || text_target == 0 {
                return Ok(Prompt {
                    body,
                    injection,
                    needles,
                    tokens,
                    exact_tokens,
                });
            }
            text_target = text_target.saturating_sub(tokens - length);
        }
    }

    /// Fills `step` from the answer: needles recalled, the verifier's checks.
    fn judge(&self, prompt: &Prompt, answer: &Value, ttft_ms: u64, step: &mut ProbeStep) {
        let view = W::read_answer(answer);
        let first = view.choices.first();
        let content = first
            .and_then(|choice| {
                choice
                    .texts
                    .iter()
                    .find(|field| field.kind == canarygate_policies::verify::Part::Content)
            })
            .map_or("", |field| field.text(answer));
        step.prompt_tokens_reported = view.usage.map(|usage| usage.prompt_tokens);
        step.recalled = recalled(content, &prompt.needles) as u32;

        let mut verifier = Verifier::new(
            &prompt.injection,
            &self.policy.verify,
            &self.target.provider,
            prompt.exact_tokens,
        );
        if !verifier.observe_ttft(ttft_ms) {
            verifier.push(0, content, &self.registry);
        }
        let finish = first.and_then(|choice| choice.finish_reason.clone());
        let verdict = verifier
            .finish(
                &Facts {
                    finish_reasons: vec![finish],
                    usage: view.usage,
                    done_marker: None,
                },
                &self.registry,
            )
            .verdict;
        let mut problems = Vec::new();
        if !verdict.passed() {
            problems.push(format!(
                "checks failed: {}",
                verdict.failed_check_names().join(",")
            ));
        }
        if step.recalled < step.needles {
            problems.push(format!(
                "recalled {} of {} needles",
                step.recalled, step.needles
            ));
        }
        step.ok = problems.is_empty();
        step.problem = (!problems.is_empty()).then(|| problems.join("; "));
    }
}

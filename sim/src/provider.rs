//! The simulated provider's state, and the steps every surface shares.
//!
//! Each surface reads its request into a [`Turn`]: what is asked
//! ([`crate::request::Generation`]) and the conversations the model reads
//! ([`Conversation`]: chat-shaped messages, one per prompt of a batch). [`SimProvider::run`]
//! then does what a provider does whatever the wire format: it picks the
//! failure mode, checks the context window, admits the request against the
//! rate limit, stalls when the mode says so, and decides what the model sees
//! ([`SimProvider::visible_contexts`], the one place where `leak-on-overflow`,
//! `truncate-*` and `swap` act), reading it from the shared KV pool and
//! counting what the prefix cache holds. The surface renders the answer in
//! its own format and hands it to [`crate::delivery`], which paces it and
//! cuts or stalls it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::answer::{Answer, Compose};
use crate::conversation::{CacheRule, Conversation, Turn, segments};
use crate::error::{ErrorShape, SimError};
use crate::headers::{ORGANIZATION, RateSnapshot, RateWindow};
use crate::model::Segment;
use crate::pool::{KvPool, Position, ReadBack};
use crate::prefix_cache::PrefixCache;
use crate::request::Generation;
use crate::store::{CompletionStore, ResponseStore};
use crate::surface::{RequestTag, Surface};
use crate::{MODE_HEADER, Mode, RATE_LIMIT_AFTER_HEADER, SimConfig, UnknownMode};

/// Where the model's context came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The request's own messages.
    Own,
    /// Stale KV pool positions written by these requests.
    Stale(Vec<RequestTag>),
    /// This other request's context.
    Swapped(RequestTag),
    /// Part of the request's own messages.
    Truncated,
}

/// What the model sees of one conversation, and what the provider reports.
#[derive(Debug, Clone)]
pub struct Visible {
    pub context: Vec<Segment>,
    /// Prompt tokens reported in usage.
    pub prompt_tokens: u64,
    /// Of those, tokens read from the prefix cache (not prefilled).
    pub cached_tokens: u64,
    /// Of those, tokens written to the cache at breakpoints (Anthropic's
    /// `cache_creation_input_tokens`).
    pub cache_written: u64,
    pub source: Source,
}

/// A request the provider has taken on: its answers are to be rendered.
#[derive(Debug)]
pub struct Run {
    /// The id of its answer ([`Surface::answer_id`]).
    pub id: String,
    pub mode: Mode,
    /// Seconds since the epoch.
    pub created: u64,
    /// One per conversation of the turn.
    pub views: Vec<Visible>,
    /// Before the first token.
    pub prefill: Duration,
    /// Per decode step.
    pub per_token: Duration,
}

impl Run {
    /// The answer to each conversation of the turn, from what the model
    /// sees of it, as `generation` asks.
    pub fn answers(&self, generation: &Generation) -> Vec<Answer> {
        self.views
            .iter()
            .map(|view| {
                Answer::compose(Compose {
                    id: self.id.clone(),
                    created: self.created,
                    generation,
                    context: &view.context,
                    prompt_tokens: view.prompt_tokens,
                    cached_tokens: view.cached_tokens,
                })
            })
            .collect()
    }

    /// The ground truth of [`crate::CONTEXT_HEADER`] and the ids of
    /// [`crate::CONTEXT_FROM_HEADER`], over every conversation.
    pub fn context_label(&self) -> (&'static str, Vec<String>) {
        let mut label = "own";
        let mut from: Vec<RequestTag> = Vec::new();
        for view in &self.views {
            let (this, others) = match &view.source {
                Source::Own => ("own", Vec::new()),
                Source::Truncated => ("truncated", Vec::new()),
                Source::Stale(writers) => ("stale", writers.clone()),
                Source::Swapped(other) => ("swapped", vec![*other]),
            };
            // The gravest wins: another request's text over a loss of one's own.
            let rank = |label: &str| {
                ["own", "truncated", "stale", "swapped"]
                    .iter()
                    .position(|l| *l == label)
            };
            if rank(this) > rank(label) {
                label = this;
            }
            from.extend(others);
        }
        from.sort();
        from.dedup();
        (label, from.into_iter().map(RequestTag::answer_id).collect())
    }
}

/// Counters served at `GET /sim/stats`.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    /// Responses generated from other requests' context (stale or swapped).
    pub leaked: AtomicU64,
    /// Prompts replaced by a one-token placeholder (`leak-on-overflow`).
    pub placeholder_substitutions: AtomicU64,
    /// Prompts silently truncated.
    pub truncated: AtomicU64,
    /// Responses generated from another request's context (`swap`).
    pub swapped: AtomicU64,
    /// Requests refused with 429.
    pub rate_limited: AtomicU64,
    /// Requests refused or streams ended as overloaded (`overloaded`).
    pub overloaded: AtomicU64,
    /// Prompts served with part of them from the prefix cache.
    pub cache_hits: AtomicU64,
    /// Prompt tokens served from the prefix cache, summed.
    pub cached_tokens: AtomicU64,
    /// Requests that generate nothing: stored responses fetched or deleted,
    /// tokens counted.
    pub lookups: AtomicU64,
    /// Requests per surface, in [`Surface::ALL`] order.
    pub by_surface: [AtomicU64; 5],
    /// Requests of any path that came over HTTP/2.
    pub http2_requests: AtomicU64,
    /// The path and query string of the last request that had a query
    /// (`/v1/messages beta=true`).
    pub last_query: Mutex<Option<String>>,
}

/// The simulated provider's state.
pub struct SimProvider {
    pub config: SimConfig,
    pub stats: Stats,
    next_id: AtomicU64,
    /// The shared paged KV pool, sized for the context window.
    pub pool: Mutex<KvPool>,
    /// The most recent request's tag and own context, for `swap`.
    last_context: Mutex<Option<(RequestTag, Arc<Vec<Segment>>)>>,
    /// Prompt prefixes seen, when caching is on.
    pub prefix_cache: Option<Mutex<PrefixCache>>,
    /// Requests and tokens admitted in the current rate-limit window.
    pub rate: Mutex<RateWindow>,
    /// Stored Responses API responses (`store: true`).
    pub responses: Mutex<ResponseStore>,
    /// Stored chat completions (`store: true`).
    pub completions: Mutex<CompletionStore>,
    /// When this provider started (nanoseconds since the epoch): makes
    /// request ids unique across runs.
    pub started_nanos: u128,
}

impl SimProvider {
    pub fn new(config: SimConfig) -> Arc<Self> {
        Arc::new(Self {
            pool: Mutex::new(KvPool::new(config.context_window, config.page_tokens)),
            last_context: Mutex::new(None),
            prefix_cache: config
                .prefix_cache
                .clone()
                .map(|cache| Mutex::new(PrefixCache::new(cache))),
            rate: Mutex::new(RateWindow::new(config.rate_limit.clone(), Instant::now())),
            responses: Mutex::new(ResponseStore::default()),
            completions: Mutex::new(CompletionStore::default()),
            started_nanos: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos()),
            config,
            stats: Stats::default(),
            next_id: AtomicU64::new(1),
        })
    }

    /// The steps every surface shares (see the module docs): `Err` is the
    /// error to answer; `rate` gets what the response reports.
    pub async fn run(
        &self,
        headers: &HeaderMap,
        turn: &Turn,
        rate: &mut Option<RateSnapshot>,
    ) -> Result<Run, SimError> {
        let mode = match headers.get(MODE_HEADER) {
            Some(value) => value
                .to_str()
                .map_err(|_| SimError::invalid_request(Some("invalid_sim_mode"), "bad x-sim-mode"))?
                .parse()
                .map_err(|error: UnknownMode| {
                    SimError::invalid_request(Some("invalid_sim_mode"), error.to_string())
                })?,
            None => self.config.mode,
        };
        let prompts: Vec<u64> = turn
            .conversations
            .iter()
            .map(Conversation::prompt_tokens)
            .collect();
        let window = self.config.context_window;
        let completion = turn.generation.max_tokens.unwrap_or(0);
        // leak-on-overflow never checks what it can hold, its window included.
        if mode != Mode::LeakOnOverflow
            && let Some(prompt) = prompts
                .iter()
                .find(|prompt| prompt.saturating_add(completion) > window)
        {
            return Err(turn.surface.context_error(window, *prompt, completion));
        }
        if completion > self.config.max_output_tokens {
            return Err(turn.surface.output_cap_error(
                &turn.generation.model,
                self.config.max_output_tokens,
                completion,
            ));
        }
        if mode == Mode::Overloaded && !turn.generation.stream {
            return Err(SimError::overloaded());
        }
        let choices = turn.generation.choices.max(1) as u64 * prompts.len() as u64;
        let tokens = prompts
            .iter()
            .sum::<u64>()
            .saturating_add(completion.saturating_mul(choices));
        self.admit(headers, mode, turn.surface, tokens, rate)?;
        if mode == Mode::StallFirstByte {
            std::future::pending::<()>().await;
        }
        let number = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tag = RequestTag::new(number, turn.surface);
        let views = self.visible_contexts(
            tag,
            mode,
            &turn.generation.model,
            &turn.conversations,
            &prompts,
        )?;
        let uncached: u64 = views
            .iter()
            .map(|view| view.prompt_tokens - view.cached_tokens)
            .sum();
        Ok(Run {
            id: tag.answer_id(),
            mode,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.as_secs()),
            views,
            prefill: delay(uncached as f64, self.config.prefill_tps),
            per_token: delay(1.0, self.config.decode_tps),
        })
    }

    /// Counts a request of `tokens` tokens against the rate limit, or
    /// refuses it with 429 (always in `rate-limited`) worded as `surface`'s
    /// provider words it; `rate` gets what the response reports.
    fn admit(
        &self,
        headers: &HeaderMap,
        mode: Mode,
        surface: Surface,
        tokens: u64,
        rate: &mut Option<RateSnapshot>,
    ) -> Result<(), SimError> {
        let limit = match headers.get(RATE_LIMIT_AFTER_HEADER) {
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|text| text.trim().parse::<u64>().ok())
                    .ok_or_else(|| {
                        SimError::invalid_request(
                            Some("invalid_sim_rate_limit"),
                            format!("{RATE_LIMIT_AFTER_HEADER} must be a whole number"),
                        )
                    })?,
            ),
            None => None,
        };
        let now = Instant::now();
        let mut window = self.rate.lock().unwrap_or_else(PoisonError::into_inner);
        let anthropic = |kind: &str, limit: u64| {
            let unit = if kind == "requests" {
                "requests"
            } else {
                "input tokens"
            };
            format!(
                "This request would exceed the rate limit for your organization ({ORGANIZATION}) \
                 of {limit} {unit} per minute. Please reduce the prompt length or the maximum \
                 tokens requested, or try again later."
            )
        };
        if mode == Mode::RateLimited {
            let snapshot = RateSnapshot {
                remaining_requests: 0,
                remaining_tokens: 0,
                reset: Duration::from_secs(1),
                ..window.peek(now, limit)
            };
            let limit = snapshot.limit_requests;
            let message = match surface.error_shape() {
                ErrorShape::Anthropic => anthropic("requests", limit),
                ErrorShape::OpenAi => format!(
                    "Rate limit reached for requests per min (RPM) in organization \
                     {ORGANIZATION}: Limit {limit}, Used {limit}, Requested 1. Please try again \
                     in 1s."
                ),
            };
            *rate = Some(snapshot);
            return Err(SimError::rate_limited(
                "requests",
                message,
                Duration::from_secs(1),
            ));
        }
        match window.admit(now, tokens, limit) {
            Ok(snapshot) => {
                *rate = Some(snapshot);
                Ok(())
            }
            Err(refusal) => {
                // Retry when the window reopens, at least a millisecond on.
                let retry = refusal.snapshot.reset.max(Duration::from_millis(1));
                let message = match surface.error_shape() {
                    ErrorShape::Anthropic => anthropic(
                        refusal.kind,
                        if refusal.kind == "requests" {
                            refusal.snapshot.limit_requests
                        } else {
                            refusal.snapshot.limit_tokens
                        },
                    ),
                    ErrorShape::OpenAi => refusal.message,
                };
                *rate = Some(refusal.snapshot);
                Err(SimError::rate_limited(refusal.kind, message, retry))
            }
        }
    }

    /// What the model sees of each of `conversations` (one request, `tag`,
    /// in `mode`; `prompts` are their prompt tokens), read from the shared
    /// KV pool (see the crate docs), and the prompt tokens reported. This is
    /// the one place where the failure modes change what the model sees.
    pub fn visible_contexts(
        &self,
        tag: RequestTag,
        mode: Mode,
        model: &str,
        conversations: &[Conversation],
        prompts: &[u64],
    ) -> Result<Vec<Visible>, SimError> {
        // The most recent other request, before this one takes its place.
        let previous = self
            .last_context
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut views = Vec::with_capacity(conversations.len());
        for (conversation, &prompt_tokens) in conversations.iter().zip(prompts) {
            let own = Arc::new(segments(&conversation.messages));
            *self
                .last_context
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some((tag, own.clone()));
            let visible = self.visible(
                tag,
                mode,
                model,
                conversation,
                prompt_tokens,
                previous.as_ref(),
            )?;
            match &visible.source {
                Source::Stale(writers) if !writers.is_empty() => {
                    self.stats.leaked.fetch_add(1, Ordering::Relaxed);
                }
                Source::Swapped(_) => {
                    self.stats.leaked.fetch_add(1, Ordering::Relaxed);
                    self.stats.swapped.fetch_add(1, Ordering::Relaxed);
                }
                Source::Truncated => {
                    self.stats.truncated.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
            views.push(visible);
        }
        Ok(views)
    }

    /// [`SimProvider::visible_contexts`] of one conversation; `previous` is
    /// the most recent other request's context.
    fn visible(
        &self,
        tag: RequestTag,
        mode: Mode,
        model: &str,
        conversation: &Conversation,
        prompt_tokens: u64,
        previous: Option<&(RequestTag, Arc<Vec<Segment>>)>,
    ) -> Result<Visible, SimError> {
        Ok(match mode {
            Mode::LeakOnOverflow if prompt_tokens > self.config.prefill_pool_tokens() => {
                // SGLang's "rejection": a one-token placeholder replaces the
                // prompt and the error goes to a side field nobody reads.
                let to_finish = format!(
                    "prompt of {prompt_tokens} tokens exceeds the prefill KV pool of {} tokens",
                    self.config.prefill_pool_tokens()
                );
                tracing::debug!(%to_finish, "sim: prompt replaced by a one-token placeholder");
                self.stats
                    .placeholder_substitutions
                    .fetch_add(1, Ordering::Relaxed);
                // Decode reserves for the full prompt; prefill writes one.
                let reserved = prompt_tokens.min(self.config.context_window);
                let read = self.run_in_pool(tag, reserved, &[Position::Control])?;
                Visible {
                    context: read.context,
                    prompt_tokens: 1,
                    cached_tokens: 0,
                    cache_written: 0,
                    source: Source::Stale(
                        read.other_writers
                            .into_iter()
                            .map(RequestTag::from_writer)
                            .collect(),
                    ),
                }
            }
            Mode::TruncateHead | Mode::TruncateTail => {
                match conversation.truncated(mode == Mode::TruncateHead) {
                    Some((kept, dropped)) => {
                        let mut visible = self.honest(tag, model, conversation, &kept, dropped)?;
                        visible.source = Source::Truncated;
                        visible
                    }
                    None => self.honest(tag, model, conversation, &conversation.messages, 0)?,
                }
            }
            Mode::Swap => {
                // The request is processed; the replies cross.
                let mut visible =
                    self.honest(tag, model, conversation, &conversation.messages, 0)?;
                if let Some((other, context)) = previous {
                    visible.context = context.as_ref().clone();
                    visible.source = Source::Swapped(*other);
                }
                visible
            }
            _ => self.honest(tag, model, conversation, &conversation.messages, 0)?,
        })
    }

    /// Writes `messages` (what is left of `conversation`, `dropped`
    /// messages gone from its head) into the pool and reads them back; the
    /// part of them the prefix cache holds is not prefilled.
    fn honest(
        &self,
        tag: RequestTag,
        model: &str,
        conversation: &Conversation,
        messages: &[Value],
        dropped: usize,
    ) -> Result<Visible, SimError> {
        let positions = conversation.positions(messages);
        let prompt_tokens = positions.len() as u64;
        let (cached_tokens, cache_written) =
            self.cache(model, &positions, conversation, messages, dropped);
        let read = self.run_in_pool(tag, prompt_tokens, &positions)?;
        Ok(Visible {
            context: read.context,
            prompt_tokens,
            cached_tokens,
            cache_written,
            source: Source::Own,
        })
    }

    /// Tokens of `positions` (a prompt for `model`) the prefix cache holds,
    /// and those written to it at breakpoints; remembers the prefixes for
    /// the next prompts.
    fn cache(
        &self,
        model: &str,
        positions: &[Position],
        conversation: &Conversation,
        messages: &[Value],
        dropped: usize,
    ) -> (u64, u64) {
        let (Some(config), Some(cache)) = (&self.config.prefix_cache, &self.prefix_cache) else {
            return (0, 0);
        };
        let hashes = match &conversation.cache {
            CacheRule::Off => return (0, 0),
            CacheRule::Automatic => config.hashes(model, positions),
            CacheRule::Breakpoints(breakpoints) => {
                let lengths = Conversation::breakpoint_lengths(breakpoints, messages, dropped);
                let lookback = Conversation::lookback_lengths(breakpoints, messages, dropped);
                config.hashes_at(model, positions, &lengths, &lookback)
            }
        };
        let cached = cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .serve(&hashes, Instant::now());
        if cached > 0 {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            self.stats
                .cached_tokens
                .fetch_add(cached, Ordering::Relaxed);
        }
        let written = match conversation.cache {
            CacheRule::Breakpoints(_) => hashes.longest().saturating_sub(cached),
            _ => 0,
        };
        (cached, written)
    }

    fn run_in_pool(
        &self,
        tag: RequestTag,
        reserved: u64,
        written: &[Position],
    ) -> Result<ReadBack, SimError> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .run(tag.writer(), reserved, written)
            .ok_or_else(|| SimError::internal("sim: the KV pool has too few free pages"))
    }

    /// Counts a request of `surface` as it arrives; its `x-request-id`
    /// number.
    pub fn arrive(&self, surface: Surface) -> u64 {
        self.stats.by_surface[surface.index()].fetch_add(1, Ordering::Relaxed);
        self.stats.requests.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The stats served at `GET /sim/stats`.
    pub fn stats_json(&self) -> Value {
        let stats = &self.stats;
        let (pages, page_tokens) = {
            let pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            (pool.pages(), pool.page_tokens())
        };
        let cache_prefixes = self
            .prefix_cache
            .as_ref()
            .map(|cache| cache.lock().unwrap_or_else(PoisonError::into_inner).len());
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let by_surface: serde_json::Map<String, Value> = Surface::ALL
            .iter()
            .map(|surface| {
                (
                    surface.name().to_owned(),
                    json!(load(&stats.by_surface[surface.index()])),
                )
            })
            .collect();
        json!({
            "requests": load(&stats.requests),
            "completed": load(&stats.completed),
            "cancelled": load(&stats.cancelled),
            "rejected": load(&stats.rejected),
            "leaked": load(&stats.leaked),
            "placeholder_substitutions": load(&stats.placeholder_substitutions),
            "truncated": load(&stats.truncated),
            "swapped": load(&stats.swapped),
            "rate_limited": load(&stats.rate_limited),
            "overloaded": load(&stats.overloaded),
            "lookups": load(&stats.lookups),
            "surfaces": by_surface,
            "http2_requests": load(&stats.http2_requests),
            "last_query": stats.last_query.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            "stored_responses": self.responses.lock().unwrap_or_else(PoisonError::into_inner).len(),
            "stored_completions": self.completions.lock().unwrap_or_else(PoisonError::into_inner).len(),
            "context_window": self.config.context_window,
            "prefill_pool_tokens": self.config.prefill_pool_tokens(),
            "kv_pool": {"pages": pages, "page_tokens": page_tokens},
            "prefix_cache": {
                "enabled": cache_prefixes.is_some(),
                "hits": load(&stats.cache_hits),
                "cached_tokens": load(&stats.cached_tokens),
                "prefixes": cache_prefixes.unwrap_or(0),
            },
        })
    }
}

fn delay(amount: f64, rate: f64) -> Duration {
    if rate > 0.0 {
        Duration::from_secs_f64(amount / rate)
    } else {
        Duration::ZERO
    }
}

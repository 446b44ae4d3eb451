//! The engine: admission, a prefill worker and a decode worker joined by a checked transfer,
//! continuous batching and preemption.
//!
//! ```text
//! submit ──admission──> prefill queue ──prefill worker──> Transfer{job, manifest, logits}
//!    │ (rejected: error, no page, no queue)                  │
//!    │                                            decode worker: manifest.verify ─ refused ─> Failed
//!    │                                                       │ accepted
//!    │                                            running batch: one forward per step for all
//!    └────────────── events (tokens, done, failed) <─────────┘   requests; new prefills join
//!                                                                between steps; no page free ->
//!                                                                newest request is preempted and
//!                                                                recomputed by prefill
//! ```

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::{DType, Device};
use tokenizers::Tokenizer;

use crate::config::ModelConfig;
use crate::detokenize::TextSoFar;
use crate::kv::{KvPool, Owner, PageId};
use crate::model::{Model, Segment};
use crate::prompt::ControlTokens;
use crate::sampling::{Sampler, SamplingParams};
use crate::text::{ChatMessage, ChatTemplate, load_tokenizer};
use crate::transfer::Manifest;
use crate::{AdmissionError, EngineError};

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// CPU, f32.
    Cpu,
    /// CUDA device with this ordinal, bf16 (needs the `cuda` feature).
    Cuda(usize),
}

/// Number format of the weights, activations and KV pool (attention scores and softmax are
/// always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
}

/// Engine settings. Build with [`EngineConfig::new`] and override fields.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    pub model_dir: PathBuf,
    /// Bytes for the KV pool (all layers, K and V).
    pub kv_budget_bytes: usize,
    /// Positions per KV page.
    pub page_size: usize,
    /// The pool must hold `kv_margin` times the advertised context window (>= 1.0).
    pub kv_margin: f64,
    /// Advertise at most this many tokens; start fails if the pool cannot hold it.
    pub max_context: Option<usize>,
    /// Most requests decoded in one batch.
    pub max_batch: usize,
    /// Prompt tokens per prefill forward pass.
    pub prefill_chunk: usize,
    /// Device.
    pub device: DeviceKind,
    /// Number format; `None`: the device's own (CPU f32, CUDA bf16).
    pub precision: Option<Precision>,
}

impl EngineConfig {
    /// Defaults: 512 MiB KV pool, 16-token pages, margin 1.0, batch 16, CPU, the device's
    /// precision.
    pub fn new(model_dir: impl Into<PathBuf>) -> Self {
        Self {
            model_dir: model_dir.into(),
            kv_budget_bytes: 512 << 20,
            page_size: 16,
            kv_margin: 1.0,
            max_context: None,
            max_batch: 16,
            prefill_chunk: 512,
            device: DeviceKind::Cpu,
            precision: None,
        }
    }
}

/// Context window and KV pool capacity, measured at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Tokens the KV pool holds.
    pub pool_tokens: usize,
    /// Context window of the model's config.
    pub model_context: usize,
    /// Context window the engine advertises and enforces:
    /// `min(model_context, pool_tokens / kv_margin, max_context)`.
    pub context_window: usize,
}

/// Counters of a running engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// KV pages in the pool.
    pub total_pages: usize,
    /// KV pages not owned by any request.
    pub free_pages: usize,
    /// Requests preempted (pages freed, recomputed later) so far.
    pub preemptions: u64,
}

/// One generation request, in token ids (see [`EngineHandle::chat_prompt`]).
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate; `None`: up to the context window.
    pub max_tokens: Option<usize>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Attach each token's logits to its event (for verification tooling and tests).
    pub return_logits: bool,
}

impl GenerationRequest {
    /// Greedy request for `prompt` with at most `max_tokens` new tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens: Some(max_tokens),
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            return_logits: false,
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token.
    Stop,
    /// One of the request's stop strings (its index in `stop`), cut from the text.
    StopString(usize),
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop | Self::StopString(_) => "stop",
            Self::Length => "length",
        }
    }
}

/// Token counts of a finished generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens, all of which were prefilled.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// A streamed generation event.
#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it makes visible (may be empty while text is held back
    /// for an incomplete character or a possible stop string).
    Token {
        /// Token id.
        id: u32,
        /// New text.
        text: String,
        /// Logits this token was sampled from, when requested.
        logits: Option<Vec<f32>>,
    },
    /// The generation finished; no more events follow.
    Done {
        /// Why.
        finish_reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The generation failed; no more events follow.
    Failed(EngineError),
}

/// The receiving end of one admitted request: an iterator of [`Event`]s.
#[derive(Debug)]
pub struct Generation {
    id: u64,
    prompt_tokens: usize,
    events: Receiver<Event>,
}

/// A finished generation, collected.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// Generated text (stop strings removed).
    pub text: String,
    /// Logits per generated token, when requested.
    pub logits: Vec<Vec<f32>>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token counts.
    pub usage: Usage,
}

impl Generation {
    /// Request id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Blocks until the generation ends and returns everything it produced.
    pub fn wait(self) -> Result<Completion, EngineError> {
        self.wait_unless(&AtomicBool::new(false))
    }

    /// [`Generation::wait`], giving up once `abandoned` is set (the caller
    /// went away): looked at with each token and every 100 ms
    /// while none comes (a queued request). Giving up drops the generation,
    /// which stops it and frees its KV pages, as dropping a stream does.
    pub fn wait_unless(self, abandoned: &AtomicBool) -> Result<Completion, EngineError> {
        let (mut token_ids, mut text, mut logits) = (Vec::new(), String::new(), Vec::new());
        loop {
            if abandoned.load(Ordering::Relaxed) {
                return Err(EngineError::Abandoned);
            }
            let event = match self.events.recv_timeout(ABANDON_POLL) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Err(EngineError::ShutDown),
            };
            match event {
                Event::Token {
                    id,
                    text: t,
                    logits: l,
                } => {
                    token_ids.push(id);
                    text.push_str(&t);
                    logits.extend(l);
                }
                Event::Done {
                    finish_reason,
                    usage,
                } => {
                    return Ok(Completion {
                        token_ids,
                        text,
                        logits,
                        finish_reason,
                        usage,
                    });
                }
                Event::Failed(e) => return Err(e),
            }
        }
    }
}

/// How often [`Generation::wait_unless`] looks whether its caller went away
/// while no token comes.
const ABANDON_POLL: std::time::Duration = std::time::Duration::from_millis(100);

impl Iterator for Generation {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        self.events.recv().ok()
    }
}

/// Fault injected into the prefill → decode transfer, for tests of the manifest check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum TransferFault {
    /// The manifest omits its last page.
    DropLastPage,
    /// The manifest claims one written token (the incident's placeholder).
    ClaimOneToken,
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Loads the model, sizes the KV pool, checks the context window against it and starts the
    /// prefill and decode workers.
    pub fn start(config: EngineConfig) -> Result<EngineHandle, EngineError> {
        start(config, None)
    }

    #[cfg(test)]
    pub(crate) fn start_with_fault(
        config: EngineConfig,
        fault: TransferFault,
    ) -> Result<EngineHandle, EngineError> {
        start(config, Some(fault))
    }
}

/// `messages` without system messages: their text, joined, opens the first user message (a new
/// one when a system message is followed by none).
fn system_in_first_user_message(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let system: Vec<&str> = messages
        .iter()
        .filter(|message| message.role == "system")
        .map(|message| message.content.as_str())
        .collect();
    let system = system.join("\n\n");
    let mut rest: Vec<ChatMessage> = messages
        .iter()
        .filter(|message| message.role != "system")
        .cloned()
        .collect();
    match rest.iter_mut().find(|message| message.role == "user") {
        Some(user) => user.content = format!("{system}\n\n{}", user.content),
        None => rest.insert(
            0,
            ChatMessage {
                role: "user".to_owned(),
                content: system,
            },
        ),
    }
    rest
}

struct Shared {
    model: Model,
    pool: KvPool,
    tokenizer: Tokenizer,
    eos: Vec<u32>,
    max_batch: usize,
    prefill_chunk: usize,
    shutdown: AtomicBool,
    preemptions: AtomicU64,
    fault: Option<TransferFault>,
}

/// A running engine. Dropping it stops the workers; unfinished requests fail with
/// [`EngineError::ShutDown`].
pub struct EngineHandle {
    shared: Arc<Shared>,
    capacity: Capacity,
    template: ChatTemplate,
    control: ControlTokens,
    jobs: Sender<Job>,
    next_id: AtomicU64,
    workers: Vec<JoinHandle<()>>,
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| EngineError::Model(format!("cannot read {}: {e}", dir.display())))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(EngineError::Model(format!(
            "no *.safetensors in {}",
            dir.display()
        )));
    }
    Ok(files)
}

fn device(kind: DeviceKind, precision: Option<Precision>) -> Result<(Device, DType), EngineError> {
    let (device, default) = match kind {
        DeviceKind::Cpu => (Device::Cpu, DType::F32),
        DeviceKind::Cuda(ordinal) if cfg!(feature = "cuda") => {
            (Device::new_cuda(ordinal)?, DType::BF16)
        }
        DeviceKind::Cuda(_) => {
            return Err(EngineError::Config(
                "this build has no CUDA support (rebuild with --features cuda)".into(),
            ));
        }
    };
    let dtype = match precision {
        None => default,
        Some(Precision::F32) => DType::F32,
        Some(Precision::Bf16) => DType::BF16,
    };
    Ok((device, dtype))
}

/// Context window the engine may advertise, or why it cannot start.
fn context_window(
    model_context: usize,
    pool_tokens: usize,
    margin: f64,
    max_context: Option<usize>,
) -> Result<usize, EngineError> {
    if !(margin >= 1.0 && margin.is_finite()) {
        return Err(EngineError::Config(format!(
            "kv margin must be >= 1.0 (the pool may not hold less than the window), got {margin}"
        )));
    }
    let affordable = (pool_tokens as f64 / margin).floor() as usize;
    let mut window = model_context.min(affordable);
    if let Some(wanted) = max_context {
        if wanted > affordable {
            return Err(EngineError::Config(format!(
                "cannot serve a context of {wanted} tokens: the KV pool holds {pool_tokens} tokens, \
                 which with margin {margin} allows {affordable}; raise the KV budget"
            )));
        }
        window = window.min(wanted);
    }
    if window < 2 {
        return Err(EngineError::Config(format!(
            "context window of {window} tokens is unusable (pool holds {pool_tokens})"
        )));
    }
    Ok(window)
}

fn start(config: EngineConfig, fault: Option<TransferFault>) -> Result<EngineHandle, EngineError> {
    let dir = &config.model_dir;
    let model_config = ModelConfig::from_file(&dir.join("config.json"))?;
    let files = safetensors_files(dir)?;
    let tokenizer = load_tokenizer(dir)?;
    let template = ChatTemplate::load(dir)?;
    let control = ControlTokens::new(&tokenizer, template.source())?;
    let (device, dtype) = device(config.device, config.precision)?;
    if config.max_batch == 0 || config.prefill_chunk == 0 {
        return Err(EngineError::Config(
            "max_batch and prefill_chunk must be > 0".into(),
        ));
    }
    let pool = KvPool::new(
        config.kv_budget_bytes,
        config.page_size,
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype,
        &device,
    )?;
    let capacity = Capacity {
        pool_tokens: pool.capacity_tokens(),
        model_context: model_config.max_position_embeddings,
        context_window: context_window(
            model_config.max_position_embeddings,
            pool.capacity_tokens(),
            config.kv_margin,
            config.max_context,
        )?,
    };
    let model = Model::load(
        &model_config,
        &files,
        capacity.context_window,
        dtype,
        &device,
    )?;
    let mut eos = model_config.eos_token_ids.clone();
    if eos.is_empty() {
        eos = generation_config_eos(dir);
    }
    let shared = Arc::new(Shared {
        model,
        pool,
        tokenizer,
        eos,
        max_batch: config.max_batch,
        prefill_chunk: config.prefill_chunk,
        shutdown: AtomicBool::new(false),
        preemptions: AtomicU64::new(0),
        fault,
    });
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let (transfer_tx, transfer_rx) = mpsc::channel::<Transfer>();
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name.into())
            .spawn(f)
            .map_err(|e| EngineError::Internal(format!("cannot start {name}: {e}")))
    };
    let prefill = {
        let shared = shared.clone();
        spawn(
            "cg-prefill",
            Box::new(move || prefill_worker(&shared, jobs_rx, transfer_tx)),
        )?
    };
    let decode = {
        let shared = shared.clone();
        let requeue = jobs_tx.clone();
        spawn(
            "cg-decode",
            Box::new(move || decode_worker(&shared, transfer_rx, requeue)),
        )?
    };
    Ok(EngineHandle {
        shared,
        capacity,
        template,
        control,
        jobs: jobs_tx,
        next_id: AtomicU64::new(1),
        workers: vec![prefill, decode],
    })
}

fn generation_config_eos(dir: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
        return Vec::new();
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    match json.get("eos_token_id") {
        Some(serde_json::Value::Array(ids)) => ids
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        Some(v) => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        None => Vec::new(),
    }
}

impl EngineHandle {
    /// Context window and pool capacity measured at start.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// Current pool occupancy and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            total_pages: self.shared.pool.num_pages(),
            free_pages: self.shared.pool.free_pages(),
            preemptions: self.shared.preemptions.load(Ordering::Relaxed),
        }
    }

    /// The context window the engine enforces (prompt + max_tokens).
    pub fn context_window(&self) -> usize {
        self.capacity.context_window
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.shared.tokenizer
    }

    /// Tokenizes plain text, adding the tokenizer's special tokens (e.g. BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.shared
            .tokenizer
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Renders OpenAI `messages` with the model's chat template and tokenizes the result
    /// (the template supplies special tokens), ending where the assistant's reply begins.
    ///
    /// The messages are read as OpenAI means them: a `developer` message is the system
    /// message; control tokens in a message's text (a user's `<|eot_id|>`) are text, never the
    /// tokens the template writes (see `prompt`); a template that refuses a system message
    /// (Gemma's, Mistral 7B v0.1's) gets its text at the start of the first user message, as
    /// providers serving such models place it: any template error with a system message present
    /// is tried once more that way (Mistral's refusal says `roles must alternate`), and the
    /// first error stands when the second try fails too.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        self.prompt_of(messages, |messages| self.template.render(messages))
    }

    /// [`EngineHandle::chat_prompt`] for `messages` whose last is the start of the assistant's
    /// reply (a prefill, as Anthropic's API reads a last assistant message): the prompt ends
    /// where that start does, so the reply continues it ([`ChatTemplate::render_continuing`]).
    pub fn chat_prompt_continuing(
        &self,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>, EngineError> {
        self.prompt_of(messages, |messages| {
            self.template.render_continuing(messages)
        })
    }

    fn prompt_of(
        &self,
        messages: &[ChatMessage],
        render: impl Fn(&[ChatMessage]) -> Result<String, EngineError>,
    ) -> Result<Vec<u32>, EngineError> {
        let messages: Vec<ChatMessage> = messages
            .iter()
            .map(|message| ChatMessage {
                role: match message.role.as_str() {
                    "developer" => "system".to_owned(),
                    role => role.to_owned(),
                },
                content: self.control.mark(&message.content).into_owned(),
            })
            .collect();
        let text = match render(&messages) {
            Ok(text) => text,
            Err(refused) if messages.iter().any(|message| message.role == "system") => {
                render(&system_in_first_user_message(&messages)).map_err(|_| refused)?
            }
            Err(error) => return Err(error),
        };
        self.control.encode(&self.shared.tokenizer, &text)
    }

    /// Admits a request or rejects it. A rejected request allocates nothing and never reaches
    /// a queue; an admitted one streams its events through the returned [`Generation`].
    pub fn submit(&self, request: GenerationRequest) -> Result<Generation, AdmissionError> {
        let prompt_len = request.prompt.len();
        if prompt_len == 0 {
            return Err(AdmissionError::Invalid("the prompt is empty".into()));
        }
        let vocab = self.shared.model.config().vocab_size;
        if let Some(&bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(AdmissionError::Invalid(format!(
                "token id {bad} is outside the vocabulary ({vocab} ids)"
            )));
        }
        request
            .sampling
            .validate()
            .map_err(|error| AdmissionError::Invalid(error.to_string()))?;
        let limit = self.capacity.context_window;
        let max_tokens = match request.max_tokens {
            Some(0) => return Err(AdmissionError::Invalid("max_tokens must be > 0".into())),
            Some(n) => n,
            None => limit.saturating_sub(prompt_len).max(1),
        };
        let requested = prompt_len.saturating_add(max_tokens);
        if requested > limit {
            return Err(AdmissionError::ContextLengthExceeded {
                requested,
                prompt_tokens: prompt_len,
                limit,
            });
        }
        if self.shared.shutdown.load(Ordering::Acquire) {
            return Err(AdmissionError::Unavailable);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = mpsc::channel();
        let max_stop = request.stop.iter().map(String::len).max().unwrap_or(0);
        let job = Job {
            id,
            generation: 0,
            prompt_len,
            tokens: request.prompt,
            max_tokens,
            sampler: Sampler::new(request.sampling),
            stop: request.stop.into_iter().filter(|s| !s.is_empty()).collect(),
            max_stop,
            return_logits: request.return_logits,
            emitted: 0,
            text: TextSoFar::default(),
            events,
        };
        self.jobs
            .send(job)
            .map_err(|_| AdmissionError::Unavailable)?;
        Ok(Generation {
            id,
            prompt_tokens: prompt_len,
            events: receiver,
        })
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// An admitted request on its way through the workers.
struct Job {
    id: u64,
    /// Attempt number; bumped on preemption so pages of an earlier attempt are foreign.
    generation: u32,
    prompt_len: usize,
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    max_tokens: usize,
    sampler: Sampler,
    stop: Vec<String>,
    max_stop: usize,
    return_logits: bool,
    /// Bytes of generated text already sent.
    emitted: usize,
    /// The generated text so far.
    text: TextSoFar,
    events: Sender<Event>,
}

impl Job {
    fn owner(&self) -> Owner {
        Owner {
            request: self.id,
            generation: self.generation,
        }
    }

    fn fail(self, shared: &Shared, error: EngineError) {
        shared.pool.release(self.owner());
        let _ = self.events.send(Event::Failed(error));
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Appends a sampled token and streams it; returns the finish reason if generation ends
    /// (or `Some(Stop)` if the receiver is gone).
    fn push_token(
        &mut self,
        shared: &Shared,
        token: u32,
        logits: Option<Vec<f32>>,
    ) -> Option<FinishReason> {
        self.tokens.push(token);
        let is_eos = shared.eos.contains(&token);
        let generated = &self.tokens[self.prompt_len..];
        if is_eos {
            self.text
                .finish(&shared.tokenizer, &generated[..generated.len() - 1]);
        } else if generated.len() >= self.max_tokens {
            self.text.finish(&shared.tokenizer, generated);
        } else {
            self.text.push(&shared.tokenizer, token, generated);
        }
        // The earliest stop string in the text, and which it is.
        let stop_at = self.text.find_stop(&self.stop, self.max_stop);
        let text = self.text.text();
        let mut finish = match stop_at {
            Some((_, index)) => Some(FinishReason::StopString(index)),
            None if is_eos => Some(FinishReason::Stop),
            None if self.generated() >= self.max_tokens => Some(FinishReason::Length),
            None => None,
        };
        let end = match (stop_at, finish) {
            (Some((at, _)), _) => at,
            (None, Some(_)) => text.len(),
            // Hold back what may still become a stop string or a complete character.
            (None, None) => {
                let mut end = text.trim_end_matches('\u{FFFD}').len();
                end = end.saturating_sub(self.max_stop.saturating_sub(1));
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                end
            }
        };
        let delta = text.get(self.emitted..end).unwrap_or("").to_string();
        self.emitted = self.emitted.max(end);
        let logits = if self.return_logits { logits } else { None };
        if self
            .events
            .send(Event::Token {
                id: token,
                text: delta,
                logits,
            })
            .is_err()
        {
            // Nobody listens any more: stop spending compute on it.
            finish = Some(FinishReason::Stop);
        }
        finish
    }

    fn finish(self, shared: &Shared, reason: FinishReason) {
        shared.pool.release(self.owner());
        let usage = Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
        };
        let _ = self.events.send(Event::Done {
            finish_reason: reason,
            usage,
        });
    }
}

/// Prefill's handoff to decode.
struct Transfer {
    job: Job,
    manifest: Manifest,
    /// Logits after the last prefilled token.
    logits: Vec<f32>,
}

const POLL: Duration = Duration::from_millis(20);

fn prefill_worker(shared: &Shared, jobs: Receiver<Job>, transfers: Sender<Transfer>) {
    let mut queue: VecDeque<Job> = VecDeque::new();
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            for job in queue.drain(..).chain(jobs.try_iter()) {
                job.fail(shared, EngineError::ShutDown);
            }
            return;
        }
        if queue.is_empty() {
            match jobs.recv_timeout(POLL) {
                Ok(job) => queue.push_back(job),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        for job in jobs.try_iter() {
            // Preempted requests go first: they already waited once.
            if job.generation > 0 {
                queue.push_front(job);
            } else {
                queue.push_back(job);
            }
        }
        let Some(job) = queue.front() else { continue };
        let needed = shared.pool.pages_for(job.tokens.len());
        let Some(pages) = shared.pool.allocate(job.owner(), needed) else {
            shared.pool.wait_for_free(POLL);
            continue;
        };
        let Some(job) = queue.pop_front() else {
            continue;
        };
        match prefill(shared, &job, pages) {
            Ok((manifest, logits)) => {
                let transfer = Transfer {
                    job,
                    manifest,
                    logits,
                };
                if let Err(mpsc::SendError(t)) = transfers.send(transfer) {
                    t.job.fail(shared, EngineError::ShutDown);
                    return;
                }
            }
            Err(e) => job.fail(shared, e),
        }
    }
}

/// Writes the KV of all of `job.tokens` into `pages` and returns the manifest and the logits
/// after the last token.
fn prefill(
    shared: &Shared,
    job: &Job,
    pages: Vec<PageId>,
) -> Result<(Manifest, Vec<f32>), EngineError> {
    let (pool, owner, n) = (&shared.pool, job.owner(), job.tokens.len());
    let mut logits = None;
    let mut start = 0;
    while start < n {
        let end = (start + shared.prefill_chunk).min(n);
        let segment = Segment {
            tokens: job.tokens[start..end].to_vec(),
            start,
            write_slots: pool.write_slots(owner, &pages, start, end - start)?,
            read_slots: pool.read_slots(owner, &pages, end)?,
        };
        logits = Some(shared.model.forward(&[segment], pool)?);
        start = end;
    }
    let logits = logits
        .ok_or_else(|| EngineError::Internal("empty prefill".into()))?
        .squeeze(0)?
        .to_vec1::<f32>()?;
    let checksum = pool.checksum(&pool.read_slots(owner, &pages, n)?)?;
    let mut manifest = Manifest {
        owner,
        pages,
        tokens: n,
        checksum,
    };
    match shared.fault {
        Some(TransferFault::DropLastPage) => {
            manifest.pages.pop();
        }
        Some(TransferFault::ClaimOneToken) => manifest.tokens = 1,
        None => {}
    }
    Ok((manifest, logits))
}

/// A request in the decode batch. Invariant: `job.tokens.len() == kv_len + 1` (the last
/// sampled token is not yet in the KV pool).
struct Running {
    job: Job,
    pages: Vec<PageId>,
    kv_len: usize,
}

fn decode_worker(shared: &Shared, transfers: Receiver<Transfer>, requeue: Sender<Job>) {
    let mut running: Vec<Running> = Vec::new();
    let mut arrived: VecDeque<Transfer> = VecDeque::new();
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            for r in running.drain(..) {
                r.job.fail(shared, EngineError::ShutDown);
            }
            for t in arrived.drain(..).chain(transfers.try_iter()) {
                t.job.fail(shared, EngineError::ShutDown);
            }
            return;
        }
        if running.is_empty() && arrived.is_empty() {
            match transfers.recv_timeout(POLL) {
                Ok(t) => arrived.push_back(t),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        // New prefills join between steps.
        arrived.extend(transfers.try_iter());
        while running.len() < shared.max_batch {
            let Some(t) = arrived.pop_front() else { break };
            if let Some(r) = accept(shared, t) {
                running.push(r);
            }
        }
        make_room(shared, &mut running, &requeue);
        if running.is_empty() {
            continue;
        }
        step(shared, &mut running);
    }
}

/// Checks a transfer's manifest and samples the first token; `None` if the request ended here.
fn accept(shared: &Shared, t: Transfer) -> Option<Running> {
    let Transfer {
        mut job,
        manifest,
        logits,
    } = t;
    if let Err(e) = manifest.verify(&shared.pool, job.owner(), job.tokens.len()) {
        job.fail(shared, e);
        return None;
    }
    let kv_len = job.tokens.len();
    let token = job.sampler.sample(&logits);
    if let Some(reason) = job.push_token(shared, token, Some(logits)) {
        job.finish(shared, reason);
        return None;
    }
    Some(Running {
        job,
        pages: manifest.pages,
        kv_len,
    })
}

/// Gives every running request a page for its next position, preempting the newest requests
/// (their pages freed, recomputed later by prefill) when the pool is full.
fn make_room(shared: &Shared, running: &mut Vec<Running>, requeue: &Sender<Job>) {
    let pool = &shared.pool;
    let mut i = 0;
    while i < running.len() {
        let r = &mut running[i];
        if r.kv_len < r.pages.len() * pool.page_size() {
            i += 1;
            continue;
        }
        if let Some(page) = pool.allocate(r.job.owner(), 1) {
            r.pages.extend(page);
            i += 1;
            continue;
        }
        let newest = (0..running.len())
            .max_by_key(|&j| running[j].job.id)
            .unwrap_or(i);
        let victim = running.remove(newest);
        shared.preemptions.fetch_add(1, Ordering::Relaxed);
        let mut job = victim.job;
        pool.release(job.owner());
        job.generation += 1;
        if let Err(mpsc::SendError(job)) = requeue.send(job) {
            job.fail(shared, EngineError::ShutDown);
        }
        if newest < i {
            i -= 1;
        }
    }
}

/// One decode step for the whole batch.
fn step(shared: &Shared, running: &mut Vec<Running>) {
    let pool = &shared.pool;
    let mut segments = Vec::with_capacity(running.len());
    let mut i = 0;
    while i < running.len() {
        let r = &running[i];
        let owner = r.job.owner();
        let segment = pool
            .write_slots(owner, &r.pages, r.kv_len, 1)
            .and_then(|write_slots| {
                Ok(Segment {
                    tokens: vec![r.job.tokens[r.kv_len]],
                    start: r.kv_len,
                    write_slots,
                    read_slots: pool.read_slots(owner, &r.pages, r.kv_len + 1)?,
                })
            });
        match segment {
            Ok(s) => {
                segments.push(s);
                i += 1;
            }
            Err(e) => running.remove(i).job.fail(shared, e.into()),
        }
    }
    if segments.is_empty() {
        return;
    }
    let rows = shared
        .model
        .forward(&segments, pool)
        .and_then(|logits| Ok(logits.to_vec2::<f32>()?));
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) => {
            for r in running.drain(..) {
                r.job.fail(shared, e.clone());
            }
            return;
        }
    };
    let mut still = Vec::with_capacity(running.len());
    for (mut r, logits) in running.drain(..).zip(rows) {
        r.kv_len += 1;
        let token = r.job.sampler.sample(&logits);
        match r.job.push_token(shared, token, Some(logits)) {
            Some(reason) => r.job.finish(shared, reason),
            None => still.push(r),
        }
    }
    *running = still;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_never_exceeds_pool_over_margin() {
        assert_eq!(context_window(4096, 1024, 1.0, None).unwrap(), 1024);
        assert_eq!(context_window(4096, 1024, 2.0, None).unwrap(), 512);
        assert_eq!(context_window(256, 1024, 2.0, None).unwrap(), 256);
        assert_eq!(context_window(4096, 1024, 1.0, Some(100)).unwrap(), 100);
        let err = context_window(4096, 1024, 2.0, Some(1000))
            .unwrap_err()
            .to_string();
        assert!(err.contains("1000") && err.contains("1024"), "{err}");
        assert!(context_window(4096, 1024, 0.5, None).is_err());
    }

    fn faulty_engine(dir: &Path, fault: TransferFault) -> EngineHandle {
        crate::write_tiny_model(dir, &crate::TinyModel::default()).unwrap();
        let config = EngineConfig {
            page_size: 4,
            kv_budget_bytes: 64 << 10,
            ..EngineConfig::new(dir)
        };
        Engine::start_with_fault(config, fault).unwrap()
    }

    /// Decode must refuse a manifest that misses pages or claims fewer tokens than the prompt,
    /// fail the request (no token is produced) and free every page it held.
    #[test]
    fn incomplete_manifests_are_refused_by_fault_injection() {
        use crate::transfer::TransferError;
        for fault in [TransferFault::DropLastPage, TransferFault::ClaimOneToken] {
            let dir = tempfile::tempdir().unwrap();
            let engine = faulty_engine(dir.path(), fault);
            let events: Vec<Event> = engine
                .submit(GenerationRequest::greedy((1..=30).collect(), 5))
                .unwrap()
                .collect();
            assert_eq!(events.len(), 1, "{fault:?}: {events:?}");
            match (&events[0], fault) {
                (
                    Event::Failed(EngineError::Transfer(TransferError::MissingPages {
                        listed: 7,
                        needed: 8,
                        ..
                    })),
                    TransferFault::DropLastPage,
                )
                | (
                    Event::Failed(EngineError::Transfer(TransferError::Incomplete {
                        covered: 1,
                        required: 30,
                    })),
                    TransferFault::ClaimOneToken,
                ) => {}
                (other, _) => panic!("{fault:?}: expected a refused transfer, got {other:?}"),
            }
            let stats = engine.stats();
            assert_eq!(
                stats.free_pages, stats.total_pages,
                "{fault:?}: pages leaked"
            );
        }
    }
}

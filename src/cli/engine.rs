//! `canarygate engine ...`: the bundled local engine on its own (the
//! `canarygate-engine` crate).

use std::path::PathBuf;
use std::sync::Arc;

use canarygate_engine::{
    DeviceKind, Engine, EngineConfig, EngineError, EngineHandle, Event, GenerationRequest,
    SamplingParams, TinyModel, TinyTokenizer, write_tiny_model,
};
use clap::{Args, Subcommand};
use serde_json::json;

/// Subcommands of `canarygate engine`.
#[derive(Debug, Subcommand)]
pub enum EngineCommand {
    /// Serve OpenAI-compatible chat completions from a local model.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: String,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Generate a completion of a raw prompt and print it.
    Generate {
        /// Prompt text (tokenized with the tokenizer's special tokens, no chat template).
        #[arg(long)]
        prompt: String,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Argmax decoding (overrides temperature).
        #[arg(long)]
        greedy: bool,
        /// Sampling temperature.
        #[arg(long, default_value_t = 1.0)]
        temperature: f32,
        /// Nucleus sampling mass.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Keep only the k most likely tokens (0: all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print one JSON object with `prompt_ids`, `generated_ids` and `text`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Write a small random Llama model directory (for tests and demos).
    InitTiny {
        /// Directory to create.
        dir: PathBuf,
        /// Seed of the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Context window written to config.json (max_position_embeddings).
        #[arg(long, default_value_t = 512)]
        context: usize,
        /// Word-level tokenizer (about one token per word) instead of one token per byte.
        #[arg(long)]
        word_tokenizer: bool,
    },
}

/// Engine options shared by `serve` and `generate`.
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// KV pool size in MiB.
    #[arg(long, default_value_t = 512)]
    kv_budget_mib: usize,
    /// Positions per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// The pool must hold this many times the advertised context window (>= 1.0).
    #[arg(long, default_value_t = 1.0)]
    kv_margin: f64,
    /// Advertise at most this context window; start fails if the pool cannot hold it.
    #[arg(long)]
    max_context: Option<usize>,
    /// Most requests per decode batch.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Run on this CUDA device (needs a build with `--features cuda`).
    #[arg(long)]
    cuda: Option<usize>,
}

impl EngineArgs {
    fn start(&self) -> Result<EngineHandle, EngineError> {
        let config = EngineConfig {
            kv_budget_bytes: self.kv_budget_mib << 20,
            page_size: self.page_size,
            kv_margin: self.kv_margin,
            max_context: self.max_context,
            max_batch: self.max_batch,
            device: self.cuda.map_or(DeviceKind::Cpu, DeviceKind::Cuda),
            ..EngineConfig::new(&self.model)
        };
        let engine = Engine::start(config)?;
        let c = engine.capacity();
        eprintln!(
            "canarygate engine: KV pool holds {} tokens; model context window {}; serving a context window of {} (kv margin {})",
            c.pool_tokens, c.model_context, c.context_window, self.kv_margin
        );
        Ok(engine)
    }
}

/// Runs one `canarygate engine` subcommand.
pub fn run(command: EngineCommand) -> anyhow::Result<()> {
    match command {
        EngineCommand::InitTiny {
            dir,
            seed,
            context,
            word_tokenizer,
        } => {
            write_tiny_model(
                &dir,
                &TinyModel {
                    seed,
                    max_position_embeddings: context,
                    tokenizer: if word_tokenizer {
                        TinyTokenizer::Words
                    } else {
                        TinyTokenizer::Bytes
                    },
                    ..TinyModel::default()
                },
            )?;
            eprintln!("wrote a random tiny Llama model to {}", dir.display());
            Ok(())
        }
        EngineCommand::Serve { listen, engine } => {
            let name = engine
                .model
                .file_name()
                .map_or_else(|| "local".to_string(), |n| n.to_string_lossy().into_owned());
            let handle = Arc::new(engine.start()?);
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind(&listen).await?;
                eprintln!(
                    "canarygate engine: listening on http://{}",
                    listener.local_addr()?
                );
                canarygate_engine::serve(handle, name, listener).await
            })?;
            Ok(())
        }
        EngineCommand::Generate {
            prompt,
            max_tokens,
            greedy,
            temperature,
            top_p,
            top_k,
            seed,
            json,
            engine,
        } => {
            let handle = engine.start()?;
            let prompt_ids = handle.encode(&prompt)?;
            let sampling = SamplingParams {
                temperature: if greedy { 0.0 } else { temperature },
                top_p,
                top_k,
                seed,
            };
            let generation = handle.submit(GenerationRequest {
                prompt: prompt_ids.clone(),
                max_tokens: Some(max_tokens),
                sampling,
                stop: Vec::new(),
                return_logits: false,
            })?;
            let mut generated_ids = Vec::new();
            let mut text = String::new();
            for event in generation {
                match event {
                    Event::Token { id, text: t, .. } => {
                        generated_ids.push(id);
                        if !json {
                            use std::io::Write;
                            print!("{t}");
                            std::io::stdout().flush()?;
                        }
                        text.push_str(&t);
                    }
                    Event::Done { .. } => break,
                    Event::Failed(e) => return Err(e.into()),
                }
            }
            if json {
                println!(
                    "{}",
                    json!({"prompt_ids": prompt_ids, "generated_ids": generated_ids, "text": text})
                );
            } else {
                println!();
            }
            Ok(())
        }
    }
}

//! The simulated provider's surfaces on a real socket, one test binary (one
//! link) with a module per surface: Chat Completions, legacy completions,
//! embeddings, Anthropic Messages, the Responses API, and the official
//! SDKs against all of them.

mod common;

mod chat;
mod completions;
mod embeddings;
mod messages;
mod responses;
mod sdk;

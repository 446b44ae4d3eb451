//! The APIs the simulator speaks, one module each: each reads its request
//! into a [`Turn`](crate::conversation::Turn), lets the shared
//! [`SimProvider::run`](crate::provider::SimProvider::run) decide what the
//! model sees, composes the answer ([`crate::answer`]) and renders it in its
//! own wire format for [`crate::delivery`].
//!
//! Rendering is pure (bodies and stream frames from an answer); the HTTP
//! handlers are thin. Every response carries its provider's headers
//! ([`exchange::finish`]): OpenAI's on the OpenAI surfaces, Anthropic's on Messages.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod exchange;
pub mod messages;
pub mod responses;

pub use exchange::Sim;

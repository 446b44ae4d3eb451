//! canarygate-policies: the pure logic of canarygate.
//!
//! Everything here is free of I/O so it can be tested and fuzzed alone:
//! the policy schema and its validation ([`config`]), the incremental
//! Server-Sent Events parser ([`sse`]) and prompt-token estimation ([`tokens`]).

pub mod config;
pub mod sse;
pub mod tokens;

pub use config::{Policy, PolicyError};

//! canarygate-engine: the bundled local prefill/decode engine.
//!
//! Placeholder until the engine issue lands: it exposes the CLI surface the binary delegates to.

pub mod cli;

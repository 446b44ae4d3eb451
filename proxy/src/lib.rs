//! canarygate-proxy: the verifying reverse proxy and the simulated provider.
//!
//! [`Server`] is the proxy (`canarygate serve`): it authenticates the caller,
//! places canaries in the request, forwards it, verifies the answer as it
//! streams and records the request in the [`audit`] log. [`sim`] is the
//! simulated OpenAI-compatible provider (`canarygate sim-provider`) that
//! tests, benchmarks and the [`demo`] run against.

pub mod audit;
mod clock;
pub mod demo;
mod error;
pub mod identity;
pub mod local;
mod metrics;
pub mod probe;
mod relay;
mod request;
pub mod server;
pub mod sim;
pub mod tls;
mod trail;
mod upstream;
mod verified;

pub use server::{ServeOptions, Server, Startup};

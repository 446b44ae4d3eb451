//! canarygate-proxy: the verifying reverse proxy and the simulated provider.
//!
//! [`server`] is the proxy (`canarygate serve`); [`sim`] is the simulated
//! OpenAI-compatible provider (`canarygate sim-provider`) that tests,
//! benchmarks and the demo run against.

pub mod audit;
pub mod clock;
pub mod demo;
pub mod error;
pub mod identity;
pub mod metrics;
pub mod relay;
pub mod request;
pub mod server;
pub mod sim;
pub mod tls;
mod trail;
pub mod upstream;
mod verified;

pub use server::{ServeOptions, Server};

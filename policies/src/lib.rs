//! canarygate-policies: the pure logic of canarygate.
//!
//! Everything here is free of I/O so it can be tested and fuzzed alone:
//! the policy schema and its validation ([`config`], [`verify_config`]), the
//! incremental Server-Sent Events parser ([`sse`]), prompt-token estimation
//! ([`tokens`]), canaries ([`canary`]), placing them into requests
//! ([`mod@inject`]) with the output tokens an echo gets ([`echo_cost`]), the
//! registry of live canaries ([`registry`]), the streaming verifier with its
//! verdicts ([`verify`]) and the topic check's texts and sampling
//! ([`topic`]).

pub mod canary;
pub mod config;
pub mod context;
pub mod echo_cost;
pub mod endpoints_config;
pub mod inject;
pub mod local_config;
pub mod probe;

pub mod registry;
pub mod registry_config;
pub mod sse;
pub mod tokens;
pub mod topic;
pub mod verify;
pub mod verify_config;

pub use canary::{Canary, CanaryKey};
pub use config::{Policy, PolicyError};
pub use echo_cost::EchoCost;
pub use inject::{Injection, RequestCanaries, inject};
pub use registry::{CanaryRegistry, MemoryRegistry, Registration};
pub use verify::{Decision, Facts, ProviderUsage, Verdict, Verifier};
pub use verify_config::{EchoMode, FailureAction, ReleasePolicy, VerifyConfig};

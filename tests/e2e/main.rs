//! The root crate's integration tests, linked into one test binary (`e2e`):
//! each file here is one module, so `cargo test` compiles and links the
//! whole set once instead of once per file (each binary carries candle).
//!
//! Run one file's tests with its module path as the filter:
//! `scripts/test.sh --test e2e proxy_e2e::` (or one test:
//! `scripts/test.sh --test e2e proxy_e2e::upstream_down_is_502`).
//!
//! The modules share one process and run in parallel threads, so a test
//! must not change process-wide state (environment variables, the current
//! directory, the umask, resource limits, signal handlers): it sets those on
//! the child processes it starts instead, as every test here does.

mod common;

mod architecture;
mod audit_cli;
mod audit_serve;
mod chat_templates;
mod cli;
mod demo;
mod engine_cli;
mod fidelity;
mod honest_traffic;
mod hostile_clients;
mod local_fallback;
mod openai_sdk;
mod passthrough;
mod probe;
mod prompt_caching;
mod proxy_e2e;
mod review_page;
mod shared_registry;
mod sim_modes;
mod surface_completions;
mod surface_messages;
mod surface_responses;
mod tls_upstream;
mod topic_check;
mod verification_e2e;

//! canarygate-proxy: the serving path of the verifying reverse proxy.
//!
//! [`Server`] is `canarygate serve`: it admits a request (slot, credential,
//! body), places canaries in it, forwards it, verifies the answer as it
//! streams, records the request in the audit log ([`canarygate_audit`]),
//! and serves it from the bundled engine when the provider cannot be
//! trusted with it. [`probe`] measures the context a provider really serves.
//!
//! The modules form layers; each imports only from the layers below it
//! (a test holds the crate to this, see `docs/ARCHITECTURE.md`):
//!
//! 1. `server`: bind and run, router, middleware, admission, background tasks.
//! 2. `pipeline`: the one place that decides: preflight, provider or local,
//!    fallback after a failed verdict.
//! 3. `paths` (`verified`, `plain`, `local`) and `probe`: serving a request
//!    one way; probing a provider.
//! 4. The pieces they share: `context` (the request on its way and its
//!    responses), `upstream` (the providers' clients, the one upstream
//!    request, error mapping), `upstream_client` (the HTTP client they
//!    call with: pool, TLS, HTTP/2, the connect deadline), `body` (the one audited response body),
//!    `relay`, `trail` (the audit record, concluded in one place),
//!    `upstream_setup` (what building the providers' clients needs),
//!    `registry` (live canaries), `wire` (wire formats), `topic` (the
//!    topic check), `state`,
//!    `identity`, `engine`, `probe_results`.
//! 5. `error`, `clock`, `metrics`, `upstream_body` (a provider's response
//!    body, read ahead to tell a stream labelled JSON).

#[cfg(test)]
mod allocations;
mod body;
mod clock;
mod context;
mod engine;
pub mod error;
mod identity;
mod metrics;
mod paths;
mod pipeline;
pub mod probe;
mod probe_results;
mod registry;
mod relay;
mod server;
mod shared_registry;
mod state;
mod system_role;
pub mod topic;
mod trail;
mod upstream;
mod upstream_body;
mod upstream_client;
mod upstream_setup;
mod wire;

pub use context::{
    OVERHEAD_HEADER, REQUEST_ID_HEADER, SERVED_BY_HEADER, SESSION_ID_HEADER, VERDICT_HEADER,
};
pub use engine::LocalEngineError;
pub use identity::client_key_hash;
pub use paths::local::LOCAL_REASON_HEADER;
pub use probe_results::{PROBES_DIR, StoreError, store as store_probe_result};
pub use server::{OpenFiles, ServeOptions, Server, StartError, Startup};
pub use upstream::{UpstreamError, Upstreams, provider_api_key};

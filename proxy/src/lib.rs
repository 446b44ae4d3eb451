//! canarygate-proxy: the verifying reverse proxy and the simulated provider.
pub mod audit;

//! The measuring parts of the load generators in `bench/`, shared by the
//! binaries: `canarygate-bench` (throughput, CPU and latency of targets
//! side by side: `bench/run.sh`, `bench/registry.sh`, the growth curves of
//! `bench/growth.sh`) and `canarygate-bench-memory` (resident memory with
//! open streams, per request's canaries, and over a soak: `bench/growth.sh`).
//!
//! [`target`] parses who is measured; [`load`] sends the requests;
//! [`procstat`] and [`memory`] read CPU time and resident memory from
//! `/proc`; [`overhead`] reads canarygate's own time per request from its
//! `/metrics`; [`disk`] times the disk's sync, the floor of a durable answer.

pub mod disk;
pub mod load;
pub mod memory;
pub mod overhead;
pub mod procstat;
pub mod target;

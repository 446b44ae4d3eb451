//! Time: the wall clock (`now_ms`, the same clock the audit log stamps
//! records with) and per-request accounting of the proxy's own time.
//!
//! Overhead is wall time from the start of a request to its end, minus the
//! time spent waiting on the provider (connect, first byte, every chunk,
//! including the scheduler rounds a relay yields so that the provider's
//! connection task can decode what already arrived) and on the client
//! (between handing hyper a chunk and being asked for the next).
//! It is observed into `canarygate_proxy_overhead_seconds` when the clock drops,
//! which also covers requests the client abandoned.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use canarygate_audit::time::now_ms;

use crate::metrics::{InFlightGuard, Metrics};

/// Started when a chat request arrives; records its overhead when dropped.
pub struct RequestClock {
    start: Instant,
    waiting: Duration,
    metrics: Arc<Metrics>,
    _in_flight: InFlightGuard,
}

impl RequestClock {
    /// Starts the clock and counts the request as in flight.
    pub fn start(metrics: Arc<Metrics>) -> Self {
        Self {
            start: Instant::now(),
            waiting: Duration::ZERO,
            _in_flight: metrics.start_in_flight(),
            metrics,
        }
    }

    /// Awaits `future`, counting its duration as waiting.
    pub async fn wait<F: Future>(&mut self, future: F) -> F::Output {
        let started = Instant::now();
        let output = future.await;
        self.waiting += started.elapsed();
        output
    }

    /// Counts `duration` as waiting.
    pub fn add_waiting(&mut self, duration: Duration) {
        self.waiting += duration;
    }

    /// The metrics the request counts in.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The proxy's own time so far.
    pub fn overhead(&self) -> Duration {
        self.start.elapsed().saturating_sub(self.waiting)
    }
}

impl Drop for RequestClock {
    fn drop(&mut self) {
        self.metrics.observe_overhead(self.overhead().as_secs_f64());
    }
}

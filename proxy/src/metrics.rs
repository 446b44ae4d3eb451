//! Prometheus metrics served at `GET /metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Endpoint, e.g. `chat_completions`.
    pub route: &'static str,
    /// HTTP status sent to the client.
    pub status: u16,
}

/// Labels of the local-engine counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalLabels {
    /// Why the request was served locally, e.g. `untrusted_context`.
    pub reason: &'static str,
}

/// The process's metrics. Cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    in_flight: Gauge,
    overhead: Histogram,
    local: Family<LocalLabels, Counter>,
    audit_background_failures: Gauge,
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("canarygate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by endpoint and HTTP status",
            requests.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "in_flight_requests",
            "Chat completion requests being served",
            in_flight.clone(),
        );
        // 10 µs .. ~2.6 s in powers of two.
        let overhead = Histogram::new((0..19).map(|i| 10e-6 * f64::from(1u32 << i)));
        registry.register(
            "proxy_overhead_seconds",
            "Time canarygate spent on a request itself: total minus waiting on upstream and client",
            overhead.clone(),
        );
        let local = Family::<LocalLabels, Counter>::default();
        registry.register(
            "local_served",
            "Chat requests served by the local engine instead of the provider, by reason",
            local.clone(),
        );
        let audit_background_failures = Gauge::default();
        registry.register(
            "audit_background_failures",
            "Audit writes that failed with nobody waiting ([audit] durability = \"background\", canary persistence)",
            audit_background_failures.clone(),
        );
        Self {
            registry,
            requests,
            in_flight,
            overhead,
            local,
            audit_background_failures,
        }
    }

    /// Counts one answered request.
    pub fn count_request(&self, route: &'static str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
    }

    /// Counts one request served by the local engine.
    pub fn count_local(&self, reason: &'static str) {
        self.local.get_or_create(&LocalLabels { reason }).inc();
    }

    /// Marks a chat request as started; the guard marks it finished when dropped.
    pub fn start_in_flight(&self) -> InFlightGuard {
        self.in_flight.inc();
        InFlightGuard(self.in_flight.clone())
    }

    /// Records the proxy's own time on one request.
    pub fn observe_overhead(&self, seconds: f64) {
        self.overhead.observe(seconds);
    }

    /// Sets the count of failed background audit writes.
    pub fn set_audit_background_failures(&self, count: u64) {
        self.audit_background_failures
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Decrements the in-flight gauge when dropped.
pub struct InFlightGuard(Gauge);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

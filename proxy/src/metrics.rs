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

/// Labels of the overhead-token counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// `prompt` or `completion`.
    pub kind: &'static str,
}

/// Labels of the client-timeout counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TimeoutLabels {
    /// What the client was too slow with: `header`, `body`, `body_idle`,
    /// `keepalive`.
    pub phase: &'static str,
}

/// Labels of the registry counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegistryLabels {
    /// `register` (claiming a request's canaries) or `lookup` (resolving
    /// an answer's canary-shaped spans); for `registry_unavailable_requests`,
    /// what the request got: `degraded` (served, local-only detection),
    /// `refused` (fail-closed, not sent) or `failed` (fail-closed, its
    /// answer's spans could not be looked up: `foreign_canary` failed).
    pub what: &'static str,
}

/// Labels of the local-engine counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalLabels {
    /// Why the request was served locally, e.g. `untrusted_context`.
    pub reason: &'static str,
}

/// Labels of the topic-score counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TopicLabels {
    /// `fits`, `low`, or why it was not scored (`timeout`, `busy`, ...).
    pub result: String,
}

/// Upper bounds of `canarygate_topic_score_seconds`' buckets.
const TOPIC_BUCKETS_SECONDS: [f64; 12] = [
    1e-3, 2e-3, 3e-3, 5e-3, 10e-3, 20e-3, 30e-3, 50e-3, 100e-3, 200e-3, 500e-3, 1.0,
];

/// Upper bounds of `canarygate_proxy_overhead_seconds`' buckets: 10–100 µs
/// apart up to 1 ms, where a proxy's overhead percentiles fall, with an edge
/// at exactly 1 ms (the bound the benchmark checks p99 against); 200 µs
/// apart up to 2 ms and 500 µs apart up to 4 ms, where a durable answer's
/// p99 falls (the disk's sync p99 plus up to 1 ms is the benchmark's bound
/// for it); then coarser up to 5 s.
const OVERHEAD_BUCKETS_SECONDS: [f64; 36] = [
    10e-6, 20e-6, 30e-6, 40e-6, 50e-6, 60e-6, 80e-6, 100e-6, 150e-6, 200e-6, 250e-6, 300e-6,
    400e-6, 500e-6, 600e-6, 700e-6, 800e-6, 900e-6, 1e-3, 1.2e-3, 1.4e-3, 1.6e-3, 1.8e-3, 2e-3,
    2.5e-3, 3e-3, 3.5e-3, 4e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 500e-3, 1.0, 5.0,
];

/// The process's metrics. Cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    in_flight: Gauge,
    overhead: Histogram,
    local: Family<LocalLabels, Counter>,
    audit_background_failures: Gauge,
    audit_cache_bytes: Gauge,
    audit_journal_sync: Histogram,
    audit_record_wait: Histogram,
    canaries_in_memory: Gauge,
    client_connections: Gauge,
    client_connections_evicted: Counter,
    client_timeouts: Family<TimeoutLabels, Counter>,
    overhead_tokens: Family<TokenLabels, Counter>,
    registry_up: Gauge,
    registry_failures: Family<RegistryLabels, Counter>,
    registry_unavailable_requests: Family<RegistryLabels, Counter>,
    topic_scores: Family<TopicLabels, Counter>,
    topic_seconds: Histogram,
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
        let overhead = Histogram::new(OVERHEAD_BUCKETS_SECONDS.iter().copied());
        registry.register(
            "proxy_overhead_seconds",
            "Time canarygate spent on a request itself: total minus waiting on upstream and client",
            overhead.clone(),
        );
        // The same buckets as the overhead's: a durable answer's own time
        // is read against these.
        let audit_journal_sync = Histogram::new(OVERHEAD_BUCKETS_SECONDS.iter().copied());
        registry.register(
            "audit_journal_sync_seconds",
            "Time one audit journal write took, its fdatasync included (durable audit): the disk's sync under this load",
            audit_journal_sync.clone(),
        );
        let audit_record_wait = Histogram::new(OVERHEAD_BUCKETS_SECONDS.iter().copied());
        registry.register(
            "audit_record_wait_seconds",
            "Time a request waited for the audit log to take its record, counted in its own time: until on disk (durable audit) or queued (background)",
            audit_record_wait.clone(),
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
        let audit_cache_bytes = Gauge::default();
        registry.register(
            "audit_cache_bytes",
            "Bytes in the audit store's page cache, which grows with the audit file up to its fixed bound",
            audit_cache_bytes.clone(),
        );
        let canaries_in_memory = Gauge::default();
        registry.register(
            "canaries_in_memory",
            "Canaries held in this process's registry: live, or expired and not yet purged",
            canaries_in_memory.clone(),
        );
        let client_connections = Gauge::default();
        registry.register(
            "client_connections",
            "Client connections open",
            client_connections.clone(),
        );
        let client_connections_evicted = Counter::default();
        registry.register(
            "client_connections_evicted",
            "Idle client connections closed to make room for a new one at limits.max_connections",
            client_connections_evicted.clone(),
        );
        let client_timeouts = Family::<TimeoutLabels, Counter>::default();
        registry.register(
            "client_timeouts",
            "Clients too slow with a request's head, its body, between two body chunks, \
             idle past the keep-alive timeout, or reading nothing of an answer, by phase",
            client_timeouts.clone(),
        );
        let overhead_tokens = Family::<TokenLabels, Counter>::default();
        registry.register(
            "overhead_tokens",
            "canarygate's own tokens in verified answers: prompt tokens it added, completion \
             tokens the client did not get (the echo, canaries, tokens cut at its limit), by kind",
            overhead_tokens.clone(),
        );
        let registry_up = Gauge::default();
        registry.register(
            "registry_up",
            "1 while the canary registry answers (always, for the in-memory one), 0 while \
             the shared registry cannot be reached",
            registry_up.clone(),
        );
        let registry_failures = Family::<RegistryLabels, Counter>::default();
        registry.register(
            "registry_failures",
            "Round trips to the shared canary registry that failed or timed out, by what",
            registry_failures.clone(),
        );
        let registry_unavailable_requests = Family::<RegistryLabels, Counter>::default();
        registry.register(
            "registry_unavailable_requests",
            "Requests that met an unavailable shared registry: served with local-only \
             detection (degraded), refused before sending or failed for a lookup (fail-closed)",
            registry_unavailable_requests.clone(),
        );
        let topic_scores = Family::<TopicLabels, Counter>::default();
        registry.register(
            "topic_scores",
            "Answers the topic check scored, by result: fits, low, or why not scored",
            topic_scores.clone(),
        );
        let topic_seconds = Histogram::new(TOPIC_BUCKETS_SECONDS.iter().copied());
        registry.register(
            "topic_score_seconds",
            "Time to score one answer (embedding the question and the answer), queueing included",
            topic_seconds.clone(),
        );
        Self {
            topic_scores,
            topic_seconds,
            registry,
            requests,
            in_flight,
            overhead,
            local,
            audit_background_failures,
            audit_cache_bytes,
            audit_journal_sync,
            audit_record_wait,
            canaries_in_memory,
            client_connections,
            client_connections_evicted,
            client_timeouts,
            overhead_tokens,
            registry_up,
            registry_failures,
            registry_unavailable_requests,
        }
    }

    /// Counts one topic score and how long it took.
    pub fn count_topic(&self, result: &str, seconds: f64) {
        self.topic_scores
            .get_or_create(&TopicLabels {
                result: result.to_owned(),
            })
            .inc();
        self.topic_seconds.observe(seconds);
    }

    /// Sets whether the canary registry answers.
    pub fn registry_up(&self, up: bool) {
        self.registry_up.set(i64::from(up));
    }

    /// Counts one failed round trip to the shared registry.
    pub fn registry_failure(&self, what: &'static str) {
        self.registry_failures
            .get_or_create(&RegistryLabels { what })
            .inc();
    }

    /// Counts one request that met an unavailable shared registry:
    /// `degraded`, `refused` or `failed`.
    pub fn registry_unavailable(&self, what: &'static str) {
        self.registry_unavailable_requests
            .get_or_create(&RegistryLabels { what })
            .inc();
    }

    /// Counts canarygate's own tokens in one verified answer.
    pub fn count_overhead_tokens(&self, prompt: u64, completion: u64) {
        for (kind, tokens) in [("prompt", prompt), ("completion", completion)] {
            self.overhead_tokens
                .get_or_create(&TokenLabels { kind })
                .inc_by(tokens);
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

    /// Marks a client connection as open; the guard marks it closed when dropped.
    pub fn open_client_connection(&self) -> ConnectionGauge {
        self.client_connections.inc();
        ConnectionGauge(self.client_connections.clone())
    }

    /// Counts one idle client connection closed for a new one.
    pub fn count_eviction(&self) {
        self.client_connections_evicted.inc();
    }

    /// Counts one client too slow in `phase` (`header`, `body`,
    /// `body_idle`, `keepalive`, `write`).
    pub fn count_client_timeout(&self, phase: &'static str) {
        self.client_timeouts
            .get_or_create(&TimeoutLabels { phase })
            .inc();
    }

    /// Records the proxy's own time on one request.
    pub fn observe_overhead(&self, seconds: f64) {
        self.overhead.observe(seconds);
    }

    /// Observes one audit journal write and its sync.
    pub fn observe_audit_journal_sync(&self, seconds: f64) {
        self.audit_journal_sync.observe(seconds);
    }

    /// Observes one request's wait for the audit log to take its record.
    pub fn observe_audit_record_wait(&self, seconds: f64) {
        self.audit_record_wait.observe(seconds);
    }

    /// Sets the count of failed background audit writes.
    pub fn set_audit_background_failures(&self, count: u64) {
        self.audit_background_failures
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Sets `canarygate_audit_cache_bytes`.
    pub fn set_audit_cache_bytes(&self, bytes: usize) {
        self.audit_cache_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets `canarygate_canaries_in_memory`.
    pub fn set_canaries_in_memory(&self, count: usize) {
        self.canaries_in_memory
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

/// Decrements the open-connections gauge when dropped.
pub struct ConnectionGauge(Gauge);

impl Drop for ConnectionGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Decrements the in-flight gauge when dropped.
pub struct InFlightGuard(Gauge);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overhead_buckets_rise_and_split_at_one_millisecond() {
        assert!(OVERHEAD_BUCKETS_SECONDS.windows(2).all(|w| w[0] < w[1]));
        let metrics = Metrics::new();
        metrics.observe_overhead(0.000_95);
        metrics.observe_overhead(0.001_05);
        let text = metrics.render();
        assert!(
            text.contains("canarygate_proxy_overhead_seconds_bucket{le=\"0.001\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("canarygate_proxy_overhead_seconds_bucket{le=\"0.0012\"} 2\n"),
            "{text}"
        );
    }
}

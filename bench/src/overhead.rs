//! A proxy's own time per request, as canarygate reports it.
//!
//! canarygate observes every chat request into the Prometheus histogram
//! `canarygate_proxy_overhead_seconds`: wall time minus the time spent waiting
//! on the provider and on the client (the definition TensorZero uses for its
//! gateway's "latency overhead"). Scraping it before and after a latency
//! phase gives the distribution of that phase's requests alone, free of the
//! noise of the load generator and the upstream that end-to-end *added*
//! latency carries.
//!
//! A pool of instances (one target behind several URLs) is read as one:
//! every instance's histogram is scraped and their counts are added bucket
//! by bucket ([`Histogram::sum`]), which is the histogram of all the pool's
//! requests. Percentiles are taken from that sum, never averaged over
//! instances.
//!
//! With the durable audit, the same scrape gives the floor of that own time:
//! `canarygate_audit_journal_sync_seconds`, the duration of each journal
//! write and its `fdatasync` under the phase's own load, and the part of it
//! spent waiting for the audit log: `canarygate_audit_record_wait_seconds`,
//! each request's wait from handing its record over until its task runs
//! again with the record on disk ([`Scrape`]).

use std::net::SocketAddr;

use crate::disk::SyncSummary;

/// canarygate's own time per request.
const OVERHEAD: &str = "canarygate_proxy_overhead_seconds";
/// Each audit journal write and its sync (durable audit only).
const JOURNAL_SYNC: &str = "canarygate_audit_journal_sync_seconds";
/// Each request's wait for the audit log to take its record.
const RECORD_WAIT: &str = "canarygate_audit_record_wait_seconds";

/// A cumulative histogram: `(upper bound in seconds, requests at or below)`,
/// bounds ascending, the last one `+Inf`.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    buckets: Vec<(f64, u64)>,
}

impl Histogram {
    /// The overhead histogram in a Prometheus text exposition, if it has one.
    pub fn parse(text: &str) -> Option<Self> {
        Self::parse_named(text, OVERHEAD)
    }

    /// The histogram `name` in a Prometheus text exposition, if it has one.
    fn parse_named(text: &str, name: &str) -> Option<Self> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut buckets = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(prefix.as_str()) else {
                continue;
            };
            let (bound, rest) = rest.split_once("\"}")?;
            let bound = match bound {
                "+Inf" => f64::INFINITY,
                bound => bound.parse().ok()?,
            };
            let count = rest.trim().parse().ok()?;
            buckets.push((bound, count));
        }
        let ascending = buckets.windows(2).all(|w| w[0].0 < w[1].0);
        let ends_at_infinity = buckets.last().is_some_and(|b| b.0 == f64::INFINITY);
        (ascending && ends_at_infinity).then_some(Self { buckets })
    }

    /// What was observed after `earlier` (a scrape of the same process).
    pub fn since(&self, earlier: &Self) -> Option<Self> {
        if self.buckets.len() != earlier.buckets.len() {
            return None;
        }
        let buckets = self
            .buckets
            .iter()
            .zip(&earlier.buckets)
            .map(|(now, then)| (now.0 == then.0).then(|| (now.0, now.1.saturating_sub(then.1))))
            .collect::<Option<_>>()?;
        Some(Self { buckets })
    }

    /// The histogram of every request observed by any of `histograms`
    /// (scrapes of several instances at about the same moment): counts added
    /// bucket by bucket. None when there are none, or their buckets differ.
    pub fn sum(histograms: &[Self]) -> Option<Self> {
        let (first, rest) = histograms.split_first()?;
        let mut buckets = first.buckets.clone();
        for other in rest {
            if other.buckets.len() != buckets.len() {
                return None;
            }
            for (total, bucket) in buckets.iter_mut().zip(&other.buckets) {
                if total.0 != bucket.0 {
                    return None;
                }
                total.1 += bucket.1;
            }
        }
        Some(Self { buckets })
    }

    /// Requests observed.
    pub fn count(&self) -> u64 {
        self.buckets.last().map_or(0, |b| b.1)
    }

    /// The upper bound, in µs, of the bucket holding the nearest-rank `q`
    /// quantile: the quantile is at most this. NaN when empty, infinite when
    /// it lies beyond the last finite bound.
    pub fn quantile_bound_us(&self, q: f64) -> f64 {
        let count = self.count();
        if count == 0 {
            return f64::NAN;
        }
        let rank = ((q * count as f64).ceil() as u64).clamp(1, count);
        self.buckets
            .iter()
            .find(|b| b.1 >= rank)
            .map_or(f64::INFINITY, |b| b.0 * 1e6)
    }
}

/// What one scrape of canarygate's `/metrics` gives: the overhead
/// histogram, and the journal's sync and the record wait histograms where
/// it has them.
#[derive(Debug, Clone, PartialEq)]
pub struct Scrape {
    pub overhead: Histogram,
    pub journal_sync: Option<Histogram>,
    pub record_wait: Option<Histogram>,
}

impl Scrape {
    /// The histograms in a Prometheus text exposition; None without the
    /// overhead's.
    pub fn parse(text: &str) -> Option<Self> {
        Some(Self {
            overhead: Histogram::parse(text)?,
            journal_sync: Histogram::parse_named(text, JOURNAL_SYNC),
            record_wait: Histogram::parse_named(text, RECORD_WAIT),
        })
    }

    /// A pool's scrapes as one ([`Histogram::sum`]); the journal's and the
    /// record wait's only when every instance has them.
    pub fn sum(scrapes: &[Self]) -> Option<Self> {
        let overheads: Vec<Histogram> = scrapes.iter().map(|s| s.overhead.clone()).collect();
        let sum_of = |part: fn(&Self) -> &Option<Histogram>| {
            let parts: Option<Vec<Histogram>> = scrapes.iter().map(|s| part(s).clone()).collect();
            parts.and_then(|parts| Histogram::sum(&parts))
        };
        Some(Self {
            overhead: Histogram::sum(&overheads)?,
            journal_sync: sum_of(|s| &s.journal_sync),
            record_wait: sum_of(|s| &s.record_wait),
        })
    }
}

/// The target's histograms, from `GET /metrics` on its origin; None when it
/// has no overhead histogram (not canarygate) or cannot be reached.
pub async fn scrape(addr: SocketAddr, host: &str) -> Option<Scrape> {
    let text = crate::load::get(addr, host, "/metrics").await?;
    Scrape::parse(std::str::from_utf8(&text).ok()?)
}

/// The value of the unlabelled gauge or counter `name` in a Prometheus text
/// exposition; None when it has none.
pub fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// Overhead percentiles of one latency phase.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    pub requests: u64,
    /// Upper bounds of the buckets holding p50 and p99, µs.
    pub p50_us: f64,
    pub p99_us: f64,
    /// Journal syncs in the phase (0 without the durable audit).
    pub journal_syncs: u64,
    /// Upper bound of the bucket holding their p99, µs; NaN without any.
    pub journal_sync_p99_us: f64,
    /// Upper bound of the bucket holding the p99 of the requests' waits for
    /// their audit records, µs; NaN where canarygate does not report them.
    pub record_wait_p99_us: f64,
    /// The disk's sync under the phase's load, timed by the load generator
    /// beside it ([`crate::disk::LoadedSyncProbe`]); None without a probe.
    pub loaded_sync: Option<SyncSummary>,
}

impl Overhead {
    /// Percentiles of what was observed between two scrapes of the
    /// overhead histogram.
    pub fn between(before: &Histogram, after: &Histogram) -> Option<Self> {
        let phase = after.since(before)?;
        Some(Self {
            requests: phase.count(),
            p50_us: phase.quantile_bound_us(0.50),
            p99_us: phase.quantile_bound_us(0.99),
            journal_syncs: 0,
            journal_sync_p99_us: f64::NAN,
            record_wait_p99_us: f64::NAN,
            loaded_sync: None,
        })
    }

    /// The same, with the journal's syncs in the phase where both scrapes
    /// have them.
    pub fn of_phase(before: &Scrape, after: &Scrape) -> Option<Self> {
        let mut overhead = Self::between(&before.overhead, &after.overhead)?;
        if let (Some(before), Some(after)) = (&before.journal_sync, &after.journal_sync)
            && let Some(syncs) = after.since(before)
        {
            overhead.journal_syncs = syncs.count();
            overhead.journal_sync_p99_us = syncs.quantile_bound_us(0.99);
        }
        if let (Some(before), Some(after)) = (&before.record_wait, &after.record_wait)
            && let Some(waits) = after.since(before)
        {
            overhead.record_wait_p99_us = waits.quantile_bound_us(0.99);
        }
        Some(overhead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposition(counts: [u64; 4]) -> String {
        format!(
            "# TYPE canarygate_proxy_overhead_seconds histogram\n\
             canarygate_proxy_overhead_seconds_sum 0.5\n\
             canarygate_proxy_overhead_seconds_count {}\n\
             canarygate_proxy_overhead_seconds_bucket{{le=\"0.0001\"}} {}\n\
             canarygate_proxy_overhead_seconds_bucket{{le=\"0.001\"}} {}\n\
             canarygate_proxy_overhead_seconds_bucket{{le=\"0.01\"}} {}\n\
             canarygate_proxy_overhead_seconds_bucket{{le=\"+Inf\"}} {}\n\
             canarygate_requests_total{{route=\"chat_completions\",status=\"200\"}} 9\n",
            counts[3], counts[0], counts[1], counts[2], counts[3]
        )
    }

    #[test]
    fn a_phase_is_the_difference_of_two_scrapes() {
        let before = Histogram::parse(&exposition([5, 5, 5, 5])).unwrap();
        // The phase: 50 requests ≤ 100 µs, 49 in (100 µs, 1 ms], 1 in (1, 10] ms.
        let after = Histogram::parse(&exposition([55, 104, 105, 105])).unwrap();
        let phase = Overhead::between(&before, &after).unwrap();
        assert_eq!(phase.requests, 100);
        assert_eq!(phase.p50_us, 100.0);
        assert_eq!(phase.p99_us, 1000.0);
        let slower = Histogram::parse(&exposition([55, 103, 105, 105])).unwrap();
        assert_eq!(
            Overhead::between(&before, &slower).unwrap().p99_us,
            10_000.0
        );
    }

    #[test]
    fn a_pool_is_the_sum_of_its_instances() {
        // Instance A: 10 fast requests in the phase; instance B: 90 in
        // (100 µs, 1 ms] and 9 in (1, 10] ms, and 1 slower.
        let before = [
            Histogram::parse(&exposition([3, 3, 3, 3])).unwrap(),
            Histogram::parse(&exposition([0, 7, 7, 7])).unwrap(),
        ];
        let after = [
            Histogram::parse(&exposition([13, 13, 13, 13])).unwrap(),
            Histogram::parse(&exposition([0, 97, 106, 107])).unwrap(),
        ];
        let pool = Overhead::between(
            &Histogram::sum(&before).unwrap(),
            &Histogram::sum(&after).unwrap(),
        )
        .unwrap();
        assert_eq!(pool.requests, 110);
        // Rank 55 of 110 lies in (100 µs, 1 ms]; rank 109 in (1, 10] ms.
        assert_eq!(pool.p50_us, 1000.0);
        assert_eq!(pool.p99_us, 10_000.0);
        // One instance alone is its own sum.
        assert_eq!(Histogram::sum(&before[..1]).as_ref(), Some(&before[0]));
        assert_eq!(Histogram::sum(&[]), None);
        let other_bounds =
            Histogram::parse(&exposition([1, 1, 1, 1]).replace("0.01", "0.02")).unwrap();
        assert_eq!(Histogram::sum(&[before[0].clone(), other_bounds]), None);
    }

    #[test]
    fn quantiles_beyond_the_last_bound_are_infinite_and_empty_ones_nan() {
        let h = Histogram::parse(&exposition([0, 0, 0, 3])).unwrap();
        assert_eq!(h.quantile_bound_us(0.5), f64::INFINITY);
        let empty = Histogram::parse(&exposition([0, 0, 0, 0])).unwrap();
        assert!(empty.quantile_bound_us(0.99).is_nan());
    }

    /// A scrape holding the overhead histogram and the histogram `name`.
    fn scrape_with(name: &str, overhead: [u64; 4], other: [u64; 4]) -> Scrape {
        let other = exposition(other).replace(OVERHEAD, name);
        Scrape::parse(&format!("{}{other}", exposition(overhead))).unwrap()
    }

    #[test]
    fn the_journal_syncs_of_a_phase_come_from_the_same_scrapes() {
        let with_journal = |overhead, journal| scrape_with(JOURNAL_SYNC, overhead, journal);
        let before = with_journal([5, 5, 5, 5], [0, 4, 5, 5]);
        // The phase: 100 syncs, 98 ≤ 1 ms, 2 in (1, 10] ms.
        let after = with_journal([55, 104, 105, 105], [0, 102, 105, 105]);
        let phase = Overhead::of_phase(&before, &after).unwrap();
        assert_eq!((phase.requests, phase.p99_us), (100, 1000.0));
        assert_eq!(phase.journal_syncs, 100);
        assert_eq!(phase.journal_sync_p99_us, 10_000.0);
        // A pool sums them; a canarygate without the histogram has none.
        let pool = Scrape::sum(&[before.clone(), after.clone()]).unwrap();
        assert_eq!(pool.journal_sync.unwrap().count(), 110);
        let older = Scrape::parse(&exposition([5, 5, 5, 5])).unwrap();
        assert_eq!(older.journal_sync, None);
        assert_eq!(
            Scrape::sum(&[older.clone(), after.clone()])
                .unwrap()
                .journal_sync,
            None
        );
        let phase = Overhead::of_phase(&older, &after).unwrap();
        assert_eq!(phase.journal_syncs, 0);
        assert!(phase.journal_sync_p99_us.is_nan());
        assert!(phase.record_wait_p99_us.is_nan());
    }

    #[test]
    fn the_record_waits_of_a_phase_come_from_the_same_scrapes() {
        let with_waits = |overhead, waits| scrape_with(RECORD_WAIT, overhead, waits);
        let before = with_waits([5, 5, 5, 5], [0, 5, 5, 5]);
        // The phase: 100 waits, 99 ≤ 1 ms, 1 in (1, 10] ms; then 2 of them.
        let after = with_waits([55, 104, 105, 105], [0, 104, 105, 105]);
        let phase = Overhead::of_phase(&before, &after).unwrap();
        assert_eq!(phase.record_wait_p99_us, 1000.0);
        let slower = with_waits([55, 104, 105, 105], [0, 103, 105, 105]);
        let phase = Overhead::of_phase(&before, &slower).unwrap();
        assert_eq!(phase.record_wait_p99_us, 10_000.0);
        let pool = Scrape::sum(&[before.clone(), after]).unwrap();
        assert_eq!(pool.record_wait.unwrap().count(), 110);
    }

    #[test]
    fn gauges_are_read_by_their_whole_name() {
        let text = "# TYPE canarygate_audit_cache_bytes gauge\n\
                    canarygate_audit_cache_bytes_max 9\n\
                    canarygate_audit_cache_bytes 1048576\n";
        assert_eq!(gauge(text, "canarygate_audit_cache_bytes"), Some(1048576.0));
        assert_eq!(gauge(text, "canarygate_audit_cache"), None);
        assert_eq!(
            gauge("nginx says hello\n", "canarygate_audit_cache_bytes"),
            None
        );
    }

    #[test]
    fn other_expositions_have_no_histogram() {
        assert_eq!(Histogram::parse("nginx says hello\n"), None);
        assert_eq!(Histogram::parse(""), None);
        let without_inf = exposition([1, 2, 3, 4]).replace("+Inf", "1");
        assert_eq!(Histogram::parse(&without_inf), None);
        let other = Histogram::parse(&exposition([1, 1, 1, 1])).unwrap();
        let fewer = Histogram {
            buckets: vec![(f64::INFINITY, 1)],
        };
        assert_eq!(other.since(&fewer), None);
    }
}

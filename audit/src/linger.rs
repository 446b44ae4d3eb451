//! How long the journal writer waits, after a batch, before taking the next.
//!
//! When the journal thread runs at a raised priority (`journal_nice`,
//! [`crate::priority`]), it takes a record as soon as one arrives. Under heavy load that makes
//! many small batches, each with its own `fdatasync`: at saturation the
//! bench's whole answers cost 1.095× the CPU per request (bench/README.md,
//! "The journal thread's priority"). When a batch held more than one
//! record, records are arriving faster than the disk syncs them; the writer
//! then waits up to two syncs' time (the recent mean, at most 1 ms) before
//! it takes the next batch, so that records gather. The wait ends as soon
//! as as many records are queued as the batch held, so writers that hand
//! over their next records at once (a closed loop, where the disk is the
//! bottleneck) are not held back: without that end, 64 such writers made
//! 0.76× the appends/s (`cargo bench -p canarygate-audit --bench
//! audit_append`). A lone record is never held back, and a thread left at
//! the process's priority (`journal_nice = 0`, or not allowed) never waits:
//! its records gather while it waits for a CPU. This is group
//! commit's classic delay (PostgreSQL's `commit_delay`, which it applies
//! only while other transactions are active), sized from this disk's own
//! syncs instead of a setting.

use std::time::{Duration, Instant};

/// The wait, in mean syncs.
const SYNCS_OF_LINGER: f64 = 2.0;
/// Longest wait, whatever the disk's syncs take.
const MAX_LINGER: Duration = Duration::from_millis(1);
/// How often a wait looks at the queue.
const POLL: Duration = Duration::from_micros(100);

/// Why [`Linger::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waited {
    /// Not at all: the batch was a lone record, or no sync is known yet.
    No,
    /// Until as many records were queued as the batch held.
    Gathered,
    /// For the whole wait.
    Full,
}

/// The running estimate of a sync's duration, and the wait it gives.
#[derive(Debug)]
pub(crate) struct Linger {
    /// Whether to wait at all: only while the journal thread's priority is
    /// raised (at the process's priority, records gather while the thread
    /// waits for a CPU, as before either change).
    enabled: bool,
    /// Exponentially weighted mean of the recent syncs, µs (0: none yet).
    mean_sync_us: f64,
}

impl Linger {
    /// Weight of the newest sync in the mean.
    const WEIGHT: f64 = 1.0 / 16.0;

    /// A linger that waits when `enabled`.
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            mean_sync_us: 0.0,
        }
    }

    /// Takes in one batch's write and sync time.
    pub(crate) fn observe_sync(&mut self, took: Duration) {
        let us = took.as_secs_f64() * 1e6;
        self.mean_sync_us = if self.mean_sync_us == 0.0 {
            us
        } else {
            self.mean_sync_us + Self::WEIGHT * (us - self.mean_sync_us)
        };
    }

    /// The longest wait before the next batch, after one that journaled
    /// `records`.
    pub(crate) fn after_batch(&self, records: usize) -> Duration {
        if !self.enabled || records < 2 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(SYNCS_OF_LINGER * self.mean_sync_us / 1e6).min(MAX_LINGER)
    }

    /// Waits, after a batch that journaled `records`, until `queued()` (the
    /// records waiting now) reaches `records` or [`Self::after_batch`] has
    /// passed.
    pub(crate) fn wait(&self, records: usize, queued: impl Fn() -> usize) -> Waited {
        Self::wait_up_to(self.after_batch(records), records, queued)
    }

    /// Waits until `queued()` reaches `records` or `wait` has passed.
    fn wait_up_to(wait: Duration, records: usize, queued: impl Fn() -> usize) -> Waited {
        if wait.is_zero() {
            return Waited::No;
        }
        let until = Instant::now() + wait;
        loop {
            if queued() >= records {
                return Waited::Gathered;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Waited::Full;
            }
            std::thread::sleep(left.min(POLL));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_lone_record_and_a_log_without_syncs_are_never_held_back() {
        let mut linger = Linger::new(true);
        assert_eq!(linger.after_batch(5), Duration::ZERO, "no sync yet");
        linger.observe_sync(us(300));
        assert_eq!(linger.after_batch(0), Duration::ZERO);
        assert_eq!(linger.after_batch(1), Duration::ZERO);
        assert_eq!(linger.after_batch(2), us(600));
        assert_eq!(linger.wait(1, || 0), Waited::No);

        let mut disabled = Linger::new(false);
        disabled.observe_sync(us(300));
        assert_eq!(disabled.after_batch(10), Duration::ZERO);
        assert_eq!(disabled.wait(10, || 0), Waited::No);
    }

    #[test]
    fn the_wait_follows_the_recent_syncs_and_is_capped() {
        let mut linger = Linger::new(true);
        linger.observe_sync(us(200));
        // One slow sync moves the mean by a sixteenth of the difference.
        linger.observe_sync(us(1_800));
        assert_eq!(linger.after_batch(3), us(600));
        for _ in 0..200 {
            linger.observe_sync(us(50));
        }
        let settled = linger.after_batch(3);
        assert!(settled >= us(100) && settled < us(102), "{settled:?}");
        for _ in 0..200 {
            linger.observe_sync(Duration::from_millis(20));
        }
        assert_eq!(linger.after_batch(3), MAX_LINGER);
    }

    #[test]
    fn a_wait_ends_once_as_many_operations_as_the_batch_are_queued() {
        let mut linger = Linger::new(true);
        linger.observe_sync(Duration::from_millis(5));
        let looks = std::cell::Cell::new(0);
        let already = || {
            looks.set(looks.get() + 1);
            4
        };
        assert_eq!(linger.wait(4, already), Waited::Gathered);
        assert_eq!(looks.get(), 1, "no sleep when they are there already");

        // Records arriving one per look. The wait is long here so that a
        // loaded machine's oversleeping (four 100 µs sleeps can take more
        // than the 1 ms cap) cannot end it first.
        looks.set(0);
        let arriving = || {
            looks.set(looks.get() + 1);
            looks.get()
        };
        let long = Duration::from_secs(60);
        assert_eq!(Linger::wait_up_to(long, 5, arriving), Waited::Gathered);
        assert_eq!(looks.get(), 5);

        let started = Instant::now();
        assert_eq!(linger.wait(3, || 2), Waited::Full);
        assert!(started.elapsed() >= MAX_LINGER);
    }
}

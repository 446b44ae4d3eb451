//! The disk's sync latency: the floor under a durable answer.
//!
//! canarygate's durable audit answers only once the request's record is
//! synced to disk, so its own p99 cannot beat the p99 of one small write and
//! `fdatasync` on the disk that holds its data directory. Two measures:
//!
//! - [`sync_latencies_us`]: back to back on an idle machine (a 4 KiB block
//!   appended to a file, then synced), before a round's phases;
//! - [`LoadedSyncProbe`]: during a latency phase, at random moments, a
//!   4 KiB block written over a zero-filled file (as the journal writes its
//!   preallocated segments) and synced: what a durable write costs on that
//!   disk under the phase's load, CPU contention included, without any of
//!   canarygate's queueing.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes of each probe write (one page, a small batch of audit records).
pub const PROBE_BYTES: usize = 4096;

/// `samples` latencies, in µs, of a [`PROBE_BYTES`] append followed by
/// `fdatasync`, on a fresh file in `dir` (removed afterwards).
pub fn sync_latencies_us(dir: &Path, samples: usize) -> std::io::Result<Vec<f64>> {
    let path = dir.join(format!("fsync-probe-{}", std::process::id()));
    let mut file = std::fs::File::create(&path)?;
    let block = [0x5a_u8; PROBE_BYTES];
    let measured = (0..samples)
        .map(|_| {
            let started = Instant::now();
            file.write_all(&block)?;
            file.sync_data()?;
            Ok(started.elapsed().as_secs_f64() * 1e6)
        })
        .collect();
    drop(file);
    std::fs::remove_file(&path)?;
    measured
}

/// Sync latencies summed up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncSummary {
    /// Syncs timed.
    pub samples: usize,
    /// Their p50 and p99, µs.
    pub p50_us: f64,
    pub p99_us: f64,
}

impl SyncSummary {
    /// The summary of `latencies_us`, in any order; None when empty.
    pub fn of(mut latencies_us: Vec<f64>) -> Option<Self> {
        if latencies_us.is_empty() {
            return None;
        }
        latencies_us.sort_by(f64::total_cmp);
        Some(Self {
            samples: latencies_us.len(),
            p50_us: crate::load::percentile(&latencies_us, 0.5),
            p99_us: crate::load::percentile(&latencies_us, 0.99),
        })
    }
}

/// Size of the zero-filled file a [`LoadedSyncProbe`] writes over, cycling.
const LOADED_PROBE_FILE_BYTES: u64 = 8 << 20;

/// Syncs timed on a thread of their own while a latency phase runs.
pub struct LoadedSyncProbe {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<std::io::Result<Vec<f64>>>,
}

impl LoadedSyncProbe {
    /// Zero-fills a probe file in `dir` (synced, before returning) and starts
    /// timing [`PROBE_BYTES`] writes + `fdatasync` there, `rate` per second
    /// on average, at exponentially distributed intervals (a Poisson
    /// process, like independent arrivals).
    pub fn start(dir: &Path, rate: f64) -> std::io::Result<Self> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(std::io::Error::other(format!(
                "probe rate {rate} is not positive"
            )));
        }
        let path = dir.join(format!("fsync-probe-loaded-{}", std::process::id()));
        let mut file = std::fs::File::create(&path)?;
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..LOADED_PROBE_FILE_BYTES / zeros.len() as u64 {
            file.write_all(&zeros)?;
        }
        file.sync_all()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("sync-probe".into())
            .spawn(move || probe_until(file, path, rate, &stopped))?;
        Ok(Self { stop, thread })
    }

    /// Stops the probe; the latencies it measured, in µs, in order. The
    /// probe file is removed.
    pub fn finish(self) -> std::io::Result<Vec<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| std::io::Error::other("the sync probe panicked"))?
    }
}

fn probe_until(
    mut file: std::fs::File,
    path: PathBuf,
    rate: f64,
    stop: &AtomicBool,
) -> std::io::Result<Vec<f64>> {
    let block = [0x5a_u8; PROBE_BYTES];
    let mut random = Xorshift::seeded();
    let mut offset = 0u64;
    let mut measured = Vec::new();
    let result = loop {
        // The wait is cut in short sleeps so that `finish` is never held
        // up by more than one of them.
        let mut wait = Duration::from_secs_f64(random.exponential(rate));
        while !wait.is_zero() && !stop.load(Ordering::Relaxed) {
            let step = wait.min(Duration::from_millis(20));
            std::thread::sleep(step);
            wait -= step;
        }
        if stop.load(Ordering::Relaxed) {
            break Ok(measured);
        }
        let started = Instant::now();
        let synced = file
            .seek(SeekFrom::Start(offset))
            .and_then(|_| file.write_all(&block))
            .and_then(|()| file.sync_data());
        if let Err(error) = synced {
            break Err(error);
        }
        measured.push(started.elapsed().as_secs_f64() * 1e6);
        offset = (offset + PROBE_BYTES as u64) % LOADED_PROBE_FILE_BYTES;
    };
    drop(file);
    std::fs::remove_file(&path)?;
    result
}

/// A small xorshift generator: the probe's timing needs no more than
/// uncorrelated intervals.
struct Xorshift(u64);

impl Xorshift {
    fn seeded() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        Self(nanos | 1)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// An exponentially distributed interval, seconds, of mean `1 / rate`.
    fn exponential(&mut self, rate: f64) -> f64 {
        -self.unit().ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_measure_each_sync_and_leave_no_file() {
        let dir = std::env::temp_dir().join(format!("canarygate-disk-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let latencies = sync_latencies_us(&dir, 5).unwrap();
        assert_eq!(latencies.len(), 5);
        assert!(latencies.iter().all(|us| us.is_finite() && *us > 0.0));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_loaded_probe_times_syncs_until_finished_and_leaves_no_file() {
        let dir =
            std::env::temp_dir().join(format!("canarygate-disk-loaded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let probe = LoadedSyncProbe::start(&dir, 200.0).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let asked = Instant::now();
        let latencies = probe.finish().unwrap();
        assert!(asked.elapsed() < Duration::from_secs(2), "finish is prompt");
        // 60 expected; far fewer would mean the intervals are wrong.
        assert!(latencies.len() >= 10, "{}", latencies.len());
        assert!(latencies.iter().all(|us| us.is_finite() && *us > 0.0));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir(&dir).unwrap();
        assert!(LoadedSyncProbe::start(&dir, 0.0).is_err());
    }

    #[test]
    fn a_summary_takes_percentiles_of_the_sorted_latencies() {
        assert_eq!(SyncSummary::of(Vec::new()), None);
        let latencies: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let summary = SyncSummary::of(latencies).unwrap();
        assert_eq!(summary.samples, 100);
        assert_eq!((summary.p50_us, summary.p99_us), (50.0, 99.0));
    }

    #[test]
    fn probe_intervals_are_exponential_with_the_asked_mean() {
        let mut random = Xorshift(0x9e37_79b9_7f4a_7c15);
        let n = 100_000;
        let intervals: Vec<f64> = (0..n).map(|_| random.exponential(200.0)).collect();
        let mean = intervals.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.005).abs() < 0.000_1, "{mean}");
        // An exponential's median is ln 2 times its mean.
        let mut sorted = intervals;
        sorted.sort_by(f64::total_cmp);
        let median = sorted[n / 2];
        assert!(
            (median / 0.005 - std::f64::consts::LN_2).abs() < 0.02,
            "{median}"
        );
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = std::env::temp_dir().join("canarygate-disk-test-missing/nested");
        assert!(sync_latencies_us(&dir, 1).is_err());
    }
}

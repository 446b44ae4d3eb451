//! The disk's sync latency: the floor under a durable answer.
//!
//! canarygate's durable audit answers only once the request's record is
//! synced to disk, so its own p99 cannot beat the p99 of one small write and
//! `fdatasync` on the disk that holds its data directory. [`sync_latencies_us`]
//! measures that, the way the journal writes: a 4 KiB block appended to a
//! file, then synced.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

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
    fn a_missing_directory_is_an_error() {
        let dir = std::env::temp_dir().join("canarygate-disk-test-missing/nested");
        assert!(sync_latencies_us(&dir, 1).is_err());
    }
}

//! Resident memory of process trees, from `/proc`, and how fast it grows.
//!
//! Resident set size (RSS) is read from `VmRSS` in `/proc/PID/status`: the
//! pages of the process in RAM, its share of shared libraries included. A
//! tree's RSS is the sum over its live processes (nginx's master and
//! workers), so pages the workers share are counted once per worker; the
//! differences the growth bench reports (with streams open against without,
//! after a run against before) are what grows, which is private memory.

use crate::procstat;

/// `VmRSS` of the text of a `/proc/PID/status`, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut fields = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

/// RSS of one process in bytes (None when it is gone or has no memory, as
/// a zombie).
pub fn rss(pid: u32) -> Option<u64> {
    parse_vm_rss(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// RSS of the trees rooted at `roots` together, each process once, bytes.
pub fn trees_rss(roots: &[u32]) -> u64 {
    procstat::trees_pids(roots)
        .into_iter()
        .filter_map(rss)
        .sum()
}

/// Open file descriptors of the trees rooted at `roots` together (sockets
/// included): how many connections a proxy still holds.
pub fn trees_open_files(roots: &[u32]) -> usize {
    procstat::trees_pids(roots)
        .into_iter()
        .filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/fd")).ok())
        .map(|entries| entries.count())
        .sum()
}

/// Least-squares slope of `(seconds, bytes)` samples, in bytes per minute;
/// None with fewer than two distinct times.
pub fn slope_per_minute(samples: &[(f64, f64)]) -> Option<f64> {
    let n = samples.len() as f64;
    if samples.len() < 2 {
        return None;
    }
    let mean_t = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let mean_v = samples.iter().map(|s| s.1).sum::<f64>() / n;
    let (mut covariance, mut variance) = (0.0, 0.0);
    for &(t, v) in samples {
        covariance += (t - mean_t) * (v - mean_v);
        variance += (t - mean_t) * (t - mean_t);
    }
    (variance > 0.0).then(|| covariance / variance * 60.0)
}

/// The median of `values` (NaN when empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tnginx\nVmPeak:\t  20000 kB\nVmRSS:\t    1234 kB\nRssAnon:\t 100 kB\n";
        assert_eq!(parse_vm_rss(status), Some(1234 * 1024));
        // Kernel threads and zombies have no VmRSS line.
        assert_eq!(parse_vm_rss("Name:\tkthreadd\nState:\tS\n"), None);
        assert_eq!(parse_vm_rss("VmRSS:\t12 MB\n"), None);
        assert_eq!(parse_vm_rss("VmRSS:\tlots kB\n"), None);
    }

    #[test]
    fn own_rss_is_read_and_trees_sum() {
        let me = std::process::id();
        let own = rss(me).unwrap();
        assert!(own > 1 << 20, "{own}");
        // A tree with a root listed twice counts it once; gone pids count nothing.
        let tree = trees_rss(&[me, me, u32::MAX]);
        assert!(tree >= own / 2 && tree < own * 2, "{tree} against {own}");
        assert_eq!(rss(u32::MAX), None);
        assert_eq!(trees_rss(&[]), 0);
        // stdin, stdout, stderr at least.
        assert!(trees_open_files(&[me]) >= 3);
        assert_eq!(trees_open_files(&[u32::MAX]), 0);
    }

    #[test]
    fn slopes_are_per_minute() {
        // 1 MiB per 30 s: 2 MiB per minute, whatever the intercept.
        let growing: Vec<(f64, f64)> = (0..10)
            .map(|i| (i as f64 * 30.0, 5e8 + i as f64 * 1048576.0))
            .collect();
        let slope = slope_per_minute(&growing).unwrap();
        assert!((slope - 2.0 * 1048576.0).abs() < 1e-3, "{slope}");
        // Flat with noise around a level: close to 0.
        let flat: Vec<(f64, f64)> = (0..20)
            .map(|i| {
                (
                    i as f64 * 5.0,
                    1e8 + if i % 2 == 0 { 4096.0 } else { -4096.0 },
                )
            })
            .collect();
        assert!(slope_per_minute(&flat).unwrap().abs() < 1000.0);
        assert_eq!(slope_per_minute(&[(1.0, 5.0)]), None);
        assert_eq!(slope_per_minute(&[(1.0, 5.0), (1.0, 7.0)]), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, f64::NAN, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
        assert!(median(vec![f64::NAN]).is_nan());
    }
}

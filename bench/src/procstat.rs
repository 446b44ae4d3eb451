//! CPU time of a process tree, from `/proc`.

use std::collections::HashMap;
use std::time::Duration;

/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK`).
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// Parent pid and utime + stime (in ticks) of the text of a `/proc/PID/stat`.
fn parse_stat(text: &str) -> Option<(u32, u64)> {
    // Fields after the parenthesised command name (which may hold spaces and
    // parentheses): state (3), ppid (4), ..., utime (14), stime (15).
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

/// CPU time (user + system, all threads) this process has used so far.
pub fn self_cpu() -> Duration {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|text| parse_stat(&text))
        .map_or(Duration::ZERO, |(_, ticks)| ticks_to_duration(ticks))
}

/// Every live process: children by parent pid, and CPU ticks by pid.
fn scan() -> (HashMap<u32, Vec<u32>>, HashMap<u32, u64>) {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut ticks: HashMap<u32, u64> = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (children, ticks);
    };
    for entry in entries.flatten() {
        let Some(id) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((ppid, t)) = parse_stat(&text) {
            children.entry(ppid).or_default().push(id);
            ticks.insert(id, t);
        }
    }
    (children, ticks)
}

/// The live processes of the trees rooted at `roots`, with their CPU ticks;
/// each process once, even when one root lies in another's tree.
fn trees(roots: &[u32]) -> Vec<(u32, u64)> {
    let (children, ticks) = scan();
    walk(roots, &children, &ticks)
}

/// The processes of `roots`' trees in a scan (see [`trees`]).
fn walk(
    roots: &[u32],
    children: &HashMap<u32, Vec<u32>>,
    ticks: &HashMap<u32, u64>,
) -> Vec<(u32, u64)> {
    let mut seen = std::collections::HashSet::new();
    let mut found = Vec::new();
    let mut pending = roots.to_vec();
    while let Some(id) = pending.pop() {
        if !seen.insert(id) {
            continue;
        }
        if let Some(t) = ticks.get(&id) {
            found.push((id, *t));
        }
        if let Some(kids) = children.get(&id) {
            pending.extend(kids);
        }
    }
    found
}

/// CPU time (user + system) used so far by `pid` and every live descendant
/// (nginx workers, uvicorn workers, ...). Time of descendants that already
/// exited is not counted.
pub fn tree_cpu(pid: u32) -> Duration {
    trees_cpu(&[pid])
}

/// [`tree_cpu`] of several processes together (the instances of a pool and
/// the server they share), from one scan of `/proc`.
pub fn trees_cpu(roots: &[u32]) -> Duration {
    ticks_to_duration(trees(roots).iter().map(|(_, t)| t).sum())
}

/// The live processes of the trees of `roots`, each once.
pub fn trees_pids(roots: &[u32]) -> Vec<u32> {
    trees(roots).into_iter().map(|(pid, _)| pid).collect()
}

/// Number of live processes in the trees of `roots` (0 when all are gone).
pub fn trees_size(roots: &[u32]) -> usize {
    trees(roots).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_command_names() {
        let text = "1234 (nginx: worker (x) 1) S 1200 1234 1234 0 -1 4194624 100 0 0 0 \
                    250 40 0 0 20 0 1 0 100 1000 10";
        assert_eq!(parse_stat(text), Some((1200, 290)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn own_tree_is_counted() {
        let pid = std::process::id();
        assert!(trees_size(&[pid]) >= 1);
        // Burn a little CPU so the counter moves past zero.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(31).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(tree_cpu(pid) >= self_cpu().saturating_sub(Duration::from_millis(20)));
    }

    #[test]
    fn overlapping_trees_count_once() {
        // 1 ─┬─ 2 ── 4
        //    └─ 3
        // 9 (alone)
        let children = HashMap::from([(1, vec![2, 3]), (2, vec![4])]);
        let ticks = HashMap::from([(1, 10), (2, 20), (3, 30), (4, 40), (9, 90)]);
        let total =
            |roots: &[u32]| -> u64 { walk(roots, &children, &ticks).iter().map(|p| p.1).sum() };
        assert_eq!(total(&[1]), 100);
        // A root inside another root's tree, or listed twice, counts once.
        assert_eq!(total(&[1, 2]), 100);
        assert_eq!(total(&[2, 2]), 60);
        assert_eq!(total(&[2, 9]), 150);
        // Processes that are gone count nothing.
        assert_eq!(total(&[7]), 0);
        assert_eq!(total(&[]), 0);
    }

    #[test]
    fn several_live_trees_are_read_together() {
        let me = std::process::id();
        assert!(trees_size(&[me, u32::MAX]) >= 1);
        assert_eq!(trees_size(&[u32::MAX]), 0);
        assert_eq!(trees_cpu(&[]), Duration::ZERO);
    }
}

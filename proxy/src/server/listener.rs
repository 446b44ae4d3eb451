//! The accept loop: at most `limits.max_connections` client connections,
//! each served by [`connection::serve`], and a graceful shutdown that lets
//! the requests in flight finish.
//!
//! At the cap, a new connection takes the place of the one idle the
//! longest (no request on it: between requests, or not done sending its
//! first head), as nginx reuses keep-alive connections when it runs out;
//! a connection with a request in flight is never closed for another.
//! When every connection has one, the listener stops accepting and new
//! connections wait in the kernel's listen queue until one closes or goes
//! idle.
//!
//! [`open_file_budget`] raises the soft open-file limit to the hard one and
//! fits the cap below it.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use canarygate_policies::config::{DEFAULT_MAX_CONNECTIONS, Limits};
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use super::connection::{self, Activity, Shared};
use crate::metrics::Metrics;

/// How long to wait before accepting again after an accept error other
/// than a connection reset (such as running out of file descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// How long an evicted connection may take to close before the listener
/// looks for another one to evict.
const EVICTION_WAIT: Duration = Duration::from_secs(2);

/// How often an accept error is logged at most.
const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// File descriptors kept for everything but client and provider
/// connections: the listener, the runtime's epoll and wakers, stdio, the
/// audit store and secret, probe results, the local engine's files.
pub const RESERVED_FILES: u64 = 64;

/// Fewest client connections `serve` starts with when it lowers the default
/// to fit the open-file limit.
const MIN_CONNECTIONS: u64 = 16;

/// The process's open-file limit, as found and as raised at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// The soft limit found at start.
    pub soft_before: u64,
    /// The soft limit now: the hard limit when raising it worked.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (or, where the hard
/// limit is unlimited, as far as the kernel allows) and returns both. The
/// limit left as it was when raising fails.
pub fn raise_open_file_limit() -> io::Result<OpenFiles> {
    let (soft, hard) = rlimit::Resource::NOFILE.get()?;
    let mut raised = OpenFiles {
        soft_before: soft,
        soft,
        hard,
    };
    // Linux refuses "unlimited" for open files (the ceiling is
    // fs.nr_open, 1,048,576 by default): try the hard limit, then that.
    // `increase_nofile_limit` also keeps under macOS's per-process ceiling
    // (kern.maxfilesperproc), which its "unlimited" hard limit hides.
    for target in [hard, hard.min(1 << 20)] {
        if target <= raised.soft {
            break;
        }
        if let Ok(soft) = rlimit::increase_nofile_limit(target) {
            raised.soft = soft;
            break;
        }
    }
    Ok(raised)
}

/// The connection cap for `limits` under `soft_limit` open files. Every
/// request in flight may hold a provider connection as well as its client
/// connection, so `max_connections + max_concurrent_requests +
/// RESERVED_FILES` should fit. A `max_connections` the policy sets is
/// refused when it does not; the default is lowered to fit, and when even
/// the concurrency does not fit (1,024 files and the default 1,024
/// requests) it takes half of the files left, so that `serve` still starts
/// on a small limit (the caller warns: requests beyond the other half may
/// fail to reach the provider).
pub fn open_file_budget(limits: &Limits, soft_limit: u64) -> Result<usize, String> {
    let others = limits.max_concurrent_requests as u64 + RESERVED_FILES;
    let room = soft_limit.saturating_sub(others);
    let explain = || {
        format!(
            "the open-file limit is {soft_limit}, and limits.max_concurrent_requests = {} \
             (each may hold a provider connection) plus {RESERVED_FILES} other files leave \
             room for {room} client connections; raise the limit (`ulimit -n`, systemd's \
             LimitNOFILE) or lower limits.max_concurrent_requests",
            limits.max_concurrent_requests
        )
    };
    match limits.max_connections {
        Some(max) if max as u64 > room => Err(format!(
            "limits.max_connections = {max} does not fit: {}, or lower limits.max_connections",
            explain()
        )),
        Some(max) => Ok(max),
        None if room < MIN_CONNECTIONS => {
            let half = soft_limit.saturating_sub(RESERVED_FILES) / 2;
            if half < MIN_CONNECTIONS {
                return Err(explain());
            }
            Ok(usize::try_from(half).unwrap_or(usize::MAX))
        }
        None => Ok(usize::try_from(room)
            .unwrap_or(usize::MAX)
            .min(DEFAULT_MAX_CONNECTIONS)),
    }
}

/// The open client connections, and the cap on them.
struct OpenConnections {
    places: Arc<Semaphore>,
    open: Mutex<HashMap<u64, Arc<Activity>>>,
    next_id: AtomicU64,
    /// Notified when some connection has no request left.
    went_idle: Arc<Notify>,
}

/// One connection's place: frees it when dropped.
struct Place {
    id: u64,
    open: Arc<OpenConnections>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Ok(mut open) = self.open.open.lock() {
            open.remove(&self.id);
        }
    }
}

impl OpenConnections {
    fn new(max: usize) -> Self {
        Self {
            places: Arc::new(Semaphore::new(max)),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            went_idle: Arc::new(Notify::new()),
        }
    }

    /// A free place, making one by evicting the connection idle the longest
    /// when there is none; waits while every connection has a request.
    async fn place(&self) -> OwnedSemaphorePermit {
        loop {
            if let Ok(permit) = Arc::clone(&self.places).try_acquire_owned() {
                return permit;
            }
            let went_idle = self.went_idle.notified();
            tokio::pin!(went_idle);
            went_idle.as_mut().enable();
            let evicted = self.evict_longest_idle();
            tokio::select! {
                permit = Arc::clone(&self.places).acquire_owned() => {
                    return permit.expect("the semaphore is never closed");
                }
                () = &mut went_idle, if !evicted => {}
                () = tokio::time::sleep(EVICTION_WAIT), if evicted => {}
            }
        }
    }

    /// Asks the connection without a request for the longest time to close.
    fn evict_longest_idle(&self) -> bool {
        let Ok(open) = self.open.lock() else {
            return false;
        };
        open.values()
            .filter_map(|activity| Some((activity.idle_since()?, activity)))
            .min_by_key(|(since, _)| *since)
            .is_some_and(|(_, activity)| activity.evict())
    }

    fn admit(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> (Arc<Activity>, Place) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(Activity::new(Arc::clone(&self.went_idle)));
        if let Ok(mut open) = self.open.lock() {
            open.insert(id, Arc::clone(&activity));
        }
        let place = Place {
            id,
            open: Arc::clone(self),
            _permit: permit,
        };
        (activity, place)
    }
}

/// Accepts and serves connections until `shutdown` resolves, then waits for
/// every connection to finish its requests and close.
pub async fn serve(
    listener: TcpListener,
    shared: Shared,
    max_connections: usize,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let shared = Arc::new(shared);
    let connections = Arc::new(OpenConnections::new(max_connections));
    let (stop, stopping) = watch::channel(());
    let mut last_error_logged: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    if !is_connection_error(&error) {
                        if last_error_logged
                            .is_none_or(|at| at.elapsed() >= ACCEPT_ERROR_LOG_INTERVAL)
                        {
                            last_error_logged = Some(Instant::now());
                            tracing::warn!("accepting a client connection: {error}");
                        }
                        if matches!(error.raw_os_error(), Some(EMFILE | ENFILE)) {
                            connections.evict_longest_idle();
                        }
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                    continue;
                }
            },
        };
        // Accepted first, placed second: at the cap, an idle connection is
        // evicted only for a client that is really there. Meanwhile the
        // next ones wait in the listen queue.
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = connections.place() => permit,
        };
        // No Nagle: a streamed token must leave at once, not wait for an ACK.
        let _ = stream.set_nodelay(true);
        let (activity, place) = connections.admit(permit);
        let gauge = metrics.open_client_connection();
        let shared = Arc::clone(&shared);
        let stopping = stopping.clone();
        tokio::spawn(async move {
            connection::serve(stream, activity, shared, stopping).await;
            // The gauge first: once the place is free, the listener (on
            // another thread) may admit the next connection and count it,
            // and the gauge must never read above `max_connections`.
            drop(gauge);
            drop(place);
        });
    }
    drop(listener);
    let _ = stop.send(());
    drop(stopping);
    stop.closed().await;
    Ok(())
}

/// `EMFILE` and `ENFILE`: the process or the system is out of file
/// descriptors.
const EMFILE: i32 = 24;
const ENFILE: i32 = 23;

/// Errors of one connection (it was reset before it was accepted): accept
/// the next at once.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: Option<usize>, max_concurrent_requests: usize) -> Limits {
        Limits {
            max_connections,
            max_concurrent_requests,
            ..Limits::default()
        }
    }

    #[test]
    fn the_connection_cap_fits_the_open_file_limit() {
        // Plenty of files: the default, or what the policy asks.
        assert_eq!(
            open_file_budget(&limits(None, 1024), 1 << 20),
            Ok(DEFAULT_MAX_CONNECTIONS)
        );
        assert_eq!(
            open_file_budget(&limits(Some(50_000), 1024), 1 << 20),
            Ok(50_000)
        );
        // 1,024 files: the default shrinks, an explicit cap is refused.
        assert_eq!(
            open_file_budget(&limits(None, 256), 1024),
            Ok(1024 - 256 - RESERVED_FILES as usize)
        );
        let refused = open_file_budget(&limits(Some(1000), 256), 1024).unwrap_err();
        assert!(
            refused.contains("limits.max_connections = 1000 does not fit")
                && refused.contains("the open-file limit is 1024"),
            "{refused}"
        );
        // The default concurrency does not fit 1,024 files: half of what is
        // left goes to client connections, so serve still starts.
        assert_eq!(
            open_file_budget(&limits(None, 1024), 1024),
            Ok((1024 - RESERVED_FILES as usize) / 2)
        );
        // Too few files for even that: refused, saying what to change.
        let refused = open_file_budget(&limits(None, 1024), 64 + 2 * 15).unwrap_err();
        assert!(
            refused.contains("lower limits.max_concurrent_requests"),
            "{refused}"
        );
    }

    #[test]
    fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
        let files = raise_open_file_limit().unwrap();
        assert!(files.soft >= files.soft_before);
        let (soft, hard) = rlimit::Resource::NOFILE.get().unwrap();
        assert_eq!((soft, hard), (files.soft, files.hard));
        assert!(
            soft == hard || hard == rlimit::INFINITY,
            "soft {soft}, hard {hard}"
        );
    }

    #[tokio::test]
    async fn at_the_cap_the_longest_idle_connection_makes_room() {
        let connections = Arc::new(OpenConnections::new(2));
        let (older, _older_place) = connections.admit(connections.place().await);
        tokio::time::sleep(Duration::from_millis(5)).await;
        let (newer, _newer_place) = connections.admit(connections.place().await);
        assert!(Arc::clone(&connections.places).try_acquire_owned().is_err());
        assert!(connections.evict_longest_idle());
        assert!(older.idle_since().is_none(), "the older one is evicted");
        assert!(newer.idle_since().is_some(), "the newer one is kept");
        assert!(connections.evict_longest_idle());
        assert!(!connections.evict_longest_idle(), "nothing left to evict");
    }
}

//! The journal writer's scheduling priority.
//!
//! Every durable answer waits for the journal thread twice: for it to wake
//! and take the record, and for it to wake again when the disk has synced.
//! On a host whose CPUs are busy (the jobs canarygate serves run beside it),
//! each wakeup can wait milliseconds behind other runnable threads, and a
//! record that arrives during a late sync waits for that one too. A lower
//! nice value gives the thread a larger share and an earlier deadline under
//! Linux's fair scheduler, so it runs soon after it is woken. On the bench
//! host (whole answers at 2,500/s, nice −10), a record's wait for the
//! journal fell by a third at the median and a quarter or more at p99, with
//! [`crate::linger`] keeping the thread from trading that for many small
//! batches. The answers' own p99 did not follow and whole answers' throughput
//! at saturation fell 5–8 %, so it is off unless asked for
//! (`AuditOptions::journal_nice`; bench/README.md, "The journal thread's
//! priority").
//!
//! Linux keeps a nice value per thread (setpriority(2), "BUGS": the POSIX
//! per-process value is per thread under NPTL), so this changes the journal
//! thread alone. Going below the process's own value needs `CAP_SYS_NICE`
//! or an `RLIMIT_NICE` that allows it; without either the thread keeps the
//! process's priority and [`JournalPriority::Refused`] says why.

/// How the journal writer's priority came out ([`crate::AuditLog::journal_priority`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalPriority {
    /// Left at the process's priority (`journal_nice = 0`).
    Unchanged,
    /// Raised: the thread's nice value now.
    Raised {
        /// Nice value of the journal thread (the process's plus the asked change).
        nice: i32,
    },
    /// Asked for and not granted: the thread runs at the process's
    /// priority. The reason, as the OS gave it.
    Refused(String),
}

/// Moves the calling thread's nice value by `change` (−20..=0; 0 leaves it).
pub(crate) fn raise_current_thread(change: i32) -> JournalPriority {
    if change == 0 {
        return JournalPriority::Unchanged;
    }
    imp::raise_current_thread(change)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::JournalPriority;

    pub(super) fn raise_current_thread(change: i32) -> JournalPriority {
        // SAFETY: gettid has no preconditions and cannot fail.
        let tid = unsafe { libc::gettid() };
        let Ok(who) = libc::id_t::try_from(tid) else {
            return JournalPriority::Refused(format!("thread id {tid} out of range"));
        };
        // getpriority may return -1 as a value: errno tells an error apart.
        // SAFETY: errno is thread-local; getpriority only reads.
        let current = unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, who)
        };
        if current == -1 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() != Some(0) {
                return JournalPriority::Refused(error.to_string());
            }
        }
        let nice = (current + change).clamp(-20, 19);
        // SAFETY: changes this thread's scheduling only.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, who, nice) } == 0 {
            JournalPriority::Raised { nice }
        } else {
            JournalPriority::Refused(std::io::Error::last_os_error().to_string())
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::JournalPriority;

    pub(super) fn raise_current_thread(_change: i32) -> JournalPriority {
        JournalPriority::Refused("a thread's own priority is set on Linux only".into())
    }
}

//! Test builds only: the global allocator counts, per thread, the
//! allocations and reallocations made and the bytes they asked for, so a
//! test can hold a hot path to an allocation budget ([`on_this_thread`]).
//! Memory itself comes from the system allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ops::Sub;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

/// What a thread allocated: allocations and reallocations, and the bytes
/// they asked for (a reallocation counts its whole new size).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// Allocations and reallocations.
    pub count: u64,
    /// Bytes asked for.
    pub bytes: u64,
}

impl Sub for Allocated {
    type Output = Allocated;

    fn sub(self, earlier: Allocated) -> Allocated {
        Allocated {
            count: self.count - earlier.count,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

/// What a run of events allocated, against the bytes they forwarded.
#[derive(Debug, Default)]
pub struct Tally {
    events: u64,
    allocated: Allocated,
    forwarded: u64,
}

impl Tally {
    /// Counts one event that allocated `spent` and forwarded `forwarded`
    /// bytes.
    pub fn add(&mut self, spent: Allocated, forwarded: usize) {
        self.events += 1;
        self.allocated.count += spent.count;
        self.allocated.bytes += spent.bytes;
        self.forwarded += forwarded as u64;
    }

    /// Allocations per event.
    pub fn count_per_event(&self) -> f64 {
        self.allocated.count as f64 / self.events.max(1) as f64
    }

    /// Bytes allocated, over bytes forwarded.
    pub fn bytes_per_forwarded(&self) -> f64 {
        self.allocated.bytes as f64 / self.forwarded.max(1) as f64
    }

    /// One line for the test's output (`--nocapture`), as bench/README.md
    /// quotes it.
    pub fn report(&self, what: &str) -> String {
        format!(
            "{what}: {:.3} allocations and {:.0} bytes per event, {:.0} bytes forwarded per event ({:.2}x)",
            self.count_per_event(),
            self.allocated.bytes as f64 / self.events.max(1) as f64,
            self.forwarded as f64 / self.events.max(1) as f64,
            self.bytes_per_forwarded(),
        )
    }
}

/// What the calling thread allocated so far.
pub fn on_this_thread() -> Allocated {
    Allocated {
        count: COUNT.with(Cell::get),
        bytes: BYTES.with(Cell::get),
    }
}

fn count(size: usize) {
    // `const` thread-locals without destructors: always accessible.
    COUNT.with(|count| count.set(count.get() + 1));
    BYTES.with(|bytes| bytes.set(bytes.get() + size as u64));
}

struct Counting;

// SAFETY: every call is passed on to `System` unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

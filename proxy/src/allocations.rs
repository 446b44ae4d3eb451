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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

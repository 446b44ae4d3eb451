//! Paged KV pool with page provenance.
//!
//! Per layer, K and V live in one tensor each of logical shape
//! `[pages, page_size, kv_heads, head_dim]`, stored flattened as `[pages * page_size,
//! kv_heads * head_dim]` so that a position's row (its *slot*) is `page * page_size + offset`.
//!
//! Every page records its owner (request id + generation) and how many of its positions were
//! written. Reads go through [`KvPool::read_slots`], which checks that every position read was
//! written by the reader itself; freed pages lose their owner (and, in debug builds, are filled
//! with NaN so that any stray read poisons the logits).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use crate::EngineError;

/// Who may read and write a page: one attempt (generation) of one request. A request that is
/// preempted and recomputed gets a new generation, so pages of the earlier attempt are foreign.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    /// Request id, unique per engine.
    pub request: u64,
    /// Attempt number of that request.
    pub generation: u32,
}

/// Index of a page in the pool.
pub type PageId = u32;

/// A broken provenance invariant: the engine refuses the read or write instead of using the data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProvenanceError {
    /// The page belongs to another request or attempt, or to nobody.
    #[error("page {page} is owned by {actual:?}, not by {expected:?}")]
    ForeignPage {
        /// Page in question.
        page: PageId,
        /// Owner that tried to use it.
        expected: Owner,
        /// Owner recorded on the page.
        actual: Option<Owner>,
    },
    /// A position that was never written by this request would be read.
    #[error("position {position} of {owner:?} was never written (page {page} holds {written})")]
    Unwritten {
        /// Reader.
        owner: Owner,
        /// Position within the request.
        position: usize,
        /// Page holding that position.
        page: PageId,
        /// Positions written on that page.
        written: usize,
    },
    /// The request's page list does not reach the position.
    #[error("{owner:?} has {pages} pages, too few for position {position}")]
    MissingPage {
        /// Reader or writer.
        owner: Owner,
        /// Pages in its list.
        pages: usize,
        /// Position that needed a page.
        position: usize,
    },
    /// A write would leave a gap of unwritten positions.
    #[error(
        "write at position {position} of {owner:?} skips positions (page {page} holds {written})"
    )]
    Gap {
        /// Writer.
        owner: Owner,
        /// First position written.
        position: usize,
        /// Page of that position.
        page: PageId,
        /// Positions already written on that page.
        written: usize,
    },
}

#[derive(Debug, Clone, Default)]
struct PageMeta {
    owner: Option<Owner>,
    written: usize,
}

#[derive(Debug)]
struct PageTable {
    pages: Vec<PageMeta>,
    free: Vec<PageId>,
}

/// The paged KV pool shared by the prefill and decode workers.
#[derive(Debug)]
pub struct KvPool {
    /// Per layer `(k, v)`, each `[pages * page_size, kv_heads * head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
    page_size: usize,
    num_pages: usize,
    row_width: usize,
    table: Mutex<PageTable>,
    freed: Condvar,
}

impl KvPool {
    /// Allocates a pool of as many pages as fit in `budget_bytes` for all layers, K and V.
    pub fn new(
        budget_bytes: usize,
        page_size: usize,
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, EngineError> {
        if page_size == 0 {
            return Err(EngineError::Config("page size must be > 0".into()));
        }
        let row_width = kv_heads * head_dim;
        let page_bytes = 2 * num_layers * page_size * row_width * dtype.size_in_bytes();
        let num_pages = budget_bytes / page_bytes;
        if num_pages == 0 {
            return Err(EngineError::Config(format!(
                "KV budget of {budget_bytes} bytes holds no page (one page needs {page_bytes} bytes)"
            )));
        }
        let rows = num_pages * page_size;
        let layers = (0..num_layers)
            .map(|_| {
                let k = Tensor::zeros((rows, row_width), dtype, device)?;
                let v = Tensor::zeros((rows, row_width), dtype, device)?;
                Ok((k, v))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            page_size,
            num_pages,
            row_width,
            table: Mutex::new(PageTable {
                pages: vec![PageMeta::default(); num_pages],
                // Pop from the back: lowest page ids first.
                free: (0..num_pages as PageId).rev().collect(),
            }),
            freed: Condvar::new(),
        })
    }

    /// Positions per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Total pages.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Capacity in tokens (all pages).
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }

    /// Pages currently free.
    pub fn free_pages(&self) -> usize {
        self.lock().free.len()
    }

    /// K and V tensors of one layer, `[pages * page_size, kv_heads * head_dim]`.
    pub(crate) fn layer(&self, layer: usize) -> &(Tensor, Tensor) {
        &self.layers[layer]
    }

    fn lock(&self) -> MutexGuard<'_, PageTable> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // grants a page to two owners (every update is a single assignment), so recover.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `count` free pages for `owner`, all or none.
    pub fn allocate(&self, owner: Owner, count: usize) -> Option<Vec<PageId>> {
        let mut table = self.lock();
        if table.free.len() < count {
            return None;
        }
        let at = table.free.len() - count;
        let pages = table.free.split_off(at);
        for &p in &pages {
            let meta = &mut table.pages[p as usize];
            debug_assert!(meta.owner.is_none() && meta.written == 0);
            *meta = PageMeta {
                owner: Some(owner),
                written: 0,
            };
        }
        Some(pages)
    }

    /// Blocks up to `timeout` for pages to be freed.
    pub fn wait_for_free(&self, timeout: Duration) {
        let table = self.lock();
        let _ = self.freed.wait_timeout(table, timeout);
    }

    /// Frees every page owned by `owner` (whether or not the caller still lists it) and
    /// returns how many were freed. Freed pages have no owner and no written positions; in
    /// debug builds their contents are overwritten with NaN.
    pub fn release(&self, owner: Owner) -> usize {
        let mut freed = Vec::new();
        {
            let mut table = self.lock();
            for (id, meta) in table.pages.iter_mut().enumerate() {
                if meta.owner == Some(owner) {
                    *meta = PageMeta::default();
                    freed.push(id as PageId);
                }
            }
            if cfg!(debug_assertions) {
                // Poison before the pages become allocatable again.
                for &p in &freed {
                    self.poison(p);
                }
            }
            table.free.extend(freed.iter().copied());
        }
        self.freed.notify_all();
        freed.len()
    }

    fn poison(&self, page: PageId) {
        let start = page as usize * self.page_size;
        for (k, v) in &self.layers {
            let nan = Tensor::full(f32::NAN, (self.page_size, self.row_width), k.device())
                .and_then(|t| t.to_dtype(k.dtype()));
            if let Ok(nan) = nan {
                // Poisoning is a debug aid; a failure here only weakens that aid.
                let _ = k.slice_set(&nan, 0, start);
                let _ = v.slice_set(&nan, 0, start);
            }
        }
    }

    /// Records that `owner` writes positions `start..start + count` through its page list and
    /// returns the slot of each written position. Writes must extend what is written (no gaps).
    pub fn write_slots(
        &self,
        owner: Owner,
        pages: &[PageId],
        start: usize,
        count: usize,
    ) -> Result<Vec<u32>, ProvenanceError> {
        let mut table = self.lock();
        let mut slots = Vec::with_capacity(count);
        for position in start..start + count {
            let page =
                *pages
                    .get(position / self.page_size)
                    .ok_or(ProvenanceError::MissingPage {
                        owner,
                        pages: pages.len(),
                        position,
                    })?;
            let meta = &mut table.pages[page as usize];
            if meta.owner != Some(owner) {
                return Err(ProvenanceError::ForeignPage {
                    page,
                    expected: owner,
                    actual: meta.owner,
                });
            }
            let offset = position % self.page_size;
            if offset > meta.written {
                return Err(ProvenanceError::Gap {
                    owner,
                    position,
                    page,
                    written: meta.written,
                });
            }
            meta.written = meta.written.max(offset + 1);
            slots.push((page as usize * self.page_size + offset) as u32);
        }
        Ok(slots)
    }

    /// Checks that every position `0..len` of `owner` lies on a page it owns and was written,
    /// and returns their slots in position order. This is the only way attention finds its KV.
    pub fn read_slots(
        &self,
        owner: Owner,
        pages: &[PageId],
        len: usize,
    ) -> Result<Vec<u32>, ProvenanceError> {
        let table = self.lock();
        let mut slots = Vec::with_capacity(len);
        for (i, &page) in pages.iter().enumerate() {
            let first = i * self.page_size;
            if first >= len {
                break;
            }
            let meta = &table.pages[page as usize];
            if meta.owner != Some(owner) {
                return Err(ProvenanceError::ForeignPage {
                    page,
                    expected: owner,
                    actual: meta.owner,
                });
            }
            let wanted = (len - first).min(self.page_size);
            if meta.written < wanted {
                return Err(ProvenanceError::Unwritten {
                    owner,
                    position: first + meta.written,
                    page,
                    written: meta.written,
                });
            }
            let base = page as usize * self.page_size;
            slots.extend((base..base + wanted).map(|s| s as u32));
        }
        if slots.len() < len {
            return Err(ProvenanceError::MissingPage {
                owner,
                pages: pages.len(),
                position: slots.len(),
            });
        }
        Ok(slots)
    }

    /// FNV-1a checksum (one step per 32-bit word) of the K and V of positions `slots`, all layers, as f32 bit patterns.
    pub fn checksum(&self, slots: &[u32]) -> Result<u64, EngineError> {
        let device = self.layers[0].0.device();
        let index = Tensor::from_slice(slots, slots.len(), device)?;
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for (k, v) in &self.layers {
            for t in [k, v] {
                let rows = t.index_select(&index, 0)?.to_dtype(DType::F32)?;
                for x in rows.flatten_all()?.to_vec1::<f32>()? {
                    hash = (hash ^ x.to_bits() as u64).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        Ok(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pages: usize) -> KvPool {
        // 1 layer, 1 kv head, head_dim 2, page 4: one page = 2 * 4 * 2 * 4 bytes = 64 bytes.
        KvPool::new(64 * pages, 4, 1, 1, 2, DType::F32, &Device::Cpu).unwrap()
    }

    const A: Owner = Owner {
        request: 1,
        generation: 0,
    };
    const B: Owner = Owner {
        request: 2,
        generation: 0,
    };

    #[test]
    fn allocation_is_all_or_nothing() {
        let pool = pool(3);
        assert!(pool.allocate(A, 4).is_none());
        assert_eq!(pool.free_pages(), 3);
        let pages = pool.allocate(A, 2).unwrap();
        assert_eq!(pages.len(), 2);
        assert!(pool.allocate(B, 2).is_none());
        assert_eq!(pool.release(A), 2);
        assert_eq!(pool.free_pages(), 3);
    }

    #[test]
    fn reads_only_own_written_positions() {
        let pool = pool(4);
        let a = pool.allocate(A, 2).unwrap();
        let b = pool.allocate(B, 1).unwrap();
        assert_eq!(pool.write_slots(A, &a, 0, 5).unwrap().len(), 5);
        assert_eq!(pool.read_slots(A, &a, 5).unwrap().len(), 5);
        // Position 5 was never written.
        assert!(matches!(
            pool.read_slots(A, &a, 6),
            Err(ProvenanceError::Unwritten { position: 5, .. })
        ));
        // B's page in A's list is refused, for reads and writes.
        let mixed = [a[0], b[0]];
        assert!(matches!(
            pool.read_slots(A, &mixed, 5),
            Err(ProvenanceError::ForeignPage { .. })
        ));
        assert!(matches!(
            pool.write_slots(A, &mixed, 4, 1),
            Err(ProvenanceError::ForeignPage { .. })
        ));
        // Too few pages.
        assert!(matches!(
            pool.read_slots(A, &a[..1], 5),
            Err(ProvenanceError::MissingPage { .. })
        ));
        // Gaps are refused.
        assert!(matches!(
            pool.write_slots(B, &b, 2, 1),
            Err(ProvenanceError::Gap { .. })
        ));
    }

    #[test]
    fn freed_pages_are_invalidated_for_the_next_owner() {
        let pool = pool(1);
        let a = pool.allocate(A, 1).unwrap();
        pool.write_slots(A, &a, 0, 4).unwrap();
        pool.release(A);
        let b = pool.allocate(B, 1).unwrap();
        assert_eq!(a, b);
        // The page is B's now, but B wrote nothing: nothing A wrote is readable.
        assert!(matches!(
            pool.read_slots(B, &b, 1),
            Err(ProvenanceError::Unwritten { position: 0, .. })
        ));
        // A's stale id no longer grants access.
        assert!(matches!(
            pool.read_slots(A, &a, 1),
            Err(ProvenanceError::ForeignPage { .. })
        ));
        // A new generation of A is a different owner.
        let a1 = Owner { generation: 1, ..A };
        assert!(pool.read_slots(a1, &b, 0).is_ok());
        assert!(pool.write_slots(a1, &b, 0, 1).is_err());
    }
}

//! The prefill → decode handoff: a manifest of the pages prefill wrote, checked by decode.

use crate::EngineError;
use crate::kv::{KvPool, Owner, PageId, ProvenanceError};

/// What prefill claims to have written for one request attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The request attempt the pages belong to.
    pub owner: Owner,
    /// Pages holding positions `0..tokens`, in position order.
    pub pages: Vec<PageId>,
    /// Positions written.
    pub tokens: usize,
    /// [`KvPool::checksum`] of the written positions.
    pub checksum: u64,
}

/// Why decode refused a manifest. The request fails with this error instead of decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The manifest is for another request or attempt.
    #[error("manifest belongs to {found:?}, expected {expected:?}")]
    WrongOwner {
        /// Owner decode expected.
        expected: Owner,
        /// Owner in the manifest.
        found: Owner,
    },
    /// Prefill wrote fewer positions than the prompt has.
    #[error("manifest covers {covered} tokens but the prompt has {required}")]
    Incomplete {
        /// Positions the manifest claims.
        covered: usize,
        /// Positions of the prompt.
        required: usize,
    },
    /// Fewer pages than the prompt needs.
    #[error("manifest lists {listed} pages but {required} tokens need {needed}")]
    MissingPages {
        /// Pages listed.
        listed: usize,
        /// Pages needed.
        needed: usize,
        /// Positions of the prompt.
        required: usize,
    },
    /// The pages do not hold what the manifest says.
    #[error("manifest pages fail provenance: {0}")]
    Provenance(ProvenanceError),
    /// The KV read back differs from what prefill wrote.
    #[error("KV checksum {found:#018x} differs from the manifest's {expected:#018x}")]
    Checksum {
        /// Checksum in the manifest.
        expected: u64,
        /// Checksum of the pool now.
        found: u64,
    },
}

impl Manifest {
    /// Checks that this manifest hands over exactly the KV of `required` positions of
    /// `expected`: right owner, whole prompt covered, every page owned and written, same checksum.
    pub fn verify(
        &self,
        pool: &KvPool,
        expected: Owner,
        required: usize,
    ) -> Result<(), EngineError> {
        let refuse = |e| Err(EngineError::Transfer(e));
        if self.owner != expected {
            return refuse(TransferError::WrongOwner {
                expected,
                found: self.owner,
            });
        }
        if self.tokens != required {
            return refuse(TransferError::Incomplete {
                covered: self.tokens,
                required,
            });
        }
        let needed = pool.pages_for(required);
        if self.pages.len() != needed {
            return refuse(TransferError::MissingPages {
                listed: self.pages.len(),
                needed,
                required,
            });
        }
        let slots = match pool.read_slots(expected, &self.pages, required) {
            Ok(slots) => slots,
            Err(e) => return refuse(TransferError::Provenance(e)),
        };
        let found = pool.checksum(&slots)?;
        if found != self.checksum {
            return refuse(TransferError::Checksum {
                expected: self.checksum,
                found,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    const OWNER: Owner = Owner {
        request: 9,
        generation: 0,
    };

    fn written_pool() -> (KvPool, Manifest) {
        let pool = KvPool::new(64 * 4, 4, 1, 1, 2, DType::F32, &Device::Cpu).unwrap();
        let pages = pool.allocate(OWNER, 2).unwrap();
        let slots = pool.write_slots(OWNER, &pages, 0, 6).unwrap();
        let checksum = pool.checksum(&slots).unwrap();
        let manifest = Manifest {
            owner: OWNER,
            pages,
            tokens: 6,
            checksum,
        };
        (pool, manifest)
    }

    fn refusal(pool: &KvPool, m: &Manifest, required: usize) -> TransferError {
        match m.verify(pool, OWNER, required) {
            Err(EngineError::Transfer(e)) => e,
            other => panic!("expected a transfer refusal, got {other:?}"),
        }
    }

    #[test]
    fn complete_manifest_is_accepted() {
        let (pool, m) = written_pool();
        m.verify(&pool, OWNER, 6).unwrap();
    }

    #[test]
    fn manifest_missing_a_page_is_refused() {
        let (pool, mut m) = written_pool();
        m.pages.pop();
        assert!(matches!(
            refusal(&pool, &m, 6),
            TransferError::MissingPages {
                listed: 1,
                needed: 2,
                ..
            }
        ));
    }

    #[test]
    fn placeholder_manifest_is_refused() {
        // The incident: prefill wrote one token for an 8-page prompt and reported success.
        let (pool, mut m) = written_pool();
        m.tokens = 1;
        assert!(matches!(
            refusal(&pool, &m, 6),
            TransferError::Incomplete {
                covered: 1,
                required: 6
            }
        ));
    }

    #[test]
    fn foreign_or_stale_pages_are_refused() {
        let (pool, mut m) = written_pool();
        let other = Owner {
            request: 10,
            generation: 0,
        };
        m.pages[1] = pool.allocate(other, 1).unwrap()[0];
        assert!(matches!(
            refusal(&pool, &m, 6),
            TransferError::Provenance(ProvenanceError::ForeignPage { .. })
        ));
        let (pool, mut m) = written_pool();
        m.checksum ^= 1;
        assert!(matches!(
            refusal(&pool, &m, 6),
            TransferError::Checksum { .. }
        ));
    }
}

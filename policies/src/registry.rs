//! The registry of live canaries: who minted each one.
//!
//! The verifier asks one question per canary-shaped span it finds:
//! [`CanaryRegistry::owner`]. Implementations decide how they key entries;
//! [`MemoryRegistry`] keys them by [`Canary::key`] under a secret, so neither
//! it nor a store that persists its [`MemoryRegistry::entries`] ever holds a
//! raw canary value. Restoring after a restart with the same secret
//! ([`MemoryRegistry::restore`]) keeps canaries still in flight recognisable.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

use serde::{Deserialize, Serialize};

use crate::canary::{Canary, CanaryKey};

/// Who minted a canary, and until when it is live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Session (client identity) that sent the request.
    pub session: String,
    /// Request id.
    pub request: String,
    /// Expiry, in milliseconds since the Unix epoch. Lookups ignore it: an
    /// entry counts until [`MemoryRegistry::purge_expired`] drops it, so a
    /// late leak of an expired canary is still caught.
    pub expires_at_ms: u64,
}

/// Lookup of live canaries, shared by every request of the process.
pub trait CanaryRegistry: Send + Sync {
    /// The registration of `canary`, if it is live. Called once per
    /// canary-shaped span in an answer; must not depend on the number of
    /// entries for its cost (a hash lookup).
    fn owner(&self, canary: &Canary) -> Option<Registration>;
}

const SHARDS: usize = 16;

/// Concurrent in-memory registry, sharded to keep lock contention low.
pub struct MemoryRegistry {
    secret: Vec<u8>,
    shards: [RwLock<HashMap<CanaryKey, Registration>>; SHARDS],
}

impl MemoryRegistry {
    /// An empty registry keying entries with HMAC under `secret`.
    pub fn new(secret: &[u8]) -> Self {
        Self {
            secret: secret.to_vec(),
            shards: std::array::from_fn(|_| RwLock::new(HashMap::new())),
        }
    }

    /// The key `canary` is stored under.
    pub fn key(&self, canary: &Canary) -> CanaryKey {
        canary.key(&self.secret)
    }

    /// Registers `canary`; returns its key (for the persistent store).
    pub fn insert(&self, canary: &Canary, registration: Registration) -> CanaryKey {
        let key = self.key(canary);
        self.restore(key, registration);
        key
    }

    /// Registers an entry by key, as loaded from the persistent store.
    pub fn restore(&self, key: CanaryKey, registration: Registration) {
        self.shard(&key)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, registration);
    }

    /// Forgets `canary`; returns whether it was registered.
    pub fn remove(&self, canary: &Canary) -> bool {
        let key = self.key(canary);
        self.shard(&key)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key)
            .is_some()
    }

    /// Drops entries that expired at or before `now_ms`; returns how many.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        let mut removed = 0;
        for shard in &self.shards {
            let mut map = shard.write().unwrap_or_else(PoisonError::into_inner);
            let before = map.len();
            map.retain(|_, registration| registration.expires_at_ms > now_ms);
            removed += before - map.len();
        }
        removed
    }

    /// Number of registered canaries.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.read().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A snapshot of every entry, for persisting.
    pub fn entries(&self) -> Vec<(CanaryKey, Registration)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let map = shard.read().unwrap_or_else(PoisonError::into_inner);
            out.extend(map.iter().map(|(key, reg)| (*key, reg.clone())));
        }
        out
    }

    fn shard(&self, key: &CanaryKey) -> &RwLock<HashMap<CanaryKey, Registration>> {
        &self.shards[usize::from(key.0[0]) % SHARDS]
    }
}

impl CanaryRegistry for MemoryRegistry {
    fn owner(&self, canary: &Canary) -> Option<Registration> {
        let key = self.key(canary);
        self.shard(&key)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned()
    }
}

impl std::fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistry")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(request: &str, expires_at_ms: u64) -> Registration {
        Registration {
            session: "s".into(),
            request: request.into(),
            expires_at_ms,
        }
    }

    #[test]
    fn insert_lookup_remove_purge() {
        let registry = MemoryRegistry::new(b"secret");
        let a = Canary::from_random([1; 10]);
        let b = Canary::from_random([2; 10]);
        registry.insert(&a, registration("a", 10));
        registry.insert(&b, registration("b", 20));
        assert_eq!(registry.owner(&a).unwrap().request, "a");
        assert_eq!(registry.len(), 2);
        assert_eq!(registry.purge_expired(10), 1);
        assert!(registry.owner(&a).is_none());
        assert!(registry.remove(&b));
        assert!(registry.is_empty());
    }

    #[test]
    fn restore_with_same_secret_recognises_canaries() {
        let before = MemoryRegistry::new(b"secret");
        let canary = Canary::from_random([9; 10]);
        before.insert(&canary, registration("r", 5));
        let after = MemoryRegistry::new(b"secret");
        for (key, reg) in before.entries() {
            after.restore(key, reg);
        }
        assert_eq!(after.owner(&canary).unwrap().request, "r");
        let other_secret = MemoryRegistry::new(b"other");
        for (key, reg) in before.entries() {
            other_secret.restore(key, reg);
        }
        assert!(other_secret.owner(&canary).is_none());
    }
}

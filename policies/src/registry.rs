//! The registry of live canaries: who minted each one.
//!
//! The verifier asks one question per canary-shaped span it finds:
//! [`CanaryRegistry::owner`]. Implementations decide how they key entries;
//! [`MemoryRegistry`] keys them by [`Canary::key`] under a secret, so neither
//! it nor a store that persists its [`MemoryRegistry::entries`] ever holds a
//! raw canary value. Restoring after a restart with the same secret
//! ([`MemoryRegistry::restore`]) keeps canaries still in flight recognisable.

use std::collections::{BTreeSet, HashMap};
use std::sync::{PoisonError, RwLock};

use serde::{Deserialize, Serialize};

use crate::canary::{BuildKeyHasher, Canary, CanaryKey, CanaryKeyer};

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

/// One shard: the entries, and the same keys ordered by expiry, so that a
/// purge touches only what expired instead of every entry under the lock.
#[derive(Default)]
struct Shard {
    entries: HashMap<CanaryKey, Registration, BuildKeyHasher>,
    by_expiry: BTreeSet<(u64, CanaryKey)>,
}

impl Shard {
    fn insert(&mut self, key: CanaryKey, registration: Registration) {
        let expires_at_ms = registration.expires_at_ms;
        if let Some(replaced) = self.entries.insert(key, registration) {
            self.by_expiry.remove(&(replaced.expires_at_ms, key));
        }
        self.by_expiry.insert((expires_at_ms, key));
    }

    fn remove(&mut self, key: &CanaryKey) -> bool {
        let Some(removed) = self.entries.remove(key) else {
            return false;
        };
        self.by_expiry.remove(&(removed.expires_at_ms, *key));
        true
    }

    /// Drops the entries that expired at or before `now_ms`; returns how many.
    fn purge_expired(&mut self, now_ms: u64) -> usize {
        let Some(after) = now_ms.checked_add(1) else {
            let removed = self.entries.len();
            *self = Self::default();
            return removed;
        };
        let live = self.by_expiry.split_off(&(after, CanaryKey([0; 16])));
        let expired = std::mem::replace(&mut self.by_expiry, live);
        for (_, key) in &expired {
            self.entries.remove(key);
        }
        expired.len()
    }
}

/// Concurrent in-memory registry, sharded to keep lock contention low.
pub struct MemoryRegistry {
    keyer: CanaryKeyer,
    shards: [RwLock<Shard>; SHARDS],
}

impl MemoryRegistry {
    /// An empty registry keying entries with HMAC under `secret`.
    pub fn new(secret: &[u8]) -> Self {
        Self {
            keyer: CanaryKeyer::new(secret),
            shards: std::array::from_fn(|_| RwLock::new(Shard::default())),
        }
    }

    /// The key `canary` is stored under.
    pub fn key(&self, canary: &Canary) -> CanaryKey {
        self.keyer.key(canary)
    }

    /// Registers `canary`; returns its key (for the persistent store).
    pub fn insert(&self, canary: &Canary, registration: Registration) -> CanaryKey {
        let key = self.key(canary);
        self.restore(key, registration);
        key
    }

    /// Registers `canary` unless it is already live; `None` when it is (its
    /// registration is left as it was).
    pub fn insert_new(&self, canary: &Canary, registration: Registration) -> Option<CanaryKey> {
        let key = self.key(canary);
        let mut shard = self.write(&key);
        if shard.entries.contains_key(&key) {
            return None;
        }
        shard.insert(key, registration);
        Some(key)
    }

    /// A fresh canary ([`Canary::mint`]), registered to `registration`. A
    /// value that is already live is refused and another one drawn, so no two
    /// live canaries are ever equal.
    pub fn mint(&self, registration: &Registration) -> (Canary, CanaryKey) {
        self.mint_from(registration, Canary::mint)
    }

    /// [`MemoryRegistry::mint`] with canaries drawn from `draw`.
    fn mint_from(
        &self,
        registration: &Registration,
        mut draw: impl FnMut() -> Canary,
    ) -> (Canary, CanaryKey) {
        loop {
            let canary = draw();
            if let Some(key) = self.insert_new(&canary, registration.clone()) {
                return (canary, key);
            }
        }
    }

    /// Registers an entry by key, as loaded from the persistent store.
    pub fn restore(&self, key: CanaryKey, registration: Registration) {
        self.write(&key).insert(key, registration);
    }

    /// Forgets `canary`; returns whether it was registered.
    pub fn remove(&self, canary: &Canary) -> bool {
        let key = self.key(canary);
        self.write(&key).remove(&key)
    }

    /// Drops entries that expired at or before `now_ms`; returns how many.
    /// Each shard is locked only while its expired entries are removed.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .purge_expired(now_ms)
            })
            .sum()
    }

    /// Number of registered canaries.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entries
                    .len()
            })
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
            let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
            out.extend(shard.entries.iter().map(|(key, reg)| (*key, reg.clone())));
        }
        out
    }

    fn shard(&self, key: &CanaryKey) -> &RwLock<Shard> {
        &self.shards[usize::from(key.0[0]) % SHARDS]
    }

    fn write(&self, key: &CanaryKey) -> std::sync::RwLockWriteGuard<'_, Shard> {
        self.shard(key)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl CanaryRegistry for MemoryRegistry {
    fn owner(&self, canary: &Canary) -> Option<Registration> {
        let key = self.key(canary);
        self.shard(&key)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
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
    use proptest::prelude::*;

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
    fn a_live_value_is_refused() {
        let registry = MemoryRegistry::new(b"secret");
        let canary = Canary::from_random([3; 10]);
        assert!(
            registry
                .insert_new(&canary, registration("first", 10))
                .is_some()
        );
        assert!(
            registry
                .insert_new(&canary, registration("second", 20))
                .is_none()
        );
        assert_eq!(registry.owner(&canary).unwrap().request, "first");
        assert_eq!(registry.purge_expired(10), 1);
        assert!(
            registry
                .insert_new(&canary, registration("third", 30))
                .is_some()
        );

        let (minted, key) = registry.mint(&registration("minted", 40));
        assert_eq!(registry.key(&minted), key);
        assert_eq!(registry.owner(&minted).unwrap().request, "minted");
        assert_eq!(registry.len(), 2);

        // A draw that hits a live value is thrown away and drawn again.
        let mut draws = [canary, minted, Canary::from_random([4; 10])].into_iter();
        let (fresh, _) = registry.mint_from(&registration("fresh", 50), || {
            draws.next().expect("no more draws")
        });
        assert_eq!(fresh, Canary::from_random([4; 10]));
        assert_eq!(draws.next(), None);
        assert_eq!(registry.owner(&canary).unwrap().request, "third");
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

    #[derive(Debug, Clone)]
    enum Op {
        Insert { canary: u8, expires_at_ms: u64 },
        Remove { canary: u8 },
        Purge { now_ms: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..24u8, 0..40u64).prop_map(|(canary, expires_at_ms)| Op::Insert {
                canary,
                expires_at_ms
            }),
            (0..24u8).prop_map(|canary| Op::Remove { canary }),
            prop_oneof![0..40u64, Just(u64::MAX)].prop_map(|now_ms| Op::Purge { now_ms }),
        ]
    }

    proptest! {
        /// The expiry index never changes what the registry answers: it
        /// behaves as a plain map purged by a full scan.
        #[test]
        fn behaves_as_a_map_purged_by_scanning(ops in proptest::collection::vec(op(), 1..120)) {
            let registry = MemoryRegistry::new(b"secret");
            let mut model: HashMap<u8, u64> = HashMap::new();
            let canary = |n: u8| Canary::from_random([n; 10]);
            for op in ops {
                match op {
                    Op::Insert { canary: n, expires_at_ms } => {
                        registry.insert(&canary(n), registration("r", expires_at_ms));
                        model.insert(n, expires_at_ms);
                    }
                    Op::Remove { canary: n } => {
                        prop_assert_eq!(registry.remove(&canary(n)), model.remove(&n).is_some());
                    }
                    Op::Purge { now_ms } => {
                        let before = model.len();
                        model.retain(|_, expires| *expires > now_ms);
                        prop_assert_eq!(registry.purge_expired(now_ms), before - model.len());
                    }
                }
                prop_assert_eq!(registry.len(), model.len());
                for n in 0..24u8 {
                    let owner = registry.owner(&canary(n)).map(|r| r.expires_at_ms);
                    prop_assert_eq!(owner, model.get(&n).copied());
                }
            }
            let indexed: usize = registry
                .shards
                .iter()
                .map(|shard| shard.read().unwrap().by_expiry.len())
                .sum();
            prop_assert_eq!(indexed, model.len());
        }
    }
}

//! The live canaries of this deployment, behind one interface: registering
//! a request's canaries before it goes upstream, looking up who minted a
//! canary found in an answer, and dropping expired ones.
//!
//! A request's canaries are drawn by the registry itself
//! ([`CanaryBook::mint`]): a value already live is refused and drawn again,
//! so no two live canaries are ever equal. They are live from that moment;
//! once they are in the request, [`CanaryBook::register`] persists them and
//! gives their ids for the record, and if they could not be placed
//! [`CanaryBook::withdraw`] drops them.
//!
//! Where the entries live is the [`Backend`]'s business. Today there is one,
//! in memory ([`MemoryRegistry`], keyed hashes only), persisted through the
//! audit store so that canaries of requests in flight survive a restart. A
//! shared backend (several instances on one registry) is another variant; it
//! must claim each value the same way (set only if absent):
//! [`CanaryBook::register`] is already awaited before the request is sent,
//! and [`CanaryBook::lookup`] is the only way the verifier asks.

use std::sync::Arc;

use canarygate_audit::{AuditError, AuditLog, CanaryEntry};
use canarygate_policies::CanaryKey;
use canarygate_policies::inject::RequestCanaries;
use canarygate_policies::registry::{CanaryRegistry, MemoryRegistry, Registration};

use crate::clock::now_ms;

/// Where live canaries are kept.
enum Backend {
    /// This process's memory, persisted through the audit store.
    Memory(MemoryRegistry),
}

/// Who a request's canaries belong to.
pub struct Owner<'a> {
    /// The session (keyed hash).
    pub session: &'a str,
    /// The request id.
    pub request_id: &'a str,
}

/// A request's two canaries, live in the registry but not yet persisted:
/// [`CanaryBook::register`] them once they are in the request, or
/// [`CanaryBook::withdraw`] them.
#[must_use = "minted canaries stay live until registered or withdrawn"]
pub struct Minted {
    /// The values, to place in the request.
    pub canaries: RequestCanaries,
    keys: [CanaryKey; 2],
    registration: Registration,
}

/// The registry of live canaries, shared by every request.
pub struct CanaryBook {
    backend: Backend,
    audit: AuditLog,
}

impl CanaryBook {
    /// The in-memory registry, keyed under the install's `canary` secret,
    /// holding the canaries the audit store says are still live.
    pub fn open(audit: AuditLog) -> Result<Arc<Self>, AuditError> {
        let registry = MemoryRegistry::new(&audit.secrets().secret("canary"));
        let live = audit.live_canaries(now_ms())?;
        if !live.is_empty() {
            tracing::info!(
                canaries = live.len(),
                "restored live canaries of requests still in flight before the restart"
            );
        }
        for entry in live {
            registry.restore(
                entry.key,
                Registration {
                    session: entry.session,
                    request: entry.request_id,
                    expires_at_ms: entry.expires_at_ms,
                },
            );
        }
        Ok(Arc::new(Self {
            backend: Backend::Memory(registry),
            audit,
        }))
    }

    /// Draws a request's two canaries from the OS CSPRNG, live as `owner`'s
    /// until `ttl_secs` from now. Values already live are refused and drawn
    /// again, so they are unique among live canaries and differ from each
    /// other.
    pub fn mint(&self, owner: Owner<'_>, ttl_secs: u64) -> Result<Minted, getrandom::Error> {
        let registration = Registration {
            session: owner.session.to_owned(),
            request: owner.request_id.to_owned(),
            expires_at_ms: now_ms().saturating_add(ttl_secs.saturating_mul(1000)),
        };
        let Backend::Memory(registry) = &self.backend;
        let (canaries, keys) = RequestCanaries::mint_registered(registry, &registration)?;
        Ok(Minted {
            canaries,
            keys,
            registration,
        })
    }

    /// Keeps `minted` for the request it was placed in; returns the
    /// canaries' ids (hex keyed hashes, for the audit record). Persisted in
    /// the audit store with the next group commit (not awaited: a crash in
    /// the next few milliseconds forgets them; the record's canary ids still
    /// name them).
    pub async fn register(&self, minted: Minted) -> Vec<String> {
        let Minted {
            keys, registration, ..
        } = minted;
        let entries: Vec<CanaryEntry> = keys
            .iter()
            .map(|&key| CanaryEntry {
                key,
                session: registration.session.clone(),
                request_id: registration.request.clone(),
                expires_at_ms: registration.expires_at_ms,
            })
            .collect();
        if let Err(error) = self.audit.register_canaries_soon(entries) {
            tracing::warn!("persisting canaries: {error}");
        }
        keys.iter().map(|key| hex::encode(key.0)).collect()
    }

    /// Drops `minted` canaries that were never sent (placing them failed).
    pub fn withdraw(&self, minted: Minted) {
        let Backend::Memory(registry) = &self.backend;
        registry.remove(&minted.canaries.head);
        registry.remove(&minted.canaries.tail);
    }

    /// The lookup the verifier scans answers with.
    pub fn lookup(&self) -> &dyn CanaryRegistry {
        let Backend::Memory(registry) = &self.backend;
        registry
    }

    /// Drops the canaries expired at `now_ms` from the backend (blocking:
    /// it takes the shards' locks).
    pub fn purge_expired(&self, now_ms: u64) {
        let Backend::Memory(registry) = &self.backend;
        registry.purge_expired(now_ms);
    }

    /// Drops the canaries expired at `now_ms` from the audit store.
    pub async fn sweep_store(&self, now_ms: u64) -> Result<u64, AuditError> {
        self.audit.sweep_canaries(now_ms).await
    }
}

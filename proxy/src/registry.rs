//! The live canaries of this deployment, behind one interface: registering
//! a request's canaries before it goes upstream, looking up who minted a
//! canary found in an answer, and dropping expired ones.
//!
//! Where the entries live is the [`Backend`]'s business. Today there is one,
//! in memory ([`MemoryRegistry`], keyed hashes only), persisted through the
//! audit store so that canaries of requests in flight survive a restart. A
//! shared backend (several instances on one registry) is another variant:
//! [`CanaryBook::register`] is already awaited before the request is sent,
//! and [`CanaryBook::lookup`] is the only way the verifier asks.

use std::sync::Arc;

use canarygate_audit::{AuditError, AuditLog, CanaryEntry};
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

    /// Registers both canaries as `owner`'s until `ttl_secs` from now;
    /// returns their ids (hex keyed hashes, for the audit record). In memory
    /// at once, and in the audit store with the next group commit (not
    /// awaited: a crash in the next few milliseconds forgets them; the
    /// record's canary ids still name them).
    pub async fn register(
        &self,
        canaries: &RequestCanaries,
        owner: Owner<'_>,
        ttl_secs: u64,
    ) -> Vec<String> {
        let expires_at_ms = now_ms().saturating_add(ttl_secs.saturating_mul(1000));
        let Backend::Memory(registry) = &self.backend;
        let mut ids = Vec::with_capacity(2);
        let mut entries = Vec::with_capacity(2);
        for canary in [canaries.head, canaries.tail] {
            let registration = Registration {
                session: owner.session.to_owned(),
                request: owner.request_id.to_owned(),
                expires_at_ms,
            };
            let key = registry.insert(&canary, registration);
            ids.push(hex::encode(key.0));
            entries.push(CanaryEntry {
                key,
                session: owner.session.to_owned(),
                request_id: owner.request_id.to_owned(),
                expires_at_ms,
            });
        }
        if let Err(error) = self.audit.register_canaries_soon(entries) {
            tracing::warn!("persisting canaries: {error}");
        }
        ids
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

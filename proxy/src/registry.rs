//! The live canaries of this deployment, behind one interface: registering
//! a request's canaries before it goes upstream, resolving who minted the
//! canary-shaped spans found in an answer, and dropping expired ones.
//!
//! A request's canaries are drawn by the registry itself
//! ([`CanaryBook::mint`]): a value already live is refused and drawn again,
//! so no two live canaries are ever equal. They are live in this process
//! from that moment; once they are in the request, [`CanaryBook::register`]
//! claims them in the shared registry (when there is one), persists them
//! and gives their ids for the record; if they could not be placed (or the
//! shared registry holds one already) [`CanaryBook::withdraw`] drops them.
//!
//! Two places hold entries:
//!
//! - this process's memory ([`MemoryRegistry`], keyed hashes only),
//!   persisted through the audit store so that canaries of requests in
//!   flight survive a restart. Alone, it is the whole registry
//!   (`[registry] backend = "memory"`);
//! - with `backend = "redis"`, a [`SharedRegistry`] every instance of the
//!   deployment claims its canaries in and asks about spans it does not
//!   know. The verifier's lookups are synchronous, so the verified path
//!   first has [`CanaryBook::resolve`] fetch the spans an answer's text
//!   could decide ([`Verifier::spans_to_look_up`]; one round trip per
//!   answer or stream event, and none when the text holds no unknown
//!   canary-shaped span), then gives the verifier [`CanaryBook::lookup`]:
//!   memory first, then what was fetched.
//!
//! When the shared registry cannot be asked, `[registry] on_unavailable`
//! decides: refuse the request before it is sent (`fail-closed`) or serve
//! it with this instance's canaries only, the verdict saying
//! `registry_degraded`.
//!
//! [`Verifier::spans_to_look_up`]: canarygate_policies::verify::Verifier::spans_to_look_up

use std::collections::HashMap;
use std::sync::Arc;

use canarygate_audit::{AuditError, AuditLog, CanaryEntry};
use canarygate_policies::CanaryKey;
use canarygate_policies::canary::Canary;
use canarygate_policies::inject::RequestCanaries;
use canarygate_policies::registry::{CanaryRegistry, MemoryRegistry, Registration};
use canarygate_policies::registry_config::OnUnavailable;

use crate::clock::now_ms;
use crate::metrics::Metrics;
use crate::shared_registry::{Health, SharedRegistry, Unavailable};

/// Who a request's canaries belong to.
pub struct Owner<'a> {
    /// The session (keyed hash).
    pub session: &'a str,
    /// The request id.
    pub request_id: &'a str,
}

/// A request's two canaries, live in this process but not yet registered:
/// [`CanaryBook::register`] them once they are in the request, or
/// [`CanaryBook::withdraw`] them.
#[must_use = "minted canaries stay live until registered or withdrawn"]
pub struct Minted {
    /// The values, to place in the request.
    pub canaries: RequestCanaries,
    keys: [CanaryKey; 2],
    registration: Registration,
}

/// Canaries registered for a request.
pub struct Registered {
    /// Their ids (hex keyed hashes), for the audit record.
    pub ids: Vec<String>,
    /// The shared registry could not be asked: other instances will not
    /// recognise them (served because the policy degrades).
    pub degraded: bool,
}

/// Why a request's canaries could not be registered.
pub enum RegisterError {
    /// The shared registry holds one of the values already (another
    /// instance's live canary): draw again.
    Taken,
    /// The shared registry cannot be asked and the policy fails closed.
    Unavailable(Unavailable),
}

/// What [`CanaryBook::resolve`] could not settle.
pub struct Unresolved {
    /// Canary-shaped spans left to this instance's memory.
    pub spans: u64,
    /// They fail the answer (the policy fails closed).
    pub fail: bool,
}

/// The shared registry and what to do without it.
struct Shared {
    client: SharedRegistry,
    on_unavailable: OnUnavailable,
}

/// The registry of live canaries, shared by every request.
pub struct CanaryBook {
    memory: MemoryRegistry,
    shared: Option<Shared>,
    audit: AuditLog,
    metrics: Arc<Metrics>,
}

impl CanaryBook {
    /// The registry keyed under `canary_secret`, holding the canaries the
    /// audit store says are still live, and sharing them through `shared`
    /// when given.
    pub fn open(
        audit: AuditLog,
        canary_secret: &[u8],
        shared: Option<(SharedRegistry, OnUnavailable)>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, AuditError> {
        let memory = MemoryRegistry::new(canary_secret);
        let live = audit.live_canaries(now_ms())?;
        if !live.is_empty() {
            tracing::info!(
                canaries = live.len(),
                "restored live canaries of requests still in flight before the restart"
            );
        }
        for entry in live {
            memory.restore(
                entry.key,
                Registration {
                    session: entry.session,
                    request: entry.request_id,
                    expires_at_ms: entry.expires_at_ms,
                },
            );
        }
        // Shared: down until the first heartbeat has checked it.
        metrics.registry_up(shared.is_none());
        Ok(Arc::new(Self {
            memory,
            shared: shared.map(|(client, on_unavailable)| Shared {
                client,
                on_unavailable,
            }),
            audit,
            metrics,
        }))
    }

    /// Draws a request's two canaries ([`Canary::mint`]), live as `owner`'s
    /// until `ttl_secs` from now. Values already live here are refused and
    /// drawn again, so they are unique among this instance's live canaries
    /// and differ from each other ([`CanaryBook::register`] checks the
    /// shared registry).
    pub fn mint(&self, owner: Owner<'_>, ttl_secs: u64) -> Minted {
        let registration = Registration {
            session: owner.session.to_owned(),
            request: owner.request_id.to_owned(),
            expires_at_ms: now_ms().saturating_add(ttl_secs.saturating_mul(1000)),
        };
        let (canaries, keys) = RequestCanaries::mint_registered(&self.memory, &registration);
        Minted {
            canaries,
            keys,
            registration,
        }
    }

    /// Registers `minted` for the request it was placed in: claims both
    /// values in the shared registry (one round trip, awaited: the request
    /// must not go upstream before another instance can recognise its
    /// canaries), then persists them in the audit store with the next group
    /// commit (not awaited: a crash in the next few milliseconds forgets
    /// them; the record's canary ids still name them).
    pub async fn register(&self, minted: &Minted) -> Result<Registered, RegisterError> {
        let mut degraded = false;
        if let Some(shared) = &self.shared {
            let entries = minted.keys.map(|key| (key, &minted.registration));
            match shared.client.claim(&entries).await {
                Ok(claimed) => {
                    if !claimed.iter().all(|&claimed| claimed) {
                        let mine: Vec<CanaryKey> = (minted.keys.iter().zip(&claimed))
                            .filter(|&(_, &claimed)| claimed)
                            .map(|(key, _)| *key)
                            .collect();
                        shared.client.release(&mine).await;
                        return Err(RegisterError::Taken);
                    }
                    self.metrics.registry_up(true);
                }
                Err(error) => {
                    self.metrics.registry_up(false);
                    self.metrics.registry_failure("register");
                    if shared.on_unavailable == OnUnavailable::FailClosed {
                        return Err(RegisterError::Unavailable(error));
                    }
                    degraded = true;
                }
            }
        }
        let entries: Vec<CanaryEntry> = minted
            .keys
            .iter()
            .map(|&key| CanaryEntry {
                key,
                session: minted.registration.session.clone(),
                request_id: minted.registration.request.clone(),
                expires_at_ms: minted.registration.expires_at_ms,
            })
            .collect();
        if let Err(error) = self.audit.register_canaries_soon(entries) {
            tracing::warn!("persisting canaries: {error}");
        }
        Ok(Registered {
            ids: minted.keys.iter().map(|key| hex::encode(key.0)).collect(),
            degraded,
        })
    }

    /// Drops `minted` canaries that were never sent (placing or claiming
    /// them failed) from this process.
    pub fn withdraw(&self, minted: Minted) {
        self.memory.remove(&minted.canaries.head);
        self.memory.remove(&minted.canaries.tail);
    }

    /// Fetches into `fetched` the registrations of the `spans` this process
    /// does not know and has not fetched, from the shared registry (one round
    /// trip; none without a shared registry or unknown spans). `None` when
    /// every span is settled.
    pub async fn resolve(
        &self,
        spans: &[Canary],
        fetched: &mut HashMap<Canary, Option<Registration>>,
    ) -> Option<Unresolved> {
        let shared = self.shared.as_ref()?;
        let unknown: Vec<Canary> = spans
            .iter()
            .copied()
            .filter(|canary| !fetched.contains_key(canary) && self.memory.owner(canary).is_none())
            .collect();
        if unknown.is_empty() {
            return None;
        }
        let keys: Vec<CanaryKey> = unknown
            .iter()
            .map(|canary| self.memory.key(canary))
            .collect();
        match shared.client.find(&keys).await {
            Ok(found) => {
                self.metrics.registry_up(true);
                fetched.extend(unknown.into_iter().zip(found));
                None
            }
            Err(error) => {
                tracing::warn!(
                    spans = unknown.len(),
                    "looking up canary-shaped spans in the shared registry: {error}"
                );
                self.metrics.registry_up(false);
                self.metrics.registry_failure("lookup");
                // Settled as unknown: looked up in memory only, counted once,
                // not asked again on every event that still holds them.
                let spans = unknown.len() as u64;
                fetched.extend(unknown.into_iter().map(|canary| (canary, None)));
                Some(Unresolved {
                    spans,
                    fail: shared.on_unavailable == OnUnavailable::FailClosed,
                })
            }
        }
    }

    /// The lookup the verifier scans answers with: this process's memory,
    /// then the registrations [`CanaryBook::resolve`] fetched.
    pub fn lookup<'a>(
        &'a self,
        fetched: &'a HashMap<Canary, Option<Registration>>,
    ) -> impl CanaryRegistry + 'a {
        Lookup {
            memory: &self.memory,
            fetched,
        }
    }

    /// Counts a request that met an unavailable shared registry, by what it
    /// got: `degraded`, `refused` or `failed`.
    pub fn count_unavailable(&self, what: &'static str) {
        self.metrics.registry_unavailable(what);
    }

    /// Whether canaries are shared with other instances (registering them is
    /// a network round trip).
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Whether the registry is shared, and the shared one's health.
    pub fn shared_health(&self) -> Option<Health> {
        self.shared.as_ref().map(|shared| shared.client.health())
    }

    /// Checks the shared registry (the background task's heartbeat, and
    /// once at start): notices an outage and its end without traffic. When
    /// it comes back, or lost its data, this instance's live canaries are
    /// claimed again before requests use it: canaries registered while it
    /// was away (degraded) or lost with its data become recognisable to the
    /// other instances again.
    pub async fn heartbeat(&self) {
        let Some(shared) = &self.shared else {
            return;
        };
        let client = &shared.client;
        let up = match client.check().await {
            Ok(checked) => {
                let needs_reclaim = !client.health().up || checked.marker_was_missing;
                let reclaimed = if needs_reclaim {
                    let entries = self.memory.entries();
                    let count = entries.len();
                    let result = client.reclaim(&entries).await;
                    if result.is_ok() && count > 0 {
                        tracing::info!(
                            canaries = count,
                            "claimed this instance's live canaries again"
                        );
                    }
                    result.is_ok()
                } else {
                    true
                };
                if reclaimed {
                    client.mark_up();
                }
                reclaimed
            }
            Err(_) => false,
        };
        self.metrics.registry_up(up);
    }

    /// Canaries this process holds in memory: live, or expired and not yet
    /// purged.
    pub fn held_in_memory(&self) -> usize {
        self.memory.len()
    }

    /// Drops the canaries expired at `now_ms` from this process's memory
    /// (blocking: it takes the shards' locks). The shared registry's keys
    /// expire by themselves.
    pub fn purge_expired(&self, now_ms: u64) {
        self.memory.purge_expired(now_ms);
    }

    /// Drops the canaries expired at `now_ms` from the audit store.
    pub async fn sweep_store(&self, now_ms: u64) -> Result<u64, AuditError> {
        self.audit.sweep_canaries(now_ms).await
    }
}

/// [`CanaryBook::lookup`]'s view.
struct Lookup<'a> {
    memory: &'a MemoryRegistry,
    fetched: &'a HashMap<Canary, Option<Registration>>,
}

impl CanaryRegistry for Lookup<'_> {
    fn owner(&self, canary: &Canary) -> Option<Registration> {
        self.memory
            .owner(canary)
            .or_else(|| self.fetched.get(canary).cloned().flatten())
    }
}

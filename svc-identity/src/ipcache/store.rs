//! Keeping this node's entries in the store, and the other nodes' entries
//! (KVSTORE claims) in the cache.
//!
//! The store is level-triggered against the LOCAL_ENDPOINT claims: a
//! reconcile pass (the only writer of this node's entries, one pass at a
//! time) writes every claim the store lacks (or holds differently) and
//! withdraws this node's store entries that no claim backs. It runs after
//! a change of the claims, after every listing (so when the store is back
//! after an outage), when an entry this node claims vanished from the store
//! (the lease expired, another node's late delete), periodically
//! ([`IpCacheOptions::resync_interval`]), with backoff after a failed pass,
//! and, re-publishing every claim, when the backend reports a replaced
//! lease ([`IdentityBackend::lease_renewed`]).
//! When two nodes both claim one address (an IP moved between nodes and the
//! old node has not withdrawn it yet) each keeps its own claim locally; the
//! store holds the last writer's.
//!
//! After a restart, this node's entries found in the store at the first
//! listing with no claim yet are adopted as LOCAL_ENDPOINT claims for
//! [`IpCacheOptions::restore_grace`] (svc-endpoint replays its endpoints
//! when it sees the new boot id); those not claimed again by then are
//! withdrawn, locally and from the store. So a restart of svc-identity
//! neither blinks remote nodes' view of this node's pods nor leaks entries.
//!
//! After a restart this node's store entries may still be bound to the
//! previous process's lease (a crash leaves it to its TTL): the first pass
//! after the first listing writes every claim again, on this process's
//! lease, so the old lease expiring takes nothing that is still claimed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use ipnet::IpNet;
use rivet_common::controller::Progress;
use tokio::time::Instant;

use super::{IpCache, IpcacheEntry, IpcacheSource, State, parse_prefix, store_ip};

use crate::backend::{BackendError, IpEntry, IpEvent};
use crate::events::{self, KeyAction, RestoredCause, RestoredKind, StoreKey};
use crate::store_watch;

/// Store writes in flight at once for one batch.
const STORE_CONCURRENCY: usize = 16;

/// How far the reconcile passes got.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct PublishProgress {
    /// The generation of the LOCAL_ENDPOINT claims the last pass started from.
    attempted: u64,
    /// Why that pass could not reconcile everything, `None` when it did.
    error: Option<String>,
}

/// An entry to write to the store, and what the write is to it (`None`:
/// written again unchanged).
type StoreWrite = (IpNet, IpEntry, Option<KeyAction>);

impl IpCache {
    /// Whether the store is known to be unreachable: the last pass or the
    /// last listing/watch failed.
    fn store_unreachable(&self) -> bool {
        self.watch_failed.load(Ordering::Acquire) || self.progress.borrow().error.is_some()
    }

    /// Has the claims of `generation` published: unless the store is known
    /// to be unreachable, starts a pass and waits for it (at most
    /// [`IpCacheOptions::publish_wait`]); else leaves them to the pass that
    /// runs when it is back.
    pub(super) async fn publish(&self, generation: u64) {
        if self.store_unreachable() {
            return;
        }
        let mut rx = self.progress.subscribe();
        self.reconcile.trigger();
        let _ = tokio::time::timeout(self.opts.publish_wait, rx.wait_for(|p| p.attempted >= generation)).await;
    }

    /// Why the last publishing pass failed, `None` when it succeeded.
    pub fn publish_error(&self) -> Option<String> {
        self.progress.borrow().error.clone()
    }

    /// This node's entries not yet as desired in the store: claims to
    /// publish and entries to withdraw (0 once reconciled).
    pub fn pending_writes(&self) -> usize {
        let st = self.lock();
        let desired = self.desired(&st);
        let writes = desired
            .iter()
            .filter(|(p, e)| st.own_in_store.get(p) != Some(e))
            .count();
        let withdrawals = st.own_in_store.keys().filter(|p| !desired.contains_key(p)).count();
        writes + withdrawals
    }

    /// The store entries the LOCAL_ENDPOINT claims want.
    pub(super) fn desired(&self, st: &State) -> BTreeMap<IpNet, IpEntry> {
        st.claims
            .iter()
            .filter_map(|(p, c)| {
                c.get(&IpcacheSource::LocalEndpoint)
                    .map(|e| (*p, Self::store_entry(e, &self.opts.node_name)))
            })
            .collect()
    }

    /// Writes store entries (some concurrently), each with what the write
    /// is to the store (created, updated, or `None`: rewritten unchanged);
    /// what succeeded is recorded as held by the store and counted, the
    /// first failure is returned.
    async fn write_store(&self, writes: Vec<StoreWrite>) -> Result<(), BackendError> {
        let results: Vec<Result<StoreWrite, BackendError>> = futures::stream::iter(writes)
            .map(|(p, e, action)| async move { self.backend.upsert_ip(&e).await.map(|()| (p, e, action)) })
            .buffer_unordered(STORE_CONCURRENCY)
            .collect()
            .await;
        let (mut created, mut updated) = (0, 0);
        let mut first_error = None;
        {
            let mut st = self.lock();
            for r in results {
                match r {
                    Ok((p, e, action)) => {
                        st.own_in_store.insert(p, e);
                        match action {
                            Some(KeyAction::Created) => created += 1,
                            Some(_) => updated += 1,
                            None => {}
                        }
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let m = &self.opts.metrics;
        events::keys_reconciled(m, StoreKey::Ip, KeyAction::Created, created);
        events::keys_reconciled(m, StoreKey::Ip, KeyAction::Updated, updated);
        if created + updated > 0 {
            self.snapshot_part.changed();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Deletes this node's store entries, like [`write_store`](Self::write_store).
    async fn withdraw_store(&self, prefixes: Vec<IpNet>) -> Result<(), BackendError> {
        let results: Vec<Result<IpNet, BackendError>> = futures::stream::iter(prefixes)
            .map(|p| async move { self.backend.delete_ip(&store_ip(&p)).await.map(|()| p) })
            .buffer_unordered(STORE_CONCURRENCY)
            .collect()
            .await;
        let mut deleted = 0;
        let mut first_error = None;
        {
            let mut st = self.lock();
            for r in results {
                match r {
                    Ok(p) => {
                        st.own_in_store.remove(&p);
                        st.restored_withdrawals.remove(&p);
                        deleted += 1;
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        events::keys_reconciled(&self.opts.metrics, StoreKey::Ip, KeyAction::Deleted, deleted);
        if deleted > 0 {
            self.snapshot_part.changed();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Keeps the KVSTORE claims equal to the other nodes' store entries:
    /// list, watch from the listing's revision, re-list on any error.
    pub(super) async fn watch_store(self: Arc<Self>, progress: Progress) -> Result<(), BackendError> {
        let result = self.list_and_watch(&progress).await;
        self.watch_failed.store(true, Ordering::Release);
        result
    }

    async fn list_and_watch(&self, progress: &Progress) -> Result<(), BackendError> {
        store_watch::list_then_watch(
            progress,
            self.backend.list_ips(),
            |revision| self.backend.watch_ips(revision),
            |entries, revision| {
                self.snapshot_part.set_store_revision(revision);
                self.apply_listing(entries);
                self.watch_failed.store(false, Ordering::Release);
            },
            |event| self.apply_event(event),
        )
        .await
    }

    fn apply_listing(&self, entries: Vec<IpEntry>) {
        let me = &self.opts.node_name;
        let mut others: BTreeMap<IpNet, IpcacheEntry> = BTreeMap::new();
        let mut own: BTreeMap<IpNet, IpEntry> = BTreeMap::new();
        for e in entries {
            let prefix = match parse_prefix(&e.ip) {
                Ok(p) => p,
                Err(reason) => {
                    tracing::warn!(ip = %e.ip, node = %e.node, %reason, "skipping an unusable IP cache entry of the store");
                    continue;
                }
            };
            if e.identity == 0 {
                tracing::warn!(ip = %e.ip, node = %e.node, "skipping a store entry with identity 0");
                continue;
            }
            if &e.node == me {
                own.insert(prefix, e);
            } else {
                others.insert(prefix, Self::claim_from_store(prefix, &e, IpcacheSource::KvStore));
            }
        }
        let mut st = self.lock();
        let stale: Vec<IpNet> = st
            .claims
            .iter()
            .filter(|(p, c)| c.contains_key(&IpcacheSource::KvStore) && !others.contains_key(p))
            .map(|(p, _)| *p)
            .collect();
        for prefix in stale {
            self.update(&mut st, prefix, |c| {
                c.remove(&IpcacheSource::KvStore);
            });
        }
        let remote = others.len();
        for (prefix, entry) in others {
            self.update(&mut st, prefix, |c| {
                c.insert(IpcacheSource::KvStore, entry);
            });
        }
        let mut adopted = 0;
        if !st.listed {
            st.listed = true;
            // This process's lease may not be the one the store's entries
            // are bound to (a restart): the first pass writes every claim.
            st.republish_pending = true;
            let withdrawn = std::mem::take(&mut st.restored_withdrawals);
            for (prefix, e) in &own {
                let claimed = st
                    .claims
                    .get(prefix)
                    .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint));
                // Withdrawn here before the restart, or svc-endpoint ended
                // its replay without it: the pass withdraws it.
                if !claimed && !withdrawn.contains(prefix) && !st.replay_ended {
                    let entry = Self::claim_from_store(*prefix, e, IpcacheSource::LocalEndpoint);
                    self.update(&mut st, *prefix, |c| {
                        c.insert(IpcacheSource::LocalEndpoint, entry);
                    });
                    st.restored.insert(*prefix);
                    adopted += 1;
                }
            }
            if adopted > 0 {
                st.restore_deadline = Some(Instant::now() + self.opts.restore_grace);
            }
        }
        tracing::info!(
            remote,
            own = own.len(),
            adopted,
            revision = st.revision,
            "IP cache listed from the store"
        );
        st.own_in_store = own;
        drop(st);
        self.snapshot_part.changed();
        self.ready.send_replace(true);
        self.reconcile.trigger();
    }

    fn apply_event(&self, event: IpEvent) {
        let me = &self.opts.node_name;
        let mut st = self.lock();
        match event {
            IpEvent::Upsert(e) => {
                let Ok(prefix) = parse_prefix(&e.ip) else {
                    tracing::warn!(ip = %e.ip, node = %e.node, "skipping an unusable IP cache event");
                    return;
                };
                if &e.node == me {
                    st.own_in_store.insert(prefix, e);
                    // The key holds this node's entry now, no other node's.
                    self.update(&mut st, prefix, |c| {
                        c.remove(&IpcacheSource::KvStore);
                    });
                } else {
                    st.own_in_store.remove(&prefix);
                    if st
                        .claims
                        .get(&prefix)
                        .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint))
                    {
                        tracing::warn!(
                            prefix = %prefix,
                            node = %e.node,
                            "another node published an address an endpoint of this node claims; the local claim stays effective here"
                        );
                    }
                    let entry = Self::claim_from_store(prefix, &e, IpcacheSource::KvStore);
                    self.update(&mut st, prefix, |c| {
                        c.insert(IpcacheSource::KvStore, entry);
                    });
                }
            }
            IpEvent::Delete { ip } => {
                let Ok(prefix) = parse_prefix(&ip) else {
                    return;
                };
                st.own_in_store.remove(&prefix);
                self.update(&mut st, prefix, |c| {
                    c.remove(&IpcacheSource::KvStore);
                });
                if st
                    .claims
                    .get(&prefix)
                    .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint))
                {
                    // The store lost an entry this node claims (lease
                    // expired, another node's delete): publish it again.
                    self.reconcile.trigger();
                }
            }
        }
        drop(st);
        self.snapshot_part.changed();
    }

    /// One publish pass (see [`reconcile_once`](Self::reconcile_once)),
    /// after dropping the restored claims whose grace ended; the next one
    /// in a resync interval, or when the grace ends if that is sooner.
    pub(super) async fn publish_pass(self: Arc<Self>) -> Result<Duration, BackendError> {
        if self.lock().restore_deadline.is_some_and(|d| d <= Instant::now()) {
            self.expire_restored();
        }
        self.reconcile_once().await?;
        let resync = self.opts.resync_interval;
        Ok(match self.lock().restore_deadline {
            Some(deadline) => resync.min(deadline.saturating_duration_since(Instant::now())),
            None => resync,
        })
    }

    /// Every claim is to be written again (on a replaced node lease).
    pub(super) fn republish(&self) {
        tracing::info!("node lease replaced; publishing this node's IP cache entries again");
        self.lock().republish_pending = true;
        self.reconcile.trigger();
    }

    /// Drops the restored claims nobody claimed again.
    fn expire_restored(&self) {
        let mut st = self.lock();
        st.restore_deadline = None;
        st.local_generation += 1;
        let expired = std::mem::take(&mut st.restored);
        for prefix in &expired {
            self.update(&mut st, *prefix, |c| {
                c.remove(&IpcacheSource::LocalEndpoint);
            });
        }
        drop(st);
        events::restored_released(
            &self.opts.metrics,
            RestoredKind::IpClaims,
            RestoredCause::GraceEnded,
            expired.len(),
        );
    }

    /// One pass: every LOCAL_ENDPOINT claim is in the store (all written
    /// again with `republish`), and this node's store entries no claim backs
    /// are withdrawn (once the store was listed). Only the publish loop runs
    /// it, so passes never overlap; its outcome is recorded in `progress`.
    async fn reconcile_once(&self) -> Result<(), BackendError> {
        let (writes, withdraw, generation, republished) = {
            let st = self.lock();
            let republish = st.republish_pending;
            let desired = self.desired(&st);
            let withdraw: Vec<IpNet> = if st.listed {
                st.own_in_store
                    .keys()
                    .filter(|p| !desired.contains_key(p))
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            let writes: Vec<StoreWrite> = desired
                .into_iter()
                .filter_map(|(p, e)| {
                    let action = match st.own_in_store.get(&p) {
                        None => Some(KeyAction::Created),
                        Some(held) if *held != e => Some(KeyAction::Updated),
                        Some(_) => None,
                    };
                    (republish || action.is_some()).then_some((p, e, action))
                })
                .collect();
            (writes, withdraw, st.local_generation, republish)
        };
        if !writes.is_empty() || !withdraw.is_empty() {
            tracing::info!(
                publish = writes.len(),
                withdraw = withdraw.len(),
                "syncing this node's IP cache entries to the store"
            );
        }
        let written = self.write_store(writes).await;
        let withdrawn = self.withdraw_store(withdraw).await;
        let result = written.and(withdrawn);
        if republished && result.is_ok() {
            self.lock().republish_pending = false;
        }
        self.progress.send_replace(PublishProgress {
            attempted: generation,
            error: result
                .as_ref()
                .err()
                .map(|e| format!("publishing this node's IP cache entries: {e}")),
        });
        result
    }
}

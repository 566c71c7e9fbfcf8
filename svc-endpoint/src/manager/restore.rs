//! Restore on start: the state dir's endpoints back in the table, their
//! addresses re-reserved, everything regenerated, leftovers removed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use tonic::{Code, Status};

use super::interfaces::listed_interface;
use super::queue::{Queue, RemovalReason};
use super::{EndpointManager, RegenError, Slot, ipam_owner};
use crate::endpoint::{EndpointState, EndpointStatus, IDENTITY_OWNER_PREFIX, RegenerationStep, identity_owner};
use crate::events;

/// How long restore waits for the identity snapshot and CIDR identities.
const RESTORE_INPUTS_WAIT: Duration = Duration::from_secs(30);

/// Restore progress.
#[derive(Debug, Clone, Default)]
pub struct RestoreProgress {
    /// Whether restore finished.
    pub complete: bool,
    /// State dirs found.
    pub found: u32,
    /// Regenerated and ready.
    pub restored: u32,
    /// Dropped (interface gone) and cleaned up.
    pub dropped: u32,
    /// Failed (kept, retried in the background).
    pub failed: u32,
    /// Start.
    pub started: Option<SystemTime>,
    /// End.
    pub finished: Option<SystemTime>,
}

impl EndpointManager {
    /// Restore progress.
    pub fn restore_progress(&self) -> RestoreProgress {
        self.inner.restore.lock().expect("restore lock poisoned").clone()
    }

    /// Waits until restore finished.
    pub async fn restored(&self) {
        let mut rx = self.inner.restore_done.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// Restore on start (the seed's restoreOldEndpoints): state dirs →
    /// endpoints; drop those whose interface is gone; re-reserve addresses;
    /// regenerate all; remove datapath entries and identity references no
    /// endpoint owns.
    pub(super) async fn restore(&self) {
        let started = Instant::now();
        {
            let mut progress = self.inner.restore.lock().expect("restore lock poisoned");
            progress.started = Some(SystemTime::now());
        }
        let state_dir = self.inner.state_dir.clone();
        let scan = match tokio::task::spawn_blocking(move || state_dir.scan()).await {
            Ok(Ok(scan)) => scan,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "reading the endpoint state dir failed; starting without restored endpoints");
                Default::default()
            }
            Err(e) => {
                tracing::error!(error = %e, "reading the endpoint state dir panicked");
                Default::default()
            }
        };
        let found = u32::try_from(scan.records.len()).unwrap_or(u32::MAX);
        tracing::info!(found, unreadable = scan.unreadable.len(), "restoring endpoints");
        let mut queues = Vec::new();
        {
            let mut state = self.state();
            for (id, reason) in &scan.unreadable {
                tracing::error!(
                    endpoint = id,
                    reason,
                    "endpoint state unreadable; its id stays reserved"
                );
                state.reserved_ids.insert(*id);
            }
            for (id, (record, source)) in scan.records {
                let mut status = EndpointStatus::new(EndpointState::Restoring, &format!("restored from {source:?}"));
                status.identity = record.identity;
                status.identity_labels = record.identity_labels.clone();
                // Its worker removes it at once if asked; regenerations wait
                // until restore released it below.
                let queue = Queue::new(true, true);
                self.spawn_worker(id, queue.clone());
                queues.push((id, queue.clone()));
                state.next_id = state.next_id.max(id.wrapping_add(1)).max(1);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec: record.spec.clone(),
                        status,
                        queue,
                        persisted: Some(record),
                        resolving: None,
                    },
                );
            }
            // Peers' named ports before any regeneration: an endpoint
            // restored before the peers whose ports its rules name would
            // otherwise lose those entries until they regenerated.
            let identities: Vec<u32> = state.endpoints.values().map(|s| s.status.identity).collect();
            let addresses: Vec<IpAddr> = state
                .endpoints
                .values()
                .flat_map(|s| s.spec.addresses.iter().map(|a| a.address))
                .collect();
            self.named_ports_changed(&mut state, identities, addresses, "named ports restored");
            self.update_state_metrics(&state);
        }
        self.inner.scanned.send_replace(true);
        self.inner.restore.lock().expect("restore lock poisoned").found = found;

        // The datapath's view: which restored endpoints lost their interface,
        // which ids it holds that no endpoint owns.
        let listed = self
            .retry_until_ok("svc-loader ListEndpoints", || self.inner.deps.loader.list())
            .await;
        let mut dropped = {
            let mut state = self.state();
            for held in &listed.endpoints {
                let Ok(id) = u16::try_from(held.endpoint_id) else {
                    continue;
                };
                if state
                    .endpoints
                    .get(&id)
                    .is_none_or(|slot| slot.spec.host_ifindex != held.host_ifindex)
                {
                    // Not ours (or moved): cleaned after restore; never reuse the id before.
                    state.reserved_ids.insert(id);
                }
            }
            for id in &listed.orphan_policy_endpoint_ids {
                if let Ok(id) = u16::try_from(*id) {
                    state.reserved_ids.insert(id);
                }
            }
            let held: Vec<_> = listed.endpoints.iter().map(listed_interface).collect();
            state.lost_interfaces(&held)
        };
        self.inner.ids_known.send_replace(true);

        // Restored endpoints keep their datapath; regenerating them against
        // an empty selector cache (or without the CIDR identities) would
        // briefly deny allowed peers.
        self.wait_for_policy_inputs(RESTORE_INPUTS_WAIT).await;

        // Re-reserve addresses and regenerate everything in parallel (the
        // regeneration semaphore bounds the datapath work).
        let pending: Vec<(u16, Arc<Queue>)> = queues
            .into_iter()
            .filter(|(id, _)| !dropped.iter().any(|(d, _)| d == id))
            .collect();
        let results: Vec<(u16, Result<(), RegenError>)> = futures::stream::iter(pending)
            .map(|(id, queue)| async move {
                if let Err(e) = self.restore_addresses(id).await {
                    tracing::error!(endpoint = id, error = %e, "re-reserving the endpoint's addresses failed");
                }
                let generation = queue.request("restored");
                queue.release_hold();
                (id, queue.wait(generation).await)
            })
            .buffer_unordered(64)
            .collect()
            .await;
        let (mut restored, mut failed) = (0u32, 0u32);
        for (id, result) in results {
            match result {
                Ok(()) => restored += 1,
                Err(e) if e.step == RegenerationStep::Datapath && e.status.code() == Code::NotFound => {
                    dropped.push((id, RemovalReason::InterfaceGone));
                }
                Err(e) if e.step == RegenerationStep::Datapath && e.status.code() == Code::FailedPrecondition => {
                    dropped.push((id, RemovalReason::InterfaceReplaced));
                }
                // Deleted (DeleteEndpoint) while restore waited: the delete
                // cleaned it; neither restored nor a failure.
                Err(e) if e.status.code() == Code::Aborted => {
                    tracing::info!(endpoint = id, "endpoint deleted during restore");
                }
                Err(e) => {
                    failed += 1;
                    tracing::error!(endpoint = id, error = %e, "restoring the endpoint failed; retrying in the background");
                }
            }
        }
        for (id, reason) in &dropped {
            if let Err(e) = self.remove_and_wait(*id, *reason, None).await {
                tracing::error!(endpoint = id, error = %e, "dropping a dead endpoint failed; retrying in the background");
            }
        }
        self.cleanup_leftovers().await;

        let took = started.elapsed();
        let dropped_count = u32::try_from(dropped.len()).unwrap_or(u32::MAX);
        {
            let mut progress = self.inner.restore.lock().expect("restore lock poisoned");
            progress.restored = restored;
            progress.dropped = dropped_count;
            progress.failed = failed;
            progress.finished = Some(SystemTime::now());
            progress.complete = true;
        }
        events::restore_finished(&self.inner.metrics, found, restored, dropped_count, failed, took);
        self.inner.restore_done.send_replace(true);
    }

    /// Waits (at most `limit`) for svc-identity's first identity snapshot
    /// and for the CIDR identities of the repository's policies.
    async fn wait_for_policy_inputs(&self, limit: Duration) {
        let started = Instant::now();
        let mut synced = self.inner.identities_synced.subscribe();
        if tokio::time::timeout(limit, synced.wait_for(|s| *s)).await.is_err() {
            tracing::warn!(waited = ?limit, "no identity snapshot from svc-identity yet; policies may lack peers until it arrives");
            return;
        }
        let mut backoff = self.inner.options.retry_backoff.clone();
        while let Err(e) = self.reconcile_cidrs(false).await {
            if started.elapsed() >= limit {
                tracing::warn!(error = %e, "CIDR identities not allocated yet; retrying in the background");
                self.inner.cidr_wake.notify_one();
                return;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    async fn retry_until_ok<T, F, Fut>(&self, what: &str, call: F) -> T
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut attempts = 0u32;
        loop {
            match call().await {
                Ok(value) => return value,
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_multiple_of(10) {
                        tracing::warn!(call = what, attempts, error = %e, "waiting for a dependency");
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    /// svc-ipam Restore for every address the endpoint got from svc-ipam.
    pub(super) async fn restore_addresses(&self, id: u16) -> Result<(), Status> {
        let Some((queue, spec)) = self
            .state()
            .endpoints
            .get(&id)
            .map(|s| (s.queue.clone(), s.spec.clone()))
        else {
            return Ok(());
        };
        for address in spec.addresses.iter().filter(|a| !a.ipam_pool.is_empty()) {
            let request = ipampb::RestoreRequest {
                owner: Some(ipam_owner(&spec)),
                pool: address.ipam_pool.clone(),
                address: address.address.to_string(),
            };
            // Each call holds the endpoint's lock, as a removal attempt does:
            // a concurrent DeleteEndpoint then completes either before (the
            // queue is closed and nothing is re-reserved) or after the call
            // (and the CNI releases the addresses only once its delete
            // returned). Without it a resync after a svc-ipam restart could
            // re-reserve the addresses of a pod the CNI had just deleted and
            // released: a leak. Never held across the retries' waits, so a
            // delete does not wait for svc-ipam to come back.
            self.retry_while_unavailable(|| async {
                let _serialised = queue.lock.lock().await;
                if queue.is_closed() {
                    return Ok(());
                }
                self.inner.deps.ipam.restore(request.clone()).await.map(drop)
            })
            .await?;
        }
        Ok(())
    }

    /// Retries while the dependency is unreachable; other errors return.
    async fn retry_while_unavailable<T, F, Fut>(&self, call: F) -> Result<T, Status>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            match call().await {
                Err(e) if e.code() == Code::Unavailable && Instant::now() < give_up => {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                other => return other,
            }
        }
    }

    /// Datapath entries, attachments and identity references that no
    /// endpoint owns.
    async fn cleanup_leftovers(&self) {
        let deps = &self.inner.deps;
        match deps.loader.list().await {
            Ok(listed) => {
                let owned: BTreeMap<u16, u32> = self
                    .state()
                    .endpoints
                    .values()
                    .map(|s| (s.spec.id, s.spec.host_ifindex))
                    .collect();
                let mut removals = Vec::new();
                for held in &listed.endpoints {
                    let id = u16::try_from(held.endpoint_id).ok();
                    if id.and_then(|id| owned.get(&id)) != Some(&held.host_ifindex) {
                        removals.push((held.endpoint_id, held.host_ifindex, "endpoint entry"));
                    }
                }
                for orphan in &listed.orphan_attachments {
                    removals.push((0, orphan.host_ifindex, "attachment"));
                }
                for id in &listed.orphan_policy_endpoint_ids {
                    if !u16::try_from(*id).is_ok_and(|id| owned.contains_key(&id)) {
                        removals.push((*id, 0, "policy entries"));
                    }
                }
                for (endpoint_id, host_ifindex, what) in removals {
                    match deps
                        .loader
                        .remove(ldpb::RemoveEndpointRequest {
                            endpoint_id,
                            host_ifindex,
                        })
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(
                                endpoint_id,
                                host_ifindex,
                                what,
                                "removed a datapath leftover no endpoint owns"
                            );
                            if let Ok(id) = u16::try_from(endpoint_id) {
                                self.state().reserved_ids.remove(&id);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(endpoint_id, host_ifindex, what, error = %e, "removing a datapath leftover failed")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing the datapath for leftovers failed"),
        }
        match deps
            .identity
            .list(idpb::ListIdentitiesRequest {
                local_only: true,
                include_owners: true,
                ..Default::default()
            })
            .await
        {
            Ok(listed) => {
                let owners: BTreeSet<String> = self.state().endpoints.keys().map(|id| identity_owner(*id)).collect();
                let stale: BTreeSet<String> = listed
                    .identities
                    .iter()
                    .flat_map(|i| i.owners.iter())
                    .filter(|o| o.starts_with(IDENTITY_OWNER_PREFIX) && !owners.contains(*o))
                    .cloned()
                    .collect();
                for owner in stale {
                    match deps
                        .identity
                        .release(idpb::ReleaseIdentityRequest {
                            id: 0,
                            owner: owner.clone(),
                        })
                        .await
                    {
                        Ok(_) => tracing::info!(owner, "released identity references of a gone endpoint"),
                        Err(e) => tracing::warn!(owner, error = %e, "releasing stale identity references failed"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing identity owners for leftovers failed"),
        }
    }
}

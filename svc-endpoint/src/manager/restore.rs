//! Restore on start: the state dir's endpoints back in the table, their
//! addresses re-reserved, everything regenerated, leftovers removed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use rivet_common::controller::Action;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use tonic::{Code, Status};

use super::error::FailureKind;
use super::interfaces::listed_interface;
use super::queue::Queue;
use super::{EndpointManager, RegenError, Slot, ipam_owner};
use crate::endpoint::{EndpointState, EndpointStatus, IDENTITY_OWNER_PREFIX, identity_owner};
use crate::events;

/// How long restore waits for the identity snapshot and CIDR identities.
const RESTORE_INPUTS_WAIT: Duration = Duration::from_secs(30);

/// How long restore retries while svc-ipam is unreachable before it
/// regenerates the endpoints without their addresses re-reserved.
const RESTORE_ADDRESSES_WAIT: Duration = Duration::from_secs(60);

/// Why a restore pass stopped (it runs again after a backoff).
#[derive(Debug, thiserror::Error)]
pub(super) enum RestoreError {
    /// svc-loader's listing is needed to know which endpoints are gone.
    #[error("listing svc-loader's endpoints: {}", .0.message())]
    ListDatapath(#[source] Status),
    /// svc-ipam is unreachable (retried for [`RESTORE_ADDRESSES_WAIT`]).
    #[error("re-reserving the addresses of endpoint {id} with svc-ipam: {}", source.message())]
    ReserveAddresses {
        /// The endpoint.
        id: u16,
        /// svc-ipam's answer.
        #[source]
        source: Status,
    },
}

/// Restore progress.
#[derive(Debug, Clone, Default)]
pub struct RestoreProgress {
    /// Whether restore finished.
    pub complete: bool,
    /// State dirs found.
    pub found: u32,
    /// Regenerated and ready.
    pub restored: u32,
    /// Dropped (interface or pod gone) and cleaned up; in Kubernetes mode
    /// also those `pod-check` dropped after restore.
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

    /// `endpoint-restore`, once on start (the seed's restoreOldEndpoints):
    /// state dirs → endpoints; drop those whose interface is gone;
    /// re-reserve addresses; regenerate all; remove datapath entries and
    /// identity references no endpoint owns. An error (svc-loader or
    /// svc-ipam unreachable) runs the pass again after a backoff; the
    /// state dir is read by the first pass only (deletes may remove
    /// endpoints once it did), later passes take the restored endpoints
    /// from the table.
    pub(super) async fn restore(&self) -> Result<Action, RestoreError> {
        let started = *self
            .inner
            .restore
            .lock()
            .expect("restore lock poisoned")
            .started
            .get_or_insert_with(SystemTime::now);
        if !*self.inner.scanned.borrow() {
            self.restore_state_dir().await;
        }

        // The datapath's view: which restored endpoints lost their interface,
        // which ids it holds that no endpoint owns.
        let listed = self
            .inner
            .deps
            .loader
            .list()
            .await
            .map_err(RestoreError::ListDatapath)?;
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
        // Kubernetes mode: pods deleted while svc-endpoint was down.
        let pods_gone = self.pods_gone_at_restore(&dropped).await;
        dropped.extend(pods_gone);

        // Restored endpoints keep their datapath; regenerating them against
        // an empty selector cache (or without the CIDR identities) would
        // briefly deny allowed peers.
        self.wait_for_policy_inputs(RESTORE_INPUTS_WAIT).await;

        // The restored endpoints not regenerated yet.
        let pending: Vec<(u16, Arc<Queue>)> = self
            .state()
            .endpoints
            .iter()
            .filter(|(id, slot)| {
                slot.status.state == EndpointState::Restoring
                    && !slot.queue.is_closed()
                    && !dropped.iter().any(|(d, _)| d == *id)
            })
            .map(|(id, slot)| (*id, slot.queue.clone()))
            .collect();
        // Their addresses first, so svc-ipam does not hand them out again;
        // while svc-ipam is unreachable the pass is retried, for a while.
        let ids: Vec<u16> = pending.iter().map(|(id, _)| *id).collect();
        let reserved: Vec<(u16, Result<(), Status>)> = futures::stream::iter(ids)
            .map(|id| async move { (id, self.restore_addresses(id).await) })
            .buffer_unordered(64)
            .collect()
            .await;
        for (id, result) in reserved {
            match result {
                Err(e)
                    if e.code() == Code::Unavailable
                        && started.elapsed().unwrap_or_default() < RESTORE_ADDRESSES_WAIT =>
                {
                    return Err(RestoreError::ReserveAddresses { id, source: e });
                }
                Err(e) => {
                    tracing::error!(endpoint = id, error = %e, "re-reserving the endpoint's addresses failed")
                }
                Ok(()) => {}
            }
        }

        // Regenerate everything in parallel (the regeneration semaphore
        // bounds the datapath work).
        let results: Vec<(u16, Result<(), RegenError>)> = futures::stream::iter(pending)
            .map(|(id, queue)| async move {
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
                Err(RegenError {
                    kind: FailureKind::InterfaceLost(reason),
                    ..
                }) => dropped.push((id, reason)),
                // Deleted (DeleteEndpoint) while restore waited: the delete
                // cleaned it; neither restored nor a failure.
                Err(RegenError {
                    kind: FailureKind::EndpointRemoved,
                    ..
                }) => {
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

        let took = started.elapsed().unwrap_or_default();
        let dropped_count = u32::try_from(dropped.len()).unwrap_or(u32::MAX);
        let found = {
            let mut progress = self.inner.restore.lock().expect("restore lock poisoned");
            progress.restored = restored;
            progress.dropped = dropped_count;
            progress.failed = failed;
            progress.finished = Some(SystemTime::now());
            progress.complete = true;
            progress.found
        };
        events::restore_finished(&self.inner.metrics, found, restored, dropped_count, failed, took);
        self.inner.restore_done.send_replace(true);
        Ok(Action::done())
    }

    /// The state dir's endpoints into the table, each with its worker and
    /// a queue that holds regenerations until restore releases it; the
    /// ids of unreadable ones reserved. (A pass that panicked in the
    /// middle left some in the table already: those are kept.)
    async fn restore_state_dir(&self) {
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
                if state.endpoints.contains_key(&id) {
                    continue;
                }
                let mut status = EndpointStatus::new(EndpointState::Restoring, &format!("restored from {source:?}"));
                status.identity = record.identity;
                status.identity_labels = record.identity_labels.clone();
                // Its worker removes it at once if asked; regenerations wait
                // until restore released it.
                let queue = Queue::new(true, true);
                self.spawn_worker(id, queue.clone());
                state.next_id = state.next_id.max(id.wrapping_add(1)).max(1);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec: record.spec.clone(),
                        status,
                        queue,
                        persisted: Some(record),
                        resolving: None,
                        changed: 0,
                        claimed_in: None,
                    },
                );
                state.changed(id);
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
        self.inner.restore.lock().expect("restore lock poisoned").found = found;
        self.inner.scanned.send_replace(true);
    }

    /// Waits (at most `limit`) for svc-identity's first identity snapshot
    /// and for the CIDR identities of the repository's policies (allocated
    /// by `cidr-identities`, which keeps retrying after the wait).
    async fn wait_for_policy_inputs(&self, limit: Duration) {
        let started = Instant::now();
        let mut synced = self.inner.identities_synced.subscribe();
        if tokio::time::timeout(limit, synced.wait_for(|s| *s)).await.is_err() {
            tracing::warn!(waited = ?limit, "no identity snapshot from svc-identity yet; policies may lack peers until it arrives");
            return;
        }
        if !self.cidrs_reconciled(limit.saturating_sub(started.elapsed())).await {
            tracing::warn!(waited = ?limit, "CIDR identities not allocated yet; retrying in the background");
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
                address: rivet_proto::net::address_bytes(address.address),
            };
            // Each call holds the endpoint's lock, as a removal attempt does:
            // a concurrent DeleteEndpoint then completes either before (the
            // queue is closed and nothing is re-reserved) or after the call
            // (and the CNI releases the addresses only once its delete
            // returned). Without it a resync after a svc-ipam restart could
            // re-reserve the addresses of a pod the CNI had just deleted and
            // released: a leak. Released before any retry (the passes of
            // restore and of the dependency probe retry), so a delete does
            // not wait for svc-ipam to come back.
            let _serialised = queue.lock.lock().await;
            if queue.is_closed() {
                return Ok(());
            }
            self.inner.deps.ipam.restore(request).await?;
        }
        Ok(())
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

//! The daemons svc-endpoint drives: the identity watch that feeds the
//! selector cache, boot-id probes, and the replay of desired state into
//! one that restarted.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use futures::StreamExt;
use rivet_common::controller::{Action, Progress};
use rivet_common::labels::Labels;
use tonic::Status;

use rivet_common::grpc::error_reason;

use super::service_pods::{RemotePod, remote_pod};
use super::{EndpointManager, RemoteNamedPorts};
use crate::endpoint::IDENTITY_OWNER_PREFIX;
use crate::events;
use rivet_policy::{NamedPort, Protocol};
use rivet_proto::identity::v1 as idpb;

/// What an ipcache entry says of another node's pod's named ports: `None`
/// for an entry that is no host address; `Some((address, None))` for one
/// that holds none of another node's (so whatever was held goes).
/// Local endpoints' own entries are left to the endpoints themselves.
fn remote_named_ports(entry: &idpb::IpcacheEntry) -> Option<(IpAddr, Option<RemoteNamedPorts>)> {
    let net = rivet_proto::net::prefix_from_proto(entry.prefix.as_ref()?).ok()?;
    if net.prefix_len() != net.max_prefix_len() {
        return None;
    }
    let local = entry.source == idpb::IpcacheSource::LocalEndpoint as i32;
    let ports: Vec<NamedPort> = entry
        .named_ports
        .iter()
        .filter_map(|p| {
            let protocol = match p.protocol.as_str() {
                "TCP" => Protocol::Tcp,
                "UDP" => Protocol::Udp,
                "SCTP" => Protocol::Sctp,
                _ => return None,
            };
            let port = u16::try_from(p.port).ok().filter(|p| *p != 0)?;
            Some(NamedPort::new(p.name.clone(), protocol, port))
        })
        .collect();
    let remote = (!local && !ports.is_empty()).then_some(RemoteNamedPorts {
        identity: entry.identity,
        ports,
    });
    Some((net.addr(), remote))
}

/// The identities and addresses whose named ports `entries` may change.
fn touched<'a>(entries: impl Iterator<Item = (&'a IpAddr, &'a RemoteNamedPorts)>) -> (Vec<u32>, Vec<IpAddr>) {
    entries.map(|(address, remote)| (remote.identity, *address)).unzip()
}

/// svc-endpoint's view of a dependency.
#[derive(Debug, Clone, Default)]
pub struct DependencyStatus {
    /// "svc-identity", ...
    pub name: &'static str,
    /// Answered the last probe.
    pub connected: bool,
    /// Its boot id as last seen.
    pub seen_boot_id: String,
    /// Last replay of desired state after a new boot id.
    pub last_resync: Option<SystemTime>,
    /// Last probe or replay error.
    pub last_error: String,
    /// It restarted and the replay of desired state into it has not
    /// succeeded yet (retried by every probe until it does).
    pub resync_owed: bool,
}

/// Why a pass of `identity-watch` or `dependency-probe` failed (it runs
/// again after a backoff).
#[derive(Debug, thiserror::Error)]
pub(super) enum DependencyError {
    /// svc-identity did not open the identity watch.
    #[error("opening svc-identity's identity watch: {}", .0.message())]
    WatchOpen(#[source] Status),
    /// The identity watch broke.
    #[error("svc-identity's identity watch broke: {}", .0.message())]
    WatchBroken(#[source] Status),
    /// svc-identity did not open the ipcache watch.
    #[error("opening svc-identity's ipcache watch: {}", .0.message())]
    IpcacheWatchOpen(#[source] Status),
    /// The ipcache watch broke.
    #[error("svc-identity's ipcache watch broke: {}", .0.message())]
    IpcacheWatchBroken(#[source] Status),
    /// svc-identity did not take the end of the replay.
    #[error("ending the replay of the endpoints' claims to svc-identity boot {boot_id}: {}", source.message())]
    EndReplay {
        /// The boot replayed to.
        boot_id: String,
        /// svc-identity's answer.
        #[source]
        source: Status,
    },
    /// A restarted svc-ipam did not take an endpoint's addresses back.
    #[error("re-reserving the addresses of endpoint {id} in the restarted svc-ipam: {}", source.message())]
    ReserveAddresses {
        /// The endpoint.
        id: u16,
        /// svc-ipam's answer.
        #[source]
        source: Status,
    },
}

/// A daemon svc-endpoint drives; its index in [`Dependency::ALL`] is its
/// status's in the manager's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dependency {
    Identity,
    Ipam,
    Loader,
}

impl Dependency {
    /// Every dependency, in the order of the status table.
    pub(super) const ALL: [Dependency; 3] = [Dependency::Identity, Dependency::Ipam, Dependency::Loader];

    /// Its daemon's name.
    pub(super) fn name(self) -> &'static str {
        match self {
            Dependency::Identity => "svc-identity",
            Dependency::Ipam => "svc-ipam",
            Dependency::Loader => "svc-loader",
        }
    }

    /// Its status's place in the manager's table.
    fn index(self) -> usize {
        self as usize
    }
}

impl EndpointManager {
    /// The dependencies as last probed.
    pub fn dependencies(&self) -> Vec<DependencyStatus> {
        self.inner
            .dependencies
            .lock()
            .expect("dependency lock poisoned")
            .to_vec()
    }

    /// `identity-watch`: keeps the selector cache current from
    /// svc-identity's identity stream; returns when the stream breaks or
    /// ends (the controller opens it again after a backoff).
    pub(super) async fn watch_identities(&self, progress: Progress) -> Result<(), DependencyError> {
        let mut stream = self
            .inner
            .deps
            .identity
            .watch()
            .await
            .map_err(DependencyError::WatchOpen)?;
        let mut snapshot: Vec<(u32, Labels)> = Vec::new();
        while let Some(message) = stream.next().await {
            let message = message.map_err(DependencyError::WatchBroken)?;
            progress.ok();
            let parsed = message
                .added
                .iter()
                .filter_map(|i| match Labels::parse(&i.labels) {
                    Ok(labels) => Some((i.id, labels)),
                    Err(e) => {
                        tracing::warn!(identity = i.id, error = %e, "ignoring an identity with invalid labels");
                        None
                    }
                })
                .collect::<Vec<_>>();
            if message.snapshot {
                snapshot.extend(parsed);
                if !message.snapshot_complete {
                    continue;
                }
                let mut state = self.state();
                state.selectors.replace_identities(std::mem::take(&mut snapshot));
                self.queue_changed_policies(&mut state, "identities resynced");
                state.pods_changed();
                drop(state);
                self.inner.identities_synced.send_replace(true);
                continue;
            }
            let mut state = self.state();
            let mut changed = false;
            for (id, labels) in parsed {
                changed |= state.selectors.upsert_identity(id, labels);
            }
            for id in &message.removed {
                changed |= state.selectors.remove_identity(*id);
            }
            if changed {
                self.queue_changed_policies(&mut state, "identities changed");
                state.pods_changed();
            }
        }
        Ok(())
    }

    /// `ipcache-watch`: keeps the named ports of other nodes' pods (their
    /// ipcache entries) in the selector cache, so that egress rules naming
    /// a port resolve against them as on one node; regenerates the
    /// endpoints whose policies that changes. A snapshot (every new stream,
    /// so also after either daemon restarted) replaces what was held;
    /// returns when the stream breaks or ends.
    pub(super) async fn watch_ipcache(&self, progress: Progress) -> Result<(), DependencyError> {
        let mut stream = self
            .inner
            .deps
            .identity
            .watch_ipcache()
            .await
            .map_err(DependencyError::IpcacheWatchOpen)?;
        let mut snapshot: BTreeMap<IpAddr, RemoteNamedPorts> = BTreeMap::new();
        let mut pods_snapshot: BTreeMap<IpAddr, RemotePod> = BTreeMap::new();
        while let Some(message) = stream.next().await {
            let message = message.map_err(DependencyError::IpcacheWatchBroken)?;
            progress.ok();
            if message.snapshot {
                snapshot.extend(message.upserted.iter().filter_map(|e| {
                    let (address, remote) = remote_named_ports(e)?;
                    Some((address, remote?))
                }));
                pods_snapshot.extend(message.upserted.iter().filter_map(|e| {
                    let (address, pod) = remote_pod(e)?;
                    Some((address, pod?))
                }));
                if !message.snapshot_complete {
                    continue;
                }
                let mut state = self.state();
                let pods = std::mem::take(&mut pods_snapshot);
                if state.remote_pods != pods {
                    state.remote_pods = pods;
                    state.pods_changed();
                }
                self.inner.ipcache_synced.send_replace(true);
                let held = std::mem::replace(&mut state.remote_named_ports, std::mem::take(&mut snapshot));
                let (identities, addresses) = touched(held.iter().chain(state.remote_named_ports.iter()));
                if held != state.remote_named_ports {
                    self.named_ports_changed(&mut state, identities, addresses, "remote named ports resynced");
                }
                continue;
            }
            let mut state = self.state();
            let pod_changes: Vec<(IpAddr, Option<RemotePod>)> = message
                .upserted
                .iter()
                .filter_map(remote_pod)
                .chain(message.deleted.iter().filter_map(|p| {
                    let net = rivet_proto::net::prefix_from_proto(p).ok()?;
                    (net.prefix_len() == net.max_prefix_len()).then(|| (net.addr(), None))
                }))
                .collect();
            let mut pods_changed = false;
            for (address, pod) in pod_changes {
                let old = match pod.clone() {
                    Some(pod) => state.remote_pods.insert(address, pod),
                    None => state.remote_pods.remove(&address),
                };
                pods_changed |= old != pod;
            }
            if pods_changed {
                state.pods_changed();
            }
            let mut changes: Vec<(IpAddr, Option<RemoteNamedPorts>)> =
                message.upserted.iter().filter_map(remote_named_ports).collect();
            changes.extend(message.deleted.iter().filter_map(|p| {
                let net = rivet_proto::net::prefix_from_proto(p).ok()?;
                (net.prefix_len() == net.max_prefix_len()).then(|| (net.addr(), None))
            }));
            let mut touched_entries: Vec<(IpAddr, RemoteNamedPorts)> = Vec::new();
            for (address, remote) in changes {
                let old = match remote.clone() {
                    Some(remote) => state.remote_named_ports.insert(address, remote),
                    None => state.remote_named_ports.remove(&address),
                };
                if old != remote {
                    touched_entries.extend(old.into_iter().chain(remote).map(|r| (address, r)));
                }
            }
            if !touched_entries.is_empty() {
                let (identities, addresses) = touched(touched_entries.iter().map(|(a, r)| (a, r)));
                self.named_ports_changed(&mut state, identities, addresses, "remote named ports changed");
            }
        }
        Ok(())
    }

    /// `dependency-probe`, every `dependency_poll`: probes each
    /// dependency's boot id; a new one is owed a replay of everything it
    /// should hold (level-triggered resync, DESIGN.md §1), until a replay
    /// succeeded (a failed one is an error: retried after a backoff).
    pub(super) async fn probe_dependencies(&self) -> Result<Action, DependencyError> {
        let deps = &self.inner.deps;
        let (identity, ipam, loader) =
            futures::join!(deps.identity.boot_id(), deps.ipam.boot_id(), deps.loader.boot_id());
        let mut failed = None;
        for (dependency, result) in [
            (Dependency::Identity, identity),
            (Dependency::Ipam, ipam),
            (Dependency::Loader, loader),
        ] {
            let owed = {
                let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
                let dep = &mut all[dependency.index()];
                match result {
                    Ok(boot_id) => {
                        dep.connected = true;
                        dep.last_error.clear();
                        if !dep.seen_boot_id.is_empty() && dep.seen_boot_id != boot_id {
                            dep.resync_owed = true;
                        }
                        dep.seen_boot_id = boot_id;
                        dep.resync_owed
                    }
                    Err(e) => {
                        dep.connected = false;
                        dep.last_error = e.message().to_string();
                        false
                    }
                }
            };
            if owed && let Err(e) = self.resync(dependency).await {
                failed.get_or_insert(e);
            }
        }
        if let Err(e) = self.end_identity_replay().await {
            failed.get_or_insert(e);
        }
        match failed {
            None => Ok(Action::requeue(self.inner.options.dependency_poll)),
            Some(e) => Err(e),
        }
    }

    /// Once every endpoint claimed its identity reference and IP cache
    /// entries in svc-identity's current boot (after its restart, or this
    /// process's restore), tells it so with `EndReplay`, once per boot: it
    /// then drops at once what it restored and nobody claimed (a pod deleted
    /// just before or while it was down) instead of keeping it for its
    /// restore grace. An endpoint still to claim (a regeneration failing, as
    /// while svc-loader is down) holds the marker back, so no live entry
    /// ever goes; the grace stays the fallback.
    async fn end_identity_replay(&self) -> Result<(), DependencyError> {
        if !*self.inner.restore_done.borrow() {
            return Ok(());
        }
        let boot_id = {
            let all = self.inner.dependencies.lock().expect("dependency lock poisoned");
            let identity = &all[Dependency::Identity.index()];
            if !identity.connected || identity.resync_owed || identity.seen_boot_id.is_empty() {
                return Ok(());
            }
            identity.seen_boot_id.clone()
        };
        if self.inner.replay_ended.lock().expect("replay lock poisoned").as_deref() == Some(&boot_id) {
            return Ok(());
        }
        let endpoints = {
            let state = self.state();
            let live = state.endpoints.values().filter(|s| !s.queue.is_closed());
            let mut count = 0;
            for slot in live {
                if slot.claimed_in.as_deref() != Some(boot_id.as_str()) {
                    return Ok(());
                }
                count += 1;
            }
            count
        };
        let request = idpb::EndReplayRequest {
            boot_id: boot_id.clone(),
            owner_prefix: IDENTITY_OWNER_PREFIX.to_string(),
            ip_sources: vec![idpb::IpcacheSource::LocalEndpoint.into()],
        };
        match self.inner.deps.identity.end_replay(request).await {
            Ok(response) => {
                events::identity_replay_ended(
                    &self.inner.metrics,
                    &boot_id,
                    endpoints,
                    response.released_identities,
                    response.withdrawn_ip_claims,
                );
                *self.inner.replay_ended.lock().expect("replay lock poisoned") = Some(boot_id);
                Ok(())
            }
            // Restarted again: the next probe sees its boot id and replays.
            Err(status) if error_reason::<idpb::ErrorReason>(&status) == Some(idpb::ErrorReason::BootIdMismatch) => {
                tracing::info!(boot_id, error = %status.message(), "svc-identity restarted again before the replay ended");
                Ok(())
            }
            Err(source) => Err(DependencyError::EndReplay { boot_id, source }),
        }
    }

    /// Replays desired state into a restarted dependency.
    async fn resync(&self, dependency: Dependency) -> Result<(), DependencyError> {
        let ids: Vec<u16> = self.state().endpoints.keys().copied().collect();
        let mut result = Ok(());
        match dependency {
            Dependency::Identity => {
                // Node-local CIDR identities and every endpoint's reference
                // and ipcache entry live in svc-identity's memory.
                if let Err(e) = self.reconcile_cidrs(true).await {
                    tracing::warn!(error = %e, "replaying the CIDR identities failed; retrying in the background");
                    self.inner.cidr_reallocate.store(true, Ordering::SeqCst);
                    self.inner.cidr_wake.trigger();
                }
                self.request_all("svc-identity restarted");
            }
            Dependency::Loader => self.request_all("svc-loader restarted"),
            Dependency::Ipam => {
                for id in &ids {
                    if let Err(source) = self.restore_addresses(*id).await {
                        result = Err(DependencyError::ReserveAddresses { id: *id, source });
                    }
                }
            }
        }
        events::dependency_resynced(&self.inner.metrics, dependency.name(), ids.len());
        let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
        let status = &mut all[dependency.index()];
        status.last_resync = Some(SystemTime::now());
        match &result {
            Ok(()) => status.resync_owed = false,
            Err(e) => status.last_error = e.to_string(),
        }
        result
    }

    fn request_all(&self, reason: &str) {
        let state = self.state();
        for slot in state.endpoints.values().filter(|s| !s.queue.is_closed()) {
            slot.queue.request(reason);
        }
    }
}

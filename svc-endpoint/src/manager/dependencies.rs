//! The daemons svc-endpoint drives: the identity watch that feeds the
//! selector cache, boot-id probes, and the replay of desired state into
//! one that restarted.

use std::time::SystemTime;

use futures::StreamExt;
use rivet_common::labels::Labels;

use super::EndpointManager;
use crate::events;

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

    /// Keeps the selector cache current from svc-identity's identity stream.
    pub(super) async fn watch_identities(&self) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        loop {
            let mut stream = match self.inner.deps.identity.watch().await {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, "identity watch not established; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            let mut snapshot: Vec<(u32, Labels)> = Vec::new();
            while let Some(message) = stream.next().await {
                let message = match message {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::info!(error = %e, "identity watch ended; re-establishing");
                        break;
                    }
                };
                backoff.reset();
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
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Probes each dependency's boot id; a new one replays everything it
    /// should hold (level-triggered resync, DESIGN.md §1).
    pub(super) async fn probe_dependencies(&self) {
        let mut interval = tokio::time::interval(self.inner.options.dependency_poll);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let deps = &self.inner.deps;
            let (identity, ipam, loader) =
                futures::join!(deps.identity.boot_id(), deps.ipam.boot_id(), deps.loader.boot_id());
            for (dependency, result) in [
                (Dependency::Identity, identity),
                (Dependency::Ipam, ipam),
                (Dependency::Loader, loader),
            ] {
                let restarted = {
                    let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
                    let dep = &mut all[dependency.index()];
                    match result {
                        Ok(boot_id) => {
                            dep.connected = true;
                            dep.last_error.clear();
                            let restarted = !dep.seen_boot_id.is_empty() && dep.seen_boot_id != boot_id;
                            dep.seen_boot_id = boot_id;
                            restarted
                        }
                        Err(e) => {
                            dep.connected = false;
                            dep.last_error = e.message().to_string();
                            false
                        }
                    }
                };
                if restarted {
                    self.resync(dependency).await;
                }
            }
        }
    }

    /// Replays desired state into a restarted dependency.
    async fn resync(&self, dependency: Dependency) {
        let ids: Vec<u16> = self.state().endpoints.keys().copied().collect();
        let mut error = String::new();
        match dependency {
            Dependency::Identity => {
                // Node-local CIDR identities and every endpoint's reference
                // and ipcache entry live in svc-identity's memory.
                if let Err(e) = self.reconcile_cidrs(true).await {
                    error = format!("CIDR identities: {}", e.message());
                    self.inner.cidr_wake.notify_one();
                }
                self.request_all("svc-identity restarted");
            }
            Dependency::Loader => self.request_all("svc-loader restarted"),
            Dependency::Ipam => {
                for id in &ids {
                    if let Err(e) = self.restore_addresses(*id).await {
                        error = format!("endpoint {id}: {}", e.message());
                    }
                }
            }
        }
        events::dependency_resynced(&self.inner.metrics, dependency.name(), ids.len());
        let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
        let status = &mut all[dependency.index()];
        status.last_resync = Some(SystemTime::now());
        if !error.is_empty() {
            status.last_error = error;
        }
    }

    fn request_all(&self, reason: &str) {
        let state = self.state();
        for slot in state.endpoints.values().filter(|s| !s.queue.is_closed()) {
            slot.queue.request(reason);
        }
    }
}

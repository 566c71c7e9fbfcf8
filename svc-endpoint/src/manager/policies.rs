//! Policy changes and selector-cache changes, and which endpoints they
//! re-queue.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::MutexGuard;

use super::queue::Queue;
use super::{EndpointManager, ManagerError, State, store};
use crate::events;
use rivet_policy::{NamedPort, Policy, PolicyChange, PolicyError, PolicyKey, PolicyOrigin, StoredPolicy};

/// What the `--policy-dir` watcher did (see [`crate::policy_dir`]).
#[derive(Debug, Clone, Default)]
pub struct PolicyDirStatus {
    /// The directory; `None` without a watcher.
    pub dir: Option<std::path::PathBuf>,
    /// Scans completed.
    pub scans: u64,
    /// Files rejected, summed over the scans.
    pub files_rejected: u64,
    /// The last scan's problems, empty when it applied every file.
    pub last_error: String,
}

/// The policy origins a node accepts (`--policy-sources`, e.g.
/// `api,directory`). A policy of another origin is refused
/// (POLICY_ORIGIN_DISABLED) and nothing is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySources {
    api: bool,
    directory: bool,
    kubernetes: bool,
}

/// A `--policy-sources` value that names no origin or an unknown one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicySourcesError {
    /// An unknown name.
    #[error("unknown policy source {0:?} (expected api, directory or kubernetes)")]
    Unknown(String),
    /// Nothing named.
    #[error("no policy source named (expected a list of api, directory, kubernetes)")]
    Empty,
}

impl PolicySources {
    /// The default: `api,directory`, and `kubernetes` too in Kubernetes
    /// mode (files and the CLI stay useful for node-local policies).
    pub fn default_for(kubernetes_mode: bool) -> Self {
        Self {
            api: true,
            directory: true,
            kubernetes: kubernetes_mode,
        }
    }

    /// Parses a comma-separated list of `api`, `directory`, `kubernetes`.
    ///
    /// ```
    /// use svc_endpoint::manager::PolicySources;
    /// use rivet_policy::PolicyOrigin;
    ///
    /// let sources = PolicySources::parse("kubernetes, api")?;
    /// assert!(sources.accepts(PolicyOrigin::Api) && !sources.accepts(PolicyOrigin::Directory));
    /// assert!(PolicySources::parse("api,files").is_err());
    /// # Ok::<(), svc_endpoint::manager::PolicySourcesError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Self, PolicySourcesError> {
        let mut sources = Self {
            api: false,
            directory: false,
            kubernetes: false,
        };
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "api" => sources.api = true,
                "directory" => sources.directory = true,
                "kubernetes" => sources.kubernetes = true,
                other => return Err(PolicySourcesError::Unknown(other.to_string())),
            }
        }
        if sources.origins().is_empty() {
            return Err(PolicySourcesError::Empty);
        }
        Ok(sources)
    }

    /// Whether policies of `origin` are accepted.
    pub fn accepts(self, origin: PolicyOrigin) -> bool {
        match origin {
            PolicyOrigin::Api => self.api,
            PolicyOrigin::Directory => self.directory,
            PolicyOrigin::Kubernetes => self.kubernetes,
        }
    }

    /// The accepted origins, in declaration order.
    pub fn origins(self) -> Vec<PolicyOrigin> {
        [PolicyOrigin::Api, PolicyOrigin::Directory, PolicyOrigin::Kubernetes]
            .into_iter()
            .filter(|o| self.accepts(*o))
            .collect()
    }
}

impl std::fmt::Display for PolicySources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.origins().into_iter().map(PolicyOrigin::as_str).collect();
        f.write_str(&names.join(","))
    }
}

/// The outcome of a policy change.
#[derive(Debug, Clone)]
pub struct PolicyUpdate {
    /// What changed.
    pub change: PolicyChange,
    /// Endpoints whose policy the change affects.
    pub affected: usize,
    /// Their ids.
    pub endpoints: Vec<u16>,
    /// With `wait`: endpoints that realised the change.
    pub realised: usize,
}

impl State {
    /// Sets the named ports of each of `identities` and `addresses` in the
    /// selector cache to the union of those of the endpoints holding it and
    /// of other nodes' pods holding it (the ipcache), in one pass over the
    /// endpoints (endpoints of one identity share one peer
    /// entry in other endpoints' policies; egress ipBlocks naming a port
    /// resolve per address). Returns whether the ports of an address
    /// changed: the CIDR identities of the host prefixes they need
    /// ([`State::desired_cidrs`]) may have changed too.
    fn refresh_named_ports(
        &mut self,
        identities: impl IntoIterator<Item = u32>,
        addresses: impl IntoIterator<Item = IpAddr>,
    ) -> bool {
        let mut by_identity: BTreeMap<u32, Vec<NamedPort>> = identities
            .into_iter()
            .filter(|identity| *identity != 0)
            .map(|identity| (identity, Vec::new()))
            .collect();
        let mut by_address: BTreeMap<IpAddr, Vec<NamedPort>> =
            addresses.into_iter().map(|address| (address, Vec::new())).collect();
        for slot in self.endpoints.values() {
            let ports = &slot.spec.named_ports;
            if let Some(held) = by_identity.get_mut(&slot.status.identity) {
                held.extend_from_slice(ports);
            }
            for address in &slot.spec.addresses {
                if let Some(held) = by_address.get_mut(&address.address) {
                    held.extend_from_slice(ports);
                }
            }
        }
        for (address, remote) in &self.remote_named_ports {
            if let Some(held) = by_identity.get_mut(&remote.identity) {
                held.extend_from_slice(&remote.ports);
            }
            if let Some(held) = by_address.get_mut(address) {
                held.extend_from_slice(&remote.ports);
            }
        }
        for (identity, ports) in by_identity {
            self.selectors.set_named_ports(identity, ports);
        }
        let mut changed = false;
        for (address, ports) in by_address {
            changed |= self.selectors.set_address_named_ports(address, ports);
        }
        changed
    }
}

impl EndpointManager {
    /// The policy origins this node accepts.
    pub fn policy_sources(&self) -> PolicySources {
        self.inner.policy_sources
    }

    fn require_policy_source(&self, origin: PolicyOrigin) -> Result<(), ManagerError> {
        if self.inner.policy_sources.accepts(origin) {
            Ok(())
        } else {
            Err(ManagerError::PolicyOriginDisabled {
                origin,
                sources: self.inner.policy_sources,
            })
        }
    }

    /// Records a completed scan of the policy dir and the files it rejected
    /// (file, reason).
    pub fn policy_dir_scanned(&self, dir: &std::path::Path, rejected: &[(std::path::PathBuf, String)]) {
        events::policy_dir_scanned(&self.inner.metrics, dir, rejected);
        let mut status = self.inner.policy_dir.lock().expect("policy dir lock poisoned");
        status.dir = Some(dir.to_path_buf());
        status.scans += 1;
        status.files_rejected += rejected.len() as u64;
        status.last_error = rejected
            .iter()
            .map(|(file, reason)| format!("{}: {reason}", file.display()))
            .collect::<Vec<_>>()
            .join("; ");
    }

    /// What the policy dir watcher did.
    pub fn policy_dir_status(&self) -> PolicyDirStatus {
        self.inner.policy_dir.lock().expect("policy dir lock poisoned").clone()
    }

    /// Repository revision and policy count.
    pub fn policy_summary(&self) -> (u64, usize) {
        let state = self.state();
        (state.repository.revision(), state.repository.len())
    }

    /// Policies, ordered by key.
    pub fn policies(&self) -> (Vec<StoredPolicy>, u64) {
        let state = self.state();
        (state.repository.iter().cloned().collect(), state.repository.revision())
    }

    /// One policy and the endpoints it selects now.
    pub fn policy(&self, key: &PolicyKey) -> Option<(StoredPolicy, Vec<u16>)> {
        let state = self.state();
        let stored = state.repository.get(key)?.clone();
        let selected = state
            .endpoints
            .values()
            .filter(|s| s.status.identity != 0 && stored.policy.selects(&s.status.identity_labels))
            .map(|s| s.spec.id)
            .collect();
        Some((stored, selected))
    }

    /// Stores a policy and regenerates the endpoints it selects (before or
    /// after); with `wait` returns once they realised it.
    pub async fn upsert_policy(
        &self,
        policy: Policy,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Duration,
    ) -> Result<PolicyUpdate, ManagerError> {
        let started = Instant::now();
        self.require_policy_source(origin)?;
        let config = self.inner.config_lock.lock().await;
        let change = {
            let mut state = self.state();
            // Check the origin before touching anything.
            let mut trial = state.repository.get(policy.key()).cloned();
            if let Some(stored) = trial.take()
                && stored.origin != origin
            {
                return Err(PolicyError::OriginConflict {
                    key: policy.key().clone(),
                    held_by: stored.origin,
                }
                .into());
            }
            state.repository.upsert(policy, origin)?
        };
        self.policy_changed(config, change, origin, wait, started + deadline)
            .await
    }

    /// Removes a policy; `Ok(None)` when it did not exist.
    pub async fn delete_policy(
        &self,
        key: &PolicyKey,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Duration,
    ) -> Result<Option<PolicyUpdate>, ManagerError> {
        let started = Instant::now();
        self.require_policy_source(origin)?;
        let config = self.inner.config_lock.lock().await;
        let change = self.state().repository.delete(key, origin)?;
        match change {
            None => Ok(None),
            Some(change) => self
                .policy_changed(config, change, origin, wait, started + deadline)
                .await
                .map(Some),
        }
    }

    /// Persists a changed repository (under `config`, released before any
    /// wait so that other changes never queue behind a realisation) and
    /// regenerates the endpoints the change affects. The answer comes by
    /// `deadline` whatever svc-identity does: the CIDR identities are waited
    /// for only while some are missing, and only within the deadline.
    async fn policy_changed(
        &self,
        config: MutexGuard<'_, ()>,
        change: PolicyChange,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Instant,
    ) -> Result<PolicyUpdate, ManagerError> {
        if !change.changed {
            return Ok(PolicyUpdate {
                change,
                affected: 0,
                endpoints: Vec::new(),
                realised: 0,
            });
        }
        if origin == PolicyOrigin::Api {
            let documents: Vec<String> = {
                let state = self.state();
                state
                    .repository
                    .iter()
                    .filter(|p| p.origin == PolicyOrigin::Api)
                    .map(|p| p.policy.document().to_string())
                    .collect()
            };
            store(&self.inner.api_policies, documents, "API policies").await?;
        }
        drop(config);
        // The policy's CIDR identities first, so the regenerations see them.
        // The pass runs in `cidr-identities` (it may be waiting on a
        // svc-identity that waits on etcd); regenerations are queued again
        // when they come.
        let cidrs_missing = change.current.as_ref().is_some_and(|policy| {
            let state = self.state();
            let mut needed = policy.cidrs();
            needed.extend(policy.named_port_hosts(&state.selectors));
            needed.iter().any(|p| !state.cidr_identities.contains_key(p))
        });
        if cidrs_missing && wait {
            let limit = deadline.saturating_duration_since(Instant::now());
            if !self.cidrs_reconciled(limit).await {
                tracing::warn!(waited = ?limit, "CIDR identities for the policy not allocated yet; retrying in the background");
            }
        } else {
            self.inner.cidr_wake.trigger();
        }
        let waits: Vec<(u16, Arc<Queue>, u64)> = {
            let mut state = self.state();
            self.inner
                .metrics
                .set_policy(state.repository.revision(), state.repository.len());
            let reason = format!("policy {} changed", change.key);
            state
                .endpoints
                .values_mut()
                .filter(|s| !s.queue.is_closed() && s.policy_labels().is_some_and(|l| change.affects(l)))
                .map(|s| (s.spec.id, s.queue.clone(), s.queue.request(&reason)))
                .collect()
        };
        tracing::info!(policy = %change.key, revision = change.revision, affected = waits.len(), "policy changed");
        let affected = waits.len();
        let realised = if wait {
            self.wait_all(&waits, deadline.saturating_duration_since(Instant::now()))
                .await?
        } else {
            0
        };
        Ok(PolicyUpdate {
            change,
            affected,
            endpoints: waits.iter().map(|(id, ..)| *id).collect(),
            realised,
        })
    }

    /// After the selector cache changed: queues a regeneration of every
    /// endpoint a policy whose resolution the change can alter selects
    /// (nothing is resolved here). An endpoint counts with the labels its
    /// running regeneration resolved for, else with those of its realised
    /// policy: a change that arrives during a regeneration always leads to
    /// one more (coalesced) regeneration. Endpoints that have not resolved
    /// yet will see the change anyway.
    pub(super) fn queue_changed_policies(&self, state: &mut State, reason: &str) -> usize {
        let changes = state.selectors.take_changes();
        let affected = state.repository.affected_by(&changes);
        if affected.is_empty() {
            return 0;
        }
        let mut queued = 0;
        for slot in state.endpoints.values() {
            if slot.queue.is_closed() {
                continue;
            }
            let Some(labels) = slot.policy_labels() else {
                continue;
            };
            if affected.iter().any(|policy| policy.selects(labels)) {
                slot.queue.request(reason);
                queued += 1;
            }
        }
        if queued > 0 {
            tracing::debug!(
                endpoints = queued,
                policies = affected.len(),
                reason,
                "policy of endpoints changed"
            );
        }
        queued
    }

    /// After endpoints holding `identities` or `addresses` came, went or
    /// changed: their named ports in the selector cache, the CIDR identities
    /// of the host prefixes those need (in the background), and a
    /// regeneration of the endpoints whose policies they can change.
    pub(super) fn named_ports_changed(
        &self,
        state: &mut State,
        identities: impl IntoIterator<Item = u32>,
        addresses: impl IntoIterator<Item = IpAddr>,
        reason: &str,
    ) {
        if state.refresh_named_ports(identities, addresses) {
            self.inner.cidr_wake.trigger();
        }
        self.queue_changed_policies(state, reason);
    }
}

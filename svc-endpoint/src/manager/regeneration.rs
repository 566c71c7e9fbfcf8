//! One regeneration: identity → policy → datapath → ipcache → state dir.

use std::net::IpAddr;
use std::time::{Instant, SystemTime};

use rivet_common::grpc::error_reason;
use rivet_common::labels::Labels;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::loader::v1 as ldpb;
use tonic::Status;
use tracing::Instrument as _;

use super::queue::{Queue, RemovalReason};
use super::{EndpointManager, RegenError};
use crate::endpoint::{EndpointSpec, EndpointState, RegenerationFailure, RegenerationStep};
use crate::events;
use crate::state_dir::EndpointRecord;
use rivet_policy::{NamedPort, Resolution, ResolvedPolicy, Subject};

/// What a regeneration realised.
struct Regenerated {
    /// The endpoint's identity.
    identity: u32,
    /// Its labels, as svc-identity returned them.
    identity_labels: Labels,
    /// The policy now in the datapath.
    policy: ResolvedPolicy,
    /// The repository revision it was resolved at.
    revision: u64,
    /// The record written to the state dir; `None` when it already held it.
    written: Option<EndpointRecord>,
    /// The svc-identity boot id that took both the identity reference and
    /// the IP cache entries (`None`: it restarted between the two calls).
    claimed_in: Option<String>,
}

impl EndpointManager {
    /// One regeneration: identity → policy → datapath → ipcache → state dir.
    /// Stops before the next step once the endpoint is being removed
    /// (ABORTED; the removal that follows undoes what was done).
    pub(super) async fn regenerate(&self, id: u16, reason: &str, queue: &Queue) -> Result<(), RegenError> {
        let started = Instant::now();
        let (spec, request_labels, previous_identity, restoring) = {
            let state = self.state();
            let Some(slot) = state.endpoints.get(&id) else {
                return Ok(());
            };
            if queue.is_closed() {
                return Err(RegenError::aborted(RegenerationStep::Identity));
            }
            let labels = state
                .identity_request_labels(&slot.spec)
                .map_err(|s| RegenError::new(RegenerationStep::Identity, s))?;
            (
                slot.spec.clone(),
                labels,
                slot.status.identity,
                slot.status.state == EndpointState::Restoring,
            )
        };
        let regenerating = if previous_identity == 0 && !restoring {
            EndpointState::WaitingForIdentity
        } else {
            EndpointState::Regenerating
        };
        record_pod_attributes(&spec);
        self.set_state(id, regenerating, reason);
        let result = self
            .run_steps(&spec, request_labels, previous_identity, reason, queue)
            .await;
        let (e, failed) = {
            let mut state = self.state();
            let Some(slot) = state.endpoints.get_mut(&id) else {
                return result.map(|_| ());
            };
            slot.resolving = None;
            if queue.is_closed() {
                // Being removed: no state change, nothing kept for debugging.
                return result.map(|_| ());
            }
            match result {
                Ok(Regenerated {
                    identity,
                    identity_labels,
                    policy,
                    revision,
                    written,
                    claimed_in,
                }) => {
                    let took = started.elapsed();
                    let addresses: Vec<IpAddr> = slot.spec.addresses.iter().map(|a| a.address).collect();
                    let previous = std::mem::replace(&mut slot.status.identity, identity);
                    slot.status.identity_labels = identity_labels;
                    slot.status.realised_policy = Some(policy);
                    slot.status.policy_revision = revision;
                    slot.status.last_regeneration = Some((SystemTime::now(), took));
                    slot.status.regenerations += 1;
                    slot.status.last_error = None;
                    if let Some(record) = written {
                        slot.persisted = Some(record);
                    }
                    slot.claimed_in = claimed_in;
                    slot.status.transition(id, EndpointState::Ready, reason);
                    state.changed(id);
                    events::regeneration_completed(&self.inner.metrics, id, identity, revision, reason, took);
                    self.named_ports_changed(&mut state, [previous, identity], addresses, "named ports changed");
                    self.update_state_metrics(&state);
                    return Ok(());
                }
                Err(e) => {
                    slot.status.last_error = Some(RegenerationFailure {
                        step: e.step,
                        message: e.status.message().to_string(),
                        at: SystemTime::now(),
                    });
                    let next = if restoring {
                        EndpointState::Restoring
                    } else {
                        EndpointState::WaitingToRegenerate
                    };
                    slot.status
                        .transition(id, next, &format!("regeneration failed at {}", e.step.as_str()));
                    events::regeneration_failed(&self.inner.metrics, id, e.step, e.status.code(), e.status.message());
                    let failed = EndpointRecord {
                        spec: slot.spec.clone(),
                        identity: slot.status.identity,
                        identity_labels: slot.status.identity_labels.clone(),
                        policy_revision: slot.status.policy_revision,
                        written: SystemTime::now(),
                    };
                    // The next successful regeneration must write the record even
                    // if it is unchanged: that write is what removes the
                    // `_next_fail` kept below (otherwise it stays beside a ready
                    // endpoint, e.g. after a regeneration failed while
                    // svc-loader was down and the resync succeeded).
                    slot.persisted = None;
                    state.changed(id);
                    (e, failed)
                }
            }
        };
        // Kept for debugging; a create that is undone removes it.
        let state_dir = self.inner.state_dir.clone();
        match tokio::task::spawn_blocking(move || state_dir.write_failed(&failed)).await {
            Ok(Ok(())) => {}
            Ok(Err(write)) => tracing::warn!(endpoint = id, error = %write, "could not keep the failed state"),
            Err(join) => tracing::warn!(endpoint = id, error = %join, "could not keep the failed state"),
        }
        Err(e)
    }

    /// The steps of one regeneration, without touching the endpoint's
    /// status (its caller records the outcome).
    async fn run_steps(
        &self,
        spec: &EndpointSpec,
        request_labels: Labels,
        previous_identity: u32,
        reason: &str,
        queue: &Queue,
    ) -> Result<Regenerated, RegenError> {
        let deps = &self.inner.deps;
        let id = spec.id;
        let open = |step| {
            if queue.is_closed() {
                Err(RegenError::aborted(step))
            } else {
                Ok(())
            }
        };
        // 1. identity
        let allocated = deps
            .identity
            .allocate(idpb::AllocateIdentityRequest {
                labels: request_labels.iter().map(ToString::to_string).collect(),
                owner: spec.identity_owner(),
            })
            .instrument(tracing::info_span!("regenerate.identity"))
            .await
            .map_err(|s| RegenError::new(RegenerationStep::Identity, s))?;
        let identity = allocated.identity.ok_or_else(|| {
            RegenError::new(
                RegenerationStep::Identity,
                Status::internal("no identity in the response"),
            )
        })?;
        let identity_labels = Labels::parse(&identity.labels).map_err(|e| {
            RegenError::new(
                RegenerationStep::Identity,
                Status::internal(format!("svc-identity returned invalid labels: {e}")),
            )
        })?;
        tracing::Span::current().record("rivet.identity.id", identity.id);
        if previous_identity == 0 {
            self.set_state(id, EndpointState::Regenerating, reason);
        }
        // 2. policy: its inputs under the lock, the resolution without it
        let policy_span = tracing::info_span!("regenerate.policy", entries = tracing::field::Empty);
        let (prepared, revision) = policy_span.in_scope(|| {
            let mut state = self.state();
            let prepared = state.repository.prepare(&identity_labels, &state.selectors);
            if let Some(slot) = state.endpoints.get_mut(&id) {
                slot.resolving = Some(identity_labels.clone());
            }
            (prepared, state.repository.revision())
        });
        let resolved = self
            .resolve_policy(id, prepared, identity_labels.clone(), spec.named_ports.clone())
            .instrument(policy_span.clone())
            .await?;
        policy_span.record("entries", resolved.entries.len());
        drop(policy_span);
        // 3. datapath
        open(RegenerationStep::Datapath)?;
        let applied = deps
            .loader
            .apply(ldpb::ApplyEndpointRequest {
                endpoint_id: u32::from(id),
                host_ifindex: spec.host_ifindex,
                addresses: spec
                    .addresses
                    .iter()
                    .map(|a| rivet_proto::net::address_bytes(a.address))
                    .collect(),
                mac: spec.mac.to_vec(),
                identity: identity.id,
                policy: Some(resolved.to_proto(revision, self.inner.options.allow_from_host)),
            })
            .instrument(tracing::info_span!("regenerate.datapath"))
            .await
            .map_err(datapath_failure)?;
        if let Some(held) = applied.endpoint
            && !held.host_ifname.is_empty()
            && held.host_ifname != spec.host_interface
        {
            return Err(RegenError::interface_lost(
                Status::failed_precondition(format!(
                    "ifindex {} is now {}, not the endpoint's {}",
                    spec.host_ifindex, held.host_ifname, spec.host_interface
                )),
                RemovalReason::InterfaceReplaced,
            ));
        }
        // 4. ipcache
        open(RegenerationStep::Ipcache)?;
        let published = deps
            .identity
            .upsert_ip(idpb::UpsertIpRequest {
                entries: spec
                    .addresses
                    .iter()
                    .map(|a| idpb::IpcacheEntry {
                        prefix: Some(rivet_proto::net::host_prefix(a.address)),
                        identity: identity.id,
                        host_ip: Vec::new(),
                        pod_namespace: spec.pod_namespace.clone(),
                        pod_name: spec.pod_name.clone(),
                        source: idpb::IpcacheSource::LocalEndpoint.into(),
                        node_name: String::new(),
                        // Other nodes resolve egress rules naming these ports
                        // from the ipcache (their watch of it).
                        named_ports: spec
                            .named_ports
                            .iter()
                            .map(|p| idpb::NamedPort {
                                name: p.name.clone(),
                                protocol: crate::endpoint::protocol_name(p.protocol).to_string(),
                                port: u32::from(p.port),
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .instrument(tracing::info_span!("regenerate.ipcache"))
            .await
            .map_err(|s| RegenError::new(RegenerationStep::Ipcache, s))?;
        let claimed_in = (published.boot_id == allocated.boot_id).then_some(published.boot_id);
        // 5. state dir (skipped when it already holds exactly this)
        let record = EndpointRecord {
            spec: spec.clone(),
            identity: identity.id,
            identity_labels: identity_labels.clone(),
            policy_revision: revision,
            written: SystemTime::now(),
        };
        let unchanged = {
            let state = self.state();
            state
                .endpoints
                .get(&id)
                .and_then(|s| s.persisted.as_ref())
                .is_some_and(|p| {
                    p.spec == record.spec
                        && p.identity == record.identity
                        && p.identity_labels == record.identity_labels
                })
        };
        open(RegenerationStep::StateDir)?;
        let written = if unchanged {
            None
        } else {
            let state_dir = self.inner.state_dir.clone();
            let to_write = record.clone();
            tokio::task::spawn_blocking(move || state_dir.write(&to_write))
                .instrument(tracing::info_span!("regenerate.state_dir"))
                .await
                .map_err(|e| RegenError::new(RegenerationStep::StateDir, Status::internal(e.to_string())))?
                .map_err(|e| RegenError::new(RegenerationStep::StateDir, Status::internal(e.to_string())))?;
            Some(record)
        };
        // The old identity is released only once nothing uses it.
        if previous_identity != 0
            && previous_identity != identity.id
            && let Err(e) = deps
                .identity
                .release(idpb::ReleaseIdentityRequest {
                    id: previous_identity,
                    owner: spec.identity_owner(),
                })
                .instrument(tracing::info_span!("regenerate.release_identity"))
                .await
        {
            tracing::warn!(endpoint = id, identity = previous_identity, error = %e, "releasing the previous identity failed; a resync will");
        }
        Ok(Regenerated {
            identity: identity.id,
            identity_labels,
            policy: resolved,
            revision,
            written,
            claimed_in,
        })
    }

    /// Resolves prepared policy inputs: on the async thread when small, on a
    /// blocking thread when large (thousands of peer identities), so a big
    /// policy never stalls the runtime. No lock is held either way.
    async fn resolve_policy(
        &self,
        id: u16,
        prepared: Resolution,
        labels: Labels,
        named_ports: Vec<NamedPort>,
    ) -> Result<ResolvedPolicy, RegenError> {
        let started = Instant::now();
        let blocking = prepared.weight() > self.inner.options.blocking_resolution_above;
        let resolve = move || {
            prepared.resolve(&Subject {
                labels: &labels,
                named_ports: &named_ports,
            })
        };
        let resolved = if blocking {
            tokio::task::spawn_blocking(resolve).await.map_err(|e| {
                RegenError::new(
                    RegenerationStep::Policy,
                    Status::internal(format!("resolving the policy of endpoint {id}: {e}")),
                )
            })?
        } else {
            resolve()
        };
        events::policy_resolved(
            &self.inner.metrics,
            id,
            resolved.entries.len(),
            started.elapsed(),
            blocking,
        );
        Ok(resolved)
    }
}

/// Records the pod's OpenTelemetry attributes on the current (`regenerate`)
/// span: what a Jaeger user searches a pod's traces by.
fn record_pod_attributes(spec: &EndpointSpec) {
    let span = tracing::Span::current();
    for (field, value) in [
        ("k8s.pod.name", &spec.pod_name),
        ("k8s.namespace.name", &spec.pod_namespace),
        ("k8s.pod.uid", &spec.pod_uid),
        ("container.id", &spec.container_id),
    ] {
        if !value.is_empty() {
            span.record(field, value.as_str());
        }
    }
    let addresses: Vec<String> = spec.addresses.iter().map(|a| a.address.to_string()).collect();
    span.record("rivet.pod.addresses", addresses.join(",").as_str());
}

/// A failed ApplyEndpoint, and whether svc-loader's reason says the
/// endpoint's host interface is gone or the endpoint is attached to
/// another interface (its interface was replaced).
fn datapath_failure(status: Status) -> RegenError {
    match error_reason::<ldpb::ErrorReason>(&status) {
        Some(ldpb::ErrorReason::InterfaceNotFound) => RegenError::interface_lost(status, RemovalReason::InterfaceGone),
        Some(ldpb::ErrorReason::EndpointOnOtherInterface) => {
            RegenError::interface_lost(status, RemovalReason::InterfaceReplaced)
        }
        _ => RegenError::new(RegenerationStep::Datapath, status),
    }
}

//! svc-endpoint's telemetry: each named event writes its log line and updates
//! its metric in one place, so logs and metrics never disagree.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::endpoint::{EndpointState, RegenerationStep};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// A failed step (of a regeneration or a removal) and the gRPC code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResolutionLabels {
    /// "inline" (on the async thread) or "blocking".
    thread: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DependencyLabels {
    dependency: &'static str,
}

/// The metrics of svc-endpoint.
#[derive(Clone, Debug)]
pub struct EndpointMetrics {
    endpoints: MetricFamily<StateLabels, Gauge>,
    regenerations: Counter,
    regeneration_errors: MetricFamily<StepLabels, Counter>,
    regeneration_seconds: Histogram,
    endpoints_dropped: MetricFamily<ReasonLabels, Counter>,
    removal_errors: MetricFamily<StepLabels, Counter>,
    removals_converged: MetricFamily<ReasonLabels, Counter>,
    resyncs: MetricFamily<DependencyLabels, Counter>,
    replays_ended: Counter,
    policy_revision: Gauge,
    policies: Gauge,
    restore_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    policy_dir_scans: Counter,
    policy_resolutions: MetricFamily<ResolutionLabels, Counter>,
    policy_resolution_seconds: Histogram,
    policy_dir_files_rejected: Counter,
    kubernetes_replays: Counter,
    kubernetes_replay_forgotten: MetricFamily<KindLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    /// "pod", "namespace" or "policy".
    kind: &'static str,
}

impl Default for EndpointMetrics {
    fn default() -> Self {
        Self {
            endpoints: Default::default(),
            regenerations: Default::default(),
            regeneration_errors: Default::default(),
            regeneration_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            endpoints_dropped: Default::default(),
            removal_errors: Default::default(),
            removals_converged: Default::default(),
            resyncs: Default::default(),
            replays_ended: Counter::default(),
            policy_revision: Default::default(),
            policies: Default::default(),
            restore_seconds: Default::default(),
            policy_dir_scans: Default::default(),
            policy_resolutions: Default::default(),
            policy_resolution_seconds: Histogram::new(exponential_buckets(0.00001, 4.0, 12)),
            policy_dir_files_rejected: Default::default(),
            kubernetes_replays: Default::default(),
            kubernetes_replay_forgotten: Default::default(),
        }
    }
}

impl EndpointMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("endpoint");
        r.register("endpoints", "Endpoints by state", self.endpoints.clone());
        r.register("regenerations", "Regenerations completed", self.regenerations.clone());
        r.register(
            "regeneration_errors",
            "Failed regenerations by step and gRPC code",
            self.regeneration_errors.clone(),
        );
        r.register(
            "regeneration_duration_seconds",
            "Time of one successful regeneration",
            self.regeneration_seconds.clone(),
        );
        r.register(
            "dropped",
            "Endpoints removed by svc-endpoint itself, by reason",
            self.endpoints_dropped.clone(),
        );
        r.register(
            "removal_errors",
            "Failed attempts to remove an endpoint, by step and gRPC code (each is retried)",
            self.removal_errors.clone(),
        );
        r.register(
            "removals_converged",
            "Removals completed in the background after failed attempts, by reason",
            self.removals_converged.clone(),
        );
        r.register(
            "dependency_resyncs",
            "Replays of desired state after a dependency restarted",
            self.resyncs.clone(),
        );
        r.register(
            "identity_replays_ended",
            "Replays of every endpoint's claims to a svc-identity boot ended with EndReplay",
            self.replays_ended.clone(),
        );
        r.register(
            "policy_revision",
            "Policy repository revision",
            self.policy_revision.clone(),
        );
        r.register("policies", "Policies in the repository", self.policies.clone());
        r.register(
            "policy_resolutions",
            "Endpoint policies resolved, by the thread that did it",
            self.policy_resolutions.clone(),
        );
        r.register(
            "policy_resolution_duration_seconds",
            "Time to resolve one endpoint's policy",
            self.policy_resolution_seconds.clone(),
        );
        r.register(
            "policy_dir_scans",
            "Scans of the --policy-dir completed",
            self.policy_dir_scans.clone(),
        );
        r.register(
            "policy_dir_files_rejected",
            "Policy dir files that did not parse (their previous policies stay)",
            self.policy_dir_files_rejected.clone(),
        );
        r.register(
            "kubernetes_replays",
            "Level-triggered replays of svc-k8s-sync's desired state applied",
            self.kubernetes_replays.clone(),
        );
        r.register(
            "kubernetes_replay_forgotten",
            "Pod metadata, namespaces and policies forgotten because a replay did not name them, by kind",
            self.kubernetes_replay_forgotten.clone(),
        );
        r.register(
            "restore_duration_seconds",
            "Time the last restore took",
            self.restore_seconds.clone(),
        );
    }

    /// Sets the per-state endpoint counts.
    pub fn set_states(&self, counts: &[(EndpointState, usize)]) {
        for state in EndpointState::ALL {
            let n = counts.iter().find(|(s, _)| *s == state).map_or(0, |(_, n)| *n);
            self.endpoints
                .get_or_create(&StateLabels { state: state.as_str() })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Endpoint policies resolved so far: (on the async threads, on
    /// blocking threads).
    pub fn policy_resolutions(&self) -> (u64, u64) {
        let count = |thread| {
            self.policy_resolutions
                .get_or_create(&ResolutionLabels { thread })
                .get()
        };
        (count("inline"), count("blocking"))
    }

    /// Sets the repository gauges.
    pub fn set_policy(&self, revision: u64, policies: usize) {
        self.policy_revision.set(i64::try_from(revision).unwrap_or(i64::MAX));
        self.policies.set(i64::try_from(policies).unwrap_or(i64::MAX));
    }
}

/// A regeneration completed.
pub fn regeneration_completed(
    m: &EndpointMetrics,
    id: u16,
    identity: u32,
    revision: u64,
    reason: &str,
    took: Duration,
) {
    tracing::debug!(
        endpoint = id,
        identity,
        revision,
        reason,
        took_us = took.as_micros() as u64,
        "endpoint regenerated"
    );
    m.regenerations.inc();
    m.regeneration_seconds.observe(took.as_secs_f64());
}

/// A regeneration failed at `step`.
pub fn regeneration_failed(m: &EndpointMetrics, id: u16, step: RegenerationStep, code: tonic::Code, message: &str) {
    tracing::warn!(endpoint = id, step = step.as_str(), code = ?code, "endpoint regeneration failed: {message}");
    m.regeneration_errors
        .get_or_create(&StepLabels {
            step: step.as_str(),
            code: rivet_common::grpc::code_label(code),
        })
        .inc();
}

/// An endpoint was created.
pub fn endpoint_created(id: u16, container_id: &str, interface: &str, pod: &str) {
    tracing::info!(endpoint = id, container_id, interface, pod, "endpoint created");
}

/// An endpoint was deleted.
pub fn endpoint_deleted(id: u16, reason: &str) {
    tracing::info!(endpoint = id, reason, "endpoint deleted");
}

/// svc-endpoint removed an endpoint on its own (interface gone at restore,
/// failed create undone).
pub fn endpoint_dropped(m: &EndpointMetrics, id: u16, reason: &'static str, detail: &str) {
    tracing::info!(endpoint = id, reason, "endpoint dropped: {detail}");
    m.endpoints_dropped.get_or_create(&ReasonLabels { reason }).inc();
}

/// An attempt to remove an endpoint failed; its worker retries.
pub fn removal_failed(m: &EndpointMetrics, id: u16, step: &'static str, status: &tonic::Status, failures: u32) {
    tracing::warn!(endpoint = id, step, code = ?status.code(), failures, "removing the endpoint failed; retrying in the background: {}", status.message());
    m.removal_errors
        .get_or_create(&StepLabels {
            step,
            code: rivet_common::grpc::code_label(status.code()),
        })
        .inc();
}

/// A removal completed in the background after earlier attempts (failed,
/// or done before a caller gave up and asked for the addresses too).
pub fn removal_converged(
    m: &EndpointMetrics,
    id: u16,
    reason: &'static str,
    earlier_attempts: u64,
    released_addresses: bool,
) {
    tracing::info!(
        endpoint = id,
        reason,
        earlier_attempts,
        released_addresses,
        "endpoint removal completed in the background"
    );
    m.removals_converged.get_or_create(&ReasonLabels { reason }).inc();
}

/// A dependency restarted and svc-endpoint replayed its desired state.
pub fn dependency_resynced(m: &EndpointMetrics, dependency: &'static str, endpoints: usize) {
    tracing::info!(dependency, endpoints, "dependency restarted; desired state replayed");
    m.resyncs.get_or_create(&DependencyLabels { dependency }).inc();
}

/// Every endpoint claimed again in svc-identity boot `boot_id`, and
/// EndReplay told it so: what it restored and nobody claimed went.
pub fn identity_replay_ended(
    m: &EndpointMetrics,
    boot_id: &str,
    endpoints: usize,
    released_identities: u32,
    withdrawn_ip_claims: u32,
) {
    tracing::info!(
        boot_id,
        endpoints,
        released_identities,
        withdrawn_ip_claims,
        "replay to svc-identity ended; it released what was restored and not claimed again"
    );
    m.replays_ended.inc();
}

/// Restore finished.
pub fn restore_finished(m: &EndpointMetrics, found: u32, restored: u32, dropped: u32, failed: u32, took: Duration) {
    tracing::info!(
        found,
        restored,
        dropped,
        failed,
        took_ms = took.as_millis() as u64,
        "endpoint restore complete"
    );
    m.restore_seconds.set(took.as_secs_f64());
}

/// A scan of the policy dir completed; `rejected` files did not parse and
/// changed nothing.
pub fn policy_dir_scanned(m: &EndpointMetrics, dir: &std::path::Path, rejected: &[(std::path::PathBuf, String)]) {
    for (file, reason) in rejected {
        tracing::error!(file = %file.display(), error = %reason, "policy file rejected; its previous policies stay");
    }
    tracing::debug!(dir = %dir.display(), rejected = rejected.len(), "policy dir scanned");
    m.policy_dir_scans.inc();
    m.policy_dir_files_rejected.inc_by(rejected.len() as u64);
}

/// An endpoint's policy was resolved (`blocking`: on a blocking thread).
pub fn policy_resolved(m: &EndpointMetrics, id: u16, entries: usize, took: Duration, blocking: bool) {
    tracing::debug!(
        endpoint = id,
        entries,
        blocking,
        took_us = took.as_micros() as u64,
        "policy resolved"
    );
    let thread = if blocking { "blocking" } else { "inline" };
    m.policy_resolutions.get_or_create(&ResolutionLabels { thread }).inc();
    m.policy_resolution_seconds.observe(took.as_secs_f64());
}

/// A Kubernetes replay was applied: what it forgot and how many endpoints
/// it queued.
pub fn kubernetes_replayed(
    m: &EndpointMetrics,
    forgotten: [(&'static str, usize); 3],
    affected: usize,
    rejected: usize,
) {
    tracing::info!(
        pods_forgotten = forgotten[0].1,
        namespaces_forgotten = forgotten[1].1,
        policies_removed = forgotten[2].1,
        affected,
        rejected,
        "Kubernetes replay applied"
    );
    m.kubernetes_replays.inc();
    for (kind, n) in forgotten {
        m.kubernetes_replay_forgotten
            .get_or_create(&KindLabels { kind })
            .inc_by(n as u64);
    }
}

//! Duty `stale-objects` (issue 15 §6, the seed's CiliumEndpoint GC and
//! node taint): two controllers over watch caches of RivetEndpoints, Pods,
//! RivetNodes and Nodes.
//!
//! - `endpoint-gc` ([`endpoints`]): every `--endpoint-gc-interval` deletes
//!   the RivetEndpoints whose pod is gone (404) or was re-created with
//!   another UID than the endpoint's owner reference. A candidate from the
//!   caches is confirmed with a live GET of its pod and deleted with a
//!   resourceVersion + UID precondition, so a pod created or an endpoint
//!   rewritten while the pass runs is never touched.
//! - `node-taint` ([`taint`]): puts `node.rivet.io/agent-not-ready:NoSchedule`
//!   back on a Node whose RivetNode is not ready (condition `Ready` not
//!   True, absent, or its `lastHeartbeatTime` older than
//!   `--node-status-grace`). svc-k8s-sync removes it once ready.
//!
//! Not here: RivetNodes whose Node is gone (the cluster-pool duty deletes
//! them with their pod CIDRs' release).

pub mod endpoints;
pub mod taint;

mod cache;
mod events;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_k8s::{RivetEndpoint, RivetNode};

pub use events::StaleMetrics;

use crate::term::{Duty, NotLeading, Term};

/// The flags of the `stale-objects` duty.
#[derive(Debug, Clone, clap::Args)]
pub struct StaleArgs {
    /// How often RivetEndpoints whose pod is gone are collected (the seed's
    /// `--cilium-endpoint-gc-interval`; `0s` turns the collection off).
    /// Deleting one is cheap and it holds nothing but an object, so minutes
    /// are fine.
    #[arg(long, env = "RIVET_ENDPOINT_GC_INTERVAL", default_value = "5m", value_parser = humantime::parse_duration)]
    pub endpoint_gc_interval: Duration,

    /// How old the `Ready` condition's `lastHeartbeatTime` of a RivetNode may
    /// be before its node counts as not ready and gets the not-ready taint
    /// back. svc-k8s-sync refreshes it every `--node-ready-period-seconds`
    /// (10 s); 40 s is kube-controller-manager's node-monitor grace period:
    /// three missed refreshes plus the write's own latency, and a node's
    /// clock may be a few seconds off the operator's.
    #[arg(long, env = "RIVET_NODE_STATUS_GRACE", default_value = "40s", value_parser = humantime::parse_duration)]
    pub node_status_grace: Duration,

    /// Whether the not-ready taint is put back at all (the seed's
    /// `--set-cilium-node-taints`).
    #[arg(
        long,
        env = "RIVET_SET_NODE_TAINTS",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub set_node_taints: bool,
}

impl Default for StaleArgs {
    fn default() -> Self {
        Self {
            endpoint_gc_interval: Duration::from_secs(300),
            node_status_grace: Duration::from_secs(40),
            set_node_taints: true,
        }
    }
}

/// Why a pass of the duty failed (retried with the controller's backoff).
#[derive(Debug, thiserror::Error)]
pub enum StaleError {
    /// A call to the API server failed.
    #[error("{verb} {resource}: {source}")]
    Api {
        /// The verb (`get`, `delete`, `patch`).
        verb: &'static str,
        /// The object (`pods shop/web`, `nodes/node-1`).
        resource: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// This replica no longer leads: nothing more is written.
    #[error(transparent)]
    NotLeading(#[from] NotLeading),
}

impl StaleError {
    fn api(verb: &'static str, resource: impl Into<String>, source: kube::Error) -> Self {
        Self::Api {
            verb,
            resource: resource.into(),
            source,
        }
    }

    /// A short label for metrics (`conflict`, `not_found`, `not_leading`, ...).
    pub fn kind_label(&self) -> &'static str {
        match self {
            Self::Api { source, .. } => rivet_k8s::error_kind(source),
            Self::NotLeading(_) => "not_leading",
        }
    }
}

/// The `stale-objects` duty.
#[derive(Clone)]
pub struct StaleObjects {
    client: Client,
    args: StaleArgs,
    metrics: StaleMetrics,
}

impl StaleObjects {
    /// The duty over `client`, counting into `metrics`.
    pub fn new(client: Client, args: StaleArgs, metrics: StaleMetrics) -> Self {
        Self { client, args, metrics }
    }
}

impl Duty for StaleObjects {
    fn name(&self) -> &'static str {
        "stale-objects"
    }

    fn start(&self, term: &Term, controllers: &Controllers) {
        let gc_enabled = !self.args.endpoint_gc_interval.is_zero();
        if gc_enabled {
            let collector = Arc::new(endpoints::EndpointGc {
                client: self.client.clone(),
                endpoints: cache::watch(
                    controllers,
                    "watch-rivetendpoints",
                    Api::<RivetEndpoint>::all(self.client.clone()),
                    self.metrics.clone(),
                    Trigger::new(),
                ),
                pods: cache::watch(
                    controllers,
                    "watch-pods",
                    Api::<PartialObjectMeta<Pod>>::all(self.client.clone()),
                    self.metrics.clone(),
                    Trigger::new(),
                ),
                metrics: self.metrics.clone(),
            });
            let (term, interval) = (term.clone(), self.args.endpoint_gc_interval);
            let synced = Trigger::new();
            collector.endpoints.on_synced(&synced);
            collector.pods.on_synced(&synced);
            controllers.reconcile(Controller::new("endpoint-gc").trigger(&synced), move || {
                let (collector, term) = (collector.clone(), term.clone());
                async move {
                    if !collector.synced() {
                        return Ok(Action::await_change());
                    }
                    collector.pass(&term).await?;
                    Ok::<_, StaleError>(Action::requeue(interval))
                }
            });
        }
        if self.args.set_node_taints {
            let changed = Trigger::new();
            let tainter = Arc::new(taint::NodeTainter {
                client: self.client.clone(),
                rivet_nodes: cache::watch(
                    controllers,
                    "watch-rivetnodes",
                    Api::<RivetNode>::all(self.client.clone()),
                    self.metrics.clone(),
                    changed.clone(),
                ),
                nodes: cache::watch(
                    controllers,
                    "watch-nodes",
                    Api::<Node>::all(self.client.clone()),
                    self.metrics.clone(),
                    changed.clone(),
                ),
                grace: self.args.node_status_grace,
                metrics: self.metrics.clone(),
            });
            let term = term.clone();
            controllers.reconcile(Controller::new("node-taint").trigger(&changed), move || {
                let (tainter, term) = (tainter.clone(), term.clone());
                async move {
                    if !tainter.synced() {
                        return Ok(Action::await_change());
                    }
                    tainter.pass(&term).await
                }
            });
        }
    }
}

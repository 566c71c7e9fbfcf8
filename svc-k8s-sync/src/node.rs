//! Marking the node ready (the seed's AnnotateNode): once every watch cache
//! synced and every daemon of the node answers GetInfo without being
//! degraded, svc-k8s-sync
//! - applies this node's `RivetNode` (spec: addresses from flags, pod CIDRs
//!   from svc-ipam's pools in node-pool IPAM, none in cluster-pool IPAM,
//!   where the operator writes them and [`crate::pod_cidrs`] applies them;
//!   status: condition `Ready`, its `lastHeartbeatTime` refreshed on every
//!   pass so the operator can tell a stopped agent from a ready one),
//! - annotates the Node (`rivet.io/pod-cidrs`, `rivet.io/node-addresses`),
//! - removes the taint `node.rivet.io/agent-not-ready:NoSchedule` if present
//!   (the operator puts it back when the node stops being ready).
//!
//! A reconcile controller (`node-ready`): level-triggered, re-checked
//! periodically; while a daemon is not ready (or, in cluster-pool IPAM,
//! svc-ipam does not serve the spec's pod CIDRs) the RivetNode says so
//! (`Ready=False` with the daemon named) and the taint stays.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_k8s::{NodeAddress, NodeCondition, RivetNode, RivetNodeSpec, RivetNodeStatus};
use rivet_proto::daemon::v1::GetInfoRequest;
use rivet_proto::daemon::v1::daemon_client::DaemonClient;
use rivet_proto::ipam::v1::ListRequest;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use serde_json::json;

use crate::error::ApiError;
use crate::events::SyncMetrics;
use crate::pod_cidrs::IpamMode;
use crate::watch::WatchStatus;
use crate::{FIELD_MANAGER, SyncState};

pub use rivet_k8s::{NOT_READY_TAINT, is_not_ready_taint};
/// Node annotation: the pod CIDRs, comma-separated.
pub const POD_CIDRS_ANNOTATION: &str = "rivet.io/pod-cidrs";
/// Node annotation: the node addresses Rivet uses, comma-separated.
pub const NODE_ADDRESSES_ANNOTATION: &str = "rivet.io/node-addresses";

/// How soon readiness is checked again while a daemon is not ready.
const NOT_READY_RECHECK: Duration = Duration::from_secs(1);

/// Why the node could not be marked ready.
#[derive(Debug, thiserror::Error)]
pub enum ReadinessError {
    /// A daemon of the node is not ready.
    #[error("{daemon} is not ready: {reason}")]
    DaemonNotReady {
        /// The daemon.
        daemon: String,
        /// Unreachable or degraded, and why.
        reason: String,
    },
    /// svc-ipam's pools could not be read.
    #[error("reading svc-ipam's pools: {0}")]
    Pools(String),
    /// Cluster-pool IPAM: svc-ipam does not serve the RivetNode's pod CIDRs.
    #[error("{0}")]
    PodCidrsNotApplied(String),
    /// An API call failed.
    #[error(transparent)]
    Api(#[from] ApiError),
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The node's daemons as readiness sees them.
pub trait NodeDaemons: Send + Sync {
    /// `Ok` when every daemon answers and none is degraded.
    fn check(&self) -> BoxFuture<'_, Result<(), ReadinessError>>;
    /// The pod CIDRs of svc-ipam's pools.
    fn pod_cidrs(&self) -> BoxFuture<'_, Result<Vec<String>, ReadinessError>>;
}

/// The daemons' sockets in the socket dir.
#[derive(Clone, Debug)]
pub struct SocketDaemons {
    /// The socket dir.
    pub socket_dir: PathBuf,
    /// The daemons that must be ready (`svc-ipam`, `svc-endpoint`, ...).
    pub daemons: Vec<String>,
}

fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    }
}

impl NodeDaemons for SocketDaemons {
    fn check(&self) -> BoxFuture<'_, Result<(), ReadinessError>> {
        Box::pin(async move {
            for daemon in &self.daemons {
                let socket = rivet_common::socket::socket_path(&self.socket_dir, daemon);
                let not_ready = |reason: String| ReadinessError::DaemonNotReady {
                    daemon: daemon.clone(),
                    reason,
                };
                let channel = connect_unix(&socket, &options())
                    .await
                    .map_err(|e| not_ready(e.to_string()))?;
                let info = DaemonClient::new(channel)
                    .get_info(GetInfoRequest {})
                    .await
                    .map_err(|e| not_ready(format!("GetInfo: {}", e.message())))?
                    .into_inner();
                if !info.degraded.is_empty() {
                    return Err(not_ready(format!("degraded: {}", info.degraded)));
                }
            }
            Ok(())
        })
    }

    fn pod_cidrs(&self) -> BoxFuture<'_, Result<Vec<String>, ReadinessError>> {
        Box::pin(async move {
            let socket = rivet_common::socket::socket_path(&self.socket_dir, "svc-ipam");
            let channel = connect_unix(&socket, &options())
                .await
                .map_err(|e| ReadinessError::Pools(e.to_string()))?;
            let pools = IpamClient::new(channel)
                .list(ListRequest::default())
                .await
                .map_err(|e| ReadinessError::Pools(e.message().to_string()))?
                .into_inner()
                .pools;
            let mut cidrs = pools
                .iter()
                .flat_map(|p| &p.ranges)
                .map(|r| {
                    let cidr = r.cidr.as_ref().map(rivet_proto::net::prefix_from_proto);
                    match cidr {
                        Some(Ok(cidr)) => Ok(cidr.to_string()),
                        Some(Err(e)) => Err(ReadinessError::Pools(format!("svc-ipam listed a bad pool CIDR: {e}"))),
                        None => Err(ReadinessError::Pools(
                            "svc-ipam listed a pool range without its CIDR".into(),
                        )),
                    }
                })
                .collect::<Result<Vec<String>, _>>()?;
            cidrs.sort();
            cidrs.dedup();
            Ok(cidrs)
        })
    }
}

/// The node-ready controller's inputs.
pub struct NodeReadiness {
    /// The API.
    pub client: Client,
    /// This node.
    pub node_name: String,
    /// Its addresses (`--node-address`).
    pub addresses: Vec<String>,
    /// Where the pod CIDRs come from (and so whether the spec has them).
    pub ipam_mode: IpamMode,
    /// The node's daemons.
    pub daemons: Arc<dyn NodeDaemons>,
    /// The caches' sync state.
    pub status: Arc<WatchStatus>,
    /// What GetStatus reports.
    pub state: Arc<SyncState>,
    /// Logs and metrics.
    pub metrics: SyncMetrics,
    /// How often readiness is re-checked.
    pub period: Duration,
}

impl NodeReadiness {
    /// Runs as controller `node-ready`, woken by `trigger` (cache events).
    pub fn start(self, controllers: &Controllers, trigger: &Trigger) {
        let this = Arc::new(self);
        controllers.reconcile(Controller::new("node-ready").trigger(trigger), move || {
            let this = this.clone();
            async move { this.pass().await }
        });
    }

    async fn pass(&self) -> Result<Action, ReadinessError> {
        if !self.status.all_synced() {
            return Ok(Action::await_change());
        }
        let checked = match self.daemons.check().await {
            Ok(()) => self
                .state
                .pod_cidrs_pending()
                .map_or(Ok(()), |why| Err(ReadinessError::PodCidrsNotApplied(why))),
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            // Another daemon not being ready is the node's state, not a
            // failure of this controller: reported, then checked again.
            let was_ready = self.state.node_ready();
            self.state.set_node_ready(false);
            self.apply_rivet_node(None, Some(&e.to_string())).await?;
            self.metrics.node_not_ready(&self.node_name, was_ready, &e.to_string());
            return Ok(Action::requeue(NOT_READY_RECHECK));
        }
        let cidrs = self.daemons.pod_cidrs().await?;
        self.apply_rivet_node(Some(&cidrs), None).await?;
        self.annotate_node(&cidrs).await?;
        let taint_removed = self.remove_taint().await?;
        if !self.state.node_ready() || taint_removed {
            self.metrics.node_marked_ready(&self.node_name, taint_removed);
        }
        self.state.set_node_ready(true);
        Ok(Action::requeue(self.period))
    }

    /// Applies the RivetNode: the spec when `cidrs` is known, and the Ready
    /// condition (False with `not_ready`'s text when given).
    async fn apply_rivet_node(&self, cidrs: Option<&[String]>, not_ready: Option<&str>) -> Result<(), ApiError> {
        let api: Api<RivetNode> = Api::all(self.client.clone());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let resource = format!("rivetnodes/{}", self.node_name);
        let current = if let Some(cidrs) = cidrs {
            // Cluster-pool: the operator owns spec.podCidrs; this manager never sends them.
            let spec_cidrs = (self.ipam_mode == IpamMode::NodePool).then_some(cidrs);
            let object = json!({
                "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetNode",
                "metadata": { "name": self.node_name },
                "spec": rivet_node_spec(&self.addresses, spec_cidrs),
            });
            api.patch(&self.node_name, &params, &Patch::Apply(object))
                .await
                .map_err(|e| ApiError::new("apply", resource.clone(), e))?
        } else if let Some(current) = api
            .get_opt(&self.node_name)
            .await
            .map_err(|e| ApiError::new("get", resource.clone(), e))?
        {
            current
        } else {
            // The status needs the object; its spec comes once ready.
            let spec = match self.ipam_mode {
                IpamMode::NodePool => json!(RivetNodeSpec::default()),
                IpamMode::ClusterPool => rivet_node_spec(&self.addresses, None),
            };
            let object = json!({
                "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetNode",
                "metadata": { "name": self.node_name },
                "spec": spec,
            });
            api.patch(&self.node_name, &params, &Patch::Apply(object))
                .await
                .map_err(|e| ApiError::new("apply", resource.clone(), e))?
        };
        let (status, reason, message) = match not_ready {
            None => (
                "True",
                "AgentReady",
                "watch caches synced and every daemon of the node ready",
            ),
            Some(message) => ("False", "DaemonNotReady", message),
        };
        let previous = current
            .status
            .as_ref()
            .and_then(|s| s.condition(rivet_k8s::CONDITION_READY));
        let condition = ready_condition(previous, status, reason, message, Timestamp::now());
        let status = json!({
            "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetNode",
            "status": RivetNodeStatus { conditions: vec![condition] },
        });
        api.patch_status(&self.node_name, &params, &Patch::Apply(status))
            .await
            .map_err(|e| ApiError::new("apply", format!("{resource}/status"), e))?;
        Ok(())
    }

    async fn annotate_node(&self, cidrs: &[String]) -> Result<(), ApiError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let annotations: BTreeMap<&str, String> = [
            (POD_CIDRS_ANNOTATION, cidrs.join(",")),
            (NODE_ADDRESSES_ANNOTATION, self.addresses.join(",")),
        ]
        .into();
        let patch = json!({ "metadata": { "annotations": annotations } });
        api.patch(&self.node_name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| ApiError::new("patch", format!("nodes/{}", self.node_name), e))?;
        Ok(())
    }

    /// Removes the not-ready taint; `true` when there was one. The patch
    /// carries the resourceVersion read, so a concurrent change of the
    /// taints fails it (409) and the next pass reads again.
    async fn remove_taint(&self) -> Result<bool, ApiError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let resource = format!("nodes/{}", self.node_name);
        let node = api
            .get(&self.node_name)
            .await
            .map_err(|e| ApiError::new("get", resource.clone(), e))?;
        let taints: Vec<Taint> = node.spec.and_then(|s| s.taints).unwrap_or_default();
        let kept: Vec<&Taint> = taints.iter().filter(|t| !is_not_ready_taint(t)).collect();
        if kept.len() == taints.len() {
            return Ok(false);
        }
        let patch = json!({
            "metadata": { "resourceVersion": node.metadata.resource_version },
            "spec": { "taints": kept },
        });
        api.patch(&self.node_name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| ApiError::new("patch", resource, e))?;
        Ok(true)
    }
}

/// The RivetNode spec svc-k8s-sync applies: `addresses` (InternalIP) and
/// the encapsulation, and `podCidrs` only when given (node-pool IPAM). In
/// cluster-pool IPAM the field is left out, so svc-k8s-sync's field manager
/// never owns (and never clears) what the operator allocated.
pub fn rivet_node_spec(addresses: &[String], pod_cidrs: Option<&[String]>) -> serde_json::Value {
    let spec = RivetNodeSpec {
        addresses: addresses
            .iter()
            .map(|ip| NodeAddress {
                type_: "InternalIP".into(),
                ip: ip.clone(),
            })
            .collect(),
        pod_cidrs: pod_cidrs.unwrap_or_default().to_vec(),
        ..RivetNodeSpec::default()
    };
    let mut value = json!(spec);
    if pod_cidrs.is_none()
        && let Some(fields) = value.as_object_mut()
    {
        fields.remove("podCidrs");
    }
    value
}

/// The `Ready` condition to write at `now`: the heartbeat is `now` on every
/// pass (the operator taints a node whose heartbeat is older than its
/// `--node-status-grace`); the transition time is `now` only when the
/// status differs from `previous` (or `previous` has none), as kubelet
/// writes a Node's conditions.
pub fn ready_condition(
    previous: Option<&NodeCondition>,
    status: &str,
    reason: &str,
    message: &str,
    now: Timestamp,
) -> NodeCondition {
    let now = rivet_k8s::format_time(now);
    let last_transition_time = match previous {
        Some(p) if p.status == status && p.last_transition_time.is_some() => p.last_transition_time.clone(),
        _ => Some(now.clone()),
    };
    NodeCondition {
        type_: rivet_k8s::CONDITION_READY.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_transition_time,
        last_heartbeat_time: Some(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().expect("a timestamp")
    }

    #[test]
    fn the_heartbeat_moves_on_every_pass_and_the_transition_only_on_a_change() {
        let first = ready_condition(None, "True", "AgentReady", "ready", at("2026-11-26T06:00:00.4Z"));
        assert_eq!(first.last_heartbeat_time.as_deref(), Some("2026-11-26T06:00:00Z"));
        assert_eq!(first.last_transition_time.as_deref(), Some("2026-11-26T06:00:00Z"));

        let same = ready_condition(Some(&first), "True", "AgentReady", "ready", at("2026-11-26T06:00:10Z"));
        assert_eq!(same.last_heartbeat_time.as_deref(), Some("2026-11-26T06:00:10Z"));
        assert_eq!(
            same.last_transition_time.as_deref(),
            Some("2026-11-26T06:00:00Z"),
            "no change of status, no transition"
        );

        let changed = ready_condition(
            Some(&same),
            "False",
            "DaemonNotReady",
            "svc-ipam",
            at("2026-11-26T06:00:20Z"),
        );
        assert_eq!(changed.last_transition_time.as_deref(), Some("2026-11-26T06:00:20Z"));
        assert_eq!(changed.last_heartbeat_time.as_deref(), Some("2026-11-26T06:00:20Z"));

        // A condition written before heartbeats existed gets its transition now.
        let old = NodeCondition {
            last_transition_time: None,
            last_heartbeat_time: None,
            ..changed
        };
        let upgraded = ready_condition(
            Some(&old),
            "False",
            "DaemonNotReady",
            "svc-ipam",
            at("2026-11-26T06:00:30Z"),
        );
        assert_eq!(upgraded.last_transition_time.as_deref(), Some("2026-11-26T06:00:30Z"));
    }
}

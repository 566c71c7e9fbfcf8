//! Cluster-pool IPAM on the node (`--ipam-mode cluster-pool`, issue 15 §2):
//! the operator writes this node's pod CIDRs into its RivetNode's
//! `spec.podCidrs`, and svc-k8s-sync
//! - applies the RivetNode's spec (addresses) at start, never `podCidrs`
//!   (its field manager must not own them), so the operator can allocate
//!   before the node is ready;
//! - watches its own RivetNode and pushes `spec.podCidrs` to svc-ipam
//!   (`SetPool("default", ...)`), level-triggered: on every change of the
//!   object and every resync period, so a restarted svc-ipam that lost its
//!   state gets them again (SetPool with the same ranges writes nothing);
//! - writes condition `PodCIDRsApplied` (True, or False with svc-ipam's
//!   reason and message, e.g. a change that would strand a pod's address)
//!   with its own field manager;
//! - holds the node's readiness until svc-ipam serves the spec's CIDRs.
//!
//! A reconcile controller (`pod-cidrs`) over a watch of the one RivetNode
//! (`watch-rivet-node`).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_common::grpc::{ClientOptions, RpcError, connect_unix};
use rivet_k8s::{NodeCondition, RivetNode, RivetNodeStatus};
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use serde_json::json;

use crate::error::ApiError;
use crate::events::SyncMetrics;
use crate::node::rivet_node_spec;
use crate::watch::{self, WatchSpec, WatchStatus};
use crate::{FIELD_MANAGER, SyncState};

/// The field manager of condition `PodCIDRsApplied` (each condition has
/// one writer; `Ready` is [`FIELD_MANAGER`]'s).
pub const POD_CIDRS_FIELD_MANAGER: &str = "svc-k8s-sync-pod-cidrs";

/// The svc-ipam pool the pod CIDRs become (rivet-cni allocates from it).
pub const IPAM_POOL: &str = "default";

/// How the node gets its pod CIDRs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum IpamMode {
    /// svc-ipam's `--pool`s are the node's; svc-k8s-sync writes them into
    /// `RivetNode.spec.podCidrs`.
    #[default]
    NodePool,
    /// The operator allocates them into `RivetNode.spec.podCidrs`;
    /// svc-k8s-sync hands them to svc-ipam (SetPool).
    ClusterPool,
}

/// Why a pass failed (retried with the controller's backoff).
#[derive(Debug, thiserror::Error)]
pub enum PodCidrsError {
    /// An API call failed.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// svc-ipam did not answer SetPool (no reason: not reached, timed out).
    #[error("SetPool on svc-ipam: {0}")]
    Ipam(RpcError<ipampb::ErrorReason>),
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The node's svc-ipam as this controller uses it.
pub trait NodeIpam: Send + Sync {
    /// `SetPool(IPAM_POOL, cidrs)`.
    fn set_pool(
        &self,
        cidrs: &[IpNet],
    ) -> BoxFuture<'_, Result<ipampb::SetPoolResponse, RpcError<ipampb::ErrorReason>>>;
}

/// svc-ipam on its socket.
#[derive(Clone, Debug)]
pub struct SocketIpam {
    /// `<socket-dir>/svc-ipam.sock`.
    pub socket: PathBuf,
}

impl NodeIpam for SocketIpam {
    fn set_pool(
        &self,
        cidrs: &[IpNet],
    ) -> BoxFuture<'_, Result<ipampb::SetPoolResponse, RpcError<ipampb::ErrorReason>>> {
        let request = ipampb::SetPoolRequest {
            name: IPAM_POOL.into(),
            cidrs: cidrs.iter().map(|c| rivet_proto::net::prefix_to_proto(*c)).collect(),
        };
        Box::pin(async move {
            let options = ClientOptions {
                connect_timeout: Duration::from_secs(2),
                request_timeout: Duration::from_secs(10),
                ..ClientOptions::default()
            };
            let channel = connect_unix(&self.socket, &options).await.map_err(|e| {
                tonic::Status::unavailable(format!("connecting to svc-ipam at {}: {e}", self.socket.display()))
            })?;
            Ok(IpamClient::new(channel).set_pool(request).await?.into_inner())
        })
    }
}

/// The pod-cidrs controller's inputs.
pub struct PodCidrs {
    /// The API.
    pub client: Client,
    /// This node.
    pub node_name: String,
    /// Its addresses (`--node-address`), applied into the spec at start.
    pub addresses: Vec<String>,
    /// The node's svc-ipam.
    pub ipam: Arc<dyn NodeIpam>,
    /// Where readiness learns whether the pod CIDRs are applied.
    pub state: Arc<SyncState>,
    /// Logs and metrics.
    pub metrics: SyncMetrics,
    /// How often the spec's CIDRs are pushed again without a change.
    pub resync: Duration,
    /// Fired when the applied state changes (wakes node readiness).
    pub ready_trigger: Trigger,
}

struct Running {
    inputs: PodCidrs,
    rivet_node: Store<RivetNode>,
    watch: Arc<WatchStatus>,
    spec_applied: AtomicBool,
}

/// What the pass found, as condition `PodCIDRsApplied`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Applied {
    status: &'static str,
    reason: String,
    message: String,
}

impl PodCidrs {
    /// Starts the watch of this node's RivetNode and controller
    /// `pod-cidrs`; readiness waits for the pod CIDRs from now on.
    pub fn start(self, controllers: &Controllers) {
        self.state
            .set_pod_cidrs_pending(Some("waiting for the RivetNode's spec.podCidrs".into()));
        let trigger = Trigger::new();
        // Its own status: this watch is not one of the caches svc-endpoint is fed from.
        let watch = Arc::new(WatchStatus::default());
        let rivet_node = watch::start(
            controllers,
            WatchSpec {
                kind: "RivetNode",
                controller: "watch-rivet-node",
                api: Api::<RivetNode>::all(self.client.clone()),
                config: watcher::Config::default().fields(&format!("metadata.name={}", self.node_name)),
                dyntype: (),
            },
            watch.clone(),
            self.metrics.clone(),
            vec![trigger.clone()],
        );
        let running = Arc::new(Running {
            inputs: self,
            rivet_node,
            watch,
            spec_applied: AtomicBool::new(false),
        });
        controllers.reconcile(Controller::new("pod-cidrs").trigger(&trigger), move || {
            let running = running.clone();
            async move { running.pass().await }
        });
    }
}

impl Running {
    async fn pass(&self) -> Result<Action, PodCidrsError> {
        let me = &self.inputs;
        if !self.spec_applied.load(Ordering::Relaxed) {
            self.apply_spec().await?;
            self.spec_applied.store(true, Ordering::Relaxed);
        }
        if !self.watch.synced("RivetNode") {
            return Ok(Action::await_change());
        }
        let object = self.rivet_node.get(&ObjectRef::new(&me.node_name));
        let spec_cidrs = object.as_ref().map(|o| o.spec.pod_cidrs.clone()).unwrap_or_default();
        let applied = self.push(&spec_cidrs).await?;
        let pending = (applied.status != "True").then(|| format!("pod CIDRs not applied: {}", applied.message));
        if me.state.set_pod_cidrs_pending(pending) {
            match applied.status {
                "True" => me.metrics.pod_cidrs_applied(&me.node_name, &spec_cidrs),
                _ => me
                    .metrics
                    .pod_cidrs_not_applied(&me.node_name, &applied.reason, &applied.message),
            }
            me.ready_trigger.trigger();
        }
        let current = object.as_ref().and_then(|o| {
            o.status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == rivet_k8s::CONDITION_POD_CIDRS_APPLIED)
                .cloned()
        });
        self.write_condition(&applied, current).await?;
        Ok(Action::requeue(me.resync))
    }

    /// SetPool with the spec's CIDRs; a refusal is the condition's answer,
    /// an unreachable svc-ipam an error (retried).
    async fn push(&self, spec_cidrs: &[String]) -> Result<Applied, PodCidrsError> {
        if spec_cidrs.is_empty() {
            return Ok(Applied {
                status: "False",
                reason: "WaitingForPodCIDRs".into(),
                message: "spec.podCidrs is empty: the operator has not allocated this node's pod CIDRs yet".into(),
            });
        }
        let cidrs = match spec_cidrs
            .iter()
            .map(|c| c.parse::<IpNet>())
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(cidrs) => cidrs,
            Err(e) => {
                return Ok(Applied {
                    status: "False",
                    reason: "InvalidPodCIDRs".into(),
                    message: format!("spec.podCidrs {spec_cidrs:?}: {e}"),
                });
            }
        };
        match self.inputs.ipam.set_pool(&cidrs).await {
            Ok(_) => Ok(Applied {
                status: "True",
                reason: "PodCIDRsApplied".into(),
                message: format!("svc-ipam serves pool {IPAM_POOL}: {}", spec_cidrs.join(",")),
            }),
            Err(e) => match e.reason() {
                Some(reason) => Ok(Applied {
                    status: "False",
                    reason: camel_case(reason.as_str_name()),
                    message: format!("svc-ipam refused {}: {}", spec_cidrs.join(","), e.message()),
                }),
                // A field svc-ipam found invalid carries no reason but is an answer.
                None if e.code() == tonic::Code::InvalidArgument => Ok(Applied {
                    status: "False",
                    reason: "InvalidPodCIDRs".into(),
                    message: format!("svc-ipam refused {}: {}", spec_cidrs.join(","), e.message()),
                }),
                None => Err(PodCidrsError::Ipam(e)),
            },
        }
    }

    /// Applies the spec's addresses (never `podCidrs`): creates the
    /// RivetNode the operator allocates for.
    async fn apply_spec(&self) -> Result<(), ApiError> {
        let me = &self.inputs;
        let api: Api<RivetNode> = Api::all(me.client.clone());
        let object = json!({
            "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetNode",
            "metadata": { "name": me.node_name },
            "spec": rivet_node_spec(&me.addresses, None),
        });
        api.patch(
            &me.node_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await
        .map_err(|e| ApiError::new("apply", format!("rivetnodes/{}", me.node_name), e))?;
        tracing::info!(
            node = me.node_name,
            "RivetNode spec applied (addresses; pod CIDRs come from the operator)"
        );
        Ok(())
    }

    /// Applies condition `PodCIDRsApplied` unless the object already says
    /// the same; `lastTransitionTime` moves only when the status does.
    async fn write_condition(&self, applied: &Applied, current: Option<NodeCondition>) -> Result<(), ApiError> {
        let me = &self.inputs;
        let same = current.as_ref().is_some_and(|c| {
            c.status == applied.status
                && c.reason.as_deref() == Some(applied.reason.as_str())
                && c.message.as_deref() == Some(applied.message.as_str())
        });
        if same {
            return Ok(());
        }
        let transition = match current {
            Some(c) if c.status == applied.status => c.last_transition_time,
            _ => Some(rivet_k8s::format_time(Timestamp::now())),
        };
        let condition = NodeCondition {
            type_: rivet_k8s::CONDITION_POD_CIDRS_APPLIED.into(),
            status: applied.status.into(),
            reason: Some(applied.reason.clone()),
            message: Some(applied.message.clone()),
            last_transition_time: transition,
            last_heartbeat_time: None,
        };
        let status = json!({
            "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetNode",
            "status": RivetNodeStatus { conditions: vec![condition] },
        });
        let api: Api<RivetNode> = Api::all(me.client.clone());
        api.patch_status(
            &me.node_name,
            &PatchParams::apply(POD_CIDRS_FIELD_MANAGER).force(),
            &Patch::Apply(status),
        )
        .await
        .map_err(|e| ApiError::new("apply", format!("rivetnodes/{}/status", me.node_name), e))?;
        Ok(())
    }
}

/// `POOL_CHANGE_STRANDS_ALLOCATIONS` → `PoolChangeStrandsAllocations` (a
/// condition's reason is CamelCase).
fn camel_case(screaming: &str) -> String {
    screaming
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_string() + &chars.as_str().to_ascii_lowercase())
                .unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn reasons_become_camel_case() {
        assert_eq!(
            super::camel_case("POOL_CHANGE_STRANDS_ALLOCATIONS"),
            "PoolChangeStrandsAllocations"
        );
        assert_eq!(super::camel_case("NO_POOL_YET"), "NoPoolYet");
    }
}

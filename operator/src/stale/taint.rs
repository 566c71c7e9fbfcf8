//! The not-ready taint put back: a Node whose RivetNode says Rivet is not
//! ready there gets `node.rivet.io/agent-not-ready:NoSchedule`, so no new
//! pod is scheduled onto a node that cannot network it (running pods stay:
//! `NoSchedule`, not `NoExecute`). svc-k8s-sync removes it once ready.
//!
//! What counts as not ready ([`judge`]):
//! - condition `Ready` not `True` (the agent says a daemon is down);
//! - no `Ready` condition (a RivetNode the operator created from the Node
//!   whose agent never reported);
//! - `lastHeartbeatTime` older than `--node-status-grace`, absent or
//!   unreadable (the agent stopped: svc-k8s-sync refreshes it on every
//!   readiness pass).
//!
//! A Node without a RivetNode is left alone: before its agent's first
//! start it is the node's registration taints' business (kubelet's
//! `--register-with-taints`), and the operator keeps no memory of which
//! nodes had one. A Node being deleted is left alone too.
//!
//! The pass runs when a Node or RivetNode changes and again when the
//! freshest-looking heartbeat would pass the grace. Before tainting, the
//! RivetNode and the Node are read live (the caches may lag a node that
//! just became ready); the patch carries the Node's resourceVersion, so a
//! concurrent change of its taints fails with 409 and the pass is retried;
//! other taints are kept and the taint is never added twice.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use rivet_common::controller::Action;
use rivet_k8s::{CONDITION_READY, NOT_READY_TAINT, RivetNode, is_not_ready_taint};
use serde_json::json;

use super::cache::Cache;
use super::{StaleError, StaleMetrics};
use crate::term::Term;

/// A RivetNode's readiness at a moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    /// Ready, with a heartbeat that stays fresh until `stale_at`.
    Ready {
        /// When the heartbeat passes the grace.
        stale_at: Timestamp,
    },
    /// Not ready: the taint belongs on the Node.
    NotReady {
        /// The metric label: `not_ready`, `no_ready_condition`,
        /// `heartbeat_stale`.
        reason: &'static str,
        /// For the log line.
        detail: String,
    },
}

/// Judges `rivet_node` at `now` with a heartbeat grace of `grace`.
///
/// ```
/// use std::time::Duration;
/// use rivet_k8s::{NodeCondition, RivetNode, RivetNodeSpec, RivetNodeStatus};
/// use rivet_operator::stale::taint::{NodeState, judge};
///
/// let mut node = RivetNode::new("node-1", RivetNodeSpec::default());
/// node.status = Some(RivetNodeStatus {
///     conditions: vec![NodeCondition {
///         type_: "Ready".into(),
///         status: "True".into(),
///         last_heartbeat_time: Some("2026-11-26T06:00:00Z".into()),
///         ..NodeCondition::default()
///     }],
/// });
/// let grace = Duration::from_secs(40);
/// assert!(matches!(judge(&node, "2026-11-26T06:00:39Z".parse()?, grace), NodeState::Ready { .. }));
/// assert!(matches!(
///     judge(&node, "2026-11-26T06:00:41Z".parse()?, grace),
///     NodeState::NotReady { reason: "heartbeat_stale", .. }
/// ));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn judge(rivet_node: &RivetNode, now: Timestamp, grace: Duration) -> NodeState {
    let not_ready = |reason, detail: String| NodeState::NotReady { reason, detail };
    let Some(ready) = rivet_node.status.as_ref().and_then(|s| s.condition(CONDITION_READY)) else {
        return not_ready("no_ready_condition", "its RivetNode has no Ready condition".into());
    };
    if ready.status != "True" {
        return not_ready(
            "not_ready",
            format!(
                "Ready is {} ({}): {}",
                ready.status,
                ready.reason.as_deref().unwrap_or(""),
                ready.message.as_deref().unwrap_or("")
            ),
        );
    }
    let heartbeat = match ready.last_heartbeat() {
        Some(Ok(at)) => at,
        Some(Err(e)) => {
            return not_ready(
                "heartbeat_stale",
                format!(
                    "its Ready heartbeat {:?} is not RFC 3339: {e}",
                    ready.last_heartbeat_time
                ),
            );
        }
        None => return not_ready("heartbeat_stale", "its Ready condition has no heartbeat".into()),
    };
    let stale_at = heartbeat + grace;
    if now > stale_at {
        let age = now.duration_since(heartbeat).unsigned_abs();
        return not_ready(
            "heartbeat_stale",
            format!(
                "its Ready heartbeat ({heartbeat}) is {}s old, more than --node-status-grace {}s",
                age.as_secs(),
                grace.as_secs()
            ),
        );
    }
    NodeState::Ready { stale_at }
}

/// Whether `node` carries the not-ready taint.
pub fn has_not_ready_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(is_not_ready_taint))
}

/// The `node-taint` controller's state.
pub(crate) struct NodeTainter {
    pub client: Client,
    pub rivet_nodes: Cache<RivetNode>,
    pub nodes: Cache<Node>,
    pub grace: Duration,
    pub metrics: StaleMetrics,
}

impl NodeTainter {
    /// Both caches completed their first list.
    pub fn synced(&self) -> bool {
        self.rivet_nodes.synced() && self.nodes.synced()
    }

    /// One pass: taints the not-ready nodes that lack the taint; runs again
    /// when the first ready node's heartbeat would go stale (at the latest
    /// after the grace). Every node is tried; the first failure is returned
    /// after the rest.
    pub async fn pass(&self, term: &Term) -> Result<Action, StaleError> {
        let now = Timestamp::now();
        let mut next = self.grace;
        let mut not_ready = 0;
        let mut to_taint = Vec::new();
        for node in self.nodes.store.state() {
            if node.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(rivet_node) = self.rivet_nodes.store.get(&ObjectRef::new(&node.name_any())) else {
                continue;
            };
            match judge(&rivet_node, now, self.grace) {
                NodeState::Ready { stale_at } => {
                    let until = now.duration_until(stale_at).unsigned_abs();
                    next = next.min(until + Duration::from_secs(1));
                }
                NodeState::NotReady { .. } => {
                    not_ready += 1;
                    if !has_not_ready_taint(&node) {
                        to_taint.push(node.name_any());
                    }
                }
            }
        }
        self.metrics.nodes_not_ready(not_ready);
        let mut first_error = None;
        for name in to_taint {
            match self.taint(term, &name).await {
                Ok(()) => {}
                Err(StaleError::NotLeading(e)) => return Err(e.into()),
                Err(e) => {
                    self.metrics.call_failed("node-taint", e.kind_label(), &e.to_string());
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(Action::requeue(next)),
        }
    }

    /// Taints node `name` once its RivetNode, read live, is still not ready.
    async fn taint(&self, term: &Term, name: &str) -> Result<(), StaleError> {
        let rivet_nodes: Api<RivetNode> = Api::all(self.client.clone());
        let live = rivet_nodes
            .get_opt(name)
            .await
            .map_err(|e| StaleError::api("get", format!("rivetnodes/{name}"), e))?;
        let (reason, detail) = match live.map(|n| judge(&n, Timestamp::now(), self.grace)) {
            Some(NodeState::NotReady { reason, detail }) => (reason, detail),
            // Ready again or gone since the caches were read.
            _ => return Ok(()),
        };
        let nodes: Api<Node> = Api::all(self.client.clone());
        let resource = format!("nodes/{name}");
        let Some(node) = nodes
            .get_opt(name)
            .await
            .map_err(|e| StaleError::api("get", resource.clone(), e))?
        else {
            return Ok(());
        };
        if has_not_ready_taint(&node) || node.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let mut taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
        taints.push(Taint {
            key: NOT_READY_TAINT.into(),
            effect: "NoSchedule".into(),
            value: None,
            time_added: None,
        });
        let patch = json!({
            "metadata": { "resourceVersion": node.metadata.resource_version },
            "spec": { "taints": taints },
        });
        term.ensure()?;
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| StaleError::api("patch", resource, e))?;
        self.metrics.taint_added(name, reason, &detail);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_k8s::{NodeCondition, RivetNodeSpec, RivetNodeStatus};

    fn node(ready: Option<(&str, Option<&str>)>) -> RivetNode {
        let mut node = RivetNode::new("node-1", RivetNodeSpec::default());
        node.status = Some(RivetNodeStatus {
            conditions: ready
                .map(|(status, heartbeat)| NodeCondition {
                    type_: "Ready".into(),
                    status: status.into(),
                    last_heartbeat_time: heartbeat.map(Into::into),
                    ..NodeCondition::default()
                })
                .into_iter()
                .collect(),
        });
        node
    }

    fn reason(state: NodeState) -> &'static str {
        match state {
            NodeState::Ready { .. } => "ready",
            NodeState::NotReady { reason, .. } => reason,
        }
    }

    #[test]
    fn a_node_is_ready_only_with_ready_true_and_a_fresh_heartbeat() {
        let now: Timestamp = "2026-11-26T06:01:00Z".parse().unwrap();
        let grace = Duration::from_secs(40);
        let judged = |n: &RivetNode| reason(judge(n, now, grace));
        assert_eq!(judged(&node(Some(("True", Some("2026-11-26T06:00:50Z"))))), "ready");
        assert_eq!(
            judge(&node(Some(("True", Some("2026-11-26T06:00:50Z")))), now, grace),
            NodeState::Ready {
                stale_at: "2026-11-26T06:01:30Z".parse().unwrap()
            }
        );
        assert_eq!(
            judged(&node(Some(("True", Some("2026-11-26T06:00:20Z"))))),
            "ready",
            "exactly the grace"
        );
        assert_eq!(
            judged(&node(Some(("True", Some("2026-11-26T06:00:19Z"))))),
            "heartbeat_stale"
        );
        assert_eq!(judged(&node(Some(("True", None)))), "heartbeat_stale");
        assert_eq!(judged(&node(Some(("True", Some("yesterday"))))), "heartbeat_stale");
        assert_eq!(
            judged(&node(Some(("False", Some("2026-11-26T06:00:59Z"))))),
            "not_ready"
        );
        assert_eq!(
            judged(&node(Some(("Unknown", Some("2026-11-26T06:00:59Z"))))),
            "not_ready"
        );
        assert_eq!(judged(&node(None)), "no_ready_condition");
        let mut no_status = node(None);
        no_status.status = None;
        assert_eq!(judged(&no_status), "no_ready_condition");
    }

    #[test]
    fn only_the_not_ready_no_schedule_taint_counts() {
        let with = |taints: Vec<Taint>| Node {
            spec: Some(k8s_openapi::api::core::v1::NodeSpec {
                taints: Some(taints),
                ..Default::default()
            }),
            ..Node::default()
        };
        let taint = |key: &str, effect: &str| Taint {
            key: key.into(),
            effect: effect.into(),
            ..Taint::default()
        };
        assert!(has_not_ready_taint(&with(vec![
            taint("other", "NoSchedule"),
            taint(NOT_READY_TAINT, "NoSchedule")
        ])));
        assert!(!has_not_ready_taint(&with(vec![taint(NOT_READY_TAINT, "NoExecute")])));
        assert!(!has_not_ready_taint(&Node::default()));
    }
}

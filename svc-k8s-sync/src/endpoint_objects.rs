//! `RivetEndpoint` objects from svc-endpoint's endpoints: one per pod, in
//! the pod's namespace and with its name, owned by the pod (so the API
//! server's garbage collector deletes it with the pod), its status written
//! by server-side apply with field manager `svc-k8s-sync`, deleted when the
//! endpoint goes. After each WatchEndpoints snapshot (a new stream: start,
//! or svc-endpoint restarted) objects of this node that no endpoint has
//! are deleted.
//!
//! A supervised controller (`rivet-endpoints`) holding the WatchEndpoints
//! stream; a stream that ends or fails is opened again after a backoff. A
//! new svc-endpoint `boot_id` on the stream also wakes the feed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use rivet_common::controller::{Controller, Controllers, Trigger};
use rivet_common::grpc::{ClientOptions, DaemonChannel, RpcError, connect_unix_lazy};
use rivet_k8s::{RivetEndpoint, RivetEndpointState, RivetEndpointStatus};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use serde_json::json;
use tracing::Instrument as _;

use crate::caches::Caches;
use crate::error::ApiError;
use crate::events::SyncMetrics;
use crate::{FIELD_MANAGER, SyncState};

/// The label naming the node of a RivetEndpoint (so a node lists its own);
/// its value is [`node_label_value`], the full name is in the status.
pub const NODE_LABEL: &str = "rivet.io/node";

/// The longest label value the API server accepts.
const LABEL_VALUE_MAX: usize = 63;
/// Hex digits of the name's SHA-256 in a shortened value (64 bits).
const NODE_HASH_HEX: usize = 16;

/// The [`NODE_LABEL`] value of node `node`: the name itself when it fits a
/// label value (a node name is a DNS subdomain of up to 253 characters, a
/// label value at most 63), else its first 46 characters, `_` and 16 hex
/// digits of its SHA-256. A node name never holds `_`, so a shortened value
/// never equals another node's own name.
pub fn node_label_value(node: &str) -> String {
    if node.len() <= LABEL_VALUE_MAX {
        return node.to_owned();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(node.as_bytes());
    let hash: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    // A DNS subdomain is ASCII, so a byte index is a char boundary.
    let prefix = &node[..LABEL_VALUE_MAX - 1 - NODE_HASH_HEX];
    format!("{prefix}_{}", &hash[..NODE_HASH_HEX])
}

/// Why the endpoint stream stopped.
#[derive(Debug, thiserror::Error)]
pub enum EndpointObjectsError {
    /// WatchEndpoints failed or its stream broke.
    #[error("svc-endpoint WatchEndpoints: {0}")]
    Watch(#[from] RpcError<pb::ErrorReason>),
    /// An API write failed.
    #[error(transparent)]
    Api(#[from] ApiError),
}

/// The status of `endpoint`'s RivetEndpoint on node `node`.
pub fn endpoint_status(endpoint: &pb::Endpoint, node: &str) -> RivetEndpointStatus {
    let addresses: Vec<IpAddr> = endpoint
        .addresses
        .iter()
        .filter_map(|a| rivet_proto::net::address_from_bytes(&a.address).ok())
        .collect();
    let state = match pb::EndpointState::try_from(endpoint.state).unwrap_or_default() {
        pb::EndpointState::Restoring => RivetEndpointState::Restoring,
        pb::EndpointState::Unspecified | pb::EndpointState::WaitingForIdentity => {
            RivetEndpointState::WaitingForIdentity
        }
        pb::EndpointState::WaitingToRegenerate => RivetEndpointState::WaitingToRegenerate,
        pb::EndpointState::Regenerating => RivetEndpointState::Regenerating,
        pb::EndpointState::Ready => RivetEndpointState::Ready,
        pb::EndpointState::Disconnecting => RivetEndpointState::Disconnecting,
        pb::EndpointState::Disconnected => RivetEndpointState::Disconnected,
    };
    RivetEndpointStatus {
        id: endpoint.id,
        node: node.into(),
        container_id: Some(endpoint.container_id.clone()).filter(|c| !c.is_empty()),
        identity: Some(endpoint.identity).filter(|i| *i != 0),
        identity_labels: endpoint.identity_labels.clone(),
        ipv4: addresses.iter().find(|a| a.is_ipv4()).map(|a| a.to_string()),
        ipv6: addresses.iter().find(|a| a.is_ipv6()).map(|a| a.to_string()),
        state,
        policy_revision: endpoint.policy_revision,
        ingress_enforced: endpoint.ingress_enforced,
        egress_enforced: endpoint.egress_enforced,
        last_error: Some(endpoint.last_error.clone()).filter(|e| !e.is_empty()),
    }
}

type PodKey = (String, String);

/// The writer's inputs.
pub struct EndpointObjects {
    /// The API.
    pub client: Client,
    /// This node.
    pub node_name: String,
    /// The caches (pod uids for owner references; writes wait for sync).
    pub caches: Caches,
    /// Counters for GetStatus.
    pub state: Arc<SyncState>,
    /// Logs and metrics.
    pub metrics: SyncMetrics,
    /// Fired when svc-endpoint's boot_id changes.
    pub feed_trigger: Trigger,
}

impl EndpointObjects {
    /// Runs as controller `rivet-endpoints` against svc-endpoint at
    /// `socket`, once the caches synced.
    pub fn start(self, controllers: &Controllers, socket: &Path) {
        let channel = connect_unix_lazy(socket, &ClientOptions::default());
        let this = Arc::new(self);
        // Kept across streams: a resync's snapshot repeats traceparents.
        let traced = Arc::new(Mutex::new(TracedPods::new()));
        controllers.supervise(Controller::new("rivet-endpoints"), move |progress| {
            let (this, channel, traced) = (this.clone(), channel.clone(), traced.clone());
            async move {
                this.caches.status.wait_synced().await;
                this.run(channel, &progress, &traced).await
            }
        });
    }

    async fn run(
        &self,
        channel: DaemonChannel,
        progress: &rivet_common::controller::Progress,
        traced: &Mutex<TracedPods>,
    ) -> Result<(), EndpointObjectsError> {
        let mut stream = EndpointServiceClient::new(channel)
            .watch_endpoints(pb::WatchEndpointsRequest::default())
            .await
            .map_err(RpcError::from)?
            .into_inner();
        progress.ok();
        // Endpoint ids per pod, and the status last applied per pod.
        let mut pods: BTreeMap<PodKey, BTreeSet<u32>> = BTreeMap::new();
        let mut applied: BTreeMap<PodKey, RivetEndpointStatus> = BTreeMap::new();
        let mut boot_id = String::new();
        while let Some(message) = stream.next().await {
            let message = message.map_err(RpcError::from)?;
            if message.boot_id != boot_id {
                boot_id = message.boot_id.clone();
                self.feed_trigger.trigger();
            }
            match message.event {
                Some(pb::watch_endpoints_response::Event::Upserted(endpoint)) => {
                    let Some(key) = pod_key(&endpoint) else { continue };
                    pods.entry(key.clone()).or_default().insert(endpoint.id);
                    let status = endpoint_status(&endpoint, &self.node_name);
                    if applied.get(&key) == Some(&status) {
                        continue;
                    }
                    let traceparent = &endpoint.traceparent;
                    let new_trace =
                        !traceparent.is_empty() && lock(traced).get(&key).is_none_or(|seen| seen != traceparent);
                    let span = if new_trace {
                        self.apply_span(&key, traceparent)
                    } else {
                        tracing::Span::none()
                    };
                    if self.apply(&key, &endpoint, &status).instrument(span).await? {
                        if new_trace {
                            lock(traced).insert(key.clone(), traceparent.clone());
                        }
                        applied.insert(key, status);
                    }
                }
                Some(pb::watch_endpoints_response::Event::Removed(endpoint)) => {
                    let Some(key) = pod_key(&endpoint) else { continue };
                    let left = pods.get_mut(&key).map(|ids| {
                        ids.remove(&endpoint.id);
                        ids.len()
                    });
                    if left.unwrap_or(0) == 0 {
                        pods.remove(&key);
                        applied.remove(&key);
                        lock(traced).remove(&key);
                        self.delete(&key).await?;
                    }
                }
                Some(pb::watch_endpoints_response::Event::Synced(_)) => {
                    self.delete_orphans(&pods).await?;
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The span of applying `key`'s RivetEndpoint for the request whose
    /// context is `traceparent` (svc-endpoint's CreateEndpoint or
    /// UpdateLabels): a child of it, so the write joins that request's trace.
    fn apply_span(&self, (namespace, pod): &PodKey, traceparent: &str) -> tracing::Span {
        let span = tracing::info_span!("apply_rivet_endpoint", namespace = %namespace, pod = %pod);
        if !rivet_common::telemetry::set_parent_from_traceparent(&span, traceparent) {
            self.metrics.invalid_traceparent(namespace, pod, traceparent);
        }
        span
    }

    /// Applies the object and its status; `false` when the pod is not in
    /// the cache (gone: its object, if any, goes with it).
    async fn apply(
        &self,
        key: &PodKey,
        endpoint: &pb::Endpoint,
        status: &RivetEndpointStatus,
    ) -> Result<bool, ApiError> {
        let (namespace, name) = key;
        let uid = match self.caches.pod(namespace, name).and_then(|p| p.metadata.uid.clone()) {
            Some(uid) => uid,
            None if !endpoint.pod_uid.is_empty() => endpoint.pod_uid.clone(),
            None => return Ok(false),
        };
        let api: Api<RivetEndpoint> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let resource = format!("rivetendpoints {namespace}/{name}");
        let object = json!({
            "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetEndpoint",
            "metadata": {
                "name": name, "namespace": namespace,
                "labels": { NODE_LABEL: node_label_value(&self.node_name) },
                "ownerReferences": [{ "apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid }],
            },
            "spec": {},
        });
        let result = api.patch(name, &params, &Patch::Apply(object)).await;
        self.count("apply RivetEndpoint", &result);
        result.map_err(|e| ApiError::new("apply", resource.clone(), e))?;
        let status = json!({ "apiVersion": crate::RIVET_API_VERSION, "kind": "RivetEndpoint", "status": status });
        let result = api.patch_status(name, &params, &Patch::Apply(status)).await;
        self.count("apply RivetEndpoint status", &result);
        result.map_err(|e| ApiError::new("apply", format!("{resource}/status"), e))?;
        self.state.endpoint_object_applied();
        Ok(true)
    }

    async fn delete(&self, (namespace, name): &PodKey) -> Result<(), ApiError> {
        let api: Api<RivetEndpoint> = Api::namespaced(self.client.clone(), namespace);
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {
                self.metrics.call_ok("delete RivetEndpoint");
                self.state.endpoint_object_deleted();
                Ok(())
            }
            Err(e) if crate::error::status_code(&e) == Some(404) => Ok(()),
            Err(e) => {
                let e = ApiError::new("delete", format!("rivetendpoints {namespace}/{name}"), e);
                self.metrics
                    .call_failed("delete RivetEndpoint", e.kind_label(), &e.to_string());
                Err(e)
            }
        }
    }

    /// Deletes this node's objects that no endpoint has.
    async fn delete_orphans(&self, pods: &BTreeMap<PodKey, BTreeSet<u32>>) -> Result<(), ApiError> {
        let api: Api<RivetEndpoint> = Api::all(self.client.clone());
        let selector = format!("{NODE_LABEL}={}", node_label_value(&self.node_name));
        let objects = api
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| ApiError::new("list", "rivetendpoints", e))?;
        for object in objects {
            let (Some(namespace), Some(name)) = (object.metadata.namespace, object.metadata.name) else {
                continue;
            };
            let key = (namespace, name);
            if !pods.contains_key(&key) {
                tracing::info!(
                    namespace = key.0,
                    pod = key.1,
                    "deleting a RivetEndpoint no endpoint has"
                );
                self.delete(&key).await?;
            }
        }
        Ok(())
    }

    fn count<T>(&self, call: &'static str, result: &Result<T, kube::Error>) {
        match result {
            Ok(_) => self.metrics.call_ok(call),
            Err(e) => self
                .metrics
                .call_failed(call, crate::error::kind_label(e), &format!("{call}: {e}")),
        }
    }
}

/// Per pod, the endpoint traceparent whose RivetEndpoint write was traced.
type TracedPods = BTreeMap<PodKey, String>;

/// `traced`, whatever a panicking holder left (a plain map stays consistent).
fn lock(traced: &Mutex<TracedPods>) -> std::sync::MutexGuard<'_, TracedPods> {
    traced.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pod_key(endpoint: &pb::Endpoint) -> Option<PodKey> {
    (!endpoint.pod_namespace.is_empty() && !endpoint.pod_name.is_empty())
        .then(|| (endpoint.pod_namespace.clone(), endpoint.pod_name.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kubernetes' label value rule: at most 63 characters, empty or
    /// alphanumeric at both ends with `-`, `_`, `.` and alphanumerics between.
    fn is_label_value(value: &str) -> bool {
        let alnum = |c: char| c.is_ascii_alphanumeric();
        value.len() <= 63
            && (value.is_empty()
                || (value.starts_with(alnum)
                    && value.ends_with(alnum)
                    && value.chars().all(|c| alnum(c) || "-_.".contains(c))))
    }

    #[test]
    fn a_node_name_that_fits_a_label_value_is_the_value() {
        let name = format!("node-{}", "a".repeat(58));
        assert_eq!(name.len(), 63);
        assert_eq!(node_label_value(&name), name);
        assert_eq!(node_label_value("node-a.example"), "node-a.example");
    }

    #[test]
    fn a_node_name_longer_than_a_label_value_gets_a_valid_value_of_its_own() {
        // The longest node name (a DNS subdomain of 253), names that differ
        // only past the cut, and one whose cut ends on a dot.
        let longest = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61)
        );
        assert_eq!(longest.len(), 253);
        let twin_a = format!("{}-a", "n".repeat(70));
        let twin_b = format!("{}-b", "n".repeat(70));
        let dotted = format!("{}.{}", "x".repeat(45), "y".repeat(40));
        for name in [&longest, &twin_a, &twin_b, &dotted] {
            let value = node_label_value(name);
            assert!(is_label_value(&value), "{value:?} for {name:?} is not a label value");
            assert!(value.starts_with(&name[..46]), "{value:?} keeps the name's start");
            assert_eq!(node_label_value(name), value, "the value is stable");
        }
        assert_ne!(node_label_value(&twin_a), node_label_value(&twin_b));
    }

    #[test]
    fn the_status_shows_the_endpoints_addresses_as_text() {
        let address = |a: &str| pb::EndpointAddress {
            address: rivet_proto::net::address_bytes(a.parse().unwrap()),
            ipam_pool: "default".into(),
        };
        let endpoint = pb::Endpoint {
            id: 7,
            addresses: vec![address("2001:2::7"), address("198.18.0.7")],
            ..Default::default()
        };
        let status = endpoint_status(&endpoint, "node-a");
        assert_eq!(status.ipv4.as_deref(), Some("198.18.0.7"));
        assert_eq!(status.ipv6.as_deref(), Some("2001:2::7"));
    }
}

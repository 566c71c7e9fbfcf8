//! The watch caches of every kind svc-k8s-sync watches, started together.
//! Pods are this node's only (field selector `spec.nodeName`); the other
//! kinds are cluster-wide. Services and EndpointSlices feed svc-endpoint's
//! service catalog; Nodes are kept for node readiness.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use rivet_common::controller::{Controllers, Trigger};

use crate::desired::{self, Desired};
use crate::events::SyncMetrics;
use crate::watch::{self, WatchSpec, WatchStatus};

/// The kind names in status, in the order they are started.
pub const KINDS: &[&str] = &[
    "Pod",
    "Namespace",
    "NetworkPolicy",
    "RivetNetworkPolicy",
    "Node",
    "Service",
    "EndpointSlice",
];

/// `RivetNetworkPolicy` (`rivet.io/v1`), read as a dynamic object so that
/// its spec reaches svc-endpoint's policy parser as the API holds it (one
/// object the parser rejects is reported on its own, not a failed list).
pub fn rivet_network_policy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(crate::RIVET_API_GROUP, "v1", "RivetNetworkPolicy"),
        "rivetnetworkpolicies",
    )
}

/// The stores of every watched kind.
#[derive(Clone)]
pub struct Caches {
    /// This node's pods.
    pub pods: Store<Pod>,
    /// Every namespace.
    pub namespaces: Store<Namespace>,
    /// Every NetworkPolicy.
    pub network_policies: Store<NetworkPolicy>,
    /// Every RivetNetworkPolicy.
    pub rivet_network_policies: Store<DynamicObject>,
    /// Every Node.
    pub nodes: Store<Node>,
    /// Every Service.
    pub services: Store<Service>,
    /// Every EndpointSlice.
    pub endpoint_slices: Store<EndpointSlice>,
    /// Their sync state.
    pub status: Arc<WatchStatus>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Caches {
    /// Starts one watch controller per kind; `changed` fires after every
    /// event.
    pub fn start(
        client: &Client,
        node_name: &str,
        controllers: &Controllers,
        metrics: &SyncMetrics,
        changed: &[Trigger],
    ) -> Self {
        let status = Arc::new(WatchStatus::default());
        let changed = changed.to_vec();
        let config = watcher::Config::default();
        macro_rules! watch {
            ($kind:literal, $controller:literal, $api:expr, $config:expr, $dyntype:expr) => {
                watch::start(
                    controllers,
                    WatchSpec {
                        kind: $kind,
                        controller: $controller,
                        api: $api,
                        config: $config,
                        dyntype: $dyntype,
                    },
                    status.clone(),
                    metrics.clone(),
                    changed.clone(),
                )
            };
        }
        let rnp = rivet_network_policy_resource();
        Self {
            pods: watch!(
                "Pod",
                "watch-pods",
                Api::all(client.clone()),
                config.clone().fields(&format!("spec.nodeName={node_name}")),
                ()
            ),
            namespaces: watch!(
                "Namespace",
                "watch-namespaces",
                Api::all(client.clone()),
                config.clone(),
                ()
            ),
            network_policies: watch!(
                "NetworkPolicy",
                "watch-network-policies",
                Api::all(client.clone()),
                config.clone(),
                ()
            ),
            rivet_network_policies: watch!(
                "RivetNetworkPolicy",
                "watch-rivet-network-policies",
                Api::all_with(client.clone(), &rnp),
                config.clone(),
                rnp.clone()
            ),
            nodes: watch!("Node", "watch-nodes", Api::all(client.clone()), config.clone(), ()),
            services: watch!(
                "Service",
                "watch-services",
                Api::all(client.clone()),
                config.clone(),
                ()
            ),
            endpoint_slices: watch!(
                "EndpointSlice",
                "watch-endpoint-slices",
                Api::all(client.clone()),
                config.clone(),
                ()
            ),
            status,
        }
    }

    /// What svc-endpoint should know now.
    pub fn desired(&self) -> Desired {
        let mut out = Desired::default();
        for pod in self.pods.state() {
            if let Some(metadata) = desired::pod_metadata(&pod) {
                let reference = metadata.pod.clone().unwrap_or_default();
                out.pods.insert((reference.namespace, reference.name), metadata);
            }
        }
        for namespace in self.namespaces.state() {
            // An empty set means "forget": a namespace without labels is left out.
            if let Some((name, labels)) = desired::namespace_labels(&namespace).filter(|(_, l)| !l.is_empty()) {
                out.namespaces.insert(name, labels);
            }
        }
        for policy in self.network_policies.state() {
            if let Some((key, document)) = desired::network_policy_document(&policy) {
                out.policies.insert(key, document);
            }
        }
        for policy in self.rivet_network_policies.state() {
            if let Some((key, document)) = desired::rivet_policy_document(&policy) {
                out.policies.insert(key, document);
            }
        }
        let services = self.services.state();
        let slices = self.endpoint_slices.state();
        let documents = services
            .iter()
            .filter_map(|s| desired::service_document(s))
            .chain(slices.iter().filter_map(|s| desired::endpoint_slice_document(s)));
        out.service_objects.extend(documents);
        out
    }

    /// Pod `namespace/name` in this node's pod cache.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Arc<Pod>> {
        self.pods.get(&ObjectRef::new(name).within(namespace))
    }
}

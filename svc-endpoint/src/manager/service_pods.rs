//! The cluster's pods for the service catalog's selectors
//! ([`PodSource`]): this node's endpoints and other nodes' pods from
//! svc-identity's ipcache (`ipcache-watch`), with their labels (a remote
//! pod's from its identity in the selector cache) and named ports.

use std::collections::BTreeMap;
use std::net::IpAddr;

use rivet_common::labels::{LabelSource, Labels};
use rivet_policy::{NamedPort, Protocol};
use rivet_proto::identity::v1 as idpb;
use tokio::sync::watch;

use super::{EndpointManager, State};
use crate::catalog::PodSource;
use crate::catalog::backends::PodInfo;
use crate::endpoint::{EndpointKind, EndpointState, EndpointStatus};

/// Another node's pod as its ipcache entry describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RemotePod {
    identity: u32,
    namespace: String,
    name: String,
    node_name: String,
    named_ports: Vec<NamedPort>,
}

/// What an ipcache entry says of another node's pod: `None` for an entry
/// that is no host address; `Some((address, None))` for one that is no
/// other node's pod (so whatever was held for the address goes).
pub(super) fn remote_pod(entry: &idpb::IpcacheEntry) -> Option<(IpAddr, Option<RemotePod>)> {
    let net = rivet_proto::net::prefix_from_proto(entry.prefix.as_ref()?).ok()?;
    if net.prefix_len() != net.max_prefix_len() {
        return None;
    }
    let remote =
        entry.source == idpb::IpcacheSource::Kvstore as i32 || entry.source == idpb::IpcacheSource::Kubernetes as i32;
    let pod = (remote && !entry.pod_name.is_empty()).then(|| RemotePod {
        identity: entry.identity,
        namespace: entry.pod_namespace.clone(),
        name: entry.pod_name.clone(),
        node_name: entry.node_name.clone(),
        named_ports: entry
            .named_ports
            .iter()
            .filter_map(|p| {
                let protocol = p.protocol.parse::<Protocol>().ok()?;
                let port = u16::try_from(p.port).ok().filter(|p| *p != 0)?;
                Some(NamedPort::new(p.name.clone(), protocol, port))
            })
            .collect(),
    });
    Some((net.addr(), pod))
}

/// A pod's own labels (key → value) from its endpoint or identity labels:
/// the `k8s` and `container` ones, without the namespace labels Rivet adds.
fn pod_labels(labels: &Labels) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter(|l| {
            matches!(
                l.source(),
                LabelSource::K8s | LabelSource::Container | LabelSource::Unspec
            )
        })
        .filter(|l| l.key() != rivet_common::labels::POD_NAMESPACE_LABEL && !l.key().starts_with("ns.labels/"))
        .map(|l| (l.key().to_string(), l.value().to_string()))
        .collect()
}

/// Whether an endpoint's datapath serves traffic: ready, or restored from
/// the state dir (its datapath survived the restart) and not yet
/// regenerated; a new endpoint becomes a backend once it is ready.
fn serves(status: &EndpointStatus) -> bool {
    status.state == EndpointState::Ready
        || status.regenerations > 0
        || status
            .history
            .front()
            .is_some_and(|t| t.from == EndpointState::Restoring)
}

impl State {
    /// Records a change of the pods the catalog sees (no endpoint's).
    pub(super) fn pods_changed(&mut self) {
        self.changes.revision += 1;
        self.changes.published.send_replace(self.changes.revision);
    }

    fn service_pods(&self) -> Vec<PodInfo> {
        let mut pods = Vec::new();
        for slot in self.endpoints.values() {
            if slot.spec.kind != EndpointKind::Pod || !serves(&slot.status) {
                continue;
            }
            let terminating = matches!(
                slot.status.state,
                EndpointState::Disconnecting | EndpointState::Disconnected
            ) || slot.queue.is_closed();
            pods.push(PodInfo {
                namespace: if slot.spec.pod_namespace.is_empty() {
                    super::DEFAULT_NAMESPACE.to_string()
                } else {
                    slot.spec.pod_namespace.clone()
                },
                name: slot.spec.pod_name.clone(),
                labels: pod_labels(&slot.spec.labels),
                addresses: slot.spec.addresses.iter().map(|a| a.address).collect(),
                named_ports: slot.spec.named_ports.clone(),
                node_name: String::new(),
                local: true,
                terminating,
            });
        }
        // A remote pod's addresses are one entry each: group them by pod.
        let mut remote: BTreeMap<(&str, &str, &str), PodInfo> = BTreeMap::new();
        for (address, pod) in &self.remote_pods {
            let Some(labels) = self.selectors.labels(pod.identity) else {
                continue;
            };
            remote
                .entry((&pod.node_name, &pod.namespace, &pod.name))
                .or_insert_with(|| PodInfo {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    labels: pod_labels(&labels),
                    addresses: Vec::new(),
                    named_ports: pod.named_ports.clone(),
                    node_name: pod.node_name.clone(),
                    local: false,
                    terminating: false,
                })
                .addresses
                .push(*address);
        }
        pods.extend(remote.into_values());
        pods
    }
}

impl PodSource for EndpointManager {
    fn pods(&self) -> Option<Vec<PodInfo>> {
        let synced = *self.inner.scanned.borrow()
            && *self.inner.identities_synced.borrow()
            && *self.inner.ipcache_synced.borrow();
        synced.then(|| self.state().service_pods())
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.state().changes.published.subscribe()
    }

    fn revision(&self) -> u64 {
        self.state().changes.revision
    }
}

//! The records of the cluster that live in the kvstore next to identities
//! (DESIGN.md §4): a node under `nodes/v1/<cluster>/<node>` ([`NodeRecord`])
//! and a shared service under `services/v1/<cluster>/<ns>/<name>`
//! ([`ServiceRecord`]), both as JSON. The keys are svc-identity's
//! `etcd_backend::Layout`.
//!
//! Writers: rivet-operator mirrors every RivetNode and every Service
//! annotated [`GLOBAL_SERVICE_ANNOTATION`] (source [`RecordSource::Operator`],
//! keys without a lease). Readers: nodes without Kubernetes access, other
//! clusters, and (multi-node) every node, which also publishes its own
//! [`NodeRecord`] on its own lease.
//!
//! Stable format: fields are only ever added, each with a default, and
//! readers ignore fields they do not know (serde's default), so an older
//! reader keeps reading a newer writer's records. Lists are sorted, so equal
//! content serialises to equal bytes (writers compare before they write).
//!
//! Not here: turning Kubernetes objects into records (rivet-operator), the
//! keys (svc-identity's `Layout`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// The annotation that shares a Service through the kvstore (the seed's
/// `service.cilium.io/global`): value `"true"`.
pub const GLOBAL_SERVICE_ANNOTATION: &str = "service.rivet.io/global";

/// Who wrote a record.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum RecordSource {
    /// rivet-operator's mirror of the API object (a key without a lease).
    Operator,
    /// The node itself, on its own lease (multi-node).
    Node,
}

/// A node under `nodes/v1/<cluster>/<node>`.
///
/// ```
/// use rivet_common::cluster::{EncapsulationMode, NodeRecord, RecordSource};
/// let record: NodeRecord = serde_json::from_str(r#"{
///     "name": "n1", "cluster": "default",
///     "addresses": [{"type": "InternalIP", "ip": "198.18.0.1"}],
///     "podCidrs": ["198.19.1.0/24"],
///     "encapsulation": {"mode": "vxlan", "port": 8472},
///     "source": "operator",
///     "someFieldOfALaterVersion": 1
/// }"#).unwrap();
/// assert_eq!(record.encapsulation.mode, EncapsulationMode::Vxlan);
/// assert_eq!(record.source, RecordSource::Operator);
/// ```
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    /// The node's name (the Node's and RivetNode's `metadata.name`).
    pub name: String,
    /// The cluster the node belongs to (`--cluster-name`).
    pub cluster: String,
    /// The node's addresses, sorted by type then address.
    #[serde(default)]
    pub addresses: Vec<NodeRecordAddress>,
    /// The prefixes the node's pods get addresses from (one per family),
    /// sorted.
    #[serde(default)]
    pub pod_cidrs: Vec<IpNet>,
    /// How other nodes reach this node's pods.
    #[serde(default)]
    pub encapsulation: NodeRecordEncapsulation,
    /// The boot id of the node's svc-identity that wrote the record (empty
    /// in the operator's mirror): peers see a node restart as a new value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
    /// The node's health endpoint addresses (reached through the pod
    /// datapath by other nodes' probes), sorted; empty until it has one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub health_addresses: Vec<IpAddr>,
    /// Who wrote the record.
    pub source: RecordSource,
}

/// One address of a node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeRecordAddress {
    /// `InternalIP`, `ExternalIP` (as in the Node's status).
    #[serde(rename = "type")]
    pub type_: String,
    /// The address.
    pub ip: IpAddr,
}

/// Encapsulation of pod traffic towards a node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRecordEncapsulation {
    /// Direct routing or VXLAN.
    pub mode: EncapsulationMode,
    /// The UDP port of the tunnel (absent: the mode's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

/// How pod traffic crosses nodes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum EncapsulationMode {
    /// Routed natively (pod CIDRs are routable between nodes).
    #[default]
    Direct,
    /// VXLAN tunnels between nodes.
    Vxlan,
}

/// A shared service under `services/v1/<cluster>/<namespace>/<name>`.
///
/// ```
/// use rivet_common::cluster::{Protocol, ServiceRecord};
/// let record: ServiceRecord = serde_json::from_str(r#"{
///     "cluster": "default", "namespace": "shop", "name": "web",
///     "frontends": [{"ip": "198.18.100.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}],
///     "backends": [{"ip": "198.19.1.5", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}],
///     "source": "operator"
/// }"#).unwrap();
/// assert_eq!(record.backends[0].ports[0].protocol, Protocol::Tcp);
/// assert!(record.labels.is_empty() && record.session_affinity.is_none());
/// ```
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRecord {
    /// The cluster the service belongs to (`--cluster-name`).
    pub cluster: String,
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
    /// The cluster IPs with the Service's ports, sorted by address (empty
    /// for a headless service).
    #[serde(default)]
    pub frontends: Vec<ServiceAddress>,
    /// The ready endpoints of the Service's EndpointSlices with their ports,
    /// sorted by address (an address in several slices appears once, with
    /// the union of its ports).
    #[serde(default)]
    pub backends: Vec<ServiceAddress>,
    /// The Service's labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The Service's pod selector (empty: none; its endpoints are managed
    /// by hand).
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// `ClientIP` session affinity, when the Service asks for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_affinity: Option<SessionAffinity>,
    /// Who wrote the record.
    pub source: RecordSource,
}

/// One address of a service (a frontend or a backend) and its ports.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ServiceAddress {
    /// The address.
    pub ip: IpAddr,
    /// Its ports, sorted by name, port, protocol.
    #[serde(default)]
    pub ports: Vec<ServicePort>,
}

/// A port of a service address.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    /// The port's name in the Service (empty when the Service has a single
    /// unnamed port); a frontend and its backends share it.
    #[serde(default)]
    pub name: String,
    /// The port number.
    pub port: u16,
    /// The transport protocol.
    pub protocol: Protocol,
}

/// A service port's transport protocol, spelled as in Kubernetes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP.
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP.
    #[serde(rename = "UDP")]
    Udp,
    /// SCTP.
    #[serde(rename = "SCTP")]
    Sctp,
}

/// `ClientIP` session affinity: a client sticks to one backend.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SessionAffinity {
    /// How long a client sticks after its last packet, in seconds
    /// (Kubernetes' default: 10800).
    pub timeout_seconds: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format is a contract with other processes and releases:
    /// pin its exact spelling.
    #[test]
    fn records_serialise_to_the_documented_json() {
        let node = NodeRecord {
            name: "n1".into(),
            cluster: "c1".into(),
            addresses: vec![NodeRecordAddress {
                type_: "InternalIP".into(),
                ip: "198.18.0.1".parse().unwrap(),
            }],
            pod_cidrs: vec!["198.19.1.0/24".parse().unwrap(), "2001:2:0:1::/64".parse().unwrap()],
            encapsulation: NodeRecordEncapsulation {
                mode: EncapsulationMode::Vxlan,
                port: Some(8472),
            },
            boot_id: String::new(),
            health_addresses: vec![],
            source: RecordSource::Operator,
        };
        assert_eq!(
            serde_json::to_string(&node).unwrap(),
            r#"{"name":"n1","cluster":"c1","addresses":[{"type":"InternalIP","ip":"198.18.0.1"}],"podCidrs":["198.19.1.0/24","2001:2:0:1::/64"],"encapsulation":{"mode":"vxlan","port":8472},"source":"operator"}"#
        );
        let own = NodeRecord {
            boot_id: "b1".into(),
            health_addresses: vec!["198.18.1.2".parse().unwrap()],
            source: RecordSource::Node,
            ..node
        };
        let text = serde_json::to_string(&own).unwrap();
        assert!(
            text.ends_with(r#""bootId":"b1","healthAddresses":["198.18.1.2"],"source":"node"}"#),
            "a node's own record carries its boot id and health addresses: {text}"
        );
        assert_eq!(serde_json::from_str::<NodeRecord>(&text).unwrap(), own);
        let service = ServiceRecord {
            cluster: "c1".into(),
            namespace: "shop".into(),
            name: "web".into(),
            frontends: vec![ServiceAddress {
                ip: "198.18.100.10".parse().unwrap(),
                ports: vec![ServicePort {
                    name: "dns".into(),
                    port: 53,
                    protocol: Protocol::Udp,
                }],
            }],
            backends: vec![],
            labels: BTreeMap::from([("app".into(), "web".into())]),
            selector: BTreeMap::new(),
            session_affinity: Some(SessionAffinity { timeout_seconds: 60 }),
            source: RecordSource::Operator,
        };
        let text = serde_json::to_string(&service).unwrap();
        assert_eq!(
            text,
            r#"{"cluster":"c1","namespace":"shop","name":"web","frontends":[{"ip":"198.18.100.10","ports":[{"name":"dns","port":53,"protocol":"UDP"}]}],"backends":[],"labels":{"app":"web"},"selector":{},"sessionAffinity":{"timeoutSeconds":60},"source":"operator"}"#
        );
        assert_eq!(serde_json::from_str::<ServiceRecord>(&text).unwrap(), service);
    }
}

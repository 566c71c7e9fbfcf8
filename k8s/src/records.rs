//! Rivet's objects as the records of the cluster (`rivet_common::cluster`),
//! pure, no I/O: one conversion for rivet-operator's kvstore mirror and
//! svc-identity's node registry in CRD mode.

use std::net::IpAddr;

use ipnet::IpNet;
use rivet_common::cluster::{EncapsulationMode, NodeRecord, NodeRecordAddress, NodeRecordEncapsulation, RecordSource};

use crate::RivetNode;

/// A field of an object that could not be mirrored (the rest is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// `RivetNode/n1 spec.podCidrs[1]`.
    pub field: String,
    /// The value and why.
    pub reason: String,
}

/// The record of `node` in `cluster` written by `source` (rivet-operator's
/// kvstore mirror, or svc-identity's view of the RivetNodes in CRD mode),
/// and the fields left out because they do not parse.
///
/// ```
/// use rivet_k8s::{RivetNode, RivetNodeSpec};
/// use rivet_common::cluster::RecordSource;
/// use rivet_k8s::records::node_record;
/// let mut node = RivetNode::new("n1", RivetNodeSpec {
///     pod_cidrs: vec!["2001:2:0:1::/64".into(), "198.19.1.0/24".into(), "nonsense".into()],
///     ..Default::default()
/// });
/// let (record, skipped) = node_record(&node, "c1", RecordSource::Node);
/// assert_eq!(record.pod_cidrs, ["198.19.1.0/24".parse().unwrap(), "2001:2:0:1::/64".parse().unwrap()]);
/// assert_eq!(skipped[0].field, "RivetNode/n1 spec.podCidrs[2]");
/// ```
pub fn node_record(node: &RivetNode, cluster: &str, source: RecordSource) -> (NodeRecord, Vec<Skipped>) {
    let name = node.metadata.name.clone().unwrap_or_default();
    let mut skipped = Vec::new();
    let mut addresses: Vec<NodeRecordAddress> = node
        .spec
        .addresses
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a.ip.parse::<IpAddr>() {
            Ok(ip) => Some(NodeRecordAddress {
                type_: a.type_.clone(),
                ip,
            }),
            Err(e) => {
                skipped.push(Skipped {
                    field: format!("RivetNode/{name} spec.addresses[{i}].ip"),
                    reason: format!("{:?}: {e}", a.ip),
                });
                None
            }
        })
        .collect();
    addresses.sort();
    addresses.dedup();
    let mut pod_cidrs: Vec<IpNet> = node
        .spec
        .pod_cidrs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c.parse::<IpNet>() {
            Ok(net) => Some(net),
            Err(e) => {
                skipped.push(Skipped {
                    field: format!("RivetNode/{name} spec.podCidrs[{i}]"),
                    reason: format!("{c:?}: {e}"),
                });
                None
            }
        })
        .collect();
    pod_cidrs.sort();
    pod_cidrs.dedup();
    let record = NodeRecord {
        name,
        cluster: cluster.to_string(),
        addresses,
        pod_cidrs,
        encapsulation: NodeRecordEncapsulation {
            mode: match node.spec.encapsulation.mode {
                crate::EncapsulationMode::Direct => EncapsulationMode::Direct,
                crate::EncapsulationMode::Vxlan => EncapsulationMode::Vxlan,
            },
            port: node.spec.encapsulation.port,
        },
        boot_id: String::new(),
        health_addresses: Vec::new(),
        source,
    };
    (record, skipped)
}

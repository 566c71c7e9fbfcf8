//! API objects → kvstore records (`rivet_common::cluster`): pure, no I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use rivet_common::cluster::{
    GLOBAL_SERVICE_ANNOTATION, NodeRecord, Protocol, RecordSource, ServiceAddress, ServicePort, ServiceRecord,
    SessionAffinity,
};
use rivet_k8s::RivetNode;

/// The label an EndpointSlice names its Service with.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Kubernetes' default `ClientIP` affinity timeout (3 hours).
const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10_800;

pub use rivet_k8s::records::Skipped;

/// The record of `node` in `cluster` as rivet-operator mirrors it (source
/// `operator`), and the fields left out because they do not parse
/// ([`rivet_k8s::records::node_record`]).
///
/// ```
/// use rivet_k8s::{RivetNode, RivetNodeSpec};
/// use rivet_operator::kvstore_mirror::records::node_record;
/// let mut node = RivetNode::new("n1", RivetNodeSpec {
///     pod_cidrs: vec!["2001:2:0:1::/64".into(), "198.19.1.0/24".into(), "nonsense".into()],
///     ..Default::default()
/// });
/// let (record, skipped) = node_record(&node, "c1");
/// assert_eq!(record.pod_cidrs, ["198.19.1.0/24".parse().unwrap(), "2001:2:0:1::/64".parse().unwrap()]);
/// assert_eq!(skipped[0].field, "RivetNode/n1 spec.podCidrs[2]");
/// ```
pub fn node_record(node: &RivetNode, cluster: &str) -> (NodeRecord, Vec<Skipped>) {
    rivet_k8s::records::node_record(node, cluster, RecordSource::Operator)
}

/// Whether `service` is shared through the kvstore: annotated
/// `service.rivet.io/global: "true"` (any case, like the seed).
pub fn is_global(service: &Service) -> bool {
    service
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GLOBAL_SERVICE_ANNOTATION))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// A Kubernetes protocol name (absent: TCP).
fn protocol(name: Option<&str>) -> Result<Protocol, String> {
    match name.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(format!("unknown protocol {other:?}")),
    }
}

/// A port number from the API's `i32`.
fn port_number(port: i32) -> Result<u16, String> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("port {port} is out of range"))
}

/// The ports `(name, number, protocol)` listed at `field` that parse; the
/// others are added to `skipped`. A port without a number (an
/// EndpointSlice's "all ports") has nothing to mirror.
fn collect_ports<'p>(
    ports: impl Iterator<Item = (Option<&'p str>, Option<i32>, Option<&'p str>)>,
    field: &str,
    skipped: &mut Vec<Skipped>,
) -> BTreeSet<ServicePort> {
    let mut parsed = BTreeSet::new();
    for (i, (name, number, proto)) in ports.enumerate() {
        let Some(number) = number else { continue };
        let port = port_number(number).and_then(|port| {
            Ok(ServicePort {
                name: name.unwrap_or_default().to_string(),
                port,
                protocol: protocol(proto)?,
            })
        });
        match port {
            Ok(port) => {
                parsed.insert(port);
            }
            Err(reason) => skipped.push(Skipped {
                field: format!("{field}[{i}]"),
                reason,
            }),
        }
    }
    parsed
}

/// The record of `service` in `cluster` with the ready endpoints of
/// `slices` (those of other services are ignored), and the fields left out.
pub fn service_record<'s>(
    service: &Service,
    slices: impl IntoIterator<Item = &'s EndpointSlice>,
    cluster: &str,
) -> (ServiceRecord, Vec<Skipped>) {
    let namespace = service.metadata.namespace.clone().unwrap_or_default();
    let name = service.metadata.name.clone().unwrap_or_default();
    let object = format!("Service/{namespace}/{name}");
    let mut skipped = Vec::new();
    let spec = service.spec.clone().unwrap_or_default();

    let ports = collect_ports(
        spec.ports
            .iter()
            .flatten()
            .map(|p| (p.name.as_deref(), Some(p.port), p.protocol.as_deref())),
        &format!("{object} spec.ports"),
        &mut skipped,
    );
    let cluster_ips: Vec<&String> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().collect(),
        _ => spec.cluster_ip.iter().collect(),
    };
    let mut frontends = BTreeMap::new();
    for (i, ip) in cluster_ips.into_iter().enumerate() {
        if ip.is_empty() || ip == "None" {
            continue; // headless
        }
        match ip.parse::<IpAddr>() {
            Ok(ip) => {
                frontends.insert(ip, ports.clone());
            }
            Err(e) => skipped.push(Skipped {
                field: format!("{object} spec.clusterIPs[{i}]"),
                reason: format!("{ip:?}: {e}"),
            }),
        }
    }

    let mut backends: BTreeMap<IpAddr, BTreeSet<ServicePort>> = BTreeMap::new();
    let own = slices.into_iter().filter(|s| {
        s.metadata.namespace.as_deref() == Some(namespace.as_str())
            && s.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)) == Some(&name)
    });
    for slice in own {
        let slice_name = slice.metadata.name.as_deref().unwrap_or_default();
        let slice_ports = collect_ports(
            slice
                .ports
                .iter()
                .flatten()
                .map(|p| (p.name.as_deref(), p.port, p.protocol.as_deref())),
            &format!("EndpointSlice/{namespace}/{slice_name} ports"),
            &mut skipped,
        );
        for (i, endpoint) in slice.endpoints.iter().enumerate() {
            // The API: an absent `ready` means ready.
            if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for (j, address) in endpoint.addresses.iter().enumerate() {
                match address.parse::<IpAddr>() {
                    Ok(ip) => backends.entry(ip).or_default().extend(slice_ports.iter().cloned()),
                    Err(e) => skipped.push(Skipped {
                        field: format!("EndpointSlice/{namespace}/{slice_name} endpoints[{i}].addresses[{j}]"),
                        reason: format!("{address:?}: {e}"),
                    }),
                }
            }
        }
    }

    let addresses = |map: BTreeMap<IpAddr, BTreeSet<ServicePort>>| {
        map.into_iter()
            .map(|(ip, ports)| ServiceAddress {
                ip,
                ports: ports.into_iter().collect(),
            })
            .collect()
    };
    let session_affinity = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| SessionAffinity {
        timeout_seconds: spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_SECONDS),
    });
    let record = ServiceRecord {
        cluster: cluster.to_string(),
        namespace,
        name,
        frontends: addresses(frontends),
        backends: addresses(backends),
        labels: service.metadata.labels.clone().unwrap_or_default(),
        selector: spec.selector.unwrap_or_default(),
        session_affinity,
        source: RecordSource::Operator,
    };
    (record, skipped)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ClientIPConfig, ServicePort as K8sPort, ServiceSpec, SessionAffinityConfig};
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use kube::api::ObjectMeta;
    use rivet_common::cluster::EncapsulationMode;
    use rivet_k8s::{Encapsulation, NodeAddress, RivetNodeSpec};

    use super::*;

    fn meta(namespace: &str, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        }
    }

    fn slice(
        name: &str,
        service: &str,
        ports: &[(&str, i32, &str)],
        endpoints: &[(&str, Option<bool>)],
    ) -> EndpointSlice {
        EndpointSlice {
            metadata: meta("shop", name, &[(SERVICE_NAME_LABEL, service)]),
            address_type: "IPv4".into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p, proto)| EndpointPort {
                        name: Some(n.to_string()),
                        port: Some(*p),
                        protocol: Some(proto.to_string()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: endpoints
                .iter()
                .map(|(ip, ready)| Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: *ready,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn a_node_record_sorts_and_keeps_what_parses() {
        let node = RivetNode::new(
            "n1",
            RivetNodeSpec {
                addresses: vec![
                    NodeAddress {
                        type_: "InternalIP".into(),
                        ip: "198.18.0.2".into(),
                    },
                    NodeAddress {
                        type_: "ExternalIP".into(),
                        ip: "198.18.9.9".into(),
                    },
                    NodeAddress {
                        type_: "InternalIP".into(),
                        ip: "not-an-ip".into(),
                    },
                ],
                pod_cidrs: vec!["198.19.1.0/24".into()],
                encapsulation: Encapsulation {
                    mode: rivet_k8s::EncapsulationMode::Vxlan,
                    port: Some(8472),
                },
            },
        );
        let (record, skipped) = node_record(&node, "c1");
        let ips: Vec<String> = record
            .addresses
            .iter()
            .map(|a| format!("{} {}", a.type_, a.ip))
            .collect();
        assert_eq!(ips, ["ExternalIP 198.18.9.9", "InternalIP 198.18.0.2"]);
        assert_eq!(record.encapsulation.mode, EncapsulationMode::Vxlan);
        assert_eq!(record.encapsulation.port, Some(8472));
        assert_eq!((record.name.as_str(), record.cluster.as_str()), ("n1", "c1"));
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].field, "RivetNode/n1 spec.addresses[2].ip");
    }

    #[test]
    fn a_service_record_has_ready_backends_of_its_own_slices_merged_by_address() {
        let mut service = Service {
            metadata: meta("shop", "web", &[("tier", "front")]),
            spec: Some(ServiceSpec {
                cluster_ip: Some("198.18.100.10".into()),
                cluster_ips: Some(vec!["198.18.100.10".into(), "2001:2::a".into()]),
                ports: Some(vec![
                    K8sPort {
                        name: Some("http".into()),
                        port: 80,
                        ..Default::default()
                    },
                    K8sPort {
                        name: Some("dns".into()),
                        port: 53,
                        protocol: Some("UDP".into()),
                        ..Default::default()
                    },
                ]),
                selector: Some(BTreeMap::from([("app".into(), "web".into())])),
                session_affinity: Some("ClientIP".into()),
                session_affinity_config: Some(SessionAffinityConfig {
                    client_ip: Some(ClientIPConfig {
                        timeout_seconds: Some(60),
                    }),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let slices = [
            slice(
                "web-a",
                "web",
                &[("http", 8080, "TCP")],
                &[
                    ("198.19.1.5", Some(true)),
                    ("198.19.1.6", Some(false)),
                    ("198.19.1.7", None),
                ],
            ),
            slice("web-b", "web", &[("dns", 5353, "UDP")], &[("198.19.1.5", Some(true))]),
            slice(
                "other-a",
                "other",
                &[("http", 9090, "TCP")],
                &[("198.19.1.9", Some(true))],
            ),
        ];
        let (record, skipped) = service_record(&service, &slices, "c1");
        assert!(skipped.is_empty(), "{skipped:?}");
        let text = serde_json::to_value(&record).unwrap();
        assert_eq!(
            text["frontends"],
            serde_json::json!([
                {"ip": "198.18.100.10", "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "http", "port": 80, "protocol": "TCP"}]},
                {"ip": "2001:2::a", "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "http", "port": 80, "protocol": "TCP"}]}
            ])
        );
        assert_eq!(
            text["backends"],
            serde_json::json!([
                {"ip": "198.19.1.5", "ports": [
                    {"name": "dns", "port": 5353, "protocol": "UDP"},
                    {"name": "http", "port": 8080, "protocol": "TCP"}]},
                {"ip": "198.19.1.7", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}
            ])
        );
        assert_eq!(record.session_affinity, Some(SessionAffinity { timeout_seconds: 60 }));
        assert_eq!(record.labels["tier"], "front");
        assert_eq!(record.selector["app"], "web");

        // Headless, and an unknown protocol is left out by name.
        let spec = service.spec.as_mut().unwrap();
        spec.cluster_ip = Some("None".into());
        spec.cluster_ips = Some(vec!["None".into()]);
        spec.ports.as_mut().unwrap()[1].protocol = Some("QUIC".into());
        spec.session_affinity = None;
        let (record, skipped) = service_record(&service, &slices, "c1");
        assert!(record.frontends.is_empty() && record.session_affinity.is_none());
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].field, "Service/shop/web spec.ports[1]");
    }

    #[test]
    fn only_the_global_annotation_set_to_true_shares_a_service() {
        let annotated = |value: Option<&str>| Service {
            metadata: ObjectMeta {
                annotations: value.map(|v| BTreeMap::from([(GLOBAL_SERVICE_ANNOTATION.to_string(), v.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(is_global(&annotated(Some("true"))));
        assert!(is_global(&annotated(Some("True"))));
        assert!(!is_global(&annotated(Some("false"))));
        assert!(!is_global(&annotated(Some(""))));
        assert!(!is_global(&annotated(None)));
    }
}

//! From a stored Service, its EndpointSlices and the cluster's pods to what
//! svc-loader gets: one `LbService` per Service port and family, and the
//! backends as `rivet service get` shows them. Pure (no I/O, no clock).
//!
//! Where backends come from:
//! - a Service of origin KUBERNETES: its EndpointSlices only (the
//!   EndpointSlice controller already turned the selector into them);
//! - a Service of origin API: its EndpointSlices of origin API when there
//!   is one; else, with a selector, the pods whose labels match it in the
//!   Service's namespace (this node's endpoints and other nodes' pods from
//!   the ipcache); else its EndpointSlices of any origin.
//!
//! States (Kubernetes' EndpointSlice conditions): ready and not terminating
//! is ACTIVE (new flows); terminating and serving is TERMINATING (keeps its
//! flows, no new ones); anything else is no backend. A selected pod is
//! ACTIVE, or TERMINATING while its endpoint is being removed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use rivet_policy::NamedPort;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::loader::v1 as lb;

use super::Origin;
use super::document::{ClusterIps, Family, ServiceDef, ServicePortDef, SliceDef, TargetPort, TrafficPolicy};

/// A pod as selector resolution sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// Namespace.
    pub namespace: String,
    /// Name (empty when unknown).
    pub name: String,
    /// Its labels, key → value (Kubernetes pod labels).
    pub labels: BTreeMap<String, String>,
    /// Its addresses.
    pub addresses: Vec<IpAddr>,
    /// Its named container ports (named targetPorts resolve through them).
    pub named_ports: Vec<NamedPort>,
    /// The node it runs on ("" when unknown).
    pub node_name: String,
    /// It runs on this node.
    pub local: bool,
    /// It is going away: keeps its flows, gets no new ones.
    pub terminating: bool,
}

/// A stored Service with its allocations resolved: `def.cluster_ips` is
/// `Given` (or `Headless`, or `Allocate` for a KUBERNETES Service the API
/// server gave no address yet) and every node port is set.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedService<'a> {
    /// The Service.
    pub def: &'a ServiceDef,
    /// Who applied it.
    pub origin: Origin,
    /// Service id per (port name, family).
    pub ids: &'a BTreeMap<(String, Family), u32>,
}

/// One Service port and family as handed to svc-loader.
#[derive(Debug, Clone, PartialEq)]
pub struct LbEntry {
    /// The Service port's name.
    pub port_name: String,
    /// Its family.
    pub family: Family,
    /// The loader service.
    pub service: lb::LbService,
}

/// What a Service resolves to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolution {
    /// One per port and family (none for a headless Service).
    pub entries: Vec<LbEntry>,
    /// Every backend considered, with its conditions.
    pub backends: Vec<pb::ServiceBackendView>,
}

/// Whether `labels` match `selector` (every key equal; an empty selector
/// matches nothing, as a Service without selector selects no pod).
pub fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A backend before it becomes an `LbBackend`.
struct Candidate {
    address: IpAddr,
    port: u16,
    state: lb::BackendState,
    node_local: bool,
}

/// Resolves `service` against its `slices` (those labelled with its name in
/// its namespace, with their origins) and the cluster's `pods`.
/// `local_addresses` are this node's endpoints' (a slice endpoint at one is
/// node-local whatever its nodeName says).
pub fn resolve(
    service: &ResolvedService<'_>,
    slices: &[(&SliceDef, Origin)],
    pods: &[PodInfo],
    node_name: &str,
    local_addresses: &BTreeSet<IpAddr>,
) -> Resolution {
    let def = service.def;
    let api_slices = slices.iter().any(|(_, o)| *o == Origin::Api);
    let from_pods = service.origin == Origin::Api && !api_slices && !def.selector.is_empty();
    let slices: Vec<&SliceDef> = slices
        .iter()
        .filter(|(_, o)| service.origin == Origin::Kubernetes || !api_slices || *o == Origin::Api)
        .map(|(s, _)| *s)
        .collect();
    let cluster_ips: Vec<IpAddr> = match &def.cluster_ips {
        ClusterIps::Given(ips) => ips.clone(),
        ClusterIps::Headless | ClusterIps::Allocate => Vec::new(),
    };
    let mut resolution = Resolution::default();
    for port in &def.ports {
        let port_label = if port.name.is_empty() {
            port.port.to_string()
        } else {
            port.name.clone()
        };
        for family in [Family::IPv4, Family::IPv6] {
            let mut candidates = Vec::new();
            if from_pods {
                for pod in pods
                    .iter()
                    .filter(|p| p.namespace == def.namespace && selects(&def.selector, &p.labels))
                {
                    let Some(target) = target_port(port, &pod.named_ports) else {
                        continue;
                    };
                    for address in pod.addresses.iter().filter(|a| Family::of(**a) == family) {
                        let state = if pod.terminating {
                            lb::BackendState::Terminating
                        } else {
                            lb::BackendState::Active
                        };
                        resolution.backends.push(pb::ServiceBackendView {
                            address: address.to_string(),
                            port: target.into(),
                            service_port: port_label.clone(),
                            ready: !pod.terminating,
                            serving: true,
                            terminating: pod.terminating,
                            pod: format!("{}/{}", pod.namespace, pod.name),
                            node_name: pod.node_name.clone(),
                        });
                        candidates.push(Candidate {
                            address: *address,
                            port: target,
                            state,
                            node_local: pod.local,
                        });
                    }
                }
            } else {
                for slice in slices.iter().filter(|s| s.family == Some(family)) {
                    let Some(target) = slice
                        .ports
                        .iter()
                        .find(|p| p.name == port.name && p.protocol == port.protocol)
                        .and_then(|p| p.port)
                    else {
                        continue;
                    };
                    for endpoint in &slice.endpoints {
                        let state = if endpoint.ready && !endpoint.terminating {
                            Some(lb::BackendState::Active)
                        } else if endpoint.terminating && endpoint.serving {
                            Some(lb::BackendState::Terminating)
                        } else {
                            None
                        };
                        for address in &endpoint.addresses {
                            resolution.backends.push(pb::ServiceBackendView {
                                address: address.to_string(),
                                port: target.into(),
                                service_port: port_label.clone(),
                                ready: endpoint.ready,
                                serving: endpoint.serving,
                                terminating: endpoint.terminating,
                                pod: endpoint.pod.clone(),
                                node_name: endpoint.node_name.clone(),
                            });
                            if let Some(state) = state {
                                candidates.push(Candidate {
                                    address: *address,
                                    port: target,
                                    state,
                                    node_local: (!node_name.is_empty() && endpoint.node_name == node_name)
                                        || local_addresses.contains(address),
                                });
                            }
                        }
                    }
                }
            }
            let Some(cluster_ip) = cluster_ips.iter().copied().find(|ip| Family::of(*ip) == family) else {
                continue;
            };
            let Some(service_id) = service.ids.get(&(port.name.clone(), family)).copied() else {
                continue;
            };
            let mut frontends = vec![lb::LbFrontend {
                kind: lb::FrontendKind::ClusterIp as i32,
                address: rivet_proto::net::address_bytes(cluster_ip),
                port: port.port.into(),
            }];
            if def.service_type.has_node_ports()
                && let Some(node_port) = port.node_port
            {
                frontends.push(lb::LbFrontend {
                    kind: lb::FrontendKind::NodePort as i32,
                    address: Vec::new(),
                    port: node_port.into(),
                });
            }
            resolution.entries.push(LbEntry {
                port_name: port.name.clone(),
                family,
                service: lb::LbService {
                    service_id,
                    family: match family {
                        Family::IPv4 => lb::Family::Ipv4,
                        Family::IPv6 => lb::Family::Ipv6,
                    } as i32,
                    protocol: port.protocol.to_proto() as i32,
                    frontends,
                    backends: lb_backends(candidates),
                    affinity_timeout_seconds: def.affinity_timeout_seconds,
                    external_traffic_policy: match def.external_traffic_policy {
                        TrafficPolicy::Cluster => lb::TrafficPolicy::Cluster,
                        TrafficPolicy::Local => lb::TrafficPolicy::Local,
                    } as i32,
                },
            });
        }
    }
    resolution
}

/// The backend port of `port` on a pod with `named_ports`; `None` when a
/// named target port is not one of the pod's.
fn target_port(port: &ServicePortDef, named_ports: &[NamedPort]) -> Option<u16> {
    match &port.target {
        TargetPort::Number(n) => Some(*n),
        TargetPort::Name(name) => named_ports
            .iter()
            .find(|p| p.name == *name && p.protocol == port.protocol)
            .map(|p| p.port),
    }
}

/// Unique by (address, port), an ACTIVE one winning, sorted (so an
/// unchanged set compares equal).
fn lb_backends(candidates: Vec<Candidate>) -> Vec<lb::LbBackend> {
    let mut by_key: BTreeMap<(IpAddr, u16), Candidate> = BTreeMap::new();
    for c in candidates {
        let key = (c.address, c.port);
        match by_key.get(&key) {
            Some(held) if held.state == lb::BackendState::Active => {}
            _ => {
                by_key.insert(key, c);
            }
        }
    }
    by_key
        .into_values()
        .map(|c| lb::LbBackend {
            address: rivet_proto::net::address_bytes(c.address),
            port: c.port.into(),
            state: c.state as i32,
            node_local: c.node_local,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::document::ServiceObject;
    use super::*;
    use rivet_policy::Protocol;

    fn service(doc: &str) -> ServiceDef {
        match ServiceObject::parse(doc).unwrap() {
            ServiceObject::Service(s) => *s,
            _ => panic!("a Service"),
        }
    }

    fn slice(doc: &str) -> SliceDef {
        match ServiceObject::parse(doc).unwrap() {
            ServiceObject::EndpointSlice(s) => *s,
            _ => panic!("a slice"),
        }
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  type: NodePort\n  clusterIP: 198.19.128.10\n  selector: {app: web}\n  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080}]\n";

    fn pod(name: &str, app: &str, address: &str, local: bool) -> PodInfo {
        PodInfo {
            namespace: "shop".into(),
            name: name.into(),
            labels: BTreeMap::from([("app".into(), app.into())]),
            addresses: vec![address.parse().unwrap()],
            named_ports: vec![NamedPort::new("http", Protocol::Tcp, 8080)],
            node_name: if local { "n1".into() } else { "n2".into() },
            local,
            terminating: false,
        }
    }

    /// WEB's id of port http over IPv4.
    fn web_ids() -> BTreeMap<(String, Family), u32> {
        BTreeMap::from([(("http".to_string(), Family::IPv4), 7)])
    }

    /// `def` applied through the API with `ids`.
    fn api<'a>(def: &'a ServiceDef, ids: &'a BTreeMap<(String, Family), u32>) -> ResolvedService<'a> {
        ResolvedService {
            def,
            origin: Origin::Api,
            ids,
        }
    }

    fn backends(r: &Resolution) -> Vec<(String, u32, i32, bool)> {
        r.entries[0]
            .service
            .backends
            .iter()
            .map(|b| {
                (
                    rivet_proto::net::format_address(&b.address),
                    b.port,
                    b.state,
                    b.node_local,
                )
            })
            .collect()
    }

    #[test]
    fn a_selector_takes_matching_pods_of_its_namespace_through_their_named_port() {
        let def = service(WEB);
        let ids = web_ids();
        let svc = api(&def, &ids);
        let mut other_ns = pod("web-9", "web", "198.18.0.9", true);
        other_ns.namespace = "default".into();
        let mut no_port = pod("web-3", "web", "198.18.0.3", true);
        no_port.named_ports.clear();
        let pods = [
            pod("web-1", "web", "198.18.0.1", true),
            pod("web-2", "web", "198.18.1.2", false),
            pod("db-1", "db", "198.18.0.4", true),
            other_ns,
            no_port,
        ];
        let r = resolve(&svc, &[], &pods, "n1", &BTreeSet::new());
        assert_eq!(r.entries.len(), 1);
        let e = &r.entries[0].service;
        assert_eq!(e.service_id, 7);
        assert_eq!(e.frontends.len(), 2, "ClusterIP and NodePort");
        assert_eq!(e.frontends[1].port, 30080);
        let active = lb::BackendState::Active as i32;
        assert_eq!(
            backends(&r),
            [
                ("198.18.0.1".to_string(), 8080, active, true),
                ("198.18.1.2".to_string(), 8080, active, false)
            ]
        );
    }

    #[test]
    fn api_slices_win_over_the_selector_and_conditions_set_states() {
        let def = service(WEB);
        let ids = web_ids();
        let svc = api(&def, &ids);
        let s = slice(
            r#"{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
  "metadata": {"name": "web-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
  "addressType": "IPv4", "ports": [{"name": "http", "port": 9090}],
  "endpoints": [
    {"addresses": ["198.18.0.5"], "nodeName": "n1"},
    {"addresses": ["198.18.0.6"], "conditions": {"ready": false, "serving": true, "terminating": true}},
    {"addresses": ["198.18.0.7"], "conditions": {"ready": false, "serving": false, "terminating": true}},
    {"addresses": ["198.18.0.8"], "conditions": {"ready": false}}]}"#,
        );
        let pods = [pod("web-1", "web", "198.18.0.1", true)];
        let r = resolve(&svc, &[(&s, Origin::Api)], &pods, "n1", &BTreeSet::new());
        assert_eq!(
            backends(&r),
            [
                ("198.18.0.5".to_string(), 9090, lb::BackendState::Active as i32, true),
                (
                    "198.18.0.6".to_string(),
                    9090,
                    lb::BackendState::Terminating as i32,
                    false
                ),
            ]
        );
        // Every endpoint is shown with its conditions, backends or not.
        assert_eq!(r.backends.len(), 4);
        // Without the slice the selector decides.
        let r = resolve(&svc, &[], &pods, "n1", &BTreeSet::new());
        assert_eq!(backends(&r)[0].0, "198.18.0.1");
    }

    #[test]
    fn headless_and_unresolved_families_make_no_loader_service() {
        let mut def = service(WEB);
        def.cluster_ips = ClusterIps::Headless;
        let ids = BTreeMap::new();
        let svc = api(&def, &ids);
        let r = resolve(
            &svc,
            &[],
            &[pod("web-1", "web", "198.18.0.1", true)],
            "n1",
            &BTreeSet::new(),
        );
        assert!(r.entries.is_empty());
        assert_eq!(r.backends.len(), 1, "backends are still shown");
    }
}

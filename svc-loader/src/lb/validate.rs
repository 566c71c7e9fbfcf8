//! `LbService` messages → checked [`Service`]s: every field, named on error.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use rivet_proto::loader::v1 as pb;

use super::{Backend, Frontend, Service};
use crate::validate::InvalidField;

/// Most backends of one service (the proto's limit; the record holds 1,024).
pub const MAX_BACKENDS: usize = 1000;
/// Most frontends of one service (ClusterIPs, externalIPs, a NodePort).
pub const MAX_FRONTENDS: usize = 64;
/// Longest session affinity timeout (Kubernetes' limit: one day).
pub const MAX_AFFINITY_TIMEOUT: u32 = 86_400;
/// Most services in one `ReplaceServices`: a bound on what one stream may
/// make the loader hold in memory. The maps' size (`--lb-services-max`) is
/// the node's real limit, refused as MAP_FULL.
pub const MAX_SERVICES: usize = 1 << 20;

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field: field.into(),
        reason: reason.into(),
    }
}

fn port(field: &str, port: u32) -> Result<u16, InvalidField> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid(field, format!("{port} is not a port (1..=65535)")))
}

fn address(field: &str, bytes: &[u8], family: u8) -> Result<IpAddr, InvalidField> {
    let ip = match (family, bytes.len()) {
        (4, 4) => IpAddr::from(<[u8; 4]>::try_from(bytes).expect("length checked")),
        (6, 16) => IpAddr::from(<[u8; 16]>::try_from(bytes).expect("length checked")),
        (_, len) => {
            return Err(invalid(
                field,
                format!("{len} bytes is no IPv{family} address (the service's family)"),
            ));
        }
    };
    if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
        return Err(invalid(field, format!("{ip} cannot be a service address")));
    }
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return Err(invalid(field, format!("{ip} is IPv4-mapped: use the IPv4 family")));
    }
    Ok(ip)
}

/// A required message field is missing.
pub fn missing(field: &str) -> InvalidField {
    invalid(field, "is required")
}

/// A field that must be nonzero is zero.
pub fn nonzero(field: &str) -> InvalidField {
    invalid(field, "must be nonzero")
}

/// A `ReplaceServices` stream carried more than [`MAX_SERVICES`].
pub fn too_many_services(n: usize) -> InvalidField {
    invalid("services", format!("{n} services or more, at most {MAX_SERVICES}"))
}

/// Checks one service; `field` is its path (`service`, `services[3]`).
pub fn service(field: &str, s: &pb::LbService) -> Result<Service, InvalidField> {
    if s.service_id == 0 {
        return Err(nonzero(&format!("{field}.service_id")));
    }
    let family = match pb::Family::try_from(s.family) {
        Ok(pb::Family::Ipv4) => 4,
        Ok(pb::Family::Ipv6) => 6,
        _ => return Err(invalid(format!("{field}.family"), "must be IPV4 or IPV6")),
    };
    let protocol = match pb::Protocol::try_from(s.protocol) {
        Ok(p @ (pb::Protocol::Tcp | pb::Protocol::Udp | pb::Protocol::Sctp)) => p as u8,
        _ => return Err(invalid(format!("{field}.protocol"), "must be TCP, UDP or SCTP")),
    };
    if s.frontends.is_empty() {
        return Err(invalid(format!("{field}.frontends"), "a service needs a frontend"));
    }
    if s.frontends.len() > MAX_FRONTENDS {
        return Err(invalid(
            format!("{field}.frontends"),
            format!("{} frontends, at most {MAX_FRONTENDS}", s.frontends.len()),
        ));
    }
    let mut frontends = BTreeSet::new();
    for (i, f) in s.frontends.iter().enumerate() {
        let path = format!("{field}.frontends[{i}]");
        let p = port(&format!("{path}.port"), f.port)?;
        let frontend = match pb::FrontendKind::try_from(f.kind) {
            Ok(pb::FrontendKind::ClusterIp) => Frontend::ClusterIp(SocketAddr::new(
                address(&format!("{path}.address"), &f.address, family)?,
                p,
            )),
            Ok(pb::FrontendKind::NodePort) => {
                if !f.address.is_empty() {
                    return Err(invalid(
                        format!("{path}.address"),
                        "must be empty for a NODE_PORT (every address of the node)",
                    ));
                }
                Frontend::NodePort(p)
            }
            _ => return Err(invalid(format!("{path}.kind"), "must be CLUSTER_IP or NODE_PORT")),
        };
        if !frontends.insert(frontend) {
            return Err(invalid(path, format!("{frontend} is given twice")));
        }
    }
    if s.backends.len() > MAX_BACKENDS {
        return Err(invalid(
            format!("{field}.backends"),
            format!("{} backends, at most {MAX_BACKENDS}", s.backends.len()),
        ));
    }
    let mut backends = BTreeMap::new();
    for (i, b) in s.backends.iter().enumerate() {
        let path = format!("{field}.backends[{i}]");
        let addr = SocketAddr::new(
            address(&format!("{path}.address"), &b.address, family)?,
            port(&format!("{path}.port"), b.port)?,
        );
        let terminating = match pb::BackendState::try_from(b.state) {
            Ok(pb::BackendState::Active) => false,
            Ok(pb::BackendState::Terminating) => true,
            _ => return Err(invalid(format!("{path}.state"), "must be ACTIVE or TERMINATING")),
        };
        let backend = Backend {
            addr,
            terminating,
            node_local: b.node_local,
        };
        if backends.insert(addr, backend).is_some() {
            return Err(invalid(path, format!("backend {addr} is given twice")));
        }
    }
    if s.affinity_timeout_seconds > MAX_AFFINITY_TIMEOUT {
        return Err(invalid(
            format!("{field}.affinity_timeout_seconds"),
            format!(
                "{} s, at most {MAX_AFFINITY_TIMEOUT} (0 = no affinity)",
                s.affinity_timeout_seconds
            ),
        ));
    }
    let local = match pb::TrafficPolicy::try_from(s.external_traffic_policy) {
        Ok(pb::TrafficPolicy::Unspecified | pb::TrafficPolicy::Cluster) => false,
        Ok(pb::TrafficPolicy::Local) => true,
        Err(_) => {
            return Err(invalid(
                format!("{field}.external_traffic_policy"),
                "must be CLUSTER or LOCAL",
            ));
        }
    };
    Ok(Service {
        id: s.service_id,
        family,
        protocol,
        frontends: frontends.into_iter().collect(),
        backends: backends.into_values().collect(),
        affinity_timeout: s.affinity_timeout_seconds,
        local,
    })
}

/// Checks a whole set (`ReplaceServices`): every service, unique ids, and
/// no frontend claimed twice.
pub fn service_set(services: &[pb::LbService]) -> Result<Vec<Service>, InvalidField> {
    if services.len() > MAX_SERVICES {
        return Err(too_many_services(services.len()));
    }
    let mut ids = BTreeSet::new();
    let mut claimed = BTreeMap::new();
    let mut checked = Vec::with_capacity(services.len());
    for (i, s) in services.iter().enumerate() {
        let field = format!("services[{i}]");
        let service = service(&field, s)?;
        if !ids.insert(service.id) {
            return Err(invalid(
                format!("{field}.service_id"),
                format!("service {} is given twice", service.id),
            ));
        }
        for key in service.frontend_keys() {
            if let Some(other) = claimed.insert(key, service.id) {
                return Err(invalid(
                    format!("{field}.frontends"),
                    format!("{} is also a frontend of service {other}", super::frontend_name(&key)),
                ));
            }
        }
        checked.push(service);
    }
    Ok(checked)
}

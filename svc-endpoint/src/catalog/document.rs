//! Service (v1) and EndpointSlice (discovery.k8s.io/v1) documents, YAML or
//! JSON, read with k8s-openapi's types and validated into what the catalog
//! uses. Every error names the field path (`spec.ports[1].targetPort`).
//! Not for: allocation (clusterIPs, nodePorts: `allocate`) or backends.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rivet_common::k8s_name;
use rivet_policy::Protocol;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Documents larger than this are refused.
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// sessionAffinity ClientIP's timeout when the document gives none (Kubernetes' default).
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10_800;

/// The longest affinity timeout (Kubernetes' bound, and the loader's).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86_400;

/// Kubernetes' default NodePort range.
pub const NODE_PORTS: std::ops::RangeInclusive<u16> = 30_000..=32_767;

/// An invalid document: the field path (empty for the whole document) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{reason}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
pub struct DocumentError {
    /// `spec.ports[0].port`.
    pub path: String,
    /// Why.
    pub reason: String,
}

impl DocumentError {
    fn new(path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}

/// The two kinds the catalog stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ObjectKind {
    /// v1 Service.
    Service,
    /// discovery.k8s.io/v1 EndpointSlice.
    EndpointSlice,
}

impl ObjectKind {
    /// `Service` or `EndpointSlice`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
        }
    }
}

/// An object's key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    /// Its kind.
    pub kind: ObjectKind,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Family {
    /// IPv4.
    IPv4,
    /// IPv6.
    IPv6,
}

impl Family {
    /// The family of `address`.
    pub fn of(address: IpAddr) -> Self {
        if address.is_ipv4() { Self::IPv4 } else { Self::IPv6 }
    }

    /// `IPv4` or `IPv6`, as Kubernetes writes them.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IPv4 => "IPv4",
            Self::IPv6 => "IPv6",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "IPv4" => Some(Self::IPv4),
            "IPv6" => Some(Self::IPv6),
            _ => None,
        }
    }
}

/// `spec.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceType {
    /// A virtual address inside the cluster.
    ClusterIp,
    /// ClusterIP plus a port on every node.
    NodePort,
    /// NodePort plus ClusterIP here (no external load balancer).
    LoadBalancer,
}

impl ServiceType {
    /// As Kubernetes writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ClusterIp => "ClusterIP",
            Self::NodePort => "NodePort",
            Self::LoadBalancer => "LoadBalancer",
        }
    }

    /// Whether its ports get node ports.
    pub fn has_node_ports(self) -> bool {
        matches!(self, Self::NodePort | Self::LoadBalancer)
    }
}

/// What the document says of its cluster IPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterIps {
    /// None given: allocated (or kept from the stored object).
    Allocate,
    /// `clusterIP: None`: headless, no load balancing.
    Headless,
    /// These, one per family, the first one the primary.
    Given(Vec<IpAddr>),
}

/// `spec.ipFamilyPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FamilyPolicy {
    /// One family (default).
    SingleStack,
    /// Both when the node has both service CIDRs.
    PreferDualStack,
    /// Both, or the Service is refused.
    RequireDualStack,
}

/// `spec.externalTrafficPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrafficPolicy {
    /// Every backend, the client SNATed to the node.
    Cluster,
    /// This node's backends only, the client kept.
    Local,
}

impl TrafficPolicy {
    /// As Kubernetes writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cluster => "Cluster",
            Self::Local => "Local",
        }
    }
}

/// `targetPort`: a number or a named container port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    /// A port number.
    Number(u16),
    /// A container port's name.
    Name(String),
}

impl fmt::Display for TargetPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Name(name) => f.write_str(name),
        }
    }
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortDef {
    /// Empty for the single unnamed port.
    pub name: String,
    /// TCP, UDP or SCTP.
    pub protocol: Protocol,
    /// The frontend port.
    pub port: u16,
    /// Where the backends listen.
    pub target: TargetPort,
    /// The node port (NodePort/LoadBalancer), `None` to allocate.
    pub node_port: Option<u16>,
}

/// A validated Service.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceDef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `spec.type`.
    pub service_type: ServiceType,
    /// `spec.clusterIP(s)`.
    pub cluster_ips: ClusterIps,
    /// `spec.ipFamilies` as given (may be empty).
    pub ip_families: Vec<Family>,
    /// `spec.ipFamilyPolicy`.
    pub family_policy: FamilyPolicy,
    /// `spec.ports`.
    pub ports: Vec<ServicePortDef>,
    /// `spec.selector`; empty: none (backends from EndpointSlices only).
    pub selector: BTreeMap<String, String>,
    /// sessionAffinity ClientIP's timeout, seconds; 0: no affinity.
    pub affinity_timeout_seconds: u32,
    /// `spec.externalTrafficPolicy`.
    pub external_traffic_policy: TrafficPolicy,
    /// The object as read (written back with the allocations).
    pub object: Service,
}

impl ServiceDef {
    /// Its key.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            kind: ObjectKind::Service,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// One port of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    /// The Service port it serves (by name; empty for the unnamed one).
    pub name: String,
    /// TCP, UDP or SCTP.
    pub protocol: Protocol,
    /// The backend port; `None`: the slice serves no port of that name.
    pub port: Option<u16>,
}

/// One endpoint of an EndpointSlice with Kubernetes' condition semantics
/// applied: ready=nil means ready, serving=nil means as ready,
/// terminating=nil means not terminating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    /// Its addresses (of the slice's family).
    pub addresses: Vec<IpAddr>,
    /// Takes new connections.
    pub ready: bool,
    /// Serving (also while terminating).
    pub serving: bool,
    /// Terminating.
    pub terminating: bool,
    /// `nodeName`; empty when absent.
    pub node_name: String,
    /// `targetRef` of kind Pod as `ns/name`; empty otherwise.
    pub pod: String,
}

/// A validated EndpointSlice.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceDef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The Service it belongs to (`kubernetes.io/service-name`).
    pub service: String,
    /// `addressType`; `None` for FQDN (stored, never a backend).
    pub family: Option<Family>,
    /// `ports`.
    pub ports: Vec<SlicePort>,
    /// `endpoints`.
    pub endpoints: Vec<SliceEndpoint>,
    /// The object as read.
    pub object: EndpointSlice,
}

impl SliceDef {
    /// Its key.
    pub fn key(&self) -> ObjectKey {
        ObjectKey {
            kind: ObjectKind::EndpointSlice,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// A validated object.
#[derive(Debug, Clone, PartialEq)]
pub enum ServiceObject {
    /// A Service.
    Service(Box<ServiceDef>),
    /// An EndpointSlice.
    EndpointSlice(Box<SliceDef>),
}

impl ServiceObject {
    /// Its key.
    pub fn key(&self) -> ObjectKey {
        match self {
            Self::Service(s) => s.key(),
            Self::EndpointSlice(s) => s.key(),
        }
    }

    /// The key a document names (its kind, `metadata.namespace` or
    /// `default`, `metadata.name`) even when it does not parse as a whole;
    /// `None` when it names no Service or EndpointSlice.
    pub fn key_of(text: &str) -> Option<ObjectKey> {
        if text.len() > MAX_DOCUMENT_BYTES {
            return None;
        }
        let value = load(text).ok()?;
        let kind = match value.get("kind")?.as_str()? {
            "Service" => ObjectKind::Service,
            "EndpointSlice" => ObjectKind::EndpointSlice,
            _ => return None,
        };
        let metadata = value.get("metadata")?;
        let name = metadata.get("name")?.as_str().filter(|n| !n.is_empty())?;
        let namespace = metadata
            .get("namespace")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .unwrap_or("default");
        Some(ObjectKey {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        })
    }

    /// Reads and validates one document (YAML or JSON).
    ///
    /// ```
    /// use svc_endpoint::catalog::document::ServiceObject;
    /// let doc = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  ports: [{port: 80, targetPort: 8080}]\n";
    /// let ServiceObject::Service(s) = ServiceObject::parse(doc).unwrap() else { panic!() };
    /// assert_eq!((s.namespace.as_str(), s.ports[0].port), ("default", 80));
    /// let err = ServiceObject::parse(&doc.replace("8080", "0")).unwrap_err();
    /// assert_eq!(err.to_string(), "spec.ports[0].targetPort: must be 1..=65535, found 0");
    /// ```
    pub fn parse(text: &str) -> Result<Self, DocumentError> {
        if text.len() > MAX_DOCUMENT_BYTES {
            return Err(DocumentError::new("", format!("at most {MAX_DOCUMENT_BYTES} bytes")));
        }
        let value = load(text)?;
        let Value::Object(map) = &value else {
            return Err(DocumentError::new(
                "",
                "expected an object with apiVersion, kind, metadata and spec",
            ));
        };
        let field = |name: &str| map.get(name).and_then(Value::as_str).unwrap_or_default().to_string();
        let (api_version, kind) = (field("apiVersion"), field("kind"));
        match (kind.as_str(), api_version.as_str()) {
            ("Service", "v1") => parse_service(from_value(value)?).map(|s| Self::Service(Box::new(s))),
            ("EndpointSlice", "discovery.k8s.io/v1") => {
                parse_slice(from_value(value)?).map(|s| Self::EndpointSlice(Box::new(s)))
            }
            ("Service", found) | ("EndpointSlice", found) => Err(DocumentError::new(
                "apiVersion",
                format!(
                    "must be {} for kind {kind}, found {found:?}",
                    if kind == "Service" { "v1" } else { "discovery.k8s.io/v1" }
                ),
            )),
            ("", _) => Err(DocumentError::new(
                "kind",
                "is required: Service (apiVersion v1) or EndpointSlice (apiVersion discovery.k8s.io/v1)",
            )),
            (other, _) => Err(DocumentError::new(
                "kind",
                format!("{other:?} is not a Service or an EndpointSlice"),
            )),
        }
    }
}

/// YAML or JSON into a value (text starting with `{` is JSON first).
fn load(text: &str) -> Result<Value, DocumentError> {
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    if trimmed.starts_with('{')
        && let Ok(value) = serde_json::from_str(trimmed)
    {
        return Ok(value);
    }
    serde_path_to_error::deserialize(serde_norway::Deserializer::from_str(trimmed))
        .map_err(|e| DocumentError::new(render_path(e.path()), e.inner()))
}

fn from_value<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, DocumentError> {
    serde_path_to_error::deserialize(value).map_err(|e| DocumentError::new(render_path(e.path()), e.inner()))
}

/// `spec.ports[0].port` from the path segments.
fn render_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => out.push_str(".?"),
        }
    }
    if out == "." { String::new() } else { out }
}

/// Namespace (default `default`) and name, checked.
fn metadata(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    service: bool,
) -> Result<(String, String), DocumentError> {
    let name = meta.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err(DocumentError::new("metadata.name", "is required"));
    }
    // Service names are DNS labels (they become DNS names); slices' subdomains.
    let checked = if service {
        k8s_name::check_dns_label(&name)
    } else {
        k8s_name::check_dns_subdomain(&name)
    };
    checked.map_err(|e| DocumentError::new("metadata.name", format!("{name:?} {e}")))?;
    let namespace = meta
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_string());
    k8s_name::check_namespace(&namespace)
        .map_err(|e| DocumentError::new("metadata.namespace", format!("{namespace:?} {e}")))?;
    Ok((namespace, name))
}

fn port_number(path: &str, value: i32) -> Result<u16, DocumentError> {
    u16::try_from(value)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| DocumentError::new(path, format!("must be 1..=65535, found {value}")))
}

fn protocol(path: &str, value: Option<&str>) -> Result<Protocol, DocumentError> {
    match value.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(DocumentError::new(
            path,
            format!("must be TCP, UDP or SCTP, found {other:?}"),
        )),
    }
}

fn address(path: &str, text: &str) -> Result<IpAddr, DocumentError> {
    text.parse()
        .map_err(|_| DocumentError::new(path, format!("{text:?} is not an IP address")))
}

fn parse_service(object: Service) -> Result<ServiceDef, DocumentError> {
    let (namespace, name) = metadata(&object.metadata, true)?;
    let spec = object
        .spec
        .clone()
        .ok_or_else(|| DocumentError::new("spec", "is required"))?;
    let service_type = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => ServiceType::ClusterIp,
        "NodePort" => ServiceType::NodePort,
        "LoadBalancer" => ServiceType::LoadBalancer,
        "ExternalName" => {
            return Err(DocumentError::new(
                "spec.type",
                "ExternalName is not supported (no load balancing)",
            ));
        }
        other => {
            return Err(DocumentError::new(
                "spec.type",
                format!("must be ClusterIP, NodePort or LoadBalancer, found {other:?}"),
            ));
        }
    };

    let ip_families = spec
        .ip_families
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, f)| {
            Family::parse(f).ok_or_else(|| {
                DocumentError::new(
                    format!("spec.ipFamilies[{i}]"),
                    format!("must be IPv4 or IPv6, found {f:?}"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if ip_families.len() > 2 || (ip_families.len() == 2 && ip_families[0] == ip_families[1]) {
        return Err(DocumentError::new("spec.ipFamilies", "at most one of each family"));
    }
    let family_policy = match spec.ip_family_policy.as_deref() {
        None | Some("SingleStack") => FamilyPolicy::SingleStack,
        Some("PreferDualStack") => FamilyPolicy::PreferDualStack,
        Some("RequireDualStack") => FamilyPolicy::RequireDualStack,
        Some(other) => {
            return Err(DocumentError::new(
                "spec.ipFamilyPolicy",
                format!("must be SingleStack, PreferDualStack or RequireDualStack, found {other:?}"),
            ));
        }
    };
    if family_policy == FamilyPolicy::SingleStack && ip_families.len() == 2 {
        return Err(DocumentError::new(
            "spec.ipFamilies",
            "two families need ipFamilyPolicy PreferDualStack or RequireDualStack",
        ));
    }

    // clusterIPs wins; clusterIP must then be its first item (as in Kubernetes).
    let cluster_ip = spec.cluster_ip.clone().filter(|s| !s.is_empty());
    let cluster_ips_raw: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if let (Some(first), Some(single)) = (cluster_ips_raw.first(), &cluster_ip)
        && first != single
    {
        return Err(DocumentError::new(
            "spec.clusterIPs[0]",
            format!("must equal spec.clusterIP ({single:?}), found {first:?}"),
        ));
    }
    let raw: Vec<(String, String)> = if cluster_ips_raw.is_empty() {
        cluster_ip
            .map(|ip| ("spec.clusterIP".to_string(), ip))
            .into_iter()
            .collect()
    } else {
        cluster_ips_raw
            .iter()
            .enumerate()
            .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.clone()))
            .collect()
    };
    let cluster_ips = if raw.is_empty() {
        ClusterIps::Allocate
    } else if raw.iter().any(|(_, ip)| ip == "None") {
        if raw.len() > 1 {
            return Err(DocumentError::new(
                "spec.clusterIPs",
                "None (headless) must be the only value",
            ));
        }
        if service_type != ServiceType::ClusterIp {
            return Err(DocumentError::new(
                "spec.clusterIP",
                format!("None (headless) needs type ClusterIP, not {}", service_type.as_str()),
            ));
        }
        ClusterIps::Headless
    } else {
        let ips = raw
            .iter()
            .map(|(path, ip)| address(path, ip))
            .collect::<Result<Vec<_>, _>>()?;
        if ips.len() > 2 || (ips.len() == 2 && Family::of(ips[0]) == Family::of(ips[1])) {
            return Err(DocumentError::new(
                "spec.clusterIPs",
                "at most one address of each family",
            ));
        }
        if ips.len() == 2 && family_policy == FamilyPolicy::SingleStack {
            return Err(DocumentError::new(
                "spec.clusterIPs",
                "two addresses need ipFamilyPolicy PreferDualStack or RequireDualStack",
            ));
        }
        for (i, ip) in ips.iter().enumerate() {
            if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() {
                return Err(DocumentError::new(
                    raw[i].0.clone(),
                    format!("{ip} cannot be a cluster IP"),
                ));
            }
            if let Some(f) = ip_families.get(i)
                && *f != Family::of(*ip)
            {
                return Err(DocumentError::new(
                    raw[i].0.clone(),
                    format!("{ip} is not of family {} (spec.ipFamilies[{i}])", f.as_str()),
                ));
            }
        }
        ClusterIps::Given(ips)
    };

    let raw_ports = spec.ports.clone().unwrap_or_default();
    if raw_ports.is_empty() && cluster_ips != ClusterIps::Headless {
        return Err(DocumentError::new("spec.ports", "at least one port is required"));
    }
    let mut ports: Vec<ServicePortDef> = Vec::with_capacity(raw_ports.len());
    for (i, p) in raw_ports.iter().enumerate() {
        let at = |field: &str| format!("spec.ports[{i}].{field}");
        let name = p.name.clone().unwrap_or_default();
        if raw_ports.len() > 1 && name.is_empty() {
            return Err(DocumentError::new(
                at("name"),
                "is required when there are several ports",
            ));
        }
        if !name.is_empty() {
            k8s_name::check_dns_label(&name).map_err(|e| DocumentError::new(at("name"), format!("{name:?} {e}")))?;
        }
        let protocol = protocol(&at("protocol"), p.protocol.as_deref())?;
        let port = port_number(&at("port"), p.port)?;
        let target = match &p.target_port {
            None => TargetPort::Number(port),
            Some(IntOrString::Int(n)) => TargetPort::Number(port_number(&at("targetPort"), *n)?),
            Some(IntOrString::String(s)) => match s.parse::<i32>() {
                Ok(n) => TargetPort::Number(port_number(&at("targetPort"), n)?),
                Err(_) => {
                    rivet_common::named_port::check_port_name(s)
                        .map_err(|e| DocumentError::new(at("targetPort"), format!("{s:?} {e}")))?;
                    TargetPort::Name(s.clone())
                }
            },
        };
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) if !service_type.has_node_ports() => {
                return Err(DocumentError::new(
                    at("nodePort"),
                    format!("{n} is given but type {} has no node ports", service_type.as_str()),
                ));
            }
            Some(n) => {
                let n = port_number(&at("nodePort"), n)?;
                if !NODE_PORTS.contains(&n) {
                    return Err(DocumentError::new(
                        at("nodePort"),
                        format!("must be in {}-{}, found {n}", NODE_PORTS.start(), NODE_PORTS.end()),
                    ));
                }
                Some(n)
            }
        };
        if let Some(j) = ports.iter().position(|q| q.name == name) {
            return Err(DocumentError::new(
                at("name"),
                format!("{name:?} is also spec.ports[{j}]'s name"),
            ));
        }
        if let Some(j) = ports.iter().position(|q| q.port == port && q.protocol == protocol) {
            return Err(DocumentError::new(
                at("port"),
                format!("{port}/{protocol} is also spec.ports[{j}]"),
            ));
        }
        if let Some(n) = node_port
            && let Some(j) = ports
                .iter()
                .position(|q| q.node_port == Some(n) && q.protocol == protocol)
        {
            return Err(DocumentError::new(
                at("nodePort"),
                format!("{n}/{protocol} is also spec.ports[{j}]"),
            ));
        }
        ports.push(ServicePortDef {
            name,
            protocol,
            port,
            target,
            node_port,
        });
    }

    let selector = spec.selector.clone().unwrap_or_default();
    for (key, value) in &selector {
        k8s_name::check_label_key(key)
            .map_err(|e| DocumentError::new(format!("spec.selector.{key}"), format!("key {e}")))?;
        k8s_name::check_label_value(value)
            .map_err(|e| DocumentError::new(format!("spec.selector.{key}"), format!("{value:?} {e}")))?;
    }

    let affinity_timeout_seconds = match spec.session_affinity.as_deref() {
        None | Some("None") => {
            if spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .is_some()
            {
                return Err(DocumentError::new(
                    "spec.sessionAffinityConfig",
                    "is only allowed with sessionAffinity ClientIP",
                ));
            }
            0
        }
        Some("ClientIP") => {
            let given = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match given {
                None => DEFAULT_AFFINITY_TIMEOUT_SECONDS,
                Some(t) => u32::try_from(t)
                    .ok()
                    .filter(|t| (1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(t))
                    .ok_or_else(|| {
                        DocumentError::new(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            format!("must be 1..={MAX_AFFINITY_TIMEOUT_SECONDS}, found {t}"),
                        )
                    })?,
            }
        }
        Some(other) => {
            return Err(DocumentError::new(
                "spec.sessionAffinity",
                format!("must be None or ClientIP, found {other:?}"),
            ));
        }
    };
    let external_traffic_policy = match spec.external_traffic_policy.as_deref() {
        None | Some("Cluster") => TrafficPolicy::Cluster,
        Some("Local") if service_type.has_node_ports() => TrafficPolicy::Local,
        Some("Local") => {
            return Err(DocumentError::new(
                "spec.externalTrafficPolicy",
                "Local needs type NodePort or LoadBalancer",
            ));
        }
        Some(other) => {
            return Err(DocumentError::new(
                "spec.externalTrafficPolicy",
                format!("must be Cluster or Local, found {other:?}"),
            ));
        }
    };
    Ok(ServiceDef {
        namespace,
        name,
        service_type,
        cluster_ips,
        ip_families,
        family_policy,
        ports,
        selector,
        affinity_timeout_seconds,
        external_traffic_policy,
        object,
    })
}

fn parse_slice(object: EndpointSlice) -> Result<SliceDef, DocumentError> {
    let (namespace, name) = metadata(&object.metadata, false)?;
    let service = object
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .cloned()
        .unwrap_or_default();
    let label_path = format!("metadata.labels.{SERVICE_NAME_LABEL}");
    if service.is_empty() {
        return Err(DocumentError::new(
            label_path,
            "is required: the name of the slice's Service",
        ));
    }
    k8s_name::check_dns_label(&service).map_err(|e| DocumentError::new(label_path, format!("{service:?} {e}")))?;
    let family = match object.address_type.as_str() {
        "IPv4" => Some(Family::IPv4),
        "IPv6" => Some(Family::IPv6),
        "FQDN" => None,
        other => {
            return Err(DocumentError::new(
                "addressType",
                format!("must be IPv4, IPv6 or FQDN, found {other:?}"),
            ));
        }
    };
    let mut ports = Vec::new();
    for (i, p) in object.ports.iter().flatten().enumerate() {
        let at = |field: &str| format!("ports[{i}].{field}");
        let name = p.name.clone().unwrap_or_default();
        let protocol = protocol(&at("protocol"), p.protocol.as_deref())?;
        let port = p.port.map(|n| port_number(&at("port"), n)).transpose()?;
        if ports
            .iter()
            .any(|q: &SlicePort| q.name == name && q.protocol == protocol)
        {
            return Err(DocumentError::new(
                at("name"),
                format!("{name:?}/{protocol} appears twice"),
            ));
        }
        ports.push(SlicePort { name, protocol, port });
    }
    let mut endpoints = Vec::new();
    for (i, e) in object.endpoints.iter().enumerate() {
        let at = |field: &str| format!("endpoints[{i}].{field}");
        if e.addresses.is_empty() {
            return Err(DocumentError::new(at("addresses"), "at least one address is required"));
        }
        let mut addresses = Vec::new();
        if let Some(family) = family {
            for (j, a) in e.addresses.iter().enumerate() {
                let path = format!("endpoints[{i}].addresses[{j}]");
                let ip = address(&path, a)?;
                if Family::of(ip) != family {
                    return Err(DocumentError::new(
                        path,
                        format!("{ip} is not of the slice's addressType {}", family.as_str()),
                    ));
                }
                addresses.push(ip);
            }
        }
        let conditions = e.conditions.clone().unwrap_or_default();
        let ready = conditions.ready.unwrap_or(true);
        let serving = conditions.serving.unwrap_or(ready);
        let terminating = conditions.terminating.unwrap_or(false);
        let pod = e
            .target_ref
            .as_ref()
            .filter(|r| r.kind.as_deref() == Some("Pod"))
            .map(|r| {
                format!(
                    "{}/{}",
                    r.namespace.clone().unwrap_or_else(|| namespace.clone()),
                    r.name.clone().unwrap_or_default()
                )
            })
            .unwrap_or_default();
        endpoints.push(SliceEndpoint {
            addresses,
            ready,
            serving,
            terminating,
            node_name: e.node_name.clone().unwrap_or_default(),
            pod,
        });
    }
    Ok(SliceDef {
        namespace,
        name,
        service,
        family,
        ports,
        endpoints,
        object,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
spec:
  type: NodePort
  selector: {app: web}
  ipFamilyPolicy: PreferDualStack
  clusterIPs: [198.19.128.10, 2001:2:0:ff::10]
  sessionAffinity: ClientIP
  ports:
  - {name: http, port: 80, targetPort: http, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
";

    const SLICE: &str = r#"{
  "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
  "metadata": {"name": "web-abc", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
  "addressType": "IPv4",
  "ports": [{"name": "http", "port": 8080}],
  "endpoints": [
    {"addresses": ["198.18.0.5"], "nodeName": "n1", "targetRef": {"kind": "Pod", "name": "web-1"}},
    {"addresses": ["198.18.0.6"], "conditions": {"ready": false, "serving": true, "terminating": true}},
    {"addresses": ["198.18.0.7"], "conditions": {"ready": false}}
  ]
}"#;

    fn service(text: &str) -> ServiceDef {
        match ServiceObject::parse(text) {
            Ok(ServiceObject::Service(s)) => *s,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_full_service_reads_with_defaults_applied() {
        let s = service(SERVICE);
        assert_eq!((s.namespace.as_str(), s.name.as_str()), ("shop", "web"));
        assert_eq!(s.service_type, ServiceType::NodePort);
        assert_eq!(
            s.cluster_ips,
            ClusterIps::Given(vec![
                "198.19.128.10".parse().unwrap(),
                "2001:2:0:ff::10".parse().unwrap()
            ])
        );
        assert_eq!(s.affinity_timeout_seconds, DEFAULT_AFFINITY_TIMEOUT_SECONDS);
        assert_eq!(s.ports[0].target, TargetPort::Name("http".into()));
        assert_eq!(s.ports[0].node_port, Some(30080));
        assert_eq!(s.ports[1].protocol, Protocol::Udp);
        assert_eq!(s.ports[1].target, TargetPort::Number(5353));
        assert_eq!(s.selector.get("app").map(String::as_str), Some("web"));
        assert_eq!(s.external_traffic_policy, TrafficPolicy::Cluster);
        // The same object as JSON reads the same.
        let json = serde_json::to_string(&s.object).unwrap();
        assert_eq!(service(&json).ports, s.ports);
    }

    #[test]
    fn headless_and_unnamed_single_port() {
        let s = service(
            "kind: Service\napiVersion: v1\nmetadata: {name: db}\nspec: {clusterIP: None, ports: [{port: 5432}]}",
        );
        assert_eq!(s.cluster_ips, ClusterIps::Headless);
        assert_eq!(s.ports[0].name, "");
        assert_eq!(s.ports[0].target, TargetPort::Number(5432));
    }

    #[test]
    fn every_bad_field_is_named() {
        let cases = [
            ("  type: ExternalName", "spec.type"),
            ("  clusterIPs: [198.19.128.10, 198.19.128.11]", "spec.clusterIPs"),
            ("  clusterIPs: [bogus]", "spec.clusterIPs[0]"),
            ("  - {name: http, port: 70000, targetPort: 80}", "spec.ports[0].port"),
            ("  - {name: http, port: 80, targetPort: 0}", "spec.ports[0].targetPort"),
            (
                "  - {name: http, port: 80, targetPort: no_such_name!}",
                "spec.ports[0].targetPort",
            ),
            ("  - {name: http, port: 80, nodePort: 80}", "spec.ports[0].nodePort"),
            ("  - {name: http, port: 80, protocol: ICMP}", "spec.ports[0].protocol"),
            ("  - {port: 81}", "spec.ports[0].name"),
            ("  - {name: web, port: 53, protocol: UDP}", "spec.ports[1].port"),
            ("  sessionAffinity: Sticky", "spec.sessionAffinity"),
            ("  selector: {app: 'not valid!'}", "spec.selector.app"),
            ("  ipFamilies: [IPv5]", "spec.ipFamilies[0]"),
            ("  sessionAffinity: [ClientIP]", "spec.sessionAffinity"),
        ];
        for (line, path) in cases {
            // Replace the line that starts the same way (or add it to spec).
            let prefix = line.split(':').next().unwrap();
            let mut text: Vec<String> = SERVICE.lines().map(str::to_string).collect();
            if line.starts_with("  - ") {
                let first_port = text.iter().position(|l| l.starts_with("  - ")).unwrap();
                text[first_port] = line.to_string();
            } else if let Some(at) = text
                .iter()
                .position(|l| l.starts_with(prefix) && !l.starts_with("  - "))
            {
                text[at] = line.to_string();
            } else {
                text.push(line.to_string());
            }
            let doc = text.join("\n");
            let err = ServiceObject::parse(&doc).expect_err(line);
            assert_eq!(err.path, path, "{line}: {err}");
        }
        let err = ServiceObject::parse("kind: Service\napiVersion: apps/v1\nmetadata: {name: x}").unwrap_err();
        assert_eq!(err.path, "apiVersion");
        let err = ServiceObject::parse("kind: Deployment\napiVersion: v1").unwrap_err();
        assert_eq!(err.path, "kind");
        let err =
            ServiceObject::parse("kind: Service\napiVersion: v1\nmetadata: {name: Web}\nspec: {ports: [{port: 1}]}")
                .unwrap_err();
        assert_eq!(err.path, "metadata.name");
    }

    #[test]
    fn slice_conditions_follow_kubernetes() {
        let ServiceObject::EndpointSlice(s) = ServiceObject::parse(SLICE).unwrap() else {
            panic!("a slice")
        };
        assert_eq!(s.service, "web");
        assert_eq!(s.family, Some(Family::IPv4));
        assert_eq!(s.ports[0].port, Some(8080));
        let flags: Vec<_> = s
            .endpoints
            .iter()
            .map(|e| (e.ready, e.serving, e.terminating))
            .collect();
        // ready=nil is ready; serving=nil follows ready; terminating=nil is false.
        assert_eq!(flags, [(true, true, false), (false, true, true), (false, false, false)]);
        assert_eq!(s.endpoints[0].pod, "shop/web-1");
        assert_eq!(s.endpoints[0].node_name, "n1");
    }

    #[test]
    fn bad_slices_are_refused_with_the_field() {
        let cases = [
            (
                SLICE.replace("\"kubernetes.io/service-name\": \"web\"", "\"x\": \"y\""),
                "metadata.labels.kubernetes.io/service-name",
            ),
            (SLICE.replace("\"IPv4\"", "\"IPv5\""), "addressType"),
            (SLICE.replace("198.18.0.6", "2001:2::6"), "endpoints[1].addresses[0]"),
            (SLICE.replace("8080", "0"), "ports[0].port"),
            (SLICE.replace("[\"198.18.0.7\"]", "[]"), "endpoints[2].addresses"),
        ];
        for (doc, path) in cases {
            let err = ServiceObject::parse(&doc).expect_err(path);
            assert_eq!(err.path, path, "{err}");
        }
    }
}

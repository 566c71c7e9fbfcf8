//! `rivet bpf ...` and `rivet monitor`: what svc-loader's datapath holds.

use std::collections::BTreeMap;
use std::net::IpAddr;

use clap::Subcommand;
use rivet_proto::endpoint::v1 as endpoint_pb;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use rivet_proto::loader::v1 as pb;
use rivet_proto::loader::v1::load_balancer_service_client::LoadBalancerServiceClient;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_proto::loader::v1::node_routing_service_client::NodeRoutingServiceClient;
use rivet_proto::net::{self, format_address};
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context};

const DAEMON: &str = "svc-loader";

/// `rivet bpf ...`
#[derive(Debug, Subcommand)]
pub enum BpfCommand {
    /// Endpoints in the datapath with their attach state.
    #[command(subcommand)]
    Endpoint(EndpointCommand),
    /// Policy entries of one endpoint, with packet counters.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Connection tracking entries.
    #[command(subcommand)]
    Ct(CtCommand),
    /// Forwarded and dropped packets by reason and direction.
    Metrics,
    /// The datapath's IP cache: prefix, security identity and the node to
    /// tunnel to (remote pods and nodes of a cluster).
    Ipcache,
    /// The peer nodes svc-loader routes to, its routing mode and interfaces
    /// (multi-node; NodeRoutingService).
    Nodes,
    /// The service maps: frontends, backends with their state and Maglev
    /// slots, flags and affinity (LoadBalancerService).
    #[command(subcommand)]
    Service(ServiceMapCommand),
}

/// `rivet bpf service ...`
#[derive(Debug, Subcommand)]
pub enum ServiceMapCommand {
    /// List the services svc-loader holds, with their names from
    /// svc-endpoint's service catalog when it answers (else ids only).
    List {
        /// Also count the flow and affinity entries (walks lb4_flows,
        /// lb6_flows and lb_affinity: slow with many connections).
        #[arg(long)]
        counts: bool,
    },
}

/// `rivet bpf endpoint ...`
#[derive(Debug, Subcommand)]
pub enum EndpointCommand {
    /// List endpoints.
    List,
}

/// `rivet bpf policy ...`
#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Show one endpoint's policy.
    Get {
        /// Endpoint id.
        endpoint: u32,
    },
}

/// `rivet bpf ct ...`
#[derive(Debug, Subcommand)]
pub enum CtCommand {
    /// List entries (both families).
    List {
        /// Only entries with this address at either end.
        #[arg(long)]
        address: Option<IpAddr>,
        /// Only entries with this port at either end.
        #[arg(long)]
        port: Option<u16>,
    },
}

fn mac(raw: &[u8]) -> String {
    raw.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn name<E: TryFrom<i32> + std::fmt::Debug>(raw: i32, prefix: &str) -> String {
    match E::try_from(raw) {
        Ok(e) => {
            // "Tcp" → "tcp", "PolicyDenied" → "policy-denied"
            let s = format!("{e:?}");
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    out.push('-');
                }
                out.push(c.to_ascii_lowercase());
            }
            out.trim_start_matches(prefix).to_string()
        }
        Err(_) => raw.to_string(),
    }
}

/// An endpoint as printed.
#[derive(Debug, Serialize)]
pub struct EndpointView {
    id: u32,
    ifindex: u32,
    ifname: String,
    addresses: Vec<String>,
    mac: String,
    identity: u32,
    policy_revision: u64,
    enforce_ingress: bool,
    enforce_egress: bool,
    policy_entries: u32,
    from_container: String,
    to_container: String,
}

/// One policy entry of `rivet bpf policy get`.
#[derive(Debug, Serialize)]
struct PolicyRow {
    direction: String,
    /// `any`, an identity, or `addr:<cidr identity>` for an entry matched
    /// by the peer's address (ipBlock) through the prefixes below.
    peer_identity: String,
    protocol: String,
    ports: String,
    verdict: String,
    packets: u64,
    bytes: u64,
}

/// One prefix of `rivet bpf policy get`: peer addresses whose longest
/// prefix this is match the `addr:<cidr identity>` entries.
#[derive(Debug, Serialize)]
struct PrefixRow {
    direction: String,
    prefix: String,
    cidr_identity: u32,
}

/// `rivet bpf policy get`.
#[derive(Debug, Serialize)]
struct PolicyView {
    endpoint_id: u32,
    revision: u64,
    enforce_ingress: bool,
    enforce_egress: bool,
    allow_from_host: bool,
    entries: Vec<PolicyRow>,
    prefixes: Vec<PrefixRow>,
}

impl From<&pb::GetEndpointPolicyResponse> for PolicyView {
    fn from(r: &pb::GetEndpointPolicyResponse) -> Self {
        let entries = r
            .entries
            .iter()
            .map(|s| {
                let e = s.entry.unwrap_or_default();
                PolicyRow {
                    direction: name::<pb::Direction>(e.direction, "direction-"),
                    peer_identity: match (pb::PeerKind::try_from(e.peer_kind), e.peer_identity) {
                        (Ok(pb::PeerKind::Address), id) => format!("addr:{id}"),
                        (_, 0) => "any".into(),
                        (_, id) => id.to_string(),
                    },
                    protocol: name::<pb::Protocol>(e.protocol, "protocol-"),
                    ports: match (e.port, e.end_port) {
                        (0, _) => "any".into(),
                        (p, 0) => p.to_string(),
                        (p, q) => format!("{p}-{q}"),
                    },
                    verdict: name::<pb::Verdict>(e.verdict, "verdict-"),
                    packets: s.packets,
                    bytes: s.bytes,
                }
            })
            .collect();
        let prefixes = r
            .prefixes
            .iter()
            .map(|p| {
                let prefix = p.prefix.clone().unwrap_or_default();
                PrefixRow {
                    direction: name::<pb::Direction>(p.direction, "direction-"),
                    prefix: format!("{}/{}", format_address(&prefix.address), prefix.prefix_length),
                    cidr_identity: p.cidr_identity,
                }
            })
            .collect();
        Self {
            endpoint_id: r.endpoint_id,
            revision: r.revision,
            enforce_ingress: r.enforce_ingress,
            enforce_egress: r.enforce_egress,
            allow_from_host: r.allow_from_host,
            entries,
            prefixes,
        }
    }
}

impl PolicyView {
    fn render(&self) -> String {
        let mut out = format!(
            "endpoint {} revision {} enforce ingress={} egress={} allow-from-host={}\n",
            self.endpoint_id, self.revision, self.enforce_ingress, self.enforce_egress, self.allow_from_host
        );
        let mut t = Table::new(["DIRECTION", "PEER", "PROTOCOL", "PORTS", "VERDICT", "PACKETS", "BYTES"]);
        for e in &self.entries {
            t.row([
                e.direction.clone(),
                e.peer_identity.clone(),
                e.protocol.clone(),
                e.ports.clone(),
                e.verdict.clone(),
                e.packets.to_string(),
                e.bytes.to_string(),
            ]);
        }
        out.push_str(&t.render());
        if !self.prefixes.is_empty() {
            out.push_str("\naddress prefixes (PEER addr:<id>: the peer address's longest prefix has identity <id>)\n");
            let mut t = Table::new(["DIRECTION", "PREFIX", "CIDR IDENTITY"]);
            for p in &self.prefixes {
                t.row([p.direction.clone(), p.prefix.clone(), p.cidr_identity.to_string()]);
            }
            out.push_str(&t.render());
        }
        out
    }
}

/// Runs one `rivet bpf` command.
/// Every entry of the datapath's IP cache (ListIpcache, page by page), by prefix.
pub async fn list_ipcache<T>(client: &mut LoaderServiceClient<T>) -> Result<Vec<pb::IpcacheEntry>, tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    const PAGE: u32 = 10_000;
    let mut entries = Vec::new();
    let mut start_after = None;
    loop {
        let page = client
            .list_ipcache(pb::ListIpcacheRequest {
                page_size: PAGE,
                start_after: start_after.take(),
            })
            .await?
            .into_inner();
        let full = page.entries.len() == PAGE as usize;
        start_after = page.entries.last().and_then(|e| e.prefix.clone());
        entries.extend(page.entries);
        if !full || start_after.is_none() {
            return Ok(entries);
        }
    }
}

/// One row of `rivet bpf ipcache`.
#[derive(Debug, Serialize)]
struct IpcacheView {
    prefix: String,
    identity: u32,
    /// Empty: local, or reached without a tunnel.
    tunnel_endpoint: String,
}

/// `rivet bpf nodes`.
#[derive(Debug, Serialize)]
struct NodesView {
    routing_mode: String,
    underlay_interface: String,
    tunnel_interface: String,
    tunnel_port: u32,
    routes: u32,
    nodes: Vec<PeerView>,
}

/// One peer of `rivet bpf nodes`.
#[derive(Debug, Serialize)]
struct PeerView {
    name: String,
    underlay: Vec<String>,
    pod_cidrs: Vec<String>,
}

/// `rivet bpf service list`.
#[derive(Debug, Serialize, PartialEq)]
struct ServiceMapView {
    services: Vec<LbServiceView>,
    /// Entries of lb4_flows + lb6_flows (`--counts`).
    #[serde(skip_serializing_if = "Option::is_none")]
    flow_entries: Option<u64>,
    /// Entries of lb_affinity (`--counts`).
    #[serde(skip_serializing_if = "Option::is_none")]
    affinity_entries: Option<u64>,
    /// Whether names came from svc-endpoint's catalog.
    names_known: bool,
}

/// One service of `rivet bpf service list`.
#[derive(Debug, Serialize, PartialEq)]
struct LbServiceView {
    service_id: u32,
    /// `namespace/name:port (family)` from the catalog; empty when unknown.
    name: String,
    protocol: String,
    frontends: Vec<String>,
    /// `affinity=<s>s`, `local`.
    flags: Vec<String>,
    table_id: u32,
    external_table_id: u32,
    backends: Vec<LbBackendView>,
}

/// One backend of a service.
#[derive(Debug, Serialize, PartialEq)]
struct LbBackendView {
    backend_id: u32,
    address: String,
    state: String,
    node_local: bool,
    maglev_slots: u32,
}

/// Service ids → `namespace/name:port (family)` from the catalog's view.
fn catalog_names(services: &[endpoint_pb::ServiceView]) -> BTreeMap<u32, String> {
    let mut names = BTreeMap::new();
    for s in services {
        for lb in &s.load_balancer {
            names.insert(
                lb.service_id,
                format!("{}/{}:{} ({})", s.namespace, s.name, lb.service_port, lb.family),
            );
        }
    }
    names
}

fn socket_text(address: &[u8], port: u32) -> String {
    match net::address_from_bytes(address) {
        Ok(IpAddr::V6(v6)) => format!("[{v6}]:{port}"),
        Ok(v4) => format!("{v4}:{port}"),
        Err(_) => format!("?:{port}"),
    }
}

fn service_map_view(r: &pb::ListServicesResponse, names: Option<&BTreeMap<u32, String>>) -> ServiceMapView {
    let services = r
        .services
        .iter()
        .filter_map(|status| {
            let s = status.service.as_ref()?;
            let mut flags = Vec::new();
            if s.affinity_timeout_seconds > 0 {
                flags.push(format!("affinity={}s", s.affinity_timeout_seconds));
            }
            if s.external_traffic_policy == pb::TrafficPolicy::Local as i32 {
                flags.push("local".to_owned());
            }
            Some(LbServiceView {
                service_id: s.service_id,
                name: names.and_then(|n| n.get(&s.service_id).cloned()).unwrap_or_default(),
                protocol: name::<pb::Protocol>(s.protocol, "protocol-"),
                frontends: s
                    .frontends
                    .iter()
                    .map(|f| match pb::FrontendKind::try_from(f.kind) {
                        Ok(pb::FrontendKind::NodePort) => format!("nodeport:{}", f.port),
                        _ => socket_text(&f.address, f.port),
                    })
                    .collect(),
                flags,
                table_id: status.table_id,
                external_table_id: status.external_table_id,
                backends: status
                    .backends
                    .iter()
                    .filter_map(|b| {
                        let backend = b.backend.as_ref()?;
                        Some(LbBackendView {
                            backend_id: b.backend_id,
                            address: socket_text(&backend.address, backend.port),
                            state: name::<pb::BackendState>(backend.state, "backend-state-"),
                            node_local: backend.node_local,
                            maglev_slots: b.maglev_slots,
                        })
                    })
                    .collect(),
            })
        })
        .collect();
    ServiceMapView {
        services,
        flow_entries: r.entries_counted.then_some(r.flow_entries),
        affinity_entries: r.entries_counted.then_some(r.affinity_entries),
        names_known: names.is_some(),
    }
}

fn service_map_text(view: &ServiceMapView) -> String {
    let mut t = Table::new([
        "ID",
        "NAME",
        "PROTO",
        "FRONTENDS",
        "FLAGS",
        "BACKEND",
        "BACKEND ID",
        "STATE",
        "SLOTS",
    ]);
    let dash = |s: String| if s.is_empty() { "-".to_owned() } else { s };
    for s in &view.services {
        let service_cells = [
            s.service_id.to_string(),
            dash(s.name.clone()),
            s.protocol.clone(),
            s.frontends.join(","),
            dash(s.flags.join(",")),
        ];
        if s.backends.is_empty() {
            let mut row: Vec<String> = service_cells.to_vec();
            row.extend(["(none: rejects)".to_owned(), "-".into(), "-".into(), "0".into()]);
            t.row(row);
        }
        for (i, b) in s.backends.iter().enumerate() {
            let mut row: Vec<String> = if i == 0 {
                service_cells.to_vec()
            } else {
                vec![String::new(); service_cells.len()]
            };
            let state = if b.node_local {
                format!("{} (node-local)", b.state)
            } else {
                b.state.clone()
            };
            row.extend([
                b.address.clone(),
                b.backend_id.to_string(),
                state,
                b.maglev_slots.to_string(),
            ]);
            t.row(row);
        }
    }
    let mut out = t.render();
    let counts = match (view.flow_entries, view.affinity_entries) {
        (Some(flows), Some(affinity)) => format!(", {flows} flow entries, {affinity} affinity entries"),
        _ => String::new(),
    };
    out.push_str(&format!(
        "\n{} services{counts}{}\n",
        view.services.len(),
        if view.names_known {
            ""
        } else {
            " (names unknown: svc-endpoint did not answer)"
        }
    ));
    out
}

pub async fn run(ctx: &Context, command: BpfCommand) -> Result<(), CliError> {
    let channel = ctx.connect(DAEMON).await?;
    let mut client = LoaderServiceClient::new(channel.clone());
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        BpfCommand::Service(ServiceMapCommand::List { counts }) => {
            let r = LoadBalancerServiceClient::new(channel)
                .list_services(pb::ListServicesRequest { count_entries: counts })
                .await
                .map_err(rpc)?
                .into_inner();
            // Names are a courtesy: the maps are shown without them.
            let names = match ctx.connect("svc-endpoint").await {
                Ok(channel) => ServiceCatalogServiceClient::new(channel)
                    .list_services(endpoint_pb::ListServicesRequest::default())
                    .await
                    .ok()
                    .map(|r| catalog_names(&r.into_inner().services)),
                Err(_) => None,
            };
            let view = service_map_view(&r, names.as_ref());
            ctx.print(&view, || service_map_text(&view));
        }
        BpfCommand::Ipcache => {
            let view: Vec<IpcacheView> = list_ipcache(&mut client)
                .await
                .map_err(rpc)?
                .iter()
                .map(|e| IpcacheView {
                    prefix: e.prefix.as_ref().map(net::format_prefix).unwrap_or_default(),
                    identity: e.identity,
                    tunnel_endpoint: if e.tunnel_endpoint.is_empty() {
                        String::new()
                    } else {
                        format_address(&e.tunnel_endpoint)
                    },
                })
                .collect();
            ctx.print(&view, || {
                let mut t = Table::new(["PREFIX", "IDENTITY", "TUNNEL ENDPOINT"]);
                for e in &view {
                    let tunnel = if e.tunnel_endpoint.is_empty() {
                        "-"
                    } else {
                        e.tunnel_endpoint.as_str()
                    };
                    t.row([e.prefix.clone(), e.identity.to_string(), tunnel.to_string()]);
                }
                t.render()
            });
        }
        BpfCommand::Nodes => {
            let r = NodeRoutingServiceClient::new(channel)
                .list_nodes(pb::ListNodesRequest {})
                .await
                .map_err(rpc)?
                .into_inner();
            let view = NodesView {
                routing_mode: name::<pb::RoutingMode>(r.routing_mode, "routing-mode-"),
                underlay_interface: r.underlay_interface,
                tunnel_interface: r.tunnel_interface,
                tunnel_port: r.tunnel_port,
                routes: r.routes,
                nodes: r
                    .nodes
                    .iter()
                    .map(|n| PeerView {
                        name: n.name.clone(),
                        underlay: [&n.underlay_ipv4, &n.underlay_ipv6]
                            .into_iter()
                            .filter(|a| !a.is_empty())
                            .map(|a| format_address(a))
                            .collect(),
                        pod_cidrs: n.pod_cidrs.iter().map(net::format_prefix).collect(),
                    })
                    .collect(),
            };
            ctx.print(&view, || {
                let tunnel = if view.tunnel_interface.is_empty() {
                    "-".to_string()
                } else {
                    format!("{} (UDP {})", view.tunnel_interface, view.tunnel_port)
                };
                let mut out = crate::fields([
                    ("ROUTING", view.routing_mode.clone()),
                    ("UNDERLAY", view.underlay_interface.clone()),
                    ("TUNNEL", tunnel),
                    ("ROUTES", view.routes.to_string()),
                ]);
                let mut t = Table::new(["NODE", "UNDERLAY", "POD CIDRS"]);
                for n in &view.nodes {
                    t.row([n.name.clone(), n.underlay.join(","), n.pod_cidrs.join(",")]);
                }
                out.push('\n');
                out.push_str(&t.render());
                out
            });
        }
        BpfCommand::Endpoint(EndpointCommand::List) => {
            let r = client
                .list_endpoints(pb::ListEndpointsRequest {})
                .await
                .map_err(rpc)?
                .into_inner();
            let view: Vec<EndpointView> = r
                .endpoints
                .iter()
                .map(|e| EndpointView {
                    id: e.endpoint_id,
                    ifindex: e.host_ifindex,
                    ifname: e.host_ifname.clone(),
                    addresses: e.addresses.iter().map(|a| format_address(a)).collect(),
                    mac: mac(&e.mac),
                    identity: e.identity,
                    policy_revision: e.policy_revision,
                    enforce_ingress: e.enforce_ingress,
                    enforce_egress: e.enforce_egress,
                    policy_entries: e.policy_entries,
                    from_container: name::<pb::AttachState>(e.from_container, "attach-state-"),
                    to_container: name::<pb::AttachState>(e.to_container, "attach-state-"),
                })
                .collect();
            ctx.print(&view, || {
                let mut t = Table::new([
                    "ID",
                    "INTERFACE",
                    "ADDRESSES",
                    "IDENTITY",
                    "REVISION",
                    "ENFORCE",
                    "ENTRIES",
                    "ATTACHED",
                ]);
                for e in &view {
                    let enforce = match (e.enforce_ingress, e.enforce_egress) {
                        (true, true) => "both",
                        (true, false) => "ingress",
                        (false, true) => "egress",
                        (false, false) => "none",
                    };
                    t.row([
                        e.id.to_string(),
                        format!("{} ({})", e.ifname, e.ifindex),
                        e.addresses.join(","),
                        e.identity.to_string(),
                        e.policy_revision.to_string(),
                        enforce.to_string(),
                        e.policy_entries.to_string(),
                        format!("in:{} out:{}", e.from_container, e.to_container),
                    ]);
                }
                t.render()
            });
        }
        BpfCommand::Policy(PolicyCommand::Get { endpoint }) => {
            let r = client
                .get_endpoint_policy(pb::GetEndpointPolicyRequest { endpoint_id: endpoint })
                .await
                .map_err(rpc)?
                .into_inner();
            let view = PolicyView::from(&r);
            ctx.print(&view, || view.render());
        }
        BpfCommand::Ct(CtCommand::List { address, port }) => {
            let filter = pb::ConntrackFilter {
                family: 0,
                protocol: 0,
                address: address.map(net::address_bytes).unwrap_or_default(),
                port: port.map(u32::from).unwrap_or_default(),
            };
            let mut entries = Vec::new();
            let mut start_after = None;
            loop {
                let r = client
                    .dump_conntrack(pb::DumpConntrackRequest {
                        filter: Some(filter.clone()),
                        page_size: 1000,
                        start_after: start_after.take(),
                    })
                    .await
                    .map_err(rpc)?
                    .into_inner();
                start_after = r.entries.last().and_then(|e| e.key.clone());
                entries.extend(r.entries);
                if r.complete || start_after.is_none() {
                    break;
                }
            }
            #[derive(Serialize)]
            struct Row {
                direction: String,
                protocol: String,
                source: String,
                destination: String,
                state: String,
                expires_in_s: f64,
                packets_forward: u64,
                packets_reply: u64,
                source_identity: u32,
                endpoint_id: u32,
            }
            let rows: Vec<Row> = entries
                .iter()
                .map(|e| {
                    let key = e.key.clone().unwrap_or_default();
                    let t = key.tuple.unwrap_or_default();
                    Row {
                        direction: name::<pb::Direction>(key.direction, "direction-"),
                        protocol: name::<pb::Protocol>(t.protocol, "protocol-"),
                        source: format!("{}:{}", format_address(&t.source_address), t.source_port),
                        destination: format!("{}:{}", format_address(&t.destination_address), t.destination_port),
                        state: name::<pb::TcpState>(e.tcp_state, "tcp-state-"),
                        expires_in_s: e.expires_in_nanos as f64 / 1e9,
                        packets_forward: e.packets_forward,
                        packets_reply: e.packets_reply,
                        source_identity: e.source_identity,
                        endpoint_id: e.endpoint_id,
                    }
                })
                .collect();
            ctx.print(&rows, || {
                let mut t = Table::new([
                    "DIR",
                    "PROTO",
                    "SOURCE",
                    "DESTINATION",
                    "STATE",
                    "EXPIRES",
                    "PKTS FWD",
                    "PKTS REPLY",
                    "SRC ID",
                    "EP",
                ]);
                for r in &rows {
                    t.row([
                        r.direction.clone(),
                        r.protocol.clone(),
                        r.source.clone(),
                        r.destination.clone(),
                        r.state.clone(),
                        format!("{:.0}s", r.expires_in_s),
                        r.packets_forward.to_string(),
                        r.packets_reply.to_string(),
                        r.source_identity.to_string(),
                        r.endpoint_id.to_string(),
                    ]);
                }
                t.render()
            });
        }
        BpfCommand::Metrics => {
            let r = client
                .get_drop_counters(pb::GetDropCountersRequest { include_zero: false })
                .await
                .map_err(rpc)?
                .into_inner();
            #[derive(Serialize)]
            struct Row {
                kind: String,
                reason: String,
                direction: String,
                packets: u64,
                bytes: u64,
            }
            let mut rows: Vec<Row> = r
                .forwarded
                .iter()
                .map(|f| Row {
                    kind: "forwarded".into(),
                    reason: "-".into(),
                    direction: name::<pb::Direction>(f.direction, "direction-"),
                    packets: f.packets,
                    bytes: f.bytes,
                })
                .collect();
            rows.extend(r.drops.iter().map(|d| Row {
                kind: "dropped".into(),
                reason: name::<pb::DropReason>(d.reason, "drop-reason-"),
                direction: name::<pb::Direction>(d.direction, "direction-"),
                packets: d.packets,
                bytes: d.bytes,
            }));
            ctx.print(&rows, || {
                let mut t = Table::new(["KIND", "REASON", "DIRECTION", "PACKETS", "BYTES"]);
                for r in &rows {
                    t.row([
                        r.kind.clone(),
                        r.reason.clone(),
                        r.direction.clone(),
                        r.packets.to_string(),
                        r.bytes.to_string(),
                    ]);
                }
                t.render()
            });
        }
    }
    Ok(())
}

/// `rivet monitor`: streams datapath events until interrupted.
pub async fn monitor(ctx: &Context, verdicts: bool, trace: bool, endpoints: Vec<u32>) -> Result<(), CliError> {
    let mut client = LoaderServiceClient::new(ctx.connect(DAEMON).await?);
    let mut types = vec![pb::EventType::Drop as i32];
    if verdicts {
        types.push(pb::EventType::PolicyVerdict as i32);
    }
    if trace {
        types.push(pb::EventType::Trace as i32);
    }
    // A stream has no deadline; the per-call timeout applies to connecting.
    let mut stream = client
        .monitor_events(pb::MonitorEventsRequest {
            types,
            endpoint_ids: endpoints,
        })
        .await
        .map_err(|s| CliError::rpc(DAEMON, s))?
        .into_inner();
    while let Some(event) = stream.message().await.map_err(|s| CliError::rpc(DAEMON, s))? {
        if event.r#type == pb::EventType::Subscribed as i32 {
            // The stream's first message: every event from here on is shown.
            // On stderr, so that scripts can wait for it without parsing events.
            eprintln!("rivet monitor: listening");
            continue;
        }
        print_event(ctx, &event);
    }
    Ok(())
}

/// One event as a line of text, or a JSON object per line.
pub fn print_event(ctx: &Context, e: &pb::MonitorEvent) {
    let t = e.tuple.clone().unwrap_or_default();
    #[derive(Serialize)]
    struct Line {
        r#type: String,
        reason: String,
        verdict: String,
        direction: String,
        endpoint_id: u32,
        protocol: String,
        source: String,
        destination: String,
        source_identity: u32,
        destination_identity: u32,
        length: u32,
        lost_events: u64,
    }
    let line = Line {
        r#type: name::<pb::EventType>(e.r#type, "event-type-"),
        reason: match pb::EventType::try_from(e.r#type) {
            Ok(pb::EventType::Trace) => name::<pb::TracePoint>(e.trace_point, "trace-point-"),
            _ => name::<pb::DropReason>(e.drop_reason, "drop-reason-"),
        },
        verdict: name::<pb::Verdict>(e.verdict, "verdict-"),
        direction: name::<pb::Direction>(e.direction, "direction-"),
        endpoint_id: e.endpoint_id,
        protocol: name::<pb::Protocol>(t.protocol, "protocol-"),
        source: format!("{}:{}", format_address(&t.source_address), t.source_port),
        destination: format!("{}:{}", format_address(&t.destination_address), t.destination_port),
        source_identity: e.source_identity,
        destination_identity: e.destination_identity,
        length: e.packet_length,
        lost_events: e.lost_events,
    };
    match ctx.output {
        crate::Output::Json => println!("{}", serde_json::to_string(&line).expect("serialisable")),
        crate::Output::Yaml => print!("---\n{}", serde_norway::to_string(&line).expect("serialisable")),
        crate::Output::Table => {
            let what = match line.r#type.as_str() {
                "drop" => format!("DROP ({})", line.reason),
                "policy-verdict" => format!("VERDICT {}", line.verdict),
                "trace" => format!("TRACE {}", line.reason),
                other => other.to_string(),
            };
            println!(
                "{what} ep {} {} {} {} -> {} identity {} -> {} len {}{}",
                line.endpoint_id,
                line.direction,
                line.protocol,
                line.source,
                line.destination,
                line.source_identity,
                line.destination_identity,
                line.length,
                if line.lost_events > 0 {
                    format!(" (lost {} events)", line.lost_events)
                } else {
                    String::new()
                }
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_view_shows_address_entries_and_their_prefixes() {
        let entry = |peer_identity, peer_kind: pb::PeerKind| pb::PolicyEntryStatus {
            entry: Some(pb::PolicyEntry {
                direction: pb::Direction::Egress as i32,
                peer_identity,
                protocol: pb::Protocol::Tcp as i32,
                port: 443,
                end_port: 0,
                verdict: pb::Verdict::Allow as i32,
                peer_kind: peer_kind as i32,
            }),
            packets: 3,
            bytes: 180,
        };
        let r = pb::GetEndpointPolicyResponse {
            endpoint_id: 7,
            revision: 2,
            enforce_egress: true,
            entries: vec![
                entry(0, pb::PeerKind::Identity),
                entry(300, pb::PeerKind::Identity),
                entry(1 << 24, pb::PeerKind::Address),
            ],
            prefixes: vec![pb::EndpointPrefix {
                direction: pb::Direction::Egress as i32,
                prefix: Some(rivet_proto::net::IpPrefix {
                    address: vec![198, 18, 0, 0],
                    prefix_length: 15,
                }),
                cidr_identity: 1 << 24,
            }],
            ..Default::default()
        };
        let view = PolicyView::from(&r);
        let peers: Vec<&str> = view.entries.iter().map(|e| e.peer_identity.as_str()).collect();
        assert_eq!(peers, ["any", "300", "addr:16777216"]);
        let text = view.render();
        assert!(text.contains("198.18.0.0/15"), "{text}");
        assert!(text.contains("16777216"), "{text}");
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["prefixes"][0]["prefix"], "198.18.0.0/15");
        assert_eq!(json["prefixes"][0]["direction"], "egress");
    }

    #[test]
    fn service_list_shows_backends_with_state_and_slots_and_catalog_names() {
        let backend = |addr: [u8; 4], state: pb::BackendState, id, slots| pb::LbBackendStatus {
            backend: Some(pb::LbBackend {
                address: addr.to_vec(),
                port: 8080,
                state: state as i32,
                node_local: id == 1,
            }),
            backend_id: id,
            maglev_slots: slots,
        };
        let r = pb::ListServicesResponse {
            services: vec![
                pb::LbServiceStatus {
                    service: Some(pb::LbService {
                        service_id: 7,
                        family: pb::Family::Ipv4 as i32,
                        protocol: pb::Protocol::Tcp as i32,
                        frontends: vec![
                            pb::LbFrontend {
                                kind: pb::FrontendKind::ClusterIp as i32,
                                address: vec![198, 19, 128, 10],
                                port: 80,
                            },
                            pb::LbFrontend {
                                kind: pb::FrontendKind::NodePort as i32,
                                address: vec![],
                                port: 30080,
                            },
                        ],
                        backends: vec![],
                        affinity_timeout_seconds: 30,
                        external_traffic_policy: pb::TrafficPolicy::Local as i32,
                    }),
                    table_id: 3,
                    external_table_id: 4,
                    backends: vec![
                        backend([198, 18, 0, 2], pb::BackendState::Active, 1, 1021),
                        backend([198, 18, 0, 3], pb::BackendState::Terminating, 2, 0),
                    ],
                },
                pb::LbServiceStatus {
                    service: Some(pb::LbService {
                        service_id: 8,
                        family: pb::Family::Ipv6 as i32,
                        protocol: pb::Protocol::Udp as i32,
                        frontends: vec![pb::LbFrontend {
                            kind: pb::FrontendKind::ClusterIp as i32,
                            address: "2001:2:0:ff::a"
                                .parse::<std::net::Ipv6Addr>()
                                .unwrap()
                                .octets()
                                .to_vec(),
                            port: 53,
                        }],
                        ..Default::default()
                    }),
                    table_id: 5,
                    ..Default::default()
                },
            ],
            flow_entries: 4,
            affinity_entries: 1,
            boot_id: "b".into(),
            entries_counted: true,
        };
        let names = catalog_names(&[endpoint_pb::ServiceView {
            namespace: "default".into(),
            name: "web".into(),
            load_balancer: vec![endpoint_pb::LoadBalancerEntry {
                service_port: "http".into(),
                family: "IPv4".into(),
                service_id: 7,
                realised: true,
            }],
            ..Default::default()
        }]);
        let view = service_map_view(&r, Some(&names));
        let text = service_map_text(&view);
        assert!(
            text.contains("7   default/web:http (IPv4)  tcp    198.19.128.10:80,nodeport:30080  affinity=30s,local  198.18.0.2:8080  1           active (node-local)  1021"),
            "{text}"
        );
        assert!(
            text.contains("198.18.0.3:8080  2           terminating          0"),
            "{text}"
        );
        assert!(
            text.contains("8   -                        udp    [2001:2:0:ff::a]:53"),
            "{text}"
        );
        assert!(text.contains("(none: rejects)"), "{text}");
        assert!(
            text.contains("2 services, 4 flow entries, 1 affinity entries\n"),
            "{text}"
        );
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["services"][0]["backends"][1]["state"], "terminating");
        assert_eq!(json["services"][0]["external_table_id"], 4);

        assert_eq!(json["flow_entries"], 4);

        let anonymous = service_map_text(&service_map_view(&r, None));
        assert!(
            anonymous.contains("(names unknown: svc-endpoint did not answer)"),
            "{anonymous}"
        );

        // Without --counts the maps were not walked: no counts shown.
        let uncounted = pb::ListServicesResponse {
            entries_counted: false,
            flow_entries: 0,
            affinity_entries: 0,
            ..r
        };
        let view = service_map_view(&uncounted, Some(&names));
        let text = service_map_text(&view);
        assert!(text.contains("\n2 services\n"), "{text}");
        assert!(!text.contains("flow entries"), "{text}");
        assert!(serde_json::to_value(&view).unwrap().get("flow_entries").is_none());
    }
}

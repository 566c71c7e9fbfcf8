//! The `rivet.loader.v1.LoaderService` gRPC service: validation, error
//! codes and conversions around [`EndpointDatapath`].

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt as _};
use rivet_common::grpc::{BootId, status_with_reason};
use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use tokio::sync::broadcast;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::datapath::{AttachState, PROG_FROM_NETDEV, PROG_FROM_OVERLAY, PROG_TO_NETDEV, PROG_TO_OVERLAY};
use crate::events::{self, LoaderMetrics};
use crate::loader::{EndpointDatapath, LoaderError};
use crate::monitor::EventHub;
use crate::validate::{self, InvalidField};
use rivet_datapath::maps::{self, Ct4Key, Ct6Key, CtEntry, DIR_EGRESS, DIR_INGRESS, Event, IpcacheValue};

/// Implements `rivet.loader.v1.LoaderService`.
#[derive(Debug, Clone)]
pub struct LoaderService {
    datapath: Arc<EndpointDatapath>,
    metrics: LoaderMetrics,
    events: Arc<EventHub>,
    boot_id: BootId,
    /// The tunnel device (vxlan mode), whose overlay programs the status lists.
    tunnel_ifindex: Option<u32>,
    /// The external interfaces, whose NodePort programs the status lists.
    nodeport_ifindexes: Vec<u32>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::MonitorEvent, Status>> + Send>>;

impl LoaderService {
    /// A service over `datapath`, streaming events from `events`.
    pub fn new(
        datapath: Arc<EndpointDatapath>,
        events: Arc<EventHub>,
        boot_id: BootId,
        metrics: LoaderMetrics,
    ) -> Self {
        Self {
            datapath,
            metrics,
            events,
            boot_id,
            tunnel_ifindex: None,
            nodeport_ifindexes: Vec::new(),
        }
    }

    /// Reports the overlay programs' attachments on tunnel device `ifindex`.
    pub fn with_tunnel(mut self, ifindex: Option<u32>) -> Self {
        self.tunnel_ifindex = ifindex;
        self
    }

    /// Reports the NodePort programs' attachments on the external
    /// interfaces `ifindexes`.
    pub fn with_nodeport_interfaces(mut self, ifindexes: Vec<u32>) -> Self {
        self.nodeport_ifindexes = ifindexes;
        self
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::loader_service_server::LoaderServiceServer<Self> {
        pb::loader_service_server::LoaderServiceServer::new(self)
    }

    fn fail(&self, method: &'static str, status: Status) -> Status {
        events::request_failed(&self.metrics, method, &status);
        status
    }

    fn boot_id(&self) -> String {
        self.boot_id.to_string()
    }

    /// Runs blocking datapath work (syscalls, netlink) off the async threads.
    async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&EndpointDatapath) -> Result<R, LoaderError> + Send + 'static,
    ) -> Result<R, Status> {
        let dp = self.datapath.clone();
        tokio::task::spawn_blocking(move || f(&dp))
            .await
            .map_err(|e| Status::internal(format!("datapath task failed: {e}")))?
            .map_err(status)
    }
}

fn invalid(e: InvalidField) -> Status {
    Status::invalid_argument(e.to_string())
}

/// Maps a loader error to its status and the reason a client acts on
/// (`rivet.loader.v1.ErrorReason`).
fn status(e: LoaderError) -> Status {
    use LoaderError as E;
    use pb::ErrorReason as R;
    let (code, reason) = match &e {
        E::InterfaceNotFound { .. } => (Code::NotFound, R::InterfaceNotFound),
        E::UnknownEndpoint(_) => (Code::NotFound, R::EndpointNotFound),
        E::NotAVeth { .. } | E::WrongPrefix { .. } => (Code::PermissionDenied, R::InterfaceNotEndpoint),
        E::InterfaceHeld { .. } => (Code::AlreadyExists, R::InterfaceHeld),
        E::AddressHeld { .. } => (Code::AlreadyExists, R::AddressHeld),
        E::EndpointElsewhere { .. } => (Code::FailedPrecondition, R::EndpointOnOtherInterface),
        E::Policy(_) => (Code::InvalidArgument, R::PolicyInvalid),
        E::Map {
            source: aya::maps::MapError::SyscallError(s),
            ..
        } if matches!(
            s.io_error.raw_os_error(),
            Some(libc::E2BIG) | Some(libc::ENOSPC) | Some(libc::ENOMEM)
        ) =>
        {
            (Code::ResourceExhausted, R::MapFull)
        }
        E::Interface { .. } | E::Datapath { .. } | E::Map { .. } => return Status::internal(e.to_string()),
    };
    status_with_reason(code, e.to_string(), reason)
}

fn attach_state(s: AttachState) -> pb::AttachState {
    match s {
        AttachState::Attached { .. } => pb::AttachState::Attached,
        AttachState::Detached => pb::AttachState::Detached,
        AttachState::Stale { .. } => pb::AttachState::Stale,
        AttachState::InterfaceGone => pb::AttachState::InterfaceGone,
    }
}

fn direction(d: u8) -> pb::Direction {
    match d {
        DIR_INGRESS => pb::Direction::Ingress,
        DIR_EGRESS => pb::Direction::Egress,
        _ => pb::Direction::Unspecified,
    }
}

fn protocol(p: u8) -> i32 {
    match p {
        0 => pb::Protocol::Any as i32,
        p => i32::from(p),
    }
}

fn endpoint_proto(v: &crate::loader::EndpointView) -> pb::Endpoint {
    let i = &v.info;
    pb::Endpoint {
        endpoint_id: i.endpoint_id,
        host_ifindex: i.ifindex,
        host_ifname: v.ifname.clone().unwrap_or_default(),
        addresses: [i.ipv4_addr().map(IpAddr::V4), i.ipv6_addr().map(IpAddr::V6)]
            .into_iter()
            .flatten()
            .map(address_bytes)
            .collect(),
        mac: i.mac.to_vec(),
        identity: i.identity,
        policy_revision: i.policy_revision,
        enforce_ingress: i.flags & maps::EP_F_ENFORCE_INGRESS != 0,
        enforce_egress: i.flags & maps::EP_F_ENFORCE_EGRESS != 0,
        allow_from_host: i.flags & maps::EP_F_ALLOW_FROM_HOST != 0,
        policy_entries: v.policy_entries as u32,
        from_container: attach_state(v.ingress) as i32,
        to_container: attach_state(v.egress) as i32,
        policy_prefixes: v.policy_prefixes as u32,
    }
}

fn ipcache_proto(addr: IpAddr, len: u8, v: &IpcacheValue) -> pb::IpcacheEntry {
    pb::IpcacheEntry {
        prefix: Some(IpPrefix {
            address: address_bytes(addr),
            prefix_length: u32::from(len),
        }),
        identity: v.identity,
        tunnel_endpoint: v
            .tunnel_endpoint_addr()
            .map(|a| address_bytes(IpAddr::V4(a)))
            .unwrap_or_default(),
    }
}

/// Nanoseconds of CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_nanos() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A conntrack entry in sortable form: (family, key bytes).
type CtSortKey = (u8, Vec<u8>);

fn ct_sort_key(k: &pb::ConntrackKey) -> CtSortKey {
    let t = k.tuple.clone().unwrap_or_default();
    let mut bytes = t.source_address.clone();
    bytes.extend(&t.destination_address);
    bytes.extend((t.source_port as u16).to_be_bytes());
    bytes.extend((t.destination_port as u16).to_be_bytes());
    bytes.push(t.protocol as u8);
    bytes.push(k.direction as u8);
    (t.source_address.len() as u8, bytes)
}

/// A conntrack key in std types.
struct CtTuple {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    protocol: u8,
    direction: u8,
}

impl From<&Ct4Key> for CtTuple {
    fn from(k: &Ct4Key) -> Self {
        let (s, d) = (k.src(), k.dst());
        Self {
            src: IpAddr::V4(*s.ip()),
            dst: IpAddr::V4(*d.ip()),
            sport: s.port(),
            dport: d.port(),
            protocol: k.protocol,
            direction: k.direction,
        }
    }
}

impl From<&Ct6Key> for CtTuple {
    fn from(k: &Ct6Key) -> Self {
        let (s, d) = (k.src(), k.dst());
        Self {
            src: IpAddr::V6(*s.ip()),
            dst: IpAddr::V6(*d.ip()),
            sport: s.port(),
            dport: d.port(),
            protocol: k.protocol,
            direction: k.direction,
        }
    }
}

fn ct_proto(t: &CtTuple, e: &CtEntry, now: u64) -> pb::ConntrackEntry {
    pb::ConntrackEntry {
        key: Some(pb::ConntrackKey {
            tuple: Some(pb::FiveTuple {
                source_address: address_bytes(t.src),
                destination_address: address_bytes(t.dst),
                source_port: u32::from(t.sport),
                destination_port: u32::from(t.dport),
                protocol: i32::from(t.protocol),
            }),
            direction: direction(t.direction) as i32,
        }),
        expires_in_nanos: e.expires as i64 - now as i64,
        tcp_state: i32::from(e.tcp_state),
        tcp_flags_forward: u32::from(e.tcp_flags_fwd),
        tcp_flags_reply: u32::from(e.tcp_flags_rev),
        packets_forward: e.packets_fwd,
        bytes_forward: e.bytes_fwd,
        packets_reply: e.packets_rev,
        bytes_reply: e.bytes_rev,
        source_identity: e.src_identity,
        endpoint_id: e.endpoint_id,
    }
}

fn event_proto(e: &Event, boot_id: &str, lost: u64) -> pb::MonitorEvent {
    let tuple = pb::FiveTuple {
        source_address: e.src_ip().map(address_bytes).unwrap_or_default(),
        destination_address: e.dst_ip().map(address_bytes).unwrap_or_default(),
        source_port: u32::from(e.src_port()),
        destination_port: u32::from(u16::from_be(e.dport)),
        protocol: i32::from(e.protocol),
    };
    let mut m = pb::MonitorEvent {
        boot_id: boot_id.to_string(),
        r#type: i32::from(e.kind),
        time_unix_nanos: 0,
        cpu: 0,
        endpoint_id: e.endpoint_id,
        ifindex: e.ifindex,
        direction: direction(e.direction) as i32,
        tuple: Some(tuple),
        source_identity: e.src_identity,
        destination_identity: e.dst_identity,
        drop_reason: 0,
        verdict: 0,
        matched_entry: None,
        trace_point: 0,
        packet_length: e.length,
        lost_events: lost,
    };
    match e.kind {
        maps::EVENT_DROP => m.drop_reason = i32::from(e.reason),
        maps::EVENT_POLICY_VERDICT => {
            m.verdict = i32::from(e.verdict);
            m.drop_reason = i32::from(e.reason);
        }
        maps::EVENT_TRACE => m.trace_point = i32::from(e.reason),
        _ => {}
    }
    m
}

#[tonic::async_trait]
impl pb::loader_service_server::LoaderService for LoaderService {
    #[tracing::instrument(
        name = "loader.apply_endpoint",
        skip_all,
        fields(
            endpoint_id = request.get_ref().endpoint_id,
            rivet.identity.id = request.get_ref().identity,
            rivet.pod.addresses,
        )
    )]
    async fn apply_endpoint(
        &self,
        request: Request<pb::ApplyEndpointRequest>,
    ) -> Result<Response<pb::ApplyEndpointResponse>, Status> {
        let started = std::time::Instant::now();
        let spec = validate::endpoint(request.get_ref())
            .map_err(invalid)
            .map_err(|s| self.fail("ApplyEndpoint", s))?;
        let addresses: Vec<String> = (spec.ipv4.map(|a| a.to_string()).into_iter())
            .chain(spec.ipv6.map(|a| a.to_string()))
            .collect();
        tracing::Span::current().record("rivet.pod.addresses", addresses.join(",").as_str());
        let applied = self
            .blocking(move |dp| dp.apply(&spec))
            .await
            .map_err(|s| self.fail("ApplyEndpoint", s))?;
        events::endpoint_applied(
            &self.metrics,
            applied.info.endpoint_id,
            applied.info.identity,
            applied.info.policy_revision,
            applied.changed,
            started.elapsed(),
        );
        let id = applied.info.endpoint_id;
        let view = self.blocking(move |dp| dp.view(id)).await?;
        Ok(Response::new(pb::ApplyEndpointResponse {
            endpoint: Some(endpoint_proto(&view)),
            changed: applied.changed,
            boot_id: self.boot_id(),
        }))
    }

    #[tracing::instrument(name = "loader.remove_endpoint", skip_all)]
    async fn remove_endpoint(
        &self,
        request: Request<pb::RemoveEndpointRequest>,
    ) -> Result<Response<pb::RemoveEndpointResponse>, Status> {
        let r = request.into_inner();
        let id = match r.endpoint_id {
            0 => None,
            id => Some(validate::endpoint_id("endpoint_id", id).map_err(invalid)?),
        };
        let ifindex = (r.host_ifindex != 0).then_some(r.host_ifindex);
        if id.is_none() && ifindex.is_none() {
            return Err(Status::invalid_argument("endpoint_id or host_ifindex: one is required"));
        }
        let removed = self
            .blocking(move |dp| dp.remove(id, ifindex))
            .await
            .map_err(|s| self.fail("RemoveEndpoint", s))?;
        if removed {
            events::endpoint_removed(&self.metrics, id, ifindex);
        }
        Ok(Response::new(pb::RemoveEndpointResponse {
            removed,
            boot_id: self.boot_id(),
        }))
    }

    async fn get_endpoint_policy(
        &self,
        request: Request<pb::GetEndpointPolicyRequest>,
    ) -> Result<Response<pb::GetEndpointPolicyResponse>, Status> {
        let id = validate::endpoint_id("endpoint_id", request.get_ref().endpoint_id).map_err(invalid)?;
        let view = self.blocking(move |dp| dp.policy(id)).await?;
        let info = view.info;
        Ok(Response::new(pb::GetEndpointPolicyResponse {
            endpoint_id: id,
            revision: info.policy_revision,
            enforce_ingress: info.flags & maps::EP_F_ENFORCE_INGRESS != 0,
            enforce_egress: info.flags & maps::EP_F_ENFORCE_EGRESS != 0,
            allow_from_host: info.flags & maps::EP_F_ALLOW_FROM_HOST != 0,
            entries: view
                .entries
                .iter()
                .map(|v| {
                    let ports = v.entry.ports();
                    let any_port = v.entry.port_bits == 0;
                    pb::PolicyEntryStatus {
                        entry: Some(pb::PolicyEntry {
                            direction: direction(v.entry.direction) as i32,
                            peer_identity: v.entry.identity,
                            protocol: protocol(v.entry.protocol),
                            port: if any_port { 0 } else { u32::from(*ports.start()) },
                            end_port: if any_port || ports.start() == ports.end() {
                                0
                            } else {
                                u32::from(*ports.end())
                            },
                            verdict: i32::from(v.verdict),
                            peer_kind: if v.entry.by_address {
                                pb::PeerKind::Address
                            } else {
                                pb::PeerKind::Identity
                            } as i32,
                        }),
                        packets: v.packets,
                        bytes: v.bytes,
                    }
                })
                .collect(),
            boot_id: self.boot_id(),
            prefixes: view
                .prefixes
                .iter()
                .map(|p| pb::EndpointPrefix {
                    direction: direction(p.direction) as i32,
                    prefix: Some(IpPrefix {
                        address: address_bytes(p.addr),
                        prefix_length: u32::from(p.len),
                    }),
                    cidr_identity: p.cidr_identity,
                })
                .collect(),
        }))
    }

    async fn list_endpoints(
        &self,
        _request: Request<pb::ListEndpointsRequest>,
    ) -> Result<Response<pb::ListEndpointsResponse>, Status> {
        let listing = self.blocking(|dp| dp.list()).await?;
        Ok(Response::new(pb::ListEndpointsResponse {
            endpoints: listing.endpoints.iter().map(endpoint_proto).collect(),
            orphan_attachments: listing
                .orphan_attachments
                .iter()
                .map(|a| pb::OrphanAttachment {
                    host_ifindex: a.ifindex,
                    host_ifname: a.ifname.clone().unwrap_or_default(),
                    from_container: matches!(a.ingress, AttachState::Attached { .. } | AttachState::Stale { .. }),
                    to_container: matches!(a.egress, AttachState::Attached { .. } | AttachState::Stale { .. }),
                })
                .collect(),
            orphan_policy_endpoint_ids: listing.orphan_policies,
            boot_id: self.boot_id(),
        }))
    }

    async fn list_endpoint_interfaces(
        &self,
        _request: Request<pb::ListEndpointInterfacesRequest>,
    ) -> Result<Response<pb::ListEndpointInterfacesResponse>, Status> {
        let interfaces = self.blocking(|dp| dp.endpoint_interfaces()).await?;
        Ok(Response::new(pb::ListEndpointInterfacesResponse {
            endpoints: interfaces
                .into_iter()
                .map(|i| pb::EndpointInterface {
                    endpoint_id: i.endpoint_id,
                    host_ifindex: i.ifindex,
                    gone: i.ifname.is_none(),
                    host_ifname: i.ifname.unwrap_or_default(),
                })
                .collect(),
            boot_id: self.boot_id(),
        }))
    }

    async fn upsert_ipcache(
        &self,
        request: Request<pb::UpsertIpcacheRequest>,
    ) -> Result<Response<pb::UpsertIpcacheResponse>, Status> {
        let entries = validate::ipcache_entries("entries", &request.get_ref().entries).map_err(invalid)?;
        let (upserted, unchanged) = self.blocking(move |dp| dp.upsert_ipcache(&entries)).await?;
        Ok(Response::new(pb::UpsertIpcacheResponse {
            upserted,
            unchanged,
            boot_id: self.boot_id(),
        }))
    }

    async fn delete_ipcache(
        &self,
        request: Request<pb::DeleteIpcacheRequest>,
    ) -> Result<Response<pb::DeleteIpcacheResponse>, Status> {
        let prefixes = validate::ipcache_prefixes("prefixes", &request.get_ref().prefixes).map_err(invalid)?;
        let deleted = self.blocking(move |dp| dp.delete_ipcache(&prefixes)).await?;
        Ok(Response::new(pb::DeleteIpcacheResponse {
            deleted,
            boot_id: self.boot_id(),
        }))
    }

    async fn replace_ipcache(
        &self,
        request: Request<Streaming<pb::ReplaceIpcacheRequest>>,
    ) -> Result<Response<pb::ReplaceIpcacheResponse>, Status> {
        let mut stream = request.into_inner();
        let mut wanted = std::collections::BTreeSet::new();
        let (mut upserted, mut unchanged) = (0, 0);
        while let Some(chunk) = stream.message().await? {
            let entries = validate::ipcache_entries("entries", &chunk.entries).map_err(invalid)?;
            wanted.extend(entries.iter().map(|(a, l, _)| (*a, *l)));
            let (u, n) = self.blocking(move |dp| dp.upsert_ipcache(&entries)).await?;
            upserted += u;
            unchanged += n;
        }
        // The stream ended cleanly: what was not sent goes, except the
        // node's own addresses, which the loader publishes itself.
        let host = crate::host_addresses::node_addresses().map_err(|e| Status::internal(e.to_string()))?;
        let stale: Vec<(IpAddr, u8)> = self
            .blocking(|dp| dp.ipcache_entries())
            .await?
            .into_iter()
            .filter(|(a, l, v)| {
                let sent = wanted.contains(&(*a, *l));
                let ours = v.identity == maps::IDENTITY_HOST && host.contains(a);
                !sent && !ours
            })
            .map(|(a, l, _)| (a, l))
            .collect();
        let deleted = self.blocking(move |dp| dp.delete_ipcache(&stale)).await?;
        Ok(Response::new(pb::ReplaceIpcacheResponse {
            upserted,
            unchanged,
            deleted,
            boot_id: self.boot_id(),
        }))
    }

    async fn list_ipcache(
        &self,
        request: Request<pb::ListIpcacheRequest>,
    ) -> Result<Response<pb::ListIpcacheResponse>, Status> {
        let r = request.into_inner();
        let page = match r.page_size {
            0 => 1000,
            n if n <= 10000 => n as usize,
            _ => return Err(Status::invalid_argument("page_size: at most 10000")),
        };
        let after = match r.start_after.as_ref() {
            Some(p) => Some(validate::prefix("start_after", Some(p)).map_err(invalid)?),
            None => None,
        };
        let all = self.blocking(|dp| dp.ipcache_entries()).await?;
        let rest: Vec<_> = all
            .into_iter()
            .filter(|(a, l, _)| after.is_none_or(|s| (*a, *l) > s))
            .collect();
        let complete = rest.len() <= page;
        Ok(Response::new(pb::ListIpcacheResponse {
            entries: rest
                .iter()
                .take(page)
                .map(|(a, l, v)| ipcache_proto(*a, *l, v))
                .collect(),
            complete,
            boot_id: self.boot_id(),
        }))
    }

    async fn get_datapath_status(
        &self,
        _request: Request<pb::GetDatapathStatusRequest>,
    ) -> Result<Response<pb::GetDatapathStatusResponse>, Status> {
        let tunnel = self.tunnel_ifindex;
        let external = self.nodeport_ifindexes.clone();
        let (pin_dir, ids, endpoints, maps, overlay, nodeport) = self
            .blocking(move |dp| {
                let endpoints = dp.list()?.endpoints.len();
                let d = dp.datapath();
                let (from_overlay, to_overlay) = d.overlay_program_ids();
                // (program, id, attached to the tunnel device)
                let overlay = match tunnel {
                    Some(ifindex) => {
                        let a = d.overlay_attachment(ifindex).map_err(|source| LoaderError::Datapath {
                            action: "listing the overlay filters on the tunnel device".to_owned(),
                            source: Box::new(source),
                        })?;
                        [
                            (PROG_FROM_OVERLAY, from_overlay, a.ingress_prog_id == Some(from_overlay)),
                            (PROG_TO_OVERLAY, to_overlay, a.egress_prog_id == Some(to_overlay)),
                        ]
                    }
                    None => [
                        (PROG_FROM_OVERLAY, from_overlay, false),
                        (PROG_TO_OVERLAY, to_overlay, false),
                    ],
                };
                // (program, id, external interfaces running it)
                let (from_netdev, to_netdev) = d.nodeport_program_ids();
                let mut nodeport = [(PROG_FROM_NETDEV, from_netdev, 0), (PROG_TO_NETDEV, to_netdev, 0)];
                for ifindex in external {
                    let (ingress, egress) = d.nodeport_attachment(ifindex).map_err(|source| LoaderError::Datapath {
                        action: "listing the NodePort filters on an external interface".to_owned(),
                        source: Box::new(source),
                    })?;
                    nodeport[0].2 += u32::from(ingress == Some(from_netdev));
                    nodeport[1].2 += u32::from(egress == Some(to_netdev));
                }
                Ok((
                    d.pin_dir().display().to_string(),
                    d.program_ids(),
                    endpoints,
                    d.map_status(),
                    overlay,
                    nodeport,
                ))
            })
            .await?;
        Ok(Response::new(pb::GetDatapathStatusResponse {
            maps: maps
                .iter()
                .map(|m| pb::MapStatus {
                    name: m.name.clone(),
                    map_type: rivet_datapath::spec::map_type_name(m.spec.map_type),
                    key_size: m.spec.key_size,
                    value_size: m.spec.value_size,
                    max_entries: m.spec.max_entries,
                    entries: None,
                    pin_path: m.pin.display().to_string(),
                    reused: m.reused,
                })
                .collect(),
            programs: vec![
                pb::ProgramStatus {
                    name: "from_container".into(),
                    program_id: ids.from_container,
                    tag: String::new(),
                    attachments: endpoints as u32,
                },
                pb::ProgramStatus {
                    name: "to_container".into(),
                    program_id: ids.to_container,
                    tag: String::new(),
                    attachments: endpoints as u32,
                },
            ]
            .into_iter()
            .chain(overlay.map(|(name, program_id, attached)| pb::ProgramStatus {
                name: name.into(),
                program_id,
                tag: String::new(),
                attachments: u32::from(attached),
            }))
            .chain(nodeport.map(|(name, program_id, attachments)| pb::ProgramStatus {
                name: name.into(),
                program_id,
                tag: String::new(),
                attachments,
            }))
            .collect(),
            pin_dir,
            object_sha256: crate::object_sha256(),
            kernel_release: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            endpoints: endpoints as u32,
            boot_id: self.boot_id(),
        }))
    }

    async fn dump_conntrack(
        &self,
        request: Request<pb::DumpConntrackRequest>,
    ) -> Result<Response<pb::DumpConntrackResponse>, Status> {
        let r = request.into_inner();
        let page = match r.page_size {
            0 => 1000,
            n if n <= 10000 => n as usize,
            _ => return Err(Status::invalid_argument("page_size: at most 10000")),
        };
        let filter = r.filter.unwrap_or_default();
        let family = pb::Family::try_from(filter.family).unwrap_or(pb::Family::Unspecified);
        let want_proto = match pb::Protocol::try_from(filter.protocol) {
            Ok(pb::Protocol::Unspecified | pb::Protocol::Any) => None,
            Ok(p) => Some(p as i32 as u8),
            Err(_) => return Err(Status::invalid_argument("filter.protocol: unknown protocol")),
        };
        let want_addr = match filter.address.len() {
            0 => None,
            _ => Some(validate::address("filter.address", &filter.address).map_err(invalid)?),
        };
        if filter.port > 65535 {
            return Err(Status::invalid_argument("filter.port: at most 65535"));
        }
        let want_port = (filter.port != 0).then_some(filter.port as u16);
        let after = r.start_after.as_ref().map(ct_sort_key);
        let entries = self
            .blocking(move |dp| {
                let now = monotonic_nanos();
                let mut out = Vec::new();
                let keep = |t: &CtTuple| {
                    want_proto.is_none_or(|p| p == t.protocol)
                        && want_addr.is_none_or(|a| a == t.src || a == t.dst)
                        && want_port.is_none_or(|p| p == t.sport || p == t.dport)
                };
                let maps = dp.datapath().maps();
                if family != pb::Family::Ipv6 {
                    for (k, e) in maps.ct4.lock().iter().filter_map(Result::ok) {
                        let t = CtTuple::from(&k);
                        if keep(&t) {
                            out.push(ct_proto(&t, &e, now));
                        }
                    }
                }
                if family != pb::Family::Ipv4 {
                    for (k, e) in maps.ct6.lock().iter().filter_map(Result::ok) {
                        let t = CtTuple::from(&k);
                        if keep(&t) {
                            out.push(ct_proto(&t, &e, now));
                        }
                    }
                }
                Ok(out)
            })
            .await?;
        let mut entries: Vec<_> = entries
            .into_iter()
            .map(|e| (ct_sort_key(e.key.as_ref().expect("set above")), e))
            .filter(|(k, _)| after.as_ref().is_none_or(|a| k > a))
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let complete = entries.len() <= page;
        Ok(Response::new(pb::DumpConntrackResponse {
            entries: entries.into_iter().take(page).map(|(_, e)| e).collect(),
            complete,
            boot_id: self.boot_id(),
        }))
    }

    async fn get_drop_counters(
        &self,
        request: Request<pb::GetDropCountersRequest>,
    ) -> Result<Response<pb::GetDropCountersResponse>, Status> {
        let include_zero = request.get_ref().include_zero;
        let totals = self
            .blocking(|dp| {
                dp.datapath().metrics_totals().map_err(|source| LoaderError::Datapath {
                    action: "reading datapath counters".into(),
                    source: Box::new(source),
                })
            })
            .await?;
        let mut drops = Vec::new();
        let mut forwarded = Vec::new();
        for ((reason, dir), v) in totals {
            if v.packets == 0 && !include_zero {
                continue;
            }
            if reason == maps::REASON_FORWARDED {
                forwarded.push(pb::ForwardCounter {
                    direction: direction(dir) as i32,
                    packets: v.packets,
                    bytes: v.bytes,
                });
            } else {
                drops.push(pb::DropCounter {
                    reason: i32::from(reason),
                    direction: direction(dir) as i32,
                    packets: v.packets,
                    bytes: v.bytes,
                });
            }
        }
        Ok(Response::new(pb::GetDropCountersResponse {
            drops,
            forwarded,
            boot_id: self.boot_id(),
        }))
    }

    type MonitorEventsStream = EventStream;

    async fn monitor_events(
        &self,
        request: Request<pb::MonitorEventsRequest>,
    ) -> Result<Response<Self::MonitorEventsStream>, Status> {
        let r = request.into_inner();
        let mut kinds = Vec::new();
        for (i, t) in r.types.iter().enumerate() {
            match pb::EventType::try_from(*t) {
                Ok(pb::EventType::Drop) => kinds.push(maps::EVENT_DROP),
                Ok(pb::EventType::PolicyVerdict) => kinds.push(maps::EVENT_POLICY_VERDICT),
                Ok(pb::EventType::Trace) => kinds.push(maps::EVENT_TRACE),
                _ => return Err(Status::invalid_argument(format!("types[{i}]: unknown event type {t}"))),
            }
        }
        if kinds.is_empty() {
            kinds.push(maps::EVENT_DROP);
        }
        let endpoints = r.endpoint_ids;
        let sub = self.events.subscribe(
            kinds.contains(&maps::EVENT_POLICY_VERDICT),
            kinds.contains(&maps::EVENT_TRACE),
        );
        let boot_id = self.boot_id();
        // The subscription exists: say so first, so a client knows from
        // when on events reach it.
        let subscribed = pb::MonitorEvent {
            boot_id: boot_id.clone(),
            r#type: pb::EventType::Subscribed as i32,
            ..Default::default()
        };
        // Driven by the response (no task of its own): `sub` drops, and the
        // optional events switch off, when the subscriber goes away.
        let events = futures::stream::unfold(sub, move |mut sub| {
            let (kinds, endpoints, boot_id) = (kinds.clone(), endpoints.clone(), boot_id.clone());
            async move {
                let mut lost = 0u64;
                loop {
                    let event = match sub.rx.recv().await {
                        Ok(e) => e,
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            lost += n;
                            continue;
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    };
                    if !kinds.contains(&event.kind)
                        || (!endpoints.is_empty() && !endpoints.contains(&event.endpoint_id))
                    {
                        continue;
                    }
                    return Some((Ok(event_proto(&event, &boot_id, lost)), sub));
                }
            }
        });
        Ok(Response::new(Box::pin(
            futures::stream::once(async { Ok(subscribed) }).chain(events),
        )))
    }
}

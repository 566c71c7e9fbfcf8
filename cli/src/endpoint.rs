//! `rivet endpoint list|get|label`: endpoints as svc-endpoint knows them,
//! and the pod labels of endpoints a runtime created.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use clap::{Subcommand, ValueEnum};
use rivet_common::mac::format_mac_bytes;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::net::{address_bytes, format_address};
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, age, duration, fields, now_unix_nanos, truncate};

const DAEMON: &str = "svc-endpoint";

/// Widest ERROR cell of `rivet endpoint list`.
const ERROR_WIDTH: usize = 60;

/// Characters of a container id shown where a pod name is missing.
const SHORT_CONTAINER_ID: usize = 12;

/// Interface of a `container:<id>` reference without one (the CNI default).
const DEFAULT_INTERFACE: &str = "eth0";

/// An endpoint state on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// Read from the state dir at start, not yet regenerated.
    Restoring,
    /// Waiting for svc-identity.
    WaitingForIdentity,
    /// Queued for regeneration.
    WaitingToRegenerate,
    /// Being regenerated.
    Regenerating,
    /// Regenerated; the datapath holds its policy.
    Ready,
    /// Being removed.
    Disconnecting,
    /// Removed.
    Disconnected,
}

impl From<StateArg> for pb::EndpointState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Restoring => Self::Restoring,
            StateArg::WaitingForIdentity => Self::WaitingForIdentity,
            StateArg::WaitingToRegenerate => Self::WaitingToRegenerate,
            StateArg::Regenerating => Self::Regenerating,
            StateArg::Ready => Self::Ready,
            StateArg::Disconnecting => Self::Disconnecting,
            StateArg::Disconnected => Self::Disconnected,
        }
    }
}

/// `rivet endpoint ...`
#[derive(Debug, Subcommand)]
pub enum EndpointCommand {
    /// Endpoints of the node, ordered by id.
    List {
        /// Only endpoints in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Only endpoints of pods in this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only endpoints with this identity.
        #[arg(long)]
        identity: Option<u32>,
        /// Also the recent state transitions of each endpoint.
        #[arg(long)]
        history: bool,
    },
    /// One endpoint with every field and its state history.
    Get {
        /// An endpoint id (`12`), one of its addresses (`198.18.0.5`), a pod
        /// (`namespace/name`) or a container interface
        /// (`container:<id>[/<interface>]`, interface default eth0).
        #[arg(value_name = "REF")]
        reference: EndpointRef,
    },
    /// Replace a pod's own labels (svc-endpoint's UpdateLabels): how pods a
    /// runtime created without Kubernetes get labels. Its endpoints are
    /// re-identified (and their policy recomputed) before this returns; labels
    /// of a pod without an endpoint yet are remembered for it. `--clear`
    /// removes every label of the pod.
    Label {
        /// The pod, `namespace/name` (or another endpoint reference, as for `get`).
        #[arg(value_name = "REF")]
        reference: EndpointRef,
        #[command(flatten)]
        labels: crate::namespace::NewLabels,
    },
}

/// `rivet endpoint label` output.
#[derive(Debug, Clone, Serialize)]
pub struct LabelView {
    /// The reference as given.
    reference: String,
    /// The new labels, `k8s:key=value`.
    labels: Vec<String>,
    /// Endpoints whose identity changed.
    reidentified: u32,
    /// The endpoints after the change (none: the labels wait for the pod).
    endpoints: Vec<EndpointView>,
}

fn label_text(view: &LabelView) -> String {
    let labels = if view.labels.is_empty() {
        "cleared".to_string()
    } else {
        view.labels
            .iter()
            .map(|l| l.strip_prefix("k8s:").unwrap_or(l))
            .collect::<Vec<_>>()
            .join(",")
    };
    if view.endpoints.is_empty() {
        return format!(
            "{}: labels {labels}; no endpoint yet (remembered for when the pod gets one)\n",
            view.reference
        );
    }
    let endpoints = view
        .endpoints
        .iter()
        .map(|e| format!("endpoint {} identity {}", e.id, e.identity))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "{}: labels {labels}; {endpoints} ({} re-identified)\n",
        view.reference, view.reidentified
    )
}

/// Which endpoint `rivet endpoint get` is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointRef {
    /// By id.
    Id(u32),
    /// By one of its addresses.
    Address(IpAddr),
    /// By pod (matches one endpoint only when the pod has one).
    Pod {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
    },
    /// By container id and interface inside the container.
    Container {
        /// Container id.
        container_id: String,
        /// Interface inside the container.
        interface: String,
    },
}

impl FromStr for EndpointRef {
    type Err = String;

    /// Parses `12`, `198.18.0.5`, `2001:2::5`, `namespace/name`,
    /// `container:<id>` or `container:<id>/<interface>`.
    fn from_str(s: &str) -> Result<Self, String> {
        let invalid = || {
            format!(
                "`{s}` is not an endpoint reference: give an id (12), an address (198.18.0.5), \
                 a pod (namespace/name) or container:<id>[/<interface>]"
            )
        };
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return match s.parse::<u32>() {
                Ok(0) | Err(_) => Err(format!("`{s}` is not an endpoint id (1..65535)")),
                Ok(id) => Ok(Self::Id(id)),
            };
        }
        if let Some(rest) = s.strip_prefix("container:") {
            let (container_id, interface) = rest.split_once('/').unwrap_or((rest, DEFAULT_INTERFACE));
            if container_id.is_empty() || interface.is_empty() || interface.contains('/') {
                return Err(invalid());
            }
            return Ok(Self::Container {
                container_id: container_id.to_string(),
                interface: interface.to_string(),
            });
        }
        if let Ok(address) = s.parse::<IpAddr>() {
            return Ok(Self::Address(address));
        }
        if let Some((address, _)) = s.split_once('/')
            && address.parse::<IpAddr>().is_ok()
        {
            return Err(format!("`{s}`: give the address without prefix length"));
        }
        match s.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self::Pod {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                })
            }
            _ => Err(invalid()),
        }
    }
}

impl fmt::Display for EndpointRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Id(id) => write!(f, "{id}"),
            Self::Address(a) => write!(f, "{a}"),
            Self::Pod { namespace, name } => write!(f, "{namespace}/{name}"),
            Self::Container {
                container_id,
                interface,
            } => write!(f, "container:{container_id}/{interface}"),
        }
    }
}

impl EndpointRef {
    /// The reference as the API takes it; an address as its bytes.
    pub fn to_proto(&self) -> pb::EndpointRef {
        use pb::endpoint_ref::Ref;
        pb::EndpointRef {
            r#ref: Some(match self {
                Self::Id(id) => Ref::Id(*id),
                Self::Address(a) => Ref::Address(address_bytes(*a)),
                Self::Pod { namespace, name } => Ref::Pod(pb::PodRef {
                    namespace: namespace.clone(),
                    name: name.clone(),
                }),
                Self::Container {
                    container_id,
                    interface,
                } => Ref::Container(pb::ContainerInterface {
                    container_id: container_id.clone(),
                    interface: interface.clone(),
                }),
            }),
        }
    }
}

/// The name of an endpoint state as printed (`ready`, `waiting-for-identity`);
/// `none` for unspecified (the `from` of an endpoint's first transition).
pub fn state_name(raw: i32) -> &'static str {
    match pb::EndpointState::try_from(raw) {
        Ok(pb::EndpointState::Unspecified) => "none",
        Ok(pb::EndpointState::Restoring) => "restoring",
        Ok(pb::EndpointState::WaitingForIdentity) => "waiting-for-identity",
        Ok(pb::EndpointState::WaitingToRegenerate) => "waiting-to-regenerate",
        Ok(pb::EndpointState::Regenerating) => "regenerating",
        Ok(pb::EndpointState::Ready) => "ready",
        Ok(pb::EndpointState::Disconnecting) => "disconnecting",
        Ok(pb::EndpointState::Disconnected) => "disconnected",
        _ => "unknown",
    }
}

/// The name of a regeneration step as printed; empty when unspecified.
pub fn step_name(raw: i32) -> &'static str {
    match pb::RegenerationStep::try_from(raw) {
        Ok(pb::RegenerationStep::Identity) => "identity",
        Ok(pb::RegenerationStep::Policy) => "policy",
        Ok(pb::RegenerationStep::Datapath) => "datapath",
        Ok(pb::RegenerationStep::Ipcache) => "ipcache",
        Ok(pb::RegenerationStep::StateDir) => "state-dir",
        _ => "",
    }
}

/// An endpoint address as printed.
#[derive(Debug, Clone, Serialize)]
pub struct AddressView {
    /// The address, without prefix length.
    address: String,
    /// The svc-ipam pool; empty when svc-ipam did not allocate it.
    ipam_pool: String,
}

/// A named container port as printed.
#[derive(Debug, Clone, Serialize)]
pub struct NamedPortView {
    /// Port name.
    name: String,
    /// `TCP`, `UDP` or `SCTP`.
    protocol: String,
    /// Port number.
    port: u32,
}

/// A state transition as printed.
#[derive(Debug, Clone, Serialize)]
pub struct TransitionView {
    /// State before.
    from: String,
    /// State after.
    to: String,
    /// Why.
    reason: String,
    /// When, Unix nanoseconds.
    at_unix_nanos: i64,
}

/// An endpoint as printed: every field of the API's `Endpoint`, enums as
/// names.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointView {
    /// Endpoint id.
    id: u32,
    /// Container id.
    container_id: String,
    /// Interface inside the container.
    interface: String,
    /// The container's network namespace.
    netns_path: String,
    /// Host side of the veth pair.
    host_interface: String,
    /// Its ifindex.
    host_ifindex: u32,
    /// Addresses.
    addresses: Vec<AddressView>,
    /// MAC of the container-side interface.
    mac: String,
    /// Pod namespace (empty outside Kubernetes).
    pod_namespace: String,
    /// Pod name.
    pod_name: String,
    /// Pod uid.
    pod_uid: String,
    /// The pod's own labels.
    labels: Vec<String>,
    /// The labels the identity was allocated for.
    identity_labels: Vec<String>,
    /// Identity; 0 until allocated.
    identity: u32,
    /// State name.
    state: String,
    /// Policy revision realised in the datapath.
    policy_revision: u64,
    /// Whether ingress policy is enforced.
    ingress_enforced: bool,
    /// Whether egress policy is enforced.
    egress_enforced: bool,
    /// Datapath policy entries.
    policy_entries: u32,
    /// Creation, Unix nanoseconds.
    created_unix_nanos: i64,
    /// Last successful regeneration, Unix nanoseconds; 0 before the first.
    last_regeneration_unix_nanos: i64,
    /// How long it took.
    last_regeneration_nanos: u64,
    /// Regenerations so far.
    regenerations: u64,
    /// Last regeneration failure; empty when the last attempt succeeded.
    last_error: String,
    /// The step that failed.
    last_error_step: String,
    /// When, Unix nanoseconds.
    last_error_unix_nanos: i64,
    /// Recent transitions, oldest first (`--history` for lists).
    state_history: Vec<TransitionView>,
    /// Named container ports.
    named_ports: Vec<NamedPortView>,
}

impl From<&pb::Endpoint> for EndpointView {
    fn from(e: &pb::Endpoint) -> Self {
        Self {
            id: e.id,
            container_id: e.container_id.clone(),
            interface: e.interface.clone(),
            netns_path: e.netns_path.clone(),
            host_interface: e.host_interface.clone(),
            host_ifindex: e.host_ifindex,
            addresses: e
                .addresses
                .iter()
                .map(|a| AddressView {
                    address: format_address(&a.address),
                    ipam_pool: a.ipam_pool.clone(),
                })
                .collect(),
            mac: format_mac_bytes(&e.mac),
            pod_namespace: e.pod_namespace.clone(),
            pod_name: e.pod_name.clone(),
            pod_uid: e.pod_uid.clone(),
            labels: e.labels.clone(),
            identity_labels: e.identity_labels.clone(),
            identity: e.identity,
            state: state_name(e.state).into(),
            policy_revision: e.policy_revision,
            ingress_enforced: e.ingress_enforced,
            egress_enforced: e.egress_enforced,
            policy_entries: e.policy_entries,
            created_unix_nanos: e.created_unix_nanos,
            last_regeneration_unix_nanos: e.last_regeneration_unix_nanos,
            last_regeneration_nanos: e.last_regeneration_nanos,
            regenerations: e.regenerations,
            last_error: e.last_error.clone(),
            last_error_step: step_name(e.last_error_step).into(),
            last_error_unix_nanos: e.last_error_unix_nanos,
            state_history: e
                .state_history
                .iter()
                .map(|t| TransitionView {
                    from: state_name(t.from).into(),
                    to: state_name(t.to).into(),
                    reason: t.reason.clone(),
                    at_unix_nanos: t.at_unix_nanos,
                })
                .collect(),
            named_ports: e
                .named_ports
                .iter()
                .map(|p| NamedPortView {
                    name: p.name.clone(),
                    protocol: p.protocol.clone(),
                    port: p.port,
                })
                .collect(),
        }
    }
}

impl EndpointView {
    /// `namespace/name`, or the short container id outside Kubernetes.
    fn pod(&self) -> String {
        if !self.pod_name.is_empty() {
            format!("{}/{}", self.pod_namespace, self.pod_name)
        } else if !self.container_id.is_empty() {
            self.container_id.chars().take(SHORT_CONTAINER_ID).collect()
        } else {
            "-".into()
        }
    }

    /// `r12 in+eg`: realised revision and enforced directions; `-` before any.
    fn policy(&self) -> String {
        if self.policy_revision == 0 {
            return "-".into();
        }
        let directions = match (self.ingress_enforced, self.egress_enforced) {
            (true, true) => " in+eg",
            (true, false) => " in",
            (false, true) => " eg",
            (false, false) => "",
        };
        format!("r{}{directions}", self.policy_revision)
    }

    /// `2m5s ago (35ms)`; `-` before the first regeneration.
    fn last_regeneration(&self, now: i64) -> String {
        if self.last_regeneration_unix_nanos == 0 {
            return "-".into();
        }
        format!(
            "{} ago ({})",
            age(now, self.last_regeneration_unix_nanos),
            duration(self.last_regeneration_nanos)
        )
    }

    /// `step: message` on one line; empty without an error.
    fn error(&self) -> String {
        if self.last_error.is_empty() {
            return String::new();
        }
        let message = self.last_error.split_whitespace().collect::<Vec<_>>().join(" ");
        if self.last_error_step.is_empty() {
            message
        } else {
            format!("{}: {message}", self.last_error_step)
        }
    }
}

/// `rivet endpoint list` output.
#[derive(Debug, Clone, Serialize)]
pub struct ListView {
    /// false while svc-endpoint is still restoring: endpoints may be missing.
    restore_complete: bool,
    /// Boot id of the answering svc-endpoint.
    boot_id: String,
    /// The endpoints.
    endpoints: Vec<EndpointView>,
}

fn list_table(view: &ListView, now: i64, history: bool) -> String {
    let mut t = Table::new([
        "ID",
        "POD",
        "IFACE",
        "ADDRESSES",
        "IDENTITY",
        "STATE",
        "POLICY",
        "LAST REGEN",
        "ERROR",
    ]);
    for e in &view.endpoints {
        let error = e.error();
        t.row([
            e.id.to_string(),
            e.pod(),
            e.host_interface.clone(),
            e.addresses
                .iter()
                .map(|a| a.address.as_str())
                .collect::<Vec<_>>()
                .join(","),
            if e.identity == 0 {
                "-".into()
            } else {
                e.identity.to_string()
            },
            e.state.clone(),
            e.policy(),
            e.last_regeneration(now),
            if error.is_empty() {
                "-".into()
            } else {
                truncate(&error, ERROR_WIDTH)
            },
        ]);
    }
    let mut out = t.render();
    if history {
        let mut t = Table::new(["ENDPOINT", "WHEN", "TRANSITION", "REASON"]);
        for e in &view.endpoints {
            for h in &e.state_history {
                t.row([
                    e.id.to_string(),
                    format!("{} ago", age(now, h.at_unix_nanos)),
                    format!("{} → {}", h.from, h.to),
                    h.reason.clone(),
                ]);
            }
        }
        out.push_str("\nState history (oldest first):\n");
        out.push_str(&t.render());
    }
    if !view.restore_complete {
        out.push_str("\nsvc-endpoint is still restoring endpoints: this list may be incomplete.\n");
    }
    out
}

fn endpoint_text(e: &EndpointView, now: i64) -> String {
    let lines = |items: Vec<String>| items.join("\n");
    let ago = |at: i64| {
        if at == 0 {
            String::new()
        } else {
            format!("{} ago", age(now, at))
        }
    };
    let mut out = fields([
        ("ID", e.id.to_string()),
        ("STATE", e.state.clone()),
        (
            "POD",
            if e.pod_name.is_empty() {
                String::new()
            } else {
                format!("{}/{} (uid {})", e.pod_namespace, e.pod_name, e.pod_uid)
            },
        ),
        ("CONTAINER", e.container_id.clone()),
        ("INTERFACE", e.interface.clone()),
        ("NETNS", e.netns_path.clone()),
        (
            "HOST INTERFACE",
            format!("{} (ifindex {})", e.host_interface, e.host_ifindex),
        ),
        (
            "ADDRESSES",
            lines(
                e.addresses
                    .iter()
                    .map(|a| {
                        if a.ipam_pool.is_empty() {
                            format!("{} (not from svc-ipam)", a.address)
                        } else {
                            format!("{} (pool {})", a.address, a.ipam_pool)
                        }
                    })
                    .collect(),
            ),
        ),
        ("MAC", e.mac.clone()),
        (
            "NAMED PORTS",
            lines(
                e.named_ports
                    .iter()
                    .map(|p| format!("{} {}/{}", p.name, p.port, p.protocol))
                    .collect(),
            ),
        ),
        ("LABELS", lines(e.labels.clone())),
        (
            "IDENTITY",
            if e.identity == 0 {
                "- (not allocated)".into()
            } else {
                e.identity.to_string()
            },
        ),
        ("IDENTITY LABELS", lines(e.identity_labels.clone())),
        (
            "POLICY",
            if e.policy_revision == 0 {
                "none realised".into()
            } else {
                let enforced = |on| if on { "enforced" } else { "not enforced" };
                format!(
                    "revision {}, ingress {}, egress {}, {} datapath entries",
                    e.policy_revision,
                    enforced(e.ingress_enforced),
                    enforced(e.egress_enforced),
                    e.policy_entries
                )
            },
        ),
        ("CREATED", ago(e.created_unix_nanos)),
        (
            "LAST REGENERATION",
            if e.last_regeneration_unix_nanos == 0 {
                format!("never ({} regenerations)", e.regenerations)
            } else {
                format!(
                    "{}, took {} ({} regenerations)",
                    ago(e.last_regeneration_unix_nanos),
                    duration(e.last_regeneration_nanos),
                    e.regenerations
                )
            },
        ),
        (
            "LAST ERROR",
            if e.last_error.is_empty() {
                String::new()
            } else {
                format!("{} ({})", e.error(), ago(e.last_error_unix_nanos))
            },
        ),
    ]);
    let mut t = Table::new(["WHEN", "TRANSITION", "REASON"]);
    for h in &e.state_history {
        t.row([
            format!("{} ago", age(now, h.at_unix_nanos)),
            format!("{} → {}", h.from, h.to),
            h.reason.clone(),
        ]);
    }
    out.push_str("\nState history (oldest first):\n");
    out.push_str(&t.render());
    out
}

/// Runs one `rivet endpoint` command.
pub async fn run(ctx: &Context, command: EndpointCommand) -> Result<(), CliError> {
    // Bad labels need no daemon.
    let labels = match &command {
        EndpointCommand::Label { labels, .. } => labels.parse()?,
        _ => Vec::new(),
    };
    let mut client = EndpointServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        EndpointCommand::List {
            state,
            namespace,
            identity,
            history,
        } => {
            let r = client
                .list_endpoints(ctx.request(pb::ListEndpointsRequest {
                    state: state.map_or(pb::EndpointState::Unspecified, Into::into) as i32,
                    pod_namespace: namespace.unwrap_or_default(),
                    identity: identity.unwrap_or(0),
                    include_history: history,
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let view = ListView {
                restore_complete: r.restore_complete,
                boot_id: r.boot_id,
                endpoints: r.endpoints.iter().map(Into::into).collect(),
            };
            let now = now_unix_nanos();
            ctx.print(&view, || list_table(&view, now, history));
        }
        EndpointCommand::Get { reference } => {
            let r = client
                .get_endpoint(ctx.request(pb::GetEndpointRequest {
                    r#ref: Some(reference.to_proto()),
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let Some(endpoint) = r.endpoint else {
                return Err(CliError::Rpc {
                    daemon: DAEMON,
                    code: tonic::Code::Internal,
                    message: format!("answered without an endpoint for {reference}"),
                });
            };
            let view = EndpointView::from(&endpoint);
            let now = now_unix_nanos();
            ctx.print(&view, || endpoint_text(&view, now));
        }
        EndpointCommand::Label { reference, .. } => {
            let r = client
                .update_labels(ctx.request(pb::UpdateLabelsRequest {
                    r#ref: Some(reference.to_proto()),
                    labels: labels.clone(),
                    r#async: false,
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let view = LabelView {
                reference: reference.to_string(),
                labels,
                reidentified: r.reidentified,
                endpoints: r.endpoints.iter().map(Into::into).collect(),
            };
            ctx.print(&view, || label_text(&view));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<EndpointRef, String> {
        s.parse()
    }

    #[test]
    fn refs_by_id_and_address() {
        assert_eq!(parse("12"), Ok(EndpointRef::Id(12)));
        assert_eq!(parse("65535"), Ok(EndpointRef::Id(65535)));
        assert!(parse("0").is_err());
        assert!(parse("99999999999").is_err());
        assert_eq!(
            parse("198.18.0.5"),
            Ok(EndpointRef::Address("198.18.0.5".parse().unwrap()))
        );
        // Any spelling is the same address on the wire.
        let v6 = parse("2001:2:0:0::5").unwrap();
        assert_eq!(v6, EndpointRef::Address("2001:2::5".parse().unwrap()));
        assert_eq!(
            v6.to_proto().r#ref,
            Some(pb::endpoint_ref::Ref::Address(vec![
                0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5
            ]))
        );
    }

    #[test]
    fn refs_by_pod_and_container() {
        assert_eq!(
            parse("shop/web-0"),
            Ok(EndpointRef::Pod {
                namespace: "shop".into(),
                name: "web-0".into()
            })
        );
        assert_eq!(
            parse("container:abc123"),
            Ok(EndpointRef::Container {
                container_id: "abc123".into(),
                interface: "eth0".into()
            })
        );
        let net1 = parse("container:abc123/net1").unwrap();
        assert_eq!(
            net1,
            EndpointRef::Container {
                container_id: "abc123".into(),
                interface: "net1".into()
            }
        );
        assert_eq!(net1.to_string(), "container:abc123/net1");
        assert_eq!(parse("shop/web-0").unwrap().to_string(), "shop/web-0");
    }

    #[test]
    fn bad_refs_are_refused() {
        for bad in [
            "",
            "web",
            "/web",
            "shop/",
            "a/b/c",
            "container:",
            "container:/eth0",
            "container:abc/",
            "container:abc/eth0/x",
            "198.18.0.5/24",
            "-1",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse("web").unwrap_err().contains("namespace/name"));
    }

    fn endpoint() -> pb::Endpoint {
        pb::Endpoint {
            id: 7,
            container_id: "0123456789abcdef".into(),
            host_interface: "lxc7".into(),
            addresses: vec![pb::EndpointAddress {
                address: vec![198, 18, 0, 7],
                ipam_pool: "default".into(),
            }],
            state: pb::EndpointState::Ready as i32,
            ..Default::default()
        }
    }

    #[test]
    fn list_cells() {
        let now = 1_700_000_000_000_000_000;
        let mut e = endpoint();
        let v = EndpointView::from(&e);
        assert_eq!(v.pod(), "0123456789ab");
        assert_eq!(v.policy(), "-");
        assert_eq!(v.last_regeneration(now), "-");
        assert_eq!(v.error(), "");
        assert_eq!(v.state, "ready");

        e.pod_namespace = "shop".into();
        e.pod_name = "web-0".into();
        e.policy_revision = 12;
        e.ingress_enforced = true;
        e.egress_enforced = true;
        e.last_regeneration_unix_nanos = now - 125_000_000_000;
        e.last_regeneration_nanos = 35_000_000;
        e.last_error = "attach failed:\n  no such device".into();
        e.last_error_step = pb::RegenerationStep::Datapath as i32;
        let v = EndpointView::from(&e);
        assert_eq!(v.pod(), "shop/web-0");
        assert_eq!(v.policy(), "r12 in+eg");
        assert_eq!(v.last_regeneration(now), "2m5s ago (35ms)");
        assert_eq!(v.error(), "datapath: attach failed: no such device");

        e.ingress_enforced = false;
        assert_eq!(EndpointView::from(&e).policy(), "r12 eg");
        e.egress_enforced = false;
        assert_eq!(EndpointView::from(&e).policy(), "r12");
    }

    #[test]
    fn list_table_notes_an_incomplete_restore() {
        let view = ListView {
            restore_complete: false,
            boot_id: "b".into(),
            endpoints: vec![EndpointView::from(&endpoint())],
        };
        let text = list_table(&view, 1, false);
        assert!(text.starts_with("ID  POD           IFACE  ADDRESSES   IDENTITY  STATE  POLICY  LAST REGEN  ERROR\n"));
        assert!(text.contains("7   0123456789ab  lxc7   198.18.0.7  -         ready  -       -           -\n"));
        assert!(text.contains("may be incomplete"));
    }

    #[test]
    fn state_and_step_names() {
        assert_eq!(
            state_name(pb::EndpointState::WaitingForIdentity as i32),
            "waiting-for-identity"
        );
        assert_eq!(state_name(0), "none");
        assert_eq!(state_name(99), "unknown");
        assert_eq!(step_name(pb::RegenerationStep::StateDir as i32), "state-dir");
        assert_eq!(step_name(0), "");
        assert_eq!(
            pb::EndpointState::from(StateArg::WaitingToRegenerate),
            pb::EndpointState::WaitingToRegenerate
        );
    }
}

//! `rivet node list`: the cluster's nodes as this node's svc-identity sees
//! them (`rivet.identity.v1.NodeService.ListNodes`).

use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::node_service_client::NodeServiceClient;
use rivet_proto::net::{format_address, format_prefix};
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context};

const DAEMON: &str = "svc-identity";

/// A node as printed.
#[derive(Debug, Serialize)]
pub struct NodeView {
    name: String,
    /// This node (the one answering).
    local: bool,
    addresses: Vec<String>,
    pod_cidrs: Vec<String>,
    /// `native`, `vxlan` or `none`.
    routing: String,
    tunnel_port: u32,
    health_addresses: Vec<String>,
    boot_id: String,
    /// `node` (its own record) or `operator` (rivet-operator's mirror).
    source: String,
}

/// The listing as printed with `-o json`.
#[derive(Debug, Serialize)]
pub struct NodeList {
    cluster: String,
    /// svc-identity has listed the store's records (false: this node only).
    listed: bool,
    nodes: Vec<NodeView>,
}

impl NodeView {
    fn new(n: &pb::Node) -> Self {
        Self {
            name: n.name.clone(),
            local: n.local,
            addresses: n.addresses.iter().map(|a| format_address(a)).collect(),
            pod_cidrs: n.pod_cidrs.iter().map(format_prefix).collect(),
            routing: match pb::RoutingMode::try_from(n.routing_mode).unwrap_or_default() {
                pb::RoutingMode::Native => "native",
                pb::RoutingMode::Vxlan => "vxlan",
                pb::RoutingMode::Unspecified => "none",
            }
            .into(),
            tunnel_port: n.tunnel_port,
            health_addresses: n.health_addresses.iter().map(|a| format_address(a)).collect(),
            boot_id: n.boot_id.clone(),
            source: match pb::NodeSource::try_from(n.source).unwrap_or_default() {
                pb::NodeSource::Node => "node",
                pb::NodeSource::Operator => "operator",
                pb::NodeSource::Unspecified => "-",
            }
            .into(),
        }
    }
}

/// The table: this node marked with `*`.
fn table(list: &NodeList) -> String {
    let mut t = Table::new([
        "NAME",
        "ADDRESSES",
        "POD CIDRS",
        "ROUTING",
        "HEALTH",
        "BOOT-ID",
        "SOURCE",
    ]);
    let or_dash = |v: &[String]| if v.is_empty() { "-".to_string() } else { v.join(",") };
    for n in &list.nodes {
        t.row([
            if n.local {
                format!("{} *", n.name)
            } else {
                n.name.clone()
            },
            or_dash(&n.addresses),
            or_dash(&n.pod_cidrs),
            n.routing.clone(),
            or_dash(&n.health_addresses),
            if n.boot_id.is_empty() {
                "-".into()
            } else {
                n.boot_id.clone()
            },
            n.source.clone(),
        ]);
    }
    let mut text = format!("cluster {} (* this node)\n", list.cluster);
    if !list.listed {
        text.push_str("the kvstore's node records are not listed yet: this node only\n");
    }
    text.push_str(&t.render());
    text
}

/// Runs `rivet node list`.
pub async fn list(ctx: &Context) -> Result<(), CliError> {
    let r = NodeServiceClient::new(ctx.connect(DAEMON).await?)
        .list_nodes(pb::ListNodesRequest {})
        .await
        .map_err(|s| CliError::rpc(DAEMON, s))?
        .into_inner();
    let list = NodeList {
        cluster: r.cluster.clone(),
        listed: r.listed,
        nodes: r.nodes.iter().map(NodeView::new).collect(),
    };
    ctx.print(&list, || table(&list));
    Ok(())
}

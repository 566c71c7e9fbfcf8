//! The cluster's namespaces: the underlay (a bridge) and each node's
//! namespace with its underlay veth. Made with `ip`, only inside namespaces
//! the cluster creates.

use anyhow::Result;

use super::{BRIDGE, ClusterPlan, NodePlan, UNDERLAY_INTERFACE, UNDERLAY_MTU};
use crate::{netns, node};

/// Creates the underlay namespace with its bridge, up. `created` is called
/// with the namespace's name before it is made (for cluster.json).
pub fn create_underlay(plan: &ClusterPlan, created: &mut impl FnMut(&str) -> Result<()>) -> Result<()> {
    let ns = plan.underlay_netns.as_str();
    created(ns)?;
    netns::create(ns)?;
    netns::ip(
        ns,
        &[
            "link",
            "add",
            BRIDGE,
            "mtu",
            &UNDERLAY_MTU.to_string(),
            "type",
            "bridge",
        ],
    )?;
    netns::ip(ns, &["link", "set", BRIDGE, "up"])?;
    Ok(())
}

/// Creates node `node`'s namespace as `rivet node up --create-netns` would
/// (forwarding on, DAD off), with `ul0` and its addresses, its peer on the
/// underlay bridge, everything up.
pub fn create_node(plan: &ClusterPlan, node: &NodePlan, created: &mut impl FnMut(&str) -> Result<()>) -> Result<()> {
    let ns = node.name.as_str();
    created(ns)?;
    netns::create(ns)?;
    netns::sysctls(&netns::path(ns), node::NODE_NETNS_SYSCTLS)?;
    let mtu = UNDERLAY_MTU.to_string();
    netns::ip(
        ns,
        &[
            "link",
            "add",
            UNDERLAY_INTERFACE,
            "mtu",
            &mtu,
            "type",
            "veth",
            "peer",
            "name",
            &node.bridge_port,
            "mtu",
            &mtu,
            "netns",
            &plan.underlay_netns,
        ],
    )?;
    netns::ip(
        &plan.underlay_netns,
        &["link", "set", &node.bridge_port, "master", BRIDGE, "up"],
    )?;
    let [v4, v6] = node.underlay_cidrs();
    netns::ip(ns, &["addr", "add", &v4, "dev", UNDERLAY_INTERFACE])?;
    netns::ip(ns, &["-6", "addr", "add", &v6, "dev", UNDERLAY_INTERFACE, "nodad"])?;
    netns::ip(ns, &["link", "set", UNDERLAY_INTERFACE, "up"])?;
    Ok(())
}

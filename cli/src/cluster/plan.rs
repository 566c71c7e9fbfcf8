//! The cluster plan: every name and address of a simulated cluster, from
//! its name, size and routing mode (no I/O).
//!
//! The address plan is the cluster convention of issue 16: node `i`
//! (1-based) is namespace and node `<cluster>-n<i>`, its underlay veth `ul0`
//! holds 198.19.254.`i`/24 and 2001:2:0:fe::`i`/64, its pods get
//! 198.18.`i`.0/24 and 2001:2:0:`i`::/64; the underlay namespace
//! `<cluster>-ul` holds the bridge `ul` and the peer ends `n<i>`.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// Most nodes of one cluster (the last octet of the underlay /24, and the
/// third octet of the pod /24s, minus the network and broadcast values).
pub const MAX_NODES: usize = 253;

/// Longest cluster name: `<cluster>-ul` and `<cluster>-n<i>` stay short
/// enough to read, and a pod namespace `rivet-pod-<node>-<ns>-<pod>` fits
/// the 64 characters of a namespace name with ordinary pod names.
pub const MAX_NAME: usize = 16;

/// Name of the bridge in the underlay namespace.
pub const BRIDGE: &str = "ul";

/// Name of each node's underlay interface (in the node namespace).
pub const UNDERLAY_INTERFACE: &str = "ul0";

/// MTU of the underlay links.
pub const UNDERLAY_MTU: u32 = 1500;

/// The IPAM pool of every node.
pub const POOL: &str = "default";

/// How pod traffic crosses nodes: one choice for the whole cluster (`rivet
/// node up --routing`'s).
pub use crate::node::RoutingMode as Routing;

/// One node of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePlan {
    /// 1-based position in the cluster.
    pub index: usize,
    /// Node name, also its namespace's name.
    pub name: String,
    /// Underlay IPv4 address (on `ul0`, prefix length 24).
    pub underlay_v4: Ipv4Addr,
    /// Underlay IPv6 address (on `ul0`, prefix length 64).
    pub underlay_v6: Ipv6Addr,
    /// The peer end of `ul0` in the underlay namespace, on the bridge.
    pub bridge_port: String,
    /// IPv4 pod CIDR (`198.18.<i>.0/24`).
    pub pod_cidr_v4: String,
    /// IPv6 pod CIDR (`2001:2:0:<i>::/64`).
    pub pod_cidr_v6: String,
}

impl NodePlan {
    /// svc-ipam's pool, as `rivet node up --pool` takes it.
    pub fn pool(&self) -> String {
        format!("{POOL}={},{}", self.pod_cidr_v4, self.pod_cidr_v6)
    }

    /// The underlay addresses with their prefix lengths, as `ip addr add` takes them.
    pub fn underlay_cidrs(&self) -> [String; 2] {
        [format!("{}/24", self.underlay_v4), format!("{}/64", self.underlay_v6)]
    }
}

/// The names and addresses of a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPlan {
    /// Cluster name (`--cluster-name` of every node).
    pub name: String,
    /// Routing mode of every node.
    pub routing: Routing,
    /// The underlay namespace (`<cluster>-ul`).
    pub underlay_netns: String,
    /// The nodes, in order.
    pub nodes: Vec<NodePlan>,
}

impl ClusterPlan {
    /// The plan of cluster `name` with `nodes` nodes.
    ///
    /// ```
    /// use rivet_cli::cluster::{ClusterPlan, Routing};
    /// let plan = ClusterPlan::new("rivet", 3, Routing::Vxlan).unwrap();
    /// assert_eq!(plan.underlay_netns, "rivet-ul");
    /// assert_eq!(plan.nodes[1].name, "rivet-n2");
    /// assert_eq!(plan.nodes[1].pool(), "default=198.18.2.0/24,2001:2:0:2::/64");
    /// assert_eq!(plan.nodes[2].underlay_v4.to_string(), "198.19.254.3");
    /// ```
    pub fn new(name: &str, nodes: usize, routing: Routing) -> Result<Self> {
        check_name(name)?;
        if nodes == 0 || nodes > MAX_NODES {
            bail!("--nodes must be 1 to {MAX_NODES} (the address plan gives each node one /24), not {nodes}");
        }
        let nodes = (1..=nodes)
            .map(|i| {
                let octet = u8::try_from(i).expect("at most MAX_NODES nodes");
                NodePlan {
                    index: i,
                    name: format!("{name}-n{i}"),
                    underlay_v4: Ipv4Addr::new(198, 19, 254, octet),
                    underlay_v6: Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, u16::from(octet)),
                    bridge_port: format!("n{i}"),
                    pod_cidr_v4: format!("198.18.{i}.0/24"),
                    pod_cidr_v6: format!("2001:2:0:{i:x}::/64"),
                }
            })
            .collect();
        Ok(Self {
            name: name.to_string(),
            routing,
            underlay_netns: format!("{name}-ul"),
            nodes,
        })
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&NodePlan> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

/// Checks a cluster name: 1 to [`MAX_NAME`] of `[a-z0-9-]`, starting with a
/// letter, not ending with `-` (it prefixes node and namespace names, and
/// node names are DNS labels).
///
/// ```
/// assert!(rivet_cli::cluster::check_name("rivet").is_ok());
/// assert!(rivet_cli::cluster::check_name("Rivet").is_err());
/// ```
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !ok {
        bail!(
            "`{name}` is not a usable cluster name: 1 to {MAX_NAME} of a-z 0-9 -, starting with a letter \
             (it prefixes the node and namespace names)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_plan_of_the_convention() {
        let plan = ClusterPlan::new("c", 12, Routing::Native).unwrap();
        let n12 = &plan.nodes[11];
        assert_eq!(n12.index, 12);
        assert_eq!(n12.name, "c-n12");
        assert_eq!(n12.underlay_cidrs(), ["198.19.254.12/24", "2001:2:0:fe::c/64"]);
        assert_eq!(n12.pod_cidr_v4, "198.18.12.0/24");
        // The IPv6 pod CIDR's fourth group is the index, written in hex.
        assert_eq!(n12.pod_cidr_v6, "2001:2:0:c::/64");
        assert_eq!(n12.bridge_port, "n12");
        assert_eq!(plan.node("c-n12"), Some(n12));
        assert_eq!(plan.node("c-n13"), None);
        // Every generated interface name fits the kernel's 15 bytes.
        let last = &ClusterPlan::new("c", MAX_NODES, Routing::Native).unwrap().nodes[MAX_NODES - 1];
        assert!(last.bridge_port.len() <= 15 && last.underlay_v4 == Ipv4Addr::new(198, 19, 254, 253));
    }

    #[test]
    fn sizes_and_names_are_checked() {
        assert!(ClusterPlan::new("c", 0, Routing::Native).is_err());
        assert!(ClusterPlan::new("c", MAX_NODES + 1, Routing::Native).is_err());
        for bad in ["", "1abc", "a_b", "abc-", "a".repeat(MAX_NAME + 1).as_str()] {
            assert!(check_name(bad).is_err(), "{bad:?} is refused");
        }
        assert!(check_name("rt-123x4").is_ok());
    }
}

//! Reaching the other nodes of the cluster (multi-node): the routing mode
//! chosen by the node's operator (flags, never clients), the peer nodes
//! svc-identity pushes (`NodeRoutingService.ReplaceNodes`) and the routes to
//! their pod CIDRs, realised level-triggered in the loader's namespace.
//!
//! - native: one route per peer pod CIDR `via <peer underlay address> dev
//!   <underlay>`, of the CIDR's family; an IPv4 CIDR of a peer without an
//!   IPv4 underlay address goes via its IPv6 one (RFC 5549, `via inet6`);
//!   an IPv6 CIDR needs an IPv6 underlay address (Linux has no IPv6 route
//!   via an IPv4 gateway): validation refuses it.
//! - vxlan: one route per peer pod CIDR `dev rivet_vxlan` (the
//!   collect-metadata device, see [`netlink::ensure_vxlan`]): pod traffic is
//!   redirected to it by the datapath, node-originated traffic gets there by
//!   these routes and its tunnel key from `to_overlay`.
//!
//! Every route carries [`ROUTE_PROTOCOL`]: a resync finds exactly the
//! routes it owns (those of peers that left go), and nothing else in the
//! namespace is touched. Peers are held in memory only; a restarted loader
//! keeps the routes in place until svc-identity pushes the set again (it
//! does when the loader's boot id changes).
//!
//! The kernel deletes a route whose device goes down, and anyone may delete
//! one of ours: [`resync`] realises the held peers' routes again on every
//! link or route change (rtnetlink notifications) and periodically
//! ([`NodeRouting::resync`]). A route that cannot be added while its device
//! is down is deferred, not an error: the link coming up brings a pass.

pub mod netlink;
pub mod resync;
pub mod service;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use std::sync::{Mutex, MutexGuard, PoisonError};

use ipnet::IpNet;

/// Name of the VXLAN device in vxlan mode.
pub const TUNNEL_INTERFACE: &str = "rivet_vxlan";

/// Default UDP port of the tunnel (Cilium's, the Linux VXLAN default).
pub const DEFAULT_TUNNEL_PORT: u16 = 8472;

/// Bytes VXLAN over IPv4 adds to a packet: outer IPv4 (20), UDP (8), VXLAN
/// (8) and the inner Ethernet header (14). Pod MTU = underlay MTU − this.
pub const VXLAN_OVERHEAD: u32 = 50;

/// `rtm_protocol` of Rivet's routes to peers: unassigned in
/// `linux/rtnetlink.h` and iproute2's `rt_protos` (`ip route show proto 77`).
pub const ROUTE_PROTOCOL: u8 = 77;

/// Most peers a `ReplaceNodes` may carry.
pub const MAX_PEERS: usize = 8192;

/// Most pod CIDRs per peer.
pub const MAX_POD_CIDRS: usize = 8;

/// How pod traffic crosses nodes; one choice for the whole cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingMode {
    /// Single node: no peers, no routes, no tunnel (the default).
    None,
    /// Peer pod CIDRs routed via the peers' underlay addresses.
    Native,
    /// A collect-metadata VXLAN device; the source identity rides in the VNI.
    Vxlan,
}

impl RoutingMode {
    /// The name used in flags and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Native => "native",
            Self::Vxlan => "vxlan",
        }
    }
}

/// Another node of the cluster, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerNode {
    /// DNS-1123 subdomain.
    pub name: String,
    /// Underlay IPv4 address (the tunnel endpoint in vxlan mode).
    pub underlay_ipv4: Option<Ipv4Addr>,
    /// Underlay IPv6 address.
    pub underlay_ipv6: Option<Ipv6Addr>,
    /// Its pod CIDRs (canonical, not overlapping any other peer's).
    pub pod_cidrs: Vec<IpNet>,
}

/// A route to a peer's pod CIDR, as Rivet installs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerRoute {
    /// The peer's pod CIDR.
    pub destination: IpNet,
    /// Next hop (native: the peer's underlay address, possibly of the other
    /// family); none for a device route (vxlan).
    pub gateway: Option<IpAddr>,
    /// Output interface.
    pub ifindex: u32,
    /// Preferred source of node-originated traffic (vxlan: the node's
    /// underlay address of the family, so replies come back over the
    /// underlay to an address the peers know).
    pub source: Option<IpAddr>,
}

/// The interfaces of the node's routing mode, resolved at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingSetup {
    /// The mode.
    pub mode: RoutingMode,
    /// The underlay interface (name, ifindex); none in mode none.
    pub underlay: Option<(String, u32)>,
    /// The tunnel device's ifindex (vxlan mode).
    pub tunnel_ifindex: Option<u32>,
    /// UDP port of the tunnel.
    pub tunnel_port: u16,
    /// The underlay's first global addresses at start: the preferred
    /// sources of the routes through the tunnel.
    pub underlay_addresses: (Option<Ipv4Addr>, Option<Ipv6Addr>),
}

/// The routes Rivet owns in the namespace: [`netlink::NetlinkRoutes`] in
/// the daemon, a fake in unit tests.
pub trait RouteTable: Send + Sync {
    /// Every route carrying [`ROUTE_PROTOCOL`] in the main table.
    fn owned_routes(&self) -> io::Result<Vec<PeerRoute>>;
    /// Adds `route`, replacing a route of ours to the same destination.
    fn replace(&self, route: &PeerRoute) -> io::Result<()>;
    /// Deletes `route`; one already gone is not an error.
    fn delete(&self, route: &PeerRoute) -> io::Result<()>;
}

/// Why realising the peers failed.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// The loader runs without a routing mode.
    #[error("the loader runs without a routing mode (--routing-mode none): it holds no peer nodes")]
    Disabled,
    /// A netlink request failed.
    #[error("{action} (route {route}): {source}")]
    Route {
        /// What was being done.
        action: &'static str,
        /// The route, as text.
        route: String,
        /// The error.
        source: io::Error,
    },
    /// Listing the routes failed.
    #[error("listing the routes of protocol {ROUTE_PROTOCOL}: {0}")]
    List(#[source] io::Error),
}

impl RoutingError {
    /// The error's kind, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Route { action, .. } if *action == ADDING => "add",
            Self::Route { .. } => "delete",
            Self::List(_) => "list",
        }
    }
}

const ADDING: &str = "adding a route to a peer's pod CIDR";
const DELETING: &str = "deleting the route to a pod CIDR no peer has";

/// Whether adding a route failed only because its device (or the way to
/// its gateway) is down: the link coming up brings another pass.
fn device_down(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENETDOWN | libc::ENETUNREACH | libc::EHOSTUNREACH)
    )
}

/// What a [`NodeRouting::replace_nodes`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteChanges {
    /// Routes added (or changed next hop).
    pub added: u32,
    /// Routes removed.
    pub removed: u32,
    /// Routes already as wanted.
    pub unchanged: u32,
    /// Routes that could not be added because their device is down
    /// (ENETDOWN, ENETUNREACH): added by a later pass.
    pub deferred: u32,
}

/// What [`NodeRouting::status`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingStatus {
    /// The peers held, by name.
    pub peers: Vec<PeerNode>,
    /// Routes of ours in the namespace.
    pub routes: u32,
}

/// Resolves the interfaces of `mode` in this namespace: the underlay must
/// exist; in vxlan mode the tunnel device is adopted or created
/// ([`netlink::ensure_vxlan`]). Mode none needs nothing.
pub fn setup(
    mode: RoutingMode,
    underlay_interface: Option<&str>,
    tunnel_port: u16,
) -> Result<(RoutingSetup, Option<netlink::TunnelDevice>), SetupError> {
    let mut setup = RoutingSetup {
        mode,
        underlay: None,
        tunnel_ifindex: None,
        tunnel_port,
        underlay_addresses: (None, None),
    };
    if mode == RoutingMode::None {
        if let Some(name) = underlay_interface {
            tracing::warn!(
                underlay = name,
                "--underlay-interface is ignored with --routing-mode none (single node)"
            );
        }
        return Ok((setup, None));
    }
    let name = underlay_interface.ok_or(SetupError::NoUnderlay { mode: mode.as_str() })?;
    let ifindex = crate::netdev::name_to_ifindex(name)
        .map_err(|source| SetupError::Interface {
            name: name.to_owned(),
            source,
        })?
        .ok_or_else(|| SetupError::UnderlayMissing { name: name.to_owned() })?;
    setup.underlay = Some((name.to_owned(), ifindex));
    if mode != RoutingMode::Vxlan {
        return Ok((setup, None));
    }
    setup.underlay_addresses = netlink::global_addresses(ifindex).map_err(|source| SetupError::Interface {
        name: name.to_owned(),
        source,
    })?;
    let underlay_mtu = netlink::link_facts(ifindex)
        .map_err(|source| SetupError::Interface {
            name: name.to_owned(),
            source,
        })?
        .mtu;
    let tunnel =
        netlink::ensure_vxlan(TUNNEL_INTERFACE, tunnel_port, underlay_mtu).map_err(|source| SetupError::Interface {
            name: TUNNEL_INTERFACE.to_owned(),
            source,
        })?;
    setup.tunnel_ifindex = Some(tunnel.ifindex);
    Ok((setup, Some(tunnel)))
}

/// The datapath's view of `setup` (the `routing` map), with the tunnel
/// device's MTU.
pub fn datapath_config(setup: &RoutingSetup, tunnel_mtu: Option<u32>) -> rivet_datapath::maps::RoutingConfig {
    use rivet_datapath::maps::{ROUTING_NATIVE, ROUTING_NONE, ROUTING_VXLAN};
    rivet_datapath::maps::RoutingConfig {
        mode: match setup.mode {
            RoutingMode::None => ROUTING_NONE,
            RoutingMode::Native => ROUTING_NATIVE,
            RoutingMode::Vxlan => ROUTING_VXLAN,
        },
        tunnel_ifindex: setup.tunnel_ifindex.unwrap_or(0),
        tunnel_mtu: tunnel_mtu.unwrap_or(0),
        underlay_ifindex: setup.underlay.as_ref().map_or(0, |(_, ifindex)| *ifindex),
    }
}

/// Why the routing mode could not be set up at start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Native and vxlan need `--underlay-interface`.
    #[error("--routing-mode {mode} needs --underlay-interface")]
    NoUnderlay {
        /// The mode.
        mode: &'static str,
    },
    /// The underlay interface does not exist in the loader's namespace.
    #[error("the underlay interface {name} does not exist in the loader's network namespace")]
    UnderlayMissing {
        /// Its name.
        name: String,
    },
    /// A `--nodeport-interface` does not exist in the loader's namespace.
    #[error("the NodePort interface {name} (--nodeport-interface) does not exist in the loader's network namespace")]
    NodePortInterfaceMissing {
        /// Its name.
        name: String,
    },
    /// Querying or creating an interface failed.
    #[error("setting up interface {name}: {source}")]
    Interface {
        /// Its name.
        name: String,
        /// The error.
        source: io::Error,
    },
}

/// The node's external interfaces, where NodePort services are served
/// (`from_netdev` / `to_netdev`): the underlay of a routing mode, then
/// every `nodeport_interfaces` name (the operator's `--nodeport-interface`
/// flags), each once, as (name, ifindex). Each must exist.
pub fn nodeport_interfaces(
    setup: &RoutingSetup,
    nodeport_interfaces: &[String],
) -> Result<Vec<(String, u32)>, SetupError> {
    let mut found: Vec<(String, u32)> = setup.underlay.iter().cloned().collect();
    for name in nodeport_interfaces {
        let ifindex = crate::netdev::name_to_ifindex(name)
            .map_err(|source| SetupError::Interface {
                name: name.clone(),
                source,
            })?
            .ok_or_else(|| SetupError::NodePortInterfaceMissing { name: name.clone() })?;
        if !found.iter().any(|(_, i)| *i == ifindex) {
            found.push((name.clone(), ifindex));
        }
    }
    Ok(found)
}

/// The peers of this node and their routes.
pub struct NodeRouting {
    setup: RoutingSetup,
    routes: Box<dyn RouteTable>,
    /// Held for a whole replace or resync: passes realise one after the
    /// other. None until the first `ReplaceNodes` (a restarted loader keeps
    /// the routes it finds until then).
    peers: Mutex<Option<Vec<PeerNode>>>,
}

impl std::fmt::Debug for NodeRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRouting")
            .field("setup", &self.setup)
            .finish_non_exhaustive()
    }
}

impl NodeRouting {
    /// Routing for `setup`, installing routes through `routes`.
    pub fn new(setup: RoutingSetup, routes: Box<dyn RouteTable>) -> Self {
        Self {
            setup,
            routes,
            peers: Mutex::new(None),
        }
    }

    fn held(&self) -> MutexGuard<'_, Option<Vec<PeerNode>>> {
        // A panic while holding it leaves the last set, not broken data.
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The mode and interfaces.
    pub fn setup(&self) -> &RoutingSetup {
        &self.setup
    }

    /// The routes `peers` need in this mode, by destination.
    pub fn desired_routes(&self, peers: &[PeerNode]) -> Result<BTreeMap<IpNet, PeerRoute>, RoutingError> {
        let mut routes = BTreeMap::new();
        let Some((_, underlay)) = &self.setup.underlay else {
            return Err(RoutingError::Disabled);
        };
        for peer in peers {
            for cidr in &peer.pod_cidrs {
                let route = match (self.setup.mode, self.setup.tunnel_ifindex) {
                    (RoutingMode::Vxlan, Some(tunnel)) => PeerRoute {
                        destination: *cidr,
                        gateway: None,
                        ifindex: tunnel,
                        source: match cidr {
                            IpNet::V4(_) => self.setup.underlay_addresses.0.map(IpAddr::V4),
                            IpNet::V6(_) => self.setup.underlay_addresses.1.map(IpAddr::V6),
                        },
                    },
                    (RoutingMode::Native, _) => {
                        let gateway = match cidr {
                            IpNet::V4(_) => peer
                                .underlay_ipv4
                                .map(IpAddr::V4)
                                .or(peer.underlay_ipv6.map(IpAddr::V6)),
                            IpNet::V6(_) => peer.underlay_ipv6.map(IpAddr::V6),
                        };
                        // Validation guarantees a gateway; a CIDR without one
                        // gets no route rather than a wrong one.
                        let Some(gateway) = gateway else { continue };
                        PeerRoute {
                            destination: *cidr,
                            gateway: Some(gateway),
                            ifindex: *underlay,
                            source: None,
                        }
                    }
                    _ => return Err(RoutingError::Disabled),
                };
                routes.insert(*cidr, route);
            }
        }
        Ok(routes)
    }

    /// Replaces the set of peers and realises their routes: adds (or
    /// replaces) the missing ones first, then deletes the routes of ours
    /// to destinations no peer has. Idempotent. A route whose device is
    /// down is deferred ([`RouteChanges::deferred`]) to a [`resync`](Self::resync).
    pub fn replace_nodes(&self, mut peers: Vec<PeerNode>) -> Result<RouteChanges, RoutingError> {
        peers.sort_by(|a, b| a.name.cmp(&b.name));
        let desired = self.desired_routes(&peers)?;
        let mut held = self.held();
        let changes = self.realise(&desired)?;
        *held = Some(peers);
        Ok(changes)
    }

    /// Realises the held peers' routes again (routes the kernel removed
    /// with a device that went down, or someone deleted). None before the
    /// first [`replace_nodes`](Self::replace_nodes): nothing is held yet.
    pub fn resync(&self) -> Result<Option<RouteChanges>, RoutingError> {
        let held = self.held();
        let Some(peers) = held.as_ref() else {
            return Ok(None);
        };
        let desired = self.desired_routes(peers)?;
        self.realise(&desired).map(Some)
    }

    /// Deletes every route of ours and forgets the peers (the loader's
    /// uninstall on a node without endpoints; a resync then does nothing).
    pub fn remove_all(&self) -> Result<RouteChanges, RoutingError> {
        let mut held = self.held();
        let changes = self.realise(&BTreeMap::new())?;
        *held = None;
        Ok(changes)
    }

    /// Makes the routes of ours equal to `desired`; the caller holds the lock.
    fn realise(&self, desired: &BTreeMap<IpNet, PeerRoute>) -> Result<RouteChanges, RoutingError> {
        let existing: BTreeSet<PeerRoute> = self
            .routes
            .owned_routes()
            .map_err(RoutingError::List)?
            .into_iter()
            .collect();
        let mut changes = RouteChanges::default();
        for route in desired.values() {
            if existing.contains(route) {
                changes.unchanged += 1;
                continue;
            }
            match self.routes.replace(route) {
                Ok(()) => changes.added += 1,
                Err(e) if device_down(&e) => {
                    tracing::debug!(route = %describe(route), error = %e, "route deferred until its device is up");
                    changes.deferred += 1;
                }
                Err(source) => {
                    return Err(RoutingError::Route {
                        action: ADDING,
                        route: describe(route),
                        source,
                    });
                }
            }
        }
        for route in existing.iter().filter(|r| !desired.contains_key(&r.destination)) {
            self.routes.delete(route).map_err(|source| RoutingError::Route {
                action: DELETING,
                route: describe(route),
                source,
            })?;
            changes.removed += 1;
        }
        Ok(changes)
    }

    /// The peers held and the routes of ours in the namespace.
    pub fn status(&self) -> Result<RoutingStatus, RoutingError> {
        let peers = self.held().clone().unwrap_or_default();
        let routes = self.routes.owned_routes().map_err(RoutingError::List)?.len() as u32;
        Ok(RoutingStatus { peers, routes })
    }
}

/// A route as `ip route` would show it.
pub fn describe(route: &PeerRoute) -> String {
    let mut text = match route.gateway {
        Some(gw) => format!("{} via {gw} ifindex {}", route.destination, route.ifindex),
        None => format!("{} ifindex {}", route.destination, route.ifindex),
    };
    if let Some(source) = route.source {
        text.push_str(&format!(" src {source}"));
    }
    text
}

#[cfg(test)]
mod tests;

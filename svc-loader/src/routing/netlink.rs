//! The routes and the tunnel device over rtnetlink, in the calling thread's
//! network namespace (the loader runs in the node's).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use netlink_packet_core::{NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use netlink_packet_route::link::{InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType, RouteVia,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::{PeerRoute, ROUTE_PROTOCOL, RouteTable, VXLAN_OVERHEAD};
use crate::rtnl::request;

/// [`RouteTable`] over rtnetlink: the main table of the namespace.
#[derive(Clone, Copy, Debug, Default)]
pub struct NetlinkRoutes;

impl RouteTable for NetlinkRoutes {
    fn owned_routes(&self) -> io::Result<Vec<PeerRoute>> {
        let mut routes = Vec::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RouteMessage::default();
            msg.header.address_family = family;
            for reply in request(RouteNetlinkMessage::GetRoute(msg), NLM_F_DUMP)? {
                if let RouteNetlinkMessage::NewRoute(msg) = reply
                    && let Some(route) = owned_route(&msg)
                {
                    routes.push(route);
                }
            }
        }
        Ok(routes)
    }

    fn replace(&self, route: &PeerRoute) -> io::Result<()> {
        request(
            RouteNetlinkMessage::NewRoute(route_message(route)),
            NLM_F_CREATE | NLM_F_REPLACE,
        )
        .map(drop)
    }

    fn delete(&self, route: &PeerRoute) -> io::Result<()> {
        match request(RouteNetlinkMessage::DelRoute(route_message(route)), 0) {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            other => other.map(drop),
        }
    }
}

fn route_address(a: IpAddr) -> RouteAddress {
    match a {
        IpAddr::V4(a) => RouteAddress::Inet(a),
        IpAddr::V6(a) => RouteAddress::Inet6(a),
    }
}

fn route_message(route: &PeerRoute) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = match route.destination {
        IpNet::V4(_) => AddressFamily::Inet,
        IpNet::V6(_) => AddressFamily::Inet6,
    };
    msg.header.destination_prefix_length = route.destination.prefix_len();
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::from(ROUTE_PROTOCOL);
    msg.header.kind = RouteType::Unicast;
    msg.header.scope = if route.gateway.is_some() {
        RouteScope::Universe
    } else {
        RouteScope::Link
    };
    msg.attributes
        .push(RouteAttribute::Destination(route_address(route.destination.network())));
    match (route.destination, route.gateway) {
        (_, None) => {}
        (IpNet::V4(_), Some(gw @ IpAddr::V4(_))) | (IpNet::V6(_), Some(gw @ IpAddr::V6(_))) => {
            msg.attributes.push(RouteAttribute::Gateway(route_address(gw)));
        }
        // RFC 5549: a next hop of the other family.
        (_, Some(IpAddr::V6(gw))) => msg.attributes.push(RouteAttribute::Via(RouteVia::Inet6(gw))),
        (_, Some(IpAddr::V4(gw))) => msg.attributes.push(RouteAttribute::Via(RouteVia::Inet(gw))),
    }
    if let Some(source) = route.source {
        msg.attributes.push(RouteAttribute::PrefSource(route_address(source)));
    }
    msg.attributes.push(RouteAttribute::Oif(route.ifindex));
    msg
}

/// A route of the dump, if it is ours (protocol, main table, one next hop).
fn owned_route(msg: &RouteMessage) -> Option<PeerRoute> {
    if msg.header.protocol != RouteProtocol::from(ROUTE_PROTOCOL) {
        return None;
    }
    let mut table = u32::from(msg.header.table);
    let (mut destination, mut gateway, mut ifindex, mut source) = (None, None, None, None);
    for attribute in &msg.attributes {
        match attribute {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(a)) => destination = Some(IpAddr::V4(*a)),
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => destination = Some(IpAddr::V6(*a)),
            RouteAttribute::Gateway(RouteAddress::Inet(a)) | RouteAttribute::Via(RouteVia::Inet(a)) => {
                gateway = Some(IpAddr::V4(*a))
            }
            RouteAttribute::Gateway(RouteAddress::Inet6(a)) | RouteAttribute::Via(RouteVia::Inet6(a)) => {
                gateway = Some(IpAddr::V6(*a))
            }
            RouteAttribute::Oif(i) => ifindex = Some(*i),
            RouteAttribute::PrefSource(RouteAddress::Inet(a)) => source = Some(IpAddr::V4(*a)),
            RouteAttribute::PrefSource(RouteAddress::Inet6(a)) => source = Some(IpAddr::V6(*a)),
            _ => {}
        }
    }
    if table != u32::from(RouteHeader::RT_TABLE_MAIN) {
        return None;
    }
    let destination = IpNet::new(destination?, msg.header.destination_prefix_length).ok()?;
    Some(PeerRoute {
        destination,
        gateway,
        ifindex: ifindex?,
        source,
    })
}

/// The first global IPv4 and IPv6 addresses of interface `ifindex`.
pub fn global_addresses(ifindex: u32) -> io::Result<(Option<Ipv4Addr>, Option<Ipv6Addr>)> {
    let (mut v4, mut v6) = (None, None);
    for reply in request(RouteNetlinkMessage::GetAddress(AddressMessage::default()), NLM_F_DUMP)? {
        let RouteNetlinkMessage::NewAddress(msg) = reply else {
            continue;
        };
        if msg.header.index != ifindex || msg.header.scope != AddressScope::Universe {
            continue;
        }
        for attribute in &msg.attributes {
            match attribute {
                AddressAttribute::Address(IpAddr::V4(a)) if v4.is_none() => v4 = Some(*a),
                AddressAttribute::Address(IpAddr::V6(a)) if v6.is_none() => v6 = Some(*a),
                _ => {}
            }
        }
    }
    Ok((v4, v6))
}

/// What the kernel says about one interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkFacts {
    /// Its MTU.
    pub mtu: u32,
    /// Up (administratively).
    pub up: bool,
    /// Its kind (`vxlan`, `veth`, …), if it has one.
    pub kind: Option<String>,
    /// A VXLAN device in collect-metadata (`external`) mode.
    pub collect_metadata: bool,
    /// The VXLAN device's UDP port.
    pub vxlan_port: Option<u16>,
}

/// The facts of interface `ifindex`.
pub fn link_facts(ifindex: u32) -> io::Result<LinkFacts> {
    let mut msg = LinkMessage::default();
    msg.header.index = ifindex;
    let replies = request(RouteNetlinkMessage::GetLink(msg), 0)?;
    let Some(RouteNetlinkMessage::NewLink(link)) = replies.into_iter().next() else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no link message for ifindex {ifindex}"),
        ));
    };
    let mut facts = LinkFacts {
        up: link.header.flags.contains(LinkFlags::Up),
        ..LinkFacts::default()
    };
    for attribute in &link.attributes {
        match attribute {
            LinkAttribute::Mtu(mtu) => facts.mtu = *mtu,
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    match info {
                        LinkInfo::Kind(kind) => facts.kind = Some(kind.to_string()),
                        LinkInfo::Data(InfoData::Vxlan(options)) => {
                            for option in options {
                                match option {
                                    InfoVxlan::CollectMetadata(on) => facts.collect_metadata = *on,
                                    InfoVxlan::Port(port) => facts.vxlan_port = Some(*port),
                                    _ => {}
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(facts)
}

/// The tunnel device as [`ensure_vxlan`] found or made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TunnelDevice {
    /// Its ifindex.
    pub ifindex: u32,
    /// Its MTU.
    pub mtu: u32,
    /// Created now (false: adopted as it was).
    pub created: bool,
}

/// The collect-metadata VXLAN device `name` on UDP `port`: adopted as it is
/// when it exists (never deleted or recreated: pods' traffic runs through
/// it), else created with MTU `underlay_mtu − 50`, no learning, no ARP
/// (neighbours through it resolve to its own address: the datapath rewrites
/// the inner Ethernet header on receive), and up. An interface of that name
/// that is not a collect-metadata VXLAN device on `port` is an error.
pub fn ensure_vxlan(name: &str, port: u16, underlay_mtu: u32) -> io::Result<TunnelDevice> {
    if let Some(ifindex) = crate::netdev::name_to_ifindex(name)? {
        let facts = link_facts(ifindex)?;
        if facts.kind.as_deref() != Some("vxlan") || !facts.collect_metadata || facts.vxlan_port != Some(port) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "interface {name} exists but is not a collect-metadata VXLAN device on UDP port {port} \
                     (kind {:?}, external {}, port {:?}); delete it or change --tunnel-port",
                    facts.kind, facts.collect_metadata, facts.vxlan_port
                ),
            ));
        }
        if !facts.up {
            set_up(ifindex)?;
        }
        return Ok(TunnelDevice {
            ifindex,
            mtu: facts.mtu,
            created: false,
        });
    }
    let mtu = underlay_mtu.saturating_sub(VXLAN_OVERHEAD);
    let mut msg = LinkMessage::default();
    msg.header.flags = LinkFlags::Up | LinkFlags::Noarp;
    msg.header.change_mask = LinkFlags::Up | LinkFlags::Noarp;
    msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
    msg.attributes.push(LinkAttribute::Mtu(mtu));
    msg.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Vxlan),
        LinkInfo::Data(InfoData::Vxlan(vec![
            InfoVxlan::CollectMetadata(true),
            InfoVxlan::Port(port),
            InfoVxlan::Learning(false),
        ])),
    ]));
    request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL)
        .map_err(|e| io::Error::new(e.kind(), format!("creating VXLAN device {name}: {e}")))?;
    let ifindex = crate::netdev::name_to_ifindex(name)?.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("VXLAN device {name} vanished after its creation"),
        )
    })?;
    if !link_facts(ifindex)?.up {
        set_up(ifindex)?;
    }
    Ok(TunnelDevice {
        ifindex,
        mtu,
        created: true,
    })
}

/// Deletes interface `name` (the tunnel device at uninstall); `Ok(false)`
/// if there is none.
pub fn delete_link(name: &str) -> io::Result<bool> {
    let Some(ifindex) = crate::netdev::name_to_ifindex(name)? else {
        return Ok(false);
    };
    let mut msg = LinkMessage::default();
    msg.header.index = ifindex;
    match request(RouteNetlinkMessage::DelLink(msg), 0) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(false),
        Err(e) => Err(io::Error::new(e.kind(), format!("deleting interface {name}: {e}"))),
    }
}

fn set_up(ifindex: u32) -> io::Result<()> {
    let mut msg = LinkMessage::default();
    msg.header.index = ifindex;
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    request(RouteNetlinkMessage::SetLink(msg), 0)
        .map(drop)
        .map_err(|e| io::Error::new(e.kind(), format!("setting ifindex {ifindex} up: {e}")))
}

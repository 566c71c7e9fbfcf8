//! [`Netlink`] over rtnetlink: one netlink socket in the node namespace
//! (where rivet-cni runs) and one per container namespace, opened by a
//! short-lived thread that `setns()`es into it (a netlink socket talks to the
//! namespace it was created in, whichever thread uses it later). Nothing runs
//! `ip`.

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use futures::TryStreamExt as _;
use futures::future::BoxFuture;
use ipnet::IpNet;
use nix::sched::{CloneFlags, setns};
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use rtnetlink::packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteScope};
use rtnetlink::{Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};

use crate::api::{Link, Netlink, NetlinkError, PodConfig, PodState, RouteEntry, Veth, VethRequest};

/// [`Netlink`] with real sockets. Create it inside the tokio runtime that
/// will drive it.
pub struct RtNetlink {
    node: Handle,
    pods: tokio::sync::Mutex<HashMap<PathBuf, Handle>>,
}

impl std::fmt::Debug for RtNetlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RtNetlink").finish_non_exhaustive()
    }
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get().abs()),
        _ => None,
    }
}

fn nl_err(action: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let action = action.into();
    move |e| match errno(&e) {
        Some(code) => NetlinkError::os(action, code),
        None => NetlinkError::other(action, e.to_string()),
    }
}

fn io_err(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetlinkError {
    let action = action.into();
    move |e| NetlinkError {
        action,
        reason: e.to_string(),
        errno: e.raw_os_error(),
    }
}

impl RtNetlink {
    /// Opens the node namespace's netlink socket.
    pub fn new() -> std::io::Result<Self> {
        let (connection, node, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        Ok(Self {
            node,
            pods: tokio::sync::Mutex::new(HashMap::new()),
        })
    }

    /// A netlink handle talking to the namespace at `netns` (opened once).
    async fn pod(&self, netns: &Path) -> Result<Handle, NetlinkError> {
        let mut pods = self.pods.lock().await;
        if let Some(handle) = pods.get(netns) {
            return Ok(handle.clone());
        }
        let shown = netns.display().to_string();
        let file = File::open(netns).map_err(io_err(format!("opening network namespace {shown}")))?;
        let runtime = tokio::runtime::Handle::current();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread_shown = shown.clone();
        std::thread::Builder::new()
            .name("rivet-cni-netns".into())
            .spawn(move || {
                // This thread enters the namespace and ends: nothing else ever
                // runs in it by accident.
                let opened = (|| {
                    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| {
                        NetlinkError::os(format!("entering network namespace {thread_shown}"), e as i32)
                    })?;
                    let _runtime = runtime.enter();
                    let (connection, handle, _) = rtnetlink::new_connection()
                        .map_err(io_err(format!("opening a netlink socket in {thread_shown}")))?;
                    runtime.spawn(connection);
                    Ok(handle)
                })();
                let _ = tx.send(opened);
            })
            .map_err(io_err("starting a thread to enter the network namespace"))?;
        let handle = rx
            .await
            .map_err(|_| NetlinkError::other(format!("entering network namespace {shown}"), "the thread died"))??;
        pods.insert(netns.to_path_buf(), handle.clone());
        Ok(handle)
    }
}

/// The link called `name` through `handle`, if any.
async fn link_by_name(handle: &Handle, name: &str, where_: &str) -> Result<Option<Link>, NetlinkError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(Some(to_link(&msg))),
        Ok(None) => Ok(None),
        Err(e) if matches!(errno(&e), Some(libc::ENODEV) | Some(libc::ENOENT)) => Ok(None),
        Err(e) => Err(nl_err(format!("looking up {name} in {where_}"))(e)),
    }
}

fn to_link(msg: &LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        name: String::new(),
        mac: None,
        mtu: 0,
        up: msg.header.flags.contains(LinkFlags::Up),
        kind: None,
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(name) => link.name = name.clone(),
            LinkAttribute::Address(mac) => link.mac = <[u8; 6]>::try_from(mac.as_slice()).ok(),
            LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(kind) = info {
                        link.kind = Some(kind.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    link
}

fn any_net(v4: bool) -> IpNet {
    if v4 {
        IpNet::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0).expect("prefix 0")
    } else {
        IpNet::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0).expect("prefix 0")
    }
}

/// A device route `<dst> dev <ifindex>` (scope link for IPv4).
fn device_route(dst: IpAddr, ifindex: u32) -> RouteMessage {
    match dst {
        IpAddr::V4(a) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(a, 32)
            .output_interface(ifindex)
            .scope(RouteScope::Link)
            .build(),
        IpAddr::V6(a) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(a, 128)
            .output_interface(ifindex)
            .build(),
    }
}

/// `<dst> via <gw> dev <ifindex> [src <src>]`.
fn gateway_route(dst: IpNet, gw: IpAddr, ifindex: u32, src: Option<IpAddr>) -> Result<RouteMessage, NetlinkError> {
    let invalid = |e: &dyn std::fmt::Display| NetlinkError::other(format!("route {dst} via {gw}"), e.to_string());
    let mut builder = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(dst.addr(), dst.prefix_len())
        .map_err(|e| invalid(&e))?
        .gateway(gw)
        .map_err(|e| invalid(&e))?
        .output_interface(ifindex);
    if let Some(src) = src {
        builder = builder.pref_source(src).map_err(|e| invalid(&e))?;
    }
    Ok(builder.build())
}

fn route_entry(msg: &RouteMessage) -> Option<RouteEntry> {
    if msg.header.table != RouteHeader::RT_TABLE_MAIN
        && !msg
            .attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::Table(t) if *t == u32::from(RouteHeader::RT_TABLE_MAIN)))
    {
        return None;
    }
    let addr = |a: &RouteAddress| match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    };
    let v4 = msg.header.address_family == rtnetlink::packet_route::AddressFamily::Inet;
    let mut dst = any_net(v4);
    let mut gw = None;
    let mut oif = None;
    for attr in &msg.attributes {
        match attr {
            RouteAttribute::Destination(a) => {
                dst = IpNet::new(addr(a)?, msg.header.destination_prefix_length).ok()?;
            }
            RouteAttribute::Gateway(a) => gw = addr(a),
            RouteAttribute::Oif(i) => oif = Some(*i),
            _ => {}
        }
    }
    Some(RouteEntry { dst, gw, oif })
}

fn address_of(msg: &AddressMessage) -> Option<IpNet> {
    let ip = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let ip = ip.or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })?;
    IpNet::new(ip, msg.header.prefix_len).ok()
}

impl Netlink for RtNetlink {
    fn check_netns<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<(), NetlinkError>> {
        Box::pin(async move {
            let shown = path.display();
            let file = File::open(path).map_err(io_err(format!("opening {shown}")))?;
            // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd's
            // namespace type; `file` is open for the duration of the call.
            let kind = unsafe { libc::ioctl(file.as_raw_fd(), libc::NS_GET_NSTYPE) };
            if kind < 0 {
                let e = std::io::Error::last_os_error();
                return Err(NetlinkError {
                    action: format!("checking {shown}"),
                    reason: format!("not a network namespace ({e})"),
                    errno: e.raw_os_error(),
                });
            }
            if kind != libc::CLONE_NEWNET {
                return Err(NetlinkError::other(
                    format!("checking {shown}"),
                    "a namespace, but not a network namespace",
                ));
            }
            Ok(())
        })
    }

    fn host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Link>, NetlinkError>> {
        Box::pin(link_by_name(&self.node, name, "the node namespace"))
    }

    fn create_veth<'a>(&'a self, request: &'a VethRequest) -> BoxFuture<'a, Result<Veth, NetlinkError>> {
        Box::pin(async move {
            let netns_shown = request.netns.display().to_string();
            let netns = File::open(&request.netns).map_err(io_err(format!("opening {netns_shown}")))?;
            // The peer is created directly in the container namespace with its
            // final name: no temporary name in the node namespace to collide
            // or leak, and one link to delete on undo. It cannot be brought
            // up in the same request (the kernel configures it before the
            // pair is joined: ENOTCONN), so that comes after.
            let peer = LinkUnspec::new_with_name(&request.peer_name)
                .mtu(request.mtu)
                .setns_by_fd(netns.as_raw_fd())
                .build();
            let message = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
                .name(request.host_name.clone())
                .mtu(request.mtu)
                .up()
                .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
                .build();
            let action = format!(
                "creating veth {} (peer {} in {netns_shown})",
                request.host_name, request.peer_name
            );
            self.node.link().add(message).execute().await.map_err(nl_err(&action))?;
            drop(netns);
            let host = link_by_name(&self.node, &request.host_name, "the node namespace")
                .await?
                .ok_or_else(|| NetlinkError::other(&action, "the host side vanished right after creation"))?;
            let pod = self.pod(&request.netns).await?;
            let mut peer = link_by_name(&pod, &request.peer_name, &netns_shown)
                .await?
                .ok_or_else(|| NetlinkError::other(&action, "the container side is not in the namespace"))?;
            pod.link()
                .set(LinkUnspec::new_with_index(peer.index).up().build())
                .execute()
                .await
                .map_err(nl_err(format!("setting {} up in {netns_shown}", request.peer_name)))?;
            peer.up = true;
            Ok(Veth { host, peer })
        })
    }

    fn configure_pod<'a>(&'a self, netns: &'a Path, config: &'a PodConfig) -> BoxFuture<'a, Result<(), NetlinkError>> {
        Box::pin(async move {
            let pod = self.pod(netns).await?;
            let shown = netns.display();
            let index = config.ifindex;
            for a in &config.addresses {
                let mut flags = AddressFlags::Noprefixroute;
                if a.address.addr().is_ipv6() {
                    flags |= AddressFlags::Nodad;
                }
                let mut request = pod.address().add(index, a.address.addr(), a.address.prefix_len());
                request.message_mut().attributes.push(AddressAttribute::Flags(flags));
                request
                    .execute()
                    .await
                    .map_err(nl_err(format!("adding {} to interface {index} in {shown}", a.address)))?;
            }
            let mut gateways: Vec<IpAddr> = config.addresses.iter().map(|a| a.gateway).collect();
            gateways.dedup();
            for gw in gateways {
                pod.route()
                    .add(device_route(gw, index))
                    .execute()
                    .await
                    .map_err(nl_err(format!("adding the link route to gateway {gw} in {shown}")))?;
            }
            for r in &config.routes {
                let src = config
                    .addresses
                    .iter()
                    .map(|a| a.address.addr())
                    .find(|a| a.is_ipv4() == r.dst.addr().is_ipv4());
                pod.route()
                    .add(gateway_route(r.dst, r.gw, index, src)?)
                    .execute()
                    .await
                    .map_err(nl_err(format!("adding route {} via {} in {shown}", r.dst, r.gw)))?;
            }
            Ok(())
        })
    }

    fn add_host_routes<'a>(
        &'a self,
        host_ifindex: u32,
        addresses: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<(), NetlinkError>> {
        Box::pin(async move {
            for address in addresses {
                self.node
                    .route()
                    .add(device_route(*address, host_ifindex))
                    .execute()
                    .await
                    .map_err(nl_err(format!(
                        "adding the host route to {address} via interface {host_ifindex}"
                    )))?;
            }
            Ok(())
        })
    }

    fn delete_host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, NetlinkError>> {
        Box::pin(async move {
            let Some(link) = link_by_name(&self.node, name, "the node namespace").await? else {
                return Ok(false);
            };
            match self.node.link().del(link.index).execute().await {
                Ok(()) => Ok(true),
                Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(false),
                Err(e) => Err(nl_err(format!("deleting {name}"))(e)),
            }
        })
    }

    fn inspect_pod<'a>(
        &'a self,
        netns: &'a Path,
        ifname: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodState>, NetlinkError>> {
        Box::pin(async move {
            let pod = self.pod(netns).await?;
            let shown = netns.display().to_string();
            let Some(link) = link_by_name(&pod, ifname, &shown).await? else {
                return Ok(None);
            };
            let addresses: Vec<AddressMessage> = pod
                .address()
                .get()
                .set_link_index_filter(link.index)
                .execute()
                .try_collect()
                .await
                .map_err(nl_err(format!("listing the addresses of {ifname} in {shown}")))?;
            let addresses = addresses
                .iter()
                .filter(|m| m.header.index == link.index)
                .filter_map(address_of)
                .collect();
            let mut routes = Vec::new();
            for query in [
                RouteMessageBuilder::<Ipv4Addr>::new().build(),
                RouteMessageBuilder::<Ipv6Addr>::new().build(),
            ] {
                let found: Vec<RouteMessage> = pod
                    .route()
                    .get(query)
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nl_err(format!("listing the routes in {shown}")))?;
                routes.extend(found.iter().filter_map(route_entry));
            }
            Ok(Some(PodState {
                link,
                addresses,
                routes,
            }))
        })
    }
}

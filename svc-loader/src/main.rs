//! svc-loader: flags and wiring; the logic lives in the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::Controllers;
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use rivet_datapath::maps::CtTimeouts;
use rivet_datapath::{pin, spec};
use svc_loader::datapath::{Datapath, DatapathOptions};
use svc_loader::events::LoaderMetrics;
use svc_loader::lb::service::LoadBalancerService;
use svc_loader::lb::{LbCapacity, LoadBalancer, PinnedServiceMaps};
use svc_loader::loader::EndpointDatapath;
use svc_loader::monitor::EventHub;
use svc_loader::routing::{self, NodeRouting, RoutingMode};
use svc_loader::service::LoaderService;
use tonic::service::Routes;

/// Rivet's privileged datapath daemon.
#[derive(Debug, Parser)]
#[command(name = "svc-loader", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// Mount point of the BPF filesystem; pins go to `<bpffs>/rivet/<node-name>/`.
    #[arg(long, env = "RIVET_BPFFS", default_value = pin::DEFAULT_BPFFS)]
    bpffs: PathBuf,

    /// Only veths whose name starts with this are endpoint interfaces.
    #[arg(long, env = "RIVET_ENDPOINT_INTERFACE_PREFIX", default_value = "lxc")]
    endpoint_interface_prefix: String,

    /// Size of the endpoints map (one entry per endpoint and per address).
    #[arg(long, env = "RIVET_ENDPOINTS_MAX", default_value_t = spec::ENDPOINTS.default_max_entries)]
    endpoints_max: u32,
    /// Size of the ipcache (LPM trie, allocated on use).
    #[arg(long, env = "RIVET_IPCACHE_MAX", default_value_t = spec::IPCACHE.default_max_entries)]
    ipcache_max: u32,
    /// Size of the policy map, all endpoints together (LPM trie, allocated on use).
    #[arg(long, env = "RIVET_POLICY_MAX", default_value_t = spec::POLICY.default_max_entries)]
    policy_max: u32,
    /// Size of the per-endpoint prefixes map (ipBlock peers matched by
    /// address), all endpoints together (LPM trie, allocated on use).
    #[arg(long, env = "RIVET_EP_PREFIXES_MAX", default_value_t = spec::EP_PREFIXES.default_max_entries)]
    ep_prefixes_max: u32,
    /// Entries of each conntrack map (ct4, ct6): 512Ki TCP + 256Ki other by default.
    #[arg(long, env = "RIVET_CT_MAX", default_value_t = spec::CT4.default_max_entries)]
    ct_max: u32,
    /// Entries of each translated-flow map (lb4_flows, lb6_flows): two per
    /// connection to a service.
    #[arg(long, env = "RIVET_LB_FLOWS_MAX", default_value_t = spec::LB4_FLOWS.default_max_entries)]
    lb_flows_max: u32,
    /// Services the node can hold: entries of lb_services, lb_rev_nat,
    /// lb_maglev and lb_frontends, and 4 backends per service on average
    /// in lb_svc_backends (a Maglev table takes 4 KiB, a service record
    /// 24 B and a backend of a service 16 B of kernel memory, allocated as
    /// used).
    #[arg(long, env = "RIVET_LB_SERVICES_MAX", default_value_t = spec::LB_SERVICES.default_max_entries)]
    lb_services_max: u32,
    /// Size of the event ring buffer in bytes.
    #[arg(long, env = "RIVET_EVENTS_BYTES", default_value_t = spec::EVENTS.default_max_entries)]
    events_bytes: u32,

    /// Conntrack lifetime of a TCP connection being opened, seconds.
    #[arg(long, env = "RIVET_CT_TCP_SYN_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_syn)]
    ct_tcp_syn_timeout: u32,
    /// Conntrack lifetime of an established TCP connection, seconds.
    #[arg(long, env = "RIVET_CT_TCP_ESTABLISHED_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_established)]
    ct_tcp_established_timeout: u32,
    /// Conntrack lifetime of a closing TCP connection, seconds.
    #[arg(long, env = "RIVET_CT_TCP_CLOSING_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.tcp_closing)]
    ct_tcp_closing_timeout: u32,
    /// Conntrack lifetime of a UDP flow, seconds.
    #[arg(long, env = "RIVET_CT_UDP_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.udp)]
    ct_udp_timeout: u32,
    /// Conntrack lifetime of an ICMP flow, seconds.
    #[arg(long, env = "RIVET_CT_ICMP_TIMEOUT", default_value_t = CtTimeouts::DEFAULT.icmp)]
    ct_icmp_timeout: u32,

    /// How pod traffic reaches other nodes: none (single node), native
    /// (routes via the peers' underlay addresses) or vxlan (the
    /// `rivet_vxlan` collect-metadata device; the source identity rides in
    /// the VNI). One choice for the whole cluster.
    #[arg(long, env = "RIVET_ROUTING_MODE", value_enum, default_value = "none")]
    routing_mode: RoutingMode,
    /// The interface towards the other nodes (native and vxlan; it must
    /// exist in the loader's namespace).
    #[arg(long, env = "RIVET_UNDERLAY_INTERFACE", required_if_eq_any = [("routing_mode", "native"), ("routing_mode", "vxlan")])]
    underlay_interface: Option<String>,
    /// An external interface serving NodePort services besides the underlay
    /// (repeatable; with --routing-mode none the only ones). It must exist
    /// in the loader's namespace. Without any, NodePort frontends are held
    /// but reached only from pods and the node itself.
    #[arg(
        long = "nodeport-interface",
        env = "RIVET_NODEPORT_INTERFACES",
        value_delimiter = ','
    )]
    nodeport_interfaces: Vec<String>,
    /// UDP port of the VXLAN tunnel.
    #[arg(long, env = "RIVET_TUNNEL_PORT", default_value_t = routing::DEFAULT_TUNNEL_PORT,
          value_parser = clap::value_parser!(u16).range(1..))]
    tunnel_port: u16,

    /// How often the routes to peer nodes are realised again besides on
    /// every link or route change (the backstop for a missed notification).
    #[arg(long, env = "RIVET_ROUTE_RESYNC_SECONDS", default_value_t = routing::resync::DEFAULT_RESYNC_INTERVAL.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    route_resync_seconds: u64,

    /// Socket-level load balancing: attach the cgroup connect/sendmsg/
    /// recvmsg/getpeername programs to this cgroup v2 directory (the
    /// sockets of every process in it and below translate a ClusterIP to a
    /// backend once, at connect). Absent: off, and links left by an
    /// earlier start are detached.
    #[arg(long, env = "RIVET_SOCKET_LB_CGROUP")]
    socket_lb_cgroup: Option<PathBuf>,

    /// How often the node's addresses are re-published as the host identity.
    #[arg(long, env = "RIVET_HOST_ADDRESS_SYNC_SECONDS", default_value_t = 10)]
    host_address_sync_seconds: u64,
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_loader::DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_loader::DAEMON_NAME, svc_loader::CAPABILITIES);
    daemon::exit(
        svc_loader::DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(
        svc_loader::DAEMON_NAME,
        env!("CARGO_PKG_VERSION"),
        flags.common.node_name(),
    );
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let node = flags.common.node_name();
    let listener = daemon::bind_socket(&flags.common, svc_loader::DAEMON_NAME, svc_loader::READ_ONLY_METHODS)?;

    let mut options = DatapathOptions::for_node(&flags.bpffs, &node)?;
    options.endpoints_max = flags.endpoints_max;
    options.ipcache_max = flags.ipcache_max;
    options.policy_max = flags.policy_max;
    options.ep_prefixes_max = flags.ep_prefixes_max;
    options.ct4_max = flags.ct_max;
    options.ct6_max = flags.ct_max;
    options.lb_flows_max = flags.lb_flows_max;
    options.lb_services_max = flags.lb_services_max;
    options.events_bytes = flags.events_bytes;
    options.ct_timeouts = CtTimeouts {
        tcp_syn: flags.ct_tcp_syn_timeout,
        tcp_established: flags.ct_tcp_established_timeout,
        tcp_closing: flags.ct_tcp_closing_timeout,
        udp: flags.ct_udp_timeout,
        icmp: flags.ct_icmp_timeout,
        other: flags.ct_udp_timeout,
    };
    let (routing_setup, tunnel) = routing::setup(
        flags.routing_mode,
        flags.underlay_interface.as_deref(),
        flags.tunnel_port,
    )
    .context("setting up the routing mode")?;
    if let Some(tunnel) = tunnel {
        tracing::info!(
            device = routing::TUNNEL_INTERFACE,
            ifindex = tunnel.ifindex,
            mtu = tunnel.mtu,
            created = tunnel.created,
            port = flags.tunnel_port,
            "tunnel device ready"
        );
    }
    let pin_dir = options.pin_dir.clone();
    let mut datapath =
        Datapath::open(options).with_context(|| format!("opening the datapath in {}", pin_dir.display()))?;
    let routing_config = routing::datapath_config(&routing_setup, tunnel.map(|t| t.mtu));
    datapath
        .write_routing(routing_config)
        .context("writing the routing config")?;
    if let Some(tunnel) = tunnel {
        datapath
            .attach_overlay(tunnel.ifindex)
            .context("attaching the overlay programs to the tunnel device")?;
    }
    let external = routing::nodeport_interfaces(&routing_setup, &flags.nodeport_interfaces)
        .context("resolving the NodePort interfaces")?;
    let served = datapath
        .serve_nodeport(&external.iter().map(|(_, ifindex)| *ifindex).collect::<Vec<_>>())
        .context("attaching the NodePort programs to the external interfaces")?;
    tracing::info!(
        interfaces = ?external.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>(),
        detached = served.detached.len(),
        "NodePort programs on the external interfaces"
    );
    let socket_lb = match &flags.socket_lb_cgroup {
        Some(cgroup) => Ok(datapath
            .enable_socket_lb(cgroup)
            .with_context(|| format!("attaching socket load balancing to {}", cgroup.display()))?),
        None => Err(datapath
            .disable_socket_lb()
            .context("detaching socket load balancing")?),
    };
    let report = datapath.adoption().clone();
    tracing::info!(
        pin_dir = %pin_dir.display(),
        updated = report.updated,
        unchanged = report.unchanged,
        migrated_tcx_links = report.migrated.len(),
        removed_tcx_link_pins = report.removed.len(),
        "datapath loaded; existing attachments adopted"
    );
    let ct_migrations = datapath.ct_migrations().to_vec();
    let ring = datapath.take_events().context("the events ring buffer is missing")?;
    let endpoints = Arc::new(EndpointDatapath::new(
        datapath,
        flags.endpoint_interface_prefix.clone(),
    )?);
    let controllers = Controllers::new();
    let events = EventHub::start(ring, endpoints.clone(), &controllers).context("watching the events ring buffer")?;
    svc_loader::host_addresses::sync(
        endpoints.clone(),
        Duration::from_secs(flags.host_address_sync_seconds.max(1)),
        &controllers,
    );

    let metrics = LoaderMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    match &socket_lb {
        Ok(report) => svc_loader::events::socket_lb_enabled(&metrics, report),
        Err(removed) => svc_loader::events::socket_lb_disabled(&metrics, *removed),
    }
    for migrated in &ct_migrations {
        svc_loader::events::ct_migrated(&metrics, migrated);
    }
    let node_routing = Arc::new(NodeRouting::new(
        routing_setup.clone(),
        Box::new(routing::netlink::NetlinkRoutes),
    ));
    routing::resync::start(
        node_routing.clone(),
        Duration::from_secs(flags.route_resync_seconds),
        metrics.clone(),
        &controllers,
    );
    let routing_service =
        routing::service::NodeRoutingService::new(node_routing.clone(), identity.boot_id.clone(), metrics.clone());
    let lb_sizes = endpoints
        .datapath()
        .map_status()
        .into_iter()
        .map(|m| (m.name, m.spec.max_entries))
        .collect();
    let (lb, restored) = LoadBalancer::restore(
        Box::new(PinnedServiceMaps(endpoints.clone())),
        LbCapacity::from_sizes(&lb_sizes),
    )
    .context("restoring the service index from the pinned maps")?;
    svc_loader::events::services_restored(&metrics, &restored);
    let lb_service = LoadBalancerService::new(Arc::new(lb), identity.boot_id.clone(), metrics.clone());
    let service = LoaderService::new(endpoints.clone(), events, identity.boot_id.clone(), metrics)
        .with_tunnel(tunnel.map(|t| t.ifindex))
        .with_nodeport_interfaces(served.attached);
    let routes = Routes::new(service.into_server())
        .add_service(routing_service.into_server())
        .add_service(lb_service.into_server());
    daemon::run(
        &flags.common,
        listener,
        identity,
        controllers,
        routes,
        registry,
        Health::default(),
    )
    .await?;
    // Served no more: no endpoint can be added while this looks.
    let outcome = svc_loader::uninstall::at_shutdown(&endpoints, &node_routing)
        .context("removing the datapath of a node no pod uses")?;
    svc_loader::events::shutdown(&outcome);
    Ok(())
}

//! svc-health: flags and wiring; the logic lives in the library.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::{Controller, Controllers};
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use svc_health::events::HealthMetrics;
use svc_health::helper::ForkedNamespaceSockets;
use svc_health::net::{self, EchoSequence, NetProbes, OwnNamespace, SocketSource};
use svc_health::peers::RegistryPeers;
use svc_health::prober::{LocalNode, Prober, ProberOptions};
use svc_health::service::HealthService;
use tonic::service::Routes;

/// Rivet's connectivity prober between nodes.
#[derive(Debug, Parser)]
#[command(name = "svc-health", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// An underlay address of this node to serve `/hello` on for the peers' probes (repeatable; none:
    /// every address of the namespace, `0.0.0.0` and `::`: the node's namespace is the node's).
    #[arg(long = "node-address", env = "RIVET_NODE_ADDRESS", value_delimiter = ',')]
    node_addresses: Vec<IpAddr>,

    /// The port of `/hello`, here and on the peers (Cilium's 4240).
    #[arg(long, env = "RIVET_HEALTH_PORT", default_value_t = net::HEALTH_PORT)]
    health_port: u16,

    /// From the start of one probe round to the start of the next, seconds.
    #[arg(long, env = "RIVET_HEALTH_PROBE_INTERVAL", default_value_t = 30.0)]
    probe_interval: f64,

    /// Bound of each probe and of the peer listing, seconds; below the interval (default: a third of
    /// it, at most 5).
    #[arg(long, env = "RIVET_HEALTH_PROBE_TIMEOUT")]
    probe_timeout: Option<f64>,

    /// The network namespace of this node's health endpoint (`/run/netns/<name>`, made by `rivet node
    /// up`): `/hello` is served there too, and the probes of the peers' health endpoints leave from
    /// there, through the pod datapath. Without it those probes are not run.
    #[arg(long, env = "RIVET_HEALTH_NETNS")]
    health_netns: Option<PathBuf>,
}

fn seconds(name: &str, value: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        value.is_finite() && value > 0.0,
        "--{name} must be a number of seconds > 0"
    );
    Ok(Duration::from_secs_f64(value))
}

fn options(flags: &Flags) -> anyhow::Result<ProberOptions> {
    let interval = seconds("probe-interval", flags.probe_interval)?;
    anyhow::ensure!(
        interval >= Duration::from_millis(100),
        "--probe-interval must be at least 0.1"
    );
    let timeout = match flags.probe_timeout {
        Some(t) => seconds("probe-timeout", t)?,
        None => (interval / 3).min(Duration::from_secs(5)),
    };
    anyhow::ensure!(
        timeout < interval,
        "--probe-timeout ({timeout:?}) must be below --probe-interval ({interval:?}): a round must end before the next"
    );
    Ok(ProberOptions { interval, timeout })
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_health::DAEMON_NAME, Err(e));
    }
    // Before the privilege drop (entering a namespace needs CAP_SYS_ADMIN) and while this is the only
    // thread (it forks): the helper that makes sockets in the health endpoint's namespace drops the
    // same privileges itself.
    let health_sockets = match &flags.health_netns {
        Some(path) => match ForkedNamespaceSockets::fork(path, || {
            daemon::drop_privileges(&flags.common, svc_health::DAEMON_NAME, svc_health::CAPABILITIES)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }) {
            Ok(sockets) => Some(Arc::new(sockets)),
            Err(e) => return daemon::exit(svc_health::DAEMON_NAME, Err(e)),
        },
        None => None,
    };
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_health::DAEMON_NAME, svc_health::CAPABILITIES);
    daemon::exit(
        svc_health::DAEMON_NAME,
        privileges
            .map_err(anyhow::Error::from)
            .and_then(|p| run(flags, p, health_sockets)),
    )
}

#[tokio::main]
async fn run(
    flags: Flags,
    privileges: Dropped,
    health_sockets: Option<Arc<ForkedNamespaceSockets>>,
) -> anyhow::Result<()> {
    let node = flags.common.node_name();
    let identity = DaemonIdentity::new(svc_health::DAEMON_NAME, env!("CARGO_PKG_VERSION"), node.clone());
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let opts = options(&flags)?;
    let listener = daemon::bind_socket(&flags.common, svc_health::DAEMON_NAME, svc_health::READ_ONLY_METHODS)?;
    let controllers = Controllers::new();

    // Bound before serving: an address in use fails the start. The node's addresses, and every address
    // of the health endpoint's namespace.
    let listen: Vec<IpAddr> = if flags.node_addresses.is_empty() {
        vec![IpAddr::from([0, 0, 0, 0]), IpAddr::from([0u16; 8])]
    } else {
        flags.node_addresses.clone()
    };
    let node_sockets: Arc<dyn SocketSource> = Arc::new(OwnNamespace);
    let mut places: Vec<(Arc<dyn SocketSource>, SocketAddr)> = listen
        .iter()
        .map(|a| (node_sockets.clone(), SocketAddr::new(*a, flags.health_port)))
        .collect();
    if let Some(sockets) = &health_sockets {
        for any in [IpAddr::from([0, 0, 0, 0]), IpAddr::from([0u16; 8])] {
            places.push((sockets.clone(), SocketAddr::new(any, flags.health_port)));
        }
    }
    let mut listeners = Vec::new();
    for (sockets, address) in &places {
        listeners.push(net::bind_hello(&**sockets, *address).await?);
    }
    let bound = Arc::new(Mutex::new(Some(listeners)));
    controllers.supervise(Controller::new("health-server"), move |progress| {
        let (bound, places) = (bound.clone(), places.clone());
        async move {
            let taken = bound.lock().unwrap_or_else(|e| e.into_inner()).take();
            let listeners = match taken {
                Some(listeners) => listeners,
                None => {
                    let mut listeners = Vec::new();
                    for (sockets, address) in &places {
                        listeners.push(net::bind_hello(&**sockets, *address).await?);
                    }
                    listeners
                }
            };
            progress.ok();
            futures::future::try_join_all(listeners.into_iter().map(net::serve_hello)).await?;
            Ok::<_, net::HelloError>(())
        }
    });

    let metrics = HealthMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let peers = Arc::new(RegistryPeers::new(
        &flags.common.socket_path("svc-identity"),
        opts.timeout,
    ));
    let probes = Arc::new(NetProbes {
        node: node_sockets,
        health_endpoint: health_sockets.map(|s| s as Arc<dyn SocketSource>),
        port: flags.health_port,
        sequence: Arc::new(EchoSequence::default()),
    });
    tracing::info!(
        interval_s = opts.interval.as_secs_f64(),
        timeout_s = opts.timeout.as_secs_f64(),
        node_addresses = ?flags.node_addresses,
        health_netns = ?flags.health_netns,
        port = flags.health_port,
        "starting; peers come from svc-identity's node registry every round"
    );
    let prober = Prober::new(
        opts,
        LocalNode {
            name: node,
            node_addresses: flags.node_addresses.clone(),
        },
        peers,
        probes,
        metrics,
    );
    prober.start(&controllers);

    let service = HealthService::new(prober, identity.boot_id.clone());
    let routes = Routes::new(service.into_server());
    daemon::run(
        &flags.common,
        listener,
        identity,
        controllers,
        routes,
        registry,
        Health::default(),
    )
    .await
    .context("serving")?;
    Ok(())
}

//! svc-k8s-sync: flags and wiring; the logic lives in the library.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::{Controllers, Trigger};
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use rivet_k8s::ClusterAccess;
use svc_k8s_sync::caches::Caches;
use svc_k8s_sync::endpoint_objects::EndpointObjects;
use svc_k8s_sync::events::SyncMetrics;
use svc_k8s_sync::feed::{Feed, GrpcFeed};
use svc_k8s_sync::node::{NodeReadiness, SocketDaemons};
use svc_k8s_sync::pod_cidrs::{IpamMode, PodCidrs, SocketIpam};
use svc_k8s_sync::service::SyncService;
use svc_k8s_sync::{DAEMON_NAME, SyncState};

/// Rivet's Kubernetes watcher: feeds pod and namespace labels and policies
/// to svc-endpoint, answers pod lookups, marks the node ready.
#[derive(Debug, Parser)]
#[command(name = "svc-k8s-sync", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// How to reach the API server: the path of a kubeconfig (its current
    /// context), or `in-cluster` for the pod's ServiceAccount.
    #[arg(long, env = "RIVET_KUBECONFIG", default_value = ClusterAccess::IN_CLUSTER)]
    kubeconfig: ClusterAccess,

    /// This node's addresses (repeat or comma-separate), written into its
    /// RivetNode and the Node's `rivet.io/node-addresses` annotation.
    #[arg(long, env = "RIVET_NODE_ADDRESS", value_delimiter = ',')]
    node_address: Vec<std::net::IpAddr>,

    /// The daemons that must answer GetInfo without being degraded before
    /// the node is marked ready (their sockets in --socket-dir).
    #[arg(
        long,
        env = "RIVET_READY_DAEMONS",
        value_delimiter = ',',
        default_value = "svc-ipam,svc-identity,svc-loader,svc-endpoint"
    )]
    ready_daemons: Vec<String>,

    /// How often node readiness is checked again once marked, seconds.
    #[arg(long, env = "RIVET_NODE_READY_PERIOD_SECONDS", default_value_t = 10.0)]
    node_ready_period_seconds: f64,

    /// How long the initial lists of every watched kind may take before the
    /// delay is reported (status, log, metric); not fatal: nothing is fed or
    /// deleted until they complete.
    #[arg(long, env = "RIVET_CACHE_SYNC_TIMEOUT_SECONDS", default_value_t = 60.0)]
    cache_sync_timeout_seconds: f64,

    /// Where the node's pod CIDRs come from. `node-pool`: svc-ipam's
    /// `--pool`s, written into the RivetNode's spec.podCidrs. `cluster-pool`:
    /// the operator allocates them into spec.podCidrs (svc-k8s-sync applies
    /// the spec's addresses at start and never podCidrs); svc-k8s-sync hands
    /// them to svc-ipam (SetPool "default"), reports condition
    /// PodCIDRsApplied, and marks the node ready only once they are applied.
    #[arg(long, env = "RIVET_IPAM_MODE", value_enum, default_value_t = IpamMode::NodePool)]
    ipam_mode: IpamMode,

    /// Cluster-pool IPAM: how often the RivetNode's pod CIDRs are handed to
    /// svc-ipam again without a change (a restarted svc-ipam that lost its
    /// state gets them back; the same ranges write nothing), seconds.
    #[arg(long, env = "RIVET_POD_CIDRS_RESYNC_SECONDS", default_value_t = 10.0)]
    pod_cidrs_resync_seconds: f64,

    /// How often svc-endpoint's boot_id is checked when there is nothing to
    /// send (a restarted svc-endpoint gets the whole state again), seconds.
    #[arg(long, env = "RIVET_FEED_POLL_SECONDS", default_value_t = 2.0)]
    feed_poll_seconds: f64,
}

fn seconds(name: &str, value: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        value.is_finite() && value > 0.0,
        "--{name} must be a number of seconds > 0"
    );
    Ok(Duration::from_secs_f64(value))
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, DAEMON_NAME, svc_k8s_sync::CAPABILITIES);
    daemon::exit(
        DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(DAEMON_NAME, env!("CARGO_PKG_VERSION"), flags.common.node_name());
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let node = flags.common.node_name();
    let sync_timeout = seconds("cache-sync-timeout-seconds", flags.cache_sync_timeout_seconds)?;
    let poll = seconds("feed-poll-seconds", flags.feed_poll_seconds)?;
    let listener = daemon::bind_socket(&flags.common, DAEMON_NAME, svc_k8s_sync::READ_ONLY_METHODS)?;
    let ready_period = seconds("node-ready-period-seconds", flags.node_ready_period_seconds)?;
    let pod_cidrs_resync = seconds("pod-cidrs-resync-seconds", flags.pod_cidrs_resync_seconds)?;
    let client = flags.kubeconfig.client().await?;

    let metrics = SyncMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let controllers = Controllers::new();
    let state = Arc::new(SyncState::default());
    let (feed_trigger, sync_trigger, ready_trigger) = (Trigger::new(), Trigger::new(), Trigger::new());
    let caches = Caches::start(
        &client,
        &node,
        &controllers,
        &metrics,
        &[feed_trigger.clone(), sync_trigger.clone(), ready_trigger.clone()],
    );
    tracing::info!(node, access = %flags.kubeconfig, "watching the API server");
    svc_k8s_sync::watch_cache_sync(
        &controllers,
        &sync_trigger,
        caches.status.clone(),
        state.clone(),
        metrics.clone(),
        sync_timeout,
    );
    let feed = {
        let caches = caches.clone();
        Feed::new(
            Arc::new(GrpcFeed::new(&flags.common.socket_path("svc-endpoint"))),
            caches.status.clone(),
            move || caches.desired(),
            metrics.clone(),
            poll,
        )
    };
    feed.start(&controllers, &feed_trigger);
    EndpointObjects {
        client: client.clone(),
        node_name: node.clone(),
        caches: caches.clone(),
        state: state.clone(),
        metrics: metrics.clone(),
        feed_trigger: feed_trigger.clone(),
    }
    .start(&controllers, &flags.common.socket_path("svc-endpoint"));
    let addresses: Vec<String> = flags.node_address.iter().map(ToString::to_string).collect();
    if flags.ipam_mode == IpamMode::ClusterPool {
        PodCidrs {
            client: client.clone(),
            node_name: node.clone(),
            addresses: addresses.clone(),
            ipam: Arc::new(SocketIpam {
                socket: flags.common.socket_path("svc-ipam"),
            }),
            state: state.clone(),
            metrics: metrics.clone(),
            resync: pod_cidrs_resync,
            ready_trigger: ready_trigger.clone(),
        }
        .start(&controllers);
    }
    NodeReadiness {
        client,
        node_name: node.clone(),
        addresses,
        ipam_mode: flags.ipam_mode,
        daemons: Arc::new(SocketDaemons {
            socket_dir: flags.common.socket_dir.clone(),
            daemons: flags.ready_daemons.clone(),
        }),
        status: caches.status.clone(),
        state: state.clone(),
        metrics: metrics.clone(),
        period: ready_period,
    }
    .start(&controllers, &ready_trigger);

    let service = SyncService::new(node, identity.boot_id.clone(), caches, feed, state);
    daemon::run(
        &flags.common,
        listener,
        identity,
        controllers,
        service.into_routes(),
        registry,
        Health::default(),
    )
    .await
    .context("serving")?;
    Ok(())
}

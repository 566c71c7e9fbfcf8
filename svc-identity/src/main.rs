//! svc-identity: flags and wiring; the logic lives in the library.

use std::net::IpAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ipnet::IpNet;
use prometheus_client::registry::Registry;
use rivet_common::cluster::EncapsulationMode;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::Controllers;
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::identity::{self, DEFAULT_MAX_CLUSTER_IDENTITY};
use rivet_common::labels::LabelFilter;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use rivet_k8s::ClusterAccess;
use svc_identity::allocator::{AllocatorOptions, IdentityAllocator};
use svc_identity::backend::{IdentityBackend, NodeStore};
use svc_identity::cidr::CidrIdentities;
use svc_identity::embedded_backend::EmbeddedBackend;
use svc_identity::etcd_backend::{EtcdBackend, EtcdOptions};
use svc_identity::events::{IdentityMetrics, ReconciledKeys};
use svc_identity::heartbeat::{HeartbeatArgs, HeartbeatWatchdog};
use svc_identity::ipcache::{IpCache, IpCacheOptions, LoaderSync, LoaderSyncOptions};
use svc_identity::ipcache_service::IpcacheService;
use svc_identity::kubernetes_backend::KubernetesBackend;
use svc_identity::kubernetes_cluster::{ClusterObjects, ClusterObjectsOptions};
use svc_identity::node_service::NodeService;
use svc_identity::registry::{DEFAULT_TUNNEL_PORT, NodeRegistry, RegistryOptions};
use svc_identity::service::IdentityService;
use svc_identity::snapshot::{self, SNAPSHOT_FILE_NAME, SnapshotOptions, SnapshotWriter};
use tonic::service::Routes;

/// Rivet's label → identity allocator and IP cache.
#[derive(Debug, Parser)]
#[command(name = "svc-identity", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// Where identities live: `embedded` (one node: a file in
    /// `<state-dir>/identity/`), `etcd` (`--etcd-endpoints`) or `kubernetes`
    /// (RivetIdentity objects; `--kubeconfig`). Default: etcd when
    /// `--etcd-endpoints` is given, else embedded.
    #[arg(long, env = "RIVET_IDENTITY_STORE", value_enum)]
    identity_store: Option<StoreKind>,

    /// etcd endpoints (comma-separated), for the etcd store.
    #[arg(long, env = "RIVET_ETCD_ENDPOINTS", value_delimiter = ',')]
    etcd_endpoints: Vec<String>,

    /// The API server of the kubernetes store: `in-cluster` (the pod's
    /// ServiceAccount) or the path of a kubeconfig.
    #[arg(long, env = "RIVET_KUBECONFIG")]
    kubeconfig: Option<ClusterAccess>,

    /// Key prefix in etcd.
    #[arg(long, env = "RIVET_KVSTORE_PREFIX", default_value = "rivet/state/")]
    kvstore_prefix: String,

    /// Cluster name (IP cache keys are per cluster).
    #[arg(long, env = "RIVET_CLUSTER_NAME", default_value = "default")]
    cluster_name: String,

    /// TTL of this node's etcd lease, seconds: a crashed node's keys vanish
    /// after it, and an etcd that hangs longer expires them (15 min, as
    /// Cilium's kvstore lease).
    #[arg(long, env = "RIVET_LEASE_TTL_SECONDS", default_value_t = svc_identity::etcd_backend::DEFAULT_LEASE_TTL.as_secs())]
    lease_ttl_seconds: u64,

    /// How often this node's value keys are reconciled with the store
    /// (missing ones written, unused ones deleted), seconds.
    #[arg(long, env = "RIVET_IDENTITY_RESYNC_SECONDS", default_value_t = 60)]
    resync_seconds: u64,

    /// How long after start this node's keys found in the store (value keys,
    /// IP cache entries of a previous run) are kept for svc-endpoint to
    /// claim them again before unclaimed ones are deleted, seconds.
    #[arg(long, env = "RIVET_IDENTITY_RESTORE_GRACE_SECONDS", default_value_t = 120)]
    restore_grace_seconds: u64,

    /// Largest cluster identity (the range starts at 256; CIDR identities
    /// start at 2^24).
    #[arg(long, env = "RIVET_MAX_IDENTITY", default_value_t = DEFAULT_MAX_CLUSTER_IDENTITY,
          value_parser = max_cluster_identity)]
    max_identity: u32,

    /// Identity-relevant label rules, `[!][source:]key-prefix`, added to the
    /// default excludes (pod-template-hash, ...).
    #[arg(long = "label", env = "RIVET_LABELS", value_delimiter = ',')]
    labels: Vec<String>,

    #[command(flatten)]
    heartbeat: HeartbeatArgs,

    /// How pod traffic crosses nodes, the same on every node of the
    /// cluster: `none` (a single node), `native` (pod CIDRs routed via the
    /// nodes' underlay addresses) or `vxlan`. With a mode, the peer nodes
    /// are pushed to svc-loader (its `--routing-mode` must match). Needs the
    /// etcd store (nodes meet in `nodes/v1`) or the kubernetes store (nodes
    /// meet as RivetNodes).
    #[arg(long, env = "RIVET_ROUTING_MODE", value_enum, default_value_t = RoutingFlag::None)]
    routing_mode: RoutingFlag,

    /// This node's underlay address (repeatable, comma-separated): published
    /// in its node record; the IPv4 one is the tunnel endpoint other nodes
    /// use for this node's pods. With the kubernetes store: default, its
    /// RivetNode's addresses (svc-k8s-sync writes them).
    #[arg(long = "node-address", env = "RIVET_NODE_ADDRESSES", value_delimiter = ',')]
    node_addresses: Vec<IpAddr>,

    /// A prefix this node's pods get addresses from (repeatable,
    /// comma-separated): published in its node record; peers route it here.
    /// Default: its RivetNode's pod CIDRs (the cluster pool's allocation),
    /// read from the node's RivetNode (kubernetes store) or, with etcd,
    /// from the record rivet-operator mirrors from it, which this node then
    /// leaves as it is instead of publishing its own.
    #[arg(long = "pod-cidr", env = "RIVET_POD_CIDRS", value_delimiter = ',', value_parser = pod_cidr)]
    pod_cidrs: Vec<IpNet>,

    /// The VXLAN UDP port of the cluster (published with `--routing-mode
    /// vxlan`).
    #[arg(long, env = "RIVET_TUNNEL_PORT", default_value_t = DEFAULT_TUNNEL_PORT)]
    tunnel_port: u16,
}

/// `--routing-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoutingFlag {
    None,
    Native,
    Vxlan,
}

/// `--identity-store`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StoreKind {
    Embedded,
    Etcd,
    Kubernetes,
}

impl Flags {
    /// The routing mode, checked against the store and addresses it needs.
    fn routing(&self, store: StoreKind) -> anyhow::Result<Option<EncapsulationMode>> {
        let mode = match self.routing_mode {
            RoutingFlag::None => return Ok(None),
            RoutingFlag::Native => EncapsulationMode::Direct,
            RoutingFlag::Vxlan => EncapsulationMode::Vxlan,
        };
        if store == StoreKind::Embedded {
            anyhow::bail!(
                "--routing-mode needs the etcd store (--etcd-endpoints) or the kubernetes store: nodes find each \
                 other there"
            );
        }
        // The kubernetes store: this node's addresses and pod CIDRs come
        // from its RivetNode unless given.
        if store == StoreKind::Kubernetes {
            if mode == EncapsulationMode::Vxlan
                && !self.node_addresses.is_empty()
                && !self.node_addresses.iter().any(IpAddr::is_ipv4)
            {
                anyhow::bail!("--routing-mode vxlan needs an IPv4 --node-address (tunnel endpoints are IPv4)");
            }
            return Ok(Some(mode));
        }
        if self.node_addresses.is_empty() {
            anyhow::bail!("--routing-mode needs this node's underlay address (--node-address)");
        }
        if mode == EncapsulationMode::Vxlan && !self.node_addresses.iter().any(IpAddr::is_ipv4) {
            anyhow::bail!("--routing-mode vxlan needs an IPv4 --node-address (tunnel endpoints are IPv4)");
        }
        // Without --pod-cidr the node's record is rivet-operator's mirror
        // of its RivetNode (cluster-pool IPAM): see `publishes_own_record`.
        Ok(Some(mode))
    }

    /// The store to use, checked against the flags it needs.
    fn store(&self) -> anyhow::Result<StoreKind> {
        let kind = self.identity_store.unwrap_or(if self.etcd_endpoints.is_empty() {
            StoreKind::Embedded
        } else {
            StoreKind::Etcd
        });
        match kind {
            StoreKind::Etcd if self.etcd_endpoints.is_empty() => {
                anyhow::bail!("--identity-store etcd needs --etcd-endpoints")
            }
            StoreKind::Kubernetes if self.kubeconfig.is_none() => {
                anyhow::bail!("--identity-store kubernetes needs --kubeconfig (`in-cluster` or a kubeconfig path)")
            }
            StoreKind::Embedded | StoreKind::Kubernetes if !self.etcd_endpoints.is_empty() => {
                anyhow::bail!("--etcd-endpoints is only for --identity-store etcd")
            }
            kind => Ok(kind),
        }
    }
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_identity::DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_identity::DAEMON_NAME, svc_identity::CAPABILITIES);
    daemon::exit(
        svc_identity::DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(
        svc_identity::DAEMON_NAME,
        env!("CARGO_PKG_VERSION"),
        flags.common.node_name(),
    );
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let filter = LabelFilter::parse(&flags.labels).context("invalid --label rule")?;
    let node = flags.common.node_name();
    let listener = daemon::bind_socket(
        &flags.common,
        svc_identity::DAEMON_NAME,
        svc_identity::READ_ONLY_METHODS,
    )?;

    let metrics = IdentityMetrics::default();
    let state_dir = flags.common.state_dir.join("identity");
    // With etcd: started whether etcd answers or not, serving the local
    // snapshot until etcd is listed (the embedded store is local already).
    // Every background loop of the daemon, the etcd lease keeper's too.
    let controllers = Controllers::new();
    let store = flags.store()?;
    let routing = flags.routing(store)?;
    // The operator's heartbeat lives in etcd only.
    let mut heartbeat = None;
    // Node records: etcd's nodes/v1 or the RivetNodes (the embedded store
    // is one node: the registry lists this node only).
    let mut node_store: Option<Arc<dyn NodeStore>> = None;
    let (backend, snapshot): (Arc<dyn IdentityBackend>, Option<SnapshotOptions>) = if store == StoreKind::Embedded {
        let path = state_dir.join("store.json");
        let backend = EmbeddedBackend::open(&path, &node).context("opening the embedded identity store")?;
        (Arc::new(backend), None)
    } else if let (StoreKind::Kubernetes, Some(access)) = (store, &flags.kubeconfig) {
        let client = access.client().await.context("configuring the Kubernetes client")?;
        // Other nodes (RivetNodes) and their pods (RivetEndpoints).
        let cluster = ClusterObjects::start(
            client.clone(),
            ClusterObjectsOptions {
                node_name: node.clone(),
                cluster: flags.cluster_name.clone(),
            },
            &controllers,
        );
        node_store = Some(cluster.clone());
        (Arc::new(KubernetesBackend::new(client).with_cluster(cluster)), None)
    } else {
        let options = EtcdOptions {
            endpoints: flags.etcd_endpoints.clone(),
            prefix: flags.kvstore_prefix.clone(),
            cluster: flags.cluster_name.clone(),
            node: node.clone(),
            lease_ttl: Duration::from_secs(flags.lease_ttl_seconds.max(2)),
            ..EtcdOptions::new(flags.etcd_endpoints.clone(), node.clone())
        };
        let backend = EtcdBackend::start(options, &controllers)
            .await
            .context("configuring the etcd client")?;
        let watchdog = HeartbeatWatchdog::new(backend.layout().heartbeat_key(), flags.heartbeat.threshold());
        watchdog.run(backend.etcd_client().clone(), &controllers);
        heartbeat = Some(watchdog);
        let snapshot = SnapshotOptions::new(
            state_dir.join(SNAPSHOT_FILE_NAME),
            &node,
            backend.layout().prefix(),
            &flags.cluster_name,
        );
        let backend = Arc::new(backend);
        node_store = Some(backend.clone());
        (backend, Some(snapshot))
    };
    tracing::info!(backend = backend.kind(), node = %node, "identity store configured");

    let restore_grace = Duration::from_secs(flags.restore_grace_seconds);
    let ipcache = IpCache::new(
        backend.clone(),
        IpCacheOptions {
            restore_grace,
            host_ip: flags.node_addresses.iter().copied().find(IpAddr::is_ipv4),
            metrics: metrics.clone(),
            ..IpCacheOptions::new(node.clone())
        },
    );
    let allocator = IdentityAllocator::new(
        backend.clone(),
        AllocatorOptions {
            max_id: flags.max_identity,
            filter,
            resync_interval: Duration::from_secs(flags.resync_seconds.max(1)),
            restore_grace,
            metrics: metrics.clone(),
            ..AllocatorOptions::default()
        },
    );
    let snapshot_writer = match &snapshot {
        Some(options) => {
            let (to_load, events) = (options.clone(), metrics.clone());
            let loaded = tokio::task::spawn_blocking(move || snapshot::load(&to_load, &events))
                .await
                .context("loading the local snapshot")?;
            if let Some(loaded) = loaded {
                snapshot::restore(loaded, &allocator, &ipcache);
            }
            Some(SnapshotWriter::new(
                allocator.clone(),
                ipcache.clone(),
                options.clone(),
                metrics.clone(),
            ))
        }
        None => None,
    };
    ipcache.run(&controllers);
    let registry = NodeRegistry::new(
        RegistryOptions {
            routing,
            node_addresses: flags.node_addresses.clone(),
            pod_cidrs: flags.pod_cidrs.clone(),
            // Routed without --pod-cidr: the record is rivet-operator's
            // mirror of the node's RivetNode, the node reads it.
            publish_own_record: routing.is_none() || !flags.pod_cidrs.is_empty(),
            tunnel_port: flags.tunnel_port,
            metrics: metrics.clone(),
            ..RegistryOptions::new(node.clone(), flags.cluster_name.clone(), identity.boot_id.to_string())
        },
        node_store,
        backend.clone(),
        ipcache.clone(),
    );
    registry.run(&controllers);
    // Every entry reaches this node's datapath (retrying until svc-loader
    // is up), and with a routing mode the peer nodes too.
    let loader_sync = LoaderSync::new(
        ipcache.clone(),
        LoaderSyncOptions {
            peers: routing.is_some().then(|| registry.peer_nodes()),
            ..LoaderSyncOptions::new(flags.common.socket_path("svc-loader"))
        },
    );
    loader_sync.run(&controllers);
    allocator.run(&controllers);
    if let Some(writer) = &snapshot_writer {
        writer.run(&controllers);
    }
    let mut metrics_registry = Registry::with_prefix("rivet");
    {
        let (allocator, ipcache) = (allocator.clone(), ipcache.clone());
        metrics.register(&mut metrics_registry, move || {
            vec![
                (ReconciledKeys::ValueKeys, allocator.pending_writes()),
                (ReconciledKeys::IpEntries, ipcache.pending_writes()),
            ]
        });
    }

    let cidrs = Arc::new(CidrIdentities::new(ipcache.clone()));
    let mut service =
        IdentityService::new(allocator, cidrs, identity.boot_id.clone()).with_ipcache(ipcache.clone(), loader_sync);
    if let Some(watchdog) = heartbeat {
        watchdog.register(&mut metrics_registry);
        service = service.with_heartbeat(watchdog);
    }
    let routes = Routes::new(service.into_server())
        .add_service(IpcacheService::new(ipcache, identity.boot_id.clone()).into_server())
        .add_service(NodeService::new(registry).into_server());
    let served = daemon::run(
        &flags.common,
        listener,
        identity,
        controllers,
        routes,
        metrics_registry,
        Health::default(),
    )
    .await;
    // A clean stop (SIGTERM/SIGINT): the controllers stopped with the
    // server, so no pass writes any more; the snapshot holds the last state,
    // and this node's keys go now, not after the lease TTL (a crash leaves
    // them to the TTL).
    if let Some(writer) = &snapshot_writer {
        writer.write_last().await;
    }
    backend.shutdown().await;
    served?;
    Ok(())
}

/// `--max-identity`: a number inside the cluster range.
fn max_cluster_identity(text: &str) -> Result<u32, String> {
    let max = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    identity::check_max_cluster_identity(max).map_err(|e| e.to_string())?;
    Ok(max)
}

/// `--pod-cidr`: a prefix without host bits.
fn pod_cidr(text: &str) -> Result<IpNet, String> {
    let net: IpNet = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    if net.trunc() != net {
        return Err(format!("{text} has host bits set (the prefix is {})", net.trunc()));
    }
    Ok(net)
}

//! rivet-operator: flags and wiring; the logic lives in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::controller::Controllers;
use rivet_common::grpc::{self, BootId};
use rivet_common::metrics::Health;
use rivet_common::telemetry::{self, LogFormat, TelemetryOptions};
use rivet_common::{config, daemon};
use rivet_k8s::ClusterAccess;
use rivet_operator::cluster_pool::{ClusterPool, ClusterPoolArgs, PoolMetrics};
use rivet_operator::heartbeat::{HeartbeatArgs, KvstoreHeartbeat};
use rivet_operator::identity_gc::{IdentityGcArgs, IdentityGcDuty, IdentityGcMetrics};
use rivet_operator::kvstore::KvstoreArgs;
use rivet_operator::kvstore_mirror::{KvstoreMirror, MirrorArgs};
use rivet_operator::leader::{ElectionMetrics, Elector, LeaderElectionArgs};
use rivet_operator::stale::{StaleArgs, StaleMetrics, StaleObjects};
use rivet_operator::term::Duty;

const NAME: &str = "rivet-operator";

/// Rivet's cluster-scope duties (pod CIDRs per node, identity GC, the
/// kvstore heartbeat, node and service mirrors in the kvstore, stale-object
/// GC). Run two or more replicas: they elect a leader on a Lease and only
/// the leader works. None of it is in the datapath: a cluster without an
/// operator keeps forwarding.
///
/// Every flag can also be set by its environment variable or by a file
/// named after it in --config-dir (precedence: flag, env, file, default).
#[derive(Debug, Parser)]
#[command(name = NAME, version, about, long_about)]
struct Flags {
    /// How to reach the API server: the path of a kubeconfig (its current
    /// context), or `in-cluster` for the pod's ServiceAccount.
    #[arg(long, env = "RIVET_KUBECONFIG", default_value = ClusterAccess::IN_CLUSTER)]
    kubeconfig: ClusterAccess,

    /// Address of the HTTP listener for `/metrics` and `/healthz` (off when
    /// unset), e.g. `0.0.0.0:9963`. `/healthz` answers 200 while the process
    /// runs, leader or standby.
    #[arg(long, env = "RIVET_METRICS_ADDRESS")]
    metrics_address: Option<SocketAddr>,

    /// Log format on stderr (level: `RUST_LOG`, default `info`). Traces go
    /// to OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
    #[arg(long, env = "RIVET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// Directory of configuration files, one per flag (file name = flag
    /// name, e.g. a mounted ConfigMap).
    #[arg(long, env = "RIVET_CONFIG_DIR")]
    config_dir: Option<PathBuf>,

    /// Only check the configuration: parse the flags, environment and config
    /// dir, say whether they are valid, and exit (0 when they are).
    #[arg(long)]
    check_config: bool,

    #[command(flatten)]
    election: LeaderElectionArgs,

    #[command(flatten)]
    kvstore: KvstoreArgs,

    #[command(flatten)]
    identity_gc: IdentityGcArgs,

    #[command(flatten)]
    cluster_pool: ClusterPoolArgs,

    #[command(flatten)]
    stale: StaleArgs,

    #[command(flatten)]
    heartbeat: HeartbeatArgs,

    #[command(flatten)]
    kvstore_mirror: MirrorArgs,
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    daemon::exit(NAME, run(flags))
}

#[tokio::main]
async fn run(flags: Flags) -> anyhow::Result<()> {
    let boot_id = BootId::random();
    // Checked first: a bad election setting is refused before anything runs.
    let election = flags.election.config(boot_id.as_str())?;
    flags.identity_gc.store(&flags.kvstore)?;
    let pool = flags.cluster_pool.pool()?;
    let _telemetry = telemetry::init(TelemetryOptions {
        service_name: NAME.into(),
        log_format: flags.log_format,
        default_filter: "info".into(),
        resource_attributes: vec![
            ("service.version".into(), env!("CARGO_PKG_VERSION").into()),
            ("service.instance.id".into(), boot_id.to_string()),
        ],
    })?;
    let client = flags.kubeconfig.client().await?;

    let controllers = Controllers::new();
    let metrics = ElectionMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let identity_gc_metrics = IdentityGcMetrics::default();
    identity_gc_metrics.register(&mut registry);
    let cluster_pool_metrics = PoolMetrics::registered(&mut registry);
    let stale_metrics = StaleMetrics::default();
    stale_metrics.register(registry.sub_registry_with_prefix("operator"));
    // The kvstore duties (heartbeat, mirrors), with --etcd-endpoints only.
    let mut kvstore_duties: Vec<Arc<dyn Duty>> = Vec::new();
    if flags.kvstore.enabled() {
        let etcd = flags.kvstore.connect().await?;
        let layout = flags.kvstore.layout();
        let heartbeat = KvstoreHeartbeat::new(etcd.clone(), &layout, flags.heartbeat.kvstore_heartbeat_interval);
        heartbeat.register(&mut registry);
        let resync = flags.kvstore_mirror.kvstore_mirror_resync;
        let mirror = KvstoreMirror::new(client.clone(), etcd, layout, resync);
        mirror.register(&mut registry);
        kvstore_duties.extend([Arc::new(heartbeat) as Arc<dyn Duty>, Arc::new(mirror)]);
    }
    controllers.register_metrics(&mut registry);

    let health = Health::default();
    if let Some(address) = flags.metrics_address {
        daemon::serve_metrics(address, &controllers, registry, health.clone()).await?;
    }

    // The duties every term starts, one line each.
    let mut duties: Vec<Arc<dyn Duty>> = vec![
        Arc::new(IdentityGcDuty::new(
            flags.identity_gc,
            flags.kvstore.clone(),
            client.clone(),
            identity_gc_metrics,
        )?),
        Arc::new(ClusterPool::new(
            client.clone(),
            pool,
            flags.cluster_pool.grace(),
            cluster_pool_metrics,
        )),
        Arc::new(StaleObjects::new(client.clone(), flags.stale, stale_metrics)),
    ];
    duties.extend(kvstore_duties);

    tracing::info!(
        identity = election.identity,
        lease = format!("{}/{}", election.namespace, election.lease_name),
        access = %flags.kubeconfig,
        duties = duties.len(),
        kvstore = flags.kvstore.enabled(),
        "competing for leadership"
    );
    let elector = Elector::start(client, election, duties, metrics, &controllers);
    health.set_serving();
    grpc::shutdown_signal().await;
    health.set_unhealthy("shutting down");
    let released = elector.shutdown().await;
    controllers.shutdown().await;
    released.context("releasing the Lease on shutdown")?;
    Ok(())
}

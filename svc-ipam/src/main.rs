//! svc-ipam: flags and wiring; the logic lives in the library.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::Controllers;
use rivet_common::daemon;
use rivet_common::grpc::DaemonIdentity;
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use svc_ipam::events::IpamMetrics;
use svc_ipam::pool::{PoolSet, PoolSpec};
use svc_ipam::service::IpamService;
use svc_ipam::store::IpamStore;
use tonic::service::Routes;

/// Rivet's per-node address pools.
#[derive(Debug, Parser)]
#[command(name = "svc-ipam", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// An address pool, NAME=CIDR[,CIDR...] (IPv4 and/or IPv6); repeat for
    /// several pools. In the env var, separate pools with ';'. Fixed for the
    /// process' lifetime. Without any, svc-ipam waits for its pool from
    /// SetPool (cluster-pool IPAM: svc-k8s-sync sets the node's pod CIDRs),
    /// degraded until then; a pool set so is kept in the state dir.
    #[arg(long = "pool", env = "RIVET_IPAM_POOL", value_delimiter = ';')]
    pools: Vec<PoolSpec>,
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_ipam::DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_ipam::DAEMON_NAME, svc_ipam::CAPABILITIES);
    daemon::exit(
        svc_ipam::DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(
        svc_ipam::DAEMON_NAME,
        env!("CARGO_PKG_VERSION"),
        flags.common.node_name(),
    );
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let pools = PoolSet::new(&flags.pools).context("invalid --pool configuration")?;
    // The socket lock comes first: it keeps a second instance off the state.
    let listener = daemon::bind_socket(&flags.common, svc_ipam::DAEMON_NAME, svc_ipam::READ_ONLY_METHODS)?;

    let metrics = IpamMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let store = Arc::new(IpamStore::open(
        &flags.common.state_dir.join("ipam"),
        pools,
        metrics.clone(),
    )?);
    let controllers = Controllers::new();
    svc_ipam::report_missing_pool(&controllers, store.clone());

    let service = IpamService::new(store, identity.boot_id.clone(), metrics);
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
    .await?;
    Ok(())
}

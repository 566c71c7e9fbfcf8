//! svc-endpoint: flags and wiring; the logic lives in the library.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use prometheus_client::registry::Registry;
use rivet_common::config::{self, CommonArgs};
use rivet_common::controller::Controllers;
use rivet_common::daemon;
use rivet_common::grpc::{ClientOptions, DaemonIdentity};
use rivet_common::metrics::Health;
use rivet_common::privileges::Dropped;
use svc_endpoint::catalog::{CatalogMetrics, CatalogOptions, ServiceCatalog};
use svc_endpoint::catalog_api::ServiceCatalogApi;
use svc_endpoint::clients::{GrpcIdentity, GrpcIpam, GrpcLoader, GrpcPodDirectory, PodDirectoryApi};
use svc_endpoint::events::EndpointMetrics;
use svc_endpoint::manager::{Dependencies, EndpointManager, ManagerOptions, PolicySources};
use svc_endpoint::policy_dir::PolicyDirectory;
use svc_endpoint::service::EndpointApi;
use tonic::service::Routes;

/// Rivet's endpoint orchestrator: endpoint lifecycle, policy, restore.
#[derive(Debug, Parser)]
#[command(name = "svc-endpoint", version, about)]
struct Flags {
    #[command(flatten)]
    common: CommonArgs,

    /// A directory of NetworkPolicy / RivetNetworkPolicy files (YAML or
    /// JSON), watched; its policies have origin DIRECTORY.
    #[arg(long, env = "RIVET_POLICY_DIR")]
    policy_dir: Option<std::path::PathBuf>,

    /// How often the policy dir is reread even without change events, seconds.
    #[arg(long, env = "RIVET_POLICY_DIR_RESCAN_SECONDS", default_value_t = 30)]
    policy_dir_rescan_seconds: u64,

    /// Regenerations running at once.
    #[arg(long, env = "RIVET_REGENERATION_CONCURRENCY", default_value_t = 16)]
    regeneration_concurrency: usize,

    /// Let traffic from the node itself (host identity) reach local pods
    /// whatever the policy, so kubelet probes work.
    #[arg(long, env = "RIVET_ALLOW_FROM_HOST", default_value_t = true, action = clap::ArgAction::Set)]
    allow_from_host: bool,

    /// How often the other daemons' boot ids are checked (a new one replays
    /// everything they should hold), milliseconds.
    #[arg(long, env = "RIVET_DEPENDENCY_POLL_MS", default_value_t = 1000)]
    dependency_poll_ms: u64,

    /// How often svc-loader is asked which endpoints lost their host
    /// interface (they are dropped and their addresses released, as when a
    /// runtime never calls DEL), milliseconds; 0 disables the check.
    #[arg(long, env = "RIVET_INTERFACE_CHECK_MS", default_value_t = 10_000)]
    interface_check_ms: u64,

    /// Deadline of each call to svc-identity, svc-ipam and svc-loader, seconds.
    #[arg(long, env = "RIVET_CALL_TIMEOUT_SECONDS", default_value_t = 10)]
    call_timeout_seconds: u64,

    /// Kubernetes mode: svc-k8s-sync's socket. Pod labels and named ports
    /// then come from svc-k8s-sync (PodMetadataService) only, never from
    /// the CNI call; a pod whose labels are not known yet runs on the
    /// reserved init identity; restore asks it whether each pod still
    /// exists.
    #[arg(long, env = "RIVET_K8S_SYNC_SOCKET")]
    k8s_sync_socket: Option<std::path::PathBuf>,

    /// The policy origins accepted, comma-separated: api, directory,
    /// kubernetes. Default: api,directory; all three in Kubernetes mode.
    #[arg(long, env = "RIVET_POLICY_SOURCES", value_parser = PolicySources::parse)]
    policy_sources: Option<PolicySources>,

    /// Where Services' cluster IPs are allocated from, at most one CIDR per
    /// family (repeat the flag or separate with commas). A clusterIP that a
    /// Service applied through the API asks for must be in one of them.
    #[arg(long = "service-cidr", env = "RIVET_SERVICE_CIDR", value_delimiter = ',')]
    service_cidrs: Vec<ipnet::IpNet>,
}

fn main() -> ExitCode {
    let flags: Flags = config::load();
    // Before any thread starts: the allocator hands out arenas per thread.
    if let Err(e) = rivet_common::malloc::tune_for_daemon() {
        return daemon::exit(svc_endpoint::DAEMON_NAME, Err(e));
    }
    // First, before the runtime starts threads: credentials are per thread.
    let privileges = daemon::drop_privileges(&flags.common, svc_endpoint::DAEMON_NAME, svc_endpoint::CAPABILITIES);
    daemon::exit(
        svc_endpoint::DAEMON_NAME,
        privileges.map_err(anyhow::Error::from).and_then(|p| run(flags, p)),
    )
}

#[tokio::main]
async fn run(flags: Flags, privileges: Dropped) -> anyhow::Result<()> {
    let identity = DaemonIdentity::new(
        svc_endpoint::DAEMON_NAME,
        env!("CARGO_PKG_VERSION"),
        flags.common.node_name(),
    );
    let _telemetry = daemon::init_telemetry(&flags.common, &identity)?;
    privileges.log();
    let listener = daemon::bind_socket(
        &flags.common,
        svc_endpoint::DAEMON_NAME,
        svc_endpoint::READ_ONLY_METHODS,
    )?;

    let client = ClientOptions {
        request_timeout: Duration::from_secs(flags.call_timeout_seconds.max(1)),
        ..ClientOptions::default()
    };
    let loader = Arc::new(GrpcLoader::new(&flags.common.socket_path("svc-loader"), &client));
    let deps = Dependencies {
        identity: Arc::new(GrpcIdentity::new(&flags.common.socket_path("svc-identity"), &client)),
        ipam: Arc::new(GrpcIpam::new(&flags.common.socket_path("svc-ipam"), &client)),
        loader: loader.clone(),
        pods: flags
            .k8s_sync_socket
            .as_deref()
            .map(|socket| Arc::new(GrpcPodDirectory::new(socket, &client)) as Arc<dyn PodDirectoryApi>),
    };
    let policy_sources = flags
        .policy_sources
        .unwrap_or_else(|| PolicySources::default_for(flags.k8s_sync_socket.is_some()));
    if flags.policy_dir.is_some() && !policy_sources.accepts(rivet_policy::PolicyOrigin::Directory) {
        anyhow::bail!("--policy-dir is given but `directory` is not one of --policy-sources ({policy_sources})");
    }
    let options = ManagerOptions {
        regeneration_concurrency: flags.regeneration_concurrency.max(1),
        allow_from_host: flags.allow_from_host,
        dependency_poll: Duration::from_millis(flags.dependency_poll_ms.max(100)),
        interface_check: Duration::from_millis(flags.interface_check_ms),
        policy_sources: Some(policy_sources),
        ..ManagerOptions::new(flags.common.state_dir.clone())
    };
    let metrics = EndpointMetrics::default();
    let mut registry = Registry::with_prefix("rivet");
    metrics.register(&mut registry);
    let manager = EndpointManager::new(options, deps, metrics)?;
    let catalog_metrics = CatalogMetrics::default();
    catalog_metrics.register(&mut registry);
    let catalog = ServiceCatalog::new(
        CatalogOptions {
            loader_poll: Duration::from_millis(flags.dependency_poll_ms.max(100)),
            ..CatalogOptions::new(
                flags.common.state_dir.clone(),
                flags.service_cidrs.clone(),
                flags.common.node_name(),
            )
        },
        loader,
        Arc::new(manager.clone()),
        catalog_metrics,
    )?;
    let controllers = Controllers::new();
    manager.start(&controllers);
    catalog.start(&controllers);
    if let Some(dir) = flags.policy_dir.clone() {
        PolicyDirectory::new(
            dir,
            manager.clone(),
            Duration::from_secs(flags.policy_dir_rescan_seconds.max(1)),
        )
        .start(&controllers);
    }

    let (endpoints, policies, namespaces, pod_metadata) = EndpointApi::new(manager, identity.boot_id.clone())
        .with_catalog(catalog.clone())
        .into_servers();
    let routes = Routes::new(endpoints)
        .add_service(ServiceCatalogApi::new(catalog).into_server())
        .add_service(policies)
        .add_service(namespaces)
        .add_service(pod_metadata);
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

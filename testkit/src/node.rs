//! A whole simulated node — the node network namespace with svc-loader
//! inside it, svc-identity (embedded store, or etcd through
//! [`NodeOptions::identity_args`]), svc-ipam, svc-endpoint and, with
//! [`NodeOptions::gc_args`], svc-gc as real processes sharing one socket
//! dir — and pods wired to it, all removed on drop.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::netns::{PodSpec, TestPod};
use rivet_common::testing::{DaemonCommand, DaemonProcess, workspace_binary};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::loader::v1 as ldpb;
use svc_endpoint::clients::{GrpcIdentity, GrpcIpam, GrpcLoader};
use svc_endpoint::manager::Dependencies;

use crate::jaeger::OtlpRelay;
use crate::loader::{DEFAULT_ENDPOINTS_MAX, LoaderNode};

/// The node's IPv4 pool (the gateway .1 is answered by the datapath).
pub const POOL4: &str = "198.18.0.0/22";
/// The node's IPv6 pool.
pub const POOL6: &str = "2001:2::/64";

/// How often the daemons export their finished spans with
/// [`NodeOptions::otlp`] (`OTEL_BSP_SCHEDULE_DELAY`, ms; the SDK's default
/// is 5 s): a test sees a trace without stopping the daemons.
pub const EXPORT_DELAY_MS: &str = "100";

/// A node running all four node daemons (five with svc-gc). Fields drop in
/// order: svc-gc, the unprivileged daemons, then the loader node (loader,
/// namespaces, pins, temp dir).
#[derive(Debug)]
pub struct EndpointNode {
    /// svc-gc (with [`NodeOptions::gc_args`]), on the loader's pinned maps.
    pub gc: Option<DaemonProcess>,
    /// svc-endpoint (absent with [`NodeOptions::without_endpoint_daemon`]).
    pub endpoint: Option<DaemonProcess>,
    /// svc-identity (embedded store).
    pub identity: DaemonProcess,
    /// svc-ipam.
    pub ipam: DaemonProcess,
    /// The node namespace, its pods and svc-loader.
    pub node: LoaderNode,
    /// The relay from the node namespace to the OTLP receiver (with
    /// [`NodeOptions::otlp`]): its [`endpoint`](OtlpRelay::endpoint) is the
    /// one for processes inside the namespace (svc-loader, rivet-cni).
    pub otlp_relay: Option<OtlpRelay>,
}

/// Extra flags per daemon.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// Added to svc-endpoint's command line.
    pub endpoint_args: Vec<String>,
    /// Do not start svc-endpoint (a test runs the manager in-process).
    pub without_endpoint_daemon: bool,
    /// Export every daemon's spans to this OTLP/gRPC receiver on the host's
    /// loopback (e.g. [`Jaeger::otlp_addr`](crate::jaeger::Jaeger::otlp_addr)):
    /// the daemons in the host namespace directly, svc-loader through a
    /// relay inside the node namespace ([`EndpointNode::otlp_relay`]).
    pub otlp: Option<std::net::SocketAddr>,
    /// Where the daemon binaries are; `None`: beside the running test
    /// ([`workspace_binary`]). A benchmark binary (`target/<profile>/`,
    /// not `deps/`) passes its own directory.
    pub bin_dir: Option<PathBuf>,
    /// svc-loader's `--endpoints-max` (one entry per endpoint plus one per
    /// address; the ipcache gets twice as many entries, at least 4096).
    /// `None`: the test loader's [`DEFAULT_ENDPOINTS_MAX`].
    pub loader_endpoints_max: Option<u32>,
    /// Run svc-endpoint in Kubernetes mode, its pod metadata from
    /// svc-k8s-sync at `<sockets>/svc-k8s-sync.sock` (which the test starts).
    pub k8s_sync: bool,
    /// Cluster-pool IPAM: svc-ipam starts without `--pool` and waits for
    /// its pool from SetPool (svc-k8s-sync with `--ipam-mode cluster-pool`,
    /// which the test starts, or the test itself).
    pub cluster_pool: bool,
    /// svc-ipam's IPv4 CIDR; `None`: [`POOL4`] (a /22: 1000 pods).
    pub pool4: Option<String>,
    /// Added to svc-loader's command line (map sizes replace the test
    /// loader's: `--ct-max`, `--policy-max`, ...).
    pub loader_args: Vec<String>,
    /// Added to svc-identity's command line (e.g. `--etcd-endpoints` for a
    /// real store instead of the embedded one).
    pub identity_args: Vec<String>,
    /// Start svc-gc too, with these flags added.
    pub gc_args: Option<Vec<String>>,
}

impl NodeOptions {
    /// The path of daemon `name` under these options.
    pub fn binary(&self, name: &str) -> PathBuf {
        match &self.bin_dir {
            Some(dir) => dir.join(name),
            None => workspace_binary(name),
        }
    }
}

impl EndpointNode {
    /// Starts the node: svc-loader, svc-ipam, svc-identity, svc-endpoint.
    pub async fn start(options: NodeOptions) -> std::io::Result<Self> {
        // svc-loader runs in the node namespace, where the host's loopback
        // (and the receiver on it) is out of reach: it exports through a relay.
        let mut otlp_relay = None;
        let endpoints_max = options.loader_endpoints_max.unwrap_or(DEFAULT_ENDPOINTS_MAX);
        let loader_args: Vec<&str> = options.loader_args.iter().map(String::as_str).collect();
        let node = LoaderNode::start_with_env(
            &options.binary("svc-loader"),
            &[],
            &loader_args,
            endpoints_max,
            |node| {
                let Some(receiver) = options.otlp else {
                    return Ok(Vec::new());
                };
                let relay = OtlpRelay::start(&node.ns, receiver).map_err(std::io::Error::other)?;
                let endpoint = relay.endpoint();
                otlp_relay = Some(relay);
                Ok(vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
                    ("OTEL_BSP_SCHEDULE_DELAY".into(), EXPORT_DELAY_MS.into()),
                ])
            },
        )
        .await?;
        let otlp_env = options.otlp.map(|addr| format!("http://{addr}"));
        let dir = node.dir.path().to_path_buf();
        let sockets = dir.join("sockets");
        let common = |name: &str| {
            let command = DaemonCommand::new(options.binary(name), sockets.join(format!("{name}.sock")))
                .args(["--socket-dir".as_ref(), sockets.as_os_str()])
                .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
                .args(["--node-name", &node.node_name])
                .log_to(dir.join(format!("{name}.log")));
            match &otlp_env {
                Some(endpoint) => command
                    .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
                    .env("OTEL_BSP_SCHEDULE_DELAY", EXPORT_DELAY_MS),
                None => command,
            }
        };
        let pool = format!("default={},{POOL6}", options.pool4.as_deref().unwrap_or(POOL4));
        let ipam = common("svc-ipam")
            .args(if options.cluster_pool {
                Vec::new()
            } else {
                vec!["--pool", pool.as_str()]
            })
            .spawn()
            .await?;
        let identity = common("svc-identity").args(&options.identity_args).spawn().await?;
        let endpoint = if options.without_endpoint_daemon {
            None
        } else {
            Some(
                common("svc-endpoint")
                    .args(["--dependency-poll-ms", "200"])
                    .args(if options.k8s_sync {
                        vec![
                            "--k8s-sync-socket".into(),
                            sockets.join("svc-k8s-sync.sock").into_os_string(),
                        ]
                    } else {
                        Vec::new()
                    })
                    .args(&options.endpoint_args)
                    .spawn()
                    .await?,
            )
        };
        let gc = match &options.gc_args {
            Some(args) => {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                Some(
                    crate::gc::daemon_command(&options.binary("svc-gc"), &dir, &node.node_name, &args)
                        .spawn()
                        .await?,
                )
            }
            None => None,
        };
        Ok(Self {
            gc,
            endpoint,
            identity,
            ipam,
            node,
            otlp_relay,
        })
    }

    /// The socket dir all daemons share.
    pub fn sockets(&self) -> PathBuf {
        self.node.dir.path().join("sockets")
    }

    /// A channel to `daemon`'s socket (`svc-endpoint`, `svc-ipam`, ...)
    /// with `options`, for clients that set their own deadlines.
    pub async fn connect(
        &self,
        daemon: &str,
        options: &ClientOptions,
    ) -> Result<DaemonChannel, rivet_common::grpc::ConnectError> {
        connect_unix(&self.sockets().join(format!("{daemon}.sock")), options).await
    }

    /// The shared state dir.
    pub fn state_dir(&self) -> PathBuf {
        self.node.dir.path().join("state")
    }

    async fn channel(&self, socket: &Path) -> DaemonChannel {
        connect_unix(socket, &ClientOptions::default())
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()))
    }

    /// The svc-endpoint process.
    pub fn endpoint_daemon(&mut self) -> &mut DaemonProcess {
        self.endpoint.as_mut().expect("this node runs svc-endpoint")
    }

    fn endpoint_socket(&self) -> PathBuf {
        self.sockets().join("svc-endpoint.sock")
    }

    /// A client of svc-endpoint's EndpointService.
    pub async fn endpoints(&self) -> EndpointServiceClient<DaemonChannel> {
        EndpointServiceClient::new(self.channel(&self.endpoint_socket()).await)
    }

    /// A client of svc-endpoint's PolicyService.
    pub async fn policies(&self) -> PolicyServiceClient<DaemonChannel> {
        PolicyServiceClient::new(self.channel(&self.endpoint_socket()).await)
    }

    /// Clients of the node's svc-identity, svc-ipam and svc-loader, for an
    /// in-process [`EndpointManager`](svc_endpoint::manager::EndpointManager).
    pub fn dependencies(&self) -> Dependencies {
        let options = ClientOptions::default();
        let sockets = self.sockets();
        Dependencies {
            identity: Arc::new(GrpcIdentity::new(&sockets.join("svc-identity.sock"), &options)),
            ipam: Arc::new(GrpcIpam::new(&sockets.join("svc-ipam.sock"), &options)),
            loader: Arc::new(GrpcLoader::new(&sockets.join("svc-loader.sock"), &options)),
            pods: None,
        }
    }

    /// A client of svc-ipam.
    pub async fn ipam_client(&self) -> IpamClient<DaemonChannel> {
        IpamClient::new(self.channel(self.ipam.socket()).await)
    }

    /// Allocates a dual-stack address pair from svc-ipam for pod `name`
    /// (container id = name, interface eth0) and wires a pod namespace with
    /// them; no endpoint yet. Returns the pod.
    pub async fn add_pod_interface(&mut self, name: &str) -> &TestPod {
        let ipam = self.ipam_client().await;
        let allocate = |family: ipampb::Family| {
            let request = ipampb::AllocateRequest {
                owner: Some(ipampb::Owner {
                    container_id: name.into(),
                    interface: "eth0".into(),
                }),
                pool: "default".into(),
                family: family.into(),
                requested_address: Vec::new(),
            };
            let mut ipam = ipam.clone();
            async move {
                ipam.allocate(request)
                    .await
                    .expect("svc-ipam must allocate a pod address")
                    .into_inner()
                    .allocation
                    .expect("an allocation")
            }
        };
        let v4 = allocate(ipampb::Family::Ipv4).await;
        let v6 = allocate(ipampb::Family::Ipv6).await;
        let parse4 = |a: &[u8]| Ipv4Addr::from(<[u8; 4]>::try_from(a).expect("svc-ipam returns IPv4 bytes"));
        let parse6 = |a: &[u8]| Ipv6Addr::from(<[u8; 16]>::try_from(a).expect("svc-ipam returns IPv6 bytes"));
        let spec = PodSpec::new(
            name,
            (parse4(&v4.address), v4.prefix_length as u8),
            (parse6(&v6.address), v6.prefix_length as u8),
        )
        .gateways(parse4(&v4.gateway), parse6(&v6.gateway));
        self.node
            .node
            .add_pod(spec)
            .unwrap_or_else(|e| panic!("wiring pod {name}: {e}"))
    }

    /// The CreateEndpoint request for a wired pod (synchronous, namespace
    /// `default`, pod name = `name`).
    pub fn create_request(&self, name: &str, labels: &[&str]) -> pb::CreateEndpointRequest {
        let pod = self.node.pod(name);
        pb::CreateEndpointRequest {
            container_id: name.into(),
            interface: "eth0".into(),
            netns_path: pod.ns.path().display().to_string(),
            host_interface: pod.host_ifname.clone(),
            host_ifindex: pod.host_ifindex,
            addresses: pod
                .addrs()
                .into_iter()
                .map(|a| pb::EndpointAddress {
                    address: rivet_proto::net::address_bytes(a),
                    ipam_pool: "default".into(),
                })
                .collect(),
            mac: pod.pod_mac.to_vec(),
            pod_namespace: "default".into(),
            pod_name: name.into(),
            labels: labels.iter().map(|l| (*l).to_string()).collect(),
            ..Default::default()
        }
    }

    /// Wires pod `name` and creates its endpoint synchronously with `labels`.
    pub async fn add_pod(&mut self, name: &str, labels: &[&str]) -> pb::Endpoint {
        self.add_pod_with_ports(name, labels, Vec::new()).await
    }

    /// [`add_pod`](Self::add_pod) with named container ports.
    pub async fn add_pod_with_ports(
        &mut self,
        name: &str,
        labels: &[&str],
        named_ports: Vec<pb::NamedPort>,
    ) -> pb::Endpoint {
        self.add_pod_interface(name).await;
        let mut request = self.create_request(name, labels);
        request.named_ports = named_ports;
        self.endpoints()
            .await
            .create_endpoint(request)
            .await
            .unwrap_or_else(|e| panic!("creating the endpoint of {name}: {e}"))
            .into_inner()
            .endpoint
            .expect("the created endpoint")
    }

    /// Deletes endpoint `id` through svc-endpoint; the ids it deleted (none
    /// when it was gone already).
    pub async fn delete_endpoint(&self, id: u32) -> Vec<u32> {
        self.endpoints()
            .await
            .delete_endpoint(pb::DeleteEndpointRequest {
                r#ref: Some(pb::EndpointRef {
                    r#ref: Some(pb::endpoint_ref::Ref::Id(id)),
                }),
            })
            .await
            .unwrap_or_else(|e| panic!("deleting endpoint {id}: {e}"))
            .into_inner()
            .deleted
    }

    /// svc-loader's listing: its endpoints, and attachments and policy
    /// entries that belong to none.
    pub async fn datapath_endpoints(&self) -> ldpb::ListEndpointsResponse {
        self.node
            .client()
            .await
            .list_endpoints(ldpb::ListEndpointsRequest {})
            .await
            .unwrap_or_else(|e| panic!("svc-loader ListEndpoints: {e}"))
            .into_inner()
    }

    /// The policy svc-loader holds for endpoint `endpoint_id`.
    pub async fn datapath_policy(&self, endpoint_id: u32) -> ldpb::GetEndpointPolicyResponse {
        self.node
            .client()
            .await
            .get_endpoint_policy(ldpb::GetEndpointPolicyRequest { endpoint_id })
            .await
            .unwrap_or_else(|e| panic!("GetEndpointPolicy of endpoint {endpoint_id}: {e}"))
            .into_inner()
    }

    /// svc-identity's node-local identities, with their owners.
    pub async fn local_identities(&self) -> idpb::ListIdentitiesResponse {
        IdentityServiceClient::new(self.channel(self.identity.socket()).await)
            .list_identities(idpb::ListIdentitiesRequest {
                local_only: true,
                include_owners: true,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("svc-identity ListIdentities: {e}"))
            .into_inner()
    }

    /// Every address svc-ipam holds (orphaned ones included).
    pub async fn allocations(&self) -> Vec<ipampb::Allocation> {
        let listing = self
            .ipam_client()
            .await
            .list(ipampb::ListRequest {
                pool: String::new(),
                include_allocations: true,
            })
            .await
            .unwrap_or_else(|e| panic!("svc-ipam List: {e}"))
            .into_inner();
        listing
            .pools
            .into_iter()
            .flat_map(|p| p.allocations)
            .chain(listing.orphaned)
            .collect()
    }

    /// The endpoint of pod `namespace/name`, as svc-endpoint reports it.
    pub async fn endpoint_of_pod(&self, namespace: &str, name: &str) -> pb::Endpoint {
        self.endpoints()
            .await
            .get_endpoint(pb::GetEndpointRequest {
                r#ref: Some(pb::EndpointRef {
                    r#ref: Some(pb::endpoint_ref::Ref::Pod(pb::PodRef {
                        namespace: namespace.into(),
                        name: name.into(),
                    })),
                }),
            })
            .await
            .unwrap_or_else(|e| panic!("getting the endpoint of {namespace}/{name}: {e}"))
            .into_inner()
            .endpoint
            .expect("GetEndpoint returns the endpoint")
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> &TestPod {
        self.node.pod(name)
    }

    /// A pod's IPv4 address.
    pub fn ipv4(&self, name: &str) -> IpAddr {
        self.pod(name).ipv4().expect("test pods are dual-stack")
    }

    /// Upserts a policy document and waits until every affected endpoint
    /// realised it.
    pub async fn apply_policy(&self, document: &str) -> pb::UpsertPolicyResponse {
        self.policies()
            .await
            .upsert_policy(pb::UpsertPolicyRequest {
                document: document.into(),
                origin: pb::PolicyOrigin::Api.into(),
                wait: true,
            })
            .await
            .unwrap_or_else(|e| panic!("applying a policy: {e}"))
            .into_inner()
    }
}

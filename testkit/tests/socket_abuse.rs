//! Every daemon's socket under abuse (issue 19 §4), with the real binaries
//! on one simulated node, each started with `--allowed-uids 0` and its socket
//! file then given to group nogroup by the test (a daemon may only pick a
//! group it is in), so that uid 65534 gets past the file mode to the
//! per-call check:
//!
//! - a peer whose uid is not allowed is refused every call with
//!   PERMISSION_DENIED naming its uid and the method, and the daemon's state
//!   is what it was;
//! - a request beyond the message size limit (4 MiB) is refused with
//!   OUT_OF_RANGE or RESOURCE_EXHAUSTED, one with 64 KiB of metadata (the
//!   HTTP/2 header list limit is 16 KiB) is refused too, and the daemon
//!   keeps serving;
//! - 500 connected, silent sockets do not delay a normal client's call;
//! - beyond `--max-connections`, new connections of peers without full
//!   access are closed at once and counted, and root is still served;
//! - a daemon out of file descriptors pauses its accept loop instead of
//!   spinning, and serves again once descriptors come free.
//!
//! Other uids connect through `rivet_common::testing::peer` (a thread with
//! its own credentials), so no helper process is needed.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::{Buf as _, BufMut as _};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::netns::NetNs;
use rivet_common::testing::peer::{Credentials, channel_as, connect_as};
use rivet_common::testing::{DaemonCommand, DaemonProcess, workspace_binary};
use rivet_proto::daemon::v1 as dpb;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::gc::v1 as gcpb;
use rivet_proto::health::v1 as hpb;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::k8s::v1 as k8spb;
use rivet_proto::loader::v1 as ldpb;
use rivet_testkit::loader::LoaderNode;
use tonic::Code;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// nogroup: the socket files' group, so that uid 65534 gets past the file mode.
const NOGROUP: u32 = 65534;
/// The flags every daemon gets: only root may call.
const ACCESS: [&str; 2] = ["--allowed-uids", "0"];
/// Each daemon's `--max-connections` here (the test opens more).
const MAX_CONNECTIONS: usize = 520;
/// Silent connections held open while a normal client calls.
const IDLE: usize = 500;
/// How long a normal call may take with them open: its usual deadline
/// (blocked calls would wait forever; unloaded, they take a few ms).
const CALL_WITHIN: Duration = Duration::from_secs(10);

/// A node running every daemon that has a socket.
struct Node {
    loader: LoaderNode,
    daemons: Vec<DaemonProcess>,
    _health_ns: NetNs,
    sockets: PathBuf,
}

impl Node {
    async fn start() -> Self {
        let max = MAX_CONNECTIONS.to_string();
        let mut loader_args = ACCESS.to_vec();
        loader_args.extend(["--max-connections", &max]);
        let loader = LoaderNode::start(&workspace_binary("svc-loader"), &[], &loader_args)
            .await
            .expect("svc-loader starts");
        let dir = loader.dir.path().to_path_buf();
        // nobody must be able to reach the socket dir (a temp dir is 0700).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        let sockets = dir.join("sockets");
        std::fs::set_permissions(&sockets, std::fs::Permissions::from_mode(0o711)).unwrap();
        let ns = loader.node.ns.path();
        let common = |name: &str, in_node_ns: bool| {
            let bin = workspace_binary(name);
            let command = if in_node_ns {
                DaemonCommand::new("nsenter", sockets.join(format!("{name}.sock")))
                    .arg(format!("--net={}", ns.display()))
                    .arg("--")
                    .arg(bin)
            } else {
                DaemonCommand::new(bin, sockets.join(format!("{name}.sock")))
            };
            command
                .args(["--socket-dir".as_ref(), sockets.as_os_str()])
                .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
                .args(["--node-name", &loader.node_name])
                .args(ACCESS)
                .args(["--max-connections", &max])
                .log_to(dir.join(format!("{name}.log")))
        };
        let health_ns = NetNs::new("sah").unwrap();
        let kubeconfig = dir.join("kubeconfig");
        // An API server nobody serves: svc-k8s-sync serves its socket while
        // its watches retry.
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n\
             contexts: [{name: c, context: {cluster: c, user: u}}]\n\
             users: [{name: u, user: {token: t}}]\n",
        )
        .unwrap();
        let mut daemons = Vec::new();
        for command in [
            common("svc-ipam", false).args(["--pool", "default=198.18.0.0/24"]),
            common("svc-identity", false),
            common("svc-endpoint", false).args(["--dependency-poll-ms", "200"]),
            common("svc-gc", true).args(["--bpffs", rivet_testkit::gc::BPFFS]),
            common("svc-health", true)
                .args(["--node-address", &loader.node.loopback4.to_string()])
                .arg("--health-netns")
                .arg(health_ns.path()),
            common("svc-k8s-sync", false).arg("--kubeconfig").arg(&kubeconfig),
        ] {
            daemons.push(command.spawn().await.expect("the daemon starts"));
        }
        for daemon in DAEMONS {
            let socket = sockets.join(format!("{}.sock", daemon.name()));
            std::os::unix::fs::chown(&socket, None, Some(NOGROUP)).unwrap();
        }
        Self {
            loader,
            daemons,
            _health_ns: health_ns,
            sockets,
        }
    }

    fn socket(&self, daemon: &str) -> PathBuf {
        self.sockets.join(format!("{daemon}.sock"))
    }
}

async fn root_channel(socket: &Path) -> DaemonChannel {
    connect_unix(socket, &ClientOptions::default())
        .await
        .unwrap_or_else(|e| panic!("root connects to {}: {e}", socket.display()))
}

/// One daemon's case: a call that would change its state, and a read of
/// that state (as root).
#[derive(Debug, Clone, Copy)]
enum Daemon {
    Ipam,
    Identity,
    Endpoint,
    Loader,
    Gc,
    Health,
    K8sSync,
}

const DAEMONS: [Daemon; 7] = [
    Daemon::Ipam,
    Daemon::Identity,
    Daemon::Endpoint,
    Daemon::Loader,
    Daemon::Gc,
    Daemon::Health,
    Daemon::K8sSync,
];

impl Daemon {
    fn name(self) -> &'static str {
        match self {
            Self::Ipam => "svc-ipam",
            Self::Identity => "svc-identity",
            Self::Endpoint => "svc-endpoint",
            Self::Loader => "svc-loader",
            Self::Gc => "svc-gc",
            Self::Health => "svc-health",
            Self::K8sSync => "svc-k8s-sync",
        }
    }

    /// The daemon's own call as `channel`'s peer: its status, and the
    /// method's path.
    async fn call(self, channel: tonic::transport::Channel) -> (Result<(), tonic::Status>, &'static str) {
        match self {
            Self::Ipam => (
                ipampb::ipam_client::IpamClient::new(channel)
                    .allocate(ipampb::AllocateRequest {
                        owner: Some(ipampb::Owner {
                            container_id: "intruder".into(),
                            interface: "eth0".into(),
                        }),
                        pool: "default".into(),
                        family: ipampb::Family::Ipv4.into(),
                        requested_address: Vec::new(),
                    })
                    .await
                    .map(drop),
                "rivet.ipam.v1.Ipam/Allocate",
            ),
            Self::Identity => (
                idpb::identity_service_client::IdentityServiceClient::new(channel)
                    .allocate_identity(idpb::AllocateIdentityRequest {
                        labels: vec!["k8s:app=intruder".into()],
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                "rivet.identity.v1.IdentityService/AllocateIdentity",
            ),
            Self::Endpoint => (
                eppb::policy_service_client::PolicyServiceClient::new(channel)
                    .upsert_policy(eppb::UpsertPolicyRequest {
                        document: "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
                                   metadata: {name: deny, namespace: default}\n\
                                   spec: {podSelector: {}, policyTypes: [Ingress]}\n"
                            .into(),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                "rivet.endpoint.v1.PolicyService/UpsertPolicy",
            ),
            Self::Loader => (
                ldpb::loader_service_client::LoaderServiceClient::new(channel)
                    .upsert_ipcache(ldpb::UpsertIpcacheRequest {
                        entries: vec![ldpb::IpcacheEntry {
                            prefix: Some(rivet_proto::net::IpPrefix {
                                address: vec![198, 18, 7, 0],
                                prefix_length: 24,
                            }),
                            identity: 7,
                            tunnel_endpoint: vec![],
                        }],
                    })
                    .await
                    .map(drop),
                "rivet.loader.v1.LoaderService/UpsertIpcache",
            ),
            Self::Gc => (
                gcpb::gc_service_client::GcServiceClient::new(channel)
                    .run_now(gcpb::RunNowRequest::default())
                    .await
                    .map(drop),
                "rivet.gc.v1.GcService/RunNow",
            ),
            Self::Health => (
                hpb::health_service_client::HealthServiceClient::new(channel)
                    .get_health(hpb::GetHealthRequest::default())
                    .await
                    .map(drop),
                "rivet.health.v1.HealthService/GetHealth",
            ),
            Self::K8sSync => (
                k8spb::pod_directory_client::PodDirectoryClient::new(channel)
                    .lookup_pod(k8spb::LookupPodRequest {
                        namespace: "default".into(),
                        name: "intruder".into(),
                        ..Default::default()
                    })
                    .await
                    .map(drop),
                "rivet.k8s.v1.PodDirectory/LookupPod",
            ),
        }
    }

    /// What the intruder's call would have changed, read as root.
    async fn state(self, node: &Node) -> String {
        let channel = root_channel(&node.socket(self.name())).await;
        match self {
            Self::Ipam => format!(
                "{:?}",
                ipampb::ipam_client::IpamClient::new(channel)
                    .list(ipampb::ListRequest {
                        include_allocations: true,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .pools
            ),
            Self::Identity => format!(
                "{:?}",
                idpb::identity_service_client::IdentityServiceClient::new(channel)
                    .list_identities(idpb::ListIdentitiesRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
                    .identities
            ),
            Self::Endpoint => format!(
                "{:?}",
                eppb::policy_service_client::PolicyServiceClient::new(channel)
                    .list_policies(eppb::ListPoliciesRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
                    .policies
            ),
            Self::Loader => format!(
                "{:?}",
                ldpb::loader_service_client::LoaderServiceClient::new(channel)
                    .list_ipcache(ldpb::ListIpcacheRequest::default())
                    .await
                    .unwrap()
                    .into_inner()
                    .entries
            ),
            Self::Gc => {
                let status = gcpb::gc_service_client::GcServiceClient::new(channel)
                    .status(gcpb::StatusRequest::default())
                    .await
                    .unwrap()
                    .into_inner();
                // A pass the intruder forced would be the last, and manual
                // (periodic passes may come and go meanwhile).
                let manual = status
                    .last_pass
                    .is_some_and(|p| p.trigger() == gcpb::PassTrigger::RunNow);
                format!("last pass manual: {manual}")
            }
            // Read-only APIs (for root): nothing to change.
            Self::Health | Self::K8sSync => String::new(),
        }
    }
}

/// The message bytes as they are, both ways: a request of any size to any
/// path.
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

/// `Daemon/GetInfo` with a body of `len` bytes: one unknown length-delimited
/// field (15), which a daemon would skip if it read it.
async fn raw_get_info(channel: DaemonChannel, len: usize) -> Result<Vec<u8>, tonic::Status> {
    let mut body = vec![(15 << 3) | 2];
    let mut n = len;
    while n >= 0x80 {
        body.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    body.push(n as u8);
    body.resize(body.len() + len, b'x');
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(body),
        http::uri::PathAndQuery::from_static("/rivet.daemon.v1.Daemon/GetInfo"),
        Raw,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// `Daemon/GetInfo` as root within [`CALL_WITHIN`].
async fn get_info_in_time(socket: &Path, what: &str) -> dpb::DaemonInfo {
    let started = Instant::now();
    let call = async {
        dpb::daemon_client::DaemonClient::new(root_channel(socket).await)
            .get_info(dpb::GetInfoRequest {})
            .await
    };
    let info = tokio::time::timeout(CALL_WITHIN, call)
        .await
        .unwrap_or_else(|_| panic!("{what}: GetInfo on {} took over {CALL_WITHIN:?}", socket.display()))
        .unwrap_or_else(|s| panic!("{what}: GetInfo on {}: {s:?}", socket.display()));
    eprintln!("{what}: {} answered in {:?}", info.get_ref().name, started.elapsed());
    info.into_inner()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_daemon_refuses_strangers_oversized_requests_and_survives_idle_connections() {
    let node = Node::start().await;
    let nobody = Credentials::nobody();
    let nogroup_member = Credentials {
        uid: 65534,
        gid: NOGROUP,
        groups: vec![],
    };
    assert_eq!(nobody, nogroup_member, "nobody reaches the sockets through their group");

    for daemon in DAEMONS {
        let name = daemon.name();
        let socket = node.socket(name);
        let before = daemon.state(&node).await;

        // A uid that is not allowed: refused, naming its uid and the method.
        let channel = channel_as(&socket, &nobody)
            .await
            .unwrap_or_else(|e| panic!("{name}: nobody connects through the socket's group: {e}"));
        let (result, method) = daemon.call(channel.clone()).await;
        let refused = result.expect_err(&format!("{name}: uid 65534 must be refused {method}"));
        assert_eq!(refused.code(), Code::PermissionDenied, "{name}: {refused:?}");
        assert!(
            refused.message().contains("uid 65534") && refused.message().contains(method),
            "{name}: the refusal names the uid and the method: {}",
            refused.message()
        );
        let info = dpb::daemon_client::DaemonClient::new(channel)
            .get_info(dpb::GetInfoRequest {})
            .await
            .expect_err(&format!("{name}: not even GetInfo for a stranger"));
        assert_eq!(info.code(), Code::PermissionDenied, "{name}: {info:?}");
        assert_eq!(
            daemon.state(&node).await,
            before,
            "{name}: a refused call changed the state"
        );

        // A request over the size limit: refused cleanly, the daemon serves on.
        let channel = root_channel(&socket).await;
        let within = raw_get_info(channel.clone(), 64)
            .await
            .unwrap_or_else(|s| panic!("{name}: a small raw GetInfo is served: {s:?}"));
        assert!(!within.is_empty(), "{name}");
        let huge = raw_get_info(channel.clone(), 5 << 20)
            .await
            .expect_err(&format!("{name}: a 5 MiB request must be refused"));
        assert!(
            matches!(huge.code(), Code::OutOfRange | Code::ResourceExhausted),
            "{name}: {huge:?}"
        );
        get_info_in_time(&socket, &format!("{name} after a 5 MiB request")).await;
        // Headers beyond HTTP/2's list limit (16 KiB): refused, serving on.
        let mut request = tonic::Request::new(dpb::GetInfoRequest {});
        request
            .metadata_mut()
            .insert("x-pad", "x".repeat(64 << 10).parse().unwrap());
        let padded = dpb::daemon_client::DaemonClient::new(root_channel(&socket).await)
            .get_info(request)
            .await;
        assert!(padded.is_err(), "{name}: 64 KiB of metadata must be refused");
        get_info_in_time(&socket, &format!("{name} after 64 KiB of metadata")).await;

        // Silent connections (of a stranger: they count against the limit)
        // do not delay a normal client.
        let idle: Vec<_> = (0..IDLE)
            .map(|i| connect_as(&socket, &nobody).unwrap_or_else(|e| panic!("{name}: idle connection {i}: {e}")))
            .collect();
        get_info_in_time(&socket, &format!("{name} with {IDLE} idle connections")).await;
        drop(idle);
    }

    // Beyond --max-connections a stranger's new connection is closed at once
    // (an admitted one gets the server's HTTP/2 SETTINGS first), root is
    // still served, and a slot freed is a slot a stranger gets again.
    let socket = node.socket("svc-ipam");
    let mut held = Vec::new();
    let refused_at = loop {
        assert!(
            held.len() <= MAX_CONNECTIONS,
            "{} connections of a stranger admitted with --max-connections {MAX_CONNECTIONS}",
            held.len()
        );
        let stream = connect_as(&socket, &nobody).unwrap();
        if first_bytes(&stream) == 0 {
            break held.len();
        }
        held.push(stream);
    };
    eprintln!("svc-ipam: a stranger's connection {} refused", refused_at + 1);
    assert!(
        refused_at + 10 >= MAX_CONNECTIONS,
        "refused after only {refused_at} connections (--max-connections {MAX_CONNECTIONS})"
    );
    get_info_in_time(&socket, "svc-ipam at its connection limit").await;
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while first_bytes(&connect_as(&socket, &nobody).unwrap()) == 0 {
        assert!(
            Instant::now() < deadline,
            "the closed connections' slots never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    for daemon in DAEMONS {
        get_info_in_time(&node.socket(daemon.name()), &format!("{} at the end", daemon.name())).await;
    }
    drop(node.daemons);
    drop(node.loader);
}

/// Bytes the server sends first on `stream` (its HTTP/2 SETTINGS; 0 when it
/// closed the connection).
fn first_bytes(stream: &std::os::unix::net::UnixStream) -> usize {
    use std::io::Read as _;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    (&*stream)
        .read(&mut buf)
        .expect("the server answers a new connection with SETTINGS or closes it within 10 s")
}

/// CPU time (user + system) of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces): utime is the
    // 14th field of the line, stime the 15th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    Duration::from_millis(ticks * 1000 / per_second)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_out_of_descriptors_neither_spins_nor_stops_serving() {
    // svc-ipam with room for 64 descriptors; root's connections are always
    // admitted, so 200 of them run it out and the rest wait in the backlog.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("svc-ipam.sock");
    let mut ipam = DaemonCommand::new("prlimit", &socket)
        .args(["--nofile=64:64", "--"])
        .arg(workspace_binary("svc-ipam"))
        .args(["--socket-dir".as_ref(), dir.path().as_os_str()])
        .args(["--state-dir".as_ref(), dir.path().join("state").as_os_str()])
        .args(["--pool", "default=198.18.0.0/24"])
        .spawn()
        .await
        .expect("svc-ipam starts");
    let pid = ipam.pid().expect("svc-ipam runs");
    let held: Vec<_> = (0..200)
        .map(|i| std::os::unix::net::UnixStream::connect(&socket).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    // Until every descriptor is taken the daemon accepts; then accept fails
    // with EMFILE (which it logs), and the listener stays readable.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ipam.log().contains("for lack of resources") {
        assert!(Instant::now() < deadline, "svc-ipam never ran out: {}", ipam.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // CPU over a measurement window at EMFILE.
    let window = Duration::from_secs(1);
    let before = cpu_time(pid);
    tokio::time::sleep(window).await;
    let spent = cpu_time(pid) - before;
    eprintln!("svc-ipam out of descriptors: {spent:?} of CPU in {window:?}");
    assert!(
        spent < window / 10,
        "svc-ipam out of descriptors spent {spent:?} of CPU in {window:?}: its accept loop spins"
    );
    // Descriptors come free: the daemon serves again.
    drop(held);
    let info = tokio::time::timeout(
        Duration::from_secs(10),
        dpb::daemon_client::DaemonClient::new(root_channel(&socket).await).get_info(dpb::GetInfoRequest {}),
    )
    .await
    .expect("svc-ipam answers once descriptors are free")
    .expect("GetInfo");
    assert_eq!(info.into_inner().name, "svc-ipam");
    ipam.kill9();
}

//! A real Kubernetes cluster on this machine (issue 18 §3): a control plane
//! and worker nodes running the real v1.34 binaries (`cargo xtask install`),
//! each worker a kubelet with its own containerd, all inside network
//! namespaces the cluster owns. Tests use [`KubeCluster`] as a guard;
//! `cargo xtask cluster up|down` runs the same fixture in a background
//! process (`rivet-kube-cluster`, see its docs).
//!
//! The layout (cluster `kc<pid><n>`, workers numbered from 1):
//! - the underlay: namespace `kcul-*` with bridge `ul`;
//! - the control plane: namespace `kccp-*`, `ul0` = [`CONTROL_PLANE_V4`] and
//!   [`CONTROL_PLANE_V6`] on the bridge; etcd 3.6 on its 127.0.0.1,
//!   a second etcd for Rivet's kvstore (deploy/overlays/etcd) on
//!   [`CONTROL_PLANE_V4`]:[`RIVET_ETCD_PORT`] (the API server's etcd stays
//!   private, as on a real control plane),
//!   kube-apiserver on `0.0.0.0:6443` (workers reach it at
//!   `https://198.19.254.254:6443`), kube-controller-manager and
//!   kube-scheduler talking to it over the namespace's loopback;
//! - worker `i`: namespace `kcw-*` with `ul0` = 198.19.254.`i`/24 and
//!   2001:2:0:fe::`i`/64, and its own **mount namespace** (a real node's
//!   view of the file system): `/etc` and `/var/lib` are overlays whose
//!   upper dirs are the worker's, and `/opt`, `/run`, `/var/log` and
//!   `/var/lib/cni` are the worker's own directories bound over the
//!   host's; `/sys/fs/bpf` is a bpffs of its own (mounted at `<dir>/bpf`
//!   on the host), so the pins a node's Rivet keeps across restarts go
//!   with the worker, as with a machine's. So a DaemonSet's hostPath `/etc/cni/net.d`, `/opt/cni/bin`,
//!   `/run/rivet` or `/var/lib/kubelet` is that node's alone, exactly as on separate machines, and nothing a pod or
//!   the kubelet writes there reaches the host. containerd (CNI dirs
//!   `/opt/cni/bin` and `/etc/cni/net.d`, `sandbox_image` the imported
//!   pause image, `restrict_oom_score_adj = true`) and the kubelet both run
//!   in the worker's network and mount namespaces, so hostNetwork pods land
//!   in the worker's network namespace and the kubelet's volume mounts are
//!   the ones runc binds into containers. The worker's cgroup v2
//!   directory (below) shows at [`NODE_CGROUP_DIR`] there, and
//!   containerd runs in it (`<root>/runtime`), as a node's processes are
//!   all in its cgroup tree: deploy/'s socket load balancing on it serves
//!   this worker's host-network sockets and rivet-cni's.
//! - Host access: a relay on the host's 127.0.0.1 whose connections are
//!   made inside the control-plane namespace; the admin kubeconfig
//!   ([`KubeCluster::kubeconfig`]) points at it. Nothing is added to the
//!   host's interfaces or routes.
//!
//! Choices, and why:
//! - **Authorization `Node,RBAC` + the `NodeRestriction` admission plugin**,
//!   as kubeadm does: each kubelet has a client certificate
//!   `system:node:<name>` in group `system:nodes`, so it can only touch its
//!   own Node and its pods; the Node authorizer also grants it the token and
//!   access reviews its Webhook authn/authz of `kubectl exec` needs.
//! - **The ServiceAccount admission plugin and token controller are on**
//!   (real kubelets run pods; kube-controller-manager has the signing key
//!   and `--root-ca-file`, so `kube-root-ca.crt` is published and projected
//!   tokens work).
//! - **`--allocate-node-cidrs=false`**: Rivet's operator assigns pod CIDRs
//!   (issue 18 §4). The control-plane namespace routes each Node's
//!   `spec.podCIDRs` to its InternalIP (a watch, as a cloud's route table),
//!   so pods that are not hostNetwork get the API server's answers. The reference bridge stand-in uses 198.18.`i`.0/24 on
//!   worker `i`, written into its conflist, with routes between workers.
//! - **kubelet**: `cgroupDriver: cgroupfs` under its own cgroup root
//!   `/<cluster>/w<i>` (created in every v1 hierarchy, removed on drop),
//!   `failSwapOn: false`, root dir `/var/lib/kubelet` of the worker's mount
//!   namespace (the device-plugin socket dir is fixed there, so two kubelets
//!   need separate ones anyway), `resolvConf` a file of the
//!   cluster (no DNS server runs), eviction thresholds at 1% (the shared
//!   disk must not evict test pods) and image GC off (the images cannot be
//!   pulled again). The kubelet wants `vm.overcommit_memory=1`,
//!   `kernel.panic=10` and `kernel.panic_on_oops=1` and would write them
//!   into the machine's sysctls; instead the worker's mount namespace binds
//!   files holding those values over them in `/proc/sys`, and
//!   `protectKernelDefaults: true` makes the kubelet fail rather than write.
//! - Node IPs are both underlay addresses (`--node-ip=198.19.254.<i>,2001:2:0:fe::<i>`).
//! - **No kube-proxy**: Services are Rivet's job (issue 17). Until Rivet's
//!   datapath serves the `kubernetes` Service (198.19.255.1:443), a pod that
//!   needs the API before that (svc-k8s-sync) is given the real address,
//!   [`CONTROL_PLANE_V4`]:[`API_SERVER_PORT`] (`KUBERNETES_SERVICE_HOST` /
//!   `_PORT`), reachable from every worker over the underlay.
//! - The API server's serving certificate names 127.0.0.1, the control
//!   plane's underlay address and the first Service IP; the kubelets'
//!   serving certificates name their node IP, and the API server verifies
//!   them with the cluster CA.
//! - Pods never pull: images are imported into each worker's containerd
//!   ([`crate::image`]: pause and busybox); use `imagePullPolicy: Never`.
//!
//! Dropping the cluster stops each kubelet, removes every pod sandbox
//! through containerd's CRI (CNI DEL) and containerd itself, removes the
//! worker's pins (`/sys/fs/bpf/rivet/<worker>`), releases the
//! worker's mount namespace (all its mounts go with it), removes the cgroup
//! roots, stops the control plane, deletes the namespaces and the dir.
//!
//! ```no_run
//! # async fn t() -> Result<(), rivet_e2e::kube_cluster::KubeClusterError> {
//! use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions};
//! let cluster = KubeCluster::start(KubeClusterOptions::default()).await?;
//! println!("export KUBECONFIG={}", cluster.kubeconfig().display());
//! # Ok(()) }
//! ```

pub mod jaeger;
mod pki;
mod process;
mod relay;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::Client;
use kube::api::Api;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_common::testing::netns::{NetNs, NetnsError};
use rivet_tools::{Tool, ToolError, tool_path};

use crate::containerd::{Containerd, ContainerdConfig};
use pki::{Pki, kubeconfig};
use process::Daemon;
use relay::NetnsRelay;

/// The control plane's IPv4 address on the underlay.
pub const CONTROL_PLANE_V4: Ipv4Addr = Ipv4Addr::new(198, 19, 254, 254);
/// The control plane's IPv6 address on the underlay.
pub const CONTROL_PLANE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, 0xfe);
/// kube-apiserver's port.
pub const API_SERVER_PORT: u16 = 6443;
/// The client port of Rivet's etcd on [`CONTROL_PLANE_V4`].
pub const RIVET_ETCD_PORT: u16 = 2379;
/// `--service-cluster-ip-range`.
pub const SERVICE_CIDR: &str = "198.19.255.0/24";
/// The first Service IP (the `kubernetes` Service).
const KUBERNETES_SERVICE_IP: &str = "198.19.255.1";
/// The underlay bridge (in the underlay namespace).
const BRIDGE: &str = "ul";
/// Each namespace's underlay interface.
const UNDERLAY_INTERFACE: &str = "ul0";
/// The most workers (their addresses are 198.19.254.1 to .253).
pub const MAX_WORKERS: usize = 253;
/// How long the control plane may take to be ready.
const CONTROL_PLANE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the workers may take to register (and be Ready with a CNI).
const WORKER_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the fixture looks again.
const POLL: Duration = Duration::from_millis(200);
/// Kernel settings the kubelet insists on (`protectKernelDefaults`), shown
/// to it through the worker's mount namespace, never written.
const KUBELET_SYSCTLS: &[(&str, &str)] = &[
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// The containerd runtime handler of
/// [`KubeClusterOptions::reference_bridge_handler`] (a RuntimeClass's
/// `handler`).
pub const REFERENCE_BRIDGE_HANDLER: &str = "reference-bridge";
/// Its CNI conf dir inside each worker.
const REFERENCE_BRIDGE_CONF_DIR: &str = "/etc/cni/reference-bridge.d";

/// Where a worker's mount namespace shows its own cgroup v2 directory
/// (`<unified>/<cgroup root>`), the node's cgroup deploy/'s svc-loader
/// attaches socket load balancing to (`socket-lb-cgroup`): the kubelet's
/// pods and containerd (so rivet-cni) are below it, nothing of another
/// worker is.
pub const NODE_CGROUP_DIR: &str = "/run/rivet-cgroupv2";

/// containerd's cgroup below a worker's cgroup root (unified hierarchy).
const RUNTIME_CGROUP: &str = "runtime";

/// The file in the cluster dir that lists what [`sweep`] removes.
pub const RECORD_FILE: &str = "record.json";

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// What went wrong with the cluster; every message says what was being done.
#[derive(Debug, thiserror::Error)]
pub enum KubeClusterError {
    /// A Kubernetes or etcd binary is missing (`cargo xtask install`).
    #[error("starting the Kubernetes cluster: {0}")]
    NotInstalled(#[from] ToolError),
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A certificate could not be generated.
    #[error("generating {what}: {source}")]
    Certificate {
        /// Which one.
        what: String,
        /// Why.
        #[source]
        source: rcgen::Error,
    },
    /// A namespace operation failed.
    #[error("{context}: {source}")]
    Netns {
        /// What was being done.
        context: String,
        /// Why.
        #[source]
        source: NetnsError,
    },
    /// A worker's containerd failed.
    #[error("worker {worker}: {source}")]
    Containerd {
        /// The worker.
        worker: String,
        /// Why.
        #[source]
        source: Box<crate::Error>,
    },
    /// A daemon exited.
    #[error("{name} exited ({status}); the tail of {}:\n{tail}", log.display())]
    Exited {
        /// The daemon.
        name: String,
        /// Its exit status.
        status: String,
        /// Its log.
        log: PathBuf,
        /// The log's last lines.
        tail: String,
    },
    /// A request to the API server failed.
    #[error("{action}: {source}")]
    Api {
        /// What was being done.
        action: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The admin kubeconfig could not be turned into a client.
    #[error("building the admin client: {0}")]
    Client(#[from] rivet_k8s::ClientError),
    /// Something was not reached in time.
    #[error("{what}: not done within {timeout:?} ({last})")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        timeout: Duration,
        /// The last thing seen.
        last: String,
    },
    /// Bad options.
    #[error("invalid cluster options: {0}")]
    Options(String),
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> KubeClusterError {
    let context = context.into();
    move |source| KubeClusterError::Io { context, source }
}

fn netns_err(context: impl Into<String>) -> impl FnOnce(NetnsError) -> KubeClusterError {
    let context = context.into();
    move |source| KubeClusterError::Netns { context, source }
}

pub(crate) fn write_file(path: &Path, text: &str) -> Result<(), KubeClusterError> {
    std::fs::write(path, text).map_err(io_err(format!("writing {}", path.display())))
}

/// The pod network of the workers before Rivet is installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerCni {
    /// The reference `bridge` + `host-local` plugins (in /usr/lib/cni),
    /// pod CIDR 198.18.`i`.0/24 on worker `i`: the nodes become Ready.
    Bridge,
    /// No CNI config: the nodes register NotReady until a DaemonSet (Rivet's)
    /// installs a plugin and a conflist into `/opt/cni/bin` and
    /// `/etc/cni/net.d` of each worker.
    None,
}

/// What [`KubeCluster::start`] builds.
#[derive(Debug, Clone)]
pub struct KubeClusterOptions {
    /// Number of workers (1 to [`MAX_WORKERS`]).
    pub workers: usize,
    /// Their pod network until Rivet runs.
    pub cni: WorkerCni,
    /// Where the cluster's files go; `None`: a new temp dir (removed on
    /// drop). A given dir is created and removed on drop as well.
    pub dir: Option<PathBuf>,
    /// More OCI archives imported into every worker's containerd (e.g. the
    /// Rivet image of `cargo xtask image`), beside pause and busybox.
    pub images: Vec<PathBuf>,
    /// Also give every containerd the runtime handler
    /// [`REFERENCE_BRIDGE_HANDLER`]: a pod whose RuntimeClass names it gets
    /// the reference bridge + host-local network (the worker's
    /// [`Worker::pod_cidr`]) whatever the node's own CNI is, so Rivet and
    /// the reference plugins serve pods side by side on one cluster (the
    /// cluster bench). Its conflist is in `/etc/cni/reference-bridge.d`.
    pub reference_bridge_handler: bool,
}

impl Default for KubeClusterOptions {
    fn default() -> Self {
        Self {
            workers: 2,
            cni: WorkerCni::Bridge,
            dir: None,
            images: Vec::new(),
            reference_bridge_handler: false,
        }
    }
}

/// One worker node.
#[derive(Debug)]
pub struct Worker {
    /// 1-based position.
    pub index: usize,
    /// Its Node name.
    pub name: String,
    /// Its IPv4 node IP (on `ul0`).
    pub address: Ipv4Addr,
    /// Its IPv6 node IP (on `ul0`).
    pub address_v6: Ipv6Addr,
    /// The reference bridge's pod CIDR on it (198.18.`i`.0/24).
    pub pod_cidr: String,
    /// Its network namespace.
    pub netns: NetNs,
    /// Its files: configs, and what the worker's mount namespace shows as
    /// `/opt`, `/run`, `/var/log`, `/var/lib/cni`, `/sys/fs/bpf`, and the upper dirs of
    /// its `/etc` and `/var/lib` (the kubelet's root dir is the usual
    /// `/var/lib/kubelet` in it).
    pub dir: PathBuf,
    /// The kubelet's cgroup root (the same path in every hierarchy).
    pub cgroup_root: String,
    containerd: Option<Containerd>,
    kubelet: Option<Daemon>,
    mount_ns_mounted: bool,
}

impl Worker {
    /// The nsfs file of its mount namespace (`nsenter --mount=<this>`).
    pub fn mount_ns(&self) -> PathBuf {
        self.dir.join("mnt")
    }

    /// What the worker sees at `path` (an absolute path inside its mount
    /// namespace, e.g. `/etc/cni/net.d`), as a path on the host: for `/etc`
    /// and `/var/lib`, where the worker's own writes are (the overlay's
    /// upper dir); a path the worker shares with the host is itself.
    pub fn host_path(&self, path: &str) -> PathBuf {
        let relative = path.trim_start_matches('/');
        for (inside, host) in [
            ("opt", "opt"),
            ("run", "run"),
            ("var/log", "log"),
            ("var/lib/cni", "var-lib-cni"),
            ("sys/fs/bpf", "bpf"),
        ] {
            if let Some(rest) = relative.strip_prefix(inside)
                && (rest.is_empty() || rest.starts_with('/'))
            {
                return self.dir.join(host).join(rest.trim_start_matches('/'));
            }
        }
        for (inside, host) in [("etc/", "etc/upper"), ("var/lib/", "var-lib/upper")] {
            if let Some(rest) = relative.strip_prefix(inside) {
                return self.dir.join(host).join(rest);
            }
        }
        PathBuf::from(path)
    }

    /// A command run inside the worker (its network and mount namespaces).
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", self.netns.path().display()))
            .arg(format!("--mount={}", self.mount_ns().display()))
            .arg(program);
        command
    }

    /// Its containerd's socket (the CRI).
    pub fn containerd_socket(&self) -> Option<PathBuf> {
        self.containerd.as_ref().map(Containerd::socket)
    }

    /// The kubelet's log.
    pub fn kubelet_log(&self) -> PathBuf {
        self.dir.join("kubelet.log")
    }

    fn teardown(&mut self) {
        if let Some(mut kubelet) = self.kubelet.take() {
            kubelet.stop();
        }
        // Every sandbox through the CRI (CNI DEL), containerd, shims.
        drop(self.containerd.take());
        // The node's pins, on the host's bpffs every worker shares: Rivet's
        // DaemonSet leaves them when its pods are not drained first.
        if let Ok(pins) = rivet_common::pin_layout::pin_dir(rivet_common::pin_layout::DEFAULT_BPFFS, &self.name)
            && let Err(e) = std::fs::remove_dir_all(&pins)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("rivet kube cluster teardown: removing {}: {e}", pins.display());
        }
        // Whatever still runs in the kubelet's cgroups (pods of a dead
        // containerd), then the cgroups.
        let dirs = cgroup_dirs(&self.cgroup_root);
        for dir in &dirs {
            for pid in cgroup_pids(dir) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        if std::mem::take(&mut self.mount_ns_mounted)
            && let Err(e) = nix::mount::umount2(&self.mount_ns(), nix::mount::MntFlags::MNT_DETACH)
        {
            eprintln!(
                "rivet kube cluster teardown: releasing {}: {e}",
                self.mount_ns().display()
            );
        }
        // With the namespace gone, this is the bpffs's last mount: its
        // pins go with it.
        let bpffs = self.dir.join("bpf");
        if let Err(e) = nix::mount::umount2(&bpffs, nix::mount::MntFlags::MNT_DETACH)
            && e != nix::errno::Errno::EINVAL
            && e != nix::errno::Errno::ENOENT
        {
            eprintln!("rivet kube cluster teardown: unmounting {}: {e}", bpffs.display());
        }
        // The top of the root (`/<cluster>`) goes with the cluster.
        for dir in dirs {
            remove_cgroup_tree(&dir);
        }
    }
}

/// A running cluster; see the module docs. Dropping it removes everything.
pub struct KubeCluster {
    name: String,
    dir: PathBuf,
    admin: Client,
    /// Signs the workers' certificates.
    pki: std::sync::Arc<Pki>,
    workers: Vec<Worker>,
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
    control_plane: Vec<Daemon>,
    relay: Option<NetnsRelay>,
    /// Routes each Node's pod CIDRs in the control-plane namespace.
    pod_routes: Option<tokio::task::JoinHandle<()>>,
    control_plane_ns: Option<NetNs>,
    underlay: Option<NetNs>,
    started_in: Duration,
}

impl std::fmt::Debug for KubeCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeCluster")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl KubeCluster {
    /// Builds the cluster and waits until the control plane is ready and
    /// every worker registered (and is Ready, with [`WorkerCni::Bridge`]).
    ///
    /// # Errors
    /// A missing binary (before anything starts), a daemon that exits or is
    /// not ready in time (with its log tail); what was made is removed.
    pub async fn start(options: KubeClusterOptions) -> Result<Self, KubeClusterError> {
        if options.workers == 0 || options.workers > MAX_WORKERS {
            return Err(KubeClusterError::Options(format!(
                "{} workers (1 to {MAX_WORKERS})",
                options.workers
            )));
        }
        for tool in [
            Tool::Etcd,
            Tool::KubeApiserver,
            Tool::KubeControllerManager,
            Tool::KubeScheduler,
            Tool::Kubelet,
        ] {
            tool_path(tool)?;
        }
        crate::containerd::check_prerequisites().map_err(|source| KubeClusterError::Containerd {
            worker: "(none yet)".into(),
            source: Box::new(source),
        })?;
        let started = Instant::now();
        let name = format!(
            "kc{:x}{:x}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let dir = match &options.dir {
            Some(dir) => dir.clone(),
            None => std::env::temp_dir().join(format!("rivet-{name}")),
        };
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating the cluster dir {}", dir.display())))?;
        let underlay = NetNs::new("kcul").map_err(netns_err("creating the underlay namespace"))?;
        let mut cluster = match ControlPlaneParts::start(&name, &dir, underlay).await {
            Ok(cluster) => cluster,
            Err(e) => {
                // The namespaces made so far went with their guards.
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        cluster.start_workers(&options).await?;
        cluster.pod_routes = Some(tokio::spawn(route_pod_cidrs_to_nodes(
            cluster.admin.clone(),
            cluster.control_plane_netns().name().to_owned(),
        )));
        cluster.started_in = started.elapsed();
        Ok(cluster)
    }

    /// The cluster's name (prefix of its node names and cgroup root).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cluster's dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin kubeconfig (client certificate in `system:masters`), for
    /// kubectl on the host.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("pki/admin.kubeconfig")
    }

    /// A client with the admin kubeconfig.
    pub fn admin_client(&self) -> Client {
        self.admin.clone()
    }

    /// `kubectl --kubeconfig <admin>`; add arguments and run it.
    ///
    /// # Errors
    /// kubectl not installed.
    pub fn kubectl(&self) -> Result<Command, KubeClusterError> {
        let mut command = Command::new(tool_path(Tool::Kubectl)?);
        command.arg("--kubeconfig").arg(self.kubeconfig());
        Ok(command)
    }

    /// Runs `kubectl <args>` with `stdin` (e.g. `apply -f -`): `Ok(stdout)`,
    /// or `Err(stdout + stderr)` (also when kubectl cannot run).
    pub fn kubectl_output(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        use std::io::Write as _;
        let mut child = self
            .kubectl()
            .map_err(|e| e.to_string())?
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("running kubectl: {e}"))?;
        let mut input = child.stdin.take().expect("stdin is piped");
        input
            .write_all(stdin.unwrap_or_default().as_bytes())
            .map_err(|e| format!("writing kubectl's stdin: {e}"))?;
        drop(input);
        let out = child
            .wait_with_output()
            .map_err(|e| format!("waiting for kubectl: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// Imports an OCI archive into every worker's containerd (a new image
    /// tag for a rolling update) and waits until each CRI sees `names`.
    ///
    /// # Errors
    /// `ctr images import` fails, or an image of `names` does not show.
    pub async fn import_images(&self, archive: &Path, names: &[&str]) -> Result<(), KubeClusterError> {
        for worker in &self.workers {
            if let Some(containerd) = &worker.containerd {
                containerd
                    .import_images(archive, names)
                    .await
                    .map_err(|source| KubeClusterError::Containerd {
                        worker: worker.name.clone(),
                        source: Box::new(source),
                    })?;
            }
        }
        Ok(())
    }

    /// The workers.
    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    /// How long [`start`](Self::start) took until the cluster was ready.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The control-plane namespace (etcd, kube-apiserver, the controllers).
    pub fn control_plane_netns(&self) -> &NetNs {
        self.control_plane_ns
            .as_ref()
            .expect("the control plane runs while the cluster does")
    }

    /// The URL the workers (and pods) reach kube-apiserver at.
    pub fn api_server_url(&self) -> String {
        format!("https://{CONTROL_PLANE_V4}:{API_SERVER_PORT}")
    }

    /// The endpoint the workers reach Rivet's etcd at (deploy/overlays/etcd
    /// names it).
    pub fn rivet_etcd_endpoint(&self) -> String {
        format!("http://{CONTROL_PLANE_V4}:{RIVET_ETCD_PORT}")
    }

    /// Each control-plane daemon's log, by name.
    pub fn control_plane_logs(&self) -> Vec<(String, PathBuf)> {
        self.control_plane
            .iter()
            .map(|d| (d.name().to_owned(), d.log_path().to_path_buf()))
            .collect()
    }

    /// Fails when a control-plane daemon or kubelet exited.
    ///
    /// # Errors
    /// [`KubeClusterError::Exited`] with the daemon's log tail.
    pub fn check_running(&mut self) -> Result<(), KubeClusterError> {
        for daemon in &mut self.control_plane {
            daemon.check_running()?;
        }
        for worker in &mut self.workers {
            if let Some(kubelet) = worker.kubelet.as_mut() {
                kubelet.check_running()?;
            }
        }
        Ok(())
    }

    async fn start_workers(&mut self, options: &KubeClusterOptions) -> Result<(), KubeClusterError> {
        let pki = std::sync::Arc::clone(&self.pki);
        for index in 1..=options.workers {
            let worker = self.start_worker(&pki, index, options).await?;
            self.workers.push(worker);
        }
        self.route_pod_cidrs()?;
        self.wait_nodes(options.cni == WorkerCni::Bridge, WORKER_TIMEOUT).await
    }

    /// Waits until every worker's Node is Ready (e.g. after Rivet's
    /// DaemonSet installed its CNI on a cluster started with
    /// [`WorkerCni::None`]), failing early when a kubelet or control-plane
    /// daemon exits.
    ///
    /// # Errors
    /// [`KubeClusterError::Timeout`] naming the Nodes not Ready, or
    /// [`KubeClusterError::Exited`].
    pub async fn wait_nodes_ready(&mut self, timeout: Duration) -> Result<(), KubeClusterError> {
        self.wait_nodes(true, timeout).await
    }

    /// Waits until every worker's Node registered, and is Ready if `ready`.
    async fn wait_nodes(&mut self, ready: bool, timeout: Duration) -> Result<(), KubeClusterError> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let names: Vec<String> = self.workers.iter().map(|w| w.name.clone()).collect();
        let what = if ready {
            "waiting for every worker's Node to be Ready"
        } else {
            "waiting for every worker's Node to register"
        };
        self.wait(what, timeout, || {
            let nodes = nodes.clone();
            let names = names.clone();
            async move {
                let mut missing = Vec::new();
                for name in &names {
                    match nodes.get_opt(name).await {
                        Ok(Some(node)) if !ready || node_ready(&node) => {}
                        Ok(Some(_)) => missing.push(format!("{name} not Ready")),
                        Ok(None) => missing.push(format!("{name} not registered")),
                        Err(e) => missing.push(format!("{name}: {e}")),
                    }
                }
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(missing.join(", "))
                }
            }
        })
        .await
    }

    async fn start_worker(
        &mut self,
        pki: &Pki,
        index: usize,
        options: &KubeClusterOptions,
    ) -> Result<Worker, KubeClusterError> {
        let name = format!("{}-w{index}", self.name);
        let address = Ipv4Addr::new(198, 19, 254, index as u8);
        let address_v6 = Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, index as u16);
        let netns = NetNs::new("kcw").map_err(netns_err(format!("creating worker {name}'s namespace")))?;
        let dir = self.dir.join(&name);
        let worker = Worker {
            index,
            name: name.clone(),
            address,
            address_v6,
            pod_cidr: format!("198.18.{index}.0/24"),
            netns,
            dir: dir.clone(),
            cgroup_root: format!("/{}/w{index}", self.name),
            containerd: None,
            kubelet: None,
            mount_ns_mounted: false,
        };
        let underlay = self.underlay.as_ref().expect("the underlay exists while starting");
        attach_to_underlay(
            underlay,
            &worker.netns,
            &format!("w{index}"),
            &format!("{address}/24"),
            &format!("{address_v6}/64"),
        )?;
        worker
            .netns
            .sysctls(&[("net.ipv4.ip_forward", "1"), ("net.ipv6.conf.all.forwarding", "1")])
            .map_err(netns_err(format!("enabling forwarding in worker {name}")))?;
        // Anything failing from here on is cleaned up by the worker's drop,
        // so it joins the cluster first.
        let position = self.workers.len();
        self.workers.push(worker);
        self.record()?;
        let result = self.prepare_worker(pki, position, options).await;
        let worker = self.workers.remove(position);
        result.map(|()| worker)
    }

    async fn prepare_worker(
        &mut self,
        pki: &Pki,
        position: usize,
        options: &KubeClusterOptions,
    ) -> Result<(), KubeClusterError> {
        let api_server_url = self.api_server_url();
        let worker = &mut self.workers[position];
        let dir = worker.dir.clone();
        let name = worker.name.clone();
        for sub in [
            "opt/cni/bin",
            "run",
            "log",
            "var-lib-cni",
            "etc/upper/cni/net.d",
            "etc/work",
            "var-lib/upper",
            "var-lib/work",
            "sysctl",
            "manifests",
        ] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io_err(format!("creating {}", dir.join(sub).display())))?;
        }
        link_reference_plugins(&dir.join("opt/cni/bin"))?;
        if options.cni == WorkerCni::Bridge {
            write_file(
                &dir.join("etc/upper/cni/net.d/10-bridge.conflist"),
                &bridge_conflist(&worker.pod_cidr),
            )?;
        }
        if options.reference_bridge_handler {
            let conf_dir = worker.host_path(REFERENCE_BRIDGE_CONF_DIR);
            std::fs::create_dir_all(&conf_dir).map_err(io_err(format!("creating {}", conf_dir.display())))?;
            write_file(&conf_dir.join("10-bridge.conflist"), &bridge_conflist(&worker.pod_cidr))?;
        }
        create_cgroup_root(&worker.cgroup_root)?;
        create_mount_ns(worker)?;
        worker.mount_ns_mounted = true;

        let mut config = ContainerdConfig::new("/opt/cni/bin", "/etc/cni/net.d")
            .netns(worker.netns.path())
            .mount_ns(worker.mount_ns());
        if options.cni == WorkerCni::None {
            config = config.network_later();
        }
        if options.reference_bridge_handler {
            config = config.network_handler(REFERENCE_BRIDGE_HANDLER, REFERENCE_BRIDGE_CONF_DIR);
        }
        let containerd_err = |source| KubeClusterError::Containerd {
            worker: name.clone(),
            source: Box::new(source),
        };
        let containerd = Containerd::start(config).await.map_err(containerd_err)?;
        // Into the node's cgroup v2 directory before it runs any plugin, so
        // rivet-cni's sockets are the node's (socket load balancing).
        if let Some(pid) = containerd.pid() {
            join_node_cgroup(&worker.cgroup_root, RUNTIME_CGROUP, pid)?;
        }
        containerd.import_e2e_images().await.map_err(containerd_err)?;
        for archive in &options.images {
            containerd.import_images(archive, &[]).await.map_err(containerd_err)?;
        }
        let socket = containerd.socket();
        worker.containerd = Some(containerd);
        self.record()?;
        let worker = &mut self.workers[position];

        let client = pki.client(
            &format!("kubelet-{name}"),
            &format!("system:node:{name}"),
            &["system:nodes"],
        )?;
        let serving = pki.server(
            &format!("kubelet-{name}-serving"),
            &name,
            &[worker.address.to_string(), worker.address_v6.to_string(), name.clone()],
        )?;
        let kubeconfig_path = dir.join("kubelet.kubeconfig");
        write_file(
            &kubeconfig_path,
            &kubeconfig(&api_server_url, &pki.ca(), &format!("system:node:{name}"), &client),
        )?;
        write_file(
            &dir.join("resolv.conf"),
            "# The rivet test cluster runs no DNS server.\noptions ndots:1\n",
        )?;
        let config_path = dir.join("kubelet.yaml");
        write_file(
            &config_path,
            &kubelet_config(&KubeletConfig {
                cgroup_root: &worker.cgroup_root,
                address: worker.address,
                ca: &pki.ca(),
                serving: &serving,
                static_pods: &dir.join("manifests"),
                resolv_conf: &dir.join("resolv.conf"),
                runtime: &socket,
            }),
        )?;
        let kubelet = Daemon::spawn(
            &format!("kubelet-{name}"),
            &[
                format!("--net={}", worker.netns.path().display()),
                format!("--mount={}", worker.mount_ns().display()),
            ],
            &tool_path(Tool::Kubelet)?,
            &[
                format!("--config={}", config_path.display()),
                format!("--kubeconfig={}", kubeconfig_path.display()),
                "--root-dir=/var/lib/kubelet".into(),
                format!("--hostname-override={name}"),
                format!("--node-ip={},{}", worker.address, worker.address_v6),
            ],
            worker.kubelet_log(),
        )?;
        worker.kubelet = Some(kubelet);
        Ok(())
    }

    /// Routes each worker's bridge pod CIDR to it from every other worker,
    /// so pods of the reference bridge reach each other across nodes.
    fn route_pod_cidrs(&self) -> Result<(), KubeClusterError> {
        for worker in &self.workers {
            for other in self.workers.iter().filter(|o| o.index != worker.index) {
                worker
                    .netns
                    .ip(&["route", "replace", &other.pod_cidr, "via", &other.address.to_string()])
                    .map_err(netns_err(format!("routing {} on {}", other.pod_cidr, worker.name)))?;
            }
        }
        Ok(())
    }

    /// Writes [`RECORD_FILE`]: what [`sweep`] removes when this process dies
    /// without dropping the cluster.
    fn record(&self) -> Result<(), KubeClusterError> {
        let namespaces: Vec<&str> = self
            .workers
            .iter()
            .map(|w| w.netns.name())
            .chain(self.control_plane_ns.as_ref().map(NetNs::name))
            .chain(self.underlay.as_ref().map(NetNs::name))
            .collect();
        let containerd_dirs: Vec<PathBuf> = self
            .workers
            .iter()
            .filter_map(|w| w.containerd.as_ref().map(|c| c.dir().to_path_buf()))
            .collect();
        let mount_namespaces: Vec<PathBuf> = self.workers.iter().map(Worker::mount_ns).collect();
        let record = serde_json::json!({
            "name": self.name,
            "namespaces": namespaces,
            "containerd_dirs": containerd_dirs,
            "mount_namespaces": mount_namespaces,
            "cgroup_top": format!("/{}", self.name),
        });
        write_file(&self.dir.join(RECORD_FILE), &record.to_string())
    }

    /// Polls `check` until it is Ok, checking every daemon is alive.
    async fn wait<F, Fut>(&mut self, what: &str, timeout: Duration, mut check: F) -> Result<(), KubeClusterError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_running()?;
            let last = match check().await {
                Ok(()) => return Ok(()),
                Err(last) => last,
            };
            if Instant::now() >= deadline {
                return Err(KubeClusterError::Timeout {
                    what: what.to_owned(),
                    timeout,
                    last,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        for worker in &mut self.workers {
            worker.teardown();
        }
        // kube-scheduler, kube-controller-manager, kube-apiserver, etcd.
        while let Some(mut daemon) = self.control_plane.pop() {
            daemon.stop();
        }
        drop(self.relay.take());
        if let Some(routes) = self.pod_routes.take() {
            routes.abort();
        }
        // Workers' namespaces, then the control plane's, then the bridge.
        self.workers.clear();
        drop(self.control_plane_ns.take());
        drop(self.underlay.take());
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("rivet kube cluster teardown: removing {}: {e}", self.dir.display());
        }
    }
}

/// Removes, without the [`KubeCluster`] guard, everything the cluster in
/// `dir` made, from its [`RECORD_FILE`]: for a cluster whose process was
/// killed (`rivet-kube-cluster down` after a SIGKILLed supervisor). Kills
/// every process that names the cluster's or a containerd's dir (daemons,
/// containerd, shims) and every process in its cgroups, deletes runc's
/// containers, releases the workers' mount namespaces, removes the cgroups,
/// the network namespaces and the dirs. Returns what it could not remove.
pub fn sweep(dir: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let record: serde_json::Value = match std::fs::read_to_string(dir.join(RECORD_FILE)) {
        Ok(text) => serde_json::from_str(&text).unwrap_or_default(),
        Err(e) => {
            problems.push(format!("reading {}: {e}", dir.join(RECORD_FILE).display()));
            serde_json::Value::Null
        }
    };
    let strings = |key: &str| -> Vec<String> {
        record[key]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let containerd_dirs: Vec<PathBuf> = strings("containerd_dirs").into_iter().map(PathBuf::from).collect();
    let mut owned: Vec<PathBuf> = vec![dir.to_path_buf()];
    owned.extend(containerd_dirs.iter().cloned());
    for pid in processes_naming(&owned) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let cgroups = record["cgroup_top"].as_str().map(cgroup_dirs).unwrap_or_default();
    for cgroup in &cgroups {
        for pid in cgroup_pids(cgroup) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    for containerd in &containerd_dirs {
        let root = containerd.join("runc").join(crate::containerd::CRI_NAMESPACE);
        for container in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&root)
                .args(["delete", "--force"])
                .arg(container.file_name())
                .output();
        }
    }
    for mnt in strings("mount_namespaces") {
        let _ = nix::mount::umount2(Path::new(&mnt), nix::mount::MntFlags::MNT_DETACH);
    }
    // Mounts a killed containerd left in the host's view (none expected:
    // its mounts live in the worker's mount namespace).
    for owned_dir in &owned {
        for mount in mounts_under(owned_dir) {
            let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    for cgroup in cgroups {
        remove_cgroup_tree(&cgroup);
        if cgroup.exists() {
            problems.push(format!("cgroup {} is still there", cgroup.display()));
        }
    }
    for namespace in strings("namespaces") {
        let out = Command::new("ip").args(["netns", "delete", &namespace]).output();
        if let Ok(out) = out
            && !out.status.success()
            && !String::from_utf8_lossy(&out.stderr).contains("No such file")
        {
            problems.push(format!(
                "deleting namespace {namespace}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    for owned_dir in owned {
        if let Err(e) = std::fs::remove_dir_all(&owned_dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            problems.push(format!("removing {}: {e}", owned_dir.display()));
        }
    }
    problems
}

/// Pids of processes whose command line names a path under one of `dirs`.
fn processes_naming(dirs: &[PathBuf]) -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if pid != me && dirs.iter().any(|d| cmdline.contains(&*d.to_string_lossy())) {
            pids.push(pid);
        }
    }
    pids
}

/// Mount points at or below `dir` in this process's mount namespace.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(PathBuf::from))
        .filter(|point| point.starts_with(dir))
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    mounts
}

/// The control plane being started: on failure, what was made is removed
/// by the [`KubeCluster`] it becomes.
struct ControlPlaneParts;

impl ControlPlaneParts {
    async fn start(name: &str, dir: &Path, underlay: NetNs) -> Result<KubeCluster, KubeClusterError> {
        underlay
            .ip(&["link", "add", BRIDGE, "type", "bridge"])
            .and_then(|_| underlay.ip(&["link", "set", BRIDGE, "up"]))
            .map_err(netns_err("creating the underlay bridge"))?;
        let control_plane_ns = NetNs::new("kccp").map_err(netns_err("creating the control-plane namespace"))?;
        attach_to_underlay(
            &underlay,
            &control_plane_ns,
            "cp",
            &format!("{CONTROL_PLANE_V4}/24"),
            &format!("{CONTROL_PLANE_V6}/64"),
        )?;
        let pki = std::sync::Arc::new(Pki::create(&dir.join("pki"))?);
        let local = format!("https://127.0.0.1:{API_SERVER_PORT}");
        let admin_cert = pki.client("admin", "rivet-admin", &["system:masters"])?;
        let relay = NetnsRelay::start(
            control_plane_ns.name(),
            SocketAddr::from((Ipv4Addr::LOCALHOST, API_SERVER_PORT)),
        )
        .await?;
        let admin_kubeconfig = dir.join("pki/admin.kubeconfig");
        write_file(
            &admin_kubeconfig,
            &kubeconfig(
                &format!("https://{}", relay.addr()),
                &pki.ca(),
                "rivet-admin",
                &admin_cert,
            ),
        )?;
        let admin = rivet_k8s::ClusterAccess::Kubeconfig(admin_kubeconfig).client().await?;
        let mut cluster = KubeCluster {
            name: name.to_owned(),
            dir: dir.to_path_buf(),
            admin,
            pki: std::sync::Arc::clone(&pki),
            workers: Vec::new(),
            control_plane: Vec::new(),
            relay: Some(relay),
            pod_routes: None,
            control_plane_ns: Some(control_plane_ns),
            underlay: Some(underlay),
            started_in: Duration::ZERO,
        };
        cluster.record()?;
        let ns_arg = vec![format!("--net={}", cluster.control_plane_netns().path().display())];
        let log = |name: &str| dir.join(format!("{name}.log"));
        let etcd_url = "http://127.0.0.1:2379";
        let peer_url = "http://127.0.0.1:2380";
        cluster.control_plane.push(Daemon::spawn(
            "etcd",
            &ns_arg,
            &tool_path(Tool::Etcd)?,
            &[
                "--name=cp".into(),
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=cp={peer_url}"),
                "--initial-cluster-state=new".into(),
                "--heartbeat-interval=10".into(),
                "--election-timeout=100".into(),
                "--log-level=warn".into(),
            ],
            log("etcd"),
        )?);
        // Rivet's kvstore: the workers' etcd overlay reaches it over the
        // underlay; a peer port of its own beside the API server's etcd.
        let rivet_etcd_url = cluster.rivet_etcd_endpoint();
        let rivet_peer_url = "http://127.0.0.1:2382";
        cluster.control_plane.push(Daemon::spawn(
            "rivet-etcd",
            &ns_arg,
            &tool_path(Tool::Etcd)?,
            &[
                "--name=rivet".into(),
                format!("--data-dir={}", dir.join("rivet-etcd").display()),
                format!("--listen-client-urls={rivet_etcd_url}"),
                format!("--advertise-client-urls={rivet_etcd_url}"),
                format!("--listen-peer-urls={rivet_peer_url}"),
                format!("--initial-advertise-peer-urls={rivet_peer_url}"),
                format!("--initial-cluster=rivet={rivet_peer_url}"),
                "--initial-cluster-state=new".into(),
                "--log-level=warn".into(),
            ],
            log("rivet-etcd"),
        )?);

        let serving = pki.server(
            "apiserver",
            "kube-apiserver",
            &[
                "127.0.0.1",
                &CONTROL_PLANE_V4.to_string(),
                KUBERNETES_SERVICE_IP,
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]
            .map(String::from),
        )?;
        let kubelet_client = pki.client(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            &["system:masters"],
        )?;
        // The aggregation layer's front proxy, as kubeadm sets it up; only
        // this certificate's name may assert users in request headers.
        let front_proxy = pki.client("front-proxy-client", "front-proxy-client", &[])?;
        let issuer = "https://kubernetes.default.svc.cluster.local";
        cluster.control_plane.push(Daemon::spawn(
            "kube-apiserver",
            &ns_arg,
            &tool_path(Tool::KubeApiserver)?,
            &[
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=0.0.0.0".into(),
                format!("--advertise-address={CONTROL_PLANE_V4}"),
                format!("--secure-port={API_SERVER_PORT}"),
                format!("--cert-dir={}", dir.join("pki/apiserver-generated").display()),
                format!("--tls-cert-file={}", serving.cert.display()),
                format!("--tls-private-key-file={}", serving.key.display()),
                format!("--client-ca-file={}", pki.ca().display()),
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                "--allow-privileged=true".into(),
                format!("--service-account-issuer={issuer}"),
                format!("--service-account-key-file={}", pki.sa_pub().display()),
                format!("--service-account-signing-key-file={}", pki.sa_key().display()),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                format!("--kubelet-client-certificate={}", kubelet_client.cert.display()),
                format!("--kubelet-client-key={}", kubelet_client.key.display()),
                format!("--kubelet-certificate-authority={}", pki.ca().display()),
                "--kubelet-preferred-address-types=InternalIP".into(),
                format!("--requestheader-client-ca-file={}", pki.ca().display()),
                "--requestheader-allowed-names=front-proxy-client".into(),
                "--requestheader-username-headers=X-Remote-User".into(),
                "--requestheader-group-headers=X-Remote-Group".into(),
                "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
                format!("--proxy-client-cert-file={}", front_proxy.cert.display()),
                format!("--proxy-client-key-file={}", front_proxy.key.display()),
                "--enable-priority-and-fairness=false".into(),
                "--profiling=false".into(),
            ],
            log("kube-apiserver"),
        )?);
        let admin = cluster.admin.clone();
        cluster
            .wait("waiting for kube-apiserver's /readyz", CONTROL_PLANE_TIMEOUT, || {
                let admin = admin.clone();
                async move {
                    let request = http::Request::get("/readyz")
                        .body(Vec::new())
                        .map_err(|e| e.to_string())?;
                    admin.request_text(request).await.map(drop).map_err(|e| e.to_string())
                }
            })
            .await?;

        for (component, user) in [
            ("kube-controller-manager", "system:kube-controller-manager"),
            ("kube-scheduler", "system:kube-scheduler"),
        ] {
            let cert = pki.client(component, user, &[])?;
            write_file(
                &dir.join(format!("pki/{component}.kubeconfig")),
                &kubeconfig(&local, &pki.ca(), user, &cert),
            )?;
        }
        let component_kubeconfig =
            |component: &str| dir.join(format!("pki/{component}.kubeconfig")).display().to_string();
        let kcm = component_kubeconfig("kube-controller-manager");
        cluster.control_plane.push(Daemon::spawn(
            "kube-controller-manager",
            &ns_arg,
            &tool_path(Tool::KubeControllerManager)?,
            &[
                format!("--kubeconfig={kcm}"),
                format!("--authentication-kubeconfig={kcm}"),
                format!("--authorization-kubeconfig={kcm}"),
                "--bind-address=127.0.0.1".into(),
                format!("--service-account-private-key-file={}", pki.sa_key().display()),
                format!("--root-ca-file={}", pki.ca().display()),
                "--use-service-account-credentials=true".into(),
                "--allocate-node-cidrs=false".into(),
                format!("--cluster-name={name}"),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--profiling=false".into(),
            ],
            log("kube-controller-manager"),
        )?);
        let scheduler = component_kubeconfig("kube-scheduler");
        cluster.control_plane.push(Daemon::spawn(
            "kube-scheduler",
            &ns_arg,
            &tool_path(Tool::KubeScheduler)?,
            &[
                format!("--kubeconfig={scheduler}"),
                format!("--authentication-kubeconfig={scheduler}"),
                format!("--authorization-kubeconfig={scheduler}"),
                "--bind-address=127.0.0.1".into(),
                "--profiling=false".into(),
            ],
            log("kube-scheduler"),
        )?);
        // kube-controller-manager works once the ServiceAccount controller
        // made `default/default` (pods need it: the admission plugin is on),
        // kube-scheduler once it holds its lease.
        let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), "default");
        let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-system");
        cluster
            .wait(
                "waiting for kube-controller-manager (ServiceAccount default/default) and kube-scheduler (its lease)",
                CONTROL_PLANE_TIMEOUT,
                || {
                    let accounts = accounts.clone();
                    let leases = leases.clone();
                    async move {
                        accounts
                            .get_opt("default")
                            .await
                            .map_err(|e| e.to_string())?
                            .ok_or("no ServiceAccount default/default yet")?;
                        for lease in ["kube-scheduler", "kube-controller-manager"] {
                            let held = leases
                                .get_opt(lease)
                                .await
                                .map_err(|e| e.to_string())?
                                .and_then(|l| l.spec)
                                .and_then(|s| s.holder_identity)
                                .is_some();
                            if !held {
                                return Err(format!("lease kube-system/{lease} not held yet"));
                            }
                        }
                        Ok(())
                    }
                },
            )
            .await?;
        Ok(cluster)
    }
}

/// Keeps a route to every Node's pod CIDRs (`spec.podCIDRs`, set by Rivet's
/// operator) via its InternalIP of the same family in the control-plane
/// namespace, as a cloud's route table would: the API server's answers to
/// pods (not hostNetwork) find their way back. kube's watcher re-lists with
/// backoff after errors; the task ends with the cluster.
async fn route_pod_cidrs_to_nodes(client: Client, control_plane_ns: String) {
    use futures::StreamExt as _;
    use kube::runtime::{WatchStreamExt as _, watcher};
    let nodes: Api<Node> = Api::all(client);
    let mut events = watcher::watcher(nodes, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        let Ok(node) = event else { continue };
        let cidrs = node.spec.and_then(|s| s.pod_cidrs).unwrap_or_default();
        let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
        for cidr in cidrs {
            let v6 = cidr.contains(':');
            let Some(via) = addresses
                .iter()
                .find(|a| a.type_ == "InternalIP" && a.address.contains(':') == v6)
            else {
                continue;
            };
            let ns = control_plane_ns.clone();
            let via = via.address.clone();
            // `ip route replace` is idempotent; a failure shows in the
            // control plane's routes, which tests check.
            let _ = tokio::task::spawn_blocking(move || {
                NetNs::existing(&ns).and_then(|ns| ns.ip(&["route", "replace", &cidr, "via", &via]))
            })
            .await;
        }
    }
}

/// A veth `ul0` in `ns` with the given addresses, its peer `port` on the
/// underlay bridge, both up.
fn attach_to_underlay(underlay: &NetNs, ns: &NetNs, port: &str, v4: &str, v6: &str) -> Result<(), KubeClusterError> {
    let context = format!("attaching {} to the underlay as {port}", ns.name());
    ns.ip(&[
        "link",
        "add",
        UNDERLAY_INTERFACE,
        "type",
        "veth",
        "peer",
        "name",
        port,
        "netns",
        underlay.name(),
    ])
    .and_then(|_| underlay.ip(&["link", "set", port, "master", BRIDGE, "up"]))
    .and_then(|_| ns.ip(&["addr", "add", v4, "dev", UNDERLAY_INTERFACE]))
    .and_then(|_| ns.ip(&["-6", "addr", "add", v6, "dev", UNDERLAY_INTERFACE, "nodad"]))
    .and_then(|_| ns.ip(&["link", "set", UNDERLAY_INTERFACE, "up"]))
    .map(drop)
    .map_err(netns_err(context))
}

/// Copies every reference plugin of /usr/lib/cni into `bin` (copies, not
/// symlinks: a pod mounting the node's /opt/cni/bin, as Rivet's CNI
/// installer does, must find the files there, as on a real node).
fn link_reference_plugins(bin: &Path) -> Result<(), KubeClusterError> {
    let source = Path::new(crate::containerd::REFERENCE_CNI_DIR);
    let entries = std::fs::read_dir(source).map_err(io_err(format!("listing {}", source.display())))?;
    for entry in entries.flatten() {
        let target = bin.join(entry.file_name());
        std::fs::copy(entry.path(), &target).map_err(io_err(format!("copying {}", target.display())))?;
    }
    Ok(())
}

/// The reference bridge + host-local conflist for one worker.
fn bridge_conflist(pod_cidr: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "rivet-kube-cluster-bridge",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": pod_cidr }]],
                "routes": [{ "dst": "0.0.0.0/0" }]
            }
        }, {
            "type": "portmap",
            "capabilities": { "portMappings": true }
        }]
    })
    .to_string()
}

/// Makes the worker's mount namespace, bound at [`Worker::mount_ns`]: `/etc`
/// an overlay with the worker's upper dir; `/opt`, `/run`, `/var/log`,
/// `/var/lib/cni` the worker's dirs; `/sys/fs/bpf` a new bpffs (at
/// `<dir>/bpf` on the host); the kubelet's sysctls shown as files.
fn create_mount_ns(worker: &Worker) -> Result<(), KubeClusterError> {
    let dir = &worker.dir;
    let mnt = worker.mount_ns();
    std::fs::File::create(&mnt).map_err(io_err(format!("creating {}", mnt.display())))?;
    let bpffs = dir.join("bpf");
    std::fs::create_dir_all(&bpffs).map_err(io_err(format!("creating {}", bpffs.display())))?;
    // Every bpf mount is a new instance: the worker's pins are its own.
    nix::mount::mount(
        Some("bpf"),
        &bpffs,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| io_err(format!("mounting a bpffs at {}", bpffs.display()))(e.into()))?;
    let q = |p: &Path| shell_quote(&p.display().to_string());
    let mut script = String::from("set -e\n");
    script.push_str(&format!("mount --bind {} /sys/fs/bpf\n", q(&bpffs)));
    for (inside, host) in [("/etc", "etc"), ("/var/lib", "var-lib")] {
        script.push_str(&format!(
            "mount -t overlay overlay -o lowerdir={inside},upperdir={},workdir={} {inside}\n",
            dir.join(host).join("upper").display(),
            dir.join(host).join("work").display()
        ));
    }
    for (inside, host) in [
        ("/opt", "opt"),
        ("/run", "run"),
        ("/var/log", "log"),
        ("/var/lib/cni", "var-lib-cni"),
    ] {
        // A fresh machine has no /var/lib/cni: made in the /var/lib
        // overlay's upper dir (the worker's), never on the host.
        if inside.starts_with("/var/lib/") {
            script.push_str(&format!("mkdir -p {inside}\n"));
        }
        script.push_str(&format!("mount --bind {} {inside}\n", q(&dir.join(host))));
    }
    // The node's cgroup v2 directory where deploy/ looks for it (a real
    // node binds its /sys/fs/cgroup there).
    if let Some(unified) = unified_hierarchy() {
        let node_cgroup = unified.join(worker.cgroup_root.trim_start_matches('/'));
        script.push_str(&format!(
            "mkdir -p {NODE_CGROUP_DIR}\nmount --bind {} {NODE_CGROUP_DIR}\n",
            q(&node_cgroup)
        ));
    }
    for (key, value) in KUBELET_SYSCTLS {
        let file = dir.join("sysctl").join(key.replace('/', "."));
        write_file(&file, &format!("{value}\n"))?;
        script.push_str(&format!("mount --bind -o ro {} /proc/sys/{key}\n", q(&file)));
    }
    let out = Command::new("unshare")
        .arg(format!("--mount={}", mnt.display()))
        .args(["--propagation", "private", "sh", "-c", &script])
        .output()
        .map_err(io_err(format!("creating worker {}'s mount namespace", worker.name)))?;
    if !out.status.success() {
        // unshare may have bound the namespace before the script failed.
        let _ = nix::mount::umount2(&mnt, nix::mount::MntFlags::MNT_DETACH);
        let _ = nix::mount::umount2(&bpffs, nix::mount::MntFlags::MNT_DETACH);
        return Err(KubeClusterError::Io {
            context: format!(
                "setting up worker {}'s mount namespace: {}",
                worker.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            source: std::io::Error::other(out.status.to_string()),
        });
    }
    Ok(())
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The fields of the kubelet's config that differ per worker.
struct KubeletConfig<'a> {
    cgroup_root: &'a str,
    address: Ipv4Addr,
    ca: &'a Path,
    serving: &'a pki::CertFiles,
    static_pods: &'a Path,
    resolv_conf: &'a Path,
    runtime: &'a Path,
}

/// The kubelet's `KubeletConfiguration` (see the module docs for why).
fn kubelet_config(c: &KubeletConfig<'_>) -> String {
    serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": c.cgroup_root,
        "cgroupsPerQOS": true,
        "enforceNodeAllocatable": ["pods"],
        "failSwapOn": false,
        "protectKernelDefaults": true,
        "address": c.address.to_string(),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": c.serving.cert,
        "tlsPrivateKeyFile": c.serving.key,
        "authentication": {
            "anonymous": { "enabled": false },
            "webhook": { "enabled": true },
            "x509": { "clientCAFile": c.ca }
        },
        "authorization": { "mode": "Webhook" },
        "staticPodPath": c.static_pods,
        "resolvConf": c.resolv_conf,
        "clusterDomain": "cluster.local",
        "containerRuntimeEndpoint": format!("unix://{}", c.runtime.display()),
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%"
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": false,
        "registerNode": true
    })
    .to_string()
}

/// Whether a Node's Ready condition is True.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Every cgroup hierarchy, the unified one too (runc makes the pods'
/// cgroups there as well on this hybrid machine): what teardown cleans.
fn all_cgroup_hierarchies() -> Vec<PathBuf> {
    cgroup_mounts(&["cgroup", "cgroup2"])
}

/// Mount points of file systems of the given types.
fn cgroup_mounts(types: &[&str]) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let point = before.split(' ').nth(4)?;
            types.contains(&after.split(' ').next()?).then(|| PathBuf::from(point))
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// `<hierarchy>/<root>` in every hierarchy.
fn cgroup_dirs(root: &str) -> Vec<PathBuf> {
    all_cgroup_hierarchies()
        .into_iter()
        .map(|h| h.join(root.trim_start_matches('/')))
        .collect()
}

/// The cgroup v2 (unified) hierarchy's mount point, if there is one.
fn unified_hierarchy() -> Option<PathBuf> {
    cgroup_mounts(&["cgroup2"]).into_iter().next()
}

/// Moves process `pid` into `<root>/<child>` of the unified hierarchy
/// (created), where the node's socket load balancing sees its sockets.
/// Nothing to do without a unified hierarchy.
fn join_node_cgroup(root: &str, child: &str, pid: u32) -> Result<(), KubeClusterError> {
    let Some(unified) = unified_hierarchy() else {
        return Ok(());
    };
    let dir = unified.join(root.trim_start_matches('/')).join(child);
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating cgroup {}", dir.display())))?;
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, pid.to_string()).map_err(io_err(format!("moving process {pid} into {}", procs.display())))
}

/// Creates the kubelet's cgroup root in every hierarchy (the kubelet
/// checks it exists in v1; in v2 it is the node's cgroup that
/// [`NODE_CGROUP_DIR`] shows), with the cpuset of the hierarchy's root.
fn create_cgroup_root(root: &str) -> Result<(), KubeClusterError> {
    for hierarchy in all_cgroup_hierarchies() {
        let mut dir = hierarchy.clone();
        for part in root.trim_start_matches('/').split('/') {
            dir.push(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).map_err(io_err(format!("creating cgroup {}", dir.display())))?;
            }
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let parent = dir.parent().map(|p| p.join(file));
                if let Some(parent) = parent.filter(|p| p.exists()) {
                    let value =
                        std::fs::read_to_string(&parent).map_err(io_err(format!("reading {}", parent.display())))?;
                    std::fs::write(dir.join(file), value.trim())
                        .map_err(io_err(format!("writing {}", dir.join(file).display())))?;
                }
            }
        }
    }
    Ok(())
}

fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    for child in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if child.path().is_dir() {
            pids.extend(cgroup_pids(&child.path()));
        }
    }
    pids
}

/// Removes a cgroup and its children, depth first, then its parent when
/// empty (the cluster's `/<cluster>` top); a cgroup whose killed processes
/// are not reaped yet is retried for 5 s.
fn remove_cgroup_tree(dir: &Path) {
    fn remove(dir: &Path) {
        for child in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if child.path().is_dir() {
                remove(&child.path());
            }
        }
        let started = Instant::now();
        loop {
            match std::fs::remove_dir(dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e)
                    if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32)
                        && started.elapsed() < Duration::from_secs(5) =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    eprintln!("rivet kube cluster teardown: removing cgroup {}: {e}", dir.display());
                    return;
                }
            }
        }
    }
    remove(dir);
    if let Some(parent) = dir.parent() {
        // Fails while another worker's root is still there: fine.
        let _ = std::fs::remove_dir(parent);
    }
}

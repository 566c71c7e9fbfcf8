//! A containerd 1.6 the test owns: its own config, root, state, gRPC and
//! ttrpc sockets, runc root, pod netns mounts and cgroup parent, all under one
//! temp dir, so it runs beside (and never touches) a containerd of the
//! machine.
//!
//! Where it runs: containerd execs the CNI plugin itself, as a child, so the
//! plugin runs in containerd's network namespace. rivet-cni must see the
//! node's interfaces and reach svc-loader's datapath there, so containerd is
//! started inside the *node* namespace (`nsenter --net=<node ns>`, the mount
//! namespace stays the host's: bpffs, /run and the temp dir are shared).
//! The pod namespaces it creates are new ones, bind-mounted under
//! `<state>/io.containerd.grpc.v1.cri/netns/`
//! (`netns_mounts_under_state_dir`), not in /run/netns.
//!
//! Drop tears down in order: every pod sandbox through the CRI (stop +
//! remove, which runs CNI DEL), containerd (SIGTERM, then SIGKILL), then
//! whatever is still there by force: runc containers (`runc delete
//! --force`), shims (SIGKILL, their sockets in /run/containerd/s), mounts
//! under the temp dir (pod netns, rootfs, shm), the cgroup parent, the dir.
//!
//! ```no_run
//! # async fn t() -> rivet_e2e::Result<()> {
//! use rivet_e2e::containerd::{Containerd, ContainerdConfig};
//! let cni = tempfile::tempdir().unwrap();
//! let config = ContainerdConfig::new(cni.path().join("bin"), cni.path().join("conf"))
//!     .netns("/run/netns/rvn-1234");
//! let containerd = Containerd::start(config).await?;
//! containerd.import_e2e_images().await?;
//! let cri = containerd.cri().await?;
//! # Ok(()) }
//! ```

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cri::Cri;
use crate::image::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use crate::{Error, Missing, Result, io_context, tail};

/// The containerd namespace the CRI plugin uses.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// Where the CRI plugin mounts pod network namespaces, below containerd's
/// dir (with `netns_mounts_under_state_dir`).
pub const NETNS_DIR: &str = "state/io.containerd.grpc.v1.cri/netns";

/// Binaries the harness runs, and where a Debian machine gets them.
pub const REQUIRED_BINARIES: &[(&str, &str)] = &[
    ("containerd", "Debian package containerd (1.6)"),
    ("containerd-shim-runc-v2", "Debian package containerd (1.6)"),
    ("ctr", "Debian package containerd (1.6)"),
    ("runc", "Debian package runc"),
    ("nsenter", "Debian package util-linux"),
];

/// The reference plugins containerd's CRI plugin needs beside the pod
/// network's own: it always sets up the pod's `lo` with `loopback`.
pub const REFERENCE_CNI_DIR: &str = "/usr/lib/cni";

static INSTANCES: AtomicU32 = AtomicU32::new(0);

/// Live [`Containerd`]s of this process: the last one to go removes the
/// shared (hard-coded) shim socket dir /run/containerd/s when it is empty,
/// under this lock so that no other instance starts a shim meanwhile.
static LIVE: Mutex<usize> = Mutex::new(0);

/// containerd 1.6 puts every shim's socket in `/run/containerd/s/<hash>`,
/// whatever its own state dir.
const SHIM_SOCKET_DIR: &str = "/run/containerd/s";

/// How to run containerd.
#[derive(Debug, Clone)]
pub struct ContainerdConfig {
    /// Network namespace (path) containerd, and so every CNI plugin it
    /// runs, lives in; `None`: the caller's.
    pub netns: Option<PathBuf>,
    /// Mount namespace (path of its nsfs file) containerd lives in; `None`:
    /// the caller's. Needs [`netns`](Self::netns).
    pub mount_ns: Option<PathBuf>,
    /// Whether start waits for NetworkReady too (a CNI config present);
    /// `false` for a node whose network plugin is installed later, by a
    /// pod (kubelet runs hostNetwork pods before the network is ready).
    pub require_network_ready: bool,
    /// CNI `bin_dir` (plugin binaries).
    pub cni_bin_dir: PathBuf,
    /// CNI `conf_dir` (the first `.conflist` / `.conf` by name is used).
    pub cni_conf_dir: PathBuf,
    /// The sandbox (pause) image: [`PAUSE_IMAGE`] unless changed; it must be
    /// imported before the first `RunPodSandbox` (nothing is pulled).
    pub sandbox_image: String,
    /// `overlayfs` (default; works on this machine's ext4) or `native`.
    pub snapshotter: String,
    /// How long start may take until the CRI reports RuntimeReady and
    /// NetworkReady.
    pub start_timeout: Duration,
    /// containerd's log level.
    pub log_level: String,
    /// More runtime handlers, runc like the default, each with its own CNI
    /// `conf_dir` (name, dir): a pod whose RuntimeClass names one gets that
    /// network instead of [`cni_conf_dir`](Self::cni_conf_dir)'s.
    pub network_handlers: Vec<(String, PathBuf)>,
}

impl ContainerdConfig {
    /// Defaults with the given CNI directories.
    pub fn new(cni_bin_dir: impl Into<PathBuf>, cni_conf_dir: impl Into<PathBuf>) -> Self {
        Self {
            netns: None,
            mount_ns: None,
            require_network_ready: true,
            cni_bin_dir: cni_bin_dir.into(),
            cni_conf_dir: cni_conf_dir.into(),
            sandbox_image: PAUSE_IMAGE.to_owned(),
            snapshotter: "overlayfs".to_owned(),
            start_timeout: Duration::from_secs(20),
            log_level: "info".to_owned(),
            network_handlers: Vec::new(),
        }
    }

    /// Runs containerd in network namespace `path` (e.g. `/run/netns/<node>`).
    pub fn netns(mut self, path: impl Into<PathBuf>) -> Self {
        self.netns = Some(path.into());
        self
    }

    /// Runs containerd in the mount namespace at `path` as well (a node
    /// with its own /etc/cni, /opt/cni, /run: the Kubernetes cluster's
    /// workers).
    pub fn mount_ns(mut self, path: impl Into<PathBuf>) -> Self {
        self.mount_ns = Some(path.into());
        self
    }

    /// Start does not wait for NetworkReady.
    pub fn network_later(mut self) -> Self {
        self.require_network_ready = false;
        self
    }

    /// Adds runtime handler `name`, whose pods get the network of the first
    /// config in `cni_conf_dir` (see [`network_handlers`](Self::network_handlers)).
    pub fn network_handler(mut self, name: &str, cni_conf_dir: impl Into<PathBuf>) -> Self {
        self.network_handlers.push((name.to_owned(), cni_conf_dir.into()));
        self
    }

    /// Sets the snapshotter.
    pub fn snapshotter(mut self, name: &str) -> Self {
        self.snapshotter = name.to_owned();
        self
    }
}

/// Checks what the harness needs from the machine: root and
/// [`REQUIRED_BINARIES`] on `PATH`. The error names what is missing.
pub fn check_prerequisites() -> Result<()> {
    check_binaries(std::env::var_os("PATH").unwrap_or_default())?;
    if !nix::unistd::geteuid().is_root() {
        return Err(Missing::Root.into());
    }
    Ok(())
}

/// [`REQUIRED_BINARIES`] in `path` (a `PATH` value), or an error naming the
/// first missing one and its package.
pub fn check_binaries(path: OsString) -> Result<()> {
    for (binary, package) in REQUIRED_BINARIES {
        if find_in_path(binary, &path).is_none() {
            return Err(Missing::Binary {
                binary: (*binary).into(),
                package: (*package).into(),
                path: path.to_string_lossy().into_owned(),
            }
            .into());
        }
    }
    Ok(())
}

/// The first executable `name` in the directories of `path`.
pub fn find_in_path(name: &str, path: &OsString) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path).map(|dir| dir.join(name)).find(|candidate| {
        std::fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// A running containerd; see the module docs. Dropping it removes
/// everything it created.
#[derive(Debug)]
pub struct Containerd {
    child: Option<Child>,
    config: ContainerdConfig,
    cgroup_parent: String,
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    /// Answered the CRI once (teardown tries the CRI only then).
    ready: bool,
    /// Counted in [`LIVE`].
    live: bool,
}

/// What is still there that a pod could have left behind (see
/// [`Containerd::leftovers`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Pod network namespaces still mounted under `<state>/io.containerd.grpc.v1.cri/netns/`.
    pub netns: Vec<PathBuf>,
    /// Containers runc still knows.
    pub runc_containers: Vec<String>,
    /// Shim processes of this containerd.
    pub shims: Vec<u32>,
    /// Mounts under containerd's dir.
    pub mounts: Vec<PathBuf>,
}

impl Leftovers {
    /// What the containerd that lived in `dir` (a [`Containerd::dir`]) left:
    /// also usable after it was dropped.
    pub fn scan(dir: &Path) -> Self {
        let runc_containers = list_dir(&dir.join("runc").join(CRI_NAMESPACE))
            .into_iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        Self {
            netns: list_dir(&dir.join(NETNS_DIR)),
            runc_containers,
            shims: shims_of(&dir.join("containerd.sock")),
            mounts: mounts_under(dir),
        }
    }

    /// Nothing left.
    pub fn is_empty(&self) -> bool {
        self.netns.is_empty() && self.runc_containers.is_empty() && self.shims.is_empty() && self.mounts.is_empty()
    }
}

impl Containerd {
    /// Writes the config, starts containerd and waits until its CRI plugin
    /// reports RuntimeReady and NetworkReady (which needs a CNI config in
    /// `cni_conf_dir`).
    pub async fn start(config: ContainerdConfig) -> Result<Self> {
        check_prerequisites()?;
        let dir = tempfile::Builder::new()
            .prefix("rivet-ctrd-")
            .tempdir()
            .map_err(io_context("creating containerd's temp dir"))?;
        let path = dir.path().to_path_buf();
        let cgroup_parent = format!(
            "rivet-e2e-{}-{}",
            std::process::id(),
            INSTANCES.fetch_add(1, Ordering::Relaxed)
        );
        *LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        let mut containerd = Self {
            child: None,
            config,
            cgroup_parent,
            dir: Some(dir),
            path,
            ready: false,
            live: true,
        };
        std::fs::write(containerd.config_path(), containerd.config_toml())
            .map_err(io_context("writing containerd's config"))?;
        let log = File::create(containerd.log_path()).map_err(io_context("creating containerd's log"))?;
        let mut command = match &containerd.config.netns {
            Some(netns) => {
                let mut command = Command::new("nsenter");
                command.arg(format!("--net={}", netns.display()));
                if let Some(mount_ns) = &containerd.config.mount_ns {
                    command.arg(format!("--mount={}", mount_ns.display()));
                }
                command.arg("containerd");
                command
            }
            None => Command::new("containerd"),
        };
        command
            .arg("--config")
            .arg(containerd.config_path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io_context("containerd's log"))?)
            .stderr(log);
        containerd.child = Some(command.spawn().map_err(io_context("starting containerd"))?);
        containerd.wait_ready().await?;
        containerd.ready = true;
        Ok(containerd)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let started = Instant::now();
        let mut last = String::from("the socket did not appear");
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait().map_err(io_context("waiting for containerd"))?
            {
                self.child = None;
                return Err(self.failure(format!("exited during start-up ({status})")));
            }
            if self.socket().exists() {
                match self.ready().await {
                    Ok(()) => return Ok(()),
                    Err(reason) => last = reason,
                }
            }
            if started.elapsed() > self.config.start_timeout {
                return Err(self.failure(format!("not ready within {:?}: {last}", self.config.start_timeout)));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn ready(&self) -> std::result::Result<(), String> {
        let cri = self.cri().await.map_err(|e| e.to_string())?;
        let conditions = cri.status().await.map_err(|e| e.to_string())?;
        let not_ready: Vec<String> = conditions
            .iter()
            .filter(|c| !c.status && (self.config.require_network_ready || c.r#type != "NetworkReady"))
            .map(|c| format!("{} ({}: {})", c.r#type, c.reason, c.message))
            .collect();
        if conditions.is_empty() || !not_ready.is_empty() {
            return Err(format!("CRI status not ready: {}", not_ready.join("; ")));
        }
        Ok(())
    }

    fn failure(&self, reason: String) -> Error {
        Error::Containerd {
            config: self.config_path(),
            reason,
            log: tail(&self.log(), 30),
        }
    }

    /// The temp dir everything lives in.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// The gRPC socket (CRI and containerd's own API).
    pub fn socket(&self) -> PathBuf {
        self.path.join("containerd.sock")
    }

    /// `config.toml`.
    pub fn config_path(&self) -> PathBuf {
        self.path.join("config.toml")
    }

    /// containerd's stdout and stderr.
    pub fn log_path(&self) -> PathBuf {
        self.path.join("containerd.log")
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Where pods' container logs go ([`PodSpec::log_directory`](crate::cri::PodSpec)).
    pub fn pod_log_dir(&self, pod: &str) -> PathBuf {
        self.path.join("pod-logs").join(pod)
    }

    /// The directory pod network namespaces are mounted in.
    pub fn netns_dir(&self) -> PathBuf {
        self.path.join(NETNS_DIR)
    }

    /// containerd's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The cgroup parent to give pods (relative: below the test's own
    /// cgroup in every hierarchy; removed on drop).
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// The directories of [`cgroup_parent`](Self::cgroup_parent) in every
    /// cgroup hierarchy (existing only while pods run).
    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        cgroup_dirs(&self.cgroup_parent)
    }

    /// The runc root of CRI containers.
    fn runc_root(&self) -> PathBuf {
        self.path.join("runc").join(CRI_NAMESPACE)
    }

    /// The config (version 2).
    pub fn config_toml(&self) -> String {
        let p = |name: &str| toml_string(&self.path.join(name));
        let config = &self.config;
        format!(
            r#"# Written by rivet-e2e: a containerd of its own, nothing shared with the machine's.
version = 2
root = {root}
state = {state}
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = {grpc}

[ttrpc]
  address = {ttrpc}

[debug]
  level = {level}

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = {opt}
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = {sandbox}
    # Root here lacks CAP_SYS_RESOURCE: never lower oom_score_adj below ours.
    restrict_oom_score_adj = true
    # Pod netns under <state>/io.containerd.grpc.v1.cri/netns, not /run/netns: ours alone, easy to clean.
    netns_mounts_under_state_dir = true
    enable_selinux = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = {snapshotter}
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          # runc state of our containers under our dir (default /run/containerd/runc).
          Root = {runc}
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = {bin}
      conf_dir = {conf}
      max_conf_num = 1
{handlers}"#,
            root = p("root"),
            state = p("state"),
            grpc = toml_string(&self.socket()),
            ttrpc = p("containerd.sock.ttrpc"),
            level = toml_quote(&config.log_level),
            opt = p("opt"),
            sandbox = toml_quote(&config.sandbox_image),
            snapshotter = toml_quote(&config.snapshotter),
            runc = p("runc"),
            bin = toml_string(&config.cni_bin_dir),
            conf = toml_string(&config.cni_conf_dir),
            handlers = self.network_handlers_toml(),
        )
    }

    /// The runtimes of [`ContainerdConfig::network_handlers`]: the default's
    /// runc settings, their own CNI dir.
    fn network_handlers_toml(&self) -> String {
        let runtimes = r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes"#;
        let mut toml = String::new();
        for (name, conf_dir) in &self.config.network_handlers {
            let name = toml_quote(name);
            toml.push_str(&format!(
                r#"    {runtimes}.{name}]
      runtime_type = "io.containerd.runc.v2"
      cni_conf_dir = {conf}
      cni_max_conf_num = 1
      {runtimes}.{name}.options]
        Root = {runc}
"#,
                conf = toml_string(conf_dir),
                runc = toml_string(&self.path.join("runc")),
            ));
        }
        toml
    }

    /// A CRI client on the socket.
    pub async fn cri(&self) -> Result<Cri> {
        Cri::connect(&self.socket()).await
    }

    /// `ctr images import` of an OCI archive into the CRI namespace,
    /// unpacked for the configured snapshotter; then waits until the CRI
    /// plugin sees every image of `names`.
    pub async fn import_images(&self, archive: &Path, names: &[&str]) -> Result<()> {
        let mut command = Command::new("ctr");
        command
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", CRI_NAMESPACE, "images", "import", "--snapshotter"])
            .arg(&self.config.snapshotter)
            .arg(archive);
        run(&mut command)?;
        let cri = self.cri().await?;
        let started = Instant::now();
        for name in names {
            while !cri.has_image(name).await? {
                if started.elapsed() > Duration::from_secs(10) {
                    return Err(self.failure(format!("imported image {name} is not visible to the CRI plugin")));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// Runs `args` in a container of `image` to completion with `ctr run
    /// --rm` (no pod, no CNI: the container gets an empty network namespace
    /// of its own) and returns its output (stdout and stderr, through a log
    /// file: a container of plain `ctr run` keeps an open stdin, and a
    /// program reading it, rivet-cni, never finishes). `id` names the container; its
    /// cgroup is under [`cgroup_parent`](Self::cgroup_parent), as pods' are.
    /// `binds` are host files mounted read-only at their path in the
    /// container (e.g. a static busybox into an image without a shell).
    pub fn run_container(
        &self,
        image: &str,
        id: &str,
        env: &[(&str, &str)],
        binds: &[(&Path, &str)],
        args: &[&str],
    ) -> Result<String> {
        let mut command = Command::new("ctr");
        command
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", CRI_NAMESPACE, "run", "--rm", "--snapshotter"])
            .arg(&self.config.snapshotter)
            .arg("--cgroup")
            .arg(format!("{}/{id}", self.cgroup_parent));
        for (name, value) in env {
            command.arg("--env").arg(format!("{name}={value}"));
        }
        for (source, target) in binds {
            command.arg("--mount").arg(format!(
                "type=bind,src={},dst={target},options=rbind:ro",
                source.display()
            ));
        }
        let logs = self.path.join("ctr-run");
        std::fs::create_dir_all(&logs).map_err(io_context(format!("creating {}", logs.display())))?;
        let log = logs.join(format!("{id}.log"));
        command.arg("--log-uri").arg(format!("file://{}", log.display()));
        let result = run(command.arg(image).arg(id).args(args));
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        match result {
            Ok(_) => Ok(output),
            Err(Error::Command { cmd, status, stderr }) => Err(Error::Command {
                cmd,
                status,
                stderr: format!("{stderr}{output}"),
            }),
            Err(other) => Err(other),
        }
    }

    /// Builds the e2e archive ([`write_e2e_archive`](crate::image::write_e2e_archive):
    /// pause + busybox) and imports it.
    pub async fn import_e2e_images(&self) -> Result<()> {
        let archive = self.path.join("e2e-images.tar");
        crate::image::write_e2e_archive(&archive)?;
        self.import_images(&archive, &[PAUSE_IMAGE, BUSYBOX_IMAGE]).await
    }

    /// What pods could have left behind: mounted pod netns, runc containers,
    /// shims, mounts under the dir. Empty once every sandbox was removed.
    pub fn leftovers(&self) -> Leftovers {
        Leftovers::scan(&self.path)
    }

    /// SIGKILLs containerd alone, as a crash would: shims and pods keep
    /// running. Drop then removes them without the CRI.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops every pod through the CRI (bounded), then containerd, then
    /// removes whatever is left by force. Called by drop.
    fn teardown(&mut self) {
        if let Some(child) = self.child.as_mut()
            && matches!(child.try_wait(), Ok(None))
            && self.ready
        {
            self.remove_sandboxes_via_cri(Duration::from_secs(20));
        }
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            let started = Instant::now();
            while matches!(child.try_wait(), Ok(None)) && started.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.force_cleanup();
    }

    /// StopPodSandbox + RemovePodSandbox for every sandbox, on a thread with
    /// its own runtime (drop may run inside or outside one).
    fn remove_sandboxes_via_cri(&self, budget: Duration) {
        let socket = self.socket();
        let worker = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => return vec![format!("no runtime for the CRI teardown: {e}")],
            };
            runtime.block_on(async move {
                let work = async {
                    let mut errors = Vec::new();
                    let cri = match Cri::connect(&socket).await {
                        Ok(cri) => cri,
                        Err(e) => return vec![e.to_string()],
                    };
                    match cri.list_pod_sandboxes().await {
                        Ok(sandboxes) => {
                            for sandbox in sandboxes {
                                if let Err(e) = cri.delete_pod(&sandbox.id).await {
                                    errors.push(e.to_string());
                                }
                            }
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                    errors
                };
                tokio::time::timeout(budget, work)
                    .await
                    .unwrap_or_else(|_| vec![format!("CRI teardown took over {budget:?}")])
            })
        });
        match worker.join() {
            Ok(errors) => {
                for error in errors {
                    eprintln!("rivet-e2e containerd teardown: {error}");
                }
            }
            Err(_) => eprintln!("rivet-e2e containerd teardown: the CRI teardown thread panicked"),
        }
    }

    /// Removes, without containerd's help, what its pods and shims may have
    /// left: runc containers, shims and their sockets, mounts, cgroups.
    fn force_cleanup(&self) {
        let runc_root = self.runc_root();
        for container in list_dir(&runc_root) {
            let Some(id) = container.file_name() else { continue };
            let mut command = Command::new("runc");
            command
                .arg("--root")
                .arg(&runc_root)
                .args(["delete", "--force"])
                .arg(id);
            if let Err(e) = run(&mut command) {
                eprintln!("rivet-e2e containerd teardown: {e}");
            }
        }
        // Shim sockets are in /run/containerd/s/; each bundle names its own.
        let bundles = self
            .path
            .join("state/io.containerd.runtime.v2.task")
            .join(CRI_NAMESPACE);
        let sockets: Vec<PathBuf> = list_dir(&bundles)
            .into_iter()
            .filter_map(|bundle| std::fs::read_to_string(bundle.join("address")).ok())
            .filter_map(|address| address.trim().strip_prefix("unix://").map(PathBuf::from))
            .collect();
        for pid in shims_of(&self.socket()) {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
        for socket in &sockets {
            let _ = std::fs::remove_file(socket);
        }
        let mut mounts = mounts_under(&self.path);
        mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
        for mount in mounts {
            if let Err(e) = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH) {
                eprintln!("rivet-e2e containerd teardown: unmounting {}: {e}", mount.display());
            }
        }
        // Anything still in the pods' cgroups (runc could not delete it).
        let dirs = cgroup_dirs(&self.cgroup_parent);
        for dir in &dirs {
            for pid in cgroup_tree_pids(dir) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        for dir in &dirs {
            remove_cgroup_tree(dir);
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.teardown();
        if std::mem::take(&mut self.live) {
            let mut live = LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *live -= 1;
            // The shared dirs, only when no containerd of ours needs them and
            // no shim of anyone's runs (rmdir fails on a non-empty dir).
            if *live == 0 && !any_shim_running() {
                for dir in [SHIM_SOCKET_DIR, "/run/containerd"] {
                    let _ = std::fs::remove_dir(dir);
                }
            }
        }
        if let Some(dir) = self.dir.take()
            && let Err(e) = dir.close()
        {
            eprintln!("rivet-e2e containerd teardown: removing {}: {e}", self.path.display());
        }
    }
}

/// A TOML basic string.
fn toml_quote(text: &str) -> String {
    serde_json::to_string(text).expect("strings serialise")
}

fn toml_string(path: &Path) -> String {
    toml_quote(&path.to_string_lossy())
}

/// Runs a command; a failure quotes its output.
pub(crate) fn run(command: &mut Command) -> Result<String> {
    let cmd = format!("{command:?}");
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(io_context(format!("running {cmd}")))?;
    if !out.status.success() {
        return Err(Error::Command {
            cmd,
            status: out.status,
            stderr: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn list_dir(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    entries.sort();
    entries
}

/// Pids of containerd shims serving the containerd at `socket` (their
/// command line has `-address <socket>`).
fn shims_of(socket: &Path) -> Vec<u32> {
    let socket = socket.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    let Ok(proc) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in proc.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_shim = args.first().is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
        if is_shim && args.windows(2).any(|w| w[0] == b"-address" && w[1] == socket) {
            pids.push(pid);
        }
    }
    pids
}

/// Whether any containerd shim runs on the machine.
fn any_shim_running() -> bool {
    let Ok(proc) = std::fs::read_dir("/proc") else {
        return true;
    };
    proc.flatten().any(|entry| {
        std::fs::read(entry.path().join("cmdline")).is_ok_and(|cmdline| {
            cmdline
                .split(|b| *b == 0)
                .next()
                .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"))
        })
    })
}

/// One line of /proc/self/mountinfo: (root, mount point, fs type, super options).
fn mountinfo() -> Vec<(String, PathBuf, String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let after: Vec<&str> = after.split(' ').collect();
            Some((
                unescape_mount(fields.get(3)?),
                PathBuf::from(unescape_mount(fields.get(4)?)),
                (*after.first()?).to_owned(),
                after.get(2).copied().unwrap_or_default().to_owned(),
            ))
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape_mount(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(octal) = text.get(i + 1..i + 4)
            && let Ok(value) = u8::from_str_radix(octal, 8)
        {
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount points at or below `dir`.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    mountinfo()
        .into_iter()
        .map(|(_, point, _, _)| point)
        .filter(|point| point.starts_with(dir))
        .collect()
}

/// `<hierarchy mount>/<this process's cgroup>/<parent>` in every cgroup
/// hierarchy (v1 controllers, named v1 hierarchies, v2), existing or not;
/// `<mount>/<parent>` for an absolute parent.
fn cgroup_dirs(parent: &str) -> Vec<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let own: Vec<(String, String, String)> = own
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            Some((
                parts.next()?.to_owned(),
                parts.next()?.to_owned(),
                parts.next()?.to_owned(),
            ))
        })
        .collect();
    let mut dirs = Vec::new();
    for (root, point, fstype, options) in mountinfo() {
        let own_path = match fstype.as_str() {
            "cgroup2" => own.iter().find(|(id, _, _)| id == "0").map(|(_, _, p)| p.clone()),
            "cgroup" => {
                let options: Vec<&str> = options.split(',').collect();
                own.iter()
                    .find(|(id, controllers, _)| {
                        id != "0" && !controllers.is_empty() && controllers.split(',').all(|c| options.contains(&c))
                    })
                    .map(|(_, _, p)| p.clone())
            }
            _ => continue,
        };
        let Some(own_path) = own_path else { continue };
        let base = if parent.starts_with('/') {
            point.clone()
        } else {
            let relative = own_path
                .strip_prefix(&root)
                .unwrap_or(&own_path)
                .trim_start_matches('/');
            point.join(relative)
        };
        let dir = base.join(parent.trim_start_matches('/'));
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// Every cgroup directory on the machine (each hierarchy under
/// /sys/fs/cgroup), to compare before and after a test.
pub fn cgroup_snapshot() -> BTreeSet<PathBuf> {
    fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) {
        for child in list_dir(dir) {
            // Control files are files; only directories are cgroups (and
            // symlinked hierarchies such as cpu,cpuacct are not walked twice).
            if std::fs::symlink_metadata(&child).is_ok_and(|m| m.is_dir()) {
                walk(&child, out);
                out.insert(child);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(Path::new("/sys/fs/cgroup"), &mut out);
    out
}

/// The cgroup directories made since `before` that are a test's: those
/// whose path has one of `marks` (a [`Containerd::cgroup_parent`], sandbox
/// and container ids, which runc names cgroups after). Other processes on
/// the machine make and remove cgroups of their own meanwhile; those are not
/// counted.
pub fn cgroups_left(before: &BTreeSet<PathBuf>, marks: &[String]) -> Vec<PathBuf> {
    cgroup_snapshot()
        .into_iter()
        .filter(|dir| !before.contains(dir))
        .filter(|dir| {
            let text = dir.to_string_lossy();
            marks.iter().any(|mark| !mark.is_empty() && text.contains(mark))
        })
        .collect()
}

/// The processes in a cgroup directory and its children.
fn cgroup_tree_pids(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    for child in list_dir(dir) {
        if child.is_dir() {
            pids.extend(cgroup_tree_pids(&child));
        }
    }
    pids
}

/// Removes a cgroup directory and its children (depth first; cgroup dirs
/// are removed with rmdir, their control files go with them). A cgroup
/// whose killed processes are not reaped yet is busy: retried for 2 s.
fn remove_cgroup_tree(dir: &Path) {
    if !dir.is_dir() {
        return;
    }
    for child in list_dir(dir) {
        if child.is_dir() {
            remove_cgroup_tree(&child);
        }
    }
    let started = Instant::now();
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc_ebusy()) && started.elapsed() < Duration::from_secs(2) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                eprintln!("rivet-e2e containerd teardown: removing cgroup {}: {e}", dir.display());
                return;
            }
        }
    }
}

fn libc_ebusy() -> i32 {
    nix::errno::Errno::EBUSY as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_runtime_binary_is_named_with_its_package() {
        let dir = tempfile::tempdir().unwrap();
        let err = check_binaries(dir.path().as_os_str().to_owned()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("`containerd` is not on PATH"), "{text}");
        assert!(text.contains("Debian package containerd"), "{text}");

        // Everything but runc: runc is named.
        use std::os::unix::fs::PermissionsExt;
        for (binary, _) in REQUIRED_BINARIES.iter().filter(|(b, _)| *b != "runc") {
            let file = dir.path().join(binary);
            std::fs::write(&file, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let text = check_binaries(dir.path().as_os_str().to_owned())
            .unwrap_err()
            .to_string();
        assert!(text.contains("`runc` is not on PATH (Debian package runc)"), "{text}");
    }

    /// A containerd of `config` under `/t/ctrd` that was never started.
    fn unstarted(config: ContainerdConfig) -> Containerd {
        Containerd {
            child: None,
            config,
            cgroup_parent: "rivet-e2e-test".into(),
            dir: None,
            path: PathBuf::from("/t/ctrd"),
            ready: false,
            live: false,
        }
    }

    #[test]
    fn config_points_everything_at_the_temp_dir() {
        let toml = unstarted(ContainerdConfig::new("/t/cni/bin", "/t/cni/conf")).config_toml();
        for want in [
            "root = \"/t/ctrd/root\"",
            "state = \"/t/ctrd/state\"",
            "address = \"/t/ctrd/containerd.sock\"",
            "address = \"/t/ctrd/containerd.sock.ttrpc\"",
            "restrict_oom_score_adj = true",
            "sandbox_image = \"docker.io/rivet/pause:e2e\"",
            "bin_dir = \"/t/cni/bin\"",
            "conf_dir = \"/t/cni/conf\"",
            "Root = \"/t/ctrd/runc\"",
            "snapshotter = \"overlayfs\"",
        ] {
            assert!(toml.contains(want), "{want} in\n{toml}");
        }
    }

    #[test]
    fn a_network_handler_is_a_runc_runtime_with_its_own_cni_dir() {
        let config = ContainerdConfig::new("/t/cni/bin", "/t/cni/conf").network_handler("peer-net", "/t/cni/peer.d");
        let toml = unstarted(config).config_toml();
        let handler = toml
            .split_once(r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes."peer-net"]"#)
            .unwrap_or_else(|| panic!("the handler's table in\n{toml}"))
            .1;
        for want in [
            "runtime_type = \"io.containerd.runc.v2\"",
            "cni_conf_dir = \"/t/cni/peer.d\"",
            "cni_max_conf_num = 1",
            r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes."peer-net".options]"#,
            "Root = \"/t/ctrd/runc\"",
        ] {
            assert!(handler.contains(want), "{want} in the handler's tables\n{handler}");
        }
        // The default network stays the node's.
        assert!(toml.contains("conf_dir = \"/t/cni/conf\""), "{toml}");
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mount(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mount(r"/plain"), "/plain");
        assert_eq!(unescape_mount(r"/end\"), r"/end\");
    }

    #[test]
    fn cgroup_dirs_are_below_our_own_cgroup() {
        let dirs = cgroup_dirs("rivet-e2e-probe");
        assert!(!dirs.is_empty(), "some cgroup hierarchy is mounted");
        for dir in &dirs {
            assert!(dir.ends_with("rivet-e2e-probe"), "{}", dir.display());
            assert!(dir.starts_with("/sys/fs/cgroup"), "{}", dir.display());
        }
    }
}

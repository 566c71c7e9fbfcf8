//! Rivet installed on the real cluster the way a user installs it (issue 18
//! §4): the Rivet image written from the test run's binaries and imported
//! into every worker, `kubectl apply -k deploy/`, a second tag of the same
//! image for a rolling update, and the traffic kept running while Rivet's
//! pods are replaced or their containers killed.
//!
//! - [`write_rivet_archives`]: one archive per tag of one image (the layer
//!   is built once), so an update to the second tag changes nothing but the
//!   pods;
//! - [`write_image_tag_overlay`]: a kustomization over deploy/ that sets the
//!   Rivet image's tag, as a user's overlay would;
//! - [`PingMonitor`] and [`EchoStream`]: ping and a TCP stream from a pod,
//!   run through `kubectl exec`, counted by sequence number and checked byte
//!   for byte;
//! - [`kill_container`]: SIGKILL of a container through its worker's
//!   containerd (what a crashing daemon looks like to the kubelet);
//! - [`poll`]: waits for a condition read from the cluster;
//! - [`busybox_pod`]: a sleeping busybox pod pinned to a node;
//! - [`Scenario`]: kubectl steps against the cluster, each failure naming
//!   its step, with pod helpers ([`ready_pods`], [`daemonset_rolled_out`]).
//!
//! Used by `tests/kube_deploy.rs`, `tests/kube_etcd.rs` and
//! `tests/kube_jaeger.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use rivet_k8s::RivetNode;
use rivet_oci::{Compression, OciArchive, reference, rivet};

use crate::kube_cluster::{KubeCluster, KubeClusterError, Worker, io_err};
use crate::{Error, Result, io_context};

/// The tag `deploy/base/kustomization.yaml` gives the Rivet image.
pub const DEPLOY_TAG: &str = "dev";

/// The repository's `deploy/` directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("rivet-e2e is in the workspace")
        .join("deploy")
}

/// The Rivet image's name with `tag` (`docker.io/rivet/rivet:<tag>`).
pub fn rivet_image(tag: &str) -> String {
    reference(rivet::IMAGE, tag)
}

/// Writes `<out_dir>/rivet-<tag>.oci.tar` for every tag from the binaries in
/// `bin_dir` (`target/debug`): the same layer and config under each name,
/// so the images differ only in their tag. Returns the archives in the
/// order of `tags`.
///
/// # Errors
/// A missing binary, or writing an archive failed.
pub fn write_rivet_archives(bin_dir: &Path, out_dir: &Path, tags: &[&str]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(io_context(format!("creating {}", out_dir.display())))?;
    let layer = rivet::rivet_layer(bin_dir, Compression::GZIP_FAST)?;
    let mut written = Vec::new();
    for tag in tags {
        let path = out_dir.join(format!("{}-{tag}.oci.tar", rivet::IMAGE));
        OciArchive::new()
            .add(rivet::rivet_image(&rivet_image(tag), &layer))
            .write(&path)?;
        written.push(path);
    }
    Ok(written)
}

/// Writes `<dir>/kustomization.yaml`: deploy/ with the Rivet image's tag
/// set to `tag` (kustomize takes a base only by a relative path).
///
/// # Errors
/// `dir` cannot be made absolute, or writing failed.
pub fn write_image_tag_overlay(dir: &Path, tag: &str) -> Result<(), KubeClusterError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let dir = std::fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))?;
    let deploy = std::fs::canonicalize(deploy_dir()).map_err(io_err("resolving deploy/"))?;
    let up = dir.components().filter(|c| matches!(c, Component::Normal(_))).count();
    let base = format!(
        "{}{}",
        "../".repeat(up),
        deploy.display().to_string().trim_start_matches('/')
    );
    let (repository, image) = (rivet_oci::REPOSITORY, rivet::IMAGE);
    let text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {base}\nimages:\n- name: {repository}/{image}\n  newTag: {tag}\n"
    );
    crate::kube_cluster::write_file(&dir.join("kustomization.yaml"), &text)
}

/// Polls `check` every 250 ms until it returns `Ok`, for at most `timeout`;
/// `Err(seen)` says what was seen instead (the timeout error carries the
/// last one).
///
/// # Errors
/// [`KubeClusterError::Timeout`] naming `what` and the last `seen`.
pub async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, KubeClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, String>>,
{
    let started = Instant::now();
    loop {
        let last = match check().await {
            Ok(value) => return Ok(value),
            Err(seen) => seen,
        };
        if started.elapsed() > timeout {
            return Err(KubeClusterError::Timeout {
                what: what.to_owned(),
                timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// SIGKILLs the container `container_id` (a pod status's `containerID`,
/// with or without its `containerd://`) through the worker's containerd, as
/// a crash would end it: the kubelet sees it exit and restarts it.
///
/// # Errors
/// `ctr task kill` failed.
pub fn kill_container(worker: &Worker, container_id: &str) -> Result<()> {
    let socket = worker.containerd_socket().ok_or_else(|| Error::Io {
        context: format!("killing container {container_id} on {}", worker.name),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "the worker's containerd is not running"),
    })?;
    let id = container_id.trim_start_matches("containerd://");
    let mut command = Command::new("ctr");
    command
        .arg("--address")
        .arg(socket)
        .args(["--namespace", "k8s.io", "tasks", "kill", "--signal", "SIGKILL", id]);
    crate::containerd::run(&mut command).map(drop)
}

/// A command in a pod through `kubectl exec -i`: its stdin is ours, its
/// stdout comes line by line through the receiver [`spawn`](Self::spawn)
/// returns (closed when kubectl exits). Dropping it kills kubectl.
struct PodExec {
    child: Child,
    stdin: Option<ChildStdin>,
    /// kubectl's (and the command's) stderr, collected by a thread.
    stderr: Arc<Mutex<String>>,
}

impl PodExec {
    fn spawn(mut kubectl: Command, pod: &str, command: &[&str]) -> Result<(Self, mpsc::Receiver<String>)> {
        let mut child = kubectl
            .args(["exec", "-i", pod, "--"])
            .args(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_context(format!("running kubectl exec -i {pod} -- {command:?}")))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (pipe, collected) = (child.stderr.take().expect("piped"), Arc::clone(&stderr));
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(std::io::Result::ok) {
                let mut collected = collected.lock().expect("not poisoned");
                collected.push_str(&line);
                collected.push('\n');
            }
        });
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Ok((Self { child, stdin, stderr }, lines))
    }

    /// Closes stdin (the command in the pod ends) and waits up to `timeout`
    /// for kubectl to exit before killing it; returns what it wrote to
    /// stderr.
    fn finish(mut self, timeout: Duration) -> String {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stderr.lock().expect("not poisoned").clone()
    }
}

impl Drop for PodExec {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ping -i 0.1 <target>` from a pod, every reply's sequence number kept.
/// Stopped by closing its stdin (the shell around it interrupts it), so
/// nothing stays running in the pod.
pub struct PingMonitor {
    exec: Option<PodExec>,
    replies: Arc<Mutex<BTreeSet<u64>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    description: String,
}

/// What a [`PingMonitor`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingReport {
    /// Replies received.
    pub received: usize,
    /// The highest sequence number answered.
    pub highest: Option<u64>,
    /// Sequence numbers below `highest` with no reply: lost.
    pub lost: Vec<u64>,
}

impl PingMonitor {
    /// Starts pinging `target` from `pod` (`kubectl` is the cluster's).
    ///
    /// # Errors
    /// kubectl cannot be run.
    pub fn start(kubectl: Command, pod: &str, target: IpAddr) -> Result<Self> {
        let script = format!("ping -i 0.1 {target} & read _; kill -INT $!");
        let (exec, lines) = PodExec::spawn(kubectl, pod, &["sh", "-c", &script])?;
        let replies = Arc::new(Mutex::new(BTreeSet::new()));
        let seen = Arc::clone(&replies);
        let reader = std::thread::spawn(move || {
            for seq in lines.iter().filter_map(|line| reply_seq(&line)) {
                seen.lock().expect("not poisoned").insert(seq);
            }
        });
        Ok(Self {
            exec: Some(exec),
            replies,
            reader: Some(reader),
            description: format!("ping {target} from {pod}"),
        })
    }

    /// Replies received so far.
    pub fn received(&self) -> usize {
        self.replies.lock().expect("not poisoned").len()
    }

    /// Waits until `more` replies beyond the current count arrived.
    ///
    /// # Errors
    /// [`KubeClusterError::Timeout`] with the count.
    pub async fn wait_replies(&self, more: usize, timeout: Duration) -> Result<(), KubeClusterError> {
        let goal = self.received() + more;
        poll(&format!("{}: {more} more replies", self.description), timeout, || {
            let received = self.received();
            async move {
                if received >= goal {
                    Ok(())
                } else {
                    Err(format!("{received} replies, waiting for {goal}"))
                }
            }
        })
        .await
    }

    /// Stops the ping and says what was lost.
    pub fn stop(mut self) -> PingReport {
        if let Some(exec) = self.exec.take() {
            exec.finish(Duration::from_secs(5));
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let replies = self.replies.lock().expect("not poisoned");
        let highest = replies.last().copied();
        let lost = highest
            .map(|h| (0..h).filter(|seq| !replies.contains(seq)).collect())
            .unwrap_or_default();
        PingReport {
            received: replies.len(),
            highest,
            lost,
        }
    }
}

/// The `seq=` of a busybox ping reply line (`64 bytes from a: seq=3 ttl=64 time=0.1 ms`).
fn reply_seq(line: &str) -> Option<u64> {
    if !line.contains("bytes from") {
        return None;
    }
    let rest = line.split("seq=").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// One TCP connection from a pod (`nc <address> <port>` through `kubectl
/// exec`) to an echo server, fed a numbered line every 50 ms, each checked
/// against its echo before the next: the stream survives only if every
/// line comes back intact, in order, on the same connection.
pub struct EchoStream {
    stop: Arc<AtomicBool>,
    echoed: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<EchoReport>>,
    description: String,
}

/// What an [`EchoStream`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoReport {
    /// Lines echoed intact.
    pub echoed: u64,
    /// Bytes sent and echoed back identical.
    pub bytes: u64,
    /// The first failure: a line not echoed in time, a wrong echo, or the
    /// connection's end.
    pub failure: Option<String>,
}

/// How long one line may take to come back.
const ECHO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the first line may take: kubectl exec's session and the
/// connection come first.
const FIRST_ECHO_TIMEOUT: Duration = Duration::from_secs(20);

impl EchoStream {
    /// Connects from `pod` to `address:port` and starts the lines.
    ///
    /// # Errors
    /// kubectl cannot be run.
    pub fn start(kubectl: Command, pod: &str, address: IpAddr, port: u16) -> Result<Self> {
        let (mut exec, lines) = PodExec::spawn(kubectl, pod, &["nc", &address.to_string(), &port.to_string()])?;
        let stop = Arc::new(AtomicBool::new(false));
        let echoed = Arc::new(AtomicU64::new(0));
        let (stop_flag, count) = (Arc::clone(&stop), Arc::clone(&echoed));
        let thread = std::thread::spawn(move || {
            let mut report = EchoReport {
                echoed: 0,
                bytes: 0,
                failure: None,
            };
            let mut stdin = exec.stdin.take().expect("piped");
            while !stop_flag.load(Ordering::Relaxed) {
                let line = format!("rivet-e2e-stream {:08} {}", report.echoed, "0123456789abcdef".repeat(4));
                if let Err(e) = writeln!(stdin, "{line}").and_then(|()| stdin.flush()) {
                    report.failure = Some(format!("writing line {}: {e}", report.echoed));
                    break;
                }
                let timeout = if report.echoed == 0 {
                    FIRST_ECHO_TIMEOUT
                } else {
                    ECHO_TIMEOUT
                };
                match lines.recv_timeout(timeout) {
                    Ok(echo) if echo == line => {
                        report.echoed += 1;
                        report.bytes += line.len() as u64 + 1;
                        count.store(report.echoed, Ordering::Relaxed);
                    }
                    Ok(echo) => {
                        report.failure = Some(format!("line {}: sent {line:?}, echoed {echo:?}", report.echoed));
                        break;
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        report.failure = Some(format!("line {} not echoed within {timeout:?}", report.echoed));
                        break;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        report.failure = Some(format!("the connection ended after {} lines", report.echoed));
                        break;
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            exec.stdin = Some(stdin);
            let stderr = exec.finish(Duration::from_secs(5));
            if let Some(failure) = report.failure.as_mut()
                && !stderr.trim().is_empty()
            {
                failure.push_str(&format!("; kubectl exec: {}", stderr.trim()));
            }
            report
        });
        Ok(Self {
            stop,
            echoed,
            thread: Some(thread),
            description: format!("TCP stream from {pod} to {address}:{port}"),
        })
    }

    /// Lines echoed so far.
    pub fn echoed(&self) -> u64 {
        self.echoed.load(Ordering::Relaxed)
    }

    /// Waits until `more` lines beyond the current count came back.
    ///
    /// # Errors
    /// [`KubeClusterError::Timeout`] with the count, at once if the stream
    /// ended.
    pub async fn wait_echoed(&self, more: u64, timeout: Duration) -> Result<(), KubeClusterError> {
        let goal = self.echoed() + more;
        let what = format!("{}: {more} more lines", self.description);
        let outcome = poll(&what, timeout, || {
            let echoed = self.echoed();
            let ended = self.thread.as_ref().is_none_or(std::thread::JoinHandle::is_finished);
            async move {
                if echoed >= goal {
                    Ok(Ok(()))
                } else if ended {
                    Ok(Err(format!("the stream ended after {echoed} lines (stop() says why)")))
                } else {
                    Err(format!("{echoed} lines echoed, waiting for {goal}"))
                }
            }
        })
        .await?;
        outcome.map_err(|last| KubeClusterError::Timeout { what, timeout, last })
    }

    /// Ends the stream (closing the connection) and reports.
    pub fn stop(mut self) -> EchoReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("joined once")
            .join()
            .unwrap_or_else(|_| EchoReport {
                echoed: self.echoed(),
                bytes: 0,
                failure: Some("the stream's thread panicked".into()),
            })
    }
}

impl Drop for EchoStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// NetworkPolicy `name` in `default`: pods labelled `app=<app>` take
/// ingress only from pods labelled `role=client`, on TCP `port`.
pub fn clients_only_policy(name: &str, app: &str, port: u16) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "podSelector": { "matchLabels": { "app": app } },
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{ "podSelector": { "matchLabels": { "role": "client" } } }],
                "ports": [{ "protocol": "TCP", "port": port }]
            }]
        }
    })
}

/// Pod `name` in `default` on `node` with `labels`: the test busybox image
/// sleeping for an hour, deleted at once (grace 0).
pub fn busybox_pod(name: &str, node: &str, labels: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "default", "labels": labels },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main",
                "image": crate::image::BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sleep", "3600"]
            }]
        }
    })
}

/// How long one step of a [`Scenario`] may wait for the cluster.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// A cluster driven with kubectl step by step, as a user would: the
/// cluster and what the steps share; a failing step dumps the cluster's
/// state (pods, nodes, events, Rivet's logs) before the cluster goes.
pub struct Scenario {
    /// The cluster (dropped with the scenario).
    pub cluster: KubeCluster,
    /// The step running, named in every failure.
    pub step: &'static str,
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
    }
}

impl Scenario {
    /// `kubectl <args>`; fails the step with kubectl's output.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.kubectl_stdin(args, None)
    }

    /// `kubectl <args>` with `stdin` (e.g. `apply -f -`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.try_kubectl(args, stdin);
        match out {
            Ok(out) => out,
            Err(out) => panic!("step {}: kubectl {args:?} failed: {out}", self.step),
        }
    }

    /// `kubectl <args>`: `Ok(stdout)` or `Err(stdout + stderr)`.
    pub fn try_kubectl(&self, args: &[&str], stdin: Option<&str>) -> std::result::Result<String, String> {
        use std::io::Write as _;
        let mut command = self.cluster.kubectl().unwrap();
        command
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = command.spawn().expect("running kubectl");
        let mut input = child.stdin.take().expect("piped");
        if let Some(stdin) = stdin {
            input.write_all(stdin.as_bytes()).expect("writing kubectl's stdin");
        }
        drop(input);
        let out = child.wait_with_output().expect("waiting for kubectl");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// `kubectl exec <pod> -- sh -c <script>`: `Ok(stdout)` or the failure.
    pub fn exec(&self, pod: &str, script: &str) -> std::result::Result<String, String> {
        self.try_kubectl(&["exec", pod, "--", "sh", "-c", script], None)
    }

    /// `pod` gets a line echoed by `address:port`
    /// ([`crate::cross_node::echoes`]).
    pub fn echoes(&self, pod: &str, address: IpAddr, port: u16) -> std::result::Result<(), String> {
        crate::cross_node::echoes(&|| self.cluster.kubectl().unwrap(), pod, address, port)
    }

    /// Waits for `check` (see [`poll`]), failing the step with what was seen.
    pub async fn wait<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, String>>,
    {
        poll(what, STEP_TIMEOUT, check)
            .await
            .unwrap_or_else(|e| panic!("step {}: {e}", self.step))
    }

    /// What a failed step leaves to read: every pod, the Nodes, the
    /// events, and the logs of Rivet's pods.
    pub fn dump(&self) {
        for args in [
            &["get", "nodes", "-o", "wide"][..],
            &["get", "pods", "-A", "-o", "wide"],
            &["get", "events", "-A", "--sort-by=.lastTimestamp"],
            &[
                "logs",
                "-n",
                "kube-system",
                "-l",
                "app.kubernetes.io/part-of=rivet",
                "--all-containers",
                "--prefix",
                "--tail=30",
                "--max-log-requests=30",
            ],
        ] {
            let out = self.try_kubectl(args, None).unwrap_or_else(|e| e);
            eprintln!("--- kubectl {}\n{out}", args.join(" "));
        }
    }

    pub fn worker(&self, node: &str) -> &Worker {
        self.cluster
            .workers()
            .iter()
            .find(|w| w.name == node)
            .unwrap_or_else(|| panic!("step {}: no worker {node}", self.step))
    }

    pub fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.cluster.admin_client(), namespace)
    }

    /// Pods of `namespace` matching `selector`, by name.
    pub async fn list_pods(&self, namespace: &str, selector: &str) -> Vec<Pod> {
        self.pods(namespace)
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap_or_else(|e| panic!("step {}: listing pods {selector}: {e}", self.step))
            .items
    }

    /// Waits until the `rivet-node` DaemonSet rolled out on both nodes
    /// ([`daemonset_rolled_out`]).
    pub async fn wait_rivet_node_rolled_out(&self) {
        let daemonsets: Api<DaemonSet> = Api::namespaced(self.cluster.admin_client(), "kube-system");
        self.wait("the rivet-node DaemonSet Ready on both nodes", || {
            let daemonsets = daemonsets.clone();
            async move {
                let ds = daemonsets.get("rivet-node").await.map_err(|e| e.to_string())?;
                daemonset_rolled_out(&ds)
            }
        })
        .await;
    }

    /// Waits until every worker's RivetNode holds a pod CIDR (the
    /// operator's cluster-pool allocation, as Cilium's is the CiliumNode's
    /// `spec.podCIDRs`); the first of each, by node name.
    pub async fn wait_pod_cidrs(&self) -> BTreeMap<String, ipnet::IpNet> {
        let rivet_nodes: Api<RivetNode> = Api::all(self.cluster.admin_client());
        let names: Vec<String> = self.cluster.workers().iter().map(|w| w.name.clone()).collect();
        self.wait("a pod CIDR in every node's RivetNode", || {
            let (rivet_nodes, names) = (rivet_nodes.clone(), names.clone());
            async move {
                let mut cidrs = BTreeMap::new();
                for name in &names {
                    let node = rivet_nodes.get_opt(name).await.map_err(|e| e.to_string())?;
                    let cidr = node
                        .and_then(|n| n.spec.pod_cidrs.first().cloned())
                        .ok_or(format!("{name}: no pod CIDR"))?;
                    cidrs.insert(name.clone(), cidr.parse().map_err(|e| format!("{name}: {cidr}: {e}"))?);
                }
                Ok(cidrs)
            }
        })
        .await
    }

    /// The `rivet-node` pod on `node`.
    pub async fn rivet_node_pod(&self, node: &str) -> Pod {
        self.list_pods("kube-system", "app.kubernetes.io/name=rivet-node")
            .await
            .into_iter()
            .find(|p| spec_node(p) == node && p.metadata.deletion_timestamp.is_none())
            .unwrap_or_else(|| panic!("step {}: no rivet-node pod on {node}", self.step))
    }
}

/// The pod's name.
pub fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or_default()
}

/// The node the pod is scheduled to (empty: none yet).
pub fn spec_node(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

/// The pod's (first) address.
pub fn pod_ip(pod: &Pod) -> Option<IpAddr> {
    pod.status.as_ref()?.pod_ip.as_ref()?.parse().ok()
}

/// Whether the pod's Ready condition is true.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// `(name, node, ip)` of ready pods, or what is not ready.
pub fn ready_pods(pods: &[Pod], want: usize) -> std::result::Result<Vec<(String, String, IpAddr)>, String> {
    let ready: Vec<_> = pods
        .iter()
        .filter(|p| pod_ready(p) && p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some((name(p).to_owned(), spec_node(p).to_owned(), pod_ip(p)?)))
        .collect();
    if ready.len() == want {
        Ok(ready)
    } else {
        let phases: Vec<String> = pods
            .iter()
            .map(|p| {
                format!(
                    "{} on {:?}: {:?}",
                    name(p),
                    spec_node(p),
                    p.status.as_ref().and_then(|s| s.phase.clone())
                )
            })
            .collect();
        Err(format!("{} of {want} ready: {phases:?}", ready.len()))
    }
}

/// `objects` as one `v1/List` (JSON is YAML) for `kubectl apply -f -`.
pub fn yaml(objects: &[serde_json::Value]) -> String {
    serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": objects }).to_string()
}

/// Whether the DaemonSet rolled out on both nodes of the two-worker cluster: status for the
/// current generation, every pod updated, ready and available.
pub fn daemonset_rolled_out(ds: &DaemonSet) -> std::result::Result<(), String> {
    let status = ds.status.clone().unwrap_or_default();
    let generation = ds.metadata.generation.unwrap_or_default();
    let desired = status.desired_number_scheduled;
    if desired == 2
        && status.observed_generation == Some(generation)
        && status.updated_number_scheduled == Some(desired)
        && status.number_ready == desired
        && status.number_available == Some(desired)
    {
        Ok(())
    } else {
        Err(format!(
            "generation {generation}, observed {:?}, desired {desired}, updated {:?}, ready {}, available {:?}",
            status.observed_generation, status.updated_number_scheduled, status.number_ready, status.number_available
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_seq_reads_busybox_ping_lines() {
        assert_eq!(
            reply_seq("64 bytes from 198.18.64.5: seq=17 ttl=63 time=0.211 ms"),
            Some(17)
        );
        assert_eq!(reply_seq("PING 198.18.64.5 (198.18.64.5): 56 data bytes"), None);
        assert_eq!(reply_seq("3 packets transmitted, 3 packets received"), None);
    }

    #[test]
    fn the_overlay_names_deploy_by_a_relative_path() {
        let dir = tempfile::tempdir().unwrap();
        write_image_tag_overlay(dir.path(), "second").unwrap();
        let text = std::fs::read_to_string(dir.path().join("kustomization.yaml")).unwrap();
        let base = text.lines().find(|l| l.starts_with("- ../")).expect(&text);
        let resolved = std::fs::canonicalize(dir.path().join(base.trim_start_matches("- "))).unwrap();
        assert_eq!(resolved, std::fs::canonicalize(deploy_dir()).unwrap());
        assert!(
            text.contains("- name: docker.io/rivet/rivet\n  newTag: second\n"),
            "{text}"
        );
    }
}

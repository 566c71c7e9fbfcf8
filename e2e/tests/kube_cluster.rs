//! The real Kubernetes cluster fixture (issue 18 §3): control plane and two
//! kubelet + containerd workers in network namespaces, with the reference
//! bridge + host-local CNI standing in for Rivet.
//!
//! - `two_kubelet_workers_run_pods_and_leave_nothing`: both Nodes register
//!   as `system:node:<name>` and are Ready; a busybox pod on each node is
//!   Running with an address of its node's pod CIDR; `kubectl exec` works
//!   (the API server reaches each kubelet's serving port) and one pod pings
//!   the other across nodes; a pod reaches the API server once its Node has
//!   a pod CIDR (the control plane routes it); a hostNetwork pod lands in its worker's
//!   network namespace and sees the worker's mount namespace (its
//!   `/etc/cni/net.d`). Dropping the cluster leaves no namespace, process,
//!   mount, cgroup or dir.
//! - `a_cni_installed_later_inside_a_worker_makes_it_ready`: with no CNI
//!   config the Nodes register NotReady (containerd starts without
//!   NetworkReady, as it must for Rivet's DaemonSet to install its plugin);
//!   a conflist written into one worker's `/etc/cni/net.d` from inside its
//!   mount namespace (as a DaemonSet's init container writes it) makes that
//!   Node Ready while the other stays NotReady, until it gets one too.
//! - `down_after_a_killed_supervisor_removes_everything`: `rivet-kube-cluster
//!   up` (what `cargo xtask cluster up` runs), its supervisor SIGKILLed with
//!   the cluster running a pod, then `down`: the sweep from the cluster's
//!   record leaves no process, namespace, cgroup or dir.
//!
//! Needs root, containerd, runc, /usr/lib/cni, busybox-static and the
//! Kubernetes tools (`cargo xtask install`); a missing one fails the test.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use rivet_common::testing::netns::list_netns;
use rivet_e2e::image::BUSYBOX_IMAGE;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, Worker, WorkerCni, node_ready};

const POD_TIMEOUT: Duration = Duration::from_secs(90);

fn busybox_pod(name: &str, node: &str, host_network: bool) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "nodeName": node,
            "hostNetwork": host_network,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sleep", "3600"]
            }]
        }
    }))
    .expect("a valid pod")
}

async fn wait_running(pods: &Api<Pod>, name: &str) -> Pod {
    let started = Instant::now();
    loop {
        let pod = pods.get(name).await.expect("reading the pod");
        let status = pod.status.clone().unwrap_or_default();
        if status.phase.as_deref() == Some("Running") && status.pod_ip.is_some() {
            return pod;
        }
        assert!(
            started.elapsed() < POD_TIMEOUT,
            "pod {name} not Running with an address within {POD_TIMEOUT:?}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn kubectl_exec(cluster: &KubeCluster, pod: &str, command: &[&str]) -> String {
    let out = cluster
        .kubectl()
        .unwrap()
        .args(["exec", pod, "--"])
        .args(command)
        .output()
        .expect("running kubectl");
    assert!(
        out.status.success(),
        "kubectl exec {pod} -- {command:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Mount points whose path contains `text`.
fn mounts_containing(text: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(text))
        .map(str::to_owned)
        .collect()
}

/// Processes whose command line contains `text`.
fn processes_containing(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(text) {
                found.push(format!("{}: {cmdline}", entry.file_name().to_string_lossy()));
            }
        }
    }
    found
}

/// No namespace of `namespaces`, no process, mount or file under the
/// cluster's `dir` or a containerd dir, no cgroup of the cluster `name`.
fn assert_nothing_left(name: &str, namespaces: &[String], dir: &std::path::Path, containerd_dirs: &[String]) {
    let left: Vec<String> = list_netns()
        .unwrap()
        .into_iter()
        .filter(|ns| namespaces.contains(ns))
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
    for owned in std::iter::once(dir.display().to_string()).chain(containerd_dirs.iter().cloned()) {
        let processes = processes_containing(&owned);
        assert!(processes.is_empty(), "processes of {owned} left: {processes:?}");
        assert!(!std::path::Path::new(&owned).exists(), "{owned} left");
        let mounts = mounts_containing(&owned);
        assert!(mounts.is_empty(), "mounts of {owned} left: {mounts:?}");
    }
    let cgroups: Vec<String> = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .map(|h| h.path().join(name))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_kubelet_workers_run_pods_and_leave_nothing() {
    let host_kubelet_dir = std::path::Path::new("/var/lib/kubelet");
    let host_had_kubelet_dir = host_kubelet_dir.exists();
    let cluster = KubeCluster::start(KubeClusterOptions::default()).await.unwrap();
    println!(
        "cluster {} up in {:.1} s (control plane, 2 workers Ready)",
        cluster.name(),
        cluster.started_in().as_secs_f64()
    );
    let name = cluster.name().to_owned();
    let dir = cluster.dir().to_path_buf();
    // containerd's own dirs (root, state, sockets) are beside the cluster's.
    let containerd_dirs: Vec<String> = cluster
        .workers()
        .iter()
        .map(|w| {
            let socket = w.containerd_socket().expect("containerd runs");
            socket.parent().unwrap().display().to_string()
        })
        .collect();
    let namespaces: Vec<String> = std::iter::once(cluster.control_plane_netns().name().to_owned())
        .chain(cluster.workers().iter().map(|w| w.netns.name().to_owned()))
        .collect();

    let nodes: Api<Node> = Api::all(cluster.admin_client());
    for worker in cluster.workers() {
        let node = nodes.get(&worker.name).await.unwrap();
        assert!(node_ready(&node), "{} Ready", worker.name);
        let addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
        assert!(
            addresses
                .iter()
                .any(|a| a.type_ == "InternalIP" && a.address == worker.address.to_string()),
            "{}: node IP {} in {addresses:?}",
            worker.name,
            worker.address
        );
        assert!(
            addresses
                .iter()
                .any(|a| a.type_ == "InternalIP" && a.address == worker.address_v6.to_string()),
            "{}: IPv6 node IP {} in {addresses:?}",
            worker.name,
            worker.address_v6
        );
    }

    let pods: Api<Pod> = Api::namespaced(cluster.admin_client(), "default");
    let mut ips = Vec::new();
    for worker in cluster.workers() {
        let pod_name = format!("bb-{}", worker.index);
        pods.create(&PostParams::default(), &busybox_pod(&pod_name, &worker.name, false))
            .await
            .unwrap();
        let pod = wait_running(&pods, &pod_name).await;
        let ip: std::net::Ipv4Addr = pod.status.unwrap().pod_ip.unwrap().parse().unwrap();
        let cidr: ipnet::Ipv4Net = worker.pod_cidr.parse().unwrap();
        assert!(cidr.contains(&ip), "pod {pod_name} address {ip} in {cidr}");
        ips.push(ip);
    }
    // kubectl exec: the API server in the control-plane namespace reaches
    // each kubelet's serving port over the underlay.
    let hostname = kubectl_exec(&cluster, "bb-1", &["hostname"]);
    assert_eq!(hostname.trim(), "bb-1");
    let ping = kubectl_exec(&cluster, "bb-1", &["ping", "-c", "2", "-W", "2", &ips[1].to_string()]);
    assert!(
        ping.contains("2 packets received"),
        "bb-1 pings bb-2 across nodes: {ping}"
    );

    // A pod (not hostNetwork) reaches the API server: once its Node has a
    // pod CIDR (Rivet's operator sets it; here the test does), the control
    // plane routes the answers back.
    for worker in cluster.workers() {
        let patch = serde_json::json!({ "spec": { "podCIDR": worker.pod_cidr, "podCIDRs": [worker.pod_cidr] } });
        nodes
            .patch(&worker.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }
    let api = format!("{}", rivet_e2e::kube_cluster::CONTROL_PLANE_V4);
    let started = Instant::now();
    loop {
        let out = cluster
            .kubectl()
            .unwrap()
            .args([
                "exec",
                "bb-2",
                "--",
                "sh",
                "-c",
                &format!("nc -w 2 {api} 6443 </dev/null"),
            ])
            .output()
            .unwrap();
        if out.status.success() {
            break;
        }
        assert!(
            started.elapsed() < POD_TIMEOUT,
            "pod bb-2 does not reach the API server at {api}:6443: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A hostNetwork pod is in its worker's network namespace.
    let worker = &cluster.workers()[1];
    pods.create(&PostParams::default(), &busybox_pod("host", &worker.name, true))
        .await
        .unwrap();
    wait_running(&pods, "host").await;
    let addresses = kubectl_exec(&cluster, "host", &["ip", "-o", "addr", "show", "ul0"]);
    assert!(
        addresses.contains(&format!("{}/24", worker.address)),
        "the hostNetwork pod sees worker 2's ul0: {addresses}"
    );
    // And the worker's files are its own: the bridge conflist is in the
    // worker's /etc/cni/net.d, not the host's.
    assert!(worker.host_path("/etc/cni/net.d/10-bridge.conflist").exists());
    assert!(!std::path::Path::new("/etc/cni/net.d/10-bridge.conflist").exists());
    assert!(
        worker
            .host_path("/var/lib/kubelet/device-plugins/kubelet.sock")
            .exists()
    );
    assert!(
        host_had_kubelet_dir || !host_kubelet_dir.exists(),
        "a kubelet wrote into the host's /var/lib/kubelet"
    );

    drop(cluster);
    assert_nothing_left(&name, &namespaces, &dir, &containerd_dirs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cni_installed_later_inside_a_worker_makes_it_ready() {
    let mut cluster = KubeCluster::start(KubeClusterOptions {
        cni: WorkerCni::None,
        ..KubeClusterOptions::default()
    })
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(cluster.admin_client());
    for worker in cluster.workers() {
        let node = nodes.get(&worker.name).await.unwrap();
        assert!(!node_ready(&node), "{} is NotReady without a CNI config", worker.name);
    }
    // The conflist goes in through the worker's mount namespace, where
    // containerd watches /etc/cni/net.d (an overlay: the host's /etc is
    // untouched).
    let [first, second] = cluster.workers() else {
        panic!("two workers")
    };
    let conflist = |worker: &Worker| {
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "later",
            "plugins": [{
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipam": { "type": "host-local", "ranges": [[{ "subnet": worker.pod_cidr }]] }
            }]
        })
    };
    install_conflist(first, &conflist(first));
    assert!(first.host_path("/etc/cni/net.d/10-later.conflist").exists());
    assert!(!second.host_path("/etc/cni/net.d/10-later.conflist").exists());

    let started = Instant::now();
    loop {
        let node = nodes.get(&first.name).await.unwrap();
        if node_ready(&node) {
            break;
        }
        assert!(
            started.elapsed() < POD_TIMEOUT,
            "{} not Ready within {POD_TIMEOUT:?} after its CNI config appeared: {:?}",
            first.name,
            node.status.and_then(|s| s.conditions)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let other = nodes.get(&second.name).await.unwrap();
    assert!(
        !node_ready(&other),
        "{} has no CNI config and stays NotReady",
        second.name
    );
    install_conflist(second, &conflist(second));
    cluster.wait_nodes_ready(POD_TIMEOUT).await.unwrap();
}

/// Writes `10-later.conflist` into the worker's /etc/cni/net.d from inside
/// its mount namespace.
fn install_conflist(worker: &Worker, conflist: &serde_json::Value) {
    let status = worker
        .command("sh")
        .args(["-c", "cat > /etc/cni/net.d/10-later.conflist"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(conflist.to_string().as_bytes())?;
            child.wait()
        })
        .unwrap();
    assert!(status.success(), "writing the conflist inside {}", worker.name);
}

/// `rivet-kube-cluster --state-dir <dir>`; `down` on drop, so a failing test
/// leaves nothing either.
struct CliCluster {
    state: tempfile::TempDir,
}

impl CliCluster {
    fn command(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(env!("CARGO_BIN_EXE_rivet-kube-cluster"))
            .arg("--state-dir")
            .arg(self.state.path())
            .args(args)
            .output()
            .expect("running rivet-kube-cluster")
    }
}

impl Drop for CliCluster {
    fn drop(&mut self) {
        let _ = self.command(&["down"]);
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn down_after_a_killed_supervisor_removes_everything() {
    let cluster = CliCluster {
        state: tempfile::Builder::new().prefix("rivet-kc-cli-").tempdir().unwrap(),
    };
    let up = cluster.command(&["up"]);
    assert!(up.status.success(), "up: {}", text(&up));
    let ready = text(&up);
    assert!(ready.contains("kubeconfig: "), "{ready}");
    let dir = cluster.state.path().join("cluster");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("record.json")).unwrap()).unwrap();
    let strings = |key: &str| -> Vec<String> {
        let values = record[key].as_array().unwrap_or_else(|| panic!("{key} in {record}"));
        values.iter().map(|v| v.as_str().unwrap().to_owned()).collect()
    };
    let namespaces = strings("namespaces");
    assert_eq!(namespaces.len(), 4, "2 workers, control plane, underlay: {record}");
    let containerd_dirs = strings("containerd_dirs");
    assert_eq!(containerd_dirs.len(), 2, "{record}");
    let name = record["name"].as_str().unwrap().to_owned();

    // A pod runs (shim, pause and busybox processes in the kubelet's cgroups).
    let kubeconfig = dir.join("pki/admin.kubeconfig");
    let kubectl = rivet_tools::tool_path(rivet_tools::Tool::Kubectl).unwrap();
    let run = std::process::Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args([
            "run",
            "sleeper",
            "--image",
            BUSYBOX_IMAGE,
            "--image-pull-policy=Never",
            "--restart=Never",
            "--",
            "/bin/sleep",
            "3600",
        ])
        .output()
        .unwrap();
    assert!(run.status.success(), "kubectl run: {}", text(&run));
    let wait = std::process::Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["wait", "--for=condition=Ready", "pod/sleeper", "--timeout=90s"])
        .output()
        .unwrap();
    assert!(wait.status.success(), "kubectl wait: {}", text(&wait));
    assert!(
        !processes_containing(&containerd_dirs[0]).is_empty() || !processes_containing(&containerd_dirs[1]).is_empty()
    );

    let pid: i32 = std::fs::read_to_string(cluster.state.path().join("supervisor.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        std::thread::sleep(Duration::from_millis(20));
    }
    // The daemons outlive their supervisor: that is what down must clean.
    assert!(!processes_containing(&dir.display().to_string()).is_empty());

    let down = cluster.command(&["down"]);
    assert!(down.status.success(), "down: {}", text(&down));
    assert_nothing_left(&name, &namespaces, &dir, &containerd_dirs);
    assert!(!cluster.state.path().exists(), "down removes the state dir");
}

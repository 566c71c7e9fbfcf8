//! Pods run by containerd 1.6 + runc, driven through the CRI API as kubelet
//! drives it; the runtime calls the CNI plugin itself.
//!
//! - `rivet_cni_pods_connectivity_policy_and_cleanup`: a node made by
//!   `rivet node up`, containerd reading exactly the CNI files it installed
//!   (conflist with the default cniVersion, rivet-cni, loopback), three pods
//!   labelled with `rivet endpoint label` and listed by `rivet pod list`,
//!   ping, a NetworkPolicy (`rivet policy apply`) enforced between them, and
//!   StopPodSandbox / RemovePodSandbox leaving nothing behind, no cgroup
//!   directory included.
//! - `a_sandbox_failing_beside_rivet_cni_leaves_nothing`: loopback refuses
//!   ADD after rivet-cni's ADD succeeded; containerd's teardown (DEL through
//!   both) leaves no endpoint, address, veth, netns or cgroup.
//! - `a_sandbox_whose_teardown_never_reaches_rivet_cni_is_collected_by_cni_gc`:
//!   loopback fails ADD and DEL (as when it is missing), so rivet-cni never
//!   gets a DEL and containerd keeps the sandbox and its netns; CNI GC with a
//!   valid list that lacks it removes the endpoint, address and veth, and
//!   kubelet's retries finish once loopback works.
//! - `bridge_plugin_pods_prove_the_harness`: the same runtime path with the
//!   reference bridge + host-local plugins: it proves the harness (config,
//!   images, CRI calls, teardown) independently of rivet-cni, and gives the
//!   RunPodSandbox baseline rivet-cni is compared with.
//! - `a_crashed_containerd_leaves_nothing_behind_on_drop`: the `Containerd`
//!   guard after a SIGKILLed containerd with a pod still running.
//!
//! Needs root, containerd, containerd-shim-runc-v2, ctr, runc, nsenter,
//! /bin/busybox (busybox-static) and /usr/lib/cni (the reference plugins):
//! a missing one fails the test with its name, it never skips.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::NetNs;
use rivet_e2e::containerd::{Containerd, ContainerdConfig, REFERENCE_CNI_DIR, cgroup_snapshot, cgroups_left};
use rivet_e2e::cri::{Cri, ExecOutput, PodSpec, RunningPod};
use rivet_e2e::image::BUSYBOX_IMAGE;
use rivet_e2e::node::RivetNode;

/// The pods' Kubernetes namespace.
const NAMESPACE: &str = "shop";

/// The port backend serves on.
const PORT: &str = "8080";

/// What backend answers.
const GREETING: &str = "hello-from-backend";

/// Test-owned CNI directories: `bin/` (plugins) and `conf/` (one conflist).
struct CniDirs {
    dir: tempfile::TempDir,
}

impl CniDirs {
    fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("rivet-cni-").tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("bin")).unwrap();
        std::fs::create_dir_all(dir.path().join("conf")).unwrap();
        Self { dir }
    }

    fn bin(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("conf")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Links plugin `name` to `source` (what a real install copies).
    fn install(&self, name: &str, source: &Path) {
        assert!(
            source.is_file(),
            "CNI plugin {} is missing (reference plugins: Debian package containernetworking-plugins)",
            source.display()
        );
        std::os::unix::fs::symlink(source, self.bin().join(name)).unwrap();
    }

    /// containerd's CRI plugin always runs `loopback` for the pod's `lo`.
    fn install_reference(&self, name: &str) {
        self.install(name, &Path::new(REFERENCE_CNI_DIR).join(name));
    }

    fn write_conflist(&self, name: &str, conflist: &serde_json::Value) {
        std::fs::write(
            self.conf().join(format!("10-{name}.conflist")),
            serde_json::to_vec_pretty(conflist).unwrap(),
        )
        .unwrap();
    }
}

async fn start_containerd(node: &Path, cni_bin: &Path, cni_conf: &Path) -> Containerd {
    let started = Instant::now();
    let containerd = Containerd::start(ContainerdConfig::new(cni_bin, cni_conf).netns(node))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let up = started.elapsed();
    let started = Instant::now();
    containerd.import_e2e_images().await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("containerd ready in {up:?}, images imported in {:?}", started.elapsed());
    containerd
}

/// The pod spec kubelet would send (labels app=<name>), with the
/// containerd's cgroup parent and log dir.
fn pod_spec(containerd: &Containerd, name: &str) -> PodSpec {
    PodSpec::new(NAMESPACE, name)
        .label("app", name)
        .cgroup_parent(containerd.cgroup_parent())
        .log_directory(&containerd.pod_log_dir(name))
}

/// backend serves [`GREETING`] on [`PORT`]; the others sleep.
fn command(name: &str) -> Vec<&'static str> {
    if name == "backend" {
        vec!["nc", "-ll", "-p", PORT, "-e", "echo", GREETING]
    } else {
        vec!["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
    }
}

async fn run_pods(cri: &Cri, containerd: &Containerd, names: &[&str]) -> Vec<RunningPod> {
    let mut pods = Vec::new();
    for name in names {
        let pod = cri
            .run_pod(&pod_spec(containerd, name), BUSYBOX_IMAGE, &command(name))
            .await
            .unwrap_or_else(|e| panic!("starting pod {name}: {e}\ncontainerd log:\n{}", tail(&containerd.log())));
        eprintln!(
            "pod {name}: RunPodSandbox {:?}, create+start container {:?}, IPs {:?}",
            pod.run_sandbox, pod.start_container, pod.ips
        );
        pods.push(pod);
    }
    pods
}

fn pod<'a>(pods: &'a [RunningPod], name: &str) -> &'a RunningPod {
    pods.iter().find(|p| p.spec.name == name).expect("a started pod")
}

async fn exec(cri: &Cri, pod: &RunningPod, cmd: &[&str]) -> ExecOutput {
    cri.exec_sync(&pod.container_id, cmd, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?} in {}: {e}", pod.spec.name))
}

async fn ping(cri: &Cri, from: &RunningPod, to: IpAddr) -> ExecOutput {
    let to = to.to_string();
    exec(cri, from, &["ping", "-c", "1", "-W", "2", &to]).await
}

/// `nc` from `from` to backend: Some(output) when it answered.
async fn nc(cri: &Cri, from: &RunningPod, backend: &RunningPod) -> ExecOutput {
    let to = backend.ipv4().expect("backend has IPv4").to_string();
    exec(cri, from, &["nc", "-w", "2", &to, PORT]).await
}

fn answered(out: &ExecOutput) -> bool {
    out.success() && out.stdout.contains(GREETING)
}

/// Waits until backend's server listens (its container just started).
async fn wait_server(cri: &Cri, pods: &[RunningPod]) {
    let backend = pod(pods, "backend");
    let started = Instant::now();
    loop {
        let out = nc(cri, backend, backend).await;
        if answered(&out) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "backend's server never answered itself: {out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn ping_all(cri: &Cri, pods: &[RunningPod]) {
    for from in pods {
        for to in pods.iter().filter(|p| p.spec.name != from.spec.name) {
            for ip in &to.ips {
                let out = ping(cri, from, *ip).await;
                assert!(
                    out.success(),
                    "{} → {} ({ip}) must answer ping: {out}",
                    from.spec.name,
                    to.spec.name
                );
            }
        }
    }
}

/// Stops and removes every pod as kubelet does; returns the StopPodSandbox
/// durations.
async fn delete_pods(cri: &Cri, pods: &[RunningPod]) -> Vec<Duration> {
    let mut took = Vec::new();
    for pod in pods {
        let stop = cri
            .delete_pod(&pod.sandbox_id)
            .await
            .unwrap_or_else(|e| panic!("deleting pod {}: {e}", pod.spec.name));
        took.push(stop);
    }
    took
}

async fn assert_runtime_clean(cri: &Cri, containerd: &Containerd, veths: impl Fn() -> String) {
    let sandboxes = cri.list_pod_sandboxes().await.unwrap();
    assert!(sandboxes.is_empty(), "sandboxes left: {sandboxes:?}");
    let leftovers = containerd.leftovers();
    assert!(leftovers.is_empty(), "pods left behind: {leftovers:?}");
    let veths = veths();
    assert!(
        veths.trim().is_empty(),
        "host veths left in the node namespace:\n{veths}"
    );
}

/// What names the cgroups of `pods` (see `cgroups_left`): the cgroup
/// parent and every sandbox and container id.
fn pod_cgroup_marks(containerd: &Containerd, pods: &[RunningPod]) -> Vec<String> {
    let mut marks = vec![containerd.cgroup_parent().to_string()];
    marks.extend(pods.iter().flat_map(|p| [p.sandbox_id.clone(), p.container_id.clone()]));
    marks
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

fn summary(what: &str, durations: &[Duration]) -> String {
    let mut sorted = durations.to_vec();
    sorted.sort();
    match (sorted.first(), sorted.last()) {
        (Some(min), Some(max)) => format!(
            "{what}: min {min:?} / median {:?} / max {max:?} (n={})",
            sorted[sorted.len() / 2],
            sorted.len()
        ),
        _ => format!("{what}: none"),
    }
}

/// CNI dirs with the reference bridge + host-local plugins (198.18.4.0/24
/// on bridge `rve2e0` in the node namespace); returns host-local's data dir.
fn bridge_cni() -> (CniDirs, PathBuf) {
    let cni = CniDirs::new();
    for plugin in ["bridge", "host-local", "loopback"] {
        cni.install_reference(plugin);
    }
    let ipam_dir = cni.path("host-local");
    cni.write_conflist(
        "bridge",
        &serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "e2e-bridge",
            "plugins": [{
                "type": "bridge",
                "bridge": "rve2e0",
                "isGateway": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "198.18.4.0/24"}]],
                    "dataDir": ipam_dir,
                },
            }],
        }),
    );
    (cni, ipam_dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn bridge_plugin_pods_prove_the_harness() {
    let started = Instant::now();
    let cgroups_before = cgroup_snapshot();
    let node = NetNs::new("rvn").unwrap_or_else(|e| panic!("{e}"));
    let (cni, ipam_dir) = bridge_cni();
    let containerd = start_containerd(&node.path(), &cni.bin(), &cni.conf()).await;
    let cri = containerd.cri().await.unwrap();

    let names = ["frontend", "backend", "db"];
    let pods = run_pods(&cri, &containerd, &names).await;
    let cgroup_marks = pod_cgroup_marks(&containerd, &pods);
    assert!(
        !cgroups_left(&cgroups_before, &cgroup_marks).is_empty(),
        "the running pods' cgroups are seen by the check"
    );
    for pod in &pods {
        let ip = pod
            .ipv4()
            .unwrap_or_else(|| panic!("{} has no IPv4: {:?}", pod.spec.name, pod.ips));
        assert!(
            ip.to_string().starts_with("198.18.4."),
            "{} got {ip} from host-local",
            pod.spec.name
        );
    }
    ping_all(&cri, &pods).await;
    wait_server(&cri, &pods).await;
    for from in ["frontend", "db"] {
        let out = nc(&cri, pod(&pods, from), pod(&pods, "backend")).await;
        assert!(answered(&out), "{from} → backend:{PORT} (no policy here): {out}");
    }

    let stops = delete_pods(&cri, &pods).await;
    assert_runtime_clean(&cri, &containerd, || {
        node.run(&["ip", "-o", "link", "show", "type", "veth"]).unwrap()
    })
    .await;
    let allocations: Vec<String> = std::fs::read_dir(ipam_dir.join("e2e-bridge"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.parse::<IpAddr>().is_ok())
        .collect();
    assert!(allocations.is_empty(), "host-local addresses left: {allocations:?}");
    drop(cri);
    drop(containerd);
    let left = cgroups_left(&cgroups_before, &cgroup_marks);
    assert!(left.is_empty(), "cgroup directories left on the machine: {left:#?}");

    let runs: Vec<Duration> = pods.iter().map(|p| p.run_sandbox).collect();
    eprintln!("bridge: {}", summary("RunPodSandbox", &runs));
    eprintln!("bridge: {}", summary("StopPodSandbox", &stops));
    eprintln!("bridge: whole test {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crashed_containerd_leaves_nothing_behind_on_drop() {
    let node = NetNs::new("rvn").unwrap_or_else(|e| panic!("{e}"));
    let (cni, _) = bridge_cni();
    let mut containerd = start_containerd(&node.path(), &cni.bin(), &cni.conf()).await;
    let cri = containerd.cri().await.unwrap();
    let pods = run_pods(&cri, &containerd, &["db"]).await;
    let dir = containerd.dir().to_path_buf();
    let before = containerd.leftovers();
    assert!(
        !before.netns.is_empty() && !before.shims.is_empty() && !before.mounts.is_empty(),
        "a running pod has a netns, a shim and mounts: {before:?}"
    );
    let cgroups = containerd.cgroup_dirs();
    assert!(
        cgroups.iter().any(|d| d.is_dir()),
        "pods live below the cgroup parent: {cgroups:?}"
    );

    // containerd dies; the shim, the pod and its mounts stay. Drop must
    // remove them without the CRI (no CNI DEL: the node's state is the
    // node's to reconcile).
    containerd.kill9();
    assert!(!containerd.leftovers().shims.is_empty(), "shims outlive containerd");
    let started = Instant::now();
    drop(containerd);
    eprintln!(
        "forced teardown of a crashed containerd with 1 pod: {:?}",
        started.elapsed()
    );
    let after = rivet_e2e::containerd::Leftovers::scan(&dir);
    assert!(after.is_empty(), "left behind: {after:?}");
    assert!(!dir.exists(), "containerd's dir is removed");
    let kept: Vec<_> = cgroups.iter().filter(|d| d.exists()).collect();
    assert!(kept.is_empty(), "cgroups left: {kept:?}");
    for pid in &before.shims {
        // Gone, or a zombie until init reaps it (shims are daemons).
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = state.rsplit_once(") ").map(|(_, rest)| &rest[..1]).unwrap_or("X");
        assert!(state == "Z" || state == "X", "shim {pid} is dead (state {state})");
    }
    // The pod's netns went with its last process and mount; its veth with it.
    let started = Instant::now();
    loop {
        let veths = node.run(&["ip", "-o", "link", "show", "type", "veth"]).unwrap();
        if veths.trim().is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "pod {} left its host veth:\n{veths}",
            pods[0].spec.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// NetworkPolicy: backend accepts only frontend, only on [`PORT`].
const BACKEND_POLICY: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: backend
  namespace: shop
spec:
  podSelector:
    matchLabels:
      app: backend
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              app: frontend
      ports:
        - protocol: TCP
          port: 8080
"#;

#[tokio::test(flavor = "multi_thread")]
async fn rivet_cni_pods_connectivity_policy_and_cleanup() {
    rivet_e2e::containerd::check_prerequisites().unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    let cgroups_before = cgroup_snapshot();
    // The node as a user makes it; containerd reads what `node up` installed,
    // unchanged: rivet-cni, loopback and the conflist's default cniVersion.
    let mut node = RivetNode::up(&rivet_common::testing::workspace_binary("rivet"))
        .unwrap_or_else(|e| panic!("rivet node up: {e}"));
    for plugin in ["rivet-cni", "loopback"] {
        assert!(node.cni_bin_dir().join(plugin).is_file(), "node up installs {plugin}");
    }
    let conflist: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.cni_conf_dir().join("10-rivet.conflist")).expect("node up wrote the conflist"),
    )
    .unwrap();
    assert_eq!(conflist["cniVersion"], "1.0.0", "a version containerd 1.6 reads");
    let containerd = start_containerd(&node.netns_path(), &node.cni_bin_dir(), &node.cni_conf_dir()).await;
    let cri = containerd.cri().await.unwrap();
    let cni_log = node.path("state/logs/rivet-cni.log");
    let cni_log_tail = || tail(&std::fs::read_to_string(&cni_log).unwrap_or_default());

    // containerd passes no pod labels to CNI: without Kubernetes they come
    // from `rivet endpoint label`, remembered until the endpoint exists.
    let names = ["frontend", "backend", "db"];
    for name in names {
        let out = node
            .json(&[
                "endpoint",
                "label",
                &format!("{NAMESPACE}/{name}"),
                &format!("app={name}"),
            ])
            .unwrap_or_else(|e| panic!("labelling {name}: {e}"));
        assert_eq!(
            out["endpoints"],
            serde_json::json!([]),
            "no endpoint before the sandbox"
        );
    }

    let mut pods = Vec::new();
    for name in names {
        let spec = pod_spec(&containerd, name);
        let pod = cri
            .run_pod(&spec, BUSYBOX_IMAGE, &command(name))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "starting pod {name}: {e}\nrivet-cni log:\n{}\ncontainerd log:\n{}",
                    cni_log_tail(),
                    tail(&containerd.log())
                )
            });
        eprintln!(
            "pod {name}: RunPodSandbox {:?}, create+start container {:?}, IPs {:?}",
            pod.run_sandbox, pod.start_container, pod.ips
        );
        pods.push(pod);
    }

    let cgroup_marks = pod_cgroup_marks(&containerd, &pods);
    assert!(
        !cgroups_left(&cgroups_before, &cgroup_marks).is_empty(),
        "the running pods' cgroups are seen by the check"
    );

    // Every pod has an address from the node's pools and a READY endpoint
    // named after the pod (K8S_POD_NAMESPACE / K8S_POD_NAME).
    let pool4: ipnet::IpNet = "198.18.0.0/22".parse().unwrap();
    let pool6: ipnet::IpNet = "2001:2::/64".parse().unwrap();
    let listed = node.json(&["endpoint", "list", "--namespace", NAMESPACE]).unwrap();
    let endpoints = listed["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), names.len(), "one endpoint per pod: {listed:#}");
    let pod_list = node.json(&["pod", "list"]).unwrap();
    for pod in &pods {
        let name = &pod.spec.name;
        assert!(
            pod.ips.iter().any(|ip| pool4.contains(ip)),
            "{name} has an IPv4 address of {pool4}: {:?}",
            pod.ips
        );
        assert!(
            pod.ips.iter().all(|ip| pool4.contains(ip) || pool6.contains(ip)),
            "{:?}",
            pod.ips
        );
        let endpoint = endpoints
            .iter()
            .find(|e| e["pod_name"] == name.as_str())
            .unwrap_or_else(|| panic!("no endpoint for pod {name}: {listed:#}"));
        assert_eq!(endpoint["state"], "ready", "{endpoint:#}");
        assert_eq!(endpoint["pod_namespace"], NAMESPACE);
        assert_eq!(
            endpoint["container_id"],
            pod.sandbox_id.as_str(),
            "the CNI container id is the sandbox id"
        );
        assert!(
            endpoint["host_interface"].as_str().unwrap().starts_with("lxc"),
            "{endpoint:#}"
        );
        let mut addresses: Vec<IpAddr> = endpoint["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["address"].as_str().unwrap().parse().unwrap())
            .collect();
        let mut ips = pod.ips.clone();
        addresses.sort();
        ips.sort();
        assert_eq!(addresses, ips, "the runtime reports the endpoint's addresses");
        assert!(
            endpoint["identity_labels"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l == &format!("k8s:app={name}")),
            "{name}'s identity carries its label: {endpoint:#}"
        );
        // `rivet pod list` shows the runtime's pods.
        let row = pod_list
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name.as_str())
            .unwrap_or_else(|| panic!("rivet pod list shows {name}: {pod_list:#}"));
        assert_eq!(row["created_by"], "runtime", "{row}");
    }

    // Connectivity, then policy: only frontend → backend:8080.
    ping_all(&cri, &pods).await;
    wait_server(&cri, &pods).await;
    let out = nc(&cri, pod(&pods, "db"), pod(&pods, "backend")).await;
    assert!(answered(&out), "without a policy db reaches backend: {out}");
    let policy = node.path("backend.yaml");
    std::fs::write(&policy, BACKEND_POLICY).unwrap();
    let applied = node
        .json(&["policy", "apply", "--wait", "-f", policy.to_str().unwrap()])
        .unwrap();
    assert_eq!(
        applied["applied"][0]["selected_endpoints"], 1,
        "the policy selects backend only: {applied:#}"
    );
    let out = nc(&cri, pod(&pods, "frontend"), pod(&pods, "backend")).await;
    assert!(answered(&out), "frontend → backend:{PORT} is allowed: {out}");
    let out = nc(&cri, pod(&pods, "db"), pod(&pods, "backend")).await;
    assert!(!answered(&out), "db → backend:{PORT} must be denied: {out}");
    let out = ping(&cri, pod(&pods, "db"), pod(&pods, "frontend").ipv4().unwrap()).await;
    assert!(out.success(), "db ↔ frontend is not selected by the policy: {out}");

    // StopPodSandbox + RemovePodSandbox → rivet-cni DEL: nothing left.
    let stops = delete_pods(&cri, &pods).await;
    let remaining = node.json(&["endpoint", "list"]).unwrap();
    assert_eq!(
        remaining["endpoints"],
        serde_json::json!([]),
        "endpoints left after DEL"
    );
    let ipam = node.json(&["ipam", "list", "--allocations"]).unwrap();
    assert_eq!(
        ipam["allocations"],
        serde_json::json!([]),
        "addresses left allocated: {ipam:#}"
    );
    assert_runtime_clean(&cri, &containerd, || node.veths().unwrap()).await;
    drop(cri);
    drop(containerd);
    let left = cgroups_left(&cgroups_before, &cgroup_marks);
    assert!(left.is_empty(), "cgroup directories left on the machine: {left:#?}");
    node.down().unwrap_or_else(|e| panic!("rivet node down: {e}"));

    let runs: Vec<Duration> = pods.iter().map(|p| p.run_sandbox).collect();
    eprintln!("rivet-cni: {}", summary("RunPodSandbox", &runs));
    eprintln!("rivet-cni: {}", summary("StopPodSandbox", &stops));
    eprintln!("rivet-cni: whole test {:?}", started.elapsed());
}

/// A `loopback` that refuses ADD (and, as the real one, has nothing to undo
/// on DEL): containerd runs it beside rivet-cni for the same sandbox.
const FAILING_LOOPBACK: &str = r#"#!/bin/sh
cat >/dev/null
echo "$CNI_COMMAND $CNI_CONTAINERID" >> "$(dirname "$0")/loopback.calls"
if [ "$CNI_COMMAND" = ADD ]; then
    echo '{"cniVersion":"1.0.0","code":11,"msg":"loopback refused by the test"}'
    exit 1
fi
exit 0
"#;

/// A node made by `rivet node up` whose `loopback` is replaced by
/// `script`, containerd on it, and a sandbox `doomed` in namespace shop that
/// fails with an error saying `says`.
async fn doomed_sandbox(script: &str, says: &str) -> (RivetNode, Containerd, Cri) {
    rivet_e2e::containerd::check_prerequisites().unwrap_or_else(|e| panic!("{e}"));
    let node = RivetNode::up(&rivet_common::testing::workspace_binary("rivet"))
        .unwrap_or_else(|e| panic!("rivet node up: {e}"));
    install_script(&node.cni_bin_dir().join("loopback"), script);
    let containerd = start_containerd(&node.netns_path(), &node.cni_bin_dir(), &node.cni_conf_dir()).await;
    let cri = containerd.cri().await.unwrap();
    let err = cri
        .run_pod(&pod_spec(&containerd, "doomed"), BUSYBOX_IMAGE, &command("doomed"))
        .await
        .expect_err("the sandbox fails with its loopback");
    assert!(err.to_string().contains(says), "{err}");
    (node, containerd, cri)
}

/// A sandbox that fails after rivet-cni's ADD succeeded (containerd runs
/// loopback and rivet-cni together, and loopback fails): whatever containerd
/// does next — a DEL through the chain, or only removing the pod's netns —
/// nothing of the pod is left: no endpoint, address, host veth, netns or
/// cgroup.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_failing_beside_rivet_cni_leaves_nothing() {
    let cgroups_before = cgroup_snapshot();
    let (mut node, containerd, cri) = doomed_sandbox(FAILING_LOOPBACK, "loopback refused by the test").await;
    let cni_log = std::fs::read_to_string(node.path("state/logs/rivet-cni.log")).unwrap_or_default();
    assert!(
        cni_log.contains("cni.add")
            && cni_log.contains(r#"k8s.namespace.name="shop""#)
            && cni_log.contains(r#"k8s.pod.name="doomed""#),
        "rivet-cni's ADD ran for the sandbox:\n{cni_log}"
    );
    let calls = std::fs::read_to_string(node.cni_bin_dir().join("loopback.calls")).unwrap_or_default();
    eprintln!(
        "containerd after the failed sandbox: loopback calls {:?}; rivet-cni DEL called: {}",
        calls.lines().collect::<Vec<_>>(),
        cni_log.contains("cni.del")
    );

    // Converges without any further call from the runtime.
    let started = Instant::now();
    loop {
        let endpoints = node.json(&["endpoint", "list"]).unwrap();
        let ipam = node.json(&["ipam", "list", "--allocations"]).unwrap();
        let veths = node.veths().unwrap();
        let netns = containerd.leftovers().netns;
        if endpoints["endpoints"] == serde_json::json!([])
            && ipam["allocations"] == serde_json::json!([])
            && veths.trim().is_empty()
            && netns.is_empty()
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "left after the failed sandbox: endpoints {:#}, allocations {:#}, veths {veths:?}, netns {netns:?}",
            endpoints["endpoints"],
            ipam["allocations"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("the failed sandbox left nothing after {:?}", started.elapsed());
    assert!(
        cri.list_pod_sandboxes().await.unwrap().iter().all(|s| s.state != 0),
        "no sandbox is ready"
    );
    let marks = vec![containerd.cgroup_parent().to_string()];
    drop(cri);
    drop(containerd);
    let left = cgroups_left(&cgroups_before, &marks);
    assert!(left.is_empty(), "cgroup directories left on the machine: {left:#?}");
    node.down().unwrap_or_else(|e| panic!("rivet node down: {e}"));
}

/// A `loopback` as good as missing: ADD and DEL both fail.
const BROKEN_LOOPBACK: &str = r#"#!/bin/sh
cat >/dev/null
echo '{"cniVersion":"1.0.0","code":11,"msg":"loopback is broken"}'
exit 1
"#;

/// Writes an executable script over `path`.
fn install_script(path: &Path, text: &str) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// CNI GC of the node's network as a runtime with GC (CNI 1.1) calls it:
/// rivet-cni in the node namespace, `cni.dev/valid-attachments` on stdin.
fn cni_gc(node: &RivetNode, valid: serde_json::Value) -> std::process::Output {
    let list: serde_json::Value =
        serde_json::from_slice(&std::fs::read(node.cni_conf_dir().join("10-rivet.conflist")).unwrap()).unwrap();
    let mut conf = list["plugins"][0].clone();
    conf["name"] = list["name"].clone();
    conf["cniVersion"] = "1.1.0".into();
    conf["cni.dev/valid-attachments"] = valid;
    let mut child = std::process::Command::new("nsenter")
        .arg(format!("--net={}", node.netns_path().display()))
        .arg(node.cni_bin_dir().join("rivet-cni"))
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", "GC")
        .env("CNI_PATH", node.cni_bin_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), conf.to_string().as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The issue's case: loopback missing (here: failing ADD and DEL), so
/// containerd's teardown of the failed sandbox stops at loopback and never
/// calls rivet-cni's DEL; it keeps the pod's netns and the sandbox
/// (NOTREADY), and rivet-cni's attachment with it. CNI GC (what a runtime
/// with CNI 1.1 calls) with a valid list that lacks the sandbox removes the
/// endpoint, the address and the host veth at once; once loopback works
/// again, kubelet's StopPodSandbox + RemovePodSandbox finish and nothing
/// is left.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_whose_teardown_never_reaches_rivet_cni_is_collected_by_cni_gc() {
    let cgroups_before = cgroup_snapshot();
    let (mut node, containerd, cri) = doomed_sandbox(BROKEN_LOOPBACK, "loopback is broken").await;
    let loopback = node.cni_bin_dir().join("loopback");
    let cni_log = || std::fs::read_to_string(node.path("state/logs/rivet-cni.log")).unwrap_or_default();
    assert!(
        !cni_log().contains("cni.del"),
        "containerd never called rivet-cni's DEL"
    );
    let endpoints = node.json(&["endpoint", "list"]).unwrap();
    assert_eq!(
        endpoints["endpoints"].as_array().map(Vec::len),
        Some(1),
        "the attachment the runtime left: {endpoints:#}"
    );
    let sandboxes = cri.list_pod_sandboxes().await.unwrap();
    assert_eq!(sandboxes.len(), 1, "containerd keeps the failed sandbox: {sandboxes:?}");

    // CNI GC, the attachment not in the valid list: all of it goes now.
    let gc = cni_gc(&node, serde_json::json!([]));
    assert!(
        gc.status.success(),
        "GC: {}{}",
        String::from_utf8_lossy(&gc.stdout),
        String::from_utf8_lossy(&gc.stderr)
    );
    assert_eq!(
        node.json(&["endpoint", "list"]).unwrap()["endpoints"],
        serde_json::json!([])
    );
    let ipam = node.json(&["ipam", "list", "--allocations"]).unwrap();
    assert_eq!(ipam["allocations"], serde_json::json!([]), "{ipam:#}");
    assert!(node.veths().unwrap().trim().is_empty(), "the host veth is gone");

    // loopback repaired: kubelet's retries finish containerd's side (DEL of
    // what is gone already succeeds).
    std::fs::copy(Path::new(REFERENCE_CNI_DIR).join("loopback"), &loopback).unwrap();
    cri.delete_pod(&sandboxes[0].id)
        .await
        .unwrap_or_else(|e| panic!("stopping and removing the failed sandbox: {e}"));
    assert_runtime_clean(&cri, &containerd, || node.veths().unwrap()).await;
    let marks = vec![containerd.cgroup_parent().to_string(), sandboxes[0].id.clone()];
    drop(cri);
    drop(containerd);
    let left = cgroups_left(&cgroups_before, &marks);
    assert!(left.is_empty(), "cgroup directories left on the machine: {left:#?}");
    node.down().unwrap_or_else(|e| panic!("rivet node down: {e}"));
}

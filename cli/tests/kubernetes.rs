//! `rivet node up --kubeconfig` as a user runs it against a real
//! kube-apiserver (the testkit's `KubeApiServer`, with svc-k8s-sync's
//! ServiceAccount bound to exactly `deploy/rbac/svc-k8s-sync.yaml`): pods
//! made by `rivet pod add` get their labels from their Pod objects, their
//! RivetEndpoints are written, a NetworkPolicy from the API is enforced,
//! `rivet status` shows svc-k8s-sync healthy, and `rivet node down` leaves
//! nothing behind; with `--ipam-mode cluster-pool` svc-ipam waits for the
//! pod CIDRs of the node's RivetNode and a pod gets its address from them.
//!
//! Needs root, a bpffs, the workspace binaries (`cargo build --bins`) and
//! the tools of `cargo xtask install`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rivet_testkit::kube::KubeApiServer;
use support::{TestNode, eventually, eventually_ok, reachable_tempdir};

mod support;

/// The reserved identity of a pod whose labels are not known yet.
const INIT_IDENTITY: u64 = 5;

/// Applies `yaml` with the admin kubectl.
fn kubectl_apply(api: &KubeApiServer, yaml: &str) {
    let mut child = api
        .kubectl()
        .expect("kubectl is installed")
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running kubectl");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kubectl apply failed: {}{}\n{yaml}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `kubectl get <what> -o json`, or `None` when it is not found.
fn kubectl_get(api: &KubeApiServer, what: &[&str]) -> Option<serde_json::Value> {
    let out = api
        .kubectl()
        .expect("kubectl is installed")
        .arg("get")
        .args(what)
        .args(["-o", "json"])
        .output()
        .expect("running kubectl");
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).expect("kubectl -o json prints JSON"))
}

/// svc-k8s-sync's kubeconfig where the daemon's user can read it: the
/// fixture's (in its 0700 dir) with the CA copied beside it.
fn reachable_kubeconfig(kubeconfig: &Path, ca: &Path, dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let ca_copy = dir.join("ca.crt");
    std::fs::copy(ca, &ca_copy).unwrap();
    let text = std::fs::read_to_string(kubeconfig)
        .unwrap()
        .replace(&ca.display().to_string(), &ca_copy.display().to_string());
    let path = dir.join("svc-k8s-sync.kubeconfig");
    std::fs::write(&path, text).unwrap();
    for file in [&ca_copy, &path] {
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    path.display().to_string()
}

/// A kube-apiserver with Rivet's CRDs, and a kubeconfig of svc-k8s-sync's
/// ServiceAccount the daemon's user can read (in the returned dir).
fn api_for_svc_k8s_sync(runtime: &tokio::runtime::Runtime) -> (KubeApiServer, tempfile::TempDir, String) {
    let api = runtime.block_on(KubeApiServer::start()).expect("kube-apiserver starts");
    runtime
        .block_on(api.apply_crds())
        .expect("Rivet's CRDs are established");
    let access = runtime
        .block_on(api.service_account_client("svc-k8s-sync"))
        .expect("svc-k8s-sync's ServiceAccount and RBAC apply");
    let kube_dir = reachable_tempdir("rvtk");
    let kubeconfig = reachable_kubeconfig(&access.kubeconfig, &api.ca_cert(), kube_dir.path());
    (api, kube_dir, kubeconfig)
}

/// svc-k8s-sync's log (for failure messages).
fn k8s_sync_log(node: &TestNode) -> String {
    std::fs::read_to_string(node.record().log_dir.join("svc-k8s-sync.log")).unwrap_or_default()
}

/// The endpoint of pod `default/<name>` from `rivet endpoint list`.
fn endpoint(node: &TestNode, name: &str) -> Option<serde_json::Value> {
    node.json(&["endpoint", "list"])["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["pod_namespace"] == "default" && e["pod_name"] == name)
        .cloned()
}

#[test]
fn node_up_with_a_kubeconfig_takes_labels_and_policy_from_the_api_and_down_leaves_nothing() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, _kube_dir, kubeconfig) = api_for_svc_k8s_sync(&runtime);

    let mut node = TestNode::up_with(&["--kubeconfig", &kubeconfig]);
    let node_name = node.record().node_name;
    let names: Vec<String> = node.record().daemons.iter().map(|d| d.name.clone()).collect();
    assert!(names.iter().any(|n| n == "svc-k8s-sync"), "{names:?}");
    kubectl_apply(
        &api,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node_name}\n---\n\
             apiVersion: v1\nkind: Namespace\nmetadata:\n  name: default\n  labels:\n    team: shop\n"
        ),
    );
    for (pod, app) in [("a", "client"), ("b", "server")] {
        kubectl_apply(
            &api,
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod}\n  namespace: default\n  labels:\n    app: {app}\n\
                 spec:\n  nodeName: {node_name}\n  containers:\n  - name: c\n    image: none\n"
            ),
        );
    }

    // Pods added without labels: the labels come from their Pod objects.
    node.ok(&["pod", "add", "a"]);
    node.ok(&["pod", "add", "b"]);
    for (pod, app) in [("a", "client"), ("b", "server")] {
        let label = format!("k8s:app={app}");
        eventually_ok(
            &format!("{pod} gets its API labels' identity"),
            Duration::from_secs(30),
            || {
                let e = endpoint(&node, pod);
                let ok = e.as_ref().is_some_and(|e| {
                    e["state"] == "ready"
                        && e["identity"].as_u64().is_some_and(|i| i != INIT_IDENTITY)
                        && e["identity_labels"].as_array().unwrap().iter().any(|l| *l == *label)
                });
                if ok {
                    Ok(())
                } else {
                    Err(format!("{e:?}\nsvc-k8s-sync's log:\n{}", k8s_sync_log(&node)))
                }
            },
        );
    }

    // Each pod's RivetEndpoint carries its endpoint's status.
    let b = endpoint(&node, "b").unwrap();
    eventually("b's RivetEndpoint shows its endpoint", Duration::from_secs(30), || {
        kubectl_get(&api, &["rivetendpoint", "-n", "default", "b"]).is_some_and(|o| {
            o["status"]["id"] == b["id"]
                && o["status"]["identity"] == b["identity"]
                && o["status"]["node"] == *node_name
                && o["metadata"]["ownerReferences"][0]["name"] == "b"
        })
    });

    // A NetworkPolicy from the API is enforced: a reaches b's echo server
    // before it, not once b realised it.
    let mut server = node.spawn_in("b", &["busybox", "nc", "-ll", "-p", "8080", "-e", "cat"]);
    let b4 = node.ipv4("b");
    eventually("b's echo server answers a", Duration::from_secs(10), || {
        node.tcp_echo("a", &b4, 8080)
    });
    kubectl_apply(
        &api,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: server-from-nobody\n  namespace: default\n\
         spec:\n  podSelector:\n    matchLabels:\n      app: server\n  policyTypes: [Ingress]\n\
         \x20 ingress:\n  - from:\n    - podSelector:\n        matchLabels:\n          app: nobody\n",
    );
    let mut revision = 0;
    eventually("the NetworkPolicy is in svc-endpoint", Duration::from_secs(30), || {
        let list = node.json(&["policy", "list", "--namespace", "default"]);
        list["policies"].as_array().unwrap().iter().any(|p| {
            let found = p["origin"] == "kubernetes" && p.to_string().contains("server-from-nobody");
            if found {
                revision = p["revision"].as_u64().unwrap();
            }
            found
        })
    });
    eventually("b realises the NetworkPolicy", Duration::from_secs(30), || {
        endpoint(&node, "b").is_some_and(|e| {
            e["state"] == "ready" && e["ingress_enforced"] == true && e["policy_revision"].as_u64() >= Some(revision)
        })
    });

    assert!(!node.tcp_echo("a", &b4, 8080), "the NetworkPolicy denies a -> b");

    // `rivet status` is healthy and shows svc-k8s-sync's watches.
    let status = node.rivet(&["status"]).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.status.success(), "rivet status: {text}");
    assert!(text.contains("\nsvc-k8s-sync:\n"), "{text}");
    assert!(text.contains(&format!("node       {node_name}, ready\n")), "{text}");
    assert!(text.contains("caches     synced\n"), "{text}");

    node.down_and_check_nothing_left();
    let _ = server.wait();
    let left = Command::new("pgrep").args(["-f", &kubeconfig]).output().unwrap();
    assert!(left.stdout.is_empty(), "no svc-k8s-sync is left: {:?}", left.stdout);
}

#[test]
fn node_up_in_cluster_pool_mode_takes_its_pod_cidrs_from_the_rivet_node() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (api, _kube_dir, kubeconfig) = api_for_svc_k8s_sync(&runtime);

    let mut node = TestNode::up_with(&["--kubeconfig", &kubeconfig, "--ipam-mode", "cluster-pool"]);
    let node_name = node.record().node_name;
    kubectl_apply(
        &api,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node_name}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: default\n\
             spec:\n  nodeName: {node_name}\n  containers:\n  - name: c\n    image: none\n"
        ),
    );
    // svc-ipam runs without a pool and says so until the RivetNode has one.
    eventually_ok("rivet status shows svc-ipam waiting", Duration::from_secs(30), || {
        let out = node.rivet(&["status"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains("no pool yet: waiting for the node's pod CIDRs") {
            Ok(())
        } else {
            Err(text)
        }
    });
    // The operator's allocation, written as admin.
    kubectl_apply(
        &api,
        &format!(
            "apiVersion: rivet.io/v1\nkind: RivetNode\nmetadata:\n  name: {node_name}\n\
             spec:\n  podCidrs: [198.18.12.0/24, \"2001:2:0:12::/120\"]\n"
        ),
    );
    eventually_ok(
        "rivet ipam list shows the RivetNode's pool",
        Duration::from_secs(30),
        || {
            let ranges = node.json(&["ipam", "list"])["ranges"].clone();
            let found = ranges
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["pool"] == "default" && r["cidr"] == "198.18.12.0/24" && r["source"] == "set-pool");
            if found {
                Ok(())
            } else {
                Err(format!("{ranges}\nsvc-k8s-sync's log:\n{}", k8s_sync_log(&node)))
            }
        },
    );
    node.ok(&["pod", "add", "a"]);
    let a = node.ipv4("a");
    assert!(a.starts_with("198.18.12."), "a's {a} is in the RivetNode's pod CIDR");
    node.down_and_check_nothing_left();
}

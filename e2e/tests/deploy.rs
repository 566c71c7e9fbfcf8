//! deploy/ (issue 18 §2), before any kubelet runs it:
//!
//! - `kubectl kustomize` builds deploy/ and every overlay, and a real
//!   kube-apiserver accepts every object (`kubectl apply --dry-run=server -k`);
//! - the built objects keep the promises of deploy/'s comments: the RBAC is
//!   exactly deploy/rbac/'s files (the ones the daemons' least-privilege
//!   tests bind), every CRD of deploy/crds/ is there, only svc-k8s-sync and
//!   (with the CRD store) svc-identity get an API token, only svc-loader
//!   adds capabilities (its table plus the three it drops at start) and it
//!   alone runs as root, every daemon has requests, limits, OTLP and
//!   `/healthz` probes on the port its ConfigMap gives `--metrics-address`;
//! - every container's command line parses with the real binaries: each
//!   daemon with its ConfigMap as config dir, its environment and
//!   `--check-config`; the init containers really run (`rivet node prepare`
//!   and `rivet-cni install`, their host paths moved into a temp dir), and
//!   the `cleanup` sidecar waits for SIGTERM, then removes what they left
//!   (this namespace has no pod interface and no daemon serves).
//!
//! Needs kube-apiserver and kubectl (`cargo xtask install`), the rivet
//! users and the workspace binaries (`cargo build --bins`).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use rivet_common::testing::workspace_binary;
use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::tools::{Tool, tool_path};
use serde::Deserialize as _;
use serde_json::Value;

/// deploy/ (the CRD store) and its overlays.
const KUSTOMIZATIONS: [&str; 2] = ["deploy", "deploy/overlays/etcd"];

/// The daemons of the node DaemonSet, one container each.
const NODE_DAEMONS: [&str; 6] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    "svc-endpoint",
    "svc-gc",
    "svc-k8s-sync",
];

/// Where the in-cluster config finds a ServiceAccount token.
const TOKEN_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kubectl(args: &[&str]) -> String {
    let out = Command::new(tool_path(Tool::Kubectl).expect("kubectl (cargo xtask install)"))
        .args(args)
        .output()
        .expect("running kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("kubectl prints UTF-8")
}

fn yaml_documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("YAML a JSON value holds"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// The objects `kubectl kustomize <dir>` builds.
fn kustomize(dir: &str) -> Vec<Value> {
    let path = workspace().join(dir);
    yaml_documents(&kubectl(&["kustomize", &path.display().to_string()]))
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

fn get<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    find(objects, kind, name).unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn strs(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The YAML files of a deploy/ directory, without its kustomization.
fn manifests(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(workspace().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    files
}

/// The data of the ConfigMap a pod volume names (kustomize's hashed name).
fn config_map_data<'a>(objects: &'a [Value], pod: &Value, volume: &str) -> &'a serde_json::Map<String, Value> {
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == volume)
        .unwrap_or_else(|| panic!("no volume {volume}"));
    let name = volume["configMap"]["name"].as_str().expect("a ConfigMap volume");
    get(objects, "ConfigMap", name)["data"]
        .as_object()
        .expect("ConfigMap data")
}

fn containers(pod: &Value, field: &str) -> Vec<Value> {
    pod[field].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kustomization_builds_and_the_api_server_accepts_every_object() {
    let server = KubeApiServer::start().await.expect("kube-apiserver");
    let kubeconfig = server.admin_kubeconfig().display().to_string();
    for dir in KUSTOMIZATIONS {
        let path = workspace().join(dir).display().to_string();
        let accepted: Value = serde_json::from_str(&kubectl(&[
            "--kubeconfig",
            &kubeconfig,
            "apply",
            "--dry-run=server",
            "-k",
            &path,
            "-o",
            "json",
        ]))
        .expect("kubectl apply -o json prints JSON");
        let accepted: BTreeSet<(String, String)> = accepted["items"]
            .as_array()
            .expect("a List")
            .iter()
            .map(|o| {
                (
                    o["kind"].as_str().unwrap().to_string(),
                    o["metadata"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let built: BTreeSet<(String, String)> = kustomize(dir)
            .iter()
            .map(|o| {
                (
                    o["kind"].as_str().unwrap().to_string(),
                    o["metadata"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            accepted, built,
            "{dir}: the API server accepted every object kustomize built"
        );
        assert!(
            built.contains(&("DaemonSet".into(), "rivet-node".into())),
            "{dir}: {built:?}"
        );
    }
}

#[test]
fn the_objects_keep_deploy_s_promises() {
    for dir in KUSTOMIZATIONS {
        let objects = kustomize(dir);
        let crd_store = dir == "deploy";

        // Every CRD of deploy/crds/, as generated.
        for file in manifests("deploy/crds") {
            let name = file.file_stem().unwrap().to_string_lossy().into_owned();
            get(&objects, "CustomResourceDefinition", &name);
        }
        // The RBAC is deploy/rbac/'s files, object for object (svc-identity's
        // only with the CRD store).
        for file in manifests("deploy/rbac") {
            let identity = file.ends_with("svc-identity.yaml");
            for doc in yaml_documents(&std::fs::read_to_string(&file).unwrap()) {
                let (kind, name) = (doc["kind"].as_str().unwrap(), doc["metadata"]["name"].as_str().unwrap());
                match find(&objects, kind, name) {
                    Some(built) => {
                        assert!(crd_store || !identity, "{dir}: {kind} {name} is only for the CRD store");
                        assert_eq!(built, &doc, "{dir}: {kind} {name} differs from {}", file.display());
                    }
                    None => assert!(
                        !crd_store && identity,
                        "{dir}: {kind} {name} of {} is missing",
                        file.display()
                    ),
                }
            }
        }

        let node = get(&objects, "DaemonSet", "rivet-node");
        assert_eq!(node["spec"]["updateStrategy"]["type"], "RollingUpdate");
        assert_eq!(node["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"], 1);
        let pod = &node["spec"]["template"]["spec"];
        assert_eq!(pod["hostNetwork"], true);
        assert_eq!(
            pod["automountServiceAccountToken"], false,
            "no container gets a token unasked"
        );
        assert_eq!(pod["serviceAccountName"], "rivet-k8s-sync");
        assert_eq!(
            node["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"],
            "true"
        );
        let mut names: Vec<String> = containers(pod, "containers")
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        let mut expected: Vec<String> = NODE_DAEMONS.iter().map(|d| d.to_string()).collect();
        expected.sort();
        assert_eq!(names, expected, "{dir}: one container per daemon");

        for c in containers(pod, "containers") {
            let name = c["name"].as_str().unwrap();
            let security = &c["securityContext"];
            assert_ne!(security["privileged"], true, "{dir}: {name} is not privileged");
            assert_eq!(security["allowPrivilegeEscalation"], false, "{dir}: {name}");
            assert_eq!(strs(&security["capabilities"]["drop"]), ["ALL"], "{dir}: {name}");
            let added = strs(&security["capabilities"]["add"]);
            if name == "svc-loader" {
                assert_eq!(
                    added,
                    ["BPF", "NET_ADMIN", "PERFMON", "SETUID", "SETGID", "SETPCAP"],
                    "{dir}"
                );
                assert!(
                    strs(&c["args"]).contains(&"--user=rivet-datapath"),
                    "{dir}: svc-loader switches users"
                );
            } else {
                assert!(added.is_empty(), "{dir}: {name} adds {added:?}");
                assert_eq!(security["runAsNonRoot"], true, "{dir}: {name}");
                assert!(security["runAsUser"].as_u64().is_some_and(|u| u != 0), "{dir}: {name}");
            }
            for kind in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    let quantity = &c["resources"][kind][resource];
                    assert!(
                        quantity.is_string() || quantity.is_number(),
                        "{dir}: {name} {kind}.{resource}"
                    );
                }
            }
            let env: Vec<&str> = c["env"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e["name"].as_str())
                .collect();
            assert!(
                env.contains(&"OTEL_EXPORTER_OTLP_ENDPOINT"),
                "{dir}: {name} exports traces"
            );
            // Probes on the port its ConfigMap gives --metrics-address.
            let config = config_map_data(&objects, pod, &format!("config-{name}"));
            let address = config["metrics-address"]
                .as_str()
                .unwrap_or_else(|| panic!("{dir}: {name}"));
            let port: u64 = address.rsplit_once(':').unwrap().1.parse().unwrap();
            for probe in ["livenessProbe", "readinessProbe"] {
                assert_eq!(c[probe]["httpGet"]["path"], "/healthz", "{dir}: {name} {probe}");
                assert_eq!(c[probe]["httpGet"]["port"], port, "{dir}: {name} {probe}");
            }
            // An API token only where the daemon talks to the API server.
            let token = c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["mountPath"] == TOKEN_PATH);
            let wants = name == "svc-k8s-sync" || (name == "svc-identity" && crd_store);
            assert_eq!(token, wants, "{dir}: {name} has a token: {token}");
        }

        let operator = get(&objects, "Deployment", "rivet-operator");
        assert_eq!(operator["spec"]["replicas"], 2);
        let operator_pod = &operator["spec"]["template"]["spec"];
        assert_eq!(operator_pod["serviceAccountName"], "rivet-operator");
        let config = config_map_data(&objects, operator_pod, "config");
        assert_eq!(
            config["identity-store"],
            if crd_store { "kubernetes" } else { "etcd" },
            "{dir}"
        );
        let jaeger = get(&objects, "Service", "jaeger");
        assert!(
            jaeger["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "otlp-grpc" && p["port"] == 4317),
            "{dir}: the OTLP endpoint the containers use"
        );
        get(&objects, "Deployment", "jaeger");
    }
}

/// What kubelet gives a container: env values (fieldRefs and the Jaeger
/// Service's variables filled with example values), `envFrom` ConfigMaps.
fn container_env(objects: &[Value], container: &Value) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = [
        ("JAEGER_SERVICE_HOST", "198.18.0.9"),
        ("JAEGER_SERVICE_PORT_OTLP_GRPC", "4317"),
        ("PATH", "/usr/bin:/bin"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for from in container["envFrom"].as_array().into_iter().flatten() {
        let name = from["configMapRef"]["name"].as_str().expect("envFrom a ConfigMap");
        for (k, v) in get(objects, "ConfigMap", name)["data"].as_object().unwrap() {
            env.insert(k.clone(), v.as_str().unwrap().to_string());
        }
    }
    for var in container["env"].as_array().into_iter().flatten() {
        let value = match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("spec.nodeName") => "node-1".to_string(),
            Some("status.hostIP") => "198.18.0.2".to_string(),
            Some("status.hostIPs") => "198.18.0.2,2001:2::2".to_string(),
            Some(other) => panic!("an unexpected fieldRef {other}"),
            None => expand(var["value"].as_str().expect("a value"), &env),
        };
        env.insert(var["name"].as_str().unwrap().to_string(), value);
    }
    env
}

/// Kubernetes' `$(VAR)` expansion.
fn expand(text: &str, env: &BTreeMap<String, String>) -> String {
    env.iter()
        .fold(text.to_string(), |s, (k, v)| s.replace(&format!("$({k})"), v))
}

/// The container's command line with `$(VAR)`s expanded and every mount
/// path moved under `root` (`<root>/<volume>`), and the ConfigMap volumes
/// written there.
fn command_line(objects: &[Value], pod: &Value, c: &Value, env: &BTreeMap<String, String>, root: &Path) -> Vec<String> {
    let mut mounts = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let volume = m["name"].as_str().unwrap();
        let dir = root.join(volume);
        std::fs::create_dir_all(&dir).unwrap();
        if pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == volume && v["configMap"].is_object())
        {
            for (key, value) in config_map_data(objects, pod, volume) {
                std::fs::write(dir.join(key), value.as_str().unwrap()).unwrap();
            }
        }
        mounts.push((m["mountPath"].as_str().unwrap().to_string(), dir));
    }
    strs(&c["command"])
        .into_iter()
        .chain(strs(&c["args"]))
        .map(|arg| {
            let arg = expand(arg, env);
            mounts
                .iter()
                .fold(arg, |arg, (path, dir)| match arg.split_once(path.as_str()) {
                    Some((head, tail)) if tail.is_empty() || tail.starts_with('/') => {
                        format!("{head}{}{tail}", dir.display())
                    }
                    _ => arg,
                })
        })
        .collect()
}

fn run(line: &[String], env: &BTreeMap<String, String>) -> String {
    let out = Command::new(workspace_binary(&line[0]))
        .args(&line[1..])
        .env_clear()
        .envs(env)
        .output()
        .expect("running the binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{line:?}: {}\n{text}", out.status);
    text
}

#[test]
fn every_container_s_command_line_works_with_the_real_binaries() {
    for dir in KUSTOMIZATIONS {
        let objects = kustomize(dir);
        let pods = [
            get(&objects, "DaemonSet", "rivet-node"),
            get(&objects, "Deployment", "rivet-operator"),
        ];
        for workload in pods {
            let pod = &workload["spec"]["template"]["spec"];
            for c in containers(pod, "containers") {
                let root = tempfile::tempdir().unwrap();
                let env = container_env(&objects, &c);
                let mut line = command_line(&objects, pod, &c, &env, root.path());
                line.push("--check-config".into());
                let out = run(&line, &env);
                assert!(out.contains("the configuration is valid"), "{dir}: {line:?}: {out}");
            }
            // The init containers run for real, into the temp dir.
            for c in containers(pod, "initContainers") {
                let root = tempfile::tempdir().unwrap();
                let env = container_env(&objects, &c);
                let name = c["name"].as_str().unwrap();
                let line = command_line(&objects, pod, &c, &env, root.path());
                match name {
                    "prepare" => {
                        run(&line, &env);
                        let rivet = nix::unistd::User::from_name("rivet").unwrap().expect("user rivet");
                        let datapath = nix::unistd::User::from_name("rivet-datapath")
                            .unwrap()
                            .expect("user rivet-datapath");
                        let sockets = std::fs::metadata(root.path().join("run/sockets")).unwrap();
                        assert_eq!(sockets.mode() & 0o7777, 0o1771, "{dir}: the socket dir");
                        assert_eq!(sockets.gid(), rivet.gid.as_raw(), "{dir}: the socket dir's group");
                        for daemon in NODE_DAEMONS {
                            let owner = if matches!(daemon, "svc-loader" | "svc-gc") {
                                &datapath
                            } else {
                                &rivet
                            };
                            let state = std::fs::metadata(root.path().join("run").join(daemon)).unwrap();
                            assert_eq!(
                                (state.uid(), state.mode() & 0o777),
                                (owner.uid.as_raw(), 0o700),
                                "{dir}: {daemon}"
                            );
                        }
                        let pins = std::fs::metadata(root.path().join("bpffs/rivet/node-1")).unwrap();
                        assert_eq!(pins.uid(), datapath.uid.as_raw(), "{dir}: the pin dir");
                    }
                    "install-cni" => {
                        let bin = root.path().join("cni-bin");
                        std::fs::create_dir_all(&bin).unwrap();
                        std::fs::copy("/usr/lib/cni/loopback", bin.join("loopback"))
                            .expect("the reference loopback plugin");
                        run(&line, &env);
                        assert!(bin.join("rivet-cni").is_file(), "{dir}");
                        let conflist: Value = serde_json::from_str(
                            &std::fs::read_to_string(root.path().join("cni-conf/10-rivet.conflist")).unwrap(),
                        )
                        .unwrap();
                        // The host's socket dir, where the daemons' containers put their sockets.
                        assert_eq!(conflist["plugins"][0]["socketDir"], "/var/run/rivet/sockets", "{dir}");
                        // rivet-cni exports to the jaeger Service (the runtime's environment has no OTLP).
                        assert_eq!(
                            conflist["plugins"][0]["tracing"]["otlpEndpoint"], "http://198.18.0.9:4317",
                            "{dir}"
                        );
                        let sockets = pod["volumes"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .find(|v| v["name"] == "sockets")
                            .unwrap();
                        assert_eq!(sockets["hostPath"]["path"], "/var/run/rivet/sockets", "{dir}");
                    }
                    "cleanup" => {
                        assert_eq!(
                            c["restartPolicy"], "Always",
                            "{dir}: a sidecar, stopped after the daemons"
                        );
                        run_cleanup_sidecar(dir, &line, &env, root.path());
                    }
                    other => panic!("{dir}: an init container nobody checks: {other}"),
                }
            }
        }
    }
}

/// The `cleanup` sidecar's command line over what `prepare` and
/// `install-cni` leave (moved into `root`): it waits, and on SIGTERM removes
/// the plugin, the conflist, the CNI log, dead sockets and lock files and
/// the empty dirs, and nothing else.
fn run_cleanup_sidecar(dir: &str, line: &[String], env: &BTreeMap<String, String>, root: &Path) {
    use std::io::BufRead as _;
    let leftovers = [
        "cni-bin/rivet-cni",
        "cni-conf/10-rivet.conflist",
        "run/rivet-cni.log",
        "run/sockets/svc-ipam.sock.lock",
    ];
    for file in leftovers {
        std::fs::create_dir_all(root.join(file).parent().unwrap()).unwrap();
        std::fs::write(root.join(file), "").unwrap();
    }
    std::fs::write(root.join("cni-bin/loopback"), "").unwrap();
    std::fs::create_dir_all(root.join("run/svc-ipam")).unwrap();
    std::fs::create_dir_all(root.join("bpffs/rivet/node-1")).unwrap();
    std::fs::write(root.join("run/svc-endpoint-state"), "").unwrap();
    let mut child = Command::new(workspace_binary(&line[0]))
        .args(&line[1..])
        .env_clear()
        .envs(env)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("running rivet node cleanup");
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.contains("waiting for SIGTERM"), "{dir}: {line:?}: {first:?}");
    assert!(
        root.join("cni-conf/10-rivet.conflist").exists(),
        "{dir}: nothing removed before the signal"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{dir}: {status}: {rest}");
    assert!(
        rest.contains("no pod and no daemon uses the node: removed"),
        "{dir}: {rest}"
    );
    for gone in leftovers.iter().chain(&["run/sockets", "run/svc-ipam", "bpffs/rivet"]) {
        assert!(!root.join(gone).exists(), "{dir}: {gone} removed: {rest}");
    }
    assert!(root.join("cni-bin/loopback").exists(), "{dir}: other plugins stay");
    assert!(
        root.join("run/svc-endpoint-state").exists(),
        "{dir}: daemons' files stay"
    );
}

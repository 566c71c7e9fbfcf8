//! `cargo xtask demo --cluster`: three nodes on one machine, using only the
//! real binaries and the `rivet` CLI as a user would type it.
//!
//! 1. `rivet cluster up --nodes 3 --routing <mode>`: one etcd, an underlay
//!    bridge, three node namespaces each running `rivet node up`;
//!    `rivet cluster status`, `rivet node list` as node 1 sees the cluster;
//! 2. a pod on each node (`rivet --node <node> pod add`): frontend, backend, db;
//! 3. cross-node traffic: frontend pings backend and db (IPv4 and IPv6) and
//!    says hello to backend over TCP; node 1's datapath (`rivet bpf
//!    ipcache`, `rivet bpf nodes`) holds the remote pods with their nodes;
//! 4. a cross-node policy: db denies everything (`rivet cluster policy
//!    apply`, on every node) — frontend's hello is dropped; then a policy
//!    allows frontend → db:5432 — it passes;
//! 5. `rivet health` of node 1: every peer's probes;
//! 6. node 3 leaves (`rivet cluster stop-node`): node 1 forgets it (node
//!    list, routes, ipcache);
//! 7. `rivet cluster down`: nothing is left.
//!
//! Nothing touches the machine's own interfaces: everything is in namespaces
//! the cluster creates, files in a temp dir (`$D`), addresses from
//! 198.18.0.0/15 and 2001:2::/48. Torn down at the end, on failure and on Ctrl-C.

use std::fs;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::demo::{Demo, TempDir, build_binaries, guarded, heading};

/// The cluster's name (a number is appended if its namespaces exist).
const NAME: &str = "demo";
/// The port db serves on.
const DB_PORT: u16 = 5432;
/// The port backend serves on.
const BACKEND_PORT: u16 = 8080;
/// How long the nodes may take to learn a pod or forget a node.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Denies everything to db, on every node.
const DENY: &str = "\
# Nothing may reach db (it runs on node 3; the policy is enforced there,
# on the sender's identity carried across nodes).
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-deny-all, namespace: default}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
";

/// Allows frontend (node 1) to db:5432.
const ALLOW: &str = "\
# frontend may reach db on TCP 5432.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-frontend, namespace: default}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: frontend}}}]
    ports: [{protocol: TCP, port: 5432}]
";

/// Builds the binaries and runs the cluster demo with `routing` (`native`
/// or `vxlan`).
pub fn run(routing: &str) -> Result<()> {
    let bin_dir = build_binaries()?;
    let tmp = TempDir::create("rivet-demo")?;
    let name = free_cluster_name();
    let demo = Demo::of_cluster(bin_dir.join("rivet"), tmp.path().to_path_buf(), &name);
    let logs = tmp.path().join("clusters").join(&name);
    let routing = routing.to_string();
    guarded(demo, tmp, &logs, move |demo| {
        ClusterDemo { demo, name: &name }.run(&routing)
    })
}

/// `demo`, or `demo2`, … when namespaces of that cluster exist.
fn free_cluster_name() -> String {
    (1..100)
        .map(|n| if n == 1 { NAME.to_string() } else { format!("{NAME}{n}") })
        .find(|name| !Path::new("/run/netns").join(format!("{name}-ul")).exists())
        .unwrap_or_else(|| format!("{NAME}{}", std::process::id()))
}

struct ClusterDemo<'a> {
    demo: &'a Demo,
    name: &'a str,
}

impl ClusterDemo<'_> {
    fn node(&self, i: usize) -> String {
        format!("{}-n{i}", self.name)
    }

    /// `rivet --node <node i> <args>`.
    fn on(&self, i: usize, args: &[&str]) -> std::process::Command {
        let node = self.node(i);
        let mut all = vec!["--node", node.as_str()];
        all.extend(args);
        self.demo.rivet(&all)
    }

    /// A pod's addresses (IPv4, IPv6) from `rivet --node .. pod list`.
    fn addresses(&self, node: usize, pod: &str) -> Result<(String, String)> {
        let node_name = self.node(node);
        let pods = self.demo.json(&["--node", &node_name, "pod", "list"])?;
        let addrs: Vec<String> = pods
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["name"] == pod)
            .flat_map(|p| p["addresses"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        let v4 = addrs.iter().find(|a| a.contains('.')).cloned();
        let v6 = addrs.iter().find(|a| a.contains(':')).cloned();
        v4.zip(v6)
            .with_context(|| format!("pod {pod} has no IPv4 and IPv6 address"))
    }

    /// Waits until node `i`'s datapath ipcache holds (or, `present`
    /// false, no longer holds) each of `addresses`.
    fn wait_ipcache(&self, i: usize, addresses: &[&str], present: bool) -> Result<()> {
        let node = self.node(i);
        let started = Instant::now();
        loop {
            let ipcache = self.demo.json(&["--node", &node, "bpf", "ipcache"])?;
            let held = |a: &str| {
                ipcache
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|e| e["prefix"].as_str().and_then(|p| p.split('/').next()) == Some(a))
            };
            if addresses.iter().all(|a| held(a) == present) {
                println!(
                    "(node {node}'s datapath {} {} within {:.1}s)",
                    if present { "holds" } else { "no longer holds" },
                    addresses.join(", "),
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if started.elapsed() > CONVERGE_TIMEOUT {
                bail!("node {node}'s ipcache did not converge on {addresses:?} within {CONVERGE_TIMEOUT:?}");
            }
            sleep(Duration::from_millis(100));
        }
    }

    /// `rivet cluster policy apply -f <file> --wait`: on every node.
    fn apply(&self, file: &Path) -> Result<()> {
        let file = file.display().to_string();
        let args = ["cluster", "policy", "--name", self.name, "apply", "-f", &file, "--wait"];
        self.demo.show(&mut self.demo.rivet(&args))?;
        Ok(())
    }

    /// `echo hello | nc -w 2 <to> <port>` from frontend; whether the hello came back.
    fn hello(&self, to: &str, port: u16) -> Result<bool> {
        let out = self.demo.show_allowing_failure(
            self.on(1, &["pod", "exec", "frontend", "--", "busybox", "nc", "-w", "2", to])
                .arg(port.to_string()),
            Some("hello\n"),
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).trim() == "hello")
    }

    fn run(&self, routing: &str) -> Result<()> {
        let d = self.demo.dir.display();
        heading(
            "1. Three nodes",
            &format!(
                "Everything lives in a temp dir, D={d}, and in network namespaces the cluster creates.\n\
                 `rivet cluster up` starts one etcd, an underlay namespace with a bridge, and three node\n\
                 namespaces, each with a veth on the bridge (198.19.254.i) and its own `rivet node up`\n\
                 (pods from 198.18.i.0/24 and 2001:2:0:i::/64). Routing: {routing}."
            ),
        );
        println!("$ export RIVET_STATE_DIR=$D");
        self.demo.show(&mut self.demo.rivet(&[
            "cluster",
            "up",
            "--name",
            self.name,
            "--nodes",
            "3",
            "--routing",
            routing,
        ]))?;
        self.demo.show(&mut self.on(1, &["node", "list"]))?;

        heading(
            "2. A pod on each node",
            "`--node` picks the node: each pod is wired by that node's own rivet-cni.",
        );
        for (i, pod) in [(1, "frontend"), (2, "backend"), (3, "db")] {
            let label = format!("app={pod}");
            self.demo
                .show(&mut self.on(i, &["pod", "add", pod, "--label", &label]))?;
        }
        let (backend4, backend6) = self.addresses(2, "backend")?;
        let (db4, db6) = self.addresses(3, "db")?;
        self.wait_ipcache(1, &[&backend4, &backend6, &db4, &db6], true)?;

        heading(
            "3. Traffic across nodes",
            "frontend (node 1) pings backend (node 2) and db (node 3) in both families, and says\n\
             hello to backend's TCP echo server. Node 1's datapath knows the remote pods, their\n\
             identities and the node each lives on, and the peers it routes to.",
        );
        let mut servers = Vec::new();
        for (i, pod, port) in [(2, "backend", BACKEND_PORT), (3, "db", DB_PORT)] {
            servers.push(self.demo.echo_server(&["--node", &self.node(i)], pod, port)?);
        }
        for to in [&backend4, &backend6, &db4, &db6] {
            self.demo.show(&mut self.on(
                1,
                &[
                    "pod", "exec", "frontend", "--", "ping", "-c", "2", "-i", "0.2", "-W", "2", to,
                ],
            ))?;
        }
        sleep(Duration::from_millis(500));
        if !self.hello(&backend4, BACKEND_PORT)? {
            bail!("backend did not echo frontend's hello across nodes");
        }
        self.demo.show(&mut self.on(1, &["bpf", "ipcache"]))?;
        self.demo.show(&mut self.on(1, &["bpf", "nodes"]))?;

        heading(
            "4. A policy across nodes: deny, then allow",
            "Policies live in each node's svc-endpoint without Kubernetes: `rivet cluster policy`\n\
             applies them on every node. db (node 3) judges frontend (node 1) by its identity.",
        );
        let deny = self.demo.dir.join("deny.yaml");
        let allow = self.demo.dir.join("allow.yaml");
        fs::write(&deny, DENY)?;
        fs::write(&allow, ALLOW)?;
        println!("$ cat $D/deny.yaml");
        print!("{DENY}");
        self.apply(&deny)?;
        if self.hello(&db4, DB_PORT)? {
            bail!("db answered frontend although the policy denies it");
        }
        println!("$ cat $D/allow.yaml");
        print!("{ALLOW}");
        self.apply(&allow)?;
        if !self.hello(&db4, DB_PORT)? {
            bail!("db did not answer frontend although a policy allows it");
        }
        drop(servers);

        heading(
            "5. Health between nodes",
            "Each node probes every other node (ICMP, HTTP) and its health endpoint through the\n\
             pod datapath.",
        );
        self.wait_health()?;
        self.demo.show(&mut self.on(1, &["health"]))?;

        heading(
            "6. Node 3 leaves",
            "`rivet cluster stop-node` stops it cleanly: it deletes its pods, removes its record\n\
             from etcd, and the other nodes drop its routes and ipcache entries at once.",
        );
        let node3 = self.node(3);
        self.demo
            .show(&mut self.demo.rivet(&["cluster", "stop-node", &node3, "--name", self.name]))?;
        self.wait_ipcache(1, &[&db4, &db6], false)?;
        self.demo.show(&mut self.on(1, &["node", "list"]))?;
        self.demo.show(&mut self.on(1, &["bpf", "nodes"]))?;
        self.demo
            .show(&mut self.demo.rivet(&["cluster", "status", "--name", self.name]))?;

        heading(
            "7. Teardown",
            "`rivet cluster down` stops every node and etcd and removes the namespaces and dirs.",
        );
        self.demo.show(&mut self.demo.teardown_command())?;
        let left: Vec<String> = ["ul", "n1", "n2", "n3"]
            .iter()
            .map(|s| format!("/run/netns/{}-{s}", self.name))
            .filter(|p| Path::new(p).exists())
            .collect();
        if !left.is_empty() {
            bail!("the cluster left {}", left.join(", "));
        }
        println!("(no namespace, pins, processes or files of the cluster left)");
        Ok(())
    }

    /// Waits until node 1's health shows every peer reachable (a probe
    /// round after the nodes met).
    fn wait_health(&self) -> Result<()> {
        let node = self.node(1);
        let started = Instant::now();
        loop {
            let health: Value = self.demo.json(&["--node", &node, "health"])?;
            if health["peers"] == 2 && health["peers_reachable"] == 2 {
                return Ok(());
            }
            if started.elapsed() > CONVERGE_TIMEOUT {
                bail!("node {node} did not see both peers healthy within {CONVERGE_TIMEOUT:?}: {health:#}");
            }
            sleep(Duration::from_millis(200));
        }
    }
}

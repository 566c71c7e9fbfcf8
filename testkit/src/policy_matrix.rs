//! The NetworkPolicy semantics users expect, as a table (issue 12 §2),
//! modelled on the upstream Kubernetes network-policy e2e suite
//! (`test/e2e/network/netpol`): three namespaces x, y, z with pods a, b, c
//! each, created through the real CNI plugin by `rivet pod add`; echo
//! servers in every pod on TCP and UDP ports 80 and 81 (IPv4 and IPv6);
//! then per case a few steps — `rivet policy apply --wait`, `rivet namespace
//! label`, `rivet endpoint label` — and after each the expected 9×9
//! reachability matrix, probed pod to pod in parallel and printed as a
//! matrix (expected and observed) on a mismatch.
//!
//! The table and its runner ([`Matrix`]) are the same whether the nine pods
//! live on one node (`cli/tests/policy_matrix.rs`) or are spread over the
//! nodes of a cluster (`e2e/tests/multinode_policy.rs`); what differs is
//! behind [`MatrixNodes`]: how many nodes, which one holds a pod, the `rivet`
//! command of a node and a daemon's kill -9. Policies and namespace labels
//! are per node without Kubernetes, so the runner applies them on every
//! node; a pod's own labels go to its node.
//!
//! - A pod reaching itself never leaves its namespace (no datapath sees
//!   it): the diagonal is not probed and shown as `-`.
//! - Every probe that is expected to be denied must also show up as a policy
//!   drop (`policy-denied` or `policy-default-deny`) of that flow in `rivet
//!   monitor` of some node (the source's for egress, the destination's for
//!   ingress), so "denied" is a drop by the datapath, not a timeout or a
//!   missing server.
//! - After `rivet policy apply|delete --wait` (on every node) the datapath
//!   must hold the policy: the first probe round must match. A namespace or
//!   pod relabel is realised asynchronously (the CLI queues
//!   re-identification; the endpoints whose policy selects the new
//!   identities learn them from the identity watch, other nodes from the
//!   kvstore's `ip/v1`), so after one the matrix must match within
//!   [`CONVERGE`] (probed again until then, as the upstream suite does).
//! - UDP probes use a source port no earlier probe of the run used, so no
//!   conntrack entry of an earlier allowed exchange can answer for them (TCP
//!   needs no such care: the client closes first and its TIME_WAIT keeps the
//!   kernel from reusing a 4-tuple).
//! - After each case every policy is deleted, relabelled namespaces and pods
//!   get their labels back, and every probe must pass again.
//!
//! `RIVET_MATRIX_CASE=<part of a case name>` runs only those cases.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, TcpServerGuard, UdpServerGuard};

use crate::monitor::{DropEvent, DropMonitor};

/// The matrix's namespaces.
pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
/// The pods of each namespace.
pub const POD_NAMES: [&str; 3] = ["a", "b", "c"];
/// Pods in matrix order: x/a, x/b, x/c, y/a, … z/c.
pub const N: usize = NAMESPACES.len() * POD_NAMES.len();

/// Connect timeout of a probe expected to be denied (it runs out).
const DENIED_TIMEOUT: Duration = Duration::from_secs(1);
/// Connect timeout of a probe expected to pass (a local veth answers in
/// milliseconds; this only bounds a loaded machine).
const ALLOWED_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the matrix may take to match after a relabel.
pub const CONVERGE: Duration = Duration::from_secs(15);
/// How long `rivet monitor` may take to show the drops of a probe round.
const DROP_EVENTS_WITHIN: Duration = Duration::from_secs(10);
/// UDP probe source ports: below the ephemeral range (32768-60999), so a
/// chosen port never collides with one the kernel picked.
const UDP_SOURCE_PORTS: std::ops::Range<u16> = 10_000..32_000;

/// Where the nine pods live and how to reach the node(s) holding them: the
/// one part of the table's run that differs between one node and a cluster.
pub trait MatrixNodes: Sync {
    /// How many nodes there are (numbered `0..nodes()`).
    fn nodes(&self) -> usize;
    /// The node that holds pod `index` (matrix order, see [`N`]).
    fn node_of(&self, index: usize) -> usize;
    /// `rivet <args>` against node `node` (its state and socket dirs).
    fn rivet(&self, node: usize, args: &[&str]) -> Command;
    /// `kill -9` of daemon `name` of node `node`; returns once its
    /// supervisor runs it again.
    fn kill9_and_wait_for_restart(&self, node: usize, name: &str);
    /// Returns once every node knows the pods just added (`(node,
    /// addresses)`): on a cluster, once the other nodes' datapaths hold
    /// them (ipcache, tunnel endpoint). One node has nothing to wait for.
    fn wait_for_pods(&self, pods: &[(usize, [IpAddr; 2])]) {
        let _ = pods;
    }
}

/// Runs `rivet <args>` on `node`; its stdout, or a panic with its output.
fn rivet_ok(nodes: &dyn MatrixNodes, node: usize, args: &[&str]) -> String {
    let out = nodes.rivet(node, args).output().expect("running rivet");
    assert!(
        out.status.success(),
        "rivet {} on node {node} failed ({}): {}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rivet <args> -o json` on `node`, parsed.
fn rivet_json(nodes: &dyn MatrixNodes, node: usize, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&rivet_ok(nodes, node, &all)).expect("rivet -o json prints JSON")
}

/// Polls `f` every 100 ms until it is `Ok`; panics after `timeout` with
/// the last `Err` (what is still missing).
fn eventually_ok(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<(), String>) {
    let started = Instant::now();
    loop {
        let missing = match f() {
            Ok(()) => return,
            Err(missing) => missing,
        };
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}{}{missing}",
            if missing.is_empty() { "" } else { "; still missing:\n  " }
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A probe's transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// A TCP connect.
    Tcp,
    /// A UDP echo.
    Udp,
}

/// A probe's address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// To the pod's IPv4 address.
    V4,
    /// To the pod's IPv6 address.
    V6,
}

/// What a probe connects to: protocol, port and address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Port {
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The server's port.
    pub number: u16,
    /// IPv4 or IPv6.
    pub family: Family,
}

const fn port(protocol: Protocol, number: u16, family: Family) -> Port {
    Port {
        protocol,
        number,
        family,
    }
}

/// TCP port 80, IPv4.
pub const TCP80: Port = port(Protocol::Tcp, 80, Family::V4);
/// TCP port 81, IPv4.
pub const TCP81: Port = port(Protocol::Tcp, 81, Family::V4);
/// UDP port 80, IPv4.
pub const UDP80: Port = port(Protocol::Udp, 80, Family::V4);
/// UDP port 81, IPv4.
pub const UDP81: Port = port(Protocol::Udp, 81, Family::V4);
/// TCP port 80, IPv6.
pub const TCP80_V6: Port = port(Protocol::Tcp, 80, Family::V6);
/// TCP port 81, IPv6.
pub const TCP81_V6: Port = port(Protocol::Tcp, 81, Family::V6);
/// UDP port 81, IPv6.
pub const UDP81_V6: Port = port(Protocol::Udp, 81, Family::V6);
/// Every port the servers listen on, IPv4.
pub const ALL_V4: &[Port] = &[TCP80, TCP81, UDP80, UDP81];

impl fmt::Display for Port {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let protocol = match self.protocol {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        };
        let family = match self.family {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        };
        write!(f, "{protocol}/{} {family}", self.number)
    }
}

/// The expected matrix of one or more ports: every probe starts as `base`,
/// then each `(from, to, allowed)` in order sets the probes between the pods
/// its patterns match (`ns/pod`, `*` for any namespace or pod).
pub struct Expect {
    /// The ports probed, each against the same matrix.
    pub ports: &'static [Port],
    /// Every probe's verdict before `cells`.
    pub base: bool,
    /// `(from, to, allowed)` patterns, applied in order.
    pub cells: &'static [(&'static str, &'static str, bool)],
}

/// One step of a case.
pub enum Step {
    /// `rivet policy apply --wait` of these documents (on every node);
    /// `{x/b}` stands for x/b's IPv4 address and `{x/b:6}` for its IPv6
    /// address.
    Apply(&'static str),
    /// `rivet namespace label <namespace> <labels>` (replaces them; on every
    /// node).
    LabelNamespace(&'static str, &'static [&'static str]),
    /// `rivet endpoint label <namespace/pod> <labels>` (replaces them; on
    /// the pod's node).
    LabelPod(&'static str, &'static [&'static str]),
    /// Probe the matrix.
    Expect(Expect),
    /// Probe only the pairs to the pods the pattern matches, at once (no
    /// waiting for a relabel to converge): what must hold from the start.
    ExpectNowTo(&'static str, Expect),
    /// `rivet pod del` and `rivet pod add` of a pod: a new endpoint with the
    /// base labels (none remembered from before), maybe a new address.
    Recreate(&'static str),
    /// Another assertion about the node(s).
    Check(fn(&Matrix<'_>)),
    /// `kill -9` of a daemon on every node in turn; returns once each
    /// supervisor restarted it and svc-endpoint lists every pod's endpoint
    /// ready again.
    Kill9(&'static str),
    /// The steps again, this many times.
    Repeat(usize, &'static [Step]),
}

/// A row of the table: a name and its steps (policies, relabels, matrices).
pub struct Case {
    /// What the case shows (`RIVET_MATRIX_CASE` matches part of it).
    pub name: &'static str,
    /// Its steps, in order.
    pub steps: &'static [Step],
}

/// A pod's expected reachability: `allowed[from][to]`.
#[derive(Clone, PartialEq, Eq)]
struct Reachability {
    allowed: [[bool; N]; N],
}

/// `ns/pod` of pod `index`.
pub fn pod_key(index: usize) -> String {
    format!("{}/{}", NAMESPACES[index / 3], POD_NAMES[index % 3])
}

/// Whether `ns/pod` pattern `pattern` (each part a name or `*`) matches pod `index`.
fn matches(pattern: &str, index: usize) -> bool {
    let (ns, pod) = pattern
        .split_once('/')
        .unwrap_or_else(|| panic!("pattern {pattern:?} is not ns/pod"));
    (ns == "*" || ns == NAMESPACES[index / 3]) && (pod == "*" || pod == POD_NAMES[index % 3])
}
impl Reachability {
    fn expected(expect: &Expect) -> Self {
        let mut allowed = [[expect.base; N]; N];
        for (from, to, verdict) in expect.cells {
            let mut hit = false;
            for (i, row) in allowed.iter_mut().enumerate() {
                for (j, cell) in row.iter_mut().enumerate() {
                    if matches(from, i) && matches(to, j) {
                        *cell = *verdict;
                        hit = true;
                    }
                }
            }
            assert!(hit, "({from}, {to}) matches no pod pair");
        }
        // A pod reaching itself never leaves its namespace: always allowed.
        for (i, row) in allowed.iter_mut().enumerate() {
            row[i] = true;
        }
        Self { allowed }
    }

    /// Probes that differ from `other` (never the diagonal).
    fn differences(&self, other: &Self) -> Vec<(usize, usize)> {
        pairs()
            .filter(|&(i, j)| self.allowed[i][j] != other.allowed[i][j])
            .collect()
    }

    /// The upstream suite's rendering: a row per client, a column per
    /// server, `.` allowed, `X` denied, `-` itself; `*` marks a cell that
    /// differs from `other`.
    fn render(&self, other: Option<&Self>) -> String {
        let mut out = String::from("      ");
        for j in 0..N {
            out.push_str(&format!("{:<5}", pod_key(j)));
        }
        out.push('\n');
        for i in 0..N {
            out.push_str(&format!("{:<6}", pod_key(i)));
            for j in 0..N {
                let mark = if i == j {
                    "-"
                } else if self.allowed[i][j] {
                    "."
                } else {
                    "X"
                };
                let differs = other.is_some_and(|o| i != j && o.allowed[i][j] != self.allowed[i][j]);
                out.push_str(&format!("{mark}{:<4}", if differs { "*" } else { "" }));
            }
            out.push('\n');
        }
        out
    }
}

/// Every probed pair: all but a pod to itself.
fn pairs() -> impl Iterator<Item = (usize, usize)> {
    (0..N).flat_map(|i| (0..N).map(move |j| (i, j))).filter(|(i, j)| i != j)
}

/// A pod of the matrix: its namespace (not ours: `rivet pod add` made it)
/// and addresses.
struct Pod {
    key: String,
    /// The node that holds it.
    node: usize,
    /// TCP and UDP echo servers on ports 80 and 81, both families.
    servers: (Vec<TcpServerGuard>, Vec<UdpServerGuard>),
    ns: NetNs,
    ipv4: Ipv4Addr,
    ipv6: Ipv6Addr,
    /// The next UDP source port this pod probes from.
    next_udp_port: AtomicU16,
}

impl Pod {
    /// `rivet pod add` on `node` with the base labels and the named ports,
    /// then the pod as `rivet pod list` shows it, with its servers started.
    fn add(nodes: &dyn MatrixNodes, node: usize, ns: &str, name: &str, next_udp_port: u16) -> Self {
        let mut args = vec!["pod", "add", name, "-n", ns];
        let labels = pod_base_labels(name);
        for label in &labels {
            args.extend(["--label", label]);
        }
        for port in named_ports(ns, name) {
            args.extend(["--port", port]);
        }
        rivet_ok(nodes, node, &args);
        let listed = rivet_json(nodes, node, &["pod", "list"]);
        let row = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["namespace"] == ns && p["name"] == name)
            .unwrap_or_else(|| panic!("pod {ns}/{name} is listed: {listed:#}"));
        assert_eq!(row["state"], "ready", "{row}");
        let endpoint = rivet_json(nodes, node, &["endpoint", "get", &format!("{ns}/{name}")]);
        assert_eq!(
            endpoint["named_ports"].as_array().map(Vec::len),
            Some(named_ports(ns, name).len()),
            "the pod's named ports reached its endpoint: {endpoint:#}"
        );
        let addresses: Vec<IpAddr> = row["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().parse().unwrap())
            .collect();
        let ipv4 = addresses.iter().find_map(|a| match a {
            IpAddr::V4(a) => Some(*a),
            IpAddr::V6(_) => None,
        });
        let ipv6 = addresses.iter().find_map(|a| match a {
            IpAddr::V6(a) => Some(*a),
            IpAddr::V4(_) => None,
        });
        let ipv4 = ipv4.unwrap_or_else(|| panic!("{ns}/{name} has an IPv4 address: {row}"));
        let ipv6 = ipv6.unwrap_or_else(|| panic!("{ns}/{name} has an IPv6 address: {row}"));
        let netns = NetNs::existing(row["netns"].as_str().unwrap()).expect("the pod's namespace");
        let mut servers = (Vec::new(), Vec::new());
        for number in [80, 81] {
            let addrs = [
                SocketAddr::new(ipv4.into(), number),
                SocketAddr::new(ipv6.into(), number),
            ];
            servers
                .0
                .push(netns.tcp_echo_server(&addrs).expect("a TCP server in the pod"));
            servers
                .1
                .push(netns.udp_echo_server(&addrs).expect("a UDP server in the pod"));
        }
        Self {
            key: format!("{ns}/{name}"),
            node,
            servers,
            ns: netns,
            ipv4,
            ipv6,
            next_udp_port: AtomicU16::new(next_udp_port),
        }
    }

    /// Its node and addresses.
    fn placement(&self) -> (usize, [IpAddr; 2]) {
        (self.node, [self.ipv4.into(), self.ipv6.into()])
    }

    fn addr(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => self.ipv4.into(),
            Family::V6 => self.ipv6.into(),
        }
    }

    /// Whether a connection (TCP) or an echo (UDP) to `to` on `port` succeeds.
    fn probe(&self, to: &Pod, port: Port, timeout: Duration) -> bool {
        let dst = SocketAddr::new(to.addr(port.family), port.number);
        let result = match port.protocol {
            Protocol::Tcp => self.ns.tcp_connect(dst, timeout),
            Protocol::Udp => {
                let source = self.next_udp_port.fetch_add(1, Ordering::Relaxed);
                assert!(
                    UDP_SOURCE_PORTS.contains(&source),
                    "{} ran out of UDP source ports",
                    self.key
                );
                let local = match port.family {
                    Family::V4 => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), source),
                    Family::V6 => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), source),
                };
                self.ns.udp_echo_from(local, dst, timeout)
            }
        };
        result.unwrap_or_else(|e| panic!("probing {} -> {} {port}: {e}", self.key, to.key))
    }
}

/// `rivet monitor -o json` for the whole run (started again after
/// svc-loader restarts, which ends its stream); its drops in order.
struct Monitor {
    drops: Arc<Mutex<Vec<DropEvent>>>,
    /// One per node.
    processes: Vec<Mutex<DropMonitor>>,
}

impl Monitor {
    /// `rivet monitor` on every node, into one list of drops.
    fn start(nodes: &dyn MatrixNodes) -> Self {
        let drops = Arc::new(Mutex::new(Vec::new()));
        let processes = (0..nodes.nodes())
            .map(|node| {
                Mutex::new(DropMonitor::start(
                    nodes.rivet(node, &["monitor", "-o", "json"]),
                    &drops,
                ))
            })
            .collect();
        Self { drops, processes }
    }

    /// A new subscription on `node`, to the svc-loader that runs there now.
    fn restart(&self, nodes: &dyn MatrixNodes, node: usize) {
        let mut process = self.processes[node].lock().unwrap();
        // The old one first: its drops are in before the new one's.
        drop(std::mem::replace(
            &mut *process,
            DropMonitor::start(nodes.rivet(node, &["monitor", "-o", "json"]), &self.drops),
        ));
    }

    /// How many drops were seen so far: the start of a probe round's.
    fn mark(&self) -> usize {
        self.drops.lock().unwrap().len()
    }

    /// Drops seen since `mark`.
    fn since(&self, mark: usize) -> Vec<DropEvent> {
        self.drops.lock().unwrap()[mark..].to_vec()
    }
}

/// The table's run: the nodes, the nine pods (with their servers) and a
/// monitor per node. Dropping it deletes nothing of the nodes' (their pods
/// go with them), only the servers and monitors.
pub struct Matrix<'n> {
    // Dropped in this order: monitor and servers before the nodes go.
    monitor: Monitor,
    /// In matrix order; a pod deleted and added again is replaced.
    pods: RwLock<Vec<Pod>>,
    nodes: &'n dyn MatrixNodes,
    /// Where the policy documents are written for `rivet policy apply -f`.
    scratch: tempfile::TempDir,
}

/// The named ports every pod declares (`rivet pod add --port`): the
/// upstream suite's `serve-<port>-<protocol>`, and `web`, which is port 80
/// everywhere but on z/c, where it is 81.
fn named_ports(namespace: &str, pod: &str) -> [&'static str; 5] {
    let web = if (namespace, pod) == ("z", "c") {
        "web=TCP/81"
    } else {
        "web=TCP/80"
    };
    [
        "serve-80-tcp=TCP/80",
        "serve-81-tcp=TCP/81",
        "serve-80-udp=UDP/80",
        "serve-81-udp=UDP/81",
        web,
    ]
}

fn namespace_base_labels(namespace: &str) -> Vec<String> {
    vec![
        format!("ns={namespace}"),
        format!("kubernetes.io/metadata.name={namespace}"),
    ]
}

fn pod_base_labels(name: &str) -> Vec<String> {
    vec![format!("pod={name}")]
}

/// The identity labels svc-endpoint derives from the base labels.
fn base_identity_labels(index: usize) -> Vec<String> {
    let (ns, pod) = (NAMESPACES[index / 3], POD_NAMES[index % 3]);
    let mut labels = vec![
        format!("k8s:io.kubernetes.pod.namespace={ns}"),
        format!("k8s:ns.labels/kubernetes.io/metadata.name={ns}"),
        format!("k8s:ns.labels/ns={ns}"),
        format!("k8s:pod={pod}"),
    ];
    labels.sort();
    labels
}

impl<'n> Matrix<'n> {
    /// The namespaces labelled and the nine pods added (with their servers)
    /// on the nodes `nodes` puts them on, and a monitor on every node.
    pub fn up(nodes: &'n dyn MatrixNodes) -> Self {
        for ns in NAMESPACES {
            let mut args = vec!["namespace", "label", ns];
            let labels = namespace_base_labels(ns);
            args.extend(labels.iter().map(String::as_str));
            for node in 0..nodes.nodes() {
                rivet_ok(nodes, node, &args);
            }
        }
        let pods = (0..N)
            .map(|index| {
                Pod::add(
                    nodes,
                    nodes.node_of(index),
                    NAMESPACES[index / 3],
                    POD_NAMES[index % 3],
                    UDP_SOURCE_PORTS.start,
                )
            })
            .collect::<Vec<Pod>>();
        nodes.wait_for_pods(&pods.iter().map(Pod::placement).collect::<Vec<_>>());
        let monitor = Monitor::start(nodes);
        Self {
            monitor,
            pods: RwLock::new(pods),
            nodes,
            scratch: tempfile::tempdir().expect("a temp dir for policy documents"),
        }
    }

    /// The starting point (no policy, every probe passes), then every case
    /// of [`CASES`] whose name contains `RIVET_MATRIX_CASE` (all without
    /// it), one after another; each leaves the nodes as it found them.
    pub fn run_table(&self) {
        self.expect(
            "no policy",
            &Expect {
                ports: &[TCP80, TCP81, UDP80, UDP81, TCP80_V6, UDP81_V6],
                base: true,
                cells: &[],
            },
            false,
            "*/*",
        );
        let only = std::env::var("RIVET_MATRIX_CASE").unwrap_or_default();
        for case in CASES.iter().filter(|c| c.name.contains(&only)) {
            self.run(case);
        }
    }

    fn pods(&self) -> std::sync::RwLockReadGuard<'_, Vec<Pod>> {
        self.pods.read().unwrap()
    }

    /// `rivet <args> -o json` on the node of pod `key`.
    pub fn json_on_node_of(&self, key: &str, args: &[&str]) -> serde_json::Value {
        let node = self.pods()[self.index(key)].node;
        rivet_json(self.nodes, node, args)
    }

    /// `rivet <args> -o json` on every node.
    pub fn json_on_every_node(&self, args: &[&str]) -> Vec<serde_json::Value> {
        (0..self.nodes.nodes())
            .map(|node| rivet_json(self.nodes, node, args))
            .collect()
    }

    /// `rivet <args>` on every node.
    fn on_every_node(&self, args: &[&str]) {
        for node in 0..self.nodes.nodes() {
            rivet_ok(self.nodes, node, args);
        }
    }

    /// `rivet pod del`, then `rivet pod add` of the same pod on the same
    /// node (a new endpoint, maybe a new address) with its base labels and
    /// servers.
    fn recreate(&self, key: &str) {
        let index = self.index(key);
        let mut pods = self.pods.write().unwrap();
        let (ns, name) = (NAMESPACES[index / 3], POD_NAMES[index % 3]);
        let node = pods[index].node;
        let next_udp_port = pods[index].next_udp_port.load(Ordering::Relaxed);
        // Its servers go with it.
        pods[index].servers = Default::default();
        rivet_ok(self.nodes, node, &["pod", "del", name, "-n", ns]);
        pods[index] = Pod::add(self.nodes, node, ns, name, next_udp_port);
        self.nodes.wait_for_pods(&[pods[index].placement()]);
    }

    fn index(&self, key: &str) -> usize {
        self.pods()
            .iter()
            .position(|p| p.key == key)
            .unwrap_or_else(|| panic!("no pod {key}"))
    }

    /// `{x/b}` and `{x/b:6}` replaced by the pod's addresses.
    fn fill_in(&self, text: &str) -> String {
        let mut text = text.to_string();
        for pod in self.pods().iter() {
            text = text
                .replace(&format!("{{{}:6}}", pod.key), &pod.ipv6.to_string())
                .replace(&format!("{{{}}}", pod.key), &pod.ipv4.to_string());
        }
        assert!(
            !NAMESPACES.iter().any(|ns| text.contains(&format!("{{{ns}/"))),
            "an unknown placeholder in {text}"
        );
        text
    }

    /// `rivet policy apply --wait` on every node.
    fn apply(&self, documents: &str) {
        let path = self.scratch.path().join("policy.yaml");
        std::fs::write(&path, self.fill_in(documents)).unwrap();
        let args = ["policy", "apply", "--wait", "-f", path.to_str().unwrap()];
        for applied in self.json_on_every_node(&args) {
            assert!(applied["failed"].is_null(), "{applied:#}");
        }
    }

    /// One round: every pair (to a pod `to` matches) on every port, in
    /// parallel; a pair not probed is as expected.
    fn probe(&self, ports: &[Port], expected: &Reachability, to: &str) -> Vec<Reachability> {
        let pods = &*self.pods();
        let results: Vec<(usize, usize, usize, bool)> = std::thread::scope(|scope| {
            let probes: Vec<_> = ports
                .iter()
                .enumerate()
                .flat_map(|(k, port)| pairs().map(move |(i, j)| (k, *port, i, j)))
                .filter(|&(_, _, _, j)| matches(to, j))
                .map(|(k, port, i, j)| {
                    let timeout = if expected.allowed[i][j] {
                        ALLOWED_TIMEOUT
                    } else {
                        DENIED_TIMEOUT
                    };
                    scope.spawn(move || (k, i, j, pods[i].probe(&pods[j], port, timeout)))
                })
                .collect();
            probes.into_iter().map(|p| p.join().unwrap()).collect()
        });
        let mut observed = vec![expected.clone(); ports.len()];
        for (k, i, j, reached) in results {
            observed[k].allowed[i][j] = reached;
        }
        observed
    }

    /// Probes until the matrix of every port is `expect`'s (once, or within
    /// [`CONVERGE`] when `converge`), then checks that every denied probe
    /// was a policy drop. Only the probes to pods `to` matches (`*/*`: all).
    fn expect(&self, case: &str, expect: &Expect, converge: bool, to: &str) {
        let expected = Reachability::expected(expect);
        let deadline = Instant::now() + CONVERGE;
        let mut rounds = 0;
        loop {
            rounds += 1;
            let mark = self.monitor.mark();
            let observed = self.probe(expect.ports, &expected, to);
            let wrong: Vec<(Port, &Reachability)> = expect
                .ports
                .iter()
                .zip(&observed)
                .filter(|(_, o)| **o != expected)
                .map(|(p, o)| (*p, o))
                .collect();
            if wrong.is_empty() {
                self.check_drops(case, mark, expect.ports, &expected, to);
                return;
            }
            if !converge || Instant::now() >= deadline {
                let mut report = format!(
                    "case {case:?}: the reachability matrix is wrong after {rounds} probe round(s){}{}\n\
                     expected (`.` allowed, `X` denied, `-` itself):\n{}",
                    if converge {
                        format!(" ({CONVERGE:?} after the change)")
                    } else {
                        String::new()
                    },
                    if to == "*/*" {
                        String::new()
                    } else {
                        format!(" (probes to {to} only)")
                    },
                    expected.render(None)
                );
                for (port, observed) in wrong {
                    report.push_str(&format!(
                        "observed on {port} (`*` differs):\n{}",
                        observed.render(Some(&expected))
                    ));
                    for (i, j) in expected.differences(observed) {
                        report.push_str(&format!(
                            "  {} -> {} {port}: expected {}, observed {}\n",
                            pod_key(i),
                            pod_key(j),
                            verdict(expected.allowed[i][j]),
                            verdict(observed.allowed[i][j])
                        ));
                    }
                }
                panic!("{report}");
            }
        }
    }

    /// Every probe of the round starting at `mark` that was denied shows
    /// up in `rivet monitor` as a policy drop of its flow.
    fn check_drops(&self, case: &str, mark: usize, ports: &[Port], expected: &Reachability, to: &str) {
        let wanted: Vec<(Port, usize, usize)> = ports
            .iter()
            .flat_map(|port| pairs().map(move |(i, j)| (*port, i, j)))
            .filter(|&(_, i, j)| !expected.allowed[i][j] && matches(to, j))
            .collect();
        let pods = self.pods();
        let is_drop_of = |event: &DropEvent, &(port, i, j): &(Port, usize, usize)| {
            let protocol = match port.protocol {
                Protocol::Tcp => "tcp",
                Protocol::Udp => "udp",
            };
            event.protocol == protocol
                && event.source == pods[i].addr(port.family)
                && event.destination == SocketAddr::new(pods[j].addr(port.family), port.number)
        };
        let what = format!("case {case:?}: a policy drop in `rivet monitor` for every denied probe");
        eventually_ok(&what, DROP_EVENTS_WITHIN, || {
            let drops = self.monitor.since(mark);
            let missing: Vec<String> = wanted
                .iter()
                .filter(|probe| !drops.iter().any(|d| is_drop_of(d, probe) && d.is_policy_drop()))
                .map(|&(port, i, j)| {
                    let other: Vec<&str> = drops
                        .iter()
                        .filter(|d| is_drop_of(d, &(port, i, j)))
                        .map(|d| d.reason.as_str())
                        .collect();
                    format!("{} -> {} {port} (other drops of it: {other:?})", pod_key(i), pod_key(j))
                })
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(missing.join("\n  "))
            }
        });
    }

    fn run(&self, case: &Case) {
        let started = Instant::now();
        let mut relabelled = Relabelled::default();
        self.run_steps(case.name, case.steps, &mut relabelled, &mut false);
        self.reset(case.name, &relabelled);
        eprintln!("case {:?} passed in {:.1?}", case.name, started.elapsed());
    }

    /// `changed_labels`: whether a relabel happened since the last probe round.
    /// `changed_labels`: whether a relabel happened since the last probe round.
    fn run_steps(&self, case: &str, steps: &[Step], relabelled: &mut Relabelled, changed_labels: &mut bool) {
        for step in steps {
            match step {
                Step::Apply(documents) => self.apply(documents),
                Step::LabelNamespace(namespace, labels) => {
                    let mut args = vec!["namespace", "label", namespace];
                    args.extend(labels.iter());
                    self.on_every_node(&args);
                    relabelled.namespaces.insert(namespace);
                    *changed_labels = true;
                }
                Step::LabelPod(pod, labels) => {
                    let node = self.pods()[self.index(pod)].node;
                    let mut args = vec!["endpoint", "label", pod];
                    args.extend(labels.iter());
                    rivet_ok(self.nodes, node, &args);
                    relabelled.pods.insert(pod);
                    *changed_labels = true;
                }
                Step::Expect(expect) => {
                    self.expect(case, expect, *changed_labels, "*/*");
                    *changed_labels = false;
                }
                Step::ExpectNowTo(to, expect) => self.expect(case, expect, false, to),
                Step::Recreate(pod) => {
                    self.recreate(pod);
                    relabelled.pods.insert(pod);
                    *changed_labels = true;
                }
                Step::Check(check) => check(self),
                Step::Kill9(daemon) => {
                    for node in 0..self.nodes.nodes() {
                        self.nodes.kill9_and_wait_for_restart(node, daemon);
                        if *daemon == "svc-loader" {
                            self.monitor.restart(self.nodes, node);
                        }
                        self.wait_for_endpoints(
                            &format!("{daemon} of node {node} restarted in case {case:?}"),
                            |_, e| e["state"] == "ready",
                        );
                    }
                    // What the restarted daemon restores, it realises on its own time.
                    *changed_labels = true;
                }
                Step::Repeat(times, steps) => {
                    for _ in 0..*times {
                        self.run_steps(case, steps, relabelled, changed_labels);
                    }
                }
            }
        }
    }

    /// Waits until svc-endpoint of every node has restored its endpoints
    /// and the endpoint of every pod (by index) is as `ready` says.
    fn wait_for_endpoints(&self, what: &str, ready: impl Fn(usize, &serde_json::Value) -> bool) {
        let node_of: Vec<usize> = self.pods().iter().map(|p| p.node).collect();
        eventually_ok(what, CONVERGE, || {
            let mut listed = Vec::new();
            for node in 0..self.nodes.nodes() {
                let Ok(out) = self.nodes.rivet(node, &["endpoint", "list", "-o", "json"]).output() else {
                    return Err(format!("rivet endpoint list on node {node} did not run"));
                };
                let Ok(endpoints) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
                    return Err(format!("svc-endpoint of node {node} is not answering yet"));
                };
                if endpoints["restore_complete"] != true {
                    return Err(format!("svc-endpoint of node {node} is restoring"));
                }
                listed.push(endpoints);
            }
            let missing: Vec<String> = (0..N)
                .filter(|&index| {
                    let (ns, name) = (NAMESPACES[index / 3], POD_NAMES[index % 3]);
                    !listed[node_of[index]]["endpoints"].as_array().is_some_and(|all| {
                        all.iter()
                            .any(|e| e["pod_namespace"] == ns && e["pod_name"] == name && ready(index, e))
                    })
                })
                .map(pod_key)
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(missing.join(", "))
            }
        });
    }

    /// Back to the start: no policy, the base labels, every probe passing.
    fn reset(&self, case: &str, relabelled: &Relabelled) {
        for node in 0..self.nodes.nodes() {
            let policies = rivet_json(self.nodes, node, &["policy", "list"]);
            for policy in policies["policies"].as_array().unwrap() {
                let key = &policy["key"];
                let key = format!(
                    "{}/{}/{}",
                    key["kind"].as_str().unwrap(),
                    key["namespace"].as_str().unwrap(),
                    key["name"].as_str().unwrap()
                );
                rivet_ok(self.nodes, node, &["policy", "delete", "--wait", &key]);
            }
        }
        for namespace in &relabelled.namespaces {
            let labels = namespace_base_labels(namespace);
            let mut args = vec!["namespace", "label", namespace];
            args.extend(labels.iter().map(String::as_str));
            self.on_every_node(&args);
        }
        for pod in &relabelled.pods {
            let node = self.pods()[self.index(pod)].node;
            let labels = pod_base_labels(&pod[pod.find('/').unwrap() + 1..]);
            let mut args = vec!["endpoint", "label", pod];
            args.extend(labels.iter().map(String::as_str));
            rivet_ok(self.nodes, node, &args);
        }
        self.wait_for_endpoints(
            &format!("every endpoint back to its base identity labels after case {case:?}"),
            |index, e| e["state"] == "ready" && e["identity_labels"] == serde_json::json!(base_identity_labels(index)),
        );
        self.expect(
            &format!("{case} (after its reset)"),
            &Expect {
                ports: ALL_V4,
                base: true,
                cells: &[],
            },
            !relabelled.namespaces.is_empty() || !relabelled.pods.is_empty(),
            "*/*",
        );
    }
}

/// What a case relabelled (the reset puts the base labels back).
#[derive(Default)]
struct Relabelled {
    namespaces: BTreeSet<&'static str>,
    pods: BTreeSet<&'static str>,
}

fn verdict(allowed: bool) -> &'static str {
    if allowed { "allowed" } else { "denied" }
}

// ---------------------------------------------------------------------------
// Checks beside the matrix.

/// `rivet policy get` of an Ingress-only policy shows egress unrestricted
/// (on every node), and the endpoints it selects enforce ingress only.
fn ingress_only_policy_leaves_egress_unrestricted(matrix: &Matrix<'_>) {
    for got in matrix.json_on_every_node(&["policy", "get", "x/deny-ingress"]) {
        assert_eq!(
            got["normalized"]["spec"]["enableDefaultDeny"],
            serde_json::json!({"ingress": true, "egress": false}),
            "{got:#}"
        );
    }
    let endpoint = matrix.json_on_node_of("x/a", &["endpoint", "get", "x/a"]);
    assert_eq!(
        (&endpoint["ingress_enforced"], &endpoint["egress_enforced"]),
        (&serde_json::json!(true), &serde_json::json!(false)),
        "{endpoint:#}"
    );
}

/// x/c relabelled `pod=b` has x/b's identity: an ipBlock must still tell
/// their addresses apart.
fn x_b_and_x_c_share_an_identity(matrix: &Matrix<'_>) {
    let identity = |pod: &str| matrix.json_on_node_of(pod, &["endpoint", "get", pod])["identity"].clone();
    let (b, c) = (identity("x/b"), identity("x/c"));
    assert!(b.as_u64().is_some_and(|id| id >= 256), "{b}");
    assert_eq!(b, c, "x/b and x/c (both pod=b in x) share one identity");
}

// ---------------------------------------------------------------------------
// The table.

const DENY_INGRESS_X: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-ingress, namespace: x}
spec: {podSelector: {}, policyTypes: [Ingress]}
";

/// Every pod of x is unreachable from every other pod (x's own included).
const X_ISOLATED: &[(&str, &str, bool)] = &[("*/*", "x/*", false)];

/// The table: every case, in the order they run.
pub const CASES: &[Case] = &[
    Case {
        name: "default deny ingress in x",
        steps: &[
            Step::Apply(DENY_INGRESS_X),
            Step::Expect(Expect {
                ports: &[TCP80, TCP81, UDP80, UDP81, TCP80_V6, UDP81_V6],
                base: true,
                cells: X_ISOLATED,
            }),
            Step::Check(ingress_only_policy_leaves_egress_unrestricted),
        ],
    },
    Case {
        name: "allow all ingress beside a default deny",
        steps: &[
            Step::Apply(DENY_INGRESS_X),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: X_ISOLATED,
            }),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-all, namespace: x}
spec:
  podSelector: {}
  ingress: [{}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[],
            }),
        ],
    },
    Case {
        name: "deny all egress in x (egress to nothing)",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-egress, namespace: x}
spec: {podSelector: {}, policyTypes: [Egress], egress: []}
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80, TCP80_V6],
                base: true,
                cells: &[("x/*", "*/*", false)],
            }),
        ],
    },
    Case {
        name: "policyTypes Egress only leaves ingress open",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-to-b, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{podSelector: {matchLabels: {pod: b}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("x/a", "*/*", false), ("x/a", "x/b", true)],
            }),
        ],
    },
    Case {
        name: "podSelector selects in the policy's namespace",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-b, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("x/b", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "namespaceSelector",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-y, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/*", "x/a", true)],
            }),
            // The same policy updated to another namespace: y loses what z gains.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-y, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: z}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("z/*", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "namespaceSelector and podSelector in one peer (AND)",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-y-b, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/b", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "namespaceSelector and podSelector as two peers (OR)",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-y-or-b, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {ns: y}}}, {podSelector: {matchLabels: {pod: b}}}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/*", "x/a", true), ("x/b", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "matchExpressions In and NotIn",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-yz-not-a, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from:
    - namespaceSelector: {matchExpressions: [{key: ns, operator: In, values: [y, z]}]}
      podSelector: {matchExpressions: [{key: pod, operator: NotIn, values: [a]}]}
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[
                    ("*/*", "x/a", false),
                    ("y/b", "x/a", true),
                    ("y/c", "x/a", true),
                    ("z/b", "x/a", true),
                    ("z/c", "x/a", true),
                ],
            }),
        ],
    },
    Case {
        name: "matchExpressions Exists and DoesNotExist",
        steps: &[
            Step::LabelPod("y/c", &["pod=c", "tier=db"]),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-tier, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from: [{namespaceSelector: {}, podSelector: {matchExpressions: [{key: tier, operator: Exists}]}}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/c", "x/a", true)],
            }),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-tier, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from: [{namespaceSelector: {}, podSelector: {matchExpressions: [{key: tier, operator: DoesNotExist}]}}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("y/c", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "numeric port",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-tcp-80, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: TCP, port: 80}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, TCP80_V6],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP81, UDP80, UDP81],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "port range with endPort",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-tcp-range, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: TCP, port: 80, endPort: 81}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, TCP81],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[UDP80, UDP81],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // The range's first port is its start: 80 is outside 81-90.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-tcp-range, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: TCP, port: 81, endPort: 90}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // ... and its last port is endPort: 81 is outside 70-80.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-tcp-range, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: TCP, port: 70, endPort: 80}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "protocol UDP is not TCP",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-udp-81, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: UDP, port: 81}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[UDP81, UDP81_V6],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP81, TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // SCTP is neither TCP nor UDP.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-udp-81, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: SCTP, port: 80}, {protocol: SCTP, port: 81}]}]
",
            ),
            Step::Expect(Expect {
                ports: ALL_V4,
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // A protocol without a port: every port of it.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-udp-81, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{protocol: UDP}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[UDP80, UDP81, UDP81_V6],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP80, TCP81],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "egress to a port",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-81, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{namespaceSelector: {}}], ports: [{protocol: TCP, port: 81}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("x/a", "*/*", false)],
            }),
        ],
    },
    Case {
        name: "ingress from podSelector {} allows the policy's namespace only",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-own-namespace, namespace: x}
spec:
  podSelector: {}
  ingress: [{from: [{podSelector: {}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("*/*", "x/*", false), ("x/*", "x/*", true)],
            }),
        ],
    },
    Case {
        name: "stacked policies on one pod are a union, per port",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-80-from-y, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}], ports: [{protocol: TCP, port: 80}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-81-from-z, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: z}}}], ports: [{protocol: TCP, port: 81}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/*", "x/a", true)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("*/*", "x/a", false), ("z/*", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "ingress and egress in one policy",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-both, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Ingress, Egress]
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]
  egress: [{to: [{namespaceSelector: {matchLabels: {ns: z}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80, TCP80_V6],
                base: true,
                cells: &[
                    ("*/*", "x/a", false),
                    ("y/*", "x/a", true),
                    ("x/a", "*/*", false),
                    ("x/a", "z/*", true),
                ],
            }),
        ],
    },
    Case {
        name: "the client's egress deny wins over the server's ingress allow",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-no-egress, namespace: x}
spec: {podSelector: {matchLabels: {pod: a}}, policyTypes: [Egress]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-x, namespace: y}
spec:
  podSelector: {matchLabels: {pod: b}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns: x}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("*/*", "y/b", false), ("x/*", "y/b", true), ("x/a", "*/*", false)],
            }),
        ],
    },
    Case {
        name: "egress ipBlock of one pod's addresses",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-to-yb, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{ipBlock: {cidr: '{y/b}/32'}}, {ipBlock: {cidr: '{y/b:6}/128'}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80, TCP80_V6, UDP81_V6],
                base: true,
                cells: &[("x/a", "*/*", false), ("x/a", "y/b", true)],
            }),
        ],
    },
    Case {
        name: "egress ipBlock except one pod: two pods of one identity on either side",
        steps: &[
            Step::LabelPod("x/c", &["pod=b"]),
            Step::Check(x_b_and_x_c_share_an_identity),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-but-xc, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{ipBlock: {cidr: 198.18.0.0/15, except: ['{x/c}/32']}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("x/a", "x/c", false)],
            }),
            // An IPv4 block says nothing about IPv6 addresses.
            Step::Expect(Expect {
                ports: &[TCP80_V6],
                base: true,
                cells: &[("x/a", "*/*", false)],
            }),
        ],
    },
    Case {
        name: "egress ipBlock of a pod beside a block excepting it",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-overlap, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: '{y/b}/32'}}]
    ports: [{protocol: TCP, port: 80}]
  - to: [{ipBlock: {cidr: 198.18.0.0/15, except: ['{y/b}/32', '{z/c}/32']}}]
",
            ),
            // y/b by the first rule (port 80 only), every other pod but z/c by the second.
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("x/a", "z/c", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81, UDP80],
                base: true,
                cells: &[("x/a", "y/b", false), ("x/a", "z/c", false)],
            }),
        ],
    },
    Case {
        name: "ingress ipBlock of one pod's addresses",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-yb, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{ipBlock: {cidr: '{y/b}/32'}}, {ipBlock: {cidr: '{y/b:6}/128'}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80, TCP80_V6, UDP81_V6],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/b", "x/a", true)],
            }),
        ],
    },
    Case {
        name: "ingress ipBlock except one pod: two pods of one identity on either side",
        steps: &[
            Step::LabelPod("x/c", &["pod=b"]),
            Step::Check(x_b_and_x_c_share_an_identity),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-all-but-xc, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{ipBlock: {cidr: 198.18.0.0/15, except: ['{x/c}/32']}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("x/c", "x/a", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP80_V6],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // The same per IPv6 address.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-all-but-xc, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from:
    - ipBlock: {cidr: 198.18.0.0/15, except: ['{x/c}/32']}
    - ipBlock: {cidr: '2001:2::/48', except: ['{x/c:6}/128']}
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, TCP80_V6, UDP81_V6],
                base: true,
                cells: &[("x/c", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "ingress to a named port",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-named-port, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{port: serve-80-tcp}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, TCP80_V6],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP81, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-named-port, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{port: serve-81-udp, protocol: UDP}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[UDP81],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP81, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            // The name of a UDP port with the protocol left at TCP names nothing.
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-named-port, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{port: serve-80-udp}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80, UDP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
        ],
    },
    Case {
        name: "ingress to a named port that differs per pod",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: z}
spec:
  podSelector: {}
  ingress: [{from: [{namespaceSelector: {}}], ports: [{port: web}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "z/c", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("*/*", "z/a", false), ("*/*", "z/b", false)],
            }),
        ],
    },
    Case {
        name: "egress to a named port, resolved per destination",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-web, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{namespaceSelector: {}}], ports: [{port: web}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("x/a", "z/c", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("x/a", "*/*", false), ("x/a", "z/c", true)],
            }),
        ],
    },
    Case {
        // No `to`: each destination pod's own `web` (z/c's is 81), and
        // nothing on any number to a pod that does not name it.
        name: "egress to a named port for any peer, resolved per destination",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-any-web, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{ports: [{port: web}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("x/a", "z/c", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("x/a", "*/*", false), ("x/a", "z/c", true)],
            }),
            Step::Expect(Expect {
                ports: &[UDP80, UDP81],
                base: true,
                cells: &[("x/a", "*/*", false)],
            }),
        ],
    },
    Case {
        // The pods inside the block, each on its own number of the name;
        // an except is honoured per address.
        name: "egress to a named port with ipBlock peers",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-block-port, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress: [{to: [{ipBlock: {cidr: 198.18.0.0/15}}], ports: [{port: serve-81-tcp}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[],
            }),
            Step::Expect(Expect {
                ports: &[TCP80, UDP81],
                base: true,
                cells: &[("x/a", "*/*", false)],
            }),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-egress-block-port, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 198.18.0.0/15, except: ['{z/c}/32']}}, {ipBlock: {cidr: '2001:2::/48'}}]
    ports: [{port: web}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("x/a", "z/c", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("x/a", "*/*", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP80_V6],
                base: true,
                cells: &[("x/a", "z/c", false)],
            }),
            // z/c's `web` over IPv6: inside the IPv6 block, no except there.
            Step::Expect(Expect {
                ports: &[TCP81_V6],
                base: true,
                cells: &[("x/a", "*/*", false), ("x/a", "z/c", true)],
            }),
        ],
    },
    Case {
        name: "policies hold across kill -9 of svc-loader, svc-endpoint and svc-identity",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-mixed, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Ingress, Egress]
  ingress:
  - from: [{namespaceSelector: {matchLabels: {ns: y}}}]
    ports: [{port: serve-80-tcp}]
  egress:
  - to: [{ipBlock: {cidr: 198.18.0.0/15, except: ['{z/c}/32']}}]
    ports: [{protocol: TCP, port: 81}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/*", "x/a", true), ("x/a", "*/*", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("*/*", "x/a", false), ("x/a", "z/c", false)],
            }),
            Step::Kill9("svc-loader"),
            Step::Kill9("svc-endpoint"),
            Step::Kill9("svc-identity"),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/*", "x/a", true), ("x/a", "*/*", false)],
            }),
            Step::Expect(Expect {
                ports: &[TCP81],
                base: true,
                cells: &[("*/*", "x/a", false), ("x/a", "z/c", false)],
            }),
            // The restarted daemons still act on changes.
            Step::LabelNamespace("z", &["ns=y", "kubernetes.io/metadata.name=z"]),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[
                    ("*/*", "x/a", false),
                    ("y/*", "x/a", true),
                    ("z/*", "x/a", true),
                    ("x/a", "*/*", false),
                ],
            }),
        ],
    },
    Case {
        // A StatefulSet's pod comes back under its name: a new endpoint,
        // protected from its first packet, with none of the labels the old
        // one was given afterwards.
        name: "a pod deleted and added again",
        steps: &[
            Step::LabelPod("y/b", &["pod=b", "team=red"]),
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-red, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}, podSelector: {matchLabels: {team: red}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-isolated, namespace: y}
spec: {podSelector: {matchLabels: {pod: b}}, policyTypes: [Ingress]}
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/b", "x/a", true), ("*/*", "y/b", false)],
            }),
            Step::Recreate("y/b"),
            Step::ExpectNowTo(
                "y/b",
                Expect {
                    ports: &[TCP80, UDP81],
                    base: true,
                    cells: &[("*/*", "y/b", false)],
                },
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("*/*", "y/b", false)],
            }),
            // Labelled again: its new address and identity reach x/a.
            Step::LabelPod("y/b", &["pod=b", "team=red"]),
            Step::Expect(Expect {
                ports: &[TCP80, TCP80_V6],
                base: true,
                cells: &[("*/*", "x/a", false), ("y/b", "x/a", true), ("*/*", "y/b", false)],
            }),
        ],
    },
    Case {
        // The race: every y pod gets a new identity at once while
        // x/a regenerates; x/a must end up allowing all three, every time.
        name: "namespace relabel during regeneration",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-ns2, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {ns2: updated}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false)],
            }),
            Step::Repeat(
                3,
                &[
                    Step::LabelNamespace("y", &["ns=y", "kubernetes.io/metadata.name=y", "ns2=updated"]),
                    Step::Expect(Expect {
                        ports: &[TCP80],
                        base: true,
                        cells: &[("*/*", "x/a", false), ("y/*", "x/a", true)],
                    }),
                    Step::LabelNamespace("y", &["ns=y", "kubernetes.io/metadata.name=y"]),
                    Step::Expect(Expect {
                        ports: &[TCP80],
                        base: true,
                        cells: &[("*/*", "x/a", false)],
                    }),
                ],
            ),
        ],
    },
    Case {
        name: "pod relabel moves pods in and out of a podSelector",
        steps: &[
            Step::Apply(
                "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-any-b, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress: [{from: [{namespaceSelector: {}, podSelector: {matchLabels: {pod: b}}}]}]
",
            ),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/a", false), ("*/b", "x/a", true)],
            }),
            // y/c into the peer selector, y/b out of it.
            Step::LabelPod("y/c", &["pod=b"]),
            Step::LabelPod("y/b", &["pod=other"]),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[
                    ("*/*", "x/a", false),
                    ("*/b", "x/a", true),
                    ("y/b", "x/a", false),
                    ("y/c", "x/a", true),
                ],
            }),
            // x/a out of the policy's own podSelector: no longer isolated.
            Step::LabelPod("x/a", &["pod=other"]),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[],
            }),
            // x/b into it: isolated, reachable from the pods labelled b now.
            Step::LabelPod("x/b", &["pod=a"]),
            Step::Expect(Expect {
                ports: &[TCP80],
                base: true,
                cells: &[("*/*", "x/b", false), ("z/b", "x/b", true), ("y/c", "x/b", true)],
            }),
        ],
    },
];

//! Shared by the tests that run whole nodes with `rivet node up
//! --create-netns --detach`: [`TestNode`] (a node in a temp dir and a
//! namespace of its own, `rivet node down` on drop) and the checks they
//! share; and by those that start daemons themselves ([`reachable_tempdir`],
//! [`ProcCredentials`]).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rivet_cli::node::{DaemonPhase, NodeRecord};

/// Every binary `rivet node up` starts or installs.
const BINARIES: [&str; 7] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    "svc-endpoint",
    "svc-gc",
    "svc-health",
    "rivet-cni",
];

static NODES: AtomicU32 = AtomicU32::new(0);

pub fn rivet_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rivet"))
}

pub fn require_binaries() {
    let dir = rivet_bin()
        .parent()
        .expect("rivet is in target/<profile>")
        .to_path_buf();
    for name in BINARIES {
        assert!(
            dir.join(name).is_file(),
            "{} is missing: build the workspace binaries first (`cargo build --bins`)",
            dir.join(name).display()
        );
    }
}

/// Polls `f` every 100 ms until it is true; panics after `timeout`.
/// Returns how long it took.
pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    eventually_ok(what, timeout, || if f() { Ok(()) } else { Err(String::new()) })
}

/// Polls `f` every 100 ms until it is `Ok`; panics after `timeout` with
/// the last `Err` (what is still missing). Returns how long it took.
pub fn eventually_ok(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<(), String>) -> Duration {
    let started = Instant::now();
    loop {
        let missing = match f() {
            Ok(()) => return started.elapsed(),
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

/// A temp dir in /tmp the daemons' users can reach (tempfile makes 0700
/// ones).
pub fn reachable_tempdir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .expect("temp dir");
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    dir
}

/// The credential fields of `/proc/<pid>/status`.
#[derive(Debug)]
pub struct ProcCredentials {
    /// Real, effective, saved and filesystem uid.
    pub uids: Vec<u32>,
    /// The same gids.
    pub gids: Vec<u32>,
    /// Supplementary groups, sorted.
    pub groups: Vec<u32>,
    /// `CapInh`, `CapPrm`, `CapEff`, `CapBnd` and `CapAmb`.
    pub cap: BTreeMap<String, u64>,
    pub no_new_privs: bool,
}

impl ProcCredentials {
    /// Of `/proc/<pid>/status` (`pid` may be `self` or `thread-self`).
    pub fn of(pid: &str) -> Self {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}:")))
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
                .trim()
                .to_string()
        };
        let ids = |name: &str| -> Vec<u32> { field(name).split_whitespace().map(|n| n.parse().unwrap()).collect() };
        let mut groups = ids("Groups");
        groups.sort_unstable();
        Self {
            uids: ids("Uid"),
            gids: ids("Gid"),
            groups,
            cap: ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]
                .iter()
                .map(|c| (c.to_string(), u64::from_str_radix(&field(c), 16).unwrap()))
                .collect(),
            no_new_privs: field("NoNewPrivs") == "1",
        }
    }
}

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

pub fn netns_list() -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// A node started with `rivet node up --detach` in a temp dir; `rivet node
/// down` on drop (also on panic).
pub struct TestNode {
    dir: tempfile::TempDir,
    /// The node's namespace, also its name.
    pub netns: String,
    stopped: bool,
}

impl TestNode {
    pub fn up() -> Self {
        Self::up_with(&[])
    }

    /// A node whose `rivet node up` gets `extra` flags too (`--pool ...`,
    /// `--etcd-endpoints ...`).
    pub fn up_with(extra: &[&str]) -> Self {
        require_binaries();
        // The daemons run as the rivet users: they must reach their dirs in it.
        let dir = reachable_tempdir("rvt");
        let netns = format!("rvtn-{}-{}", std::process::id(), NODES.fetch_add(1, Ordering::Relaxed));
        let mut node = Self {
            dir,
            netns,
            stopped: false,
        };
        let cni_bin = node.path("cni/bin");
        let cni_conf = node.path("cni/net.d");
        let out = node
            .rivet(&[
                "node",
                "up",
                "--netns",
                &node.netns.clone(),
                "--create-netns",
                "--detach",
            ])
            .args(["--cni-bin-dir".as_ref(), cni_bin.as_os_str()])
            .args(["--cni-conf-dir".as_ref(), cni_conf.as_os_str()])
            .args(["--stop-grace-seconds", "5"])
            .args(extra)
            .output()
            .expect("running rivet node up");
        if !out.status.success() {
            node.stopped = true;
            let _ = node.rivet(&["node", "down"]).output();
            panic!(
                "rivet node up failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        node
    }

    pub fn path(&self, relative: &str) -> PathBuf {
        self.dir.path().join(relative)
    }

    pub fn state_dir(&self) -> PathBuf {
        self.path("state")
    }

    /// `rivet --state-dir .. --socket-dir .. <args>`.
    pub fn rivet(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(rivet_bin());
        cmd.arg("--state-dir")
            .arg(self.state_dir())
            .arg("--socket-dir")
            .arg(self.path("sockets"))
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `rivet <args>`; its stdout, or a panic with its output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.rivet(args).output().expect("running rivet");
        assert!(
            out.status.success(),
            "rivet {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&all)).expect("rivet -o json prints JSON")
    }

    pub fn record(&self) -> NodeRecord {
        NodeRecord::load(&self.state_dir())
            .expect("node.json parses")
            .expect("node.json exists")
    }

    /// `rivet pod exec <pod> -- <command>`.
    pub fn exec(&self, pod: &str, command: &[&str]) -> Output {
        let mut args = vec!["pod", "exec", pod, "--"];
        args.extend(command);
        self.rivet(&args).output().expect("running rivet pod exec")
    }

    /// Background `rivet pod exec`.
    pub fn spawn_in(&self, pod: &str, command: &[&str]) -> Child {
        let mut args = vec!["pod", "exec", pod, "--"];
        args.extend(command);
        self.rivet(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning rivet pod exec")
    }

    /// A pod's addresses from `rivet pod list`.
    pub fn addresses(&self, pod: &str) -> Vec<String> {
        let pods = self.json(&["pod", "list"]);
        let pod = pods
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == pod)
            .unwrap_or_else(|| panic!("pod {pod} is listed"));
        pod["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    }

    pub fn ipv4(&self, pod: &str) -> String {
        self.addresses(pod)
            .into_iter()
            .find(|a| a.contains('.'))
            .expect("an IPv4 address")
    }

    pub fn ping(&self, from: &str, to: &str) -> bool {
        self.exec(from, &["ping", "-c", "2", "-i", "0.2", "-W", "2", to])
            .status
            .success()
    }

    /// A TCP echo through busybox nc: `hello` sent from `from` comes back from `to`.
    pub fn tcp_echo(&self, from: &str, to_addr: &str, port: u16) -> bool {
        let mut args = vec!["pod", "exec", from, "--", "busybox", "nc", "-w", "2"];
        let port = port.to_string();
        args.extend([to_addr, &port]);
        let mut child = self
            .rivet(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning nc");
        // nc may exit before reading (connection refused or dropped): no echo.
        let _ = std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"hello\n");
        let out = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim() == "hello"
    }

    /// Kills daemon `name` with SIGKILL and waits until the supervisor has
    /// it running again under a new pid.
    pub fn kill9_and_wait_for_restart(&self, name: &str) {
        let before = self.record();
        let daemon = before.daemon(name).unwrap();
        let pid = daemon.pid.expect("the daemon runs");
        let status = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
        assert!(status.success());
        eventually(&format!("{name} restarted"), Duration::from_secs(30), || {
            let now = self.record();
            let d = now.daemon(name).unwrap();
            d.phase == DaemonPhase::Running && d.pid.is_some_and(|p| p != pid) && d.restarts == daemon.restarts + 1
        });
        let d = self.record().daemon(name).unwrap().clone();
        assert_eq!(d.last_exit.as_deref(), Some("signal 9 (SIGKILL)"));
        assert!(!alive(pid));
    }

    /// `rivet node down`, then checks that nothing is left.
    pub fn down_and_check_nothing_left(&mut self) {
        let record = self.record();
        let out = self.ok(&["node", "down"]);
        self.stopped = true;
        assert!(out.contains(&format!("node {} stopped", record.node_name)), "{out}");
        let namespaces = netns_list();
        assert!(
            !namespaces.contains(&self.netns),
            "the node namespace is gone: {namespaces:?}"
        );
        let pod_prefix = format!("rivet-pod-{}-", record.node_name);
        assert!(
            !namespaces.iter().any(|n| n.starts_with(&pod_prefix)),
            "no pod namespace is left: {namespaces:?}"
        );
        assert!(!record.pin_dir.exists(), "{} is gone", record.pin_dir.display());
        assert!(!record.socket_dir.exists(), "{} is gone", record.socket_dir.display());
        assert!(
            !record.conflist.exists() && !record.cni_binary.exists(),
            "the CNI files are gone"
        );
        for plugin in &record.cni_plugins {
            assert!(!plugin.exists(), "{} is gone", plugin.display());
        }
        assert!(!self.state_dir().join("node.json").exists());
        assert!(!self.state_dir().join("pods").exists());
        assert!(!alive(record.supervisor_pid), "the supervisor exited");
        for d in &record.daemons {
            if let Some(pid) = d.pid {
                assert!(!alive(pid), "{} (pid {pid}) exited", d.name);
            }
        }
        // What stays: the logs.
        assert!(record.log_dir.join("svc-endpoint.log").exists());
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.rivet(&["node", "down"]).output();
        }
    }
}

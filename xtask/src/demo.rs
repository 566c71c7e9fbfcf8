//! `cargo xtask demo`: one Rivet node, three pods and a NetworkPolicy, using only the
//! real binaries and the `rivet` CLI as a user would type it.
//!
//! 1. `rivet node up --create-netns --detach`: the five node daemons under one
//!    supervisor, in a network namespace of their own, with rivet-cni installed;
//! 2. three pods (frontend, backend, db) through the real CNI plugin (`rivet pod add`);
//! 3. a policy: only frontend may reach backend, on TCP 8080; nothing may reach db;
//! 4. frontend → backend:8080 answers (a `busybox nc` echo);
//! 5. frontend → db:5432 does not, and `rivet monitor` says why; `rivet endpoint
//!    list`, `rivet status`;
//! 6. a Service in front of two pods web-1 and web-2 (`rivet service apply`):
//!    frontend's requests to its ClusterIP are answered by each backend; `rivet
//!    service list`, `rivet bpf service list`;
//! 7. `kill -9` of svc-endpoint while frontend pings backend: the supervisor restarts
//!    it, and the ping loses nothing;
//! 8. `rivet node down`: nothing is left.
//!
//! Nothing touches the machine's own interfaces, routes or sysctls: the node lives in a
//! network namespace it creates, the pods in namespaces of their own, every file in a
//! temp dir (shown as `$D`), addresses come from 198.18.0.0/15 and 2001:2::/48. The
//! node is torn down at the end, also when a step fails (a drop guard) or on Ctrl-C
//! (a signal thread).

use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::cmd;

/// The node's network namespace (and node name); a number is appended if taken.
const NETNS: &str = "rivet-demo";
/// The port backend serves on, and the only one the policy opens.
const BACKEND_PORT: u16 = 8080;
/// The port db serves on; nothing may reach it.
const DB_PORT: u16 = 5432;
/// How long svc-endpoint may take to be restarted and answer again.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);
/// Pings sent during the restart (one every 100 ms).
const PINGS: u32 = 60;
/// Longest Unix socket path (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The Service's ClusterIP (in `rivet node up`'s default service CIDR).
const SERVICE_IP: &str = "198.19.128.10";
/// The Service's port.
const SERVICE_PORT: u16 = 80;
/// The port web-1 and web-2 serve on.
const WEB_PORT: u16 = 8080;
/// How many requests frontend sends to the ClusterIP.
const SERVICE_REQUESTS: usize = 6;
/// How long the Service may take to be programmed.
const SERVICE_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The Service of the demo: its backends are the pods labelled app=web.
const SERVICE: &str = "\
# A ClusterIP in front of the pods labelled app=web: port 80 -> their 8080.
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 198.19.128.10
  selector: {app: web}
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080}
";

/// The policy of the demo.
const POLICY: &str = "\
# Only frontend may reach backend, and only on TCP 8080.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: backend-from-frontend, namespace: default}
spec:
  podSelector: {matchLabels: {app: backend}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: frontend}}}]
    ports: [{protocol: TCP, port: 8080}]
---
# Nothing may reach db.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-deny-all, namespace: default}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
---
# ICMP is not a NetworkPolicy protocol: Rivet's own kind lets frontend ping
# backend (used to watch traffic while a daemon restarts).
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: backend-ping-from-frontend, namespace: default}
spec:
  podSelector: {matchLabels: {app: backend}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: frontend}}}]
    ports: [{protocol: ICMP}]
";

/// Builds the binaries and runs the demo.
pub fn run() -> Result<()> {
    let bin_dir = build_binaries()?;
    let tmp = TempDir::create("rivet-demo")?;
    let demo = Demo::new(bin_dir.join("rivet"), tmp.path().to_path_buf(), free_netns_name())?;
    let logs = demo.dir.join("state/logs");
    guarded(demo, tmp, &logs, Demo::run)
}

/// `cargo build --workspace --bins`; the dir of the binaries, each checked.
pub(crate) fn build_binaries() -> Result<PathBuf> {
    cmd::run(cmd::cargo().args(["build", "--workspace", "--bins"]))?;
    let bin_dir = cmd::target_dir().join("debug");
    for (name, crate_dir) in [
        ("rivet", "cli"),
        ("rivet-cni", "cni"),
        ("svc-ipam", "svc-ipam"),
        ("svc-identity", "svc-identity"),
        ("svc-loader", "svc-loader"),
        ("svc-endpoint", "svc-endpoint"),
    ] {
        built_binary(&bin_dir, name, crate_dir)?;
    }
    Ok(bin_dir)
}

/// Runs `body` with the teardown guaranteed: on Ctrl-C or SIGTERM (a
/// signal thread), on failure (the logs under `logs` are kept) and at the end.
pub(crate) fn guarded(demo: Demo, tmp: TempDir, logs: &Path, body: impl FnOnce(&Demo) -> Result<()>) -> Result<()> {
    // Ctrl-C or SIGTERM: tear the node down, then exit. The signals are blocked in
    // this thread (and so in every thread spawned later) and taken by one thread.
    let teardown = Arc::new(Mutex::new(Some(demo.teardown_command())));
    let signals = block_signals()?;
    {
        let teardown = Arc::clone(&teardown);
        let tmp_path = tmp.path().to_path_buf();
        std::thread::spawn(move || {
            if let Ok(signal) = signals.wait() {
                INTERRUPTED.store(true, Ordering::SeqCst);
                eprintln!("\n# {signal:?}: tearing down");
                if let Some(mut down) = teardown.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    let _ = down.status();
                }
                let _ = fs::remove_dir_all(&tmp_path);
                std::process::exit(130);
            }
        });
    }

    let result = body(&demo);
    park_if_interrupted();
    // Whatever happened: everything goes (unless the signal thread took it already).
    let down = teardown.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Err(e) = result {
        if let Some(mut down) = down {
            eprintln!("\n# The demo failed; tearing down");
            let _ = down.stdout(Stdio::null()).status();
        }
        eprintln!("# Kept for a look: the logs in {}", logs.display());
        tmp.keep();
        return Err(e);
    }
    println!();
    println!("# Demo finished; removing {}", tmp.path().display());
    Ok(())
}

/// The path of a binary `cargo build --workspace --bins` should have produced, or an
/// error saying which crate was expected to provide it.
pub(crate) fn built_binary(bin_dir: &Path, name: &str, crate_dir: &str) -> Result<PathBuf> {
    let path = bin_dir.join(name);
    if !path.is_file() {
        bail!(
            "the demo needs the `{name}` binary, but `cargo build --workspace --bins` did not \
             produce {}: is the {crate_dir}/ crate a workspace member with a `{name}` binary?",
            path.display()
        );
    }
    Ok(path)
}

/// `rivet-demo`, or `rivet-demo-2`, … when a namespace of that name exists (e.g. left
/// by a demo killed with SIGKILL).
fn free_netns_name() -> String {
    (1..100)
        .map(|n| {
            if n == 1 {
                NETNS.to_string()
            } else {
                format!("{NETNS}-{n}")
            }
        })
        .find(|name| !Path::new("/run/netns").join(name).exists())
        .unwrap_or_else(|| format!("{NETNS}-{}", std::process::id()))
}

/// Set by the signal thread: it tears the node down and ends the process.
pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Once interrupted, the main thread starts nothing new: it waits for the signal
/// thread to finish the teardown and exit.
pub(crate) fn park_if_interrupted() {
    while INTERRUPTED.load(Ordering::SeqCst) {
        sleep(Duration::from_secs(1));
    }
}

/// Blocks SIGINT and SIGTERM in this thread (inherited by threads spawned later; child
/// processes start with an empty mask); the set to wait on.
pub(crate) fn block_signals() -> Result<SigSet> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().context("blocking SIGINT and SIGTERM")?;
    Ok(set)
}

/// One demo run.
pub(crate) struct Demo {
    rivet: PathBuf,
    /// The temp dir, shown as `$D`.
    pub(crate) dir: PathBuf,
    netns: String,
    /// The environment of every `rivet` (the `export` line shown at the start).
    env: Vec<(&'static str, PathBuf)>,
    /// `rivet <args>` that tears everything down.
    teardown: Vec<String>,
}

impl Demo {
    fn new(rivet: PathBuf, dir: PathBuf, netns: String) -> Result<Self> {
        let socket = dir.join("sockets/svc-endpoint.sock");
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            bail!(
                "the demo's socket path {} is over the {MAX_SOCKET_PATH}-byte limit of Unix \
                 socket paths: set TMPDIR to a shorter directory, e.g. TMPDIR=/tmp",
                socket.display()
            );
        }
        let env = vec![
            ("RIVET_STATE_DIR", dir.join("state")),
            ("RIVET_SOCKET_DIR", dir.join("sockets")),
        ];
        Ok(Self {
            rivet,
            dir,
            netns,
            env,
            teardown: vec!["node".into(), "down".into()],
        })
    }

    /// A demo of a cluster in `dir` (its state dir): `rivet cluster down
    /// --name <cluster>` tears it down.
    pub(crate) fn of_cluster(rivet: PathBuf, dir: PathBuf, cluster: &str) -> Self {
        Self {
            rivet,
            env: vec![("RIVET_STATE_DIR", dir.clone())],
            dir,
            netns: String::new(),
            teardown: ["cluster", "down", "--name", cluster].map(String::from).to_vec(),
        }
    }

    /// `rivet <args>` with the demo's state and socket dirs in the environment (as the
    /// `export` line shown at the start).
    pub(crate) fn rivet(&self, args: &[&str]) -> Command {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(&self.rivet);
        command.args(args).envs(self.env.iter().map(|(k, v)| (*k, v)));
        // The signal mask is inherited across exec: the signals this process
        // blocked (for its signal thread) must reach the commands it runs.
        // SAFETY: sigprocmask is async-signal-safe and touches only the new process.
        unsafe {
            command.pre_exec(|| {
                let mut set = SigSet::empty();
                set.add(Signal::SIGINT);
                set.add(Signal::SIGTERM);
                set.thread_unblock().map_err(std::io::Error::from)
            });
        }
        command
    }

    /// `rivet node down` (`rivet cluster down`), for the teardown guards.
    pub(crate) fn teardown_command(&self) -> Command {
        let args: Vec<&str> = self.teardown.iter().map(String::as_str).collect();
        self.rivet(&args)
    }

    /// A command line as a user would type it: `rivet` by name, the temp dir as `$D`.
    pub(crate) fn shown(&self, command: &Command) -> String {
        let dir = self.dir.display().to_string();
        let program = Path::new(command.get_program());
        let mut words = vec![
            program
                .file_name()
                .unwrap_or(program.as_os_str())
                .to_string_lossy()
                .into_owned(),
        ];
        words.extend(command.get_args().map(|a| {
            let a = a.to_string_lossy().replace(&dir, "$D");
            if a.contains(' ') { format!("'{a}'") } else { a }
        }));
        words.join(" ")
    }

    /// Shows `$ <command>`, runs it, shows its output; fails if it fails.
    pub(crate) fn show(&self, command: &mut Command) -> Result<Output> {
        let output = self.show_allowing_failure(command, None)?;
        if !output.status.success() {
            bail!("`{}` failed ({})", self.shown(command), output.status);
        }
        Ok(output)
    }

    /// Shows `$ [echo <stdin> | ]<command>`, runs it, shows its output and, if it
    /// failed, its exit status.
    pub(crate) fn show_allowing_failure(&self, command: &mut Command, stdin: Option<&str>) -> Result<Output> {
        park_if_interrupted();
        match stdin {
            Some(text) => println!("$ echo {} | {}", text.trim_end(), self.shown(command)),
            None => println!("$ {}", self.shown(command)),
        }
        let _ = std::io::stdout().flush();
        let mut child = command
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("could not run {}", self.shown(command)))?;
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let _ = pipe.write_all(text.as_bytes());
        }
        let output = child.wait_with_output()?;
        park_if_interrupted();
        print!("{}", String::from_utf8_lossy(&output.stdout));
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
        if !output.status.success() {
            println!("({})", output.status);
        }
        Ok(output)
    }

    /// Starts `command` in the background, shown with a trailing `&`; its output goes
    /// to `log`.
    pub(crate) fn background(&self, command: &mut Command, log: &Path) -> Result<Background> {
        park_if_interrupted();
        println!("$ {} &", self.shown(command));
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("could not run {}", self.shown(command)))?;
        Ok(Background { child })
    }

    /// A TCP echo server (`busybox nc -ll -e cat`) in pod `pod` on `port`,
    /// in the background (`rivet <node_args> pod exec ...`).
    pub(crate) fn echo_server(&self, node_args: &[&str], pod: &str, port: u16) -> Result<Background> {
        let port = port.to_string();
        let mut args = node_args.to_vec();
        args.extend([
            "pod", "exec", pod, "--", "busybox", "nc", "-ll", "-p", &port, "-e", "cat",
        ]);
        self.background(&mut self.rivet(&args), &self.dir.join(format!("{pod}-server.log")))
    }

    /// `rivet <args> -o json`, parsed.
    pub(crate) fn json(&self, args: &[&str]) -> Result<Value> {
        let mut command = self.rivet(args);
        command.args(["-o", "json"]);
        let output = command
            .output()
            .with_context(|| format!("could not run {}", self.shown(&command)))?;
        if !output.status.success() {
            bail!(
                "`{}` failed ({}): {}",
                self.shown(&command),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        serde_json::from_slice(&output.stdout).with_context(|| format!("the output of {}", self.shown(&command)))
    }

    /// A pod's IPv4 address, from `rivet pod list`.
    fn pod_ipv4(&self, name: &str) -> Result<String> {
        let pods = self.json(&["pod", "list"])?;
        pods.as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["name"] == name)
            .flat_map(|p| p["addresses"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a.as_str().map(str::to_string))
            .find(|a| a.contains('.'))
            .with_context(|| format!("pod {name} has no IPv4 address in `rivet pod list`"))
    }

    /// A pod's endpoint id, from `rivet pod list`.
    fn pod_endpoint(&self, name: &str) -> Result<u64> {
        let pods = self.json(&["pod", "list"])?;
        pods.as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == name)
            .and_then(|p| p["endpoint_id"].as_u64())
            .with_context(|| format!("pod {name} has no endpoint in `rivet pod list`"))
    }

    /// Step 6: a Service in front of web-1 and web-2, each answering with
    /// its name; frontend's requests to the ClusterIP reach both.
    fn service(&self) -> Result<()> {
        heading(
            "6. A Service in front of two pods",
            "web-1 and web-2 (app=web) answer every connection with their name. The Service\n\
             selects them; svc-endpoint resolves it to its backends and svc-loader programs the BPF\n\
             service maps: a pod's connection to the ClusterIP is translated to a backend (Maglev)\n\
             in the datapath, before policy, and the replies come back from the ClusterIP.",
        );
        let mut servers = Vec::new();
        for pod in ["web-1", "web-2"] {
            self.show(&mut self.rivet(&["pod", "add", pod, "--label", "app=web"]))?;
            let port = WEB_PORT.to_string();
            servers.push(self.background(
                &mut self.rivet(&[
                    "pod", "exec", pod, "--", "busybox", "nc", "-ll", "-p", &port, "-e", "busybox", "echo", pod,
                ]),
                &self.dir.join(format!("{pod}-server.log")),
            )?);
        }
        let file = self.dir.join("service.yaml");
        fs::write(&file, SERVICE)?;
        println!("$ cat $D/service.yaml");
        print!("{SERVICE}");
        self.show(&mut self.rivet(&["service", "apply", "-f", &file.display().to_string()]))?;
        self.show(&mut self.rivet(&["service", "list"]))?;
        // Programmed once a request is answered (not shown).
        let started = Instant::now();
        while self.ask_service(false)?.is_none() {
            if started.elapsed() > SERVICE_READY_TIMEOUT {
                bail!(
                    "{SERVICE_IP}:{SERVICE_PORT} answered nothing within {}s",
                    SERVICE_READY_TIMEOUT.as_secs()
                );
            }
            sleep(Duration::from_millis(200));
        }
        let mut answered = std::collections::BTreeSet::new();
        for _ in 0..SERVICE_REQUESTS {
            if let Some(name) = self.ask_service(true)? {
                answered.insert(name);
            }
        }
        if answered.len() != 2 {
            bail!("frontend's requests to the ClusterIP were answered by {answered:?}, not by web-1 and web-2");
        }
        self.show(&mut self.rivet(&["bpf", "service", "list"]))?;
        drop(servers);
        Ok(())
    }

    /// One request from frontend to the ClusterIP (each a new connection,
    /// from a new source port); the backend's name, if one answered.
    fn ask_service(&self, shown: bool) -> Result<Option<String>> {
        let mut command = self.rivet(&["pod", "exec", "frontend", "--", "busybox", "nc", "-w", "2", SERVICE_IP]);
        command.arg(SERVICE_PORT.to_string());
        let output = if shown {
            self.show_allowing_failure(&mut command, Some("hello\n"))?
        } else {
            let mut child = command
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("could not run {}", self.shown(&command)))?;
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(b"hello\n");
            }
            child.wait_with_output()?
        };
        let name = String::from_utf8_lossy(&output.stdout).trim().to_string();
        Ok(Some(name).filter(|n| n.starts_with("web-")))
    }

    /// svc-endpoint's restore phase, from `rivet status`.
    fn endpoint_restore_phase(&self) -> Result<String> {
        let status = self.json(&["status"])?;
        Ok(status
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["daemon"] == "svc-endpoint")
            .and_then(|d| d["endpoint_status"]["restore"]["phase"].as_str())
            .unwrap_or("unknown")
            .to_string())
    }

    /// The pid of a node daemon and its restarts, from `rivet node status`.
    fn daemon(&self, name: &str) -> Result<(Option<u64>, String, u64)> {
        let node = self.json(&["node", "status"])?;
        let daemon = node["daemons"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["name"] == name)
            .with_context(|| format!("{name} is not in `rivet node status`"))?;
        Ok((
            daemon["pid"].as_u64(),
            daemon["phase"].as_str().unwrap_or_default().to_string(),
            daemon["restarts"].as_u64().unwrap_or_default(),
        ))
    }

    fn run(&self) -> Result<()> {
        let d = self.dir.display();
        heading(
            "1. A node",
            &format!(
                "Everything lives in a temp dir, D={d}, and in network namespaces the demo creates.\n\
                 `rivet node up` starts svc-ipam, svc-identity, svc-loader (inside the node's namespace),\n\
                 svc-endpoint, svc-gc and svc-health, each once the previous one answers, supervises them and\n\
                 installs rivet-cni with its conflist. Each daemon runs as its own user with only the\n\
                 capabilities it needs: svc-loader keeps three, the others none (USER, CAPABILITIES)."
            ),
        );
        println!("$ export RIVET_STATE_DIR=$D/state RIVET_SOCKET_DIR=$D/sockets");
        let cni_bin = self.dir.join("cni/bin");
        let cni_conf = self.dir.join("cni/net.d");
        self.show(
            self.rivet(&["node", "up", "--netns", &self.netns, "--create-netns"])
                .args([
                    "--cni-bin-dir".as_ref(),
                    cni_bin.as_os_str(),
                    "--cni-conf-dir".as_ref(),
                    cni_conf.as_os_str(),
                    "--detach".as_ref(),
                ]),
        )?;

        heading(
            "2. Three pods",
            "Each is a network namespace wired by rivet-cni, called exactly as a container runtime\n\
             calls it (CNI ADD with the conflist, CNI_ARGS and the labels).",
        );
        for (pod, label) in [
            ("frontend", "app=frontend"),
            ("backend", "app=backend"),
            ("db", "app=db"),
        ] {
            self.show(&mut self.rivet(&["pod", "add", pod, "--label", label]))?;
        }
        self.show(&mut self.rivet(&["pod", "list"]))?;
        let backend = self.pod_ipv4("backend")?;
        let db = self.pod_ipv4("db")?;

        heading(
            "3. A policy",
            "Only frontend may reach backend, on TCP 8080; nothing may reach db.",
        );
        let policy = self.dir.join("policy.yaml");
        fs::write(&policy, POLICY)?;
        println!("$ cat $D/policy.yaml");
        print!("{POLICY}");
        self.show(&mut self.rivet(&["policy", "apply", "-f", &policy.display().to_string(), "--wait"]))?;

        heading(
            "4. frontend -> backend:8080 is allowed",
            "backend and db run a TCP echo server (busybox nc); frontend says hello to backend.",
        );
        let mut servers = Vec::new();
        for (pod, port) in [("backend", BACKEND_PORT), ("db", DB_PORT)] {
            servers.push(self.echo_server(&[], pod, port)?);
        }
        sleep(Duration::from_millis(500));
        let echo = self.show_allowing_failure(
            self.rivet(&["pod", "exec", "frontend", "--", "busybox", "nc", "-w", "2", &backend])
                .arg(BACKEND_PORT.to_string()),
            Some("hello\n"),
        )?;
        if String::from_utf8_lossy(&echo.stdout).trim() != "hello" {
            bail!("backend did not echo frontend's hello");
        }

        heading(
            "5. frontend -> db:5432 is denied",
            "The datapath drops the connection attempt at db's interface; `rivet monitor` streams\n\
             drop events with their reason.",
        );
        let monitor_log = self.dir.join("monitor.txt");
        let db_endpoint = self.pod_endpoint("db")?;
        let mut monitor = self.background(
            &mut self.rivet(&["monitor", "--endpoint", &db_endpoint.to_string()]),
            &monitor_log,
        )?;
        sleep(Duration::from_millis(500));
        let denied = self.show_allowing_failure(
            self.rivet(&["pod", "exec", "frontend", "--", "busybox", "nc", "-w", "2", &db])
                .arg(DB_PORT.to_string()),
            Some("hello\n"),
        )?;
        if String::from_utf8_lossy(&denied.stdout).contains("hello") {
            bail!("db answered frontend although the policy denies it");
        }
        sleep(Duration::from_millis(300));
        monitor.stop();
        let port = format!(":{DB_PORT}");
        println!(
            "$ grep {port} $D/monitor.txt   # what `rivet monitor` printed meanwhile (db is endpoint {db_endpoint})"
        );
        let events = fs::read_to_string(&monitor_log).unwrap_or_default();
        let drops: Vec<&str> = events.lines().filter(|l| l.contains(&port)).collect();
        for line in drops.iter().take(3) {
            println!("{line}");
        }
        if !drops.iter().any(|l| l.starts_with("DROP")) {
            bail!("`rivet monitor` showed no drop for frontend -> db");
        }
        self.show(&mut self.rivet(&["endpoint", "list"]))?;
        self.show(&mut self.rivet(&["status"]))?;

        self.service()?;

        heading(
            "7. kill -9 svc-endpoint while frontend pings backend",
            "The supervisor restarts it; the datapath never waits for the control plane, so no\n\
             ping is lost.",
        );
        let ping_log = self.dir.join("ping.txt");
        let mut ping = self.background(
            self.rivet(&["pod", "exec", "frontend", "--", "ping", "-q", "-i", "0.1", "-W", "1"])
                .args(["-c", &PINGS.to_string(), &backend]),
            &ping_log,
        )?;
        sleep(Duration::from_secs(1));
        let (old_pid, _, restarts) = self.daemon("svc-endpoint")?;
        let old_pid = old_pid.context("svc-endpoint has no pid")?;
        println!("$ kill -9 {old_pid}   # svc-endpoint, pid from `rivet node status`");
        kill(Pid::from_raw(old_pid as i32), Signal::SIGKILL).context("kill -9 svc-endpoint")?;
        let started = Instant::now();
        loop {
            let (pid, phase, now_restarts) = self.daemon("svc-endpoint")?;
            if pid.is_some_and(|p| p != old_pid) && phase == "running" && now_restarts > restarts {
                println!(
                    "(the supervisor restarted svc-endpoint as pid {} within {:.1}s)",
                    pid.unwrap_or_default(),
                    started.elapsed().as_secs_f64()
                );
                break;
            }
            if started.elapsed() > RESTART_TIMEOUT {
                bail!("svc-endpoint was not restarted within {}s", RESTART_TIMEOUT.as_secs());
            }
            sleep(Duration::from_millis(100));
        }
        // The new svc-endpoint restores its endpoints from its state dir.
        loop {
            if self.endpoint_restore_phase()? == "complete" {
                break;
            }
            if started.elapsed() > RESTART_TIMEOUT {
                bail!(
                    "the restarted svc-endpoint did not complete its restore within {}s",
                    RESTART_TIMEOUT.as_secs()
                );
            }
            sleep(Duration::from_millis(100));
        }
        self.show(&mut self.rivet(&["status"]))?;
        let status = ping.wait()?;
        park_if_interrupted();
        println!("$ cat $D/ping.txt   # the ping that ran throughout");
        let summary = fs::read_to_string(&ping_log).unwrap_or_default();
        for line in summary
            .lines()
            .filter(|l| l.contains("packets") || l.starts_with("rtt"))
        {
            println!("{line}");
        }
        if !status.success() || !summary.contains(" 0% packet loss") {
            bail!("pings were lost while svc-endpoint restarted:\n{summary}");
        }

        heading(
            "8. Teardown",
            "The supervisor deletes the pods (CNI DEL), stops the daemons in reverse order and\n\
             removes what it created: the namespace, the pins, the sockets, the CNI files.",
        );
        drop(servers);
        // The pin dir as the node recorded it (the CLI owns the layout).
        let pin_dir = self.json(&["node", "status"])?["pin_dir"]
            .as_str()
            .context("`rivet node status` names no pin_dir")?
            .to_string();
        let _ = self.show(&mut self.teardown_command())?;
        let leftovers: Vec<String> = [
            format!("/run/netns/{}", self.netns),
            pin_dir,
            self.dir.join("sockets").display().to_string(),
            self.dir.join("state/node.json").display().to_string(),
            cni_conf.join("10-rivet.conflist").display().to_string(),
        ]
        .into_iter()
        .filter(|p| Path::new(p).exists())
        .collect();
        if !leftovers.is_empty() {
            bail!("the node left {}", leftovers.join(", "));
        }
        println!("(no namespace, pins, sockets or CNI files left)");
        Ok(())
    }
}

/// A step's heading and its explanation.
pub(crate) fn heading(title: &str, text: &str) {
    println!();
    println!("== {title}");
    for line in text.lines() {
        println!("# {line}");
    }
}

/// A background command, killed and reaped when dropped.
pub(crate) struct Background {
    child: Child,
}

impl Background {
    /// SIGTERM, then reap it.
    pub(crate) fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if let Ok(pid) = i32::try_from(self.child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    /// Waits for it to exit by itself.
    fn wait(&mut self) -> Result<std::process::ExitStatus> {
        self.child.wait().context("waiting for a background command")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A fresh directory under the system temp dir, removed with everything in it when
/// dropped.
pub(crate) struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/<prefix>.<pid>.<n>` with the first free `n`; short, so socket
    /// paths inside stay well under the kernel's limit.
    pub(crate) fn create(prefix: &str) -> Result<Self> {
        let base = std::env::temp_dir();
        for n in 0..100 {
            let path = base.join(format!("{prefix}.{}.{n}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(err) if err.kind() == ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(err).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
        bail!("could not find a free temp dir name under {}", base.display())
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Leaves the directory in place (for the logs of a failed run).
    pub(crate) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(err) = fs::remove_dir_all(&self.path) {
            eprintln!("warning: could not remove {}: {err}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_dir_is_removed_on_drop() {
        let tmp = TempDir::create("rivet-xtask-test").unwrap();
        let path = tmp.path().to_path_buf();
        fs::create_dir_all(path.join("sockets/nested")).unwrap();
        fs::write(path.join("sockets/nested/file"), "x").unwrap();
        drop(tmp);
        assert!(!path.exists());
    }

    #[test]
    fn dropped_background_command_is_stopped_and_reaped() {
        let child = Command::new("sleep").arg("60").spawn().unwrap();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        drop(Background { child });
        // Reaped: the pid no longer exists (signal 0 only checks).
        assert!(kill(pid, None).is_err());
    }

    #[test]
    fn commands_are_shown_as_typed() {
        let demo = Demo::new(
            "/x/target/debug/rivet".into(),
            "/tmp/rivet-demo.1.0".into(),
            NETNS.into(),
        )
        .unwrap();
        let mut command = demo.rivet(&["node", "up", "--cni-bin-dir", "/tmp/rivet-demo.1.0/cni/bin"]);
        command.arg("a b");
        assert_eq!(demo.shown(&command), "rivet node up --cni-bin-dir $D/cni/bin 'a b'");
    }

    #[test]
    fn too_long_socket_paths_are_refused() {
        let deep = format!("/tmp/{}", "d".repeat(100));
        let err = Demo::new("rivet".into(), deep.into(), NETNS.into()).err().unwrap();
        assert!(err.to_string().contains("TMPDIR"), "{err}");
    }

    #[test]
    fn missing_binary_names_the_crate() {
        let tmp = TempDir::create("rivet-xtask-test").unwrap();
        let err = built_binary(tmp.path(), "svc-ipam", "svc-ipam")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`svc-ipam` binary"), "{err}");
        assert!(err.contains("svc-ipam/ crate"), "{err}");
    }

    #[test]
    fn the_service_is_the_one_the_demo_asks() {
        assert!(SERVICE.contains(&format!("clusterIP: {SERVICE_IP}")));
        assert!(SERVICE.contains(&format!("port: {SERVICE_PORT}, targetPort: {WEB_PORT}")));
    }

    #[test]
    fn the_policy_has_three_documents() {
        assert_eq!(POLICY.matches("\n---\n").count(), 2);
        assert!(POLICY.contains(&format!("port: {BACKEND_PORT}")));
    }
}

//! `rivet node up --create-netns` and `rivet pod` as a user runs them: a whole
//! node in a network namespace of its own, pods created through the real CNI
//! plugins, traffic between them, daemons killed with SIGKILL and restarted by
//! the supervisor, and `rivet node down` leaving nothing behind (no
//! namespace, pins, sockets, CNI files or processes).
//!
//! Needs root, a bpffs at /sys/fs/bpf and the workspace binaries beside
//! `rivet` (`cargo build --bins`). Addresses come from 198.18.0.0/15 and
//! 2001:2::/48 only.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rivet_cli::node::{DaemonPhase, NODE_DAEMONS, NodePhase};
use rivet_common::privileges::{Account, resolve_group, resolve_user};
use support::{ProcCredentials, TestNode, alive, eventually, netns_list, require_binaries, rivet_bin};

mod support;

/// The node as `rivet node up` describes it: four daemons answering, the
/// CNI plugin installed, the namespace configured.
fn check_started(node: &TestNode) {
    let record = node.record();
    assert_eq!(record.phase, NodePhase::Running);
    assert_eq!(record.netns.as_deref(), Some(node.netns.as_str()));
    assert!(record.netns_created);
    let names: Vec<&str> = record.daemons.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, NODE_DAEMONS);
    for d in &record.daemons {
        assert_eq!(d.phase, DaemonPhase::Running, "{d:?}");
        assert!(alive(d.pid.unwrap()), "{d:?}");
    }
    // The datapath daemons (svc-loader, svc-gc) and svc-health run inside the node namespace, the
    // others do not.
    let in_ns = Command::new("ip")
        .args(["netns", "pids", &node.netns])
        .output()
        .unwrap();
    let in_ns = String::from_utf8_lossy(&in_ns.stdout).to_string();
    let endpoint = record.daemon("svc-endpoint").unwrap().pid.unwrap();
    for daemon in ["svc-loader", "svc-gc", "svc-health"] {
        let pid = record.daemon(daemon).unwrap().pid.unwrap();
        assert!(
            in_ns.split_whitespace().any(|p| p == pid.to_string()),
            "{daemon} runs in the node namespace: {in_ns}"
        );
    }
    assert!(!in_ns.split_whitespace().any(|p| p == endpoint.to_string()), "{in_ns}");
    // The namespace: forwarding on, node addresses on lo.
    let lo = Command::new("ip")
        .args(["-n", &node.netns, "addr", "show", "dev", "lo"])
        .output()
        .unwrap();
    let lo = String::from_utf8_lossy(&lo.stdout).to_string();
    assert!(
        lo.contains("198.19.0.1/32") && lo.contains("2001:2:0:ffff::1/128"),
        "{lo}"
    );
    // svc-health's group (the daemon user's) may open ICMP echo sockets, in the node namespace only.
    let range = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node.netns,
            "sysctl",
            "-n",
            "net.ipv4.ping_group_range",
        ])
        .output()
        .unwrap();
    let gid = installed_user("rivet").gid;
    assert_eq!(
        String::from_utf8_lossy(&range.stdout)
            .split_whitespace()
            .collect::<Vec<_>>(),
        [gid.to_string(), gid.to_string()]
    );
    // svc-health answers (a node alone has no peer to probe).
    let health = node.ok(&["health", "-o", "json"]);
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["peers"], 0, "{health}");
    // The CNI files.
    let conflist: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record.conflist).unwrap()).unwrap();
    // The newest version common runtimes read (containerd 1.6: up to 1.0.0).
    assert_eq!(conflist["cniVersion"], "1.0.0");
    assert_eq!(conflist["name"], "rivet");
    assert_eq!(conflist["plugins"][0]["type"], "rivet-cni");
    assert_eq!(
        conflist["plugins"][0]["socketDir"],
        record.socket_dir.display().to_string()
    );
    assert!(record.cni_binary.is_file());
    // loopback beside rivet-cni (containerd runs it for every pod), copied
    // from the machine's plugins and recorded for node down.
    let loopback = record.cni_binary.with_file_name("loopback");
    assert!(loopback.is_file(), "{} is installed", loopback.display());
    assert_eq!(record.cni_plugins, [loopback]);
    // --cni-version offers exactly what the installed rivet-cni supports.
    let version = Command::new(&record.cni_binary)
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let version: serde_json::Value = serde_json::from_slice(&version.stdout).unwrap();
    assert_eq!(
        version["supportedVersions"],
        serde_json::json!(rivet_cli::node::CNI_VERSIONS)
    );
    assert!(record.pin_dir.is_dir(), "svc-loader pinned its maps");
    // `rivet status` finds the sockets through node.json.
    let out = Command::new(rivet_bin())
        .arg("--state-dir")
        .arg(node.state_dir())
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("node {} (netns {}", record.node_name, node.netns)),
        "{text}"
    );
}

#[test]
fn node_up_pods_through_rivet_cni_restart_and_down_leave_nothing() {
    let mut node = TestNode::up();
    check_started(&node);

    // `rivet node list`: a node alone (embedded store) lists itself, marked.
    let list = node.json(&["node", "list"]);
    assert_eq!(
        (&list["cluster"], &list["listed"]),
        (&"default".into(), &true.into()),
        "{list}"
    );
    let nodes = list["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1, "{list}");
    assert_eq!(nodes[0]["name"], node.netns.as_str(), "{list}");
    assert_eq!(nodes[0]["local"], true, "{list}");
    assert_eq!(nodes[0]["routing"], "none", "{list}");
    assert_eq!(nodes[0]["source"], "node", "{list}");
    let table = node.ok(&["node", "list"]);
    assert!(table.contains(&format!("{} *", node.netns)), "{table}");

    node.ok(&["pod", "add", "a", "--label", "app=a"]);
    node.ok(&["pod", "add", "b", "--label", "app=b", "--namespace", "default"]);
    let pods = node.json(&["pod", "list"]);
    for pod in pods.as_array().unwrap() {
        assert_eq!(pod["state"], "ready", "{pod}");
        assert!(pod["endpoint_id"].as_u64().is_some(), "{pod}");
        assert!(pod["identity"].as_u64().is_some_and(|i| i >= 256), "{pod}");
        assert_eq!(pod["addresses"].as_array().unwrap().len(), 2, "dual stack: {pod}");
    }
    // Adding the same pod again is refused.
    let again = node.rivet(&["pod", "add", "a"]).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists already"));

    // Traffic both ways, both families, ICMP and TCP.
    let b = node.addresses("b");
    for address in &b {
        assert!(node.ping("a", address), "a -> b {address}");
    }
    assert!(node.ping("b", &node.ipv4("a")), "b -> a");
    let mut server = node.spawn_in("b", &["busybox", "nc", "-ll", "-p", "8080", "-e", "cat"]);
    let b4 = node.ipv4("b");
    eventually("b's echo server answers", Duration::from_secs(10), || {
        node.tcp_echo("a", &b4, 8080)
    });

    // The node's svc-gc sweeps the real conntrack maps with svc-endpoint's
    // endpoint list, and keeps the entries of live connections.
    let pass = node.json(&["gc", "run"]);
    assert_eq!(pass["trigger"], "run-now", "{pass}");
    assert_eq!(
        pass["orphan_check"], "done",
        "svc-gc must check orphans against the node's endpoints: {pass}"
    );
    assert!(
        pass["scanned"].as_u64().unwrap() > 0,
        "the pods' connections are in conntrack: {pass}"
    );
    assert_eq!(
        pass["deleted"]["orphaned_endpoint"], 0,
        "entries of existing pods are not orphans: {pass}"
    );
    assert!(
        node.tcp_echo("a", &b4, 8080),
        "a GC pass must not break a live connection's path"
    );

    // kill -9: the supervisor restarts the daemon; pods keep their traffic
    // and endpoints.
    for daemon in ["svc-endpoint", "svc-loader", "svc-gc"] {
        node.kill9_and_wait_for_restart(daemon);
        assert!(node.ping("a", &b4), "a -> b after {daemon} restarted");
        assert!(node.tcp_echo("a", &b4, 8080), "TCP a -> b after {daemon} restarted");
    }
    eventually("endpoints ready after the restarts", Duration::from_secs(30), || {
        node.json(&["pod", "list"])
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["state"] == "ready")
    });

    // pod del is idempotent and removes the namespace.
    let a_netns = node.json(&["pod", "list"])[0]["netns"].as_str().unwrap().to_string();
    assert!(node.ok(&["pod", "del", "a"]).contains("deleted"));
    assert!(node.ok(&["pod", "del", "a"]).contains("not found"));
    assert!(!netns_list().contains(&a_netns));
    let endpoints = node.json(&["endpoint", "list"]);
    assert_eq!(endpoints["endpoints"].as_array().map(Vec::len), Some(1), "{endpoints}");

    // b is still there: node down deletes it (and its echo server).
    node.down_and_check_nothing_left();
    let _ = server.wait();
}

// ---------------------------------------------------------------------------
// Privileges: each daemon runs as its user with only its capabilities, the
// unprivileged users cannot touch the datapath, and each socket admits only
// who needs it.

/// Capability bits (linux/capability.h) of svc-loader's table.
const CAP_NET_ADMIN: u64 = 1 << 12;
const CAP_PERFMON: u64 = 1 << 38;
const CAP_BPF: u64 = 1 << 39;

/// A user `cargo xtask install` creates.
fn installed_user(name: &str) -> Account {
    resolve_user(name).unwrap_or_else(|e| panic!("{e}: run `cargo xtask install` first (it creates the rivet users)"))
}

/// Runs `f` on a thread with `user`'s uid, gid and groups and no
/// capabilities. Raw setgroups/setresgid/setresuid syscalls change only the
/// calling thread (glibc's wrappers would change every thread of the test),
/// and going from root to another uid clears the thread's capabilities.
/// Processes it spawns get the same credentials.
fn as_user<R: Send>(user: &Account, f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let groups: Vec<libc::gid_t> = user.groups.clone();
                // SAFETY: syscalls on this thread's credentials; `groups` outlives the call.
                unsafe {
                    assert_eq!(libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()), 0);
                    assert_eq!(libc::syscall(libc::SYS_setresgid, user.gid, user.gid, user.gid), 0);
                    assert_eq!(libc::syscall(libc::SYS_setresuid, user.uid, user.uid, user.uid), 0);
                }
                let me = ProcCredentials::of("thread-self");
                assert_eq!(me.uids, [user.uid; 4]);
                assert_eq!(me.cap["CapEff"] | me.cap["CapPrm"], 0, "no capabilities left");
                f()
            })
            .join()
            .unwrap()
    })
}

/// One bpf(2) call with a 128-byte attribute; the fd (closed) or the errno.
fn bpf(cmd: libc::c_long, attr: &[u64; 16]) -> Result<(), i32> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of the given size; every
    // pointer in it points to memory the caller keeps alive for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_ptr(), std::mem::size_of_val(attr)) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    // SAFETY: the kernel just gave us this fd.
    unsafe { libc::close(fd as i32) };
    Ok(())
}

/// BPF_OBJ_GET: opens a pinned map.
fn open_pin(path: &Path) -> Result<(), i32> {
    let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [0u64; 16];
    attr[0] = path.as_ptr() as u64;
    bpf(7, &attr)
}

/// BPF_PROG_LOAD of the smallest `sched_cls` program (`r0 = 0; exit`).
fn load_tc_program() -> Result<(), i32> {
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    let mut attr = [0u64; 16];
    attr[0] = 3 | (2 << 32); // BPF_PROG_TYPE_SCHED_CLS, 2 instructions
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    bpf(5, &attr)
}

/// BPF_PROG_GET_FD_BY_ID: the program a tc filter runs.
fn program_by_id(id: u32) -> Result<(), i32> {
    let mut attr = [0u64; 16];
    attr[0] = u64::from(id);
    bpf(13, &attr)
}

#[test]
fn daemons_run_with_only_their_privileges_and_sockets_admit_only_who_needs_them() {
    let daemon_user = installed_user("rivet");
    let datapath_user = installed_user("rivet-datapath");
    let reader_gid = resolve_group("rivet-readers").expect("rivet-readers exists: run `cargo xtask install`");
    let mut node = TestNode::up();
    node.ok(&["pod", "add", "a", "--label", "app=a"]);
    let record = node.record();

    // Every daemon's credentials, from /proc: exactly the table.
    let loader_caps = CAP_BPF | CAP_NET_ADMIN | CAP_PERFMON;
    for (daemon, user, caps) in [
        ("svc-ipam", &daemon_user, 0),
        ("svc-identity", &daemon_user, 0),
        ("svc-endpoint", &daemon_user, 0),
        ("svc-loader", &datapath_user, loader_caps),
        ("svc-gc", &datapath_user, 0),
        ("svc-health", &daemon_user, 0),
    ] {
        let pid = record.daemon(daemon).unwrap().pid.unwrap();
        let creds = ProcCredentials::of(&pid.to_string());
        assert_eq!(creds.uids, [user.uid; 4], "{daemon}: real, effective, saved, fs uid");
        assert_eq!(creds.gids, [user.gid; 4], "{daemon}: gids");
        assert_eq!(creds.groups, user.groups, "{daemon}: supplementary groups");
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(creds.cap[set], caps, "{daemon}: {set} is {:#x}", creds.cap[set]);
        }
        assert_eq!((creds.cap["CapInh"], creds.cap["CapAmb"]), (0, 0), "{daemon}");
        assert!(creds.no_new_privs, "{daemon}: no_new_privs");
    }
    // `rivet node status` shows the same, read from /proc.
    let status = node.ok(&["node", "status"]);
    for (daemon, user, caps) in [
        ("svc-ipam", "rivet", "-"),
        ("svc-loader", "rivet-datapath", "net_admin,perfmon,bpf"),
        ("svc-gc", "rivet-datapath", "-"),
    ] {
        let line = status
            .lines()
            .find(|l| l.trim_start().starts_with(daemon))
            .unwrap_or_else(|| panic!("{daemon} in {status}"));
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(columns[columns.len() - 2..], [user, caps], "{line}");
    }

    // The unprivileged daemons' user gets EACCES / EPERM from the kernel for
    // the datapath: its pins, loading a program, the attached program, tc.
    let pin = record.pin_dir.join("endpoints");
    let netns = record.netns.clone().unwrap();
    let links = Command::new("ip")
        .args(["-n", &netns, "-o", "link", "show"])
        .output()
        .unwrap();
    let veth = String::from_utf8_lossy(&links.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap().to_string())
        .find(|n| n.starts_with("lxc"))
        .expect("pod a's host veth in the node namespace");
    let filters = || {
        let out = Command::new("tc")
            .args(["-n", &netns, "filter", "show", "dev", &veth, "ingress"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let before = filters();
    let prog_id: u32 = before
        .split_whitespace()
        .skip_while(|w| *w != "id")
        .nth(1)
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("from_container's program id in `tc filter show`: {before}"));
    let denied = as_user(&daemon_user, || {
        (open_pin(&pin), load_tc_program(), program_by_id(prog_id))
    });
    assert_eq!(
        denied,
        (Err(libc::EACCES), Err(libc::EPERM), Err(libc::EPERM)),
        "the rivet user: open {}, load a tc program, get program {prog_id}",
        pin.display()
    );
    // The pin is there for its owner (svc-gc's user): the refusal is about the uid.
    assert_eq!(as_user(&datapath_user, || open_pin(&pin)), Ok(()));
    // Entering the node namespace needs CAP_SYS_ADMIN: nsenter as root, then drop to the user.
    let tc = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .args([
            "setpriv",
            "--reuid",
            &daemon_user.uid.to_string(),
            "--regid",
            &daemon_user.gid.to_string(),
        ])
        .args([
            "--init-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ])
        .args(["tc", "filter", "del", "dev", &veth, "ingress"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&tc.stderr);
    assert!(
        !tc.status.success() && stderr.contains("Operation not permitted"),
        "detaching the datapath as the rivet user: {stderr}"
    );
    assert_eq!(filters(), before, "the datapath stays attached");

    // Sockets: members of rivet-readers may read, not change; others may not connect.
    let as_uid = |(uid, gid): (u32, u32), groups: &[u32], args: &[&str]| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid", &uid.to_string(), "--regid", &gid.to_string()]);
        if groups.is_empty() {
            cmd.arg("--clear-groups");
        } else {
            let list: Vec<String> = groups.iter().map(u32::to_string).collect();
            cmd.args(["--groups", &list.join(",")]);
        }
        cmd.arg(rivet_bin())
            .arg("--socket-dir")
            .arg(&record.socket_dir)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let nobody = (65534, 65534);
    for read in [
        &["endpoint", "list"][..],
        &["ipam", "list"],
        &["identity", "list"],
        &["bpf", "endpoint", "list"],
        &["gc", "status"],
        &["health"],
    ] {
        let out = as_uid(nobody, &[reader_gid], read);
        assert!(
            out.status.success(),
            "an operator may run `rivet {}`: {}",
            read.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let policy = node.path("deny.yaml");
    std::fs::write(
        &policy,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: default}\n\
         spec: {podSelector: {}, policyTypes: [Ingress]}\n",
    )
    .unwrap();
    std::fs::set_permissions(&policy, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    for ((uid, gid), groups, args, method) in [
        (
            nobody,
            vec![reader_gid],
            vec!["policy", "apply", "-f", policy.to_str().unwrap()],
            "rivet.endpoint.v1.PolicyService/UpsertPolicy",
        ),
        (
            nobody,
            vec![reader_gid],
            vec!["gc", "run"],
            "rivet.gc.v1.GcService/RunNow",
        ),
        // The daemons' own user drives svc-ipam, svc-identity and svc-loader, not svc-gc.
        (
            (daemon_user.uid, daemon_user.gid),
            daemon_user.groups.clone(),
            vec!["gc", "run"],
            "rivet.gc.v1.GcService/RunNow",
        ),
    ] {
        let out = as_uid((uid, gid), &groups, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "uid {uid}: `rivet {}` must be refused",
            args.join(" ")
        );
        assert!(
            stderr.contains("PermissionDenied") && stderr.contains(&format!("uid {uid}")) && stderr.contains(method),
            "the refusal names the uid and the method: {stderr}"
        );
    }
    let policies = node.json(&["policy", "list"]);
    assert_eq!(
        policies["policies"].as_array().map(Vec::len),
        Some(0),
        "nothing was applied: {policies}"
    );
    let out = as_uid(nobody, &[], &["ipam", "list"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("permission denied by the socket file"),
        "a uid outside the group cannot connect: {stderr}"
    );

    node.down_and_check_nothing_left();
}

/// The mini libcni against Debian's reference plugins (bridge + host-local),
/// run inside the node namespace: independent of rivet-cni.
#[test]
fn pods_through_the_reference_plugins() {
    let mut node = TestNode::up();
    let conflist = node.path("bridge.conflist");
    let host_local = node.path("host-local");
    std::fs::write(
        &conflist,
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "br",
            "plugins": [{
                "type": "bridge",
                "bridge": "rvbr0",
                "isGateway": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "198.18.8.0/24"}]],
                    "dataDir": host_local,
                },
            }],
        })
        .to_string(),
    )
    .unwrap();
    let conflist = conflist.display().to_string();
    for pod in ["x", "y"] {
        let out = node.ok(&[
            "pod",
            "add",
            pod,
            "--label",
            "app=ref",
            "--conflist",
            &conflist,
            "--cni-bin-dir",
            "/usr/lib/cni",
        ]);
        assert!(
            out.contains(&format!("pod default/{pod} added: eth0 198.18.8.")),
            "{out}"
        );
    }
    let pods = node.json(&["pod", "list"]);
    assert_eq!(pods[0]["state"], "no endpoint", "{pods}");
    // The bridge lives in the node namespace (the plugins ran there).
    let links = Command::new("ip")
        .args(["-n", &node.netns, "link", "show", "rvbr0"])
        .output()
        .unwrap();
    assert!(links.status.success(), "the bridge is in the node namespace");
    let y = node.ipv4("y");
    assert!(node.ping("x", &y));
    // `pod exec` passes the exit status through.
    assert_eq!(node.exec("x", &["sh", "-c", "exit 7"]).status.code(), Some(7));
    let missing = node.rivet(&["pod", "exec", "nope", "--", "true"]).output().unwrap();
    assert!(!missing.status.success());

    // DEL through host-local releases the address (its store has a file per
    // reserved address).
    let store = Path::new(&host_local).join("br");
    assert!(store.join(&y).exists());
    node.ok(&["pod", "del", "y"]);
    assert!(!store.join(&y).exists(), "y's address is released");
    node.ok(&[
        "pod",
        "add",
        "z",
        "--conflist",
        &conflist,
        "--cni-bin-dir",
        "/usr/lib/cni",
    ]);
    node.down_and_check_nothing_left();
    // host-local's store is empty: node down ran DEL for x and z.
    let left: Vec<_> = std::fs::read_dir(Path::new(&host_local).join("br"))
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter()
            .all(|n| n.to_string_lossy().starts_with("last_reserved") || n == "lock"),
        "{left:?}"
    );
}

/// The supervisor on its own, with the real svc-ipam: restarts after
/// SIGKILL with backoff, reports a crash loop, and stops it for good.
#[tokio::test(flavor = "current_thread")]
async fn supervisor_restarts_and_reports_a_crash_loop() {
    use std::sync::{Arc, Mutex};

    use rivet_cli::node::{DaemonSpec, DaemonStatus, NodeSupervisor, RestartPolicy, StatusObserver};

    require_binaries();
    let dir = tempfile::Builder::new().prefix("rvs").tempdir_in("/tmp").unwrap();
    let socket = dir.path().join("sockets/svc-ipam.sock");
    let spec = DaemonSpec {
        name: "svc-ipam".into(),
        program: rivet_bin().with_file_name("svc-ipam"),
        args: ["--socket-dir", "sockets", "--state-dir", "state", "--node-name", "sup"]
            .iter()
            .map(|a| match *a {
                "sockets" | "state" => dir.path().join(a).into_os_string(),
                a => a.into(),
            })
            .chain(["--pool".into(), "default=198.18.12.0/24".into()])
            .collect(),
        netns: None,
        socket,
        log: dir.path().join("logs/svc-ipam.log"),
    };
    let phases = Arc::new(Mutex::new(Vec::new()));
    let observer: StatusObserver = {
        let phases = Arc::clone(&phases);
        Arc::new(move |s: &[DaemonStatus]| phases.lock().unwrap().push(s[0].phase))
    };
    let policy = RestartPolicy {
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(400),
        healthy_after: Duration::from_secs(60),
        crash_loop_window: Duration::from_secs(60),
        crash_loop_exits: 3,
    };
    let mut supervisor = NodeSupervisor::new(
        vec![spec],
        policy,
        Duration::from_secs(15),
        Duration::from_secs(5),
        observer,
    );
    let (_cancel_tx, cancel) = tokio::sync::watch::channel(false);
    supervisor.start(&cancel).await.expect("svc-ipam starts");

    let mut pids = Vec::new();
    for round in 1..=3u32 {
        let status = supervisor.statuses()[0].clone();
        let pid = status.pid.expect("running");
        pids.push(pid);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = supervisor.statuses()[0].clone();
            if s.phase == DaemonPhase::Running && s.pid.is_some_and(|p| p != pid) {
                assert_eq!(s.restarts, round);
                assert_eq!(s.last_exit.as_deref(), Some("signal 9 (SIGKILL)"));
                break;
            }
            assert!(
                Instant::now() < deadline,
                "svc-ipam restarted after kill {round}: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let seen = phases.lock().unwrap().clone();
    let crash_loop_at = seen.iter().position(|p| *p == DaemonPhase::CrashLoop);
    assert!(
        crash_loop_at.is_some(),
        "the third quick exit is a crash loop: {seen:?}"
    );
    assert_eq!(
        seen.iter().filter(|p| **p == DaemonPhase::Restarting).count(),
        2,
        "{seen:?}"
    );
    // Every start is marked in the daemon's log.
    let log = std::fs::read_to_string(dir.path().join("logs/svc-ipam.log")).unwrap();
    assert_eq!(log.matches("==== rivet node: starting svc-ipam").count(), 4, "{log}");

    let last = supervisor.statuses()[0].pid.unwrap();
    supervisor.stop().await;
    let s = supervisor.statuses()[0].clone();
    assert_eq!(s.phase, DaemonPhase::Stopped);
    assert!(s.pid.is_none());
    for pid in pids.into_iter().chain([last]) {
        assert!(!alive(pid), "pid {pid} is gone");
    }
}

/// Python's grpcio as a client of another language would use it: default
/// options, the generic unary call (no generated stubs), `GetInfo` on the
/// socket given as the first argument with each target spelling; prints one
/// line per call: `ok <hex of the reply>` or `error <code> <details>`.
const GRPCIO_CLIENT: &str = r#"
import sys, grpc
path = sys.argv[1]
for target in ("unix:" + path, "unix://" + path):
    channel = grpc.insecure_channel(target)
    try:
        reply = channel.unary_unary("/rivet.daemon.v1.Daemon/GetInfo")(b"", timeout=10)
        print("ok", reply.hex(), grpc.__version__)
    except grpc.RpcError as e:
        print("error", e.code(), e.details(), grpc.__version__)
    channel.close()
"#;

/// grpcio-reflection's client on the socket given as the first argument:
/// prints the advertised services (comma-separated) and the output type of
/// `rivet.daemon.v1.Daemon/GetInfo`, resolved through reflection alone.
const GRPCIO_REFLECTION_CLIENT: &str = r#"
import sys, grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
channel = grpc.insecure_channel("unix:" + sys.argv[1])
database = ProtoReflectionDescriptorDatabase(channel)
services = sorted(database.get_services())
method = DescriptorPool(database).FindServiceByName("rivet.daemon.v1.Daemon").FindMethodByName("GetInfo")
print(",".join(services), method.output_type.full_name)
"#;

/// PyPI's grpcio, installed by `cargo xtask install` (xtask's `GRPCIO_VENV`).
const PYPI_GRPCIO_PYTHON: &str = "/opt/rivet-test/grpcio-venv/bin/python";

/// Every daemon's socket answers Python's grpcio with default options:
/// Debian's grpcio 1.51 (sends `:authority localhost`) and PyPI's newer one
/// (sends the socket path percent-encoded, which h2 alone refuses with
/// RST_STREAM PROTOCOL_ERROR).
#[test]
fn python_grpcio_with_default_options_reaches_every_daemon() {
    use prost::Message as _;
    use rivet_proto::daemon::v1::DaemonInfo;

    for python in ["/usr/bin/python3", PYPI_GRPCIO_PYTHON] {
        let probe = Command::new(python).args(["-c", "import grpc"]).output();
        assert!(
            probe.as_ref().is_ok_and(|o| o.status.success()),
            "{python} cannot import grpc (install it with `cargo xtask install`: Debian's python3-grpcio and \
             PyPI's grpcio in /opt/rivet-test/grpcio-venv): {probe:?}"
        );
    }
    let mut node = TestNode::up();
    let record = node.record();
    for daemon in &record.daemons {
        for python in ["/usr/bin/python3", PYPI_GRPCIO_PYTHON] {
            let out = Command::new(python)
                .args(["-c", GRPCIO_CLIENT])
                .arg(&daemon.socket)
                .stdin(Stdio::null())
                .output()
                .expect("running python");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{python}: {}{text}",
                String::from_utf8_lossy(&out.stderr)
            );
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 2, "{text}");
            for line in lines {
                let fields: Vec<&str> = line.splitn(3, ' ').collect();
                assert_eq!(
                    fields[0],
                    "ok",
                    "{python} → {} ({}): {line}",
                    daemon.name,
                    daemon.socket.display()
                );
                let bytes: Vec<u8> = (0..fields[1].len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&fields[1][i..i + 2], 16).unwrap())
                    .collect();
                let info = DaemonInfo::decode(bytes.as_slice()).expect("a DaemonInfo");
                assert_eq!(info.name, daemon.name, "{line}");
                assert_eq!(info.node_name, record.node_name);
                assert_eq!(Some(info.pid), daemon.pid, "the supervised process answered");
            }
        }
    }
    // Server reflection: a generic client learns each daemon's services
    // and their message types from the socket alone (grpcio-reflection,
    // v1alpha as grpcurl asks first), and only that daemon's.
    for daemon in &record.daemons {
        let out = Command::new(PYPI_GRPCIO_PYTHON)
            .args(["-c", GRPCIO_REFLECTION_CLIENT])
            .arg(&daemon.socket)
            .stdin(Stdio::null())
            .output()
            .expect("running python");
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            out.status.success(),
            "reflection on {}: {}{text}",
            daemon.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let (services, get_info) = text.split_once(' ').unwrap_or_default();
        assert_eq!(get_info, "rivet.daemon.v1.DaemonInfo", "{text}");
        let own = format!("rivet.{}.v1.", daemon.name.trim_start_matches("svc-"));
        let services: Vec<&str> = services.split(',').collect();
        assert!(services.contains(&"rivet.daemon.v1.Daemon"), "{text}");
        assert!(
            services.iter().any(|s| s.starts_with(&own)),
            "{} advertises its own: {text}",
            daemon.name
        );
        assert!(
            services
                .iter()
                .all(|s| s.starts_with(&own) || *s == "rivet.daemon.v1.Daemon"),
            "{} advertises only its own services: {text}",
            daemon.name
        );
    }
    node.down_and_check_nothing_left();
}

/// A pod made the way a runtime makes it: its own network namespace and the
/// node's conflist run through the CNI plugin (the mini libcni of `rivet
/// pod`, without a pod record). DEL and the namespace go on drop.
struct RuntimePod {
    runner: rivet_cli::pod::CniRunner,
    list: rivet_cli::pod::NetworkConfigList,
    attachment: rivet_cli::pod::Attachment,
    netns: String,
    result: Option<serde_json::Value>,
}

impl RuntimePod {
    fn add(node: &TestNode, namespace: &str, name: &str) -> Self {
        let record = node.record();
        let netns = format!("rvtr-{}-{name}", std::process::id());
        rivet_cli::netns::create(&netns).expect("creating the pod's namespace");
        let mut pod = Self {
            runner: rivet_cli::pod::CniRunner {
                cni_path: vec![record.cni_bin_dir.clone()],
                node_netns: record.netns_path.clone(),
                timeout: Duration::from_secs(60),
                stderr_log: None,
            },
            list: rivet_cli::pod::NetworkConfigList::load(&record.conflist).expect("the node's conflist"),
            attachment: rivet_cli::pod::Attachment {
                container_id: format!("{:0>64}", format!("{}{name}", std::process::id())),
                netns: rivet_cli::netns::path(&netns),
                ifname: "eth0".into(),
                pod_namespace: namespace.into(),
                pod_name: name.into(),
                labels: Default::default(),
                ports: Vec::new(),
            },
            netns,
            result: None,
        };
        let result = pod.runner.add(&pod.list, &pod.attachment).expect("CNI ADD");
        pod.result = Some(result);
        pod
    }

    fn ipv4(&self) -> String {
        rivet_cli::pod::result_addresses(self.result.as_ref())
            .into_iter()
            .find(|a| a.contains('.'))
            .expect("an IPv4 address")
    }
}

impl Drop for RuntimePod {
    fn drop(&mut self) {
        if let Err(e) = self.runner.del(&self.list, &self.attachment, self.result.as_ref()) {
            eprintln!("DEL of the runtime pod: {e}");
        }
        let _ = rivet_cli::netns::delete(&self.netns);
    }
}

/// A policy isolating app=rt in namespace shop: only app=client may reach it.
const RUNTIME_POD_POLICY: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: rt-ingress, namespace: shop}
spec:
  podSelector: {matchLabels: {app: rt}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
";

/// Without Kubernetes, a pod a runtime created (no `rivet pod add` record,
/// no labels in the CNI call) is listed by `rivet pod list`, gets labels
/// with `rivet endpoint label`, and a policy selecting it then applies; a
/// policy selecting nothing draws a warning (exit 0).
#[test]
fn pods_a_runtime_created_are_listed_labelled_and_selected() {
    let mut node = TestNode::up();
    node.ok(&["pod", "add", "client", "-n", "shop", "--label", "app=client"]);
    node.ok(&["pod", "add", "other", "-n", "shop", "--label", "app=other"]);
    let runtime = RuntimePod::add(&node, "shop", "rt");

    let pods = node.json(&["pod", "list"]);
    let row = pods
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "rt")
        .unwrap_or_else(|| panic!("the runtime's pod is listed: {pods:#}"));
    assert_eq!(row["namespace"], "shop", "{row}");
    assert_eq!(row["created_by"], "runtime", "{row}");
    assert_eq!(row["state"], "ready", "{row}");
    assert_eq!(row["container_id"], runtime.attachment.container_id.as_str());
    assert_eq!(row["addresses"].as_array().unwrap().len(), 2, "{row}");
    let client = pods.as_array().unwrap().iter().find(|p| p["name"] == "client").unwrap();
    assert_eq!(client["created_by"], "rivet-pod", "{client}");
    let table = node.ok(&["pod", "list"]);
    assert!(
        table.lines().any(|l| l.contains(" rt ") && l.contains("runtime")),
        "{table}"
    );

    // The policy selects no pod yet: applied, with a warning.
    let policy = node.path("rt-policy.yaml");
    std::fs::write(&policy, RUNTIME_POD_POLICY).unwrap();
    let out = node
        .rivet(&["policy", "apply", "-f", policy.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: NetworkPolicy/shop/rt-ingress selects no endpoint"),
        "{stderr}"
    );
    let rt = runtime.ipv4();
    let ping_rt = |from: &str| {
        node.rivet(&[
            "pod", "exec", from, "-n", "shop", "--", "ping", "-c", "2", "-i", "0.2", "-W", "2", &rt,
        ])
        .output()
        .unwrap()
        .status
        .success()
    };
    assert!(ping_rt("other"), "unlabelled, rt is not isolated");

    // Labels for the runtime's pod: re-identified, now selected and isolated.
    let labelled = node.json(&["endpoint", "label", "shop/rt", "app=rt"]);
    assert_eq!(labelled["reidentified"], 1, "{labelled}");
    assert_eq!(
        labelled["endpoints"][0]["labels"],
        serde_json::json!(["k8s:app=rt"]),
        "{labelled}"
    );
    let id = labelled["endpoints"][0]["id"].clone();
    let got = node.json(&["policy", "get", "shop/rt-ingress"]);
    assert_eq!(got["selected_endpoints"], serde_json::json!([id]), "{got}");
    assert!(ping_rt("client"), "client may reach rt");
    assert!(!ping_rt("other"), "other is denied once rt is selected");
    let out = node
        .rivet(&["policy", "apply", "-f", policy.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "a policy that selects a pod draws no warning"
    );
    let pods = node.json(&["pod", "list"]);
    let row = pods.as_array().unwrap().iter().find(|p| p["name"] == "rt").unwrap();
    assert_eq!(row["labels"], serde_json::json!({"app": "rt"}), "{row}");

    // Replace semantics: the complete new set.
    let relabelled = node.json(&["endpoint", "label", "shop/rt", "tier=x"]);
    assert_eq!(relabelled["endpoints"][0]["labels"], serde_json::json!(["k8s:tier=x"]));
    assert!(ping_rt("other"), "no longer app=rt: no longer isolated");
    let bad = node
        .rivet(&["endpoint", "label", "shop/rt", "novalue"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not a label"));

    drop(runtime);
    let pods = node.json(&["pod", "list"]);
    assert!(
        pods.as_array().unwrap().iter().all(|p| p["name"] != "rt"),
        "DEL removes it from the list: {pods:#}"
    );
    node.down_and_check_nothing_left();
}

/// NetworkPolicy for `named_port`: app=server accepts app=client on the port
/// named `web` only.
const NAMED_PORT_POLICY: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-web, namespace: default}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: web}]
";

/// Named ports without Kubernetes: `rivet pod add --port web=TCP/8080`
/// reaches svc-endpoint through the CNI call, and an ingress rule naming
/// `web` allows exactly that port between real pods.
#[test]
fn an_ingress_rule_with_a_named_port_allows_exactly_that_port() {
    let mut node = TestNode::up();
    node.ok(&[
        "pod",
        "add",
        "server",
        "--label",
        "app=server",
        "--port",
        "web=TCP/8080",
    ]);
    node.ok(&["pod", "add", "client", "--label", "app=client"]);
    let endpoint = node.json(&["endpoint", "get", "default/server"]);
    assert_eq!(
        endpoint["named_ports"],
        serde_json::json!([{"name": "web", "protocol": "TCP", "port": 8080}]),
        "{endpoint:#}"
    );
    let mut servers: Vec<Child> = ["8080", "9090"]
        .into_iter()
        .map(|port| node.spawn_in("server", &["busybox", "nc", "-ll", "-p", port, "-e", "cat"]))
        .collect();
    let server = node.ipv4("server");
    for port in [8080, 9090] {
        eventually(&format!("server answers on {port}"), Duration::from_secs(10), || {
            node.tcp_echo("client", &server, port)
        });
    }
    let policy = node.path("named-port.yaml");
    std::fs::write(&policy, NAMED_PORT_POLICY).unwrap();
    node.ok(&["policy", "apply", "--wait", "-f", policy.to_str().unwrap()]);
    assert!(node.tcp_echo("client", &server, 8080), "the port named web is allowed");
    assert!(!node.tcp_echo("client", &server, 9090), "any other port is denied");
    node.down_and_check_nothing_left();
    for server in &mut servers {
        let _ = server.wait();
    }
}

/// GET /hello on `address:4240` from a thread in namespace `ns`: true on a 200.
fn hello_from(ns: &str, address: &str) -> bool {
    let ns = rivet_common::testing::netns::NetNs::existing(ns).unwrap();
    let target: std::net::SocketAddr = format!("{address}:4240").parse().unwrap();
    ns.in_ns(move || {
        use std::io::{Read as _, Write as _};
        let Ok(mut stream) = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = format!("GET /hello HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response.starts_with("HTTP/1.1 200")
    })
    .unwrap()
}

#[test]
fn the_health_endpoint_is_reserved_health_outside_pod_policy_survives_restarts_and_goes_with_the_node() {
    let mut node = TestNode::up_with(&["--health-endpoint"]);
    let record = node.record();
    let ns = record
        .health_netns
        .clone()
        .expect("node.json records the health endpoint's namespace");
    assert_eq!(ns, format!("hlth-{}", record.node_name));
    let health_endpoint = || {
        let endpoints = node.json(&["endpoint", "list"]);
        let list = endpoints["endpoints"].as_array().unwrap().clone();
        assert_eq!(list.len(), 1, "only the health endpoint: {endpoints}");
        list[0].clone()
    };
    let endpoint = health_endpoint();
    assert_eq!(endpoint["identity"], 4, "the reserved health identity: {endpoint}");
    assert_eq!(endpoint["identity_labels"], serde_json::json!(["reserved:health"]));
    assert_eq!(endpoint["state"], "ready");
    let address = endpoint["addresses"][0]["address"].as_str().unwrap().to_string();

    // svc-health serves /hello in it: reached from the node through the datapath.
    assert!(
        hello_from(&node.netns, &address),
        "/hello on the health endpoint {address}"
    );
    // A policy that denies every pod's ingress does not select it.
    let policy = node.path("deny-all.yaml");
    std::fs::write(
        &policy,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: default}\n\
         spec: {podSelector: {}, policyTypes: [Ingress, Egress]}\n",
    )
    .unwrap();
    node.ok(&["policy", "apply", "-f", policy.to_str().unwrap()]);
    assert_eq!(health_endpoint()["ingress_enforced"], false);
    assert!(
        hello_from(&node.netns, &address),
        "a pod policy does not cut the health endpoint off"
    );

    // svc-health and its socket helper (in the health endpoint's namespace): two processes.
    let health_processes = || processes_with_arg(&format!("/run/netns/{ns}"));
    assert_eq!(health_processes().len(), 2, "svc-health and its helper");
    // kill -9 of svc-health and svc-endpoint: the endpoint stays, with its identity, and answers again.
    for daemon in ["svc-health", "svc-endpoint"] {
        node.kill9_and_wait_for_restart(daemon);
        eventually(
            &format!("/hello after {daemon} restarted"),
            Duration::from_secs(30),
            || hello_from(&node.netns, &address),
        );
    }
    // The killed daemon's helper died with it (even though both switched to the rivet user).
    eventually("one svc-health and one helper", Duration::from_secs(10), || {
        health_processes().len() == 2
    });
    let after = health_endpoint();
    assert_eq!(
        (after["id"].clone(), after["identity"].clone()),
        (endpoint["id"].clone(), 4.into())
    );

    node.down_and_check_nothing_left();
    assert!(!netns_list().contains(&ns), "the health endpoint's namespace is gone");
    assert_eq!(health_processes(), Vec::<u32>::new(), "no svc-health process is left");
}

/// Pids of the processes with an argument containing `text`.
fn processes_with_arg(text: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|a| String::from_utf8_lossy(a).contains(text)))
        })
        .collect()
}

//! Malformed invocations of the real rivet-cni binary (issue 19 §4): bad or
//! oversized stdin, missing, path-like or conflicting `CNI_*` variables,
//! unknown versions, wrong network namespace paths, and a namespace that
//! disappears in the middle of an ADD. Each ends with the spec's error JSON
//! (the right code) on stdout, a non-zero exit, and nothing left on the
//! node: no address in svc-ipam, no endpoint, no map entry, no veth.
//! (`add_del.rs` and `failures.rs` hold the other input and step failures.)

mod common;

use std::time::{Duration, Instant};

use common::{Harness, Pod};
use serde_json::json;

/// One malformed invocation.
struct Bad {
    name: &'static str,
    env: Vec<(String, String)>,
    stdin: Vec<u8>,
    code: u64,
    /// Text the error message must contain.
    needle: &'static str,
}

/// `env` with `key` set to `value` (or removed when `None`).
fn set(env: &[(String, String)], key: &str, value: Option<&str>) -> Vec<(String, String)> {
    let mut env: Vec<_> = env.iter().filter(|(k, _)| k != key).cloned().collect();
    if let Some(value) = value {
        env.push((key.into(), value.into()));
    }
    env
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_invocations_fail_with_the_spec_codes_and_leave_nothing() {
    let h = Harness::start().await;
    let pod = Pod::new("bad-input");
    let env = Harness::env("ADD", &pod, "eth0");
    let conf = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut conf = h.conf("1.0.0");
        edit(&mut conf);
        conf.to_string().into_bytes()
    };
    let good = conf(&|_| {});
    // A valid netconf followed by 64 MiB of JSON whitespace: valid JSON,
    // and far more than a netconf.
    let mut huge = good.clone();
    huge.resize(huge.len() + (64 << 20), b' ');
    let file = tempfile::NamedTempFile::new().unwrap();
    let cases = vec![
        Bad {
            name: "empty stdin",
            env: env.clone(),
            stdin: Vec::new(),
            code: 6,
            needle: "decoding",
        },
        Bad {
            name: "not an object",
            env: env.clone(),
            stdin: b"[1, 2]".to_vec(),
            code: 6,
            needle: "JSON object",
        },
        Bad {
            name: "not UTF-8",
            env: env.clone(),
            stdin: b"{\"cniVersion\": \"\xff\xfe\"}".to_vec(),
            code: 6,
            needle: "decoding",
        },
        Bad {
            name: "nested 100,000 deep",
            env: env.clone(),
            stdin: "[".repeat(100_000).into_bytes(),
            code: 6,
            needle: "recursion limit",
        },
        Bad {
            name: "64 MiB of stdin",
            env: env.clone(),
            stdin: huge,
            code: 6,
            needle: "larger than",
        },
        Bad {
            name: "unknown cniVersion",
            env: env.clone(),
            stdin: conf(&|c| c["cniVersion"] = json!("9.9.9")),
            code: 1,
            needle: "9.9.9",
        },
        Bad {
            name: "cniVersion not a string",
            env: env.clone(),
            stdin: conf(&|c| c["cniVersion"] = json!(1.0)),
            code: 6,
            needle: "cniVersion",
        },
        Bad {
            name: "unknown CNI_COMMAND",
            env: set(&env, "CNI_COMMAND", Some("ADD;DEL")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_COMMAND",
        },
        Bad {
            name: "no CNI_CONTAINERID",
            env: set(&env, "CNI_CONTAINERID", None),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_CONTAINERID",
        },
        Bad {
            name: "path-like CNI_CONTAINERID",
            env: set(&env, "CNI_CONTAINERID", Some("../../etc/passwd")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_CONTAINERID",
        },
        Bad {
            name: "path-like CNI_IFNAME",
            env: set(&env, "CNI_IFNAME", Some("../eth0")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_IFNAME",
        },
        Bad {
            name: "CNI_IFNAME over 15 bytes",
            env: set(&env, "CNI_IFNAME", Some("eth0123456789012")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_IFNAME",
        },
        Bad {
            name: "relative CNI_NETNS",
            env: set(&env, "CNI_NETNS", Some("proc/1/ns/net")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_NETNS",
        },
        Bad {
            name: "CNI_NETNS that does not exist",
            env: set(&env, "CNI_NETNS", Some("/run/netns/rivet-no-such-pod")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_NETNS",
        },
        Bad {
            name: "CNI_NETNS a directory",
            env: set(&env, "CNI_NETNS", Some("/run")),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_NETNS",
        },
        Bad {
            name: "CNI_NETNS a regular file",
            env: set(&env, "CNI_NETNS", file.path().to_str()),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_NETNS",
        },
        Bad {
            name: "CNI_ARGS naming the pod twice",
            env: set(
                &env,
                "CNI_ARGS",
                Some("K8S_POD_NAMESPACE=default;K8S_POD_NAME=a;K8S_POD_NAME=b"),
            ),
            stdin: good.clone(),
            code: 4,
            needle: "more than once",
        },
        Bad {
            name: "CHECK without CNI_NETNS",
            env: set(&set(&env, "CNI_COMMAND", Some("CHECK")), "CNI_NETNS", None),
            stdin: good.clone(),
            code: 4,
            needle: "CNI_NETNS",
        },
    ];
    let links = pod.ns.ip(&["-o", "link", "show"]).unwrap();
    for case in cases {
        let started = Instant::now();
        let run = h.exec_bin(&h.bin, &case.env, &case.stdin).await;
        let msg = run.err_code(case.code);
        assert!(
            msg.contains(case.needle),
            "{}: the message should mention {:?}: {msg}",
            case.name,
            case.needle
        );
        assert_eq!(
            run.stdout.trim().lines().count(),
            1,
            "{}: stdout holds the error JSON only: {}",
            case.name,
            run.stdout
        );
        h.assert_clean(&h.leftovers().await, case.name);
        assert_eq!(
            pod.ns.ip(&["-o", "link", "show"]).unwrap(),
            links,
            "{}: the pod's links changed",
            case.name
        );
        eprintln!("{}: code {} in {:?}: {msg}", case.name, case.code, started.elapsed());
    }

    // After all that, the node works.
    let r = h.add(&pod, "1.0.0").await;
    assert!(r["ips"].as_array().is_some_and(|ips| ips.len() == 2), "{r}");
    h.del(&pod, "1.0.0").await;
    h.assert_clean(&h.leftovers().await, "after a normal ADD and DEL");
}

/// Sends `signal` to `pid` (a daemon of the node).
fn signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill(2) on a child process of this test; no memory is involved.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill({pid}, {signal}): {}", std::io::Error::last_os_error());
}

/// Polls `done` (a condition on the node) every 10 ms until it holds or
/// `within` passes; whether it held.
async fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_namespace_deleted_in_the_middle_of_add_leaves_nothing() {
    let h = Harness::start().await;
    let pod = Pod::new("vanish");
    let conf = h.conf("1.0.0");
    // svc-loader stopped: the ADD waits in CreateEndpoint (which realises
    // the datapath synchronously) with the veth already made; the namespace
    // goes then, and svc-loader goes on.
    let loader = h.node.node.loader.pid().expect("svc-loader runs");
    signal(loader, libc::SIGSTOP);
    let vanish = async {
        let made = wait_until(Duration::from_secs(30), || !h.host_veths().is_empty()).await;
        let deleted = std::process::Command::new("ip")
            .args(["netns", "del", pod.ns.name()])
            .status()
            .unwrap();
        signal(loader, libc::SIGCONT);
        assert!(made, "the ADD never made its host veth");
        assert!(deleted.success(), "ip netns del {}", pod.ns.name());
    };
    let (run, ()) = tokio::join!(h.cni("ADD", &pod, &conf), vanish);
    let outcome = run.json();
    eprintln!(
        "ADD with its namespace deleted under it: {outcome} in {:?}",
        run.elapsed
    );
    if run.status.success() {
        // The plugin finished before the namespace was gone: the runtime's
        // DEL (its namespace path gone, as the spec allows) removes it all.
        assert!(outcome["ips"].is_array(), "{outcome}");
    } else {
        let error = run.err();
        assert!(
            [4, 11, 100, 101, 102].contains(&error["code"].as_u64().unwrap()),
            "an error of the spec or of rivet-cni's own range: {error}"
        );
    }
    let del = h.cni("DEL", &pod, &conf).await;
    assert!(del.status.success(), "DEL after the namespace is gone: {}", del.stdout);
    // The kernel destroys the pod's veth pair a moment after its namespace.
    assert!(
        wait_until(Duration::from_secs(10), || h.host_veths().is_empty()).await,
        "the host veth outlived its namespace: {:?}",
        h.host_veths()
    );
    h.assert_clean(&h.leftovers().await, "namespace deleted in the middle of ADD, then DEL");

    // The node still works.
    let ok = Pod::new("after-vanish");
    h.add(&ok, "1.0.0").await;
    h.del(&ok, "1.0.0").await;
    h.assert_clean(&h.leftovers().await, "after a normal ADD and DEL");
}

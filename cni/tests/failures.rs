//! A failure injected at each step of ADD, with the real binary and daemons,
//! leaves nothing behind: no svc-ipam allocation, no host veth, no
//! svc-endpoint endpoint, no svc-loader map entry or attachment, nothing in
//! the pod's namespace; and the error is the spec's JSON with the right code.

mod common;

use std::time::Duration;

use common::{Harness, PREFIX, Pod};
use rivet_proto::ipam::v1 as ipampb;
use serde_json::{Value, json};

struct Case {
    name: &'static str,
    code: u64,
    /// Text the message must contain.
    needle: &'static str,
}

/// The pod's links (`ip -o link` names), to compare before and after.
fn links(pod: &Pod) -> Vec<String> {
    let out = pod.ns.ip(&["-o", "link", "show"]).unwrap();
    let mut names: Vec<String> = out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_string())
        .collect();
    names.sort();
    names
}

async fn expect_failure(h: &Harness, pod: &Pod, env: &[(String, String)], conf: &Value, case: &Case) {
    let before = links(pod);
    let run = h.exec(env, conf).await;
    let msg = run.err_code(case.code);
    assert!(
        msg.contains(case.needle),
        "{}: the message should mention {:?}: {msg}",
        case.name,
        case.needle
    );
    let left = h.leftovers().await;
    h.assert_clean(&left, case.name);
    assert_eq!(links(pod), before, "{}: the pod's links changed", case.name);
    let addrs = pod.ns.ip(&["-o", "addr", "show", "scope", "global"]).unwrap();
    assert!(
        addrs.trim().is_empty(),
        "{}: addresses left in the pod: {addrs}",
        case.name
    );
    eprintln!("{}: failed as expected in {:?}: {msg}", case.name, run.elapsed);
}

/// Allocates every free IPv4 address of the node's pool (svc-ipam makes
/// concurrent allocations durable with one write) until svc-ipam answers
/// POOL_EXHAUSTED; the owners that got one.
async fn fill_ipv4(h: &Harness) -> Vec<ipampb::Owner> {
    let client = h.node.ipam_client().await;
    let mut owners = Vec::new();
    loop {
        let batch: Vec<ipampb::Owner> = (owners.len()..owners.len() + 128)
            .map(|i| ipampb::Owner {
                container_id: format!("fill-{i}"),
                interface: "eth0".into(),
            })
            .collect();
        let results = futures::future::join_all(batch.iter().map(|owner| {
            let mut client = client.clone();
            let request = ipampb::AllocateRequest {
                owner: Some(owner.clone()),
                pool: "default".into(),
                family: ipampb::Family::Ipv4.into(),
                requested_address: Vec::new(),
            };
            async move { client.allocate(request).await }
        }))
        .await;
        let mut exhausted = false;
        for (owner, result) in batch.into_iter().zip(results) {
            match result {
                Ok(_) => owners.push(owner),
                Err(status) => {
                    assert_eq!(
                        rivet_common::grpc::error_reason(&status),
                        Some(ipampb::ErrorReason::PoolExhausted),
                        "{status:?}"
                    );
                    exhausted = true;
                }
            }
        }
        if exhausted {
            return owners;
        }
    }
}

async fn release(h: &Harness, owners: Vec<ipampb::Owner>) {
    let client = h.node.ipam_client().await;
    for chunk in owners.chunks(128) {
        futures::future::join_all(chunk.iter().map(|owner| {
            let mut client = client.clone();
            let request = ipampb::ReleaseRequest {
                owner: Some(owner.clone()),
            };
            async move { client.release(request).await.expect("svc-ipam releases a filler") }
        }))
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failure_after_each_add_step_leaves_nothing() {
    let mut h = Harness::start().await;

    // Readiness: svc-endpoint unreachable (its socket missing), svc-ipam fine.
    let pod = Pod::new("f-ready");
    let sockets = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        h.node.sockets().join("svc-ipam.sock"),
        sockets.path().join("svc-ipam.sock"),
    )
    .unwrap();
    let mut conf = h.conf("1.0.0");
    conf["socketDir"] = json!(sockets.path());
    let env = Harness::env("ADD", &pod, "eth0");
    let case = Case {
        name: "svc-endpoint unreachable",
        code: 50,
        needle: "svc-endpoint",
    };
    expect_failure(&h, &pod, &env, &conf, &case).await;

    // Addresses: a pool svc-ipam does not have.
    let mut conf = h.conf("1.0.0");
    conf["ipamPool"] = json!("nope");
    let case = Case {
        name: "unknown pool",
        code: 7,
        needle: "ipamPool",
    };
    expect_failure(&h, &pod, &env, &conf, &case).await;

    // Addresses: the pool's IPv4 range is full. svc-ipam's POOL_EXHAUSTED
    // reason, not its wording, makes it 11 (addresses come free as pods go).
    let fillers = fill_ipv4(&h).await;
    let run = h.exec(&env, &h.conf("1.0.0")).await;
    let error = run.err();
    assert_eq!(error["code"], 11, "a full pool clears by itself: {error}");
    assert!(
        error["details"].as_str().unwrap().contains("reason POOL_EXHAUSTED"),
        "{error}"
    );
    release(&h, fillers).await;
    h.assert_clean(&h.leftovers().await, "pool exhausted");

    // The container namespace: a path that is not a network namespace.
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut env_file = env.clone();
    env_file.retain(|(k, _)| k != "CNI_NETNS");
    env_file.push(("CNI_NETNS".into(), file.path().display().to_string()));
    let case = Case {
        name: "not a netns",
        code: 4,
        needle: "CNI_NETNS",
    };
    expect_failure(&h, &pod, &env_file, &h.conf("1.0.0"), &case).await;

    // The veth: the pod already has an eth0 (after addresses were allocated).
    let taken = Pod::new("f-veth");
    // (No dummy driver on this kernel: a veth pair inside the pod stands in.)
    taken
        .ns
        .ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "rvpeer"])
        .unwrap();
    let case = Case {
        name: "interface name taken in the pod",
        code: 100,
        needle: "File exists",
    };
    expect_failure(
        &h,
        &taken,
        &Harness::env("ADD", &taken, "eth0"),
        &h.conf("1.0.0"),
        &case,
    )
    .await;
    assert!(taken.ns.has_link("eth0").unwrap(), "the pod's own eth0 is not touched");

    // The container's routes: the pod has a default route already.
    let routed = Pod::new("f-route");
    routed
        .ns
        .ip(&["link", "add", "rvdef", "type", "veth", "peer", "name", "rvdef1"])
        .unwrap();
    routed.ns.ip(&["link", "set", "rvdef", "up"]).unwrap();
    routed.ns.ip(&["route", "add", "default", "dev", "rvdef"]).unwrap();
    let case = Case {
        name: "default route taken in the pod",
        code: 100,
        needle: "route 0.0.0.0/0",
    };
    expect_failure(
        &h,
        &routed,
        &Harness::env("ADD", &routed, "eth0"),
        &h.conf("1.0.0"),
        &case,
    )
    .await;

    // The host routes: the requested address is routed elsewhere on the node.
    let host = Pod::new("f-host");
    h.node_ns()
        .ip(&["link", "add", "rvdum0", "type", "veth", "peer", "name", "rvdum1"])
        .unwrap();
    h.node_ns().ip(&["link", "set", "rvdum0", "up"]).unwrap();
    h.node_ns()
        .ip(&["route", "add", "198.18.3.200/32", "dev", "rvdum0"])
        .unwrap();
    let mut conf = h.conf("1.0.0");
    conf["runtimeConfig"] = json!({"ips": ["198.18.3.200/22"]});
    let case = Case {
        name: "host route taken",
        code: 100,
        needle: "host route to 198.18.3.200",
    };
    expect_failure(&h, &host, &Harness::env("ADD", &host, "eth0"), &conf, &case).await;

    // The endpoint: svc-endpoint refuses the pod's name.
    let named = Pod::new("f-endpoint");
    let mut env = Harness::env("ADD", &named, "eth0");
    env.retain(|(k, _)| k != "CNI_ARGS");
    env.push((
        "CNI_ARGS".into(),
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=Not_A_Name".into(),
    ));
    let case = Case {
        name: "CreateEndpoint refused",
        code: 102,
        needle: "pod_name",
    };
    expect_failure(&h, &named, &env, &h.conf("1.0.0"), &case).await;

    // The endpoint: the datapath is down, the synchronous create cannot
    // finish, and neither can svc-endpoint undo it (removing its datapath
    // state needs svc-loader too). rivet-cni removes the veth, keeps the
    // addresses while the endpoint exists (so they are never handed out
    // twice) and says so; the runtime's DEL finishes once svc-loader is back.
    let stalled = Pod::new("f-loader");
    h.node.node.loader.kill9();
    let mut conf = h.conf("1.0.0");
    conf["timeoutSeconds"] = json!(3);
    let run = h.cni("ADD", &stalled, &conf).await;
    let error = run.err();
    assert_eq!(error["code"], 11, "the datapath being down is transient: {error}");
    assert!(error["msg"].as_str().unwrap().contains("datapath"), "{error}");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("undoing the ADD failed too"),
        "{error}"
    );
    assert!(run.elapsed < Duration::from_secs(20), "{:?}", run.elapsed);
    assert!(h.host_veths().is_empty(), "the veth is gone at once");
    assert!(!stalled.ns.has_link("eth0").unwrap());
    let held: Vec<_> = h.allocations().await.iter().map(|a| a.address.clone()).collect();
    assert_eq!(held.len(), 2, "addresses are kept while the endpoint exists: {held:?}");
    h.node.node.loader.restart().await.expect("svc-loader restarts");
    h.cni("DEL", &stalled, &h.conf("1.0.0")).await.ok();
    h.assert_clean(&h.leftovers().await, "svc-loader down, then DEL");
    eprintln!("svc-loader down: failed as expected in {:?}: {error}", run.elapsed);

    // After all that, the node works.
    let ok = Pod::new("f-ok");
    let r = h.add(&ok, "1.0.0").await;
    assert!(r["interfaces"][0]["name"].as_str().unwrap().starts_with(PREFIX));
    h.del(&ok, "1.0.0").await;
    h.assert_clean(&h.leftovers().await, "after a normal ADD and DEL");
    h.node_ns().ip(&["link", "del", "rvdum0"]).unwrap();
}

//! The real rivet-cni binary in a node namespace against the real daemons:
//! ADD wires pods that reach each other through the datapath with a READY
//! endpoint, results per version, CHECK, DEL (twice, and after the pod's
//! namespace is gone), STATUS, GC, and the binary's input errors.

mod common;

use std::time::Duration;

use common::{CniRun, GATEWAY4, GATEWAY6, Harness, PREFIX, Pod, median_max, ping, result_ips};
use rivet_common::mac::format_mac;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::net::{format_address, mac_from_bytes};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread")]
async fn add_wires_reachable_pods_and_del_removes_everything() {
    let h = Harness::start().await;
    let (a, b) = (Pod::new("pod-a"), Pod::new("pod-b"));
    let add_a = h.cni("ADD", &a, &h.conf("1.1.0")).await;
    let ra = add_a.ok();
    let add_b = h.cni("ADD", &b, &h.conf("1.1.0")).await;
    let rb = add_b.ok();
    assert!(
        add_a.stderr.is_empty(),
        "with a logFile nothing goes to stderr: {}",
        add_a.stderr
    );

    // The result.
    assert_eq!(ra["cniVersion"], "1.1.0");
    let host = ra["interfaces"][0]["name"].as_str().unwrap().to_string();
    assert!(host.starts_with(PREFIX) && host.len() == 15, "{host}");
    assert!(ra["interfaces"][0].get("sandbox").is_none());
    assert_eq!(ra["interfaces"][1]["name"], "eth0");
    assert_eq!(ra["interfaces"][1]["sandbox"], a.path().display().to_string());
    assert_eq!(ra["interfaces"][1]["mtu"], 1500);
    assert_eq!(ra["ips"][0]["gateway"], GATEWAY4);
    assert_eq!(ra["ips"][1]["gateway"], GATEWAY6);
    assert_eq!(ra["ips"][0]["interface"], 1);
    assert!(ra["ips"][0]["address"].as_str().unwrap().ends_with("/22"), "{ra}");
    assert!(
        ra["ips"][1]["address"].as_str().unwrap().starts_with("2001:2::"),
        "{ra}"
    );
    assert_eq!(
        ra["routes"],
        json!([{"dst": "0.0.0.0/0", "gw": GATEWAY4}, {"dst": "::/0", "gw": GATEWAY6}])
    );
    let (ips_a, ips_b) = (result_ips(&ra), result_ips(&rb));

    // The wiring: what the datapath expects (DESIGN.md §8).
    let host_mac = ra["interfaces"][0]["mac"].as_str().unwrap();
    assert_eq!(h.node_ns().mac(&host).map(|m| format_mac(&m)).unwrap(), host_mac);
    let pod_addrs = a.ns.ip(&["-o", "addr", "show", "dev", "eth0"]).unwrap();
    assert!(pod_addrs.contains("noprefixroute"), "{pod_addrs}");
    let routes4 = a.ns.ip(&["route"]).unwrap();
    assert!(
        routes4.contains(&format!("default via {GATEWAY4} dev eth0")),
        "{routes4}"
    );
    assert!(routes4.contains(&format!("src {}", ips_a[0])), "{routes4}");
    assert!(!routes4.contains("198.18.0.0/22"), "no prefix route: {routes4}");
    let routes6 = a.ns.ip(&["-6", "route"]).unwrap();
    assert!(
        routes6.contains(&format!("default via {GATEWAY6} dev eth0")),
        "{routes6}"
    );
    let node_routes = h.node_ns().ip(&["route"]).unwrap();
    assert!(
        node_routes.contains(&format!("{} dev {host}", ips_a[0])),
        "{node_routes}"
    );
    let node_routes6 = h.node_ns().ip(&["-6", "route"]).unwrap();
    assert!(
        node_routes6.contains(&format!("{} dev {host}", ips_a[1])),
        "{node_routes6}"
    );
    assert!(
        !h.node_ns().ip(&["-o", "addr"]).unwrap().contains(GATEWAY4),
        "the gateway is on no interface"
    );

    // The endpoint is READY and names this veth.
    let ep = h.endpoint(&a).await.expect("an endpoint for pod-a");
    assert_eq!(ep.state, eppb::EndpointState::Ready as i32);
    assert_ne!(ep.identity, 0);
    assert_eq!(ep.host_interface, host);
    assert_eq!(ep.host_ifindex, h.node_ns().ifindex(&host).unwrap());
    assert_eq!(
        format_mac(&mac_from_bytes(&ep.mac).unwrap()),
        ra["interfaces"][1]["mac"]
    );
    assert_eq!(ep.pod_namespace, "default");
    assert_eq!(ep.pod_name, "pod-a");
    assert_eq!(ep.pod_uid, "uid-pod-a");
    let ep_addrs: Vec<String> = ep.addresses.iter().map(|a| format_address(&a.address)).collect();
    assert_eq!(ep_addrs, ips_a.iter().map(ToString::to_string).collect::<Vec<_>>());
    assert!(ep.addresses.iter().all(|a| a.ipam_pool == "default"));

    // Traffic: both families, both directions, through the gateway the
    // datapath answers ARP/ND for.
    for dst in &ips_b {
        assert_eq!(ping(&a.ns, *dst), 3, "pod-a -> {dst}\n{}", h.log_tail());
    }
    for dst in &ips_a {
        assert_eq!(ping(&b.ns, *dst), 3, "pod-b -> {dst}");
    }
    let neigh = a.ns.ip(&["neigh", "show", GATEWAY4]).unwrap();
    assert!(
        neigh.contains(host_mac),
        "the gateway resolves to the host veth: {neigh}"
    );

    // CHECK with the ADD result.
    let check = h.cni("CHECK", &a, &with_prev(h.conf("1.1.0"), &ra)).await;
    assert_eq!(check.ok(), Value::Null, "CHECK prints nothing on success");

    // DEL, twice, then without CNI_NETNS; pod-b after its namespace is gone.
    let mut del_times = Vec::new();
    for _ in 0..2 {
        let del = h.cni("DEL", &a, &with_prev(h.conf("1.1.0"), &ra)).await;
        assert_eq!(del.ok(), Value::Null);
        del_times.push(del.elapsed);
    }
    let mut env = Harness::env("DEL", &a, "eth0");
    env.retain(|(k, _)| k != "CNI_NETNS");
    h.exec(&env, &h.conf("1.1.0")).await.ok();
    assert!(h.endpoint(&a).await.is_none());
    assert!(
        !a.ns.has_link("eth0").unwrap(),
        "the container side went with the host side"
    );
    let env_b = Harness::env("DEL", &b, "eth0");
    let b_path = b.path();
    drop(b);
    assert!(!b_path.exists());
    h.exec(&env_b, &h.conf("1.1.0")).await.ok();
    let left = h.leftovers().await;
    h.assert_clean(&left, "after DEL");
    eprintln!(
        "ADD wall time: {:?} and {:?}; DEL: {:?} (first), {:?} (repeat)",
        add_a.elapsed, add_b.elapsed, del_times[0], del_times[1]
    );
}

fn with_prev(mut conf: Value, prev: &Value) -> Value {
    conf["prevResult"] = prev.clone();
    conf
}

#[tokio::test(flavor = "multi_thread")]
async fn results_in_every_version() {
    let h = Harness::start().await;
    let mut adds = Vec::new();
    let mut dels = Vec::new();
    for (i, version) in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"].into_iter().enumerate() {
        let pod = Pod::new(&format!("v{i}"));
        let add = h.cni("ADD", &pod, &h.conf(version)).await;
        let r = add.ok();
        adds.push(add.elapsed);
        assert_eq!(r["cniVersion"], version);
        assert_eq!(r["interfaces"].as_array().unwrap().len(), 2, "{r}");
        let ips = r["ips"].as_array().unwrap();
        assert_eq!(ips.len(), 2, "{r}");
        if version.starts_with("0.") {
            assert_eq!(ips[0]["version"], "4", "{version}: {r}");
            assert_eq!(ips[1]["version"], "6", "{version}: {r}");
        } else {
            assert!(ips.iter().all(|ip| ip.get("version").is_none()), "{version}: {r}");
        }
        assert_eq!(
            r["interfaces"][1].get("mtu").is_some(),
            version == "1.1.0",
            "{version}: {r}"
        );
        if version != "0.3.0" && version != "0.3.1" {
            h.cni("CHECK", &pod, &with_prev(h.conf(version), &r)).await.ok();
        } else {
            let msg = h.cni("CHECK", &pod, &with_prev(h.conf(version), &r)).await.err_code(1);
            assert!(msg.contains("0.4.0"), "{msg}");
        }
        let del = h.cni("DEL", &pod, &h.conf(version)).await;
        del.ok();
        dels.push(del.elapsed);
    }
    h.assert_clean(&h.leftovers().await, "after every version");
    let (add_median, add_max) = median_max(adds);
    let (del_median, del_max) = median_max(dels);
    eprintln!("ADD median {add_median:?} max {add_max:?}; DEL median {del_median:?} max {del_max:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn check_fails_clearly_once_the_host_veth_is_gone() {
    let h = Harness::start().await;
    let pod = Pod::new("broken");
    let r = h.add(&pod, "1.0.0").await;
    let conf = with_prev(h.conf("1.0.0"), &r);
    h.cni("CHECK", &pod, &conf).await.ok();

    // The endpoint goes behind the plugin's back: svc-endpoint's
    // ENDPOINT_NOT_FOUND reaches rivet-cni as "no endpoint" (a failed
    // CHECK, 104), not as svc-endpoint refusing the call (102).
    h.node
        .endpoints()
        .await
        .delete_endpoint(eppb::DeleteEndpointRequest {
            r#ref: Some(eppb::EndpointRef {
                r#ref: Some(eppb::endpoint_ref::Ref::Container(eppb::ContainerInterface {
                    container_id: pod.id.clone(),
                    interface: "eth0".into(),
                })),
            }),
        })
        .await
        .expect("svc-endpoint deletes the endpoint");
    let msg = h.cni("CHECK", &pod, &conf).await.err_code(104);
    assert!(msg.contains("svc-endpoint has no endpoint"), "{msg}");

    // Something removes an address: CHECK names it.
    let ip4 = r["ips"][0]["address"].as_str().unwrap();
    pod.ns.ip(&["addr", "del", ip4, "dev", "eth0"]).unwrap();
    let msg = h.cni("CHECK", &pod, &conf).await.err_code(104);
    assert!(msg.contains("lacks address") && msg.contains(ip4), "{msg}");

    // Deleting the host side takes the container side with it.
    let host = r["interfaces"][0]["name"].as_str().unwrap();
    h.node_ns().ip(&["link", "del", host]).unwrap();
    let msg = h.cni("CHECK", &pod, &conf).await.err_code(104);
    assert!(
        msg.contains(&format!("host interface {host}")) && msg.contains("missing"),
        "{msg}"
    );

    // DEL still cleans up: the endpoint and the addresses.
    h.del(&pod, "1.0.0").await;
    h.assert_clean(&h.leftovers().await, "DEL after the veth was broken");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_and_gc() {
    let h = Harness::start().await;
    let status = |conf: Value| {
        let env = vec![("CNI_COMMAND".to_string(), "STATUS".to_string())];
        let h = &h;
        async move { h.exec(&env, &conf).await }
    };
    assert_eq!(status(h.conf("1.1.0")).await.ok(), Value::Null);
    status(h.conf("1.0.0")).await.err_code(1);
    let empty = tempfile::tempdir().unwrap();
    let mut down = h.conf("1.1.0");
    down["socketDir"] = json!(empty.path());
    let run: CniRun = status(down).await;
    let msg = run.err_code(50);
    assert!(msg.contains("svc-endpoint") && msg.contains("not available"), "{msg}");
    assert!(
        run.elapsed < Duration::from_secs(5),
        "STATUS answers promptly: {:?}",
        run.elapsed
    );

    // GC: three attachments, one valid.
    let pods: Vec<Pod> = (0..3).map(|i| Pod::new(&format!("gc{i}"))).collect();
    for pod in &pods {
        h.add(pod, "1.1.0").await;
    }
    // Without the list nothing is removed.
    h.gc(&h.conf("1.1.0")).await.ok();
    assert_eq!(h.endpoints().await.len(), 3);
    let mut conf = h.conf("1.1.0");
    conf["cni.dev/valid-attachments"] = json!([{"containerID": "gc1", "ifname": "eth0"}]);
    h.gc(&conf).await.ok();
    let endpoints = h.endpoints().await;
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0].container_id, "gc1");
    assert_eq!(endpoints[0].state, eppb::EndpointState::Ready as i32);
    let owners: Vec<String> = h
        .allocations()
        .await
        .iter()
        .map(|a| a.owner.as_ref().unwrap().container_id.clone())
        .collect();
    assert_eq!(owners, ["gc1", "gc1"]);
    assert_eq!(h.host_veths().len(), 1);
    assert!(!pods[0].ns.has_link("eth0").unwrap(), "gc0's veth is gone");
    assert!(pods[1].ns.has_link("eth0").unwrap(), "gc1's veth stays");
    // GC needs CNI_PATH.
    let env = vec![("CNI_COMMAND".to_string(), "GC".to_string())];
    let msg = h.exec(&env, &h.conf("1.1.0")).await.err_code(4);
    assert!(msg.contains("CNI_PATH"), "{msg}");
    h.del(&pods[1], "1.1.0").await;
    h.assert_clean(&h.leftovers().await, "after GC and DEL");
}

/// GC with a delegated IPAM plugin (Debian's host-local: CNI up to 1.0.0,
/// no GC of its own): the addresses of the attachments GC removes go back
/// to host-local (its DEL per attachment), those of valid ones stay.
#[tokio::test(flavor = "multi_thread")]
async fn gc_gives_a_delegated_plugins_addresses_back() {
    let h = Harness::start().await;
    let store = tempfile::tempdir().unwrap();
    let conf = |version: &str| {
        let mut conf = h.conf(version);
        conf["ipam"] = json!({
            "type": "host-local",
            "ranges": [[{"subnet": "198.18.12.0/24"}]],
            "dataDir": store.path(),
        });
        conf
    };
    let pods: Vec<Pod> = (0..3).map(|i| Pod::new(&format!("dgc{i}"))).collect();
    for pod in &pods {
        h.cni("ADD", pod, &conf("1.0.0")).await.ok();
    }
    // host-local's store: a file per address, holding its container id.
    let held = || -> Vec<String> {
        let mut owners: Vec<String> = std::fs::read_dir(store.path().join("rivet"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().parse::<std::net::IpAddr>().is_ok())
            .map(|e| {
                std::fs::read_to_string(e.path())
                    .unwrap()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        owners.sort();
        owners
    };
    assert_eq!(held(), ["dgc0", "dgc1", "dgc2"]);
    let mut gc = conf("1.1.0");
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "dgc1", "ifname": "eth0"}]);
    h.gc(&gc).await.ok();
    let endpoints: Vec<String> = h.endpoints().await.iter().map(|e| e.container_id.clone()).collect();
    assert_eq!(endpoints, ["dgc1"]);
    assert_eq!(
        held(),
        ["dgc1"],
        "the removed attachments' addresses are host-local's again"
    );
    h.cni("DEL", &pods[1], &conf("1.0.0")).await.ok();
    assert!(held().is_empty());
    h.assert_clean(&h.leftovers().await, "after GC and DEL");
}

#[tokio::test(flavor = "multi_thread")]
async fn version_and_input_errors() {
    let h = Harness::start().await;
    let pod = Pod::new("errors");
    let version = h
        .exec(
            &[("CNI_COMMAND".into(), "VERSION".into())],
            &json!({"cniVersion": "1.0.0"}),
        )
        .await
        .ok();
    assert_eq!(
        version["supportedVersions"],
        json!(["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
    );
    assert_eq!(version["cniVersion"], "1.1.0");

    let env = Harness::env("ADD", &pod, "eth0");
    // Malformed JSON: decode error, in the latest version since none could be read.
    let run = h.exec_bin(&h.bin, &env, b"{\"cniVersion\": ").await;
    assert_eq!(run.err()["code"], 6);
    // Unsupported version.
    let mut conf = h.conf("1.0.0");
    conf["cniVersion"] = json!("0.2.0");
    assert!(h.exec(&env, &conf).await.err_code(1).contains("0.2.0"));
    // A misspelled Rivet key.
    let mut conf = h.conf("1.0.0");
    conf["socketdir"] = json!("/tmp");
    let run = h.exec(&env, &conf).await;
    let msg = run.err_code(2);
    assert!(msg.contains("socketdir") && msg.contains("socketDir"), "{msg}");
    assert_eq!(run.err()["cniVersion"], "1.0.0", "errors come in the netconf's version");
    // An invalid Rivet value.
    let mut conf = h.conf("1.0.0");
    conf["hostInterfacePrefix"] = json!("much-too-long");
    assert!(h.exec(&env, &conf).await.err_code(7).contains("hostInterfacePrefix"));
    // Environment errors name the variable.
    let mut missing = env.clone();
    missing.retain(|(k, _)| k != "CNI_IFNAME");
    assert!(
        h.exec(&missing, &h.conf("1.0.0"))
            .await
            .err_code(4)
            .contains("CNI_IFNAME")
    );
    let mut bad = env.clone();
    bad.retain(|(k, _)| k != "CNI_ARGS");
    bad.push(("CNI_ARGS".into(), "K8S_POD_NAME=x;FOO=bar".into()));
    assert!(h.exec(&bad, &h.conf("1.0.0")).await.err_code(4).contains("FOO"));
    let no_command: Vec<(String, String)> = env.iter().filter(|(k, _)| k != "CNI_COMMAND").cloned().collect();
    assert!(
        h.exec(&no_command, &h.conf("1.0.0"))
            .await
            .err_code(4)
            .contains("CNI_COMMAND")
    );
    // None of them touched anything, and stdout only ever held the error JSON.
    h.assert_clean(&h.leftovers().await, "after input errors");
    let log = std::fs::read_to_string(&h.log_file).unwrap();
    assert!(
        log.contains("socketdir"),
        "failures are logged to the logFile too:\n{log}"
    );
    assert!(h.allocations().await.is_empty());
}

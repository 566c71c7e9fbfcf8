//! rivet-cni chained after the reference `ptp` plugin (with `host-local`
//! IPAM) from /usr/lib/cni, the way a conflist runs them: ptp creates the
//! veth and addresses, rivet-cni only creates the endpoint on ptp's veth and
//! passes ptp's result through; pods reach each other through Rivet's
//! datapath; DEL (reverse order) removes the endpoint, then ptp its veth.

mod common;

use std::path::Path;

use common::{Harness, Pod, ping, result_ips};
use rivet_common::testing::{DaemonCommand, workspace_binary};
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::net::format_address;
use serde_json::{Value, json};

const PTP: &str = "/usr/lib/cni/ptp";

/// Restarts the node's svc-loader so that it acts on ptp's `veth<hex>`
/// interfaces (the test node's loader only takes `rvh*`).
async fn loader_for_veth_prefix(h: &mut Harness) {
    let node = &mut h.node.node;
    node.loader.terminate().await.expect("svc-loader stops");
    let dir = node.dir.path().to_path_buf();
    let sockets = dir.join("sockets");
    node.loader = DaemonCommand::new("nsenter", sockets.join("svc-loader.sock"))
        .arg(format!("--net={}", node.node.ns.path().display()))
        .arg(workspace_binary("svc-loader"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
        .args(["--node-name", &node.node_name, "--endpoint-interface-prefix", "veth"])
        .args(["--ct-max", "65536", "--lb-flows-max", "65536"])
        .args(["--endpoints-max", "1024", "--ipcache-max", "4096"])
        .args(["--policy-max", "65536", "--events-bytes", "262144"])
        .log_to(dir.join("svc-loader-veth.log"))
        .spawn()
        .await
        .expect("svc-loader restarts with the veth prefix");
}

#[tokio::test(flavor = "multi_thread")]
async fn chained_after_ptp_with_host_local() {
    let mut h = Harness::start().await;
    loader_for_veth_prefix(&mut h).await;
    assert!(Path::new(PTP).is_file(), "containernetworking-plugins provides {PTP}");
    let data = tempfile::tempdir().unwrap();
    let ptp_conf = json!({
        "cniVersion": "1.0.0",
        "name": "chain",
        "type": "ptp",
        "ipam": {
            "type": "host-local",
            "dataDir": data.path(),
            "ranges": [[{"subnet": "198.18.8.0/24"}], [{"subnet": "2001:2:0:8::/64"}]],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]
        }
    });
    let rivet_conf = |prev: &Value| {
        let mut conf = h.conf("1.0.0");
        conf["name"] = json!("chain");
        conf["prevResult"] = prev.clone();
        conf
    };

    let pods = [Pod::new("chain-a"), Pod::new("chain-b")];
    let mut results = Vec::new();
    for pod in &pods {
        let env = Harness::env("ADD", pod, "eth0");
        let ptp = h.exec_bin(Path::new(PTP), &env, ptp_conf.to_string().as_bytes()).await;
        let ptp_result = ptp.ok();
        let rivet = h.exec(&env, &rivet_conf(&ptp_result)).await;
        let out = rivet.ok();
        assert_eq!(
            out, ptp_result,
            "rivet-cni passes the previous result through unchanged"
        );
        eprintln!("ptp ADD {:?}, chained rivet-cni ADD {:?}", ptp.elapsed, rivet.elapsed);

        let host = ptp_result["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i.get("sandbox").is_none())
            .expect("ptp reports its host veth")["name"]
            .as_str()
            .unwrap()
            .to_string();
        let ep = h.endpoint(pod).await.expect("an endpoint on ptp's veth");
        assert_eq!(ep.state, eppb::EndpointState::Ready as i32);
        assert_eq!(ep.host_interface, host);
        assert_eq!(ep.host_ifindex, h.node_ns().ifindex(&host).unwrap());
        assert!(
            ep.addresses.iter().all(|a| a.ipam_pool.is_empty()),
            "{:?}",
            ep.addresses
        );
        let ips: Vec<String> = result_ips(&ptp_result).iter().map(ToString::to_string).collect();
        let ep_ips: Vec<String> = ep.addresses.iter().map(|a| format_address(&a.address)).collect();
        assert_eq!(ep_ips, ips);
        assert!(h.host_veths().is_empty(), "rivet-cni created no interface of its own");
        assert!(h.allocations().await.is_empty(), "svc-ipam was not asked");

        let check = h
            .exec(&Harness::env("CHECK", pod, "eth0"), &rivet_conf(&ptp_result))
            .await;
        check.ok();
        results.push(ptp_result);
    }

    // Traffic between the chained pods goes through Rivet's datapath.
    for dst in result_ips(&results[1]) {
        assert_eq!(ping(&pods[0].ns, dst), 3, "chain-a -> {dst}\n{}", h.log_tail());
    }
    for dst in result_ips(&results[0]) {
        assert_eq!(ping(&pods[1].ns, dst), 3, "chain-b -> {dst}");
    }

    // DEL in reverse order: rivet-cni removes only the endpoint.
    for (pod, result) in pods.iter().zip(&results) {
        let env = Harness::env("DEL", pod, "eth0");
        h.exec(&env, &rivet_conf(result)).await.ok();
        assert!(h.endpoint(pod).await.is_none());
        assert!(pod.ns.has_link("eth0").unwrap(), "ptp's veth is ptp's to delete");
        let mut ptp_del = ptp_conf.clone();
        ptp_del["prevResult"] = result.clone();
        h.exec_bin(Path::new(PTP), &env, ptp_del.to_string().as_bytes())
            .await
            .ok();
        assert!(!pod.ns.has_link("eth0").unwrap());
        // A second DEL of both is fine.
        h.exec(&env, &rivet_conf(result)).await.ok();
    }
    let left = h.leftovers().await;
    h.assert_clean(&left, "after the chained DELs");
}

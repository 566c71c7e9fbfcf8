//! Cluster-pool IPAM on a real node against a real kube-apiserver: the test
//! plays the operator (writes the RivetNode's spec.podCidrs as admin);
//! svc-k8s-sync hands them to svc-ipam, reports PodCIDRsApplied and marks
//! the node ready only then; a change that would strand a pod's address is
//! refused with svc-ipam's reason and the old pool kept; a svc-ipam that
//! lost its state gets the pool back. With the real rivet-operator
//! allocating, a pod gets its address from the CIDR it allocated.

mod support;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use rivet_k8s::{NodeCondition, RivetNode};
use rivet_proto::ipam::v1 as ipampb;
use rivet_testkit::node::{POOL4, POOL6};
use serde_json::json;
use support::{CONVERGE, Cluster, eventually};

/// The field manager the test writes spec.podCidrs with, as the operator.
const OPERATOR: &str = "rivet-operator";

async fn set_pod_cidrs(cluster: &Cluster, cidrs: &[&str]) {
    Api::<RivetNode>::all(cluster.admin())
        .patch(
            &cluster.node.node.node_name,
            &PatchParams::apply(OPERATOR).force(),
            &Patch::Apply(json!({
                "apiVersion": "rivet.io/v1", "kind": "RivetNode",
                "metadata": { "name": cluster.node.node.node_name },
                "spec": { "podCidrs": cidrs },
            })),
        )
        .await
        .expect("the operator's spec.podCidrs apply");
}

async fn rivet_node(cluster: &Cluster) -> RivetNode {
    Api::<RivetNode>::all(cluster.admin())
        .get(&cluster.node.node.node_name)
        .await
        .expect("the RivetNode")
}

fn condition(node: &RivetNode, type_: &str) -> Option<NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .cloned()
}

/// Waits until condition PodCIDRsApplied has `status` and `reason`.
async fn wait_applied(cluster: &Cluster, status: &str, reason: &str) -> NodeCondition {
    eventually(&format!("PodCIDRsApplied={status} ({reason})"), CONVERGE, || async {
        let node = rivet_node(cluster).await;
        match condition(&node, rivet_k8s::CONDITION_POD_CIDRS_APPLIED) {
            Some(c) if c.status == status && c.reason.as_deref() == Some(reason) => Ok(c),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// svc-ipam's pool `default` (None while it has none).
async fn ipam_pool(cluster: &Cluster) -> Option<ipampb::Pool> {
    let listed = cluster
        .node
        .ipam_client()
        .await
        .list(ipampb::ListRequest::default())
        .await
        .expect("svc-ipam lists")
        .into_inner();
    listed.pools.into_iter().find(|p| p.name == "default")
}

fn pool_cidrs(pool: &ipampb::Pool) -> Vec<String> {
    pool.ranges
        .iter()
        .map(|r| rivet_proto::net::format_prefix(r.cidr.as_ref().expect("a CIDR")))
        .collect()
}

async fn wait_ready_untainted(cluster: &Cluster) {
    eventually("the node is ready and untainted", CONVERGE, || async {
        let ready = cluster.sync_status().await.node_ready;
        let tainted = cluster.not_ready_taint().await;
        if ready && !tainted {
            Ok(())
        } else {
            Err(format!("ready={ready} tainted={tainted}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_cidrs_written_by_the_operator_reach_svc_ipam_gate_readiness_and_a_stranding_change_is_refused() {
    let mut cluster = Cluster::start_cluster_pool(&["--pod-cidrs-resync-seconds", "0.5"]).await;

    // At start: the RivetNode exists with the node's addresses and no pod
    // CIDRs, svc-k8s-sync does not own spec.podCidrs, and the node waits.
    let waiting = wait_applied(&cluster, "False", "WaitingForPodCIDRs").await;
    assert!(waiting.last_transition_time.is_some(), "{waiting:?}");
    let node = rivet_node(&cluster).await;
    assert_eq!(node.spec.addresses.len(), 1);
    assert_eq!(node.spec.addresses[0].ip, "198.19.0.1");
    assert!(node.spec.pod_cidrs.is_empty(), "{:?}", node.spec);
    let spec_owner = node
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .find(|e| e.manager.as_deref() == Some("svc-k8s-sync") && e.subresource.is_none())
        .expect("svc-k8s-sync applied the spec");
    let fields = serde_json::to_string(&spec_owner.fields_v1).expect("managed fields");
    assert!(
        fields.contains("f:addresses") && !fields.contains("f:podCidrs"),
        "svc-k8s-sync owns the addresses, never the pod CIDRs: {fields}"
    );
    assert!(ipam_pool(&cluster).await.is_none(), "svc-ipam has no pool yet");
    assert!(!cluster.sync_status().await.node_ready, "no pod CIDRs, not ready");
    assert!(
        cluster.not_ready_taint().await,
        "the taint stays until the pool is applied"
    );
    let ready = condition(&node, rivet_k8s::CONDITION_READY).expect("Ready is written");
    assert_eq!(ready.status, "False", "{ready:?}");

    // The operator allocates: svc-ipam serves them, the node becomes ready.
    set_pod_cidrs(&cluster, &[POOL4, POOL6]).await;
    let applied = wait_applied(&cluster, "True", "PodCIDRsApplied").await;
    assert!(applied.message.unwrap_or_default().contains(POOL4));
    let pool = ipam_pool(&cluster).await.expect("svc-ipam serves pool default");
    assert_eq!(pool_cidrs(&pool), [POOL4, POOL6]);
    assert_eq!(pool.source, ipampb::PoolSource::SetPool as i32);
    wait_ready_untainted(&cluster).await;
    let annotations = Api::<Node>::all(cluster.admin())
        .get(&cluster.node.node.node_name)
        .await
        .expect("the Node")
        .metadata
        .annotations
        .unwrap_or_default();
    assert_eq!(
        annotations.get("rivet.io/pod-cidrs").map(String::as_str),
        Some("198.18.0.0/22,2001:2::/64")
    );

    // A pod gets its address from the operator-allocated CIDR.
    cluster.namespace("shop", &[]).await;
    cluster.pod("shop", "web", &[("app", "web")]).await;
    let web = cluster.cni_pod("web").ipv4;
    assert!(POOL4.parse::<IpNet>().unwrap().contains(&web), "{web}");
    let _server = cluster.tcp_server("web", 8080);
    cluster.pod("shop", "client", &[("app", "client")]).await;
    assert!(cluster.tcp("client", "web", 8080), "pods talk before the change");

    // A change that strands the pods' addresses is refused with svc-ipam's
    // reason; svc-ipam keeps the old pool and the pods keep working.
    set_pod_cidrs(&cluster, &["198.18.8.0/24", POOL6]).await;
    let refused = wait_applied(&cluster, "False", "PoolChangeStrandsAllocations").await;
    let message = refused.message.unwrap_or_default();
    assert!(
        message.contains("allocated address(es)") && message.contains("198.18.8.0/24"),
        "the condition says how many and what was asked: {message}"
    );
    assert_eq!(
        pool_cidrs(&ipam_pool(&cluster).await.expect("pool default")),
        [POOL4, POOL6],
        "the old pool is kept"
    );
    assert!(cluster.tcp("client", "web", 8080), "the pods are unaffected");
    eventually(
        "the node is not ready while its pod CIDRs are not applied",
        CONVERGE,
        || async {
            let node = rivet_node(&cluster).await;
            match condition(&node, rivet_k8s::CONDITION_READY) {
                Some(c)
                    if c.status == "False" && c.message.as_deref().unwrap_or("").contains("pod CIDRs not applied") =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // Grown instead (the pods' addresses stay inside): applied.
    set_pod_cidrs(&cluster, &["198.18.0.0/21", POOL6]).await;
    wait_applied(&cluster, "True", "PodCIDRsApplied").await;
    assert_eq!(
        pool_cidrs(&ipam_pool(&cluster).await.expect("pool default")),
        ["198.18.0.0/21", POOL6]
    );
    assert!(cluster.tcp("client", "web", 8080));

    // svc-ipam restarted with its state lost: svc-k8s-sync sets the pool
    // again (level-triggered), without any change to the RivetNode.
    cluster.node.ipam.kill9();
    std::fs::remove_file(cluster.node.state_dir().join("ipam/allocations.json")).expect("svc-ipam's state");
    cluster.node.ipam.restart().await.expect("svc-ipam restarts");
    let pool = eventually("svc-ipam gets its pool back", CONVERGE, || async {
        ipam_pool(&cluster).await.ok_or_else(|| "no pool".to_string())
    })
    .await;
    assert_eq!(pool_cidrs(&pool), ["198.18.0.0/21", POOL6]);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_allocates_the_nodes_pod_cidrs_and_a_pod_gets_its_address_from_them() {
    let mut cluster = Cluster::start_cluster_pool(&[]).await;
    let operator = cluster.start_operator(&[]).await;

    wait_applied(&cluster, "True", "PodCIDRsApplied").await;
    let node = rivet_node(&cluster).await;
    let allocated = condition(&node, rivet_k8s::CONDITION_POD_CIDRS_ALLOCATED).expect("the operator's condition");
    assert_eq!(allocated.status, "True", "{allocated:?}");
    let cidrs: Vec<IpNet> = node.spec.pod_cidrs.iter().map(|c| c.parse().expect("a CIDR")).collect();
    let v4 = *cidrs.iter().find(|c| c.addr().is_ipv4()).expect("an IPv4 pod CIDR");
    let v6 = *cidrs.iter().find(|c| c.addr().is_ipv6()).expect("an IPv6 pod CIDR");
    assert!(
        v4.prefix_len() == 24 && "198.18.0.0/16".parse::<IpNet>().unwrap().contains(&v4),
        "{v4}"
    );
    assert!(
        v6.prefix_len() == 120 && "2001:2::/104".parse::<IpNet>().unwrap().contains(&v6),
        "{v6}"
    );
    let served = ipam_pool(&cluster).await.expect("svc-ipam serves the operator's CIDRs");
    assert_eq!(pool_cidrs(&served), node.spec.pod_cidrs);

    wait_ready_untainted(&cluster).await;
    cluster.namespace("shop", &[]).await;
    cluster.pod("shop", "web", &[("app", "web")]).await;
    let web = cluster.cni_pod("web").ipv4;
    assert!(
        v4.contains(&web),
        "the pod's {web} is inside the operator-allocated {v4}"
    );
    drop(operator);
}

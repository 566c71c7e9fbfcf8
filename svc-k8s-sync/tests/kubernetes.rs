//! svc-k8s-sync against a real kube-apiserver, feeding a real node in
//! Kubernetes mode: policies, pod labels and namespace labels made through
//! the API change real verdicts between namespace pods; restore drops the
//! endpoint of a pod deleted while svc-endpoint was down; kill -9 of
//! svc-k8s-sync and a kube-apiserver restart lose no packet and regenerate
//! nothing; RBAC refusals are reported with the verb and the kind.

mod support;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rivet_k8s::RivetEndpoint;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::k8s::v1 as k8spb;
use rivet_testkit::kube::delete_pod_now;
use serde_json::json;
use support::{CONVERGE, Cluster, eventually};

fn backend_policy(from_app: &str) -> NetworkPolicy {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": { "name": "backend", "namespace": "shop" },
        "spec": {
            "podSelector": { "matchLabels": { "app": "backend" } },
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{ "podSelector": { "matchLabels": { "app": from_app } } }],
                "ports": [{ "protocol": "TCP", "port": 8080 }],
            }],
        },
    }))
    .expect("a NetworkPolicy")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_network_policy_made_through_the_api_is_enforced_patched_and_removed() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    cluster.pod("shop", "frontend", &[("app", "frontend")]).await;
    cluster.pod("shop", "backend", &[("app", "backend")]).await;
    cluster.pod("shop", "other", &[("app", "other")]).await;
    let _server = cluster.tcp_server("backend", 8080);
    assert!(cluster.tcp("other", "backend", 8080), "no policy: allowed");

    let policies: Api<NetworkPolicy> = Api::namespaced(cluster.admin(), "shop");
    policies
        .create(&PostParams::default(), &backend_policy("frontend"))
        .await
        .expect("the NetworkPolicy is created");
    let revision = cluster.wait_policy("NetworkPolicy", "shop", "backend", true).await;
    cluster.wait_realised(revision, &["backend"]).await;
    assert!(cluster.tcp("frontend", "backend", 8080), "frontend is allowed");
    assert!(
        !cluster.tcp("other", "backend", 8080),
        "other is denied once the policy is realised"
    );

    policies
        .patch(
            "backend",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "ingress": [{
                "from": [{ "podSelector": { "matchLabels": { "app": "other" } } }],
                "ports": [{ "protocol": "TCP", "port": 8080 }],
            }] } })),
        )
        .await
        .expect("the NetworkPolicy is patched");
    let patched = eventually("the patched policy reaches svc-endpoint", CONVERGE, || async {
        let now = cluster.wait_policy("NetworkPolicy", "shop", "backend", true).await;
        if now > revision {
            Ok(now)
        } else {
            Err(format!("revision {now}"))
        }
    })
    .await;
    cluster.wait_realised(patched, &["backend"]).await;
    assert!(
        cluster.tcp("other", "backend", 8080),
        "other is allowed after the patch"
    );
    assert!(
        !cluster.tcp("frontend", "backend", 8080),
        "frontend is denied after the patch"
    );

    policies
        .delete("backend", &DeleteParams::default())
        .await
        .expect("the NetworkPolicy is deleted");
    let after = cluster.wait_policy("NetworkPolicy", "shop", "backend", false).await;
    cluster.wait_realised(after, &["backend"]).await;
    assert!(
        cluster.tcp("frontend", "backend", 8080),
        "allowed again after the delete"
    );
    assert!(cluster.tcp("other", "backend", 8080), "allowed again after the delete");

    // Each endpoint's RivetEndpoint carries its status.
    let objects: Api<RivetEndpoint> = Api::namespaced(cluster.admin(), "shop");
    let backend = cluster.endpoint("shop", "backend").await.expect("backend's endpoint");
    let object = eventually("backend's RivetEndpoint is written", CONVERGE, || async {
        match objects.get_opt("backend").await {
            Ok(Some(o)) if o.status.as_ref().is_some_and(|s| s.policy_revision >= after) => Ok(o),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let status = object.status.expect("a status");
    assert_eq!(status.id, backend.id);
    assert_eq!(status.identity, Some(backend.identity));
    assert_eq!(status.node, cluster.node.node.node_name);
    assert_eq!(
        object.metadata.owner_references.unwrap_or_default()[0].kind,
        "Pod",
        "owned by its pod"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_and_namespace_labels_patched_in_the_api_change_identities_and_verdicts() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    cluster.namespace("tools", &[]).await;
    cluster.pod("shop", "frontend", &[("app", "frontend")]).await;
    cluster.pod("shop", "backend", &[("app", "backend")]).await;
    cluster.pod("shop", "other", &[("app", "other")]).await;
    cluster.pod("tools", "probe", &[("app", "probe")]).await;
    let _server = cluster.tcp_server("backend", 8080);
    let policy: NetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": { "name": "backend", "namespace": "shop" },
        "spec": {
            "podSelector": { "matchLabels": { "app": "backend" } },
            "policyTypes": ["Ingress"],
            "ingress": [{ "from": [
                { "podSelector": { "matchLabels": { "app": "frontend" } } },
                { "namespaceSelector": { "matchLabels": { "team": "ops" } } },
            ] }],
        },
    }))
    .unwrap();
    Api::<NetworkPolicy>::namespaced(cluster.admin(), "shop")
        .create(&PostParams::default(), &policy)
        .await
        .expect("the NetworkPolicy is created");
    let revision = cluster.wait_policy("NetworkPolicy", "shop", "backend", true).await;
    cluster.wait_realised(revision, &["backend"]).await;
    assert!(!cluster.tcp("other", "backend", 8080), "app=other is denied");
    assert!(
        !cluster.tcp("probe", "backend", 8080),
        "namespace tools without team=ops is denied"
    );

    // A pod label patched in the API: a new identity, a new verdict.
    let before = cluster.endpoint("shop", "other").await.unwrap();
    Api::<Pod>::namespaced(cluster.admin(), "shop")
        .patch(
            "other",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "app": "frontend" } } })),
        )
        .await
        .expect("the pod's labels are patched");
    let after = cluster
        .wait_endpoint("shop", "other", |e| {
            e.identity_labels.iter().any(|l| l == "k8s:app=frontend")
        })
        .await;
    assert_ne!(after.identity, before.identity, "new labels, new identity");
    let revision = cluster.wait_policy("NetworkPolicy", "shop", "backend", true).await;
    cluster.wait_realised(revision, &["backend"]).await;
    eventually("backend admits other's new identity", CONVERGE, || async {
        if cluster.tcp("other", "backend", 8080) {
            Ok(())
        } else {
            Err("denied".to_string())
        }
    })
    .await;

    // A namespace label patched in the API: namespaceSelector verdicts change.
    let probe_before = cluster.endpoint("tools", "probe").await.unwrap();
    cluster.namespace("tools", &[("team", "ops")]).await;
    let probe_after = cluster
        .wait_endpoint("tools", "probe", |e| {
            e.identity_labels.iter().any(|l| l.ends_with("team=ops"))
        })
        .await;
    assert_ne!(
        probe_after.identity, probe_before.identity,
        "namespace labels are identity labels"
    );
    eventually("backend admits the ops namespace", CONVERGE, || async {
        if cluster.tcp("probe", "backend", 8080) {
            Ok(())
        } else {
            Err("denied".to_string())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_deleted_while_svc_endpoint_is_down_is_dropped_at_restore_and_its_address_released() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    cluster.pod("shop", "stays", &[("app", "a")]).await;
    let gone = cluster.pod("shop", "gone", &[("app", "b")]).await;
    let address = |bytes: &[u8]| rivet_proto::net::address_from_bytes(bytes).expect("an address");
    let gone_addresses: Vec<std::net::IpAddr> = gone.addresses.iter().map(|a| address(&a.address)).collect();

    cluster
        .node
        .endpoint_daemon()
        .terminate()
        .await
        .expect("svc-endpoint stops");
    delete_pod_now(cluster.admin(), "shop", "gone")
        .await
        .expect("the pod is deleted");
    eventually("svc-k8s-sync sees the pod gone", CONVERGE, || async {
        match cluster.lookup_pod("shop", "gone").await {
            Ok(r) if r.presence == k8spb::PodPresence::Absent as i32 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    cluster
        .node
        .endpoint_daemon()
        .restart()
        .await
        .expect("svc-endpoint restarts");

    eventually("restore completes", CONVERGE, || async {
        let status = cluster
            .node
            .endpoints()
            .await
            .get_status(pb::GetStatusRequest {})
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        match status.restore {
            Some(r) if r.phase == pb::RestorePhase::Complete as i32 => {
                assert_eq!(r.dropped, 1, "the deleted pod's endpoint is dropped: {r:?}");
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(cluster.endpoint("shop", "gone").await.is_none(), "its endpoint is gone");
    assert!(
        cluster.endpoint("shop", "stays").await.is_some(),
        "the other pod's endpoint stays"
    );
    // The deleted pod's RivetEndpoint goes with its endpoint (no
    // controller-manager runs here to collect it by owner reference).
    let objects: Api<RivetEndpoint> = Api::namespaced(cluster.admin(), "shop");
    eventually("the gone pod's RivetEndpoint is deleted", CONVERGE, || async {
        let names: Vec<String> = objects
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect();
        if names == ["stays"] {
            Ok(())
        } else {
            Err(format!("{names:?}"))
        }
    })
    .await;
    let allocated: Vec<std::net::IpAddr> = cluster
        .node
        .allocations()
        .await
        .iter()
        .map(|a| address(&a.address))
        .collect();
    for address in &gone_addresses {
        assert!(!allocated.contains(address), "{address} is released: {allocated:?}");
    }
}

/// `ping -c <count> -i 0.005` from pod `from` to `to` in a thread.

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_svc_k8s_sync_and_an_api_server_restart_lose_no_packet_and_regenerate_nothing() {
    let mut cluster = Cluster::start().await;
    cluster.shop_with_server_policy().await;
    let regenerations = cluster.regenerations().await;
    let replays_before = cluster.sync_status().await.fed[0].replays;

    // kill -9 under traffic: the restarted svc-k8s-sync lists again and
    // replays; svc-endpoint finds nothing changed.
    let ping = cluster.ping_in_background("client", "server", 400);
    let old_boot = cluster.sync_status().await.boot_id;
    cluster.sync.kill9();
    cluster.sync.restart().await.expect("svc-k8s-sync restarts");
    let status = cluster.wait_replayed(1).await;
    assert_ne!(status.boot_id, old_boot, "a new process");
    let (sent, received) = ping.join().expect("the ping thread");
    assert_eq!(
        sent - received,
        0,
        "no packet lost across kill -9 of svc-k8s-sync ({sent} sent)"
    );
    assert_eq!(
        cluster.regenerations().await,
        regenerations,
        "the replay regenerated nothing"
    );
    assert!(replays_before >= 1);

    // kube-apiserver restart under traffic: the watches resume; a change
    // made after it still arrives; nothing is regenerated.
    let ping = cluster.ping_in_background("client", "server", 400);
    cluster.api.restart().await.expect("kube-apiserver restarts");
    cluster.namespace("marker", &[("after", "restart")]).await;
    eventually(
        "a namespace labelled after the restart reaches svc-endpoint",
        CONVERGE,
        || async {
            let listed = cluster.endpoint_namespaces().await;
            if listed
                .iter()
                .any(|n| n.name == "marker" && n.labels.iter().any(|l| l.contains("after=restart")))
            {
                Ok(())
            } else {
                Err(format!("{listed:?}"))
            }
        },
    )
    .await;
    let (sent, received) = ping.join().expect("the ping thread");
    assert_eq!(
        sent - received,
        0,
        "no packet lost across the API server restart ({sent} sent)"
    );
    assert_eq!(cluster.regenerations().await, regenerations, "nothing regenerated");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_node_is_marked_ready_once_synced_and_not_ready_while_a_daemon_is_down() {
    let cluster = Cluster::start().await;
    let status = eventually("the node is marked ready", CONVERGE, || async {
        let status = cluster.sync_status().await;
        if status.node_ready {
            Ok(status)
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await;
    assert!(status.caches_synced);
    let node = Api::<Node>::all(cluster.admin())
        .get(&cluster.node.node.node_name)
        .await
        .expect("the Node");
    let annotations = node.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("rivet.io/pod-cidrs").map(String::as_str),
        Some("198.18.0.0/22,2001:2::/64")
    );
    assert_eq!(
        annotations.get("rivet.io/node-addresses").map(String::as_str),
        Some("198.19.0.1")
    );
    let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
    assert!(
        taints.iter().all(|t| t.key != "node.rivet.io/agent-not-ready"),
        "the not-ready taint is removed: {taints:?}"
    );
    let rivet_node = Api::<rivet_k8s::RivetNode>::all(cluster.admin())
        .get(&cluster.node.node.node_name)
        .await
        .expect("the RivetNode");
    let ready = rivet_node
        .status
        .and_then(|s| s.condition("Ready").cloned())
        .expect("a Ready condition");
    assert_eq!(ready.status, "True", "{ready:?}");
    let transition = ready.last_transition_time.clone().expect("a transition time");
    let heartbeat = ready.last_heartbeat_time.clone().expect("a heartbeat");

    // Each readiness pass (every second here) refreshes the heartbeat; the
    // transition time stays while the status does.
    let rivet_nodes = Api::<rivet_k8s::RivetNode>::all(cluster.admin());
    let name = cluster.node.node.node_name.clone();
    let ready_condition = || async {
        rivet_nodes
            .get(&name)
            .await
            .map_err(|e| e.to_string())?
            .status
            .and_then(|s| s.condition("Ready").cloned())
            .ok_or_else(|| "no Ready condition".to_string())
    };
    let refreshed = eventually("the Ready heartbeat is refreshed", CONVERGE, || async {
        let now = ready_condition().await?;
        if now.last_heartbeat_time.as_deref() > Some(heartbeat.as_str()) {
            Ok(now)
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await;
    assert_eq!(refreshed.status, "True");
    assert_eq!(
        refreshed.last_transition_time.as_deref(),
        Some(transition.as_str()),
        "no transition while ready"
    );

    // A daemon that stops answering makes the node not ready, named in the
    // RivetNode's condition; its return makes it ready again.
    let mut cluster = cluster;
    cluster.node.identity.terminate().await.expect("svc-identity stops");
    eventually("the RivetNode says svc-identity is not ready", CONVERGE, || async {
        let conditions = rivet_nodes
            .get(&name)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default()
            .conditions;
        let not_ready = conditions.iter().any(|c| {
            c.type_ == "Ready"
                && c.status == "False"
                && c.message.as_deref().unwrap_or("").contains("svc-identity")
                && c.last_transition_time.as_deref() > Some(transition.as_str())
        });
        if not_ready && !cluster.sync_status().await.node_ready {
            // The node's state, not a failure of svc-k8s-sync.
            let info = rivet_proto::daemon::v1::daemon_client::DaemonClient::new(cluster.sync_channel().await)
                .get_info(rivet_proto::daemon::v1::GetInfoRequest {})
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            let controller = info
                .controllers
                .iter()
                .find(|c| c.name == "node-ready")
                .expect("node-ready");
            assert_ne!(
                controller.state,
                rivet_proto::daemon::v1::ControllerState::Failing as i32,
                "{controller:?}"
            );
            Ok(())
        } else {
            Err(format!("{conditions:?}"))
        }
    })
    .await;
    cluster.node.identity.restart().await.expect("svc-identity restarts");
    eventually("the node is ready again", CONVERGE, || async {
        if cluster.sync_status().await.node_ready {
            Ok(())
        } else {
            Err("not ready".to_string())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_its_permissions_svc_k8s_sync_reports_the_403_and_feeds_nothing() {
    // svc-identity's ServiceAccount may read RivetIdentities only.
    let cluster = Cluster::start_with("svc-identity", &["--cache-sync-timeout-seconds", "1"]).await;
    let status = eventually("the sync timeout is reported", CONVERGE, || async {
        let status = cluster.sync_status().await;
        let pods = status
            .kinds
            .iter()
            .find(|k| k.kind == "Pod")
            .cloned()
            .unwrap_or_default();
        if status.cache_sync_timed_out && !pods.last_error.is_empty() {
            Ok(status)
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await;
    assert!(!status.caches_synced);
    let pods = status.kinds.iter().find(|k| k.kind == "Pod").unwrap();
    assert!(
        pods.last_error.contains("list Pod") && pods.last_error.contains("403"),
        "names the verb, the kind and the refusal: {}",
        pods.last_error
    );
    assert_eq!(status.fed[0].replays, 0, "nothing is fed without synced caches");
    assert!(!status.node_ready);
    let lookup = cluster
        .lookup_pod("shop", "any")
        .await
        .expect_err("no answer from an unsynced cache");
    assert_eq!(lookup.code(), tonic::Code::PermissionDenied, "{lookup:?}");
    assert_eq!(
        rivet_common::grpc::error_reason::<k8spb::ErrorReason>(&lookup),
        Some(k8spb::ErrorReason::ApiForbidden),
        "the refusal crosses gRPC typed"
    );
    assert!(lookup.message().contains("list Pod"), "{}", lookup.message());
    assert!(cluster.sync_log().contains("forbidden"), "the log says forbidden");

    // And svc-k8s-sync's own account is refused what deploy/rbac does not grant.
    let own = cluster.api.service_account_client("svc-k8s-sync").await.unwrap();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::all(own.client);
    let refused = secrets
        .list(&Default::default())
        .await
        .expect_err("secrets are not granted");
    assert_eq!(svc_k8s_sync::error::status_code(&refused), Some(403));
}

#[tokio::test(flavor = "multi_thread")]
async fn lookup_pod_answers_from_the_synced_cache() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    cluster.pod("shop", "web", &[("app", "web")]).await;
    let found = cluster.lookup_pod("shop", "web").await.expect("LookupPod");
    assert_eq!(found.presence, k8spb::PodPresence::Present as i32);
    assert_eq!(found.node_name, cluster.node.node.node_name);
    let missing = cluster.lookup_pod("shop", "nope").await.expect("LookupPod");
    assert_eq!(missing.presence, k8spb::PodPresence::Absent as i32);
    let invalid = cluster
        .lookup_pod("Bad_NS", "web")
        .await
        .expect_err("an invalid namespace");
    assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_created_while_svc_k8s_sync_is_down_runs_on_init_until_its_labels_arrive() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    cluster.sync.terminate().await.expect("svc-k8s-sync stops");
    // The CNI ADD does not fail for want of labels.
    cluster.create_pod("shop", "late", &[("app", "late")]).await;
    let early = cluster.endpoint("shop", "late").await.expect("the endpoint exists");
    assert_eq!(early.identity, 5, "the reserved init identity: {early:?}");
    assert!(early.labels_pending);
    cluster.sync.restart().await.expect("svc-k8s-sync restarts");
    let later = cluster
        .wait_endpoint("shop", "late", |e| {
            !e.labels_pending && e.identity_labels.iter().any(|l| l == "k8s:app=late")
        })
        .await;
    assert!(
        later.identity >= 256,
        "a cluster identity once the labels arrived: {later:?}"
    );
}

/// The Node's taints as `key:effect`, but those the API server's
/// admission adds (`node.kubernetes.io/not-ready`: no kubelet reports here).
async fn node_taints(cluster: &Cluster) -> Vec<String> {
    Api::<Node>::all(cluster.admin())
        .get(&cluster.node.node.node_name)
        .await
        .expect("the Node")
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !t.key.starts_with("node.kubernetes.io/"))
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect()
}

/// Waits until the Node has the not-ready taint (`tainted`) or not.
async fn wait_tainted(cluster: &Cluster, what: &str, tainted: bool) {
    eventually(what, CONVERGE, || async {
        let taints = node_taints(cluster).await;
        if taints.contains(&"node.rivet.io/agent-not-ready:NoSchedule".to_string()) == tainted {
            Ok(())
        } else {
            Err(format!("{taints:?}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_taints_the_node_while_a_daemon_is_down_or_svc_k8s_sync_is_stopped_and_svc_k8s_sync_untaints_it() {
    use rivet_operator::stale::{StaleArgs, StaleMetrics, StaleObjects};
    use rivet_operator::term::{Duty, Term};

    let mut cluster = Cluster::start().await;
    wait_tainted(&cluster, "svc-k8s-sync removes the registration taint", false).await;
    let operator = cluster
        .api
        .service_account_client("rivet-operator")
        .await
        .expect("the operator's RBAC applies")
        .client;
    let controllers = rivet_common::controller::Controllers::new();
    let grace = std::time::Duration::from_secs(5);
    let args = StaleArgs {
        endpoint_gc_interval: std::time::Duration::ZERO,
        node_status_grace: grace,
        set_node_taints: true,
    };
    let term = Term::begin(
        "test",
        0,
        std::time::Instant::now() + std::time::Duration::from_secs(3600),
    );
    StaleObjects::new(operator, args, StaleMetrics::default()).start(&term, &controllers);

    // Ready with a heartbeat every second: the duty's passes (one each time
    // the RivetNode changes) leave the node alone.
    let passes = |controllers: &rivet_common::controller::Controllers| {
        controllers
            .status()
            .iter()
            .find(|c| c.name == "node-taint")
            .map_or(0, |c| c.outcomes)
    };
    let seen = passes(&controllers);
    controllers.wait_outcomes("node-taint", seen + 5).await;
    assert_eq!(
        node_taints(&cluster).await,
        Vec::<String>::new(),
        "a ready node stays untainted"
    );

    // A daemon down: Ready=False, the taint goes back; svc-identity back:
    // svc-k8s-sync takes it off.
    cluster.node.identity.terminate().await.expect("svc-identity stops");
    wait_tainted(&cluster, "the operator taints the not-ready node", true).await;
    cluster.node.identity.restart().await.expect("svc-identity restarts");
    wait_tainted(&cluster, "svc-k8s-sync untaints the ready node", false).await;

    // svc-k8s-sync stopped: its heartbeat goes stale, the taint goes back
    // (not before the grace); started again, it takes it off.
    cluster.sync.terminate().await.expect("svc-k8s-sync stops");
    let stopped = std::time::Instant::now();
    wait_tainted(&cluster, "the operator taints the node of a stopped agent", true).await;
    // Heartbeats are whole seconds and came every second.
    assert!(
        stopped.elapsed() + std::time::Duration::from_millis(2100) >= grace,
        "tainted only once the heartbeat passed the grace: {:?}",
        stopped.elapsed()
    );
    cluster.sync.restart().await.expect("svc-k8s-sync restarts");
    wait_tainted(&cluster, "the restarted svc-k8s-sync untaints the node", false).await;
    controllers.shutdown().await;
}

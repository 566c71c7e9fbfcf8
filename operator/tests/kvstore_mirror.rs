//! The kvstore mirror against a real kube-apiserver (the operator's own
//! ServiceAccount and RBAC from deploy/) and a real etcd 3.6: create,
//! update, delete and the leftover sweep, for nodes and services. The duty
//! runs in-process on a `Term` of its own.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use etcd_client::{Client as EtcdClient, GetOptions, PutOptions, WatchOptions};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rivet_common::cluster::{NodeRecord, RecordSource, ServiceRecord};
use rivet_common::controller::Controllers;
use rivet_common::testing::etcd::EtcdServer;
use rivet_k8s::{Encapsulation, EncapsulationMode, NodeAddress, RivetNode, RivetNodeSpec};
use rivet_operator::kvstore::Layout;
use rivet_operator::kvstore_mirror::KvstoreMirror;
use rivet_operator::term::{Duty, Term};
use rivet_testkit::kube::KubeApiServer;
use serde_json::json;

const CLUSTER: &str = "c1";

fn layout() -> Layout {
    Layout::new("rivet/state/", CLUSTER)
}

/// The key's value and mod revision.
async fn get(etcd: &EtcdClient, key: &str) -> Option<(String, i64)> {
    let resp = etcd.kv_client().get(key, None).await.expect("etcd get");
    resp.kvs()
        .first()
        .map(|kv| (kv.value_str().unwrap().to_string(), kv.mod_revision()))
}

/// Polls etcd until `pred` holds for `key`'s value (20 s).
async fn wait_key(
    etcd: &EtcdClient,
    key: &str,
    what: &str,
    pred: impl Fn(Option<&str>) -> bool,
) -> Option<(String, i64)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = get(etcd, key).await;
        if pred(got.as_ref().map(|(v, _)| v.as_str())) {
            return got;
        }
        assert!(Instant::now() < deadline, "{what}: {key} = {got:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn node_record(value: Option<&str>) -> Option<NodeRecord> {
    value.map(|v| serde_json::from_str(v).expect("a node record"))
}

fn service_record(value: Option<&str>) -> Option<ServiceRecord> {
    value.map(|v| serde_json::from_str(v).expect("a service record"))
}

fn rivet_node(name: &str, ip: &str, cidr: &str) -> RivetNode {
    RivetNode::new(
        name,
        RivetNodeSpec {
            addresses: vec![NodeAddress {
                type_: "InternalIP".into(),
                ip: ip.into(),
            }],
            pod_cidrs: vec![cidr.into()],
            encapsulation: Encapsulation {
                mode: EncapsulationMode::Vxlan,
                port: Some(8472),
            },
        },
    )
}

/// A key on a lease of its own (a node registering itself, multi-node).
async fn put_leased(etcd: &EtcdClient, key: &str) {
    let lease = etcd.lease_client().grant(600, None).await.unwrap().id();
    etcd.kv_client()
        .put(key, "a node's own record", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
}

struct Running {
    term: Term,
    controllers: Controllers,
}

impl Running {
    fn start(duty: &KvstoreMirror) -> Self {
        let term = Term::begin("test", 0, std::time::Instant::now() + Duration::from_secs(3600));
        let controllers = Controllers::new();
        duty.start(&term, &controllers);
        Self { term, controllers }
    }

    async fn stop(self) {
        self.term.end();
        self.controllers.shutdown().await;
    }
}

async fn setup() -> (KubeApiServer, EtcdServer, EtcdClient, KvstoreMirror) {
    let (server, etcd) = tokio::join!(KubeApiServer::start(), EtcdServer::start_async());
    let (server, etcd) = (server.expect("kube-apiserver starts"), etcd.expect("etcd starts"));
    server.apply_crds().await.expect("CRDs");
    let operator = server
        .service_account_client("rivet-operator")
        .await
        .expect("operator's account");
    let client = EtcdClient::connect([etcd.endpoint()], None).await.unwrap();
    let duty = KvstoreMirror::new(operator.client, client.clone(), layout(), Duration::from_secs(3600));
    (server, etcd, client, duty)
}

#[tokio::test]
async fn rivet_nodes_are_mirrored_created_updated_deleted_and_leftovers_swept() {
    let (server, _etcd, etcd, duty) = setup().await;
    let layout = layout();
    let nodes: Api<RivetNode> = Api::all(server.admin_client());
    for (name, ip, cidr) in [
        ("n1", "198.18.0.1", "198.19.1.0/24"),
        ("n2", "198.18.0.2", "198.19.2.0/24"),
    ] {
        nodes
            .create(&PostParams::default(), &rivet_node(name, ip, cidr))
            .await
            .unwrap();
    }
    // Before the term: a leftover of a node that is gone, a stale copy of
    // n1, a node's own record on its lease, and another cluster's key.
    let mut kv = etcd.kv_client();
    kv.put(layout.node_key("gone"), "{}", None).await.unwrap();
    kv.put(layout.node_key("n1"), "stale", None).await.unwrap();
    put_leased(&etcd, &layout.node_key("self-registered")).await;
    kv.put("rivet/state/nodes/v1/other-cluster/x", "{}", None)
        .await
        .unwrap();

    let running = Running::start(&duty);
    let n1 = wait_key(&etcd, &layout.node_key("n1"), "n1 mirrored", |v| v != Some("stale")).await;
    let record = node_record(n1.as_ref().map(|(v, _)| v.as_str())).expect("n1's record");
    assert_eq!(record.name, "n1");
    assert_eq!(record.cluster, CLUSTER);
    assert_eq!(record.source, RecordSource::Operator);
    assert_eq!(record.pod_cidrs, ["198.19.1.0/24".parse().unwrap()]);
    assert_eq!(record.addresses[0].ip.to_string(), "198.18.0.1");
    assert_eq!(record.encapsulation.port, Some(8472));
    wait_key(&etcd, &layout.node_key("n2"), "n2 mirrored", |v| v.is_some()).await;
    wait_key(
        &etcd,
        &layout.node_key("gone"),
        "the leftover swept at the term's start",
        |v| v.is_none(),
    )
    .await;
    // The mirror key has no lease: the operator's copy.
    let resp = kv.get(layout.node_key("n1"), None).await.unwrap();
    assert_eq!(resp.kvs()[0].lease(), 0);

    // Update: n2's pod CIDR changes.
    let patch = json!({"spec": {"podCidrs": ["198.19.22.0/24"]}});
    nodes
        .patch("n2", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    wait_key(&etcd, &layout.node_key("n2"), "n2 updated", |v| {
        node_record(v).is_some_and(|r| r.pod_cidrs == ["198.19.22.0/24".parse().unwrap()])
    })
    .await;
    let n2 = get(&etcd, &layout.node_key("n2")).await.unwrap();
    assert!(n2.1 > 0);

    // A change elsewhere (n3 joins) rewrites nothing that is already right.
    let n1_revision = get(&etcd, &layout.node_key("n1")).await.unwrap().1;
    nodes
        .create(&PostParams::default(), &rivet_node("n3", "198.18.0.3", "198.19.3.0/24"))
        .await
        .unwrap();
    wait_key(&etcd, &layout.node_key("n3"), "n3 mirrored", |v| v.is_some()).await;
    assert_eq!(
        get(&etcd, &layout.node_key("n1")).await.unwrap().1,
        n1_revision,
        "n1 was rewritten"
    );
    assert_eq!(
        get(&etcd, &layout.node_key("n2")).await.unwrap().1,
        n2.1,
        "n2 was rewritten"
    );

    // Delete: the key goes with the RivetNode.
    nodes.delete("n1", &DeleteParams::default()).await.unwrap();
    wait_key(&etcd, &layout.node_key("n1"), "n1's key deleted", |v| v.is_none()).await;

    // A leftover appearing while the term runs is swept on the next change.
    kv.put(layout.node_key("gone-later"), "{}", None).await.unwrap();
    nodes.delete("n3", &DeleteParams::default()).await.unwrap();
    wait_key(&etcd, &layout.node_key("n3"), "n3's key deleted", |v| v.is_none()).await;
    wait_key(&etcd, &layout.node_key("gone-later"), "the later leftover swept", |v| {
        v.is_none()
    })
    .await;

    // Never touched: a node's own record on its lease, another cluster's key.
    assert_eq!(
        get(&etcd, &layout.node_key("self-registered"))
            .await
            .map(|(v, _)| v)
            .as_deref(),
        Some("a node's own record")
    );
    assert!(get(&etcd, "rivet/state/nodes/v1/other-cluster/x").await.is_some());
    running.stop().await;

    // Stopped: the records stay as they were (the mirror is a copy).
    let left = kv
        .get(
            layout.node_prefix(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    let keys: Vec<&str> = left.kvs().iter().map(|kv| kv.key_str().unwrap()).collect();
    assert_eq!(keys, [layout.node_key("n2"), layout.node_key("self-registered")]);
}

fn service(name: &str, global: Option<&str>) -> Service {
    let annotations = global.map(|v| json!({"service.rivet.io/global": v}));
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"tier": "front"}, "annotations": annotations},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    }))
    .unwrap()
}

fn slice(name: &str, service: &str, ready: &[&str], not_ready: &[&str]) -> EndpointSlice {
    let endpoint = |ip: &&str, ready: bool| json!({"addresses": [ip], "conditions": {"ready": ready}});
    let endpoints: Vec<_> = ready
        .iter()
        .map(|ip| endpoint(ip, true))
        .chain(not_ready.iter().map(|ip| endpoint(ip, false)))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }))
    .unwrap()
}

/// Every key under `prefix` written or deleted after revision `after`,
/// from etcd's history (the test's etcd never compacts). Puts a marker key
/// under the prefix to know where the history ends: call it once nothing
/// else writes there.
async fn keys_touched(etcd: &EtcdClient, prefix: &str, after: i64) -> BTreeSet<String> {
    let marker = format!("{prefix}end-of-test-marker");
    etcd.kv_client().put(marker.as_str(), "", None).await.unwrap();
    let options = WatchOptions::new().with_prefix().with_start_revision(after + 1);
    let mut stream = etcd.watch_client().watch(prefix, Some(options)).await.unwrap();
    let mut keys = BTreeSet::new();
    loop {
        let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("etcd replays its history")
            .unwrap()
            .expect("the watch stays open");
        for event in resp.events() {
            let key = event.kv().unwrap().key_str().unwrap();
            if key == marker {
                etcd.kv_client().delete(marker.as_str(), None).await.unwrap();
                return keys;
            }
            keys.insert(key.to_string());
        }
    }
}

fn backends(record: &ServiceRecord) -> Vec<String> {
    record.backends.iter().map(|b| b.ip.to_string()).collect()
}

#[tokio::test]
async fn global_services_are_mirrored_with_their_ready_endpoints_and_others_never() {
    let (server, _etcd, etcd, duty) = setup().await;
    let layout = layout();
    server.ensure_namespace("shop").await.unwrap();
    let services: Api<Service> = Api::namespaced(server.admin_client(), "shop");
    let slices: Api<EndpointSlice> = Api::namespaced(server.admin_client(), "shop");
    let web = services
        .create(&PostParams::default(), &service("web", Some("true")))
        .await
        .unwrap();
    let cluster_ip = web.spec.unwrap().cluster_ip.unwrap();
    slices
        .create(
            &PostParams::default(),
            &slice("web-1", "web", &["198.19.1.5"], &["198.19.1.6"]),
        )
        .await
        .unwrap();
    services
        .create(&PostParams::default(), &service("private", None))
        .await
        .unwrap();
    slices
        .create(
            &PostParams::default(),
            &slice("private-1", "private", &["198.19.1.7"], &[]),
        )
        .await
        .unwrap();
    services
        .create(&PostParams::default(), &service("opted-out", Some("false")))
        .await
        .unwrap();
    // Before the term: a leftover and a service key on a lease.
    let mut kv = etcd.kv_client();
    kv.put(layout.service_key("shop", "old"), "{}", None).await.unwrap();
    put_leased(&etcd, &layout.service_key("shop", "leased")).await;

    let before = kv.get("x", None).await.unwrap().header().unwrap().revision();
    let running = Running::start(&duty);
    let key = layout.service_key("shop", "web");
    let got = wait_key(&etcd, &key, "web mirrored", |v| v.is_some()).await;
    let record = service_record(got.as_ref().map(|(v, _)| v.as_str())).unwrap();
    assert_eq!(
        (record.cluster.as_str(), record.namespace.as_str(), record.name.as_str()),
        (CLUSTER, "shop", "web")
    );
    assert_eq!(record.frontends.len(), 1);
    assert_eq!(record.frontends[0].ip.to_string(), cluster_ip);
    assert_eq!(
        (
            record.frontends[0].ports[0].name.as_str(),
            record.frontends[0].ports[0].port
        ),
        ("http", 80)
    );
    assert_eq!(backends(&record), ["198.19.1.5"], "only ready endpoints");
    assert_eq!(record.backends[0].ports[0].port, 8080);
    assert_eq!(record.selector["app"], "web");
    assert_eq!(record.labels["tier"], "front");
    wait_key(&etcd, &layout.service_key("shop", "old"), "the leftover swept", |v| {
        v.is_none()
    })
    .await;

    // Update: an endpoint becomes ready, another appears in a second slice.
    slices
        .replace("web-1", &PostParams::default(), &{
            let mut s = slice("web-1", "web", &["198.19.1.5", "198.19.1.6"], &[]);
            s.metadata.resource_version = slices.get("web-1").await.unwrap().metadata.resource_version;
            s
        })
        .await
        .unwrap();
    slices
        .create(&PostParams::default(), &slice("web-2", "web", &["198.19.2.5"], &[]))
        .await
        .unwrap();
    wait_key(&etcd, &key, "web's backends updated", |v| {
        service_record(v).is_some_and(|r| backends(&r) == ["198.19.1.5", "198.19.1.6", "198.19.2.5"])
    })
    .await;

    // The annotation goes: the key goes; back: the key is back.
    let annotate = |v: Option<&str>| json!({"metadata": {"annotations": {"service.rivet.io/global": v}}});
    services
        .patch("web", &PatchParams::default(), &Patch::Merge(&annotate(None)))
        .await
        .unwrap();
    wait_key(&etcd, &key, "unannotated: deleted", |v| v.is_none()).await;
    services
        .patch("web", &PatchParams::default(), &Patch::Merge(&annotate(Some("true"))))
        .await
        .unwrap();
    wait_key(&etcd, &key, "annotated again: mirrored", |v| v.is_some()).await;

    // Delete: the key goes.
    services.delete("web", &DeleteParams::default()).await.unwrap();
    wait_key(&etcd, &key, "deleted with its Service", |v| v.is_none()).await;

    // After all those passes: the unannotated and opted-out services were
    // never mirrored (not even for a moment), the leased key is untouched.
    running.stop().await;
    let touched = keys_touched(&etcd, &layout.service_prefix(), before).await;
    assert_eq!(
        touched,
        BTreeSet::from([layout.service_key("shop", "old"), key.clone()]),
        "keys the mirror wrote or deleted"
    );
    let all = kv
        .get(
            layout.service_prefix(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    let keys: Vec<&str> = all.kvs().iter().map(|kv| kv.key_str().unwrap()).collect();
    assert_eq!(keys, [layout.service_key("shop", "leased")]);
}

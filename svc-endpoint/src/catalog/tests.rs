//! The catalog in-process: a recording loader and a pod list stand in for
//! svc-loader and the endpoint manager (the real ones are in
//! `tests/services.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use rivet_common::controller::Controllers;
use rivet_policy::{NamedPort, Protocol};
use rivet_proto::loader::v1 as lb;
use tokio::sync::watch;
use tonic::Status;

use super::backends::PodInfo;
use super::document::ObjectKind;
use super::*;
use crate::clients::{ApiResult, LoadBalancerApi};

/// svc-loader's LoadBalancerService as a map, with a boot id and a call log.
#[derive(Default)]
struct RecordingLoader {
    boot_id: Mutex<String>,
    services: Mutex<BTreeMap<u32, lb::LbService>>,
    calls: Mutex<Vec<String>>,
    /// Service ids UpsertService refuses (FRONTEND_HELD).
    refuse: Mutex<Vec<u32>>,
    /// GetInfo calls.
    info_calls: std::sync::atomic::AtomicUsize,
}

impl RecordingLoader {
    fn new() -> Arc<Self> {
        let loader = Self::default();
        *loader.boot_id.lock().unwrap() = "boot-1".into();
        Arc::new(loader)
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.calls.lock().unwrap())
    }

    fn held(&self) -> BTreeMap<u32, lb::LbService> {
        self.services.lock().unwrap().clone()
    }

    fn restart(&self) {
        *self.boot_id.lock().unwrap() = "boot-2".into();
    }
}

impl LoadBalancerApi for RecordingLoader {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.info_calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = self.boot_id.lock().unwrap().clone();
        async move { Ok(id) }.boxed()
    }
    fn upsert_service(&self, service: lb::LbService) -> BoxFuture<'_, ApiResult<lb::UpsertServiceResponse>> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("upsert {}", service.service_id));
        let result = if self.refuse.lock().unwrap().contains(&service.service_id) {
            Err(Status::already_exists("frontend held by service 99"))
        } else {
            self.services.lock().unwrap().insert(service.service_id, service);
            Ok(lb::UpsertServiceResponse {
                changed: true,
                boot_id: self.boot_id.lock().unwrap().clone(),
            })
        };
        async move { result }.boxed()
    }
    fn delete_service(&self, service_id: u32) -> BoxFuture<'_, ApiResult<lb::DeleteServiceResponse>> {
        self.calls.lock().unwrap().push(format!("delete {service_id}"));
        let existed = self.services.lock().unwrap().remove(&service_id).is_some();
        let boot_id = self.boot_id.lock().unwrap().clone();
        async move { Ok(lb::DeleteServiceResponse { existed, boot_id }) }.boxed()
    }
    fn replace_services(&self, services: Vec<lb::LbService>) -> BoxFuture<'_, ApiResult<lb::ReplaceServicesResponse>> {
        self.calls.lock().unwrap().push(format!("replace {}", services.len()));
        *self.services.lock().unwrap() = services.into_iter().map(|s| (s.service_id, s)).collect();
        let boot_id = self.boot_id.lock().unwrap().clone();
        async move {
            Ok(lb::ReplaceServicesResponse {
                upserted: 0,
                deleted: 0,
                boot_id,
            })
        }
        .boxed()
    }
    fn list_services(&self) -> BoxFuture<'_, ApiResult<lb::ListServicesResponse>> {
        let services = self
            .held()
            .into_values()
            .map(|s| lb::LbServiceStatus {
                service: Some(s),
                ..Default::default()
            })
            .collect();
        let boot_id = self.boot_id.lock().unwrap().clone();
        async move {
            Ok(lb::ListServicesResponse {
                services,
                boot_id,
                ..Default::default()
            })
        }
        .boxed()
    }
}

/// A settable pod list.
struct Pods {
    pods: Mutex<Option<Vec<PodInfo>>>,
    changes: watch::Sender<u64>,
    /// Calls of `pods()`: what building the pods costs the endpoint manager.
    built: std::sync::atomic::AtomicUsize,
}

impl Pods {
    fn new(pods: Option<Vec<PodInfo>>) -> Arc<Self> {
        Arc::new(Self {
            pods: Mutex::new(pods),
            changes: watch::channel(0).0,
            built: Default::default(),
        })
    }

    fn built(&self) -> usize {
        self.built.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn set(&self, pods: Vec<PodInfo>) {
        *self.pods.lock().unwrap() = Some(pods);
        self.changes.send_modify(|n| *n += 1);
    }
}

impl PodSource for Pods {
    fn pods(&self) -> Option<Vec<PodInfo>> {
        self.built.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.pods.lock().unwrap().clone()
    }
    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

fn pod(name: &str, address: &str) -> PodInfo {
    PodInfo {
        namespace: "shop".into(),
        name: name.into(),
        labels: BTreeMap::from([("app".into(), "web".into())]),
        addresses: vec![address.parse().unwrap()],
        named_ports: vec![NamedPort::new("http", Protocol::Tcp, 8080)],
        node_name: String::new(),
        local: true,
        terminating: false,
    }
}

const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  ipFamilyPolicy: PreferDualStack\n  selector: {app: web}\n  ports: [{name: http, port: 80, targetPort: http}]\n";

const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: shop\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nports: [{name: http, port: 9090}]\nendpoints: [{addresses: [198.18.0.50]}]\n";

fn catalog(dir: &std::path::Path, loader: Arc<RecordingLoader>, pods: Arc<Pods>) -> ServiceCatalog {
    catalog_polling(dir, loader, pods, Duration::from_millis(20))
}

fn catalog_polling(
    dir: &std::path::Path,
    loader: Arc<RecordingLoader>,
    pods: Arc<Pods>,
    loader_poll: Duration,
) -> ServiceCatalog {
    let options = CatalogOptions {
        loader_poll,
        ..CatalogOptions::new(
            dir,
            vec!["198.19.128.0/20".parse().unwrap(), "2001:2:0:ff::/112".parse().unwrap()],
            "n1",
        )
    };
    ServiceCatalog::new(options, loader, pods, CatalogMetrics::default()).unwrap()
}

const WAIT: Duration = Duration::from_secs(10);

fn backends(service: &lb::LbService) -> Vec<String> {
    service
        .backends
        .iter()
        .map(|b| format!("{}:{}", rivet_proto::net::format_address(&b.address), b.port))
        .collect()
}

#[tokio::test]
async fn apply_allocates_pushes_and_survives_a_restart_with_nothing_changed() {
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let pods = Pods::new(Some(vec![pod("web-1", "198.18.0.5"), pod("web-2", "2001:2::6")]));
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), pods.clone());
    c.start(&controllers);

    let applied = c.apply(WEB, Origin::Api, true, WAIT).await.unwrap();
    assert!(applied.changed);
    assert_eq!(
        applied.cluster_ips,
        [
            "198.19.128.1".parse::<IpAddr>().unwrap(),
            "2001:2:0:ff::1".parse().unwrap()
        ]
    );
    let held = loader.held();
    assert_eq!(held.len(), 2, "one loader service per family: {held:?}");
    let by_family: BTreeMap<i32, Vec<String>> = held.values().map(|s| (s.family, backends(s))).collect();
    assert_eq!(by_family[&(lb::Family::Ipv4 as i32)], ["198.18.0.5:8080"]);
    assert_eq!(by_family[&(lb::Family::Ipv6 as i32)], ["2001:2::6:8080"]);

    // The same document again changes nothing, keeps the IPs.
    let again = c.apply(WEB, Origin::Api, true, WAIT).await.unwrap();
    assert!(!again.changed);
    assert_eq!(again.cluster_ips, applied.cluster_ips);

    // An API EndpointSlice takes over from the selector: one upsert, IPv4 only.
    loader.calls();
    c.apply(SLICE, Origin::Api, true, WAIT).await.unwrap();
    let v4 = loader
        .held()
        .into_values()
        .find(|s| s.family == lb::Family::Ipv4 as i32)
        .unwrap();
    assert_eq!(backends(&v4), ["198.18.0.50:9090"]);
    let calls = loader.calls();
    assert!(calls.iter().all(|c| c.starts_with("upsert")), "{calls:?}");
    let ids_before: Vec<u32> = loader.held().keys().copied().collect();
    controllers.shutdown().await;
    drop(c);

    // A new catalog over the same dir (svc-endpoint restarted): same IPs and
    // ids, one replace of an identical set into the same loader.
    let controllers = Controllers::new();
    let held_before = loader.held();
    let c = catalog(dir.path(), loader.clone(), pods.clone());
    c.start(&controllers);
    let view = c.list("shop");
    assert_eq!(view[0].cluster_ips, ["198.19.128.1", "2001:2:0:ff::1"]);
    let reapplied = c.apply(WEB, Origin::Api, true, WAIT).await.unwrap();
    assert!(!reapplied.changed, "restored as stored");
    assert_eq!(loader.held(), held_before, "the loader holds exactly what it held");
    assert_eq!(loader.held().keys().copied().collect::<Vec<_>>(), ids_before);
    let calls = loader.calls();
    assert_eq!(calls, ["replace 2"], "{calls:?}");

    // svc-loader restarted: the whole set again.
    loader.restart();
    c.delete(
        &ObjectKey {
            kind: ObjectKind::EndpointSlice,
            namespace: "shop".into(),
            name: "web-1".into(),
        },
        Origin::Api,
        true,
        WAIT,
    )
    .await
    .unwrap();
    let calls = loader.calls();
    assert!(calls.contains(&"replace 2".to_string()), "{calls:?}");
    controllers.shutdown().await;
}

#[tokio::test]
async fn pods_joining_and_leaving_move_the_backends() {
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let pods = Pods::new(Some(vec![pod("web-1", "198.18.0.5")]));
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), pods.clone());
    c.start(&controllers);
    let web = WEB.replace("ipFamilyPolicy: PreferDualStack", "ipFamilyPolicy: SingleStack");
    c.apply(&web, Origin::Api, true, WAIT).await.unwrap();
    let held = || loader.held().into_values().next().unwrap();
    assert_eq!(backends(&held()), ["198.18.0.5:8080"]);

    let mut leaving = pod("web-1", "198.18.0.5");
    leaving.terminating = true;
    pods.set(vec![leaving, pod("web-2", "198.18.0.6")]);
    let realised = async {
        loop {
            let s = held();
            if backends(&s) == ["198.18.0.5:8080", "198.18.0.6:8080"]
                && s.backends[0].state == lb::BackendState::Terminating as i32
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(WAIT, realised)
        .await
        .expect("the new pod is a backend, the old one terminating");
    pods.set(vec![pod("web-2", "198.18.0.6")]);
    tokio::time::timeout(WAIT, async {
        while backends(&held()) != ["198.18.0.6:8080"] {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the deleted pod leaves");
    controllers.shutdown().await;
}

#[tokio::test]
async fn passes_build_the_pods_only_for_services_and_only_after_they_changed() {
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let pods = Pods::new(Some(vec![pod("web-1", "198.18.0.5")]));
    // Not started: the test runs each pass itself.
    let c = catalog(dir.path(), loader.clone(), pods.clone());
    for _ in 0..3 {
        c.push_pass().await.unwrap();
    }
    pods.set(vec![pod("web-2", "198.18.0.6")]);
    c.push_pass().await.unwrap();
    assert_eq!(pods.built(), 0, "no Service: the pods are never built");

    let web = WEB.replace("ipFamilyPolicy: PreferDualStack", "ipFamilyPolicy: SingleStack");
    c.apply(&web, Origin::Api, false, WAIT).await.unwrap();
    c.push_pass().await.unwrap();
    let held = || loader.held().into_values().map(|s| backends(&s)).collect::<Vec<_>>();
    assert_eq!(held(), [["198.18.0.6:8080"]]);
    assert_eq!(pods.built(), 1);
    for _ in 0..3 {
        c.push_pass().await.unwrap();
    }
    assert_eq!(pods.built(), 1, "the same revision: the pods of the last pass");

    pods.set(vec![pod("web-3", "198.18.0.7")]);
    c.push_pass().await.unwrap();
    assert_eq!(pods.built(), 2);
    assert_eq!(held(), [["198.18.0.7:8080"]]);
}

#[tokio::test]
async fn selector_services_wait_for_the_pods_after_a_start() {
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let pods = Pods::new(None);
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), pods.clone());
    c.start(&controllers);
    c.apply(WEB, Origin::Api, false, WAIT).await.unwrap();
    let err = c
        .apply(WEB, Origin::Api, true, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, CatalogError::NotRealisedInTime { .. }), "{err}");
    let calls = loader.calls();
    assert!(
        loader.held().is_empty() && calls.iter().all(|c| c == "replace 0"),
        "nothing pushed without the pods: {calls:?}"
    );
    pods.set(vec![pod("web-1", "198.18.0.5")]);
    c.apply(WEB, Origin::Api, true, WAIT).await.unwrap();
    assert_eq!(loader.held().len(), 2);
    controllers.shutdown().await;
}

#[tokio::test]
async fn conflicts_are_refused_with_their_reason() {
    use rivet_proto::endpoint::v1::ErrorReason as R;
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), Pods::new(Some(Vec::new())));
    c.start(&controllers);
    let reason = |e: CatalogError| rivet_common::grpc::error_reason::<R>(&Status::from(e));

    let given = WEB
        .replace("spec:\n", "spec:\n  clusterIPs: [198.19.128.77]\n")
        .replace("PreferDualStack", "SingleStack");
    c.apply(&given, Origin::Api, false, WAIT).await.unwrap();
    // Another Service asking for the same address.
    let other = given.replace("name: web,", "name: other,");
    let err = c.apply(&other, Origin::Api, false, WAIT).await.unwrap_err();
    assert!(err.to_string().contains("belongs to Service shop/web"), "{err}");
    assert_eq!(reason(err), Some(R::ClusterIpUnavailable));
    // Outside the service CIDR.
    let outside = other.replace("198.19.128.77", "198.18.5.5");
    let err = c.apply(&outside, Origin::Api, false, WAIT).await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("spec.clusterIP: 198.18.5.5 is not in a --service-cidr"),
        "{err}"
    );
    assert_eq!(reason(err), Some(R::ServiceInvalid));
    // The key is the API's.
    let err = c.apply(&given, Origin::Kubernetes, false, WAIT).await.unwrap_err();
    assert_eq!(reason(err), Some(R::ServiceOriginConflict));
    // Node ports: a taken one is refused, absent ones are allocated and kept.
    let np = "apiVersion: v1\nkind: Service\nmetadata: {name: np}\nspec:\n  type: NodePort\n  ports: [{port: 80}]\n";
    c.apply(np, Origin::Api, false, WAIT).await.unwrap();
    let (view, _) = c.get("default", "np").unwrap();
    assert_eq!(view.ports[0].node_port, 30_000);
    c.apply(np, Origin::Api, false, WAIT).await.unwrap();
    assert_eq!(c.get("default", "np").unwrap().0.ports[0].node_port, 30_000);
    let taken = np
        .replace("name: np", "name: np2")
        .replace("{port: 80}", "{port: 80, nodePort: 30000}");
    let err = c.apply(&taken, Origin::Api, false, WAIT).await.unwrap_err();
    assert!(
        err.to_string().contains("30000/TCP belongs to Service default/np"),
        "{err}"
    );

    // svc-loader refusing one service: the waiter hears it, others pass.
    let (view, _) = c.get("shop", "web").unwrap();
    loader.refuse.lock().unwrap().push(view.load_balancer[0].service_id);
    let changed = given.replace("port: 80,", "port: 81,");
    let err = c.apply(&changed, Origin::Api, true, WAIT).await.unwrap_err();
    assert_eq!(reason(err), Some(R::ServiceRefusedByLoader));
    assert!(!c.get("shop", "web").unwrap().0.load_balancer[0].realised);
    assert!(c.get("default", "np").unwrap().0.load_balancer[0].realised);
    controllers.shutdown().await;
}

/// A Service as the API server has it: its own clusterIP (need not be in
/// this node's CIDR), one port.
fn k8s(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
    )
}

/// A replay replaces the KUBERNETES objects (the API's stay), and refused
/// documents do not hold back the clean-up: what no document names goes,
/// a refused document that names its object keeps the one held, and a new
/// Service may take a stale one's clusterIP.
#[tokio::test]
async fn a_kubernetes_replay_removes_stale_objects_whatever_it_refused() {
    use rivet_proto::endpoint::v1::ErrorReason as R;
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), Pods::new(Some(Vec::new())));
    c.start(&controllers);
    let slice = |service: &str| {
        SLICE
            .replace("web-1", &format!("{service}-1"))
            .replace("service-name: web", &format!("service-name: {service}"))
            .replace("namespace: shop", "namespace: default")
    };
    for document in [
        k8s("a", "10.96.0.10"),
        k8s("b", "10.96.0.11"),
        k8s("d", "10.96.0.12"),
        slice("d"),
    ] {
        c.apply(&document, Origin::Kubernetes, false, WAIT).await.unwrap();
    }
    c.apply(WEB, Origin::Api, false, WAIT).await.unwrap();

    let outcome = c
        .replay_kubernetes(vec![
            ("item 1".into(), k8s("a", "10.96.0.10")),
            ("item 2".into(), "kind: Service\n".into()),
            (
                "item 3".into(),
                k8s("b", "10.96.0.11").replace("spec: {", "spec: {type: ExternalName, "),
            ),
            ("item 4".into(), k8s("c", "10.96.0.12")),
        ])
        .await
        .unwrap();
    let rejected: Vec<(&str, Option<String>, R)> = outcome
        .rejected
        .iter()
        .map(|r| (r.item.as_str(), r.key.as_ref().map(ToString::to_string), r.reason))
        .collect();
    assert_eq!(
        rejected,
        [
            ("item 2", None, R::ServiceInvalid),
            ("item 3", Some("Service default/b".to_string()), R::ServiceInvalid)
        ],
        "{:?}",
        outcome.rejected
    );
    assert!(
        outcome.rejected[1].message.starts_with("spec.type: ExternalName"),
        "{:?}",
        outcome.rejected
    );
    // d and its slice were stale; c took d's clusterIP; b stays as held.
    assert_eq!((outcome.applied, outcome.removed), (2, 2));
    let names: Vec<String> = c.list("").into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["a", "b", "c", "web"]);
    assert_eq!(c.get("default", "c").unwrap().0.cluster_ips, ["10.96.0.12"]);
    assert_eq!(c.get("default", "b").unwrap().0.r#type, "ClusterIP");
    let stored = std::fs::read_dir(dir.path().join("services")).unwrap().count();
    assert_eq!(stored, 4, "the stale objects' files are gone");
    controllers.shutdown().await;
}

/// Deleting an API Service deletes the API's EndpointSlices labelled for
/// it (Kubernetes' garbage collection through ownerReferences), not other
/// Services' slices.
#[tokio::test]
async fn deleting_a_service_deletes_its_endpoint_slices() {
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let controllers = Controllers::new();
    let c = catalog(dir.path(), loader.clone(), Pods::new(Some(Vec::new())));
    c.start(&controllers);
    let other = WEB.replace("name: web,", "name: other,");
    let other_slice = SLICE
        .replace("web-1", "other-1")
        .replace("service-name: web", "service-name: other");
    for document in [WEB, SLICE, &SLICE.replace("web-1", "web-2"), &other, &other_slice] {
        c.apply(document, Origin::Api, false, WAIT).await.unwrap();
    }
    let key = |kind, name: &str| ObjectKey {
        kind,
        namespace: "shop".into(),
        name: name.into(),
    };
    assert!(
        c.delete(&key(ObjectKind::Service, "web"), Origin::Api, true, WAIT)
            .await
            .unwrap()
    );
    let (_, documents) = c.get("shop", "other").unwrap();
    assert_eq!(documents.len(), 2, "other keeps its slice");
    let stored: BTreeSet<String> = std::fs::read_dir(dir.path().join("services"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(stored.len(), 2, "web's slices are gone from the state dir: {stored:?}");
    // Applied again, web has no slice: its backends come from its selector.
    c.apply(WEB, Origin::Api, false, WAIT).await.unwrap();
    let (_, documents) = c.get("shop", "web").unwrap();
    assert_eq!(documents.len(), 1, "{documents:?}");
    assert!(
        !c.delete(&key(ObjectKind::EndpointSlice, "web-1"), Origin::Api, false, WAIT)
            .await
            .unwrap()
    );
    controllers.shutdown().await;
}

/// Pushes learn svc-loader's boot id from their answers: a burst of
/// changes asks no GetInfo; an idle catalog still polls and replays the
/// whole set into a restarted loader.
#[tokio::test]
async fn pushes_learn_the_boot_id_from_answers_and_only_an_idle_catalog_polls() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let loader = RecordingLoader::new();
    let controllers = Controllers::new();
    let poll = Duration::from_secs(5);
    let c = catalog_polling(dir.path(), loader.clone(), Pods::new(Some(Vec::new())), poll);
    c.start(&controllers);
    let service = |port: u16| {
        format!("apiVersion: v1\nkind: Service\nmetadata: {{name: s{port}}}\nspec: {{ports: [{{port: {port}}}]}}\n")
    };
    for port in 1..=30 {
        c.apply(&service(port), Origin::Api, true, WAIT).await.unwrap();
    }
    assert_eq!(loader.held().len(), 30);
    // Before: one GetInfo per pass, 30 or more (one if the burst outlasted a poll).
    let polls = loader.info_calls.load(SeqCst);
    assert!(polls <= 1, "30 pushes asked GetInfo {polls} times");
    assert_eq!(c.metrics().loader_polls(), polls as u64);

    // Idle: GetInfo every `loader_poll`; a restarted loader gets the whole set.
    loader.calls();
    loader.restart();
    tokio::time::timeout(poll * 3, async {
        while !loader.calls().contains(&"replace 30".to_string()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("an idle catalog notices the restart and replays");
    assert!(c.metrics().loader_polls() >= 1);
    controllers.shutdown().await;
}

//! Every component's spans in the in-cluster Jaeger (issue 18 §4): the
//! images of `cargo xtask image` (rivet from the dev binaries, tag `dev` as
//! deploy/ names it, and the Jaeger image) imported into both workers of a
//! real cluster started without a CNI, `kubectl apply -k deploy/`, one
//! busybox pod created on the node running Jaeger:
//!
//! - `one_pod_creation_is_one_trace_in_the_cluster_s_jaeger`: Jaeger, read
//!   from worker 1's network namespace
//!   (`rivet_e2e::kube_cluster::jaeger::ClusterJaeger`), holds the pod's
//!   `cni.add` trace (rivet-cni, its conflist's `tracing.otlpEndpoint`) with
//!   spans of svc-ipam, svc-endpoint, svc-identity, svc-loader and
//!   svc-k8s-sync (`apply_rivet_endpoint` of the pod's RivetEndpoint, its
//!   parent the context svc-endpoint's watch item carries) under its trace
//!   id: the host-network daemons and rivet-cni (run by the worker's
//!   containerd) reach the jaeger ClusterIP through socket load balancing
//!   on the node's cgroup (`socket-lb-cgroup`, deploy/README "Traces").
//!
//! Needs root, containerd, runc, /usr/lib/cni, busybox-static, the
//! Kubernetes tools and jaeger (`cargo xtask install`) and the workspace
//! binaries (`cargo build --bins`); a missing one fails the test.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use rivet_common::testing::workspace_binary;
use rivet_e2e::kube_cluster::jaeger::ClusterJaeger;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, WorkerCni};
use rivet_e2e::kube_deploy::busybox_pod;
use rivet_oci::images::{ImageSet, JaegerBinary, write_images};
use rivet_testkit::jaeger::{JaegerSpan, parse_traces, service_query_path};

/// How long deploy/ may take to be Ready on both nodes.
const DEPLOY_TIMEOUT: Duration = Duration::from_secs(240);
/// How long the spans may take to be in Jaeger (batch exporters, retries
/// while the ClusterIP was not served yet).
const TRACE_TIMEOUT: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(500);

/// The components whose spans the pod's creation trace holds.
const TRACED: [&str; 6] = [
    "rivet-cni",
    "svc-ipam",
    "svc-endpoint",
    "svc-identity",
    "svc-loader",
    "svc-k8s-sync",
];

async fn wait_for<T>(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> Result<T, String>) -> T {
    let started = Instant::now();
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) if started.elapsed() > timeout => panic!("{what}: not within {timeout:?}: {last}"),
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_pod_creation_is_one_trace_in_the_cluster_s_jaeger() {
    let images = tempfile::Builder::new().prefix("rivet-kjaeger-").tempdir().unwrap();
    let written = write_images(&ImageSet {
        bin_dir: workspace_binary("rivet").parent().unwrap().to_path_buf(),
        busybox: rivet_oci::busybox::HOST_BUSYBOX.into(),
        out_dir: images.path().to_path_buf(),
        tag: "dev".into(),
        compression: rivet_oci::Compression::GZIP_FAST,
        jaeger: Some(JaegerBinary::installed().unwrap_or_else(|e| panic!("{e}"))),
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let jaeger_archive = written.jaeger.as_ref().expect("asked for").path.clone();
    let mut cluster = KubeCluster::start(KubeClusterOptions {
        cni: WorkerCni::None,
        images: vec![written.rivet.path.clone(), jaeger_archive],
        ..KubeClusterOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    drop(images);

    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let out = cluster
        .kubectl()
        .unwrap()
        .arg("apply")
        .arg("-k")
        .arg(&deploy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl apply -k deploy/: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client = cluster.admin_client();
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    wait_for(
        "the rivet-node DaemonSet Ready on both nodes",
        DEPLOY_TIMEOUT,
        async || {
            let status = daemonsets
                .get("rivet-node")
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            (status.desired_number_scheduled == 2 && status.number_ready == 2)
                .then_some(())
                .ok_or(format!("{status:?}"))
        },
    )
    .await;
    cluster
        .wait_nodes_ready(DEPLOY_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "kube-system");
    wait_for("Jaeger available", DEPLOY_TIMEOUT, async || {
        let status = deployments
            .get("jaeger")
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        (status.available_replicas == Some(1))
            .then_some(())
            .ok_or(format!("{status:?}"))
    })
    .await;
    let system_pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let jaeger_pod = system_pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=jaeger"))
        .await
        .unwrap()
        .items
        .into_iter()
        .next()
        .expect("the Jaeger pod");
    let node = jaeger_pod.spec.unwrap().node_name.expect("Jaeger is scheduled");

    // One pod on Jaeger's node: its spans reach Jaeger without crossing nodes.
    let since = SystemTime::now();
    let name = format!("traced-{}", std::process::id());
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod: Pod = serde_json::from_value(busybox_pod(&name, &node, serde_json::json!({}))).unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_for("the traced pod Running with an address", DEPLOY_TIMEOUT, async || {
        let status = pods
            .get(&name)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        (status.phase.as_deref() == Some("Running") && status.pod_ip.is_some())
            .then_some(())
            .ok_or(format!("{status:?}"))
    })
    .await;

    let jaeger = ClusterJaeger::new(client.clone(), &cluster.workers()[0].netns.path());
    let mut last = Vec::new();
    let spans = wait_for(
        "the pod's cni.add trace with every component",
        TRACE_TIMEOUT,
        async || {
            let path = service_query_path("rivet-cni", since, SystemTime::now() + Duration::from_secs(60));
            let body = jaeger.get(&path).await.map_err(|e| e.to_string())?;
            let spans = match body {
                Some(body) => parse_traces(body.as_bytes()).map_err(|e| e.to_string())?,
                None => Vec::new(),
            };
            let Some(add) = spans
                .iter()
                .find(|s| s.name == "cni.add" && s.attribute("k8s.pod.name") == Some(name.as_str()))
            else {
                last = services_by_trace(&spans);
                return Err(format!("no cni.add of {name}; traces: {last:?}"));
            };
            let trace: Vec<JaegerSpan> = spans.iter().filter(|s| s.trace_id == add.trace_id).cloned().collect();
            let services: BTreeSet<&str> = trace.iter().map(|s| s.service_name.as_str()).collect();
            if TRACED.iter().all(|s| services.contains(s)) {
                Ok(trace)
            } else {
                Err(format!("trace {} has {services:?}", add.trace_id))
            }
        },
    )
    .await;
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service_name.as_str()).collect();
    eprintln!(
        "pod {name} on {node}: trace {} with {} spans of {services:?}",
        spans[0].trace_id,
        spans.len()
    );
    for service in TRACED {
        assert!(services.contains(service), "{service} in {services:?}");
    }
    let apply = spans
        .iter()
        .find(|s| s.service_name == "svc-k8s-sync" && s.name == "apply_rivet_endpoint")
        .unwrap_or_else(|| panic!("svc-k8s-sync's apply_rivet_endpoint in the trace: {spans:#?}"));
    assert_eq!(apply.attribute("pod"), Some(name.as_str()), "{apply:#?}");
    assert_eq!(
        spans.iter().filter(|s| s.name == "apply_rivet_endpoint").count(),
        1,
        "one apply span per traced change, not one per watch item: {spans:#?}"
    );
}

/// Each trace's services, for the failure message.
fn services_by_trace(spans: &[JaegerSpan]) -> Vec<(String, BTreeSet<String>)> {
    let ids: BTreeSet<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
    ids.into_iter()
        .map(|id| {
            let services = spans
                .iter()
                .filter(|s| s.trace_id == id)
                .map(|s| s.service_name.clone())
                .collect();
            (id.to_owned(), services)
        })
        .collect()
}

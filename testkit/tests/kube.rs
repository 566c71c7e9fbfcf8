//! The KubeApiServer fixture against the real kube-apiserver v1.34 and etcd
//! 3.6 from `cargo xtask install`.

use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec};
use kube::api::{Api, DynamicObject, ListParams, ObjectMeta, PostParams};
use kube::core::ApiResource;
use rivet_testkit::kube::{KubeApiServer, delete_pod_now};

fn pod(name: &str, node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some([("app".to_string(), "web".to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            containers: vec![Container {
                name: "main".to_string(),
                image: Some("busybox".to_string()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn namespace(name: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// Starts in seconds on 127.0.0.1 with RBAC; the admin creates a namespace
/// and a pod in it at once (no ServiceAccount admission to wait for); the
/// pod survives a restart of kube-apiserver on the same URL; a pod deleted
/// with grace period 0 is gone at once; drop removes everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_api_server_serves_restarts_and_cleans_up() {
    let mut server = KubeApiServer::start().await.expect("kube-apiserver starts");
    eprintln!("kube-apiserver ready after {:?}", server.ready_after());
    let url = server.url();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let client = server.admin_client();
    let version = client.apiserver_version().await.expect("version");
    assert_eq!(version.git_version, "v1.34.4");

    let ns = format!("rivet-test-{}", std::process::id());
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace(&ns))
        .await
        .expect("admin creates a namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.create(&PostParams::default(), &pod("web-1", "node-a"))
        .await
        .expect("a pod right after its namespace");
    pods.create(&PostParams::default(), &pod("web-2", "node-a"))
        .await
        .expect("a second pod");

    let out = server
        .kubectl()
        .expect("kubectl")
        .args(["get", "pods", "-n", &ns, "-o", "name"])
        .output()
        .expect("run kubectl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "pod/web-1\npod/web-2\n");

    let pid = server.pid().expect("runs");
    server.restart().await.expect("kube-apiserver restarts");
    eprintln!("kube-apiserver restarted, ready after {:?}", server.ready_after());
    assert_eq!(server.url(), url);
    assert_ne!(server.pid(), Some(pid));
    let names: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("list pods after the restart (same client)")
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(names, ["web-1", "web-2"]);

    delete_pod_now(client.clone(), &ns, "web-1")
        .await
        .expect("delete web-1");
    assert!(
        pods.get_opt("web-1").await.expect("get web-1").is_none(),
        "web-1 still there"
    );
    delete_pod_now(client.clone(), &ns, "web-1")
        .await
        .expect("deleting a deleted pod is fine");

    let dir = server.admin_kubeconfig().parent().expect("dir").to_path_buf();
    let etcd_data = server.etcd().data_dir();
    drop(server);
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(!etcd_data.exists(), "{} left behind", etcd_data.display());
    assert!(
        std::fs::metadata(format!("/proc/{pid}")).is_err(),
        "kube-apiserver {pid} still runs"
    );
}

/// A ServiceAccount bound to exactly deploy/rbac/svc-identity.yaml may
/// read and create RivetIdentities (CRDs from deploy/crds/ applied) and is
/// refused (403) anything else; svc-k8s-sync's may list pods but not
/// create them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_get_exactly_deploys_rbac() {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    let crds = server.apply_crds().await.expect("CRDs applied and Established");
    assert!(crds.iter().any(|c| c == "rivetidentities.rivet.io"), "{crds:?}");

    let identity = server
        .service_account_client("svc-identity")
        .await
        .expect("svc-identity's ServiceAccount");
    assert_eq!(
        (identity.namespace.as_str(), identity.name.as_str()),
        ("kube-system", "rivet-identity")
    );
    let text = std::fs::read_to_string(&identity.kubeconfig).expect("kubeconfig");
    assert!(text.contains("token: "), "{text}");

    let resource = ApiResource {
        group: "rivet.io".to_string(),
        version: "v1".to_string(),
        api_version: "rivet.io/v1".to_string(),
        kind: "RivetIdentity".to_string(),
        plural: "rivetidentities".to_string(),
    };
    let identities: Api<DynamicObject> = Api::all_with(identity.client.clone(), &resource);
    identities
        .list(&ListParams::default())
        .await
        .expect("svc-identity lists identities");
    let object: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "rivet.io/v1",
        "kind": "RivetIdentity",
        "metadata": {"name": "256"},
        "spec": {"labels": ["k8s:app=web"]},
    }))
    .expect("an identity object");
    identities
        .create(&PostParams::default(), &object)
        .await
        .expect("svc-identity creates an identity");
    let refused = identities
        .delete("256", &Default::default())
        .await
        .expect_err("svc-identity may not delete identities");
    assert_forbidden(&refused, "system:serviceaccount:kube-system:rivet-identity");
    let refused = Api::<Pod>::all(identity.client.clone())
        .list(&ListParams::default())
        .await
        .expect_err("svc-identity may not list pods");
    assert_forbidden(&refused, "system:serviceaccount:kube-system:rivet-identity");

    let sync = server
        .service_account_client("svc-k8s-sync")
        .await
        .expect("svc-k8s-sync's ServiceAccount");
    server.ensure_namespace("rivet-rbac").await.expect("namespace");
    let pods: Api<Pod> = Api::namespaced(sync.client.clone(), "rivet-rbac");
    pods.list(&ListParams::default())
        .await
        .expect("svc-k8s-sync lists pods");
    let refused = pods
        .create(&PostParams::default(), &pod("web", "node-a"))
        .await
        .expect_err("svc-k8s-sync may not create pods");
    assert_forbidden(&refused, "system:serviceaccount:kube-system:rivet-k8s-sync");
}

fn assert_forbidden(err: &kube::Error, user: &str) {
    let kube::Error::Api(status) = err else {
        panic!("expected a refusal by the API, got {err}");
    };
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.is_forbidden(), "{status:?}");
    assert!(status.message.contains(user), "{}", status.message);
}

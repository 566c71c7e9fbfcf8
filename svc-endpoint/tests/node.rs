//! svc-endpoint as a real process with the real svc-identity (embedded
//! store), svc-ipam and svc-loader, and namespace pods: creates are ready
//! with traffic flowing when they return, labels and policies flip traffic.

mod support;

use support::{endpoint_status, eventually, pings, until};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rivet_proto::endpoint::v1 as pb;
use rivet_proto::loader::v1 as ldpb;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use tonic::Code;

const SHORT: Duration = Duration::from_millis(500);

async fn node() -> EndpointNode {
    EndpointNode::start(NodeOptions::default())
        .await
        .expect("the node's daemons start")
}

fn tcp(node: &EndpointNode, from: &str, to: &str, port: u16) -> bool {
    node.pod(from)
        .tcp_echo(SocketAddr::new(node.ipv4(to), port), SHORT)
        .expect("the harness can run a TCP probe")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_created_endpoint_is_ready_and_reachable_when_create_returns() {
    let mut node = node().await;
    let a = node.add_pod("a", &["k8s:app=web"]).await;
    // Measured at the moment create returns: nothing may still be pending.
    node.add_pod_interface("b").await;
    let request = node.create_request("b", &["k8s:app=web"]);
    let b = node
        .endpoints()
        .await
        .create_endpoint(request.clone())
        .await
        .expect("create must succeed")
        .into_inner();
    assert!(
        pings(&node, "a", "b"),
        "b must be reachable the moment its create returns"
    );
    let b = b.endpoint.expect("an endpoint");
    assert_eq!(
        b.state,
        pb::EndpointState::Ready as i32,
        "a synchronous create returns a ready endpoint"
    );
    assert_ne!(b.identity, 0, "a ready endpoint has an identity");
    assert_eq!(a.identity, b.identity, "the same labels must give the same identity");
    assert_ne!(a.id, b.id, "endpoint ids are unique");
    assert!(
        b.identity_labels
            .iter()
            .any(|l| l == "k8s:io.kubernetes.pod.namespace=default"),
        "the namespace is part of the identity: {:?}",
        b.identity_labels
    );

    // The datapath holds both, attached.
    let listed = node.datapath_endpoints().await;
    let ids: Vec<u32> = listed.endpoints.iter().map(|e| e.endpoint_id).collect();
    assert!(
        ids.contains(&a.id) && ids.contains(&b.id),
        "the loader must hold both endpoints: {ids:?}"
    );
    assert!(
        listed
            .endpoints
            .iter()
            .all(|e| e.from_container == ldpb::AttachState::Attached as i32
                && e.to_container == ldpb::AttachState::Attached as i32),
        "both hooks must be attached"
    );

    // Idempotent repeat; an address of another endpoint is refused.
    let again = node
        .endpoints()
        .await
        .create_endpoint(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(!again.created, "the same container + interface again creates nothing");
    assert_eq!(again.endpoint.unwrap().id, b.id);
    let mut stolen = node.create_request("a", &[]);
    stolen.container_id = "other".into();
    let e = node.endpoints().await.create_endpoint(stolen).await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::AlreadyExists,
        "an address owned by another endpoint: {e}"
    );
    let mut changed = request;
    changed.host_ifindex += 1000;
    let e = node.endpoints().await.create_endpoint(changed).await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "same container + interface with other parameters: {e}"
    );

    // Get by every kind of reference.
    for r in [
        pb::endpoint_ref::Ref::Id(b.id),
        pb::endpoint_ref::Ref::Address(rivet_proto::net::address_bytes(node.ipv4("b"))),
        pb::endpoint_ref::Ref::Pod(pb::PodRef {
            namespace: "default".into(),
            name: "b".into(),
        }),
        pb::endpoint_ref::Ref::Container(pb::ContainerInterface {
            container_id: "b".into(),
            interface: "eth0".into(),
        }),
    ] {
        let got = node
            .endpoints()
            .await
            .get_endpoint(pb::GetEndpointRequest {
                r#ref: Some(pb::EndpointRef { r#ref: Some(r.clone()) }),
            })
            .await
            .unwrap_or_else(|e| panic!("get by {r:?}: {e}"))
            .into_inner()
            .endpoint
            .unwrap();
        assert_eq!(got.id, b.id, "get by {r:?}");
        assert!(!got.state_history.is_empty(), "get returns the state history");
    }

    // Delete: gone from the datapath, twice is fine.
    assert_eq!(node.delete_endpoint(b.id).await, vec![b.id]);
    assert!(
        node.delete_endpoint(b.id).await.is_empty(),
        "a second delete finds nothing and succeeds"
    );
    let listed = node.datapath_endpoints().await;
    assert!(
        listed.endpoints.iter().all(|e| e.endpoint_id != b.id) && listed.orphan_attachments.is_empty(),
        "a deleted endpoint leaves nothing in the datapath"
    );
    assert!(
        !node.state_dir().join("endpoints").join(b.id.to_string()).exists(),
        "a deleted endpoint's state dir is removed"
    );
}

const BACKEND_POLICY: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: backend
  namespace: default
spec:
  podSelector:
    matchLabels:
      app: backend
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              app: frontend
      ports:
        - protocol: TCP
          port: 8080
"#;

#[tokio::test(flavor = "multi_thread")]
async fn policies_and_labels_flip_traffic() {
    let mut node = node().await;
    node.add_pod("frontend", &["k8s:app=frontend"]).await;
    node.add_pod("backend", &["k8s:app=backend"]).await;
    node.add_pod("other", &["k8s:app=other"]).await;
    let _server = node.pod("backend").tcp_server(8080).unwrap();
    let _other_port = node.pod("backend").tcp_server(9090).unwrap();
    assert!(
        tcp(&node, "other", "backend", 8080),
        "without a policy everything is allowed"
    );

    let started = Instant::now();
    let applied = node.apply_policy(BACKEND_POLICY).await;
    let took = started.elapsed();
    assert!(applied.changed);
    assert_eq!(applied.affected_endpoints, 1, "only backend is selected");
    assert_eq!(
        applied.realised_endpoints, 1,
        "wait returns once backend realised the policy"
    );
    assert!(
        tcp(&node, "frontend", "backend", 8080),
        "frontend → backend:8080 is allowed"
    );
    assert!(
        !tcp(&node, "frontend", "backend", 9090),
        "other ports of backend are denied"
    );
    assert!(
        !tcp(&node, "other", "backend", 8080),
        "a pod not selected by the rule must not reach backend"
    );
    eprintln!("policy apply → realised in {took:?}");

    // Idempotent repeat.
    let again = node.apply_policy(BACKEND_POLICY).await;
    assert!(!again.changed, "the same document again changes nothing");
    assert_eq!(again.revision, applied.revision);

    // A label change moves `other` into the allowed set.
    let updated = node
        .endpoints()
        .await
        .update_labels(pb::UpdateLabelsRequest {
            r#ref: Some(pb::EndpointRef {
                r#ref: Some(pb::endpoint_ref::Ref::Pod(pb::PodRef {
                    namespace: "default".into(),
                    name: "other".into(),
                })),
            }),
            labels: vec!["k8s:app=frontend".into()],
            r#async: false,
        })
        .await
        .expect("update labels")
        .into_inner();
    assert_eq!(updated.reidentified, 1, "the new labels give a new identity");
    assert!(
        tcp(&node, "other", "backend", 8080),
        "after relabelling as frontend, other reaches backend"
    );

    // Delete the policy: everything is allowed again.
    let started = Instant::now();
    let deleted = node
        .policies()
        .await
        .delete_policy(pb::DeletePolicyRequest {
            key: Some(pb::PolicyKey {
                kind: "NetworkPolicy".into(),
                namespace: "default".into(),
                name: "backend".into(),
            }),
            origin: pb::PolicyOrigin::Api.into(),
            wait: true,
        })
        .await
        .unwrap()
        .into_inner();
    eprintln!("policy delete → realised in {:?}", started.elapsed());
    assert!(deleted.deleted);
    assert!(
        tcp(&node, "frontend", "backend", 9090),
        "without the policy every port is open again"
    );

    // An invalid policy is refused with its field, and nothing changes.
    let e = node
        .policies()
        .await
        .upsert_policy(pb::UpsertPolicyRequest {
            document: BACKEND_POLICY.replace("port: 8080", "port: 8080\n          endPort: 80"),
            origin: pb::PolicyOrigin::Api.into(),
            wait: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("endPort"),
        "the error names the field: {}",
        e.message()
    );
    let listed = node
        .policies()
        .await
        .list_policies(pb::ListPoliciesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.policies.is_empty(), "an invalid policy must never half-apply");
}

/// Runs the `rivet` CLI against the node; returns stdout, panicking with
/// stderr on failure.
fn rivet(node: &EndpointNode, args: &[&str]) -> String {
    let output = std::process::Command::new(rivet_common::testing::workspace_binary("rivet"))
        .arg("--socket-dir")
        .arg(node.sockets())
        .args(args)
        .output()
        .expect("the rivet CLI runs");
    assert!(
        output.status.success(),
        "rivet {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("the CLI prints UTF-8")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_lists_endpoints_applies_policies_and_shows_status() {
    let mut node = node().await;
    let web = node.add_pod("web", &["k8s:app=web"]).await;
    let _server = node.pod("web").tcp_server(80).unwrap();
    node.add_pod("client", &["k8s:app=client"]).await;

    let list: serde_json::Value = serde_json::from_str(&rivet(&node, &["-o", "json", "endpoint", "list"])).unwrap();
    let ids: Vec<u64> = list["endpoints"]
        .as_array()
        .expect("an endpoints array")
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "the CLI lists both endpoints: {list}");
    let table = rivet(&node, &["endpoint", "get", "default/web"]);
    assert!(
        table.contains(&web.identity.to_string()),
        "get by pod shows the identity: {table}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deny.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny-web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Ingress]\n",
    )
    .unwrap();
    rivet(&node, &["policy", "apply", "--wait", "-f", file.to_str().unwrap()]);
    assert!(
        !tcp(&node, "client", "web", 80),
        "after `rivet policy apply` of a deny-all, web is closed"
    );
    let policies = rivet(&node, &["policy", "list"]);
    assert!(policies.contains("deny-web"), "the policy is listed: {policies}");
    rivet(&node, &["policy", "delete", "--wait", "default/deny-web"]);
    assert!(
        tcp(&node, "client", "web", 80),
        "after `rivet policy delete`, web is open again"
    );

    let status = rivet(&node, &["status"]);
    for expected in ["svc-endpoint", "svc-identity", "svc-loader", "svc-ipam"] {
        assert!(status.contains(expected), "status shows {expected}: {status}");
    }
    assert!(
        status.to_lowercase().contains("ready"),
        "status shows endpoints by state: {status}"
    );
}

/// The policy svc-loader holds for an endpoint, and its entries' peers.
async fn realised_peers(node: &EndpointNode, endpoint_id: u32) -> (ldpb::GetEndpointPolicyResponse, Vec<u32>) {
    let held = node.datapath_policy(endpoint_id).await;
    let peers = held
        .entries
        .iter()
        .filter_map(|e| e.entry.as_ref())
        .map(|e| e.peer_identity)
        .collect();
    (held, peers)
}

/// What svc-endpoint's policy dir watcher reports.
async fn policy_dir_status(node: &EndpointNode) -> pb::PolicyDirStatus {
    endpoint_status(node)
        .await
        .policy_dir
        .expect("svc-endpoint watches a policy dir")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_policy_dir_is_followed_and_a_bad_file_changes_nothing() {
    let policies = tempfile::tempdir().unwrap();
    let mut node = EndpointNode::start(NodeOptions {
        endpoint_args: vec!["--policy-dir".into(), policies.path().display().to_string()],
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    node.add_pod("web", &["k8s:app=web"]).await;
    node.add_pod("client", &["k8s:app=client"]).await;
    let _server = node.pod("web").tcp_server(80).unwrap();
    assert!(tcp(&node, "client", "web", 80));

    // A deny-all for web plus an egress ipBlock for client (CIDR identities).
    let file = policies.path().join("web.yaml");
    std::fs::write(
        &file,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny-web, namespace: default}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Ingress]\n---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: client-out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to:\n    - ipBlock: {cidr: 198.19.128.0/24, except: [198.19.128.0/28]}\n    - podSelector: {matchLabels: {app: web}}\n",
    )
    .unwrap();
    eventually(Duration::from_secs(10), "a policy file denies traffic", async || {
        !tcp(&node, "client", "web", 80)
    })
    .await;

    let listed = node
        .policies()
        .await
        .list_policies(pb::ListPoliciesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.policies.len(), 2, "both documents of the file are applied");
    assert!(
        listed
            .policies
            .iter()
            .all(|p| p.origin == pb::PolicyOrigin::Directory as i32),
        "policies of the dir have origin DIRECTORY"
    );
    // The ipBlock became CIDR identities in the ipcache, and client's egress
    // entries name them.
    let ipcache = node
        .node
        .client()
        .await
        .list_ipcache(ldpb::ListIpcacheRequest::default())
        .await
        .unwrap()
        .into_inner();
    let cidr_ids: Vec<u32> = ipcache
        .entries
        .iter()
        .filter(|e| e.prefix.as_ref().is_some_and(|p| p.address == [198, 19, 128, 0]))
        .map(|e| e.identity)
        .collect();
    assert_eq!(
        cidr_ids.len(),
        2,
        "the cidr and its except are both in the datapath's ipcache: {cidr_ids:?}"
    );
    let client = node.endpoint_of_pod("default", "client").await;
    let (held, peers) = realised_peers(&node, client.id).await;
    assert!(held.enforce_egress, "client's egress is enforced");
    assert_eq!(
        cidr_ids.iter().filter(|id| peers.contains(id)).count(),
        1,
        "exactly the cidr (not its except) is an allowed peer: peers {peers:?}, cidr ids {cidr_ids:?}"
    );

    // A broken file changes nothing, once a scan has read and rejected it.
    let scanned = policy_dir_status(&node).await;
    assert_eq!(scanned.files_rejected, 0, "no file was rejected yet: {scanned:?}");
    std::fs::write(&file, "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny-web}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Sideways]\n").unwrap();
    let rejected = until(Duration::from_secs(10), "a scan rejects the broken file", async || {
        let status = policy_dir_status(&node).await;
        if status.files_rejected > 0 {
            Ok(status)
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await;
    assert!(
        rejected.last_error.contains("web.yaml") && rejected.last_error.contains("Sideways"),
        "the status names the file and the field: {rejected:?}"
    );
    assert!(
        !tcp(&node, "client", "web", 80),
        "a file that does not parse must leave its policies applied"
    );
    let still = node
        .policies()
        .await
        .list_policies(pb::ListPoliciesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(still.policies.len(), 2, "a file that does not parse changes nothing");

    // Removing the file removes its policies.
    std::fs::remove_file(&file).unwrap();
    eventually(Duration::from_secs(10), "removing the file reopens web", async || {
        tcp(&node, "client", "web", 80)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn namespace_labels_are_identity_labels_and_namespace_selectors_follow_them() {
    let mut node = node().await;
    node.add_pod("db", &["k8s:app=db"]).await;
    let _server = node.pod("db").tcp_server(5432).unwrap();
    for (pod, namespace) in [("shop-client", "shop"), ("lab-client", "lab")] {
        node.add_pod_interface(pod).await;
        let mut request = node.create_request(pod, &["k8s:app=client"]);
        request.pod_namespace = namespace.into();
        node.endpoints()
            .await
            .create_endpoint(request)
            .await
            .expect("create in a namespace");
    }
    // Only namespaces labelled team=shop may reach db.
    node.apply_policy(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: db}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - from:\n    - namespaceSelector: {matchLabels: {team: shop}}\n",
    )
    .await;
    assert!(
        !tcp(&node, "shop-client", "db", 5432),
        "an unlabelled namespace must not match the selector"
    );

    let mut namespaces = rivet_proto::endpoint::v1::namespace_service_client::NamespaceServiceClient::new(
        rivet_common::grpc::connect_unix(&node.sockets().join("svc-endpoint.sock"), &Default::default())
            .await
            .unwrap(),
    );
    let set = namespaces
        .set_namespace_labels(pb::SetNamespaceLabelsRequest {
            namespace: "shop".into(),
            labels: vec!["k8s:team=shop".into()],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(set.changed);
    assert_eq!(
        set.affected_endpoints, 1,
        "the namespace's one endpoint is re-identified"
    );
    eventually(
        Duration::from_secs(10),
        "labelling the namespace lets its pods reach db",
        async || tcp(&node, "shop-client", "db", 5432),
    )
    .await;
    assert!(!tcp(&node, "lab-client", "db", 5432), "another namespace stays out");
    let got = node.endpoint_of_pod("shop", "shop-client").await;
    for label in [
        "k8s:io.kubernetes.pod.namespace=shop",
        "k8s:ns.labels/team=shop",
        "k8s:ns.labels/kubernetes.io/metadata.name=shop",
    ] {
        assert!(
            got.identity_labels.iter().any(|l| l == label),
            "identity labels hold {label}: {:?}",
            got.identity_labels
        );
    }
    let e = namespaces
        .set_namespace_labels(pb::SetNamespaceLabelsRequest {
            namespace: "shop".into(),
            labels: vec!["container:team=x".into()],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "namespace labels must have source k8s");
}

/// The reproduction of issue 12 §2: relabelling a namespace re-identifies
/// its pods at once, and their identities reach the selector cache while
/// the selecting endpoint is regenerating for the first of them. Every
/// change that arrives during a regeneration must lead to one more, so x/a's
/// realised policy ends up allowing every new identity (before the fix it
/// usually allowed some and never recovered). Several rounds, so a lucky
/// interleaving cannot hide the bug.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_relabel_during_a_regeneration_reaches_every_selected_peer() {
    const Y_PODS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
    let mut node = node().await;
    node.add_pod_interface("xa").await;
    let mut request = node.create_request("xa", &["k8s:app=a"]);
    request.pod_namespace = "x".into();
    request.pod_name = "a".into();
    node.endpoints()
        .await
        .create_endpoint(request)
        .await
        .expect("creating x/a");
    for name in Y_PODS {
        let pod = format!("y{name}");
        node.add_pod_interface(&pod).await;
        let mut request = node.create_request(&pod, &[&format!("k8s:app={name}")]);
        request.pod_namespace = "y".into();
        request.pod_name = name.into();
        node.endpoints()
            .await
            .create_endpoint(request)
            .await
            .unwrap_or_else(|e| panic!("creating y/{name}: {e}"));
    }
    node.apply_policy(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: from-updated, namespace: x}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  ingress:\n  - from:\n    - namespaceSelector: {matchLabels: {ns2: updated}}\n",
    )
    .await;
    let xa = node.endpoint_of_pod("x", "a").await;
    let mut namespaces = pb::namespace_service_client::NamespaceServiceClient::new(
        rivet_common::grpc::connect_unix(&node.sockets().join("svc-endpoint.sock"), &Default::default())
            .await
            .unwrap(),
    );
    for round in 0..6 {
        // Each round is a new label set, so every round makes new identities.
        let updated = round % 2 == 0;
        let mut labels = vec![
            "k8s:kubernetes.io/metadata.name=y".to_string(),
            format!("k8s:round={round}"),
        ];
        if updated {
            labels.push("k8s:ns2=updated".into());
        }
        let set = namespaces
            .set_namespace_labels(pb::SetNamespaceLabelsRequest {
                namespace: "y".into(),
                labels,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            set.affected_endpoints,
            Y_PODS.len() as u32,
            "round {round}: y's pods are re-identified"
        );

        // The new identities, once their endpoints are ready with them.
        let mut identities = Vec::new();
        let round_label = format!("k8s:ns.labels/round={round}");
        for name in Y_PODS {
            let what = format!("round {round}: y/{name} is re-identified");
            let identity = until(Duration::from_secs(10), &what, async || {
                let e = node.endpoint_of_pod("y", name).await;
                if e.identity_labels.contains(&round_label) && e.state == pb::EndpointState::Ready as i32 {
                    Ok(e.identity)
                } else {
                    Err(format!("{e:?}"))
                }
            })
            .await;
            identities.push(identity);
        }
        let expected = if updated { identities.len() } else { 0 };
        let what = format!("round {round}: x/a's realised policy allows {expected} of y's identities {identities:?}");
        until(Duration::from_secs(10), &what, async || {
            let (_, peers) = realised_peers(&node, xa.id).await;
            let allowed = identities.iter().filter(|id| peers.contains(id)).count();
            if allowed == expected {
                Ok(())
            } else {
                Err(format!("it allows {allowed} (peers {peers:?})"))
            }
        })
        .await;
    }
}

/// Waits until `check` holds for the policy svc-loader holds for endpoint
/// `endpoint_id` (entries as (peer, port)).
async fn until_realised(node: &EndpointNode, endpoint_id: u32, what: &str, check: impl Fn(&[(u32, u32)]) -> bool) {
    until(Duration::from_secs(10), what, async || {
        let entries: Vec<(u32, u32)> = node
            .datapath_policy(endpoint_id)
            .await
            .entries
            .iter()
            .filter_map(|e| e.entry.as_ref())
            .map(|e| (e.peer_identity, e.port))
            .collect();
        if check(&entries) {
            Ok(())
        } else {
            Err(format!("entries {entries:?}"))
        }
    })
    .await;
}

/// Issue 12 §4: a change in an endpoint's named ports re-queues the
/// endpoints whose rules use the name, and the ports leave with the
/// endpoint. web-0 holds the web identity without ports; web-1 joins the
/// same identity (no identity event) with port `http` = 8080: client's
/// egress rule to web's `http` must then allow 8080, and stop once web-1 is
/// deleted while web-0 keeps the identity.
#[tokio::test(flavor = "multi_thread")]
async fn named_ports_reach_the_peers_that_use_them_and_leave_with_their_endpoint() {
    let mut node = node().await;
    let client = node.add_pod("client", &["k8s:app=client"]).await;
    let web0 = node.add_pod("web-0", &["k8s:app=web"]).await;
    node.apply_policy(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: client-out}\nspec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  - to:\n    - podSelector: {matchLabels: {app: web}}\n    ports:\n    - {protocol: TCP, port: http}\n",
    )
    .await;
    until_realised(&node, client.id, "no web endpoint names http yet", |e| e.is_empty()).await;

    let http = pb::NamedPort {
        name: "http".into(),
        protocol: "TCP".into(),
        port: 8080,
    };
    let web1 = node.add_pod_with_ports("web-1", &["k8s:app=web"], vec![http]).await;
    assert_eq!(web1.identity, web0.identity, "web-1 shares web-0's identity");
    until_realised(&node, client.id, "client's rule resolves web's http to 8080", |e| {
        e == [(web0.identity, 8080)]
    })
    .await;

    node.delete_endpoint(web1.id).await;
    until_realised(&node, client.id, "web-1's port leaves with it", |e| e.is_empty()).await;
}

/// Issue 12 §4: pod labels svc-endpoint remembers are forgotten with the
/// pod's endpoint, whatever selected it (a reused pod name, such as a
/// StatefulSet pod, must not inherit them); labels set before the endpoint
/// exists still apply at its create.
#[tokio::test(flavor = "multi_thread")]
async fn remembered_pod_labels_go_with_the_pods_endpoint() {
    let mut node = node().await;
    let pod_ref = |name: &str| pb::EndpointRef {
        r#ref: Some(pb::endpoint_ref::Ref::Pod(pb::PodRef {
            namespace: "default".into(),
            name: name.into(),
        })),
    };
    let label = |labels: &[&str]| pb::UpdateLabelsRequest {
        r#ref: Some(pod_ref("db-0")),
        labels: labels.iter().map(ToString::to_string).collect(),
        r#async: false,
    };
    // Before the endpoint exists: remembered, applied at create.
    node.endpoints()
        .await
        .update_labels(label(&["k8s:app=db", "k8s:tier=early"]))
        .await
        .expect("labelling a pod without an endpoint");
    node.add_pod_interface("db-0").await;
    let first = node
        .endpoints()
        .await
        .create_endpoint(node.create_request("db-0", &[]))
        .await
        .expect("creating db-0")
        .into_inner()
        .endpoint
        .unwrap();
    assert!(
        first.labels.contains(&"k8s:tier=early".to_string()),
        "labels set before the create apply: {:?}",
        first.labels
    );
    node.endpoints()
        .await
        .update_labels(label(&["k8s:app=db", "k8s:tier=old"]))
        .await
        .expect("relabelling db-0");

    // Deleted by its container (not by the pod), then the name comes back.
    node.endpoints()
        .await
        .delete_endpoint(pb::DeleteEndpointRequest {
            r#ref: Some(pb::EndpointRef {
                r#ref: Some(pb::endpoint_ref::Ref::Container(pb::ContainerInterface {
                    container_id: "db-0".into(),
                    interface: "eth0".into(),
                })),
            }),
        })
        .await
        .expect("deleting db-0's endpoint");
    let mut again = node.create_request("db-0", &["k8s:app=db"]);
    again.container_id = "db-0-second".into();
    let second = node
        .endpoints()
        .await
        .create_endpoint(again)
        .await
        .expect("creating db-0 again")
        .into_inner()
        .endpoint
        .unwrap();
    assert_eq!(
        second.labels,
        ["k8s:app=db"],
        "a reused pod name does not inherit the old pod's labels"
    );
}

/// Issue 12 §4 / §5: a pod whose network namespace goes away without a CNI
/// DEL (a runtime leaking a sandbox) must not leak its endpoint: svc-endpoint
/// notices the host interface is gone while running and releases the
/// endpoint, its identity reference, ipcache entries, state dir and its
/// svc-ipam addresses.
#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_whose_interface_disappears_while_running_is_dropped_and_releases_everything() {
    let mut node = EndpointNode::start(NodeOptions {
        endpoint_args: vec!["--interface-check-ms".into(), "200".into()],
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    node.add_pod("stays", &["k8s:app=stays"]).await;
    let gone = node.add_pod("gone", &["k8s:app=gone"]).await;
    let addresses = node.pod("gone").addrs();
    assert!(
        node.node.node.remove_pod("gone"),
        "the pod's namespace is deleted behind the CNI's back"
    );

    let listed = until(
        Duration::from_secs(10),
        "the endpoint of the vanished pod is dropped",
        async || {
            let listed = node
                .endpoints()
                .await
                .list_endpoints(pb::ListEndpointsRequest::default())
                .await
                .unwrap()
                .into_inner();
            if listed.endpoints.iter().all(|e| e.id != gone.id) {
                Ok(listed)
            } else {
                Err(format!("{listed:?}"))
            }
        },
    )
    .await;
    assert_eq!(listed.endpoints.len(), 1, "the other pod's endpoint stays: {listed:?}");
    let id = u16::try_from(gone.id).unwrap();
    support::assert_nothing_left(
        &node,
        &node.state_dir(),
        id,
        ("gone", &addresses),
        true,
        "after the pod's namespace vanished",
    )
    .await;
}

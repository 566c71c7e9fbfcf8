//! svc-endpoint as a real process with the real svc-identity (embedded
//! store), svc-ipam and svc-loader, and namespace pods: creates are ready
//! with traffic flowing when they return, labels and policies flip traffic.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rivet_proto::endpoint::v1 as pb;
use rivet_proto::loader::v1 as ldpb;
use svc_endpoint::testing::{EndpointNode, NodeOptions};
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

fn pings(node: &EndpointNode, from: &str, to: &str) -> bool {
    node.pod(from)
        .ping(node.ipv4(to), 1, Duration::from_millis(10), SHORT)
        .expect("the harness can ping")
        .received
        == 1
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
    assert!(pings(&node, "a", "b"), "b must be reachable the moment its create returns");
    let b = b.endpoint.expect("an endpoint");
    assert_eq!(b.state, pb::EndpointState::Ready as i32, "a synchronous create returns a ready endpoint");
    assert_ne!(b.identity, 0, "a ready endpoint has an identity");
    assert_eq!(a.identity, b.identity, "the same labels must give the same identity");
    assert_ne!(a.id, b.id, "endpoint ids are unique");
    assert!(
        b.identity_labels.iter().any(|l| l == "k8s:io.kubernetes.pod.namespace=default"),
        "the namespace is part of the identity: {:?}",
        b.identity_labels
    );

    // The datapath holds both, attached.
    let listed = node.node.client().await.list_endpoints(ldpb::ListEndpointsRequest {}).await.unwrap().into_inner();
    let ids: Vec<u32> = listed.endpoints.iter().map(|e| e.endpoint_id).collect();
    assert!(ids.contains(&a.id) && ids.contains(&b.id), "the loader must hold both endpoints: {ids:?}");
    assert!(
        listed.endpoints.iter().all(|e| e.from_container == ldpb::AttachState::Attached as i32
            && e.to_container == ldpb::AttachState::Attached as i32),
        "both hooks must be attached"
    );

    // Idempotent repeat; an address of another endpoint is refused.
    let again = node.endpoints().await.create_endpoint(request.clone()).await.unwrap().into_inner();
    assert!(!again.created, "the same container + interface again creates nothing");
    assert_eq!(again.endpoint.unwrap().id, b.id);
    let mut stolen = node.create_request("a", &[]);
    stolen.container_id = "other".into();
    let e = node.endpoints().await.create_endpoint(stolen).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "an address owned by another endpoint: {e}");
    let mut changed = request;
    changed.host_ifindex += 1000;
    let e = node.endpoints().await.create_endpoint(changed).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "same container + interface with other parameters: {e}");

    // Get by every kind of reference.
    for r in [
        pb::endpoint_ref::Ref::Id(b.id),
        pb::endpoint_ref::Ref::Address(node.ipv4("b").to_string()),
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
    let delete = pb::DeleteEndpointRequest {
        r#ref: Some(pb::EndpointRef {
            r#ref: Some(pb::endpoint_ref::Ref::Id(b.id)),
        }),
    };
    let deleted = node.endpoints().await.delete_endpoint(delete.clone()).await.unwrap().into_inner();
    assert_eq!(deleted.deleted, vec![b.id]);
    let again = node.endpoints().await.delete_endpoint(delete).await.unwrap().into_inner();
    assert!(again.deleted.is_empty(), "a second delete finds nothing and succeeds");
    let listed = node.node.client().await.list_endpoints(ldpb::ListEndpointsRequest {}).await.unwrap().into_inner();
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
    assert!(tcp(&node, "other", "backend", 8080), "without a policy everything is allowed");

    let started = Instant::now();
    let applied = node.apply_policy(BACKEND_POLICY).await;
    let took = started.elapsed();
    assert!(applied.changed);
    assert_eq!(applied.affected_endpoints, 1, "only backend is selected");
    assert_eq!(applied.realised_endpoints, 1, "wait returns once backend realised the policy");
    assert!(tcp(&node, "frontend", "backend", 8080), "frontend → backend:8080 is allowed");
    assert!(!tcp(&node, "frontend", "backend", 9090), "other ports of backend are denied");
    assert!(!tcp(&node, "other", "backend", 8080), "a pod not selected by the rule must not reach backend");
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
    assert!(tcp(&node, "other", "backend", 8080), "after relabelling as frontend, other reaches backend");

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
    assert!(tcp(&node, "frontend", "backend", 9090), "without the policy every port is open again");

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
    assert!(e.message().contains("endPort"), "the error names the field: {}", e.message());
    let listed = node
        .policies()
        .await
        .list_policies(pb::ListPoliciesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.policies.is_empty(), "an invalid policy must never half-apply");
}

//! The CRDs on a real kube-apiserver (rivet-testkit's KubeApiServer): the
//! API server accepts them, keeps every field of each kind (a field the
//! schema lacked would be pruned silently), and `kubectl get` shows the
//! printer columns.

use rivet_k8s::kube::api::{Api, Patch, PatchParams, PostParams};
use rivet_k8s::{
    EncapsulationMode, NodeAddress, NodeCondition, RivetEndpoint, RivetEndpointSpec, RivetEndpointState,
    RivetEndpointStatus, RivetIdentity, RivetIdentitySpec, RivetNetworkPolicy, RivetNode, RivetNodeSpec,
    RivetNodeStatus, policy_from_object,
};
use rivet_policy::Policy;
use rivet_testkit::kube::KubeApiServer;

/// Every field of a RivetNetworkPolicy spec.
const POLICY: &str = include_str!("every-field-rnp.yaml");

fn kubectl_get(server: &KubeApiServer, args: &[&str]) -> String {
    let output = server
        .kubectl()
        .expect("kubectl")
        .args(["get"])
        .args(args)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

#[tokio::test]
async fn the_api_server_keeps_every_field_of_each_kind_and_shows_the_columns() {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server
        .apply_crds()
        .await
        .expect("the CRDs are accepted and established");
    let client = server.admin_client();

    // A RivetNetworkPolicy read back from the API is the policy of its YAML.
    let policies: Api<RivetNetworkPolicy> = Api::namespaced(client.clone(), "default");
    let object: RivetNetworkPolicy = serde_norway::from_str(POLICY).unwrap();
    policies.create(&PostParams::default(), &object).await.expect("created");
    let read = policies.get("every-field").await.unwrap();
    let from_api = policy_from_object(&read).expect("valid");
    let from_file = Policy::parse(POLICY).unwrap();
    assert!(
        from_api.same_spec(&from_file),
        "from the API: {}\nfrom the file: {}",
        from_api.normalized_json(),
        from_file.normalized_json()
    );

    // A RivetEndpoint's status, written through the status subresource.
    let endpoints: Api<RivetEndpoint> = Api::namespaced(client.clone(), "default");
    endpoints
        .create(
            &PostParams::default(),
            &RivetEndpoint::new("web-1", RivetEndpointSpec {}),
        )
        .await
        .expect("created");
    let status = RivetEndpointStatus {
        id: 17,
        node: "node-a".into(),
        container_id: Some("c0ffee".into()),
        identity: Some(70001),
        identity_labels: vec!["k8s:app=web".into(), "k8s:io.kubernetes.pod.namespace=default".into()],
        ipv4: Some("198.18.0.17".into()),
        ipv6: Some("2001:2::17".into()),
        state: RivetEndpointState::Ready,
        policy_revision: 42,
        ingress_enforced: true,
        egress_enforced: false,
        last_error: Some("loader: timed out".into()),
    };
    let patch = serde_json::json!({"apiVersion": "rivet.io/v1", "kind": "RivetEndpoint", "status": status});
    endpoints
        .patch_status("web-1", &PatchParams::apply("rivet-test"), &Patch::Apply(&patch))
        .await
        .expect("status applied");
    assert_eq!(endpoints.get("web-1").await.unwrap().status, Some(status));

    // A RivetNode with its spec and Ready condition.
    let nodes: Api<RivetNode> = Api::all(client.clone());
    let spec = RivetNodeSpec {
        addresses: vec![NodeAddress {
            type_: "InternalIP".into(),
            ip: "198.18.0.1".into(),
        }],
        pod_cidrs: vec!["198.18.16.0/20".into(), "2001:2:0:10::/64".into()],
        encapsulation: rivet_k8s::Encapsulation {
            mode: EncapsulationMode::Vxlan,
            port: Some(8472),
        },
    };
    nodes
        .create(&PostParams::default(), &RivetNode::new("node-a", spec.clone()))
        .await
        .unwrap();
    let ready = RivetNodeStatus {
        conditions: vec![NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: Some("DaemonsReady".into()),
            message: None,
            last_transition_time: Some("2026-11-26T04:00:00Z".into()),
            last_heartbeat_time: Some("2026-11-26T04:00:10Z".into()),
        }],
    };
    let patch = serde_json::json!({"apiVersion": "rivet.io/v1", "kind": "RivetNode", "status": ready});
    nodes
        .patch_status("node-a", &PatchParams::apply("rivet-test"), &Patch::Apply(&patch))
        .await
        .unwrap();
    let node = nodes.get("node-a").await.unwrap();
    assert_eq!((node.spec, node.status), (spec, Some(ready)));

    // A RivetIdentity.
    let identities: Api<RivetIdentity> = Api::all(client.clone());
    let labels = vec![
        "k8s:app=web".to_string(),
        "k8s:io.kubernetes.pod.namespace=default".to_string(),
    ];
    identities
        .create(
            &PostParams::default(),
            &RivetIdentity::new("70001", RivetIdentitySpec { labels: labels.clone() }),
        )
        .await
        .unwrap();
    assert_eq!(identities.get("70001").await.unwrap().spec.labels, labels);

    // What a user sees, by short name.
    let table = kubectl_get(&server, &["rep", "-n", "default"]);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "ID", "IDENTITY", "STATE", "IPV4", "IPV6", "NODE", "AGE"]
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        row[..7],
        ["web-1", "17", "70001", "ready", "198.18.0.17", "2001:2::17", "node-a"]
    );
    let table = kubectl_get(&server, &["rnode"]);
    assert!(table.lines().nth(1).unwrap().starts_with("node-a"), "{table}");
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "READY", "PODCIDRS", "ENCAPSULATION", "AGE"]);
    assert!(table.contains("True") && table.contains("vxlan"), "{table}");
    let table = kubectl_get(&server, &["rid"]);
    assert!(table.contains("70001") && table.contains("k8s:app=web"), "{table}");
    let table = kubectl_get(&server, &["rnp", "-n", "default"]);
    assert!(table.contains("every-field"), "{table}");
}

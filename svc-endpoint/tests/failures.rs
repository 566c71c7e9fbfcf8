//! A failure injected at each regeneration step of a synchronous create
//! leaves nothing behind: no datapath entry or attachment, no identity
//! reference, no ipcache entry, no state dir. The manager runs in-process
//! against the node's real svc-identity, svc-ipam and svc-loader; a fault
//! makes the chosen step fail.

mod support;

use std::sync::Arc;
use std::time::Duration;

use rivet_testkit::node::{EndpointNode, NodeOptions};
use support::{Faults, Mode, assert_nothing_left, faulty_dependencies, options, start_manager};
use svc_endpoint::endpoint::RegenerationStep;
use svc_endpoint::manager::{ManagerError, NewEndpoint};
use svc_endpoint::service::validate_create;

#[tokio::test(flavor = "multi_thread")]
async fn a_failure_at_each_regeneration_step_leaves_nothing_behind() {
    let mut node = EndpointNode::start(NodeOptions {
        without_endpoint_daemon: true,
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    node.add_pod_interface("a").await;

    for step in [
        RegenerationStep::Identity,
        RegenerationStep::Datapath,
        RegenerationStep::Ipcache,
        RegenerationStep::StateDir,
    ] {
        let state = tempfile::tempdir().unwrap();
        let faults = Arc::new(Faults::default());
        match step {
            RegenerationStep::Identity => faults.allocate.set(Mode::Internal),
            // Fail after the datapath did the work, the harder case to undo.
            RegenerationStep::Datapath => faults.apply.set(Mode::InternalAfterCall),
            RegenerationStep::Ipcache => faults.upsert_ip.set(Mode::Internal),
            // A file where the endpoints directory should be: every write fails.
            _ => std::fs::write(state.path().join("endpoints"), b"not a directory").unwrap(),
        }
        let (manager, _controllers) = start_manager(options(state.path()), faulty_dependencies(&node, &faults));
        let spec = validate_create(&node.create_request("a", &["k8s:app=faulty"])).unwrap();
        let e = manager
            .create(NewEndpoint { spec, sync: true }, Duration::from_secs(20))
            .await
            .expect_err("an injected failure must fail the create");
        let id = match &e {
            ManagerError::Regeneration { id, undone, source } => {
                assert_eq!(source.step, step, "the error names the failing step: {e}");
                assert!(*undone, "a failed synchronous create is undone: {e}");
                *id
            }
            other => panic!("expected a regeneration error at {step:?}, got {other}"),
        };
        assert!(
            manager.list().is_empty(),
            "a failed create leaves no endpoint ({step:?})"
        );
        assert_nothing_left(
            &node,
            state.path(),
            id,
            ("a", &node.pod("a").addrs()),
            false,
            &format!("a failure at {step:?}"),
        )
        .await;
    }

    // With nothing injected the same create succeeds (the harness is sound).
    let state = tempfile::tempdir().unwrap();
    let (manager, _controllers) = start_manager(options(state.path()), node.dependencies());
    let spec = validate_create(&node.create_request("a", &["k8s:app=faulty"])).unwrap();
    manager
        .create(NewEndpoint { spec, sync: true }, Duration::from_secs(20))
        .await
        .expect("without an injected failure the create succeeds");
}

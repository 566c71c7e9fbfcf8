//! Chaos under churn (issue 19 §1), the short run of the suite: a fixed
//! seed, a 2-node `rivet cluster up` churned for [`CHURN`] with up to 30
//! pods, policies applied and removed, kill -9 of node daemons (also during
//! adds) and etcd restarts ([`rivet_testkit::chaos`]): no address held
//! twice, probed pods reach each other exactly as the policies say, the
//! long-lived flows lose nothing, and nothing is left once everything is
//! deleted. `cargo xtask chaos` is the long run.
//!
//! Needs root, a bpffs, the rivet users and etcd 3.6 (`cargo xtask
//! install`) and the workspace binaries (`cargo build --bins`).

use std::time::Duration;

use rivet_testkit::chaos::{self, ChaosOptions};
use rivet_testkit::cluster::Routing;

/// The seed: its first steps kill daemons, restart etcd and apply policies.
const SEED: u64 = 19;
/// Churn time (the cluster's start and the end's checks come on top).
const CHURN: Duration = Duration::from_secs(60);
/// Steps made however long they take: on a quiet machine 60 s held 96
/// steps with 11 kills and 2 etcd restarts; at load 17 only 36, without an
/// etcd restart.
const MIN_STEPS: u64 = 96;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_chaos_run_breaks_no_invariant() {
    let options = ChaosOptions {
        seed: SEED,
        duration: CHURN,
        min_steps: MIN_STEPS,
        nodes: 2,
        max_pods: 30,
        probes_per_check: 3,
        routing: Routing::Native,
        bin_dir: None,
        keep_logs: None,
    };
    let summary = chaos::run(&options)
        .await
        .unwrap_or_else(|e| panic!("the chaos run could not start: {e}"));
    eprintln!("{summary}");
    assert!(summary.violations.is_empty(), "{summary}");
    // The run did what it is for (the seed's choices).
    assert!(
        summary.adds > 0 && summary.deletes > 0 && summary.probes_allowed > 0 && summary.probes_denied > 0,
        "pods churned and probed both ways: {summary}"
    );
    assert!(
        !summary.kills.is_empty() && summary.etcd_restarts > 0 && summary.flow_sent > 0,
        "daemons killed and etcd restarted under the flows: {summary}"
    );
}

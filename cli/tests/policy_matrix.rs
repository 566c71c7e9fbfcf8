//! The NetworkPolicy reachability table (issue 12 §2) on one node: the nine
//! pods of `rivet_testkit::policy_matrix` (namespaces x, y, z × pods a, b,
//! c) on a node of `rivet node up`, created through the real CNI plugin by
//! `rivet pod add`; the table, its probes and matrices are the testkit's
//! (the multi-node run in `e2e/tests/multinode_policy.rs` spreads the same
//! pods over three nodes).
//!
//! `RIVET_MATRIX_CASE=<part of a case name>` runs only those cases.
//!
//! Needs root, a bpffs and the workspace binaries (`cargo build --bins`), as
//! the node tests do. Addresses come from the node's pools in 198.18.0.0/15
//! and 2001:2::/48.

mod support;

use std::process::Command;
use std::time::Instant;

use rivet_testkit::policy_matrix::{Matrix, MatrixNodes};
use support::TestNode;

/// All nine pods on the one node.
struct OneNode(TestNode);

impl MatrixNodes for OneNode {
    fn nodes(&self) -> usize {
        1
    }

    fn node_of(&self, _index: usize) -> usize {
        0
    }

    fn rivet(&self, _node: usize, args: &[&str]) -> Command {
        self.0.rivet(args)
    }

    fn kill9_and_wait_for_restart(&self, _node: usize, name: &str) {
        self.0.kill9_and_wait_for_restart(name);
    }
}

/// The whole table on one node (the cases run one after another; each
/// leaves the node as it found it).
#[test]
fn network_policy_reachability_matrix() {
    let started = Instant::now();
    let mut node = OneNode(TestNode::up());
    let matrix = Matrix::up(&node);
    eprintln!("9 pods, servers and monitor up in {:.1?}", started.elapsed());
    matrix.run_table();
    // The monitor and the servers go before the node.
    drop(matrix);
    node.0.down_and_check_nothing_left();
    eprintln!("the table in {:.1?}", started.elapsed());
}

//! A Rivet node made the way a user makes one: `rivet node up --netns
//! <name> --create-netns --detach` with CNI directories the test owns, so a
//! runtime pointed at them reads exactly what `node up` installs (the
//! conflist with its default cniVersion, rivet-cni and `loopback`). `rivet
//! node down` on drop, also on panic.
//!
//! ```no_run
//! # fn t() -> rivet_e2e::Result<()> {
//! use rivet_e2e::node::RivetNode;
//! let node = RivetNode::up("target/debug/rivet".as_ref())?;
//! let pods = node.json(&["pod", "list"])?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Error, Result, io_context};

static NODES: AtomicU32 = AtomicU32::new(0);

/// A running node; see the module docs.
#[derive(Debug)]
pub struct RivetNode {
    rivet: PathBuf,
    dir: tempfile::TempDir,
    netns: String,
    stopped: bool,
}

impl RivetNode {
    /// Starts a node in a new network namespace with `rivet` (the CLI
    /// binary; the daemons are beside it).
    pub fn up(rivet: &Path) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("rve2e")
            .tempdir_in("/tmp")
            .map_err(io_context("creating the node's temp dir"))?;
        let netns = format!("rve2e-{}-{}", std::process::id(), NODES.fetch_add(1, Ordering::Relaxed));
        let mut node = Self {
            rivet: rivet.to_path_buf(),
            dir,
            netns,
            stopped: false,
        };
        let mut up = node.rivet(&["node", "up", "--create-netns", "--detach", "--stop-grace-seconds", "5"]);
        up.arg("--netns")
            .arg(&node.netns)
            .arg("--cni-bin-dir")
            .arg(node.cni_bin_dir())
            .arg("--cni-conf-dir")
            .arg(node.cni_conf_dir());
        if let Err(e) = crate::containerd::run(&mut up) {
            node.stopped = true;
            let _ = node.rivet(&["node", "down"]).output();
            return Err(e);
        }
        Ok(node)
    }

    /// The CNI bin dir `node up` installed rivet-cni and `loopback` into.
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.dir.path().join("cni/bin")
    }

    /// The CNI conf dir `node up` wrote `10-rivet.conflist` into.
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.path().join("cni/net.d")
    }

    /// The node's network namespace, by name.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// `/run/netns/<netns>`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }

    /// A path in the node's temp dir (for the test's own files).
    pub fn path(&self, relative: &str) -> PathBuf {
        self.dir.path().join(relative)
    }

    /// `rivet --state-dir <node's> --socket-dir <node's> <args>`.
    pub fn rivet(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.rivet);
        command
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .arg("--socket-dir")
            .arg(self.dir.path().join("sockets"))
            .args(args)
            .stdin(Stdio::null());
        command
    }

    /// Runs `rivet <args>`; its stdout, or an error with its output.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        crate::containerd::run(&mut self.rivet(args))
    }

    /// Runs `rivet <args> -o json` and parses what it prints.
    pub fn json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.run(&all)?;
        serde_json::from_str(&text).map_err(|e| Error::Io {
            context: format!("rivet {} printed no JSON: {text}", args.join(" ")),
            source: e.into(),
        })
    }

    /// The host-side veths in the node's namespace (`ip -o link` lines).
    pub fn veths(&self) -> Result<String> {
        crate::containerd::run(Command::new("ip").args(["-n", &self.netns, "-o", "link", "show", "type", "veth"]))
    }

    /// `rivet node down`: everything the node created goes.
    pub fn down(&mut self) -> Result<String> {
        self.stopped = true;
        self.run(&["node", "down"])
    }
}

impl Drop for RivetNode {
    fn drop(&mut self) {
        if !self.stopped
            && let Err(e) = self.down()
        {
            eprintln!("rivet-e2e node teardown: {e}");
        }
    }
}

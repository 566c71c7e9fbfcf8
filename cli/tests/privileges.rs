//! A daemon's start: what it drops and when it refuses to serve
//! (rivet_common::privileges), and `rivet node up`'s checks of the users and
//! directories before it starts anything. The node itself, with every
//! daemon's credentials read from /proc, is in tests/node.rs.
//!
//! Needs root, the workspace binaries beside `rivet` (`cargo build --bins`)
//! and the users `cargo xtask install` creates.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rivet_common::testing::workspace_binary;
use support::{ProcCredentials, eventually, reachable_tempdir, rivet_bin};

mod support;

/// svc-ipam's command line with its dirs in `dir`.
fn ipam(dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(workspace_binary("svc-ipam"));
    cmd.arg("--socket-dir")
        .arg(dir.join("sockets"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--node-name", "rvp", "--pool", "default=198.18.60.0/24"])
        .args(extra)
        .stdin(Stdio::null());
    cmd
}

/// `cmd` run through `setpriv` as `nobody` with no capabilities.
fn as_nobody(cmd: &Command) -> Command {
    let mut wrapped = Command::new("setpriv");
    wrapped
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .args(["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .stdin(Stdio::null());
    wrapped
}

/// Runs `cmd`, which must exit with an error within 30 s; its stderr.
fn refused(mut cmd: Command) -> String {
    let mut daemon = Running(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running the daemon"),
    );
    let mut status = None;
    eventually("it exits by itself", Duration::from_secs(30), || {
        status = daemon.0.try_wait().unwrap();
        status.is_some()
    });
    let mut stderr = String::new();
    daemon.0.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(!status.unwrap().success(), "it must refuse to start: {stderr}");
    stderr
}

/// A running daemon, killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_daemon_started_as_root_without_user_keeps_its_uid_and_drops_every_capability() {
    let dir = reachable_tempdir("rvp");
    let mut daemon = Running(ipam(dir.path(), &[]).stderr(Stdio::null()).spawn().unwrap());
    let socket = dir.path().join("sockets/svc-ipam.sock");
    eventually("svc-ipam binds its socket", Duration::from_secs(30), || {
        assert!(daemon.0.try_wait().unwrap().is_none(), "svc-ipam exited");
        socket.exists()
    });
    let creds = ProcCredentials::of(&daemon.0.id().to_string());
    assert_eq!(creds.uids, [0; 4], "no --user: the uid stays");
    for (set, mask) in &creds.cap {
        assert_eq!(*mask, 0, "{set}");
    }
    assert!(creds.no_new_privs);
}

#[test]
fn svc_loader_refuses_to_serve_without_its_capabilities() {
    let dir = reachable_tempdir("rvp");
    let mut loader = Command::new(workspace_binary("svc-loader"));
    loader.arg("--socket-dir").arg(dir.path().join("sockets")).args([
        "--state-dir",
        "/nonexistent",
        "--node-name",
        "rvp-refuse",
    ]);
    let stderr = refused(as_nobody(&loader));
    assert!(
        stderr.contains("refusing to serve")
            && stderr.contains("needs CAP_NET_ADMIN, CAP_PERFMON, CAP_BPF")
            && stderr.contains("started without them"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("sockets").exists(),
        "it refused before binding anything"
    );
}

#[test]
fn switching_user_needs_root_and_an_existing_user() {
    let dir = reachable_tempdir("rvp");
    let stderr = refused(as_nobody(&ipam(dir.path(), &["--user", "rivet"])));
    assert!(
        stderr.contains("--user rivet") && stderr.contains("needs root") && stderr.contains("uid 65534"),
        "{stderr}"
    );
    let stderr = refused(ipam(dir.path(), &["--user", "rivet-no-such-user"]));
    assert!(
        stderr.contains("user `rivet-no-such-user` does not exist") && stderr.contains("cargo xtask install"),
        "{stderr}"
    );
}

/// `rivet node up` fails before starting anything when a user is missing or
/// cannot reach its directories.
#[test]
fn node_up_names_a_missing_user_and_an_unreachable_state_dir() {
    let dir = reachable_tempdir("rvp");
    let node_up = |state: &Path, extra: &[&str]| {
        let mut cmd = Command::new(rivet_bin());
        cmd.arg("--state-dir")
            .arg(state)
            .arg("--socket-dir")
            .arg(dir.path().join("sockets"))
            .args([
                "node",
                "up",
                "--netns",
                "rvp-never-created",
                "--ready-timeout-seconds",
                "5",
            ])
            .arg("--cni-bin-dir")
            .arg(dir.path().join("cni/bin"))
            .arg("--cni-conf-dir")
            .arg(dir.path().join("cni/net.d"))
            .args(extra)
            .stdin(Stdio::null());
        cmd
    };
    let stderr = refused(node_up(
        &dir.path().join("state"),
        &["--daemon-user", "rivet-no-such-user"],
    ));
    assert!(
        stderr.contains("user `rivet-no-such-user` does not exist")
            && stderr.contains("cargo xtask install")
            && stderr.contains("--daemon-user"),
        "{stderr}"
    );
    let stderr = refused(node_up(
        &dir.path().join("state"),
        &["--daemon-user", "rivet-datapath", "--datapath-user", "rivet-datapath"],
    ));
    assert!(stderr.contains("must run as another user"), "{stderr}");

    let closed = dir.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let stderr = refused(node_up(&closed.join("state"), &[]));
    assert!(
        stderr.contains("user rivet") && stderr.contains(&format!("{} is 0700", closed.display())),
        "{stderr}"
    );
    assert!(!closed.join("state/node.json").exists(), "nothing was started");
    assert!(!dir.path().join("sockets").exists(), "nothing was created");
}

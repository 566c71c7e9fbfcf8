//! `rivet node cleanup`: what `rivet node prepare` and `rivet-cni install`
//! put on a node, removed once no pod and no daemon uses it (the
//! Kubernetes DaemonSet's `cleanup` sidecar, which kubelet stops after
//! every daemon container; deploy/README.md "Uninstall").
//!
//! It removes nothing while svc-loader's pins are there (svc-loader removes
//! them when it stops on a node no pod uses, so pins mean pods on Rivet, or
//! a loader that could not clean up) or a daemon still answers on its
//! socket (a restart of this container alone). svc-loader decides because it
//! knows the endpoints: a pod's veth that the kernel has not yet destroyed
//! with its namespace is no pod. Otherwise it removes the
//! conflist and the plugin ([`rivet_cni::install::uninstall`]), rivet-cni's
//! log file, the daemons' dead sockets and their lock files, and then every
//! directory of [`prepare`](super::prepare) that is empty: the socket dir,
//! each daemon's state dir, the pin dir (svc-loader empties it when it
//! stops on such a node) and `<bpffs>/rivet`. A daemon's files it leaves:
//! they are that daemon's (and the node's `rivet` user's, not root's).

use std::io;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

use super::{ALL_DAEMONS, CleanupArgs};

/// Why a node keeps its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InUse {
    /// svc-loader's pins (it removes them once no pod uses the node).
    Pins,
    /// Daemons answering on their sockets.
    Daemons(Vec<String>),
}

/// Runs the cleanup, after SIGTERM/SIGINT with `--wait-for-signal`.
pub(super) async fn cleanup(socket_dir: &Path, state_dir: &Path, args: &CleanupArgs) -> Result<bool> {
    if args.wait_for_signal {
        use tokio::signal::unix::{SignalKind, signal};
        // Handlers first: a SIGTERM right after the message must not kill us.
        let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
        println!("rivet node cleanup: waiting for SIGTERM (the pod's end) to clean the node");
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    let pin_dir = rivet_common::pin_layout::pin_dir(&args.bpffs, &args.node_name)?;
    match in_use(&pin_dir, socket_dir) {
        Some(InUse::Pins) => {
            println!(
                "rivet node cleanup: svc-loader's pins are still in {} (pods use the node, or the loader \
                 could not clean up): keeping everything",
                pin_dir.display()
            );
            return Ok(true);
        }
        Some(InUse::Daemons(daemons)) => {
            println!(
                "rivet node cleanup: daemons still serving ({}): keeping everything",
                daemons.join(", ")
            );
            return Ok(true);
        }
        None => {}
    }
    let removed = remove_node_files(socket_dir, state_dir, args)?;
    println!(
        "rivet node cleanup: no pod and no daemon uses the node: removed {}",
        if removed.is_empty() {
            "nothing (already clean)".to_owned()
        } else {
            removed
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    Ok(true)
}

/// What still uses the node: svc-loader's pins first, then daemons whose
/// socket answers. `None`: nothing. An empty pin dir is removed on the way:
/// `rmdir` tells an empty dir from a full one without reading it (it is
/// svc-loader's user's, 0700).
pub(crate) fn in_use(pin_dir: &Path, socket_dir: &Path) -> Option<InUse> {
    match std::fs::remove_dir(pin_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        // Not empty, or not ours to judge: keep.
        Err(_) => return Some(InUse::Pins),
    }
    let daemons: Vec<String> = ALL_DAEMONS
        .iter()
        .filter(|d| serving(&rivet_common::socket::socket_path(socket_dir, d)))
        .map(|d| d.to_string())
        .collect();
    (!daemons.is_empty()).then_some(InUse::Daemons(daemons))
}

/// Whether a daemon may be serving on `socket`: only no socket file or a
/// refused connection say no (a connection this process may not make,
/// EACCES, says nothing, so it counts as serving).
fn serving(socket: &Path) -> bool {
    match std::os::unix::net::UnixStream::connect(socket) {
        Ok(_) => true,
        Err(e) => !matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused),
    }
}

/// Removes what the module docs list; returns what went.
fn remove_node_files(socket_dir: &Path, state_dir: &Path, args: &CleanupArgs) -> Result<Vec<PathBuf>> {
    let mut removed = rivet_cni::install::uninstall(&args.cni_bin_dir, &args.cni_conf_dir)?;
    let mut files: Vec<PathBuf> = args.cni_log_file.iter().cloned().collect();
    for daemon in ALL_DAEMONS {
        let socket = rivet_common::socket::socket_path(socket_dir, daemon);
        files.push(rivet_common::socket::lock_path(&socket));
        files.push(socket);
    }
    for file in files {
        if remove_file(&file)? {
            removed.push(file);
        }
    }
    let pin_dir = rivet_common::pin_layout::pin_dir(&args.bpffs, &args.node_name)?;
    let mut dirs: Vec<PathBuf> = ALL_DAEMONS.iter().map(|d| state_dir.join(d)).collect();
    dirs.push(socket_dir.to_path_buf());
    dirs.extend(
        pin_dir
            .parent()
            .map(|root| vec![pin_dir.clone(), root.to_path_buf()])
            .unwrap_or_default(),
    );
    for dir in dirs {
        if remove_if_empty(&dir)? {
            removed.push(dir);
        }
    }
    Ok(removed)
}

/// Removes `path`; `Ok(false)` when there is nothing there.
fn remove_file(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

/// Removes `dir` if it is empty; one still holding something (or a mount
/// point: another container's volume) stays.
fn remove_if_empty(dir: &Path) -> Result<bool> {
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty | io::ErrorKind::ResourceBusy
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(e).with_context(|| format!("removing the empty directory {}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_or_a_serving_daemon_keep_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let pins = dir.path().join("pins");
        std::fs::create_dir(&pins).unwrap();
        std::fs::write(pins.join("endpoints"), "").unwrap();
        assert_eq!(in_use(&pins, dir.path()), Some(InUse::Pins));
        std::fs::remove_file(pins.join("endpoints")).unwrap();
        assert_eq!(in_use(&pins, dir.path()), None, "an empty pin dir is no pod");
        assert!(!pins.exists(), "and is removed");
        // A dead daemon's socket is no daemon; a listening one is.
        let dead = rivet_common::socket::socket_path(dir.path(), "svc-ipam");
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        assert_eq!(in_use(&pins, dir.path()), None);
        let _live =
            std::os::unix::net::UnixListener::bind(rivet_common::socket::socket_path(dir.path(), "svc-gc")).unwrap();
        assert_eq!(in_use(&pins, dir.path()), Some(InUse::Daemons(vec!["svc-gc".into()])));
    }
}

//! `rivet node prepare`: the node's directories for daemons another
//! supervisor starts (kubelet: the DaemonSet's `prepare` init container,
//! run as root before the daemons' containers). It does what `rivet node
//! up` does to them before it starts the daemons, and nothing else: the
//! socket dir `root:<daemon user's group>` 01771 (the daemons create their
//! sockets there, none removes another's), each daemon's
//! `<state-dir>/<daemon>/` (0700, its user's), stale socket lock files given
//! to their daemons, and the pin dir `<bpffs>/rivet/<node>` (0700, the
//! datapath user's). Idempotent: a restarted pod runs it again over what
//! the last one left.

use std::path::Path;

use anyhow::{Context as _, Result};

use super::{ALL_DAEMONS, PrepareArgs};
use crate::accounts;

pub(super) fn prepare(socket_dir: &Path, state_dir: &Path, args: &PrepareArgs) -> Result<bool> {
    let accounts = args.accounts.resolve()?;
    let pin_dir = rivet_common::pin_layout::pin_dir(&args.bpffs, &args.node_name)?;
    std::fs::create_dir_all(socket_dir).with_context(|| format!("creating {}", socket_dir.display()))?;
    accounts::set_up_socket_dir(socket_dir, &accounts)?;
    super::up::give_daemons_their_dirs(state_dir, socket_dir, &pin_dir, &ALL_DAEMONS, &accounts)?;
    println!(
        "rivet node: prepared {} (sockets), {}/<daemon> (state) and {} (pins)",
        socket_dir.display(),
        state_dir.display(),
        pin_dir.display()
    );
    Ok(true)
}

//! The users a node's daemons run as, and the directories `rivet node up`
//! gives them.
//!
//! - svc-ipam, svc-identity and svc-endpoint run as the daemon user
//!   (`--daemon-user`, default `rivet`) with no capabilities;
//! - svc-loader and svc-gc run as the datapath user (`--datapath-user`,
//!   default `rivet-datapath`): svc-loader keeps CAP_BPF, CAP_NET_ADMIN and
//!   CAP_PERFMON, svc-gc nothing. The pins are this user's and mode 0600 in a
//!   0700 directory: on this kernel opening a pin is only a file permission
//!   check, so a daemon running as the same uid as the pins could open every
//!   map. That is why the two users differ.
//! - the sockets are `0660 <daemon's user>:<reader group>`; the members of
//!   the reader group (`--reader-group`, default `rivet-readers`) may
//!   make read-only calls. Both daemon users are members too: they connect to
//!   each other's sockets.
//!
//! Each daemon starts as root and switches itself (`--user`), so it can drop
//! its bounding set and keep exactly its capabilities across the switch
//! (rivet_common::privileges). `rivet node up` creates and hands over what
//! they write: `<state-dir>/<daemon>/` (0700, the daemon's user), the socket
//! dir when it creates it (`root:<daemon user's group>`, 01771: the daemons
//! create their sockets, nobody removes another's, others may only reach
//! sockets by name) and the pin dir `<bpffs>/rivet/<node>` (0700, the
//! datapath user). It refuses to start when a user cannot reach its
//! directories, naming the directory and the fix.

use std::fs;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use rivet_common::privileges::{Account, PrivilegeError, resolve_group, resolve_user};

/// Default user of svc-ipam, svc-identity and svc-endpoint.
pub const DEFAULT_DAEMON_USER: &str = "rivet";
/// Default user of svc-loader and svc-gc.
pub const DEFAULT_DATAPATH_USER: &str = "rivet-datapath";
/// Default group whose members may make read-only calls.
pub const DEFAULT_READER_GROUP: &str = "rivet-readers";

/// The daemons that run as the datapath user.
const DATAPATH_DAEMONS: [&str; 2] = ["svc-loader", "svc-gc"];

/// Mode of a socket dir `rivet node up` creates: sticky, group-writable,
/// searchable by others.
const SOCKET_DIR_MODE: u32 = 0o1771;

/// Mode of a daemon's state dir and of the pin dir.
const PRIVATE_DIR_MODE: u32 = 0o700;

/// Entries a daemon kept directly in the node's state dir before each daemon
/// had its own: moved into `<state-dir>/<daemon>/` on the first start.
const LEGACY_STATE: [(&str, &[&str]); 3] = [
    ("svc-ipam", &["ipam"]),
    ("svc-identity", &["identity"]),
    ("svc-endpoint", &["endpoints", "policies.json", "namespaces.json"]),
];

/// Who the node's daemons run as, resolved from the user and group databases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAccounts {
    /// User of svc-ipam, svc-identity and svc-endpoint.
    pub daemon: Account,
    /// User of svc-loader and svc-gc.
    pub datapath: Account,
    /// The reader group's name.
    pub reader_group: String,
    /// Its gid: the sockets' group, read-only access.
    pub reader_gid: u32,
}

impl NodeAccounts {
    /// Resolves the users and the group, and checks the memberships the
    /// layout needs.
    pub fn resolve(daemon_user: &str, datapath_user: &str, reader_group: &str) -> Result<Self> {
        let user = |name: &str, flag: &str| {
            resolve_user(name).map_err(|e| match e {
                PrivilegeError::NoSuchUser { .. } => anyhow::anyhow!(
                    "user `{name}` does not exist: run `cargo xtask install` (it creates the users and groups \
                     the daemons run as), create it by hand (README, \"Users and groups\"), or name another \
                     with {flag}"
                ),
                e => anyhow::Error::from(e),
            })
        };
        let daemon = user(daemon_user, "--daemon-user")?;
        let datapath = user(datapath_user, "--datapath-user")?;
        let reader_gid = resolve_group(reader_group).map_err(|e| match e {
            PrivilegeError::NoSuchGroup { .. } => anyhow::anyhow!(
                "group `{reader_group}` does not exist: run `cargo xtask install`, create it by hand \
                 (README, \"Users and groups\"), or name another with --reader-group"
            ),
            e => anyhow::Error::from(e),
        })?;
        if daemon.uid == datapath.uid && daemon.uid != 0 {
            bail!(
                "--daemon-user and --datapath-user are both {} (uid {}): the pins belong to the datapath user, \
                 so svc-ipam, svc-identity and svc-endpoint must run as another user",
                daemon.name,
                daemon.uid
            );
        }
        for account in [&daemon, &datapath] {
            if account.uid != 0 && !account.groups.contains(&reader_gid) {
                bail!(
                    "user {} is not a member of group {reader_group}: the daemons set that group on their \
                     sockets and connect to each other's (`usermod -a -G {reader_group} {}`; \
                     `cargo xtask install` does it)",
                    account.name,
                    account.name
                );
            }
        }
        if datapath.uid != 0 && !datapath.groups.contains(&daemon.gid) {
            bail!(
                "user {} is not a member of group {} (the primary group of {}): svc-loader and svc-gc create \
                 their sockets in the socket dir, which is that group's (`usermod -a -G {} {}`; \
                 `cargo xtask install` does it)",
                datapath.name,
                daemon.gid,
                daemon.name,
                daemon.gid,
                datapath.name
            );
        }
        Ok(Self {
            daemon,
            datapath,
            reader_group: reader_group.to_string(),
            reader_gid,
        })
    }

    /// The user daemon `name` runs as.
    pub fn of(&self, name: &str) -> &Account {
        if DATAPATH_DAEMONS.contains(&name) {
            &self.datapath
        } else {
            &self.daemon
        }
    }

    /// Uids that may call every method of daemon `name`: root (rivet-cni,
    /// the CLI run as root), plus the daemon user where svc-endpoint or
    /// svc-identity drive it. svc-gc's one call (svc-endpoint's
    /// ListEndpoints) is read-only: it has it as a member of the reader group.
    pub fn full_access_uids(&self, name: &str) -> Vec<u32> {
        let mut uids = vec![0];
        if matches!(name, "svc-ipam" | "svc-identity" | "svc-loader") && self.daemon.uid != 0 {
            uids.push(self.daemon.uid);
        }
        uids
    }
}

/// `account` may search (`x`) the directory with metadata `meta`.
fn can(meta: &fs::Metadata, account: &Account, bits: u32) -> bool {
    if account.uid == 0 {
        return true;
    }
    let mode = meta.mode();
    let shift = if meta.uid() == account.uid {
        6
    } else if account.groups.contains(&meta.gid()) || meta.gid() == account.gid {
        3
    } else {
        0
    };
    (mode >> shift) & bits == bits
}

fn describe(dir: &Path, meta: &fs::Metadata) -> String {
    format!(
        "{} is {:04o} uid {} gid {}",
        dir.display(),
        meta.mode() & 0o7777,
        meta.uid(),
        meta.gid()
    )
}

/// Fails unless `account` can reach `path`: search permission on each
/// existing ancestor (the ones `rivet node up` creates are 0755).
pub fn check_reachable(account: &Account, path: &Path, what: &str) -> Result<()> {
    let mut dir = PathBuf::new();
    for component in path.parent().unwrap_or(Path::new("/")).components() {
        dir.push(component);
        let Ok(meta) = fs::metadata(&dir) else {
            return Ok(());
        };
        if !can(&meta, account, 0o1) {
            bail!(
                "user {} (uid {}) cannot reach the {what} {}: {}. Make it searchable (`chmod o+x {}`) \
                 or choose a {what} elsewhere",
                account.name,
                account.uid,
                path.display(),
                describe(&dir, &meta),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Gives `path` and everything under it to `account`. Walks by directory
/// fd with `O_NOFOLLOW` and changes entries relative to their directory
/// without following links, so a daemon user that swaps an entry for a
/// symbolic link while the walk runs cannot make root chown anything
/// outside the tree. `path` itself must sit in a directory only root
/// writes (the node's state dir, the bpffs `rivet` dir).
fn own_tree(path: &Path, account: &Account) -> Result<()> {
    let dir = open_dir_nofollow(None, path).with_context(|| format!("opening {}", path.display()))?;
    own_dir(dir, path, account)
}

fn open_dir_nofollow(parent: Option<&nix::dir::Dir>, name: &Path) -> nix::Result<std::os::fd::OwnedFd> {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC;
    match parent {
        Some(dir) => nix::fcntl::openat(dir, name, flags, nix::sys::stat::Mode::empty()),
        None => nix::fcntl::open(name, flags, nix::sys::stat::Mode::empty()),
    }
}

fn own_dir(fd: std::os::fd::OwnedFd, path: &Path, account: &Account) -> Result<()> {
    use nix::unistd::{Gid, Uid};
    let (uid, gid) = (Some(Uid::from_raw(account.uid)), Some(Gid::from_raw(account.gid)));
    let give = |what: &Path| format!("giving {} to user {}", what.display(), account.name);
    nix::unistd::fchown(&fd, uid, gid).with_context(|| give(path))?;
    let mut dir = nix::dir::Dir::from_fd(fd).with_context(|| format!("listing {}", path.display()))?;
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry.with_context(|| format!("listing {}", path.display()))?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(PathBuf::from(std::ffi::OsStr::from_bytes(name)));
        }
    }
    for name in names {
        let child = path.join(&name);
        match open_dir_nofollow(Some(&dir), &name) {
            Ok(sub) => own_dir(sub, &child, account)?,
            // Not a directory (or a link to one): change the entry itself.
            Err(nix::errno::Errno::ENOTDIR | nix::errno::Errno::ELOOP) => {
                nix::unistd::fchownat(&dir, &name, uid, gid, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
                    .with_context(|| give(&child))?
            }
            // Gone meanwhile: nothing to give.
            Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(e).with_context(|| format!("opening {}", child.display())),
        }
    }
    Ok(())
}

/// Creates `dir` if needed, gives it (and what is in it) to `account`, mode 0700.
pub fn give_private_dir(dir: &Path, account: &Account) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    own_tree(dir, account)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(PRIVATE_DIR_MODE))
        .with_context(|| format!("setting the mode of {}", dir.display()))
}

/// Moves what a daemon kept directly in `state_dir` into its own dir
/// (the layout before each daemon had one); one message per move.
pub fn migrate_legacy_state(state_dir: &Path) -> Result<Vec<String>> {
    let mut moved = Vec::new();
    for (daemon, entries) in LEGACY_STATE {
        for entry in entries {
            let old = state_dir.join(entry);
            let new = state_dir.join(daemon).join(entry);
            if fs::symlink_metadata(&old).is_err() || fs::symlink_metadata(&new).is_ok() {
                continue;
            }
            fs::create_dir_all(state_dir.join(daemon))
                .with_context(|| format!("creating {}", state_dir.join(daemon).display()))?;
            fs::rename(&old, &new).with_context(|| format!("moving {} to {}", old.display(), new.display()))?;
            moved.push(format!("moved {} to {}", old.display(), new.display()));
        }
    }
    Ok(moved)
}

/// Sets up a socket dir `rivet node up` just created: `root:<daemon group>` 01771.
pub fn set_up_socket_dir(dir: &Path, accounts: &NodeAccounts) -> Result<()> {
    std::os::unix::fs::chown(dir, Some(0), Some(accounts.daemon.gid))
        .with_context(|| format!("setting the group of {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(SOCKET_DIR_MODE))
        .with_context(|| format!("setting the mode of {}", dir.display()))
}

/// Fails unless both daemon users may create their sockets in an existing `dir`.
pub fn check_socket_dir(dir: &Path, accounts: &NodeAccounts) -> Result<()> {
    let meta = fs::metadata(dir).with_context(|| format!("inspecting {}", dir.display()))?;
    for account in [&accounts.daemon, &accounts.datapath] {
        if !can(&meta, account, 0o3) {
            bail!(
                "user {} cannot create its socket in {}: {}. Let `rivet node up` create the socket dir \
                 (remove it or name another with --socket-dir), or `chgrp {} {} && chmod 1771 {}`",
                account.name,
                dir.display(),
                describe(dir, &meta),
                accounts.daemon.gid,
                dir.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Gives a stale lock file (of a daemon that ran as another user) to the
/// daemon's user, so the daemon can take the lock.
pub fn give_lock_file(lock: &Path, account: &Account) -> Result<()> {
    match fs::symlink_metadata(lock) {
        // One link only: never change an inode that has another name elsewhere.
        Ok(meta) if meta.is_file() && meta.nlink() == 1 && meta.uid() != account.uid => {
            std::os::unix::fs::lchown(lock, Some(account.uid), Some(account.gid))
                .with_context(|| format!("giving {} to user {}", lock.display(), account.name))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(uid: u32, gid: u32, groups: &[u32]) -> Account {
        Account {
            name: format!("u{uid}"),
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn search_and_write_permission_by_owner_group_other() {
        let dir = tempfile::tempdir().unwrap();
        let meta = |mode: u32| {
            fs::set_permissions(dir.path(), fs::Permissions::from_mode(mode)).unwrap();
            fs::metadata(dir.path()).unwrap()
        };
        let owner = fs::metadata(dir.path()).unwrap().uid();
        let group = fs::metadata(dir.path()).unwrap().gid();
        let stranger = account(4242, 4242, &[4242]);
        let member = account(4243, 4243, &[4243, group]);
        let me = account(owner, 4244, &[4244]);
        assert!(!can(&meta(0o700), &stranger, 0o1));
        assert!(can(&meta(0o701), &stranger, 0o1));
        assert!(!can(&meta(0o750), &stranger, 0o1));
        assert!(can(&meta(0o750), &member, 0o1));
        assert!(!can(&meta(0o750), &member, 0o3), "group may search but not write");
        assert!(can(&meta(0o1771), &member, 0o3));
        assert!(!can(&meta(0o1771), &stranger, 0o3));
        assert!(can(&meta(0o1771), &stranger, 0o1));
        assert!(can(&meta(0o700), &me, 0o3));
        assert!(can(&meta(0o000), &account(0, 0, &[0]), 0o3), "root");
    }

    #[test]
    fn unreachable_dirs_are_named_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let closed = dir.path().join("closed");
        fs::create_dir(&closed).unwrap();
        fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let stranger = account(4242, 4242, &[4242]);
        let err = check_reachable(&stranger, &closed.join("state/x"), "state dir")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{} is 0700", closed.display())) && err.contains("chmod o+x"),
            "{err}"
        );
        fs::set_permissions(&closed, fs::Permissions::from_mode(0o711)).unwrap();
        check_reachable(&stranger, &closed.join("state/x"), "state dir").unwrap();
    }

    #[test]
    fn legacy_state_moves_into_each_daemons_dir_once() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        fs::create_dir_all(state.join("endpoints/7")).unwrap();
        fs::write(state.join("policies.json"), "{}").unwrap();
        fs::create_dir_all(state.join("ipam")).unwrap();
        fs::create_dir_all(state.join("svc-identity/identity")).unwrap();
        fs::create_dir_all(state.join("identity")).unwrap();
        let moved = migrate_legacy_state(state).unwrap();
        assert_eq!(moved.len(), 3, "{moved:?}");
        assert!(state.join("svc-endpoint/endpoints/7").is_dir());
        assert!(state.join("svc-endpoint/policies.json").is_file());
        assert!(state.join("svc-ipam/ipam").is_dir());
        assert!(
            state.join("identity").is_dir(),
            "an entry whose new place is taken stays where it is"
        );
        assert!(migrate_legacy_state(state).unwrap().is_empty(), "idempotent");
    }

    #[test]
    fn private_dirs_change_hands_with_their_contents() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("svc-ipam");
        fs::create_dir_all(target.join("ipam")).unwrap();
        fs::write(target.join("ipam/allocations.json"), "{}").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", target.join("link")).unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("precious"), "").unwrap();
        std::os::unix::fs::symlink(&outside, target.join("ipam/dir-link")).unwrap();
        let nobody = account(65534, 65534, &[65534]);
        give_private_dir(&target, &nobody).unwrap();
        for p in ["", "ipam", "ipam/allocations.json", "link", "ipam/dir-link"] {
            let meta = fs::symlink_metadata(target.join(p)).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (65534, 65534), "{p}");
        }
        assert_eq!(fs::metadata(&target).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(fs::metadata("/etc/passwd").unwrap().uid(), 0, "links are not followed");
        for p in [&outside, &outside.join("precious")] {
            assert_eq!(
                fs::metadata(p).unwrap().uid(),
                0,
                "{}: links to directories are not followed",
                p.display()
            );
        }
    }
}

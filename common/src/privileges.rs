//! Dropping a daemon's privileges at start: the user it runs as and the only
//! capabilities it keeps (DESIGN.md §1, the privileges column).
//!
//! Every daemon's `main` calls [`drop_privileges`] right after parsing its
//! flags, before the tokio runtime starts a thread: Linux credentials are per
//! thread, and threads started later inherit what the main thread has then.
//! The call
//!
//! 1. drops every capability outside the daemon's table from the bounding
//!    set (while it still has CAP_SETPCAP);
//! 2. with `--user`, switches to that user, its primary group and its
//!    supplementary groups from the group database (keeping the permitted
//!    set across the switch only when the table is not empty);
//! 3. sets effective = permitted = the table (what the process still has of
//!    it), inheritable and ambient empty, and `no_new_privs`, so nothing it
//!    executes can gain a capability back;
//! 4. reads the result back and refuses to serve ([`PrivilegeError`]) when
//!    any of the effective, permitted, inheritable or ambient sets holds a
//!    capability outside the table, when the table's capabilities are not
//!    all there, or when the user switch did not take.
//!
//! A daemon started without `--user` keeps its uid (the tests start daemons
//! as root): it still loses every capability outside its table. A bounding
//! set that cannot be lowered (a daemon started as a non-root user without
//! CAP_SETPCAP) is reported, not refused: with `no_new_privs` set it cannot
//! give anything back.

use std::ffi::CString;
use std::fmt;

pub use caps::Capability;
use caps::{CapSet, CapsHashSet};
use nix::unistd::{Gid, Group, ResGid, ResUid, Uid, User};

/// Why privileges could not be dropped, or why the daemon refuses to serve
/// with what it has.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    /// `--user` names no user.
    #[error(
        "user `{name}` does not exist: create the Rivet users and groups with `cargo xtask install` \
         (or by hand, see the README's \"Users and groups\"), or name another with --user"
    )]
    NoSuchUser {
        /// The name given.
        name: String,
    },
    /// A group name resolves to nothing.
    #[error(
        "group `{name}` does not exist: create the Rivet users and groups with `cargo xtask install` \
         (or by hand, see the README's \"Users and groups\")"
    )]
    NoSuchGroup {
        /// The name given.
        name: String,
    },
    /// The user or group database could not be read.
    #[error("looking up {what} `{name}`: {source}")]
    Lookup {
        /// `user` or `group`.
        what: &'static str,
        /// The name or id looked up.
        name: String,
        /// The error.
        source: nix::Error,
    },
    /// Another thread exists: a credential change would apply to this one only.
    #[error(
        "privileges must be dropped before any thread starts ({threads} threads run); this is a bug in the daemon's main"
    )]
    Threaded {
        /// Threads counted in /proc/self/status.
        threads: usize,
    },
    /// Switching to another user needs root.
    #[error(
        "--user {user}: switching to uid {uid} needs root (the daemon runs as uid {current}); start it as root, \
         or as that user and without --user"
    )]
    CannotSwitch {
        /// The user asked for.
        user: String,
        /// Its uid.
        uid: u32,
        /// The uid the daemon runs as.
        current: u32,
    },
    /// A credential syscall failed.
    #[error("{action}: {source}")]
    Syscall {
        /// What was being done.
        action: String,
        /// The OS error.
        source: nix::Error,
    },
    /// A capability call failed.
    #[error("{action}: {message}")]
    Capabilities {
        /// What was being done.
        action: &'static str,
        /// The caps crate's message.
        message: String,
    },
    /// After dropping, a set still holds capabilities outside the table.
    #[error(
        "refusing to serve: the {set} capability set still holds {extra} after dropping privileges \
         (this daemon needs only {needed})"
    )]
    StillPrivileged {
        /// Effective, permitted, inheritable or ambient.
        set: &'static str,
        /// What it should not have.
        extra: CapabilityList,
        /// The table.
        needed: CapabilityList,
    },
    /// The daemon lacks capabilities of its table.
    #[error(
        "refusing to serve: this daemon needs {missing} (its table: {needed}) but was started without them; \
         start it as root (with --user to run as a non-root user) or grant them"
    )]
    MissingCapabilities {
        /// What is missing from the effective set.
        missing: CapabilityList,
        /// The table.
        needed: CapabilityList,
    },
    /// The user switch did not take.
    #[error("refusing to serve: after switching to {user} the process runs as {found}")]
    WrongUser {
        /// Who it should be.
        user: String,
        /// Who it is.
        found: String,
    },
}

fn caps_err(action: &'static str) -> impl FnOnce(caps::errors::CapsError) -> PrivilegeError {
    move |e| PrivilegeError::Capabilities {
        action,
        message: e.to_string(),
    }
}

fn sys_err(action: impl Into<String>) -> impl FnOnce(nix::Error) -> PrivilegeError {
    let action = action.into();
    move |source| PrivilegeError::Syscall { action, source }
}

/// A set of capabilities in the kernel's order, printed `CAP_NET_ADMIN, CAP_BPF`
/// (or `no capabilities`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapabilityList(Vec<Capability>);

impl CapabilityList {
    /// The list of `caps`, sorted, without repeats.
    ///
    /// ```
    /// use rivet_common::privileges::{Capability, CapabilityList};
    /// let list = CapabilityList::new([Capability::CAP_BPF, Capability::CAP_NET_ADMIN, Capability::CAP_BPF]);
    /// assert_eq!(list.to_string(), "CAP_NET_ADMIN, CAP_BPF");
    /// ```
    pub fn new(caps: impl IntoIterator<Item = Capability>) -> Self {
        let mut list: Vec<Capability> = caps.into_iter().collect();
        list.sort_by_key(Capability::index);
        list.dedup();
        Self(list)
    }

    /// The capabilities of a kernel bitmask (a `Cap*:` line of `/proc/<pid>/status`).
    ///
    /// ```
    /// use rivet_common::privileges::CapabilityList;
    /// let list = CapabilityList::from_mask(0x000000c000001000);
    /// assert_eq!(list.to_string(), "CAP_NET_ADMIN, CAP_PERFMON, CAP_BPF");
    /// assert_eq!(list.short(), "net_admin,perfmon,bpf");
    /// assert_eq!(CapabilityList::from_mask(0).short(), "-");
    /// ```
    pub fn from_mask(mask: u64) -> Self {
        Self::new(caps::all().into_iter().filter(|c| mask & c.bitmask() != 0))
    }

    /// Lower-case names without `CAP_`, comma-separated (`-` for none): for tables.
    pub fn short(&self) -> String {
        if self.0.is_empty() {
            return "-".into();
        }
        let names: Vec<String> = self
            .0
            .iter()
            .map(|c| c.to_string().trim_start_matches("CAP_").to_ascii_lowercase())
            .collect();
        names.join(",")
    }

    fn of(set: &CapsHashSet) -> Self {
        Self::new(set.iter().copied())
    }

    /// The capabilities.
    pub fn as_slice(&self) -> &[Capability] {
        &self.0
    }

    /// The kernel's bitmask (as in `/proc/<pid>/status`).
    ///
    /// ```
    /// use rivet_common::privileges::{Capability, CapabilityList};
    /// let list = CapabilityList::new([Capability::CAP_NET_ADMIN, Capability::CAP_BPF]);
    /// assert_eq!(list.mask(), (1 << 12) | (1 << 39));
    /// ```
    pub fn mask(&self) -> u64 {
        self.0.iter().fold(0, |m, c| m | c.bitmask())
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for CapabilityList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no capabilities");
        }
        let names: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&names.join(", "))
    }
}

/// A user from the user database, with the groups it runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// User name.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary group.
    pub gid: u32,
    /// Its groups: the primary one and the supplementary ones.
    pub groups: Vec<u32>,
}

/// Looks up a user by name, or by uid when `spec` is a number.
///
/// ```
/// let root = rivet_common::privileges::resolve_user("root").unwrap();
/// assert_eq!((root.uid, root.gid), (0, 0));
/// assert_eq!(rivet_common::privileges::resolve_user("0").unwrap().name, "root");
/// assert!(rivet_common::privileges::resolve_user("no-such-user-rivet").is_err());
/// ```
pub fn resolve_user(spec: &str) -> Result<Account, PrivilegeError> {
    let lookup = |source| PrivilegeError::Lookup {
        what: "user",
        name: spec.to_string(),
        source,
    };
    let user = match spec.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)).map_err(lookup)?,
        Err(_) => User::from_name(spec).map_err(lookup)?,
    }
    .ok_or_else(|| PrivilegeError::NoSuchUser { name: spec.to_string() })?;
    let cname = CString::new(user.name.clone()).map_err(|_| PrivilegeError::NoSuchUser { name: spec.to_string() })?;
    let mut groups: Vec<u32> = nix::unistd::getgrouplist(&cname, user.gid)
        .map_err(lookup)?
        .into_iter()
        .map(Gid::as_raw)
        .collect();
    groups.sort_unstable();
    groups.dedup();
    Ok(Account {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
    })
}

/// Looks up a group's gid by name, or takes `spec` as a gid when it is a number.
///
/// ```
/// assert_eq!(rivet_common::privileges::resolve_group("root").unwrap(), 0);
/// assert_eq!(rivet_common::privileges::resolve_group("4242").unwrap(), 4242);
/// ```
pub fn resolve_group(spec: &str) -> Result<u32, PrivilegeError> {
    if let Ok(gid) = spec.parse::<u32>() {
        return Ok(gid);
    }
    Group::from_name(spec)
        .map_err(|source| PrivilegeError::Lookup {
            what: "group",
            name: spec.to_string(),
            source,
        })?
        .map(|g| g.gid.as_raw())
        .ok_or_else(|| PrivilegeError::NoSuchGroup { name: spec.to_string() })
}

/// What a daemon runs with after [`drop_privileges`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The daemon.
    pub daemon: &'static str,
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
    /// Its effective (= permitted) capabilities.
    pub capabilities: CapabilityList,
    /// Capabilities left in the bounding set because it could not be
    /// lowered (no CAP_SETPCAP); inert under `no_new_privs`.
    pub bounding_left: CapabilityList,
}

impl Dropped {
    /// Logs what the daemon runs with (call it once logging is set up).
    pub fn log(&self) {
        tracing::info!(
            daemon = self.daemon,
            uid = self.uid,
            gid = self.gid,
            groups = ?self.groups,
            capabilities = %self.capabilities,
            no_new_privs = true,
            "privileges dropped"
        );
        if !self.bounding_left.is_empty() {
            tracing::warn!(
                daemon = self.daemon,
                bounding = %self.bounding_left,
                "the bounding set could not be lowered (no CAP_SETPCAP); no_new_privs keeps it from granting anything"
            );
        }
    }
}

/// Threads of this process, from /proc/self/status.
fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(1)
}

/// The process's real, effective and saved uids and gids.
struct Credentials {
    uids: ResUid,
    gids: ResGid,
}

impl Credentials {
    fn read() -> Result<Self, PrivilegeError> {
        Ok(Self {
            uids: nix::unistd::getresuid().map_err(sys_err("getresuid"))?,
            gids: nix::unistd::getresgid().map_err(sys_err("getresgid"))?,
        })
    }

    /// Whether all three uids are `account`'s and all three gids its primary group.
    fn are_exactly(&self, account: &Account) -> bool {
        let (u, g) = (&self.uids, &self.gids);
        [u.real, u.effective, u.saved]
            .iter()
            .all(|id| id.as_raw() == account.uid)
            && [g.real, g.effective, g.saved]
                .iter()
                .all(|id| id.as_raw() == account.gid)
    }
}

fn read_set(set: CapSet) -> Result<CapsHashSet, PrivilegeError> {
    caps::read(None, set).map_err(caps_err("reading a capability set"))
}

/// Drops the process to `user` (when given) and to exactly the capabilities
/// of `keep` (see the module docs); fails, and the daemon must not serve,
/// when the result is wider than `keep` or lacks part of it. Call it before
/// any thread starts.
pub fn drop_privileges(
    daemon: &'static str,
    user: Option<&Account>,
    keep: &[Capability],
) -> Result<Dropped, PrivilegeError> {
    let threads = thread_count();
    if threads > 1 {
        return Err(PrivilegeError::Threaded { threads });
    }
    let keep: CapsHashSet = keep.iter().copied().collect();

    // 1. The bounding set, while CAP_SETPCAP is still ours.
    if read_set(CapSet::Effective)?.contains(&Capability::CAP_SETPCAP) {
        for cap in read_set(CapSet::Bounding)?.difference(&keep) {
            caps::drop(None, CapSet::Bounding, *cap).map_err(caps_err("dropping from the bounding set"))?;
        }
    }

    // 2. The user.
    if let Some(account) = user {
        let current = Credentials::read()?;
        if !current.are_exactly(account) {
            if current.uids.effective.as_raw() != 0 {
                return Err(PrivilegeError::CannotSwitch {
                    user: account.name.clone(),
                    uid: account.uid,
                    current: current.uids.effective.as_raw(),
                });
            }
            // Keep the permitted set across setresuid only if something of it is needed.
            if !keep.is_empty() {
                caps::securebits::set_keepcaps(true).map_err(caps_err("setting keep-caps"))?;
            }
            let groups: Vec<Gid> = account.groups.iter().copied().map(Gid::from_raw).collect();
            nix::unistd::setgroups(&groups).map_err(sys_err(format!("setgroups {:?}", account.groups)))?;
            let gid = Gid::from_raw(account.gid);
            nix::unistd::setresgid(gid, gid, gid).map_err(sys_err(format!("setresgid {}", account.gid)))?;
            let uid = Uid::from_raw(account.uid);
            nix::unistd::setresuid(uid, uid, uid)
                .map_err(sys_err(format!("setresuid {} ({})", account.uid, account.name)))?;
            if !keep.is_empty() {
                caps::securebits::set_keepcaps(false).map_err(caps_err("clearing keep-caps"))?;
            }
        }
    }

    // 3. Exactly the table: effective first (it must stay within permitted).
    let kept: CapsHashSet = read_set(CapSet::Permitted)?.intersection(&keep).copied().collect();
    caps::clear(None, CapSet::Ambient).map_err(caps_err("clearing the ambient set"))?;
    caps::set(None, CapSet::Inheritable, &CapsHashSet::new()).map_err(caps_err("clearing the inheritable set"))?;
    caps::set(None, CapSet::Effective, &kept).map_err(caps_err("setting the effective set"))?;
    caps::set(None, CapSet::Permitted, &kept).map_err(caps_err("setting the permitted set"))?;
    nix::sys::prctl::set_no_new_privs().map_err(sys_err("setting no_new_privs"))?;

    // 4. Read back and refuse anything wider, or narrower, than the table.
    let needed = CapabilityList::of(&keep);
    for (name, set) in [
        ("effective", CapSet::Effective),
        ("permitted", CapSet::Permitted),
        ("inheritable", CapSet::Inheritable),
        ("ambient", CapSet::Ambient),
    ] {
        let extra: CapsHashSet = read_set(set)?.difference(&keep).copied().collect();
        if !extra.is_empty() {
            return Err(PrivilegeError::StillPrivileged {
                set: name,
                extra: CapabilityList::of(&extra),
                needed,
            });
        }
    }
    let effective = read_set(CapSet::Effective)?;
    let missing: CapsHashSet = keep.difference(&effective).copied().collect();
    if !missing.is_empty() {
        return Err(PrivilegeError::MissingCapabilities {
            missing: CapabilityList::of(&missing),
            needed,
        });
    }
    let now = Credentials::read()?;
    let groups: Vec<u32> = nix::unistd::getgroups()
        .map_err(sys_err("getgroups"))?
        .into_iter()
        .map(Gid::as_raw)
        .collect();
    if let Some(account) = user
        && !now.are_exactly(account)
    {
        return Err(PrivilegeError::WrongUser {
            user: format!("{} (uid {}, gid {})", account.name, account.uid, account.gid),
            found: format!("uids {:?}, gids {:?}", now.uids, now.gids),
        });
    }
    let bounding_left: CapsHashSet = read_set(CapSet::Bounding)?.difference(&keep).copied().collect();
    Ok(Dropped {
        daemon,
        uid: now.uids.effective.as_raw(),
        gid: now.gids.effective.as_raw(),
        groups,
        capabilities: CapabilityList::of(&effective),
        bounding_left: CapabilityList::of(&bounding_left),
    })
}

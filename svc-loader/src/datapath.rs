//! The loaded datapath: the BPF object, its pinned maps, and the tc
//! attachments of its two programs.
//!
//! # Pins
//!
//! Everything lives under one pin directory, `<bpffs>/rivet/<node>/`
//! ([`DatapathOptions::pin_dir`]): `<pin_dir>/<map>` for every map of the
//! object (`endpoints`, `ipcache`, `policy`, `ep_prefixes`, `ct4`, `ct6`,
//! `metrics`, `events`, `config`, and any map the datapath adds later). A
//! map of the object with no pin yet (one added by a newer datapath) is
//! created and pinned beside the adopted ones.
//!
//! [`Datapath::open`] reuses an existing map pin only if the kernel's map has
//! exactly the type, key size, value size, max_entries and flags this object
//! and these options ask for; otherwise it fails with
//! [`DatapathError::PinMismatch`], naming the map and the fix. It never
//! deletes or recreates a map pin: a map in use keeps its state across
//! loader restarts, and replacing one is an operator's decision.
//!
//! # Attachments outlive the loader
//!
//! [`Datapath::attach`] adds a `clsact` qdisc to the host-side veth and one
//! direct-action `cls_bpf` filter per hook ([`crate::tc`]: priority 1,
//! handle 1, named `rivet-<node>-<program>`). A filter holds its program and the
//! program its maps, so the programs keep running when the loader exits or
//! crashes, with nothing pinned; the filter goes away with its device. A new
//! loader [`adopts`](Datapath::adopt_existing) every filter of its node by
//! replacing its program with its own instance in place (one
//! netlink request; no packet sees a missing program). [`Datapath::detach`]
//! deletes the filters. Classic tc rather than TCX links: see [`crate::tc`]
//! for the measurement. A loader that finds TCX link pins of an earlier
//! version under `<pin_dir>/links/` moves them to tc filters on start.
//!
//! Interfaces are looked up in the calling thread's network namespace
//! ([`crate::netdev`]); the loader is meant to run inside the node's.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, RingBuf};
use aya::programs::{ProgramError, ProgramFd, SchedClassifier};
use aya::{Ebpf, EbpfError, EbpfLoader};

use rivet_bpf_sys as sys;

use crate::DATAPATH_OBJECT;
use crate::netdev;
use crate::tc;
use rivet_datapath::maps::{
    Ct4Key, Ct6Key, CtEntry, CtTimeouts, DatapathConfig, EndpointInfo, EndpointKey, EpPrefixKeyData, EpPrefixValue,
    FragKey, FragValue, IpcacheKeyData, IpcacheValue, METRICS_ENTRIES, MetricsValue, PolicyKeyData, PolicyValue,
};

/// Map names (as in `bpf/datapath.c` and under the pin directory).
pub const MAP_ENDPOINTS: &str = "endpoints";
/// The ipcache LPM trie.
pub const MAP_IPCACHE: &str = "ipcache";
/// The policy LPM trie.
pub const MAP_POLICY: &str = "policy";
/// The per-endpoint prefixes LPM trie (ipBlock peers matched by address).
pub const MAP_EP_PREFIXES: &str = "ep_prefixes";
/// IPv4 conntrack.
pub const MAP_CT4: &str = "ct4";
/// IPv6 conntrack.
pub const MAP_CT6: &str = "ct6";
/// Per-CPU counters by reason and direction.
pub const MAP_METRICS: &str = "metrics";
/// The event ring buffer.
pub const MAP_EVENTS: &str = "events";
/// The single-entry config array.
pub const MAP_CONFIG: &str = "config";
/// First fragments' ports for the later fragments (LRU hash, the datapath's alone).
pub const MAP_FRAGMENTS: &str = "fragments";
/// Every map the loader uses by name.
pub const MAP_NAMES: [&str; 10] = [
    MAP_ENDPOINTS,
    MAP_IPCACHE,
    MAP_POLICY,
    MAP_EP_PREFIXES,
    MAP_CT4,
    MAP_CT6,
    MAP_METRICS,
    MAP_EVENTS,
    MAP_CONFIG,
    MAP_FRAGMENTS,
];

/// The program on tc ingress of the host-side veth (packets leaving the pod).
pub const PROG_FROM_CONTAINER: &str = "from_container";
/// The program on tc egress of the host-side veth (packets entering the pod).
pub const PROG_TO_CONTAINER: &str = "to_container";

/// Subdirectory of the pin directory where loaders before the move to tc
/// pinned their TCX links; [`Datapath::open`] migrates and removes it.
pub const LEGACY_LINKS_DIR: &str = "links";

/// Default bpffs mount point.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// Default endpoints map size (Cilium: 64Ki endpoints per node).
pub const DEFAULT_ENDPOINTS_MAX: u32 = 65_536;
/// Default ipcache size (Cilium: 512Ki prefixes).
pub const DEFAULT_IPCACHE_MAX: u32 = 524_288;
/// Default policy map size: 16Ki entries per endpoint, for 64 endpoints' worth.
pub const DEFAULT_POLICY_MAX: u32 = 16_384 * 64;
/// Default per-endpoint prefixes map size: 4Ki prefixes per endpoint, for 64
/// endpoints' worth.
pub const DEFAULT_EP_PREFIXES_MAX: u32 = 4096 * 64;
/// Default conntrack size per family (Cilium: 512Ki TCP + 256Ki other).
pub const DEFAULT_CT_MAX: u32 = 512 * 1024 + 256 * 1024;
/// Default event ring buffer size (bytes).
pub const DEFAULT_EVENTS_BYTES: u32 = 1 << 20;

/// `BPF_F_NO_PREALLOC`.
const BPF_F_NO_PREALLOC: u32 = 1;
/// `BPF_FS_MAGIC` (linux/magic.h).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

// ------------------------------------------------------------------- options

/// Where the datapath's pins live and how big its maps are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatapathOptions {
    /// `<bpffs>/rivet/<node>`: maps directly in it, links in `links/`.
    pub pin_dir: PathBuf,
    /// max_entries of `endpoints` (each endpoint takes one entry per address plus one).
    pub endpoints_max: u32,
    /// max_entries of `ipcache`.
    pub ipcache_max: u32,
    /// max_entries of `policy` (all endpoints together).
    pub policy_max: u32,
    /// max_entries of `ep_prefixes` (all endpoints together).
    pub ep_prefixes_max: u32,
    /// max_entries of `ct4`.
    pub ct4_max: u32,
    /// max_entries of `ct6`.
    pub ct6_max: u32,
    /// Size of the `events` ring buffer in bytes (rounded up to a power-of-two
    /// number of pages, as the kernel requires).
    pub events_bytes: u32,
    /// Conntrack lifetimes, written to the config map on open.
    pub ct_timeouts: CtTimeouts,
    /// `CONFIG_EVENT_*`, written to the config map on open.
    pub event_flags: u32,
}

impl DatapathOptions {
    /// Cilium-like defaults with the pins in `pin_dir`.
    pub fn new(pin_dir: impl Into<PathBuf>) -> Self {
        Self {
            pin_dir: pin_dir.into(),
            endpoints_max: DEFAULT_ENDPOINTS_MAX,
            ipcache_max: DEFAULT_IPCACHE_MAX,
            policy_max: DEFAULT_POLICY_MAX,
            ep_prefixes_max: DEFAULT_EP_PREFIXES_MAX,
            ct4_max: DEFAULT_CT_MAX,
            ct6_max: DEFAULT_CT_MAX,
            events_bytes: DEFAULT_EVENTS_BYTES,
            ct_timeouts: CtTimeouts::default(),
            event_flags: 0,
        }
    }

    /// Defaults with the pins in `<bpffs>/rivet/<node>`. The node name must
    /// be one path component (no `/`, not `.` or `..`).
    pub fn for_node(bpffs: impl AsRef<Path>, node: &str) -> Result<Self, DatapathError> {
        if node.is_empty() || node == "." || node == ".." || node.contains('/') || node.contains('\0') {
            return Err(DatapathError::InvalidOptions(format!(
                "node name {node:?} cannot name a pin directory"
            )));
        }
        Ok(Self::new(bpffs.as_ref().join("rivet").join(node)))
    }

    /// `<pin_dir>/links`, where earlier loaders pinned TCX links.
    pub fn legacy_links_dir(&self) -> PathBuf {
        self.pin_dir.join(LEGACY_LINKS_DIR)
    }

    /// The ring buffer size the kernel gets: `events_bytes` rounded up to a
    /// power-of-two number of pages (what aya does before creating it).
    pub fn effective_events_bytes(&self) -> u32 {
        let page = page_size();
        let pages = self.events_bytes.div_ceil(page).max(1);
        page * pages.next_power_of_two()
    }

    fn max_entries(&self) -> [(&'static str, u32); 7] {
        [
            (MAP_ENDPOINTS, self.endpoints_max),
            (MAP_IPCACHE, self.ipcache_max),
            (MAP_POLICY, self.policy_max),
            (MAP_EP_PREFIXES, self.ep_prefixes_max),
            (MAP_CT4, self.ct4_max),
            (MAP_CT6, self.ct6_max),
            (MAP_EVENTS, self.events_bytes),
        ]
    }

    fn validate(&self) -> Result<(), DatapathError> {
        if !self.pin_dir.is_absolute() {
            return Err(DatapathError::InvalidOptions(format!(
                "pin directory {} must be an absolute path on a bpffs",
                self.pin_dir.display()
            )));
        }
        if let Some((name, _)) = self.max_entries().iter().find(|(_, n)| *n == 0) {
            return Err(DatapathError::InvalidOptions(format!(
                "the size of map {name} must not be 0"
            )));
        }
        if self.events_bytes > 1 << 30 {
            return Err(DatapathError::InvalidOptions(format!(
                "events ring buffer of {} bytes is too big (at most 1 GiB)",
                self.events_bytes
            )));
        }
        Ok(())
    }
}

fn page_size() -> u32 {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

// -------------------------------------------------------------------- errors

/// What a map is, as the kernel reports it (or as the loader wants it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSpec {
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// max_entries (bytes for a ring buffer).
    pub max_entries: u32,
    /// `BPF_F_*` map flags.
    pub flags: u32,
}

impl From<sys::MapInfo> for MapSpec {
    fn from(info: sys::MapInfo) -> Self {
        Self {
            map_type: info.map_type,
            key_size: info.key_size,
            value_size: info.value_size,
            max_entries: info.max_entries,
            flags: info.map_flags,
        }
    }
}

impl fmt::Display for MapSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (key {} B, value {} B, max_entries {}, flags {:#x})",
            map_type_name(self.map_type),
            self.key_size,
            self.value_size,
            self.max_entries,
            self.flags
        )
    }
}

/// The kernel's name of a map type (`lru_hash`, `lpm_trie`, ...).
pub fn map_type_name(map_type: u32) -> String {
    let name = match map_type {
        1 => "hash",
        2 => "array",
        6 => "percpu_array",
        9 => "lru_hash",
        11 => "lpm_trie",
        27 => "ringbuf",
        _ => return format!("map type {map_type}"),
    };
    name.to_owned()
}

/// One of the two attachment points of an endpoint's host-side veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// tc ingress of the host-side veth: `from_container` (packets leaving the pod).
    Ingress,
    /// tc egress of the host-side veth: `to_container` (packets entering the pod).
    Egress,
}

impl Hook {
    /// Both hooks.
    pub const ALL: [Self; 2] = [Self::Ingress, Self::Egress];

    /// The program attached here.
    pub const fn program(self) -> &'static str {
        match self {
            Self::Ingress => PROG_FROM_CONTAINER,
            Self::Egress => PROG_TO_CONTAINER,
        }
    }

    /// `ingress` / `egress`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ingress => "ingress",
            Self::Egress => "egress",
        }
    }

    fn direction(self) -> tc::Direction {
        match self {
            Self::Ingress => tc::Direction::Ingress,
            Self::Egress => tc::Direction::Egress,
        }
    }

    fn from_suffix(s: &str) -> Option<Self> {
        match s {
            "ingress" => Some(Self::Ingress),
            "egress" => Some(Self::Egress),
            _ => None,
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tc {}", self.as_str())
    }
}

/// Renders an error with all its sources (`a: b: c`); aya keeps the useful
/// part (the errno, the verifier log) in the sources.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}

fn chain<'a>(err: &'a (dyn std::error::Error + 'static)) -> Chain<'a> {
    Chain(err)
}

/// Everything [`Datapath`] can fail with; each message says what was being
/// done and to what (map, pin path, program, interface).
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The options cannot work.
    #[error("invalid datapath options: {0}")]
    InvalidOptions(String),
    /// The pin directory is not on a BPF filesystem.
    #[error(
        "{} is not on a BPF filesystem (found filesystem type {fs_type:#x}); \
         mount one with `mount -t bpf bpf /sys/fs/bpf`",
        path.display()
    )]
    NotBpffs {
        /// The directory checked (the nearest existing ancestor of the pin directory).
        path: PathBuf,
        /// Its `statfs` type.
        fs_type: i64,
    },
    /// A file system operation failed.
    #[error("{what} {}: {error}", path.display())]
    Io {
        /// What was being done.
        what: String,
        /// On what.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// The embedded object lacks something the loader needs (a build bug).
    #[error("the embedded datapath object is unusable: {0}")]
    Object(String),
    /// A pinned map differs from what the datapath needs.
    #[error("map `{map}` pinned at {} is {found}, but the datapath needs {expected}; to fix: {fix}", pin.display())]
    PinMismatch {
        /// The map name.
        map: String,
        /// Its pin.
        pin: PathBuf,
        /// What the pinned map is.
        found: MapSpec,
        /// What this object with these options needs.
        expected: MapSpec,
        /// What the operator can do.
        fix: String,
    },
    /// Something other than a map is pinned where a map belongs.
    #[error("{} should be the pinned map `{map}` but is {found}; to fix: {fix}", pin.display())]
    PinNotAMap {
        /// The map name.
        map: String,
        /// The pin path.
        pin: PathBuf,
        /// What is there instead.
        found: String,
        /// What the operator can do.
        fix: String,
    },
    /// A pinned object could not be opened or inspected.
    #[error("{what} {}: {error}", pin.display())]
    Pin {
        /// What was being done.
        what: String,
        /// The pin path.
        pin: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// Creating or reusing the maps failed.
    #[error(
        "loading the datapath object with its maps pinned under {}: {}; \
         loading needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON, and write access to the pin directory",
        pin_dir.display(),
        chain(&**.error)
    )]
    Load {
        /// The pin directory.
        pin_dir: PathBuf,
        /// aya's error.
        error: Box<EbpfError>,
    },
    /// A program could not be loaded (verifier) or inspected.
    #[error("{what} program {program}: {}", chain(&**.error))]
    Program {
        /// What was being done.
        what: &'static str,
        /// The program name.
        program: &'static str,
        /// aya's error.
        error: Box<ProgramError>,
    },
    /// A map operation failed.
    #[error("{what} map {map}: {}", chain(&**.error))]
    Map {
        /// What was being done.
        what: String,
        /// The map name.
        map: &'static str,
        /// aya's error.
        error: Box<MapError>,
    },
    /// No interface with that index in the loader's network namespace.
    #[error("no interface with ifindex {ifindex} in the loader's network namespace")]
    InterfaceNotFound {
        /// The index asked for.
        ifindex: u32,
    },
    /// Looking up an interface failed (not: the interface does not exist).
    #[error("looking up interface {ifindex}: {error}")]
    Netdev {
        /// The index asked for.
        ifindex: u32,
        /// The error.
        error: io::Error,
    },
    /// Using a program for an attachment failed.
    #[error("{what} {program} on {hook} of {ifname} (ifindex {ifindex}): {}", chain(&**.error))]
    Attach {
        /// What was being done.
        what: &'static str,
        /// The program.
        program: &'static str,
        /// The hook.
        hook: Hook,
        /// The interface index.
        ifindex: u32,
        /// The interface name (or `?`).
        ifname: String,
        /// aya's error.
        error: Box<ProgramError>,
    },
    /// Listing the interfaces of the loader's namespace failed.
    #[error("listing the interfaces of the loader's network namespace: {error}")]
    Interfaces {
        /// The error.
        error: io::Error,
    },
    /// `BPF_PROG_TEST_RUN` of a program failed.
    #[error("test-running program {program} on a {len}-byte frame from ifindex {ifindex}: {error}")]
    TestRun {
        /// The program.
        program: &'static str,
        /// The frame's length.
        len: usize,
        /// The interface the frame came from.
        ifindex: u32,
        /// The kernel's answer.
        error: io::Error,
    },
    /// A tc request (qdisc or filter) for an interface failed.
    #[error("{what} (ifindex {ifindex}): {error}")]
    Tc {
        /// What was being done, to what.
        what: String,
        /// The interface index.
        ifindex: u32,
        /// The kernel's answer.
        error: io::Error,
    },
}

fn io_err(what: impl Into<String>, path: &Path) -> impl FnOnce(io::Error) -> DatapathError {
    let (what, path) = (what.into(), path.to_owned());
    move |error| DatapathError::Io { what, path, error }
}

fn map_err(what: impl Into<String>, map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    let what = what.into();
    move |error| DatapathError::Map {
        what,
        map,
        error: Box::new(error),
    }
}

// --------------------------------------------------------------- attach state

/// What [`Datapath::attach`] did on one hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkChange {
    /// The filter already runs this loader's program.
    Unchanged,
    /// A new filter was attached.
    Created,
    /// The filter now runs this loader's program instead of `previous_prog_id`.
    Updated {
        /// The program id the filter ran before.
        previous_prog_id: u32,
    },
}

impl LinkChange {
    /// Whether anything changed.
    pub fn changed(self) -> bool {
        self != Self::Unchanged
    }

    fn is_new(self) -> bool {
        self == Self::Created
    }
}

/// The result of [`Datapath::attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachOutcome {
    /// The interface.
    pub ifindex: u32,
    /// Its name in the loader's namespace.
    pub ifname: String,
    /// `from_container` on tc ingress.
    pub ingress: LinkChange,
    /// `to_container` on tc egress.
    pub egress: LinkChange,
}

impl AttachOutcome {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.ingress.changed() || self.egress.changed()
    }
}

/// The result of [`Datapath::detach`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DetachOutcome {
    /// The ingress filter was deleted.
    pub ingress: bool,
    /// The egress filter was deleted.
    pub egress: bool,
}

impl DetachOutcome {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.ingress || self.egress
    }
}

/// What [`Datapath::adopt_existing`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptReport {
    /// Filters now running this loader's programs (they ran another instance).
    pub updated: usize,
    /// Filters that already ran this loader's programs.
    pub unchanged: usize,
    /// TCX link pins of an earlier loader replaced by filters (ifindex, hook).
    pub migrated: Vec<(u32, Hook)>,
    /// TCX link pins of an earlier loader removed because their interface
    /// is gone (ifindex, hook).
    pub removed: Vec<(u32, Hook)>,
    /// Entries of the legacy links directory left alone, with the reason.
    pub ignored: Vec<(PathBuf, String)>,
}

/// The state of one hook of one interface, see [`Datapath::attachments`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachState {
    /// This loader's program is attached.
    Attached {
        /// Kernel program id (this loader's).
        prog_id: u32,
    },
    /// No filter of ours on this hook.
    Detached,
    /// Our filter runs another program (another loader instance's):
    /// [`Datapath::adopt_existing`] or [`Datapath::attach`] fixes it.
    Stale {
        /// Kernel program id.
        prog_id: u32,
    },
    /// The interface no longer exists (in this namespace).
    InterfaceGone,
}

/// One interface and the state of its two hooks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The interface index.
    pub ifindex: u32,
    /// Its name in the loader's namespace, if it exists there.
    pub ifname: Option<String>,
    /// `from_container` on tc ingress.
    pub ingress: AttachState,
    /// `to_container` on tc egress.
    pub egress: AttachState,
}

impl AttachState {
    /// Whether a filter of ours is on the hook (this instance's program or
    /// another's).
    pub fn is_ours(self) -> bool {
        matches!(self, Self::Attached { .. } | Self::Stale { .. })
    }
}

impl Attachment {
    /// Whether a filter of ours is on either hook.
    pub fn has_ours(&self) -> bool {
        self.ingress.is_ours() || self.egress.is_ours()
    }
}

/// Kernel ids of this loader's program instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramIds {
    /// `from_container`.
    pub from_container: u32,
    /// `to_container`.
    pub to_container: u32,
}

impl ProgramIds {
    /// The program id attached at `hook`.
    pub fn for_hook(&self, hook: Hook) -> u32 {
        match hook {
            Hook::Ingress => self.from_container,
            Hook::Egress => self.to_container,
        }
    }
}

// ---------------------------------------------------------------------- maps

/// One map of the datapath, shared by the loader's threads. aya's writes
/// take `&mut`, so each map has its own lock; every kernel command is atomic
/// by itself, so the lock is held for one command (or one short scan), never
/// across netlink, and writers of different maps never wait for each other.
pub struct SharedMap<T>(Mutex<T>);

impl<T> SharedMap<T> {
    fn new(map: T) -> Self {
        Self(Mutex::new(map))
    }

    /// The map, for one command or a short scan.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        // A panic while holding it leaves a map handle, not broken data.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The typed maps (all pinned). Use the key constructors in [`rivet_datapath::maps`].
pub struct DatapathMaps {
    /// ifindex / address → endpoint.
    pub endpoints: SharedMap<HashMap<MapData, EndpointKey, EndpointInfo>>,
    /// prefix → identity (keys: `IpcacheKey::to_lpm()`).
    pub ipcache: SharedMap<LpmTrie<MapData, IpcacheKeyData, IpcacheValue>>,
    /// policy entries (keys: `PolicyEntry::lpm_key()` / `PolicyKey::to_lpm()`).
    pub policy: SharedMap<LpmTrie<MapData, PolicyKeyData, PolicyValue>>,
    /// per-endpoint prefixes (keys: `EpPrefixKey::to_lpm()`).
    pub ep_prefixes: SharedMap<LpmTrie<MapData, EpPrefixKeyData, EpPrefixValue>>,
    /// IPv4 conntrack (an LRU hash).
    pub ct4: SharedMap<HashMap<MapData, Ct4Key, CtEntry>>,
    /// IPv6 conntrack (an LRU hash).
    pub ct6: SharedMap<HashMap<MapData, Ct6Key, CtEntry>>,
    /// Per-CPU counters, index `metrics_index(reason, direction)`.
    pub metrics: SharedMap<PerCpuArray<MapData, MetricsValue>>,
    /// The datapath config (index 0).
    pub config: SharedMap<Array<MapData, DatapathConfig>>,
    /// First fragments' ports (an LRU hash the datapath writes; for inspection and tests).
    pub fragments: SharedMap<HashMap<MapData, FragKey, FragValue>>,
}

impl fmt::Debug for DatapathMaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // aya's array types have no Debug; the names are what matters.
        f.debug_struct("DatapathMaps").finish_non_exhaustive()
    }
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| DatapathError::Object(format!("it has no map {name}")))?;
    T::try_from(map).map_err(map_err("using", name))
}

fn take_shared<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<SharedMap<T>, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    take_map(ebpf, name).map(SharedMap::new)
}

impl DatapathMaps {
    fn take(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
        Ok(Self {
            endpoints: take_shared(ebpf, MAP_ENDPOINTS)?,
            ipcache: take_shared(ebpf, MAP_IPCACHE)?,
            policy: take_shared(ebpf, MAP_POLICY)?,
            ep_prefixes: take_shared(ebpf, MAP_EP_PREFIXES)?,
            ct4: take_shared(ebpf, MAP_CT4)?,
            ct6: take_shared(ebpf, MAP_CT6)?,
            metrics: take_shared(ebpf, MAP_METRICS)?,
            config: take_shared(ebpf, MAP_CONFIG)?,
            fragments: take_shared(ebpf, MAP_FRAGMENTS)?,
        })
    }
}

// ------------------------------------------------------------------ datapath

/// The loaded datapath of one node; see the module docs.
///
/// Dropping it closes this process's handles only: maps stay pinned, and
/// attached programs stay attached through their filters.
///
/// Shared by the loader's threads (`&self`): attaching and detaching need
/// no lock (each netlink request is its own socket), and each map has its
/// own short lock ([`SharedMap`]).
pub struct Datapath {
    opts: DatapathOptions,
    /// aya's record of the two loaded programs (the maps are taken out into
    /// `maps`); attaching uses `program_fds`, so only tests read it.
    #[cfg_attr(not(test), allow(dead_code))]
    ebpf: Ebpf,
    /// The programs' fds, `from_container` then `to_container`, for attaching.
    program_fds: [ProgramFd; 2],
    maps: DatapathMaps,
    events: Option<RingBuf<MapData>>,
    program_ids: ProgramIds,
    adoption: AdoptReport,
    map_specs: BTreeMap<String, MapSpec>,
    reused_maps: BTreeSet<String>,
}

/// One pinned map, see [`Datapath::map_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapStatus {
    /// Map (and pin) name.
    pub name: String,
    /// What the kernel holds.
    pub spec: MapSpec,
    /// Its pin.
    pub pin: PathBuf,
    /// The pin existed when this loader started (adopted, not created).
    pub reused: bool,
}

impl fmt::Debug for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Datapath")
            .field("pin_dir", &self.opts.pin_dir)
            .field("program_ids", &self.program_ids)
            .field("events_taken", &self.events.is_none())
            .finish_non_exhaustive()
    }
}

impl Datapath {
    /// Loads the datapath with its maps pinned in `opts.pin_dir` (reusing
    /// matching pins, refusing mismatching ones), loads both programs, writes
    /// the config map, and [adopts](Self::adopt_existing) attached filters.
    pub fn open(opts: DatapathOptions) -> Result<Self, DatapathError> {
        opts.validate()?;
        check_bpffs(&opts.pin_dir)?;
        std::fs::create_dir_all(&opts.pin_dir).map_err(io_err("creating the pin directory", &opts.pin_dir))?;

        let specs = expected_specs(&opts)?;
        let mut reused_maps = BTreeSet::new();
        for (name, spec) in &specs {
            let pin = opts.pin_dir.join(name);
            check_map_pin(name, &pin, spec)?;
            if pin.exists() {
                reused_maps.insert(name.clone());
            }
        }

        let pins: Vec<(&str, PathBuf)> = specs
            .keys()
            .map(|name| (name.as_str(), opts.pin_dir.join(name)))
            .collect();
        let mut loader = EbpfLoader::new();
        for (name, pin) in &pins {
            loader.map_pin_path(name, pin.as_path());
        }
        for (name, max) in opts.max_entries() {
            loader.map_max_entries(name, max);
        }
        let mut ebpf = loader.load(DATAPATH_OBJECT).map_err(|error| DatapathError::Load {
            pin_dir: opts.pin_dir.clone(),
            error: Box::new(error),
        })?;
        // Again, now that every pin exists: one created by someone else
        // between the check and the load would have been reused as is.
        for (name, spec) in &specs {
            check_map_pin(name, &opts.pin_dir.join(name), spec)?;
        }

        let mut ids = [0u32; 2];
        let mut fds = Vec::with_capacity(2);
        for (hook, id) in Hook::ALL.into_iter().zip(&mut ids) {
            let prog = classifier(&mut ebpf, hook)?;
            let program = hook.program();
            prog.load().map_err(|error| DatapathError::Program {
                what: "loading (verifying)",
                program,
                error: Box::new(error),
            })?;
            let fd = prog
                .fd()
                .and_then(|fd| {
                    fd.try_clone().map_err(|io_error| {
                        ProgramError::SyscallError(aya::sys::SyscallError { call: "dup", io_error })
                    })
                })
                .map_err(|error| DatapathError::Program {
                    what: "duplicating the fd of",
                    program,
                    error: Box::new(error),
                })?;
            fds.push(fd);
            *id = prog
                .info()
                .map_err(|error| DatapathError::Program {
                    what: "reading the id of",
                    program,
                    error: Box::new(error),
                })?
                .id();
        }
        let maps = DatapathMaps::take(&mut ebpf)?;
        let events = take_map(&mut ebpf, MAP_EVENTS)?;

        let program_fds: [ProgramFd; 2] = fds
            .try_into()
            .map_err(|_| DatapathError::Object("both programs must load".into()))?;
        let mut datapath = Self {
            opts,
            ebpf,
            program_fds,
            maps,
            events: Some(events),
            program_ids: ProgramIds {
                from_container: ids[0],
                to_container: ids[1],
            },
            adoption: AdoptReport::default(),
            map_specs: specs,
            reused_maps,
        };
        datapath.write_config()?;
        datapath.adoption = datapath.adopt_existing()?;
        Ok(datapath)
    }

    /// Every pinned map with its shape and whether it was adopted.
    pub fn map_status(&self) -> Vec<MapStatus> {
        self.map_specs
            .iter()
            .map(|(name, spec)| MapStatus {
                name: name.clone(),
                spec: *spec,
                pin: self.opts.pin_dir.join(name),
                reused: self.reused_maps.contains(name),
            })
            .collect()
    }

    /// The options it was opened with.
    pub fn options(&self) -> &DatapathOptions {
        &self.opts
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.opts.pin_dir
    }

    /// Kernel ids of this instance's programs.
    pub fn program_ids(&self) -> ProgramIds {
        self.program_ids
    }

    /// What [`open`](Self::open) found and did with attachments.
    pub fn adoption(&self) -> &AdoptReport {
        &self.adoption
    }

    /// The typed maps.
    pub fn maps(&self) -> &DatapathMaps {
        &self.maps
    }

    /// The event ring buffer, for one consumer (`None` once taken). It can be
    /// wrapped in `tokio::io::unix::AsyncFd` for async reading.
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }

    /// The counters summed over CPUs, by `(reason, direction)`, non-zero only.
    pub fn metrics_totals(&self) -> Result<BTreeMap<(u8, u8), MetricsValue>, DatapathError> {
        let mut totals = BTreeMap::new();
        let metrics = self.maps.metrics.lock();
        for index in 0..METRICS_ENTRIES {
            let per_cpu = metrics
                .get(&index, 0)
                .map_err(map_err(format!("reading index {index} of"), MAP_METRICS))?;
            let sum = per_cpu.iter().fold(MetricsValue::default(), |acc, v| MetricsValue {
                packets: acc.packets + v.packets,
                bytes: acc.bytes + v.bytes,
            });
            if sum != MetricsValue::default() {
                totals.insert(((index / 4) as u8, (index % 4) as u8), sum);
            }
        }
        Ok(totals)
    }

    /// Runs `hook`'s program once on `frame` (an Ethernet frame) as if it
    /// came through interface `ifindex` of the calling thread's network
    /// namespace (`BPF_PROG_TEST_RUN`), against the real maps; returns the
    /// program's `TC_ACT_*`. For tests (the differential test of the
    /// datapath against the policy engine): a redirect is reported, not done.
    pub fn test_run(&self, hook: Hook, frame: &[u8], ifindex: u32) -> Result<u32, DatapathError> {
        self.test_run_repeat(hook, frame, ifindex, 1).map(|run| run.retval)
    }

    /// [`test_run`](Self::test_run) `repeat` times in the kernel on one
    /// socket buffer (a rewrite by one run is the next run's input), with
    /// the kernel's mean time per run: the verdict benchmark.
    pub fn test_run_repeat(
        &self,
        hook: Hook,
        frame: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<sys::TestRun, DatapathError> {
        let program = hook.program();
        sys::test_run_classifier_repeat(self.program_fd(hook).as_fd(), frame, ifindex, repeat).map_err(|error| {
            DatapathError::TestRun {
                program,
                len: frame.len(),
                ifindex,
                error,
            }
        })
    }

    /// Writes the options' conntrack lifetimes and event flags to the config map.
    pub fn write_config(&self) -> Result<(), DatapathError> {
        let config = DatapathConfig {
            event_flags: self.opts.event_flags,
            pad: 0,
            ct: self.opts.ct_timeouts,
        };
        self.maps
            .config
            .lock()
            .set(0, config, 0)
            .map_err(map_err("writing the config to", MAP_CONFIG))
    }

    /// Switches the optional events (`CONFIG_EVENT_*`) to `event_flags`,
    /// keeping the conntrack lifetimes (the config map is the truth; the
    /// options keep what the datapath was opened with).
    pub fn set_event_flags(&self, event_flags: u32) -> Result<(), DatapathError> {
        let mut config = self.maps.config.lock();
        let mut value = config
            .get(&0, 0)
            .map_err(map_err("reading the config from", MAP_CONFIG))?;
        value.event_flags = event_flags;
        config
            .set(0, value, 0)
            .map_err(map_err("writing the config to", MAP_CONFIG))
    }

    /// Attaches `from_container` to tc ingress and `to_container` to tc
    /// egress of interface `ifindex` (in the calling thread's namespace),
    /// adding its clsact qdisc if needed. The filters outlive this process.
    ///
    /// Idempotent: a filter that already runs this instance's program is
    /// left alone; one that runs another instance's (a previous loader's) gets
    /// this one's, atomically. If the second hook fails, a filter this call
    /// created on the first is removed again.
    pub fn attach(&self, ifindex: u32) -> Result<AttachOutcome, DatapathError> {
        let ifname = self
            .ifname(ifindex)?
            .ok_or(DatapathError::InterfaceNotFound { ifindex })?;
        // Both filters first: an endpoint that is already attached (every
        // restore, every regeneration) costs these two requests only.
        let current = [
            self.our_filter(ifindex, Hook::Ingress)?,
            self.our_filter(ifindex, Hook::Egress)?,
        ];
        if current.iter().any(Option::is_none) {
            tc::ensure_clsact(ifindex)
                .map_err(|error| tc_err(format!("adding the clsact qdisc to {ifname}"), ifindex, error))?;
        }
        let [ingress_now, egress_now] = current;
        let ingress = self.attach_hook(ifindex, &ifname, Hook::Ingress, ingress_now)?;
        let egress = match self.attach_hook(ifindex, &ifname, Hook::Egress, egress_now) {
            Ok(change) => change,
            Err(err) => {
                if ingress.is_new() {
                    // Best effort: the error that matters is `err`.
                    let _ = self.detach_hook(ifindex, Hook::Ingress);
                }
                return Err(err);
            }
        };
        Ok(AttachOutcome {
            ifindex,
            ifname,
            ingress,
            egress,
        })
    }

    /// Deletes both filters from `ifindex` (nothing if the interface is
    /// gone: its filters went with it). Idempotent.
    pub fn detach(&self, ifindex: u32) -> Result<DetachOutcome, DatapathError> {
        Ok(DetachOutcome {
            ingress: self.detach_hook(ifindex, Hook::Ingress)?,
            egress: self.detach_hook(ifindex, Hook::Egress)?,
        })
    }

    /// Makes every filter of ours (on any interface of the namespace) run
    /// this instance's programs, replacing the program in place. Runs on
    /// [`open`](Self::open), after moving TCX link pins of an earlier loader
    /// to filters.
    pub fn adopt_existing(&self) -> Result<AdoptReport, DatapathError> {
        let mut report = self.migrate_legacy_links()?;
        for attachment in self.attachments()? {
            for (hook, state) in Hook::ALL.into_iter().zip([attachment.ingress, attachment.egress]) {
                match state {
                    AttachState::Attached { .. } => report.unchanged += 1,
                    AttachState::Stale { .. } => match self.set_filter(attachment.ifindex, hook, true) {
                        Ok(()) => report.updated += 1,
                        // Deleted meanwhile: nothing to adopt.
                        Err(DatapathError::InterfaceNotFound { .. }) => {}
                        Err(err) => return Err(err),
                    },
                    AttachState::Detached | AttachState::InterfaceGone => {}
                }
            }
        }
        Ok(report)
    }

    /// Every interface of the namespace with a filter of ours, with the
    /// state of both hooks, by ifindex (one deleted during the walk is
    /// left out: its filters went with it).
    pub fn attachments(&self) -> Result<Vec<Attachment>, DatapathError> {
        let mut list = Vec::new();
        for ifindex in interfaces()?.into_keys() {
            let attachment = self.attachment(ifindex)?;
            if attachment.has_ours() {
                list.push(attachment);
            }
        }
        Ok(list)
    }

    /// The attach state of one interface (`InterfaceGone` on both hooks if
    /// it does not exist).
    pub fn attachment(&self, ifindex: u32) -> Result<Attachment, DatapathError> {
        let ifname = self.ifname(ifindex)?;
        let mut states = [AttachState::InterfaceGone; 2];
        if ifname.is_some() {
            for (hook, state) in Hook::ALL.into_iter().zip(&mut states) {
                *state = match self.our_filter(ifindex, hook) {
                    Ok(None) => AttachState::Detached,
                    Ok(Some(f)) if f.prog_id == self.program_ids.for_hook(hook) => {
                        AttachState::Attached { prog_id: f.prog_id }
                    }
                    Ok(Some(f)) => AttachState::Stale { prog_id: f.prog_id },
                    Err(DatapathError::InterfaceNotFound { .. }) => AttachState::InterfaceGone,
                    Err(err) => return Err(err),
                };
            }
        }
        Ok(Attachment {
            ifindex,
            ifname: ifname.filter(|_| states != [AttachState::InterfaceGone; 2]),
            ingress: states[0],
            egress: states[1],
        })
    }

    // ------------------------------------------------------------ internals

    fn ifname(&self, ifindex: u32) -> Result<Option<String>, DatapathError> {
        netdev::ifindex_to_name(ifindex).map_err(|error| DatapathError::Netdev { ifindex, error })
    }

    /// Makes `hook` run this instance's program, given the filter on it now.
    fn attach_hook(
        &self,
        ifindex: u32,
        ifname: &str,
        hook: Hook,
        current: Option<tc::BpfFilter>,
    ) -> Result<LinkChange, DatapathError> {
        match current {
            Some(f) if f.prog_id == self.program_ids.for_hook(hook) => Ok(LinkChange::Unchanged),
            Some(f) => {
                self.set_filter(ifindex, hook, true)?;
                Ok(LinkChange::Updated {
                    previous_prog_id: f.prog_id,
                })
            }
            None => {
                self.set_filter(ifindex, hook, false).map_err(|err| match err {
                    DatapathError::Tc { ifindex, error, .. } if error.raw_os_error() == Some(libc::EEXIST) => tc_err(
                        format!(
                            "attaching {} to {hook} of {ifname}: another filter holds priority {} handle {}",
                            hook.program(),
                            tc::FILTER_PRIORITY,
                            tc::FILTER_HANDLE
                        ),
                        ifindex,
                        error,
                    ),
                    other => other,
                })?;
                Ok(LinkChange::Created)
            }
        }
    }

    /// Attaches this instance's program as our filter on `hook`
    /// (`replace`: in place of the existing one).
    fn set_filter(&self, ifindex: u32, hook: Hook, replace: bool) -> Result<(), DatapathError> {
        let name = self.filter_name(hook);
        let fd = self.program_fd(hook);
        tc::attach_bpf(ifindex, hook.direction(), fd.as_fd(), &name, replace).map_err(|error| {
            if error.raw_os_error() == Some(libc::ENODEV) {
                return DatapathError::InterfaceNotFound { ifindex };
            }
            tc_err(format!("attaching {} to {hook}", hook.program()), ifindex, error)
        })
    }

    fn detach_hook(&self, ifindex: u32, hook: Hook) -> Result<bool, DatapathError> {
        match self.our_filter(ifindex, hook) {
            Ok(Some(_)) => {}
            Ok(None) | Err(DatapathError::InterfaceNotFound { .. }) => return Ok(false),
            Err(err) => return Err(err),
        }
        tc::detach_bpf(ifindex, hook.direction()).map_err(|error| {
            tc_err(
                format!("deleting the filter of {} on {hook}", hook.program()),
                ifindex,
                error,
            )
        })
    }

    /// The fd of the program attached at `hook`.
    fn program_fd(&self, hook: Hook) -> &ProgramFd {
        match hook {
            Hook::Ingress => &self.program_fds[0],
            Hook::Egress => &self.program_fds[1],
        }
    }

    /// The name of this node's filter on `hook`: `rivet-<node>-<program>`,
    /// so a loader adopts and deletes only its own node's filters (the pin
    /// directory's last component is the node).
    fn filter_name(&self, hook: Hook) -> String {
        let node = self.opts.pin_dir.file_name().unwrap_or_default().to_string_lossy();
        format!("rivet-{node}-{}", hook.program())
    }

    /// Our filter on `hook` of `ifindex`, if any.
    fn our_filter(&self, ifindex: u32, hook: Hook) -> Result<Option<tc::BpfFilter>, DatapathError> {
        match tc::bpf_filters(ifindex, hook.direction()) {
            Ok(filters) => Ok(filters.into_iter().find(|f| f.is_ours(&self.filter_name(hook)))),
            Err(error) if error.raw_os_error() == Some(libc::ENODEV) => {
                Err(DatapathError::InterfaceNotFound { ifindex })
            }
            Err(error) => Err(tc_err(format!("listing the filters on {hook}"), ifindex, error)),
        }
    }

    /// Moves the TCX links an earlier loader pinned under `links/` to tc
    /// filters: the filter first, then the pin goes (which detaches the
    /// link), so the interface is never without its program. Pins of
    /// interfaces that are gone are removed.
    fn migrate_legacy_links(&self) -> Result<AdoptReport, DatapathError> {
        let mut report = AdoptReport::default();
        let dir = self.opts.legacy_links_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(report),
            Err(err) => return Err(io_err("listing the legacy TCX link pins in", &dir)(err)),
        };
        for entry in entries {
            let entry = entry.map_err(io_err("listing the legacy TCX link pins in", &dir))?;
            let parsed = entry.file_name().to_str().and_then(|name| {
                let (index, hook) = name.split_once('-')?;
                Some((index.parse::<u32>().ok().filter(|i| *i != 0)?, Hook::from_suffix(hook)?))
            });
            let Some((ifindex, hook)) = parsed else {
                report
                    .ignored
                    .push((entry.path(), "not named <ifindex>-ingress|egress".to_owned()));
                continue;
            };
            let exists = self.ifname(ifindex)?.is_some();
            if exists {
                tc::ensure_clsact(ifindex)
                    .map_err(|error| tc_err("adding the clsact qdisc".to_owned(), ifindex, error))?;
                let replace = self.our_filter(ifindex, hook)?.is_some();
                self.set_filter(ifindex, hook, replace)?;
            }
            std::fs::remove_file(entry.path()).map_err(io_err("removing the legacy TCX link pin", &entry.path()))?;
            if exists {
                report.migrated.push((ifindex, hook));
            } else {
                report.removed.push((ifindex, hook));
            }
        }
        if report.ignored.is_empty() {
            // Best effort: an empty directory left behind is harmless.
            let _ = std::fs::remove_dir(&dir);
        }
        report.migrated.sort();
        report.removed.sort();
        Ok(report)
    }
}

fn tc_err(what: String, ifindex: u32, error: io::Error) -> DatapathError {
    DatapathError::Tc { what, ifindex, error }
}

/// The interfaces of the calling thread's network namespace (one link dump).
pub(crate) fn interfaces() -> Result<BTreeMap<u32, String>, DatapathError> {
    netdev::interfaces().map_err(|error| DatapathError::Interfaces { error })
}

fn classifier(ebpf: &mut Ebpf, hook: Hook) -> Result<&mut SchedClassifier, DatapathError> {
    let program = hook.program();
    ebpf.program_mut(program)
        .ok_or_else(|| DatapathError::Object(format!("it has no program {program}")))?
        .try_into()
        .map_err(|error| DatapathError::Program {
            what: "using",
            program,
            error: Box::new(error),
        })
}

/// Fails unless `dir` (or its nearest existing ancestor) is on a bpffs.
fn check_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    let fs_type = sys::fs_type(probe).map_err(io_err("checking the file system of", probe))?;
    if fs_type != BPF_FS_MAGIC {
        return Err(DatapathError::NotBpffs {
            path: probe.to_owned(),
            fs_type,
        });
    }
    Ok(())
}

/// What every pinnable map of the object must be, with the options' sizes.
fn expected_specs(opts: &DatapathOptions) -> Result<BTreeMap<String, MapSpec>, DatapathError> {
    let object = aya_obj::Object::parse(DATAPATH_OBJECT).map_err(|e| DatapathError::Object(e.to_string()))?;
    let mut specs = BTreeMap::new();
    for (name, map) in &object.maps {
        if !matches!(
            map.section_kind(),
            aya_obj::EbpfSectionKind::Maps | aya_obj::EbpfSectionKind::BtfMaps
        ) {
            continue; // .rodata/.data/.bss: per load, never pinned
        }
        let ringbuf = map.map_type() == 27;
        let max_entries = if ringbuf {
            opts.effective_events_bytes()
        } else {
            opts.max_entries()
                .iter()
                .find(|(n, _)| n == name)
                .map_or(map.max_entries(), |(_, max)| *max)
        };
        specs.insert(
            name.clone(),
            MapSpec {
                map_type: map.map_type(),
                key_size: if ringbuf { 0 } else { map.key_size() },
                value_size: if ringbuf { 0 } else { map.value_size() },
                max_entries,
                flags: map.map_flags(),
            },
        );
    }
    for name in MAP_NAMES {
        if !specs.contains_key(name) {
            return Err(DatapathError::Object(format!("it has no map {name}")));
        }
    }
    if [MAP_IPCACHE, MAP_POLICY, MAP_EP_PREFIXES]
        .iter()
        .any(|name| specs[*name].flags & BPF_F_NO_PREALLOC == 0)
    {
        return Err(DatapathError::Object(
            "its LPM tries must be created with BPF_F_NO_PREALLOC".to_owned(),
        ));
    }
    Ok(specs)
}

fn mismatch_fix(pin: &Path, found: &MapSpec, expected: &MapSpec) -> String {
    let mut fix = format!(
        "stop every node daemon using it (svc-loader, svc-gc), remove {} \
         (this flushes the map: its entries are lost), and start svc-loader again",
        pin.display()
    );
    let same_but_size = MapSpec {
        max_entries: expected.max_entries,
        ..*found
    } == *expected;
    if same_but_size {
        fix.push_str(&format!(
            "; or keep the map by configuring its current size ({})",
            found.max_entries
        ));
    }
    fix
}

/// Checks an existing map pin against `expected`; a missing pin is fine
/// (aya creates and pins the map). Never modifies the pin.
fn check_map_pin(name: &str, pin: &Path, expected: &MapSpec) -> Result<(), DatapathError> {
    let not_a_map = |found: String| DatapathError::PinNotAMap {
        map: name.to_owned(),
        pin: pin.to_owned(),
        found,
        fix: format!(
            "stop every node daemon, move {} away, and start svc-loader again",
            pin.display()
        ),
    };
    match std::fs::symlink_metadata(pin) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => {
            return Err(DatapathError::Pin {
                what: format!("inspecting the pin of map {name} at"),
                pin: pin.to_owned(),
                error,
            });
        }
        Ok(meta) if meta.is_dir() => return Err(not_a_map("a directory".to_owned())),
        Ok(_) => {}
    }
    let fd = sys::obj_get(pin).map_err(|error| DatapathError::Pin {
        what: format!("opening the pinned map {name} at"),
        pin: pin.to_owned(),
        error,
    })?;
    match sys::obj_kind(fd.as_fd()) {
        sys::ObjKind::Map | sys::ObjKind::Unknown => {}
        other => return Err(not_a_map(other.to_string())),
    }
    let found = sys::map_info(fd.as_fd())
        .map(MapSpec::from)
        .map_err(|error| DatapathError::Pin {
            what: format!("reading the pinned map {name} at"),
            pin: pin.to_owned(),
            error,
        })?;
    if found != *expected {
        return Err(DatapathError::PinMismatch {
            map: name.to_owned(),
            pin: pin.to_owned(),
            found,
            expected: *expected,
            fix: mismatch_fix(pin, &found, expected),
        });
    }
    Ok(())
}

/// Opens one pinned map of a running datapath for another process (svc-gc,
/// inspection), checking its type and key and value sizes against the
/// embedded object (not its size, which is the loader's option).
pub fn open_pinned_map(pin_dir: &Path, name: &str) -> Result<Map, DatapathError> {
    let opts = DatapathOptions::new(pin_dir);
    let specs = expected_specs(&opts)?;
    let expected = specs
        .get(name)
        .ok_or_else(|| DatapathError::InvalidOptions(format!("the datapath has no map {name}")))?;
    let pin = pin_dir.join(name);
    let fd = sys::obj_get(&pin).map_err(|error| DatapathError::Pin {
        what: format!("opening the pinned map {name} at"),
        pin: pin.clone(),
        error,
    })?;
    let found = sys::map_info(fd.as_fd())
        .map(MapSpec::from)
        .map_err(|error| DatapathError::Pin {
            what: format!("reading the pinned map {name} at"),
            pin: pin.clone(),
            error,
        })?;
    let expected = MapSpec {
        max_entries: found.max_entries,
        ..*expected
    };
    if found != expected {
        return Err(DatapathError::PinMismatch {
            map: name.to_owned(),
            pin: pin.clone(),
            found,
            expected,
            fix: "use the rivet binaries of the svc-loader that created the map".to_owned(),
        });
    }
    let data = MapData::from_fd(fd).map_err(|error| DatapathError::Pin {
        what: format!("using the pinned map {name} at"),
        pin: pin.clone(),
        error: io::Error::other(chain(&error).to_string()),
    })?;
    Map::from_map_data(data).map_err(|error| DatapathError::Pin {
        what: format!("using the pinned map {name} at"),
        pin,
        error: io::Error::other(chain(&error).to_string()),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::IpAddr;
    use std::sync::atomic::{AtomicU32, Ordering};

    use aya::maps::IterableMap as _;
    use rivet_common::testing::netns::{NetNs, veth_pair};

    use super::*;
    use rivet_datapath::maps::{IpcacheKey, PolicyKey, VERDICT_ALLOW};

    static PIN_DIRS: AtomicU32 = AtomicU32::new(0);

    /// A unique pin directory under /sys/fs/bpf/rivet-test, removed (with
    /// every pin in it, which also frees pinned links) on drop.
    pub(crate) struct PinDir(PathBuf);

    impl PinDir {
        pub(crate) fn new(tag: &str) -> Self {
            let bpffs = Path::new(DEFAULT_BPFFS);
            let fs = sys::fs_type(bpffs).unwrap_or(0);
            assert_eq!(
                fs, BPF_FS_MAGIC,
                "no BPF filesystem at {DEFAULT_BPFFS}: these tests need bpffs (`mount -t bpf bpf /sys/fs/bpf`) \
                 and root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)"
            );
            let n = PIN_DIRS.fetch_add(1, Ordering::Relaxed);
            let dir = bpffs
                .join("rivet-test")
                .join(format!("{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir); // a leftover of a crashed run with the same pid
            Self(dir)
        }

        pub(crate) fn opts(&self) -> DatapathOptions {
            test_opts(&self.0)
        }
    }

    /// Small maps and short lifetimes: tests open many datapaths.
    pub(crate) fn test_opts(pin_dir: &Path) -> DatapathOptions {
        DatapathOptions {
            endpoints_max: 1024,
            ipcache_max: 1024,
            policy_max: 4096,
            ct4_max: 4096,
            ct6_max: 2048,
            events_bytes: 64 * 1024,
            ct_timeouts: CtTimeouts {
                tcp_syn: 5,
                tcp_established: 30,
                tcp_closing: 2,
                udp: 7,
                icmp: 3,
                other: 4,
            },
            ..DatapathOptions::new(pin_dir)
        }
    }

    impl Drop for PinDir {
        fn drop(&mut self) {
            if let Err(err) = std::fs::remove_dir_all(&self.0)
                && err.kind() != io::ErrorKind::NotFound
            {
                eprintln!("could not remove test pin directory {}: {err}", self.0.display());
            }
        }
    }

    /// Program ids of the bpf filters on a hook of `ifname`, as the kernel
    /// lists them (call inside the namespace).
    fn filter_ids(ifname: &str, hook: Hook) -> Vec<u32> {
        let ifindex = netdev::name_to_ifindex(ifname).unwrap().unwrap();
        tc::bpf_filters(ifindex, hook.direction())
            .unwrap()
            .iter()
            .map(|f| f.prog_id)
            .collect()
    }

    fn both(ids: ProgramIds) -> (Vec<u32>, Vec<u32>) {
        (vec![ids.from_container], vec![ids.to_container])
    }

    fn attached(ifname: &str) -> (Vec<u32>, Vec<u32>) {
        (filter_ids(ifname, Hook::Ingress), filter_ids(ifname, Hook::Egress))
    }

    #[test]
    fn datapath_is_send() {
        fn is_send<T: Send>() {}
        is_send::<Datapath>();
        is_send::<DatapathError>();
    }

    #[test]
    fn options_defaults_and_validation() {
        let opts = DatapathOptions::for_node(DEFAULT_BPFFS, "node-1").unwrap();
        assert_eq!(opts.pin_dir, Path::new("/sys/fs/bpf/rivet/node-1"));
        assert_eq!(opts.legacy_links_dir(), Path::new("/sys/fs/bpf/rivet/node-1/links"));
        assert_eq!((opts.ct4_max, opts.ct6_max), (786_432, 786_432));
        assert_eq!(
            (opts.endpoints_max, opts.ipcache_max, opts.policy_max),
            (65_536, 524_288, 1_048_576)
        );
        assert_eq!(opts.effective_events_bytes(), 1 << 20);
        for bad in ["", ".", "..", "a/b"] {
            assert!(DatapathOptions::for_node(DEFAULT_BPFFS, bad).is_err(), "{bad:?}");
        }
        let odd = DatapathOptions {
            events_bytes: 5000,
            ..opts.clone()
        };
        assert_eq!(odd.effective_events_bytes(), 2 * page_size());

        let err = Datapath::open(DatapathOptions {
            ct4_max: 0,
            ..opts.clone()
        })
        .unwrap_err();
        assert!(err.to_string().contains("ct4"), "{err}");
        let err = Datapath::open(DatapathOptions::new("relative/dir")).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
        let tmp = tempfile::tempdir().unwrap();
        let err = Datapath::open(DatapathOptions::new(tmp.path().join("pins"))).unwrap_err();
        assert!(matches!(err, DatapathError::NotBpffs { .. }), "{err}");
        assert!(err.to_string().contains("mount -t bpf"), "{err}");
    }

    #[test]
    fn open_twice_reuses_the_pinned_maps() {
        let dir = PinDir::new("reuse");
        let first = Datapath::open(dir.opts()).unwrap();
        for name in MAP_NAMES {
            assert!(dir.0.join(name).exists(), "map {name} is pinned");
        }
        let key = EndpointKey::ifindex(42);
        let mut info = EndpointInfo {
            endpoint_id: 7,
            identity: 300,
            ifindex: 42,
            mac: [2, 0, 0, 0, 0, 1],
            policy_revision: 3,
            ..EndpointInfo::default()
        };
        info.set_ipv4(Some("198.18.0.2".parse().unwrap()));
        first.maps().endpoints.lock().insert(key, info, 0).unwrap();
        let prefix = IpcacheKey::new("198.18.0.0".parse().unwrap(), 24).unwrap();
        first
            .maps()
            .ipcache
            .lock()
            .insert(&prefix.to_lpm(), IpcacheValue::new(300, None), 0)
            .unwrap();
        let rule = PolicyKey::new(7, 300, rivet_datapath::maps::DIR_INGRESS, 6, 80, 16);
        first
            .maps()
            .policy
            .lock()
            .insert(&rule.to_lpm(), PolicyValue::new(VERDICT_ALLOW), 0)
            .unwrap();

        let second = Datapath::open(dir.opts()).unwrap();
        assert_eq!(second.maps().endpoints.lock().get(&key, 0).unwrap(), info);
        // A longest-prefix lookup of an address inside the prefix.
        let ip: IpAddr = "198.18.0.77".parse().unwrap();
        let found = second
            .maps()
            .ipcache
            .lock()
            .get(&IpcacheKey::lookup(ip).to_lpm(), 0)
            .unwrap();
        assert_eq!(found.identity, 300);
        let hit = PolicyKey::lookup(7, 300, rivet_datapath::maps::DIR_INGRESS, 6, 80);
        assert_eq!(
            second.maps().policy.lock().get(&hit.to_lpm(), 0).unwrap().verdict,
            VERDICT_ALLOW
        );
        // The very same kernel maps, different program instances.
        let id = |dp: &Datapath| dp.maps().endpoints.lock().map().info().unwrap().id();
        assert_eq!(id(&first), id(&second));
        assert_ne!(first.program_ids(), second.program_ids());
        // The config map got the options' lifetimes.
        let config = second.maps().config.lock().get(&0, 0).unwrap();
        assert_eq!(config.ct, dir.opts().ct_timeouts);
        assert!(second.metrics_totals().unwrap().is_empty());

        drop(first);
        drop(second);
        // Pins outlive the loader; another process can open one.
        let ct4 = open_pinned_map(&dir.0, MAP_CT4).unwrap();
        aya::maps::HashMap::<_, Ct4Key, CtEntry>::try_from(ct4).unwrap();
        let endpoints = open_pinned_map(&dir.0, MAP_ENDPOINTS).unwrap();
        let endpoints = aya::maps::HashMap::<_, EndpointKey, EndpointInfo>::try_from(endpoints).unwrap();
        assert_eq!(endpoints.get(&key, 0).unwrap(), info);
        assert!(open_pinned_map(&dir.0, "nope").is_err());
    }

    #[test]
    fn mismatching_pins_are_refused_and_left_alone() {
        let dir = PinDir::new("mismatch");
        std::fs::create_dir_all(&dir.0).unwrap();
        let ct4 = dir.0.join(MAP_CT4);
        let wrong = aya::maps::HashMap::<MapData, u32, u32>::create(16, 0).unwrap();
        wrong.pin(&ct4).unwrap();

        let err = Datapath::open(dir.opts()).unwrap_err();
        let text = err.to_string();
        match &err {
            DatapathError::PinMismatch {
                map,
                pin,
                found,
                expected,
                ..
            } => {
                assert_eq!(map, MAP_CT4);
                assert_eq!(pin, &ct4);
                assert_eq!((found.key_size, found.value_size, found.max_entries), (4, 4, 16));
                assert_eq!((expected.key_size, expected.value_size), (16, 56));
            }
            other => panic!("expected PinMismatch, got {other}"),
        }
        assert!(
            text.contains("map `ct4`") && text.contains(&ct4.display().to_string()),
            "{text}"
        );
        assert!(
            text.contains("remove") && text.contains("stop every node daemon"),
            "{text}"
        );
        // Never deleted or replaced.
        assert_eq!(sys::map_info(sys::obj_get(&ct4).unwrap().as_fd()).unwrap().key_size, 4);

        // Without it, the map is created; then a different size is refused.
        std::fs::remove_file(&ct4).unwrap();
        drop(Datapath::open(dir.opts()).unwrap());
        let bigger = DatapathOptions {
            ct4_max: 8192,
            ..dir.opts()
        };
        let err = Datapath::open(bigger).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, DatapathError::PinMismatch { map, .. } if map == MAP_CT4),
            "{text}"
        );
        assert!(
            text.contains("max_entries 4096") && text.contains("max_entries 8192"),
            "{text}"
        );
        assert!(text.contains("current size (4096)"), "{text}");

        // Something that is not a map where a map belongs.
        let ct6 = dir.0.join(MAP_CT6);
        std::fs::remove_file(&ct6).unwrap();
        std::fs::create_dir(&ct6).unwrap();
        let err = Datapath::open(dir.opts()).unwrap_err();
        assert!(
            matches!(&err, DatapathError::PinNotAMap { map, .. } if map == MAP_CT6),
            "{err}"
        );
        assert!(err.to_string().contains("a directory"), "{err}");
    }

    #[test]
    fn attachments_survive_the_loader_and_are_adopted() {
        let ns = NetNs::new("rvtdp").unwrap();
        veth_pair(&ns, "rvdp0", &ns, "rvdp0p").unwrap();
        let ifindex = ns.ifindex("rvdp0").unwrap();
        let dir = PinDir::new("attach");
        let opts = dir.opts();
        ns.in_ns(move || {
            let dp = Datapath::open(opts.clone()).unwrap();
            assert_eq!(dp.adoption(), &AdoptReport::default());
            let out = dp.attach(ifindex).unwrap();
            assert_eq!((out.ingress, out.egress), (LinkChange::Created, LinkChange::Created));
            assert_eq!(out.ifname, "rvdp0");
            // Idempotent.
            let again = dp.attach(ifindex).unwrap();
            assert!(!again.changed(), "{again:?}");
            let first = dp.program_ids();
            assert_eq!(attached("rvdp0"), both(first));
            let list = dp.attachments().unwrap();
            assert_eq!(list.len(), 1);
            assert_eq!(list[0].ifname.as_deref(), Some("rvdp0"));
            assert!(matches!(list[0].ingress, AttachState::Attached { prog_id, .. } if prog_id == first.from_container));
            assert!(matches!(list[0].egress, AttachState::Attached { prog_id, .. } if prog_id == first.to_container));

            // The loader goes away: the programs stay attached.
            drop(dp);
            assert_eq!(attached("rvdp0"), both(first), "attachments survive the loader");

            // A new loader adopts them: same filters, its own programs.
            let dp = Datapath::open(opts.clone()).unwrap();
            let report = dp.adoption().clone();
            assert_eq!((report.updated, report.unchanged, report.migrated.len()), (2, 0, 0));
            let second = dp.program_ids();
            assert_ne!(second, first);
            assert_eq!(attached("rvdp0"), both(second), "one program per hook, the new one");
            assert!(!dp.attach(ifindex).unwrap().changed());

            // Another instance adopts them in turn: for this one they are stale.
            let third = Datapath::open(opts.clone()).unwrap();
            let state = dp.attachment(ifindex).unwrap();
            assert!(
                matches!(state.ingress, AttachState::Stale { prog_id, .. } if prog_id == third.program_ids().from_container),
                "{state:?}"
            );
            let out = dp.attach(ifindex).unwrap();
            assert_eq!(
                out.ingress,
                LinkChange::Updated {
                    previous_prog_id: third.program_ids().from_container
                }
            );
            assert_eq!(attached("rvdp0"), both(second));
            drop(third);

            // Detach removes both; twice is fine.
            let out = dp.detach(ifindex).unwrap();
            assert!(out.ingress && out.egress, "{out:?}");
            assert_eq!(attached("rvdp0"), (vec![], vec![]));
            assert!(dp.attachments().unwrap().is_empty());
            assert!(!dp.detach(ifindex).unwrap().changed());
        })
        .unwrap();
    }

    #[test]
    fn attaching_to_a_missing_interface_is_a_clear_error() {
        let ns = NetNs::new("rvtdm").unwrap();
        veth_pair(&ns, "rvdm0", &ns, "rvdm0p").unwrap();
        let ifindex = ns.ifindex("rvdm0").unwrap();
        ns.ip(&["link", "del", "rvdm0"]).unwrap();
        let dir = PinDir::new("missing");
        let opts = dir.opts();
        ns.in_ns(move || {
            let dp = Datapath::open(opts).unwrap();
            let err = dp.attach(ifindex).unwrap_err();
            assert!(
                matches!(err, DatapathError::InterfaceNotFound { ifindex: i } if i == ifindex),
                "{err}"
            );
            assert!(err.to_string().contains(&format!("ifindex {ifindex}")), "{err}");
            assert!(!dp.detach(ifindex).unwrap().changed());
        })
        .unwrap();
        // The loader's namespace matters: the interface of another namespace is not found.
        let ns2 = NetNs::new("rvtdm").unwrap();
        veth_pair(&ns2, "rvdm1", &ns2, "rvdm1p").unwrap();
        let elsewhere = ns2.ifindex("rvdm1").unwrap();
        let opts = dir.opts();
        ns.in_ns(move || {
            let dp = Datapath::open(opts).unwrap();
            if netdev::ifindex_to_name(elsewhere).unwrap().is_none() {
                assert!(matches!(
                    dp.attach(elsewhere),
                    Err(DatapathError::InterfaceNotFound { .. })
                ));
            }
        })
        .unwrap();
    }

    #[test]
    fn deleted_interfaces_take_their_filters_and_foreign_filters_are_left_alone() {
        let ns = NetNs::new("rvtdd").unwrap();
        veth_pair(&ns, "rvdd0", &ns, "rvdd0p").unwrap();
        veth_pair(&ns, "rvdd1", &ns, "rvdd1p").unwrap();
        let gone = ns.ifindex("rvdd0").unwrap();
        let other = ns.ifindex("rvdd1").unwrap();
        let dir = PinDir::new("defunct");
        let opts = dir.opts();
        let dp = ns
            .in_ns(move || {
                let dp = Datapath::open(opts).unwrap();
                assert!(dp.attach(gone).unwrap().changed());
                dp
            })
            .unwrap();
        ns.ip(&["link", "del", "rvdd0"]).unwrap();
        // Someone else's filter at our priority and handle, under another name.
        ns.ip(&["link", "set", "rvdd1", "up"]).unwrap();
        let dp = ns
            .in_ns(move || {
                let state = dp.attachment(gone).unwrap();
                assert_eq!(
                    (state.ingress, state.egress, state.ifname.as_deref()),
                    (AttachState::InterfaceGone, AttachState::InterfaceGone, None),
                    "the interface and its filters are gone"
                );
                assert!(dp.attachments().unwrap().is_empty(), "nothing of ours is left");
                let mut dp = dp;
                assert!(
                    !dp.detach(gone).unwrap().changed(),
                    "detaching a gone interface is a no-op"
                );

                tc::ensure_clsact(other).unwrap();
                let prog = classifier(&mut dp.ebpf, Hook::Egress).unwrap();
                let fd = prog.fd().unwrap().as_fd().try_clone_to_owned().unwrap();
                tc::attach_bpf(other, tc::Direction::Ingress, fd.as_fd(), "someone_else", false).unwrap();
                let err = dp.attach(other).unwrap_err();
                assert!(
                    err.to_string().contains("another filter holds priority 1 handle 1"),
                    "a foreign filter is not overwritten: {err}"
                );
                assert_eq!(
                    attached("rvdd1"),
                    (vec![dp.program_ids().to_container], vec![]),
                    "the failed attach left the foreign filter and nothing else"
                );
                assert!(dp.attachments().unwrap().is_empty(), "a foreign filter is not ours");
                assert!(
                    !dp.detach(other).unwrap().changed(),
                    "a foreign filter is never deleted"
                );
                assert_eq!(attached("rvdd1").0.len(), 1);
                dp
            })
            .unwrap();
        let report = dp.adopt_existing().unwrap();
        assert_eq!((report.updated, report.unchanged), (0, 0), "{report:?}");
    }

    #[test]
    fn a_loader_of_another_node_in_the_same_namespace_leaves_our_filters_alone() {
        let ns = NetNs::new("rvtdo").unwrap();
        veth_pair(&ns, "rvdo0", &ns, "rvdo0p").unwrap();
        let ifindex = ns.ifindex("rvdo0").unwrap();
        let (mine, theirs) = (PinDir::new("mine"), PinDir::new("theirs"));
        let (mine, theirs) = (mine.opts(), theirs.opts());
        ns.in_ns(move || {
            let dp = Datapath::open(mine).unwrap();
            dp.attach(ifindex).unwrap();
            let other = Datapath::open(theirs).unwrap();
            assert_eq!(
                (other.adoption().updated, other.adoption().unchanged),
                (0, 0),
                "another node's loader adopts nothing of ours"
            );
            assert!(other.attachments().unwrap().is_empty(), "our filters are not theirs");
            assert!(!other.detach(ifindex).unwrap().changed(), "and it cannot detach them");
            assert_eq!(attached("rvdo0"), both(dp.program_ids()));
        })
        .unwrap();
    }

    #[test]
    fn tcx_link_pins_of_an_earlier_loader_become_filters() {
        use aya::programs::links::FdLink;
        use aya::programs::tc::TcAttachOptions;
        use aya::programs::{LinkOrder, TcAttachType};

        let ns = NetNs::new("rvtdl").unwrap();
        veth_pair(&ns, "rvdl0", &ns, "rvdl0p").unwrap();
        let ifindex = ns.ifindex("rvdl0").unwrap();
        let dir = PinDir::new("legacy");
        let opts = dir.opts();
        ns.in_ns(move || {
            // What the loader before tc did: TCX links pinned under links/.
            let mut old = Datapath::open(opts.clone()).unwrap();
            let links = opts.legacy_links_dir();
            std::fs::create_dir_all(&links).unwrap();
            for (hook, ty) in [
                (Hook::Ingress, TcAttachType::Ingress),
                (Hook::Egress, TcAttachType::Egress),
            ] {
                let prog = classifier(&mut old.ebpf, hook).unwrap();
                let id = prog
                    .attach_with_options("rvdl0", ty, TcAttachOptions::TcxOrder(LinkOrder::default()))
                    .unwrap();
                let link = FdLink::try_from(prog.take_link(id).unwrap()).unwrap();
                drop(link.pin(links.join(format!("{ifindex}-{}", hook.as_str()))).unwrap());
            }
            std::fs::create_dir(links.join("junk")).unwrap();
            drop(old);

            let dp = Datapath::open(opts.clone()).unwrap();
            let report = dp.adoption().clone();
            assert_eq!(
                report.migrated,
                vec![(ifindex, Hook::Ingress), (ifindex, Hook::Egress)],
                "{report:?}"
            );
            assert_eq!(report.ignored.len(), 1, "a stranger is reported: {report:?}");
            assert_eq!(
                attached("rvdl0"),
                both(dp.program_ids()),
                "the filters run the new programs"
            );
            // The kernel releases an unpinned link from a work queue: a moment later.
            let tcx = || {
                let count = |ty| SchedClassifier::query_tcx("rvdl0", ty).unwrap().1.len();
                (count(TcAttachType::Ingress), count(TcAttachType::Egress))
            };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while tcx() != (0, 0) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert_eq!(tcx(), (0, 0), "the TCX links are gone with their pins");
            assert!(!links.join(format!("{ifindex}-ingress")).exists());
            assert!(links.join("junk").exists(), "a stranger is left alone");
        })
        .unwrap();
    }

    /// Set for the child process of [`attachments_survive_kill_9`]:
    /// `<netns path>|<pin dir>|<ifindex>`.
    const CHILD_ENV: &str = "RIVET_DATAPATH_TEST_CHILD";

    /// The child role of [`attachments_survive_kill_9`] (the same test,
    /// re-executed with [`CHILD_ENV`] set): attaches, prints the program ids
    /// and SIGKILLs itself, so no destructor of aya or ours runs.
    fn attach_then_die_by_sigkill(spec: &str) -> ! {
        use std::io::Write as _;
        use std::os::fd::AsRawFd as _;

        let parts: Vec<&str> = spec.split('|').collect();
        let (ns_path, pin_dir, ifindex) = (parts[0], Path::new(parts[1]), parts[2].parse::<u32>().unwrap());
        let ns = std::fs::File::open(ns_path).unwrap();
        // SAFETY: setns on this thread, with a valid namespace fd.
        assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
        let dp = Datapath::open(test_opts(pin_dir)).unwrap();
        assert!(dp.attach(ifindex).unwrap().changed());
        let ids = dp.program_ids();
        println!("PROGRAM_IDS {} {}", ids.from_container, ids.to_container);
        std::io::stdout().flush().unwrap();
        // SAFETY: kill(2) on ourselves.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!("SIGKILL");
    }

    #[test]
    fn attachments_survive_kill_9() {
        use std::os::unix::process::ExitStatusExt as _;

        if let Ok(spec) = std::env::var(CHILD_ENV) {
            attach_then_die_by_sigkill(&spec);
        }
        let ns = NetNs::new("rvtdk").unwrap();
        veth_pair(&ns, "rvdk0", &ns, "rvdk0p").unwrap();
        let ifindex = ns.ifindex("rvdk0").unwrap();
        let dir = PinDir::new("kill9");
        let spec = format!("{}|{}|{ifindex}", ns.path().display(), dir.0.display());
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "datapath::tests::attachments_survive_kill_9"])
            .args(["--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, spec)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGKILL),
            "the child should have killed itself\nstdout:\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ids: Vec<u32> = stdout
            .lines()
            .find_map(|line| line.split("PROGRAM_IDS ").nth(1)) // after the harness's "test … "
            .unwrap_or_else(|| panic!("no program ids in {stdout}"))
            .split_whitespace()
            .map(|id| id.parse().unwrap())
            .collect();
        let opts = dir.opts();
        ns.in_ns(move || {
            assert_eq!(
                attached("rvdk0"),
                (vec![ids[0]], vec![ids[1]]),
                "still attached after kill -9"
            );
            let dp = Datapath::open(opts).unwrap();
            assert_eq!(dp.adoption().updated, 2, "the new loader adopts both filters");
            assert_eq!(attached("rvdk0"), both(dp.program_ids()));
        })
        .unwrap();
    }
}

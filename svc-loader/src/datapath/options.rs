//! Where the datapath's pins live and how big its maps are.

use std::path::{Path, PathBuf};

use rivet_datapath::maps::CtTimeouts;

use super::error::DatapathError;
use super::legacy::LEGACY_LINKS_DIR;
use super::pins::{MAP_CT4, MAP_CT6, MAP_ENDPOINTS, MAP_EP_PREFIXES, MAP_EVENTS, MAP_IPCACHE, MAP_POLICY};

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

    pub(super) fn max_entries(&self) -> [(&'static str, u32); 7] {
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

    pub(super) fn validate(&self) -> Result<(), DatapathError> {
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

pub(super) fn page_size() -> u32 {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

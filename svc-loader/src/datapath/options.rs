//! Where the datapath's pins live and how big its maps are.

use std::path::{Path, PathBuf};

use rivet_datapath::maps::CtTimeouts;
use rivet_datapath::spec::{
    self, MAP_CT4, MAP_CT6, MAP_ENDPOINTS, MAP_EP_PREFIXES, MAP_EVENTS, MAP_IPCACHE, MAP_LB_FRONTENDS, MAP_LB_MAGLEV,
    MAP_LB_REV_NAT, MAP_LB_SERVICES, MAP_LB_SVC_BACKENDS, MAP_LB4_FLOWS, MAP_LB6_FLOWS, MAP_POLICY,
};

use super::error::{DatapathError, OptionsError};
use super::legacy::LEGACY_LINKS_DIR;

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
    /// max_entries of `lb4_flows` and of `lb6_flows` (two per connection to a service).
    pub lb_flows_max: u32,
    /// max_entries of the per-service maps: `lb_services`, `lb_rev_nat`,
    /// `lb_maglev` and `lb_frontends` (the services a node can hold);
    /// `lb_svc_backends` gets [`spec::LB_SVC_BACKENDS_PER_SERVICE`] times it.
    pub lb_services_max: u32,
    /// Size of the `events` ring buffer in bytes (rounded up to a power-of-two
    /// number of pages, as the kernel requires).
    pub events_bytes: u32,
    /// Conntrack lifetimes, written to the config map on open.
    pub ct_timeouts: CtTimeouts,
    /// `CONFIG_EVENT_*`, written to the config map on open.
    pub event_flags: u32,
}

impl DatapathOptions {
    /// The datapath ABI's default sizes (Cilium-like, [`rivet_datapath::spec`])
    /// and lifetimes ([`CtTimeouts::DEFAULT`]) with the pins in `pin_dir`.
    pub fn new(pin_dir: impl Into<PathBuf>) -> Self {
        Self {
            pin_dir: pin_dir.into(),
            endpoints_max: spec::ENDPOINTS.default_max_entries,
            ipcache_max: spec::IPCACHE.default_max_entries,
            policy_max: spec::POLICY.default_max_entries,
            ep_prefixes_max: spec::EP_PREFIXES.default_max_entries,
            ct4_max: spec::CT4.default_max_entries,
            ct6_max: spec::CT6.default_max_entries,
            lb_flows_max: spec::LB4_FLOWS.default_max_entries,
            lb_services_max: spec::LB_SERVICES.default_max_entries,
            events_bytes: spec::EVENTS.default_max_entries,
            ct_timeouts: CtTimeouts::DEFAULT,
            event_flags: 0,
        }
    }

    /// Defaults with the pins in `<bpffs>/rivet/<node>`
    /// ([`rivet_datapath::pin_dir`]). The node name must be one path
    /// component (no `/`, not `.` or `..`).
    pub fn for_node(bpffs: impl AsRef<Path>, node: &str) -> Result<Self, DatapathError> {
        Ok(Self::new(rivet_datapath::pin_dir(bpffs, node)?))
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

    pub(super) fn max_entries(&self) -> [(&'static str, u32); 14] {
        [
            (MAP_ENDPOINTS, self.endpoints_max),
            (MAP_IPCACHE, self.ipcache_max),
            (MAP_POLICY, self.policy_max),
            (MAP_EP_PREFIXES, self.ep_prefixes_max),
            (MAP_CT4, self.ct4_max),
            (MAP_CT6, self.ct6_max),
            (MAP_LB4_FLOWS, self.lb_flows_max),
            (MAP_LB6_FLOWS, self.lb_flows_max),
            (MAP_LB_SERVICES, self.lb_services_max),
            (
                MAP_LB_SVC_BACKENDS,
                self.lb_services_max.saturating_mul(spec::LB_SVC_BACKENDS_PER_SERVICE),
            ),
            (MAP_LB_REV_NAT, self.lb_services_max),
            (MAP_LB_MAGLEV, self.lb_services_max),
            (MAP_LB_FRONTENDS, self.lb_services_max),
            (MAP_EVENTS, self.events_bytes),
        ]
    }

    pub(super) fn validate(&self) -> Result<(), OptionsError> {
        if !self.pin_dir.is_absolute() {
            return Err(OptionsError::RelativePinDir {
                pin_dir: self.pin_dir.clone(),
            });
        }
        if let Some((map, _)) = self.max_entries().into_iter().find(|(_, n)| *n == 0) {
            return Err(OptionsError::ZeroSize { map });
        }
        if self.events_bytes > 1 << 30 {
            return Err(OptionsError::EventsTooBig {
                bytes: self.events_bytes,
            });
        }
        Ok(())
    }
}

pub(super) fn page_size() -> u32 {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

//! The typed handles of the datapath's maps, shared by the loader's threads.

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use aya::Ebpf;
use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray};
use rivet_datapath::maps::{
    Ct4Key, Ct6Key, CtEntry, DatapathConfig, EndpointInfo, EndpointKey, EpPrefixKeyData, EpPrefixValue, FragKey,
    FragValue, IpcacheKeyData, IpcacheValue, LbAffinity, LbAffinityKey, LbBackend, LbFlow, LbFrontend, LbFrontendKey,
    LbMaglevTable, LbRevNat, LbService, LbServiceBackend, LbSvcBackendKey, MetricsValue, PolicyKeyData, PolicyValue,
    RoutingConfig,
};

use super::error::{DatapathError, ObjectError, map_err};
use rivet_datapath::spec::{
    MAP_CONFIG, MAP_CT4, MAP_CT6, MAP_ENDPOINTS, MAP_EP_PREFIXES, MAP_FRAGMENTS, MAP_IPCACHE, MAP_LB_AFFINITY,
    MAP_LB_BACKENDS, MAP_LB_FRONTENDS, MAP_LB_MAGLEV, MAP_LB_REV_NAT, MAP_LB_SERVICES, MAP_LB_SVC_BACKENDS,
    MAP_LB4_FLOWS, MAP_LB6_FLOWS, MAP_METRICS, MAP_POLICY, MAP_ROUTING,
};

/// One map of the datapath, shared by the loader's threads. aya's writes
/// take `&mut`, so each map has its own lock; every kernel command is atomic
/// by itself, so the lock is held for one command (or one short scan), never
/// across netlink, and writers of different maps never wait for each other.
pub struct SharedMap<T>(Mutex<T>);

impl<T> SharedMap<T> {
    pub(super) fn new(map: T) -> Self {
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
    /// The routing mode and tunnel device (index 0).
    pub routing: SharedMap<Array<MapData, RoutingConfig>>,
    /// Service frontends.
    pub lb_frontends: SharedMap<HashMap<MapData, LbFrontendKey, LbFrontend>>,
    /// Service backends by backend id.
    pub lb_backends: SharedMap<HashMap<MapData, u32, LbBackend>>,
    /// Maglev tables by table id.
    pub lb_maglev: SharedMap<HashMap<MapData, u32, LbMaglevTable>>,
    /// Reverse NAT by service id.
    pub lb_rev_nat: SharedMap<HashMap<MapData, u32, LbRevNat>>,
    /// svc-loader's service records by service id.
    pub lb_services: SharedMap<HashMap<MapData, u32, LbService>>,
    /// svc-loader's lists of each service's backends.
    pub lb_svc_backends: SharedMap<HashMap<MapData, LbSvcBackendKey, LbServiceBackend>>,
    /// Session affinity (an LRU hash the datapath writes).
    pub lb_affinity: SharedMap<HashMap<MapData, LbAffinityKey, LbAffinity>>,
    /// Translated IPv4 flows (an LRU hash the datapath writes).
    pub lb4_flows: SharedMap<HashMap<MapData, Ct4Key, LbFlow>>,
    /// Translated IPv6 flows.
    pub lb6_flows: SharedMap<HashMap<MapData, Ct6Key, LbFlow>>,
}

impl fmt::Debug for DatapathMaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // aya's array types have no Debug; the names are what matters.
        f.debug_struct("DatapathMaps").finish_non_exhaustive()
    }
}

pub(super) fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(ObjectError::MissingMap(name))?;
    T::try_from(map).map_err(map_err("using", name))
}

pub(super) fn take_shared<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<SharedMap<T>, DatapathError>
where
    T: TryFrom<Map, Error = MapError>,
{
    take_map(ebpf, name).map(SharedMap::new)
}

impl DatapathMaps {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
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
            routing: take_shared(ebpf, MAP_ROUTING)?,
            lb_frontends: take_shared(ebpf, MAP_LB_FRONTENDS)?,
            lb_backends: take_shared(ebpf, MAP_LB_BACKENDS)?,
            lb_maglev: take_shared(ebpf, MAP_LB_MAGLEV)?,
            lb_rev_nat: take_shared(ebpf, MAP_LB_REV_NAT)?,
            lb_services: take_shared(ebpf, MAP_LB_SERVICES)?,
            lb_svc_backends: take_shared(ebpf, MAP_LB_SVC_BACKENDS)?,
            lb_affinity: take_shared(ebpf, MAP_LB_AFFINITY)?,
            lb4_flows: take_shared(ebpf, MAP_LB4_FLOWS)?,
            lb6_flows: take_shared(ebpf, MAP_LB6_FLOWS)?,
        })
    }
}

//! The datapath's maps as the kernel holds them: their names (also their
//! pin names), types, key and value sizes, flags and default sizes. One
//! [`MapDef`] per map of `svc-loader/bpf/datapath.c`; svc-loader's tests
//! check the compiled object against [`ALL`], so a map added there fails
//! until it is defined here.

use std::fmt;

use crate::maps::{
    Ct4Key, Ct6Key, CtEntry, DatapathConfig, EndpointInfo, EndpointKey, EpPrefixKey, EpPrefixValue, FragKey, FragValue,
    IpcacheKey, IpcacheValue, LbAffinity, LbAffinityKey, LbBackend, LbFlow, LbFrontend, LbFrontendKey, LbMaglevTable,
    LbRevNat, LbService, LbServiceBackend, LbSockRev, LbSockRevKey, LbSvcBackendKey, METRICS_ENTRIES, MetricsValue,
    PolicyKey, PolicyValue, RoutingConfig,
};

/// `BPF_MAP_TYPE_HASH`.
pub const BPF_MAP_TYPE_HASH: u32 = 1;
/// `BPF_MAP_TYPE_ARRAY`.
pub const BPF_MAP_TYPE_ARRAY: u32 = 2;
/// `BPF_MAP_TYPE_PERCPU_ARRAY`.
pub const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
/// `BPF_MAP_TYPE_LRU_HASH`.
pub const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
/// `BPF_MAP_TYPE_LPM_TRIE`.
pub const BPF_MAP_TYPE_LPM_TRIE: u32 = 11;
/// `BPF_MAP_TYPE_RINGBUF`.
pub const BPF_MAP_TYPE_RINGBUF: u32 = 27;
/// `BPF_F_NO_PREALLOC`: LPM tries must have it (the kernel requires it).
pub const BPF_F_NO_PREALLOC: u32 = 1;

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
/// The single-entry routing array (mode, tunnel device).
pub const MAP_ROUTING: &str = "routing";
/// Service frontends (VIP / NodePort, port, protocol → service).
pub const MAP_LB_FRONTENDS: &str = "lb_frontends";
/// Service backends by the loader's backend id.
pub const MAP_LB_BACKENDS: &str = "lb_backends";
/// Maglev tables by the loader's table id.
pub const MAP_LB_MAGLEV: &str = "lb_maglev";
/// Reverse NAT: service id → the frontend replies come from.
pub const MAP_LB_REV_NAT: &str = "lb_rev_nat";
/// svc-loader's record of each service (read by no program).
pub const MAP_LB_SERVICES: &str = "lb_services";
/// svc-loader's list of each service's backends (read by no program).
pub const MAP_LB_SVC_BACKENDS: &str = "lb_svc_backends";
/// Session affinity: (client, service) → backend (LRU hash).
pub const MAP_LB_AFFINITY: &str = "lb_affinity";
/// Translated IPv4 flows (LRU hash, the datapath writes, svc-gc expires).
pub const MAP_LB4_FLOWS: &str = "lb4_flows";
/// Translated IPv6 flows.
pub const MAP_LB6_FLOWS: &str = "lb6_flows";
/// What the socket-level load balancer translated each socket to (LRU hash).
pub const MAP_LB_SOCK_REV: &str = "lb_sock_rev";
/// Every map of the datapath by name.
pub const MAP_NAMES: [&str; 21] = [
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
    MAP_ROUTING,
    MAP_LB_FRONTENDS,
    MAP_LB_BACKENDS,
    MAP_LB_MAGLEV,
    MAP_LB_REV_NAT,
    MAP_LB_SERVICES,
    MAP_LB_SVC_BACKENDS,
    MAP_LB_AFFINITY,
    MAP_LB4_FLOWS,
    MAP_LB6_FLOWS,
    MAP_LB_SOCK_REV,
];

/// What a map is, as the kernel reports it (or as a process wants it).
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

impl From<rivet_bpf_sys::MapInfo> for MapSpec {
    fn from(info: rivet_bpf_sys::MapInfo) -> Self {
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
        BPF_MAP_TYPE_HASH => "hash",
        BPF_MAP_TYPE_ARRAY => "array",
        BPF_MAP_TYPE_PERCPU_ARRAY => "percpu_array",
        BPF_MAP_TYPE_LRU_HASH => "lru_hash",
        BPF_MAP_TYPE_LPM_TRIE => "lpm_trie",
        BPF_MAP_TYPE_RINGBUF => "ringbuf",
        _ => return format!("map type {map_type}"),
    };
    name.to_owned()
}

/// One map of the datapath: its name and the shape every process using it
/// expects. The size is the loader's option (`default_max_entries` unless
/// configured); everything else is fixed by the datapath.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDef {
    /// Map name in the object, and pin name under the pin directory.
    pub name: &'static str,
    /// `BPF_MAP_TYPE_*`.
    pub map_type: u32,
    /// Key size in bytes (0 for the ring buffer).
    pub key_size: u32,
    /// Value size in bytes (0 for the ring buffer).
    pub value_size: u32,
    /// `BPF_F_*` map flags.
    pub flags: u32,
    /// max_entries in the object (bytes for the ring buffer), what the
    /// loader creates unless configured otherwise.
    pub default_max_entries: u32,
}

impl MapDef {
    /// The spec of this map with `max_entries`.
    pub const fn spec(&self, max_entries: u32) -> MapSpec {
        MapSpec {
            map_type: self.map_type,
            key_size: self.key_size,
            value_size: self.value_size,
            max_entries,
            flags: self.flags,
        }
    }

    /// Whether `found` is this map with any size (a map's size is the
    /// loader's option, not part of the contract).
    pub fn matches(&self, found: &MapSpec) -> bool {
        self.spec(found.max_entries) == *found
    }
}

const fn size32<T>() -> u32 {
    size_of::<T>() as u32
}

/// Endpoints by host-side ifindex and by address (Cilium: 64Ki endpoints per node).
pub const ENDPOINTS: MapDef = MapDef {
    name: MAP_ENDPOINTS,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<EndpointKey>(),
    value_size: size32::<EndpointInfo>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// Prefix → identity (Cilium: 512Ki prefixes).
pub const IPCACHE: MapDef = MapDef {
    name: MAP_IPCACHE,
    map_type: BPF_MAP_TYPE_LPM_TRIE,
    key_size: size32::<IpcacheKey>(),
    value_size: size32::<IpcacheValue>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: 524_288,
};

/// Policy entries of all endpoints: 16Ki entries per endpoint, for 64
/// endpoints' worth.
pub const POLICY: MapDef = MapDef {
    name: MAP_POLICY,
    map_type: BPF_MAP_TYPE_LPM_TRIE,
    key_size: size32::<PolicyKey>(),
    value_size: size32::<PolicyValue>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: 16_384 * 64,
};

/// Per-endpoint prefixes (ipBlock peers matched by address): 4Ki prefixes
/// per endpoint, for 64 endpoints' worth.
pub const EP_PREFIXES: MapDef = MapDef {
    name: MAP_EP_PREFIXES,
    map_type: BPF_MAP_TYPE_LPM_TRIE,
    key_size: size32::<EpPrefixKey>(),
    value_size: size32::<EpPrefixValue>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: 4096 * 64,
};

/// Default conntrack size per family (Cilium: 512Ki TCP + 256Ki other).
const CT_DEFAULT_MAX_ENTRIES: u32 = 512 * 1024 + 256 * 1024;

/// IPv4 conntrack.
pub const CT4: MapDef = MapDef {
    name: MAP_CT4,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<Ct4Key>(),
    value_size: size32::<CtEntry>(),
    flags: 0,
    default_max_entries: CT_DEFAULT_MAX_ENTRIES,
};

/// IPv6 conntrack.
pub const CT6: MapDef = MapDef {
    name: MAP_CT6,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<Ct6Key>(),
    value_size: size32::<CtEntry>(),
    flags: 0,
    default_max_entries: CT_DEFAULT_MAX_ENTRIES,
};

/// Per-CPU counters, index `metrics_index(reason, direction)`.
pub const METRICS: MapDef = MapDef {
    name: MAP_METRICS,
    map_type: BPF_MAP_TYPE_PERCPU_ARRAY,
    key_size: size32::<u32>(),
    value_size: size32::<MetricsValue>(),
    flags: 0,
    default_max_entries: METRICS_ENTRIES,
};

/// The event ring buffer (max_entries is its size in bytes).
pub const EVENTS: MapDef = MapDef {
    name: MAP_EVENTS,
    map_type: BPF_MAP_TYPE_RINGBUF,
    key_size: 0,
    value_size: 0,
    flags: 0,
    default_max_entries: 1 << 20,
};

/// The single-entry config array.
pub const CONFIG: MapDef = MapDef {
    name: MAP_CONFIG,
    map_type: BPF_MAP_TYPE_ARRAY,
    key_size: size32::<u32>(),
    value_size: size32::<DatapathConfig>(),
    flags: 0,
    default_max_entries: 1,
};

/// First fragments' ports (an LRU hash the datapath alone writes).
pub const FRAGMENTS: MapDef = MapDef {
    name: MAP_FRAGMENTS,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<FragKey>(),
    value_size: size32::<FragValue>(),
    flags: 0,
    default_max_entries: 16_384,
};

/// The single-entry routing array.
pub const ROUTING: MapDef = MapDef {
    name: MAP_ROUTING,
    map_type: BPF_MAP_TYPE_ARRAY,
    key_size: size32::<u32>(),
    value_size: size32::<RoutingConfig>(),
    flags: 0,
    default_max_entries: 1,
};

/// Service frontends: 64Ki (a frontend per service port and family, two
/// with a NodePort).
pub const LB_FRONTENDS: MapDef = MapDef {
    name: MAP_LB_FRONTENDS,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<LbFrontendKey>(),
    value_size: size32::<LbFrontend>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// Service backends: 64Ki distinct (address, port).
pub const LB_BACKENDS: MapDef = MapDef {
    name: MAP_LB_BACKENDS,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<u32>(),
    value_size: size32::<LbBackend>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// Maglev tables (4 KiB each): allocated on use, so the 64Ki of room
/// costs nothing until services exist.
pub const LB_MAGLEV: MapDef = MapDef {
    name: MAP_LB_MAGLEV,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<u32>(),
    value_size: size32::<LbMaglevTable>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: 65_536,
};

/// Reverse NAT entries, one per service.
pub const LB_REV_NAT: MapDef = MapDef {
    name: MAP_LB_REV_NAT,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<u32>(),
    value_size: size32::<LbRevNat>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// svc-loader's service records (24 B each): allocated on use.
pub const LB_SERVICES: MapDef = MapDef {
    name: MAP_LB_SERVICES,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<u32>(),
    value_size: size32::<LbService>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: 65_536,
};

/// Backends per service a node holds, on average, at the default size of
/// `lb_svc_backends` (svc-loader sizes it as this many per service it
/// can hold).
pub const LB_SVC_BACKENDS_PER_SERVICE: u32 = 4;

/// svc-loader's list of each service's backends, one entry per backend of
/// each service (8 B + 8 B): allocated on use.
pub const LB_SVC_BACKENDS: MapDef = MapDef {
    name: MAP_LB_SVC_BACKENDS,
    map_type: BPF_MAP_TYPE_HASH,
    key_size: size32::<LbSvcBackendKey>(),
    value_size: size32::<LbServiceBackend>(),
    flags: BPF_F_NO_PREALLOC,
    default_max_entries: LB_SERVICES.default_max_entries * LB_SVC_BACKENDS_PER_SERVICE,
};

/// Session affinity entries (an LRU hash: the oldest client goes first).
pub const LB_AFFINITY: MapDef = MapDef {
    name: MAP_LB_AFFINITY,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<LbAffinityKey>(),
    value_size: size32::<LbAffinity>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// Translated flows per family: two entries per connection, 128Ki
/// connections to services.
const LB_FLOWS_DEFAULT_MAX_ENTRIES: u32 = 262_144;

/// Translated IPv4 flows.
pub const LB4_FLOWS: MapDef = MapDef {
    name: MAP_LB4_FLOWS,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<Ct4Key>(),
    value_size: size32::<LbFlow>(),
    flags: 0,
    default_max_entries: LB_FLOWS_DEFAULT_MAX_ENTRIES,
};

/// Translated IPv6 flows.
pub const LB6_FLOWS: MapDef = MapDef {
    name: MAP_LB6_FLOWS,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<Ct6Key>(),
    value_size: size32::<LbFlow>(),
    flags: 0,
    default_max_entries: LB_FLOWS_DEFAULT_MAX_ENTRIES,
};

/// Socket-level load balancing: (socket cookie, backend) → the VIP it
/// stands for, one entry per translated socket and backend (an LRU hash:
/// entries of closed sockets age out; 64Ki live translated sockets).
pub const LB_SOCK_REV: MapDef = MapDef {
    name: MAP_LB_SOCK_REV,
    map_type: BPF_MAP_TYPE_LRU_HASH,
    key_size: size32::<LbSockRevKey>(),
    value_size: size32::<LbSockRev>(),
    flags: 0,
    default_max_entries: 65_536,
};

/// Every map of the datapath.
pub const ALL: [MapDef; 21] = [
    ENDPOINTS,
    IPCACHE,
    POLICY,
    EP_PREFIXES,
    CT4,
    CT6,
    METRICS,
    EVENTS,
    CONFIG,
    FRAGMENTS,
    ROUTING,
    LB_FRONTENDS,
    LB_BACKENDS,
    LB_MAGLEV,
    LB_REV_NAT,
    LB_SERVICES,
    LB_SVC_BACKENDS,
    LB_AFFINITY,
    LB4_FLOWS,
    LB6_FLOWS,
    LB_SOCK_REV,
];

/// The map called `name`, if the datapath has one.
pub fn by_name(name: &str) -> Option<&'static MapDef> {
    ALL.iter().find(|def| def.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_map_is_defined_once_under_its_name() {
        let names: Vec<&str> = ALL.iter().map(|def| def.name).collect();
        assert_eq!(names, MAP_NAMES);
        for def in &ALL {
            assert_eq!(by_name(def.name), Some(def));
        }
        assert_eq!(by_name("nope"), None);
    }

    #[test]
    fn lpm_tries_are_not_preallocated_and_sizes_count() {
        for def in &ALL {
            if def.map_type == BPF_MAP_TYPE_LPM_TRIE {
                assert_eq!(def.flags & BPF_F_NO_PREALLOC, BPF_F_NO_PREALLOC, "{}", def.name);
            }
            assert_ne!(def.default_max_entries, 0, "{}", def.name);
        }
        let found = CT4.spec(4096);
        assert!(CT4.matches(&found));
        assert!(!CT6.matches(&found));
        assert!(!CT4.matches(&MapSpec { flags: 1, ..found }));
        assert_eq!(
            found.to_string(),
            format!(
                "lru_hash (key 16 B, value {} B, max_entries 4096, flags 0x0)",
                CT4.value_size
            )
        );
    }
}

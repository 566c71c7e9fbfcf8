//! svc-loader: the only privileged daemon. It owns every BPF object of the
//! node: the datapath programs (embedded, compiled from `bpf/`), their pinned
//! maps and their tc filters, so the datapath outlives the daemon.
//!
//! - [`datapath`]: load once per node, reuse pins, attach/adopt/detach;
//! - [`tc`]: clsact qdiscs and `cls_bpf` filters over rtnetlink;
//! - [`maps`]: the datapath ABI's mirrors of `rivet.h`, re-exported from
//!   [`rivet_datapath`] (svc-loader's API speaks these types);
//! - [`policy_lpm`]: policy rules → LPM trie entries (deny wins);
//! - [`loader`]: endpoint operations (checked, ordered map writes);
//! - [`validate`]: request validation (no paths or free-form strings);
//! - [`service`]: the gRPC service; [`monitor`]: the event stream;
//! - [`events`]: logs and metrics, emitted together;
//! - [`host_addresses`]: the node's addresses as the host identity;
//! - [`netdev`]: interface facts in the current network namespace;
//! - [`lb`]: load balancing, the service maps and their index
//!   (`LoadBalancerService`), Maglev tables;
//! - [`routing`]: the routing mode, peer nodes and their routes
//!   (`NodeRoutingService`), the tunnel device;
//! - [`uninstall`]: what a stopping loader leaves (nothing, once no pod
//!   uses the datapath);
//! - `rtnl`: one rtnetlink request, for [`tc`] and [`routing`].

pub mod datapath;
pub mod events;
pub mod host_addresses;
pub mod lb;
pub mod loader;
pub use rivet_datapath::maps;
pub mod monitor;
pub mod netdev;
pub mod policy_lpm;
pub mod routing;
mod rtnl;
pub mod service;
pub mod tc;
pub mod uninstall;
pub mod validate;

/// The daemon's name: its socket is `<socket-dir>/svc-loader.sock`.
pub const DAEMON_NAME: &str = "svc-loader";

/// Capabilities svc-loader keeps, measured on kernel 6.18 (the README's
/// "Privileges" table says which operation needs which): CAP_BPF to create
/// maps and load programs, CAP_NET_ADMIN to load `sched_cls` programs and
/// attach them with tc, CAP_PERFMON for the verifier to accept the
/// datapath's pointer arithmetic. Not CAP_SYS_ADMIN: nothing it does needs it.
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[
    rivet_common::privileges::Capability::CAP_BPF,
    rivet_common::privileges::Capability::CAP_NET_ADMIN,
    rivet_common::privileges::Capability::CAP_PERFMON,
];

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods = &[
    (
        rivet_proto::loader::v1::loader_service_server::SERVICE_NAME,
        &[
            "GetEndpointPolicy",
            "ListEndpoints",
            "ListEndpointInterfaces",
            "ListIpcache",
            "GetDatapathStatus",
            "DumpConntrack",
            "GetDropCounters",
            "MonitorEvents",
        ],
    ),
    (
        rivet_proto::loader::v1::node_routing_service_server::SERVICE_NAME,
        &["ListNodes"],
    ),
    (
        rivet_proto::loader::v1::load_balancer_service_server::SERVICE_NAME,
        &["ListServices"],
    ),
];

/// The datapath object compiled by build.rs from `bpf/datapath.c`.
pub static DATAPATH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/datapath.o"));

/// SHA-256 of [`DATAPATH_OBJECT`] (hex), so operators can tell which
/// datapath build a node runs.
pub fn object_sha256() -> String {
    use sha2::Digest;
    sha2::Sha256::digest(DATAPATH_OBJECT)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod object_tests {
    use rivet_datapath::spec::{self, BPF_MAP_TYPE_RINGBUF, MapSpec};

    /// Every map of the compiled object is the datapath ABI's definition of
    /// it, exactly (type, key and value sizes, flags, size), and the ABI
    /// defines no map the object lacks: svc-gc and inspection open pins
    /// against these definitions without the object.
    #[test]
    fn object_maps_are_the_abi_definitions() {
        let obj = aya_obj::Object::parse(super::DATAPATH_OBJECT).expect("the embedded object parses");
        let mut in_object = Vec::new();
        for (name, map) in &obj.maps {
            if !matches!(
                map.section_kind(),
                aya_obj::EbpfSectionKind::Maps | aya_obj::EbpfSectionKind::BtfMaps
            ) {
                continue; // .rodata/.data/.bss
            }
            let def = spec::by_name(name).unwrap_or_else(|| panic!("map {name} of the object has no MapDef"));
            let ringbuf = map.map_type() == BPF_MAP_TYPE_RINGBUF;
            let found = MapSpec {
                map_type: map.map_type(),
                key_size: if ringbuf { 0 } else { map.key_size() },
                value_size: if ringbuf { 0 } else { map.value_size() },
                max_entries: map.max_entries(),
                flags: map.map_flags(),
            };
            assert_eq!(found, def.spec(def.default_max_entries), "map {name}");
            in_object.push(name.as_str());
        }
        in_object.sort_unstable();
        let mut defined = spec::MAP_NAMES.to_vec();
        defined.sort_unstable();
        assert_eq!(in_object, defined, "maps of the object vs the ABI's");
    }
}

#[cfg(test)]
mod read_only_methods_tests {
    #[test]
    fn read_only_methods_are_rpcs_of_their_services() {
        assert_eq!(
            rivet_common::access::unknown_methods(super::DAEMON_NAME, super::READ_ONLY_METHODS),
            Vec::<String>::new()
        );
    }
}

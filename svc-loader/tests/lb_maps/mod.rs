//! A test node's service maps, read and written from the test process
//! through their pins: services programmed as svc-loader's
//! LoadBalancerService does (backends, then a table, then the frontend;
//! backend ids kept while in use), and the datapath's affinity entries.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use aya::maps::{HashMap, MapData};
use rivet_datapath::maps::{
    LB_BACKEND_ACTIVE, LB_BACKEND_TERMINATING, LB_MAGLEV_SIZE, LbAffinity, LbAffinityKey, LbBackend, LbFrontend,
    LbFrontendKey, LbMaglevTable, LbRevNat, SVC_F_AFFINITY, SVC_F_CLUSTER_IP, SVC_SCOPE_INTERNAL,
};
use rivet_datapath::pin::open_pinned_map;
use rivet_datapath::spec;
use rivet_proto::loader::v1 as pb;

pub struct LbMaps {
    frontends: HashMap<MapData, LbFrontendKey, LbFrontend>,
    backends: HashMap<MapData, u32, LbBackend>,
    maglev: HashMap<MapData, u32, LbMaglevTable>,
    rev_nat: HashMap<MapData, u32, LbRevNat>,
    affinity: HashMap<MapData, LbAffinityKey, LbAffinity>,
    ids: BTreeMap<SocketAddr, u32>,
    /// Backends of each service.
    services: BTreeMap<u32, Vec<SocketAddr>>,
}

fn open<K: aya::Pod, V: aya::Pod>(dir: &Path, def: &'static spec::MapDef) -> HashMap<MapData, K, V> {
    let map = open_pinned_map(dir, def).unwrap_or_else(|e| panic!("{e}"));
    HashMap::try_from(map).unwrap_or_else(|e| panic!("map {}: {e}", def.name))
}

fn socket(address: &[u8], port: u32) -> SocketAddr {
    SocketAddr::new(
        rivet_proto::net::address_from_bytes(address).expect("an address"),
        port as u16,
    )
}

impl LbMaps {
    pub fn open(dir: &Path) -> Self {
        Self {
            frontends: open(dir, &spec::LB_FRONTENDS),
            backends: open(dir, &spec::LB_BACKENDS),
            maglev: open(dir, &spec::LB_MAGLEV),
            rev_nat: open(dir, &spec::LB_REV_NAT),
            affinity: open(dir, &spec::LB_AFFINITY),
            ids: BTreeMap::new(),
            services: BTreeMap::new(),
        }
    }

    /// Programs `service` (its first frontend; table id = service id).
    pub fn upsert(&mut self, service: &pb::LbService) {
        let protocol = service.protocol as u8;
        let mut active = Vec::new();
        let mut addrs = Vec::new();
        for b in &service.backends {
            let addr = socket(&b.address, b.port);
            let next = self.ids.len() as u32 + 1;
            let id = *self.ids.entry(addr).or_insert(next);
            let terminating = b.state == pb::BackendState::Terminating as i32;
            let state = if terminating {
                LB_BACKEND_TERMINATING
            } else {
                LB_BACKEND_ACTIVE
            };
            self.backends
                .insert(id, LbBackend::new(addr, state), 0)
                .expect("backend written");
            if !terminating {
                active.push(id);
            }
            addrs.push(addr);
        }
        active.sort_unstable();
        let mut table = LbMaglevTable::default();
        if !active.is_empty() {
            for slot in 0..LB_MAGLEV_SIZE {
                table.backend_ids[slot] = active[slot % active.len()];
            }
        }
        self.maglev.insert(service.service_id, table, 0).expect("table written");
        let fe = &service.frontends[0];
        let vip = socket(&fe.address, fe.port);
        self.rev_nat
            .insert(service.service_id, LbRevNat::new(vip), 0)
            .expect("rev nat written");
        let mut flags = SVC_F_CLUSTER_IP;
        if service.affinity_timeout_seconds > 0 {
            flags |= SVC_F_AFFINITY;
        }
        let frontend = LbFrontend {
            service_id: service.service_id,
            table_id: service.service_id,
            backend_count: active.len() as u16,
            flags,
            affinity_timeout: service.affinity_timeout_seconds,
        };
        self.frontends
            .insert(LbFrontendKey::vip(vip, protocol, SVC_SCOPE_INTERNAL), frontend, 0)
            .expect("frontend written");
        self.services.insert(service.service_id, addrs);
        // Backends no service uses any more go.
        let used: Vec<SocketAddr> = self.services.values().flatten().copied().collect();
        let gone: Vec<(SocketAddr, u32)> = self
            .ids
            .iter()
            .filter(|(addr, _)| !used.contains(addr))
            .map(|(a, id)| (*a, *id))
            .collect();
        for (addr, id) in gone {
            let _ = self.backends.remove(&id);
            self.ids.remove(&addr);
        }
    }

    pub fn backend(&self, id: u32) -> Option<LbBackend> {
        self.backends.get(&id, 0).ok()
    }

    pub fn backend_id(&self, addr: SocketAddr) -> u32 {
        self.ids[&addr]
    }

    pub fn affinity(&self, key: &LbAffinityKey) -> Option<LbAffinity> {
        self.affinity.get(key, 0).ok()
    }

    pub fn set_affinity(&mut self, key: &LbAffinityKey, value: LbAffinity) {
        self.affinity.insert(key, value, 0).expect("affinity written");
    }
}

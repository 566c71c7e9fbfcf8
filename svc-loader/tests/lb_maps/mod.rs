//! What the datapath itself keeps for services, read (and planted) by the
//! test process through the pins: affinity entries, and the loader's
//! backend ids.

use std::net::SocketAddr;
use std::path::Path;

use aya::maps::{HashMap, MapData};
use rivet_datapath::maps::{LbAffinity, LbAffinityKey, LbBackend};
use rivet_datapath::pin::open_pinned_map;
use rivet_datapath::spec;

pub struct LbMaps {
    backends: HashMap<MapData, u32, LbBackend>,
    affinity: HashMap<MapData, LbAffinityKey, LbAffinity>,
}

fn open<K: aya::Pod, V: aya::Pod>(dir: &Path, def: &'static spec::MapDef) -> HashMap<MapData, K, V> {
    let map = open_pinned_map(dir, def).unwrap_or_else(|e| panic!("{e}"));
    HashMap::try_from(map).unwrap_or_else(|e| panic!("map {}: {e}", def.name))
}

impl LbMaps {
    pub fn open(dir: &Path) -> Self {
        Self {
            backends: open(dir, &spec::LB_BACKENDS),
            affinity: open(dir, &spec::LB_AFFINITY),
        }
    }

    pub fn backend(&self, id: u32) -> Option<LbBackend> {
        self.backends.get(&id, 0).ok()
    }

    /// The id the loader gave the backend at `addr`.
    pub fn backend_id(&self, addr: SocketAddr) -> u32 {
        self.backends
            .iter()
            .filter_map(Result::ok)
            .find(|(_, b)| b.socket_addr() == Some(addr))
            .map(|(id, _)| id)
            .unwrap_or_else(|| panic!("no backend {addr} in lb_backends"))
    }

    pub fn affinity(&self, key: &LbAffinityKey) -> Option<LbAffinity> {
        self.affinity.get(key, 0).ok()
    }

    pub fn set_affinity(&mut self, key: &LbAffinityKey, value: LbAffinity) {
        self.affinity.insert(key, value, 0).expect("affinity written");
    }
}

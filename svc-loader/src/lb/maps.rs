//! The service maps as [`LoadBalancer`](super::LoadBalancer) sees them:
//! single writes and a whole snapshot, behind [`ServiceMaps`] (the pinned
//! maps in the daemon, [`LbSnapshot`] itself in unit tests).

use std::collections::BTreeMap;
use std::sync::Arc;

use aya::maps::{HashMap, MapData, MapError};
use aya::sys::SyscallError;
use rivet_datapath::maps::legacy::LbServiceV1;
use rivet_datapath::maps::{
    LbBackend, LbFrontend, LbFrontendKey, LbMaglevTable, LbRevNat, LbService, LbServiceBackend, LbSvcBackendKey,
};
use rivet_datapath::spec::{
    MAP_LB_AFFINITY, MAP_LB_BACKENDS, MAP_LB_FRONTENDS, MAP_LB_MAGLEV, MAP_LB_REV_NAT, MAP_LB_SERVICES,
    MAP_LB_SVC_BACKENDS, MAP_LB4_FLOWS, MAP_LB6_FLOWS,
};

use crate::datapath::{LB_SERVICES_V1_PIN, SharedMap};
use crate::loader::EndpointDatapath;

/// One write to a service map: `Some` puts the entry, `None` deletes it (a
/// missing entry is not an error).
#[derive(Clone, Copy, Debug)]
pub enum LbWrite<'a> {
    /// `lb_services`.
    Service(u32, Option<&'a LbService>),
    /// `lb_svc_backends`.
    ServiceBackend(LbSvcBackendKey, Option<&'a LbServiceBackend>),
    /// `lb_backends`.
    Backend(u32, Option<&'a LbBackend>),
    /// `lb_maglev`.
    Table(u32, Option<&'a LbMaglevTable>),
    /// `lb_rev_nat`.
    RevNat(u32, Option<&'a LbRevNat>),
    /// `lb_frontends`.
    Frontend(&'a LbFrontendKey, Option<&'a LbFrontend>),
}

impl LbWrite<'_> {
    /// The map written.
    pub fn map(&self) -> &'static str {
        match self {
            Self::Service(..) => MAP_LB_SERVICES,
            Self::ServiceBackend(..) => MAP_LB_SVC_BACKENDS,
            Self::Backend(..) => MAP_LB_BACKENDS,
            Self::Table(..) => MAP_LB_MAGLEV,
            Self::RevNat(..) => MAP_LB_REV_NAT,
            Self::Frontend(..) => MAP_LB_FRONTENDS,
        }
    }

    fn action(&self) -> String {
        let verb = |put: bool| if put { "writing" } else { "deleting" };
        match self {
            Self::Service(id, v) => format!("{} service {id} in", verb(v.is_some())),
            Self::ServiceBackend(key, v) => format!(
                "{} backend {} of service {} in",
                verb(v.is_some()),
                key.index,
                key.service_id
            ),
            Self::Backend(id, v) => format!("{} backend {id} in", verb(v.is_some())),
            Self::Table(id, v) => format!("{} Maglev table {id} in", verb(v.is_some())),
            Self::RevNat(id, v) => format!("{} the reverse NAT of service {id} in", verb(v.is_some())),
            Self::Frontend(key, v) => format!(
                "{} frontend {}:{} (protocol {}, scope {}) in",
                verb(v.is_some()),
                key.ip().map_or_else(|| "*".to_owned(), |ip| ip.to_string()),
                key.port(),
                key.protocol,
                key.scope
            ),
        }
    }
}

/// A service map command failed.
#[derive(Debug, thiserror::Error)]
#[error("{action} {map}: {source}")]
pub struct LbMapError {
    /// What was being done.
    pub action: String,
    /// The map.
    pub map: &'static str,
    /// aya's error.
    #[source]
    pub source: MapError,
}

impl LbMapError {
    /// The map has no room (the kernel's E2BIG / ENOSPC / ENOMEM).
    pub fn is_full(&self) -> bool {
        matches!(&self.source, MapError::SyscallError(s)
            if matches!(s.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC | libc::ENOMEM)))
    }
}

/// Everything the loader writes, as read back from the maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbSnapshot {
    /// `lb_services`.
    pub services: BTreeMap<u32, LbService>,
    /// `lb_svc_backends`.
    pub service_backends: BTreeMap<LbSvcBackendKey, LbServiceBackend>,
    /// `lb_backends`.
    pub backends: BTreeMap<u32, LbBackend>,
    /// `lb_maglev`.
    pub tables: BTreeMap<u32, Box<LbMaglevTable>>,
    /// `lb_rev_nat`.
    pub rev_nat: BTreeMap<u32, LbRevNat>,
    /// `lb_frontends`.
    pub frontends: BTreeMap<LbFrontendKey, LbFrontend>,
}

impl LbSnapshot {
    /// Applies one write (what the kernel does).
    pub fn apply(&mut self, write: LbWrite<'_>) {
        fn set<K: Ord, V>(map: &mut BTreeMap<K, V>, key: K, value: Option<V>) {
            match value {
                Some(v) => map.insert(key, v),
                None => map.remove(&key),
            };
        }
        match write {
            LbWrite::Service(id, v) => set(&mut self.services, id, v.copied()),
            LbWrite::ServiceBackend(key, v) => set(&mut self.service_backends, key, v.copied()),
            LbWrite::Backend(id, v) => set(&mut self.backends, id, v.copied()),
            LbWrite::Table(id, v) => set(&mut self.tables, id, v.map(|v| Box::new(*v))),
            LbWrite::RevNat(id, v) => set(&mut self.rev_nat, id, v.copied()),
            LbWrite::Frontend(key, v) => set(&mut self.frontends, *key, v.copied()),
        }
    }
}

/// The service maps of the node.
pub trait ServiceMaps: Send + Sync {
    /// One write.
    fn write(&self, write: LbWrite<'_>) -> Result<(), LbMapError>;
    /// Every entry the loader writes.
    fn snapshot(&self) -> Result<LbSnapshot, LbMapError>;
    /// The service records of the first layout an older loader left
    /// (set aside by [`Datapath::open`](crate::datapath::Datapath::open)),
    /// by service id; empty when there are none.
    fn legacy_services(&self) -> Result<BTreeMap<u32, Box<LbServiceV1>>, LbMapError>;
    /// Removes those records (they are converted).
    fn remove_legacy_services(&self) -> Result<(), LbMapError>;
    /// Entries of the maps the datapath writes: `lb4_flows` + `lb6_flows`,
    /// and `lb_affinity`.
    fn dynamic_entries(&self) -> Result<(u64, u64), LbMapError>;
}

/// The pinned maps of the loaded datapath.
#[derive(Debug, Clone)]
pub struct PinnedServiceMaps(pub Arc<EndpointDatapath>);

fn put_or_delete<K: aya::Pod, V: aya::Pod>(
    map: &SharedMap<HashMap<MapData, K, V>>,
    key: K,
    value: Option<&V>,
) -> Result<(), MapError> {
    let mut map = map.lock();
    match value {
        Some(v) => map.insert(key, *v, 0),
        None => match map.remove(&key) {
            Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            other => other,
        },
    }
}

fn dump<K: aya::Pod + Ord, V: aya::Pod, T>(
    map: &SharedMap<HashMap<MapData, K, V>>,
    name: &'static str,
    wrap: impl Fn(V) -> T,
) -> Result<BTreeMap<K, T>, LbMapError> {
    dump_map(&map.lock(), name, wrap)
}

fn dump_map<K: aya::Pod + Ord, V: aya::Pod, T>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
    wrap: impl Fn(V) -> T,
) -> Result<BTreeMap<K, T>, LbMapError> {
    map.iter()
        .map(|entry| entry.map(|(k, v)| (k, wrap(v))))
        .collect::<Result<_, _>>()
        .map_err(|source| LbMapError {
            action: "reading".to_owned(),
            map: name,
            source,
        })
}

fn count<K: aya::Pod, V: aya::Pod>(
    map: &SharedMap<HashMap<MapData, K, V>>,
    name: &'static str,
) -> Result<u64, LbMapError> {
    let map = map.lock();
    let mut n = 0;
    for key in map.keys() {
        match key {
            Ok(_) => n += 1,
            // An LRU entry evicted under the walk: the walk goes on.
            Err(MapError::KeyNotFound) => {}
            Err(source) => {
                return Err(LbMapError {
                    action: "counting the entries of".to_owned(),
                    map: name,
                    source,
                });
            }
        }
    }
    Ok(n)
}

impl ServiceMaps for PinnedServiceMaps {
    fn write(&self, write: LbWrite<'_>) -> Result<(), LbMapError> {
        let maps = self.0.datapath().maps();
        match write {
            LbWrite::Service(id, v) => put_or_delete(&maps.lb_services, id, v),
            LbWrite::ServiceBackend(key, v) => put_or_delete(&maps.lb_svc_backends, key, v),
            LbWrite::Backend(id, v) => put_or_delete(&maps.lb_backends, id, v),
            LbWrite::Table(id, v) => put_or_delete(&maps.lb_maglev, id, v),
            LbWrite::RevNat(id, v) => put_or_delete(&maps.lb_rev_nat, id, v),
            LbWrite::Frontend(key, v) => put_or_delete(&maps.lb_frontends, *key, v),
        }
        .map_err(|source| LbMapError {
            action: write.action(),
            map: write.map(),
            source,
        })
    }

    fn snapshot(&self) -> Result<LbSnapshot, LbMapError> {
        let maps = self.0.datapath().maps();
        Ok(LbSnapshot {
            services: dump(&maps.lb_services, MAP_LB_SERVICES, |v| v)?,
            service_backends: dump(&maps.lb_svc_backends, MAP_LB_SVC_BACKENDS, |v| v)?,
            backends: dump(&maps.lb_backends, MAP_LB_BACKENDS, |v| v)?,
            tables: dump(&maps.lb_maglev, MAP_LB_MAGLEV, Box::new)?,
            rev_nat: dump(&maps.lb_rev_nat, MAP_LB_REV_NAT, |v| v)?,
            frontends: dump(&maps.lb_frontends, MAP_LB_FRONTENDS, |v| v)?,
        })
    }

    fn legacy_services(&self) -> Result<BTreeMap<u32, Box<LbServiceV1>>, LbMapError> {
        let pin = self.0.datapath().pin_dir().join(LB_SERVICES_V1_PIN);
        if !pin.exists() {
            return Ok(BTreeMap::new());
        }
        let err = |action: &str| {
            let action = format!("{action} {}: the first-layout", pin.display());
            move |source| LbMapError {
                action,
                map: MAP_LB_SERVICES,
                source,
            }
        };
        let data = MapData::from_pin(&pin).map_err(err("opening"))?;
        let map = HashMap::<_, u32, LbServiceV1>::try_from(aya::maps::Map::HashMap(data)).map_err(err("using"))?;
        dump_map(&map, MAP_LB_SERVICES, Box::new)
    }

    fn remove_legacy_services(&self) -> Result<(), LbMapError> {
        let pin = self.0.datapath().pin_dir().join(LB_SERVICES_V1_PIN);
        match std::fs::remove_file(&pin) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(LbMapError {
                action: format!("removing the converted {}: the first-layout", pin.display()),
                map: MAP_LB_SERVICES,
                source: MapError::SyscallError(SyscallError {
                    call: "unlink",
                    io_error: e,
                }),
            }),
            _ => Ok(()),
        }
    }

    fn dynamic_entries(&self) -> Result<(u64, u64), LbMapError> {
        let maps = self.0.datapath().maps();
        let flows = count(&maps.lb4_flows, MAP_LB4_FLOWS)? + count(&maps.lb6_flows, MAP_LB6_FLOWS)?;
        Ok((flows, count(&maps.lb_affinity, MAP_LB_AFFINITY)?))
    }
}

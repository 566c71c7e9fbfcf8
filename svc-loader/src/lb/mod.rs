//! Load balancing: the service maps (`rivet.h` "services") and the
//! loader's index of them (`LoadBalancerService`).
//!
//! A service is one port of one family with its frontends (ClusterIPs,
//! NodePort) and backends; svc-endpoint names it by a durable
//! `service_id` and pushes it ([`service`]: the gRPC side, [`validate`]:
//! the checks). The loader chooses the ids of backends (a backend, by
//! (address, port), keeps its id while any service uses it, so flows to
//! surviving backends are not disturbed) and of Maglev tables
//! ([`maglev`]), and writes, in this order, so that the datapath never
//! finds a frontend whose table or backends are missing:
//!
//! 1. the service's backends with their state in it (`lb_svc_backends`,
//!    which the Maglev tables alone do not say), then its record
//!    (`lb_services`: tables, flags, how many backends), then the
//!    backend entries past its count;
//! 2. new backends and backends whose state changed (`lb_backends`);
//! 3. the Maglev tables (`lb_maglev`, replaced whole in one update);
//! 4. the reverse NAT entry (`lb_rev_nat`);
//! 5. the frontends (`lb_frontends`, with their `backend_count`), then
//!    the frontends it no longer has are deleted;
//! 6. a table no longer needed, then backends no service uses.
//!
//! Removal runs in the reverse order. Nothing is kept anywhere but in the
//! pinned maps: on start [`LoadBalancer::restore`] rebuilds the index from
//! them (the seed's "restore services from the maps") and removes what a
//! crash between two writes may have left unreferenced. An entry of the
//! index is compared, not trusted: a service whose entries differ from
//! what the index computes for it (a write that never happened) is
//! rewritten whole by the next upsert, even an identical one.
//!
//! A backend shared by services with different states is `ACTIVE` in
//! `lb_backends` while any of them has it active (its state there is what
//! the datapath checks before reusing an affinity entry); its membership of
//! each table follows each service's own state.

pub mod maglev;
pub mod maps;
pub mod service;
pub mod validate;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};

use rivet_datapath::maps::{
    LB_BACKEND_ACTIVE, LB_BACKEND_TERMINATING, LB_SVC_BACKEND_NODE_LOCAL, LB_SVC_BACKEND_TERMINATING, LbBackend,
    LbFrontend, LbFrontendKey, LbMaglevTable, LbRevNat, LbService, LbServiceBackend, LbSvcBackendKey, SVC_F_AFFINITY,
    SVC_F_CLUSTER_IP, SVC_F_LOCAL, SVC_F_NODE_PORT, SVC_SCOPE_EXTERNAL, SVC_SCOPE_INTERNAL,
};
use rivet_datapath::spec::{
    MAP_LB_BACKENDS, MAP_LB_FRONTENDS, MAP_LB_MAGLEV, MAP_LB_REV_NAT, MAP_LB_SERVICES, MAP_LB_SVC_BACKENDS,
};

pub use maps::{LbMapError, LbSnapshot, LbWrite, PinnedServiceMaps, ServiceMaps};

/// Largest backend or table id the loader hands out (ids wrap around below it).
const MAX_ID: u32 = 1 << 30;

/// One frontend of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Frontend {
    /// A VIP (ClusterIP, externalIP) and port.
    ClusterIp(SocketAddr),
    /// A port on every address of the node.
    NodePort(u16),
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ClusterIp(addr) => write!(f, "frontend {addr}"),
            Self::NodePort(port) => write!(f, "NodePort {port}"),
        }
    }
}

/// One backend of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend {
    /// Address and target port.
    pub addr: SocketAddr,
    /// Keeps its flows, gets no new ones.
    pub terminating: bool,
    /// A pod on this node (externalTrafficPolicy Local).
    pub node_local: bool,
}

/// A checked service: frontends sorted and unique, backends sorted by
/// address and unique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Nonzero, the client's.
    pub id: u32,
    /// 4 or 6.
    pub family: u8,
    /// `IPPROTO_TCP`, `UDP` or `SCTP`.
    pub protocol: u8,
    /// At least one.
    pub frontends: Vec<Frontend>,
    /// At most [`validate::MAX_BACKENDS`].
    pub backends: Vec<Backend>,
    /// sessionAffinity ClientIP seconds; 0 = none.
    pub affinity_timeout: u32,
    /// externalTrafficPolicy Local.
    pub local: bool,
}

impl Service {
    /// Whether NodePort traffic from outside has its own table of
    /// node-local backends (externalTrafficPolicy Local with a NodePort).
    fn has_external_table(&self) -> bool {
        self.local && self.frontends.iter().any(|f| matches!(f, Frontend::NodePort(_)))
    }

    /// The `lb_frontends` keys of the service.
    pub fn frontend_keys(&self) -> Vec<LbFrontendKey> {
        let mut keys = Vec::new();
        for frontend in &self.frontends {
            match frontend {
                Frontend::ClusterIp(addr) => keys.push(LbFrontendKey::vip(*addr, self.protocol, SVC_SCOPE_INTERNAL)),
                Frontend::NodePort(port) => {
                    keys.push(LbFrontendKey::node_port(
                        self.family,
                        *port,
                        self.protocol,
                        SVC_SCOPE_INTERNAL,
                    ));
                    if self.has_external_table() {
                        keys.push(LbFrontendKey::node_port(
                            self.family,
                            *port,
                            self.protocol,
                            SVC_SCOPE_EXTERNAL,
                        ));
                    }
                }
            }
        }
        keys
    }
}

/// A frontend key as text (errors, logs).
pub fn frontend_name(key: &LbFrontendKey) -> String {
    let proto = match key.protocol {
        6 => "TCP".to_owned(),
        17 => "UDP".to_owned(),
        132 => "SCTP".to_owned(),
        p => format!("protocol {p}"),
    };
    let scope = if key.scope == SVC_SCOPE_EXTERNAL {
        " (external)"
    } else {
        ""
    };
    match key.ip() {
        Some(ip) => format!("{proto} {}{scope}", SocketAddr::new(ip, key.port())),
        None => format!("{proto} NodePort {} of IPv{}{scope}", key.port(), key.family),
    }
}

/// Why a service operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LbError {
    /// A frontend belongs to another service.
    #[error("upserting service {service_id}: {frontend} belongs to service {holder}")]
    FrontendHeld {
        /// The service being written.
        service_id: u32,
        /// The frontend.
        frontend: String,
        /// Its current service.
        holder: u32,
    },
    /// A map has no room for the change (checked before any write).
    #[error("upserting service {service_id}: {map} would need {needed} entries, it holds {max}")]
    MapFull {
        /// The service being written.
        service_id: u32,
        /// The map.
        map: &'static str,
        /// Entries it would hold.
        needed: usize,
        /// Its max_entries.
        max: u32,
    },
    /// A map command failed (the index was rebuilt from the maps).
    #[error("service {service_id}: {source}")]
    Map {
        /// The service being written.
        service_id: u32,
        /// The failed command.
        #[source]
        source: LbMapError,
    },
    /// Rebuilding the index from the maps failed.
    #[error("restoring the service index from the maps: {0}")]
    Restore(#[source] LbMapError),
}

impl LbError {
    /// The map had no room.
    pub fn is_map_full(&self) -> bool {
        match self {
            Self::MapFull { .. } => true,
            Self::Map { source, .. } => source.is_full(),
            _ => false,
        }
    }
}

/// max_entries of the maps the loader writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbCapacity {
    /// `lb_services` (and `lb_rev_nat`, one entry per service).
    pub services: u32,
    /// `lb_frontends`.
    pub frontends: u32,
    /// `lb_backends`.
    pub backends: u32,
    /// `lb_maglev`.
    pub tables: u32,
    /// `lb_svc_backends` (backends of all services together).
    pub service_backends: u32,
}

impl LbCapacity {
    /// The sizes of `maps` (map name → max_entries), the ABI's defaults for
    /// a missing one.
    pub fn from_sizes(sizes: &BTreeMap<String, u32>) -> Self {
        use rivet_datapath::spec::{LB_BACKENDS, LB_FRONTENDS, LB_MAGLEV, LB_REV_NAT, LB_SERVICES, LB_SVC_BACKENDS};
        let size = |def: &rivet_datapath::spec::MapDef| sizes.get(def.name).copied().unwrap_or(def.default_max_entries);
        Self {
            services: size(&LB_SERVICES).min(size(&LB_REV_NAT)),
            frontends: size(&LB_FRONTENDS),
            backends: size(&LB_BACKENDS),
            tables: size(&LB_MAGLEV),
            service_backends: size(&LB_SVC_BACKENDS),
        }
    }
}

/// What a service is in the maps: every entry it owns.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Rendered {
    record: LbService,
    /// `lb_svc_backends` entries by index.
    backends: Vec<LbServiceBackend>,
    tables: BTreeMap<u32, Box<LbMaglevTable>>,
    rev_nat: LbRevNat,
    frontends: BTreeMap<LbFrontendKey, LbFrontend>,
}

/// A service as the maps hold it.
#[derive(Clone, Debug)]
struct Realised {
    service: Service,
    table_id: u32,
    external_table_id: u32,
    /// address → backend id, for every backend of the service.
    backend_ids: BTreeMap<SocketAddr, u32>,
    rendered: Rendered,
    /// The maps hold exactly `rendered` (false after a restore found
    /// something missing or different: the next upsert rewrites it).
    complete: bool,
    /// `lb_svc_backends` indexes `0..list_len` may hold entries of it.
    list_len: usize,
}

/// One entry of `lb_backends` and the services using it.
#[derive(Clone, Debug)]
struct BackendSlot {
    id: u32,
    /// service id → active in it.
    users: BTreeMap<u32, bool>,
    /// What `lb_backends` holds.
    written: Option<LbBackend>,
}

impl BackendSlot {
    fn desired(&self, addr: SocketAddr) -> LbBackend {
        let active = self.users.values().any(|a| *a);
        LbBackend::new(
            addr,
            if active {
                LB_BACKEND_ACTIVE
            } else {
                LB_BACKEND_TERMINATING
            },
        )
    }
}

#[derive(Debug, Default)]
struct Index {
    services: BTreeMap<u32, Realised>,
    backends: BTreeMap<SocketAddr, BackendSlot>,
    backend_addrs: BTreeMap<u32, SocketAddr>,
    tables: BTreeSet<u32>,
    frontend_owner: BTreeMap<LbFrontendKey, u32>,
    next_backend_id: u32,
    next_table_id: u32,
}

fn next_free(used: impl Fn(u32) -> bool, hint: &mut u32) -> u32 {
    let mut id = (*hint).clamp(1, MAX_ID);
    while used(id) {
        id = if id >= MAX_ID { 1 } else { id + 1 };
    }
    *hint = if id >= MAX_ID { 1 } else { id + 1 };
    id
}

impl Index {
    fn alloc_backend(&mut self) -> u32 {
        let used = &self.backend_addrs;
        next_free(|id| used.contains_key(&id), &mut self.next_backend_id)
    }

    fn alloc_table(&mut self) -> u32 {
        let used = &self.tables;
        let id = next_free(|id| used.contains(&id), &mut self.next_table_id);
        self.tables.insert(id);
        id
    }
}

/// What [`LoadBalancer::restore`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Services rebuilt from their records.
    pub services: usize,
    /// Of them, services whose entries were incomplete (rewritten by the
    /// next upsert).
    pub incomplete: usize,
    /// Entries no service references, removed.
    pub orphans_removed: usize,
    /// Services converted from records of the first layout (an upgrade).
    pub converted: usize,
}

/// What [`LoadBalancer::replace`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplaceReport {
    /// Services written (new or changed).
    pub upserted: u32,
    /// Services removed (not in the set).
    pub deleted: u32,
    /// Services already as asked.
    pub unchanged: u32,
}

/// One service as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceStatus {
    /// The service.
    pub service: Service,
    /// Its internal Maglev table.
    pub table_id: u32,
    /// Its NodePort Local table, or 0.
    pub external_table_id: u32,
    /// For each backend (the service's order): its id and its slots in
    /// the internal table.
    pub backends: Vec<(u32, u32)>,
}

/// The services of the node: the index and the maps, behind one lock (one
/// change at a time; each is a few map writes).
pub struct LoadBalancer {
    maps: Box<dyn ServiceMaps>,
    capacity: LbCapacity,
    index: Mutex<Index>,
}

impl fmt::Debug for LoadBalancer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadBalancer")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

fn render(service: &Service, table_id: u32, external_table_id: u32, ids: &BTreeMap<SocketAddr, u32>) -> Rendered {
    let record = LbService {
        table_id,
        external_table_id,
        affinity_timeout: service.affinity_timeout,
        backend_count: service.backends.len() as u16,
        family: service.family,
        protocol: service.protocol,
        flags: if service.local { u32::from(SVC_F_LOCAL) } else { 0 },
        pad: 0,
    };
    let mut backends = Vec::with_capacity(service.backends.len());
    let mut active = Vec::new();
    let mut local_active = Vec::new();
    for backend in &service.backends {
        let id = ids[&backend.addr];
        let mut flags = 0;
        if backend.terminating {
            flags |= LB_SVC_BACKEND_TERMINATING;
        } else {
            active.push((backend.addr, id));
            if backend.node_local {
                local_active.push((backend.addr, id));
            }
        }
        if backend.node_local {
            flags |= LB_SVC_BACKEND_NODE_LOCAL;
        }
        backends.push(LbServiceBackend { backend_id: id, flags });
    }
    let mut tables = BTreeMap::new();
    tables.insert(table_id, Box::new(maglev::table(&active)));
    if external_table_id != 0 {
        tables.insert(external_table_id, Box::new(maglev::table(&local_active)));
    }
    let affinity = if service.affinity_timeout > 0 {
        SVC_F_AFFINITY
    } else {
        0
    };
    let frontend = |table_id, count: usize, flags: u16| LbFrontend {
        service_id: service.id,
        table_id,
        backend_count: count as u16,
        flags: flags | affinity,
        affinity_timeout: service.affinity_timeout,
    };
    let local = if service.local { SVC_F_LOCAL } else { 0 };
    let mut frontends = BTreeMap::new();
    for key in service.frontend_keys() {
        let value = match (key.ip(), key.scope) {
            (Some(_), _) => frontend(table_id, active.len(), SVC_F_CLUSTER_IP),
            (None, SVC_SCOPE_EXTERNAL) => frontend(external_table_id, local_active.len(), SVC_F_NODE_PORT | local),
            (None, _) => frontend(table_id, active.len(), SVC_F_NODE_PORT | local),
        };
        frontends.insert(key, value);
    }
    // Replies come from the first ClusterIP (the frontends are sorted:
    // ClusterIPs first); a NodePort-only service from its port.
    let rev_nat = match service.frontends.first() {
        Some(Frontend::ClusterIp(addr)) => LbRevNat::new(*addr),
        Some(Frontend::NodePort(port)) => LbRevNat {
            addr: [0; 4],
            port: port.to_be(),
            family: service.family,
            pad: 0,
        },
        None => LbRevNat::default(),
    };
    Rendered {
        record,
        backends,
        tables,
        rev_nat,
        frontends,
    }
}

fn map_err(service_id: u32) -> impl FnOnce(LbMapError) -> LbError {
    move |source| LbError::Map { service_id, source }
}

impl LoadBalancer {
    /// The load balancer over `maps`, its index restored from them.
    pub fn restore(maps: Box<dyn ServiceMaps>, capacity: LbCapacity) -> Result<(Self, RestoreReport), LbError> {
        let lb = Self {
            maps,
            capacity,
            index: Mutex::new(Index::default()),
        };
        let converted = lb.convert_legacy()?;
        let report = {
            let mut index = lb.lock();
            lb.rebuild(&mut index)?
        };
        Ok((lb, RestoreReport { converted, ..report }))
    }

    /// Converts service records of the first layout (backends inline) an
    /// older loader left into `lb_svc_backends` and `lb_services`, then
    /// removes them. Redone whole if interrupted: the same writes.
    fn convert_legacy(&self) -> Result<usize, LbError> {
        let legacy = self.maps.legacy_services().map_err(LbError::Restore)?;
        for (&id, old) in &legacy {
            for (index, backend) in (0u32..).zip(old.backends()) {
                let key = LbSvcBackendKey { service_id: id, index };
                self.maps
                    .write(LbWrite::ServiceBackend(key, Some(backend)))
                    .map_err(LbError::Restore)?;
            }
            self.maps
                .write(LbWrite::Service(id, Some(&old.record)))
                .map_err(LbError::Restore)?;
        }
        self.maps.remove_legacy_services().map_err(LbError::Restore)?;
        Ok(legacy.len())
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // A panic mid-change leaves the index behind the maps; the next
        // change compares, and a failed one rebuilds.
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, service_id: u32, write: LbWrite<'_>) -> Result<(), LbError> {
        self.maps.write(write).map_err(map_err(service_id))
    }

    /// Rebuilds `index` from the maps and removes entries nothing references.
    fn rebuild(&self, index: &mut Index) -> Result<RestoreReport, LbError> {
        let snapshot = self.maps.snapshot().map_err(LbError::Restore)?;
        *index = Index::default();
        let mut report = RestoreReport::default();
        for (&id, record) in &snapshot.services {
            let mut complete = true;
            let mut backends = Vec::new();
            let mut backend_ids = BTreeMap::new();
            let mut entries = Vec::new();
            for index in 0..u32::from(record.backend_count) {
                match snapshot
                    .service_backends
                    .get(&LbSvcBackendKey { service_id: id, index })
                {
                    Some(entry) => entries.push(entry),
                    None => complete = false, // counted in the record, not yet written
                }
            }
            for entry in entries {
                let Some(addr) = snapshot.backends.get(&entry.backend_id).and_then(|b| b.socket_addr()) else {
                    complete = false; // written in the record, not yet in lb_backends
                    continue;
                };
                if backend_ids.insert(addr, entry.backend_id).is_some() {
                    complete = false;
                    continue;
                }
                backends.push(Backend {
                    addr,
                    terminating: entry.flags & LB_SVC_BACKEND_TERMINATING != 0,
                    node_local: entry.flags & LB_SVC_BACKEND_NODE_LOCAL != 0,
                });
            }
            backends.sort_unstable_by_key(|b| b.addr);
            let mut frontends: Vec<Frontend> = snapshot
                .frontends
                .iter()
                .filter(|(key, value)| value.service_id == id && key.scope == SVC_SCOPE_INTERNAL)
                .map(|(key, _)| match key.ip() {
                    Some(ip) => Frontend::ClusterIp(SocketAddr::new(ip, key.port())),
                    None => Frontend::NodePort(key.port()),
                })
                .collect();
            frontends.sort_unstable();
            let service = Service {
                id,
                family: record.family,
                protocol: record.protocol,
                frontends,
                backends,
                affinity_timeout: record.affinity_timeout,
                local: record.flags & u32::from(SVC_F_LOCAL) != 0,
            };
            let external_table_id = if service.has_external_table() {
                record.external_table_id
            } else {
                0
            };
            let rendered = render(&service, record.table_id, external_table_id, &backend_ids);
            complete &= rendered.record == *record
                && rendered
                    .tables
                    .iter()
                    .all(|(tid, table)| snapshot.tables.get(tid) == Some(table))
                && snapshot.rev_nat.get(&id) == Some(&rendered.rev_nat)
                && rendered
                    .frontends
                    .iter()
                    .all(|(key, value)| snapshot.frontends.get(key) == Some(value));
            for (addr, backend_id) in &backend_ids {
                let active = service.backends.iter().any(|b| b.addr == *addr && !b.terminating);
                let slot = index.backends.entry(*addr).or_insert_with(|| BackendSlot {
                    id: *backend_id,
                    users: BTreeMap::new(),
                    written: snapshot.backends.get(backend_id).copied(),
                });
                slot.users.insert(id, active);
                index.backend_addrs.insert(*backend_id, *addr);
            }
            for tid in [record.table_id, record.external_table_id] {
                if tid != 0 {
                    index.tables.insert(tid);
                }
            }
            for key in snapshot
                .frontends
                .iter()
                .filter(|(_, v)| v.service_id == id)
                .map(|(k, _)| *k)
            {
                index.frontend_owner.insert(key, id);
            }
            report.services += 1;
            if !complete {
                report.incomplete += 1;
            }
            index.services.insert(
                id,
                Realised {
                    service,
                    table_id: record.table_id,
                    external_table_id: record.external_table_id,
                    backend_ids,
                    rendered,
                    complete,
                    list_len: usize::from(record.backend_count),
                },
            );
        }
        index.next_backend_id = index.backend_addrs.keys().next_back().map_or(1, |id| id + 1);
        index.next_table_id = index.tables.iter().next_back().map_or(1, |id| id + 1);

        // Orphans, in removal order: frontends, reverse NAT, tables,
        // backend lists past their record's count, backends.
        let mut orphans = 0;
        for key in snapshot
            .frontends
            .keys()
            .filter(|k| !index.frontend_owner.contains_key(k))
        {
            self.maps
                .write(LbWrite::Frontend(key, None))
                .map_err(LbError::Restore)?;
            orphans += 1;
        }
        for id in snapshot.rev_nat.keys().filter(|id| !index.services.contains_key(id)) {
            self.maps.write(LbWrite::RevNat(*id, None)).map_err(LbError::Restore)?;
            orphans += 1;
        }
        for id in snapshot.tables.keys().filter(|id| !index.tables.contains(id)) {
            self.maps.write(LbWrite::Table(*id, None)).map_err(LbError::Restore)?;
            orphans += 1;
        }
        for key in snapshot.service_backends.keys().filter(|k| {
            snapshot
                .services
                .get(&k.service_id)
                .is_none_or(|r| k.index >= u32::from(r.backend_count))
        }) {
            self.maps
                .write(LbWrite::ServiceBackend(*key, None))
                .map_err(LbError::Restore)?;
            orphans += 1;
        }
        for id in snapshot
            .backends
            .keys()
            .filter(|id| !index.backend_addrs.contains_key(id))
        {
            self.maps.write(LbWrite::Backend(*id, None)).map_err(LbError::Restore)?;
            orphans += 1;
        }
        // A backend whose state no longer says what its services say.
        for (addr, slot) in &mut index.backends {
            let desired = slot.desired(*addr);
            if slot.written != Some(desired) {
                self.maps
                    .write(LbWrite::Backend(slot.id, Some(&desired)))
                    .map_err(LbError::Restore)?;
                slot.written = Some(desired);
            }
        }
        report.orphans_removed = orphans;
        Ok(report)
    }

    /// Runs `change`; if it fails, the index is rebuilt from the maps (a
    /// write may have happened or not) and the error returned.
    fn changing<R>(&self, f: impl FnOnce(&mut Index) -> Result<R, LbError>) -> Result<R, LbError> {
        let mut index = self.lock();
        match f(&mut index) {
            Ok(r) => Ok(r),
            Err(e @ (LbError::FrontendHeld { .. } | LbError::MapFull { .. })) => Err(e),
            Err(e) => {
                if let Err(restore) = self.rebuild(&mut index) {
                    tracing::warn!("rebuilding the service index after a failed write: {restore}");
                }
                Err(e)
            }
        }
    }

    /// Creates or replaces `service`; `Ok(false)` if the maps already held it.
    pub fn upsert(&self, service: &Service) -> Result<bool, LbError> {
        self.changing(|index| self.upsert_in(index, service))
    }

    fn check_capacity(&self, index: &Index, service: &Service, new_keys: &[LbFrontendKey]) -> Result<(), LbError> {
        let old = index.services.get(&service.id);
        let check = |map, needed: usize, max: u32| {
            if needed > max as usize {
                Err(LbError::MapFull {
                    service_id: service.id,
                    map,
                    needed,
                    max,
                })
            } else {
                Ok(())
            }
        };
        let services = index.services.len() + usize::from(old.is_none());
        check(MAP_LB_SERVICES, services, self.capacity.services)?;
        check(MAP_LB_REV_NAT, services, self.capacity.services)?;
        let frontends = index.frontend_owner.len()
            + new_keys
                .iter()
                .filter(|k| !index.frontend_owner.contains_key(k))
                .count();
        check(MAP_LB_FRONTENDS, frontends, self.capacity.frontends)?;
        let new_backends = service
            .backends
            .iter()
            .filter(|b| !index.backends.contains_key(&b.addr))
            .count();
        check(
            MAP_LB_BACKENDS,
            index.backends.len() + new_backends,
            self.capacity.backends,
        )?;
        let memberships: usize = index
            .services
            .values()
            .filter(|r| r.service.id != service.id)
            .map(|r| r.service.backends.len())
            .sum();
        check(
            MAP_LB_SVC_BACKENDS,
            memberships + service.backends.len(),
            self.capacity.service_backends,
        )?;
        let new_tables = usize::from(old.is_none())
            + usize::from(service.has_external_table() && old.is_none_or(|o| o.external_table_id == 0));
        check(MAP_LB_MAGLEV, index.tables.len() + new_tables, self.capacity.tables)
    }

    fn upsert_in(&self, index: &mut Index, service: &Service) -> Result<bool, LbError> {
        let id = service.id;
        let keys = service.frontend_keys();
        if let Some((key, holder)) = keys
            .iter()
            .find_map(|k| index.frontend_owner.get(k).filter(|h| **h != id).map(|h| (k, *h)))
        {
            return Err(LbError::FrontendHeld {
                service_id: id,
                frontend: frontend_name(key),
                holder,
            });
        }
        let old = index.services.get(&id);
        if let Some(old) = old
            && old.complete
            && old.service == *service
        {
            return Ok(false);
        }
        self.check_capacity(index, service, &keys)?;

        // Ids: the service's tables stay; backends keep theirs.
        let old = index.services.remove(&id);
        let table_id = match &old {
            Some(o) => o.table_id,
            None => index.alloc_table(),
        };
        let external_table_id = match (&old, service.has_external_table()) {
            (Some(o), true) if o.external_table_id != 0 => o.external_table_id,
            (_, true) => index.alloc_table(),
            (_, false) => 0,
        };
        let mut backend_ids = BTreeMap::new();
        for backend in &service.backends {
            let backend_id = match index.backends.get(&backend.addr) {
                Some(slot) => slot.id,
                None => {
                    let backend_id = index.alloc_backend();
                    index.backend_addrs.insert(backend_id, backend.addr);
                    index.backends.insert(
                        backend.addr,
                        BackendSlot {
                            id: backend_id,
                            users: BTreeMap::new(),
                            written: None,
                        },
                    );
                    backend_id
                }
            };
            backend_ids.insert(backend.addr, backend_id);
        }
        let rendered = render(service, table_id, external_table_id, &backend_ids);
        // Anything the maps may not hold is written again.
        let previous = old.as_ref().filter(|o| o.complete).map(|o| &o.rendered);

        // 1. The backend list, the record, the list's entries past it.
        for (index, entry) in (0u32..).zip(&rendered.backends) {
            if previous.is_none_or(|p| p.backends.get(index as usize) != Some(entry)) {
                let key = LbSvcBackendKey { service_id: id, index };
                self.write(id, LbWrite::ServiceBackend(key, Some(entry)))?;
            }
        }
        if previous.is_none_or(|p| p.record != rendered.record) {
            self.write(id, LbWrite::Service(id, Some(&rendered.record)))?;
        }
        if let Some(old) = &old {
            for index in rendered.backends.len()..old.list_len {
                let key = LbSvcBackendKey {
                    service_id: id,
                    index: index as u32,
                };
                self.write(id, LbWrite::ServiceBackend(key, None))?;
            }
        }
        // 2. Backends: this service's use of each, and their entries.
        for backend in &service.backends {
            let slot = index.backends.get_mut(&backend.addr).expect("allocated above");
            slot.users.insert(id, !backend.terminating);
            let desired = slot.desired(backend.addr);
            if slot.written != Some(desired) {
                self.write(id, LbWrite::Backend(slot.id, Some(&desired)))?;
                slot.written = Some(desired);
            }
        }
        // 3. Tables, 4. reverse NAT.
        for (tid, table) in &rendered.tables {
            if previous.is_none_or(|p| p.tables.get(tid) != Some(table)) {
                self.write(id, LbWrite::Table(*tid, Some(table)))?;
            }
        }
        if previous.is_none_or(|p| p.rev_nat != rendered.rev_nat) {
            self.write(id, LbWrite::RevNat(id, Some(&rendered.rev_nat)))?;
        }
        // 5. Frontends, then the ones it no longer has.
        for (key, value) in &rendered.frontends {
            if previous.is_none_or(|p| p.frontends.get(key) != Some(value)) {
                self.write(id, LbWrite::Frontend(key, Some(value)))?;
            }
            index.frontend_owner.insert(*key, id);
        }
        if let Some(old) = &old {
            for key in old
                .rendered
                .frontends
                .keys()
                .filter(|k| !rendered.frontends.contains_key(k))
            {
                if index.frontend_owner.get(key) == Some(&id) {
                    self.write(id, LbWrite::Frontend(key, None))?;
                    index.frontend_owner.remove(key);
                }
            }
            // 6. A table no longer needed, backends it no longer has.
            if old.external_table_id != 0 && external_table_id == 0 {
                self.write(id, LbWrite::Table(old.external_table_id, None))?;
                index.tables.remove(&old.external_table_id);
            }
            for addr in old.backend_ids.keys().filter(|a| !backend_ids.contains_key(a)) {
                self.release_backend(index, id, *addr)?;
            }
        }
        index.services.insert(
            id,
            Realised {
                service: service.clone(),
                table_id,
                external_table_id,
                list_len: rendered.backends.len(),
                backend_ids,
                rendered,
                complete: true,
            },
        );
        Ok(true)
    }

    /// Service `id` no longer uses the backend at `addr`: its entry goes
    /// when no service does, or its state follows the remaining users.
    fn release_backend(&self, index: &mut Index, id: u32, addr: SocketAddr) -> Result<(), LbError> {
        let Some(slot) = index.backends.get_mut(&addr) else {
            return Ok(());
        };
        slot.users.remove(&id);
        if slot.users.is_empty() {
            let backend_id = slot.id;
            self.write(id, LbWrite::Backend(backend_id, None))?;
            index.backends.remove(&addr);
            index.backend_addrs.remove(&backend_id);
        } else {
            let desired = slot.desired(addr);
            if slot.written != Some(desired) {
                self.write(id, LbWrite::Backend(slot.id, Some(&desired)))?;
                slot.written = Some(desired);
            }
        }
        Ok(())
    }

    /// Removes service `id`; `Ok(false)` if there was none.
    pub fn delete(&self, id: u32) -> Result<bool, LbError> {
        self.changing(|index| self.delete_in(index, id))
    }

    fn delete_in(&self, index: &mut Index, id: u32) -> Result<bool, LbError> {
        let Some(old) = index.services.remove(&id) else {
            return Ok(false);
        };
        let owned: Vec<LbFrontendKey> = index
            .frontend_owner
            .iter()
            .filter(|(_, owner)| **owner == id)
            .map(|(k, _)| *k)
            .collect();
        for key in owned {
            self.write(id, LbWrite::Frontend(&key, None))?;
            index.frontend_owner.remove(&key);
        }
        self.write(id, LbWrite::RevNat(id, None))?;
        for tid in [old.table_id, old.external_table_id] {
            if tid != 0 {
                self.write(id, LbWrite::Table(tid, None))?;
                index.tables.remove(&tid);
            }
        }
        self.write(id, LbWrite::Service(id, None))?;
        for index in 0..old.list_len {
            let key = LbSvcBackendKey {
                service_id: id,
                index: index as u32,
            };
            self.write(id, LbWrite::ServiceBackend(key, None))?;
        }
        for addr in old.backend_ids.keys() {
            self.release_backend(index, id, *addr)?;
        }
        Ok(true)
    }

    /// Makes `services` the whole set: the services not in it go first,
    /// then frontends moving between services are released by their old
    /// holder, then each service is upserted.
    pub fn replace(&self, services: &[Service]) -> Result<ReplaceReport, LbError> {
        self.changing(|index| {
            let mut report = ReplaceReport::default();
            let wanted: BTreeSet<u32> = services.iter().map(|s| s.id).collect();
            let gone: Vec<u32> = index
                .services
                .keys()
                .filter(|id| !wanted.contains(id))
                .copied()
                .collect();
            for id in gone {
                self.delete_in(index, id)?;
                report.deleted += 1;
            }
            for service in services {
                for key in service.frontend_keys() {
                    let Some(holder) = index.frontend_owner.get(&key).copied().filter(|h| *h != service.id) else {
                        continue;
                    };
                    self.write(holder, LbWrite::Frontend(&key, None))?;
                    index.frontend_owner.remove(&key);
                    if let Some(r) = index.services.get_mut(&holder) {
                        r.complete = false;
                    }
                }
            }
            for service in services {
                if self.upsert_in(index, service)? {
                    report.upserted += 1;
                } else {
                    report.unchanged += 1;
                }
            }
            Ok(report)
        })
    }

    /// Every service with its ids and Maglev slots, by service id.
    pub fn list(&self) -> Vec<ServiceStatus> {
        let index = self.lock();
        index
            .services
            .values()
            .map(|r| {
                let slots = r
                    .rendered
                    .tables
                    .get(&r.table_id)
                    .map(|t| maglev::slot_counts(t))
                    .unwrap_or_default();
                ServiceStatus {
                    service: r.service.clone(),
                    table_id: r.table_id,
                    external_table_id: r.external_table_id,
                    backends: r
                        .service
                        .backends
                        .iter()
                        .map(|b| {
                            let id = r.backend_ids[&b.addr];
                            (id, slots.get(&id).copied().unwrap_or(0))
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// Entries of the flow maps and of `lb_affinity` now.
    pub fn dynamic_entries(&self) -> Result<(u64, u64), LbMapError> {
        self.maps.dynamic_entries()
    }
}

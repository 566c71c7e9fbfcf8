//! [`EndpointDatapath`]: the loader's operations on the datapath, free of
//! gRPC. Every change is checked whole before the first map write; writes
//! are ordered so a program never sees a half-made endpoint (policy, then
//! addresses, then the ifindex entry that enables it, then the attach).
//!
//! # Concurrency
//!
//! An apply or remove holds its endpoint's lock, then its interface's
//! (`KeyedLocks`, always in that order), for the whole operation, netlink
//! included: calls for one endpoint (or one interface) run one after the
//! other, calls for different ones in parallel. What must be decided across
//! endpoints — which endpoint holds an interface or an address — lives in
//! one `Index` whose lock is held for in-memory checks only, never across
//! a syscall; the checks reserve the interface and addresses before the
//! first write, so two endpoints never both pass them. Maps have their own
//! short locks ([`crate::datapath::SharedMap`]).
//!
//! # The index equals what the maps hold
//!
//! Per endpoint the loader remembers the entries it wrote to the shared
//! per-endpoint maps (`OwnedEntries`: the policy trie and `ep_prefixes`), so the next
//! policy is a diff against them instead of a scan of a map every endpoint
//! shares. Each step of a diff is recorded as it succeeds (a failed BPF map
//! command changes nothing), so a diff that fails midway leaves the record
//! equal to the map: no ALLOW the record does not know (which no later diff
//! would remove), no entry the record has and the map lacks. A failure also
//! marks the record dirty: before the endpoint's next diff, its entries are
//! read back from the map, the truth, which covers what a record cannot
//! know (a panic in the middle of a step, a map changed by hand). Reading
//! back scans the whole trie (it is shared, there is no per-endpoint
//! range), which is fine after a failure and too slow for every
//! regeneration — hence the record. Another kind of per-endpoint entries
//! gets its own `OwnedEntries` in `EndpointRecord` and the same three
//! steps: read back when dirty, diff, `OwnedEntries::write`.
//!
//! # Established connections follow policy changes
//!
//! Conntrack entries cache their policy verdict with the datapath's policy
//! revision ([`Datapath::bump_policy_revision`]). Every operation that may
//! write to a map a verdict reads (endpoints, policy, ep_prefixes, ipcache)
//! holds a `RevisionBump` that bumps the revision after its last write
//! when it changed something, and also when it failed or panicked half-way
//! (a bump too many only costs each connection one policy lookup).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::datapath::{self, AttachState, Attachment, Datapath, DatapathError};
use crate::netdev;
use crate::policy_lpm::{self, PolicyEntry, PolicyRuleError};
use crate::validate::{EndpointSpec, PolicyPrefix, PolicySpec};
use rivet_datapath::maps::{
    DIR_EGRESS, DIR_INGRESS, EP_F_ALLOW_FROM_HOST, EP_F_EGRESS_PREFIXES, EP_F_ENFORCE_EGRESS, EP_F_ENFORCE_INGRESS,
    EP_F_INGRESS_PREFIXES, EndpointInfo, EndpointKey, EpPrefixKey, EpPrefixValue, IpcacheKey, IpcacheValue,
    PolicyValue,
};

/// Why an operation was refused or failed. Nothing was changed unless the
/// variant says so.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// No interface with that index in the loader's network namespace.
    #[error("no interface with index {ifindex} in the node's network namespace")]
    InterfaceNotFound {
        /// The index.
        ifindex: u32,
    },
    /// The interface is not a veth: the loader only acts on endpoint veths.
    #[error("interface {ifname} (index {ifindex}) is a {driver} device, not a veth; refusing to touch it")]
    NotAVeth {
        /// Index.
        ifindex: u32,
        /// Name.
        ifname: String,
        /// Its driver.
        driver: String,
    },
    /// The interface name lacks the endpoint prefix.
    #[error("interface {ifname} (index {ifindex}) does not carry the endpoint prefix {prefix:?}; refusing to touch it")]
    WrongPrefix {
        /// Index.
        ifindex: u32,
        /// Name.
        ifname: String,
        /// The configured prefix.
        prefix: String,
    },
    /// Another endpoint owns the interface.
    #[error("interface index {ifindex} belongs to endpoint {owner}")]
    InterfaceHeld {
        /// Index.
        ifindex: u32,
        /// Its endpoint.
        owner: u32,
    },
    /// Another endpoint owns an address.
    #[error("address {address} belongs to endpoint {owner}")]
    AddressHeld {
        /// The address.
        address: IpAddr,
        /// Its endpoint.
        owner: u32,
    },
    /// The endpoint id is attached to another interface.
    #[error("endpoint {endpoint_id} is attached to interface index {ifindex}; remove it first")]
    EndpointElsewhere {
        /// The endpoint.
        endpoint_id: u32,
        /// Its interface.
        ifindex: u32,
    },
    /// No such endpoint.
    #[error("endpoint {0} is not in the datapath")]
    UnknownEndpoint(u32),
    /// The policy cannot be compiled.
    #[error("policy: {0}")]
    Policy(#[from] PolicyRuleError),
    /// Reading an interface failed.
    #[error("inspecting interface index {ifindex}: {source}")]
    Interface {
        /// Index.
        ifindex: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// A map write or attach failed (possibly after earlier steps applied;
    /// re-applying the same request converges).
    #[error("{action}: {source}")]
    Datapath {
        /// What was being done.
        action: String,
        /// The error (boxed: it is large).
        source: Box<DatapathError>,
    },
    /// A map operation failed.
    #[error("{action}: {source}")]
    Map {
        /// What was being done.
        action: String,
        /// The error.
        source: aya::maps::MapError,
    },
}

fn map_err(action: impl Into<String>) -> impl FnOnce(aya::maps::MapError) -> LoaderError {
    let action = action.into();
    move |source| LoaderError::Map { action, source }
}

/// Whether a map delete failed because the key was not there: aya 0.14
/// reports that as the syscall's ENOENT, never as `KeyNotFound`.
fn is_absent(error: &aya::maps::MapError) -> bool {
    match error {
        aya::maps::MapError::KeyNotFound => true,
        aya::maps::MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Bumps the datapath's policy revision once the operation holding it is
/// done: when [`finish`](Self::finish)ed with a change, or dropped without
/// being finished (an error or a panic after a write may have left one).
struct RevisionBump<'a> {
    datapath: &'a Datapath,
    armed: bool,
}

impl<'a> RevisionBump<'a> {
    fn new(datapath: &'a Datapath) -> Self {
        Self { datapath, armed: true }
    }

    /// The operation is done; bumps if it `changed` a map a verdict reads.
    fn finish(mut self, changed: bool) -> Result<(), LoaderError> {
        self.armed = false;
        if !changed {
            return Ok(());
        }
        self.datapath
            .bump_policy_revision()
            .map(drop)
            .map_err(|source| LoaderError::Datapath {
                action: "bumping the policy revision".to_owned(),
                source: Box::new(source),
            })
    }
}

impl Drop for RevisionBump<'_> {
    fn drop(&mut self) {
        if self.armed
            && let Err(error) = self.datapath.bump_policy_revision()
        {
            tracing::error!(%error, "bumping the policy revision after a failed change");
        }
    }
}

/// The result of [`EndpointDatapath::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The endpoint as the datapath now holds it.
    pub info: EndpointInfo,
    /// Whether anything changed.
    pub changed: bool,
    /// Policy entries in the map for it.
    pub policy_entries: usize,
}

/// An endpoint as the datapath holds it, with its attachment.
#[derive(Debug, Clone)]
pub struct EndpointView {
    /// The map entry.
    pub info: EndpointInfo,
    /// Interface name, if it exists.
    pub ifname: Option<String>,
    /// Policy entries.
    pub policy_entries: usize,
    /// Prefixes of address-matched policy entries.
    pub policy_prefixes: usize,
    /// `from_container` attachment.
    pub ingress: AttachState,
    /// `to_container` attachment.
    pub egress: AttachState,
}

/// An endpoint's host interface, see [`EndpointDatapath::endpoint_interfaces`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInterface {
    /// The endpoint.
    pub endpoint_id: u32,
    /// Its interface index.
    pub ifindex: u32,
    /// The name of the interface at `ifindex` now; `None` when there is
    /// none (the interface is gone).
    pub ifname: Option<String>,
}

/// What the datapath holds, see [`EndpointDatapath::list`].
#[derive(Debug, Clone)]
pub struct DatapathListing {
    /// Endpoints, by id.
    pub endpoints: Vec<EndpointView>,
    /// Attachments of interfaces no endpoint names.
    pub orphan_attachments: Vec<Attachment>,
    /// Endpoint ids with policy entries or prefixes but no endpoint.
    pub orphan_policies: Vec<u32>,
}

/// One compiled policy entry with its counters.
#[derive(Debug, Clone, Copy)]
pub struct PolicyEntryView {
    /// The trie entry.
    pub entry: PolicyEntry,
    /// `VERDICT_*`.
    pub verdict: u8,
    /// Packets that matched it.
    pub packets: u64,
    /// Bytes that matched it.
    pub bytes: u64,
}

/// One endpoint's policy as the datapath holds it, see [`EndpointDatapath::policy`].
#[derive(Debug, Clone)]
pub struct EndpointPolicyView {
    /// The endpoint map entry (flags, revision).
    pub info: EndpointInfo,
    /// The compiled entries with counters.
    pub entries: Vec<PolicyEntryView>,
    /// The prefixes of address-matched entries.
    pub prefixes: Vec<PolicyPrefix>,
}

/// Entries one endpoint owns in a map every endpoint shares, as that map
/// holds them (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
struct OwnedEntries<K, V> {
    entries: BTreeMap<K, V>,
    /// Not known to equal the map: read it back before the next diff.
    dirty: bool,
}

impl<K, V> Default for OwnedEntries<K, V> {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            dirty: false,
        }
    }
}

impl<K: Ord + Copy, V: Copy> OwnedEntries<K, V> {
    /// Entries read from the map.
    fn read_back(entries: BTreeMap<K, V>) -> Self {
        Self { entries, dirty: false }
    }

    /// Applies `steps` in order (`None` removes) with `write`, recording
    /// each one as it takes effect; the first failure marks the entries
    /// dirty and is returned.
    fn write<E>(
        &mut self,
        steps: &[(K, Option<V>)],
        mut write: impl FnMut(&K, Option<V>) -> Result<(), E>,
    ) -> Result<(), E> {
        for (key, value) in steps {
            if let Err(e) = write(key, *value) {
                self.dirty = true;
                return Err(e);
            }
            match value {
                Some(v) => self.entries.insert(*key, *v),
                None => self.entries.remove(key),
            };
        }
        Ok(())
    }
}

/// What the loader holds for one endpoint.
#[derive(Debug, Clone, Default)]
struct EndpointRecord {
    /// Its interface, reserved by the checks of its first apply.
    ifindex: Option<u32>,
    /// Its addresses, reserved likewise (old ones until an apply dropped them).
    addresses: Vec<IpAddr>,
    /// Its entries in the policy trie.
    policy: OwnedEntries<PolicyEntry, u8>,
    /// Its entries in `ep_prefixes` (key → CIDR identity).
    prefixes: OwnedEntries<EpPrefixKey, u32>,
}

impl EndpointRecord {
    fn holds_nothing(&self) -> bool {
        self.ifindex.is_none()
            && self.addresses.is_empty()
            && self.policy == OwnedEntries::default()
            && self.prefixes == OwnedEntries::default()
    }

    /// Whether it has (or may have) entries in the per-endpoint maps.
    fn has_policy(&self) -> bool {
        !self.policy.entries.is_empty() || self.policy.dirty || !self.prefixes.entries.is_empty() || self.prefixes.dirty
    }
}

/// An endpoint's `ep_prefixes` entries for a policy.
fn prefix_entries(endpoint_id: u32, prefixes: &[PolicyPrefix]) -> BTreeMap<EpPrefixKey, u32> {
    prefixes
        .iter()
        .map(|p| {
            let key = EpPrefixKey::new(endpoint_id, p.direction, p.addr, p.len).expect("validated prefix");
            (key, p.cidr_identity)
        })
        .collect()
}

/// The `EP_F_*_PREFIXES` flags of the directions that have prefixes.
fn prefix_flags<'a>(keys: impl IntoIterator<Item = &'a EpPrefixKey>) -> u32 {
    keys.into_iter().fold(0, |flags, k| match k.data.direction {
        DIR_INGRESS => flags | EP_F_INGRESS_PREFIXES,
        DIR_EGRESS => flags | EP_F_EGRESS_PREFIXES,
        _ => flags,
    })
}

/// The steps from `current` to `desired` prefixes: new and changed ones
/// first, then the stale ones removed.
fn prefix_steps(
    current: &BTreeMap<EpPrefixKey, u32>,
    desired: &BTreeMap<EpPrefixKey, u32>,
) -> Vec<(EpPrefixKey, Option<u32>)> {
    let upserts = desired
        .iter()
        .filter(|(k, v)| current.get(k) != Some(v))
        .map(|(k, v)| (*k, Some(*v)));
    let removals = current.keys().filter(|k| !desired.contains_key(k)).map(|k| (*k, None));
    upserts.chain(removals).collect()
}

/// Who holds what, across endpoints. Its lock is held for in-memory work
/// only. `interfaces` and `addresses` are the inverse of the records'
/// `ifindex` and `addresses`; only the methods below change either side.
#[derive(Debug, Default)]
struct Index {
    endpoints: HashMap<u32, EndpointRecord>,
    /// ifindex → endpoint.
    interfaces: HashMap<u32, u32>,
    /// address → endpoint.
    addresses: HashMap<IpAddr, u32>,
}

impl Index {
    /// Endpoint `id` holds `ifindex` (if given) and `addresses`, besides
    /// the addresses it held.
    fn hold(&mut self, id: u32, ifindex: Option<u32>, addresses: &[IpAddr]) {
        let record = self.endpoints.entry(id).or_default();
        if let Some(ifindex) = ifindex {
            record.ifindex = Some(ifindex);
            self.interfaces.insert(ifindex, id);
        }
        for address in addresses {
            if !record.addresses.contains(address) {
                record.addresses.push(*address);
            }
            self.addresses.insert(*address, id);
        }
    }

    /// The checks of an apply of endpoint `id` on `ifindex` with
    /// `addresses`, and their reservations (one step, so two endpoints never
    /// both pass). Returns the addresses the endpoint held before.
    fn reserve(&mut self, id: u32, ifindex: u32, addresses: &[IpAddr]) -> Result<Vec<IpAddr>, LoaderError> {
        if let Some(&owner) = self.interfaces.get(&ifindex)
            && owner != id
        {
            return Err(LoaderError::InterfaceHeld { ifindex, owner });
        }
        if let Some(other) = self.endpoints.get(&id).and_then(|r| r.ifindex)
            && other != ifindex
        {
            return Err(LoaderError::EndpointElsewhere {
                endpoint_id: id,
                ifindex: other,
            });
        }
        for address in addresses {
            if let Some(&owner) = self.addresses.get(address)
                && owner != id
            {
                return Err(LoaderError::AddressHeld {
                    address: *address,
                    owner,
                });
            }
        }
        let previous = self.endpoints.get(&id).map(|r| r.addresses.clone()).unwrap_or_default();
        self.hold(id, Some(ifindex), addresses);
        Ok(previous)
    }

    /// Endpoint `id` holds exactly `addresses` now: the others it held are
    /// released.
    fn keep_addresses(&mut self, id: u32, addresses: &[IpAddr]) {
        let record = self.endpoints.entry(id).or_default();
        for address in std::mem::replace(&mut record.addresses, addresses.to_vec()) {
            if !addresses.contains(&address) && self.addresses.get(&address) == Some(&id) {
                self.addresses.remove(&address);
            }
        }
    }

    /// Releases `ifindex` and `addresses` where endpoint `id` holds them,
    /// and its record's; forgets the record when nothing else is left in it.
    fn release(&mut self, id: u32, ifindex: Option<u32>, addresses: &[IpAddr]) {
        if let Some(i) = ifindex
            && self.interfaces.get(&i) == Some(&id)
        {
            self.interfaces.remove(&i);
        }
        for a in addresses {
            if self.addresses.get(a) == Some(&id) {
                self.addresses.remove(a);
            }
        }
        if let Some(record) = self.endpoints.get_mut(&id) {
            record.ifindex = None;
            record.addresses.clear();
            if record.holds_nothing() {
                self.endpoints.remove(&id);
            }
        }
    }
}

/// Locks by number (endpoint id, ifindex): one holder per key at a time;
/// nothing is kept for keys nobody holds.
#[derive(Debug, Default)]
struct KeyedLocks {
    state: Mutex<HeldKeys>,
    /// A key was released: its waiters look again.
    released: Condvar,
    /// A caller started waiting or woke up (only tests wait on it: a waiter
    /// notifying the condvar other waiters sleep on would wake them, and
    /// they it, over and over while the key stays held).
    waiters_changed: Condvar,
}

#[derive(Debug, Default)]
struct HeldKeys {
    held: HashSet<u32>,
    /// Callers waiting for a key (tests wait for them).
    waiting: usize,
    /// Times a waiter woke up to look again (tests check that waiters sleep).
    wakeups: u64,
}

/// A held key of [`KeyedLocks`]; released on drop.
struct KeyGuard<'a> {
    locks: &'a KeyedLocks,
    key: u32,
}

impl KeyedLocks {
    /// Waits until `key` is free and takes it (blocking: call from a
    /// blocking thread).
    fn lock(&self, key: u32) -> KeyGuard<'_> {
        let mut state = lock(&self.state);
        while state.held.contains(&key) {
            state.waiting += 1;
            self.waiters_changed.notify_all();
            state = self.released.wait(state).unwrap_or_else(PoisonError::into_inner);
            state.waiting -= 1;
            state.wakeups += 1;
            self.waiters_changed.notify_all();
        }
        state.held.insert(key);
        KeyGuard { locks: self, key }
    }
}

#[cfg(test)]
impl KeyedLocks {
    /// Waits until `n` callers wait for a key, at most `bound`.
    fn wait_for_waiters(&self, n: usize, bound: std::time::Duration) {
        let state = lock(&self.state);
        let (state, _) = self
            .waiters_changed
            .wait_timeout_while(state, bound, |s| s.waiting < n)
            .unwrap_or_else(PoisonError::into_inner);
        assert!(
            state.waiting >= n,
            "{} callers wait for a key, expected {n}",
            state.waiting
        );
    }

    /// Waits up to `bound` for a waiter to wake up after `wakeups` wake-ups;
    /// returns the wake-ups then.
    fn wakeups_after(&self, wakeups: u64, bound: std::time::Duration) -> u64 {
        let state = lock(&self.state);
        let (state, _) = self
            .waiters_changed
            .wait_timeout_while(state, bound, |s| s.wakeups == wakeups)
            .unwrap_or_else(PoisonError::into_inner);
        state.wakeups
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        lock(&self.locks.state).held.remove(&self.key);
        self.locks.released.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain data: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A test's hook just before an apply attaches (called with the ifindex).
#[cfg(test)]
type AttachGate = std::sync::Arc<dyn Fn(u32) + Send + Sync>;

/// The endpoint-facing operations on the node's datapath; see the module
/// docs for locking and for how the index stays equal to the maps.
pub struct EndpointDatapath {
    datapath: Datapath,
    index: Mutex<Index>,
    endpoint_locks: KeyedLocks,
    interface_locks: KeyedLocks,
    interface_prefix: String,
    /// Called just before an apply attaches (tests hold an attach there).
    #[cfg(test)]
    attach_gate: Mutex<Option<AttachGate>>,
}

impl std::fmt::Debug for EndpointDatapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointDatapath")
            .field("interface_prefix", &self.interface_prefix)
            .finish_non_exhaustive()
    }
}

impl EndpointDatapath {
    /// Wraps an opened datapath; rebuilds the index from the pinned maps
    /// (they survive loader restarts).
    pub fn new(datapath: Datapath, interface_prefix: impl Into<String>) -> Result<Self, LoaderError> {
        let mut index = Index::default();
        for item in datapath.maps().endpoints.lock().iter() {
            let (k, v) = item.map_err(map_err("reading the endpoints map"))?;
            let address: Vec<IpAddr> = k.as_ip().into_iter().collect();
            index.hold(v.endpoint_id, k.as_ifindex(), &address);
        }
        for (id, entries) in read_policy(&datapath, None)? {
            index.endpoints.entry(id).or_default().policy = OwnedEntries::read_back(entries);
        }
        for (id, entries) in read_prefixes(&datapath, None)? {
            index.endpoints.entry(id).or_default().prefixes = OwnedEntries::read_back(entries);
        }
        tracing::info!(
            endpoints = index.interfaces.len(),
            policy_endpoints = index
                .endpoints
                .values()
                .filter(|r| !r.policy.entries.is_empty())
                .count(),
            prefix_endpoints = index
                .endpoints
                .values()
                .filter(|r| !r.prefixes.entries.is_empty())
                .count(),
            "datapath state adopted from pinned maps"
        );
        Ok(Self {
            datapath,
            index: Mutex::new(index),
            endpoint_locks: KeyedLocks::default(),
            interface_locks: KeyedLocks::default(),
            interface_prefix: interface_prefix.into(),
            #[cfg(test)]
            attach_gate: Mutex::new(None),
        })
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        lock(&self.index)
    }

    /// The datapath (maps, config, program ids); safe to use from any thread.
    pub fn datapath(&self) -> &Datapath {
        &self.datapath
    }

    /// Names of the interfaces that still serve a pod: an endpoint's whose
    /// interface exists, and any carrying our endpoint filters without an
    /// endpoint. Empty: no pod of this node uses the datapath (what
    /// [`crate::uninstall`] asks). A removed endpoint's veth that the kernel
    /// has not yet destroyed with its pod's namespace (asynchronous) does
    /// not count.
    pub fn pod_interfaces(&self) -> Result<Vec<String>, LoaderError> {
        let listing = self.list()?;
        let name =
            |ifname: &Option<String>, ifindex: u32| ifname.clone().unwrap_or_else(|| format!("ifindex {ifindex}"));
        Ok(listing
            .endpoints
            .iter()
            .filter(|e| e.ifname.is_some())
            .map(|e| name(&e.ifname, e.info.ifindex))
            .chain(listing.orphan_attachments.iter().map(|a| name(&a.ifname, a.ifindex)))
            .collect())
    }

    /// Checks that `ifindex` is an endpoint veth this loader may act on;
    /// returns its name and MAC.
    pub fn check_interface(&self, ifindex: u32) -> Result<(String, [u8; 6]), LoaderError> {
        let io = |source| LoaderError::Interface { ifindex, source };
        let ifname = netdev::ifindex_to_name(ifindex)
            .map_err(io)?
            .ok_or(LoaderError::InterfaceNotFound { ifindex })?;
        if !netdev::is_veth(ifindex).map_err(io)? {
            let driver = netdev::driver(ifindex)
                .map_err(io)?
                .unwrap_or_else(|| "non-veth".into());
            return Err(LoaderError::NotAVeth {
                ifindex,
                ifname,
                driver,
            });
        }
        if !ifname.starts_with(&self.interface_prefix) {
            return Err(LoaderError::WrongPrefix {
                ifindex,
                ifname,
                prefix: self.interface_prefix.clone(),
            });
        }
        let mac = netdev::host_mac(ifindex).map_err(io)?;
        Ok((ifname, mac))
    }

    /// Realises an endpoint: policy, map entries, attachment. Idempotent.
    pub fn apply(&self, spec: &EndpointSpec) -> Result<Applied, LoaderError> {
        let started = std::time::Instant::now();
        let (_ifname, node_mac) = self.check_interface(spec.ifindex)?;
        // Policy: the request's, or the current one, or fail closed.
        let desired_policy = match &spec.policy {
            Some(p) => Some((
                policy_lpm::compile(spec.endpoint_id, &p.rules)?,
                prefix_entries(spec.endpoint_id, &p.prefixes),
            )),
            None => None,
        };
        let id = spec.endpoint_id;
        let addresses: Vec<IpAddr> = spec
            .ipv4
            .map(IpAddr::V4)
            .into_iter()
            .chain(spec.ipv6.map(IpAddr::V6))
            .collect();
        let _endpoint = self.endpoint_locks.lock(id);
        let _interface = self.interface_locks.lock(spec.ifindex);
        let previous_addresses = self.index().reserve(id, spec.ifindex, &addresses)?;

        let ifkey = EndpointKey::ifindex(spec.ifindex);
        let bump = RevisionBump::new(&self.datapath);
        let existing = self.datapath.maps().endpoints.lock().get(&ifkey, 0).ok();
        let (flags, revision) = match (&desired_policy, &spec.policy, existing) {
            (Some((_, prefixes)), Some(p), _) => (policy_flags(p) | prefix_flags(prefixes.keys()), p.revision),
            (_, _, Some(e)) => (
                e.flags
                    & (EP_F_ENFORCE_INGRESS
                        | EP_F_ENFORCE_EGRESS
                        | EP_F_ALLOW_FROM_HOST
                        | EP_F_INGRESS_PREFIXES
                        | EP_F_EGRESS_PREFIXES),
                e.policy_revision,
            ),
            _ => (EP_F_ENFORCE_INGRESS | EP_F_ENFORCE_EGRESS, 0),
        };
        let mut info = EndpointInfo {
            endpoint_id: id,
            identity: spec.identity,
            ifindex: spec.ifindex,
            flags,
            mac: spec.mac,
            node_mac,
            ..EndpointInfo::default()
        };
        info.set_ipv4(spec.ipv4);
        info.set_ipv6(spec.ipv6);
        info.policy_revision = revision;

        let mut changed = false;
        // Whether a map a verdict reads changed: not when only the endpoint
        // entry's copy of svc-endpoint's revision did (no program reads it).
        let mut verdicts_changed = false;
        if let Some((desired, desired_prefixes)) = &desired_policy {
            // Prefix lookups on before any prefix or address entry of the
            // new policy is written; off again (the final entry below) only
            // after the last one went. A lookup that finds nothing changes
            // nothing.
            if let Some(mut e) = existing {
                let widened = e.flags | prefix_flags(desired_prefixes.keys());
                if widened != e.flags {
                    e.flags = widened;
                    self.write_endpoint_entries(&e)?;
                    verdicts_changed = true;
                }
            }
            let policy_changed = self.sync_policy(id, desired, desired_prefixes)?;
            changed |= policy_changed;
            verdicts_changed |= policy_changed;
        }
        // Addresses first, then the ifindex entry that enables the programs.
        if existing != Some(info) {
            let mut endpoints = self.datapath.maps().endpoints.lock();
            for address in &addresses {
                endpoints
                    .insert(EndpointKey::ip(*address), info, 0)
                    .map_err(map_err(format!("writing endpoint {id} address {address}")))?;
            }
            endpoints
                .insert(ifkey, info, 0)
                .map_err(map_err(format!("writing endpoint {id}")))?;
            changed = true;
            let revision_aside = existing.map(|e| EndpointInfo {
                policy_revision: info.policy_revision,
                ..e
            });
            verdicts_changed |= revision_aside != Some(info);
        }
        let dropped: Vec<IpAddr> = previous_addresses
            .into_iter()
            .filter(|a| !addresses.contains(a))
            .collect();
        if !dropped.is_empty() {
            let mut endpoints = self.datapath.maps().endpoints.lock();
            for address in &dropped {
                match endpoints.remove(&EndpointKey::ip(*address)) {
                    Ok(()) => {}
                    Err(e) if is_absent(&e) => {}
                    Err(e) => return Err(map_err(format!("removing endpoint {id} address {address}"))(e)),
                }
            }
            drop(endpoints);
            self.index().keep_addresses(id, &addresses);
            changed = true;
            verdicts_changed = true;
        }
        bump.finish(verdicts_changed)?;
        let maps_done = started.elapsed();
        #[cfg(test)]
        {
            let gate = lock(&self.attach_gate).clone();
            if let Some(gate) = gate {
                gate(spec.ifindex);
            }
        }
        let attach = self
            .datapath
            .attach(spec.ifindex)
            .map_err(|source| LoaderError::Datapath {
                action: format!("attaching endpoint {id} to interface index {}", spec.ifindex),
                source: Box::new(source),
            })?;
        changed |= attach.changed();
        tracing::debug!(
            endpoint_id = id,
            checks_and_maps_us = maps_done.as_micros() as u64,
            attach_us = (started.elapsed() - maps_done).as_micros() as u64,
            "endpoint realised"
        );
        let policy_entries = self.index().endpoints.get(&id).map_or(0, |r| r.policy.entries.len());
        Ok(Applied {
            info,
            changed,
            policy_entries,
        })
    }

    /// Brings endpoint `id`'s policy entries to `desired` and its prefixes
    /// to `desired_prefixes` (under its lock); its record holds what the
    /// maps hold whatever happens. Returns whether anything changed.
    ///
    /// The prefixes change between the policy steps that only narrow and
    /// those that loosen, while the trie holds the deny entries of both
    /// policies and only the allow entries common to both: whatever prefix
    /// a peer address finds on the way, no packet passes that neither
    /// policy allows (a superset of an endpoint's prefixes decides like the
    /// policy that owns them; svc-endpoint's policy module docs prove it).
    fn sync_policy(
        &self,
        id: u32,
        desired: &BTreeMap<PolicyEntry, u8>,
        desired_prefixes: &BTreeMap<EpPrefixKey, u32>,
    ) -> Result<bool, LoaderError> {
        let (mut written, mut prefixes) = {
            let mut index = self.index();
            let record = index.endpoints.entry(id).or_default();
            let before = (record.policy.clone(), record.prefixes.clone());
            // Until the outcome is stored below (a panic leaves them set).
            record.policy.dirty = true;
            record.prefixes.dirty = true;
            before
        };
        let result = (|| {
            if written.dirty {
                let truth = read_policy(&self.datapath, Some(id))?.remove(&id).unwrap_or_default();
                written = OwnedEntries::read_back(truth);
            }
            if prefixes.dirty {
                let truth = read_prefixes(&self.datapath, Some(id))?.remove(&id).unwrap_or_default();
                prefixes = OwnedEntries::read_back(truth);
            }
            let diff = policy_lpm::diff(&written.entries, desired);
            let (tightening, loosening) = diff.phases();
            let prefix_steps = prefix_steps(&prefixes.entries, desired_prefixes);
            written.write(tightening, |entry, verdict| self.write_policy(entry, verdict))?;
            prefixes.write(&prefix_steps, |key, identity| self.write_prefix(key, identity))?;
            written.write(loosening, |entry, verdict| self.write_policy(entry, verdict))?;
            Ok(!diff.is_empty() || !prefix_steps.is_empty())
        })();
        let mut index = self.index();
        let record = index.endpoints.entry(id).or_default();
        record.policy = written;
        record.prefixes = prefixes;
        result
    }

    /// Writes (`Some`) or removes (`None`) one `ep_prefixes` entry.
    fn write_prefix(&self, key: &EpPrefixKey, identity: Option<u32>) -> Result<(), LoaderError> {
        let id = key.data.endpoint_id;
        let mut prefixes = self.datapath.maps().ep_prefixes.lock();
        match identity {
            Some(cidr_identity) => prefixes
                .insert(&key.to_lpm(), EpPrefixValue { cidr_identity }, 0)
                .map_err(map_err(format!("writing a prefix of endpoint {id}"))),
            None => match prefixes.remove(&key.to_lpm()) {
                Ok(()) => Ok(()),
                Err(e) if is_absent(&e) => Ok(()),
                Err(e) => Err(map_err(format!("removing a prefix of endpoint {id}"))(e)),
            },
        }
    }

    /// Writes `info` under its address keys, then its ifindex key.
    fn write_endpoint_entries(&self, info: &EndpointInfo) -> Result<(), LoaderError> {
        let id = info.endpoint_id;
        let mut endpoints = self.datapath.maps().endpoints.lock();
        for address in [info.ipv4_addr().map(IpAddr::V4), info.ipv6_addr().map(IpAddr::V6)]
            .into_iter()
            .flatten()
        {
            endpoints
                .insert(EndpointKey::ip(address), *info, 0)
                .map_err(map_err(format!("writing endpoint {id} address {address}")))?;
        }
        endpoints
            .insert(EndpointKey::ifindex(info.ifindex), *info, 0)
            .map_err(map_err(format!("writing endpoint {id}")))
    }

    /// Writes (`Some`) or removes (`None`) one policy trie entry.
    fn write_policy(&self, entry: &PolicyEntry, verdict: Option<u8>) -> Result<(), LoaderError> {
        let mut policy = self.datapath.maps().policy.lock();
        match verdict {
            Some(v) => policy
                .insert(&entry.lpm_key(), PolicyValue::new(v), 0)
                .map_err(map_err(format!("writing policy of endpoint {}", entry.endpoint_id))),
            None => match policy.remove(&entry.lpm_key()) {
                Ok(()) => Ok(()),
                Err(e) if is_absent(&e) => Ok(()),
                Err(e) => Err(map_err(format!("removing policy of endpoint {}", entry.endpoint_id))(e)),
            },
        }
    }

    /// Removes an endpoint (by id, or whatever Rivet holds for an
    /// interface). Idempotent; returns whether anything was removed.
    pub fn remove(&self, endpoint_id: Option<u32>, ifindex: Option<u32>) -> Result<bool, LoaderError> {
        if let Some(id) = endpoint_id {
            let _endpoint = self.endpoint_locks.lock(id);
            // Stable while its lock is held: only its own apply binds it.
            let bound = self.index().endpoints.get(&id).and_then(|r| r.ifindex);
            let ifindex = bound.or(ifindex);
            let _interface = ifindex.map(|i| self.interface_locks.lock(i));
            // A given interface that another endpoint holds is not this one's.
            let ifindex = ifindex.filter(|i| self.index().interfaces.get(i).is_none_or(|owner| *owner == id));
            return self.remove_locked(id, ifindex);
        }
        let Some(ifindex) = ifindex else {
            return Ok(false);
        };
        // By interface: its owner's lock comes first, so look the owner up,
        // lock, and look again (it may have changed in between).
        loop {
            let owner = self.index().interfaces.get(&ifindex).copied();
            if let Some(id) = owner {
                let _endpoint = self.endpoint_locks.lock(id);
                if self.index().interfaces.get(&ifindex) != Some(&id) {
                    continue;
                }
                let _interface = self.interface_locks.lock(ifindex);
                return self.remove_locked(id, Some(ifindex));
            }
            let _interface = self.interface_locks.lock(ifindex);
            if self.index().interfaces.contains_key(&ifindex) {
                continue;
            }
            return Ok(self.detach(ifindex)?.changed());
        }
    }

    /// [`remove`](Self::remove) with endpoint `id` and its interface locked.
    fn remove_locked(&self, id: u32, ifindex: Option<u32>) -> Result<bool, LoaderError> {
        let record = self.index().endpoints.get(&id).cloned().unwrap_or_default();
        let bump = RevisionBump::new(&self.datapath);
        let mut removed = false;
        let mut addresses = record.addresses.clone();
        {
            // Disable first (ifindex entry), then addresses.
            let mut endpoints = self.datapath.maps().endpoints.lock();
            if let Some(i) = ifindex
                && let Ok(info) = endpoints.get(&EndpointKey::ifindex(i), 0)
                && info.endpoint_id == id
            {
                endpoints
                    .remove(&EndpointKey::ifindex(i))
                    .map_err(map_err(format!("removing endpoint {id}")))?;
                addresses.extend(
                    [info.ipv4_addr().map(IpAddr::V4), info.ipv6_addr().map(IpAddr::V6)]
                        .into_iter()
                        .flatten(),
                );
                removed = true;
            }
            for &a in &addresses {
                if let Ok(e) = endpoints.get(&EndpointKey::ip(a), 0)
                    && e.endpoint_id == id
                {
                    endpoints
                        .remove(&EndpointKey::ip(a))
                        .map_err(map_err(format!("removing endpoint {id} address {a}")))?;
                    removed = true;
                }
            }
        }
        if let Some(i) = ifindex {
            removed |= self.detach(i)?.changed();
        }
        if record.has_policy() {
            removed |= self.sync_policy(id, &BTreeMap::new(), &BTreeMap::new())?;
        }
        self.index().release(id, ifindex, &addresses);
        bump.finish(removed)?;
        Ok(removed)
    }

    fn detach(&self, ifindex: u32) -> Result<crate::datapath::DetachOutcome, LoaderError> {
        self.datapath.detach(ifindex).map_err(|source| LoaderError::Datapath {
            action: format!("detaching from interface index {ifindex}"),
            source: Box::new(source),
        })
    }

    /// The endpoint map entry of `endpoint_id` and its policy entry and
    /// prefix counts.
    fn endpoint(&self, endpoint_id: u32) -> Result<(EndpointInfo, (usize, usize)), LoaderError> {
        let (ifindex, entries) = self
            .index()
            .endpoints
            .get(&endpoint_id)
            .and_then(|r| Some((r.ifindex?, (r.policy.entries.len(), r.prefixes.entries.len()))))
            .ok_or(LoaderError::UnknownEndpoint(endpoint_id))?;
        let info = self
            .datapath
            .maps()
            .endpoints
            .lock()
            .get(&EndpointKey::ifindex(ifindex), 0)
            .map_err(|_| LoaderError::UnknownEndpoint(endpoint_id))?;
        Ok((info, entries))
    }

    /// One endpoint with its attachment (cheap: one interface queried).
    pub fn view(&self, endpoint_id: u32) -> Result<EndpointView, LoaderError> {
        let (info, (policy_entries, policy_prefixes)) = self.endpoint(endpoint_id)?;
        let ifindex = info.ifindex;
        let attachment = self
            .datapath
            .attachment(ifindex)
            .map_err(|source| LoaderError::Datapath {
                action: format!("inspecting the attachment of interface index {ifindex}"),
                source: Box::new(source),
            })?;
        Ok(EndpointView {
            info,
            ifname: attachment.ifname.clone(),
            policy_entries,
            policy_prefixes,
            ingress: attachment.ingress,
            egress: attachment.egress,
        })
    }

    /// Every endpoint with its attachment, plus attachments and policy
    /// entries that belong to no endpoint. An endpoint whose interface is
    /// gone says `InterfaceGone` on both hooks, with no name. Costs one
    /// link dump and two filter queries per interface of the namespace;
    /// [`endpoint_interfaces`](Self::endpoint_interfaces) answers whether
    /// the interfaces exist for one link dump.
    pub fn list(&self) -> Result<DatapathListing, LoaderError> {
        let mut infos = Vec::new();
        for item in self.datapath.maps().endpoints.lock().iter() {
            let (k, v) = item.map_err(map_err("reading the endpoints map"))?;
            if k.as_ifindex().is_some() {
                infos.push(v);
            }
        }
        infos.sort_by_key(|i| i.endpoint_id);
        // After the map read: an interface an entry names existed before
        // the entry was written, so one missing from the dump is gone.
        let inspect = || -> Result<HashMap<u32, Attachment>, DatapathError> {
            datapath::interfaces()?
                .into_keys()
                .map(|ifindex| Ok((ifindex, self.datapath.attachment(ifindex)?)))
                .collect()
        };
        let mut attachments = inspect().map_err(|source| LoaderError::Datapath {
            action: "listing attachments".into(),
            source: Box::new(source),
        })?;
        let (counts, mut orphan_policies): (HashMap<u32, (usize, usize)>, Vec<u32>) = {
            let index = self.index();
            (
                index
                    .endpoints
                    .iter()
                    .map(|(id, r)| (*id, (r.policy.entries.len(), r.prefixes.entries.len())))
                    .collect(),
                index
                    .endpoints
                    .iter()
                    .filter(|(_, r)| {
                        r.ifindex.is_none() && !(r.policy.entries.is_empty() && r.prefixes.entries.is_empty())
                    })
                    .map(|(id, _)| *id)
                    .collect(),
            )
        };
        orphan_policies.sort_unstable();
        let mut views = Vec::new();
        for info in infos {
            let attachment = attachments.remove(&info.ifindex).unwrap_or(Attachment {
                ifindex: info.ifindex,
                ifname: None,
                ingress: AttachState::InterfaceGone,
                egress: AttachState::InterfaceGone,
            });
            let (policy_entries, policy_prefixes) = counts.get(&info.endpoint_id).copied().unwrap_or_default();
            views.push(EndpointView {
                info,
                ifname: attachment.ifname,
                policy_entries,
                policy_prefixes,
                ingress: attachment.ingress,
                egress: attachment.egress,
            });
        }
        let mut orphans: Vec<Attachment> = attachments.into_values().filter(Attachment::has_ours).collect();
        orphans.sort_by_key(|a| a.ifindex);
        Ok(DatapathListing {
            endpoints: views,
            orphan_attachments: orphans,
            orphan_policies,
        })
    }

    /// Each endpoint's host interface as the namespace has it now, by
    /// endpoint id: the loader's index and one link dump, no filter query
    /// and no map read, so cheap enough to poll (README, "Interface
    /// liveness").
    pub fn endpoint_interfaces(&self) -> Result<Vec<EndpointInterface>, LoaderError> {
        // The index first: an interface it names existed before it was
        // reserved, so one missing from the later dump is gone.
        let held: Vec<(u32, u32)> = self.index().interfaces.iter().map(|(&i, &id)| (id, i)).collect();
        let links = datapath::interfaces().map_err(|source| LoaderError::Datapath {
            action: "listing the interfaces of endpoints".into(),
            source: Box::new(source),
        })?;
        let mut interfaces: Vec<EndpointInterface> = held
            .into_iter()
            .map(|(endpoint_id, ifindex)| EndpointInterface {
                endpoint_id,
                ifindex,
                ifname: links.get(&ifindex).cloned(),
            })
            .collect();
        interfaces.sort_by_key(|i| i.endpoint_id);
        Ok(interfaces)
    }

    /// One endpoint's map entry, compiled policy with counters, and prefixes.
    pub fn policy(&self, endpoint_id: u32) -> Result<EndpointPolicyView, LoaderError> {
        let (info, _) = self.endpoint(endpoint_id)?;
        let (entries, prefixes) = self
            .index()
            .endpoints
            .get(&endpoint_id)
            .map(|r| (r.policy.entries.clone(), r.prefixes.entries.clone()))
            .unwrap_or_default();
        let policy = self.datapath.maps().policy.lock();
        let out = entries
            .into_iter()
            .map(|(entry, verdict)| {
                let value = policy.get(&entry.lpm_key(), 0).unwrap_or(PolicyValue::new(verdict));
                PolicyEntryView {
                    entry,
                    verdict,
                    packets: value.packets,
                    bytes: value.bytes,
                }
            })
            .collect();
        let prefixes = prefixes
            .into_iter()
            .filter_map(|(key, cidr_identity)| {
                let (addr, len) = key.prefix()?;
                Some(PolicyPrefix {
                    direction: key.data.direction,
                    addr,
                    len,
                    cidr_identity,
                })
            })
            .collect();
        Ok(EndpointPolicyView {
            info,
            entries: out,
            prefixes,
        })
    }

    /// Upserts ipcache entries; returns (written, unchanged).
    /// An entry whose address already looked up its value (that prefix's,
    /// or a covering one's) changes no verdict: the policy revision is
    /// bumped only for the others.
    pub fn upsert_ipcache(&self, entries: &[(IpAddr, u8, IpcacheValue)]) -> Result<(u32, u32), LoaderError> {
        let bump = RevisionBump::new(&self.datapath);
        let mut ipcache = self.datapath.maps().ipcache.lock();
        let (mut written, mut unchanged) = (0, 0);
        for (addr, len, value) in entries {
            let key = IpcacheKey::new(*addr, *len).expect("validated prefix").to_lpm();
            // A lookup may return a covering shorter prefix: always write,
            // and only report what looked unchanged.
            if ipcache.get(&key, 0).ok().as_ref() == Some(value) {
                unchanged += 1;
            }
            ipcache
                .insert(&key, *value, 0)
                .map_err(map_err(format!("writing ipcache entry {addr}/{len}")))?;
            written += 1;
        }
        drop(ipcache);
        bump.finish(written > unchanged)?;
        Ok((written - unchanged, unchanged))
    }

    /// Deletes ipcache entries; returns how many existed.
    pub fn delete_ipcache(&self, prefixes: &[(IpAddr, u8)]) -> Result<u32, LoaderError> {
        let bump = RevisionBump::new(&self.datapath);
        let mut ipcache = self.datapath.maps().ipcache.lock();
        let mut deleted = 0;
        for (addr, len) in prefixes {
            let key = IpcacheKey::new(*addr, *len).expect("validated prefix").to_lpm();
            match ipcache.remove(&key) {
                Ok(()) => deleted += 1,
                Err(e) if is_absent(&e) => {}
                Err(e) => return Err(map_err(format!("deleting ipcache entry {addr}/{len}"))(e)),
            }
        }
        drop(ipcache);
        bump.finish(deleted > 0)?;
        Ok(deleted)
    }

    /// Every ipcache entry, sorted.
    pub fn ipcache_entries(&self) -> Result<Vec<(IpAddr, u8, IpcacheValue)>, LoaderError> {
        let ipcache = self.datapath.maps().ipcache.lock();
        let keys: Vec<_> = ipcache
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err("reading the ipcache"))?;
        let mut out = Vec::new();
        for key in keys {
            let Some((addr, len)) = IpcacheKey::from_lpm(&key).prefix() else {
                continue;
            };
            if let Ok(v) = ipcache.get(&key, 0) {
                out.push((addr, len, v));
            }
        }
        out.sort_by_key(|e| (e.0, e.1));
        Ok(out)
    }

    /// Calls `gate` with the ifindex just before each apply attaches.
    #[cfg(test)]
    fn set_attach_gate(&self, gate: AttachGate) {
        *lock(&self.attach_gate) = Some(gate);
    }

    /// Waits until `n` callers wait for an endpoint's lock, at most `bound`.
    #[cfg(test)]
    fn wait_for_lock_waiters(&self, n: usize, bound: std::time::Duration) {
        self.endpoint_locks.wait_for_waiters(n, bound);
    }
}

/// The policy trie's entries by endpoint (`only`: of that endpoint). The
/// map's lock is held for the scan: an entry deleted under the scan could
/// restart it.
fn read_policy(datapath: &Datapath, only: Option<u32>) -> Result<HashMap<u32, BTreeMap<PolicyEntry, u8>>, LoaderError> {
    let policy = datapath.maps().policy.lock();
    let mut out: HashMap<u32, BTreeMap<PolicyEntry, u8>> = HashMap::new();
    for key in policy.keys() {
        let key = key.map_err(map_err("reading the policy map"))?;
        let Some(entry) = PolicyEntry::from_lpm_key(&key) else {
            continue;
        };
        if only.is_some_and(|id| id != entry.endpoint_id) {
            continue;
        }
        let value = policy.get(&key, 0).map_err(map_err("reading the policy map"))?;
        out.entry(entry.endpoint_id).or_default().insert(entry, value.verdict);
    }
    Ok(out)
}

/// The `ep_prefixes` entries by endpoint (`only`: of that endpoint); keys
/// this loader never writes are skipped. The map's lock is held for the
/// scan.
fn read_prefixes(
    datapath: &Datapath,
    only: Option<u32>,
) -> Result<HashMap<u32, BTreeMap<EpPrefixKey, u32>>, LoaderError> {
    let prefixes = datapath.maps().ep_prefixes.lock();
    let mut out: HashMap<u32, BTreeMap<EpPrefixKey, u32>> = HashMap::new();
    for key in prefixes.keys() {
        let key = key.map_err(map_err("reading the ep_prefixes map"))?;
        let prefix_key = EpPrefixKey::from_lpm(&key);
        if prefix_key.prefix().is_none() || only.is_some_and(|id| id != prefix_key.data.endpoint_id) {
            continue;
        }
        let value = prefixes.get(&key, 0).map_err(map_err("reading the ep_prefixes map"))?;
        out.entry(prefix_key.data.endpoint_id)
            .or_default()
            .insert(prefix_key, value.cidr_identity);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

fn policy_flags(p: &PolicySpec) -> u32 {
    let mut flags = 0;
    if p.enforce_ingress {
        flags |= EP_F_ENFORCE_INGRESS;
    }
    if p.enforce_egress {
        flags |= EP_F_ENFORCE_EGRESS;
    }
    if p.allow_from_host {
        flags |= EP_F_ALLOW_FROM_HOST;
    }
    flags
}

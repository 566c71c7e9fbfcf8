//! [`EndpointDatapath`]: the loader's operations on the datapath, free of
//! gRPC. Every change is checked whole before the first map write; writes
//! are ordered so a program never sees a half-made endpoint (policy, then
//! addresses, then the ifindex entry that enables it, then the attach).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard};

use crate::datapath::{AttachState, Attachment, Datapath, DatapathError};
use crate::maps::{
    EP_F_ALLOW_FROM_HOST, EP_F_ENFORCE_EGRESS, EP_F_ENFORCE_INGRESS, EndpointInfo, EndpointKey, IpcacheKey,
    IpcacheValue, PolicyValue,
};
use crate::netdev;
use crate::policy_lpm::{self, PolicyEntry, PolicyRuleError};
use crate::validate::{EndpointSpec, PolicySpec};

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
    /// `from_container` attachment.
    pub ingress: AttachState,
    /// `to_container` attachment.
    pub egress: AttachState,
}

/// What the datapath holds, see [`EndpointDatapath::list`].
#[derive(Debug, Clone)]
pub struct DatapathListing {
    /// Endpoints, by id.
    pub endpoints: Vec<EndpointView>,
    /// Attachments of interfaces no endpoint names.
    pub orphan_attachments: Vec<Attachment>,
    /// Endpoint ids with policy entries but no endpoint.
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

struct State {
    datapath: Datapath,
    /// endpoint id → ifindex.
    by_id: HashMap<u32, u32>,
    /// endpoint id → its policy trie entries, as written.
    policies: HashMap<u32, BTreeMap<PolicyEntry, u8>>,
}

impl State {
    /// The endpoint map entry of `endpoint_id`.
    fn endpoint(&mut self, endpoint_id: u32) -> Result<EndpointInfo, LoaderError> {
        let ifindex = *self
            .by_id
            .get(&endpoint_id)
            .ok_or(LoaderError::UnknownEndpoint(endpoint_id))?;
        self.datapath
            .endpoints()
            .get(&EndpointKey::ifindex(ifindex), 0)
            .map_err(|_| LoaderError::UnknownEndpoint(endpoint_id))
    }
}

/// The endpoint-facing operations on the node's datapath.
pub struct EndpointDatapath {
    state: Mutex<State>,
    interface_prefix: String,
}

impl std::fmt::Debug for EndpointDatapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointDatapath")
            .field("interface_prefix", &self.interface_prefix)
            .finish_non_exhaustive()
    }
}

impl EndpointDatapath {
    /// Wraps an opened datapath; rebuilds the endpoint and policy indexes
    /// from the pinned maps (they survive loader restarts).
    pub fn new(mut datapath: Datapath, interface_prefix: impl Into<String>) -> Result<Self, LoaderError> {
        let mut by_id = HashMap::new();
        for item in datapath.endpoints().iter() {
            let (k, v) = item.map_err(map_err("reading the endpoints map"))?;
            if let Some(ifindex) = k.as_ifindex() {
                by_id.insert(v.endpoint_id, ifindex);
            }
        }
        let mut policies: HashMap<u32, BTreeMap<PolicyEntry, u8>> = HashMap::new();
        let keys: Vec<_> = datapath
            .policy()
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err("reading the policy map"))?;
        for key in keys {
            let Some(entry) = PolicyEntry::from_lpm_key(&key) else {
                continue;
            };
            let value = datapath
                .policy()
                .get(&key, 0)
                .map_err(map_err("reading the policy map"))?;
            policies
                .entry(entry.endpoint_id)
                .or_default()
                .insert(entry, value.verdict);
        }
        tracing::info!(
            endpoints = by_id.len(),
            policy_endpoints = policies.len(),
            "datapath state adopted from pinned maps"
        );
        Ok(Self {
            state: Mutex::new(State {
                datapath,
                by_id,
                policies,
            }),
            interface_prefix: interface_prefix.into(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("datapath lock poisoned")
    }

    /// Runs `f` with the datapath (config writes, event ring, metrics).
    pub fn with_datapath<R>(&self, f: impl FnOnce(&mut Datapath) -> R) -> R {
        f(&mut self.lock().datapath)
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
        let mut st = self.lock();
        let ifkey = EndpointKey::ifindex(spec.ifindex);
        let existing = st.datapath.endpoints().get(&ifkey, 0).ok();
        if let Some(e) = existing
            && e.endpoint_id != spec.endpoint_id
        {
            return Err(LoaderError::InterfaceHeld {
                ifindex: spec.ifindex,
                owner: e.endpoint_id,
            });
        }
        if let Some(&other) = st.by_id.get(&spec.endpoint_id)
            && other != spec.ifindex
        {
            return Err(LoaderError::EndpointElsewhere {
                endpoint_id: spec.endpoint_id,
                ifindex: other,
            });
        }
        let addresses: Vec<IpAddr> = spec
            .ipv4
            .map(IpAddr::V4)
            .into_iter()
            .chain(spec.ipv6.map(IpAddr::V6))
            .collect();
        for address in &addresses {
            if let Ok(e) = st.datapath.endpoints().get(&EndpointKey::ip(*address), 0)
                && e.endpoint_id != spec.endpoint_id
            {
                return Err(LoaderError::AddressHeld {
                    address: *address,
                    owner: e.endpoint_id,
                });
            }
        }
        // Policy: the request's, or the current one, or fail closed.
        let desired_policy = match &spec.policy {
            Some(p) => Some(policy_lpm::compile(spec.endpoint_id, &p.rules)?),
            None => None,
        };
        let (flags, revision) = match (&spec.policy, existing) {
            (Some(p), _) => (policy_flags(p), p.revision),
            (None, Some(e)) => (
                e.flags & (EP_F_ENFORCE_INGRESS | EP_F_ENFORCE_EGRESS | EP_F_ALLOW_FROM_HOST),
                e.policy_revision,
            ),
            (None, None) => (EP_F_ENFORCE_INGRESS | EP_F_ENFORCE_EGRESS, 0),
        };
        let mut info = EndpointInfo {
            endpoint_id: spec.endpoint_id,
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
        if let Some(desired) = desired_policy {
            let current = st.policies.get(&spec.endpoint_id).cloned().unwrap_or_default();
            let diff = policy_lpm::diff(&current, &desired);
            for (entry, verdict) in &diff.steps {
                match verdict {
                    Some(v) => st
                        .datapath
                        .policy()
                        .insert(&entry.lpm_key(), PolicyValue::new(*v), 0)
                        .map_err(map_err(format!("writing policy of endpoint {}", spec.endpoint_id)))?,
                    None => match st.datapath.policy().remove(&entry.lpm_key()) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                        Err(e) => {
                            return Err(map_err(format!("removing policy of endpoint {}", spec.endpoint_id))(e));
                        }
                    },
                }
            }
            changed |= !diff.is_empty();
            st.policies.insert(spec.endpoint_id, desired);
        }
        // Addresses first, then the ifindex entry that enables the programs.
        if existing != Some(info) {
            for address in &addresses {
                st.datapath
                    .endpoints()
                    .insert(EndpointKey::ip(*address), info, 0)
                    .map_err(map_err(format!(
                        "writing endpoint {} address {address}",
                        spec.endpoint_id
                    )))?;
            }
            st.datapath
                .endpoints()
                .insert(ifkey, info, 0)
                .map_err(map_err(format!("writing endpoint {}", spec.endpoint_id)))?;
            if let Some(old) = existing {
                for stale in [old.ipv4_addr().map(IpAddr::V4), old.ipv6_addr().map(IpAddr::V6)]
                    .into_iter()
                    .flatten()
                    .filter(|a| !addresses.contains(a))
                {
                    let _ = st.datapath.endpoints().remove(&EndpointKey::ip(stale));
                }
            }
            changed = true;
        }
        st.by_id.insert(spec.endpoint_id, spec.ifindex);
        let maps_done = started.elapsed();
        let attach = st
            .datapath
            .attach(spec.ifindex)
            .map_err(|source| LoaderError::Datapath {
                action: format!(
                    "attaching endpoint {} to interface index {}",
                    spec.endpoint_id, spec.ifindex
                ),
                source: Box::new(source),
            })?;
        changed |= attach.changed();
        tracing::debug!(
            endpoint_id = spec.endpoint_id,
            checks_and_maps_us = maps_done.as_micros() as u64,
            attach_us = (started.elapsed() - maps_done).as_micros() as u64,
            "endpoint realised"
        );
        let policy_entries = st.policies.get(&spec.endpoint_id).map_or(0, BTreeMap::len);
        Ok(Applied {
            info,
            changed,
            policy_entries,
        })
    }

    /// Removes an endpoint (by id, or whatever Rivet holds for an
    /// interface). Idempotent; returns whether anything was removed.
    pub fn remove(&self, endpoint_id: Option<u32>, ifindex: Option<u32>) -> Result<bool, LoaderError> {
        let mut st = self.lock();
        let ifindex = match (endpoint_id, ifindex) {
            (Some(id), given) => st.by_id.get(&id).copied().or(given),
            (None, given) => given,
        };
        let mut removed = false;
        let info = ifindex.and_then(|i| st.datapath.endpoints().get(&EndpointKey::ifindex(i), 0).ok());
        let id = endpoint_id.or(info.map(|i| i.endpoint_id));
        if let Some(info) = info {
            // Disable first (ifindex entry), then addresses.
            let _ = st.datapath.endpoints().remove(&EndpointKey::ifindex(info.ifindex));
            for a in [info.ipv4_addr().map(IpAddr::V4), info.ipv6_addr().map(IpAddr::V6)]
                .into_iter()
                .flatten()
            {
                if let Ok(e) = st.datapath.endpoints().get(&EndpointKey::ip(a), 0)
                    && e.endpoint_id == info.endpoint_id
                {
                    let _ = st.datapath.endpoints().remove(&EndpointKey::ip(a));
                }
            }
            removed = true;
        }
        if let Some(id) = id {
            if let Some(entries) = st.policies.remove(&id) {
                for entry in entries.keys() {
                    let _ = st.datapath.policy().remove(&entry.lpm_key());
                }
                removed = true;
            }
            st.by_id.remove(&id);
        }
        if let Some(ifindex) = ifindex {
            let outcome = st.datapath.detach(ifindex).map_err(|source| LoaderError::Datapath {
                action: format!("detaching from interface index {ifindex}"),
                source: Box::new(source),
            })?;
            removed |= outcome.changed();
        }
        Ok(removed)
    }

    /// One endpoint with its attachment (cheap: one interface queried).
    pub fn view(&self, endpoint_id: u32) -> Result<EndpointView, LoaderError> {
        let mut st = self.lock();
        let info = st.endpoint(endpoint_id)?;
        let ifindex = info.ifindex;
        let attachment = st
            .datapath
            .attachment(ifindex)
            .map_err(|source| LoaderError::Datapath {
                action: format!("inspecting the attachment of interface index {ifindex}"),
                source: Box::new(source),
            })?;
        Ok(EndpointView {
            info,
            ifname: attachment.ifname.clone(),
            policy_entries: st.policies.get(&endpoint_id).map_or(0, BTreeMap::len),
            ingress: attachment.ingress,
            egress: attachment.egress,
        })
    }

    /// Every endpoint with its attachment, plus attachments and policy
    /// entries that belong to no endpoint.
    pub fn list(&self) -> Result<DatapathListing, LoaderError> {
        let mut st = self.lock();
        let mut infos = Vec::new();
        for item in st.datapath.endpoints().iter() {
            let (k, v) = item.map_err(map_err("reading the endpoints map"))?;
            if k.as_ifindex().is_some() {
                infos.push(v);
            }
        }
        infos.sort_by_key(|i| i.endpoint_id);
        let attachments = st.datapath.attachments().map_err(|source| LoaderError::Datapath {
            action: "listing attachments".into(),
            source: Box::new(source),
        })?;
        let mut views = Vec::new();
        for info in infos {
            let a = attachments.iter().find(|a| a.ifindex == info.ifindex);
            views.push(EndpointView {
                info,
                ifname: netdev::ifindex_to_name(info.ifindex).ok().flatten(),
                policy_entries: st.policies.get(&info.endpoint_id).map_or(0, BTreeMap::len),
                ingress: a.map_or(AttachState::Detached, |a| a.ingress),
                egress: a.map_or(AttachState::Detached, |a| a.egress),
            });
        }
        let orphans = attachments
            .into_iter()
            .filter(|a| !views.iter().any(|v| v.info.ifindex == a.ifindex))
            .collect();
        let mut orphan_policies: Vec<u32> = st
            .policies
            .keys()
            .filter(|id| !st.by_id.contains_key(id))
            .copied()
            .collect();
        orphan_policies.sort_unstable();
        Ok(DatapathListing {
            endpoints: views,
            orphan_attachments: orphans,
            orphan_policies,
        })
    }

    /// One endpoint's map entry and compiled policy with counters.
    pub fn policy(&self, endpoint_id: u32) -> Result<(EndpointInfo, Vec<PolicyEntryView>), LoaderError> {
        let mut st = self.lock();
        let info = st.endpoint(endpoint_id)?;
        let entries = st.policies.get(&endpoint_id).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for (entry, verdict) in entries {
            let value = st
                .datapath
                .policy()
                .get(&entry.lpm_key(), 0)
                .unwrap_or(PolicyValue::new(verdict));
            out.push(PolicyEntryView {
                entry,
                verdict,
                packets: value.packets,
                bytes: value.bytes,
            });
        }
        Ok((info, out))
    }

    /// Upserts ipcache entries; returns (written, unchanged).
    pub fn upsert_ipcache(&self, entries: &[(IpAddr, u8, IpcacheValue)]) -> Result<(u32, u32), LoaderError> {
        let mut st = self.lock();
        let (mut written, mut unchanged) = (0, 0);
        for (addr, len, value) in entries {
            let key = IpcacheKey::new(*addr, *len).expect("validated prefix").to_lpm();
            // A lookup may return a covering shorter prefix: always write,
            // and only report what looked unchanged.
            if st.datapath.ipcache().get(&key, 0).ok().as_ref() == Some(value) {
                unchanged += 1;
            }
            st.datapath
                .ipcache()
                .insert(&key, *value, 0)
                .map_err(map_err(format!("writing ipcache entry {addr}/{len}")))?;
            written += 1;
        }
        Ok((written - unchanged, unchanged))
    }

    /// Deletes ipcache entries; returns how many existed.
    pub fn delete_ipcache(&self, prefixes: &[(IpAddr, u8)]) -> Result<u32, LoaderError> {
        let mut st = self.lock();
        let mut deleted = 0;
        for (addr, len) in prefixes {
            let key = IpcacheKey::new(*addr, *len).expect("validated prefix").to_lpm();
            match st.datapath.ipcache().remove(&key) {
                Ok(()) => deleted += 1,
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err(format!("deleting ipcache entry {addr}/{len}"))(e)),
            }
        }
        Ok(deleted)
    }

    /// Every ipcache entry, sorted.
    pub fn ipcache_entries(&self) -> Result<Vec<(IpAddr, u8, IpcacheValue)>, LoaderError> {
        let mut st = self.lock();
        let keys: Vec<_> = st
            .datapath
            .ipcache()
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err("reading the ipcache"))?;
        let mut out = Vec::new();
        for key in keys {
            let Some((addr, len)) = IpcacheKey::from_lpm(&key).prefix() else {
                continue;
            };
            if let Ok(v) = st.datapath.ipcache().get(&key, 0) {
                out.push((addr, len, v));
            }
        }
        out.sort_by_key(|e| (e.0, e.1));
        Ok(out)
    }
}

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

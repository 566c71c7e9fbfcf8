//! The selector cache: every identity the node knows, and per distinct peer
//! selector the identities it matches.
//!
//! Peer sets are memoised lazily: the first resolution that needs a peer
//! computes its set once over all identities; from then on every identity
//! change updates each memoised set incrementally (one match per selector),
//! so resolution never scans the identities again. The memo lives behind a
//! lock because [`PolicyRepository::resolve`](super::PolicyRepository::resolve)
//! takes the cache by shared reference; changes to identities take `&mut
//! self` and touch the memo without locking. Selectors that no policy uses
//! any more are dropped by a second-chance sweep whenever the memo has doubled
//! since the previous sweep: an entry not looked up between two sweeps goes
//! (and is recomputed if it is ever needed again).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use ipnet::IpNet;
use rivet_common::identity::{self, is_cluster};
use rivet_common::labels::{Labels, ReservedIdentity};

use super::NamedPort;
use super::selector::{IdentityRef, Peer};

/// The memo is swept when it holds at least this many selectors.
const MIN_SWEEP_SIZE: usize = 1024;

/// The identities of the node and the identity sets of peer selectors.
///
/// Knows the reserved identities 1..=7 from the start; cluster identities
/// come from svc-identity's WatchIdentities ([`upsert_identity`],
/// [`remove_identity`], [`replace_identities`]) and CIDR identities from the
/// caller's allocations for the repository's prefixes
/// ([`set_cidr_identity`]). Every mutator returns whether anything changed,
/// so the caller knows when to regenerate endpoints.
///
/// ```
/// use rivet_policy::SelectorCache;
///
/// let mut cache = SelectorCache::new();
/// assert_eq!(cache.identities(), 7);
/// assert!(cache.upsert_identity(256, "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop".parse()?));
/// assert!(!cache.upsert_identity(256, "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop".parse()?));
/// assert!(cache.set_cidr_identity("10.0.0.0/8".parse()?, 1 << 24));
/// assert_eq!(cache.identities(), 9);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`upsert_identity`]: SelectorCache::upsert_identity
/// [`remove_identity`]: SelectorCache::remove_identity
/// [`replace_identities`]: SelectorCache::replace_identities
/// [`set_cidr_identity`]: SelectorCache::set_cidr_identity
pub struct SelectorCache {
    /// 256 <= id < 2^24.
    cluster: BTreeMap<u32, Labels>,
    /// CIDR identities by prefix (host bits clear) ...
    cidr_ids: BTreeMap<IpNet, u32>,
    /// ... and by id.
    cidr_prefixes: BTreeMap<u32, IpNet>,
    /// Named ports of the local endpoints holding an identity (sorted, unique).
    named_ports: BTreeMap<u32, Vec<NamedPort>>,
    /// Named ports of the local endpoint holding an address (sorted, unique).
    address_ports: BTreeMap<IpAddr, Vec<NamedPort>>,
    memo: RwLock<Memo>,
    /// What changed since the caller last took it.
    changes: SelectorChanges,
    /// A [`snapshot_for`](SelectorCache::snapshot_for): knows only the
    /// memoised selectors it was made for.
    snapshot: bool,
}

/// What changed in a [`SelectorCache`] since [`SelectorCache::take_changes`]
/// was last called: each identity that appeared, vanished or changed (its
/// labels or prefix before and after), and the identities and endpoint
/// addresses whose named ports changed. [`PolicyRepository::affected_by`](super::PolicyRepository::affected_by)
/// turns it into the policies whose resolution it can change, so only the
/// endpoints those select are regenerated.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SelectorChanges {
    identities: Vec<(u32, Option<Known>, Option<Known>)>,
    named_ports: BTreeSet<u32>,
    address_ports: BTreeSet<IpAddr>,
}

/// An identity the cache knows beyond the reserved ones.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Known {
    Cluster(Labels),
    Cidr(IpNet),
}

impl Known {
    fn as_ref(&self) -> IdentityRef<'_> {
        match self {
            Self::Cluster(labels) => IdentityRef::Cluster(labels),
            Self::Cidr(prefix) => IdentityRef::Cidr(prefix),
        }
    }
}

impl SelectorChanges {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.identities.is_empty() && self.named_ports.is_empty() && self.address_ports.is_empty()
    }

    /// Whether a peer matches a changed identity differently before and
    /// after the change.
    pub(crate) fn moves(&self, peer: &Peer) -> bool {
        self.identities.iter().any(|(_, before, after)| {
            let matches = |known: &Option<Known>| known.as_ref().is_some_and(|k| peer.matches(k.as_ref()));
            matches(before) != matches(after)
        })
    }

    /// Whether the CIDR identity of `prefix` appeared, went or changed
    /// (an ipBlock's resolution depends on those of its `cidr` and every
    /// `except`, not only on the identities it selects).
    pub(crate) fn touches_prefix(&self, prefix: &IpNet) -> bool {
        self.identities.iter().any(|(_, before, after)| {
            [before, after]
                .into_iter()
                .any(|known| matches!(known, Some(Known::Cidr(p)) if p == prefix))
        })
    }

    /// Whether the named ports of some identity or endpoint address changed.
    pub(crate) fn named_ports_changed(&self) -> bool {
        !self.named_ports.is_empty() || !self.address_ports.is_empty()
    }

    fn identity(&mut self, id: u32, before: Option<Known>, after: Option<Known>) {
        if before != after {
            self.identities.push((id, before, after));
        }
    }
}

struct Memo {
    entries: HashMap<Peer, MemoEntry>,
    /// Sweep when `entries` reaches this size.
    sweep_at: usize,
}

struct MemoEntry {
    ids: Arc<BTreeSet<u32>>,
    /// Looked up since the last sweep.
    used: AtomicBool,
}

impl Default for SelectorCache {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for SelectorCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SelectorCache")
            .field("cluster_identities", &self.cluster.len())
            .field("cidr_identities", &self.cidr_ids.len())
            .field("named_port_identities", &self.named_ports.len())
            .field("named_port_addresses", &self.address_ports.len())
            .field("cached_selectors", &self.cached_selectors())
            .finish()
    }
}

impl SelectorCache {
    /// A cache that knows only the reserved identities.
    pub fn new() -> Self {
        Self {
            cluster: BTreeMap::new(),
            cidr_ids: BTreeMap::new(),
            cidr_prefixes: BTreeMap::new(),
            named_ports: BTreeMap::new(),
            address_ports: BTreeMap::new(),
            memo: RwLock::new(Memo {
                entries: HashMap::new(),
                sweep_at: MIN_SWEEP_SIZE,
            }),
            changes: SelectorChanges::default(),
            snapshot: false,
        }
    }

    /// A cache that answers exactly the lookups a resolution over `peers`
    /// makes (their memoised identity sets, computed now if needed, the CIDR
    /// identities and the named ports) and knows no identity itself: it
    /// costs the sets' reference counts, not a copy of the identities, and
    /// lets the resolution run away from the cache's owner (another thread,
    /// no lock). A peer it was not made for is a bug (and matches nothing).
    pub(crate) fn snapshot_for<'p>(&self, peers: impl IntoIterator<Item = &'p Peer>) -> Self {
        let entries = peers
            .into_iter()
            .filter(|peer| !peer.is_any())
            .map(|peer| {
                let entry = MemoEntry {
                    ids: self.select(peer),
                    used: AtomicBool::new(true),
                };
                (peer.clone(), entry)
            })
            .collect();
        Self {
            cluster: BTreeMap::new(),
            cidr_ids: self.cidr_ids.clone(),
            cidr_prefixes: self.cidr_prefixes.clone(),
            named_ports: self.named_ports.clone(),
            address_ports: self.address_ports.clone(),
            memo: RwLock::new(Memo {
                entries,
                sweep_at: usize::MAX,
            }),
            changes: SelectorChanges::default(),
            snapshot: true,
        }
    }

    /// Identities summed over the memoised selectors: about how many
    /// entries a resolution over them makes per port.
    pub(crate) fn selected_identities(&self) -> usize {
        let memo = self.memo.read().unwrap_or_else(|e| e.into_inner());
        memo.entries.values().map(|e| e.ids.len()).sum()
    }

    /// Takes what changed since the last call.
    pub fn take_changes(&mut self) -> SelectorChanges {
        std::mem::take(&mut self.changes)
    }

    /// Adds or replaces a cluster identity (256 <= id < 2^24; others are
    /// ignored: reserved identities are built in and CIDR identities come
    /// through [`set_cidr_identity`](Self::set_cidr_identity)). Returns
    /// whether anything changed.
    pub fn upsert_identity(&mut self, id: u32, labels: Labels) -> bool {
        if !is_cluster(id) {
            tracing::debug!(id, "ignoring an identity outside the cluster range");
            return false;
        }
        if self.cluster.get(&id) == Some(&labels) {
            return false;
        }
        let before = self.cluster.get(&id).cloned().map(Known::Cluster);
        self.changes.identity(id, before, Some(Known::Cluster(labels.clone())));
        let labels = self.cluster.entry(id).insert_entry(labels).into_mut();
        update_memo(
            self.memo.get_mut().unwrap_or_else(|e| e.into_inner()),
            id,
            Some(IdentityRef::Cluster(labels)),
        );
        true
    }

    /// Removes a cluster identity. Returns whether it was known.
    pub fn remove_identity(&mut self, id: u32) -> bool {
        let Some(before) = self.cluster.remove(&id) else {
            return false;
        };
        self.changes.identity(id, Some(Known::Cluster(before)), None);
        update_memo(self.memo_mut(), id, None);
        true
    }

    /// Replaces every cluster identity with a full snapshot (reserved and
    /// CIDR identities stay). Applied as a difference, so memoised selector
    /// sets are updated only for identities that appeared, vanished or
    /// changed. Returns whether anything changed.
    pub fn replace_identities(&mut self, identities: impl IntoIterator<Item = (u32, Labels)>) -> bool {
        let snapshot: BTreeMap<u32, Labels> = identities.into_iter().filter(|(id, _)| is_cluster(*id)).collect();
        let gone: Vec<u32> = self
            .cluster
            .keys()
            .filter(|id| !snapshot.contains_key(id))
            .copied()
            .collect();
        let mut changed = false;
        for id in gone {
            changed |= self.remove_identity(id);
        }
        for (id, labels) in snapshot {
            changed |= self.upsert_identity(id, labels);
        }
        changed
    }

    /// Sets the node-local identity of a policy prefix (host bits are
    /// cleared). An id outside the CIDR range ([`identity::is_cidr`]) is
    /// refused (false). One prefix has one
    /// identity and one identity one prefix: an earlier mapping of either is
    /// replaced. Returns whether anything changed.
    pub fn set_cidr_identity(&mut self, prefix: IpNet, id: u32) -> bool {
        if !identity::is_cidr(id) {
            tracing::warn!(id, %prefix, "refusing an identity outside the CIDR range");
            return false;
        }
        let prefix = prefix.trunc();
        if self.cidr_ids.get(&prefix) == Some(&id) {
            return false;
        }
        if let Some(old_id) = self.cidr_ids.remove(&prefix) {
            self.cidr_prefixes.remove(&old_id);
            self.changes.identity(old_id, Some(Known::Cidr(prefix)), None);
            update_memo(self.memo_mut(), old_id, None);
        }
        let before = self.cidr_prefixes.remove(&id);
        if let Some(old_prefix) = before {
            self.cidr_ids.remove(&old_prefix);
        }
        self.changes
            .identity(id, before.map(Known::Cidr), Some(Known::Cidr(prefix)));
        self.cidr_ids.insert(prefix, id);
        let prefix = self.cidr_prefixes.entry(id).insert_entry(prefix).into_mut();
        update_memo(
            self.memo.get_mut().unwrap_or_else(|e| e.into_inner()),
            id,
            Some(IdentityRef::Cidr(prefix)),
        );
        true
    }

    /// Forgets the identity of a prefix. Returns whether it was known.
    pub fn remove_cidr_identity(&mut self, prefix: &IpNet) -> bool {
        let Some(id) = self.cidr_ids.remove(&prefix.trunc()) else {
            return false;
        };
        if let Some(before) = self.cidr_prefixes.remove(&id) {
            self.changes.identity(id, Some(Known::Cidr(before)), None);
        }
        update_memo(self.memo_mut(), id, None);
        true
    }

    /// Sets the named ports of the local endpoints holding an identity (what
    /// egress rules with named ports and identity-matched peers resolve
    /// against); an empty list removes them. Returns whether anything changed.
    pub fn set_named_ports(&mut self, identity: u32, ports: Vec<NamedPort>) -> bool {
        let changed = replace_ports(&mut self.named_ports, identity, ports);
        if changed {
            self.changes.named_ports.insert(identity);
        }
        changed
    }

    /// Sets the named ports of the local endpoint holding `address` (what
    /// egress rules with named ports and ipBlock peers resolve against: the
    /// pods inside the block, each at its own address); an empty list
    /// removes them. Returns whether anything changed.
    pub fn set_address_named_ports(&mut self, address: IpAddr, ports: Vec<NamedPort>) -> bool {
        let changed = replace_ports(&mut self.address_ports, address, ports);
        if changed {
            self.changes.address_ports.insert(address);
        }
        changed
    }

    /// How many identities the cache knows: the 7 reserved ones, the cluster
    /// identities and the CIDR identities.
    pub fn identities(&self) -> usize {
        ReservedIdentity::ALL.len() + self.cluster.len() + self.cidr_ids.len()
    }

    /// The labels of a reserved or cluster identity, or the `cidr:` label of a
    /// CIDR identity.
    pub fn labels(&self, id: u32) -> Option<Labels> {
        if let Some(reserved) = ReservedIdentity::from_id(id) {
            return Some(reserved.labels());
        }
        if let Some(labels) = self.cluster.get(&id) {
            return Some(labels.clone());
        }
        self.cidr_prefixes
            .get(&id)
            .map(|prefix| Labels::try_from_iter([rivet_common::labels::Label::cidr(*prefix)]).expect("one label"))
    }

    /// The CIDR identity of a prefix, if set.
    pub fn cidr_identity(&self, prefix: &IpNet) -> Option<u32> {
        self.cidr_ids.get(&prefix.trunc()).copied()
    }

    /// How many peer selectors are memoised now.
    pub fn cached_selectors(&self) -> usize {
        self.memo.read().unwrap_or_else(|e| e.into_inner()).entries.len()
    }

    /// The identities a peer matches (not for the `all` entity: that is peer
    /// 0), memoised.
    pub(crate) fn select(&self, peer: &Peer) -> Arc<BTreeSet<u32>> {
        {
            let memo = self.memo.read().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = memo.entries.get(peer) {
                if !entry.used.load(Ordering::Relaxed) {
                    entry.used.store(true, Ordering::Relaxed);
                }
                return entry.ids.clone();
            }
        }
        if self.snapshot {
            debug_assert!(false, "a selector cache snapshot was not made for {peer:?}");
            tracing::error!(
                ?peer,
                "a selector cache snapshot was not made for this peer; it matches nothing"
            );
            return Arc::default();
        }
        let ids = Arc::new(self.compute(peer));
        let mut memo = self.memo.write().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = memo.entries.get(peer) {
            entry.used.store(true, Ordering::Relaxed);
            return entry.ids.clone();
        }
        if memo.entries.len() >= memo.sweep_at {
            memo.entries
                .retain(|_, entry| entry.used.swap(false, Ordering::Relaxed));
            memo.sweep_at = MIN_SWEEP_SIZE.max(2 * memo.entries.len());
        }
        memo.entries.insert(
            peer.clone(),
            MemoEntry {
                ids: ids.clone(),
                used: AtomicBool::new(true),
            },
        );
        ids
    }

    /// The named ports of the local endpoints holding an identity.
    pub(crate) fn named_ports_of(&self, id: u32) -> &[NamedPort] {
        self.named_ports.get(&id).map_or(&[], Vec::as_slice)
    }

    /// Every identity with named ports, with them.
    pub(crate) fn identities_with_named_ports(&self) -> impl Iterator<Item = (u32, &[NamedPort])> {
        self.named_ports.iter().map(|(id, ports)| (*id, ports.as_slice()))
    }

    /// Every local endpoint address with named ports, with them.
    pub(crate) fn addresses_with_named_ports(&self) -> impl Iterator<Item = (IpAddr, &[NamedPort])> {
        self.address_ports.iter().map(|(a, ports)| (*a, ports.as_slice()))
    }

    /// A peer's identities, from scratch.
    fn compute(&self, peer: &Peer) -> BTreeSet<u32> {
        let reserved = ReservedIdentity::ALL
            .into_iter()
            .map(|r| (r.id(), IdentityRef::Reserved(r)));
        let cluster = self
            .cluster
            .iter()
            .map(|(id, labels)| (*id, IdentityRef::Cluster(labels)));
        let cidr = self
            .cidr_prefixes
            .iter()
            .map(|(id, prefix)| (*id, IdentityRef::Cidr(prefix)));
        reserved
            .chain(cluster)
            .chain(cidr)
            .filter(|(_, identity)| peer.matches(*identity))
            .map(|(id, _)| id)
            .collect()
    }

    fn memo_mut(&mut self) -> &mut Memo {
        self.memo.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}

/// Sets (sorted, unique) or, when empty, removes the named ports of `key`.
/// Returns whether anything changed.
fn replace_ports<K: Ord>(map: &mut BTreeMap<K, Vec<NamedPort>>, key: K, mut ports: Vec<NamedPort>) -> bool {
    ports.sort();
    ports.dedup();
    if ports.is_empty() {
        map.remove(&key).is_some()
    } else if map.get(&key) == Some(&ports) {
        false
    } else {
        map.insert(key, ports);
        true
    }
}

/// Re-evaluates one identity against every memoised selector; `None` removes it.
fn update_memo(memo: &mut Memo, id: u32, identity: Option<IdentityRef<'_>>) {
    for (peer, entry) in &mut memo.entries {
        let matches = identity.is_some_and(|identity| peer.matches(identity));
        if matches != entry.ids.contains(&id) {
            let ids = Arc::make_mut(&mut entry.ids);
            if matches {
                ids.insert(id);
            } else {
                ids.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rivet_common::identity::{CIDR_IDENTITY_MAX, CIDR_IDENTITY_MIN};

    use super::super::selector::{Entity, LabelSelector};
    use super::*;

    fn labels(text: &str) -> Labels {
        text.parse().unwrap()
    }

    fn ids(set: &BTreeSet<u32>) -> Vec<u32> {
        set.iter().copied().collect()
    }

    fn all_pods() -> Peer {
        Peer::Pods {
            namespace: Some("shop".into()),
            namespace_selector: None,
            pod_selector: LabelSelector::default(),
        }
    }

    #[test]
    fn memoised_sets_follow_identity_changes() {
        let mut cache = SelectorCache::new();
        cache.upsert_identity(256, labels("k8s:app=a,k8s:io.kubernetes.pod.namespace=shop"));
        cache.upsert_identity(257, labels("k8s:app=b,k8s:io.kubernetes.pod.namespace=other"));
        let pods = all_pods();
        let cluster = Peer::Entity(Entity::Cluster);
        let world = Peer::Entity(Entity::World);
        assert_eq!(ids(&cache.select(&pods)), [256]);
        assert_eq!(ids(&cache.select(&cluster)), [1, 3, 4, 5, 6, 7, 256, 257]);
        assert_eq!(ids(&cache.select(&world)), [2]);
        assert_eq!(cache.cached_selectors(), 3);

        assert!(cache.upsert_identity(258, labels("k8s:app=c,k8s:io.kubernetes.pod.namespace=shop")));
        assert!(cache.remove_identity(256));
        assert!(!cache.remove_identity(256));
        assert!(cache.set_cidr_identity("10.0.0.0/8".parse().unwrap(), CIDR_IDENTITY_MIN));
        assert_eq!(ids(&cache.select(&pods)), [258]);
        assert_eq!(ids(&cache.select(&cluster)), [1, 3, 4, 5, 6, 7, 257, 258]);
        assert_eq!(ids(&cache.select(&world)), [2, CIDR_IDENTITY_MIN]);
        // A relabelled identity (a number reused) moves between sets.
        assert!(cache.upsert_identity(258, labels("k8s:app=c,k8s:io.kubernetes.pod.namespace=other")));
        assert!(cache.select(&pods).is_empty());
        // Still the same memo entries: nothing was recomputed from scratch.
        assert_eq!(cache.cached_selectors(), 3);
        for peer in [&pods, &cluster, &world] {
            assert_eq!(*cache.select(peer), cache.compute(peer), "{peer:?}");
        }

        // A snapshot replaces cluster identities only.
        assert!(cache.replace_identities([(300, labels("k8s:io.kubernetes.pod.namespace=shop")), (5, labels(""))]));
        assert_eq!(ids(&cache.select(&pods)), [300]);
        assert_eq!(ids(&cache.select(&world)), [2, CIDR_IDENTITY_MIN]);
        assert!(!cache.replace_identities([(300, labels("k8s:io.kubernetes.pod.namespace=shop"))]));
        assert_eq!(cache.identities(), 7 + 1 + 1);
    }

    #[test]
    fn cidr_identities_are_one_to_one() {
        let mut cache = SelectorCache::new();
        let a: IpNet = "10.0.0.0/8".parse().unwrap();
        let b: IpNet = "192.168.0.0/16".parse().unwrap();
        let block = Peer::IpBlock {
            cidr: a,
            except: vec![],
        };
        assert!(!cache.set_cidr_identity(a, 300), "below 2^24");
        assert!(
            !cache.set_cidr_identity(a, CIDR_IDENTITY_MAX + 1),
            "above the CIDR range"
        );
        assert!(cache.set_cidr_identity("10.1.2.3/8".parse().unwrap(), CIDR_IDENTITY_MIN));
        assert_eq!(cache.cidr_identity(&a), Some(CIDR_IDENTITY_MIN));
        assert!(!cache.set_cidr_identity(a, CIDR_IDENTITY_MIN));
        assert_eq!(ids(&cache.select(&block)), [CIDR_IDENTITY_MIN]);
        // The id moves to another prefix: the old prefix loses it.
        assert!(cache.set_cidr_identity(b, CIDR_IDENTITY_MIN));
        assert_eq!(cache.cidr_identity(&a), None);
        assert!(cache.select(&block).is_empty());
        // The prefix gets another id.
        assert!(cache.set_cidr_identity(a, CIDR_IDENTITY_MIN + 1));
        assert_eq!(ids(&cache.select(&block)), [CIDR_IDENTITY_MIN + 1]);
        assert!(cache.set_cidr_identity(a, CIDR_IDENTITY_MIN + 2));
        assert_eq!(ids(&cache.select(&block)), [CIDR_IDENTITY_MIN + 2]);
        assert_eq!(
            cache.labels(CIDR_IDENTITY_MIN + 2).unwrap().to_string(),
            "cidr:10.0.0.0/8"
        );
        assert!(cache.remove_cidr_identity(&a));
        assert!(!cache.remove_cidr_identity(&a));
        assert!(cache.select(&block).is_empty());
        assert_eq!(cache.identities(), 8);
    }

    #[test]
    fn unused_selectors_are_swept_and_recomputed_on_demand() {
        let mut cache = SelectorCache::new();
        cache.upsert_identity(256, labels("k8s:io.kubernetes.pod.namespace=ns0"));
        let peer = |i: usize| Peer::Pods {
            namespace: Some(format!("ns{i}")),
            namespace_selector: None,
            pod_selector: LabelSelector::default(),
        };
        // A working set that is looked up all the time, and churn.
        for i in 0..5 * MIN_SWEEP_SIZE {
            assert_eq!(ids(&cache.select(&peer(0))), [256]);
            cache.select(&peer(i + 1));
        }
        let memoised = cache.cached_selectors();
        assert!(memoised <= 2 * MIN_SWEEP_SIZE + 1, "{memoised}");
        // The hot selector survived every sweep and is still maintained.
        cache.upsert_identity(257, labels("k8s:io.kubernetes.pod.namespace=ns0"));
        assert_eq!(ids(&cache.select(&peer(0))), [256, 257]);
        // A swept one is computed again when needed.
        cache.upsert_identity(258, labels("k8s:io.kubernetes.pod.namespace=ns1"));
        assert_eq!(ids(&cache.select(&peer(1))), [258]);
    }

    #[test]
    fn named_ports_are_normalised() {
        let mut cache = SelectorCache::new();
        let http = NamedPort::new("http", super::super::Protocol::Tcp, 80);
        assert!(cache.set_named_ports(256, vec![http.clone(), http.clone()]));
        assert!(!cache.set_named_ports(256, vec![http.clone()]));
        assert_eq!(cache.named_ports_of(256), std::slice::from_ref(&http));
        assert!(cache.set_named_ports(256, vec![]));
        assert!(!cache.set_named_ports(256, vec![]));
        assert!(cache.named_ports_of(256).is_empty());
        assert!(cache.take_changes().named_ports_changed());

        let address: IpAddr = "198.18.0.5".parse().unwrap();
        assert!(cache.set_address_named_ports(address, vec![http.clone(), http.clone()]));
        assert!(!cache.set_address_named_ports(address, vec![http.clone()]));
        let changes = cache.take_changes();
        assert!(changes.named_ports_changed() && !changes.is_empty());
        assert_eq!(
            cache.addresses_with_named_ports().collect::<Vec<_>>(),
            [(address, std::slice::from_ref(&http))]
        );
        assert!(cache.set_address_named_ports(address, vec![]));
        assert_eq!(cache.addresses_with_named_ports().count(), 0);
        assert!(!cache.set_address_named_ports(address, vec![]));
    }
}

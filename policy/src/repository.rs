//! The policy repository: stored policies by key, their origins, a revision.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use rivet_common::labels::Labels;
use rivet_proto::loader::v1 as loader;
use serde::{Deserialize, Serialize};

use super::{
    AddressPrefix, Direction, Entry, NamedPort, Policy, PolicyError, PolicyKey, PolicyOrigin, SelectorCache,
    SelectorChanges, resolve,
};

/// A policy in the repository.
#[derive(Debug, Clone)]
pub struct StoredPolicy {
    /// The policy.
    pub policy: Arc<Policy>,
    /// Who stored it (and alone may change or delete it).
    pub origin: PolicyOrigin,
    /// Repository revision at which it last changed.
    pub revision: u64,
    /// When it last changed.
    pub updated: SystemTime,
}

/// The outcome of an upsert or delete.
#[derive(Debug, Clone)]
pub struct PolicyChange {
    /// The policy's key.
    pub key: PolicyKey,
    /// After an upsert: the policy's revision (unchanged on an identical
    /// repeat). After a delete: the repository's revision after it.
    pub revision: u64,
    /// Whether the repository changed (false for an identical repeat).
    pub changed: bool,
    /// The policy before (None when it is new).
    pub previous: Option<Arc<Policy>>,
    /// The policy after (None after a delete).
    pub current: Option<Arc<Policy>>,
}

impl PolicyChange {
    /// Whether the change can affect an endpoint with these identity labels:
    /// the previous or the current policy selects it. False when nothing
    /// changed.
    pub fn affects(&self, subject: &Labels) -> bool {
        self.changed
            && [&self.previous, &self.current]
                .into_iter()
                .flatten()
                .any(|p| p.selects(subject))
    }
}

/// The endpoint being resolved: its identity labels and its own named ports
/// (for ingress rules with named ports).
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// Identity labels, with namespace and namespace labels.
    pub labels: &'a Labels,
    /// The endpoint's named container ports.
    pub named_ports: &'a [NamedPort],
}

impl<'a> Subject<'a> {
    /// A subject without named ports.
    pub fn new(labels: &'a Labels) -> Self {
        Self {
            labels,
            named_ports: &[],
        }
    }
}

/// One endpoint's complete policy, as the loader takes it
/// (`rivet.loader.v1.EndpointPolicy`). A direction that is not enforced has
/// no entries and no prefixes; `entries` is sorted and unique by
/// (direction, peer_kind, peer_identity, protocol, port, end_port);
/// `prefixes` is sorted and unique by (direction, prefix), and a direction
/// has prefixes exactly when it has [`PeerKind::Address`](super::PeerKind::Address) entries, each of
/// which names the identity of one of them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResolvedPolicy {
    /// Ingress is default-deny: only what an entry allows enters.
    pub enforce_ingress: bool,
    /// Egress is default-deny.
    pub enforce_egress: bool,
    /// The entries.
    pub entries: Vec<Entry>,
    /// The prefixes address-matched entries are looked up through (absent in
    /// state written before ipBlocks matched by address).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefixes: Vec<AddressPrefix>,
}

impl ResolvedPolicy {
    /// Whether a direction is enforced.
    pub fn enforces(&self, direction: Direction) -> bool {
        match direction {
            Direction::Ingress => self.enforce_ingress,
            Direction::Egress => self.enforce_egress,
        }
    }

    /// The prefixes of one direction.
    pub fn prefixes_of(&self, direction: Direction) -> impl Iterator<Item = &AddressPrefix> {
        self.prefixes.iter().filter(move |p| p.direction == direction)
    }

    /// The entries of one direction.
    pub fn entries_of(&self, direction: Direction) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter(move |e| e.direction == direction)
    }

    /// The loader's message.
    pub fn to_proto(&self, revision: u64, allow_from_host: bool) -> loader::EndpointPolicy {
        loader::EndpointPolicy {
            revision,
            enforce_ingress: self.enforce_ingress,
            enforce_egress: self.enforce_egress,
            allow_from_host,
            entries: self.entries.iter().map(Entry::to_proto).collect(),
            prefixes: self.prefixes.iter().map(AddressPrefix::to_proto).collect(),
        }
    }
}

/// One endpoint's policy inputs, owned: the policies selecting it and a
/// snapshot of the selector cache for their peers. Resolving them gives what
/// [`PolicyRepository::resolve`] gives at the moment of
/// [`PolicyRepository::prepare`], without the repository or the cache, so a
/// large resolution can run on a blocking thread while both keep changing.
#[derive(Debug)]
pub struct Resolution {
    policies: Vec<Arc<Policy>>,
    cache: SelectorCache,
}

impl Resolution {
    /// The endpoint's complete policy.
    pub fn resolve(&self, subject: &Subject<'_>) -> ResolvedPolicy {
        resolve::resolve(self.policies.iter().map(|p| &**p), subject, &self.cache)
    }

    /// About how many entries per port the resolution makes: the peer
    /// identities summed over the selecting policies' rules.
    pub fn weight(&self) -> usize {
        self.cache.selected_identities()
    }
}

/// Every stored policy by key, with the origin owning each and a revision
/// that grows by one per effective change (starting at 0).
#[derive(Debug, Default)]
pub struct PolicyRepository {
    policies: BTreeMap<PolicyKey, StoredPolicy>,
    revision: u64,
}

impl PolicyRepository {
    /// An empty repository at revision 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current revision: 0 when nothing was ever stored, +1 per effective
    /// change.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Stores a policy or replaces the one with its key. An identical spec
    /// ([`Policy::same_spec`]) from the same origin changes nothing: the
    /// stored policy (and its document) and its revision stay and the change
    /// says `changed: false`. A key held by another origin is an
    /// [`PolicyError::OriginConflict`] and changes nothing.
    pub fn upsert(&mut self, policy: Policy, origin: PolicyOrigin) -> Result<PolicyChange, PolicyError> {
        let key = policy.key().clone();
        let previous = match self.policies.get(&key) {
            Some(stored) if stored.origin != origin => {
                return Err(PolicyError::OriginConflict {
                    key,
                    held_by: stored.origin,
                });
            }
            Some(stored) if stored.policy.same_spec(&policy) => {
                return Ok(PolicyChange {
                    key,
                    revision: stored.revision,
                    changed: false,
                    previous: Some(stored.policy.clone()),
                    current: Some(stored.policy.clone()),
                });
            }
            Some(stored) => Some(stored.policy.clone()),
            None => None,
        };
        self.revision += 1;
        let policy = Arc::new(policy);
        self.policies.insert(
            key.clone(),
            StoredPolicy {
                policy: policy.clone(),
                origin,
                revision: self.revision,
                updated: SystemTime::now(),
            },
        );
        Ok(PolicyChange {
            key,
            revision: self.revision,
            changed: true,
            previous,
            current: Some(policy),
        })
    }

    /// Deletes a policy: `Ok(None)` when absent, an
    /// [`PolicyError::OriginConflict`] when another origin holds it.
    pub fn delete(&mut self, key: &PolicyKey, origin: PolicyOrigin) -> Result<Option<PolicyChange>, PolicyError> {
        match self.policies.get(key) {
            None => return Ok(None),
            Some(stored) if stored.origin != origin => {
                return Err(PolicyError::OriginConflict {
                    key: key.clone(),
                    held_by: stored.origin,
                });
            }
            Some(_) => {}
        }
        let stored = self.policies.remove(key).expect("present");
        self.revision += 1;
        Ok(Some(PolicyChange {
            key: key.clone(),
            revision: self.revision,
            changed: true,
            previous: Some(stored.policy),
            current: None,
        }))
    }

    /// A stored policy.
    pub fn get(&self, key: &PolicyKey) -> Option<&StoredPolicy> {
        self.policies.get(key)
    }

    /// Every stored policy, ordered by key.
    pub fn iter(&self) -> impl Iterator<Item = &StoredPolicy> {
        self.policies.values()
    }

    /// How many policies are stored.
    pub fn len(&self) -> usize {
        self.policies.len()
    }

    /// Whether no policy is stored.
    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// The policies whose resolution `changes` can alter
    /// ([`Policy::reacts_to`]); only endpoints these select need a new
    /// resolution.
    pub fn affected_by(&self, changes: &SelectorChanges) -> Vec<Arc<Policy>> {
        if changes.is_empty() {
            return Vec::new();
        }
        self.policies
            .values()
            .filter(|s| s.policy.reacts_to(changes))
            .map(|s| s.policy.clone())
            .collect()
    }

    /// Every prefix of every policy's [`Policy::cidrs`]: the caller keeps a
    /// CIDR identity for each in the selector cache.
    pub fn cidrs(&self) -> BTreeSet<IpNet> {
        self.policies.values().flat_map(|s| s.policy.cidrs()).collect()
    }

    /// The host prefixes of local endpoint addresses that egress ipBlocks
    /// naming a port select ([`Policy`]'s rules over the named ports of
    /// [`SelectorCache::set_address_named_ports`]): the caller keeps a CIDR
    /// identity for each too, besides those of [`cidrs`](Self::cidrs).
    pub fn named_port_hosts(&self, identities: &SelectorCache) -> BTreeSet<IpNet> {
        self.policies
            .values()
            .flat_map(|s| s.policy.named_port_hosts(identities))
            .collect()
    }

    /// The complete policy of one endpoint: which directions are enforced
    /// and the sorted, unique entries.
    ///
    /// ```
    /// use rivet_policy::{
    ///     Direction, Entry, PeerKind, Policy, PolicyOrigin, PolicyRepository, Protocol, SelectorCache, Subject,
    ///     Verdict,
    /// };
    ///
    /// let mut repo = PolicyRepository::new();
    /// let policy = Policy::parse(
    ///     r#"
    /// apiVersion: networking.k8s.io/v1
    /// kind: NetworkPolicy
    /// metadata: {name: db-from-web, namespace: shop}
    /// spec:
    ///   podSelector: {matchLabels: {app: db}}
    ///   ingress:
    ///   - from: [{podSelector: {matchLabels: {app: web}}}]
    ///     ports: [{port: 5432}]
    /// "#,
    /// )?;
    /// repo.upsert(policy, PolicyOrigin::Api)?;
    ///
    /// let mut cache = SelectorCache::new();
    /// cache.upsert_identity(256, "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop".parse()?);
    /// cache.upsert_identity(257, "k8s:app=db,k8s:io.kubernetes.pod.namespace=shop".parse()?);
    ///
    /// let db = "k8s:app=db,k8s:io.kubernetes.pod.namespace=shop".parse()?;
    /// let resolved = repo.resolve(&Subject::new(&db), &cache);
    /// assert!(resolved.enforce_ingress);
    /// assert!(!resolved.enforce_egress, "a policy with only ingress rules does not restrict egress");
    /// assert_eq!(
    ///     resolved.entries,
    ///     [Entry {
    ///         direction: Direction::Ingress,
    ///         peer_identity: 256,
    ///         peer_kind: PeerKind::Identity,
    ///         protocol: Protocol::Tcp,
    ///         port: 5432,
    ///         end_port: 0,
    ///         verdict: Verdict::Allow,
    ///     }]
    /// );
    ///
    /// // A pod no policy selects is unrestricted.
    /// let web = "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop".parse()?;
    /// assert_eq!(repo.resolve(&Subject::new(&web), &cache), Default::default());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn resolve(&self, subject: &Subject<'_>, identities: &SelectorCache) -> ResolvedPolicy {
        resolve::resolve(self.policies.values().map(|s| &*s.policy), subject, identities)
    }

    /// The inputs of the resolution of an endpoint with `labels`, taken out
    /// of the repository and `identities` (see [`Resolution`]).
    pub fn prepare(&self, labels: &Labels, identities: &SelectorCache) -> Resolution {
        let policies: Vec<Arc<Policy>> = self
            .policies
            .values()
            .filter(|s| s.policy.selects(labels))
            .map(|s| s.policy.clone())
            .collect();
        let peers = policies.iter().flat_map(|p| p.peers());
        let cache = identities.snapshot_for(peers);
        Resolution { policies, cache }
    }
}

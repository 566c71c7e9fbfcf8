//! Resolution of one endpoint's policy: the selecting policies' rules
//! expanded over the selector cache into datapath entries.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::document::{PortRef, Rule};
use super::repository::{ResolvedPolicy, Subject};
use super::selector::Peer;
use super::{AddressPrefix, Direction, Entry, NamedPort, PeerKind, Policy, Protocol, SelectorCache, Verdict};

/// What the selecting policies say about one direction.
#[derive(Default, Clone, Copy)]
struct DirectionState {
    /// Some selecting policy has the direction in its policyTypes.
    applies: bool,
    /// One of those denies by default.
    default_deny: bool,
    /// One of those has rules (allow or deny) in the direction.
    has_rules: bool,
}

impl DirectionState {
    fn enforced(self) -> bool {
        self.applies && (self.default_deny || self.has_rules)
    }
}

/// The complete policy of `subject` under `policies`.
pub(crate) fn resolve<'p>(
    policies: impl Iterator<Item = &'p Policy>,
    subject: &Subject<'_>,
    cache: &SelectorCache,
) -> ResolvedPolicy {
    let selecting: Vec<&Policy> = policies.filter(|p| p.selects(subject.labels)).collect();
    let mut state = [DirectionState::default(); 2];
    let mut entries = Vec::new();
    let prefixes = Direction::ALL.map(|direction| address_prefixes(&selecting, direction, cache));
    for policy in &selecting {
        let spec = &policy.spec;
        for (slot, direction) in Direction::ALL.into_iter().enumerate() {
            if !spec.applies(direction) {
                continue;
            }
            let st = &mut state[slot];
            st.applies = true;
            st.default_deny |= spec.default_deny(direction);
            let context = Context {
                direction,
                subject,
                cache,
                prefixes: &prefixes[slot],
                prefix_ids: prefixes[slot].values().copied().collect(),
            };
            for verdict in [Verdict::Allow, Verdict::Deny] {
                let rules = spec.rules(direction, verdict);
                st.has_rules |= !rules.is_empty();
                for rule in rules {
                    expand(&mut entries, verdict, rule, &context);
                }
            }
        }
    }
    if super::is_initializing(subject.labels) {
        for st in &mut state {
            st.applies = true;
            st.default_deny = true;
        }
    }
    for (slot, direction) in Direction::ALL.into_iter().enumerate() {
        let st = state[slot];
        if !st.enforced() {
            entries.retain(|e: &Entry| e.direction != direction);
        } else if !st.default_deny {
            // Every selecting policy disabled default deny: allow the rest,
            // so only the deny rules bite.
            entries.push(Entry {
                direction,
                peer_kind: PeerKind::Identity,
                peer_identity: 0,
                protocol: Protocol::Any,
                port: 0,
                end_port: 0,
                verdict: Verdict::Allow,
            });
        }
    }
    let entries = finish(entries);
    // A direction without address-matched entries needs no prefix lookup.
    let prefixes = Direction::ALL
        .into_iter()
        .zip(prefixes)
        .filter(|(direction, _)| {
            entries
                .iter()
                .any(|e| e.direction == *direction && e.peer_kind == PeerKind::Address)
        })
        .flat_map(|(direction, prefixes)| {
            prefixes.into_iter().map(move |(prefix, identity)| AddressPrefix {
                direction,
                prefix,
                identity,
            })
        })
        .collect();
    ResolvedPolicy {
        enforce_ingress: state[0].enforced(),
        enforce_egress: state[1].enforced(),
        entries,
        prefixes,
    }
}

/// The prefixes the datapath matches peer addresses against in one
/// direction: every `cidr` and `except` prefix of the ipBlocks of the
/// selecting policies' rules (allow and deny) in that direction, and on
/// egress the host prefixes of the local endpoints those blocks resolve a
/// named port for ([`Policy::named_port_hosts`]), each with its CIDR
/// identity (a prefix without one yet is left out; see [`expand`]).
fn address_prefixes(selecting: &[&Policy], direction: Direction, cache: &SelectorCache) -> BTreeMap<IpNet, u32> {
    let blocks = selecting
        .iter()
        .filter(|p| p.spec.applies(direction))
        .flat_map(|p| [Verdict::Allow, Verdict::Deny].map(|v| p.spec.rules(direction, v)))
        .flatten()
        .flat_map(|rule| &rule.peers)
        .filter_map(|peer| match peer {
            Peer::IpBlock { cidr, except } => Some(std::iter::once(*cidr).chain(except.iter().copied())),
            _ => None,
        })
        .flatten();
    let hosts = selecting
        .iter()
        .filter(|_| direction == Direction::Egress)
        .flat_map(|p| p.named_port_hosts(cache));
    blocks
        .chain(hosts)
        .filter_map(|prefix| cache.cidr_identity(&prefix).map(|id| (prefix.trunc(), id)))
        .collect()
}

/// The longest of `prefixes` containing `address`, with its identity.
fn longest_prefix(prefixes: &BTreeMap<IpNet, u32>, address: IpAddr) -> Option<(IpNet, u32)> {
    prefixes
        .iter()
        .filter(|(prefix, _)| prefix.contains(&address))
        .max_by_key(|(prefix, _)| prefix.prefix_len())
        .map(|(prefix, id)| (*prefix, *id))
}

/// What [`expand`] needs besides the rule.
struct Context<'a, 's> {
    direction: Direction,
    subject: &'a Subject<'s>,
    cache: &'a SelectorCache,
    /// The direction's address prefixes with their CIDR identities ...
    prefixes: &'a BTreeMap<IpNet, u32>,
    /// ... and those identities.
    prefix_ids: BTreeSet<u32>,
}

/// Sorted, one entry per key, Deny winning over Allow.
fn finish(mut entries: Vec<Entry>) -> Vec<Entry> {
    // Entries order by key, then verdict (Allow < Deny): the last entry of a
    // key is a Deny when there is one.
    entries.sort_unstable();
    let mut out: Vec<Entry> = Vec::with_capacity(entries.len());
    for entry in entries {
        match out.last_mut() {
            Some(last) if last.same_key(&entry) => *last = entry,
            _ => out.push(entry),
        }
    }
    out
}

/// The peers of a rule: any (peer 0), or the union of the identity-matched
/// peers' identity sets and the address-matched (ipBlock) peers' CIDR
/// identities.
enum Peers {
    Any,
    Sets {
        identities: Vec<Arc<BTreeSet<u32>>>,
        addresses: BTreeSet<u32>,
    },
}

impl Peers {
    fn for_each(&self, mut f: impl FnMut(PeerKind, u32)) {
        match self {
            Self::Any => f(PeerKind::Identity, 0),
            Self::Sets { identities, addresses } => {
                identities
                    .iter()
                    .flat_map(|set| set.iter())
                    .for_each(|id| f(PeerKind::Identity, *id));
                addresses.iter().for_each(|id| f(PeerKind::Address, *id));
            }
        }
    }
}

/// Adds a rule's entries: peers x ports.
///
/// An ipBlock peer becomes address-matched entries for the CIDR identities
/// of the direction's prefixes it selects (inside `cidr`, outside every
/// `except`). An allowing ipBlock with a prefix whose CIDR identity is not
/// allocated yet contributes nothing until it is: without its `except`
/// prefixes the datapath would find `cidr` for excepted addresses and allow
/// them (for a deny, a missing `except` only denies more).
///
/// A named port on egress resolves per destination pod: for identity-matched
/// peers (and any peer) each identity's own numbers; for ipBlocks each
/// local endpoint's own numbers at its address's host prefix (see
/// [`Policy::named_port_hosts`]).
fn expand(out: &mut Vec<Entry>, verdict: Verdict, rule: &Rule, cx: &Context<'_, '_>) {
    let Context {
        direction,
        subject,
        cache,
        prefixes,
        ref prefix_ids,
    } = *cx;
    let peers = if rule.peers.is_empty() || rule.peers.iter().any(|p| p.is_any()) {
        Peers::Any
    } else {
        let mut identities = Vec::new();
        let mut addresses = BTreeSet::new();
        for peer in &rule.peers {
            match peer {
                Peer::IpBlock { cidr, except } => {
                    let complete = std::iter::once(cidr)
                        .chain(except)
                        .all(|p| cache.cidr_identity(p).is_some());
                    if verdict == Verdict::Deny || complete {
                        addresses.extend(cache.select(peer).intersection(prefix_ids));
                    }
                }
                _ => identities.push(cache.select(peer)),
            }
        }
        Peers::Sets { identities, addresses }
    };
    let entry = |peer_kind, peer_identity, protocol, port, end_port| Entry {
        direction,
        peer_kind,
        peer_identity,
        protocol,
        port,
        end_port,
        verdict,
    };
    if rule.ports.is_empty() {
        peers.for_each(|kind, peer| out.push(entry(kind, peer, Protocol::Any, 0, 0)));
        return;
    }
    for spec in &rule.ports {
        let protocol = spec.protocol;
        match &spec.port {
            None => peers.for_each(|kind, peer| out.push(entry(kind, peer, protocol, 0, 0))),
            Some(PortRef::Number(port)) => {
                let end = spec.end_port.unwrap_or(0);
                peers.for_each(|kind, peer| out.push(entry(kind, peer, protocol, *port, end)));
            }
            Some(PortRef::Name(_)) => {
                let mut push = |kind, peer, ports: &[NamedPort]| {
                    for named in ports.iter().filter(|p| spec.names(p)) {
                        out.push(entry(kind, peer, protocol, named.port, 0));
                    }
                };
                match (direction, &peers) {
                    // Ingress: the endpoint's own ports.
                    (Direction::Ingress, _) => peers.for_each(|kind, peer| push(kind, peer, subject.named_ports)),
                    // Egress to any peer: each identity with the name gets
                    // its own numbers; others (reserved and CIDR identities:
                    // not pods) get nothing.
                    (Direction::Egress, Peers::Any) => {
                        for (identity, ports) in cache.identities_with_named_ports() {
                            push(PeerKind::Identity, identity, ports);
                        }
                    }
                    (Direction::Egress, Peers::Sets { identities, addresses }) => {
                        // Each peer identity's own ports.
                        for identity in identities.iter().flat_map(|set| set.iter()) {
                            push(PeerKind::Identity, *identity, cache.named_ports_of(*identity));
                        }
                        // Each local endpoint inside a block, at its own
                        // address: the longest prefix containing it is its
                        // host prefix once that has a CIDR identity. Until
                        // then an allow gives nothing (fail closed) and a
                        // deny denies the numbers at the prefix it falls in.
                        for (address, ports) in cache.addresses_with_named_ports() {
                            let Some((prefix, id)) = longest_prefix(prefixes, address) else {
                                continue;
                            };
                            let own = prefix == IpNet::from(address);
                            if addresses.contains(&id) && (own || verdict == Verdict::Deny) {
                                push(PeerKind::Address, id, ports);
                            }
                        }
                    }
                }
            }
        }
    }
}

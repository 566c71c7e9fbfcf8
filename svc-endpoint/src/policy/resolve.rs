//! Resolution of one endpoint's policy: the selecting policies' rules
//! expanded over the selector cache into datapath entries.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::document::{PortRef, Rule};
use super::repository::{ResolvedPolicy, Subject};
use super::{Direction, Entry, NamedPort, Policy, Protocol, SelectorCache, Verdict};

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
    let mut state = [DirectionState::default(); 2];
    let mut entries = Vec::new();
    for policy in policies.filter(|p| p.selects(subject.labels)) {
        let spec = &policy.spec;
        for (slot, direction) in Direction::ALL.into_iter().enumerate() {
            if !spec.applies(direction) {
                continue;
            }
            let st = &mut state[slot];
            st.applies = true;
            st.default_deny |= spec.default_deny(direction);
            for verdict in [Verdict::Allow, Verdict::Deny] {
                let rules = spec.rules(direction, verdict);
                st.has_rules |= !rules.is_empty();
                for rule in rules {
                    expand(&mut entries, direction, verdict, rule, subject, cache);
                }
            }
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
                peer_identity: 0,
                protocol: Protocol::Any,
                port: 0,
                end_port: 0,
                verdict: Verdict::Allow,
            });
        }
    }
    ResolvedPolicy {
        enforce_ingress: state[0].enforced(),
        enforce_egress: state[1].enforced(),
        entries: finish(entries),
    }
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

/// The peers of a rule: any (peer 0), or the union of the peers' identity sets.
enum Peers {
    Any,
    Sets(Vec<Arc<BTreeSet<u32>>>),
}

impl Peers {
    fn for_each(&self, mut f: impl FnMut(u32)) {
        match self {
            Self::Any => f(0),
            Self::Sets(sets) => sets.iter().flat_map(|set| set.iter()).for_each(|id| f(*id)),
        }
    }
}

/// Adds a rule's entries: peers x ports.
fn expand(
    out: &mut Vec<Entry>,
    direction: Direction,
    verdict: Verdict,
    rule: &Rule,
    subject: &Subject<'_>,
    cache: &SelectorCache,
) {
    let peers = if rule.peers.is_empty() || rule.peers.iter().any(|p| p.is_any()) {
        Peers::Any
    } else {
        Peers::Sets(rule.peers.iter().map(|peer| cache.select(peer)).collect())
    };
    let entry = |peer_identity, protocol, port, end_port| Entry {
        direction,
        peer_identity,
        protocol,
        port,
        end_port,
        verdict,
    };
    if rule.ports.is_empty() {
        peers.for_each(|peer| out.push(entry(peer, Protocol::Any, 0, 0)));
        return;
    }
    for spec in &rule.ports {
        let protocol = spec.protocol;
        match &spec.port {
            None => peers.for_each(|peer| out.push(entry(peer, protocol, 0, 0))),
            Some(PortRef::Number(port)) => {
                let end = spec.end_port.unwrap_or(0);
                peers.for_each(|peer| out.push(entry(peer, protocol, *port, end)));
            }
            Some(PortRef::Name(name)) => {
                let resolves = |p: &&NamedPort| p.name == *name && p.protocol == protocol && p.port != 0;
                match (direction, &peers) {
                    // Ingress: the endpoint's own ports.
                    (Direction::Ingress, _) => {
                        for named in subject.named_ports.iter().filter(resolves) {
                            peers.for_each(|peer| out.push(entry(peer, protocol, named.port, 0)));
                        }
                    }
                    // Egress to any peer: whatever port the name has anywhere.
                    (Direction::Egress, Peers::Any) => {
                        for named in cache.all_named_ports().filter(resolves) {
                            out.push(entry(0, protocol, named.port, 0));
                        }
                    }
                    // Egress: each peer's own ports.
                    (Direction::Egress, Peers::Sets(_)) => peers.for_each(|peer| {
                        for named in cache.named_ports_of(peer).iter().filter(resolves) {
                            out.push(entry(peer, protocol, named.port, 0));
                        }
                    }),
                }
            }
        }
    }
}

//! A direct evaluator: what the policies say about one packet, straight
//! from their rules, without the selector cache or resolved entries. It is
//! the oracle the datapath is tested against (`tests/differential.rs`), so
//! it is kept independent of [`super::resolve`]: same semantics, different
//! code.

use std::net::IpAddr;

use ipnet::IpNet;
use rivet_common::identity::{IdentityScope, is_cluster};
use rivet_common::labels::Labels;

use super::document::{PortRef, PortSpec, Rule};
use super::selector::{IdentityRef, Peer};
use super::{Direction, NamedPort, PolicyRepository, Protocol, Subject, Verdict};

/// The other end of a packet: its identity, the labels of a cluster
/// identity, its address and, for a pod, its own named ports (for egress
/// rules naming a port, whatever their peers: Kubernetes resolves them
/// against the destination pod).
#[derive(Debug, Clone, Copy)]
pub struct PacketPeer<'a> {
    /// Numeric identity (reserved 1-7, cluster 256 <= id < 2^24, CIDR above).
    pub identity: u32,
    /// The labels of a cluster identity.
    pub labels: Option<&'a Labels>,
    /// The peer's address (ipBlock peers match on it).
    pub address: Option<IpAddr>,
    /// The peer pod's own named container ports (ignored unless `identity`
    /// is a cluster identity: only pods have named ports).
    pub named_ports: &'a [NamedPort],
}

/// What the policies do with one packet of a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// No selecting policy enforces the direction: everything passes.
    NotEnforced,
    /// An allow rule matches (or every enforcing policy disabled default
    /// deny and no deny rule matches).
    Allowed,
    /// A deny rule matches (Rivet's kind); wins over any allow.
    Denied,
    /// Enforced, and no rule allows it.
    DefaultDenied,
}

impl Decision {
    /// Whether the packet passes.
    pub fn passes(self) -> bool {
        matches!(self, Self::NotEnforced | Self::Allowed)
    }
}

impl PolicyRepository {
    /// What the stored policies do with a new connection's packet of
    /// `protocol` (IANA number) to destination port `port` (0 without
    /// ports) between `subject` and `peer` in `direction`, evaluated
    /// straight from the rules (see [`Decision`]): Kubernetes semantics (a
    /// policy enforces the directions of its policyTypes on the pods it
    /// selects; rules are a union; a rule without peers or ports matches
    /// any) plus Rivet's deny rules and `enableDefaultDeny`. Independent of
    /// [`resolve`](Self::resolve): the oracle of the datapath's tests.
    ///
    /// ```
    /// use rivet_policy::{Decision, Direction, PacketPeer, Policy, PolicyOrigin, PolicyRepository, Subject};
    ///
    /// let mut repo = PolicyRepository::new();
    /// repo.upsert(
    ///     Policy::parse(
    ///         r#"
    /// apiVersion: networking.k8s.io/v1
    /// kind: NetworkPolicy
    /// metadata: {name: db, namespace: shop}
    /// spec:
    ///   podSelector: {matchLabels: {app: db}}
    ///   ingress: [{from: [{podSelector: {matchLabels: {app: web}}}], ports: [{port: 5432}]}]
    /// "#,
    ///     )?,
    ///     PolicyOrigin::Api,
    /// )?;
    /// let db = "k8s:app=db,k8s:io.kubernetes.pod.namespace=shop".parse()?;
    /// let web = "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop".parse()?;
    /// let peer = PacketPeer { identity: 300, labels: Some(&web), address: None, named_ports: &[] };
    /// let subject = Subject::new(&db);
    /// assert_eq!(repo.evaluate(&subject, Direction::Ingress, &peer, 6, 5432), Decision::Allowed);
    /// assert_eq!(repo.evaluate(&subject, Direction::Ingress, &peer, 6, 80), Decision::DefaultDenied);
    /// assert_eq!(repo.evaluate(&subject, Direction::Egress, &peer, 6, 80), Decision::NotEnforced);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn evaluate(
        &self,
        subject: &Subject<'_>,
        direction: Direction,
        peer: &PacketPeer<'_>,
        protocol: u8,
        port: u16,
    ) -> Decision {
        let packet = Packet {
            direction,
            subject,
            peer,
            protocol,
            port,
        };
        let (mut applies, mut has_rules, mut default_deny) = (false, false, false);
        let (mut allowed, mut denied) = (false, false);
        for policy in self.iter().map(|s| &s.policy).filter(|p| p.selects(subject.labels)) {
            let spec = &policy.spec;
            if !spec.applies(direction) {
                continue;
            }
            applies = true;
            default_deny |= spec.default_deny(direction);
            for verdict in [Verdict::Allow, Verdict::Deny] {
                let rules = spec.rules(direction, verdict);
                has_rules |= !rules.is_empty();
                let hit = rules.iter().any(|rule| rule_matches(rule, &packet));
                match verdict {
                    Verdict::Allow => allowed |= hit,
                    Verdict::Deny => denied |= hit,
                }
            }
        }
        if super::is_initializing(subject.labels) {
            applies = true;
            default_deny = true;
        }
        if !applies || !(default_deny || has_rules) {
            Decision::NotEnforced
        } else if denied {
            Decision::Denied
        } else if allowed || !default_deny {
            Decision::Allowed
        } else {
            Decision::DefaultDenied
        }
    }
}

/// One packet, as the rules see it.
#[derive(Clone, Copy)]
struct Packet<'a> {
    direction: Direction,
    subject: &'a Subject<'a>,
    peer: &'a PacketPeer<'a>,
    /// IANA number.
    protocol: u8,
    /// Destination port; 0 for protocols without ports.
    port: u16,
}

fn rule_matches(rule: &Rule, packet: &Packet<'_>) -> bool {
    let peer_ok = rule.peers.is_empty() || rule.peers.iter().any(|p| peer_matches(p, packet.peer));
    let port_ok = rule.ports.is_empty() || rule.ports.iter().any(|spec| port_matches(spec, packet));
    peer_ok && port_ok
}

/// ipBlock peers match the peer's address (any address in the block and in
/// none of its excepts, pod addresses included); every other peer matches
/// its identity.
fn peer_matches(selector: &Peer, peer: &PacketPeer<'_>) -> bool {
    if let Peer::IpBlock { cidr, except } = selector {
        return peer
            .address
            .is_some_and(|a| cidr.contains(&a) && !except.iter().any(|e| e.contains(&a)));
    }
    let host_net = peer.address.map(IpNet::from);
    let identity = match IdentityScope::of(peer.identity) {
        IdentityScope::Reserved(r) => Some(IdentityRef::Reserved(r)),
        IdentityScope::Cluster => peer.labels.map(IdentityRef::Cluster),
        IdentityScope::Cidr => host_net.as_ref().map(IdentityRef::Cidr),
        IdentityScope::None | IdentityScope::Unassigned => None,
    };
    match identity {
        Some(identity) => selector.matches(identity),
        None => selector.is_any(),
    }
}

fn port_matches(spec: &PortSpec, packet: &Packet<'_>) -> bool {
    let Packet {
        direction,
        subject,
        peer,
        protocol,
        port,
    } = *packet;
    if spec.protocol == Protocol::Any {
        return true;
    }
    if spec.protocol.number() != u32::from(protocol) {
        return false;
    }
    match &spec.port {
        None => true,
        Some(PortRef::Number(first)) => (*first..=spec.end_port.unwrap_or(*first)).contains(&port),
        Some(PortRef::Name(name)) => {
            // Ingress: the endpoint's own ports; egress: the destination
            // pod's own (only pods have named ports: a reserved or CIDR
            // identity never matches one).
            let ports = match direction {
                Direction::Ingress => subject.named_ports,
                Direction::Egress if is_cluster(peer.identity) => peer.named_ports,
                Direction::Egress => &[],
            };
            ports
                .iter()
                .any(|n| n.name == *name && n.protocol == spec.protocol && n.port == port && port != 0)
        }
    }
}

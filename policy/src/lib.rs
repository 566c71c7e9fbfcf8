//! The policy engine (DESIGN.md §6): a repository of network policies, a
//! selector cache over identities, and resolution of one endpoint's exact
//! datapath policy entries.
//!
//! This crate is a pure library: no I/O, no async, no clocks except the
//! `updated` time stamped on stored policies.
//!
//! # Model
//!
//! Selectors and entities are evaluated in *identity space*; ipBlocks by
//! *address*. An endpoint (a pod) is known by its identity labels
//! ([`Labels`]), which besides the pod's own labels (`k8s:app=web`) carry its
//! namespace (`k8s:io.kubernetes.pod.namespace=shop`) and every label of that
//! namespace (`k8s:ns.labels/<key>=<value>`, always including
//! `kubernetes.io/metadata.name=<namespace>`). So a podSelector, a
//! namespaceSelector and both combined are all selectors over identities:
//!
//! - a **podSelector** key `app` matches a label with key `app` of source
//!   `k8s`, `container` or `unspec` (the namespace keys above are never pod
//!   labels: a pod cannot claim them);
//! - a **namespaceSelector** key `team` matches the label `k8s:ns.labels/team`;
//! - an **ipBlock** matches every *address* inside its `cidr` and outside all
//!   its `except` prefixes: pod and node addresses included, decided per
//!   address by the datapath (see "ipBlocks match addresses" below), so two
//!   pods of one identity can fall on different sides of a block;
//! - an **entity** (Rivet's kind only) names reserved identities (`host` 1,
//!   `world` 2 plus every CIDR identity, `remote-node` 6, `cluster` = every
//!   reserved identity but world plus every cluster identity, `all` = any).
//!   Entities stay identity-based: a pod address is never `world` because
//!   some ipBlock covers it.
//!
//! Pod and namespace selectors only match cluster identities (256 <= id <
//! 2^24) that carry a namespace label; never reserved or CIDR identities.
//!
//! # ipBlocks match addresses
//!
//! The caller allocates a node-local CIDR identity (>= 2^24) for every prefix
//! of [`Policy::cidrs`]. An ipBlock `(C, E_1..E_n)` selects the CIDR
//! identities of the prefixes inside `C` and inside no `E_i`. Its entries are
//! [`PeerKind::Address`] entries, and the endpoint's [`ResolvedPolicy`]
//! lists per direction its [`AddressPrefix`]es `S`: every `cidr` and
//! `except` prefix of the ipBlocks of the policies selecting it in that
//! direction. For a packet's peer address `a` the datapath takes the longest
//! prefix `P` of `S` containing `a` and applies the address entries of
//! `P`'s identity, besides (deny wins, any allow allows) the identity entries
//! of the peer's identity. That is exactly "a ∈ C \ ∪E_i" for every block,
//! because `S` holds `C` and every `E_i`:
//!
//! - if `a ∈ C` and `a ∉` any `E_i`: `C ∈ S` contains `a`, so `P` exists and
//!   nests with `C`; being longest, `P ⊆ C`. `P ⊆ E_i` would put `a` in
//!   `E_i`, so `P` is inside no `E_i`: the block selects `P`;
//! - if the block selects `P`: `a ∈ P ⊆ C`; and `a ∈ E_i` would make `E_i ∈ S`
//!   nest with `P`, so `P ⊆ E_i` (P is longest), which the block excludes.
//!
//! The argument holds for any `S` holding every block's prefixes, so extra
//! prefixes (of other blocks, other policies) change nothing; entries are
//! only made for identities of `S`. A prefix whose CIDR identity is not
//! allocated yet is not in `S`: an allowing block then contributes nothing
//! until all its prefixes have one (fail closed); a denying block still
//! contributes (a missing `except` only denies more).
//!
//! Traffic from or to addresses outside the cluster gets the verdict it got
//! when ipBlocks were matched through the ipcache's CIDR identities (the
//! node-wide longest prefix over every policy's prefixes): by the argument
//! above both decide "a ∈ C \ ∪E_i". The ipcache keeps the CIDR identities,
//! which entities (`world`) still need.
//!
//! # Named ports
//!
//! As in Kubernetes, a named port resolves against the destination pod's own
//! container ports: on ingress the endpoint's ([`Subject::named_ports`]), on
//! egress each destination pod's. Only pods have named ports, so a named
//! port never matches host, world, remote-node or an address no pod holds,
//! and a name that resolves to nothing contributes nothing. On egress:
//!
//! - **identity-matched peers** (pod and namespace selectors, entities): an
//!   entry per selected identity with a port of that name, with that
//!   identity's numbers ([`SelectorCache::set_named_ports`]: the union over
//!   the node's endpoints of that identity);
//! - **any peer** (no `to`, or the entity `all`): the same for every
//!   identity with a port of that name (`to` all pods, not peer 0: rule
//!   `ports: [{port: web}]` reaches each pod on its own `web` and nothing
//!   else on any number);
//! - **ipBlocks**: the node's endpoints whose addresses the block selects
//!   each lend their own numbers to their own address
//!   ([`SelectorCache::set_address_named_ports`]). The caller allocates a
//!   CIDR identity for the host prefix (/32, /128) of each such address
//!   ([`PolicyRepository::named_port_hosts`]); it joins the endpoint's
//!   prefixes `S`, where it is the longest prefix of that address only, so
//!   the numbers are address entries of that host prefix and apply to that
//!   pod alone (by the argument above, the host prefix also gets every other
//!   block's entries for its address). An address in an `except` is not
//!   selected and gets nothing. Until a host prefix has its CIDR identity,
//!   an allow gives that pod nothing on the name (fail closed) and a deny
//!   denies its numbers at the prefix its address falls in (denies more).
//!   The ipcache prefers the pod's own endpoint entry over the host
//!   prefix's CIDR claim, so the pod keeps its identity for every other
//!   rule.
//!
//! The remaining approximations: endpoints of one identity share one
//! identity entry, so on identity-matched and any-peer rules each gets the
//! union of their numbers for a name (ipBlock rules are exact per address);
//! and only this node's endpoints declare named ports, so pods on other
//! nodes match no egress named port until their ports arrive with the
//! Kubernetes feed (issue 14).
//!
//! # Pieces
//!
//! - [`Policy`]: one parsed, validated and normalised document, either a
//!   Kubernetes `NetworkPolicy` (`networking.k8s.io/v1`) or Rivet's
//!   `RivetNetworkPolicy` (`rivet.io/v1`: the same spec plus entity peers,
//!   ICMP/ICMPv6/ANY protocols, `ingressDeny`/`egressDeny` rules and
//!   `enableDefaultDeny`). Parse errors name the field path
//!   (`spec.ingress[0].ports[1].endPort: must be >= port (80)`).
//! - [`documents`]: an input with several documents (a YAML stream or a
//!   JSON array) split into them, the one way every reader splits;
//!   [`Policy::parse_all`] parses them all.
//! - [`PolicyRepository`]: the stored policies by [`PolicyKey`], each owned
//!   by the [`PolicyOrigin`] that created it, with a revision counter.
//! - [`SelectorCache`]: the known identities (reserved, cluster, CIDR), the
//!   named ports of local endpoints by identity and by address, and per
//!   distinct peer selector the set of identities it matches, memoised and
//!   updated incrementally as identities come and go.
//! - [`PolicyRepository::resolve`]: the complete [`ResolvedPolicy`] of one
//!   endpoint: per direction whether it is enforced, the sorted, unique
//!   [`Entry`] list the loader takes (`rivet.loader.v1.PolicyEntry`), and the
//!   [`AddressPrefix`]es of its ipBlocks (`rivet.loader.v1.EndpointPrefix`).
//! - [`PolicyRepository::evaluate`]: the [`Decision`] for one packet, straight
//!   from the rules (no selector cache, no entries): the oracle the datapath
//!   is tested against. It matches ipBlock peers on the peer's address.
//!
//! # Semantics
//!
//! Kubernetes NetworkPolicy first. A policy selects the endpoints of its own
//! namespace that match `spec.podSelector`. `policyTypes` (default: Ingress,
//! plus Egress when `spec.egress` has rules, as the API server defaults it)
//! names the directions in which the policy enforces default deny for what it
//! selects; rules of other directions are ignored. An endpoint selected by no
//! policy in a direction is unrestricted in it. Policies combine as a union;
//! each rule contributes peers x ports entries. A rule with no peers allows
//! any peer (peer identity 0), a rule with no ports any protocol and port
//! (protocol [`Protocol::Any`]); a rule whose peers match no identity at the
//! moment contributes nothing (it is not a wildcard). Named ports resolve
//! against the destination pod's ports (see "Named ports" above).
//!
//! Rivet's kind adds deny rules (a Deny entry wins over an Allow entry with
//! the same key) and `enableDefaultDeny`. When every policy selecting an
//! endpoint in a direction disables default deny and some of them have rules
//! there, the direction is enforced with a wildcard Allow entry, so only the
//! deny rules bite. Without `policyTypes`, a Rivet policy's directions are
//! those it has rules (allow or deny) for, Ingress when it has none at all;
//! unlike Kubernetes' "Ingress always" this means an egress-only Rivet policy
//! does not silently default-deny ingress.
//!
//! An endpoint whose labels are not known yet holds the reserved `init`
//! identity (`reserved:init`; svc-endpoint's Kubernetes mode) and is
//! default-deny in both directions whatever selects it (as Cilium's
//! repository does, though its docs say otherwise): nothing tells whether a
//! NetworkPolicy isolates the pod, so it is treated as isolated until its
//! labels arrive. Only the host (svc-endpoint's `--allow-from-host`, for
//! kubelet probes) reaches it meanwhile; no policy kind can name
//! `reserved:init` as its subject yet ([`is_initializing`]).
//!
//! Every entry produced is one the loader accepts: ports only with TCP, UDP
//! or SCTP, `end_port` only above `port`, named ports resolved to non-zero
//! numbers.

mod document;
pub mod documents;
mod evaluate;
mod repository;
mod resolve;
mod selector;
mod selector_cache;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[cfg(doc)]
use rivet_common::labels::Labels;
use rivet_proto::loader::v1 as loader;

pub use document::Policy;

/// Whether an endpoint with these identity labels is initializing (holds
/// the reserved `init` identity): it is default-deny in both directions.
///
/// ```
/// use rivet_common::labels::{Labels, ReservedIdentity};
///
/// assert!(rivet_policy::is_initializing(&ReservedIdentity::Init.labels()));
/// assert!(!rivet_policy::is_initializing(&"k8s:app=web".parse::<Labels>()?));
/// # Ok::<(), rivet_common::labels::LabelError>(())
/// ```
pub fn is_initializing(labels: &rivet_common::labels::Labels) -> bool {
    labels
        .get_from(
            rivet_common::labels::LabelSource::Reserved,
            rivet_common::labels::ReservedIdentity::Init.name(),
        )
        .is_some()
}
pub use evaluate::{Decision, PacketPeer};
pub use repository::{PolicyChange, PolicyRepository, Resolution, ResolvedPolicy, StoredPolicy, Subject};
pub use selector_cache::{SelectorCache, SelectorChanges};

/// apiVersion of [`PolicyKind::NetworkPolicy`].
pub const NETWORK_POLICY_API_VERSION: &str = "networking.k8s.io/v1";
/// apiVersion of [`PolicyKind::RivetNetworkPolicy`].
pub const RIVET_POLICY_API_VERSION: &str = "rivet.io/v1";

/// The kind of a policy document.
///
/// ```
/// use rivet_policy::PolicyKind;
///
/// let kind: PolicyKind = "RivetNetworkPolicy".parse()?;
/// assert_eq!(kind.as_str(), "RivetNetworkPolicy");
/// assert_eq!(kind.api_version(), "rivet.io/v1");
/// assert!("Pod".parse::<PolicyKind>().is_err());
/// # Ok::<(), rivet_policy::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    /// Kubernetes `NetworkPolicy` (`networking.k8s.io/v1`).
    NetworkPolicy,
    /// Rivet's own `RivetNetworkPolicy` (`rivet.io/v1`).
    RivetNetworkPolicy,
}

impl PolicyKind {
    /// Every kind.
    pub const ALL: [PolicyKind; 2] = [Self::NetworkPolicy, Self::RivetNetworkPolicy];

    /// The kind as written in documents.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NetworkPolicy => "NetworkPolicy",
            Self::RivetNetworkPolicy => "RivetNetworkPolicy",
        }
    }

    /// The apiVersion a document of this kind must have.
    pub const fn api_version(self) -> &'static str {
        match self {
            Self::NetworkPolicy => NETWORK_POLICY_API_VERSION,
            Self::RivetNetworkPolicy => RIVET_POLICY_API_VERSION,
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = PolicyError;

    /// Exactly `NetworkPolicy` or `RivetNetworkPolicy`; an error has path `kind`.
    fn from_str(s: &str) -> Result<Self, PolicyError> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| PolicyError::Invalid {
                path: "kind".into(),
                reason: format!("must be NetworkPolicy or RivetNetworkPolicy, found {s:?}"),
            })
    }
}

impl Serialize for PolicyKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for PolicyKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// What identifies a policy in the repository: kind, namespace and name from
/// the document. Displayed (and parsed) as `kind/namespace/name`.
///
/// ```
/// use rivet_policy::{PolicyKey, PolicyKind};
///
/// let key = PolicyKey::new(PolicyKind::NetworkPolicy, "shop", "allow-web");
/// assert_eq!(key.to_string(), "NetworkPolicy/shop/allow-web");
/// assert_eq!("NetworkPolicy/shop/allow-web".parse::<PolicyKey>()?, key);
/// # Ok::<(), rivet_policy::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PolicyKey {
    /// The document's kind.
    pub kind: PolicyKind,
    /// metadata.namespace (`default` when the document has none).
    pub namespace: String,
    /// metadata.name.
    pub name: String,
}

impl PolicyKey {
    /// A key from its parts (not validated).
    pub fn new(kind: PolicyKind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

impl FromStr for PolicyKey {
    type Err = PolicyError;

    /// `kind/namespace/name`; namespace and name are not validated beyond
    /// being non-empty and free of `/`.
    fn from_str(s: &str) -> Result<Self, PolicyError> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            [kind, namespace, name] if !namespace.is_empty() && !name.is_empty() => {
                Ok(Self::new(kind.parse()?, *namespace, *name))
            }
            _ => Err(PolicyError::Invalid {
                path: String::new(),
                reason: format!("a policy key is kind/namespace/name, found {s:?}"),
            }),
        }
    }
}

/// Who stored a policy. Only the origin that created a policy can replace or
/// delete it, so one feed's reconciliation never touches another's policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyOrigin {
    /// `rivet policy apply` and other direct API clients.
    Api,
    /// The watched `--policy-dir`.
    Directory,
    /// svc-k8s-sync.
    Kubernetes,
}

impl PolicyOrigin {
    /// `api`, `directory` or `kubernetes`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Directory => "directory",
            Self::Kubernetes => "kubernetes",
        }
    }
}

impl fmt::Display for PolicyOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Traffic direction, seen from the endpoint: Ingress enters the pod, Egress
/// leaves it. Displayed and serialised as in `policyTypes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Direction {
    /// Traffic entering the endpoint.
    Ingress,
    /// Traffic leaving the endpoint.
    Egress,
}

impl Direction {
    /// Both directions.
    pub const ALL: [Direction; 2] = [Self::Ingress, Self::Egress];

    /// `Ingress` or `Egress`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ingress => "Ingress",
            Self::Egress => "Egress",
        }
    }

    /// The loader's enum.
    pub fn to_proto(self) -> loader::Direction {
        match self {
            Self::Ingress => loader::Direction::Ingress,
            Self::Egress => loader::Direction::Egress,
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an entry does with matching traffic. Deny sorts after Allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Verdict {
    /// Let it through.
    Allow,
    /// Drop it, whatever else allows it.
    Deny,
}

impl Verdict {
    /// `Allow` or `Deny`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "Allow",
            Self::Deny => "Deny",
        }
    }

    /// The loader's enum.
    pub fn to_proto(self) -> loader::Verdict {
        match self {
            Self::Allow => loader::Verdict::Allow,
            Self::Deny => loader::Verdict::Deny,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An IP protocol of a policy entry, or [`Protocol::Any`]. Written (and
/// serialised) in Kubernetes' spelling: `TCP`, `UDP`, `SCTP`, plus Rivet's
/// `ICMP`, `ICMPv6` and `ANY`; parsing is case-sensitive like Kubernetes'.
///
/// ```
/// use rivet_policy::Protocol;
///
/// assert_eq!("TCP".parse::<Protocol>(), Ok(Protocol::Tcp));
/// assert_eq!(Protocol::Tcp.number(), 6);
/// assert_eq!(Protocol::Any.number(), 256);
/// assert!(!Protocol::Icmp.has_ports());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// Any protocol and any port (loader `PROTOCOL_ANY`, 256).
    Any,
    /// ICMP (1).
    Icmp,
    /// TCP (6).
    Tcp,
    /// UDP (17).
    Udp,
    /// ICMPv6 (58).
    Icmpv6,
    /// SCTP (132).
    Sctp,
}

impl Protocol {
    /// Every protocol.
    pub const ALL: [Protocol; 6] = [Self::Any, Self::Icmp, Self::Tcp, Self::Udp, Self::Icmpv6, Self::Sctp];

    /// The IANA protocol number; 256 for [`Protocol::Any`] (as loader.proto).
    pub const fn number(self) -> u32 {
        match self {
            Self::Any => 256,
            Self::Icmp => 1,
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Icmpv6 => 58,
            Self::Sctp => 132,
        }
    }

    /// The protocol with this number (256 = Any).
    pub fn from_number(number: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.number() == number)
    }

    /// The name as written in policies: `TCP`, `UDP`, `SCTP`, `ICMP`, `ICMPv6`, `ANY`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Any => "ANY",
            Self::Icmp => "ICMP",
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Icmpv6 => "ICMPv6",
            Self::Sctp => "SCTP",
        }
    }

    /// Whether entries of this protocol may name ports (TCP, UDP, SCTP).
    pub const fn has_ports(self) -> bool {
        matches!(self, Self::Tcp | Self::Udp | Self::Sctp)
    }

    /// The loader's enum.
    pub fn to_proto(self) -> loader::Protocol {
        match self {
            Self::Any => loader::Protocol::Any,
            Self::Icmp => loader::Protocol::Icmp,
            Self::Tcp => loader::Protocol::Tcp,
            Self::Udp => loader::Protocol::Udp,
            Self::Icmpv6 => loader::Protocol::Icmpv6,
            Self::Sctp => loader::Protocol::Sctp,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown protocol {s:?} (expected TCP, UDP, SCTP, ICMP, ICMPv6 or ANY)"))
    }
}

impl Serialize for Protocol {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Protocol {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A named container port of an endpoint (Kubernetes `containerPort` with a
/// name), which policy ports can refer to by name. Only TCP, UDP and SCTP
/// ports with a non-zero number are ever resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NamedPort {
    /// The port's name (an IANA service name such as `http`).
    pub name: String,
    /// TCP, UDP or SCTP.
    pub protocol: Protocol,
    /// The port number.
    pub port: u16,
}

impl NamedPort {
    /// A named port.
    pub fn new(name: impl Into<String>, protocol: Protocol, port: u16) -> Self {
        Self {
            name: name.into(),
            protocol,
            port,
        }
    }
}

/// How an [`Entry`]'s peer is matched (loader.proto's `PeerKind`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PeerKind {
    /// The peer's security identity (pod and namespace selectors, entities).
    #[default]
    Identity,
    /// The peer's address (ipBlock): the longest of the endpoint's
    /// [`AddressPrefix`]es of the direction containing it has the CIDR
    /// identity `peer_identity`.
    Address,
}

impl PeerKind {
    /// The loader's enum.
    pub fn to_proto(self) -> loader::PeerKind {
        match self {
            Self::Identity => loader::PeerKind::Identity,
            Self::Address => loader::PeerKind::Address,
        }
    }
}

/// One prefix an endpoint matches peer addresses against in one direction
/// (loader.proto's `EndpointPrefix`): a `cidr` or `except` prefix of an
/// ipBlock of a policy selecting the endpoint, with its CIDR identity.
/// Ordered by direction, then prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AddressPrefix {
    /// Direction of the traffic.
    pub direction: Direction,
    /// The prefix (host bits clear).
    pub prefix: IpNet,
    /// Its node-local CIDR identity (>= 2^24).
    pub identity: u32,
}

impl AddressPrefix {
    /// The loader's message.
    pub fn to_proto(&self) -> loader::EndpointPrefix {
        loader::EndpointPrefix {
            direction: self.direction.to_proto().into(),
            prefix: Some(rivet_proto::net::prefix_to_proto(self.prefix.trunc())),
            cidr_identity: self.identity,
        }
    }
}

/// One datapath policy entry, exactly loader.proto's `PolicyEntry`.
///
/// Wildcards: `peer_identity` 0 = any identity, `protocol` [`Protocol::Any`]
/// = any protocol and port, `port` 0 = any port of the protocol, `end_port`
/// 0 = the single port `port` (otherwise the inclusive range
/// `port..=end_port`, `end_port > port`). Ordered by direction, peer kind,
/// peer, protocol, port, end port, verdict. Displayed as
/// `Ingress Allow 256 TCP 80-90` (`*` for peer 0, `addr:<id>` for an
/// address-matched peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Entry {
    /// Direction of the traffic.
    pub direction: Direction,
    /// How the peer is matched (absent in state written before ipBlocks
    /// matched by address: identity).
    #[serde(default)]
    pub peer_kind: PeerKind,
    /// Identity of the remote side; 0 = any. With [`PeerKind::Address`] the
    /// CIDR identity of the prefix the peer's address falls in.
    pub peer_identity: u32,
    /// Protocol; Any = any protocol and port.
    pub protocol: Protocol,
    /// Port (TCP/UDP/SCTP only); 0 = any.
    pub port: u16,
    /// Last port of a range; 0 = only `port`.
    pub end_port: u16,
    /// What to do.
    pub verdict: Verdict,
}

impl Entry {
    /// Whether two entries have the same key (everything but the verdict).
    pub fn same_key(&self, other: &Entry) -> bool {
        (
            self.direction,
            self.peer_kind,
            self.peer_identity,
            self.protocol,
            self.port,
            self.end_port,
        ) == (
            other.direction,
            other.peer_kind,
            other.peer_identity,
            other.protocol,
            other.port,
            other.end_port,
        )
    }

    /// The loader's message.
    pub fn to_proto(&self) -> loader::PolicyEntry {
        loader::PolicyEntry {
            direction: self.direction.to_proto().into(),
            peer_identity: self.peer_identity,
            protocol: self.protocol.to_proto().into(),
            port: u32::from(self.port),
            end_port: u32::from(self.end_port),
            verdict: self.verdict.to_proto().into(),
            peer_kind: self.peer_kind.to_proto().into(),
        }
    }
}

impl From<Entry> for loader::PolicyEntry {
    fn from(entry: Entry) -> Self {
        entry.to_proto()
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.direction, self.verdict)?;
        match (self.peer_kind, self.peer_identity) {
            (PeerKind::Identity, 0) => f.write_str("*")?,
            (PeerKind::Identity, id) => write!(f, "{id}")?,
            (PeerKind::Address, id) => write!(f, "addr:{id}")?,
        }
        write!(f, " {}", self.protocol)?;
        if self.port != 0 {
            write!(f, " {}", self.port)?;
            if self.end_port != 0 {
                write!(f, "-{}", self.end_port)?;
            }
        }
        Ok(())
    }
}

/// Why a policy was rejected, or why the repository refused a change.
///
/// ```
/// use rivet_policy::{Policy, PolicyError};
///
/// let err = Policy::parse("apiVersion: v1\nkind: Pod\nmetadata: {name: x}").unwrap_err();
/// assert!(matches!(&err, PolicyError::Invalid { path, .. } if path == "kind"));
/// assert_eq!(err.to_string(), r#"kind: must be NetworkPolicy or RivetNetworkPolicy, found "Pod""#);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Not parseable as YAML/JSON, or not the expected shape (unknown field,
    /// wrong type). `path` is like `spec.ingress[0].ports[1].port`; empty at
    /// the top.
    #[error("{}{reason}", path_prefix(path))]
    Syntax {
        /// Where in the document.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Parsed but invalid, e.g. path `spec.ingress[0].ports[1].endPort` and
    /// reason `must be >= port (80)`.
    #[error("{}{reason}", path_prefix(path))]
    Invalid {
        /// Where in the document.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The key is held by a policy of another origin.
    #[error("{key} belongs to origin {held_by}: only {held_by} can change or delete it")]
    OriginConflict {
        /// The policy's key.
        key: PolicyKey,
        /// The origin holding it.
        held_by: PolicyOrigin,
    },
}

impl PolicyError {
    /// The field path of a Syntax or Invalid error.
    pub fn path(&self) -> Option<&str> {
        match self {
            Self::Syntax { path, .. } | Self::Invalid { path, .. } => Some(path),
            Self::OriginConflict { .. } => None,
        }
    }

    pub(crate) fn invalid(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// `"{path}: "`, or nothing at the top of the document.
fn path_prefix(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("{path}: ")
    }
}

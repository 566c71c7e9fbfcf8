//! What is probed and what a probe says: the targets a peer node gives
//! ([`Peer::targets`]) and the outcome of one probe ([`ProbeOutcome`]). No
//! I/O here: the probes themselves are [`crate::net`]'s.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

/// What a probe checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeKind {
    /// ICMP (v4) or ICMPv6 echo to a peer's underlay address.
    IcmpNode,
    /// HTTP GET /hello on port 4240 of a peer's underlay address.
    HttpNode,
    /// HTTP GET /hello on port 4240 of a peer's health endpoint, sent from
    /// this node's health endpoint through the pod datapath.
    HttpHealthEndpoint,
}

impl ProbeKind {
    /// Every kind, in order.
    pub const ALL: [ProbeKind; 3] = [ProbeKind::IcmpNode, ProbeKind::HttpNode, ProbeKind::HttpHealthEndpoint];

    /// The name in metrics and tables (`icmp_node`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::IcmpNode => "icmp_node",
            ProbeKind::HttpNode => "http_node",
            ProbeKind::HttpHealthEndpoint => "http_health_endpoint",
        }
    }
}

impl fmt::Display for ProbeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing to probe: a kind and an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    /// What is checked.
    pub kind: ProbeKind,
    /// Where.
    pub address: IpAddr,
}

/// Why a probe failed, by kind (metrics count failures by it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// No answer within the probe timeout.
    Timeout,
    /// The connection was refused.
    Refused,
    /// The network or host is unreachable.
    NoRoute,
    /// An answer that is not the expected one.
    BadResponse,
    /// The probe's socket could not be created or used.
    Socket,
}

impl FailureKind {
    /// The name in metrics and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::Refused => "refused",
            FailureKind::NoRoute => "no_route",
            FailureKind::BadResponse => "bad_response",
            FailureKind::Socket => "socket",
        }
    }

    /// The kind of an I/O error from connecting, sending or receiving.
    pub fn of_io(error: &std::io::Error) -> Self {
        use std::io::ErrorKind;
        match error.kind() {
            ErrorKind::TimedOut | ErrorKind::WouldBlock => FailureKind::Timeout,
            ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => FailureKind::Refused,
            ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable | ErrorKind::NetworkDown => FailureKind::NoRoute,
            _ => match error.raw_os_error() {
                // ENOBUFS from a datagram send: the neighbour's queue of
                // packets waiting for its resolution is full (the peer does
                // not answer ARP / neighbour solicitation).
                Some(libc::EHOSTDOWN | libc::ENOBUFS) => FailureKind::NoRoute,
                _ => FailureKind::Socket,
            },
        }
    }
}

/// A failed probe: its kind and what happened, for people.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProbeFailure {
    /// Why, by kind.
    pub kind: FailureKind,
    /// What happened.
    pub message: String,
}

impl ProbeFailure {
    /// A failure of `kind`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// An I/O error while `doing` something.
    pub fn io(doing: &str, error: &std::io::Error) -> Self {
        Self::new(FailureKind::of_io(error), format!("{doing}: {error}"))
    }
}

/// A probe's result: the round trip, or why it failed.
pub type ProbeOutcome = Result<Duration, ProbeFailure>;

/// A peer node as the registry lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// The node's name.
    pub name: String,
    /// Its underlay addresses.
    pub addresses: Vec<IpAddr>,
    /// Its health endpoint addresses (empty: none yet).
    pub health_addresses: Vec<IpAddr>,
}

impl Peer {
    /// What to probe of this peer, sorted: ICMP and HTTP on every underlay
    /// address, and HTTP on every health endpoint address of a family this
    /// node's own health endpoint has (`local_health_families`: a probe
    /// through the pod datapath starts there).
    pub fn targets(&self, local_health: &[IpAddr]) -> Vec<Target> {
        let mut targets: Vec<Target> = self
            .addresses
            .iter()
            .flat_map(|&address| {
                [ProbeKind::IcmpNode, ProbeKind::HttpNode]
                    .into_iter()
                    .map(move |kind| Target { kind, address })
            })
            .chain(
                self.health_addresses
                    .iter()
                    .filter(|a| local_health.iter().any(|l| l.is_ipv4() == a.is_ipv4()))
                    .map(|&address| Target {
                        kind: ProbeKind::HttpHealthEndpoint,
                        address,
                    }),
            )
            .collect();
        targets.sort();
        targets.dedup();
        targets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_peer_is_probed_on_every_address_and_on_health_endpoints_of_local_families() {
        let peer = Peer {
            name: "n2".into(),
            addresses: vec![ip("198.19.254.2"), ip("2001:2:0:fe::2")],
            health_addresses: vec![ip("198.18.2.2"), ip("2001:2:0:2::2")],
        };
        let targets = peer.targets(&[ip("198.18.1.2")]);
        let kinds: Vec<(ProbeKind, IpAddr)> = targets.iter().map(|t| (t.kind, t.address)).collect();
        assert_eq!(
            kinds,
            vec![
                (ProbeKind::IcmpNode, ip("198.19.254.2")),
                (ProbeKind::IcmpNode, ip("2001:2:0:fe::2")),
                (ProbeKind::HttpNode, ip("198.19.254.2")),
                (ProbeKind::HttpNode, ip("2001:2:0:fe::2")),
                (ProbeKind::HttpHealthEndpoint, ip("198.18.2.2")),
            ]
        );
        // No local health endpoint: no probe through the pod datapath.
        assert!(
            peer.targets(&[])
                .iter()
                .all(|t| t.kind != ProbeKind::HttpHealthEndpoint)
        );
    }

    #[test]
    fn io_errors_have_kinds() {
        use std::io::{Error, ErrorKind};
        assert_eq!(
            FailureKind::of_io(&Error::from(ErrorKind::ConnectionRefused)),
            FailureKind::Refused
        );
        assert_eq!(FailureKind::of_io(&Error::from_raw_os_error(113)), FailureKind::NoRoute);
        assert_eq!(
            FailureKind::of_io(&Error::from_raw_os_error(libc::EHOSTDOWN)),
            FailureKind::NoRoute
        );
        assert_eq!(
            FailureKind::of_io(&Error::from_raw_os_error(libc::ENOBUFS)),
            FailureKind::NoRoute
        );
        assert_eq!(
            FailureKind::of_io(&Error::from(ErrorKind::TimedOut)),
            FailureKind::Timeout
        );
        assert_eq!(FailureKind::of_io(&Error::from_raw_os_error(1)), FailureKind::Socket);
    }
}

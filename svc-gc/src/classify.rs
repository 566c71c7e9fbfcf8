//! Which conntrack entries a pass deletes, and why.
//!
//! # Expiry
//!
//! The datapath writes, on every refresh (at most once a second per entry),
//! `expires = now + lifetime` with `bpf_ktime_get_ns()` (the kernel's
//! monotonic clock) and the `lifetime` in seconds it applied for the entry's
//! protocol and TCP state, so `expires - lifetime` is the last refresh. An
//! entry is expired when either
//!
//! - it has been idle longer than svc-gc's timeout for its protocol and TCP
//!   state ([`Timeouts`]): `last_refresh + timeout`, or
//! - the datapath's own deadline passed: `expires`,
//!
//! whichever comes first, plus [`REFRESH_GRANULARITY`] because the last packet
//! may be up to a second after the last refresh. svc-gc's timeouts default to
//! the loader's and use the same flag names and environment variables, so one
//! setting configures both. An entry with `lifetime` 0 (written by a datapath
//! that predates the field) has no known last refresh: only `expires` counts.
//!
//! # Orphans
//!
//! An entry belongs to the endpoint on the local side of its tuple: the
//! source for `DIR_EGRESS` (the pod opened it, `from_container`), the
//! destination for `DIR_INGRESS` (opened towards the pod). It is orphaned
//! when that address belongs to no endpoint of the node — judged only with a
//! complete, non-empty endpoint list — *and* it was last refreshed before the
//! list was taken: an endpoint created after the list cannot lose entries it
//! refreshed since, and a vanished pod's entries stop being refreshed (its
//! interface and endpoint-map entries are gone).

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Duration;

use rivet_datapath::maps::{
    CT_TCP_CLOSING, CT_TCP_ESTABLISHED, Ct4Key, Ct6Key, CtEntry, CtTimeouts, DIR_EGRESS, DIR_INGRESS,
    LB_SOCK_REV_F_DATAGRAM, LbAffinity, LbAffinityKey, LbFlow, LbFrontend, LbSockRev, SVC_F_AFFINITY, ipv4_from_raw,
    ipv6_from_raw,
};

/// The datapath refreshes an entry's `expires` at most once a second: its
/// last packet may be that much later than `expires - lifetime` says.
pub const REFRESH_GRANULARITY: Duration = Duration::from_secs(1);

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;

/// Idle timeouts per protocol and TCP state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP after the first SYN, before the handshake completed.
    pub tcp_syn: Duration,
    /// Established TCP.
    pub tcp_established: Duration,
    /// TCP after FIN from both sides, or RST.
    pub tcp_closing: Duration,
    /// UDP, and protocols other than TCP and ICMP.
    pub udp: Duration,
    /// ICMP and ICMPv6 echo.
    pub icmp: Duration,
}

impl From<CtTimeouts> for Timeouts {
    /// The datapath's lifetimes as idle timeouts (`other` is not used:
    /// protocols other than TCP and ICMP take `udp`, as the loader's flags
    /// set them).
    fn from(t: CtTimeouts) -> Self {
        let secs = |s: u32| Duration::from_secs(u64::from(s));
        Self {
            tcp_syn: secs(t.tcp_syn),
            tcp_established: secs(t.tcp_established),
            tcp_closing: secs(t.tcp_closing),
            udp: secs(t.udp),
            icmp: secs(t.icmp),
        }
    }
}

impl Default for Timeouts {
    /// The datapath's defaults ([`CtTimeouts::DEFAULT`], Cilium's): SYN
    /// 60 s, established 6 h, closing 10 s, UDP 60 s, ICMP 60 s.
    fn default() -> Self {
        CtTimeouts::DEFAULT.into()
    }
}

impl Timeouts {
    /// The timeout of an entry of `protocol` in `tcp_state`.
    pub fn for_entry(&self, protocol: u8, tcp_state: u8) -> Duration {
        match protocol {
            IPPROTO_TCP => match tcp_state {
                CT_TCP_ESTABLISHED => self.tcp_established,
                CT_TCP_CLOSING => self.tcp_closing,
                _ => self.tcp_syn,
            },
            IPPROTO_ICMP | IPPROTO_ICMPV6 => self.icmp,
            IPPROTO_UDP => self.udp,
            _ => self.udp,
        }
    }
}

/// A conntrack key: where its local endpoint is.
pub trait CtKey: aya::Pod + PartialEq + Send {
    /// `IPPROTO_*`.
    fn protocol(&self) -> u8;
    /// The address of the endpoint on this node the entry belongs to;
    /// `None` for an unknown direction.
    fn local_addr(&self) -> Option<IpAddr>;
}

impl CtKey for Ct4Key {
    fn protocol(&self) -> u8 {
        self.protocol
    }

    fn local_addr(&self) -> Option<IpAddr> {
        match self.direction {
            DIR_EGRESS => Some(IpAddr::V4(ipv4_from_raw(self.saddr))),
            DIR_INGRESS => Some(IpAddr::V4(ipv4_from_raw(self.daddr))),
            _ => None,
        }
    }
}

impl CtKey for Ct6Key {
    fn protocol(&self) -> u8 {
        self.protocol
    }

    fn local_addr(&self) -> Option<IpAddr> {
        match self.direction {
            DIR_EGRESS => Some(IpAddr::V6(ipv6_from_raw(self.saddr))),
            DIR_INGRESS => Some(IpAddr::V6(ipv6_from_raw(self.daddr))),
            _ => None,
        }
    }
}

/// Why an entry is deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Its lifetime is over.
    Expired,
    /// Its endpoint is gone.
    OrphanedEndpoint,
    /// A NAT entry whose connection is gone (no NAT map yet).
    NatWithoutConnection,
    /// A session affinity entry of a service that no longer exists.
    ServiceGone,
}

/// The endpoints of the node as one pass sees them.
#[derive(Clone, Debug, Default)]
pub struct LocalEndpoints {
    /// Every address of every endpoint.
    pub addrs: HashSet<IpAddr>,
    /// When the list was taken (kernel monotonic nanoseconds).
    pub listed_at: u64,
}

/// What a pass applies to each conntrack entry.
#[derive(Clone, Debug)]
pub struct CtRules {
    /// Idle timeouts.
    pub timeouts: Timeouts,
    /// `Some` only with a complete, non-empty endpoint list: orphans are
    /// deleted.
    pub endpoints: Option<LocalEndpoints>,
}

impl CtRules {
    /// Whether to delete `entry` of `key` at `now` (kernel monotonic
    /// nanoseconds), and why. Expiry is checked first.
    pub fn verdict<K: CtKey>(&self, key: &K, entry: &CtEntry, now: u64) -> Option<Reason> {
        let slack = REFRESH_GRANULARITY.as_nanos() as u64;
        let last = entry.last_refreshed();
        let idle_deadline = last.map(|at| {
            let timeout = self.timeouts.for_entry(key.protocol(), entry.tcp_state);
            at.saturating_add(timeout.as_nanos().min(u128::from(u64::MAX)) as u64)
        });
        let deadline = idle_deadline.map_or(entry.expires, |idle| idle.min(entry.expires));
        if now >= deadline.saturating_add(slack) {
            return Some(Reason::Expired);
        }
        let endpoints = self.endpoints.as_ref()?;
        let local = key.local_addr()?;
        let idle_since_list = last.is_some_and(|at| at < endpoints.listed_at);
        (idle_since_list && !endpoints.addrs.contains(&local)).then_some(Reason::OrphanedEndpoint)
    }
}

/// Translated flows (`lb4_flows` / `lb6_flows`: the datapath's FORWARD,
/// REVERSE and NodePort SNAT entries): expired once their `expires`
/// deadline passed, plus [`REFRESH_GRANULARITY`].
pub fn flow_verdict(flow: &LbFlow, now: u64) -> Option<Reason> {
    let slack = REFRESH_GRANULARITY.as_nanos() as u64;
    (now >= flow.expires.saturating_add(slack)).then_some(Reason::Expired)
}

/// Socket-level load balancing's `lb_sock_rev`: an entry sendmsg wrote
/// for an unconnected UDP socket ([`LB_SOCK_REV_F_DATAGRAM`]) goes once
/// unused (sendmsg, recvmsg, getpeername) for longer than the UDP timeout,
/// plus [`REFRESH_GRANULARITY`] and the second its whole-second
/// `last_used` may lag. Entries of connected sockets (TCP, connected UDP)
/// stay with the LRU: such a socket reads its entry only at getpeername,
/// so an idle entry may belong to a live connection, and which sockets
/// still exist (their cookies, in every pod's namespace) is not something
/// a sweep can know.
pub fn sock_rev_verdict(entry: &LbSockRev, udp_timeout: Duration, now: u64) -> Option<Reason> {
    if entry.flags & LB_SOCK_REV_F_DATAGRAM == 0 {
        return None;
    }
    let last_used = u64::from(entry.last_used) * 1_000_000_000;
    let slack = (REFRESH_GRANULARITY + Duration::from_secs(1)).as_nanos() as u64;
    let deadline = last_used
        .saturating_add(udp_timeout.as_nanos() as u64)
        .saturating_add(slack);
    (now >= deadline).then_some(Reason::Expired)
}

/// Which `lb_affinity` entries go: those unused for longer than their
/// service's timeout (0 for a service without `SVC_F_AFFINITY` any more),
/// and those of services that no longer exist (no frontend) unused since
/// the frontends were read (a service created after the read keeps its
/// entries).
#[derive(Clone, Debug, Default)]
pub struct AffinityRules {
    /// Service id → affinity timeout in seconds (the longest of its
    /// frontends; 0 without affinity).
    pub timeouts: std::collections::HashMap<u32, u32>,
    /// Kernel monotonic time at which the frontends were read.
    pub read_at: u64,
}

impl AffinityRules {
    /// The rules from the frontends read at `read_at`.
    pub fn from_frontends<'a>(frontends: impl IntoIterator<Item = &'a LbFrontend>, read_at: u64) -> Self {
        let mut timeouts = std::collections::HashMap::new();
        for fe in frontends {
            let t = timeouts.entry(fe.service_id).or_insert(0);
            if fe.flags & SVC_F_AFFINITY != 0 {
                *t = fe.affinity_timeout.max(*t);
            }
        }
        Self { timeouts, read_at }
    }

    /// Whether `entry` goes, and why.
    pub fn verdict(&self, key: &LbAffinityKey, entry: &LbAffinity, now: u64) -> Option<Reason> {
        let slack = REFRESH_GRANULARITY.as_nanos() as u64;
        match self.timeouts.get(&key.service_id) {
            None => (entry.last_used < self.read_at).then_some(Reason::ServiceGone),
            Some(seconds) => {
                let deadline = entry
                    .last_used
                    .saturating_add(u64::from(*seconds) * 1_000_000_000)
                    .saturating_add(slack);
                (now >= deadline).then_some(Reason::Expired)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_datapath::maps::CT_TCP_SYN;

    const S: u64 = 1_000_000_000;

    fn entry(last: u64, lifetime_s: u32, state: u8) -> CtEntry {
        CtEntry {
            expires: last + u64::from(lifetime_s) * S,
            lifetime: lifetime_s,
            tcp_state: state,
            ..CtEntry::default()
        }
    }

    fn key(src: &str, dst: &str, protocol: u8, direction: u8) -> Ct4Key {
        Ct4Key::new(src.parse().unwrap(), dst.parse().unwrap(), protocol, direction)
    }

    fn rules(endpoints: Option<&[&str]>, listed_at: u64) -> CtRules {
        CtRules {
            timeouts: Timeouts {
                tcp_syn: Duration::from_secs(5),
                tcp_established: Duration::from_secs(100),
                tcp_closing: Duration::from_secs(2),
                udp: Duration::from_secs(30),
                icmp: Duration::from_secs(10),
            },
            endpoints: endpoints.map(|list| LocalEndpoints {
                addrs: list.iter().map(|a| a.parse().unwrap()).collect(),
                listed_at,
            }),
        }
    }

    #[test]
    fn idle_time_per_protocol_and_state_with_a_second_of_slack() {
        let r = rules(None, 0);
        let now = 10_000 * S;
        let tcp = key("198.18.0.2:1000", "198.18.0.3:80", IPPROTO_TCP, DIR_EGRESS);
        let udp = key("198.18.0.2:1000", "198.18.0.3:53", IPPROTO_UDP, DIR_EGRESS);
        let icmp = key("198.18.0.2:7", "198.18.0.3:7", IPPROTO_ICMP, DIR_EGRESS);
        // Datapath lifetime 6 h: only svc-gc's timeouts decide.
        let long = 21_600;
        assert_eq!(
            r.verdict(&tcp, &entry(now - 99 * S, long, CT_TCP_ESTABLISHED), now),
            None
        );
        assert_eq!(
            r.verdict(&tcp, &entry(now - 100 * S, long, CT_TCP_ESTABLISHED), now),
            None,
            "slack"
        );
        assert_eq!(
            r.verdict(&tcp, &entry(now - 101 * S, long, CT_TCP_ESTABLISHED), now),
            Some(Reason::Expired)
        );
        assert_eq!(
            r.verdict(&tcp, &entry(now - 6 * S, long, CT_TCP_SYN), now),
            Some(Reason::Expired)
        );
        assert_eq!(
            r.verdict(&tcp, &entry(now - 3 * S, long, CT_TCP_CLOSING), now),
            Some(Reason::Expired)
        );
        assert_eq!(r.verdict(&tcp, &entry(now - 3 * S, long, CT_TCP_SYN), now), None);
        assert_eq!(r.verdict(&udp, &entry(now - 29 * S, long, 0), now), None);
        assert_eq!(
            r.verdict(&udp, &entry(now - 31 * S, long, 0), now),
            Some(Reason::Expired)
        );
        assert_eq!(
            r.verdict(&icmp, &entry(now - 11 * S, long, 0), now),
            Some(Reason::Expired)
        );
    }

    #[test]
    fn the_datapaths_own_deadline_also_counts() {
        let r = rules(None, 0);
        let now = 10_000 * S;
        let tcp = key("198.18.0.2:1000", "198.18.0.3:80", IPPROTO_TCP, DIR_EGRESS);
        // Lifetime 20 s (shorter than svc-gc's 100 s), refreshed 22 s ago.
        assert_eq!(
            r.verdict(&tcp, &entry(now - 22 * S, 20, CT_TCP_ESTABLISHED), now),
            Some(Reason::Expired)
        );
        // An entry of an older datapath: no lifetime, only `expires`.
        let old = CtEntry {
            expires: now - 2 * S,
            tcp_state: CT_TCP_ESTABLISHED,
            ..CtEntry::default()
        };
        assert_eq!(r.verdict(&tcp, &old, now), Some(Reason::Expired));
        let old = CtEntry {
            expires: now + 1000 * S,
            tcp_state: CT_TCP_ESTABLISHED,
            ..CtEntry::default()
        };
        assert_eq!(r.verdict(&tcp, &old, now), None);
    }

    #[test]
    fn orphans_by_the_local_side_only_with_a_list_and_only_when_idle_since_it() {
        let now = 10_000 * S;
        let listed = now - S;
        let r = rules(Some(&["198.18.0.2"]), listed);
        let fresh = entry(now - 2 * S, 21_600, CT_TCP_ESTABLISHED);
        // Egress: the source is local.
        let mine = key("198.18.0.2:1000", "198.18.9.9:80", IPPROTO_TCP, DIR_EGRESS);
        let gone = key("198.18.0.7:1000", "198.18.0.2:80", IPPROTO_TCP, DIR_EGRESS);
        // Ingress: the destination is local.
        let mine_in = key("198.18.0.7:1000", "198.18.0.2:80", IPPROTO_TCP, DIR_INGRESS);
        let gone_in = key("198.18.0.2:1000", "198.18.0.7:80", IPPROTO_TCP, DIR_INGRESS);
        assert_eq!(r.verdict(&mine, &fresh, now), None);
        assert_eq!(r.verdict(&mine_in, &fresh, now), None);
        assert_eq!(r.verdict(&gone, &fresh, now), Some(Reason::OrphanedEndpoint));
        assert_eq!(r.verdict(&gone_in, &fresh, now), Some(Reason::OrphanedEndpoint));
        // Refreshed after the list was taken: maybe a new endpoint's.
        let recent = entry(now, 21_600, CT_TCP_ESTABLISHED);
        assert_eq!(r.verdict(&gone, &recent, now), None);
        // No list: no orphans.
        assert_eq!(rules(None, listed).verdict(&gone, &fresh, now), None);
        // Unknown direction: never an orphan.
        let odd = key("198.18.0.7:1000", "198.18.0.8:80", IPPROTO_TCP, 0);
        assert_eq!(r.verdict(&odd, &fresh, now), None);
        // Expired beats orphaned.
        let stale = entry(now - 1000 * S, 21_600, CT_TCP_ESTABLISHED);
        assert_eq!(r.verdict(&gone, &stale, now), Some(Reason::Expired));
    }

    #[test]
    fn ipv6_local_side() {
        let k = Ct6Key::new(
            "[2001:2::5]:1".parse().unwrap(),
            "[2001:2::6]:2".parse().unwrap(),
            IPPROTO_UDP,
            DIR_INGRESS,
        );
        assert_eq!(k.local_addr(), Some("2001:2::6".parse().unwrap()));
    }
}

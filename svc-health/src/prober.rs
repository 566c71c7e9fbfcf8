//! The probe rounds: every interval, list the peers (svc-identity), run
//! every probe of every peer at once, each bounded by the probe timeout,
//! record the round in the [`HealthTable`] and announce its number. A round
//! runs as the controller `health-probes`; it takes at most two timeouts
//! (the listing, then the probes), and the next starts one interval after
//! the last one started, so a peer cut off just after a round started shows
//! as unreachable at the end of the next: within two intervals.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use rivet_common::controller::{Action, Controller, Controllers};
use tokio::sync::watch;

use crate::events::HealthMetrics;
use crate::net::{self, NetProbes};
use crate::peers::{NodeListing, PeerSource};
use crate::probe::{ProbeKind, ProbeOutcome, Target};
use crate::table::{HealthTable, RoundReport};

/// Runs one probe.
pub trait ProbeRunner: Send + Sync {
    /// Probes `target` within `timeout`.
    fn probe(&self, target: Target, timeout: Duration) -> Pin<Box<dyn Future<Output = ProbeOutcome> + Send + '_>>;

    /// Whether probes through the pod datapath can run here (this node has
    /// a health endpoint to send them from).
    fn has_health_endpoint(&self) -> bool;
}

impl ProbeRunner for NetProbes {
    fn probe(&self, target: Target, timeout: Duration) -> Pin<Box<dyn Future<Output = ProbeOutcome> + Send + '_>> {
        Box::pin(async move {
            match target.kind {
                ProbeKind::IcmpNode => net::icmp_echo(&*self.node, target.address, self.sequence.next(), timeout).await,
                ProbeKind::HttpNode => net::http_hello(&*self.node, target.address, self.port, timeout).await,
                ProbeKind::HttpHealthEndpoint => match &self.health_endpoint {
                    Some(sockets) => net::http_hello(&**sockets, target.address, self.port, timeout).await,
                    None => Err(crate::probe::ProbeFailure::new(
                        crate::probe::FailureKind::Socket,
                        "this node has no health endpoint to probe from",
                    )),
                },
            }
        })
    }

    fn has_health_endpoint(&self) -> bool {
        self.health_endpoint.is_some()
    }
}

/// How often and how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProberOptions {
    /// From the start of one round to the start of the next.
    pub interval: Duration,
    /// Bound of each probe (and of the peer listing); below `interval`.
    pub timeout: Duration,
}

/// This node as the probes' results describe it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalNode {
    /// The node's name.
    pub name: String,
    /// The addresses `/hello` is served on.
    pub node_addresses: Vec<IpAddr>,
}

struct Inner {
    options: ProberOptions,
    local: LocalNode,
    peers: Arc<dyn PeerSource>,
    probes: Arc<dyn ProbeRunner>,
    metrics: HealthMetrics,
    table: Mutex<HealthTable>,
    local_health: Mutex<Vec<IpAddr>>,
    rounds: watch::Sender<u64>,
}

/// The prober and its results; cheap to clone.
#[derive(Clone)]
pub struct Prober(Arc<Inner>);

impl std::fmt::Debug for Prober {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prober")
            .field("options", &self.0.options)
            .field("local", &self.0.local)
            .finish()
    }
}

/// A snapshot of the results, for the API.
#[derive(Clone, Debug)]
pub struct HealthSnapshot {
    /// The table.
    pub table: HealthTable,
    /// This node.
    pub local: LocalNode,
    /// This node's health endpoint addresses, as the registry lists them.
    pub local_health: Vec<IpAddr>,
    /// The options in force.
    pub options: ProberOptions,
}

/// Why waiting for a round ended without one.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The deadline came first.
    #[error("no probe round after round {after} completed within {waited:?}")]
    Pending {
        /// The round asked to be passed.
        after: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// The prober stopped.
    #[error("the prober stopped")]
    Stopped,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Prober {
    /// A prober of the peers `peers` lists, with `probes`.
    pub fn new(
        options: ProberOptions,
        local: LocalNode,
        peers: Arc<dyn PeerSource>,
        probes: Arc<dyn ProbeRunner>,
        metrics: HealthMetrics,
    ) -> Self {
        let (rounds, _) = watch::channel(0);
        Self(Arc::new(Inner {
            options,
            local,
            peers,
            probes,
            metrics,
            table: Mutex::new(HealthTable::default()),
            local_health: Mutex::new(Vec::new()),
            rounds,
        }))
    }

    /// Runs the rounds as the controller `health-probes` of `controllers`.
    pub fn start(&self, controllers: &Controllers) {
        let prober = self.clone();
        controllers.reconcile(Controller::new("health-probes"), move || {
            let prober = prober.clone();
            async move {
                let started = Instant::now();
                prober.round().await;
                let next = prober.0.options.interval.saturating_sub(started.elapsed());
                Ok::<_, std::convert::Infallible>(Action::requeue(next))
            }
        });
    }

    /// One round: list, probe, record, announce.
    pub async fn round(&self) {
        let inner = &self.0;
        let timeout = inner.options.timeout;
        let started_at = SystemTime::now();
        let started = Instant::now();
        let listing: Result<NodeListing, String> = match tokio::time::timeout(timeout, inner.peers.list()).await {
            Ok(Ok(listing)) => Ok(listing),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "svc-identity NodeService.ListNodes: no answer within {timeout:?}"
            )),
        };
        let (peers, local_health) = match &listing {
            Ok(l) => {
                *lock(&inner.local_health) = l.local_health_addresses.clone();
                (l.peers.clone(), l.local_health_addresses.clone())
            }
            Err(_) => (
                lock(&inner.table).listed_peers().to_vec(),
                lock(&inner.local_health).clone(),
            ),
        };
        let from_health = if inner.probes.has_health_endpoint() {
            local_health
        } else {
            Vec::new()
        };
        let probes = peers.iter().flat_map(|peer| {
            peer.targets(&from_health).into_iter().map(move |target| {
                let name = peer.name.clone();
                async move { (name, target, inner.probes.probe(target, timeout).await) }
            })
        });
        let outcomes = futures::future::join_all(probes).await;
        let report = RoundReport {
            started: started_at,
            finished: SystemTime::now(),
            peers: listing.map(|l| l.peers),
            outcomes: outcomes.clone(),
        };
        let round = {
            let mut table = lock(&inner.table);
            let transitions = table.apply(report, |p| p.targets(&from_health));
            inner
                .metrics
                .round_completed(&table, &outcomes, &transitions, started.elapsed());
            table.round
        };
        inner.rounds.send_replace(round);
    }

    /// The results now.
    pub fn snapshot(&self) -> HealthSnapshot {
        HealthSnapshot {
            table: lock(&self.0.table).clone(),
            local: self.0.local.clone(),
            local_health: lock(&self.0.local_health).clone(),
            options: self.0.options,
        }
    }

    /// Waits until a round numbered above `after` has completed, at most
    /// `deadline`.
    pub async fn wait_for_round(&self, after: u64, deadline: Duration) -> Result<(), WaitError> {
        let mut rounds = self.0.rounds.subscribe();
        match tokio::time::timeout(deadline, rounds.wait_for(|r| *r > after)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(WaitError::Stopped),
            Err(_) => Err(WaitError::Pending {
                after,
                waited: deadline,
            }),
        }
    }
}

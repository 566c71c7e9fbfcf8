//! Identity garbage collection (the seed's operator identity GC): an
//! identity nothing uses for two rounds, `--identity-gc-interval` apart, is
//! deleted, fenced on the version the first round saw, so an identity
//! reused between the rounds is never deleted.
//!
//! - [`rounds`]: the two-round rule, no I/O.
//! - [`etcd`]: svc-identity's `etcd` store. "Used" means a value key of
//!   exactly the master's labels; the version is the master key's mod
//!   revision (svc-identity puts the master again with every new value key).
//! - [`crd`]: svc-identity's `kubernetes` store. "Used" means a
//!   RivetEndpoint's `status.identity`; the first round marks the object
//!   ([`GC_UNUSED_SINCE_ANNOTATION`]), the version is its resourceVersion
//!   (svc-identity removes the mark when it acquires the identity).
//!
//! Rivet's allocator is lock-free (CAS transactions), so there are no lock
//! files to collect. Reserved and CIDR identities are never collected.

pub mod crd;
pub mod etcd;
pub mod events;
pub mod rounds;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use rivet_common::controller::{Action, Controller, Controllers};
pub use svc_identity::kubernetes_backend::GC_UNUSED_SINCE_ANNOTATION;
use tokio::sync::Mutex;

use crate::kvstore::{ConnectError, KvstoreArgs};
use crate::term::{Duty, NotLeading, Term};
pub use events::{IdentityGcMetrics, Store};

/// The identity GC's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct IdentityGcArgs {
    /// Where svc-identity keeps the cluster's identities, as its own
    /// `--identity-store`: `etcd` (master and value keys under
    /// `--kvstore-prefix`; needs `--etcd-endpoints`) or `kubernetes`
    /// (RivetIdentity objects). Default: `etcd` when `--etcd-endpoints` is
    /// set, else `kubernetes`.
    #[arg(long, env = "RIVET_IDENTITY_STORE", value_enum)]
    pub identity_store: Option<IdentityStore>,

    /// How often a GC round runs (`15m`, `30s`). An identity is deleted
    /// after two rounds without use, so it lives 1-2 intervals unused.
    #[arg(long, env = "RIVET_IDENTITY_GC_INTERVAL", default_value = "15m",
          value_parser = humantime::parse_duration)]
    pub identity_gc_interval: Duration,

    /// Most identity deletions (and, for RivetIdentities, marks) per second
    /// (a token bucket with a tenth of a second of burst), so a large
    /// collection does not flood the store and the watches of every node.
    #[arg(long, env = "RIVET_IDENTITY_GC_RATE_LIMIT", default_value_t = NonZeroU32::new(2500).expect("non-zero"))]
    pub identity_gc_rate_limit: NonZeroU32,
}

/// The identity store to collect (`--identity-store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IdentityStore {
    /// svc-identity's `etcd` store.
    Etcd,
    /// svc-identity's `kubernetes` store.
    Kubernetes,
}

/// A flag combination the identity GC cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--identity-store etcd needs --etcd-endpoints (the etcd cluster svc-identity uses)")]
pub struct NoEtcdEndpoints;

impl IdentityGcArgs {
    /// The store to collect: `--identity-store`, or its default.
    pub fn store(&self, kvstore: &KvstoreArgs) -> Result<IdentityStore, NoEtcdEndpoints> {
        match self.identity_store {
            Some(IdentityStore::Etcd) if !kvstore.enabled() => Err(NoEtcdEndpoints),
            Some(store) => Ok(store),
            None if kvstore.enabled() => Ok(IdentityStore::Etcd),
            None => Ok(IdentityStore::Kubernetes),
        }
    }
}

impl Default for IdentityGcArgs {
    fn default() -> Self {
        Self {
            identity_store: None,
            identity_gc_interval: Duration::from_secs(15 * 60),
            identity_gc_rate_limit: NonZeroU32::new(2500).expect("non-zero"),
        }
    }
}

/// Why a round stopped.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// This replica does not lead any more: nothing more is written.
    #[error(transparent)]
    NotLeading(#[from] NotLeading),
    /// etcd failed or refused a request.
    #[error("{action}: etcd answered: {source}")]
    Etcd {
        /// What was being done.
        action: String,
        /// etcd-client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("{action}: etcd did not answer within {timeout:?}")]
    EtcdTimeout {
        /// What was being done.
        action: String,
        /// The bound.
        timeout: Duration,
    },
    /// etcd could not be reached.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The API server failed or refused a request.
    #[error("{action}: {source}")]
    Api {
        /// What was being done.
        action: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// Identities seen (cluster-scope only).
    pub scanned: usize,
    /// Of those, in use.
    pub in_use: usize,
    /// Deleted (unused for two rounds at one version).
    pub deleted: usize,
    /// Candidates of the last round not deleted (reused, in use, gone,
    /// changed during the delete).
    pub skipped: usize,
    /// Remembered for the next round.
    pub candidates: usize,
}

/// The deletion rate limit: a token bucket of `per_second` tokens a second
/// with a tenth of a second of burst. Clones share the bucket.
#[derive(Debug, Clone)]
pub struct DeleteRate(Arc<DefaultDirectRateLimiter>);

impl DeleteRate {
    /// At most `per_second` deletions a second (plus the burst).
    pub fn per_second(per_second: NonZeroU32) -> Self {
        let burst = NonZeroU32::new(per_second.get() / 10).unwrap_or(NonZeroU32::MIN);
        Self(Arc::new(RateLimiter::direct(
            Quota::per_second(per_second).allow_burst(burst),
        )))
    }

    /// Waits for a token.
    pub async fn acquire(&self) {
        self.0.until_ready().await;
    }
}

/// The identity GC duty over the store of `--identity-store`.
pub struct IdentityGcDuty {
    args: IdentityGcArgs,
    store: IdentityStore,
    kvstore: KvstoreArgs,
    client: kube::Client,
    metrics: IdentityGcMetrics,
    rate: DeleteRate,
}

impl IdentityGcDuty {
    /// The duty; `client` is the operator's API client (the CRD store).
    ///
    /// # Errors
    /// `--identity-store etcd` without `--etcd-endpoints`.
    pub fn new(
        args: IdentityGcArgs,
        kvstore: KvstoreArgs,
        client: kube::Client,
        metrics: IdentityGcMetrics,
    ) -> Result<Self, NoEtcdEndpoints> {
        let store = args.store(&kvstore)?;
        let rate = DeleteRate::per_second(args.identity_gc_rate_limit);
        Ok(Self {
            args,
            store,
            kvstore,
            client,
            metrics,
            rate,
        })
    }
}

/// One store's rounds, kept across the rounds of a term (a new term starts
/// from no candidates: the first round after a failover deletes nothing).
enum Collector {
    /// Not connected yet (etcd).
    EtcdPending,
    Etcd(Box<etcd::EtcdIdentityGc>),
    Crd(Box<crd::CrdIdentityGc>),
}

impl Duty for IdentityGcDuty {
    fn name(&self) -> &'static str {
        "identity-gc"
    }

    fn start(&self, term: &Term, controllers: &Controllers) {
        let collector = Arc::new(Mutex::new(match self.store {
            IdentityStore::Etcd => Collector::EtcdPending,
            IdentityStore::Kubernetes => Collector::Crd(Box::new(crd::CrdIdentityGc::new(
                self.client.clone(),
                self.rate.clone(),
                self.metrics.clone(),
            ))),
        }));
        let term = term.clone();
        let kvstore = self.kvstore.clone();
        let metrics = self.metrics.clone();
        let rate = self.rate.clone();
        let interval = self.args.identity_gc_interval;
        controllers.reconcile(Controller::new("identity-gc"), move || {
            let (collector, term, kvstore, metrics, rate) = (
                collector.clone(),
                term.clone(),
                kvstore.clone(),
                metrics.clone(),
                rate.clone(),
            );
            async move {
                let mut collector = collector.lock().await;
                if let Collector::EtcdPending = &*collector {
                    let client = kvstore.connect().await?;
                    *collector = Collector::Etcd(Box::new(etcd::EtcdIdentityGc::new(
                        client,
                        kvstore.layout(),
                        rate,
                        metrics,
                    )));
                }
                match &mut *collector {
                    Collector::Etcd(gc) => gc.round(&term).await?,
                    Collector::Crd(gc) => gc.round(&term).await?,
                    Collector::EtcdPending => unreachable!("connected above"),
                };
                Ok::<_, GcError>(Action::requeue(interval))
            }
        });
    }
}

/// Times a round and reports it (log and metrics).
pub(crate) async fn timed_round<F>(metrics: &IdentityGcMetrics, store: Store, round: F) -> Result<RoundReport, GcError>
where
    F: Future<Output = Result<RoundReport, GcError>>,
{
    let started = Instant::now();
    let result = round.await;
    events::round_finished(metrics, store, started.elapsed(), &result);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_durations_and_refuse_a_zero_rate() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            gc: IdentityGcArgs,
        }
        let flags = Flags::try_parse_from(["op"]).unwrap();
        assert_eq!(flags.gc.identity_gc_interval, Duration::from_secs(900));
        assert_eq!(flags.gc.identity_gc_rate_limit.get(), 2500);
        let flags = Flags::try_parse_from(["op", "--identity-gc-interval", "90s"]).unwrap();
        assert_eq!(flags.gc.identity_gc_interval, Duration::from_secs(90));
        assert!(Flags::try_parse_from(["op", "--identity-gc-rate-limit", "0"]).is_err());
    }

    #[test]
    fn the_store_defaults_to_etcd_with_endpoints_and_etcd_needs_them() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            gc: IdentityGcArgs,
            #[command(flatten)]
            kvstore: KvstoreArgs,
        }
        let store = |args: &[&str]| {
            let flags = Flags::try_parse_from(std::iter::once("op").chain(args.iter().copied())).unwrap();
            flags.gc.store(&flags.kvstore)
        };
        assert_eq!(store(&[]), Ok(IdentityStore::Kubernetes));
        assert_eq!(
            store(&["--etcd-endpoints", "http://127.0.0.1:2379"]),
            Ok(IdentityStore::Etcd)
        );
        let both = [
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
            "--identity-store",
            "kubernetes",
        ];
        assert_eq!(
            store(&both),
            Ok(IdentityStore::Kubernetes),
            "the mirrors use etcd, identities are CRDs"
        );
        assert_eq!(store(&["--identity-store", "etcd"]), Err(NoEtcdEndpoints));
    }
}

//! Duty `kvstore-heartbeat` (issue 15 §4): the leader writes the current
//! time (RFC 3339, UTC) at `<prefix>.heartbeat` every
//! `--kvstore-heartbeat-interval`, like the seed's operator. Every
//! svc-identity on the etcd store watches the key and reports the kvstore
//! unhealthy when the writes stop (`svc_identity::heartbeat`); nothing
//! else depends on it.
//!
//! Each write checks [`Term::ensure`] first, so a replica that lost its
//! lease stops writing before another can lead. A failed write is logged and
//! counted by kind and retried with the controller's backoff.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use etcd_client::Client;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rivet_common::controller::{Action, Controller, Controllers};
use svc_identity::heartbeat::parse_interval;

use crate::kvstore::{Layout, RequestError, request};
use crate::term::{Duty, NotLeading, Term};

/// Bound of one write.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The heartbeat's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct HeartbeatArgs {
    /// How often the leader writes the kvstore heartbeat
    /// (`<kvstore-prefix>.heartbeat`, with `--etcd-endpoints` only; `30s`,
    /// `1m`, ...). svc-identity's flag of the same name must match: it
    /// reports the kvstore unhealthy after its stale multiple of it.
    #[arg(long, env = "RIVET_KVSTORE_HEARTBEAT_INTERVAL", default_value = "1m",
          value_parser = parse_interval)]
    pub kvstore_heartbeat_interval: Duration,
}

/// Why a heartbeat was not written.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// This replica does not lead.
    #[error("writing the kvstore heartbeat {key}: {source}")]
    NotLeading {
        /// The key.
        key: String,
        /// The term's verdict.
        #[source]
        source: NotLeading,
    },
    /// The write failed or timed out.
    #[error(transparent)]
    Request(#[from] RequestError),
}

impl HeartbeatError {
    /// The metric label.
    fn kind(&self) -> &'static str {
        match self {
            Self::NotLeading { .. } => "not_leading",
            Self::Request(e) => e.kind(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The duty; cheap to clone.
#[derive(Clone)]
pub struct KvstoreHeartbeat(Arc<Inner>);

impl std::fmt::Debug for KvstoreHeartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvstoreHeartbeat")
            .field("key", &self.0.key)
            .field("interval", &self.0.interval)
            .finish_non_exhaustive()
    }
}

struct Inner {
    client: Client,
    key: String,
    interval: Duration,
    writes: Family<ResultLabels, Counter>,
}

impl KvstoreHeartbeat {
    /// The duty writing `layout`'s heartbeat key over `client` every
    /// `interval`.
    pub fn new(client: Client, layout: &Layout, interval: Duration) -> Self {
        Self(Arc::new(Inner {
            client,
            key: layout.heartbeat_key(),
            interval,
            writes: Family::default(),
        }))
    }

    /// Registers `rivet_operator_kvstore_heartbeat_writes_total{result}`
    /// (`written`, `not_leading`, `etcd_error`, `timeout`) under `registry`
    /// (prefix `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        registry.sub_registry_with_prefix("operator").register(
            "kvstore_heartbeat_writes",
            "Writes of the kvstore heartbeat by the leader, by result",
            self.0.writes.clone(),
        );
    }

    /// One write, fenced on `term`.
    async fn beat(&self, term: &Term) -> Result<(), HeartbeatError> {
        let key = &self.0.key;
        let result = self.write(term).await;
        let label = match &result {
            Ok(()) => "written",
            Err(e) => e.kind(),
        };
        self.0.writes.get_or_create(&ResultLabels { result: label }).inc();
        match &result {
            Ok(()) => tracing::debug!(key, "kvstore heartbeat written"),
            Err(e) => tracing::warn!(key, kind = e.kind(), error = %e, "kvstore heartbeat not written"),
        }
        result
    }

    async fn write(&self, term: &Term) -> Result<(), HeartbeatError> {
        let key = &self.0.key;
        term.ensure().map_err(|source| HeartbeatError::NotLeading {
            key: key.clone(),
            source,
        })?;
        let now = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
        let mut kv = self.0.client.kv_client();
        let action = || format!("writing the kvstore heartbeat {key}");
        request(action, WRITE_TIMEOUT, kv.put(key.as_str(), now, None)).await?;
        Ok(())
    }
}

impl Duty for KvstoreHeartbeat {
    fn name(&self) -> &'static str {
        "kvstore-heartbeat"
    }

    fn start(&self, term: &Term, controllers: &Controllers) {
        let (duty, term) = (self.clone(), term.clone());
        controllers.reconcile(Controller::new("kvstore-heartbeat"), move || {
            let (duty, term) = (duty.clone(), term.clone());
            async move {
                duty.beat(&term).await?;
                Ok::<_, HeartbeatError>(Action::requeue(duty.0.interval))
            }
        });
    }
}

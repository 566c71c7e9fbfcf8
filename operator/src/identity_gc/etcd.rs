//! Identity GC over svc-identity's `etcd` store (the seed's algorithm).
//!
//! A round reads every master key (`identities/v1/id/<id>`) and every value
//! key (`identities/v1/value/<labels>/<node>`, keys only), paged, at one
//! revision. A master is used when a value key of EXACTLY its labels exists:
//! the labels of a value key are everything before its last `/` (node names
//! hold no `/`), so value keys of longer label sets sharing the prefix
//! (`k8s:example.com` and `k8s:example.com/x=y`) never count for the shorter
//! set. An unused master remembered from the last round at the same mod
//! revision is deleted in one transaction that holds only if
//!
//! - its mod revision is still the remembered one (svc-identity puts the
//!   master again with every new value key, so a reuse between the rounds,
//!   even one released again, fails this), and
//! - no key under `value/<labels>/` was written since this round's read
//!   (`mod_revision < read revision + 1` over the prefix; true on an empty
//!   range). A key of a longer label set written since also fails it: the
//!   delete is skipped, which is safe, and retried two rounds later.
//!
//! An allocation racing the delete either comes first (the master moved:
//! skipped) or finds the master gone and re-creates it (svc-identity's
//! acquire re-creation path): never a value key without a master.
//!
//! For a benchmark of one pass: [`EtcdIdentityGc::new`] on a client, then
//! [`EtcdIdentityGc::scan`] (the reads alone) or two
//! [`EtcdIdentityGc::round`]s (the second deletes what the first found
//! unused) under a [`Term`].

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp};
use futures::StreamExt as _;
use rivet_common::identity::is_cluster;
use svc_identity::etcd_backend::prefix_end;

use super::events::{self, IdentityGcMetrics, Store};
use super::rounds::{Candidates, Seen, SkipReason};
use super::{DeleteRate, GcError, RoundReport, timed_round};
use crate::kvstore::Layout;
use crate::term::Term;

/// Fenced deletions of one round in flight at once.
const DELETES_IN_FLIGHT: usize = 32;

/// Keys per page of a range read.
pub const DEFAULT_PAGE_SIZE: i64 = 5000;
/// Bound of one request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What one scan read.
#[derive(Debug, Clone, Default)]
pub struct EtcdScan {
    /// The revision every page was read at.
    pub revision: i64,
    /// Every cluster identity's master key: its id, mod revision and
    /// whether a value key of exactly its labels exists.
    pub masters: Vec<Seen<i64>>,
    /// The labels of the unused masters (what a delete needs; only those
    /// are copied).
    pub unused_labels: HashMap<u32, String>,
    /// Value keys read.
    pub value_keys: usize,
}

/// The identity GC of one term over etcd; see the module docs.
pub struct EtcdIdentityGc {
    client: Client,
    layout: Layout,
    candidates: Candidates<i64>,
    rate: DeleteRate,
    metrics: IdentityGcMetrics,
    page_size: i64,
}

/// The labels of a value key: everything between the root and the last `/`.
fn value_key_labels<'k>(root: &str, key: &'k [u8]) -> Option<&'k [u8]> {
    let rest = key.strip_prefix(root.as_bytes())?;
    let slash = rest.iter().rposition(|b| *b == b'/')?;
    (slash > 0 && slash + 1 < rest.len()).then(|| &rest[..slash])
}

impl EtcdIdentityGc {
    /// A GC over `client` for the keys of `layout`, deleting at most as
    /// fast as `rate` allows.
    pub fn new(client: Client, layout: Layout, rate: DeleteRate, metrics: IdentityGcMetrics) -> Self {
        Self {
            client,
            layout,
            candidates: Candidates::default(),
            rate,
            metrics,
            page_size: DEFAULT_PAGE_SIZE,
        }
    }

    /// The same GC reading `page_size` keys per request.
    pub fn with_page_size(mut self, page_size: i64) -> Self {
        self.page_size = page_size.max(1);
        self
    }

    /// Candidates remembered for the next round.
    pub fn candidates(&self) -> usize {
        self.candidates.len()
    }

    async fn call<T>(
        action: impl Fn() -> String,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, GcError> {
        match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(GcError::Etcd {
                action: action(),
                source,
            }),
            Err(_) => Err(GcError::EtcdTimeout {
                action: action(),
                timeout: REQUEST_TIMEOUT,
            }),
        }
    }

    /// Reads every key under `prefix` page by page at `revision` (0: now;
    /// the first page's revision is used for the rest), calling `each` per
    /// key. Returns the revision read at.
    async fn range(
        &self,
        prefix: &str,
        keys_only: bool,
        mut revision: i64,
        mut each: impl FnMut(&KeyValue),
    ) -> Result<i64, GcError> {
        let end = prefix_end(prefix);
        let mut from = prefix.as_bytes().to_vec();
        let mut kv = self.client.kv_client();
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(self.page_size)
                .with_revision(revision);
            if keys_only {
                options = options.with_keys_only();
            }
            let action = || format!("reading {prefix} at revision {revision}");
            let resp = Self::call(action, kv.get(from.clone(), Some(options))).await?;
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or_default();
            }
            resp.kvs().iter().for_each(&mut each);
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(revision),
            }
        }
    }

    /// Reads every value key, then every master key at the same revision.
    pub async fn scan(&self) -> Result<EtcdScan, GcError> {
        let root = self.layout.value_root();
        let mut used: HashSet<Vec<u8>> = HashSet::new();
        let mut value_keys = 0;
        let revision = self
            .range(&root, true, 0, |kv| {
                value_keys += 1;
                if let Some(labels) = value_key_labels(&root, kv.key())
                    && !used.contains(labels)
                {
                    used.insert(labels.to_vec());
                }
            })
            .await?;
        let mut masters = Vec::new();
        let mut unused_labels = HashMap::new();
        self.range(&self.layout.id_prefix(), false, revision, |kv| {
            let Some(id) = std::str::from_utf8(kv.key())
                .ok()
                .and_then(|key| self.layout.id_of_key(key))
                .filter(|id| is_cluster(*id))
            else {
                return;
            };
            let in_use = used.contains(kv.value());
            if !in_use {
                let Ok(labels) = std::str::from_utf8(kv.value()) else {
                    return;
                };
                unused_labels.insert(id, labels.to_string());
            }
            masters.push(Seen {
                id,
                version: kv.mod_revision(),
                used: in_use,
            });
        })
        .await?;
        Ok(EtcdScan {
            revision,
            masters,
            unused_labels,
            value_keys,
        })
    }

    /// One round: scan, delete what the last round found unused at the
    /// same mod revision (fenced, rate-limited, [`Term::ensure`] before
    /// each), remember what is unused now.
    pub async fn round(&mut self, term: &Term) -> Result<RoundReport, GcError> {
        let metrics = self.metrics.clone();
        timed_round(&metrics, Store::Etcd, self.round_inner(term)).await
    }

    async fn round_inner(&mut self, term: &Term) -> Result<RoundReport, GcError> {
        let scan = self.scan().await?;
        let plan = self.candidates.round(scan.masters.iter().cloned());
        let mut report = RoundReport {
            scanned: scan.masters.len(),
            in_use: plan.used.len(),
            skipped: plan.skipped.len(),
            ..RoundReport::default()
        };
        for (id, reason) in &plan.skipped {
            events::candidate_skipped(&self.metrics, Store::Etcd, *id, *reason);
        }
        // Deletions are independent transactions: several in flight, so the
        // rate limit and not one round trip per key bounds the round.
        let this = &*self;
        let (unused_labels, read_at) = (&scan.unused_labels, scan.revision);
        let mut outcomes = futures::stream::iter(plan.delete)
            .map(|(id, mod_revision)| async move {
                let labels = &unused_labels[&id];
                this.rate.acquire().await;
                term.ensure()?;
                let deleted = this.delete(id, labels, mod_revision, read_at).await?;
                if deleted {
                    events::identity_deleted(&this.metrics, Store::Etcd, id, labels);
                } else {
                    events::candidate_skipped(&this.metrics, Store::Etcd, id, SkipReason::Changed);
                }
                Ok::<_, GcError>(deleted)
            })
            .buffer_unordered(DELETES_IN_FLIGHT);
        while let Some(deleted) = outcomes.next().await {
            if deleted? {
                report.deleted += 1;
            } else {
                report.skipped += 1;
            }
        }
        drop(outcomes);
        // Remembered only when the round completes: a round that fails
        // midway is retried after a backoff of seconds, and what it saw
        // unused must not count as a round that long before.
        for (id, version) in plan.first_seen {
            self.candidates.remember(id, version);
        }
        report.candidates = self.candidates.len();
        Ok(report)
    }

    /// The fenced delete of one master; `false` when the fence failed.
    async fn delete(&self, id: u32, labels: &str, mod_revision: i64, read_at: i64) -> Result<bool, GcError> {
        let id_key = self.layout.id_key(id);
        let txn = Txn::new()
            .when([
                Compare::mod_revision(id_key.clone(), CompareOp::Equal, mod_revision),
                Compare::mod_revision(self.layout.value_prefix(labels), CompareOp::Less, read_at + 1).with_prefix(),
            ])
            .and_then([TxnOp::delete(id_key, None)]);
        let mut kv = self.client.kv_client();
        let action = || format!("deleting unused identity {id} ({labels}) at mod revision {mod_revision}");
        let resp = Self::call(action, kv.txn(txn)).await?;
        Ok(resp.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_keys_name_exactly_their_labels() {
        let root = "rivet/state/identities/v1/value/";
        let labels = |key: &str| value_key_labels(root, key.as_bytes()).map(|l| String::from_utf8(l.to_vec()).unwrap());
        assert_eq!(
            labels("rivet/state/identities/v1/value/k8s:app=web/n1").as_deref(),
            Some("k8s:app=web")
        );
        // A longer label set sharing the prefix of `k8s:example.com`.
        assert_eq!(
            labels("rivet/state/identities/v1/value/k8s:example.com/x=y/n1").as_deref(),
            Some("k8s:example.com/x=y")
        );
        assert_eq!(labels("rivet/state/identities/v1/value/k8s:app=web/"), None);
        assert_eq!(labels("rivet/state/identities/v1/value/n1"), None);
        assert_eq!(labels("rivet/state/identities/v1/id/300"), None);
    }
}

//! Identity GC over svc-identity's `kubernetes` store (RivetIdentity
//! objects, named by their number).
//!
//! A RivetIdentity is used when a RivetEndpoint's `status.identity` names
//! it. A round lists both (paged) and:
//!
//! - marks an unused identity it did not remember with the annotation
//!   [`GC_UNUSED_SINCE_ANNOTATION`] (a merge patch fenced on the
//!   resourceVersion it listed) and remembers the resourceVersion the mark
//!   produced (a mark found already there, e.g. from the last leader, is
//!   remembered as it is);
//! - deletes a remembered identity still unused at the remembered
//!   resourceVersion, with a resourceVersion precondition: svc-identity
//!   removes the mark when it acquires a marked identity, so a reuse between
//!   the rounds makes the delete fail with 409 and the identity survives;
//! - removes the mark of an identity that is used again.
//!
//! A pod that starts using an identity after the round listed the endpoints
//! but before the delete loses the object; svc-identity, which holds it,
//! re-creates it with the same number at its next reconcile pass (it is the
//! source of truth for its own pods).

use std::collections::{HashMap, HashSet};

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};
use rivet_common::identity::is_cluster;
use rivet_k8s::{RivetEndpoint, RivetIdentity};
use serde::de::DeserializeOwned;

use super::events::{self, IdentityGcMetrics, Store};
use super::rounds::{Candidates, Seen, SkipReason};
use super::{DeleteRate, GC_UNUSED_SINCE_ANNOTATION, GcError, RoundReport, timed_round};
use crate::term::Term;

/// Objects per page when listing.
const PAGE_SIZE: u32 = 500;

/// The field manager of the operator's marks.
pub const FIELD_MANAGER: &str = "rivet-operator-identity-gc";

/// One RivetIdentity as listed.
#[derive(Debug, Clone)]
struct Listed {
    resource_version: String,
    marked: bool,
    labels: String,
}

/// The identity GC of one term over the RivetIdentity objects.
pub struct CrdIdentityGc {
    identities: Api<RivetIdentity>,
    endpoints: Api<RivetEndpoint>,
    candidates: Candidates<String>,
    rate: DeleteRate,
    metrics: IdentityGcMetrics,
}

/// Every object of `api`, page by page.
async fn list_all<K>(api: &Api<K>, what: &str) -> Result<Vec<K>, GcError>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = ListParams::default().limit(PAGE_SIZE);
    loop {
        let page = api.list(&params).await.map_err(|source| GcError::Api {
            action: format!("listing {what}"),
            source,
        })?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(items),
        }
    }
}

fn is_conflict_or_gone(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409 || status.code == 404)
}

impl CrdIdentityGc {
    /// A GC over the API server of `client`, deleting at most as fast as
    /// `rate` allows.
    pub fn new(client: Client, rate: DeleteRate, metrics: IdentityGcMetrics) -> Self {
        Self {
            identities: Api::all(client.clone()),
            endpoints: Api::all(client),
            candidates: Candidates::default(),
            rate,
            metrics,
        }
    }

    /// Candidates remembered for the next round.
    pub fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// One round (see the module docs); every write checks
    /// [`Term::ensure`] first.
    pub async fn round(&mut self, term: &Term) -> Result<RoundReport, GcError> {
        let metrics = self.metrics.clone();
        timed_round(&metrics, Store::Kubernetes, self.round_inner(term)).await
    }

    async fn round_inner(&mut self, term: &Term) -> Result<RoundReport, GcError> {
        // Endpoints first: an identity created after this listing is not
        // in it, but neither can an endpoint listed here miss its identity.
        let used: HashSet<u32> = list_all(&self.endpoints, "RivetEndpoints")
            .await?
            .iter()
            .filter_map(|e| e.status.as_ref()?.identity)
            .collect();
        let mut listed: HashMap<u32, Listed> = HashMap::new();
        for object in list_all(&self.identities, "RivetIdentities").await? {
            let Some(id) = object.name_any().parse().ok().filter(|id| is_cluster(*id)) else {
                continue;
            };
            listed.insert(
                id,
                Listed {
                    resource_version: object.resource_version().unwrap_or_default(),
                    marked: object.annotations().contains_key(GC_UNUSED_SINCE_ANNOTATION),
                    labels: object.spec.labels.join(","),
                },
            );
        }
        let plan = self.candidates.round(listed.iter().map(|(id, l)| Seen {
            id: *id,
            version: l.resource_version.clone(),
            used: used.contains(id),
        }));
        let mut report = RoundReport {
            scanned: listed.len(),
            in_use: plan.used.len(),
            skipped: plan.skipped.len(),
            ..RoundReport::default()
        };
        for (id, reason) in &plan.skipped {
            events::candidate_skipped(&self.metrics, Store::Kubernetes, *id, *reason);
        }
        for (id, version) in &plan.used {
            if listed[id].marked {
                term.ensure()?;
                self.set_mark(*id, version, false).await?;
            }
        }
        // Remembered only when the round completes (see the etcd store's
        // round); a mark written by a round that fails counts as round one
        // of the next.
        let mut remember = Vec::with_capacity(plan.first_seen.len());
        for (id, version) in plan.first_seen {
            if listed[&id].marked {
                remember.push((id, version));
                continue;
            }
            // Marks are writes every node's watch sees: the same budget.
            self.rate.acquire().await;
            term.ensure()?;
            if let Some(marked) = self.set_mark(id, &version, true).await? {
                remember.push((id, marked));
            }
        }
        for (id, version) in plan.delete {
            self.rate.acquire().await;
            term.ensure()?;
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(version.clone()),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match self.identities.delete(&id.to_string(), &params).await {
                Ok(_) => {
                    events::identity_deleted(&self.metrics, Store::Kubernetes, id, &listed[&id].labels);
                    report.deleted += 1;
                }
                Err(e) if is_conflict_or_gone(&e) => {
                    events::candidate_skipped(&self.metrics, Store::Kubernetes, id, SkipReason::Changed);
                    report.skipped += 1;
                }
                Err(source) => {
                    return Err(GcError::Api {
                        action: format!("deleting unused RivetIdentity {id} at resourceVersion {version}"),
                        source,
                    });
                }
            }
        }
        for (id, version) in remember {
            self.candidates.remember(id, version);
        }
        report.candidates = self.candidates.len();
        Ok(report)
    }

    /// Sets (`mark`) or removes the unused-since annotation, fenced on
    /// `version`; the new resourceVersion, or `None` when the object
    /// changed or went meanwhile (the next round looks again).
    async fn set_mark(&self, id: u32, version: &str, mark: bool) -> Result<Option<String>, GcError> {
        let value = mark.then(|| humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string());
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": version,
                "annotations": { GC_UNUSED_SINCE_ANNOTATION: value },
            }
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        match self
            .identities
            .patch(&id.to_string(), &params, &Patch::Merge(&patch))
            .await
        {
            Ok(object) => Ok(object.resource_version()),
            Err(e) if is_conflict_or_gone(&e) => Ok(None),
            Err(source) => Err(GcError::Api {
                action: format!(
                    "{} RivetIdentity {id} at resourceVersion {version}",
                    if mark {
                        "marking unused"
                    } else {
                        "unmarking (used again)"
                    }
                ),
                source,
            }),
        }
    }
}

//! RivetEndpoint GC (the seed's CiliumEndpoint GC): a RivetEndpoint whose
//! pod is gone, or whose pod was re-created under the same name with
//! another UID, is deleted.
//!
//! A pass takes its candidates from the caches ([`candidates`], pure), then
//! confirms each with a live GET of the pod, because the pod cache may lag
//! the endpoint cache: a pod that exists with the owner's UID (or, for an
//! endpoint without an owner reference, under its name) keeps its endpoint.
//! The delete carries the endpoint's resourceVersion and UID as
//! preconditions, so an endpoint svc-k8s-sync rewrote in between (for a
//! re-created pod) fails with 409 and stays; [`Term::ensure`] comes right
//! before each delete.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PartialObjectMeta, Preconditions};
use kube::{Client, Resource, ResourceExt};
use rivet_k8s::RivetEndpoint;

use super::cache::Cache;
use super::{StaleError, StaleMetrics};
use crate::term::Term;

/// A RivetEndpoint the caches call stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Its namespace (the pod's).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The pod it belongs to: its owner reference's name, else its own.
    pub pod: String,
    /// The owner reference's pod UID, when it has one.
    pub owner_uid: Option<String>,
    /// Its own UID (delete precondition).
    pub uid: Option<String>,
    /// Its resourceVersion when read (delete precondition).
    pub resource_version: Option<String>,
}

impl Candidate {
    /// Why it is stale, given the pod found by a live GET (`None`: 404):
    /// `None` when the pod still owns it.
    pub fn stale_reason(&self, live_pod_uid: Option<Option<&str>>) -> Option<StaleReason> {
        match (live_pod_uid, self.owner_uid.as_deref()) {
            (None, _) => Some(StaleReason::PodGone),
            (Some(Some(live)), Some(owner)) if live != owner => Some(StaleReason::PodReplaced),
            (Some(_), _) => None,
        }
    }

    fn display(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Why a RivetEndpoint was deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleReason {
    /// Its pod does not exist.
    PodGone,
    /// A pod of its name exists with another UID than its owner reference.
    PodReplaced,
}

impl StaleReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PodGone => "pod_gone",
            Self::PodReplaced => "pod_replaced",
        }
    }
}

/// Pod UIDs by namespace and name (empty UID when unknown).
pub type PodIndex = HashMap<(String, String), String>;

/// Indexes pods (full objects or metadata) by namespace and name.
pub fn pod_index<'a, K: Resource + 'a>(pods: impl IntoIterator<Item = &'a K>) -> PodIndex {
    pods.into_iter()
        .map(|p| {
            let meta = p.meta();
            (
                (
                    meta.namespace.clone().unwrap_or_default(),
                    meta.name.clone().unwrap_or_default(),
                ),
                meta.uid.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// The RivetEndpoints of `endpoints` whose pod `pods` does not have, or has
/// with another UID than the endpoint's owner reference. Endpoints being
/// deleted are left alone.
pub fn candidates<'a>(endpoints: impl IntoIterator<Item = &'a RivetEndpoint>, pods: &PodIndex) -> Vec<Candidate> {
    endpoints
        .into_iter()
        .filter(|e| e.metadata.deletion_timestamp.is_none())
        .filter_map(|e| {
            let owner = e
                .owner_references()
                .iter()
                .find(|o| o.kind == "Pod" && o.api_version == "v1");
            let candidate = Candidate {
                namespace: e.namespace().unwrap_or_default(),
                name: e.name_any(),
                pod: owner.map_or_else(|| e.name_any(), |o| o.name.clone()),
                owner_uid: owner.map(|o| o.uid.clone()),
                uid: e.metadata.uid.clone(),
                resource_version: e.metadata.resource_version.clone(),
            };
            let cached = pods.get(&(candidate.namespace.clone(), candidate.pod.clone()));
            let reason = candidate.stale_reason(cached.map(|uid| Some(uid.as_str()).filter(|u| !u.is_empty())));
            reason.map(|_| candidate)
        })
        .collect()
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Deleted: `namespace/name` and why.
    pub deleted: Vec<(String, StaleReason)>,
    /// Candidates kept: the live GET found their pod, or they changed or
    /// went before the delete.
    pub kept: Vec<String>,
}

/// Confirms each candidate with a live GET of its pod and deletes the stale
/// ones (resourceVersion and UID preconditions, after [`Term::ensure`]).
/// Every candidate is tried; the first failure is returned after the rest.
pub async fn collect(
    client: &Client,
    term: &Term,
    candidates: Vec<Candidate>,
    metrics: &StaleMetrics,
) -> Result<GcReport, StaleError> {
    let mut report = GcReport::default();
    let mut first_error = None;
    for candidate in candidates {
        match collect_one(client, term, &candidate, metrics).await {
            Ok(Some(reason)) => report.deleted.push((candidate.display(), reason)),
            Ok(None) => report.kept.push(candidate.display()),
            Err(StaleError::NotLeading(e)) => return Err(e.into()),
            Err(e) => {
                metrics.call_failed("endpoint-gc", e.kind_label(), &e.to_string());
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

async fn collect_one(
    client: &Client,
    term: &Term,
    candidate: &Candidate,
    metrics: &StaleMetrics,
) -> Result<Option<StaleReason>, StaleError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &candidate.namespace);
    let live: Option<PartialObjectMeta<Pod>> = pods
        .get_metadata_opt(&candidate.pod)
        .await
        .map_err(|e| StaleError::api("get", format!("pods {}/{}", candidate.namespace, candidate.pod), e))?;
    let live_uid = live.as_ref().map(|p| p.metadata.uid.as_deref());
    let Some(reason) = candidate.stale_reason(live_uid) else {
        metrics.endpoint_kept(&candidate.display(), "pod_exists");
        return Ok(None);
    };
    term.ensure()?;
    let endpoints: Api<RivetEndpoint> = Api::namespaced(client.clone(), &candidate.namespace);
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: candidate.resource_version.clone(),
            uid: candidate.uid.clone(),
        }),
        ..DeleteParams::default()
    };
    match endpoints.delete(&candidate.name, &params).await {
        Ok(_) => {
            metrics.endpoint_deleted(&candidate.display(), reason.as_str(), candidate.owner_uid.as_deref());
            Ok(Some(reason))
        }
        // Changed since read (svc-k8s-sync wrote it for a new pod) or gone
        // already: nothing to do.
        Err(e) if matches!(rivet_k8s::status_code(&e), Some(404 | 409)) => {
            metrics.endpoint_kept(&candidate.display(), "changed");
            Ok(None)
        }
        Err(e) => Err(StaleError::api(
            "delete",
            format!("rivetendpoints {}", candidate.display()),
            e,
        )),
    }
}

/// The `endpoint-gc` controller's state.
pub(crate) struct EndpointGc {
    pub client: Client,
    pub endpoints: Cache<RivetEndpoint>,
    pub pods: Cache<PartialObjectMeta<Pod>>,
    pub metrics: StaleMetrics,
}

impl EndpointGc {
    /// Both caches completed their first list.
    pub fn synced(&self) -> bool {
        self.endpoints.synced() && self.pods.synced()
    }

    /// One pass over the caches.
    pub async fn pass(&self, term: &Term) -> Result<GcReport, StaleError> {
        // The pods first: an endpoint created after this snapshot is not
        // seen, while a pod created after it is caught by the live GET.
        let pods = pod_index(self.pods.store.state().iter().map(Arc::as_ref));
        let endpoints = self.endpoints.store.state();
        let candidates = candidates(endpoints.iter().map(Arc::as_ref), &pods);
        collect(&self.client, term, candidates, &self.metrics).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use rivet_k8s::RivetEndpointSpec;

    fn endpoint(name: &str, owner: Option<(&str, &str)>) -> RivetEndpoint {
        let mut e = RivetEndpoint::new(name, RivetEndpointSpec {});
        e.metadata.namespace = Some("shop".into());
        e.metadata.uid = Some(format!("rep-{name}"));
        e.metadata.resource_version = Some("7".into());
        e.metadata.owner_references = owner.map(|(pod, uid)| {
            vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: pod.into(),
                uid: uid.into(),
                ..OwnerReference::default()
            }]
        });
        e
    }

    fn pods(list: &[(&str, &str)]) -> PodIndex {
        list.iter()
            .map(|(name, uid)| (("shop".to_string(), name.to_string()), uid.to_string()))
            .collect()
    }

    #[test]
    fn the_caches_name_endpoints_of_gone_and_replaced_pods_only() {
        let endpoints = [
            endpoint("live", Some(("live", "u1"))),
            endpoint("gone", Some(("gone", "u2"))),
            endpoint("replaced", Some(("replaced", "u3"))),
            endpoint("unowned-live", None),
            endpoint("unowned-gone", None),
        ];
        let index = pods(&[("live", "u1"), ("replaced", "u3-new"), ("unowned-live", "u9")]);
        let names: Vec<String> = candidates(&endpoints, &index).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["gone", "replaced", "unowned-gone"]);
    }

    #[test]
    fn an_endpoint_being_deleted_is_no_candidate() {
        let mut e = endpoint("gone", Some(("gone", "u2")));
        e.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        assert!(candidates([&e], &pods(&[])).is_empty());
    }

    #[test]
    fn the_live_pod_decides() {
        let candidate = candidates([&endpoint("web", Some(("web", "u1")))], &pods(&[])).remove(0);
        assert_eq!(candidate.stale_reason(None), Some(StaleReason::PodGone));
        assert_eq!(candidate.stale_reason(Some(Some("u2"))), Some(StaleReason::PodReplaced));
        assert_eq!(
            candidate.stale_reason(Some(Some("u1"))),
            None,
            "created since the caches were read"
        );
        let unowned = candidates([&endpoint("web", None)], &pods(&[])).remove(0);
        assert_eq!(unowned.stale_reason(Some(Some("any"))), None);
        assert_eq!(unowned.stale_reason(None), Some(StaleReason::PodGone));
    }
}

//! The CIDR identities the policies' ipBlocks (and the host prefixes of
//! named ports they resolve) need, allocated from svc-identity.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ipnet::IpNet;
use rivet_common::controller::Action;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::net;
use tonic::Status;

use super::{EndpointManager, State};

/// Owner of the CIDR identities allocated for policies.
const CIDR_OWNER: &str = "svc-endpoint/policy";

impl State {
    /// Every prefix that needs a CIDR identity: the policies' ipBlock
    /// prefixes and the host prefixes of the endpoints their egress ipBlocks
    /// resolve a named port for.
    pub(super) fn desired_cidrs(&self) -> BTreeSet<IpNet> {
        let mut desired = self.repository.cidrs();
        desired.extend(self.repository.named_port_hosts(&self.selectors));
        desired
    }
}

impl EndpointManager {
    /// Makes the CIDR identities match the repository's prefixes. With
    /// `reallocate` every prefix is allocated again (svc-identity restarted
    /// and forgot them).
    ///
    /// One pass at a time (a policy change and the background retry both
    /// run it), each reading the desired prefixes when it starts and again
    /// after svc-identity answered: a prefix whose policy went meanwhile is
    /// never inserted but released, so the latest desired state wins.
    /// Releases that failed are kept and retried by the next pass.
    pub(super) async fn reconcile_cidrs(&self, reallocate: bool) -> Result<(), Status> {
        let _pass = self.inner.cidr_pass.lock().await;
        // Read before the desired state: a success covers every request
        // made up to here.
        let covers = self.inner.cidr_requested.load(Ordering::SeqCst);
        let missing: Vec<IpNet> = {
            let state = self.state();
            state
                .desired_cidrs()
                .into_iter()
                .filter(|p| reallocate || !state.cidr_identities.contains_key(p))
                .collect()
        };
        if !missing.is_empty() {
            let response = self
                .inner
                .deps
                .identity
                .allocate_cidrs(idpb::AllocateCidrIdentitiesRequest {
                    prefixes: missing.iter().map(|p| net::prefix_to_proto(*p)).collect(),
                    owner: CIDR_OWNER.into(),
                })
                .await?;
            let mut state = self.state();
            let desired = state.desired_cidrs();
            for identity in response.identities {
                let prefix = match identity.prefix.as_ref().map(net::prefix_from_proto) {
                    Some(Ok(prefix)) => prefix,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "svc-identity returned an invalid prefix");
                        continue;
                    }
                    None => {
                        tracing::warn!(
                            id = identity.id,
                            "svc-identity returned a CIDR identity without its prefix"
                        );
                        continue;
                    }
                };
                if desired.contains(&prefix) {
                    state.cidr_identities.insert(prefix, identity.id);
                    state.selectors.set_cidr_identity(prefix, identity.id);
                } else {
                    // Its policy went while svc-identity allocated it.
                    state.cidr_releases.insert(prefix);
                }
            }
            self.queue_changed_policies(&mut state, "CIDR identities allocated");
        }
        let releases: Vec<IpNet> = {
            let mut state = self.state();
            let desired = state.desired_cidrs();
            let extra: Vec<IpNet> = state
                .cidr_identities
                .keys()
                .filter(|p| !desired.contains(p))
                .copied()
                .collect();
            for prefix in &extra {
                state.cidr_identities.remove(prefix);
                state.selectors.remove_cidr_identity(prefix);
                state.cidr_releases.insert(*prefix);
            }
            self.queue_changed_policies(&mut state, "CIDR identities released");
            // Desired again before its release went out: it stays allocated.
            state.cidr_releases.retain(|p| !desired.contains(p));
            state.cidr_releases.iter().copied().collect()
        };
        if !releases.is_empty() {
            self.inner
                .deps
                .identity
                .release_cidrs(idpb::ReleaseCidrIdentitiesRequest {
                    prefixes: releases.iter().map(|p| net::prefix_to_proto(*p)).collect(),
                    owner: CIDR_OWNER.into(),
                })
                .await?;
            let mut state = self.state();
            for prefix in &releases {
                state.cidr_releases.remove(prefix);
            }
        }
        self.inner.cidr_reconciled.send_if_modified(|reconciled| {
            let newer = covers > *reconciled;
            *reconciled = (*reconciled).max(covers);
            newer
        });
        Ok(())
    }

    /// `cidr-identities`: one pass when triggered (a policy or named port
    /// changed, a replay failed); an error is retried with the controller's
    /// backoff.
    pub(super) async fn reconcile_cidrs_pass(&self) -> Result<Action, Status> {
        let reallocate = self.inner.cidr_reallocate.swap(false, Ordering::SeqCst);
        match self.reconcile_cidrs(reallocate).await {
            Ok(()) => Ok(Action::await_change()),
            Err(e) => {
                if reallocate {
                    self.inner.cidr_reallocate.store(true, Ordering::SeqCst);
                }
                Err(e)
            }
        }
    }

    /// Waits (at most `limit`) until a pass of `cidr-identities` that
    /// started after this call succeeded; whether one did.
    pub(super) async fn cidrs_reconciled(&self, limit: Duration) -> bool {
        let wanted = self.inner.cidr_requested.fetch_add(1, Ordering::SeqCst) + 1;
        let mut reconciled = self.inner.cidr_reconciled.subscribe();
        self.inner.cidr_wake.trigger();
        tokio::time::timeout(limit, reconciled.wait_for(|done| *done >= wanted))
            .await
            .is_ok()
    }
}

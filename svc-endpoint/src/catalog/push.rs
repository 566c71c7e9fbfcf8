//! `service-push`: svc-loader holds what the catalog resolves, level-
//! triggered. Each pass computes the complete desired set of loader
//! services. svc-loader's boot id comes with every answer
//! (ReplaceServices, UpsertService, DeleteService, ListServices); a pass
//! asks GetInfo only when no answer carried it for `loader_poll` (the
//! catalog was idle), so a busy catalog costs no extra call and an idle
//! one still notices a restart within `loader_poll`. A boot id other than
//! the one the last replay went to (the first pass after svc-endpoint
//! started, or svc-loader restarted) gets the whole set with
//! ReplaceServices (an identical set changes nothing in the maps: the
//! loader keeps backend ids and tables); otherwise only what differs from
//! what was last pushed goes out as UpsertService / DeleteService, and an
//! answer from a new boot id ends the pass so that the next one replays.
//! A service svc-loader refuses (FRONTEND_HELD, MAP_FULL,
//! INVALID_ARGUMENT) does not hold up the others: it is remembered with
//! the reason (`rivet service get`, `wait`) and tried again every pass.
//! Runs on every change and every `loader_poll`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rivet_common::controller::{Action, Progress};
use rivet_proto::loader::v1 as lb;
use tonic::{Code, Status};

use super::document::ObjectKey;
use super::{CatalogError, ServiceCatalog, events};

/// What svc-loader holds as far as the catalog knows.
#[derive(Debug, Default)]
pub(super) struct Pushed {
    /// The boot id the last ReplaceServices went to; `None`: replace next.
    boot_id: Option<String>,
    /// When an answer last carried svc-loader's boot id.
    answered: Option<Instant>,
    /// Every service svc-loader holds, by id, as last pushed.
    services: BTreeMap<u32, lb::LbService>,
    /// Services svc-loader refused, with its message.
    refused: BTreeMap<u32, String>,
}

impl Pushed {
    /// Whether svc-loader holds `service` as it is.
    pub(super) fn holds(&self, service: &lb::LbService) -> bool {
        self.services.get(&service.service_id) == Some(service)
    }

    /// Records an answer from svc-loader: false when it came from another
    /// boot than the last replay went to (the next pass replays).
    fn answered_by(&mut self, boot_id: &str) -> bool {
        if self.boot_id.as_deref() != Some(boot_id) {
            self.boot_id = None;
            return false;
        }
        self.answered = Some(Instant::now());
        true
    }
}

/// Why a pass failed as a whole (retried after a backoff).
#[derive(Debug, thiserror::Error)]
pub(super) enum PushError {
    /// svc-loader did not answer.
    #[error("{call} on svc-loader: {}", .status.message())]
    Loader {
        /// The call.
        call: &'static str,
        /// Its status.
        #[source]
        status: Status,
    },
    /// svc-loader restarted during the pass: the next pass replays.
    #[error("svc-loader restarted during a push (boot id {seen}); replaying the whole set")]
    LoaderRestarted {
        /// The boot id an answer carried.
        seen: String,
    },
    /// The pod feed ended (svc-endpoint is stopping).
    #[error("the pod change feed closed")]
    InputsClosed,
}

/// Whether svc-loader refused this one service (others may pass).
fn refused(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::InvalidArgument | Code::AlreadyExists | Code::ResourceExhausted | Code::FailedPrecondition
    )
}

impl ServiceCatalog {
    pub(super) fn pushed(&self) -> std::sync::MutexGuard<'_, Pushed> {
        self.inner.push.lock().expect("service push lock poisoned")
    }

    /// `service-inputs`: wakes `service-push` whenever the pods may have
    /// changed; returns when the feed closes.
    pub(super) async fn watch_inputs(&self, progress: Progress) -> Result<(), PushError> {
        let mut changes = self.inner.pods.changes();
        progress.ok();
        loop {
            changes.changed().await.map_err(|_| PushError::InputsClosed)?;
            self.inner.push_wake.trigger();
        }
    }

    /// One pass of `service-push`.
    pub(super) async fn push_pass(&self) -> Result<Action, PushError> {
        // Building the pods walks every endpoint and other nodes' pod under
        // the endpoint manager's lock: only when a Service may resolve
        // against them and they changed since the last pass built them.
        // (Built on every pass, it was most of svc-endpoint's CPU at 1,000
        // endpoints and held every regeneration up behind that lock.)
        let revision = self.inner.pods.revision();
        let build = {
            let mut state = self.state();
            if state.services.is_empty() {
                state.resolved_pods = None;
                state.resolved_revision = None;
            }
            !state.services.is_empty() && state.resolved_revision != Some(revision)
        };
        let pods = build.then(|| self.inner.pods.pods().map(|p| self.with_node_name(p)));
        let (generation, desired) = {
            let mut state = self.state();
            if let Some(pods) = pods {
                if pods.is_none() && state.needs_pods() {
                    // A restart must not push selector Services without their pods.
                    return Ok(Action::requeue(self.inner.options.loader_poll));
                }
                // Complete pods only: the next pass builds them again until then.
                state.resolved_revision = pods.is_some().then_some(revision);
                let pods = pods.unwrap_or_default();
                // Only Services whose objects changed are resolved again, all of
                // them when the pods changed.
                if state.resolved_pods.as_ref() != Some(&pods) {
                    let all: Vec<_> = state.services.keys().cloned().collect();
                    state.dirty.extend(all);
                    state.resolved_pods = Some(pods);
                }
            }
            let pods = state.resolved_pods.take().unwrap_or_default();
            let dirty = std::mem::take(&mut state.dirty);
            let mut fresh = Vec::with_capacity(dirty.len());
            for name in dirty {
                let entries = state.services.get(&name).map(|s| {
                    let entries = self.resolve(&state, s, &pods).entries;
                    entries.into_iter().map(|e| e.service).collect::<Vec<_>>()
                });
                fresh.push((name, entries));
            }
            for (name, entries) in fresh {
                match entries {
                    Some(entries) => state.resolved.insert(name, entries),
                    None => state.resolved.remove(&name),
                };
            }
            state.resolved_pods = Some(pods);
            let desired: BTreeMap<u32, lb::LbService> = state
                .resolved
                .values()
                .flatten()
                .map(|s| (s.service_id, s.clone()))
                .collect();
            (state.generation, desired)
        };
        let started = Instant::now();
        let loader = &self.inner.loader;
        let loader_poll = self.inner.options.loader_poll;
        let result = async {
            let (known, silent_for) = {
                let pushed = self.pushed();
                let silent_for = pushed.answered.map_or(Duration::MAX, |t| t.elapsed());
                (pushed.boot_id.clone(), silent_for)
            };
            // Answers carry the boot id: ask only after a quiet `loader_poll`.
            let replay = match known {
                None => true,
                Some(_) if silent_for < loader_poll => false,
                Some(_) => {
                    events::loader_polled(&self.inner.metrics);
                    let boot_id = loader.boot_id().await.map_err(|status| PushError::Loader {
                        call: "GetInfo",
                        status,
                    })?;
                    !self.pushed().answered_by(&boot_id)
                }
            };
            if replay {
                match loader.replace_services(desired.values().cloned().collect()).await {
                    Ok(response) => {
                        let mut pushed = self.pushed();
                        pushed.boot_id = Some(response.boot_id.clone());
                        pushed.answered = Some(Instant::now());
                        pushed.services = desired.clone();
                        pushed.refused.clear();
                        return Ok((true, desired.len(), 0, response.boot_id));
                    }
                    // One service svc-loader refuses must not hold up the
                    // others: learn what it holds and go one by one.
                    Err(status) if refused(&status) => {
                        tracing::warn!(
                            "svc-loader refused the whole service set ({}); pushing service by service",
                            status.message()
                        );
                        let held = loader.list_services().await.map_err(|status| PushError::Loader {
                            call: "ListServices",
                            status,
                        })?;
                        let mut pushed = self.pushed();
                        pushed.boot_id = Some(held.boot_id.clone());
                        pushed.answered = Some(Instant::now());
                        pushed.services = held
                            .services
                            .into_iter()
                            .filter_map(|s| s.service)
                            .map(|s| (s.service_id, s))
                            .collect();
                    }
                    Err(status) => {
                        return Err(PushError::Loader {
                            call: "ReplaceServices",
                            status,
                        });
                    }
                }
            }
            let boot_id = self.pushed().boot_id.clone().unwrap_or_default();
            let (mut upserted, mut deleted) = (0, 0);
            let changed: Vec<&lb::LbService> = {
                let pushed = self.pushed();
                desired.values().filter(|s| !pushed.holds(s)).collect()
            };
            for service in changed {
                match loader.upsert_service(service.clone()).await {
                    Ok(response) => {
                        let mut pushed = self.pushed();
                        if !pushed.answered_by(&response.boot_id) {
                            return Err(PushError::LoaderRestarted { seen: response.boot_id });
                        }
                        pushed.services.insert(service.service_id, service.clone());
                        pushed.refused.remove(&service.service_id);
                        upserted += 1;
                    }
                    Err(status) if refused(&status) => {
                        let mut pushed = self.pushed();
                        // What it held before is gone or stale either way.
                        pushed.services.remove(&service.service_id);
                        let message = status.message().to_string();
                        if pushed.refused.get(&service.service_id) != Some(&message) {
                            events::loader_refused(&self.inner.metrics, service.service_id, &message);
                        }
                        pushed.refused.insert(service.service_id, message);
                    }
                    Err(status) => {
                        return Err(PushError::Loader {
                            call: "UpsertService",
                            status,
                        });
                    }
                }
            }
            let gone: Vec<u32> = {
                let pushed = self.pushed();
                pushed
                    .services
                    .keys()
                    .filter(|id| !desired.contains_key(id))
                    .copied()
                    .collect()
            };
            for id in gone {
                let response = loader.delete_service(id).await.map_err(|status| PushError::Loader {
                    call: "DeleteService",
                    status,
                })?;
                let mut pushed = self.pushed();
                if !pushed.answered_by(&response.boot_id) {
                    return Err(PushError::LoaderRestarted { seen: response.boot_id });
                }
                pushed.services.remove(&id);
                deleted += 1;
            }
            // Refused services that are no longer wanted are forgotten.
            self.pushed().refused.retain(|id, _| desired.contains_key(id));
            Ok((false, upserted, deleted, boot_id))
        }
        .await;
        match result {
            Ok((replaced, upserted, deleted, boot_id)) => {
                let held = self.pushed().services.len();
                events::loader_pushed(
                    &self.inner.metrics,
                    replaced,
                    upserted,
                    deleted,
                    held,
                    &boot_id,
                    started.elapsed(),
                );
                self.inner.realised.send_if_modified(|realised| {
                    let newer = generation > *realised;
                    *realised = (*realised).max(generation);
                    newer
                });
                // Next check of the boot id: `loader_poll` after the last answer.
                let silent_for = self.pushed().answered.map_or(Duration::ZERO, |t| t.elapsed());
                Ok(Action::requeue(
                    loader_poll.saturating_sub(silent_for).max(Duration::from_millis(1)),
                ))
            }
            Err(e) => {
                events::push_failed(&self.inner.metrics, &e.to_string());
                Err(e)
            }
        }
    }

    /// Waits until a pass realised `generation`; then fails if svc-loader
    /// refused one of the object's Service's loader services.
    pub(super) async fn wait_realised(
        &self,
        key: &ObjectKey,
        generation: u64,
        deadline: Duration,
    ) -> Result<(), CatalogError> {
        let mut realised = self.inner.realised.subscribe();
        let reached = tokio::time::timeout(deadline, realised.wait_for(|r| *r >= generation)).await;
        if !matches!(reached, Ok(Ok(_))) {
            return Err(CatalogError::NotRealisedInTime {
                key: key.clone(),
                deadline,
            });
        }
        let service = match key.kind {
            super::document::ObjectKind::Service => key.name.clone(),
            super::document::ObjectKind::EndpointSlice => self
                .state()
                .slices
                .get(&(key.namespace.clone(), key.name.clone()))
                .map(|s| s.def.service.clone())
                .unwrap_or_default(),
        };
        let ids: Vec<u32> = self
            .state()
            .services
            .get(&(key.namespace.clone(), service))
            .map(|s| s.ids.values().copied().collect())
            .unwrap_or_default();
        let pushed = self.pushed();
        if let Some((service_id, message)) = ids
            .iter()
            .find_map(|id| pushed.refused.get(id).map(|m| (*id, m.clone())))
        {
            return Err(CatalogError::RefusedByLoader {
                key: key.clone(),
                service_id,
                message,
            });
        }
        Ok(())
    }
}

//! The watch caches: one kube-runtime watcher per kind feeding a reflector
//! store, each a supervised controller (restarted on end or panic; the
//! watcher's own backoff paces retries after API errors). Each event updates
//! the kind's [`KindStatus`] and fires the triggers of the controllers that
//! act on the caches.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::Resource;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::{self, Event};
use rivet_common::controller::{Controller, Controllers, Trigger};
use serde::de::DeserializeOwned;

use crate::error;
use crate::events::SyncMetrics;

/// What one kind's watch has done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindStatus {
    /// The first initial list completed (stays true across re-lists: the
    /// store keeps the complete previous list until the new one is done).
    pub synced: bool,
    /// Objects in the store.
    pub objects: u64,
    /// Lists after the first (re-lists).
    pub relists: u64,
    /// The last watch error; empty once the watch works again.
    pub last_error: String,
    /// The last error was a refusal by RBAC (403).
    pub forbidden: bool,
}

/// Every watched kind's status, by kind name ("Pod", "NetworkPolicy").
#[derive(Debug)]
pub struct WatchStatus {
    kinds: Mutex<BTreeMap<&'static str, KindStatus>>,
    all_synced: tokio::sync::watch::Sender<bool>,
}

impl Default for WatchStatus {
    fn default() -> Self {
        Self {
            kinds: Mutex::default(),
            all_synced: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl WatchStatus {
    /// Registers `kind` as watched and not synced.
    pub fn register(&self, kind: &'static str) {
        self.lock().entry(kind).or_default();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, KindStatus>> {
        self.kinds.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn update(&self, kind: &'static str, f: impl FnOnce(&mut KindStatus)) {
        let all = {
            let mut kinds = self.lock();
            f(kinds.entry(kind).or_default());
            kinds.values().all(|s| s.synced)
        };
        self.all_synced
            .send_if_modified(|synced| std::mem::replace(synced, all) != all);
    }

    /// Completes once every registered kind completed its initial list.
    pub async fn wait_synced(&self) {
        let mut synced = self.all_synced.subscribe();
        // The sender lives as long as self.
        let _ = synced.wait_for(|s| *s).await;
    }

    /// Each kind's status.
    pub fn kinds(&self) -> Vec<(&'static str, KindStatus)> {
        self.lock().iter().map(|(k, s)| (*k, s.clone())).collect()
    }

    /// `kind`'s status.
    pub fn kind(&self, kind: &str) -> Option<KindStatus> {
        self.lock().get(kind).cloned()
    }

    /// Whether `kind` completed its initial list.
    pub fn synced(&self, kind: &str) -> bool {
        self.lock().get(kind).is_some_and(|s| s.synced)
    }

    /// Every registered kind completed its initial list.
    pub fn all_synced(&self) -> bool {
        let kinds = self.lock();
        !kinds.is_empty() && kinds.values().all(|s| s.synced)
    }

    /// The kinds still listing.
    pub fn unsynced(&self) -> Vec<&'static str> {
        self.lock().iter().filter(|(_, s)| !s.synced).map(|(k, _)| *k).collect()
    }

    /// Re-lists summed over the kinds: a change means the caches were
    /// rebuilt from a fresh list, and the fed daemons get a full replay.
    pub fn relists(&self) -> u64 {
        self.lock().values().map(|s| s.relists).sum()
    }
}

/// One kind to watch.
pub struct WatchSpec<K: Resource> {
    /// The kind's name in status and logs ("Pod").
    pub kind: &'static str,
    /// The controller's name (`watch-pods`).
    pub controller: &'static str,
    /// The API to watch (all namespaces or cluster-scoped).
    pub api: Api<K>,
    /// Selectors (e.g. `spec.nodeName=<node>` for pods).
    pub config: watcher::Config,
    /// The store's type information (`()` for typed kinds).
    pub dyntype: K::DynamicType,
}

/// Starts the watch of `spec` under `controllers`, filling a store; returns
/// the store's reader. `changed` fires after each event.
pub fn start<K>(
    controllers: &Controllers,
    spec: WatchSpec<K>,
    status: Arc<WatchStatus>,
    metrics: SyncMetrics,
    changed: Vec<Trigger>,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Send + Sync,
{
    let writer = Writer::<K>::new(spec.dyntype.clone());
    let store = writer.as_reader();
    let writer = Arc::new(Mutex::new(writer));
    status.register(spec.kind);
    let WatchSpec {
        kind,
        controller,
        api,
        config,
        ..
    } = spec;
    controllers.supervise(Controller::new(controller), move |progress| {
        let (api, config, writer, status, metrics, changed) = (
            api.clone(),
            config.clone(),
            writer.clone(),
            status.clone(),
            metrics.clone(),
            changed.clone(),
        );
        async move {
            let mut events = watcher::watcher(api, config).default_backoff().boxed();
            let mut lists = 0u64;
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        let objects = {
                            let mut writer = writer.lock().unwrap_or_else(|e| e.into_inner());
                            writer.apply_watcher_event(&event);
                            writer.as_reader().state().len() as u64
                        };
                        match event {
                            Event::Init => {
                                lists += 1;
                                if lists > 1 || status.synced(kind) {
                                    metrics.relisted(kind);
                                    status.update(kind, |s| s.relists += 1);
                                }
                            }
                            Event::InitDone => {
                                let first = !status.synced(kind);
                                status.update(kind, |s| {
                                    s.synced = true;
                                    s.objects = objects;
                                    s.last_error.clear();
                                    s.forbidden = false;
                                });
                                metrics.listed(kind, objects, first);
                                progress.ok();
                            }
                            Event::Apply(_) | Event::Delete(_) => {
                                status.update(kind, |s| {
                                    s.objects = objects;
                                    s.last_error.clear();
                                    s.forbidden = false;
                                });
                                progress.ok();
                            }
                            Event::InitApply(_) => continue,
                        }
                        for trigger in &changed {
                            trigger.trigger();
                        }
                    }
                    Err(e) => {
                        let (label, text) = describe_watch_error(kind, &e);
                        metrics.watch_failed(kind, label, &text);
                        status.update(kind, |s| {
                            s.last_error = text;
                            s.forbidden = label == "forbidden";
                        });
                    }
                }
            }
            Ok::<(), std::convert::Infallible>(())
        }
    });
    store
}

/// A metric label and an operator's text for a watch error, a 403 naming
/// the missing permission.
fn describe_watch_error(kind: &str, e: &watcher::Error) -> (&'static str, String) {
    let call = |verb: &'static str, source: &kube::Error| {
        let label = error::kind_label(source);
        let text = if error::is_forbidden(source) {
            format!(
                "{verb} {kind}: forbidden by the API server's RBAC (403): the ServiceAccount lacks `{verb}` on this resource (deploy/rbac/svc-k8s-sync.yaml): {source}"
            )
        } else {
            format!("{verb} {kind}: {source}")
        };
        (label, text)
    };
    match e {
        watcher::Error::InitialListFailed(source) => call("list", source),
        watcher::Error::WatchStartFailed(source) | watcher::Error::WatchFailed(source) => call("watch", source),
        watcher::Error::WatchError(status) if status.code == 403 => (
            "forbidden",
            format!(
                "watch {kind}: forbidden by the API server's RBAC (403): {}",
                status.message
            ),
        ),
        watcher::Error::WatchError(status) => (
            "watch_error",
            format!("watch {kind}: {} ({})", status.message, status.code),
        ),
        watcher::Error::NoResourceVersion => ("other", format!("watch {kind}: {e}")),
    }
}

//! A watch cache: a kube-runtime watcher feeding a reflector store, run as
//! a supervised controller of the term (restarted on end or panic; the
//! watcher's own backoff paces retries after API errors).

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
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

use super::StaleMetrics;

/// A store of one kind and whether its first list completed.
pub(crate) struct Cache<K: Resource + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// The objects.
    pub store: Store<K>,
    synced: Arc<AtomicBool>,
    synced_trigger: Arc<Mutex<Vec<Trigger>>>,
}

impl<K: Resource + Clone + 'static> Cache<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// Whether the first list completed (stays true across re-lists: the
    /// store keeps the previous list until a new one is complete).
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Fires `trigger` when the first list completes.
    pub fn on_synced(&self, trigger: &Trigger) {
        self.synced_trigger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(trigger.clone());
        if self.synced() {
            trigger.trigger();
        }
    }
}

/// Starts the watch of `api` (all objects) as controller `name` under
/// `controllers`; `changed` fires after each event once synced.
pub(crate) fn watch<K>(
    controllers: &Controllers,
    name: &'static str,
    api: Api<K>,
    metrics: StaleMetrics,
    changed: Trigger,
) -> Cache<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default + Send + Sync,
{
    let writer = Writer::<K>::new(K::DynamicType::default());
    let cache = Cache {
        store: writer.as_reader(),
        synced: Arc::default(),
        synced_trigger: Arc::default(),
    };
    let writer = Arc::new(Mutex::new(writer));
    let kind = K::kind(&K::DynamicType::default()).into_owned();
    let (synced, synced_trigger) = (cache.synced.clone(), cache.synced_trigger.clone());
    controllers.supervise(Controller::new(name), move |progress| {
        let (api, writer, metrics, changed, kind) = (
            api.clone(),
            writer.clone(),
            metrics.clone(),
            changed.clone(),
            kind.clone(),
        );
        let (synced, synced_trigger) = (synced.clone(), synced_trigger.clone());
        async move {
            let mut events = watcher::watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        writer
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .apply_watcher_event(&event);
                        match event {
                            Event::InitDone => {
                                if !synced.swap(true, Ordering::AcqRel) {
                                    for trigger in synced_trigger.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                                        trigger.trigger();
                                    }
                                }
                                progress.ok();
                            }
                            Event::Apply(_) | Event::Delete(_) => progress.ok(),
                            Event::Init | Event::InitApply(_) => continue,
                        }
                        changed.trigger();
                    }
                    Err(e) => metrics.watch_failed(&kind, &e),
                }
            }
            Ok::<(), std::convert::Infallible>(())
        }
    });
    cache
}

//! A watch cache for a duty: a kube-runtime watcher feeding a reflector
//! store, run as a supervised controller of the term (restarted on end or
//! panic; the watcher's own backoff paces retries after API errors).
//!
//! A duty must not act on a cache before its first list completed
//! ([`Cache::synced`]): an empty store would read as "every object is
//! gone".

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

/// Called with each watch error (the watcher retries by itself).
pub(crate) type OnError = Arc<dyn Fn(&watcher::Error) + Send + Sync>;

/// A store of one kind and whether its first list completed.
pub(crate) struct Cache<K: Resource + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// The objects.
    pub store: Store<K>,
    synced: Arc<AtomicBool>,
    synced_triggers: Arc<Mutex<Vec<Trigger>>>,
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

    /// Fires `trigger` when the first list completes (at once if it has).
    pub fn on_synced(&self, trigger: &Trigger) {
        self.synced_triggers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(trigger.clone());
        if self.synced() {
            trigger.trigger();
        }
    }
}

/// Starts the watch of `api` (every object) as controller `name` under
/// `controllers`; `changed` fires when a list completes and after each
/// later event; `on_error` hears each watch error (the watcher retries).
pub(crate) fn watch<K>(
    controllers: &Controllers,
    name: &'static str,
    api: Api<K>,
    on_error: OnError,
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
        synced_triggers: Arc::default(),
    };
    let writer = Arc::new(Mutex::new(writer));
    let (synced, synced_triggers) = (cache.synced.clone(), cache.synced_triggers.clone());
    controllers.supervise(Controller::new(name), move |progress| {
        let (api, writer, on_error, changed) = (api.clone(), writer.clone(), on_error.clone(), changed.clone());
        let (synced, synced_triggers) = (synced.clone(), synced_triggers.clone());
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
                                    let triggers = synced_triggers.lock().unwrap_or_else(|e| e.into_inner());
                                    triggers.iter().for_each(Trigger::trigger);
                                }
                                progress.ok();
                            }
                            Event::Apply(_) | Event::Delete(_) => progress.ok(),
                            Event::Init | Event::InitApply(_) => continue,
                        }
                        changed.trigger();
                    }
                    Err(e) => on_error(&e),
                }
            }
            Ok::<(), std::convert::Infallible>(())
        }
    });
    cache
}

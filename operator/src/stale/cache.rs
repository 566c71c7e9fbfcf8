//! The stale-objects duty's watch caches: [`crate::watch_cache`] with the
//! watch errors counted in the duty's metrics.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use kube::Resource;
use kube::api::Api;
use rivet_common::controller::{Controllers, Trigger};
use serde::de::DeserializeOwned;

use super::StaleMetrics;
pub(crate) use crate::watch_cache::Cache;

/// Starts the watch of `api` (all objects) as controller `name` under
/// `controllers`; `changed` fires after each event once synced; watch
/// errors are counted by kind.
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
    let kind = K::kind(&K::DynamicType::default()).into_owned();
    let on_error = Arc::new(move |e: &kube::runtime::watcher::Error| metrics.watch_failed(&kind, e));
    crate::watch_cache::watch(controllers, name, api, on_error, changed)
}

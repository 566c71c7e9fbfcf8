//! [`IpamStore`]: the allocator made durable. Every change is written to the
//! state file (tmp + fsync + rename) before the call returns; concurrent
//! changes share one write (group commit), so durability costs one fsync per
//! batch, not per request.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rivet_common::controller::Trigger;
use rivet_common::state_file::{StateFile, StateFileError};

use crate::allocator::{AllocError, Allocation, Allocator, AllocatorState, Owner, RangeUsage};
use crate::events::{self, IpamMetrics};
use crate::pool::{Family, PoolSet, PoolSpec};

/// Kind tag and schema version of the state file.
const STATE_KIND: &str = "rivet-ipam-allocations";
const STATE_VERSION: u32 = 1;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request broke an allocation rule.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The change could not be made durable; it was not applied.
    #[error("allocation state could not be made durable: {0}")]
    Persist(#[source] StateFileError),
    /// The state file at start could not be read; nothing is assumed.
    #[error("loading allocation state: {0}")]
    Load(#[source] StateFileError),
    /// The blocking writer task died.
    #[error("writing the allocation state: the blocking writer task failed: {source}")]
    Writer {
        /// The task's failure (a panic or cancellation).
        source: tokio::task::JoinError,
    },
}

/// A snapshot of usage and allocations for listing.
#[derive(Debug, Clone)]
pub struct Listing {
    /// The pools.
    pub pools: PoolSet,
    /// Usage per range.
    pub usage: Vec<RangeUsage>,
    /// Every allocation.
    pub allocations: Vec<Allocation>,
    /// Allocations outside every range of their pool.
    pub orphaned: Vec<Allocation>,
}

#[derive(Debug)]
struct Inner {
    allocator: Allocator,
    /// Bumped by every change.
    generation: u64,
}

/// The node's address allocations, durable and safe to share between tasks.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use svc_ipam::{allocator::Owner, events::IpamMetrics, pool::{Family, PoolSet}, store::IpamStore};
/// let pools = PoolSet::new(&["default=198.18.0.0/24".parse()?])?;
/// let store = IpamStore::open("/var/run/rivet/ipam".as_ref(), pools, IpamMetrics::default())?;
/// let owner = Owner { container_id: "abc".into(), interface: "eth0".into() };
/// let a = store.allocate(&owner, "default", Family::V4, None).await?;
/// println!("{}", a.address);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct IpamStore {
    inner: Mutex<Inner>,
    file: StateFile<AllocatorState>,
    /// Generation known to be on disk.
    persisted: AtomicU64,
    /// Serialises writers; a writer persists every change made so far.
    writer: tokio::sync::Mutex<()>,
    /// Serialises SetPool calls, so a failed write undoes only its own change.
    pool_change: tokio::sync::Mutex<()>,
    /// Fired after every applied pool change.
    pool_changed: Trigger,
    metrics: IpamMetrics,
}

/// What SetPool did.
#[derive(Debug, Clone)]
pub struct PoolChange {
    /// False when the pool already had these ranges (nothing written).
    pub changed: bool,
    /// The pools and usage after the call.
    pub listing: Listing,
}

impl IpamStore {
    /// Opens the store in `dir` (file `allocations.json`), loading and checking
    /// existing state; `pools` are the `--pool` flags', the pools SetPool set
    /// before come back from the state. A corrupt or foreign file is an
    /// error: the daemon must not start and hand out addresses pods already
    /// hold.
    pub fn open(dir: &Path, pools: PoolSet, metrics: IpamMetrics) -> Result<Self, StoreError> {
        let file = StateFile::new(state_path(dir), STATE_KIND, STATE_VERSION);
        let state = file.load().map_err(StoreError::Load)?;
        let (allocator, found) = match state {
            Some(state) => Allocator::from_state(pools, state),
            None => (Allocator::new(pools), Vec::new()),
        };
        for inconsistency in &found {
            events::state_inconsistency(&metrics, inconsistency);
        }
        tracing::info!(
            allocations = allocator.allocations().count(),
            pools = ?allocator.pools().names(),
            inconsistencies = found.len(),
            path = %file.path().display(),
            "allocation state loaded"
        );
        metrics.set_usage(allocator.pools(), &allocator.usage());
        Ok(Self {
            inner: Mutex::new(Inner {
                allocator,
                // Resolved inconsistencies are written back on the first change.
                generation: if found.is_empty() { 0 } else { 1 },
            }),
            file,
            persisted: AtomicU64::new(0),
            writer: tokio::sync::Mutex::new(()),
            pool_change: tokio::sync::Mutex::new(()),
            pool_changed: Trigger::new(),
            metrics,
        })
    }

    /// Replaces the ranges of pool `spec.name` (creating it), durable on
    /// return; see [`Allocator::set_pool`] for what is refused. The same
    /// ranges again write nothing. A change that cannot be made durable is
    /// undone.
    pub async fn set_pool(&self, spec: &PoolSpec) -> Result<PoolChange, StoreError> {
        let _serialised = self.pool_change.lock().await;
        let (result, generation) = self.change(|a| {
            let before = a.pools().clone();
            match a.set_pool(spec) {
                Ok(changed) => (Ok((changed, before)), changed),
                Err(e) => (Err(e), false),
            }
        });
        let (changed, before) = match result {
            Ok(r) => r,
            Err(e) => {
                events::pool_change_refused(&self.metrics, &spec.name, &e);
                return Err(e.into());
            }
        };
        if let Err(e) = self.commit(generation).await {
            if changed {
                // No other SetPool ran since (serialised): only this change is undone.
                self.change(|a| {
                    a.replace_pools(before);
                    ((), true)
                });
            }
            return Err(e);
        }
        let listing = self.list();
        if changed {
            events::pool_changed(
                &self.metrics,
                &spec.name,
                &before.cidrs(&spec.name),
                &spec.cidrs,
                (&listing.pools, &listing.usage),
            );
            self.pool_changed.trigger();
        }
        Ok(PoolChange { changed, listing })
    }

    /// Fires after every applied pool change (for the readiness controller).
    pub fn pool_changed(&self) -> &Trigger {
        &self.pool_changed
    }

    /// See [`Allocator::allocate`]. Returns only once the allocation is durable.
    pub async fn allocate(
        &self,
        owner: &Owner,
        pool: &str,
        family: Family,
        requested: Option<IpAddr>,
    ) -> Result<Allocation, StoreError> {
        let (result, generation) = self.change(|a| {
            let r = a.allocate(owner, pool, family, requested);
            let new = matches!(r, Ok((_, true)));
            (r, new)
        });
        let (allocation, new) = result?;
        self.settle(generation, new, &allocation).await?;
        Ok(allocation)
    }

    /// See [`Allocator::restore`]. Returns only once the reservation is durable.
    pub async fn restore(&self, owner: &Owner, pool: &str, address: IpAddr) -> Result<Allocation, StoreError> {
        let (result, generation) = self.change(|a| {
            let r = a.restore(owner, pool, address);
            let new = matches!(r, Ok((_, true)));
            (r, new)
        });
        let (allocation, new) = result?;
        self.settle(generation, new, &allocation).await?;
        Ok(allocation)
    }

    /// Releases everything `owner` holds; durable on return.
    pub async fn release_owner(&self, owner: &Owner) -> Result<Vec<Allocation>, StoreError> {
        let (released, generation) = self.change(|a| {
            let released = a.release_owner(owner);
            let changed = !released.is_empty();
            (released, changed)
        });
        self.commit(generation).await?;
        for a in &released {
            events::address_released(&self.metrics, a);
        }
        Ok(released)
    }

    /// Releases one address whoever holds it; durable on return.
    pub async fn release_address(
        &self,
        pool: Option<&str>,
        address: &IpAddr,
    ) -> Result<Option<Allocation>, StoreError> {
        let (result, generation) = self.change(|a| {
            let r = a.release_address(pool, address);
            let changed = matches!(r, Ok(Some(_)));
            (r, changed)
        });
        let released = result?;
        self.commit(generation).await?;
        if let Some(a) = &released {
            events::address_released(&self.metrics, a);
        }
        Ok(released)
    }

    /// Pools, usage and allocations as of now.
    pub fn list(&self) -> Listing {
        let inner = self.inner.lock().expect("ipam state lock poisoned");
        let a = &inner.allocator;
        Listing {
            pools: a.pools().clone(),
            usage: a.usage(),
            allocations: a.allocations().cloned().collect(),
            orphaned: a.orphaned().cloned().collect(),
        }
    }

    /// The pool configuration as of now.
    pub fn pools(&self) -> PoolSet {
        self.with_pools(PoolSet::clone)
    }

    /// `f` of the pool configuration as of now, without copying it (every
    /// answer looks up its address's range).
    pub fn with_pools<R>(&self, f: impl FnOnce(&PoolSet) -> R) -> R {
        f(self.inner.lock().expect("ipam state lock poisoned").allocator.pools())
    }

    /// The state file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Applies `f` (which says whether it changed anything) to the
    /// allocator; returns its result and the generation a caller must see
    /// persisted before answering: the current one even when nothing changed,
    /// since an idempotent answer may report a concurrent, not yet durable
    /// change.
    fn change<R>(&self, f: impl FnOnce(&mut Allocator) -> (R, bool)) -> (R, u64) {
        let mut inner = self.inner.lock().expect("ipam state lock poisoned");
        let (result, changed) = f(&mut inner.allocator);
        if changed {
            inner.generation += 1;
            self.metrics
                .set_usage(inner.allocator.pools(), &inner.allocator.usage());
        }
        (result, inner.generation)
    }

    /// Waits for `generation` to be durable; on failure undoes a new
    /// allocation so nothing unacknowledged is handed out later.
    async fn settle(&self, generation: u64, new: bool, allocation: &Allocation) -> Result<(), StoreError> {
        match self.commit(generation).await {
            Ok(()) => {
                if new {
                    events::address_allocated(&self.metrics, allocation);
                }
                Ok(())
            }
            Err(e) => {
                if new {
                    self.change(|a| {
                        let ours = a.held(&allocation.owner, &allocation.pool, allocation.family()) == Some(allocation);
                        if ours {
                            let _ = a.release_address(None, &allocation.address);
                        }
                        ((), ours)
                    });
                }
                Err(e)
            }
        }
    }

    /// Group commit: the first waiter writes everything changed so far;
    /// waiters whose change that write covered return without writing.
    async fn commit(&self, generation: u64) -> Result<(), StoreError> {
        if self.persisted.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        let _writer = self.writer.lock().await;
        if self.persisted.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        let (state, snapshot_generation) = {
            let inner = self.inner.lock().expect("ipam state lock poisoned");
            (inner.allocator.state(), inner.generation)
        };
        let file = self.file.clone();
        let count = state.allocations.len();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || file.store(&state))
            .await
            .map_err(|source| StoreError::Writer { source })?
            .map_err(StoreError::Persist)?;
        events::state_written(&self.metrics, count, started.elapsed());
        self.persisted.store(snapshot_generation, Ordering::Release);
        Ok(())
    }
}

/// Path of the state file in `dir`.
pub fn state_path(dir: &Path) -> PathBuf {
    dir.join("allocations.json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    fn pools() -> PoolSet {
        PoolSet::new(&["default=198.18.0.0/22,2001:2::/112".parse().unwrap()]).unwrap()
    }

    fn owner(c: &str) -> Owner {
        Owner {
            container_id: c.into(),
            interface: "eth0".into(),
        }
    }

    #[tokio::test]
    async fn allocations_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = IpamStore::open(dir.path(), pools(), IpamMetrics::default()).unwrap();
        let a = store.allocate(&owner("a"), "default", Family::V4, None).await.unwrap();
        let b = store.allocate(&owner("b"), "default", Family::V6, None).await.unwrap();
        store.allocate(&owner("c"), "default", Family::V4, None).await.unwrap();
        store.release_owner(&owner("c")).await.unwrap();
        drop(store);

        let store = IpamStore::open(dir.path(), pools(), IpamMetrics::default()).unwrap();
        let again = store.allocate(&owner("a"), "default", Family::V4, None).await.unwrap();
        assert_eq!(again, a, "an acknowledged allocation survives a restart");
        let listed: Vec<_> = store.list().allocations;
        assert_eq!(listed, vec![a, b], "a durable release stays released");
    }

    #[tokio::test]
    async fn concurrent_allocations_are_distinct_and_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(IpamStore::open(dir.path(), pools(), IpamMetrics::default()).unwrap());
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .allocate(&owner(&format!("c{i}")), "default", Family::V4, None)
                        .await
                        .unwrap()
                        .address
                })
            })
            .collect();
        let mut got = BTreeSet::new();
        for t in tasks {
            assert!(got.insert(t.await.unwrap()), "no address is handed out twice");
        }
        drop(store);
        let reopened = IpamStore::open(dir.path(), pools(), IpamMetrics::default()).unwrap();
        let on_disk: BTreeSet<_> = reopened.list().allocations.into_iter().map(|a| a.address).collect();
        assert_eq!(on_disk, got, "every acknowledged allocation is on disk");
    }

    #[tokio::test]
    async fn corrupt_state_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            state_path(dir.path()),
            b"{\"kind\":\"rivet-ipam-allocations\",\"schema_ver",
        )
        .unwrap();
        let err = IpamStore::open(dir.path(), pools(), IpamMetrics::default()).unwrap_err();
        assert!(
            matches!(err, StoreError::Load(StateFileError::Corrupt { .. })),
            "a torn state file must never be taken as empty: {err}"
        );
    }

    #[tokio::test]
    async fn failed_write_is_not_acknowledged_and_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let store = IpamStore::open(&state_dir, pools(), IpamMetrics::default()).unwrap();
        // A regular file where the state directory should be makes every write fail.
        std::fs::write(&state_dir, b"").unwrap();
        let err = store
            .allocate(&owner("a"), "default", Family::V4, None)
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Persist(_)), "{err}");
        assert!(
            store.list().allocations.is_empty(),
            "an allocation that is not durable must not stay allocated"
        );
    }

    fn spec(s: &str) -> PoolSpec {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn a_set_pool_is_durable_and_the_same_ranges_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = IpamStore::open(dir.path(), PoolSet::default(), IpamMetrics::default()).unwrap();
        let change = store
            .set_pool(&spec("default=198.18.0.0/24,2001:2::/112"))
            .await
            .unwrap();
        assert!(change.changed);
        let a = store.allocate(&owner("a"), "default", Family::V4, None).await.unwrap();
        let written = std::fs::metadata(state_path(dir.path())).unwrap().modified().unwrap();
        let file = std::fs::read(state_path(dir.path())).unwrap();
        let again = store
            .set_pool(&spec("default=2001:2::/112,198.18.0.0/24"))
            .await
            .unwrap();
        assert!(!again.changed, "the same ranges change nothing");
        assert_eq!(
            std::fs::read(state_path(dir.path())).unwrap(),
            file,
            "and write nothing"
        );
        assert_eq!(
            std::fs::metadata(state_path(dir.path())).unwrap().modified().unwrap(),
            written
        );
        drop(store);

        let store = IpamStore::open(dir.path(), PoolSet::default(), IpamMetrics::default()).unwrap();
        assert_eq!(
            store.pools().cidrs("default"),
            [
                "198.18.0.0/24".parse::<ipnet::IpNet>().unwrap(),
                "2001:2::/112".parse().unwrap()
            ],
            "a reopened store serves the pool set before"
        );
        assert_eq!(store.list().allocations, vec![a]);
    }

    #[tokio::test]
    async fn a_set_pool_that_cannot_be_made_durable_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let store = IpamStore::open(&state_dir, PoolSet::default(), IpamMetrics::default()).unwrap();
        store.set_pool(&spec("default=198.18.0.0/24")).await.unwrap();
        std::fs::remove_dir_all(&state_dir).unwrap();
        // A regular file where the state directory should be makes every write fail.
        std::fs::write(&state_dir, b"").unwrap();
        let err = store.set_pool(&spec("default=198.18.4.0/24")).await.unwrap_err();
        assert!(matches!(err, StoreError::Persist(_)), "{err}");
        assert_eq!(
            store.pools().cidrs("default"),
            ["198.18.0.0/24".parse::<ipnet::IpNet>().unwrap()],
            "a change that is not durable is not applied"
        );
    }

    #[tokio::test]
    async fn a_pool_change_starts_the_usage_gauges_over() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = IpamMetrics::default();
        let mut registry = prometheus_client::registry::Registry::with_prefix("rivet");
        metrics.register(&mut registry);
        let store = IpamStore::open(dir.path(), PoolSet::default(), metrics).unwrap();
        store
            .set_pool(&spec("default=198.18.0.0/24,2001:2::/120"))
            .await
            .unwrap();
        store.allocate(&owner("a"), "default", Family::V4, None).await.unwrap();
        store.set_pool(&spec("default=198.18.0.0/23")).await.unwrap();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"rivet_ipam_addresses_allocated{pool="default",family="ipv4"} 1"#)
                && text.contains(r#"rivet_ipam_addresses_available{pool="default",family="ipv4"} 508"#),
            "{text}"
        );
        assert!(
            !text.contains("ipv6"),
            "a family the pool lost has no gauge left: {text}"
        );
        assert!(
            text.contains(r#"rivet_ipam_pool_changes_total{pool="default",result="applied"} 2"#),
            "{text}"
        );
    }
}

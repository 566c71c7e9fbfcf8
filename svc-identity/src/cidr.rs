//! Node-local CIDR identities for policy ipBlocks: one identity per prefix
//! from a local range disjoint from the cluster range, never in the store,
//! each also claimed in the IP cache (source CIDR) so the datapath resolves
//! addresses inside the block to it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use ipnet::IpNet;
use rivet_common::identity::{CIDR_IDENTITY_MAX, CIDR_IDENTITY_MIN};

use crate::ipcache::{IpCache, IpcacheEntry, IpcacheError, IpcacheSource};

/// Why a CIDR operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CidrError {
    /// The local range is full.
    #[error("the node-local CIDR identity range {CIDR_IDENTITY_MIN}..={CIDR_IDENTITY_MAX} is exhausted")]
    Exhausted,
    /// The IP cache refused the claim.
    #[error("claiming CIDR identities in the IP cache: {0}")]
    Ipcache(#[from] IpcacheError),
}

#[derive(Debug, Default)]
struct Inner {
    by_prefix: BTreeMap<IpNet, (u32, BTreeSet<String>)>,
    used: BTreeSet<u32>,
}

/// The node's CIDR identities, referenced by owners (e.g. `policy/ns/name`).
#[derive(Debug)]
pub struct CidrIdentities {
    inner: Mutex<Inner>,
    ipcache: Arc<IpCache>,
}

impl CidrIdentities {
    /// CIDR identities claimed in `ipcache`.
    pub fn new(ipcache: Arc<IpCache>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            ipcache,
        }
    }

    /// The identity of each prefix (in order), allocating missing ones; one
    /// reference per (owner, prefix).
    pub async fn allocate(&self, prefixes: &[IpNet], owner: &str) -> Result<Vec<(IpNet, u32)>, CidrError> {
        let (out, fresh) = {
            let mut inner = self.inner.lock().expect("cidr state poisoned");
            let mut out = Vec::new();
            let mut fresh = Vec::new();
            for prefix in prefixes {
                let prefix = prefix.trunc();
                if let Some((id, owners)) = inner.by_prefix.get_mut(&prefix) {
                    owners.insert(owner.to_string());
                    out.push((prefix, *id));
                    continue;
                }
                let id = (CIDR_IDENTITY_MIN..=CIDR_IDENTITY_MAX)
                    .find(|id| !inner.used.contains(id))
                    .ok_or(CidrError::Exhausted)?;
                inner.used.insert(id);
                inner
                    .by_prefix
                    .insert(prefix, (id, BTreeSet::from([owner.to_string()])));
                out.push((prefix, id));
                fresh.push(IpcacheEntry::new(prefix, id, IpcacheSource::Cidr));
            }
            (out, fresh)
        };
        if !fresh.is_empty() {
            self.ipcache.upsert(fresh).await?;
        }
        Ok(out)
    }

    /// Drops `owner`'s references on `prefixes` (all of its prefixes when
    /// empty); returns the identities whose last reference went.
    pub async fn release(&self, prefixes: &[IpNet], owner: &str) -> Result<Vec<(IpNet, u32)>, CidrError> {
        let removed = {
            let mut inner = self.inner.lock().expect("cidr state poisoned");
            let targets: Vec<IpNet> = if prefixes.is_empty() {
                inner
                    .by_prefix
                    .iter()
                    .filter(|(_, (_, owners))| owners.contains(owner))
                    .map(|(p, _)| *p)
                    .collect()
            } else {
                prefixes.iter().map(IpNet::trunc).collect()
            };
            let mut removed = Vec::new();
            for prefix in targets {
                let Some((id, owners)) = inner.by_prefix.get_mut(&prefix) else {
                    continue;
                };
                let id = *id;
                if owners.remove(owner) && owners.is_empty() {
                    inner.by_prefix.remove(&prefix);
                    inner.used.remove(&id);
                    removed.push((prefix, id));
                }
            }
            removed
        };
        if !removed.is_empty() {
            let gone: Vec<IpNet> = removed.iter().map(|(p, _)| *p).collect();
            self.ipcache.delete(IpcacheSource::Cidr, &gone).await?;
        }
        Ok(removed)
    }

    /// The prefix of a CIDR identity.
    pub fn get(&self, id: u32) -> Option<IpNet> {
        let inner = self.inner.lock().expect("cidr state poisoned");
        inner.by_prefix.iter().find(|(_, (i, _))| *i == id).map(|(p, _)| *p)
    }

    /// Every CIDR identity: prefix, id and how many owners hold it.
    pub fn list(&self) -> Vec<(IpNet, u32, usize)> {
        let inner = self.inner.lock().expect("cidr state poisoned");
        inner
            .by_prefix
            .iter()
            .map(|(prefix, (id, owners))| (*prefix, *id, owners.len()))
            .collect()
    }

    /// How many CIDR identities exist.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("cidr state poisoned").by_prefix.len()
    }

    /// Whether none exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded_backend::EmbeddedBackend;
    use crate::ipcache::IpCacheOptions;

    #[tokio::test]
    async fn prefixes_get_local_identities_claimed_in_the_ipcache_and_released_by_owner() {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("s.json"), "n1").unwrap());
        let ipcache = IpCache::new(backend, IpCacheOptions::new("n1"));
        let controllers = rivet_common::controller::Controllers::new();
        ipcache.run(&controllers);
        ipcache.wait_ready().await;
        let cidrs = CidrIdentities::new(ipcache.clone());
        let block: IpNet = "198.18.64.0/18".parse().unwrap();
        let v6: IpNet = "2001:2:0:8000::/49".parse().unwrap();
        let got = cidrs.allocate(&[block, v6], "policy/a").await.unwrap();
        assert!(
            got.iter()
                .all(|(_, id)| (CIDR_IDENTITY_MIN..=CIDR_IDENTITY_MAX).contains(id)),
            "a local range: {got:?}"
        );
        assert_ne!(got[0].1, got[1].1);
        let again = cidrs.allocate(&[block], "policy/b").await.unwrap();
        assert_eq!(again[0].1, got[0].1, "one identity per prefix");
        assert_eq!(
            ipcache.get(&block).map(|e| e.identity),
            Some(got[0].1),
            "the prefix is in the IP cache"
        );
        assert!(
            cidrs.release(&[], "policy/a").await.unwrap() == vec![got[1]],
            "v6 had only policy/a"
        );
        assert_eq!(ipcache.get(&v6).map(|e| e.source), None, "its IP cache claim is gone");
        assert!(ipcache.get(&block).is_some(), "policy/b still holds the v4 block");
        assert_eq!(cidrs.release(&[block], "policy/b").await.unwrap(), vec![got[0]]);
        assert!(cidrs.is_empty());
    }
}

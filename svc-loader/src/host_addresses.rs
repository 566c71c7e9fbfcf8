//! The node's own addresses in the ipcache as the host identity, so pods'
//! policy can tell traffic from the node (kubelet probes) from the world.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers};

use crate::loader::EndpointDatapath;
use rivet_datapath::maps::{IDENTITY_HOST, IpcacheValue};

/// The unicast addresses of the loader's network namespace (not link-local).
pub fn node_addresses() -> std::io::Result<BTreeSet<IpAddr>> {
    let mut out = BTreeSet::new();
    for ifaddr in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
        let Some(addr) = ifaddr.address else { continue };
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            let ip = v6.ip();
            if ip.is_unicast_link_local() {
                continue;
            }
            IpAddr::V6(ip)
        } else {
            continue;
        };
        out.insert(ip);
    }
    Ok(out)
}

/// Why the host addresses could not be synced.
#[derive(Debug, thiserror::Error)]
pub enum HostAddressError {
    /// The namespace's addresses could not be listed.
    #[error("listing the node's addresses: {0}")]
    List(#[source] std::io::Error),
    /// The ipcache refused the change.
    #[error("syncing host addresses to the ipcache: {0}")]
    Ipcache(#[source] crate::loader::LoaderError),
}

/// Keeps the ipcache's host entries equal to the node's addresses, checking
/// every `interval` (controller `host-addresses` under `controllers`; a
/// failed check is retried after `interval`).
pub fn sync(datapath: Arc<EndpointDatapath>, interval: Duration, controllers: &Controllers) {
    let published = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let controller = Controller::new("host-addresses").backoff(Backoff::new(interval, interval).with_jitter(0.0));
    controllers.reconcile(controller, move || {
        let (datapath, published) = (datapath.clone(), published.clone());
        async move {
            let mut published = published.lock().unwrap_or_else(|e| e.into_inner());
            sync_once(&datapath, &mut published)?;
            Ok::<_, HostAddressError>(Action::requeue(interval))
        }
    });
}

/// One check: adds the addresses not in `published` yet, removes those
/// gone, and records what the ipcache holds now.
fn sync_once(datapath: &EndpointDatapath, published: &mut BTreeSet<IpAddr>) -> Result<(), HostAddressError> {
    let now = node_addresses().map_err(HostAddressError::List)?;
    let added: Vec<_> = now
        .difference(published)
        .map(|a| (*a, full_len(a), IpcacheValue::new(IDENTITY_HOST, None)))
        .collect();
    let removed: Vec<_> = published.difference(&now).map(|a| (*a, full_len(a))).collect();
    datapath
        .upsert_ipcache(&added)
        .and_then(|_| datapath.delete_ipcache(&removed))
        .map_err(HostAddressError::Ipcache)?;
    if !added.is_empty() || !removed.is_empty() {
        tracing::info!(
            added = added.len(),
            removed = removed.len(),
            "host addresses synced to the ipcache"
        );
    }
    *published = now;
    Ok(())
}

fn full_len(a: &IpAddr) -> u8 {
    if a.is_ipv4() { 32 } else { 128 }
}

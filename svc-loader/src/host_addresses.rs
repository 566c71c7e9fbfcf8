//! The node's own addresses in the ipcache as the host identity, so pods'
//! policy can tell traffic from the node (kubelet probes) from the world.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

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

/// Keeps the ipcache's host entries equal to the node's addresses, checking
/// every `interval`.
pub async fn sync(datapath: Arc<EndpointDatapath>, interval: Duration) {
    let mut published: BTreeSet<IpAddr> = BTreeSet::new();
    loop {
        match node_addresses() {
            Ok(now) => {
                let added: Vec<_> = now
                    .difference(&published)
                    .map(|a| (*a, full_len(a), IpcacheValue::new(IDENTITY_HOST, None)))
                    .collect();
                let removed: Vec<_> = published.difference(&now).map(|a| (*a, full_len(a))).collect();
                let result = datapath
                    .upsert_ipcache(&added)
                    .and_then(|_| datapath.delete_ipcache(&removed));
                match result {
                    Ok(_) => {
                        if !added.is_empty() || !removed.is_empty() {
                            tracing::info!(
                                added = added.len(),
                                removed = removed.len(),
                                "host addresses synced to the ipcache"
                            );
                        }
                        published = now;
                    }
                    Err(e) => tracing::warn!(error = %e, "syncing host addresses to the ipcache"),
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing the node's addresses"),
        }
        tokio::time::sleep(interval).await;
    }
}

fn full_len(a: &IpAddr) -> u8 {
    if a.is_ipv4() { 32 } else { 128 }
}

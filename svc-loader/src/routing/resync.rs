//! Level-triggered resync of the peers' routes: the kernel deletes a route
//! with its device (the underlay set down, `rivet_vxlan` set down), and
//! anyone may `ip route del` one of ours, while the peer set does not
//! change. Two controllers keep them in place:
//!
//! - `route-events` (supervised): an rtnetlink socket subscribed to link and
//!   route changes of both families in the loader's namespace; every
//!   notification fires the trigger of
//! - `peer-routes` (reconcile): one [`NodeRouting::resync`] per wake-up
//!   (a burst of notifications coalesces into one pass) and at least every
//!   resync interval (the backstop for a missed or overflowed notification).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers, Progress, Trigger};
use tokio::io::unix::AsyncFd;

use super::{NodeRouting, RoutingError};
use crate::events::{self, LoaderMetrics};

/// Default of `--route-resync-seconds`.
pub const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(30);

/// The rtnetlink groups that can take a route of ours away.
const GROUPS: u32 = (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE) as u32;

/// Starts both controllers under `controllers`: routes are realised again
/// on every link or route change and every `interval`. Does nothing in
/// routing mode none (no routes).
pub fn start(routing: Arc<NodeRouting>, interval: Duration, metrics: LoaderMetrics, controllers: &Controllers) {
    if routing.setup().mode == super::RoutingMode::None {
        return;
    }
    let trigger = Trigger::new();
    let events_trigger = trigger.clone();
    controllers.supervise(Controller::new("route-events"), move |progress| {
        watch(events_trigger.clone(), progress)
    });
    let mode = routing.setup().mode.as_str();
    let controller = Controller::new("peer-routes")
        .trigger(&trigger)
        .backoff(Backoff::new(Duration::from_millis(200), interval));
    controllers.reconcile(controller, move || {
        let (routing, metrics) = (routing.clone(), metrics.clone());
        async move {
            let outcome = tokio::task::spawn_blocking(move || routing.resync())
                .await
                .map_err(|e| ResyncError::Task(e.to_string()))?;
            match outcome {
                Ok(Some(changes)) => events::peer_routes_resynced(&metrics, mode, &changes),
                Ok(None) => {}
                Err(e) => {
                    events::peer_routes_resync_failed(&metrics, mode, &e);
                    return Err(ResyncError::Routing(e));
                }
            }
            Ok::<_, ResyncError>(Action::requeue(interval))
        }
    });
}

/// Fires `trigger` on every rtnetlink notification until reading fails.
async fn watch(trigger: Trigger, progress: Progress) -> Result<(), WatchError> {
    let socket = subscribe().map_err(WatchError::Subscribe)?;
    progress.ok();
    // Changes may have been missed while no socket listened.
    trigger.trigger();
    loop {
        let mut ready = socket.readable().await.map_err(WatchError::Receive)?;
        match ready.try_io(|s| s.get_ref().recv_from_full()) {
            Ok(Ok(_)) => trigger.trigger(),
            // Notifications were lost: a pass finds what they said.
            Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOBUFS) => trigger.trigger(),
            Ok(Err(e)) => return Err(WatchError::Receive(e)),
            Err(_would_block) => {}
        }
    }
}

/// An rtnetlink socket in the calling thread's namespace (the loader's),
/// subscribed to [`GROUPS`], non-blocking.
fn subscribe() -> io::Result<AsyncFd<Socket>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind(&SocketAddr::new(0, GROUPS))?;
    socket.set_non_blocking(true)?;
    // SAFETY: the fd belongs to the Socket moved into the AsyncFd; it stays
    // open and unchanged until the AsyncFd (and the Socket) drop.
    unsafe { AsyncFd::register(socket) }.map_err(io::Error::other)
}

/// Why the rtnetlink watch stopped (it is restarted).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// Opening or subscribing the socket failed.
    #[error("subscribing to rtnetlink link and route changes: {0}")]
    Subscribe(#[source] io::Error),
    /// Reading a notification failed.
    #[error("reading rtnetlink link and route changes: {0}")]
    Receive(#[source] io::Error),
}

/// Why a resync pass failed (retried after the backoff or the next change).
#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    /// Realising the routes failed.
    #[error("resyncing the routes to peer nodes: {0}")]
    Routing(#[source] RoutingError),
    /// The blocking task died.
    #[error("resyncing the routes to peer nodes: the task failed: {0}")]
    Task(String),
}

//! Datapath events: one controller (`events-ring`) drains the ring buffer
//! and fans events out to every `MonitorEvents` subscriber; verdict and
//! trace events are switched on in the datapath only while someone asks for
//! them.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use aya::maps::{MapData, RingBuf};
use rivet_common::controller::{Controller, Controllers, Progress};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Mutex, broadcast};

use crate::loader::EndpointDatapath;
use rivet_datapath::maps::{CONFIG_EVENT_TRACE, CONFIG_EVENT_VERDICTS, Event};

/// How many events a slow subscriber may lag behind before it loses some.
pub const SUBSCRIBER_BACKLOG: usize = 8192;

/// The fan-out point of datapath events.
#[derive(Debug)]
pub struct EventHub {
    tx: broadcast::Sender<Event>,
    verdict_subscribers: AtomicUsize,
    trace_subscribers: AtomicUsize,
    datapath: Arc<EndpointDatapath>,
}

/// A subscription; dropping it switches optional events off again when it
/// was the last one asking for them.
#[derive(Debug)]
pub struct Subscription {
    /// The events.
    pub rx: broadcast::Receiver<Event>,
    hub: Arc<EventHub>,
    verdicts: bool,
    trace: bool,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if self.verdicts {
            self.hub.verdict_subscribers.fetch_sub(1, Ordering::SeqCst);
        }
        if self.trace {
            self.hub.trace_subscribers.fetch_sub(1, Ordering::SeqCst);
        }
        self.hub.update_flags();
    }
}

impl EventHub {
    /// Starts draining `ring` into a new hub (controller `events-ring`
    /// under `controllers`: a drain that fails or panics starts again).
    pub fn start(
        ring: RingBuf<MapData>,
        datapath: Arc<EndpointDatapath>,
        controllers: &Controllers,
    ) -> std::io::Result<Arc<Self>> {
        let (tx, _) = broadcast::channel(SUBSCRIBER_BACKLOG);
        let hub = Arc::new(Self {
            tx: tx.clone(),
            verdict_subscribers: AtomicUsize::new(0),
            trace_subscribers: AtomicUsize::new(0),
            datapath,
        });
        // SAFETY: the fd belongs to the RingBuf moved into the AsyncFd; it
        // stays open and unchanged until the AsyncFd (and the RingBuf) drop.
        let fd = unsafe { AsyncFd::register(RingFd(ring)) }.map_err(std::io::Error::other)?;
        // Shared by the drains: a restarted one takes it over.
        let fd = Arc::new(Mutex::new(fd));
        controllers.supervise(Controller::new("events-ring"), move |progress| {
            drain(fd.clone(), tx.clone(), progress)
        });
        Ok(hub)
    }

    /// Subscribes; `verdicts` / `trace` switch those events on.
    pub fn subscribe(self: &Arc<Self>, verdicts: bool, trace: bool) -> Subscription {
        if verdicts {
            self.verdict_subscribers.fetch_add(1, Ordering::SeqCst);
        }
        if trace {
            self.trace_subscribers.fetch_add(1, Ordering::SeqCst);
        }
        self.update_flags();
        Subscription {
            rx: self.tx.subscribe(),
            hub: self.clone(),
            verdicts,
            trace,
        }
    }

    fn update_flags(&self) {
        let mut flags = 0;
        if self.verdict_subscribers.load(Ordering::SeqCst) > 0 {
            flags |= CONFIG_EVENT_VERDICTS;
        }
        if self.trace_subscribers.load(Ordering::SeqCst) > 0 {
            flags |= CONFIG_EVENT_TRACE;
        }
        if let Err(e) = self.datapath.datapath().set_event_flags(flags) {
            tracing::warn!(error = %e, "could not switch datapath event flags");
        }
    }
}

struct RingFd(RingBuf<MapData>);

/// Sends every event of the ring to `tx` as it becomes readable, until
/// the ring cannot be read.
async fn drain(
    fd: Arc<Mutex<AsyncFd<RingFd>>>,
    tx: broadcast::Sender<Event>,
    progress: Progress,
) -> Result<(), std::io::Error> {
    let mut fd = fd.lock().await;
    progress.ok();
    loop {
        let mut guard = fd
            .readable_mut()
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("waiting for the event ring buffer: {e}")))?;
        let ring = &mut guard.get_inner_mut().0;
        while let Some(item) = ring.next() {
            if let Some(event) = Event::from_bytes(&item) {
                // No subscriber is fine: events are then dropped here.
                let _ = tx.send(event);
            }
        }
        guard.clear_ready();
    }
}

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

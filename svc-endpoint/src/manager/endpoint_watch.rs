//! WatchEndpoints: every endpoint as it is, then its changes, for readers
//! such as svc-k8s-sync (which writes RivetEndpoint objects from them).
//!
//! The manager never waits for a reader: a change only bumps the
//! [`ChangeFeed`](super::ChangeFeed) revision and the endpoint's
//! [`Slot::changed`](super::Slot). Each reader wakes on the latest
//! revision, walks the table under the lock and sends the endpoints whose
//! revision moved since it last sent them; a slow reader thus skips
//! intermediate states but always gets the latest one. An endpoint gone
//! from the table is sent as `Removed` with the last state the reader
//! sent, marked disconnected; an id reused by a new endpoint (another
//! creation time) is a removal of the old one and an upsert of the new.

use std::collections::BTreeMap;
use std::time::SystemTime;

use futures::Stream;
use futures::StreamExt;
use tokio::sync::watch;

use super::{EndpointManager, EndpointView};
use crate::endpoint::EndpointState;

/// One event of [`EndpointManager::watch`].
#[derive(Debug, Clone)]
pub enum EndpointEvent {
    /// The endpoint as it is now (new, or changed since last sent).
    Upserted(EndpointView),
    /// The endpoint is gone; its last state as the reader saw it, in state
    /// `disconnected`.
    Removed(EndpointView),
    /// The initial snapshot is complete and restore finished: an endpoint
    /// not sent so far does not exist. Sent once.
    Synced,
}

/// What one reader sent of an endpoint.
struct Sent {
    created: SystemTime,
    changed: u64,
    view: EndpointView,
}

/// One reader's position.
struct Reader {
    manager: EndpointManager,
    changes: watch::Receiver<u64>,
    restored: watch::Receiver<bool>,
    sent: BTreeMap<u16, Sent>,
    synced: bool,
    first: bool,
}

impl Reader {
    /// The next non-empty batch of events; `None` once the manager is gone.
    async fn next_batch(&mut self) -> Option<Vec<EndpointEvent>> {
        loop {
            if !self.first {
                tokio::select! {
                    changed = self.changes.changed() => changed.ok()?,
                    done = self.restored.wait_for(|done| *done), if !self.synced => {
                        done.ok()?;
                    }
                }
            }
            self.first = false;
            let mut batch = self.diff();
            if !self.synced && *self.restored.borrow() {
                // After the diff: the table is complete once restore is.
                batch.extend(self.diff());
                batch.push(EndpointEvent::Synced);
                self.synced = true;
            }
            if !batch.is_empty() {
                return Some(batch);
            }
        }
    }

    /// The events that bring this reader's view up to the table.
    fn diff(&mut self) -> Vec<EndpointEvent> {
        let mut events = Vec::new();
        let state = self.manager.state();
        // Seen before reading: a change after this wakes the reader again.
        self.changes.borrow_and_update();
        for (id, slot) in &state.endpoints {
            if let Some(sent) = self.sent.get(id) {
                if sent.created == slot.spec.created {
                    if sent.changed == slot.changed {
                        continue;
                    }
                } else if let Some(old) = self.sent.remove(id) {
                    events.push(removed(old.view));
                }
            }
            let view = EndpointView {
                spec: slot.spec.clone(),
                status: slot.status.clone(),
            };
            events.push(EndpointEvent::Upserted(view.clone()));
            self.sent.insert(
                *id,
                Sent {
                    created: slot.spec.created,
                    changed: slot.changed,
                    view,
                },
            );
        }
        let gone: Vec<u16> = self
            .sent
            .keys()
            .filter(|id| !state.endpoints.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(old) = self.sent.remove(&id) {
                events.push(removed(old.view));
            }
        }
        events
    }
}

/// The last view of a removed endpoint, disconnected.
fn removed(mut view: EndpointView) -> EndpointEvent {
    view.status
        .transition(view.spec.id, EndpointState::Disconnected, "removed");
    EndpointEvent::Removed(view)
}

impl EndpointManager {
    /// Every endpoint (one [`EndpointEvent::Upserted`] each), then
    /// [`EndpointEvent::Synced`] once restore finished, then each change as
    /// it happens. Changes a slow reader did not take yet are coalesced
    /// into the latest state; the manager never waits for a reader.
    pub fn watch(&self) -> impl Stream<Item = EndpointEvent> + Send + 'static {
        let reader = Reader {
            manager: self.clone(),
            changes: self.state().changes.published.subscribe(),
            restored: self.inner.restore_done.subscribe(),
            sent: BTreeMap::new(),
            synced: false,
            first: true,
        };
        futures::stream::unfold(reader, |mut reader| async move {
            let batch = reader.next_batch().await?;
            Some((futures::stream::iter(batch), reader))
        })
        .flatten()
    }
}

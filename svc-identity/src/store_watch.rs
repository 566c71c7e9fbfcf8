//! List a store prefix, then watch it from the listing's revision: the loop
//! of every follower of the store (the IP cache's entries of other nodes,
//! the node registry's records), run by a supervising controller that
//! re-lists with backoff after an error (a lost watch, a compaction).

use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use rivet_common::controller::Progress;
use tokio::time::Instant;

use crate::backend::{BackendError, Revision};

/// A watch that ran this long before failing worked: the re-listing after
/// it starts with the shortest delay.
const WATCH_WORKED_AFTER: Duration = Duration::from_secs(10);

/// Awaits `listing`, hands it to `on_listing`, then watches from its
/// revision (`watch`) and hands every event to `on_event` until the stream
/// ends (`Ok`) or fails (the error). Listing counts as healthy for status,
/// but only a watch that worked for a while (or delivered an event) resets
/// the controller's backoff: a watch refused at once must not re-list in a
/// tight loop.
pub(crate) async fn list_then_watch<L, E, Watch, WatchFut>(
    progress: &Progress,
    listing: impl Future<Output = Result<(L, Revision), BackendError>>,
    watch: Watch,
    mut on_listing: impl FnMut(L, Revision),
    mut on_event: impl FnMut(E),
) -> Result<(), BackendError>
where
    Watch: FnOnce(Revision) -> WatchFut,
    WatchFut: Future<Output = Result<BoxStream<'static, Result<E, BackendError>>, BackendError>>,
{
    let (listed, revision) = listing.await?;
    on_listing(listed, revision);
    progress.healthy();
    let mut stream = watch(revision).await?;
    let started = Instant::now();
    let mut result = Ok(());
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                on_event(event);
                progress.ok();
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if started.elapsed() > WATCH_WORKED_AFTER {
        progress.ok();
    }
    result
}

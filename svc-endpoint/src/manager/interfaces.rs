//! Endpoints whose host interface is gone or replaced (a pod that went
//! without a DEL) are dropped.

use rivet_common::controller::Action;
use rivet_proto::loader::v1 as ldpb;
use tonic::{Code, Status};

use super::queue::RemovalReason;
use super::{EndpointManager, State};
use crate::endpoint::{EndpointSpec, EndpointState};

/// Why a pass of `interface-check` failed (it runs again after a backoff).
#[derive(Debug, thiserror::Error)]
pub(super) enum InterfaceCheckError {
    /// svc-loader did not list the endpoints' interfaces.
    #[error("listing the endpoints' interfaces with svc-loader: {}", .0.message())]
    ListInterfaces(#[source] Status),
    /// An older svc-loader did not list its endpoints.
    #[error("listing svc-loader's endpoints: {}", .0.message())]
    List(#[source] Status),
}

impl State {
    /// The endpoints whose host interface svc-loader says is lost (gone, or
    /// its ifindex names another interface), with the reason.
    pub(super) fn lost_interfaces(&self, held: &[ldpb::EndpointInterface]) -> Vec<(u16, RemovalReason)> {
        held.iter()
            .filter_map(|held| {
                let id = u16::try_from(held.endpoint_id).ok()?;
                let slot = self.endpoints.get(&id)?;
                if slot.spec.host_ifindex != held.host_ifindex || slot.queue.is_closed() {
                    return None;
                }
                interface_lost(held, &slot.spec).map(|reason| (id, reason))
            })
            .collect()
    }

    /// The ready endpoints whose host interface the listing of an older
    /// svc-loader does not name (it may be gone; its ListEndpoints does not
    /// say for certain).
    fn unnamed_interfaces(&self, listed: &ldpb::ListEndpointsResponse) -> Vec<u16> {
        listed
            .endpoints
            .iter()
            .filter(|held| held.host_ifname.is_empty())
            .filter_map(|held| {
                let id = u16::try_from(held.endpoint_id).ok()?;
                let slot = self.endpoints.get(&id)?;
                (slot.spec.host_ifindex == held.host_ifindex && slot.status.state == EndpointState::Ready).then_some(id)
            })
            .collect()
    }
}

impl EndpointManager {
    /// Removes an endpoint whose pod is gone without a DEL (its interface
    /// is gone) and releases its addresses; its worker does it.
    pub(super) fn drop_endpoint(&self, id: u16, reason: RemovalReason) {
        self.request_removal(id, reason);
    }

    /// `interface-check`, every `interface_check` once restore is done:
    /// endpoints whose host interface disappeared while they ran (the pod's
    /// netns went without a DEL, e.g. a runtime leaking a sandbox) are
    /// dropped and their addresses released, as at restore. svc-loader
    /// answers from one link dump (ListEndpointInterfaces), not
    /// per-interface tc queries.
    pub(super) async fn check_interfaces(&self) -> Result<Action, InterfaceCheckError> {
        self.restored().await;
        let loader = &self.inner.deps.loader;
        let (held, unnamed) = match loader.interfaces().await {
            Ok(listed) => (listed.endpoints, Vec::new()),
            // An svc-loader older than this daemon: its full listing.
            Err(e) if e.code() == Code::Unimplemented => {
                let listed = loader.list().await.map_err(InterfaceCheckError::List)?;
                (
                    listed.endpoints.iter().map(listed_interface).collect(),
                    self.state().unnamed_interfaces(&listed),
                )
            }
            Err(e) => return Err(InterfaceCheckError::ListInterfaces(e)),
        };
        let lost = self.state().lost_interfaces(&held);
        for (id, reason) in lost {
            self.drop_endpoint(id, reason);
        }
        // An older svc-loader could not name the interface: a
        // regeneration asks it for certain (ApplyEndpoint answers
        // INTERFACE_NOT_FOUND for a gone interface, and the worker drops
        // the endpoint then).
        let state = self.state();
        for id in unnamed {
            if let Some(slot) = state.endpoints.get(&id) {
                slot.queue.request("interface check");
            }
        }
        Ok(Action::requeue(self.inner.options.interface_check))
    }
}

/// Why svc-loader's view of an endpoint says its pod is gone: the host
/// interface is gone, or its ifindex names another interface now.
fn interface_lost(held: &ldpb::EndpointInterface, spec: &EndpointSpec) -> Option<RemovalReason> {
    if held.gone {
        return Some(RemovalReason::InterfaceGone);
    }
    let renamed = !held.host_ifname.is_empty() && held.host_ifname != spec.host_interface;
    renamed.then_some(RemovalReason::InterfaceReplaced)
}

/// An endpoint of svc-loader's full listing as its interface listing
/// would say it: gone when a hook says so.
pub(super) fn listed_interface(held: &ldpb::Endpoint) -> ldpb::EndpointInterface {
    ldpb::EndpointInterface {
        endpoint_id: held.endpoint_id,
        host_ifindex: held.host_ifindex,
        host_ifname: held.host_ifname.clone(),
        gone: held.from_container == ldpb::AttachState::InterfaceGone as i32
            || held.to_container == ldpb::AttachState::InterfaceGone as i32,
    }
}

//! What a stopping loader leaves on the node (README "Uninstall").
//!
//! A loader that stops (SIGTERM) on a node where no pod uses the datapath
//! any more — no endpoint with a live interface, no interface with our
//! endpoint filters ([`EndpointDatapath::pod_interfaces`]): the node is
//! drained, or Rivet's DaemonSet is being deleted after the drain — removes
//! what it owns: every tc filter of this node (NodePort, overlay and any
//! endpoint filter), the routes of protocol 77 to peer nodes, the tunnel
//! device, the socket load balancer's links and the pin directory. A node
//! that still has a pod keeps everything, so a restart (a rolling update,
//! a container killed) never disturbs traffic (DESIGN.md §1); a drained
//! node's next loader creates it all again. A SIGKILLed loader removes
//! nothing.

use std::path::PathBuf;

use crate::datapath::DatapathError;
use crate::loader::{EndpointDatapath, LoaderError};
use crate::routing::{self, NodeRouting, RoutingError};

/// What [`at_shutdown`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shutdown {
    /// Pods still use the datapath: nothing was removed.
    Kept {
        /// Their host interfaces.
        pod_interfaces: Vec<String>,
    },
    /// No pod used it: the node's datapath is gone.
    Removed(Removed),
}

/// What an uninstall removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// tc filters, `(ifindex, name)`.
    pub filters: Vec<(u32, String)>,
    /// Routes to peer nodes.
    pub routes: u32,
    /// Whether the tunnel device was deleted.
    pub tunnel_device: bool,
    /// Socket load balancer links.
    pub socket_lb_links: usize,
    /// The pin directory, if there was one.
    pub pin_dir: Option<PathBuf>,
}

/// Why the uninstall stopped; what was removed before stays removed, and
/// the next loader's start (or `rivet node down`) finishes the job.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// Listing the pods' interfaces failed (nothing was removed).
    #[error("checking for pods before removing the datapath: {0}")]
    Pods(#[source] LoaderError),
    /// A datapath step failed.
    #[error("removing the datapath: {0}")]
    Datapath(#[from] DatapathError),
    /// Deleting the routes to peers failed.
    #[error("removing the routes to peer nodes: {0}")]
    Routes(#[from] RoutingError),
    /// Deleting the tunnel device failed.
    #[error("removing the tunnel device rivet_vxlan: {0}")]
    Tunnel(#[source] std::io::Error),
}

/// Removes the node's datapath if no pod uses it (module docs). Call it
/// after the gRPC server stopped: nothing can add an endpoint meanwhile.
pub fn at_shutdown(endpoints: &EndpointDatapath, routing: &NodeRouting) -> Result<Shutdown, UninstallError> {
    let pod_interfaces = endpoints.pod_interfaces().map_err(UninstallError::Pods)?;
    if !pod_interfaces.is_empty() {
        return Ok(Shutdown::Kept { pod_interfaces });
    }
    let datapath = endpoints.datapath();
    let mut removed = Removed {
        filters: datapath.remove_all_filters()?,
        ..Removed::default()
    };
    if routing.setup().underlay.is_some() {
        removed.routes = routing.remove_all()?.removed;
    }
    removed.tunnel_device = routing::netlink::delete_link(routing::TUNNEL_INTERFACE).map_err(UninstallError::Tunnel)?;
    removed.socket_lb_links = datapath.disable_socket_lb()?;
    if datapath.remove_pins()? {
        removed.pin_dir = Some(datapath.pin_dir().to_path_buf());
    }
    Ok(Shutdown::Removed(removed))
}

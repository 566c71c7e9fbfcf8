//! [`IpamApi`] and [`EndpointApi`] over the daemons' Unix sockets. A channel
//! connects on first use (retrying for a short window, so a daemon that is
//! restarting is waited for), and every call carries its deadline both as
//! the gRPC timeout the server sees and as a bound on the client side. Calls
//! go through [`DaemonChannel`], which injects the current span's trace
//! context, so the daemons' spans join the invocation's trace.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use rivet_common::backoff::Backoff;
use rivet_common::grpc::{ClientOptions, ConnectError, DaemonChannel, connect_unix_counted};
use rivet_proto::daemon::v1::GetInfoRequest;
use rivet_proto::daemon::v1::daemon_client::DaemonClient;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use tokio::sync::OnceCell;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::api::{EndpointApi, EndpointError, EndpointResult, IpamApi, IpamResult};

/// How long the first connection to a daemon is retried (bounded by the
/// call's deadline): long enough for a daemon restart, short enough that
/// STATUS answers promptly when a daemon is down.
pub const CONNECT_WINDOW: Duration = Duration::from_secs(2);

/// A channel to one daemon socket, connected on first use.
#[derive(Debug)]
struct LazyChannel {
    daemon: &'static str,
    socket: PathBuf,
    /// Default per-call timeout of the channel (calls set their own).
    request_timeout: Duration,
    channel: OnceCell<DaemonChannel>,
}

impl LazyChannel {
    fn new(daemon: &'static str, socket: &Path, request_timeout: Duration) -> Self {
        Self {
            daemon,
            socket: socket.to_path_buf(),
            request_timeout,
            channel: OnceCell::new(),
        }
    }

    async fn get(&self, timeout: Duration) -> Result<DaemonChannel, Status> {
        self.channel
            .get_or_try_init(|| {
                // The wait for a daemon that is (re)starting is part of the
                // pod's trace: hundreds of ms right after a restart.
                let span = tracing::info_span!(
                    "cni.connect",
                    daemon = self.daemon,
                    socket = %self.socket.display(),
                    attempts = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                );
                self.connect(timeout).instrument(span)
            })
            .await
            .cloned()
    }

    /// Connects, retrying within [`CONNECT_WINDOW`] (and `timeout`); records
    /// the attempts on the current (`cni.connect`) span.
    async fn connect(&self, timeout: Duration) -> Result<DaemonChannel, Status> {
        let window = CONNECT_WINDOW.min(timeout);
        let options = ClientOptions {
            connect_timeout: window,
            request_timeout: self.request_timeout,
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(250)),
        };
        let span = tracing::Span::current();
        let result = match tokio::time::timeout(
            window + Duration::from_millis(100),
            connect_unix_counted(&self.socket, &options),
        )
        .await
        {
            Ok(Ok(connected)) => {
                span.record("attempts", connected.attempts);
                Ok(connected.channel)
            }
            Ok(Err(e)) => {
                if let ConnectError::Unreachable { attempts, .. } = &e {
                    span.record("attempts", attempts);
                }
                Err(Status::unavailable(format!("{}: {e}", self.daemon)))
            }
            Err(_) => Err(Status::unavailable(format!(
                "{}: connecting to {} did not finish within {window:?}",
                self.daemon,
                self.socket.display()
            ))),
        };
        if result.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        result
    }
}

/// A request with `timeout` as its gRPC deadline.
fn request<T>(message: T, timeout: Duration) -> Request<T> {
    let mut request = Request::new(message);
    request.set_timeout(timeout);
    request
}

/// Runs a call bounded by `timeout` (connection included).
async fn bounded<T, F>(daemon: &str, method: &str, timeout: Duration, call: F) -> Result<T, Status>
where
    F: Future<Output = Result<Response<T>, Status>>,
{
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map(Response::into_inner),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "{daemon} {method} did not answer within {timeout:?}"
        ))),
    }
}

fn left(started: Instant, timeout: Duration) -> Duration {
    timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1))
}

/// svc-ipam at `<socketDir>/svc-ipam.sock`.
#[derive(Debug)]
pub struct GrpcIpam(LazyChannel);

impl GrpcIpam {
    /// A client of the socket; nothing connects until the first call.
    pub fn new(socket: &Path, request_timeout: Duration) -> Self {
        Self(LazyChannel::new("svc-ipam", socket, request_timeout))
    }

    async fn client(&self, timeout: Duration) -> Result<IpamClient<DaemonChannel>, Status> {
        Ok(IpamClient::new(self.0.get(timeout).await?))
    }
}

impl IpamApi for GrpcIpam {
    fn ready<'a>(&'a self, pool: &'a str, timeout: Duration) -> BoxFuture<'a, IpamResult<()>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let list = ipampb::ListRequest {
                pool: pool.to_string(),
                include_allocations: false,
            };
            bounded("svc-ipam", "List", t, client.list(request(list, t)))
                .await
                .map(drop)
                .map_err(Into::into)
        })
    }

    fn allocate(
        &self,
        message: ipampb::AllocateRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, IpamResult<ipampb::Allocation>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let response = bounded("svc-ipam", "Allocate", t, client.allocate(request(message, t))).await?;
            response
                .allocation
                .ok_or_else(|| Status::internal("svc-ipam Allocate answered without an allocation").into())
        })
    }

    fn release(&self, owner: ipampb::Owner, timeout: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = ipampb::ReleaseRequest { owner: Some(owner) };
            Ok(bounded("svc-ipam", "Release", t, client.release(request(message, t)))
                .await?
                .released)
        })
    }

    fn release_address(
        &self,
        pool: String,
        address: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = ipampb::ReleaseAddressRequest { pool, address };
            Ok(bounded(
                "svc-ipam",
                "ReleaseAddress",
                t,
                client.release_address(request(message, t)),
            )
            .await?
            .released)
        })
    }

    fn allocations(&self, pool: String, timeout: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = ipampb::ListRequest {
                pool,
                include_allocations: true,
            };
            let response = bounded("svc-ipam", "List", t, client.list(request(message, t))).await?;
            Ok(response.pools.into_iter().flat_map(|p| p.allocations).collect())
        })
    }
}

/// svc-endpoint at `<socketDir>/svc-endpoint.sock`.
#[derive(Debug)]
pub struct GrpcEndpoints(LazyChannel);

impl GrpcEndpoints {
    /// A client of the socket; nothing connects until the first call.
    pub fn new(socket: &Path, request_timeout: Duration) -> Self {
        Self(LazyChannel::new("svc-endpoint", socket, request_timeout))
    }

    async fn client(&self, timeout: Duration) -> Result<EndpointServiceClient<DaemonChannel>, Status> {
        Ok(EndpointServiceClient::new(self.0.get(timeout).await?))
    }
}

fn container_ref(container_id: String, interface: String) -> Option<eppb::EndpointRef> {
    Some(eppb::EndpointRef {
        r#ref: Some(eppb::endpoint_ref::Ref::Container(eppb::ContainerInterface {
            container_id,
            interface,
        })),
    })
}

impl EndpointApi for GrpcEndpoints {
    fn ready(&self, timeout: Duration) -> BoxFuture<'_, EndpointResult<()>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = DaemonClient::new(self.0.get(timeout).await?);
            let t = left(started, timeout);
            bounded(
                "svc-endpoint",
                "GetInfo",
                t,
                client.get_info(request(GetInfoRequest {}, t)),
            )
            .await
            .map(drop)
            .map_err(Into::into)
        })
    }

    fn create(
        &self,
        message: eppb::CreateEndpointRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<eppb::Endpoint>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let response = bounded(
                "svc-endpoint",
                "CreateEndpoint",
                t,
                client.create_endpoint(request(message, t)),
            )
            .await?;
            response
                .endpoint
                .ok_or_else(|| Status::internal("svc-endpoint CreateEndpoint answered without the endpoint").into())
        })
    }

    fn delete(
        &self,
        container_id: String,
        interface: String,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<Vec<u32>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = eppb::DeleteEndpointRequest {
                r#ref: container_ref(container_id, interface),
            };
            Ok(bounded(
                "svc-endpoint",
                "DeleteEndpoint",
                t,
                client.delete_endpoint(request(message, t)),
            )
            .await?
            .deleted)
        })
    }

    fn delete_id(&self, id: u32, timeout: Duration) -> BoxFuture<'_, EndpointResult<Vec<u32>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = eppb::DeleteEndpointRequest {
                r#ref: Some(eppb::EndpointRef {
                    r#ref: Some(eppb::endpoint_ref::Ref::Id(id)),
                }),
            };
            Ok(bounded(
                "svc-endpoint",
                "DeleteEndpoint",
                t,
                client.delete_endpoint(request(message, t)),
            )
            .await?
            .deleted)
        })
    }

    fn get(
        &self,
        container_id: String,
        interface: String,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<Option<eppb::Endpoint>>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let message = eppb::GetEndpointRequest {
                r#ref: container_ref(container_id, interface),
            };
            match bounded(
                "svc-endpoint",
                "GetEndpoint",
                t,
                client.get_endpoint(request(message, t)),
            )
            .await
            .map_err(EndpointError::from)
            {
                Ok(response) => Ok(response.endpoint),
                Err(e) if e.is(eppb::ErrorReason::EndpointNotFound) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    fn list(&self, timeout: Duration) -> BoxFuture<'_, EndpointResult<(Vec<eppb::Endpoint>, bool)>> {
        Box::pin(async move {
            let started = Instant::now();
            let mut client = self.client(timeout).await?;
            let t = left(started, timeout);
            let response = bounded(
                "svc-endpoint",
                "ListEndpoints",
                t,
                client.list_endpoints(request(eppb::ListEndpointsRequest::default(), t)),
            )
            .await?;
            Ok((response.endpoints, response.restore_complete))
        })
    }
}

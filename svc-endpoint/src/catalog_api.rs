//! `rivet.endpoint.v1.ServiceCatalogService` over the [`ServiceCatalog`]
//! (the gRPC surface; the logic is in [`crate::catalog`]). Every field is
//! validated here; INVALID_ARGUMENT names the field.

use std::time::Duration;

use rivet_proto::endpoint::v1 as pb;
use tonic::{Request, Response, Status};

use crate::catalog::document::{MAX_DOCUMENT_BYTES, ObjectKey, ObjectKind};
use crate::catalog::{Origin, ServiceCatalog};

/// The call's deadline (grpc-timeout) or the default.
fn deadline<T>(request: &Request<T>) -> Duration {
    rivet_common::grpc::request_deadline(request, crate::service::DEFAULT_DEADLINE)
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// The request's origin (UNSPECIFIED is API).
pub fn origin(raw: i32) -> Result<Origin, Status> {
    match pb::ServiceOrigin::try_from(raw) {
        Ok(pb::ServiceOrigin::Unspecified | pb::ServiceOrigin::Api) => Ok(Origin::Api),
        Ok(pb::ServiceOrigin::Kubernetes) => Ok(Origin::Kubernetes),
        Err(_) => Err(invalid("origin", format!("unknown value {raw}"))),
    }
}

/// A document field: present and bounded.
pub fn document(field: &str, text: &str) -> Result<(), Status> {
    if text.trim().is_empty() {
        return Err(invalid(field, "required"));
    }
    if text.len() > MAX_DOCUMENT_BYTES {
        return Err(invalid(field, format!("at most {MAX_DOCUMENT_BYTES} bytes")));
    }
    Ok(())
}

fn name(
    field: &str,
    value: &str,
    check: fn(&str) -> Result<(), rivet_common::k8s_name::NameError>,
) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid(field, "required"));
    }
    check(value).map_err(|e| invalid(field, format!("{value:?} {e}")))
}

fn key(raw: Option<&pb::ServiceObjectKey>) -> Result<ObjectKey, Status> {
    let raw = raw.ok_or_else(|| invalid("key", "required"))?;
    let kind = match pb::ServiceObjectKind::try_from(raw.kind) {
        Ok(pb::ServiceObjectKind::Service) => ObjectKind::Service,
        Ok(pb::ServiceObjectKind::EndpointSlice) => ObjectKind::EndpointSlice,
        _ => return Err(invalid("key.kind", "must be SERVICE or ENDPOINT_SLICE")),
    };
    name("key.namespace", &raw.namespace, rivet_common::k8s_name::check_namespace)?;
    name("key.name", &raw.name, rivet_common::k8s_name::check_dns_subdomain)?;
    Ok(ObjectKey {
        kind,
        namespace: raw.namespace.clone(),
        name: raw.name.clone(),
    })
}

/// `key` as the proto's.
pub fn key_proto(key: &ObjectKey) -> pb::ServiceObjectKey {
    pb::ServiceObjectKey {
        kind: match key.kind {
            ObjectKind::Service => pb::ServiceObjectKind::Service,
            ObjectKind::EndpointSlice => pb::ServiceObjectKind::EndpointSlice,
        } as i32,
        namespace: key.namespace.clone(),
        name: key.name.clone(),
    }
}

/// Implements ServiceCatalogService.
#[derive(Debug, Clone)]
pub struct ServiceCatalogApi {
    catalog: ServiceCatalog,
}

impl ServiceCatalogApi {
    /// The API over `catalog`.
    pub fn new(catalog: ServiceCatalog) -> Self {
        Self { catalog }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::service_catalog_service_server::ServiceCatalogServiceServer<Self> {
        pb::service_catalog_service_server::ServiceCatalogServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::service_catalog_service_server::ServiceCatalogService for ServiceCatalogApi {
    async fn apply_service_object(
        &self,
        request: Request<pb::ApplyServiceObjectRequest>,
    ) -> Result<Response<pb::ApplyServiceObjectResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        document("document", &r.document)?;
        let origin = origin(r.origin)?;
        let applied = self.catalog.apply(&r.document, origin, r.wait, deadline).await?;
        Ok(Response::new(pb::ApplyServiceObjectResponse {
            key: Some(key_proto(&applied.key)),
            changed: applied.changed,
            cluster_ips: applied.cluster_ips.iter().map(ToString::to_string).collect(),
        }))
    }

    async fn delete_service_object(
        &self,
        request: Request<pb::DeleteServiceObjectRequest>,
    ) -> Result<Response<pb::DeleteServiceObjectResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        let key = key(r.key.as_ref())?;
        let origin = origin(r.origin)?;
        let existed = self.catalog.delete(&key, origin, r.wait, deadline).await?;
        Ok(Response::new(pb::DeleteServiceObjectResponse { existed }))
    }

    async fn list_services(
        &self,
        request: Request<pb::ListServicesRequest>,
    ) -> Result<Response<pb::ListServicesResponse>, Status> {
        let r = request.into_inner();
        if !r.namespace.is_empty() {
            name("namespace", &r.namespace, rivet_common::k8s_name::check_namespace)?;
        }
        Ok(Response::new(pb::ListServicesResponse {
            services: self.catalog.list(&r.namespace),
        }))
    }

    async fn get_service(
        &self,
        request: Request<pb::GetServiceRequest>,
    ) -> Result<Response<pb::GetServiceResponse>, Status> {
        let r = request.into_inner();
        name("namespace", &r.namespace, rivet_common::k8s_name::check_namespace)?;
        name("name", &r.name, rivet_common::k8s_name::check_dns_label)?;
        let (service, documents) = self.catalog.get(&r.namespace, &r.name)?;
        Ok(Response::new(pb::GetServiceResponse {
            service: Some(service),
            documents,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_are_named() {
        assert!(origin(2).is_ok());
        assert_eq!(origin(9).unwrap_err().message(), "origin: unknown value 9");
        assert_eq!(document("document", "  ").unwrap_err().message(), "document: required");
        let k = |kind, namespace: &str, name: &str| pb::ServiceObjectKey {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        };
        assert_eq!(key(None).unwrap_err().message(), "key: required");
        assert!(
            key(Some(&k(0, "a", "b")))
                .unwrap_err()
                .message()
                .starts_with("key.kind")
        );
        assert!(
            key(Some(&k(1, "A", "b")))
                .unwrap_err()
                .message()
                .starts_with("key.namespace")
        );
        assert!(key(Some(&k(2, "a", ""))).unwrap_err().message().starts_with("key.name"));
        assert_eq!(
            key(Some(&k(2, "a", "web-1.x"))).unwrap().kind,
            ObjectKind::EndpointSlice
        );
    }
}

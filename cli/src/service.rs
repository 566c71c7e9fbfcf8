//! `rivet service apply|list|get|delete`: svc-endpoint's service catalog
//! (Kubernetes Service and EndpointSlice documents on a node without
//! Kubernetes). The CLI is an API client: what it applies has origin `api`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use clap::{Subcommand, ValueEnum};
use rivet_policy::documents::{Document, split_documents};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, Output, fields};

const DAEMON: &str = "svc-endpoint";

/// `rivet service ...`
#[derive(Debug, Clone, Subcommand)]
pub enum ServiceCommand {
    /// Apply Service (v1) and EndpointSlice (discovery.k8s.io/v1)
    /// documents: YAML (several separated by `---` lines) or JSON (an
    /// object, or an array of them). Services go first, then the slices,
    /// each in input order; the first failure stops, and what was applied
    /// before it stays applied. A Service without clusterIP gets one from
    /// the node's --service-cidr.
    Apply {
        /// The file, or `-` for standard input.
        #[arg(short = 'f', long = "filename", visible_alias = "file", value_name = "FILE")]
        file: String,
        /// Return only once svc-loader holds each result (bounded by
        /// --timeout per document).
        #[arg(long)]
        wait: bool,
    },
    /// Every Service with its cluster IPs, ports and backends.
    List {
        /// Only Services of this namespace.
        #[arg(long)]
        namespace: Option<String>,
    },
    /// One Service: ports, backends with their conditions, the loader
    /// services it became, and (with -o json|yaml) its stored documents.
    Get {
        /// `namespace/name`, or `name` in namespace `default`.
        name: ServiceName,
    },
    /// Delete one Service (with the EndpointSlices `rivet service apply`
    /// labelled for it, as Kubernetes' garbage collector would) or, with
    /// `--kind endpointslice`, one EndpointSlice.
    Delete {
        /// `namespace/name`, or `name` in namespace `default`.
        name: ServiceName,
        /// What to delete.
        #[arg(long, value_enum, default_value_t = ObjectKind::Service)]
        kind: ObjectKind,
        /// Return only once svc-loader holds the result.
        #[arg(long)]
        wait: bool,
    },
}

/// The kinds `rivet service delete --kind` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub enum ObjectKind {
    /// A Service.
    Service,
    /// An EndpointSlice.
    #[value(name = "endpointslice")]
    EndpointSlice,
}

impl ObjectKind {
    fn to_proto(self) -> pb::ServiceObjectKind {
        match self {
            Self::Service => pb::ServiceObjectKind::Service,
            Self::EndpointSlice => pb::ServiceObjectKind::EndpointSlice,
        }
    }
}

/// `namespace/name`, or `name` in `default`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl FromStr for ServiceName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (namespace, name) = s.split_once('/').unwrap_or(("default", s));
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(format!(
                "`{s}` is not a name: give namespace/name, or name for namespace default"
            ));
        }
        Ok(Self {
            namespace: namespace.into(),
            name: name.into(),
        })
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The `kind` of a document (for ordering; the daemon validates it).
fn document_kind(text: &str) -> String {
    serde_norway::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
        .unwrap_or_default()
}

/// Services first, then everything else, each in input order.
fn apply_order(documents: Vec<Document>) -> Vec<Document> {
    let (mut services, rest): (Vec<Document>, Vec<Document>) =
        documents.into_iter().partition(|d| document_kind(&d.text) == "Service");
    services.extend(rest);
    services
}

/// One applied document as printed.
#[derive(Debug, Clone, Serialize)]
pub struct AppliedView {
    /// Position in the input, from 1.
    pub document: usize,
    /// Where it is in the input.
    pub location: String,
    /// `Service` or `EndpointSlice`.
    pub kind: String,
    /// `namespace/name`.
    pub name: String,
    /// false when an identical object was stored.
    pub changed: bool,
    /// A Service's cluster IPs as stored.
    pub cluster_ips: Vec<String>,
}

/// The document that failed.
#[derive(Debug, Clone, Serialize)]
pub struct FailureView {
    /// Position in the input, from 1.
    pub document: usize,
    /// Where it is in the input.
    pub location: String,
    /// gRPC code.
    pub code: String,
    /// svc-endpoint's reason (`SERVICE_INVALID`, ...); empty when none.
    pub reason: &'static str,
    /// The daemon's message (for an invalid document: field path and why).
    pub message: String,
    /// Whether the failed document itself stays applied: `yes` (stored,
    /// not realised), `no` (refused) or `unknown`.
    pub applied: &'static str,
}

/// `rivet service apply` output.
#[derive(Debug, Clone, Serialize)]
pub struct ApplyView {
    /// Documents in the input.
    pub documents: usize,
    /// Applied, in the order sent.
    pub applied: Vec<AppliedView>,
    /// The document that failed; the ones after it were not sent.
    pub failed: Option<FailureView>,
}

impl FailureView {
    fn new(doc: &Document, status: &tonic::Status) -> Self {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        let reason = rivet_common::grpc::error_reason::<R>(status);
        let applied = match reason {
            Some(R::ServiceInvalid | R::ServiceOriginConflict | R::ClusterIpUnavailable) => "no",
            Some(R::NotRealisedInTime | R::ServiceRefusedByLoader) => "yes",
            None if status.code() == tonic::Code::InvalidArgument => "no",
            _ => "unknown",
        };
        Self {
            document: doc.number,
            location: doc.location.to_string(),
            code: format!("{:?}", status.code()),
            reason: reason.map_or("", |r| r.as_str_name()),
            message: status.message().to_string(),
            applied,
        }
    }
}

fn apply_text(view: &ApplyView) -> String {
    let mut out = String::new();
    if !view.applied.is_empty() {
        let mut t = Table::new(["DOC", "KIND", "NAME", "CHANGED", "CLUSTER-IPS"]);
        for a in &view.applied {
            t.row([
                format!("{} ({})", a.document, a.location),
                a.kind.clone(),
                a.name.clone(),
                if a.changed { "yes" } else { "no (identical)" }.to_string(),
                if a.cluster_ips.is_empty() {
                    "-".to_string()
                } else {
                    a.cluster_ips.join(",")
                },
            ]);
        }
        out.push_str(&t.render());
    }
    out
}

fn failure_text(view: &ApplyView, f: &FailureView) -> String {
    let mut out = crate::document_failure(
        f.document,
        &f.location,
        f.code == "InvalidArgument",
        &f.code,
        &f.message,
    );
    out.push_str(match f.applied {
        "no" => "It was not applied.",
        "yes" => "It is stored, but svc-loader does not hold its result (see `rivet service get`).",
        _ => "Whether it was applied is unknown (see `rivet service list`).",
    });
    let before = view.applied.len();
    if before > 0 {
        out.push_str(&format!(" The {before} document(s) applied before it stay applied."));
    }
    let after = view.documents - before - 1;
    if after > 0 {
        out.push_str(&format!(" {after} document(s) after it were not sent."));
    }
    out.push('\n');
    out
}

/// A port as printed.
#[derive(Debug, Clone, Serialize)]
pub struct PortView {
    /// Name ("" for the unnamed one).
    pub name: String,
    /// TCP, UDP or SCTP.
    pub protocol: String,
    /// Frontend port.
    pub port: u32,
    /// Node port, 0 when none.
    pub node_port: u32,
    /// Target port (number or name).
    pub target_port: String,
}

/// A backend as printed.
#[derive(Debug, Clone, Serialize)]
pub struct BackendView {
    /// Address.
    pub address: String,
    /// Port.
    pub port: u32,
    /// The Service port it serves.
    pub service_port: String,
    /// Conditions.
    pub ready: bool,
    /// Conditions.
    pub serving: bool,
    /// Conditions.
    pub terminating: bool,
    /// `ns/name` of its pod.
    pub pod: String,
    /// Its node.
    pub node_name: String,
}

/// A loader service as printed.
#[derive(Debug, Clone, Serialize)]
pub struct LoadBalancerView {
    /// Service port.
    pub service_port: String,
    /// IPv4 or IPv6.
    pub family: String,
    /// The loader's service id.
    pub service_id: u32,
    /// svc-loader holds it as computed.
    pub realised: bool,
}

/// A Service as printed.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceView {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// ClusterIP, NodePort or LoadBalancer.
    pub r#type: String,
    /// Cluster IPs ("None" for headless).
    pub cluster_ips: Vec<String>,
    /// Ports.
    pub ports: Vec<PortView>,
    /// None or ClientIP.
    pub session_affinity: String,
    /// Seconds.
    pub affinity_timeout_seconds: u32,
    /// Cluster or Local.
    pub external_traffic_policy: String,
    /// Selector.
    pub selector: std::collections::BTreeMap<String, String>,
    /// api or kubernetes.
    pub origin: String,
    /// Backends.
    pub backends: Vec<BackendView>,
    /// Loader services.
    pub load_balancer: Vec<LoadBalancerView>,
    /// The stored documents as JSON (`get`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub documents: Option<Vec<serde_json::Value>>,
}

impl From<pb::ServiceView> for ServiceView {
    fn from(s: pb::ServiceView) -> Self {
        Self {
            namespace: s.namespace,
            name: s.name,
            r#type: s.r#type,
            cluster_ips: s.cluster_ips,
            ports: s
                .ports
                .into_iter()
                .map(|p| PortView {
                    name: p.name,
                    protocol: p.protocol,
                    port: p.port,
                    node_port: p.node_port,
                    target_port: p.target_port,
                })
                .collect(),
            session_affinity: s.session_affinity,
            affinity_timeout_seconds: s.affinity_timeout_seconds,
            external_traffic_policy: s.external_traffic_policy,
            selector: s.selector.into_iter().collect(),
            origin: match pb::ServiceOrigin::try_from(s.origin) {
                Ok(pb::ServiceOrigin::Kubernetes) => "kubernetes",
                _ => "api",
            }
            .into(),
            backends: s
                .backends
                .into_iter()
                .map(|b| BackendView {
                    address: b.address,
                    port: b.port,
                    service_port: b.service_port,
                    ready: b.ready,
                    serving: b.serving,
                    terminating: b.terminating,
                    pod: b.pod,
                    node_name: b.node_name,
                })
                .collect(),
            load_balancer: s
                .load_balancer
                .into_iter()
                .map(|e| LoadBalancerView {
                    service_port: e.service_port,
                    family: e.family,
                    service_id: e.service_id,
                    realised: e.realised,
                })
                .collect(),
            documents: None,
        }
    }
}

impl ServiceView {
    fn ports_text(&self) -> String {
        self.ports
            .iter()
            .map(|p| {
                let node = if p.node_port == 0 {
                    String::new()
                } else {
                    format!(":{}", p.node_port)
                };
                format!("{}{node}/{}", p.port, p.protocol)
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `2/3`: active of all backends, of the families the Service serves
    /// (its cluster IPs' families; every family without one): the pods of
    /// a single-stack Service have addresses of both.
    fn backends_text(&self) -> String {
        let families: Vec<bool> = self
            .cluster_ips
            .iter()
            .filter_map(|ip| ip.parse::<IpAddr>().ok())
            .map(|ip| ip.is_ipv4())
            .collect();
        let served: Vec<&BackendView> = self
            .backends
            .iter()
            .filter(|b| {
                families.is_empty()
                    || b.address
                        .parse::<IpAddr>()
                        .is_ok_and(|a| families.contains(&a.is_ipv4()))
            })
            .collect();
        let active = served.iter().filter(|b| b.ready && !b.terminating).count();
        format!("{active}/{}", served.len())
    }

    fn realised_text(&self) -> &'static str {
        if self.load_balancer.is_empty() {
            "-"
        } else if self.load_balancer.iter().all(|e| e.realised) {
            "yes"
        } else {
            "no"
        }
    }
}

fn list_table(services: &[ServiceView]) -> String {
    let mut t = Table::new([
        "NAMESPACE",
        "NAME",
        "TYPE",
        "CLUSTER-IPS",
        "PORTS",
        "BACKENDS",
        "REALISED",
        "ORIGIN",
    ]);
    for s in services {
        t.row([
            s.namespace.clone(),
            s.name.clone(),
            s.r#type.clone(),
            if s.cluster_ips.is_empty() {
                "-".into()
            } else {
                s.cluster_ips.join(",")
            },
            s.ports_text(),
            s.backends_text(),
            s.realised_text().into(),
            s.origin.clone(),
        ]);
    }
    t.render()
}

fn service_text(s: &ServiceView) -> String {
    let mut out = fields([
        ("NAME", format!("{}/{}", s.namespace, s.name)),
        ("TYPE", s.r#type.clone()),
        ("CLUSTER-IPS", s.cluster_ips.join(", ")),
        ("PORTS", s.ports_text()),
        (
            "SELECTOR",
            s.selector
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
        ),
        (
            "AFFINITY",
            if s.affinity_timeout_seconds == 0 {
                "None".into()
            } else {
                format!("ClientIP, {}s", s.affinity_timeout_seconds)
            },
        ),
        ("TRAFFIC", s.external_traffic_policy.clone()),
        ("ORIGIN", s.origin.clone()),
    ]);
    out.push_str("\nBackends:\n");
    if s.backends.is_empty() {
        out.push_str("  none\n");
    } else {
        let mut t = Table::new(["ADDRESS", "PORT", "SERVICE-PORT", "STATE", "POD", "NODE"]);
        for b in &s.backends {
            let state = match (b.ready, b.serving, b.terminating) {
                (true, _, false) => "ready",
                (_, true, true) => "terminating",
                (_, false, true) => "terminating, not serving",
                _ => "not ready",
            };
            t.row([
                b.address.clone(),
                b.port.to_string(),
                b.service_port.clone(),
                state.to_string(),
                if b.pod.is_empty() { "-".into() } else { b.pod.clone() },
                if b.node_name.is_empty() {
                    "-".into()
                } else {
                    b.node_name.clone()
                },
            ]);
        }
        out.push_str(&t.render());
    }
    out.push_str("\nLoader services:\n");
    if s.load_balancer.is_empty() {
        out.push_str("  none\n");
    } else {
        let mut t = Table::new(["SERVICE-PORT", "FAMILY", "ID", "REALISED"]);
        for e in &s.load_balancer {
            t.row([
                e.service_port.clone(),
                e.family.clone(),
                e.service_id.to_string(),
                if e.realised { "yes" } else { "no" }.to_string(),
            ]);
        }
        out.push_str(&t.render());
    }
    out
}

/// `-f` as named in messages.
fn input_name(file: &str) -> &str {
    if file == "-" { "standard input" } else { file }
}

/// The documents of `-f` (read before any daemon is asked).
pub fn read_documents(file: &str) -> Result<Vec<Document>, CliError> {
    let read = if file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(file)
    };
    let text = read.map_err(|source| CliError::ReadInput {
        input: input_name(file).into(),
        source,
    })?;
    let documents = split_documents(&text).map_err(|source| CliError::Documents {
        input: input_name(file).into(),
        source,
    })?;
    if documents.is_empty() {
        return Err(CliError::NoDocument {
            input: input_name(file).into(),
        });
    }
    Ok(documents)
}

/// Applies `documents` (Services first) on the node of `ctx`; stops at the
/// first failure.
pub async fn apply(ctx: &Context, documents: Vec<Document>, wait: bool) -> Result<ApplyView, CliError> {
    let mut client = ServiceCatalogServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
    let mut view = ApplyView {
        documents: documents.len(),
        applied: Vec::new(),
        failed: None,
    };
    for doc in apply_order(documents) {
        let answer = client
            .apply_service_object(ctx.request(pb::ApplyServiceObjectRequest {
                document: doc.text.clone(),
                origin: pb::ServiceOrigin::Api as i32,
                wait,
            }))
            .await;
        match answer {
            Ok(r) => {
                let r = r.into_inner();
                let key = r.key.unwrap_or_default();
                view.applied.push(AppliedView {
                    document: doc.number,
                    location: doc.location.to_string(),
                    kind: match pb::ServiceObjectKind::try_from(key.kind) {
                        Ok(pb::ServiceObjectKind::EndpointSlice) => "EndpointSlice",
                        _ => "Service",
                    }
                    .into(),
                    name: format!("{}/{}", key.namespace, key.name),
                    changed: r.changed,
                    cluster_ips: r.cluster_ips,
                });
            }
            Err(status) => {
                view.failed = Some(FailureView::new(&doc, &status));
                break;
            }
        }
    }
    Ok(view)
}

/// GetService of `name` on the node of `ctx`.
async fn get_service(ctx: &Context, name: &ServiceName) -> Result<pb::GetServiceResponse, CliError> {
    let mut client = ServiceCatalogServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
    let r = client
        .get_service(ctx.request(pb::GetServiceRequest {
            namespace: name.namespace.clone(),
            name: name.name.clone(),
        }))
        .await
        .map_err(|s| CliError::rpc(DAEMON, s))?;
    Ok(r.into_inner())
}

/// The stored documents of Service `name` on the node of `ctx`: the
/// Service (with its allocations) first.
pub async fn stored_documents(ctx: &Context, name: &ServiceName) -> Result<Vec<String>, CliError> {
    Ok(get_service(ctx, name).await?.documents)
}

/// Prints an apply's outcome; whether everything was applied.
pub fn print_apply(ctx: &Context, view: &ApplyView) -> bool {
    ctx.print(view, || apply_text(view));
    if let (Output::Table, Some(f)) = (ctx.output, &view.failed) {
        eprint!("{}", failure_text(view, f));
    }
    view.failed.is_none()
}

/// Runs one `rivet service` command; false when `apply` stopped at a
/// document (after printing why).
pub async fn run(ctx: &Context, command: ServiceCommand) -> Result<bool, CliError> {
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        ServiceCommand::Apply { file, wait } => {
            let documents = read_documents(&file)?;
            let view = apply(ctx, documents, wait).await?;
            Ok(print_apply(ctx, &view))
        }
        ServiceCommand::List { namespace } => {
            let mut client = ServiceCatalogServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
            let r = client
                .list_services(ctx.request(pb::ListServicesRequest {
                    namespace: namespace.unwrap_or_default(),
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let services: Vec<ServiceView> = r.services.into_iter().map(Into::into).collect();
            ctx.print(&services, || list_table(&services));
            Ok(true)
        }
        ServiceCommand::Get { name } => {
            let r = get_service(ctx, &name).await?;
            let mut view: ServiceView = r.service.unwrap_or_default().into();
            view.documents = Some(
                r.documents
                    .iter()
                    .map(|d| serde_json::from_str(d).unwrap_or_else(|_| serde_json::Value::String(d.clone())))
                    .collect(),
            );
            ctx.print(&view, || service_text(&view));
            Ok(true)
        }
        ServiceCommand::Delete { name, kind, wait } => {
            let mut client = ServiceCatalogServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
            let r = client
                .delete_service_object(ctx.request(pb::DeleteServiceObjectRequest {
                    key: Some(pb::ServiceObjectKey {
                        kind: kind.to_proto() as i32,
                        namespace: name.namespace.clone(),
                        name: name.name.clone(),
                    }),
                    origin: pb::ServiceOrigin::Api as i32,
                    wait,
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            #[derive(Serialize)]
            struct View {
                kind: ObjectKind,
                name: ServiceName,
                deleted: bool,
            }
            let view = View {
                kind,
                name,
                deleted: r.existed,
            };
            let what = match kind {
                ObjectKind::Service => "Service",
                ObjectKind::EndpointSlice => "EndpointSlice",
            };
            ctx.print(&view, || {
                if view.deleted {
                    format!("{what} {} deleted\n", view.name)
                } else {
                    format!("{what} {}: none; nothing deleted\n", view.name)
                }
            });
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(cluster_ips: &[&str], backends: &[(&str, bool)]) -> ServiceView {
        ServiceView::from(pb::ServiceView {
            namespace: "default".into(),
            name: "web".into(),
            r#type: "ClusterIP".into(),
            cluster_ips: cluster_ips.iter().map(ToString::to_string).collect(),
            backends: backends
                .iter()
                .map(|(address, ready)| pb::ServiceBackendView {
                    address: address.to_string(),
                    port: 8080,
                    ready: *ready,
                    serving: true,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    #[test]
    fn backends_count_the_families_the_service_serves() {
        // Two dual-stack pods, one of them not ready.
        let pods = [
            ("198.18.0.5", true),
            ("2001:2::5", true),
            ("198.18.0.6", false),
            ("2001:2::6", false),
        ];
        let column = |s: &ServiceView| {
            let table = list_table(std::slice::from_ref(s));
            let header = table.lines().next().unwrap();
            let row = table.lines().nth(1).unwrap();
            let at = header.find("BACKENDS").unwrap();
            row[at..].split_whitespace().next().unwrap().to_string()
        };
        assert_eq!(column(&service(&["198.19.128.10"], &pods)), "1/2", "IPv4 single-stack");
        assert_eq!(column(&service(&["2001:2:0:ff::a"], &pods)), "1/2", "IPv6 single-stack");
        assert_eq!(
            column(&service(&["198.19.128.10", "2001:2:0:ff::a"], &pods)),
            "2/4",
            "dual-stack"
        );
        assert_eq!(column(&service(&["None"], &pods)), "2/4", "headless: every family");
    }

    #[test]
    fn names_default_to_the_default_namespace() {
        assert_eq!(
            "web".parse::<ServiceName>().unwrap(),
            ServiceName {
                namespace: "default".into(),
                name: "web".into()
            }
        );
        assert_eq!("shop/web".parse::<ServiceName>().unwrap().namespace, "shop");
        assert!("a/b/c".parse::<ServiceName>().is_err());
        assert!("/web".parse::<ServiceName>().is_err());
    }

    #[test]
    fn a_refused_document_says_what_is_applied_and_what_was_not_sent() {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        let docs = split_documents("kind: Service\n---\nkind: Service\n---\nkind: EndpointSlice\n").unwrap();
        let status = rivet_common::grpc::status_with_reason(
            tonic::Code::InvalidArgument,
            "spec.ports[0].port: must be 1..=65535, found 0",
            R::ServiceInvalid,
        );
        let failure = FailureView::new(&docs[1], &status);
        assert_eq!(failure.applied, "no");
        let view = ApplyView {
            documents: 3,
            applied: vec![AppliedView {
                document: 1,
                location: "line 1".into(),
                kind: "Service".into(),
                name: "default/a".into(),
                changed: true,
                cluster_ips: Vec::new(),
            }],
            failed: Some(failure.clone()),
        };
        assert_eq!(
            failure_text(&view, &failure),
            "error: document 2 (line 3) is invalid: spec.ports[0].port: must be 1..=65535, found 0\n\
             It was not applied. The 1 document(s) applied before it stay applied. 1 document(s) after it were not sent.\n"
        );
        let late = rivet_common::grpc::status_with_reason(tonic::Code::DeadlineExceeded, "late", R::NotRealisedInTime);
        assert_eq!(FailureView::new(&docs[1], &late).applied, "yes");
    }

    #[test]
    fn services_are_applied_before_their_slices() {
        let docs = split_documents(
            "kind: EndpointSlice\nmetadata: {name: a}\n---\nkind: Service\nmetadata: {name: s}\n---\n{\"kind\": \"Service\", \"metadata\": {\"name\": \"t\"}}\n",
        )
        .unwrap();
        let order: Vec<usize> = apply_order(docs).iter().map(|d| d.number).collect();
        assert_eq!(order, [2, 3, 1]);
    }
}

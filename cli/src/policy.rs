//! `rivet policy apply|delete|list|get`: svc-endpoint's policy repository.
//! The CLI is an API client: what it applies has origin `api`.

use std::fmt;
use std::str::FromStr;

use clap::Subcommand;
use rivet_policy::documents::split_documents;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context, Output, age, fields, now_unix_nanos};

const DAEMON: &str = "svc-endpoint";

/// The kind of a key given as `namespace/name`.
pub const NETWORK_POLICY: &str = "NetworkPolicy";

/// `rivet policy ...`
#[derive(Debug, Clone, Subcommand)]
pub enum PolicyCommand {
    /// Apply policy documents: YAML (several separated by `---` or `...`
    /// lines) or JSON (an object, or an array of them), split as
    /// svc-endpoint splits its `--policy-dir` files. Each document is stored on its own, in
    /// order; the first failure stops, and the documents before it stay
    /// applied.
    Apply {
        /// The file, or `-` for standard input.
        #[arg(short = 'f', long = "filename", visible_alias = "file", value_name = "FILE")]
        file: String,
        /// Return only once every affected endpoint realised each document
        /// (bounded by --timeout per document).
        #[arg(long)]
        wait: bool,
    },
    /// Delete one policy.
    Delete {
        /// `kind/namespace/name`, or `namespace/name` for a NetworkPolicy.
        key: PolicyKey,
        /// Return only once every affected endpoint realised the deletion.
        #[arg(long)]
        wait: bool,
    },
    /// Every policy of the repository.
    List {
        /// Only policies of this namespace.
        #[arg(long)]
        namespace: Option<String>,
    },
    /// One policy: what Rivet understood of it and what it selects.
    Get {
        /// `kind/namespace/name`, or `namespace/name` for a NetworkPolicy.
        key: PolicyKey,
        /// Also print the source document as given.
        #[arg(long)]
        document: bool,
    },
}

/// A policy's key as written on the command line: `kind/namespace/name`, or
/// `namespace/name` for a NetworkPolicy. The namespace may be empty in the
/// three-part form (`Kind//name`) for a kind without namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PolicyKey {
    /// `NetworkPolicy` or Rivet's own kind.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl FromStr for PolicyKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split('/').collect();
        let (kind, namespace, name) = match parts[..] {
            [namespace, name] if !namespace.is_empty() => (NETWORK_POLICY, namespace, name),
            [kind, namespace, name] if !kind.is_empty() => (kind, namespace, name),
            _ => ("", "", ""),
        };
        if name.is_empty() {
            return Err(format!(
                "`{s}` is not a policy key: give kind/namespace/name, or namespace/name for a NetworkPolicy"
            ));
        }
        Ok(Self {
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
        })
    }
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

impl From<&PolicyKey> for pb::PolicyKey {
    fn from(k: &PolicyKey) -> Self {
        Self {
            kind: k.kind.clone(),
            namespace: k.namespace.clone(),
            name: k.name.clone(),
        }
    }
}

impl From<&pb::PolicyKey> for PolicyKey {
    fn from(k: &pb::PolicyKey) -> Self {
        Self {
            kind: k.kind.clone(),
            namespace: k.namespace.clone(),
            name: k.name.clone(),
        }
    }
}

fn origin_name(raw: i32) -> &'static str {
    match pb::PolicyOrigin::try_from(raw) {
        Ok(pb::PolicyOrigin::Api) => "api",
        Ok(pb::PolicyOrigin::Directory) => "directory",
        Ok(pb::PolicyOrigin::Kubernetes) => "kubernetes",
        _ => "unknown",
    }
}

/// One applied document as printed.
#[derive(Debug, Clone, Serialize)]
pub struct AppliedView {
    /// Position in the input, from 1.
    document: usize,
    /// Where it is in the input.
    location: String,
    /// The policy's key.
    key: PolicyKey,
    /// The policy's revision (unchanged on an identical repeat).
    revision: u64,
    /// false when an identical policy was already stored.
    changed: bool,
    /// Endpoints whose policy this change affects.
    affected_endpoints: u32,
    /// With --wait: endpoints that realised it.
    realised_endpoints: u32,
    /// Endpoints the policy selects once applied (asked after every
    /// document was sent); none draws a warning.
    selected_endpoints: Option<u32>,
}

/// The document that failed, as printed.
#[derive(Debug, Clone, Serialize)]
pub struct FailureView {
    /// Position in the input, from 1.
    document: usize,
    /// Where it is in the input.
    location: String,
    /// gRPC code (`InvalidArgument`, ...).
    code: String,
    /// svc-endpoint's reason (`POLICY_INVALID`, ...); empty when it sent none.
    reason: &'static str,
    /// The daemon's message (for an invalid document: field path and reason).
    message: String,
    /// Whether the failed document itself stays applied: `yes` (the wait
    /// ran out), `no` (refused) or `unknown` (no answer).
    applied: &'static str,
}

/// `rivet policy apply` output.
#[derive(Debug, Clone, Serialize)]
pub struct ApplyView {
    /// Documents in the input.
    documents: usize,
    /// Whether each call waited for the endpoints to realise the document.
    wait: bool,
    /// Documents applied, in order.
    applied: Vec<AppliedView>,
    /// The document that failed; the ones after it were not sent.
    failed: Option<FailureView>,
}

impl FailureView {
    fn new(document: usize, location: String, status: &tonic::Status, wait: bool) -> Self {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        let reason = rivet_common::grpc::error_reason::<R>(status);
        let applied = match reason {
            Some(R::PolicyInvalid | R::PolicyOriginConflict) => "no",
            // The daemon's answer with --wait: stored, not yet realised everywhere.
            Some(R::NotRealisedInTime) if wait => "yes",
            // A field the request itself got wrong (no reason): refused
            // before anything was stored.
            None if status.code() == tonic::Code::InvalidArgument => "no",
            _ => "unknown",
        };
        Self {
            document,
            location,
            code: format!("{:?}", status.code()),
            reason: reason.map_or("", |r| r.as_str_name()),
            message: status.message().to_string(),
            applied,
        }
    }

    /// The document itself is invalid (the message names the field).
    fn invalid(&self) -> bool {
        use rivet_proto::endpoint::v1::ErrorReason as R;
        self.reason == R::PolicyInvalid.as_str_name() || (self.reason.is_empty() && self.code == "InvalidArgument")
    }
}

fn applied_table(view: &ApplyView) -> String {
    if view.applied.is_empty() {
        return String::new();
    }
    let mut t = Table::new(["DOC", "KEY", "REVISION", "CHANGED", "ENDPOINTS"]);
    for a in &view.applied {
        t.row([
            format!("{} ({})", a.document, a.location),
            a.key.to_string(),
            a.revision.to_string(),
            if a.changed { "yes" } else { "no (identical)" }.to_string(),
            if view.wait {
                format!("{} affected, {} realised", a.affected_endpoints, a.realised_endpoints)
            } else {
                format!("{} affected", a.affected_endpoints)
            },
        ]);
    }
    t.render()
}

/// The warning for an applied policy that selects no endpoint.
fn no_selection_warning(key: &PolicyKey) -> String {
    let scope = if key.namespace.is_empty() {
        String::new()
    } else {
        format!(" in namespace {}", key.namespace)
    };
    format!(
        "warning: {key} selects no endpoint: no pod{scope} matches its podSelector now (check the \
         selector against `rivet endpoint list`); it applies to matching pods created later"
    )
}

/// Why `rivet policy apply` stopped and what that leaves applied.
fn failure_text(view: &ApplyView, f: &FailureView) -> String {
    let mut out = crate::document_failure(f.document, &f.location, f.invalid(), &f.code, &f.message);
    out.push_str(match f.applied {
        "no" => "It was not applied.",
        "yes" => "It is applied, but not every affected endpoint realised it in time.",
        _ => "Whether it was applied is unknown (see `rivet policy list`).",
    });
    let before = f.document - 1;
    out.push_str(&match before {
        0 => String::new(),
        1 => " Document 1 before it stays applied.".to_string(),
        n => format!(" Documents 1-{n} before it stay applied."),
    });
    let after = view.documents - f.document;
    out.push_str(&match after {
        0 => String::new(),
        1 => format!(" Document {} after it was not sent.", f.document + 1),
        _ => format!(
            " Documents {}-{} after it were not sent.",
            f.document + 1,
            view.documents
        ),
    });
    out.push('\n');
    out
}

/// A policy as printed.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyView {
    /// Its key.
    key: PolicyKey,
    /// `api`, `directory` or `kubernetes`.
    origin: String,
    /// The document's apiVersion.
    api_version: String,
    /// Repository revision at which it last changed.
    revision: u64,
    /// When it last changed, Unix nanoseconds.
    updated_unix_nanos: i64,
    /// Endpoints it selects now (`get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    selected_endpoints: Option<Vec<u32>>,
    /// What Rivet understood (`get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    normalized: Option<serde_json::Value>,
    /// The source document as given (`get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    document: Option<String>,
    /// The normalised form pretty-printed in the daemon's key order.
    #[serde(skip)]
    normalized_text: String,
}

impl PolicyView {
    fn new(p: &pb::Policy, full: bool) -> Self {
        Self {
            key: p.key.as_ref().map(Into::into).unwrap_or_default(),
            origin: origin_name(p.origin).into(),
            api_version: p.api_version.clone(),
            revision: p.revision,
            updated_unix_nanos: p.updated_unix_nanos,
            selected_endpoints: full.then(|| p.selected_endpoints.clone()),
            // Not JSON (which would be a server bug): kept as text.
            normalized: full.then(|| {
                serde_json::from_str(&p.normalized_json)
                    .unwrap_or_else(|_| serde_json::Value::String(p.normalized_json.clone()))
            }),
            document: full.then(|| p.document.clone()),
            normalized_text: pretty_json(&p.normalized_json).unwrap_or_else(|| p.normalized_json.clone()),
        }
    }
}

/// `rivet policy list` output.
#[derive(Debug, Clone, Serialize)]
pub struct ListView {
    /// Current repository revision.
    revision: u64,
    /// The policies.
    policies: Vec<PolicyView>,
}

fn list_table(view: &ListView, now: i64) -> String {
    let mut t = Table::new(["KIND", "NAMESPACE", "NAME", "ORIGIN", "REVISION", "AGE"]);
    for p in &view.policies {
        t.row([
            p.key.kind.clone(),
            if p.key.namespace.is_empty() {
                "-".into()
            } else {
                p.key.namespace.clone()
            },
            p.key.name.clone(),
            p.origin.clone(),
            p.revision.to_string(),
            age(now, p.updated_unix_nanos),
        ]);
    }
    t.render()
}

fn policy_text(p: &PolicyView, now: i64, with_document: bool) -> String {
    let selected = p.selected_endpoints.clone().unwrap_or_default();
    let mut out = fields([
        ("KEY", p.key.to_string()),
        ("ORIGIN", p.origin.clone()),
        ("API VERSION", p.api_version.clone()),
        (
            "REVISION",
            format!("{} (changed {} ago)", p.revision, age(now, p.updated_unix_nanos)),
        ),
        (
            "SELECTS",
            match selected.len() {
                0 => "no endpoint".into(),
                n => format!(
                    "{n} endpoint{}: {}",
                    if n == 1 { "" } else { "s" },
                    selected.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                ),
            },
        ),
    ]);
    out.push_str("\nNormalized:\n");
    out.push_str(&p.normalized_text);
    out.push('\n');
    if with_document {
        out.push_str("\nDocument:\n");
        let document = p.document.clone().unwrap_or_default();
        out.push_str(&document);
        if !document.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// `text`, valid JSON, indented by two spaces like
/// `serde_json::to_string_pretty` but keeping the order of object keys;
/// `None` when `text` is not JSON.
fn pretty_json(text: &str) -> Option<String> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    let mut out = String::new();
    let mut depth = 0usize;
    let mut chars = text.trim().chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push(c);
                while let Some(c) = chars.next() {
                    out.push(c);
                    match c {
                        '\\' => out.extend(chars.next()),
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                if chars.peek().is_some_and(|&n| n == '}' || n == ']') {
                    out.extend(chars.next());
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    Some(out)
}

/// `-f` as named in messages.
fn input_name(file: &str) -> &str {
    if file == "-" { "standard input" } else { file }
}

fn read_input(file: &str) -> Result<String, CliError> {
    let read = if file == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(file)
    };
    read.map_err(|source| CliError::ReadInput {
        input: input_name(file).into(),
        source,
    })
}

/// Runs one `rivet policy` command; false when `apply` stopped at a
/// document (after printing why).
pub async fn run(ctx: &Context, command: PolicyCommand) -> Result<bool, CliError> {
    // Read the input before connecting: a bad file needs no daemon.
    let documents = match &command {
        PolicyCommand::Apply { file, .. } => {
            let name = input_name(file);
            let docs = split_documents(&read_input(file)?).map_err(|source| CliError::Documents {
                input: name.into(),
                source,
            })?;
            if docs.is_empty() {
                return Err(CliError::NoDocument { input: name.into() });
            }
            docs
        }
        _ => Vec::new(),
    };
    let mut client = PolicyServiceClient::new(ctx.connect_with_deadline(DAEMON).await?);
    let rpc = |s| CliError::rpc(DAEMON, s);
    let now = now_unix_nanos();
    match command {
        PolicyCommand::Apply { wait, .. } => {
            let mut view = ApplyView {
                documents: documents.len(),
                wait,
                applied: Vec::new(),
                failed: None,
            };
            for doc in documents {
                let answer = client
                    .upsert_policy(ctx.request(pb::UpsertPolicyRequest {
                        document: doc.text,
                        origin: pb::PolicyOrigin::Api as i32,
                        wait,
                    }))
                    .await;
                match answer {
                    Ok(r) => {
                        let r = r.into_inner();
                        view.applied.push(AppliedView {
                            document: doc.number,
                            location: doc.location.to_string(),
                            key: r.key.as_ref().map(Into::into).unwrap_or_default(),
                            revision: r.revision,
                            changed: r.changed,
                            affected_endpoints: r.affected_endpoints,
                            realised_endpoints: r.realised_endpoints,
                            selected_endpoints: None,
                        });
                    }
                    Err(status) => {
                        view.failed = Some(FailureView::new(doc.number, doc.location.to_string(), &status, wait));
                        break;
                    }
                }
            }
            // A policy that selects nothing is usually a selector typo.
            for applied in &mut view.applied {
                let key = pb::PolicyKey::from(&applied.key);
                match client
                    .get_policy(ctx.request(pb::GetPolicyRequest { key: Some(key) }))
                    .await
                {
                    Ok(r) => {
                        let selected = r.into_inner().policy.map_or(0, |p| p.selected_endpoints.len());
                        applied.selected_endpoints = Some(u32::try_from(selected).unwrap_or(u32::MAX));
                        if selected == 0 {
                            eprintln!("{}", no_selection_warning(&applied.key));
                        }
                    }
                    Err(status) => eprintln!(
                        "warning: could not check which endpoints {} selects: {:?}: {}",
                        applied.key,
                        status.code(),
                        status.message()
                    ),
                }
            }
            ctx.print(&view, || applied_table(&view));
            if let (Output::Table, Some(f)) = (ctx.output, &view.failed) {
                eprint!("{}", failure_text(&view, f));
            }
            return Ok(view.failed.is_none());
        }
        PolicyCommand::Delete { key, wait } => {
            let r = client
                .delete_policy(ctx.request(pb::DeletePolicyRequest {
                    key: Some((&key).into()),
                    origin: pb::PolicyOrigin::Api as i32,
                    wait,
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            #[derive(Serialize)]
            struct View {
                key: PolicyKey,
                deleted: bool,
                revision: u64,
                affected_endpoints: u32,
                realised_endpoints: u32,
            }
            let view = View {
                key,
                deleted: r.deleted,
                revision: r.revision,
                affected_endpoints: r.affected_endpoints,
                realised_endpoints: r.realised_endpoints,
            };
            ctx.print(&view, || {
                if !view.deleted {
                    return format!("{}: no such policy; nothing deleted\n", view.key);
                }
                let realised = if wait {
                    format!(", {} realised", view.realised_endpoints)
                } else {
                    String::new()
                };
                format!(
                    "{} deleted; repository revision {}, {} endpoints affected{realised}\n",
                    view.key, view.revision, view.affected_endpoints
                )
            });
        }
        PolicyCommand::List { namespace } => {
            let r = client
                .list_policies(ctx.request(pb::ListPoliciesRequest {
                    namespace: namespace.unwrap_or_default(),
                    origin: pb::PolicyOrigin::Unspecified as i32,
                    include_documents: false,
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let view = ListView {
                revision: r.revision,
                policies: r.policies.iter().map(|p| PolicyView::new(p, false)).collect(),
            };
            ctx.print(&view, || list_table(&view, now));
        }
        PolicyCommand::Get { key, document } => {
            let r = client
                .get_policy(ctx.request(pb::GetPolicyRequest {
                    key: Some((&key).into()),
                }))
                .await
                .map_err(rpc)?
                .into_inner();
            let Some(policy) = r.policy else {
                return Err(CliError::Rpc {
                    daemon: DAEMON,
                    code: tonic::Code::Internal,
                    message: format!("answered without a policy for {key}"),
                });
            };
            let view = PolicyView::new(&policy, true);
            ctx.print(&view, || policy_text(&view, now, document));
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_proto::endpoint::v1::ErrorReason;

    fn key(s: &str) -> Result<PolicyKey, String> {
        s.parse()
    }

    #[test]
    fn keys() {
        let k = key("shop/allow-web").unwrap();
        assert_eq!(
            (k.kind.as_str(), k.namespace.as_str(), k.name.as_str()),
            ("NetworkPolicy", "shop", "allow-web")
        );
        assert_eq!(k.to_string(), "NetworkPolicy/shop/allow-web");
        let k = key("RivetPolicy/shop/deny").unwrap();
        assert_eq!(
            (k.kind.as_str(), k.namespace.as_str(), k.name.as_str()),
            ("RivetPolicy", "shop", "deny")
        );
        // A kind without namespace; round-trips through Display.
        let k = key("RivetClusterPolicy//base").unwrap();
        assert_eq!(k.namespace, "");
        assert_eq!(key(&k.to_string()), Ok(k));
        for bad in ["", "web", "/web", "shop/", "/shop/web", "K/shop/", "a/b/c/d", "//"] {
            assert!(key(bad).is_err(), "{bad:?} was accepted");
        }
    }

    fn status_of_apply(documents: usize, applied: usize, code: tonic::Code, reason: ErrorReason) -> ApplyView {
        let message = "spec.ingress[0].ports[1].endPort: must be >= port";
        let status = rivet_common::grpc::status_with_reason(code, message, reason);
        ApplyView {
            documents,
            wait: false,
            applied: Vec::new(),
            failed: Some(FailureView::new(
                applied + 1,
                format!("line {}", applied * 10 + 1),
                &status,
                true,
            )),
        }
    }

    #[test]
    fn failures_say_what_stays_applied() {
        let text = |view: &ApplyView| failure_text(view, view.failed.as_ref().unwrap());
        assert_eq!(
            text(&status_of_apply(
                5,
                2,
                tonic::Code::InvalidArgument,
                ErrorReason::PolicyInvalid
            )),
            "error: document 3 (line 21) is invalid: spec.ingress[0].ports[1].endPort: must be >= port\n\
             It was not applied. Documents 1-2 before it stay applied. Documents 4-5 after it were not sent.\n"
        );
        assert_eq!(
            text(&status_of_apply(
                2,
                1,
                tonic::Code::FailedPrecondition,
                ErrorReason::PolicyOriginConflict
            )),
            "error: document 2 (line 11): FailedPrecondition: spec.ingress[0].ports[1].endPort: must be >= port\n\
             It was not applied. Document 1 before it stays applied.\n"
        );
        let deadline = status_of_apply(2, 0, tonic::Code::DeadlineExceeded, ErrorReason::NotRealisedInTime);
        assert_eq!(deadline.failed.as_ref().unwrap().applied, "yes");
        assert!(text(&deadline).ends_with(
            "\nIt is applied, but not every affected endpoint realised it in time. Document 2 after it was not sent.\n"
        ));
        let unknown = status_of_apply(1, 0, tonic::Code::Cancelled, ErrorReason::Unspecified);
        assert_eq!(unknown.failed.as_ref().unwrap().applied, "unknown");
        assert!(text(&unknown).ends_with("\nWhether it was applied is unknown (see `rivet policy list`).\n"));
        // Without --wait a deadline is a timeout like any other.
        let status = tonic::Status::deadline_exceeded("late");
        assert_eq!(FailureView::new(1, "line 1".into(), &status, false).applied, "unknown");
        // The reason decides, not the code: a FAILED_PRECONDITION that is
        // no policy conflict (svc-endpoint not ready) may have applied.
        let not_ready = status_of_apply(1, 0, tonic::Code::FailedPrecondition, ErrorReason::NotReady);
        assert_eq!(not_ready.failed.as_ref().unwrap().applied, "unknown");
        // A refused field (no reason) changed nothing.
        let field = tonic::Status::invalid_argument("key.name: required");
        assert_eq!(FailureView::new(1, "line 1".into(), &field, true).applied, "no");
    }

    #[test]
    fn normalized_json_keeps_key_order() {
        let text = r#"{"podSelector":{"app":"web"},"ingress":[{"ports":[{"port":80}],"from":[]}],"note":"a\"b, {c}: d","e":{}}"#;
        assert_eq!(
            pretty_json(text).unwrap(),
            "{\n  \"podSelector\": {\n    \"app\": \"web\"\n  },\n  \"ingress\": [\n    {\n      \"ports\": [\n        {\n          \
             \"port\": 80\n        }\n      ],\n      \"from\": []\n    }\n  ],\n  \"note\": \"a\\\"b, {c}: d\",\n  \"e\": {}\n}"
        );
        // Same layout as serde_json's where key order does not differ.
        let sorted = r#"{ "a" : [1, 2.5, null], "b" : { } , "c": true }"#;
        let value: serde_json::Value = serde_json::from_str(sorted).unwrap();
        assert_eq!(
            pretty_json(sorted).unwrap(),
            serde_json::to_string_pretty(&value).unwrap()
        );
        assert_eq!(pretty_json("not json"), None);
        assert_eq!(pretty_json(""), None);
    }

    #[test]
    fn applied_rows() {
        let a = |affected, realised| AppliedView {
            document: 1,
            location: "line 1".into(),
            key: key("shop/web").unwrap(),
            revision: 4,
            changed: true,
            affected_endpoints: affected,
            realised_endpoints: realised,
            selected_endpoints: Some(1),
        };
        let mut view = ApplyView {
            documents: 2,
            wait: false,
            applied: vec![a(3, 0)],
            failed: None,
        };
        assert_eq!(
            applied_table(&view),
            "DOC         KEY                     REVISION  CHANGED  ENDPOINTS\n\
             1 (line 1)  NetworkPolicy/shop/web  4         yes      3 affected\n"
        );
        view.wait = true;
        view.applied = vec![a(3, 3)];
        assert!(applied_table(&view).ends_with("  yes      3 affected, 3 realised\n"));
        view.applied.clear();
        assert_eq!(applied_table(&view), "");
    }
}

//! `rivet identity list|get`: identities as svc-identity knows them.

use clap::Subcommand;
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::net::{format_address, format_prefix};
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context};

const DAEMON: &str = "svc-identity";

/// `rivet identity ...`
#[derive(Debug, Subcommand)]
pub enum IdentityCommand {
    /// Every identity (reserved and cluster).
    List {
        /// Only identities referenced on this node.
        #[arg(long)]
        local: bool,
    },
    /// One identity by number.
    Get {
        /// The identity.
        id: u32,
    },
}

/// An identity as printed.
#[derive(Debug, Serialize)]
pub struct IdentityView {
    id: u32,
    kind: String,
    labels: Vec<String>,
    local_references: u32,
}

impl From<&pb::Identity> for IdentityView {
    fn from(i: &pb::Identity) -> Self {
        Self {
            id: i.id,
            kind: match pb::IdentityKind::try_from(i.kind) {
                Ok(pb::IdentityKind::Reserved) => "reserved",
                Ok(pb::IdentityKind::Cluster) => "cluster",
                Ok(pb::IdentityKind::Cidr) => "cidr",
                _ => "unknown",
            }
            .into(),
            labels: i.labels.clone(),
            local_references: i.local_references,
        }
    }
}

fn table(rows: &[IdentityView]) -> String {
    let mut t = Table::new(["ID", "KIND", "REFS", "LABELS"]);
    for r in rows {
        t.row([
            r.id.to_string(),
            r.kind.clone(),
            r.local_references.to_string(),
            r.labels.join(","),
        ]);
    }
    t.render()
}

/// Runs one `rivet identity` command.
pub async fn run(ctx: &Context, command: IdentityCommand) -> Result<(), CliError> {
    let mut client = IdentityServiceClient::new(ctx.connect(DAEMON).await?);
    let rpc = |s| CliError::rpc(DAEMON, s);
    let rows: Vec<IdentityView> = match command {
        IdentityCommand::List { local } => client
            .list_identities(pb::ListIdentitiesRequest {
                kind: 0,
                local_only: local,
                include_owners: false,
            })
            .await
            .map_err(rpc)?
            .into_inner()
            .identities
            .iter()
            .map(Into::into)
            .collect(),
        IdentityCommand::Get { id } => client
            .get_identity(pb::GetIdentityRequest {
                id,
                include_owners: false,
            })
            .await
            .map_err(rpc)?
            .into_inner()
            .identity
            .iter()
            .map(Into::into)
            .collect(),
    };
    ctx.print(&rows, || table(&rows));
    Ok(())
}

/// `rivet ipcache ...`
#[derive(Debug, Subcommand)]
pub enum IpcacheCommand {
    /// Every effective IP cache entry.
    List,
}

/// An IP cache entry as printed.
#[derive(Debug, Serialize)]
pub struct IpcacheView {
    prefix: String,
    identity: u32,
    source: String,
    host_ip: String,
    pod: String,
    node: String,
}

/// Runs one `rivet ipcache` command.
pub async fn run_ipcache(ctx: &Context, command: IpcacheCommand) -> Result<(), CliError> {
    let IpcacheCommand::List = command;
    let mut client =
        rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient::new(ctx.connect(DAEMON).await?);
    let mut rows = Vec::new();
    let mut start_after = None;
    loop {
        let r = client
            .list_ipcache(pb::ListIpcacheRequest {
                source: 0,
                page_size: 1000,
                start_after: start_after.take(),
            })
            .await
            .map_err(|s| CliError::rpc(DAEMON, s))?
            .into_inner();
        for e in &r.entries {
            rows.push(IpcacheView {
                prefix: e.prefix.as_ref().map_or_else(|| "-".into(), format_prefix),
                identity: e.identity,
                source: format!("{:?}", pb::IpcacheSource::try_from(e.source).unwrap_or_default()).to_lowercase(),
                host_ip: if e.host_ip.is_empty() {
                    String::new()
                } else {
                    format_address(&e.host_ip)
                },
                pod: if e.pod_name.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", e.pod_namespace, e.pod_name)
                },
                node: e.node_name.clone(),
            });
        }
        match (r.complete, r.entries.last()) {
            (false, Some(last)) if last.prefix.is_some() => start_after = last.prefix.clone(),
            _ => break,
        }
    }
    ctx.print(&rows, || {
        let mut t = Table::new(["PREFIX", "IDENTITY", "SOURCE", "HOST", "POD", "NODE"]);
        for r in &rows {
            t.row([
                r.prefix.clone(),
                r.identity.to_string(),
                r.source.clone(),
                r.host_ip.clone(),
                r.pod.clone(),
                r.node.clone(),
            ]);
        }
        t.render()
    });
    Ok(())
}

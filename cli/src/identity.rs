//! `rivet identity list|get`: identities as svc-identity knows them.

use clap::Subcommand;
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
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

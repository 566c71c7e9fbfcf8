//! `rivet ipam list|allocate|release|restore`: inspect and debug svc-ipam.

use std::net::IpAddr;

use clap::{Subcommand, ValueEnum};
use rivet_proto::ipam::v1 as pb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::net::{address_bytes, format_address, format_prefix};
use serde::Serialize;

use crate::table::Table;
use crate::{CliError, Context};

const DAEMON: &str = "svc-ipam";

/// Address family on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FamilyArg {
    /// IPv4.
    Ipv4,
    /// IPv6.
    Ipv6,
}

/// `rivet ipam ...`
#[derive(Debug, Subcommand)]
pub enum IpamCommand {
    /// Pools with their usage (and allocations with --allocations).
    List {
        /// Only this pool.
        #[arg(long)]
        pool: Option<String>,
        /// Also list every allocation.
        #[arg(long)]
        allocations: bool,
    },
    /// Allocate an address (debugging; the CNI plugin does this for pods).
    Allocate {
        /// Owner container id.
        #[arg(long)]
        container_id: String,
        /// Owner interface name.
        #[arg(long, default_value = "eth0")]
        interface: String,
        /// Pool (default: "default").
        #[arg(long, default_value = "")]
        pool: String,
        /// Address family.
        #[arg(long, value_enum, default_value_t = FamilyArg::Ipv4)]
        family: FamilyArg,
        /// A specific address.
        #[arg(long)]
        address: Option<IpAddr>,
    },
    /// Release what an owner holds, or one address with --address.
    Release {
        /// Owner container id.
        #[arg(long, required_unless_present = "address", conflicts_with = "address")]
        container_id: Option<String>,
        /// Owner interface name.
        #[arg(long, default_value = "eth0")]
        interface: String,
        /// Release this address whoever holds it.
        #[arg(long)]
        address: Option<IpAddr>,
        /// Pool the address must belong to.
        #[arg(long, default_value = "")]
        pool: String,
    },
}

/// One allocation as printed.
#[derive(Debug, Clone, Serialize)]
pub struct AllocationView {
    /// Pool.
    pub pool: String,
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    /// Address with prefix length, e.g. `198.18.0.2/24`.
    pub address: String,
    /// Gateway.
    pub gateway: String,
    /// Owner container id.
    pub container_id: String,
    /// Owner interface.
    pub interface: String,
}

impl From<&pb::Allocation> for AllocationView {
    fn from(a: &pb::Allocation) -> Self {
        let owner = a.owner.clone().unwrap_or_default();
        Self {
            pool: a.pool.clone(),
            family: family_name(a.family),
            address: if a.prefix_length > 0 {
                format!("{}/{}", format_address(&a.address), a.prefix_length)
            } else {
                format_address(&a.address)
            },
            gateway: format_address(&a.gateway),
            container_id: owner.container_id,
            interface: owner.interface,
        }
    }
}

/// A pool range as printed.
#[derive(Debug, Clone, Serialize)]
pub struct RangeView {
    /// Pool.
    pub pool: String,
    /// Where the pool comes from: `flag` (svc-ipam's --pool) or `set-pool`
    /// (the node's RivetNode via svc-k8s-sync, cluster-pool IPAM).
    pub source: &'static str,
    /// `ipv4` or `ipv6`.
    pub family: &'static str,
    /// CIDR.
    pub cidr: String,
    /// Gateway.
    pub gateway: String,
    /// Usable addresses.
    pub size: u64,
    /// Allocated.
    pub allocated: u64,
    /// Available.
    pub available: u64,
}

/// `rivet ipam list` output.
#[derive(Debug, Clone, Serialize)]
pub struct ListView {
    /// Boot id of the answering svc-ipam.
    pub boot_id: String,
    /// Ranges with usage.
    pub ranges: Vec<RangeView>,
    /// Allocations (with --allocations).
    pub allocations: Vec<AllocationView>,
    /// Allocations outside every configured range.
    pub orphaned: Vec<AllocationView>,
}

fn family_name(raw: i32) -> &'static str {
    match pb::Family::try_from(raw) {
        Ok(pb::Family::Ipv4) => "ipv4",
        Ok(pb::Family::Ipv6) => "ipv6",
        _ => "unknown",
    }
}

fn source_name(raw: i32) -> &'static str {
    match pb::PoolSource::try_from(raw) {
        Ok(pb::PoolSource::Flag) => "flag",
        Ok(pb::PoolSource::SetPool) => "set-pool",
        _ => "unknown",
    }
}

fn allocations_table(rows: &[AllocationView]) -> String {
    let mut t = Table::new(["POOL", "FAMILY", "ADDRESS", "GATEWAY", "CONTAINER", "INTERFACE"]);
    for a in rows {
        t.row([
            a.pool.as_str(),
            a.family,
            &a.address,
            &a.gateway,
            &a.container_id,
            &a.interface,
        ]);
    }
    t.render()
}

/// Runs one `rivet ipam` command.
pub async fn run(ctx: &Context, command: IpamCommand) -> Result<(), CliError> {
    let mut client = IpamClient::new(ctx.connect(DAEMON).await?);
    let rpc = |s| CliError::rpc(DAEMON, s);
    match command {
        IpamCommand::List { pool, allocations } => {
            let show_allocations = allocations;
            let r = client
                .list(pb::ListRequest {
                    pool: pool.unwrap_or_default(),
                    include_allocations: show_allocations,
                })
                .await
                .map_err(rpc)?
                .into_inner();
            let view = ListView {
                boot_id: r.boot_id.clone(),
                ranges: r
                    .pools
                    .iter()
                    .flat_map(|p| {
                        p.ranges.iter().map(|g| RangeView {
                            pool: p.name.clone(),
                            source: source_name(p.source),
                            family: family_name(g.family),
                            cidr: g.cidr.as_ref().map_or_else(|| "-".into(), format_prefix),
                            gateway: format_address(&g.gateway),
                            size: g.size,
                            allocated: g.allocated,
                            available: g.available,
                        })
                    })
                    .collect(),
                allocations: r
                    .pools
                    .iter()
                    .flat_map(|p| p.allocations.iter().map(Into::into))
                    .collect(),
                orphaned: r.orphaned.iter().map(Into::into).collect(),
            };
            ctx.print(&view, || {
                let mut t = Table::new([
                    "POOL",
                    "SOURCE",
                    "FAMILY",
                    "CIDR",
                    "GATEWAY",
                    "SIZE",
                    "ALLOCATED",
                    "AVAILABLE",
                ]);
                for g in &view.ranges {
                    t.row([
                        g.pool.clone(),
                        g.source.to_string(),
                        g.family.to_string(),
                        g.cidr.clone(),
                        g.gateway.clone(),
                        g.size.to_string(),
                        g.allocated.to_string(),
                        g.available.to_string(),
                    ]);
                }
                let mut out = t.render();
                if show_allocations {
                    out.push('\n');
                    out.push_str(&allocations_table(&view.allocations));
                }
                if !view.orphaned.is_empty() {
                    out.push_str("\nOrphaned (outside every configured range, kept until released):\n");
                    out.push_str(&allocations_table(&view.orphaned));
                }
                out
            });
        }
        IpamCommand::Allocate {
            container_id,
            interface,
            pool,
            family,
            address,
        } => {
            let r = client
                .allocate(pb::AllocateRequest {
                    owner: Some(pb::Owner {
                        container_id,
                        interface,
                    }),
                    pool,
                    family: match family {
                        FamilyArg::Ipv4 => pb::Family::Ipv4,
                        FamilyArg::Ipv6 => pb::Family::Ipv6,
                    } as i32,
                    requested_address: address.map(address_bytes).unwrap_or_default(),
                })
                .await
                .map_err(rpc)?
                .into_inner();
            let view: Vec<AllocationView> = r.allocation.iter().map(Into::into).collect();
            ctx.print(&view, || allocations_table(&view));
        }
        IpamCommand::Release {
            container_id,
            interface,
            address,
            pool,
        } => {
            let r = match (container_id, address) {
                (Some(container_id), None) => client
                    .release(pb::ReleaseRequest {
                        owner: Some(pb::Owner {
                            container_id,
                            interface,
                        }),
                    })
                    .await
                    .map_err(rpc)?,
                (None, Some(address)) => client
                    .release_address(pb::ReleaseAddressRequest {
                        pool,
                        address: address_bytes(address),
                    })
                    .await
                    .map_err(rpc)?,
                _ => return Err(CliError::NoReleaseTarget),
            }
            .into_inner();
            let view: Vec<AllocationView> = r.released.iter().map(Into::into).collect();
            ctx.print(&view, || {
                if view.is_empty() {
                    "nothing was held; nothing released\n".to_string()
                } else {
                    format!("released:\n{}", allocations_table(&view))
                }
            });
        }
    }
    Ok(())
}

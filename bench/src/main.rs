//! `rivet-bench <name>`: runs one benchmark, prints its `RESULT` line and
//! writes `target/rivet-bench/<name>.json`. Run it through `cargo xtask bench`.

mod cluster;
mod cni;
mod datapath;
mod endpoint;
mod gc;
mod identity;
mod ipam;
mod k8s;
mod kube_proxy;
mod multinode;
mod multinode_scale;
mod operator;
mod procfs;
mod report;
mod scale;
mod services;
mod verdict;

use clap::{Parser, Subcommand};

/// Rivet's benchmarks. Each compares against a peer measured in the same run.
#[derive(Debug, Parser)]
#[command(name = "rivet-bench")]
struct Cli {
    /// List the benchmarks and exit.
    #[arg(long)]
    list: bool,
    #[command(subcommand)]
    bench: Option<Bench>,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Allocate+Release pairs/s over svc-ipam's socket vs in-process.
    Ipam(ipam::IpamArgs),
    /// iperf3 pod→pod through Rivet's datapath vs plain veth routing, interleaved rounds; ApplyEndpoint latency.
    Datapath(datapath::DatapathArgs),
    /// ns/packet of from_container and to_container (BPF_PROG_TEST_RUN: CT hit, CT miss, v4, v6) vs a
    /// program that only returns TC_ACT_OK.
    Verdict(verdict::VerdictArgs),
    /// New and cached identity allocations/s over svc-identity's socket vs raw etcd CAS txns/s.
    Identity(identity::IdentityArgs),
    /// svc-endpoint on one node: first-regeneration latency vs raw ApplyEndpoint, a policy change on 500
    /// endpoints, restore of 1000 after kill -9, daemons' RSS.
    Endpoint(endpoint::EndpointArgs),
    /// svc-gc: a pass over 1M conntrack entries (10% expired) vs a raw batch dump; CPU s/min at steady state.
    Gc(gc::GcArgs),
    /// rivet-cni ADD/DEL latency and pods ready/s on one node vs the reference bridge + host-local plugins.
    Cni(cni::CniArgs),
    /// A real kube-apiserver: NetworkPolicy through the API vs UpsertPolicy on 500 endpoints, pod label
    /// patch to new identity, svc-k8s-sync's re-list of 10,000 pods and 1,000 policies, RSS and CPU.
    K8s(k8s::K8sArgs),
    /// rivet-operator: 1000 nodes joining until all hold pod CIDRs vs the API's own create rate; identity GC
    /// rounds over 100,000 identities on etcd vs a raw range scan of the same keys.
    Operator(operator::OperatorArgs),
    /// Cross-node pod-to-pod TCP (iperf3, 1-byte request/response): Rivet native vs kernel routing, Rivet vxlan
    /// vs kernel VXLAN with static FDB, in the same topology; node-to-node latency; then the multinode-scale figures.
    Multinode(multinode::MultinodeArgs),
    /// 50 simulated nodes x 200 pods published in etcd until a real node's pinned ipcache holds them all:
    /// convergence time, the node daemons' RSS and CPU, one more pod's p50/p99 until it is in the map.
    MultinodeScale(multinode_scale::ScaleArgs),
    /// ClusterIP load balancing vs kube-proxy's iptables rules in the same topology: new connections/s and
    /// connect p50/p99 at 1, 1,000, 10,000 services, ClusterIP vs pod IP throughput, programming latency.
    Services(services::ServicesArgs),
    /// A real kubelet cluster: a 100-pod Deployment until every pod is Running on Rivet (deploy/) vs on the
    /// reference bridge + host-local plugins (a RuntimeClass) on the same cluster, interleaved rounds.
    Cluster(cluster::ClusterArgs),
    /// Resource bounds: one node at 10,000 endpoints, 100,000 identities in etcd and 1M conntrack entries;
    /// each node daemon's VmRSS, Pss and idle CPU against the 256 MiB goal (fails beyond it).
    Scale(scale::ResourceArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let bench = match (cli.list, cli.bench) {
        (false, Some(b)) => b,
        _ => {
            println!(
                "ipam  Allocate+Release pairs/s over svc-ipam's socket vs in-process (ratio = socket / in-process)"
            );
            println!(
                "datapath  iperf3 pod-to-pod through Rivet's BPF vs plain veth routing, interleaved rounds (ratio = \
                 median of the rounds' Rivet / plain, with min and max)"
            );
            println!(
                "verdict  ns/packet of from_container and to_container under BPF_PROG_TEST_RUN (conntrack hit and \
                 miss, IPv4 and IPv6) vs a tc program that only returns TC_ACT_OK (ratio = from_container IPv4 hit / \
                 floor)"
            );
            println!(
                "identity  new identity allocations/s over svc-identity's socket vs raw etcd CAS txns/s \
                 (ratio = new allocations / raw CAS)"
            );
            println!(
                "endpoint  first-regeneration p50 (sync CreateEndpoint) vs raw svc-loader ApplyEndpoint p50; policy \
                 change on 500 endpoints, restore of 1000, RSS (ratio = regeneration / ApplyEndpoint, lower is better)"
            );
            println!(
                "gc  svc-gc pass over 1M entries (10% expired) vs raw BPF_MAP_LOOKUP_BATCH dump of the same map; \
                 CPU s/min with 100k live entries (ratio = pass / dump, lower is better)"
            );
            println!(
                "cni  rivet-cni ADD/DEL p50/p99 and pods ready/s (concurrent ADDs) on one node vs the reference \
                 bridge + host-local plugins in the same node namespace (ratio = ADD p50 / bridge ADD p50, lower is \
                 better)"
            );
            println!(
                "k8s  a NetworkPolicy through a real kube-apiserver realised on 500 endpoints vs the same policy \
                 through UpsertPolicy (origin API), interleaved; pod label patch to new identity p50/p99; \
                 svc-k8s-sync's initial list of 10,000 pods and 1,000 policies, RSS, steady CPU (ratio = API p50 / \
                 UpsertPolicy p50, goal <= 1.5)"
            );
            println!(
                "operator  1000 nodes joining a real kube-apiserver until every one holds pod CIDRs (cluster-pool \
                 duty) vs the same creates with no duty; identity GC over 100,000 identities (10% unused) on etcd: \
                 round 1 (marking) vs a raw paged range scan of the same keys, round 2 (deletes/s) (ratio = round 1 / \
                 raw scan, goal <= 2)"
            );
            println!(
                "multinode  cross-node pod-to-pod iperf3 and 1-byte TCP request/response: Rivet native vs kernel \
                 routing, Rivet vxlan vs kernel VXLAN with static FDB entries, interleaved rounds; Rivet vxlan RR p50 \
                 / node-to-node RR p50; then the multinode-scale figures (ratio = the lower throughput ratio, goal \
                 >= 0.95)"
            );
            println!(
                "multinode-scale  50 simulated nodes x 200 pods in etcd (a lease each, svc-identity's store code) until \
                 a real node's pinned ipcache holds all 10,000 with identity and tunnel endpoint; RSS and CPU of \
                 svc-identity and svc-loader; one more pod etcd put -> map p50/p99 (ratio = converge / publish)"
            );
            println!(
                "services  new TCP connections/s and connect p50/p99 pod -> ClusterIP with 1, 1,000, 10,000 services \
                 through Rivet vs kube-proxy's iptables rules (iptables-restore, same topology); ClusterIP vs pod IP \
                 throughput; a 100-backend service and a backend change programmed, p50/p99 (ratio = Rivet / iptables \
                 conn/s at the largest count, goal >= 2)"
            );
            println!(
                "cluster  a 100-replica Deployment until every pod is Running on a real kubelet cluster: Rivet \
                 (kubectl apply -k deploy/) vs the reference bridge + host-local plugins on the same cluster \
                 (RuntimeClass), interleaved rounds; pods Running/s (ratio = median of per-round Rivet / bridge \
                 times, goal <= 1.2)"
            );
            println!(
                "scale  one node at 10,000 endpoints, 100,000 identities in etcd and 1M conntrack entries: each node \
                 daemon's VmRSS, Pss, Private_Dirty and idle CPU, the time to reach each size (ratio = the daemons' \
                 VmRSS sum / 256 MiB goal; fails above 1)"
            );
            return Ok(());
        }
    };
    let result = match bench {
        Bench::Ipam(args) => ipam::run(&args).await?,
        Bench::Datapath(args) => datapath::run(&args).await?,
        Bench::Verdict(args) => verdict::run(&args).await?,
        Bench::Identity(args) => identity::run(&args).await?,
        Bench::Endpoint(args) => endpoint::run(&args).await?,
        Bench::Gc(args) => gc::run(&args).await?,
        Bench::Cni(args) => cni::run(&args).await?,
        Bench::K8s(args) => k8s::run(&args).await?,
        Bench::Operator(args) => operator::run(&args).await?,
        Bench::Multinode(args) => multinode::run(&args).await?,
        Bench::MultinodeScale(args) => multinode_scale::run(&args).await?,
        Bench::Services(args) => services::run(&args).await?,
        Bench::Cluster(args) => cluster::run(&args).await?,
        Bench::Scale(args) => scale::run(&args).await?,
    };
    result.publish(&report::target_dir()?)?;
    Ok(())
}

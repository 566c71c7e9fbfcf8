//! The `services` benchmark's peer: kube-proxy's iptables mode, written as
//! kube-proxy writes it and loaded with Debian's `iptables-restore`
//! (`ip6tables-restore` for IPv6; the nf_tables backend Debian ships) into a
//! namespace the benchmark owns, never the host's tables.
//!
//! The rules have kube-proxy's shape (pkg/proxy/iptables/proxier.go, v1.34):
//! `PREROUTING`/`OUTPUT` jump to `KUBE-SERVICES`, which holds one rule per
//! service port (its ClusterIP, protocol and port) jumping to that port's
//! `KUBE-SVC-<hash>` chain; that chain marks traffic from outside the
//! cluster CIDR for masquerade (`KUBE-MARK-MASQ`) and picks an endpoint
//! chain `KUBE-SEP-<hash>` with `-m statistic --mode random --probability
//! 1/(n-i)`; an endpoint chain marks hairpin traffic (from the backend
//! itself) and DNATs to the backend. `KUBE-POSTROUTING` masquerades marked
//! packets, and the filter table's `KUBE-FORWARD` accepts marked and
//! established traffic, as kube-proxy's do. Chain names are kube-proxy's:
//! the first 16 characters of the base32 SHA-256 of the service port name
//! and protocol (and the endpoint, for `KUBE-SEP-`).
//!
//! A new connection walks `KUBE-SERVICES` rule by rule until its service's
//! rule matches (kube-proxy writes the services in its map's order, so a
//! service sits anywhere in the chain); conntrack carries the rest of the
//! connection. That linear walk is what the benchmark sets Rivet's hash
//! lookups against.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use ipnet::IpNet;
use rivet_common::testing::netns::NetNs;
use sha2::{Digest, Sha256};

/// The mark kube-proxy sets on packets to masquerade (`--masquerade-bit 14`).
const MASQ_MARK: &str = "0x4000/0x4000";

/// One port of one Service as kube-proxy's iptables mode programs it (TCP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// `<namespace>/<name>:<port name>`, kube-proxy's `ServicePortName`.
    pub name: String,
    /// The ClusterIP and port.
    pub frontend: SocketAddr,
    /// The ready endpoints (pod address and target port), all of the
    /// frontend's family.
    pub endpoints: Vec<SocketAddr>,
}

impl ServicePort {
    /// `KUBE-SVC-<hash>`.
    pub fn chain(&self) -> String {
        format!("KUBE-SVC-{}", port_proto_hash(&[&self.name, "tcp"]))
    }

    /// `KUBE-SEP-<hash>` of `endpoint`.
    pub fn endpoint_chain(&self, endpoint: SocketAddr) -> String {
        format!(
            "KUBE-SEP-{}",
            port_proto_hash(&[&self.name, "tcp", &endpoint.to_string()])
        )
    }
}

/// kube-proxy's `portProtoHash`: base32 (RFC 4648, padded alphabet) of the
/// SHA-256 of the concatenated parts, first 16 characters.
fn port_proto_hash(parts: &[&str]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update(part.as_bytes());
    }
    let mut encoded = data_encoding::BASE32.encode(&hash.finalize());
    encoded.truncate(16);
    encoded
}

/// The `iptables-restore` input of kube-proxy's rules for `services` (one
/// family: every address in them and `cluster_cidr` must be of it): the nat
/// and the filter table, each flushed and rewritten whole, as kube-proxy's
/// full sync does.
pub fn restore_input(cluster_cidr: IpNet, services: &[ServicePort]) -> String {
    let host_len = if cluster_cidr.addr().is_ipv4() { 32 } else { 128 };
    let mut chains = String::new();
    let mut rules = String::new();
    // Writing to a String cannot fail.
    let w = |s: &mut String, line: std::fmt::Arguments<'_>| {
        s.write_fmt(line).expect("writing to a String");
        s.push('\n');
    };

    w(&mut chains, format_args!("*nat"));
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        w(&mut chains, format_args!(":{chain} - [0:0]"));
    }
    let portals = "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES";
    w(&mut rules, format_args!("-A PREROUTING {portals}"));
    w(&mut rules, format_args!("-A OUTPUT {portals}"));
    w(
        &mut rules,
        format_args!("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING"),
    );
    w(
        &mut rules,
        format_args!("-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK} -j RETURN"),
    );
    w(
        &mut rules,
        format_args!("-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000"),
    );
    w(
        &mut rules,
        format_args!(
            "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE \
             --random-fully"
        ),
    );
    w(&mut rules, format_args!("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000"));

    for service in services {
        let svc_chain = service.chain();
        let (vip, port) = (service.frontend.ip(), service.frontend.port());
        let comment = format!("\"{} cluster IP\"", service.name);
        w(&mut chains, format_args!(":{svc_chain} - [0:0]"));
        w(
            &mut rules,
            format_args!(
                "-A KUBE-SERVICES -d {vip}/{host_len} -p tcp -m comment --comment {comment} -m tcp --dport {port} \
                 -j {svc_chain}"
            ),
        );
        w(
            &mut rules,
            format_args!(
                "-A {svc_chain} ! -s {cluster_cidr} -d {vip}/{host_len} -p tcp -m comment --comment {comment} -m tcp \
                 --dport {port} -j KUBE-MARK-MASQ"
            ),
        );
        let n = service.endpoints.len();
        for (i, endpoint) in service.endpoints.iter().enumerate() {
            let sep_chain = service.endpoint_chain(*endpoint);
            let comment = format!("\"{} -> {endpoint}\"", service.name);
            // kube-proxy's computeProbability: the i-th of n endpoints is taken
            // with 1/(n-i) of what the earlier ones left; the last always.
            let statistic = if i + 1 < n {
                format!("-m statistic --mode random --probability {:.10} ", 1.0 / (n - i) as f64)
            } else {
                String::new()
            };
            w(&mut chains, format_args!(":{sep_chain} - [0:0]"));
            w(
                &mut rules,
                format_args!("-A {svc_chain} -m comment --comment {comment} {statistic}-j {sep_chain}"),
            );
            let name = &service.name;
            w(
                &mut rules,
                format_args!(
                    "-A {sep_chain} -s {}/{host_len} -m comment --comment \"{name}\" -j KUBE-MARK-MASQ",
                    endpoint.ip()
                ),
            );
            w(
                &mut rules,
                format_args!(
                    "-A {sep_chain} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {endpoint}"
                ),
            );
        }
    }
    w(
        &mut rules,
        format_args!(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule \
             in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
        ),
    );
    let mut input = chains;
    input.push_str(&rules);
    input.push_str("COMMIT\n");

    input.push_str(
        "*filter\n:KUBE-FORWARD - [0:0]\n\
         -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
         -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n",
    );
    let _ = writeln!(
        input,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ_MARK} -j ACCEPT"
    );
    input.push_str(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate \
         RELATED,ESTABLISHED -j ACCEPT\nCOMMIT\n",
    );
    input
}

/// The restore program of `family`'s tables.
fn restore_program(ipv4: bool) -> &'static str {
    if ipv4 { "iptables-restore" } else { "ip6tables-restore" }
}

/// Loads `input` (from [`restore_input`]) into `ns`'s tables of the family
/// of `ipv4`, replacing the tables it names, as kube-proxy's full sync does.
pub fn restore(ns: &NetNs, ipv4: bool, input: &str) -> anyhow::Result<()> {
    run_restore(ns, restore_program(ipv4), &[], input)
}

/// Loads `input` into `ns` without flushing the tables first (`--noflush`):
/// the chains it declares are flushed and rewritten, the others kept, as
/// kube-proxy's partial sync of the services that changed does.
pub fn restore_noflush(ns: &NetNs, ipv4: bool, input: &str) -> anyhow::Result<()> {
    run_restore(ns, restore_program(ipv4), &["--noflush"], input)
}

fn run_restore(ns: &NetNs, program: &str, args: &[&str], input: &str) -> anyhow::Result<()> {
    // `ip netns exec`: iptables talks netlink in the namespace it runs in.
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns.name(), program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            anyhow::anyhow!(
                "starting {program} in {}: {e} (cargo xtask install installs it)",
                ns.name()
            )
        })?;
    let written = child.stdin.take().expect("stdin is piped").write_all(input.as_bytes());
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "{program} {} in {} failed ({}): {}",
        args.join(" "),
        ns.name(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    written.map_err(|e| anyhow::anyhow!("writing the rules to {program} in {}: {e}", ns.name()))
}

/// The `--noflush` input of kube-proxy's partial sync after `changed`'s
/// endpoints changed, with `services` (changed among them) installed: the
/// whole `KUBE-SERVICES` chain and the changed service's own chains
/// (kube-proxy writes `KUBE-SERVICES` in full on every sync and only the
/// chains of services that changed). Endpoint chains the change left behind
/// (`removed_endpoints` not among its new ones) are flushed and deleted.
pub fn partial_sync_input(
    cluster_cidr: IpNet,
    services: &[ServicePort],
    changed: &ServicePort,
    removed_endpoints: &[SocketAddr],
) -> String {
    let full = restore_input(cluster_cidr, services);
    let nat = full.split("COMMIT\n").next().unwrap_or_default();
    let svc_chain = changed.chain();
    let own: Vec<String> = std::iter::once(svc_chain.clone())
        .chain(changed.endpoints.iter().map(|e| changed.endpoint_chain(*e)))
        .collect();
    let gone: Vec<String> = removed_endpoints
        .iter()
        .filter(|e| !changed.endpoints.contains(e))
        .map(|e| changed.endpoint_chain(*e))
        .collect();
    let mut input = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
    // Declaring a chain flushes it: the gone ones are empty when deleted.
    for chain in own.iter().chain(&gone) {
        let _ = writeln!(input, ":{chain} - [0:0]");
    }
    for line in nat.lines() {
        let owned = own.iter().any(|c| line.starts_with(&format!("-A {c} ")));
        if line.starts_with("-A KUBE-SERVICES ") || owned {
            input.push_str(line);
            input.push('\n');
        }
    }
    for chain in &gone {
        let _ = writeln!(input, "-X {chain}");
    }
    input.push_str("COMMIT\n");
    input
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    use rivet_common::testing::netns::{PodSpec, TestNode};

    use super::*;

    fn service(i: u8, endpoints: &[&str]) -> ServicePort {
        ServicePort {
            name: format!("bench/s{i}:http"),
            frontend: SocketAddr::new(Ipv4Addr::new(198, 18, 128, i).into(), 80),
            endpoints: endpoints.iter().map(|e| e.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn chain_names_are_kube_proxys() {
        // kube-proxy's KUBE-SVC chain of kube-system/kube-dns:dns-tcp, as
        // every cluster's `iptables-save` shows it.
        let dns = ServicePort {
            name: "kube-system/kube-dns:dns-tcp".into(),
            frontend: "10.96.0.10:53".parse().unwrap(),
            endpoints: vec![],
        };
        assert_eq!(dns.chain(), "KUBE-SVC-ERIFXISQEP7F7OF4");
        let sep = dns.endpoint_chain("10.244.0.2:53".parse().unwrap());
        assert!(sep.starts_with("KUBE-SEP-") && sep.len() == 25, "{sep}");
    }

    #[test]
    fn endpoints_are_chosen_with_kube_proxys_probabilities() {
        let input = restore_input(
            "198.18.0.0/16".parse().unwrap(),
            &[service(1, &["198.18.0.3:8080", "198.18.0.4:8080", "198.18.0.5:8080"])],
        );
        let svc = service(1, &[]).chain();
        let picks: Vec<&str> = input
            .lines()
            .filter(|l| l.starts_with(&format!("-A {svc} ")) && l.contains("KUBE-SEP-"))
            .collect();
        assert_eq!(picks.len(), 3, "{input}");
        assert!(picks[0].contains("--probability 0.3333333333 "), "{}", picks[0]);
        assert!(picks[1].contains("--probability 0.5000000000 "), "{}", picks[1]);
        assert!(!picks[2].contains("statistic"), "{}", picks[2]);
        assert!(input.contains("-j DNAT --to-destination 198.18.0.5:8080"));
        assert!(input.contains("! -s 198.18.0.0/16 -d 198.18.128.1/32 -p tcp"));
        // The NodePort rule stays last in KUBE-SERVICES.
        let last = input.lines().rfind(|l| l.starts_with("-A KUBE-SERVICES ")).unwrap();
        assert!(last.ends_with("-j KUBE-NODEPORTS"), "{last}");
    }

    #[test]
    fn ipv6_rules_use_host_prefixes_and_bracketed_destinations() {
        let v6 = ServicePort {
            name: "bench/s6:http".into(),
            frontend: SocketAddr::new(Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, 1).into(), 80),
            endpoints: vec!["[2001:2::3]:8080".parse().unwrap()],
        };
        let input = restore_input("2001:2::/64".parse().unwrap(), &[v6]);
        assert!(input.contains("-d 2001:2:0:ff::1/128 -p tcp"), "{input}");
        assert!(input.contains("-j DNAT --to-destination [2001:2::3]:8080"), "{input}");
        assert!(input.contains("-s 2001:2::3/128 -m comment"), "{input}");
    }

    /// The rules in a real namespace: connections to the ClusterIP reach
    /// every backend, a partial sync moves the service to new endpoints,
    /// and nothing outside the namespace changes.
    #[test]
    fn the_rules_load_and_translate_in_a_namespace() {
        let mut node = TestNode::with_host_prefix("rbk").unwrap();
        let spec = |name: &str, n: u8| {
            PodSpec::new(
                name,
                (Ipv4Addr::new(198, 18, 0, n), 24),
                (Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, u16::from(n)), 64),
            )
            .gateways(Ipv4Addr::new(198, 18, 0, 1), Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1))
            .static_gateway_neighbor(true)
        };
        for (name, n) in [("client", 2), ("b1", 3), ("b2", 4), ("b3", 5)] {
            node.add_pod(spec(name, n)).unwrap();
        }
        let servers: Vec<_> = ["b1", "b2", "b3"]
            .iter()
            .map(|b| node.pod(b).tcp_server(8080).unwrap())
            .collect();
        let cidr: IpNet = "198.18.0.0/16".parse().unwrap();
        let mut services: Vec<ServicePort> = (1..=50).map(|i| service(i, &["198.18.0.5:8080"])).collect();
        services[20] = service(21, &["198.18.0.3:8080", "198.18.0.4:8080"]);
        restore(&node.ns, true, &restore_input(cidr, &services)).unwrap();
        let listed = node.ns.run(&["iptables", "-t", "nat", "-S"]).unwrap();
        assert_eq!(
            listed.lines().filter(|l| l.starts_with("-A KUBE-SERVICES ")).count(),
            51,
            "{listed}"
        );

        let client = node.pod("client");
        let vip = services[20].frontend;
        for _ in 0..40 {
            assert!(client.tcp_echo(vip, Duration::from_secs(2)).unwrap());
        }
        let counts: Vec<u64> = servers.iter().map(|s| s.connections()).collect();
        assert!(counts[0] > 0 && counts[1] > 0 && counts[2] == 0, "{counts:?}");

        // Partial sync: service 21 moves to b3 only.
        let before = services[20].clone();
        services[20] = service(21, &["198.18.0.5:8080"]);
        let input = partial_sync_input(cidr, &services, &services[20], &before.endpoints);
        restore_noflush(&node.ns, true, &input).unwrap();
        for _ in 0..10 {
            assert!(client.tcp_echo(vip, Duration::from_secs(2)).unwrap());
        }
        let after: Vec<u64> = servers.iter().map(|s| s.connections()).collect();
        assert_eq!((after[0], after[1], after[2]), (counts[0], counts[1], 10));
        let listed = node.ns.run(&["iptables", "-t", "nat", "-S"]).unwrap();
        assert!(
            !listed.contains(&before.endpoint_chain(before.endpoints[0])),
            "{listed}"
        );
    }
}

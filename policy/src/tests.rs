//! Table tests of the policy engine: the examples of the Kubernetes
//! NetworkPolicy documentation, Rivet's additions, validation errors, the
//! repository, and a large cluster checked against an independent oracle.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use rivet_common::identity::{CIDR_IDENTITY_MIN, is_cluster};
use rivet_common::labels::Labels;

use super::documents::{DocumentsError, Location};
use super::*;

// ------------------------------------------------------------------ fixture

/// The labels of a namespace (the caller always adds kubernetes.io/metadata.name).
fn namespace_labels(namespace: &str) -> Vec<(&'static str, &'static str)> {
    match namespace {
        "shop" => vec![("team", "shop")],
        "myproject" => vec![("project", "myproject")],
        "alice" => vec![("user", "alice")],
        "bob" => vec![("user", "bob")],
        "other" => vec![("project", "other")],
        _ => vec![],
    }
}

/// Identity labels of a pod: its own labels plus namespace and namespace labels.
fn pod(namespace: &str, own: &str) -> Labels {
    let own: Labels = own.parse().unwrap();
    let mut ns = namespace_labels(namespace);
    ns.push(("kubernetes.io/metadata.name", namespace));
    own.with_namespace(namespace, ns).unwrap()
}

const WEB: u32 = 256; // shop app=web
const DB: u32 = 257; // shop app=db
const SHOP_FRONT: u32 = 258; // shop role=frontend
const DEF_DB: u32 = 259; // default role=db
const DEF_FRONT: u32 = 260; // default role=frontend
const MYPROJ: u32 = 261; // myproject app=tool
const OTHER_FRONT: u32 = 262; // other role=frontend
const ALICE_CLIENT: u32 = 270; // alice role=client
const ALICE_SERVER: u32 = 271; // alice role=server
const DEF_CLIENT: u32 = 272; // default role=client
const BOB_CLIENT: u32 = 273; // bob role=client

const C172: u32 = CIDR_IDENTITY_MIN; // 172.17.0.0/16
const C172_1: u32 = CIDR_IDENTITY_MIN + 1; // 172.17.1.0/24
const C172_128: u32 = CIDR_IDENTITY_MIN + 2; // 172.17.128.0/17
const C10_0: u32 = CIDR_IDENTITY_MIN + 3; // 10.0.0.0/24
const C10: u32 = CIDR_IDENTITY_MIN + 4; // 10.0.0.0/8
const C10_1: u32 = CIDR_IDENTITY_MIN + 5; // 10.1.0.0/16
const C10_1_2: u32 = CIDR_IDENTITY_MIN + 6; // 10.1.2.0/24
const C10_2: u32 = CIDR_IDENTITY_MIN + 7; // 10.2.0.0/16
const C192: u32 = CIDR_IDENTITY_MIN + 8; // 192.168.0.0/16
const C6: u32 = CIDR_IDENTITY_MIN + 9; // 2001:db8::/32

fn identity(id: u32) -> Labels {
    match id {
        WEB => pod("shop", "k8s:app=web"),
        DB => pod("shop", "k8s:app=db"),
        SHOP_FRONT => pod("shop", "k8s:role=frontend"),
        DEF_DB => pod("default", "k8s:role=db"),
        DEF_FRONT => pod("default", "k8s:role=frontend"),
        MYPROJ => pod("myproject", "k8s:app=tool"),
        OTHER_FRONT => pod("other", "k8s:role=frontend"),
        ALICE_CLIENT => pod("alice", "k8s:role=client"),
        ALICE_SERVER => pod("alice", "k8s:role=server"),
        DEF_CLIENT => pod("default", "k8s:role=client"),
        BOB_CLIENT => pod("bob", "k8s:role=client"),
        _ => panic!("no identity {id} in the fixture"),
    }
}

const CLUSTER_IDS: [u32; 11] = [
    WEB,
    DB,
    SHOP_FRONT,
    DEF_DB,
    DEF_FRONT,
    MYPROJ,
    OTHER_FRONT,
    ALICE_CLIENT,
    ALICE_SERVER,
    DEF_CLIENT,
    BOB_CLIENT,
];

const CIDRS: [(&str, u32); 10] = [
    ("172.17.0.0/16", C172),
    ("172.17.1.0/24", C172_1),
    ("172.17.128.0/17", C172_128),
    ("10.0.0.0/24", C10_0),
    ("10.0.0.0/8", C10),
    ("10.1.0.0/16", C10_1),
    ("10.1.2.0/24", C10_1_2),
    ("10.2.0.0/16", C10_2),
    ("192.168.0.0/16", C192),
    ("2001:db8::/32", C6),
];

fn net(text: &str) -> IpNet {
    text.parse().unwrap()
}

/// Every fixture identity and CIDR identity.
fn fixture() -> SelectorCache {
    let mut cache = SelectorCache::new();
    for id in CLUSTER_IDS {
        assert!(cache.upsert_identity(id, identity(id)));
    }
    for (prefix, id) in CIDRS {
        assert!(cache.set_cidr_identity(net(prefix), id));
    }
    cache
}

/// A small cache for tests that list whole reserved or CIDR groups.
fn small_fixture() -> SelectorCache {
    let mut cache = SelectorCache::new();
    cache.upsert_identity(WEB, identity(WEB));
    cache.upsert_identity(DB, identity(DB));
    cache.set_cidr_identity(net("10.0.0.0/8"), C10);
    cache
}

fn repo(documents: &[&str]) -> PolicyRepository {
    let mut repo = PolicyRepository::new();
    for document in documents {
        let policy = Policy::parse(document).unwrap_or_else(|e| panic!("{e}\n{document}"));
        repo.upsert(policy, PolicyOrigin::Api).unwrap();
    }
    repo
}

/// `Ingress Allow 256 TCP 80` style entries and `Egress prefix 10.0.0.0/8
/// 16777220` style prefixes, sorted.
fn shown(resolved: &ResolvedPolicy) -> Vec<String> {
    let mut out: Vec<String> = resolved.entries.iter().map(Entry::to_string).collect();
    out.extend(
        resolved
            .prefixes
            .iter()
            .map(|p| format!("{} prefix {} {}", p.direction, p.prefix, p.identity)),
    );
    out.sort();
    out
}

fn sorted(expected: &[String]) -> Vec<String> {
    let mut out = expected.to_vec();
    out.sort();
    out
}

/// `e("Ingress Allow", 256, "TCP 80")`; peer 0 shows as `*`.
fn e(head: &str, peer: u32, tail: &str) -> String {
    let peer = if peer == 0 { "*".to_string() } else { peer.to_string() };
    format!("{head} {peer} {tail}")
}

/// An address-matched entry: `a("Egress Allow", C10, "TCP 443")`.
fn a(head: &str, cidr_identity: u32, tail: &str) -> String {
    format!("{head} addr:{cidr_identity} {tail}")
}

/// A prefix of the endpoint: `pfx("Egress", "10.0.0.0/8", C10)`.
fn pfx(direction: &str, prefix: &str, identity: u32) -> String {
    format!("{direction} prefix {prefix} {identity}")
}

/// The loader's rules for a policy, checked on every resolution.
fn assert_loader_valid(resolved: &ResolvedPolicy) {
    for pair in resolved.entries.windows(2) {
        assert!(
            pair[0] < pair[1],
            "entries must be sorted: {} then {}",
            pair[0],
            pair[1]
        );
        assert!(
            !pair[0].same_key(&pair[1]),
            "entries must be unique by key: {}",
            pair[1]
        );
    }
    for pair in resolved.prefixes.windows(2) {
        assert!(
            (pair[0].direction, pair[0].prefix) < (pair[1].direction, pair[1].prefix),
            "prefixes must be sorted and unique: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
    for prefix in &resolved.prefixes {
        assert!(
            prefix.identity >= CIDR_IDENTITY_MIN,
            "a prefix has a CIDR identity: {prefix:?}"
        );
        assert_eq!(prefix.prefix, prefix.prefix.trunc(), "host bits clear: {prefix:?}");
        assert!(
            resolved
                .entries_of(prefix.direction)
                .any(|e| e.peer_kind == PeerKind::Address),
            "prefixes only where address entries use them: {prefix:?}"
        );
    }
    for entry in &resolved.entries {
        assert!(
            resolved.enforces(entry.direction),
            "a direction that is not enforced has no entries: {entry}"
        );
        if entry.peer_kind == PeerKind::Address {
            assert!(
                resolved
                    .prefixes_of(entry.direction)
                    .any(|p| p.identity == entry.peer_identity),
                "an address entry names a prefix of its direction: {entry}"
            );
        }
        if !entry.protocol.has_ports() {
            assert_eq!(
                (entry.port, entry.end_port),
                (0, 0),
                "ports only with TCP/UDP/SCTP: {entry}"
            );
        }
        if entry.port == 0 {
            assert_eq!(entry.end_port, 0, "a range needs a first port: {entry}");
        }
        if entry.end_port != 0 {
            assert!(entry.end_port > entry.port, "end_port must be above port: {entry}");
        }
    }
}

/// Resolves and compares with the expectation.
#[track_caller]
fn check(
    what: &str,
    repo: &PolicyRepository,
    cache: &SelectorCache,
    subject: &Labels,
    named_ports: &[NamedPort],
    enforce: (bool, bool),
    expected: &[String],
) {
    let resolved = repo.resolve(
        &Subject {
            labels: subject,
            named_ports,
        },
        cache,
    );
    let prepared = repo.prepare(subject, cache).resolve(&Subject {
        labels: subject,
        named_ports,
    });
    assert_eq!(
        prepared, resolved,
        "{what}: a prepared resolution (no cache, no repository) is the same"
    );
    assert_loader_valid(&resolved);
    assert_eq!(
        (resolved.enforce_ingress, resolved.enforce_egress),
        enforce,
        "{what}: enforced directions (ingress, egress)"
    );
    assert_eq!(shown(&resolved), sorted(expected), "{what}");
}

// ------------------------------------------- Kubernetes documentation examples

const DEFAULT_DENY_INGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: default-deny-ingress
  namespace: shop
spec:
  podSelector: {}
  policyTypes:
  - Ingress
";

const ALLOW_ALL_INGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-all-ingress
  namespace: shop
spec:
  podSelector: {}
  ingress:
  - {}
  policyTypes:
  - Ingress
";

const DEFAULT_DENY_EGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: default-deny-egress
  namespace: shop
spec:
  podSelector: {}
  policyTypes:
  - Egress
";

const ALLOW_ALL_EGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-all-egress
  namespace: shop
spec:
  podSelector: {}
  egress:
  - {}
  policyTypes:
  - Egress
";

const DEFAULT_DENY_ALL: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: default-deny-all
  namespace: shop
spec:
  podSelector: {}
  policyTypes:
  - Ingress
  - Egress
";

const TEST_NETWORK_POLICY: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: test-network-policy
  namespace: default
spec:
  podSelector:
    matchLabels:
      role: db
  policyTypes:
  - Ingress
  - Egress
  ingress:
  - from:
    - ipBlock:
        cidr: 172.17.0.0/16
        except:
        - 172.17.1.0/24
    - namespaceSelector:
        matchLabels:
          project: myproject
    - podSelector:
        matchLabels:
          role: frontend
    ports:
    - protocol: TCP
      port: 6379
  egress:
  - to:
    - ipBlock:
        cidr: 10.0.0.0/24
    ports:
    - protocol: TCP
      port: 5978
";

const MULTI_PORT_EGRESS: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: multi-port-egress
  namespace: default
spec:
  podSelector:
    matchLabels:
      role: db
  policyTypes:
    - Egress
  egress:
    - to:
        - ipBlock:
            cidr: 10.0.0.0/24
      ports:
        - protocol: TCP
          port: 32000
          endPort: 32768
";

#[test]
fn kubernetes_default_policies_of_a_namespace() {
    let cache = fixture();
    let web = identity(WEB);
    let elsewhere = identity(DEF_DB);
    let none: &[String] = &[];
    for (document, enforce, expected, why) in [
        (
            DEFAULT_DENY_INGRESS,
            (true, false),
            none.to_vec(),
            "default deny ingress isolates ingress and leaves egress alone",
        ),
        (
            ALLOW_ALL_INGRESS,
            (true, false),
            vec![e("Ingress Allow", 0, "ANY")],
            "`ingress: [{}]` allows every peer, protocol and port",
        ),
        (
            DEFAULT_DENY_EGRESS,
            (false, true),
            none.to_vec(),
            "default deny egress isolates egress and leaves ingress alone",
        ),
        (
            ALLOW_ALL_EGRESS,
            (false, true),
            vec![e("Egress Allow", 0, "ANY")],
            "`egress: [{}]` allows every peer, protocol and port",
        ),
        (
            DEFAULT_DENY_ALL,
            (true, true),
            none.to_vec(),
            "default deny all isolates both directions with no entries",
        ),
    ] {
        let repo = repo(&[document]);
        check(why, &repo, &cache, &web, &[], enforce, &expected);
        check(
            &format!("{why} (pods of other namespaces are not selected)"),
            &repo,
            &cache,
            &elsewhere,
            &[],
            (false, false),
            &[],
        );
    }
}

/// An initializing endpoint (reserved `init` identity: its labels are not
/// known yet) is default-deny both ways, with or without policies in the
/// repository, and the oracle agrees; an ordinary pod with no policy is
/// not enforced.
#[test]
fn an_initializing_endpoint_is_default_deny_both_ways() {
    let cache = fixture();
    let init = rivet_common::labels::ReservedIdentity::Init.labels();
    let none: &[String] = &[];
    for documents in [&[][..], &[ALLOW_ALL_INGRESS, ALLOW_ALL_EGRESS][..]] {
        let repo = repo(documents);
        check(
            "an initializing endpoint",
            &repo,
            &cache,
            &init,
            &[],
            (true, true),
            none,
        );
        let peer_labels = identity(WEB);
        let peer = PacketPeer {
            identity: WEB,
            labels: Some(&peer_labels),
            address: None,
            named_ports: &[],
        };
        for direction in Direction::ALL {
            assert_eq!(
                repo.evaluate(&Subject::new(&init), direction, &peer, 6, 80),
                Decision::DefaultDenied,
                "the oracle denies {direction} of an initializing endpoint"
            );
        }
    }
    check(
        "a pod no policy selects",
        &repo(&[]),
        &cache,
        &identity(WEB),
        &[],
        (false, false),
        none,
    );
}

#[test]
fn kubernetes_test_network_policy() {
    let cache = fixture();
    let repo = repo(&[TEST_NETWORK_POLICY]);
    check(
        "ipBlock minus except, namespaceSelector and podSelector peers on TCP 6379; ipBlock egress on TCP 5978",
        &repo,
        &cache,
        &identity(DEF_DB),
        &[],
        (true, true),
        &[
            // Addresses whose longest prefix among the block's own is
            // 172.17.0.0/16 (not the excepted /24).
            a("Ingress Allow", C172, "TCP 6379"),
            pfx("Ingress", "172.17.0.0/16", C172),
            pfx("Ingress", "172.17.1.0/24", C172_1),
            // Any pod of a namespace labelled project=myproject.
            e("Ingress Allow", MYPROJ, "TCP 6379"),
            // role=frontend of the policy's own namespace only.
            e("Ingress Allow", DEF_FRONT, "TCP 6379"),
            a("Egress Allow", C10_0, "TCP 5978"),
            pfx("Egress", "10.0.0.0/24", C10_0),
        ],
    );
    check(
        "role=db of another namespace is not selected",
        &repo,
        &cache,
        &pod("shop", "k8s:role=db"),
        &[],
        (false, false),
        &[],
    );
    check(
        "role=frontend of the namespace is not selected",
        &repo,
        &cache,
        &identity(DEF_FRONT),
        &[],
        (false, false),
        &[],
    );
    let policy = Policy::parse(TEST_NETWORK_POLICY).unwrap();
    assert_eq!(
        policy.cidrs(),
        [net("10.0.0.0/24"), net("172.17.0.0/16"), net("172.17.1.0/24")],
        "every cidr and except prefix needs a CIDR identity"
    );
}

#[test]
fn kubernetes_end_port() {
    let cache = fixture();
    let repo = repo(&[MULTI_PORT_EGRESS]);
    check(
        "endPort makes a port range; policyTypes [Egress] leaves ingress alone",
        &repo,
        &cache,
        &identity(DEF_DB),
        &[],
        (false, true),
        &[
            a("Egress Allow", C10_0, "TCP 32000-32768"),
            pfx("Egress", "10.0.0.0/24", C10_0),
        ],
    );
}

#[test]
fn kubernetes_namespace_and_pod_selector_and_versus_or() {
    let cache = fixture();
    let and = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: and, namespace: default}
spec:
  podSelector: {matchLabels: {role: db}}
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          user: alice
      podSelector:
        matchLabels:
          role: client
";
    let or = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: or, namespace: default}
spec:
  podSelector: {matchLabels: {role: db}}
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          user: alice
    - podSelector:
        matchLabels:
          role: client
";
    check(
        "one peer with both selectors: clients in alice's namespaces only",
        &repo(&[and]),
        &cache,
        &identity(DEF_DB),
        &[],
        (true, false),
        &[e("Ingress Allow", ALICE_CLIENT, "ANY")],
    );
    check(
        "two peers: every pod of alice's namespaces, or clients of the policy's namespace",
        &repo(&[or]),
        &cache,
        &identity(DEF_DB),
        &[],
        (true, false),
        &[
            e("Ingress Allow", ALICE_CLIENT, "ANY"),
            e("Ingress Allow", ALICE_SERVER, "ANY"),
            e("Ingress Allow", DEF_CLIENT, "ANY"),
        ],
    );
    // BOB_CLIENT never matches either.
    let _ = BOB_CLIENT;
}

#[test]
fn kubernetes_namespace_by_name_and_all_namespaces() {
    let cache = fixture();
    let by_name = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: by-name, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: myproject
";
    check(
        "kubernetes.io/metadata.name targets one namespace by name",
        &repo(&[by_name]),
        &cache,
        &identity(DB),
        &[],
        (true, false),
        &[e("Ingress Allow", MYPROJ, "ANY")],
    );
    let all_namespaces = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: all-namespaces, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from:
    - namespaceSelector: {}
      podSelector: {matchLabels: {role: frontend}}
";
    check(
        "namespaceSelector {} matches pods of every namespace, never reserved or CIDR identities",
        &repo(&[all_namespaces]),
        &cache,
        &identity(DB),
        &[],
        (true, false),
        &[
            e("Ingress Allow", SHOP_FRONT, "ANY"),
            e("Ingress Allow", DEF_FRONT, "ANY"),
            e("Ingress Allow", OTHER_FRONT, "ANY"),
        ],
    );
}

// ------------------------------------------------------- policyTypes, empties

#[test]
fn policy_types_decide_the_enforced_directions() {
    let cache = fixture();
    let only_ingress_rule = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {role: frontend}}}]
";
    check(
        "a policy with only an ingress rule must not restrict egress",
        &repo(&[only_ingress_rule]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[e("Ingress Allow", SHOP_FRONT, "ANY")],
    );
    let egress_rule_no_types = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  egress:
  - to: [{podSelector: {matchLabels: {app: db}}}]
";
    check(
        "without policyTypes, egress rules add Egress and Ingress is always there (as the API server defaults it)",
        &repo(&[egress_rule_no_types]),
        &cache,
        &identity(WEB),
        &[],
        (true, true),
        &[e("Egress Allow", DB, "ANY")],
    );
    let empty_egress = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  egress: []
";
    check(
        "an empty egress list does not add Egress",
        &repo(&[empty_egress]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[],
    );
    let ignored = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  ingress:
  - {}
  egress:
  - to: [{ipBlock: {cidr: 192.168.0.0/16}}]
";
    check(
        "rules of a direction not in policyTypes are ignored",
        &repo(&[ignored]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[a("Egress Allow", C192, "ANY"), pfx("Egress", "192.168.0.0/16", C192)],
    );
    assert_eq!(
        Policy::parse(ignored).unwrap().cidrs(),
        [net("192.168.0.0/16")],
        "prefixes of ignored rules need no identity"
    );
}

#[test]
fn peers_matching_nothing_contribute_nothing() {
    let cache = fixture();
    let nobody = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Ingress, Egress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: nobody}}}]
  egress:
  - to: [{ipBlock: {cidr: 203.0.113.0/24}}]
    ports: [{port: 443}]
";
    check(
        "a rule whose peers match no identity is not a wildcard: default deny stays",
        &repo(&[nobody]),
        &cache,
        &identity(WEB),
        &[],
        (true, true),
        &[],
    );
}

#[test]
fn ports_protocols_and_selectors() {
    let cache = fixture();
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector:
    matchExpressions:
    - {key: app, operator: In, values: [web, db]}
    - {key: env, operator: DoesNotExist}
  ingress:
  - from:
    - podSelector:
        matchExpressions:
        - {key: role, operator: NotIn, values: [frontend]}
    ports:
    - protocol: UDP
    - port: 8080
      endPort: 8080
    - protocol: SCTP
      port: 9000
      endPort: 9001
  - from:
    - podSelector:
        matchExpressions:
        - {key: role, operator: Exists}
    ports:
    - port: 443
    - port: 443
";
    let repo = repo(&[document]);
    for subject in [WEB, DB] {
        check(
            "NotIn matches pods without the key; a protocol without port is all its ports; endPort == port is one port",
            &repo,
            &cache,
            &identity(subject),
            &[],
            (true, false),
            &[
                e("Ingress Allow", WEB, "UDP"),
                e("Ingress Allow", DB, "UDP"),
                e("Ingress Allow", WEB, "TCP 8080"),
                e("Ingress Allow", DB, "TCP 8080"),
                e("Ingress Allow", WEB, "SCTP 9000-9001"),
                e("Ingress Allow", DB, "SCTP 9000-9001"),
                e("Ingress Allow", SHOP_FRONT, "TCP 443"),
            ],
        );
    }
    check(
        "In and DoesNotExist in spec.podSelector",
        &repo,
        &cache,
        &identity(SHOP_FRONT),
        &[],
        (false, false),
        &[],
    );
    check(
        "DoesNotExist excludes pods with the key",
        &repo,
        &cache,
        &pod("shop", "k8s:app=web,k8s:env=prod"),
        &[],
        (false, false),
        &[],
    );
    check(
        "pod labels of source container count too",
        &repo,
        &cache,
        &pod("shop", "container:app=web"),
        &[],
        (true, false),
        &[
            e("Ingress Allow", WEB, "UDP"),
            e("Ingress Allow", DB, "UDP"),
            e("Ingress Allow", WEB, "TCP 8080"),
            e("Ingress Allow", DB, "TCP 8080"),
            e("Ingress Allow", WEB, "SCTP 9000-9001"),
            e("Ingress Allow", DB, "SCTP 9000-9001"),
            e("Ingress Allow", SHOP_FRONT, "TCP 443"),
        ],
    );
}

// ---------------------------------------------------------------- named ports

#[test]
fn named_ports_resolve_against_the_endpoint_on_ingress() {
    let cache = fixture();
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {role: frontend}}}]
    ports:
    - port: http
    - port: http
      protocol: UDP
    - port: metrics
    - port: missing
";
    let repo = repo(&[document]);
    let named = [
        NamedPort::new("http", Protocol::Tcp, 8080),
        NamedPort::new("http", Protocol::Udp, 8081),
        NamedPort::new("metrics", Protocol::Tcp, 9090),
        NamedPort::new("metrics", Protocol::Udp, 9091),
        NamedPort::new("broken", Protocol::Tcp, 0),
    ];
    check(
        "a named port is the subject's port of that name and protocol; unknown names give nothing",
        &repo,
        &cache,
        &identity(WEB),
        &named,
        (true, false),
        &[
            e("Ingress Allow", SHOP_FRONT, "TCP 8080"),
            e("Ingress Allow", SHOP_FRONT, "UDP 8081"),
            e("Ingress Allow", SHOP_FRONT, "TCP 9090"),
        ],
    );
    check(
        "an endpoint without those names gets no entries (not all ports)",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[],
    );
}

#[test]
fn named_ports_resolve_against_the_peers_on_egress() {
    let mut cache = fixture();
    cache.set_named_ports(DB, vec![NamedPort::new("postgres", Protocol::Tcp, 5432)]);
    cache.set_named_ports(DEF_DB, vec![NamedPort::new("postgres", Protocol::Tcp, 5433)]);
    cache.set_named_ports(MYPROJ, vec![NamedPort::new("dns", Protocol::Udp, 53)]);
    cache.set_named_ports(
        ALICE_SERVER,
        vec![
            NamedPort::new("dns", Protocol::Udp, 5353),
            NamedPort::new("dns", Protocol::Tcp, 53),
        ],
    );
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: db}}}]
    ports: [{port: postgres}]
  - ports: [{port: dns, protocol: UDP}]
";
    let repo = repo(&[document]);
    check(
        "egress named ports are each peer's own port; for any peer each identity's own",
        &repo,
        &cache,
        &identity(WEB),
        &[NamedPort::new("postgres", Protocol::Tcp, 1)],
        (false, true),
        &[
            e("Egress Allow", DB, "TCP 5432"),
            e("Egress Allow", MYPROJ, "UDP 53"),
            e("Egress Allow", ALICE_SERVER, "UDP 5353"),
        ],
    );
    cache.set_named_ports(DB, vec![]);
    check(
        "a peer without the named port gets no entry",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            e("Egress Allow", MYPROJ, "UDP 53"),
            e("Egress Allow", ALICE_SERVER, "UDP 5353"),
        ],
    );
}

/// What the datapath does with a new egress connection under a resolved
/// policy, simulated: identity entries of the peer's identity (or any),
/// address entries of the longest of the endpoint's prefixes containing the
/// address; deny wins.
fn simulated_egress(resolved: &ResolvedPolicy, peer: u32, address: IpAddr, protocol: Protocol, port: u16) -> bool {
    if !resolved.enforce_egress {
        return true;
    }
    let prefix = resolved
        .prefixes_of(Direction::Egress)
        .filter(|p| p.prefix.contains(&address))
        .max_by_key(|p| p.prefix.prefix_len())
        .map(|p| p.identity);
    let verdict = resolved
        .entries_of(Direction::Egress)
        .filter(|e| match e.peer_kind {
            PeerKind::Identity => e.peer_identity == 0 || e.peer_identity == peer,
            PeerKind::Address => Some(e.peer_identity) == prefix,
        })
        .filter(|e| {
            e.protocol == Protocol::Any
                || (e.protocol == protocol && (e.port == 0 || (e.port..=e.port.max(e.end_port)).contains(&port)))
        })
        .map(|e| e.verdict)
        .max();
    verdict == Some(Verdict::Allow)
}

/// A destination of the egress named-port tests: identity, address, its
/// own named ports.
type Destination = (u32, &'static str, Vec<NamedPort>);

/// Checks that the evaluator (the differential test's oracle) and the
/// simulated datapath of the resolution agree on TCP to each destination on
/// each port, and that they say `allowed` (destination index, port).
#[track_caller]
fn check_egress_decisions(
    what: &str,
    repo: &PolicyRepository,
    cache: &SelectorCache,
    destinations: &[Destination],
    ports: &[u16],
    allowed: &[(usize, u16)],
) {
    let subject_labels = identity(WEB);
    let subject = Subject::new(&subject_labels);
    let resolved = repo.resolve(&subject, cache);
    for (index, (id, address, named_ports)) in destinations.iter().enumerate() {
        let labels = is_cluster(*id).then(|| identity(*id));
        let address: IpAddr = address.parse().unwrap();
        let peer = PacketPeer {
            identity: *id,
            labels: labels.as_ref(),
            address: Some(address),
            named_ports,
        };
        for port in ports {
            let want = allowed.contains(&(index, *port));
            let evaluated = repo.evaluate(&subject, Direction::Egress, &peer, 6, *port).passes();
            let simulated = simulated_egress(&resolved, *id, address, Protocol::Tcp, *port);
            assert_eq!(
                (evaluated, simulated),
                (want, want),
                "{what}: TCP {port} to identity {id} at {address} (evaluator, datapath)\n{resolved:#?}"
            );
        }
    }
}

/// The issue's first case: a rule for any peer naming a port allowed the
/// name's number of every pod towards every destination (x/a reached z/c on
/// 80 though z/c's `web` is 81, and world on 80). Kubernetes resolves it
/// against each destination pod.
#[test]
fn egress_named_ports_for_any_peer_resolve_per_destination() {
    let mut cache = fixture();
    let web = |port| vec![NamedPort::new("web", Protocol::Tcp, port)];
    cache.set_named_ports(DB, web(80));
    cache.set_named_ports(DEF_DB, web(80));
    cache.set_named_ports(MYPROJ, web(81));
    let any_peer = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress: [{ports: [{port: web}]}]
";
    let entity_all = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  egress: [{to: [{entities: [all]}, {podSelector: {}}], ports: [{port: web}]}]
";
    let destinations: Vec<Destination> = vec![
        (DB, "198.18.0.11", web(80)),
        (DEF_DB, "198.18.0.12", web(80)),
        (MYPROJ, "198.18.0.13", web(81)),
        (DEF_FRONT, "198.18.0.14", vec![]),
        (2, "198.18.200.2", vec![]),
        (6, "198.18.200.6", vec![]),
        (1, "198.18.200.1", vec![]),
        (C10, "10.9.9.9", vec![]),
    ];
    for (what, document) in [("no peers", any_peer), ("the entity all", entity_all)] {
        let repo = repo(&[document]);
        check(
            what,
            &repo,
            &cache,
            &identity(WEB),
            &[],
            (false, true),
            &[
                e("Egress Allow", DB, "TCP 80"),
                e("Egress Allow", DEF_DB, "TCP 80"),
                e("Egress Allow", MYPROJ, "TCP 81"),
            ],
        );
        check_egress_decisions(
            what,
            &repo,
            &cache,
            &destinations,
            &[80, 81],
            &[(0, 80), (1, 80), (2, 81)],
        );
    }
    // Deny rules resolve the same way.
    let deny = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  enableDefaultDeny: {egress: false}
  egressDeny: [{ports: [{port: web}]}]
";
    let repo = repo(&[deny]);
    check(
        "deny",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            e("Egress Allow", 0, "ANY"),
            e("Egress Deny", DB, "TCP 80"),
            e("Egress Deny", DEF_DB, "TCP 80"),
            e("Egress Deny", MYPROJ, "TCP 81"),
        ],
    );
    let mut allowed: Vec<(usize, u16)> = (0..destinations.len()).flat_map(|i| [(i, 80), (i, 81)]).collect();
    allowed.retain(|cell| ![(0, 80), (1, 80), (2, 81)].contains(cell));
    check_egress_decisions("deny", &repo, &cache, &destinations, &[80, 81], &allowed);
}

/// The issue's second case: an egress ipBlock naming a port resolved to
/// nothing. Every local endpoint inside the block lends its own number to
/// its own address (a host prefix with a CIDR identity of its own), so two
/// pods of one identity with different numbers each get their own.
#[test]
fn egress_named_ports_with_ipblock_peers_resolve_per_address() {
    const C198: u32 = CIDR_IDENTITY_MIN + 20; // 198.18.0.0/15
    const X12: u32 = CIDR_IDENTITY_MIN + 21; // 198.18.0.12/32, the except
    const H11: u32 = CIDR_IDENTITY_MIN + 22;
    const H13: u32 = CIDR_IDENTITY_MIN + 23;
    const H15: u32 = CIDR_IDENTITY_MIN + 24;
    const H16: u32 = CIDR_IDENTITY_MIN + 25;
    let mut cache = fixture();
    assert!(cache.set_cidr_identity(net("198.18.0.0/15"), C198));
    assert!(cache.set_cidr_identity(net("198.18.0.12/32"), X12));
    let web = |port| vec![NamedPort::new("web", Protocol::Tcp, port)];
    // Local endpoints: two of identity DB with different numbers, one in
    // the except, one without the name, one outside the block.
    let destinations: Vec<Destination> = vec![
        (DB, "198.18.0.11", web(80)),
        (DB, "198.18.0.15", web(82)),
        (DEF_DB, "198.18.0.12", web(80)),
        (MYPROJ, "198.18.0.13", web(81)),
        (DEF_FRONT, "198.18.0.14", vec![NamedPort::new("web", Protocol::Udp, 80)]),
        (OTHER_FRONT, "10.0.0.16", web(80)),
        (2, "198.18.9.9", vec![]),
        (C198, "198.18.9.10", vec![]),
    ];
    for (_, address, ports) in &destinations {
        cache.set_address_named_ports(address.parse().unwrap(), ports.clone());
    }
    cache.set_named_ports(DB, [web(80), web(82)].concat());
    cache.set_named_ports(DEF_DB, web(80));
    cache.set_named_ports(MYPROJ, web(81));
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 198.18.0.0/15, except: [198.18.0.12/32]}}]
    ports: [{port: web}]
";
    let repo = repo(&[document]);
    let hosts = ["198.18.0.11/32", "198.18.0.13/32", "198.18.0.15/32"];
    assert_eq!(
        repo.named_port_hosts(&cache),
        hosts.iter().map(|h| net(h)).collect(),
        "a host prefix for each endpoint the block selects that has the name (not the except's, not a UDP web)"
    );
    check(
        "without the host prefixes' identities an allow gives nothing (fail closed)",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[],
    );
    cache.take_changes();
    for (host, id) in hosts.into_iter().zip([H11, H13, H15]) {
        assert!(cache.set_cidr_identity(net(host), id));
    }
    assert_eq!(
        repo.affected_by(&cache.take_changes()).len(),
        1,
        "host prefix identities re-resolve the policy"
    );
    check(
        "each endpoint inside the block at its own address, with its own number",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            a("Egress Allow", H11, "TCP 80"),
            a("Egress Allow", H13, "TCP 81"),
            a("Egress Allow", H15, "TCP 82"),
            pfx("Egress", "198.18.0.0/15", C198),
            pfx("Egress", "198.18.0.12/32", X12),
            pfx("Egress", "198.18.0.11/32", H11),
            pfx("Egress", "198.18.0.13/32", H13),
            pfx("Egress", "198.18.0.15/32", H15),
        ],
    );
    check_egress_decisions(
        "allow",
        &repo,
        &cache,
        &destinations,
        &[80, 81, 82],
        &[(0, 80), (1, 82), (3, 81)],
    );

    // A new endpoint in the block: the policy re-resolves, and it needs a
    // host prefix of its own.
    let sixteen: IpAddr = "198.18.0.16".parse().unwrap();
    assert!(cache.set_address_named_ports(sixteen, web(83)));
    assert_eq!(repo.affected_by(&cache.take_changes()).len(), 1);
    assert!(repo.named_port_hosts(&cache).contains(&net("198.18.0.16/32")));
    assert!(cache.set_cidr_identity(net("198.18.0.16/32"), H16));
    let resolved = repo.resolve(&Subject::new(&identity(WEB)), &cache);
    assert!(resolved.entries.contains(&Entry {
        direction: Direction::Egress,
        peer_kind: PeerKind::Address,
        peer_identity: H16,
        protocol: Protocol::Tcp,
        port: 83,
        end_port: 0,
        verdict: Verdict::Allow,
    }));
    assert!(cache.set_address_named_ports(sixteen, vec![]));
    assert!(cache.remove_cidr_identity(&net("198.18.0.16/32")));

    // A deny: every other rule still applies at a host prefix, and before a
    // host prefix has its identity the numbers are denied at the prefix the
    // address falls in (fail closed: more is denied).
    let deny = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  egress: [{to: [{ipBlock: {cidr: 198.18.0.0/15}}]}]
  egressDeny:
  - to: [{ipBlock: {cidr: 198.18.0.0/15, except: [198.18.0.12/32]}}]
    ports: [{port: web}]
";
    let repo = super::tests::repo(&[deny]);
    check(
        "deny at each endpoint's address; the allow of the whole block there too",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            a("Egress Allow", C198, "ANY"),
            a("Egress Allow", H11, "ANY"),
            a("Egress Allow", H13, "ANY"),
            a("Egress Allow", H15, "ANY"),
            a("Egress Allow", X12, "ANY"),
            a("Egress Deny", H11, "TCP 80"),
            a("Egress Deny", H13, "TCP 81"),
            a("Egress Deny", H15, "TCP 82"),
            pfx("Egress", "198.18.0.0/15", C198),
            pfx("Egress", "198.18.0.12/32", X12),
            pfx("Egress", "198.18.0.11/32", H11),
            pfx("Egress", "198.18.0.13/32", H13),
            pfx("Egress", "198.18.0.15/32", H15),
        ],
    );
    let in_block = [0, 1, 2, 3, 4, 6, 7];
    let mut allowed: Vec<(usize, u16)> = in_block.iter().flat_map(|i| [(*i, 80), (*i, 81), (*i, 82)]).collect();
    allowed.retain(|cell| ![(0, 80), (1, 82), (3, 81)].contains(cell));
    check_egress_decisions("deny", &repo, &cache, &destinations, &[80, 81, 82], &allowed);
    assert!(cache.remove_cidr_identity(&net("198.18.0.13/32")));
    let resolved = repo.resolve(&Subject::new(&identity(WEB)), &cache);
    assert!(
        resolved.entries.contains(&Entry {
            direction: Direction::Egress,
            peer_kind: PeerKind::Address,
            peer_identity: C198,
            protocol: Protocol::Tcp,
            port: 81,
            end_port: 0,
            verdict: Verdict::Deny,
        }),
        "{resolved:#?}"
    );
}

// ------------------------------------------------------- union, deny, entities

#[test]
fn several_policies_combine_as_a_union() {
    let cache = fixture();
    let documents = [
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-web, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: web}}}]
    ports: [{port: 5432}]
",
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-myproject, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {project: myproject}}}]
    ports: [{port: 53, protocol: UDP}, {port: 5432}]
",
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: egress-only, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 10.0.0.0/8}}]
    ports: [{port: 443}]
",
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: elsewhere, namespace: default}
spec:
  podSelector: {}
  ingress: [{}]
",
    ];
    let repo = repo(&documents);
    check(
        "every selecting policy adds its rules; a policy of another namespace adds nothing",
        &repo,
        &cache,
        &identity(DB),
        &[],
        (true, true),
        &[
            e("Ingress Allow", WEB, "TCP 5432"),
            e("Ingress Allow", MYPROJ, "UDP 53"),
            e("Ingress Allow", MYPROJ, "TCP 5432"),
            // Prefixes of other policies inside 10.0.0.0/8 are not this
            // endpoint's: its addresses in them fall to the /8.
            a("Egress Allow", C10, "TCP 443"),
            pfx("Egress", "10.0.0.0/8", C10),
        ],
    );
    check(
        "a pod selected only by the egress policy keeps ingress open",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[a("Egress Allow", C10, "TCP 443"), pfx("Egress", "10.0.0.0/8", C10)],
    );
}

#[test]
fn deny_wins_over_allow() {
    let cache = fixture();
    let allow = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {role: frontend}}}]
    ports: [{port: 80}, {port: 443}]
";
    let deny = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: deny, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingressDeny:
  - from: [{podSelector: {matchLabels: {role: frontend}}}]
    ports: [{port: 80}]
  - from: [{namespaceSelector: {matchLabels: {project: myproject}}}]
";
    check(
        "a Deny replaces the Allow with the same key; other Allows stay",
        &repo(&[allow, deny]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[
            e("Ingress Deny", SHOP_FRONT, "TCP 80"),
            e("Ingress Allow", SHOP_FRONT, "TCP 443"),
            e("Ingress Deny", MYPROJ, "ANY"),
        ],
    );
    check(
        "a Rivet policy with only ingress deny rules enforces ingress only (default deny on)",
        &repo(&[deny]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[
            e("Ingress Deny", SHOP_FRONT, "TCP 80"),
            e("Ingress Deny", MYPROJ, "ANY"),
        ],
    );
}

#[test]
fn entities_name_reserved_identity_groups() {
    let cache = small_fixture();
    let document = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: entities, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{entities: [host, remote-node]}]
  - from: [{entities: [cluster]}]
    ports: [{protocol: ICMP}, {protocol: ICMPv6}]
  egress:
  - to: [{entities: [world]}]
    ports: [{port: 443}]
  - to: [{entities: [all]}, {podSelector: {}}]
    ports: [{protocol: UDP, port: 53}]
  - to: [{entities: [host]}]
    ports: [{protocol: ANY}]
";
    let mut expected = vec![e("Ingress Allow", 1, "ANY"), e("Ingress Allow", 6, "ANY")];
    for id in [1, 3, 4, 5, 6, 7, WEB, DB] {
        expected.push(e("Ingress Allow", id, "ICMP"));
        expected.push(e("Ingress Allow", id, "ICMPv6"));
    }
    expected.extend([
        e("Egress Allow", 2, "TCP 443"),
        e("Egress Allow", C10, "TCP 443"),
        e("Egress Allow", 0, "UDP 53"),
        e("Egress Allow", 1, "ANY"),
    ]);
    check(
        "host=1, remote-node=6, cluster=reserved but world plus cluster identities, world=2 plus CIDR identities, all=*",
        &repo(&[document]),
        &cache,
        &identity(WEB),
        &[],
        (true, true),
        &expected,
    );
}

#[test]
fn default_deny_can_be_disabled() {
    let mut cache = small_fixture();
    let deny_world = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: deny-world, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  enableDefaultDeny: {ingress: false}
  ingressDeny:
  - from: [{entities: [world]}]
";
    check(
        "without default deny the direction is enforced with a wildcard Allow so only the denies bite",
        &repo(&[deny_world]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[
            e("Ingress Allow", 0, "ANY"),
            e("Ingress Deny", 2, "ANY"),
            e("Ingress Deny", C10, "ANY"),
        ],
    );
    let isolate = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: isolate, namespace: shop}
spec:
  podSelector: {}
  ingress:
  - from: [{podSelector: {matchLabels: {app: db}}}]
";
    check(
        "one selecting policy with default deny is enough to drop the wildcard",
        &repo(&[deny_world, isolate]),
        &cache,
        &identity(WEB),
        &[],
        (true, false),
        &[
            e("Ingress Allow", DB, "ANY"),
            e("Ingress Deny", 2, "ANY"),
            e("Ingress Deny", C10, "ANY"),
        ],
    );
    let nothing = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: nothing, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Egress]
  enableDefaultDeny: {egress: false}
";
    check(
        "no default deny and no rules: the direction stays unrestricted",
        &repo(&[nothing]),
        &cache,
        &identity(WEB),
        &[],
        (false, false),
        &[],
    );
    let deny_all_allowed = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: deny-all, namespace: shop}
spec:
  podSelector: {}
  enableDefaultDeny: {ingress: false, egress: false}
  egress:
  - toPorts: []
";
    assert!(
        matches!(Policy::parse(deny_all_allowed), Err(PolicyError::Syntax { path, .. }) if path == "spec.egress[0].toPorts"),
        "Cilium's toPorts is not part of the spec"
    );
    let wildcard_deny = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: wildcard-deny, namespace: shop}
spec:
  podSelector: {}
  enableDefaultDeny: {egress: false}
  egress:
  - to: [{podSelector: {matchLabels: {app: db}}}]
    ports: [{port: 80}]
  egressDeny:
  - {}
";
    cache.upsert_identity(SHOP_FRONT, identity(SHOP_FRONT));
    check(
        "a wildcard Deny replaces the wildcard Allow of the same key",
        &repo(&[wildcard_deny]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[e("Egress Deny", 0, "ANY"), e("Egress Allow", DB, "TCP 80")],
    );
}

#[test]
fn cidr_except_resolution() {
    let mut cache = fixture();
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to:
    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}
    ports: [{port: 443}]
  - to:
    - ipBlock: {cidr: '::/0'}
    - ipBlock: {cidr: 10.1.2.77/24}
    ports: [{port: 80}]
";
    let repo = repo(&[document]);
    let expected_before = [
        // The block's prefixes in the endpoint's set: 10.0.0.0/8 minus
        // 10.1.0.0/16 is the /8's identity (10.0.0.0/24 and 10.2.0.0/16 are
        // other policies' prefixes, not in the set: their addresses fall to
        // the /8).
        a("Egress Allow", C10, "TCP 443"),
        // Host bits of 10.1.2.77/24 are cleared; ::/0 has no identity yet,
        // so its block contributes nothing.
        a("Egress Allow", C10_1_2, "TCP 80"),
        pfx("Egress", "10.0.0.0/8", C10),
        pfx("Egress", "10.1.0.0/16", C10_1),
        pfx("Egress", "10.1.2.0/24", C10_1_2),
    ];
    check(
        "an ipBlock matches the addresses inside cidr and outside every except",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &expected_before,
    );
    assert_eq!(
        repo.cidrs().into_iter().collect::<Vec<_>>(),
        [net("10.0.0.0/8"), net("10.1.0.0/16"), net("10.1.2.0/24"), net("::/0")],
        "the caller allocates an identity for each cidr and except prefix"
    );
    // The caller allocates the missing prefix; another policy's prefix goes.
    assert!(cache.set_cidr_identity(net("::/0"), CIDR_IDENTITY_MIN + 100));
    assert!(cache.remove_cidr_identity(&net("10.2.0.0/16")));
    let mut expected = expected_before.to_vec();
    expected.push(a("Egress Allow", CIDR_IDENTITY_MIN + 100, "TCP 80"));
    expected.push(pfx("Egress", "::/0", CIDR_IDENTITY_MIN + 100));
    check(
        "CIDR identities appearing and vanishing change the entries",
        &repo,
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &expected,
    );
}

/// Issue 12 §2: ipBlocks of pod addresses. Pods B (198.18.0.11) and X
/// (198.18.0.12) share an identity; A's policies name them by address.
#[test]
fn ipblocks_match_pod_addresses_per_address() {
    const B32: u32 = CIDR_IDENTITY_MIN + 20; // 198.18.0.11/32
    const X32: u32 = CIDR_IDENTITY_MIN + 21; // 198.18.0.12/32
    const C192_4: u32 = CIDR_IDENTITY_MIN + 22; // 192.0.0.0/4
    const C198: u32 = CIDR_IDENTITY_MIN + 23; // 198.18.0.0/15
    let mut cache = fixture();
    for (prefix, id) in [
        ("198.18.0.11/32", B32),
        ("198.18.0.12/32", X32),
        ("192.0.0.0/4", C192_4),
        ("198.18.0.0/15", C198),
    ] {
        assert!(cache.set_cidr_identity(net(prefix), id));
    }
    let to_b = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: to-b, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 198.18.0.11/32}}]
";
    check(
        "an ipBlock of a pod's /32 is an address entry of that /32, not of the pod's identity",
        &repo(&[to_b]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[a("Egress Allow", B32, "ANY"), pfx("Egress", "198.18.0.11/32", B32)],
    );
    let all_but_x = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: all-but-x, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 192.0.0.0/4, except: [198.18.0.12/32]}}]
";
    check(
        "except X/32: X's address finds its /32 (no entry), every other address the /4",
        &repo(&[all_but_x]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            a("Egress Allow", C192_4, "ANY"),
            pfx("Egress", "192.0.0.0/4", C192_4),
            pfx("Egress", "198.18.0.12/32", X32),
        ],
    );
    let ingress_from_b = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: from-block, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{ipBlock: {cidr: 198.18.0.0/15, except: [198.18.0.12/32]}}]
    ports: [{port: 80}]
";
    check(
        "ingress works the same way",
        &repo(&[ingress_from_b, to_b]),
        &cache,
        &identity(WEB),
        &[],
        (true, true),
        &[
            a("Ingress Allow", C198, "TCP 80"),
            pfx("Ingress", "198.18.0.0/15", C198),
            pfx("Ingress", "198.18.0.12/32", X32),
            a("Egress Allow", B32, "ANY"),
            pfx("Egress", "198.18.0.11/32", B32),
        ],
    );
}

#[test]
fn overlapping_ipblocks_across_policies_and_deny_rules() {
    let cache = fixture();
    let wide = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: wide, namespace: shop}
spec:
  podSelector: {}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}}]
    ports: [{port: 443}]
";
    let narrow = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: narrow, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 10.1.2.0/24}}]
    ports: [{port: 443}]
";
    check(
        "a block inside another block's except: each selects only its own side",
        &repo(&[wide, narrow]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &[
            // 10.1.2.0/24 lies in the wide block's except: only the narrow
            // block selects it; 10.1.3.1 finds 10.1.0.0/16: no entry.
            a("Egress Allow", C10, "TCP 443"),
            a("Egress Allow", C10_1_2, "TCP 443"),
            pfx("Egress", "10.0.0.0/8", C10),
            pfx("Egress", "10.1.0.0/16", C10_1),
            pfx("Egress", "10.1.2.0/24", C10_1_2),
        ],
    );
    check(
        "a pod only the wide policy selects gets only its prefixes",
        &repo(&[wide, narrow]),
        &cache,
        &identity(DB),
        &[],
        (false, true),
        &[
            a("Egress Allow", C10, "TCP 443"),
            pfx("Egress", "10.0.0.0/8", C10),
            pfx("Egress", "10.1.0.0/16", C10_1),
        ],
    );
    let deny = "
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: deny, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  egressDeny:
  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/24]}}]
  egress:
  - to: [{entities: [world]}, {podSelector: {}}]
";
    let world_and_pods: Vec<String> = [2, WEB, DB, SHOP_FRONT]
        .into_iter()
        .chain(CIDRS.map(|(_, id)| id))
        .map(|id| e("Egress Allow", id, "ANY"))
        .collect();
    let mut expected = world_and_pods.clone();
    expected.extend([
        // Deny by address; world and the pod selector stay identity-based.
        a("Egress Deny", C10, "ANY"),
        pfx("Egress", "10.0.0.0/24", C10_0),
        pfx("Egress", "10.0.0.0/8", C10),
    ]);
    check(
        "a deny ipBlock is an address deny next to identity allows",
        &repo(&[deny]),
        &cache,
        &identity(WEB),
        &[],
        (false, true),
        &expected,
    );

    // A prefix without a CIDR identity yet: an allowing block waits for it
    // (its except would be missing), a denying block does not.
    let mut partial = SelectorCache::new();
    partial.upsert_identity(WEB, identity(WEB));
    partial.set_cidr_identity(net("10.0.0.0/8"), C10);
    check(
        "an allow ipBlock whose except has no identity yet contributes nothing",
        &repo(&[wide]),
        &partial,
        &identity(WEB),
        &[],
        (false, true),
        &[],
    );
    check(
        "a deny ipBlock whose except has no identity yet denies the whole cidr",
        &repo(&[deny]),
        &partial,
        &identity(WEB),
        &[],
        (false, true),
        &[
            e("Egress Allow", 2, "ANY"),
            e("Egress Allow", C10, "ANY"),
            e("Egress Allow", WEB, "ANY"),
            a("Egress Deny", C10, "ANY"),
            pfx("Egress", "10.0.0.0/8", C10),
        ],
    );
}

/// An except prefix's CIDR identity selects nothing, yet the endpoints of
/// its block must be resolved again when it comes or goes: it is one of
/// their address prefixes (without it, the allow waits; see `expand`).
#[test]
fn an_except_prefix_identity_change_affects_its_policy() {
    let mut cache = SelectorCache::new();
    cache.upsert_identity(WEB, identity(WEB));
    cache.set_cidr_identity(net("10.0.0.0/8"), C10);
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  policyTypes: [Egress]
  egress:
  - to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}}]
";
    let repo = repo(&[document]);
    let before = repo.resolve(&Subject::new(&identity(WEB)), &cache);
    assert!(before.entries.is_empty(), "the allow waits for the except's identity");
    cache.take_changes();
    assert!(cache.set_cidr_identity(net("10.1.0.0/16"), C10_1));
    let changes = cache.take_changes();
    assert_eq!(
        repo.affected_by(&changes).len(),
        1,
        "the except's identity changes the block's resolution"
    );
    let after = repo.resolve(&Subject::new(&identity(WEB)), &cache);
    assert_ne!(before, after);
    assert!(cache.remove_cidr_identity(&net("10.1.0.0/16")));
    assert_eq!(repo.affected_by(&cache.take_changes()).len(), 1, "and when it goes");
    assert!(cache.set_cidr_identity(net("192.168.0.0/16"), C192));
    assert!(
        repo.affected_by(&cache.take_changes()).is_empty(),
        "a prefix outside the block changes nothing"
    );
}

/// A random prefix of 10.0.0.0/24 at least `min_len` long, inside `within`.
fn random_prefix(rng: &mut StdRng, within: ipnet::Ipv4Net) -> ipnet::Ipv4Net {
    let len = rng.random_range(within.prefix_len()..=32);
    let host = u32::from(within.network()) | (rng.random::<u32>() & !u32::from(within.netmask()));
    ipnet::Ipv4Net::new(host.into(), len).unwrap().trunc()
}

/// The datapath's decision for a peer address, simulated over a resolved
/// policy: the longest prefix of the direction containing the address, the
/// address entries of its identity, deny wins.
fn simulated_address_verdict(resolved: &ResolvedPolicy, address: std::net::IpAddr) -> Option<Verdict> {
    let prefix = resolved
        .prefixes_of(Direction::Egress)
        .filter(|p| p.prefix.contains(&address))
        .max_by_key(|p| p.prefix.prefix_len())?;
    resolved
        .entries_of(Direction::Egress)
        .filter(|e| e.peer_kind == PeerKind::Address && e.peer_identity == prefix.identity)
        .map(|e| e.verdict)
        .max()
}

/// The property the module docs prove: per address, the datapath's longest
/// prefix over the endpoint's prefixes decides exactly "inside cidr and
/// outside every except" for every block, with deny winning; prefixes of
/// other policies (in the cache, not in the endpoint's set) change nothing.
#[test]
fn address_matching_decides_every_address_as_the_blocks_say() {
    let universe: ipnet::Ipv4Net = "10.0.0.0/24".parse().unwrap();
    let mut rng = StdRng::seed_from_u64(0x1b10c);
    for case in 0..400 {
        let mut cache = SelectorCache::new();
        cache.upsert_identity(WEB, identity(WEB));
        let mut next_id = CIDR_IDENTITY_MIN;
        let mut blocks: Vec<(Verdict, ipnet::Ipv4Net, Vec<ipnet::Ipv4Net>)> = Vec::new();
        for _ in 0..rng.random_range(1..=4) {
            let cidr = random_prefix(&mut rng, universe);
            let except: Vec<_> = (0..rng.random_range(0..3))
                .filter(|_| cidr.prefix_len() < 32)
                .map(|_| {
                    let inner = ipnet::Ipv4Net::new(cidr.network(), cidr.prefix_len() + 1).unwrap();
                    let inner = if rng.random_bool(0.5) {
                        inner
                    } else {
                        ipnet::Ipv4Net::new(
                            (u32::from(cidr.network()) | (1 << (31 - cidr.prefix_len()))).into(),
                            cidr.prefix_len() + 1,
                        )
                        .unwrap()
                    };
                    random_prefix(&mut rng, inner)
                })
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let verdict = [Verdict::Allow, Verdict::Allow, Verdict::Deny][rng.random_range(0..3)];
            blocks.push((verdict, cidr, except));
        }
        let block_yaml = |(_, cidr, except): &(Verdict, ipnet::Ipv4Net, Vec<ipnet::Ipv4Net>)| {
            let except: Vec<String> = except.iter().map(ToString::to_string).collect();
            format!("{{ipBlock: {{cidr: {cidr}, except: [{}]}}}}", except.join(", "))
        };
        let documents: Vec<String> = blocks
            .iter()
            .enumerate()
            .map(|(i, block)| {
                let rules = if block.0 == Verdict::Deny {
                    "egressDeny"
                } else {
                    "egress"
                };
                format!(
                    "apiVersion: rivet.io/v1\nkind: RivetNetworkPolicy\nmetadata: {{name: p{i}, namespace: shop}}\n\
                     spec:\n  podSelector: {{}}\n  policyTypes: [Egress]\n  {rules}:\n  - to: [{}]\n",
                    block_yaml(block)
                )
            })
            .collect();
        let repo = repo(&documents.iter().map(String::as_str).collect::<Vec<_>>());
        // Every prefix gets an identity, plus prefixes of other policies.
        let mut prefixes = repo.cidrs();
        for _ in 0..rng.random_range(0..4) {
            prefixes.insert(IpNet::V4(random_prefix(&mut rng, universe)));
        }
        for prefix in prefixes {
            cache.set_cidr_identity(prefix, next_id);
            next_id += 1;
        }
        let resolved = repo.resolve(&Subject::new(&identity(WEB)), &cache);
        assert_loader_valid(&resolved);
        for host in universe.hosts().chain([universe.network(), universe.broadcast()]) {
            let address = std::net::IpAddr::V4(host);
            let inside = |(_, cidr, except): &&(Verdict, ipnet::Ipv4Net, Vec<ipnet::Ipv4Net>)| {
                cidr.contains(&host) && !except.iter().any(|e| e.contains(&host))
            };
            let want = blocks.iter().filter(inside).map(|b| b.0).max();
            assert_eq!(
                simulated_address_verdict(&resolved, address),
                want,
                "case {case}, address {host}: blocks {blocks:?}\nresolved {resolved:#?}"
            );
        }
    }
}

#[test]
fn identity_changes_change_the_resolved_entries() {
    let mut cache = fixture();
    let document = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {role: frontend}}}]
    ports: [{port: 80}]
  - from: [{namespaceSelector: {matchLabels: {tier: gold}}}]
    ports: [{port: 81}]
";
    let repo = repo(&[document]);
    let web = identity(WEB);
    let run = |cache: &SelectorCache, what: &str, expected: &[String]| {
        check(what, &repo, cache, &web, &[], (true, false), expected)
    };
    run(&cache, "initial", &[e("Ingress Allow", SHOP_FRONT, "TCP 80")]);
    let selectors = cache.cached_selectors();

    assert!(cache.upsert_identity(280, pod("shop", "k8s:role=frontend,k8s:version=2")));
    run(
        &cache,
        "a new matching identity is added",
        &[
            e("Ingress Allow", SHOP_FRONT, "TCP 80"),
            e("Ingress Allow", 280, "TCP 80"),
        ],
    );
    assert!(cache.remove_identity(SHOP_FRONT));
    run(
        &cache,
        "a removed identity is gone",
        &[e("Ingress Allow", 280, "TCP 80")],
    );
    assert!(cache.upsert_identity(280, pod("shop", "k8s:role=backend")));
    run(
        &cache,
        "an identity number reused for other labels no longer matches",
        &[],
    );

    // A namespace label change re-identifies its pods: new identities with new labels.
    let gold = pod("other", "k8s:app=x")
        .with_namespace("other", [("tier", "gold"), ("kubernetes.io/metadata.name", "other")])
        .unwrap();
    assert!(cache.upsert_identity(290, gold));
    run(
        &cache,
        "namespace labels are identity labels",
        &[e("Ingress Allow", 290, "TCP 81")],
    );

    assert!(cache.replace_identities([
        (SHOP_FRONT, identity(SHOP_FRONT)),
        (281, pod("shop", "k8s:role=frontend"))
    ]));
    run(
        &cache,
        "a snapshot replaces every cluster identity",
        &[
            e("Ingress Allow", SHOP_FRONT, "TCP 80"),
            e("Ingress Allow", 281, "TCP 80"),
        ],
    );
    assert_eq!(
        cache.cached_selectors(),
        selectors,
        "identity changes update the memoised selectors in place"
    );
}

// ----------------------------------------------------------------- validation

const NP_HEAD: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: t, namespace: shop}\n";
const RIVET_HEAD: &str = "apiVersion: rivet.io/v1\nkind: RivetNetworkPolicy\nmetadata: {name: t, namespace: shop}\n";

enum Kind {
    Syntax,
    Invalid,
}

/// Kubernetes defaults a missing `spec.podSelector` (optional since 1.31) to
/// the empty selector and a missing spec to the empty spec; both kinds
/// follow it.
#[test]
fn a_missing_pod_selector_or_spec_is_the_empty_one() {
    for head in [NP_HEAD, RIVET_HEAD] {
        let parse = |spec: &str| Policy::parse(&format!("{head}{spec}")).expect("a valid policy");
        assert!(
            parse("spec: {ingress: [{}]}").same_spec(&parse("spec: {podSelector: {}, ingress: [{}]}")),
            "a missing podSelector must select every pod of the namespace: {head}"
        );
        assert!(
            parse("").same_spec(&parse("spec: {podSelector: {}}")),
            "a missing spec must isolate every pod of the namespace for ingress: {head}"
        );
    }
}

#[test]
fn invalid_documents_name_the_path_and_the_rule() {
    let np = |spec: &str| format!("{NP_HEAD}spec: {spec}");
    let rivet = |spec: &str| format!("{RIVET_HEAD}spec: {spec}");
    let ingress_port = |port: &str| np(&format!("{{podSelector: {{}}, ingress: [{{ports: [{port}]}}]}}"));
    let from = |peer: &str| np(&format!("{{podSelector: {{}}, ingress: [{{from: [{peer}]}}]}}"));
    let selector = |sel: &str| np(&format!("{{podSelector: {sel}}}"));
    let cases: Vec<(&str, String, Kind, &str, &str)> = vec![
        // Shape.
        ("unknown spec field", np("{podSelector: {}, ingres: []}"), Kind::Syntax, "spec.ingres", "unknown field `ingres`"),
        ("unknown nested field", ingress_port("{port: 80, bogus: 1}"), Kind::Syntax, "spec.ingress[0].ports[0].bogus", "unknown field `bogus`"),
        ("`to` in an ingress rule", np("{podSelector: {}, ingress: [{to: []}]}"), Kind::Syntax, "spec.ingress[0].to", "unknown field `to`"),
        ("unknown selector field", selector("{matchLabel: {a: b}}"), Kind::Syntax, "spec.podSelector.matchLabel", "unknown field"),
        ("wrong type", selector("{matchLabels: {app: 1}}"), Kind::Syntax, "spec.podSelector.matchLabels.app", "expected a string"),
        ("fractional port", ingress_port("{port: 80.5}"), Kind::Syntax, "spec.ingress[0].ports[0].port", "a port number or a port name"),
        ("missing cidr", from("{ipBlock: {except: []}}"), Kind::Syntax, "spec.ingress[0].from[0].ipBlock", "missing field `cidr`"),
        ("duplicate key", format!("{NP_HEAD}spec:\n  podSelector: {{}}\n  podSelector: {{matchLabels: {{a: b}}}}\n"), Kind::Syntax, "spec", "duplicate key `podSelector`"),
        ("duplicate JSON key", r#"{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "kind": "NetworkPolicy"}"#.into(), Kind::Syntax, "", "duplicate key `kind`"),
        ("unknown top-level field", format!("{NP_HEAD}specs: {{}}"), Kind::Syntax, "specs", "unknown field `specs`"),
        ("not an object", "- a\n- b\n".into(), Kind::Syntax, "", "expected an object"),
        ("broken YAML", "kind: [NetworkPolicy\n".into(), Kind::Syntax, "kind", "at line 2 column 1"),
        ("two documents", format!("{NP_HEAD}spec: {{podSelector: {{}}}}\n---\n{NP_HEAD}spec: {{podSelector: {{}}}}"), Kind::Syntax, "", "more than one document"),
        ("empty", "# nothing\n".into(), Kind::Syntax, "", "empty document"),
        // Envelope and metadata.
        ("missing kind", "apiVersion: networking.k8s.io/v1\nmetadata: {name: t}\n".into(), Kind::Invalid, "kind", "is required"),
        ("unknown kind", "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: t}\n".into(), Kind::Invalid, "kind", "must be NetworkPolicy or RivetNetworkPolicy, found \"CiliumNetworkPolicy\""),
        ("wrong apiVersion", "apiVersion: networking.k8s.io/v1beta1\nkind: NetworkPolicy\nmetadata: {name: t}\nspec: {podSelector: {}}".into(), Kind::Invalid, "apiVersion", "must be networking.k8s.io/v1 for kind NetworkPolicy, found \"networking.k8s.io/v1beta1\""),
        ("Rivet kind with the Kubernetes apiVersion", "apiVersion: networking.k8s.io/v1\nkind: RivetNetworkPolicy\nmetadata: {name: t}\nspec: {podSelector: {}}".into(), Kind::Invalid, "apiVersion", "must be rivet.io/v1 for kind RivetNetworkPolicy"),
        ("missing apiVersion", "kind: NetworkPolicy\nmetadata: {name: t}\nspec: {podSelector: {}}".into(), Kind::Invalid, "apiVersion", "found none"),
        ("missing name", "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {namespace: shop}\nspec: {podSelector: {}}".into(), Kind::Invalid, "metadata.name", "is required"),
        ("missing metadata", "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nspec: {podSelector: {}}".into(), Kind::Invalid, "metadata.name", "is required"),
        ("bad name", "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: Bad_Name}\nspec: {podSelector: {}}".into(), Kind::Invalid, "metadata.name", "must be a DNS-1123 subdomain"),
        ("bad namespace", "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: t, namespace: a.b}\nspec: {podSelector: {}}".into(), Kind::Invalid, "metadata.namespace", "must be a DNS-1123 label"),
        // policyTypes.
        ("bad policy type", np("{podSelector: {}, policyTypes: [ingress]}"), Kind::Invalid, "spec.policyTypes[0]", "must be Ingress or Egress, found \"ingress\""),
        ("duplicate policy type", np("{podSelector: {}, policyTypes: [Egress, Egress]}"), Kind::Invalid, "spec.policyTypes[1]", "duplicate value \"Egress\""),
        // Selectors.
        ("bad operator", selector("{matchExpressions: [{key: app, operator: Equals, values: [a]}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].operator", "must be In, NotIn, Exists or DoesNotExist, found \"Equals\""),
        ("In without values", selector("{matchExpressions: [{key: app, operator: In}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].values", "must be non-empty for operator In"),
        ("NotIn with empty values", selector("{matchExpressions: [{key: app, operator: NotIn, values: []}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].values", "must be non-empty for operator NotIn"),
        ("Exists with values", selector("{matchExpressions: [{key: app, operator: Exists, values: [a]}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].values", "must be empty for operator Exists"),
        ("bad expression key", selector("{matchExpressions: [{key: 'a b', operator: Exists}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].key", "\"a b\" has name"),
        ("bad expression value", selector("{matchExpressions: [{key: a, operator: In, values: [ok, '-x']}]}"), Kind::Invalid, "spec.podSelector.matchExpressions[0].values[1]", "\"-x\" must be empty or"),
        ("bad matchLabels key", selector("{matchLabels: {'Example.com/app': a}}"), Kind::Invalid, "spec.podSelector.matchLabels", "key \"Example.com/app\" has prefix"),
        ("long matchLabels value", selector(&format!("{{matchLabels: {{app: {}}}}}", "a".repeat(64))), Kind::Invalid, "spec.podSelector.matchLabels", "at most 63"),
        ("bad namespaceSelector", from("{namespaceSelector: {matchExpressions: [{key: team, operator: Exists, values: [x]}]}}"), Kind::Invalid, "spec.ingress[0].from[0].namespaceSelector.matchExpressions[0].values", "must be empty for operator Exists"),
        // Peers.
        ("empty peer", from("{}"), Kind::Invalid, "spec.ingress[0].from[0]", "must set podSelector, namespaceSelector or ipBlock"),
        ("ipBlock with podSelector", from("{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}"), Kind::Invalid, "spec.ingress[0].from[0]", "ipBlock cannot be combined with podSelector or namespaceSelector"),
        ("ipBlock with namespaceSelector", np("{podSelector: {}, egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8}, namespaceSelector: {}}]}]}"), Kind::Invalid, "spec.egress[0].to[0]", "ipBlock cannot be combined"),
        ("bare address", from("{ipBlock: {cidr: 10.0.0.1}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.cidr", "must be a CIDR"),
        ("bad CIDR", from("{ipBlock: {cidr: 10.0.0.0/33}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.cidr", "must be a CIDR (address/prefix-length"),
        ("bad except", from("{ipBlock: {cidr: 10.0.0.0/8, except: [nope]}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.except[0]", "must be a CIDR"),
        ("except outside cidr", from("{ipBlock: {cidr: 172.17.0.0/16, except: [172.17.1.0/24, 10.0.0.0/24]}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.except[1]", "10.0.0.0/24 must lie strictly inside cidr 172.17.0.0/16"),
        ("except equal to cidr", from("{ipBlock: {cidr: 172.17.0.0/16, except: [172.17.9.9/16]}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.except[0]", "172.17.0.0/16 must lie strictly inside cidr 172.17.0.0/16"),
        ("except wider than cidr", from("{ipBlock: {cidr: 172.17.0.0/16, except: [172.0.0.0/8]}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.except[0]", "must lie strictly inside"),
        ("except of another family", from("{ipBlock: {cidr: 10.0.0.0/8, except: ['2001:db8::/64']}}"), Kind::Invalid, "spec.ingress[0].from[0].ipBlock.except[0]", "same address family"),
        ("entities in a NetworkPolicy", from("{entities: [world]}"), Kind::Invalid, "spec.ingress[0].from[0].entities", "only exist in kind RivetNetworkPolicy"),
        ("ingressDeny in a NetworkPolicy", np("{podSelector: {}, ingressDeny: [{}]}"), Kind::Invalid, "spec.ingressDeny", "only exist in kind RivetNetworkPolicy"),
        ("egressDeny in a NetworkPolicy", np("{podSelector: {}, egressDeny: []}"), Kind::Invalid, "spec.egressDeny", "only exist in kind RivetNetworkPolicy"),
        ("enableDefaultDeny in a NetworkPolicy", np("{podSelector: {}, enableDefaultDeny: {ingress: false}}"), Kind::Invalid, "spec.enableDefaultDeny", "only exist in kind RivetNetworkPolicy"),
        ("unknown entity", rivet("{podSelector: {}, ingress: [{from: [{entities: [host, internet]}]}]}"), Kind::Invalid, "spec.ingress[0].from[0].entities[1]", "must be world, host, cluster, remote-node or all, found \"internet\""),
        ("no entities", rivet("{podSelector: {}, ingress: [{from: [{entities: []}]}]}"), Kind::Invalid, "spec.ingress[0].from[0].entities", "must not be empty"),
        ("entities with a selector", rivet("{podSelector: {}, egressDeny: [{to: [{entities: [world], podSelector: {}}]}]}"), Kind::Invalid, "spec.egressDeny[0].to[0]", "entities cannot be combined"),
        ("empty Rivet peer", rivet("{podSelector: {}, ingress: [{from: [{}]}]}"), Kind::Invalid, "spec.ingress[0].from[0]", "or entities"),
        // Ports.
        ("bad protocol", ingress_port("{protocol: HTTP, port: 80}"), Kind::Invalid, "spec.ingress[0].ports[0].protocol", "must be TCP, UDP or SCTP, found \"HTTP\""),
        ("lowercase protocol", ingress_port("{protocol: tcp}"), Kind::Invalid, "spec.ingress[0].ports[0].protocol", "found \"tcp\""),
        ("ICMP in a NetworkPolicy", ingress_port("{protocol: ICMP}"), Kind::Invalid, "spec.ingress[0].ports[0].protocol", "need kind RivetNetworkPolicy"),
        ("bad Rivet protocol", rivet("{podSelector: {}, ingress: [{ports: [{protocol: GRE}]}]}"), Kind::Invalid, "spec.ingress[0].ports[0].protocol", "must be TCP, UDP, SCTP, ICMP, ICMPv6 or ANY"),
        ("ICMP with a port", rivet("{podSelector: {}, ingress: [{ports: [{protocol: ICMP, port: 8}]}]}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "protocol ICMP has no ports"),
        ("ANY with an endPort", rivet("{podSelector: {}, egress: [{ports: [{protocol: ANY, endPort: 8}]}]}"), Kind::Invalid, "spec.egress[0].ports[0].endPort", "protocol ANY has no ports"),
        ("port 0", ingress_port("{port: 0}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "must be between 1 and 65535, found 0"),
        ("port 70000", ingress_port("{port: 70000}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "must be between 1 and 65535, found 70000"),
        ("negative port", ingress_port("{port: -1}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "found -1"),
        ("endPort 70000", ingress_port("{port: 80}, {port: 80, endPort: 70000}"), Kind::Invalid, "spec.ingress[0].ports[1].endPort", "must be between 1 and 65535, found 70000"),
        ("endPort below port", ingress_port("{port: 80}, {port: 80, endPort: 79}"), Kind::Invalid, "spec.ingress[0].ports[1].endPort", "must be >= port (80)"),
        ("endPort with a named port", ingress_port("{port: http, endPort: 90}"), Kind::Invalid, "spec.ingress[0].ports[0].endPort", "requires a numeric port, not the named port \"http\""),
        ("endPort without port", ingress_port("{endPort: 90}"), Kind::Invalid, "spec.ingress[0].ports[0].endPort", "requires port"),
        ("uppercase port name", ingress_port("{port: HTTP}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "\"HTTP\" is neither a port number nor a port name"),
        ("quoted number", ingress_port("{port: '80'}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "\"80\" is neither"),
        ("double dash", ingress_port("{port: a--b}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "no leading, trailing or double '-'"),
        ("long port name", ingress_port("{port: abcdefghijklmnop}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "at most 15"),
        ("port name with underscore", ingress_port("{port: my_port}"), Kind::Invalid, "spec.ingress[0].ports[0].port", "IANA service name"),
    ];
    for (what, document, kind, path, reason) in cases {
        let err = Policy::parse(&document).expect_err(what);
        let (got_path, got_reason) = match (&kind, &err) {
            (Kind::Syntax, PolicyError::Syntax { path, reason })
            | (Kind::Invalid, PolicyError::Invalid { path, reason }) => (path, reason),
            _ => panic!("{what}: wrong kind of error: {err:?}\n{document}"),
        };
        assert_eq!(got_path, path, "{what}: {err}\n{document}");
        assert!(got_reason.contains(reason), "{what}: {got_reason:?} lacks {reason:?}");
        let shown = err.to_string();
        if path.is_empty() {
            assert_eq!(shown, *got_reason, "{what}");
        } else {
            assert_eq!(shown, format!("{path}: {got_reason}"), "{what}");
        }
    }
}

// ------------------------------------------------------------------- parsing

#[test]
fn documents_are_accepted_as_kubernetes_writes_them() {
    let from_api_server = r#"{
	"apiVersion": "networking.k8s.io/v1",
	"kind": "NetworkPolicy",
	"metadata": {
		"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
		"creationTimestamp": "2024-01-01T00:00:00Z",
		"generation": 3,
		"labels": {"app": "x"},
		"managedFields": [{"manager": "kubectl", "operation": "Update"}],
		"name": "web",
		"namespace": "shop",
		"resourceVersion": "12345",
		"uid": "0b7c3f50-0000-4000-8000-000000000000"
	},
	"spec": {
		"podSelector": {"matchLabels": {"app": "web"}},
		"policyTypes": ["Ingress"],
		"ingress": [{"from": [{"ipBlock": {"cidr": "10.1.2.3/8"}}], "ports": [{"protocol": "TCP", "port": 80}]}]
	},
	"status": {}
}"#;
    let json = Policy::parse(from_api_server).unwrap();
    assert_eq!(json.key(), &PolicyKey::new(PolicyKind::NetworkPolicy, "shop", "web"));
    assert_eq!(json.api_version(), "networking.k8s.io/v1");
    assert_eq!(json.document(), from_api_server, "the source text is kept as given");

    let yaml = Policy::parse(
        "
# the same policy, written by hand
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: web
  namespace: shop
spec:
  ingress:
  - ports:
    - port: 80
    from:
    - ipBlock:
        cidr: 10.0.0.0/8
  podSelector:
    matchExpressions:
    - key: app
      operator: In
      values: [web, web]
",
    )
    .unwrap();
    assert!(
        json.same_spec(&yaml),
        "metadata, status, host bits, defaults and formatting do not make a different spec"
    );
    assert_eq!(json.normalized_json(), yaml.normalized_json());
    let normalized: serde_json::Value = serde_json::from_str(&json.normalized_json()).unwrap();
    assert_eq!(
        normalized,
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"namespace": "shop", "name": "web"},
            "spec": {
                "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]},
                "policyTypes": ["Ingress"],
                "ingress": [{"peers": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"protocol": "TCP", "port": 80}]}],
                "egress": [],
                // Ingress only: default deny in that direction alone
                // (`rivet policy get` showed both).
                "enableDefaultDeny": {"ingress": true, "egress": false}
            }
        })
    );
    // A Rivet policy's setting for a direction it does not enforce is moot too.
    let rivet = Policy::parse(
        "{apiVersion: rivet.io/v1, kind: RivetNetworkPolicy, metadata: {name: r, namespace: shop},
          spec: {podSelector: {}, policyTypes: [Egress], enableDefaultDeny: {ingress: true}}}",
    )
    .unwrap();
    let normalized: serde_json::Value = serde_json::from_str(&rivet.normalized_json()).unwrap();
    assert_eq!(
        normalized["spec"]["enableDefaultDeny"],
        serde_json::json!({"ingress": false, "egress": true})
    );

    let flow = Policy::parse(
        "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, metadata: {name: x}, spec: {podSelector: {}}}",
    )
    .unwrap();
    assert_eq!(
        flow.key().namespace,
        "default",
        "metadata.namespace defaults to default"
    );
    let other = Policy::parse(
        &flow
            .document()
            .replace("podSelector: {}", "podSelector: {}, policyTypes: [Egress]"),
    )
    .unwrap();
    assert!(!flow.same_spec(&other));
    let renamed = Policy::parse(&flow.document().replace("name: x", "name: y")).unwrap();
    assert!(!flow.same_spec(&renamed), "the key is part of the spec's identity");
}

/// The documents of a file are split as the CLI splits its input
/// (`documents::split_documents`): `...` ends a document, a JSON array holds
/// one per item, a byte order mark and CRLF line ends are fine.
#[test]
fn files_are_split_like_every_other_input() {
    let names = |text: &str| -> Vec<String> {
        match Policy::parse_all(text) {
            Ok(policies) => policies.iter().map(|p| p.key().to_string()).collect(),
            Err(e) => panic!("{text:?} was refused: {e}"),
        }
    };
    let both = [
        "NetworkPolicy/shop/default-deny-ingress",
        "NetworkPolicy/shop/allow-all-egress",
    ];
    assert_eq!(names(&format!("{DEFAULT_DENY_INGRESS}...\n{ALLOW_ALL_EGRESS}")), both);
    let json = |yaml: &str| {
        let value: serde_json::Value = serde_norway::from_str(yaml).unwrap();
        value.to_string()
    };
    assert_eq!(
        names(&format!("[{}, {}]", json(DEFAULT_DENY_INGRESS), json(ALLOW_ALL_EGRESS))),
        both
    );
    let crlf = format!("\u{feff}{DEFAULT_DENY_INGRESS}---\n{ALLOW_ALL_EGRESS}").replace('\n', "\r\n");
    assert_eq!(names(&crlf), both);
    let err = Policy::parse_all("[{\"kind\": ").unwrap_err();
    assert!(
        err.to_string().starts_with("not a JSON array of policy objects"),
        "{err}"
    );
}

#[test]
fn files_hold_several_documents() {
    let text = format!(
        "# policies of the shop\n---\n{DEFAULT_DENY_INGRESS}---\n# nothing here\n---\n{ALLOW_ALL_EGRESS}\n...\n---\n"
    );
    let policies = Policy::parse_all(&text).unwrap();
    let names: Vec<String> = policies.iter().map(|p| p.key().to_string()).collect();
    assert_eq!(
        names,
        [
            "NetworkPolicy/shop/default-deny-ingress",
            "NetworkPolicy/shop/allow-all-egress"
        ]
    );
    assert!(policies[0].document().contains("default-deny-ingress"));
    assert!(
        !policies[0].document().contains("allow-all-egress"),
        "each policy keeps its own document"
    );

    let broken = format!(
        "{DEFAULT_DENY_INGRESS}---\n\n---\n{NP_HEAD}spec: {{podSelector: {{}}, ingress: [{{ports: [{{port: 0}}]}}]}}\n"
    );
    let err = Policy::parse_all(&broken).unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 2 (line 14): spec.ingress[0].ports[0].port: must be between 1 and 65535, found 0",
        "an error names the document (counting only documents with content), its first line and the path"
    );
    let syntax = Policy::parse_all(&format!("{DEFAULT_DENY_INGRESS}---\nkind: [\n")).unwrap_err();
    assert!(
        matches!(
            &syntax,
            DocumentsError::Document {
                number: 2,
                location: Location::Line(12),
                error: PolicyError::Syntax { .. }
            }
        ),
        "{syntax:?}"
    );
    let twice = Policy::parse_all(&format!("{DEFAULT_DENY_INGRESS}---\n{DEFAULT_DENY_INGRESS}")).unwrap_err();
    assert_eq!(
        twice.to_string(),
        "document 2 (line 13): metadata.name: NetworkPolicy/shop/default-deny-ingress is already defined by document 1 (line 2)"
    );
    assert!(Policy::parse_all("").unwrap().is_empty());
    assert!(Policy::parse_all("---\n# c\n---\n").unwrap().is_empty());
}

// ---------------------------------------------------------------- repository

#[test]
fn repository_upserts_deletes_and_guards_origins() {
    let mut repo = PolicyRepository::new();
    assert_eq!((repo.revision(), repo.len(), repo.is_empty()), (0, 0, true));
    let a = Policy::parse(TEST_NETWORK_POLICY).unwrap();
    let key = a.key().clone();

    let change = repo.upsert(a.clone(), PolicyOrigin::Kubernetes).unwrap();
    assert!(change.changed && change.previous.is_none() && change.current.is_some());
    assert_eq!((change.revision, repo.revision()), (1, 1));

    // The same spec with other metadata and formatting: nothing changes.
    let again = Policy::parse(&TEST_NETWORK_POLICY.replace(
        "  namespace: default\n",
        "  namespace: default\n  resourceVersion: \"99\"\n",
    ))
    .unwrap();
    let change = repo.upsert(again, PolicyOrigin::Kubernetes).unwrap();
    assert!(
        !change.changed,
        "an identical spec from the same origin changes nothing"
    );
    assert_eq!((change.revision, repo.revision()), (1, 1));
    assert_eq!(repo.get(&key).unwrap().revision, 1);
    assert_eq!(repo.get(&key).unwrap().policy.document(), TEST_NETWORK_POLICY);
    assert!(!change.affects(&identity(DEF_DB)), "an unchanged policy affects nobody");

    // Another origin can neither replace nor delete it.
    let err = repo.upsert(a.clone(), PolicyOrigin::Api).unwrap_err();
    assert_eq!(
        err,
        PolicyError::OriginConflict {
            key: key.clone(),
            held_by: PolicyOrigin::Kubernetes
        }
    );
    assert_eq!(
        err.to_string(),
        "NetworkPolicy/default/test-network-policy belongs to origin kubernetes: only kubernetes can change or delete it"
    );
    assert!(matches!(
        repo.delete(&key, PolicyOrigin::Directory),
        Err(PolicyError::OriginConflict {
            held_by: PolicyOrigin::Kubernetes,
            ..
        })
    ));
    assert_eq!(repo.revision(), 1);

    // A real change.
    let b = Policy::parse(&TEST_NETWORK_POLICY.replace("role: db", "role: cache")).unwrap();
    let change = repo.upsert(b, PolicyOrigin::Kubernetes).unwrap();
    assert!(change.changed);
    assert_eq!((change.revision, repo.revision()), (2, 2));
    assert!(change.affects(&identity(DEF_DB)), "the previous version selected it");
    assert!(
        change.affects(&pod("default", "k8s:role=cache")),
        "the current version selects it"
    );
    assert!(!change.affects(&identity(DEF_FRONT)));
    assert!(!change.affects(&pod("shop", "k8s:role=cache")));

    // Other keys: another namespace, and the Rivet kind with the same name.
    repo.upsert(Policy::parse(DEFAULT_DENY_ALL).unwrap(), PolicyOrigin::Api)
        .unwrap();
    let rivet = "apiVersion: rivet.io/v1\nkind: RivetNetworkPolicy\nmetadata: {name: test-network-policy}\nspec:\n  podSelector: {}\n  egress: [{to: [{ipBlock: {cidr: 192.168.0.0/16}}]}]\n";
    repo.upsert(Policy::parse(rivet).unwrap(), PolicyOrigin::Directory)
        .unwrap();
    assert_eq!((repo.len(), repo.revision()), (3, 4));
    let keys: Vec<String> = repo.iter().map(|s| s.policy.key().to_string()).collect();
    assert_eq!(
        keys,
        [
            "NetworkPolicy/default/test-network-policy",
            "NetworkPolicy/shop/default-deny-all",
            "RivetNetworkPolicy/default/test-network-policy"
        ],
        "ordered by key"
    );
    assert_eq!(
        repo.cidrs().into_iter().collect::<Vec<_>>(),
        [
            net("10.0.0.0/24"),
            net("172.17.0.0/16"),
            net("172.17.1.0/24"),
            net("192.168.0.0/16")
        ]
    );
    let stored = repo
        .get(&PolicyKey::new(
            PolicyKind::RivetNetworkPolicy,
            "default",
            "test-network-policy",
        ))
        .unwrap();
    assert_eq!((stored.origin, stored.revision), (PolicyOrigin::Directory, 4));

    // Delete.
    assert!(
        repo.delete(&PolicyKey::new(PolicyKind::NetworkPolicy, "x", "y"), PolicyOrigin::Api)
            .unwrap()
            .is_none()
    );
    let change = repo.delete(&key, PolicyOrigin::Kubernetes).unwrap().unwrap();
    assert!(change.changed && change.previous.is_some() && change.current.is_none());
    assert_eq!((change.revision, repo.revision()), (5, 5));
    assert!(change.affects(&pod("default", "k8s:role=cache")));
    assert!(repo.get(&key).is_none());
    assert!(repo.delete(&key, PolicyOrigin::Kubernetes).unwrap().is_none());
    assert_eq!(repo.revision(), 5, "deleting an absent policy changes nothing");

    // After a delete, another origin may take the key.
    assert!(repo.upsert(a, PolicyOrigin::Api).unwrap().changed);
}

#[test]
fn resolved_policies_convert_to_the_loader_messages() {
    let cache = fixture();
    let resolved = repo(&[MULTI_PORT_EGRESS]).resolve(&Subject::new(&identity(DEF_DB)), &cache);
    let message = resolved.to_proto(7, true);
    assert_eq!(
        (
            message.revision,
            message.enforce_ingress,
            message.enforce_egress,
            message.allow_from_host
        ),
        (7, false, true, true)
    );
    assert_eq!(
        message.entries,
        [rivet_proto::loader::v1::PolicyEntry {
            direction: rivet_proto::loader::v1::Direction::Egress as i32,
            peer_identity: C10_0,
            protocol: rivet_proto::loader::v1::Protocol::Tcp as i32,
            port: 32000,
            end_port: 32768,
            verdict: rivet_proto::loader::v1::Verdict::Allow as i32,
            peer_kind: rivet_proto::loader::v1::PeerKind::Address as i32,
        }]
    );
    assert_eq!(
        message.prefixes,
        [rivet_proto::loader::v1::EndpointPrefix {
            direction: rivet_proto::loader::v1::Direction::Egress as i32,
            prefix: Some(rivet_proto::net::IpPrefix {
                address: vec![10, 0, 0, 0],
                prefix_length: 24,
            }),
            cidr_identity: C10_0,
        }]
    );
    for protocol in Protocol::ALL {
        assert_eq!(protocol.to_proto() as u32, protocol.number());
        assert_eq!(Protocol::from_number(protocol.number()), Some(protocol));
        assert_eq!(protocol.as_str().parse::<Protocol>(), Ok(protocol));
    }
    let json = serde_json::to_string(&NamedPort::new("http", Protocol::Tcp, 80)).unwrap();
    assert_eq!(json, r#"{"name":"http","protocol":"TCP","port":80}"#);
    assert_eq!(
        serde_json::from_str::<NamedPort>(&json).unwrap(),
        NamedPort::new("http", Protocol::Tcp, 80)
    );
}

// ------------------------------------------------------------------ at scale

/// An identity of the large cluster, as plain data for the oracle.
#[derive(Clone, Copy)]
struct Member {
    index: usize,
    namespace: usize,
    app: usize,
    role: usize,
    v2: bool,
}

impl Member {
    fn new(index: usize) -> Self {
        Self {
            index,
            namespace: index % 10,
            app: index % 20,
            role: index % 7,
            v2: index.is_multiple_of(50),
        }
    }

    fn id(self) -> u32 {
        256 + self.index as u32
    }

    fn tier(self) -> usize {
        self.namespace % 3
    }

    fn labels(self) -> Labels {
        let mut own = format!("k8s:app=a{},k8s:role=r{}", self.app, self.role);
        if self.v2 {
            own.push_str(",k8s:version=v2");
        }
        let namespace = format!("ns{}", self.namespace);
        let tier = format!("t{}", self.tier());
        own.parse::<Labels>()
            .unwrap()
            .with_namespace(
                &namespace,
                [
                    ("tier", tier.as_str()),
                    ("kubernetes.io/metadata.name", namespace.as_str()),
                ],
            )
            .unwrap()
    }

    fn http(self) -> u16 {
        8000 + (self.index % 5) as u16
    }

    /// Named ports of every fourth identity (for egress).
    fn metrics(self) -> Option<u16> {
        (self.index.is_multiple_of(4)).then_some(9000 + (self.index % 3) as u16)
    }
}

fn cidr_id(policy: usize, part: usize) -> u32 {
    CIDR_IDENTITY_MIN + (policy * 3 + part) as u32
}

fn large_policy(p: usize) -> String {
    let egress = if p.is_multiple_of(2) {
        format!(
            "
  egress:
  - to:
    - ipBlock: {{cidr: 10.{p}.0.0/16, except: [10.{p}.1.0/24]}}
    ports: [{{protocol: UDP, port: 53}}]
  - to: [{{namespaceSelector: {{}}}}]
    ports: [{{port: metrics}}]"
        )
    } else {
        String::new()
    };
    format!(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: p{p}, namespace: ns{p}}}
spec:
  podSelector:
    matchLabels: {{app: a{p}}}
    matchExpressions: [{{key: version, operator: NotIn, values: [v2]}}]
  policyTypes: [Ingress{types}]
  ingress:
  - from:
    - podSelector:
        matchExpressions: [{{key: role, operator: In, values: [r{r0}, r{r1}]}}]
    ports: [{{port: 80}}, {{port: http}}]
  - from:
    - namespaceSelector: {{matchLabels: {{tier: t{t}}}}}
      podSelector:
        matchExpressions: [{{key: app, operator: NotIn, values: [a0]}}]{egress}
",
        types = if p.is_multiple_of(2) { ", Egress" } else { "" },
        r0 = p % 7,
        r1 = (p + 1) % 7,
        t = p % 3,
    )
}

/// What the policies above mean for one subject, from plain data.
fn oracle(subject: Member, live: &[Member]) -> ResolvedPolicy {
    let p = subject.app;
    let selected = p < 10 && subject.namespace == p && !subject.v2;
    if !selected {
        return ResolvedPolicy::default();
    }
    let mut entries = BTreeSet::new();
    let mut add = |direction, peer_identity, protocol, port| {
        let peer_kind = if peer_identity >= CIDR_IDENTITY_MIN {
            PeerKind::Address
        } else {
            PeerKind::Identity
        };
        entries.insert(Entry {
            direction,
            peer_kind,
            peer_identity,
            protocol,
            port,
            end_port: 0,
            verdict: Verdict::Allow,
        });
    };
    for peer in live {
        if peer.namespace == p && (peer.role == p % 7 || peer.role == (p + 1) % 7) {
            add(Direction::Ingress, peer.id(), Protocol::Tcp, 80);
            add(Direction::Ingress, peer.id(), Protocol::Tcp, subject.http());
        }
        if peer.tier() == p % 3 && peer.app != 0 {
            add(Direction::Ingress, peer.id(), Protocol::Any, 0);
        }
        if p.is_multiple_of(2)
            && let Some(port) = peer.metrics()
        {
            add(Direction::Egress, peer.id(), Protocol::Tcp, port);
        }
    }
    let mut prefixes = Vec::new();
    if p.is_multiple_of(2) {
        // Only the block's own prefixes count (10.p.2.0/24 is another
        // policy's); the /16 minus the except is the /16's identity.
        add(Direction::Egress, cidr_id(p, 0), Protocol::Udp, 53);
        for (part, prefix) in [(0, format!("10.{p}.0.0/16")), (1, format!("10.{p}.1.0/24"))] {
            prefixes.push(AddressPrefix {
                direction: Direction::Egress,
                prefix: net(&prefix),
                identity: cidr_id(p, part),
            });
        }
    }
    ResolvedPolicy {
        enforce_ingress: true,
        enforce_egress: p.is_multiple_of(2),
        entries: entries.into_iter().collect(),
        prefixes,
    }
}

#[test]
fn a_thousand_endpoints_ten_policies_a_thousand_identities() {
    const N: usize = 1000;
    let documents: Vec<String> = (0..10).map(large_policy).collect();
    let repo = repo(&documents.iter().map(String::as_str).collect::<Vec<_>>());
    let mut cache = SelectorCache::new();
    let mut live: Vec<Member> = (0..N).map(Member::new).collect();
    for member in &live {
        cache.upsert_identity(member.id(), member.labels());
        if let Some(port) = member.metrics() {
            cache.set_named_ports(member.id(), vec![NamedPort::new("metrics", Protocol::Tcp, port)]);
        }
    }
    for prefix in repo.cidrs() {
        // 10.p.0.0/16 -> part 0, 10.p.1.0/24 -> part 1.
        let IpNet::V4(v4) = prefix else { unreachable!() };
        let p = v4.network().octets()[1] as usize;
        let part = if prefix.prefix_len() == 16 { 0 } else { 1 };
        cache.set_cidr_identity(prefix, cidr_id(p, part));
    }
    for p in (0..10).step_by(2) {
        // Another prefix inside each cidr (as another policy would bring).
        cache.set_cidr_identity(net(&format!("10.{p}.2.0/24")), cidr_id(p, 2));
    }
    assert_eq!(cache.identities(), 7 + N + 15);

    let subjects: Vec<(Member, Labels, Vec<NamedPort>)> = (0..N + 100)
        .map(Member::new)
        .map(|m| (m, m.labels(), vec![NamedPort::new("http", Protocol::Tcp, m.http())]))
        .collect();
    let verify = |cache: &SelectorCache, live: &[Member], what: &str| {
        let mut enforced = 0;
        let mut total = 0;
        for (member, labels, named_ports) in &subjects {
            let resolved = repo.resolve(&Subject { labels, named_ports }, cache);
            let expected = oracle(*member, live);
            assert_eq!(resolved, expected, "{what}: endpoint {}", member.index);
            if member.index.is_multiple_of(10) {
                let prepared = repo.prepare(labels, cache).resolve(&Subject { labels, named_ports });
                assert_eq!(prepared, expected, "{what}: endpoint {}, prepared", member.index);
            }
            enforced += usize::from(resolved.enforce_ingress);
            total += resolved.entries.len();
        }
        (enforced, total)
    };
    let (enforced, total) = verify(&cache, &live, "initial");
    assert!(
        enforced > 400 && total > 100_000,
        "the test must exercise real work: {enforced} {total}"
    );
    let selectors = cache.cached_selectors();

    // Churn: a ninth of the identities vanish, a hundred appear.
    for member in live.iter().filter(|m| m.index.is_multiple_of(9)) {
        assert!(cache.remove_identity(member.id()));
        cache.set_named_ports(member.id(), vec![]);
    }
    live.retain(|m| !m.index.is_multiple_of(9));
    for member in (N..N + 100).map(Member::new) {
        assert!(cache.upsert_identity(member.id(), member.labels()));
        if let Some(port) = member.metrics() {
            cache.set_named_ports(member.id(), vec![NamedPort::new("metrics", Protocol::Tcp, port)]);
        }
        live.push(member);
    }
    verify(&cache, &live, "after churn");
    assert_eq!(
        cache.cached_selectors(),
        selectors,
        "churn updates memoised selectors in place"
    );
}

/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Rivet datapath ABI: the layout of every map shared between the BPF programs
 * (svc-loader/bpf/datapath.c) and the Rust processes using the maps
 * (rivet-datapath's src/maps.rs mirrors these structs with #[repr(C)]; its
 * tests check every size, offset and constant with clang). Change both together.
 *
 * All multi-byte addresses and ports are in network byte order; every other
 * integer is host order.
 */
#ifndef RIVET_H
#define RIVET_H

#include <linux/types.h>

/* ---------------------------------------------------------------- identities */
#define IDENTITY_ANY 0
#define IDENTITY_HOST 1
#define IDENTITY_WORLD 2
#define IDENTITY_REMOTE_NODE 6 /* other nodes of the cluster */

/* ----------------------------------------------------------------- endpoints */
/* Key kinds of the endpoints map: one entry per host-side ifindex (a program
 * finds its own endpoint) and one per address (local delivery, peer identity). */
#define EP_KEY_IFINDEX 1
#define EP_KEY_IPV4 4
#define EP_KEY_IPV6 6

struct endpoint_key {
	__u32 kind;   /* EP_KEY_* */
	__u32 addr[4]; /* ifindex in addr[0], IPv4 in addr[0], or IPv6 */
};

#define EP_F_ENFORCE_INGRESS (1 << 0)
#define EP_F_ENFORCE_EGRESS (1 << 1)
#define EP_F_ALLOW_FROM_HOST (1 << 2)
#define EP_F_HAS_IPV4 (1 << 3)
#define EP_F_HAS_IPV6 (1 << 4)
/* The endpoint has prefixes in ep_prefixes for that direction (ipBlock
 * peers matched by address); without it the lookup is skipped. */
#define EP_F_INGRESS_PREFIXES (1 << 5)
#define EP_F_EGRESS_PREFIXES (1 << 6)

struct endpoint_info {
	__u32 endpoint_id;
	__u32 identity;
	__u32 ifindex;    /* host-side veth */
	__u32 flags;      /* EP_F_* */
	__u8 mac[6];      /* pod-side MAC */
	__u8 node_mac[6]; /* host-side veth MAC: the pod's gateway */
	__u32 ipv4;
	__u32 ipv6[4];
	__u64 policy_revision;
};

/* ------------------------------------------------------------------- ipcache */
/* LPM trie key: prefixlen counts the 32 bits of `family` + pad first. */
struct ipcache_key {
	__u32 prefixlen;
	__u8 family; /* 4 or 6 */
	__u8 pad[3];
	__u32 addr[4];
};

struct ipcache_value {
	__u32 identity;
	__u32 tunnel_endpoint; /* IPv4 of the node to tunnel to; 0 = none */
};

/* -------------------------------------------------------------------- policy */
/* LPM trie key: the fields before `dport` are always matched whole
 * (prefixlen >= POLICY_PREFIX_FIXED_BITS); the port is matched as a prefix, so
 * a port range is a few entries and "any port" is prefixlen = FIXED_BITS.
 * `identity` 0 = any identity, `protocol` 0 = any protocol (then any port). */
struct policy_key {
	__u32 prefixlen;
	__u32 endpoint_id;
	__u32 identity;
	__u8 direction; /* DIR_* */
	__u8 protocol;  /* IPPROTO_*, 0 = any */
	__u16 dport;    /* network byte order */
};
#define POLICY_PREFIX_FIXED_BITS 80 /* endpoint_id + identity + direction + protocol */
#define POLICY_PREFIX_FULL_BITS 96
/* Set in policy_key.direction for entries matched by the peer's address:
 * `identity` is then the CIDR identity of the longest of the endpoint's
 * prefixes (ep_prefixes) containing the peer address, never 0. The key
 * keeps its size, so pinned policy maps stay compatible. */
#define POLICY_DIR_BY_ADDRESS 0x80

/* ------------------------------------------------------------- ep_prefixes */
/* LPM trie of the prefixes each endpoint matches peer addresses against, per
 * direction (every cidr and except prefix of its ipBlocks). prefixlen counts
 * the 64 bits of endpoint_id, direction, family and pad first. */
struct ep_prefix_key {
	__u32 prefixlen;
	__u32 endpoint_id;
	__u8 direction; /* DIR_* */
	__u8 family;    /* 4 or 6 */
	__u8 pad[2];
	__u32 addr[4];
};
#define EP_PREFIX_FIXED_BITS 64

struct ep_prefix_value {
	__u32 cidr_identity; /* >= 2^24 */
};

#define VERDICT_ALLOW 1
#define VERDICT_DENY 2

struct policy_value {
	__u8 verdict;
	__u8 pad[7];
	__u64 packets;
	__u64 bytes;
};

/* ----------------------------------------------------------------- conntrack */
#define DIR_INGRESS 1 /* into the pod: to_container */
#define DIR_EGRESS 2  /* out of the pod: from_container */

struct ct4_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport; /* ICMP: echo id in both ports */
	__u16 dport;
	__u8 protocol;
	__u8 direction; /* DIR_* of the endpoint that opened it */
	__u16 pad;
};

struct ct6_key {
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u8 protocol;
	__u8 direction;
	__u16 pad;
};

#define CT_TCP_SYN 1
#define CT_TCP_ESTABLISHED 2
#define CT_TCP_CLOSING 3

/* Entry flags, for svc-gc and inspection. */
#define CT_F_SEEN_REPLY (1 << 0)
#define CT_F_CLOSING_FWD (1 << 1)
#define CT_F_CLOSING_REV (1 << 2)
/* The connection was translated by a service (its tuple is the backend's):
 * its replies look up their reverse NAT in lb4_flows / lb6_flows. Ordinary
 * connections never pay for that lookup. */
#define CT_F_SERVICE (1 << 3)
/* The connection was translated by a NodePort (svc-loader's nodeport.h)
 * into a backend on this node: the backend's replies get the node address
 * and NodePort back as source in its from_container, before they leave. */
#define CT_F_NODEPORT (1 << 4)

struct ct_entry {
	__u64 expires;     /* bpf_ktime_get_ns() deadline */
	__u64 packets_fwd;
	__u64 bytes_fwd;
	__u64 packets_rev;
	__u64 bytes_rev;
	__u32 src_identity; /* identity of the opening side */
	__u32 endpoint_id;  /* local endpoint the entry belongs to */
	__u8 tcp_state;     /* CT_TCP_*, 0 for non-TCP */
	__u8 tcp_flags_fwd;
	__u8 tcp_flags_rev;
	__u8 flags; /* CT_F_* */
	/* Seconds of lifetime applied when `expires` was last written, so
	 * `expires - lifetime` is when the entry was last refreshed (svc-gc's
	 * idle time). 0 in entries written by a datapath older than this field
	 * (it was padding: the value size is unchanged). */
	__u32 lifetime;
	/* The cached policy verdict on the connection and the policy revision
	 * (datapath_config.policy_revision) it was taken at; while the revision
	 * holds, the connection's packets skip the policy lookup. */
	__u32 policy_revision;
	__u8 policy_verdict; /* 0: allowed; else the DROP_POLICY_* reason that drops it */
	__u8 pad[3];
};

/* Lifetimes in seconds; the datapath reads them from the config map so the
 * loader can change them by flag (tests use short ones). */
/* Defaults (Cilium's), also what the datapath uses for a lifetime left at 0:
 * rivet-datapath's CtTimeouts::DEFAULT, checked against these by its tests. */
#define CT_DEFAULT_TCP_SYN 60
#define CT_DEFAULT_TCP_ESTABLISHED 21600
#define CT_DEFAULT_TCP_CLOSING 10
#define CT_DEFAULT_UDP 60
#define CT_DEFAULT_ICMP 60
#define CT_DEFAULT_OTHER 60

struct ct_timeouts {
	__u32 tcp_syn;
	__u32 tcp_established;
	__u32 tcp_closing;
	__u32 udp;
	__u32 icmp;
	__u32 other;
};

/* ---------------------------------------------------------------- fragments */
/* A fragmented datagram: the first fragment records its ports here and the
 * later ones (which carry no L4 header) take them. */
struct frag_key {
	__u32 saddr[4]; /* IPv4 in saddr[0] */
	__u32 daddr[4];
	__u32 id;       /* IPv4 identification (16 bits) / IPv6 Fragment header identification */
	__u8 family;    /* 4 or 6 */
	__u8 protocol;  /* IPv4 protocol / the IPv6 Fragment header's next header */
	__u16 pad;
};

struct frag_value {
	__u64 expires; /* bpf_ktime_get_ns() deadline */
	__u16 sport;   /* ICMP: echo id in both ports */
	__u16 dport;
	__u8 protocol; /* the L4 protocol (IPv6: after any further extension headers) */
	__u8 pad[3];
};

/* ------------------------------------------------------------------- config */
#define CONFIG_EVENT_VERDICTS (1 << 0)
#define CONFIG_EVENT_TRACE (1 << 1)

struct datapath_config {
	__u32 event_flags; /* CONFIG_EVENT_* */
	/* Bumped by the loader after every change to a map a policy verdict
	 * reads (endpoints, ipcache, policy, ep_prefixes): conntrack entries
	 * cached at another revision take their verdict again. */
	__u32 policy_revision;
	struct ct_timeouts ct;
};

/* ------------------------------------------------------------------ routing */
/* How pod traffic reaches other nodes (svc-loader's --routing-mode), in the
 * single entry of the `routing` array, written by the loader at every start.
 * A map of its own rather than fields of datapath_config: a pinned config
 * map keeps its value size, so running nodes adopt the new object. */
#define ROUTING_NONE 0
#define ROUTING_NATIVE 1
#define ROUTING_VXLAN 2

struct routing_config {
	__u32 mode;             /* ROUTING_* */
	__u32 tunnel_ifindex;   /* rivet_vxlan (vxlan mode), else 0 */
	__u32 tunnel_mtu;       /* its MTU at start, for inspection (the datapath asks bpf_check_mtu) */
	__u32 underlay_ifindex; /* the interface towards the other nodes, else 0 */
};

/* ----------------------------------------------------------------- services */
/* Load balancing (kube-proxy replacement). svc-loader writes every map here
 * but the flow maps, which the datapath writes and svc-gc expires. A service
 * as the loader holds it is one port of one family: frontends (ClusterIP,
 * NodePort) that share one backend set. Write order (loader): backends, then
 * the Maglev table, then the frontend (its backend_count last); removal in
 * the reverse order, so a lookup never finds a table without backends. */
#define LB_MAGLEV_SIZE 1021 /* slots per Maglev table (a prime; Maglev wants M >> backends) */

#define SVC_SCOPE_INTERNAL 0 /* from pods and the node itself: every active backend */
#define SVC_SCOPE_EXTERNAL 1 /* a NodePort reached from outside the node with
			      * externalTrafficPolicy Local: this node's backends only */

#define SVC_F_CLUSTER_IP (1 << 0) /* the frontend is a ClusterIP (or another VIP) */
#define SVC_F_NODE_PORT (1 << 1)  /* the frontend is a NodePort: addr 0 = any address of this node */
#define SVC_F_AFFINITY (1 << 2)   /* sessionAffinity ClientIP, for affinity_timeout seconds */
#define SVC_F_LOCAL (1 << 3)      /* externalTrafficPolicy Local (NodePort) */

struct lb_frontend_key {
	__u32 addr[4]; /* the VIP (IPv4 in addr[0]); NodePort: all zero */
	__u16 port;    /* network order */
	__u8 protocol; /* IPPROTO_TCP / UDP / SCTP */
	__u8 family;   /* 4 or 6 */
	__u8 scope;    /* SVC_SCOPE_* */
	__u8 pad[3];
};

struct lb_frontend {
	__u32 service_id;       /* the service: rev NAT entry, affinity key (client's svc-endpoint chooses it) */
	__u32 table_id;         /* its Maglev table in lb_maglev (the loader chooses it) */
	__u16 backend_count;    /* active backends in the table; 0: the service rejects new flows */
	__u16 flags;            /* SVC_F_* */
	__u32 affinity_timeout; /* seconds (SVC_F_AFFINITY) */
};

#define LB_BACKEND_ACTIVE 0      /* takes new flows */
#define LB_BACKEND_TERMINATING 1 /* keeps its flows, gets no new ones (not in any table) */

/* lb_backends: backend_id (u32, the loader's) -> lb_backend. */
struct lb_backend {
	__u32 addr[4]; /* IPv4 in addr[0] */
	__u16 port;    /* network order */
	__u8 family;   /* 4 or 6 */
	__u8 state;    /* LB_BACKEND_* */
};

/* lb_maglev: table_id -> the backend id of every slot (0: none). A new flow
 * takes slot hash(5-tuple) % LB_MAGLEV_SIZE, so every node picks the same
 * backend for a flow and a backend change moves ~1/N of the flows. */
struct lb_maglev_table {
	__u32 backend_ids[LB_MAGLEV_SIZE];
};

/* lb_rev_nat: service_id -> the frontend replies come from. */
struct lb_rev_nat {
	__u32 addr[4]; /* IPv4 in addr[0] */
	__u16 port;    /* network order */
	__u8 family;
	__u8 pad;
};

/* lb_affinity (LRU): the backend a client got, for SVC_F_AFFINITY. */
struct lb_affinity_key {
	__u32 client[4]; /* IPv4 in client[0] */
	__u32 service_id;
	__u8 family;
	__u8 pad[3];
};

struct lb_affinity {
	__u64 last_used; /* bpf_ktime_get_ns(); stale after affinity_timeout seconds */
	__u32 backend_id;
	__u32 pad;
};

/* lb_services: service_id -> the loader's record of the service (svc-loader
 * alone reads and writes it and lb_svc_backends; the datapath never looks
 * at them): its tables, and in lb_svc_backends every backend with its
 * state in this service, terminating and node-local ones included, which
 * the Maglev tables do not hold, so a restarted loader rebuilds its index
 * from the pins alone. A service costs its record and one lb_svc_backends
 * entry per backend (a record with 1,024 backend slots inline, 8 KiB, was
 * the layout before: rivet-datapath's maps::legacy::LbServiceV1). */
#define LB_SVC_BACKEND_TERMINATING (1 << 0) /* in this service: no new flows */
#define LB_SVC_BACKEND_NODE_LOCAL (1 << 1)  /* a pod on this node (externalTrafficPolicy Local) */

struct lb_service {
	__u32 table_id;          /* the internal Maglev table */
	__u32 external_table_id; /* the NodePort Local table, else 0 */
	__u32 affinity_timeout;  /* seconds, 0 = none */
	__u16 backend_count;     /* its lb_svc_backends entries: indexes 0..backend_count-1 */
	__u8 family;
	__u8 protocol;
	__u32 flags;             /* SVC_F_LOCAL when externalTrafficPolicy is Local */
	__u32 pad;
};

/* lb_svc_backends: (service_id, index) -> one backend of the service. */
struct lb_svc_backend_key {
	__u32 service_id;
	__u32 index; /* 0..lb_service.backend_count-1, the service's backends by address */
};

struct lb_service_backend {
	__u32 backend_id;
	__u32 flags; /* LB_SVC_BACKEND_* */
};

/* lb4_flows / lb6_flows (LRU): one translated connection, two entries keyed
 * like conntrack (ct4_key / ct6_key) with `direction` one of LB_FLOW_*:
 * FORWARD by the client's tuple to the VIP (-> the backend chosen), REVERSE
 * by the translated tuple client -> backend (-> the VIP replies come from).
 * Refreshed with the connection; svc-gc removes expired entries. */
#define LB_FLOW_FORWARD 3
#define LB_FLOW_REVERSE 4

/* lb_flow.flags */
/* Hairpin: the client is its own backend. The forward packet's source was
 * rewritten to the VIP too (a pod drops packets from its own address), so
 * the REVERSE entry is keyed by VIP:client port -> backend, and a reply
 * gets the VIP as source and the client's address back as destination. */
#define LB_FLOW_F_HAIRPIN (1 << 0)
/* The client's port was remapped (svc-loader's lb_port_remap: its
 * translated tuple was another flow's), on the FORWARD and REVERSE entries:
 * the port it leaves with is in an SNAT_OUT entry by the client's tuple, its
 * own in an SNAT_IN entry by the reply's tuple (backend -> client:port). */
#define LB_FLOW_F_PORT_MAPPED (1 << 1)

struct lb_flow {
	__u64 expires;     /* bpf_ktime_get_ns() deadline */
	__u32 addr[4];     /* FORWARD: the backend's address; REVERSE: the VIP */
	__u16 port;        /* network order: the backend's port / the VIP's */
	__u8 family;
	__u8 flags;
	__u32 backend_id;
	__u32 service_id;
	__u32 lifetime;    /* seconds applied when `expires` was written (as ct_entry) */
	__u32 pad;
	__u32 pad2;        /* explicit: the struct is 8-aligned (no implicit padding) */
};

/* NodePort SNAT (externalTrafficPolicy Cluster, a backend on another node:
 * svc-loader/bpf/nodeport.h): two more kinds of lb4_flows / lb6_flows
 * entries with the lb_flow value. SNAT_OUT by the translated tuple client ->
 * backend (-> the node address and SNAT port the flow leaves with); SNAT_IN
 * by the reply's tuple backend -> node address:SNAT port (-> the client's
 * address and port). A ClusterIP flow with LB_FLOW_F_PORT_MAPPED has them
 * too: SNAT_OUT by the client's tuple client -> VIP (-> the client and the
 * port it leaves with), SNAT_IN by the reply's tuple backend -> client:that
 * port (-> the client and its own port). */
#define LB_FLOW_SNAT_OUT 5
#define LB_FLOW_SNAT_IN 6

/* ------------------------------------------------------- socket load balancing */
/* Socket-level load balancing (cgroup connect4/6, sendmsg4/6, recvmsg4/6,
 * getpeername4/6 in svc-loader's --socket-lb-cgroup): a socket's destination
 * VIP is replaced by a backend once, at connect (or per datagram at sendmsg),
 * and lb_sock_rev (LRU) remembers it, so that getpeername and the source of
 * received datagrams show the VIP again. Keyed by the socket's cookie
 * (bpf_get_socket_cookie) and the backend it was sent to. */
struct lb_sock_rev_key {
	__u64 cookie;  /* the socket */
	__u32 addr[4]; /* the backend's address (IPv4 in addr[0]) */
	__u16 port;    /* the backend's port, network order */
	__u8 family;   /* 4 or 6 */
	__u8 pad[5];
};

/* lb_sock_rev.flags */
/* Written by sendmsg (an unconnected UDP socket, per datagram): svc-gc
 * removes it once unused (sendmsg, recvmsg, getpeername) for longer than
 * the UDP conntrack lifetime. Without it (connect: TCP, connected UDP) the
 * entry is left to the LRU: a connected socket need not touch it again for
 * its whole life (getpeername only), so its age says nothing. */
#define LB_SOCK_REV_F_DATAGRAM (1 << 0)

struct lb_sock_rev {
	__u32 addr[4];   /* the VIP (IPv4 in addr[0]) */
	__u16 port;      /* the VIP's port, network order */
	__u8 family;     /* 4 or 6 */
	__u8 flags;      /* LB_SOCK_REV_F_*; 0 in entries of older datapaths (padding) */
	/* Seconds of bpf_ktime_get_ns() at the entry's last use (written at
	 * most once a second). Older datapaths kept the service id here, in
	 * entries without LB_SOCK_REV_F_DATAGRAM: svc-gc never ages those. */
	__u32 last_used;
};

/* ------------------------------------------------------------------ metrics */
/* Per-CPU array index: reason * 4 + direction. Reason 0 = forwarded. */
#define REASON_FORWARDED 0
#define DROP_POLICY_DENIED 1
#define DROP_POLICY_DEFAULT_DENY 2
#define DROP_INVALID_PACKET 3
#define DROP_UNSUPPORTED_L3 4
#define DROP_UNSUPPORTED_L4 5
#define DROP_INVALID_SOURCE_ADDRESS 6
#define DROP_INVALID_SOURCE_MAC 7
#define DROP_UNKNOWN_ENDPOINT 8
#define DROP_CT_MAP_FULL 9
#define DROP_CT_INVALID 10
#define DROP_FRAGMENT_UNSUPPORTED 11 /* no longer produced */
#define DROP_NO_ROUTE 12
#define DROP_REDIRECT_FAILED 13
#define DROP_EXT_HEADER_CHAIN 14   /* IPv6 extension headers: too many, truncated, out of order */
#define DROP_FRAGMENT_UNTRACKED 15 /* a non-first fragment whose first was not seen */
#define DROP_TUNNEL_SOURCE_NOT_NODE 16  /* VXLAN from an outer source that is not a node (ipcache remote-node) */
#define DROP_TUNNEL_IDENTITY_INVALID 17 /* VXLAN whose VNI is no identity a node may send: 0, host (1) */
#define DROP_NO_TUNNEL_ENDPOINT 18      /* to the overlay, but the destination has no tunnel endpoint */
#define DROP_NO_SERVICE_BACKEND 19      /* a service with no active backend: rejected (TCP RST / ICMP unreachable) */
#define DROP_NAT_NO_PORT 20             /* a service flow's translated tuple is taken and every port to remap it to is held */
#define REASON_MAX 64
#define METRICS_ENTRIES (REASON_MAX * 4)

struct metrics_value {
	__u64 packets;
	__u64 bytes;
};

/* ------------------------------------------------------------------- events */
#define EVENT_DROP 1
#define EVENT_POLICY_VERDICT 2
#define EVENT_TRACE 3

#define TRACE_FROM_CONTAINER 1
#define TRACE_TO_CONTAINER 2
#define TRACE_TO_STACK 3
#define TRACE_TO_ENDPOINT 4
#define TRACE_TO_OVERLAY 5
#define TRACE_FROM_OVERLAY 6

struct event {
	__u64 timestamp; /* bpf_ktime_get_ns() */
	__u8 type;       /* EVENT_* */
	__u8 reason;     /* DROP_*, or TRACE_* for traces */
	__u8 direction;  /* DIR_* */
	__u8 verdict;    /* VERDICT_* for verdict events */
	__u8 family;     /* 4 or 6 */
	__u8 protocol;
	__u16 pad;
	__u32 endpoint_id;
	__u32 ifindex;
	__u32 src_identity;
	__u32 dst_identity;
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u32 length;
};

#endif /* RIVET_H */

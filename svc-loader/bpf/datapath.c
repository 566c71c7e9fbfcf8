// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Rivet datapath. One object per node; the same two programs serve every
 * endpoint and find their endpoint by ifindex in the endpoints map:
 *
 *   from_container  tc ingress of the host-side veth: packets leaving the pod.
 *                   Answers ARP / IPv6 neighbour solicitations for the pod's
 *                   gateway, checks the source address, applies the pod's
 *                   egress policy through conntrack, delivers to local pods by
 *                   redirect, hands everything else to the node's stack.
 *   to_container    tc egress of the host-side veth: packets entering the pod.
 *                   Applies the pod's ingress policy through conntrack.
 *   from_overlay    tc ingress of rivet_vxlan (vxlan mode): decapsulated
 *                   packets; the outer source must be a node, the VNI is the
 *                   source identity; local pods get their ingress policy
 *                   with it and the packet by redirect.
 *   to_overlay      tc egress of rivet_vxlan: sets the tunnel key of what the
 *                   stack routes into it (VNI: the source pod's identity or
 *                   remote-node).
 *   from_netdev,    tc ingress / egress of the node's external interfaces:
 *   to_netdev       NodePort services (nodeport.h).
 *
 * Multi-node (the `routing` map): in vxlan mode from_container sends a pod's
 * packet to a remote pod (ipcache entry with a tunnel endpoint) straight into
 * rivet_vxlan with its tunnel key; native mode leaves remote traffic to the
 * node's stack and its routes via the peers.
 *
 * Link plumbing: only IPv6 neighbour discovery and MLD messages sent the way
 * their RFCs require (see icmp6_link_plumbing) pass without policy; every
 * other ICMPv6 message, echo included, is ICMP traffic under policy.
 * IPv6 extension headers are walked up to IPV6_MAX_EXT_HEADERS; fragments
 * follow their flow through the `fragments` map (see frag_track).
 *
 * A connection's first packet is judged by policy and creates a conntrack
 * entry keyed by (tuple, direction of the endpoint) that caches the verdict
 * with the policy revision it was taken at; later packets and replies only
 * touch that entry until the revision changes (see enforce). Pod-to-pod traffic on the node meets both
 * policies in the source's from_container (the source's egress, then the
 * destination's ingress) and enters the destination pod by a redirect to
 * the veth peer, which skips the host veth's egress hook: each policy
 * applies exactly once per packet.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "rivet.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct endpoint_key);
	__type(value, struct endpoint_info);
} endpoints SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 524288);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct ipcache_key);
	__type(value, struct ipcache_value);
} ipcache SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1048576);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_key);
	__type(value, struct policy_value);
} policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct ep_prefix_key);
	__type(value, struct ep_prefix_value);
} ep_prefixes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 786432);
	__type(key, struct ct4_key);
	__type(value, struct ct_entry);
} ct4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 786432);
	__type(key, struct ct6_key);
	__type(value, struct ct_entry);
} ct6 SEC(".maps");

/* First fragments' ports by (source, destination, identification,
 * protocol), for the later fragments of the datagram (see frag_track). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct frag_key);
	__type(value, struct frag_value);
} fragments SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, METRICS_ENTRIES);
	__type(key, __u32);
	__type(value, struct metrics_value);
} metrics SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct datapath_config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct routing_config);
} routing SEC(".maps");

/* Services (rivet.h "services"; sizes: rivet_datapath::spec). svc-loader
 * writes all but the flow maps; the datapath writes lb4/lb6_flows and
 * lb_affinity, svc-gc expires them. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct lb_frontend_key);
	__type(value, struct lb_frontend);
} lb_frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct lb_backend);
} lb_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct lb_maglev_table);
} lb_maglev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct lb_rev_nat);
} lb_rev_nat SEC(".maps");

/* svc-loader's own record of each service and its backends (restored
 * from on restart; no program reads them). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct lb_service);
} lb_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lb_svc_backend_key);
	__type(value, struct lb_service_backend);
} lb_svc_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct lb_affinity_key);
	__type(value, struct lb_affinity);
} lb_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct ct4_key);
	__type(value, struct lb_flow);
} lb4_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct ct6_key);
	__type(value, struct lb_flow);
} lb6_flows SEC(".maps");

#define NSEC_PER_SEC 1000000000ULL

/* From linux/if_arp.h, which drags in libc headers. */
#define ARPHRD_ETHER 1
#define ARPOP_REQUEST 1
#define ARPOP_REPLY 2
/* From linux/icmp.h and linux/icmpv6.h, for the same reason. */
#define ICMP_ECHOREPLY 0
#define ICMP_DEST_UNREACH 3
#define ICMP_ECHO 8
#define ICMP_TIME_EXCEEDED 11
#define ICMP_PARAMETERPROB 12
#define ICMPV6_DEST_UNREACH 1
#define ICMPV6_PARAMPROB 4
#define ICMPV6_ECHO_REQUEST 128
#define ICMPV6_ECHO_REPLY 129
#define ICMPV6_MLD_QUERY 130
#define ICMPV6_MLD_REPORT 131
#define ICMPV6_MLD_DONE 132
#define ICMPV6_ROUTER_SOLICIT 133
#define ICMPV6_ROUTER_ADVERT 134
#define ICMPV6_NEIGHBOR_SOLICIT 135
#define ICMPV6_NEIGHBOR_ADVERT 136
#define ICMPV6_REDIRECT 137
#define ICMPV6_MLD2_REPORT 143

/* IPv6 extension headers (linux/ipv6.h's NEXTHDR_*, which needs more headers). */
#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_AUTH 51
#define NEXTHDR_DEST 60
/* Extension headers walked before the L4 header: a chain with more is
 * dropped (DROP_EXT_HEADER_CHAIN). Real traffic has at most a few (a
 * Hop-by-Hop, a Routing, a Fragment, a Destination Options header);
 * 8 keeps the loop small for the verifier. */
#define IPV6_MAX_EXT_HEADERS 8

/* How long a first fragment's ports are used for its later fragments:
 * the kernel's default reassembly timeout (net.ipv4.ipfrag_time). */
#define FRAG_LIFETIME_NS (30 * NSEC_PER_SEC)

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10

#define ETH_HLEN_ 14
#define IP4_OFF ETH_HLEN_
#define IP6_OFF ETH_HLEN_

/* A parsed packet: the tuple in network order plus what policy needs. For
 * an ICMP error the tuple is the offending packet's, reversed: the error
 * travels like a reply of that packet, so it finds its connection. */
struct pkt {
	__u32 outer_saddr[4]; /* the IP header's source, even for ICMP errors */
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u8 family;
	__u8 protocol;
	__u8 tcp_flags;
	__u8 icmp_error;   /* an ICMP error: the tuple is the reversed inner one */
	__u8 fragment;     /* a non-first fragment of no known flow: no L4 header, no ports */
	__u8 in_fragment;  /* any fragment of a fragmented datagram (first or later) */
	__u8 frag_first;   /* the first fragment (offset 0, more to come): its ports are recorded */
	__u8 frag_proto;   /* IPv4 protocol / the Fragment header's next header */
	__u8 icmp_type;    /* ICMP / ICMPv6 type and code (of the outer message) */
	__u8 icmp_code;
	__u8 hop_limit;    /* IPv6 hop limit */
	/* Services: `svc` is set once the packet was translated to a backend
	 * (its conntrack entries get CT_F_SERVICE); enforce() sets `rev_nat`
	 * when the packet is a reply on a translated connection. `nodeport`
	 * and `rev_nodeport` the same for a NodePort's translation into a
	 * backend on this node (CT_F_NODEPORT). Written without branching, so
	 * the verifier's states do not split on them; bits of one byte, since
	 * the programs' stack is nearly full. */
	__u8 svc : 1;
	__u8 rev_nat : 1;
	__u8 nodeport : 1;
	__u8 rev_nodeport : 1;
	__u8 pad : 4;
	__u32 frag_id;     /* IPv4 identification / IPv6 Fragment header identification */
	__u32 l4_off;
	__u32 len;
};

static __always_inline struct datapath_config *get_config(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&config, &zero);
}

static __always_inline struct routing_config *get_routing(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&routing, &zero);
}

static __always_inline void count(__u8 reason, __u8 dir, __u32 len)
{
	__u32 idx = (__u32)reason * 4 + dir;
	struct metrics_value *m;

	if (idx >= METRICS_ENTRIES)
		return;
	m = bpf_map_lookup_elem(&metrics, &idx);
	if (m) {
		m->packets += 1;
		m->bytes += len;
	}
}

static __always_inline void emit(__u8 type, __u8 reason, __u8 dir, __u8 verdict, const struct pkt *p,
				 const struct endpoint_info *ep, __u32 src_id, __u32 dst_id)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);

	if (!e)
		return;
	e->timestamp = bpf_ktime_get_ns();
	e->type = type;
	e->reason = reason;
	e->direction = dir;
	e->verdict = verdict;
	e->family = p->family;
	e->protocol = p->protocol;
	e->pad = 0;
	e->endpoint_id = ep ? ep->endpoint_id : 0;
	e->ifindex = ep ? ep->ifindex : 0;
	e->src_identity = src_id;
	e->dst_identity = dst_id;
	__builtin_memcpy(e->saddr, p->saddr, 16);
	__builtin_memcpy(e->daddr, p->daddr, 16);
	e->sport = p->sport;
	e->dport = p->dport;
	e->length = p->len;
	bpf_ringbuf_submit(e, 0);
}

static __always_inline int drop(__u8 reason, __u8 dir, const struct pkt *p, const struct endpoint_info *ep,
				__u32 src_id, __u32 dst_id)
{
	count(reason, dir, p->len);
	emit(EVENT_DROP, reason, dir, 0, p, ep, src_id, dst_id);
	return TC_ACT_SHOT;
}

/* ------------------------------------------------------------------ parsing */

static __always_inline int parse_ports(struct __sk_buff *skb, struct pkt *p)
{
	if (p->fragment)
		return 0;
	if (p->protocol == IPPROTO_TCP) {
		__u8 hdr[14];
		if (bpf_skb_load_bytes(skb, p->l4_off, hdr, sizeof(hdr)) < 0)
			return -1;
		__builtin_memcpy(&p->sport, &hdr[0], 2);
		__builtin_memcpy(&p->dport, &hdr[2], 2);
		p->tcp_flags = hdr[13];
	} else if (p->protocol == IPPROTO_UDP || p->protocol == IPPROTO_SCTP) {
		/* Both start with source and destination port. */
		__u16 ports[2];
		if (bpf_skb_load_bytes(skb, p->l4_off, ports, sizeof(ports)) < 0)
			return -1;
		p->sport = ports[0];
		p->dport = ports[1];
	}
	return 0;
}

/* ICMP: echo id in both ports; errors carry the offending packet, whose
 * reversed tuple is the connection the error belongs to. */
static __always_inline int parse_icmp4(struct __sk_buff *skb, struct pkt *p)
{
	__u8 hdr[8];

	if (p->fragment)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l4_off, hdr, sizeof(hdr)) < 0)
		return -1;
	p->icmp_type = hdr[0];
	p->icmp_code = hdr[1];
	if (hdr[0] == ICMP_ECHO || hdr[0] == ICMP_ECHOREPLY) {
		__builtin_memcpy(&p->sport, &hdr[4], 2);
		p->dport = p->sport;
		return 0;
	}
	if (hdr[0] == ICMP_DEST_UNREACH || hdr[0] == ICMP_TIME_EXCEEDED || hdr[0] == ICMP_PARAMETERPROB) {
		struct iphdr inner;
		__u32 off = p->l4_off + 8;
		__u16 ports[2] = {};

		if (bpf_skb_load_bytes(skb, off, &inner, sizeof(inner)) < 0)
			return -1;
		off += (inner.ihl & 0xf) * 4;
		if (inner.protocol == IPPROTO_TCP || inner.protocol == IPPROTO_UDP) {
			if (bpf_skb_load_bytes(skb, off, ports, sizeof(ports)) < 0)
				return -1;
		} else if (inner.protocol == IPPROTO_ICMP) {
			__u8 ih[8];
			if (bpf_skb_load_bytes(skb, off, ih, sizeof(ih)) < 0)
				return -1;
			__builtin_memcpy(&ports[0], &ih[4], 2);
			ports[1] = ports[0];
		}
		p->icmp_error = 1;
		p->protocol = inner.protocol;
		p->saddr[0] = inner.daddr;
		p->daddr[0] = inner.saddr;
		p->sport = ports[1];
		p->dport = ports[0];
	}
	return 0;
}

static __always_inline int parse_icmp6(struct __sk_buff *skb, struct pkt *p)
{
	__u8 hdr[8];

	if (bpf_skb_load_bytes(skb, p->l4_off, hdr, sizeof(hdr)) < 0)
		return -1;
	p->icmp_type = hdr[0];
	p->icmp_code = hdr[1];
	if (hdr[0] == ICMPV6_ECHO_REQUEST || hdr[0] == ICMPV6_ECHO_REPLY) {
		__builtin_memcpy(&p->sport, &hdr[4], 2);
		p->dport = p->sport;
		return 0;
	}
	if (hdr[0] >= ICMPV6_DEST_UNREACH && hdr[0] <= ICMPV6_PARAMPROB) {
		struct ipv6hdr inner;
		__u32 off = p->l4_off + 8;
		__u16 ports[2] = {};

		if (bpf_skb_load_bytes(skb, off, &inner, sizeof(inner)) < 0)
			return -1;
		off += sizeof(inner);
		if (inner.nexthdr == IPPROTO_TCP || inner.nexthdr == IPPROTO_UDP) {
			if (bpf_skb_load_bytes(skb, off, ports, sizeof(ports)) < 0)
				return -1;
		} else if (inner.nexthdr == IPPROTO_ICMPV6) {
			__u8 ih[8];
			if (bpf_skb_load_bytes(skb, off, ih, sizeof(ih)) < 0)
				return -1;
			__builtin_memcpy(&ports[0], &ih[4], 2);
			ports[1] = ports[0];
		}
		p->icmp_error = 1;
		p->protocol = inner.nexthdr;
		__builtin_memcpy(p->saddr, &inner.daddr, 16);
		__builtin_memcpy(p->daddr, &inner.saddr, 16);
		p->sport = ports[1];
		p->dport = ports[0];
	}
	return 0;
}

/* Returns 0 on success or the drop reason for a malformed packet. */
static __always_inline int parse_ipv4(struct __sk_buff *skb, struct pkt *p)
{
	struct iphdr ip;
	__u16 frag;

	if (bpf_skb_load_bytes(skb, IP4_OFF, &ip, sizeof(ip)) < 0)
		return DROP_INVALID_PACKET;
	if (ip.ihl < 5)
		return DROP_INVALID_PACKET;
	p->family = 4;
	p->protocol = ip.protocol;
	p->saddr[0] = ip.saddr;
	p->outer_saddr[0] = ip.saddr;
	p->daddr[0] = ip.daddr;
	p->l4_off = IP4_OFF + (ip.ihl & 0xf) * 4;
	frag = bpf_ntohs(ip.frag_off);
	if (frag & 0x3fff) { /* more fragments, or an offset */
		p->in_fragment = 1;
		p->fragment = (frag & 0x1fff) != 0;
		p->frag_first = !p->fragment;
		p->frag_proto = ip.protocol;
		p->frag_id = ip.id;
	}
	if (p->protocol == IPPROTO_ICMP)
		return parse_icmp4(skb, p) < 0 ? DROP_INVALID_PACKET : 0;
	return parse_ports(skb, p) < 0 ? DROP_INVALID_PACKET : 0;
}

static __always_inline int ipv6_is_ext_header(__u8 nexthdr)
{
	return nexthdr == NEXTHDR_HOP || nexthdr == NEXTHDR_ROUTING || nexthdr == NEXTHDR_FRAGMENT ||
	       nexthdr == NEXTHDR_AUTH || nexthdr == NEXTHDR_DEST;
}

/* Walks the extension headers (Hop-by-Hop, Routing, Fragment, Destination
 * Options, AH) to the L4 header. A chain it cannot finish is
 * DROP_EXT_HEADER_CHAIN: more than IPV6_MAX_EXT_HEADERS headers, a header
 * that runs past the packet, a Hop-by-Hop header that is not first
 * (RFC 8200 4.1), a second Fragment header. A non-first fragment stops the
 * walk at its Fragment header: what follows is not a header. */
static __always_inline int parse_ipv6(struct __sk_buff *skb, struct pkt *p)
{
	struct ipv6hdr ip;
	__u32 off = IP6_OFF + sizeof(ip);
	__u8 nexthdr;
	int i, seen_fragment = 0;

	if (bpf_skb_load_bytes(skb, IP6_OFF, &ip, sizeof(ip)) < 0)
		return DROP_INVALID_PACKET;
	p->family = 6;
	p->hop_limit = ip.hop_limit;
	__builtin_memcpy(p->saddr, &ip.saddr, 16);
	__builtin_memcpy(p->outer_saddr, &ip.saddr, 16);
	__builtin_memcpy(p->daddr, &ip.daddr, 16);
	nexthdr = ip.nexthdr;
	for (i = 0; i < IPV6_MAX_EXT_HEADERS; i++) {
		__u8 h[8];

		if (!ipv6_is_ext_header(nexthdr))
			break;
		if (nexthdr == NEXTHDR_HOP && i != 0)
			return DROP_EXT_HEADER_CHAIN;
		if (bpf_skb_load_bytes(skb, off, h, sizeof(h)) < 0)
			return DROP_EXT_HEADER_CHAIN;
		if (nexthdr == NEXTHDR_FRAGMENT) {
			__u16 frag = (__u16)h[2] << 8 | h[3];

			if (seen_fragment)
				return DROP_EXT_HEADER_CHAIN;
			seen_fragment = 1;
			off += 8;
			if (frag & 0xfff9) { /* an offset, or more fragments */
				p->in_fragment = 1;
				p->frag_proto = h[0];
				__builtin_memcpy(&p->frag_id, &h[4], 4);
				if (frag & 0xfff8) {
					p->fragment = 1;
					p->protocol = h[0];
					p->l4_off = off;
					return 0;
				}
				p->frag_first = 1;
			}
		} else if (nexthdr == NEXTHDR_AUTH) {
			off += ((__u32)h[1] + 2) * 4; /* AH counts 4-byte units, less 2 */
		} else {
			off += ((__u32)h[1] + 1) * 8;
		}
		nexthdr = h[0];
	}
	if (ipv6_is_ext_header(nexthdr) || off > skb->len)
		return DROP_EXT_HEADER_CHAIN;
	p->protocol = nexthdr;
	p->l4_off = off;
	if (p->protocol == IPPROTO_ICMPV6)
		return parse_icmp6(skb, p) < 0 ? DROP_INVALID_PACKET : 0;
	return parse_ports(skb, p) < 0 ? DROP_INVALID_PACKET : 0;
}

static __always_inline int ipv6_is_link_local(const __u32 *a)
{
	return (bpf_ntohl(a[0]) & 0xffc00000) == 0xfe800000;
}

static __always_inline int ipv6_equal(const __u32 *a, const __u32 *b)
{
	return ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) == 0;
}

static __always_inline int ipv6_is_multicast(const __u32 *a)
{
	return (bpf_ntohl(a[0]) & 0xff000000) == 0xff000000;
}

static __always_inline int ipv6_is_unspecified(const __u32 *a)
{
	return (a[0] | a[1] | a[2] | a[3]) == 0;
}

/* ff02::/16: multicast of link scope, never forwarded. */
static __always_inline int ipv6_is_link_multicast(const __u32 *a)
{
	return (bpf_ntohl(a[0]) & 0xff0f0000) == 0xff020000;
}

/* ff02::1:ff00:0/104, where DAD solicitations go. */
static __always_inline int ipv6_is_solicited_node(const __u32 *a)
{
	return bpf_ntohl(a[0]) == 0xff020000 && a[1] == 0 && bpf_ntohl(a[2]) == 1 &&
	       (bpf_ntohl(a[3]) & 0xff000000) == 0xff000000;
}

/* Whether an ICMPv6 message is link plumbing that passes without policy:
 * neighbour discovery or MLD, sent the way the RFCs require, which keeps
 * it on the link (a router never forwards it: hop limit 255 for ND, 1 for
 * MLD, and link-local or unspecified sources are never forwarded). Never
 * an ICMPv6 error, never a fragment (RFC 6980).
 *
 * - ND (RFC 4861), router solicitation 133, router advertisement 134,
 *   neighbour solicitation 135, neighbour advertisement 136, redirect 137:
 *   code 0, hop limit 255, and a link-local source; or the unspecified
 *   source for a solicitation (DAD: a neighbour solicitation to a
 *   solicited-node address, 7.1.1; a router solicitation to a multicast
 *   address, 6.1.1).
 * - MLD (RFC 2710, RFC 3810), query 130, reports 131 and 143, done 132:
 *   code 0, hop limit 1, and a link-local source; or the unspecified source
 *   for a report or done (RFC 3810 5.2.13: sent before the link-local
 *   address is ready).
 * - Only out of a pod (`own`, the pod's endpoint): a neighbour or router
 *   solicitation or a neighbour advertisement from the pod's own address to a
 *   link-local or link-scope multicast address (the pod answering the node's
 *   solicitation for that address, 7.2.4), code 0, hop limit 255. */
static __always_inline int icmp6_link_plumbing(const struct pkt *p, const struct endpoint_info *own)
{
	int src_ll, src_unspec;
	__u8 type = p->icmp_type;

	if (p->family != 6 || p->protocol != IPPROTO_ICMPV6 || p->icmp_error || p->in_fragment || p->icmp_code)
		return 0;
	src_ll = ipv6_is_link_local(p->outer_saddr);
	src_unspec = ipv6_is_unspecified(p->outer_saddr);
	if (type >= ICMPV6_ROUTER_SOLICIT && type <= ICMPV6_REDIRECT) {
		if (p->hop_limit != 255)
			return 0;
		if (src_ll)
			return 1;
		if (src_unspec)
			return (type == ICMPV6_NEIGHBOR_SOLICIT && ipv6_is_solicited_node(p->daddr)) ||
			       (type == ICMPV6_ROUTER_SOLICIT && ipv6_is_multicast(p->daddr));
		return own && (own->flags & EP_F_HAS_IPV6) && ipv6_equal(p->outer_saddr, own->ipv6) &&
		       (type == ICMPV6_ROUTER_SOLICIT || type == ICMPV6_NEIGHBOR_SOLICIT ||
			type == ICMPV6_NEIGHBOR_ADVERT) &&
		       (ipv6_is_link_local(p->daddr) || ipv6_is_link_multicast(p->daddr));
	}
	if (type == ICMPV6_MLD_QUERY || type == ICMPV6_MLD_REPORT || type == ICMPV6_MLD_DONE ||
	    type == ICMPV6_MLD2_REPORT) {
		if (p->hop_limit != 1)
			return 0;
		return src_ll || (src_unspec && type != ICMPV6_MLD_QUERY);
	}
	return 0;
}

/* ------------------------------------------------------------- fragments */

static __always_inline void frag_key_of(struct frag_key *k, const struct pkt *p)
{
	__builtin_memcpy(k->saddr, p->saddr, 16);
	__builtin_memcpy(k->daddr, p->daddr, 16);
	k->id = p->frag_id;
	k->family = p->family;
	k->protocol = p->frag_proto;
	k->pad = 0;
}

/* Fragments follow their flow (Cilium's scheme). A first fragment records
 * its L4 protocol and ports; a later fragment of the same datagram takes
 * them, so it meets the conntrack entry and the policy verdict of its
 * first fragment. A non-first fragment with no (or an expired) record
 * stays `fragment` and is dropped where policy applies
 * (DROP_FRAGMENT_UNTRACKED). ICMP errors are not recorded (the stacks
 * never fragment them). */
static __always_inline void frag_track(struct pkt *p)
{
	struct frag_key k = {};
	struct frag_value *v;
	__u64 now;

	if (!p->in_fragment || p->icmp_error)
		return;
	frag_key_of(&k, p);
	now = bpf_ktime_get_ns();
	if (p->frag_first) {
		struct frag_value nv = {
			.expires = now + FRAG_LIFETIME_NS,
			.sport = p->sport,
			.dport = p->dport,
			.protocol = p->protocol,
		};
		bpf_map_update_elem(&fragments, &k, &nv, BPF_ANY);
		return;
	}
	v = bpf_map_lookup_elem(&fragments, &k);
	if (!v || v->expires < now)
		return;
	p->protocol = v->protocol;
	p->sport = v->sport;
	p->dport = v->dport;
	p->fragment = 0;
}

/* -------------------------------------------------------------- endpoints */

static __always_inline struct endpoint_info *endpoint_by_ifindex(__u32 ifindex)
{
	struct endpoint_key k = {.kind = EP_KEY_IFINDEX, .addr = {ifindex, 0, 0, 0}};
	return bpf_map_lookup_elem(&endpoints, &k);
}

static __always_inline struct endpoint_info *endpoint_by_addr(const struct pkt *p, const __u32 *addr)
{
	struct endpoint_key k = {};

	if (p->family == 4) {
		k.kind = EP_KEY_IPV4;
		k.addr[0] = addr[0];
	} else {
		k.kind = EP_KEY_IPV6;
		__builtin_memcpy(k.addr, addr, 16);
	}
	return bpf_map_lookup_elem(&endpoints, &k);
}

/* Identity of an address: a local endpoint's, else the ipcache's longest
 * prefix, else world. An IPv6 link-local address seen on an endpoint's veth
 * can only be the node's (the other end of the link; a pod's own link-local
 * source never gets this far): the host. */
static __always_inline __u32 identity_of(const struct pkt *p, const __u32 *addr)
{
	struct endpoint_info *ep = endpoint_by_addr(p, addr);
	struct ipcache_key k = {};
	struct ipcache_value *v;

	if (ep)
		return ep->identity;
	if (p->family == 6 && ipv6_is_link_local(addr))
		return IDENTITY_HOST;
	k.family = p->family;
	if (p->family == 4) {
		k.prefixlen = 32 + 32;
		k.addr[0] = addr[0];
	} else {
		k.prefixlen = 32 + 128;
		__builtin_memcpy(k.addr, addr, 16);
	}
	v = bpf_map_lookup_elem(&ipcache, &k);
	return v ? v->identity : IDENTITY_WORLD;
}

/* ----------------------------------------------------------------- policy */

static __always_inline struct policy_value *policy_get(__u32 ep_id, __u32 identity, __u8 dir, __u8 proto, __u16 dport)
{
	struct policy_key k = {
		.prefixlen = POLICY_PREFIX_FULL_BITS,
		.endpoint_id = ep_id,
		.identity = identity,
		.direction = dir,
		.protocol = proto,
		.dport = dport,
	};
	return bpf_map_lookup_elem(&policy, &k);
}

/* The CIDR identity of the longest of the endpoint's prefixes in direction
 * `dir` containing `addr`, or 0 (none, or the endpoint has no prefixes in
 * that direction: then no lookup is made). */
static __always_inline __u32 address_identity(const struct endpoint_info *ep, __u8 dir, const struct pkt *p,
					      const __u32 *addr)
{
	__u32 flag = dir == DIR_EGRESS ? EP_F_EGRESS_PREFIXES : EP_F_INGRESS_PREFIXES;
	struct ep_prefix_key k = {};
	struct ep_prefix_value *v;

	if (!(ep->flags & flag))
		return 0;
	k.endpoint_id = ep->endpoint_id;
	k.direction = dir;
	k.family = p->family;
	if (p->family == 4) {
		k.prefixlen = EP_PREFIX_FIXED_BITS + 32;
		k.addr[0] = addr[0];
	} else {
		k.prefixlen = EP_PREFIX_FIXED_BITS + 128;
		__builtin_memcpy(k.addr, addr, 16);
	}
	v = bpf_map_lookup_elem(&ep_prefixes, &k);
	return v ? v->cidr_identity : 0;
}

/* Deny wins over allow; no match is default deny. Entries are looked up by
 * the peer's identity (`peer`, and any identity) and, when the endpoint has
 * prefixes in this direction, by the CIDR identity of the peer address's
 * longest prefix in the address key space (ipBlock peers): deny wins across
 * all of them. `proto` and `port` are the connection's (0 for ICMP).
 * Returns 0 to allow, or the drop reason (never 0). The matching entries
 * count the packet. */
static __always_inline int policy_verdict(const struct endpoint_info *ep, __u32 peer, __u8 dir, __u8 proto,
					  __u16 port, const struct pkt *p, const __u32 *peer_addr)
{
	__u32 ep_id = ep->endpoint_id;
	__u32 cidr = address_identity(ep, dir, p, peer_addr);
	__u8 addr_dir = dir | POLICY_DIR_BY_ADDRESS;
	struct policy_value *v[6];
	int allow = 0, deny = 0, i;

	v[0] = policy_get(ep_id, peer, dir, proto, port);
	v[1] = policy_get(ep_id, peer, dir, 0, 0);
	v[2] = policy_get(ep_id, IDENTITY_ANY, dir, proto, port);
	v[3] = policy_get(ep_id, IDENTITY_ANY, dir, 0, 0);
	v[4] = cidr ? policy_get(ep_id, cidr, addr_dir, proto, port) : 0;
	v[5] = cidr ? policy_get(ep_id, cidr, addr_dir, 0, 0) : 0;
#pragma unroll
	for (i = 0; i < 6; i++) {
		if (!v[i])
			continue;
		if (v[i]->verdict == VERDICT_DENY)
			deny = 1;
		else if (v[i]->verdict == VERDICT_ALLOW)
			allow = 1;
		__sync_fetch_and_add(&v[i]->packets, 1);
		__sync_fetch_and_add(&v[i]->bytes, p->len);
	}
	if (deny)
		return DROP_POLICY_DENIED;
	return allow ? 0 : DROP_POLICY_DEFAULT_DENY;
}

/* Endpoint `ep`'s verdict in direction `dir` on a connection with the peer
 * of identity `peer` at `peer_addr`, of protocol `proto` to port `port` in
 * its opening direction: 0 to allow, or the drop reason. An endpoint that
 * does not enforce `dir` allows, and so does one that lets the host in, for
 * ingress from the host. */
static __always_inline int judge(const struct endpoint_info *ep, __u8 dir, __u32 peer, __u8 proto, __u16 port,
				 const struct pkt *p, const __u32 *peer_addr)
{
	__u32 enforce_flag = dir == DIR_EGRESS ? EP_F_ENFORCE_EGRESS : EP_F_ENFORCE_INGRESS;

	if (!(ep->flags & enforce_flag))
		return 0;
	if (dir == DIR_INGRESS && peer == IDENTITY_HOST && (ep->flags & EP_F_ALLOW_FROM_HOST))
		return 0;
	if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6)
		port = 0;
	return policy_verdict(ep, peer, dir, proto, port, p, peer_addr);
}

/* -------------------------------------------------------------- conntrack */

/* Lifetime in seconds of an entry of `proto` in `tcp_state`. */
static __always_inline __u32 ct_lifetime(const struct datapath_config *cfg, __u8 proto, __u8 tcp_state)
{
	__u32 s = 0;

	if (proto == IPPROTO_TCP) {
		if (tcp_state == CT_TCP_ESTABLISHED)
			s = cfg ? cfg->ct.tcp_established : 0;
		else if (tcp_state == CT_TCP_CLOSING)
			s = cfg ? cfg->ct.tcp_closing : 0;
		else
			s = cfg ? cfg->ct.tcp_syn : 0;
		if (!s)
			s = tcp_state == CT_TCP_ESTABLISHED ? CT_DEFAULT_TCP_ESTABLISHED
			    : tcp_state == CT_TCP_CLOSING   ? CT_DEFAULT_TCP_CLOSING
							    : CT_DEFAULT_TCP_SYN;
	} else if (proto == IPPROTO_UDP) {
		s = cfg && cfg->ct.udp ? cfg->ct.udp : CT_DEFAULT_UDP;
	} else if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6) {
		s = cfg && cfg->ct.icmp ? cfg->ct.icmp : CT_DEFAULT_ICMP;
	} else {
		s = cfg && cfg->ct.other ? cfg->ct.other : CT_DEFAULT_OTHER;
	}
	return s;
}

/* The key of packet `p` seen in direction `dir` (forward), or of its reply
 * (`reverse`: addresses and ports swapped, opposite direction). */
static __always_inline void ct4_key_of(struct ct4_key *k, const struct pkt *p, __u8 dir, int reverse)
{
	k->saddr = reverse ? p->daddr[0] : p->saddr[0];
	k->daddr = reverse ? p->saddr[0] : p->daddr[0];
	k->sport = reverse ? p->dport : p->sport;
	k->dport = reverse ? p->sport : p->dport;
	k->protocol = p->protocol;
	k->direction = reverse ? (dir == DIR_EGRESS ? DIR_INGRESS : DIR_EGRESS) : dir;
	k->pad = 0;
}

static __always_inline void ct6_key_of(struct ct6_key *k, const struct pkt *p, __u8 dir, int reverse)
{
	__builtin_memcpy(k->saddr, reverse ? p->daddr : p->saddr, 16);
	__builtin_memcpy(k->daddr, reverse ? p->saddr : p->daddr, 16);
	k->sport = reverse ? p->dport : p->sport;
	k->dport = reverse ? p->sport : p->dport;
	k->protocol = p->protocol;
	k->direction = reverse ? (dir == DIR_EGRESS ? DIR_INGRESS : DIR_EGRESS) : dir;
	k->pad = 0;
}

static __always_inline struct ct_entry *ct_find(const struct pkt *p, __u8 dir, int reverse)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_key_of(&k, p, dir, reverse);
		return bpf_map_lookup_elem(&ct4, &k);
	} else {
		struct ct6_key k;
		ct6_key_of(&k, p, dir, reverse);
		return bpf_map_lookup_elem(&ct6, &k);
	}
}

static __always_inline void ct_delete(const struct pkt *p, __u8 dir)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_key_of(&k, p, dir, 0);
		bpf_map_delete_elem(&ct4, &k);
	} else {
		struct ct6_key k;
		ct6_key_of(&k, p, dir, 0);
		bpf_map_delete_elem(&ct6, &k);
	}
}

/* Advances a TCP entry's state; returns the new state. */
static __always_inline __u8 tcp_advance(struct ct_entry *e, __u8 flags, int reply)
{
	__u8 state = e->tcp_state;

	if (flags & TCP_FLAG_RST)
		return CT_TCP_CLOSING;
	if (flags & TCP_FLAG_FIN) {
		e->flags |= reply ? CT_F_CLOSING_REV : CT_F_CLOSING_FWD;
		if ((e->flags & (CT_F_CLOSING_FWD | CT_F_CLOSING_REV)) == (CT_F_CLOSING_FWD | CT_F_CLOSING_REV))
			return CT_TCP_CLOSING;
	}
	if (state == CT_TCP_SYN && reply && (flags & TCP_FLAG_ACK))
		return CT_TCP_ESTABLISHED;
	return state;
}

/* The entry of the packet's connection: forward (`*reply` 0) or as its
 * reply (`*reply` 1), or NULL. A packet whose reply has its own tuple (a
 * pod to itself with equal ports: every ICMP echo to itself) only matches
 * forward: else the egress entry it opens would pass it at the pod's own
 * ingress check as the reply of itself (found by the packet fuzzer). */
static __always_inline struct ct_entry *ct_find_either(const struct pkt *p, __u8 dir, int *reply)
{
	struct ct_entry *e = ct_find(p, dir, 0);

	*reply = 0;
	if (e)
		return e;
	if (p->sport == p->dport && ipv6_equal(p->saddr, p->daddr))
		return 0;
	*reply = 1;
	return ct_find(p, dir, 1);
}

/* A packet passed on an entry: updates its counters, TCP state and
 * lifetime. */
static __always_inline void ct_refresh(struct ct_entry *e, const struct pkt *p, int reply,
				       const struct datapath_config *cfg)
{
	__u64 now, expires;
	__u32 lifetime;
	__u8 state;

	/* Counters are best effort: plain increments, no locked operations on
	 * a line both directions' CPUs write. Flags are written only when they
	 * change. */
	if (reply) {
		e->packets_rev += 1;
		e->bytes_rev += p->len;
		if ((e->tcp_flags_rev & p->tcp_flags) != p->tcp_flags)
			e->tcp_flags_rev |= p->tcp_flags;
		if (!(e->flags & CT_F_SEEN_REPLY))
			e->flags |= CT_F_SEEN_REPLY;
	} else {
		e->packets_fwd += 1;
		e->bytes_fwd += p->len;
		if ((e->tcp_flags_fwd & p->tcp_flags) != p->tcp_flags)
			e->tcp_flags_fwd |= p->tcp_flags;
	}
	state = e->tcp_state;
	if (p->protocol == IPPROTO_TCP)
		state = tcp_advance(e, p->tcp_flags, reply);
	now = bpf_ktime_get_ns();
	lifetime = ct_lifetime(cfg, p->protocol, state);
	expires = now + (__u64)lifetime * NSEC_PER_SEC;
	/* Refresh at most once a second per entry: fewer cache-line writes.
	 * `lifetime` is rewritten with `expires` so that svc-gc can tell when
	 * the entry was last refreshed (a changed lifetime forces a write). */
	if (state != e->tcp_state || lifetime != e->lifetime || expires > e->expires + NSEC_PER_SEC) {
		e->tcp_state = state;
		e->lifetime = lifetime;
		e->expires = expires;
	}
}

static __always_inline int ct_create(const struct pkt *p, __u8 dir, __u32 src_identity, __u32 ep_id,
				     __u32 policy_revision, const struct datapath_config *cfg)
{
	struct ct_entry e = {};

	e.flags = (p->svc & 1) * CT_F_SERVICE | (p->nodeport & 1) * CT_F_NODEPORT;

	if (p->protocol == IPPROTO_TCP) {
		e.tcp_state = CT_TCP_SYN;
		if (p->tcp_flags & TCP_FLAG_RST)
			e.tcp_state = CT_TCP_CLOSING;
		e.tcp_flags_fwd = p->tcp_flags;
	}
	e.lifetime = ct_lifetime(cfg, p->protocol, e.tcp_state);
	e.expires = bpf_ktime_get_ns() + (__u64)e.lifetime * NSEC_PER_SEC;
	e.packets_fwd = 1;
	e.bytes_fwd = p->len;
	e.src_identity = src_identity;
	e.endpoint_id = ep_id;
	e.policy_revision = policy_revision; /* policy_verdict 0: allowed */
	if (p->family == 4) {
		struct ct4_key k;
		ct4_key_of(&k, p, dir, 0);
		return bpf_map_update_elem(&ct4, &k, &e, BPF_ANY);
	} else {
		struct ct6_key k;
		ct6_key_of(&k, p, dir, 0);
		return bpf_map_update_elem(&ct6, &k, &e, BPF_ANY);
	}
}

/* Conntrack + policy for one direction of one endpoint. Returns 0 to pass
 * or a drop reason.
 *
 * A connection's first packet takes the policy verdict; an allowed one
 * creates the conntrack entry, which caches the verdict with the policy
 * revision it was taken at (datapath_config.policy_revision, which the
 * loader bumps after every change to a map a verdict reads). Later packets
 * and replies pay for the conntrack lookup alone while the revision holds;
 * the first one after a change takes the verdict again for the connection
 * (its opening direction, port and peer) and caches the new one, so a
 * policy change reaches established connections at their next packet. A
 * cached deny drops the connection's packets (both ways) without touching
 * its counters, lifetime or TCP state. The peer's identity is looked up
 * only when a verdict is taken (or for a drop). */
static __always_inline int enforce(struct pkt *p, const struct endpoint_info *ep, __u8 dir,
				   const struct endpoint_info *peer_ep, const __u32 *peer_addr, __u32 peer_id,
				   const struct datapath_config *cfg, __u32 *peer_out)
{
	__u32 enforce_flag = dir == DIR_EGRESS ? EP_F_ENFORCE_EGRESS : EP_F_ENFORCE_INGRESS;
	__u32 revision, peer, src_id, dst_id;
	struct ct_entry *e;
	int reply, reason;
	__u8 proto, flags;

	*peer_out = 0;
	p->rev_nat = 0;
	p->rev_nodeport = 0;
	if (p->fragment)
		return (ep->flags & enforce_flag) ? DROP_FRAGMENT_UNTRACKED : 0;
	/* Read before any policy lookup: a verdict taken while the loader
	 * writes a change is cached at the revision before it, and taken again
	 * once the change's bump lands. */
	revision = cfg ? *(volatile __u32 *)&cfg->policy_revision : 0;
	e = ct_find_either(p, dir, &reply);
	/* A fresh SYN on a closing entry is a new connection (the port was
	 * reused): the entry goes and policy decides again. */
	if (e && !reply && p->protocol == IPPROTO_TCP && e->tcp_state == CT_TCP_CLOSING &&
	    (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN) {
		ct_delete(p, dir);
		e = 0;
	}
	if (e) {
		if (e->policy_revision != revision) {
			/* The entry is `ep`'s, opened in `dir`, or, for a reply, in
			 * the other direction by the packet's reverse; the peer is
			 * the other side either way. */
			__u8 open_dir = reply ? (dir == DIR_EGRESS ? DIR_INGRESS : DIR_EGRESS) : dir;

			peer = peer_id ? peer_id : peer_ep ? peer_ep->identity : identity_of(p, peer_addr);
			*peer_out = peer;
			e->policy_verdict = judge(ep, open_dir, peer, p->protocol, reply ? p->sport : p->dport, p,
						  peer_addr);
			e->policy_revision = revision;
		}
		if (e->policy_verdict) {
			if (!*peer_out)
				*peer_out = peer_id ? peer_id : peer_ep ? peer_ep->identity : identity_of(p, peer_addr);
			return e->policy_verdict;
		}
		if (!p->icmp_error)
			ct_refresh(e, p, reply, cfg);
		/* A connection translated after its entry was made (a service
		 * frontend added under it, an entry of a datapath without
		 * CT_F_NODEPORT) is a translated connection from now on. */
		flags = e->flags | (p->svc & 1) * CT_F_SERVICE | (p->nodeport & 1) * CT_F_NODEPORT;
		if (flags != e->flags)
			e->flags = flags;
		p->rev_nat = ((flags & CT_F_SERVICE) >> 3) & reply;
		p->rev_nodeport = ((flags & CT_F_NODEPORT) >> 4) & reply;
		return 0;
	}
	peer = peer_id ? peer_id : peer_ep ? peer_ep->identity : identity_of(p, peer_addr);
	*peer_out = peer;
	src_id = dir == DIR_EGRESS ? ep->identity : peer;
	dst_id = dir == DIR_EGRESS ? peer : ep->identity;
	/* An ICMP error of no known connection is judged as plain ICMP and
	 * never opens one. */
	proto = p->icmp_error ? (p->family == 4 ? IPPROTO_ICMP : IPPROTO_ICMPV6) : p->protocol;
	reason = judge(ep, dir, peer, proto, p->dport, p, peer_addr);
	if (cfg && (cfg->event_flags & CONFIG_EVENT_VERDICTS))
		emit(EVENT_POLICY_VERDICT, reason, dir, reason ? VERDICT_DENY : VERDICT_ALLOW, p, ep, src_id, dst_id);
	if (reason)
		return reason;
	if (p->icmp_error)
		return 0;
	if (ct_create(p, dir, src_id, ep->endpoint_id, revision, cfg) < 0)
		return DROP_CT_MAP_FULL;
	return 0;
}

/* enforce() out of line, one function per way the programs call it: each
 * program's frame and the frames of the functions it calls share 512 bytes
 * of stack, and enforce's locals kept inline left too little for the
 * service functions. */
static __noinline int enforce_egress(struct pkt *p, const struct endpoint_info *ep, const struct endpoint_info *dst,
				     const struct datapath_config *cfg, __u32 *peer_out)
{
	return enforce(p, ep, DIR_EGRESS, dst, p->daddr, 0, cfg, peer_out);
}

/* Ingress of `dst` from the local endpoint `src`. */
static __noinline int enforce_ingress_local(struct pkt *p, const struct endpoint_info *dst,
					    const struct endpoint_info *src, const struct datapath_config *cfg,
					    __u32 *peer_out)
{
	return enforce(p, dst, DIR_INGRESS, src, p->saddr, 0, cfg, peer_out);
}

/* Ingress of `ep` from the packet's source, of identity `peer_id` (0: look
 * it up). */
static __noinline int enforce_ingress(struct pkt *p, const struct endpoint_info *ep, __u32 peer_id,
				      const struct datapath_config *cfg, __u32 *peer_out)
{
	return enforce(p, ep, DIR_INGRESS, 0, p->saddr, peer_id, cfg, peer_out);
}

/* --------------------------------------------------- ARP and neighbours */

struct arp_eth {
	__u8 dst[6];
	__u8 src[6];
	__u16 proto;
	__u16 htype;
	__u16 ptype;
	__u8 hlen;
	__u8 plen;
	__u16 op;
	__u8 sha[6];
	__u8 spa[4];
	__u8 tha[6];
	__u8 tpa[4];
} __attribute__((packed));

/* Answers the pod's ARP requests (its gateway, or any address it believes
 * on-link) with the host-side veth MAC, so no proxy-ARP sysctl is needed.
 * Returns the tc verdict, or -1 for a frame too short for an ARP message
 * (the caller drops and counts it). */
static __noinline int arp_respond(struct __sk_buff *skb, const struct endpoint_info *ep)
{
	struct arp_eth a;
	__u8 tmp[4];
	__u32 target;

	if (bpf_skb_load_bytes(skb, 0, &a, sizeof(a)) < 0)
		return -1;
	if (a.htype != bpf_htons(ARPHRD_ETHER) || a.ptype != bpf_htons(ETH_P_IP) || a.op != bpf_htons(ARPOP_REQUEST))
		return TC_ACT_OK;
	/* Its own address: duplicate address detection or gratuitous ARP. */
	__builtin_memcpy(&target, a.tpa, 4);
	if (target == ep->ipv4)
		return TC_ACT_OK;
	__builtin_memcpy(a.dst, a.src, 6);
	__builtin_memcpy(a.src, ep->node_mac, 6);
	a.op = bpf_htons(ARPOP_REPLY);
	__builtin_memcpy(a.tha, a.sha, 6);
	__builtin_memcpy(tmp, a.spa, 4);
	__builtin_memcpy(a.spa, a.tpa, 4);
	__builtin_memcpy(a.tpa, tmp, 4);
	__builtin_memcpy(a.sha, ep->node_mac, 6);
	if (bpf_skb_store_bytes(skb, 0, &a, sizeof(a), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

struct nd_msg {
	__u8 type;
	__u8 code;
	__u16 csum;
	__u32 flags;
	__u32 target[4];
	__u8 opt_type;
	__u8 opt_len;
	__u8 opt_mac[6];
};

struct pseudo6 {
	__u32 saddr[4];
	__u32 daddr[4];
	__u32 len;
	__u32 nexthdr;
};

static __always_inline __u16 csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/* Answers neighbour solicitations from the pod (`p`: parsed as one, right
 * behind the IPv6 header) for anything but its own address with a
 * neighbour advertisement carrying the host-side veth MAC, delivered into
 * the pod directly (bpf_redirect_peer). Returns the tc verdict, or -1 for
 * a solicitation shorter than its payload length says (the caller drops
 * and counts it). */
static __noinline int nd_respond(struct __sk_buff *skb, const struct endpoint_info *ep, const struct pkt *p)
{
	struct ipv6hdr ip;
	struct nd_msg nd = {};
	struct pseudo6 ph = {};
	__u8 eth[12];
	__u32 icmp_off = IP6_OFF + sizeof(struct ipv6hdr);
	__u32 len, sum;
	__s64 s;

	/* DAD (unspecified source) is not ours. */
	if (p->icmp_code != 0 || ipv6_is_unspecified(p->outer_saddr))
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, IP6_OFF, &ip, sizeof(ip)) < 0)
		return TC_ACT_SHOT;
	len = bpf_ntohs(ip.payload_len);
	if (len != 24 && len != 32)
		return TC_ACT_OK;
	if (bpf_skb_load_bytes(skb, icmp_off, &nd, len == 32 ? 32 : 24) < 0)
		return -1;
	/* Nor is the pod's own address. */
	if (ipv6_equal(nd.target, ep->ipv6))
		return TC_ACT_OK;
	if (len == 32 && (nd.opt_type != 1 || nd.opt_len != 1))
		return TC_ACT_OK;

	nd.type = 136;
	nd.csum = 0;
	nd.flags = bpf_htonl(0xe0000000); /* router, solicited, override */
	if (len == 32) {
		nd.opt_type = 2; /* target link-layer address */
		__builtin_memcpy(nd.opt_mac, ep->node_mac, 6);
	}
	__builtin_memcpy(&ip.daddr, &ip.saddr, 16);
	__builtin_memcpy(&ip.saddr, nd.target, 16);
	ip.hop_limit = 255;

	__builtin_memcpy(ph.saddr, &ip.saddr, 16);
	__builtin_memcpy(ph.daddr, &ip.daddr, 16);
	ph.len = bpf_htonl(len);
	ph.nexthdr = bpf_htonl(IPPROTO_ICMPV6);
	s = bpf_csum_diff(0, 0, (__be32 *)&ph, sizeof(ph), 0);
	if (s < 0)
		return TC_ACT_SHOT;
	s = bpf_csum_diff(0, 0, (__be32 *)&nd, len == 32 ? 32 : 24, (__u32)s);
	if (s < 0)
		return TC_ACT_SHOT;
	sum = (__u32)s;
	nd.csum = csum_fold(sum);

	if (bpf_skb_load_bytes(skb, 6, eth, 6) < 0) /* pod MAC = old source */
		return TC_ACT_SHOT;
	__builtin_memcpy(&eth[6], ep->node_mac, 6);
	if (bpf_skb_store_bytes(skb, 0, eth, 12, 0) < 0 ||
	    bpf_skb_store_bytes(skb, IP6_OFF, &ip, sizeof(ip), 0) < 0 ||
	    bpf_skb_store_bytes(skb, icmp_off, &nd, len == 32 ? 32 : 24, 0) < 0)
		return TC_ACT_SHOT;
	/* Straight into the pod: the answer is the datapath's own, not traffic
	 * for to_container's policy (its source is the target, a global address). */
	return bpf_redirect_peer(skb->ifindex, 0);
}

/* ------------------------------------------------------------ forwarding */

/* Routes the packet straight to a local endpoint's veth: rewrite MACs,
 * decrement TTL / hop limit, redirect to the veth's egress (where the
 * destination's to_container applies its ingress policy). */
static __always_inline int redirect_local(struct __sk_buff *skb, const struct pkt *p, const struct endpoint_info *dst)
{
	__u8 macs[12];

	if (p->family == 4) {
		__u16 old, new;
		__u8 ttl;
		if (bpf_skb_load_bytes(skb, IP4_OFF + 8, &old, 2) < 0)
			return -1;
		ttl = ((__u8 *)&old)[0];
		if (ttl <= 1)
			return 1; /* let the stack send time-exceeded */
		new = old;
		((__u8 *)&new)[0] = ttl - 1;
		if (bpf_l3_csum_replace(skb, IP4_OFF + 10, old, new, 2) < 0 ||
		    bpf_skb_store_bytes(skb, IP4_OFF + 8, &new, 2, 0) < 0)
			return -1;
	} else {
		__u8 hl;
		if (bpf_skb_load_bytes(skb, IP6_OFF + 7, &hl, 1) < 0)
			return -1;
		if (hl <= 1)
			return 1;
		hl -= 1;
		if (bpf_skb_store_bytes(skb, IP6_OFF + 7, &hl, 1, 0) < 0)
			return -1;
	}
	__builtin_memcpy(macs, dst->mac, 6);
	__builtin_memcpy(&macs[6], dst->node_mac, 6);
	if (bpf_skb_store_bytes(skb, 0, macs, 12, 0) < 0)
		return -1;
	return 0;
}

static __always_inline void trace(const struct datapath_config *cfg, __u8 point, __u8 dir, const struct pkt *p,
				  const struct endpoint_info *ep)
{
	if (cfg && (cfg->event_flags & CONFIG_EVENT_TRACE))
		emit(EVENT_TRACE, point, dir, 0, p, ep, 0, 0);
}

/* ---------------------------------------------------------------- overlay */

/* The ipcache entry of the address exactly (its longest prefix). */
static __always_inline struct ipcache_value *ipcache_of(__u8 family, const __u32 *addr)
{
	struct ipcache_key k = {};

	k.family = family;
	if (family == 4) {
		k.prefixlen = 32 + 32;
		k.addr[0] = addr[0];
	} else {
		k.prefixlen = 32 + 128;
		__builtin_memcpy(k.addr, addr, 16);
	}
	return bpf_map_lookup_elem(&ipcache, &k);
}

/* Sets the tunnel key: to the node at `endpoint` (IPv4, network order),
 * the source identity in the VNI (Cilium's scheme). */
static __always_inline int set_tunnel(struct __sk_buff *skb, __u32 endpoint, __u32 identity)
{
	struct bpf_tunnel_key key = {};

	key.remote_ipv4 = bpf_ntohl(endpoint);
	key.tunnel_id = identity;
	key.tunnel_ttl = 64;
	return bpf_skb_set_tunnel_key(skb, &key, sizeof(key), BPF_F_ZERO_CSUM_TX);
}

/* A pod's packet to another node's pod, vxlan mode: with the tunnel key set
 * (the pod's identity in the VNI), straight into the tunnel device. A packet
 * the tunnel cannot carry whole goes to the stack instead, whose route via
 * the tunnel device has its MTU: the kernel fragments it or answers "too
 * big" (ICMP fragmentation needed / ICMPv6 packet too big) to the pod, and
 * to_overlay sets the key of what it forwards. Returns the tc verdict, or
 * -1 when the destination is not behind the tunnel. */
static __always_inline int to_tunnel(struct __sk_buff *skb, const struct pkt *p, const struct endpoint_info *ep,
				     const struct routing_config *rc, const struct datapath_config *cfg)
{
	struct ipcache_value *v = ipcache_of(p->family, p->daddr);
	__u32 mtu = 0;

	if (!v || !v->tunnel_endpoint)
		return -1;
	/* Against the device's MTU, per segment for a GSO packet (a TCP
	 * burst of one skb is many packets of the right size on the wire). */
	if (bpf_check_mtu(skb, rc->tunnel_ifindex, &mtu, 0, BPF_MTU_CHK_SEGS) != BPF_MTU_CHK_RET_SUCCESS)
		return TC_ACT_OK;
	if (set_tunnel(skb, v->tunnel_endpoint, ep->identity) < 0)
		return drop(DROP_REDIRECT_FAILED, DIR_EGRESS, p, ep, ep->identity, v->identity);
	trace(cfg, TRACE_TO_OVERLAY, DIR_EGRESS, p, ep);
	return bpf_redirect(rc->tunnel_ifindex, 0);
}

/* --------------------------------------------------------------- services */
/*
 * ClusterIP load balancing (kube-proxy replacement), per packet, in
 * from_container:
 *
 * - A pod's packet to a frontend (lb_frontends, SVC_SCOPE_INTERNAL: VIP,
 *   port, protocol) is DNATed to a backend before policy, so the client's
 *   egress policy and the backend's ingress policy judge the backend's
 *   address and identity (Cilium's semantics); conntrack holds the
 *   translated tuple, with CT_F_SERVICE.
 * - The backend: the connection's FORWARD flow entry while that backend
 *   exists (TERMINATING too: open connections keep it; a fresh TCP SYN on
 *   a reused port to a terminating backend chooses again); else, with
 *   session affinity, the client's fresh lb_affinity entry if its backend
 *   is ACTIVE; else the Maglev table's slot hash(5-tuple) % LB_MAGLEV_SIZE
 *   (affinity: hash of the client address only). The hash is jhash over
 *   the tuple, the same on every node, so every node picks the same
 *   backend for a flow. A new choice records the FORWARD entry (client
 *   tuple -> backend) and the REVERSE entry (translated tuple -> VIP).
 * - No active backend: the packet is answered in BPF and dropped, counted
 *   and emitted as DROP_NO_SERVICE_BACKEND: TCP gets a RST, anything else
 *   ICMP / ICMPv6 port unreachable, straight into the pod, so connect()
 *   fails at once with ECONNREFUSED.
 * - Replies (a conntrack reply on a CT_F_SERVICE entry) get their source
 *   back from the REVERSE entry before they enter the client: in
 *   from_container (backend on this node), to_container (through the
 *   stack: native routing, node-local backends) and from_overlay (vxlan).
 *   ICMP errors about a translated connection are translated too (outer
 *   source, quoted destination address and port).
 * - Hairpin (a pod reaching itself through its service): the source is
 *   rewritten to the VIP as well (the pod's stack drops a packet from its
 *   own address arriving on eth0), keeping the client port, so the reply
 *   goes back to the VIP and is caught by from_container (LB_FLOW_F_HAIRPIN).
 *   The VIP rather than a dedicated loopback address: no address to
 *   reserve, and the tuple stays unique per VIP.
 * - A new flow whose translated tuple another flow holds (one client port
 *   to two VIPs sharing a backend) leaves with another client port, as the
 *   kernel's NAT does (lb_port_remap; SNAT_OUT / SNAT_IN entries, undone on
 *   the reply by lb_port_unmap).
 * - Flow entries follow their connection's conntrack deadline (written at
 *   most once a second, like conntrack); svc-gc removes expired ones.
 *
 * TCP and UDP only (SCTP's CRC32c checksum is not patched incrementally).
 * NodePort frontends are the nodeport section's.
 */

#define JHASH_INITVAL 0xdeadbeef

/* Ports the datapath's own NATs give flows: a ClusterIP client's remapped
 * port (lb_port_remap, LB_REMAP_TRIES tries per new flow) and NodePort's
 * SNAT (nodeport.h). Above Linux's default ephemeral range (it ends at
 * 60999): no socket's automatic port is one of them. */
#define LB_NAT_PORT_MIN 61000
#define LB_NAT_PORT_MAX 65535
#define LB_REMAP_TRIES 8

static __always_inline __u32 rol32(__u32 word, unsigned int shift)
{
	return (word << shift) | (word >> ((-shift) & 31));
}

/* The kernel's jhash_3words (Bob Jenkins' lookup3 final mix). */
static __always_inline __u32 lb_jhash3(__u32 a, __u32 b, __u32 c, __u32 initval)
{
	initval += JHASH_INITVAL + (3 << 2);
	a += initval;
	b += initval;
	c += initval;
	c ^= b;
	c -= rol32(b, 14);
	a ^= c;
	a -= rol32(c, 11);
	b ^= a;
	b -= rol32(a, 25);
	c ^= b;
	c -= rol32(b, 16);
	a ^= c;
	a -= rol32(c, 4);
	b ^= a;
	b -= rol32(a, 14);
	c ^= b;
	c -= rol32(b, 24);
	return c;
}

static __always_inline __u32 lb_fold(__u8 family, const __u32 *addr)
{
	return family == 4 ? addr[0] : addr[0] ^ addr[1] ^ addr[2] ^ addr[3];
}

static __always_inline int lb_addr_equal(__u8 family, const __u32 *a, const __u32 *b)
{
	return family == 4 ? a[0] == b[0] : ipv6_equal(a, b);
}

/* The frontend the packet is addressed to in `scope`, or NULL. */
static __always_inline struct lb_frontend *lb_frontend_of(const struct pkt *p, __u8 scope)
{
	struct lb_frontend_key k = {};

	if (p->protocol != IPPROTO_TCP && p->protocol != IPPROTO_UDP)
		return 0;
	if (p->family == 4)
		k.addr[0] = p->daddr[0];
	else
		__builtin_memcpy(k.addr, p->daddr, 16);
	k.port = p->dport;
	k.protocol = p->protocol;
	k.family = p->family;
	k.scope = scope;
	return bpf_map_lookup_elem(&lb_frontends, &k);
}

/* The flow entry of `dir` (LB_FLOW_*) keyed by the packet's tuple, or by
 * its reverse (`reverse`: the tuple the packet is a reply of). */
static __always_inline struct lb_flow *lb_flow_get(const struct pkt *p, int reverse, __u8 dir)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_key_of(&k, p, DIR_EGRESS, reverse);
		k.direction = dir;
		return bpf_map_lookup_elem(&lb4_flows, &k);
	} else {
		struct ct6_key k;
		ct6_key_of(&k, p, DIR_EGRESS, reverse);
		k.direction = dir;
		return bpf_map_lookup_elem(&lb6_flows, &k);
	}
}

static __always_inline int lb_flow_put(const struct pkt *p, __u8 dir, const struct lb_flow *f)
{
	if (p->family == 4) {
		struct ct4_key k;
		ct4_key_of(&k, p, DIR_EGRESS, 0);
		k.direction = dir;
		return bpf_map_update_elem(&lb4_flows, &k, f, BPF_ANY);
	} else {
		struct ct6_key k;
		ct6_key_of(&k, p, DIR_EGRESS, 0);
		k.direction = dir;
		return bpf_map_update_elem(&lb6_flows, &k, f, BPF_ANY);
	}
}

/* The flow map key of the tuple (saddr, sport) -> (daddr, dport) of `p`'s
 * protocol with `direction` (LB_FLOW_*); a flow map is keyed like
 * conntrack. */
static __always_inline void flow4_key(struct ct4_key *k, const __u32 *saddr, __u16 sport, const __u32 *daddr,
				      __u16 dport, __u8 protocol, __u8 direction)
{
	k->saddr = saddr[0];
	k->daddr = daddr[0];
	k->sport = sport;
	k->dport = dport;
	k->protocol = protocol;
	k->direction = direction;
	k->pad = 0;
}

static __always_inline void flow6_key(struct ct6_key *k, const __u32 *saddr, __u16 sport, const __u32 *daddr,
				      __u16 dport, __u8 protocol, __u8 direction)
{
	__builtin_memcpy(k->saddr, saddr, 16);
	__builtin_memcpy(k->daddr, daddr, 16);
	k->sport = sport;
	k->dport = dport;
	k->protocol = protocol;
	k->direction = direction;
	k->pad = 0;
}

static __always_inline struct lb_flow *flow_get(const struct pkt *p, const __u32 *saddr, __u16 sport,
						const __u32 *daddr, __u16 dport, __u8 direction)
{
	if (p->family == 4) {
		struct ct4_key k;
		flow4_key(&k, saddr, sport, daddr, dport, p->protocol, direction);
		return bpf_map_lookup_elem(&lb4_flows, &k);
	} else {
		struct ct6_key k;
		flow6_key(&k, saddr, sport, daddr, dport, p->protocol, direction);
		return bpf_map_lookup_elem(&lb6_flows, &k);
	}
}

static __always_inline int flow_put(const struct pkt *p, const __u32 *saddr, __u16 sport, const __u32 *daddr,
				    __u16 dport, __u8 direction, const struct lb_flow *v, __u64 flags)
{
	if (p->family == 4) {
		struct ct4_key k;
		flow4_key(&k, saddr, sport, daddr, dport, p->protocol, direction);
		return bpf_map_update_elem(&lb4_flows, &k, v, flags);
	} else {
		struct ct6_key k;
		flow6_key(&k, saddr, sport, daddr, dport, p->protocol, direction);
		return bpf_map_update_elem(&lb6_flows, &k, v, flags);
	}
}

/* Moves a flow entry's deadline to its connection's (conntrack entry
 * `e`'s), at most once a second. Returns whether it wrote. */
static __always_inline int lb_flow_touch(struct lb_flow *f, const struct ct_entry *e)
{
	if (!f || !e || e->expires <= f->expires + NSEC_PER_SEC)
		return 0;
	f->expires = e->expires;
	f->lifetime = e->lifetime;
	return 1;
}

/* An active backend of `fe` for a new flow, its id in `*id`; NULL when the
 * service has none. */
static __always_inline struct lb_backend *lb_select(const struct pkt *p, const struct lb_frontend *fe, __u64 now,
						    __u32 *id)
{
	struct lb_maglev_table *table;
	struct lb_backend *be;
	__u32 slot = 0, hash;
	__u32 table_id = fe->table_id;

	if (!fe->backend_count)
		return 0;
	if (fe->flags & SVC_F_AFFINITY) {
		struct lb_affinity_key ak = {};
		struct lb_affinity *a;

		__builtin_memcpy(ak.client, p->saddr, 16);
		ak.service_id = fe->service_id;
		ak.family = p->family;
		a = bpf_map_lookup_elem(&lb_affinity, &ak);
		if (a && now - a->last_used < (__u64)fe->affinity_timeout * NSEC_PER_SEC) {
			__u32 aid = a->backend_id;

			be = bpf_map_lookup_elem(&lb_backends, &aid);
			if (be && be->state == LB_BACKEND_ACTIVE && be->family == p->family) {
				*id = aid;
				return be;
			}
		}
		hash = lb_jhash3(lb_fold(p->family, p->saddr), 0, 0, 0);
	} else {
		hash = lb_jhash3(lb_fold(p->family, p->saddr), lb_fold(p->family, p->daddr),
				 ((__u32)p->sport << 16) | p->dport, p->protocol);
	}
	table = bpf_map_lookup_elem(&lb_maglev, &table_id);
	if (!table)
		return 0;
	/* One backend fills every slot. */
	if (fe->backend_count > 1)
		slot = hash % LB_MAGLEV_SIZE;
	/* Opaque to the compiler, so the bound the verifier needs stays. */
	asm volatile("" : "+r"(slot));
	if (slot >= LB_MAGLEV_SIZE)
		return 0;
	*id = table->backend_ids[slot];
	if (!*id)
		return 0;
	be = bpf_map_lookup_elem(&lb_backends, id);
	if (!be || be->state != LB_BACKEND_ACTIVE || be->family != p->family)
		return 0;
	return be;
}

/* Offset of the L4 checksum from the L4 header (TCP, UDP). */
static __always_inline __u32 lb_l4_csum_off(__u8 protocol)
{
	return protocol == IPPROTO_TCP ? 16 : 6;
}

/* Where the L4 header is, read from the packet rather than from `p`: the
 * services functions read only the fields of `p` the whole program reads
 * anyway (reading its parse-time fields here would keep them live to the
 * end and defeat the verifier's pruning). 1 with `*l4_off`; 0 for a later
 * fragment (no L4 header); -1 for an IPv6 packet whose next header is not
 * `nexthdr` (extension headers: not translated). */
static __always_inline int l4_locate(struct __sk_buff *skb, __u8 family, __u8 nexthdr, __u32 *l4_off)
{
	if (family == 4) {
		__u8 vihl;
		__u16 frag;

		if (bpf_skb_load_bytes(skb, IP4_OFF, &vihl, 1) < 0 || bpf_skb_load_bytes(skb, IP4_OFF + 6, &frag, 2) < 0)
			return -1;
		*l4_off = IP4_OFF + (vihl & 0xf) * 4;
		return (bpf_ntohs(frag) & 0x1fff) == 0;
	} else {
		__u8 nh;

		if (bpf_skb_load_bytes(skb, IP6_OFF + 6, &nh, 1) < 0 || nh != nexthdr)
			return -1;
		*l4_off = IP6_OFF + sizeof(struct ipv6hdr);
		return 1;
	}
}

/* Rewrites the packet's destination (`dst`) or source address to `addr`
 * and, when it has an L4 header at `l4_off` (`has_l4`: not a later
 * fragment), its port to `port`, patching the IPv4 header checksum and the L4 checksum (pseudo
 * header included); `p` follows. Returns 0, or -1 if the packet could not
 * be written. */
static __always_inline int lb_rewrite(struct __sk_buff *skb, struct pkt *p, __u32 l4_off, int has_l4, int dst,
					  const __u32 *addr, __u16 port)
{
	__u32 csum_off = l4_off + lb_l4_csum_off(p->protocol);
	__u64 mangled = p->protocol == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__u32 *cur = dst ? p->daddr : p->saddr;
	__u16 *cur_port = dst ? &p->dport : &p->sport;

	if (p->family == 4) {
		__u32 old = cur[0], new = addr[0];
		__u32 off = IP4_OFF + (dst ? 16 : 12);

		if (old != new) {
			if (has_l4 && bpf_l4_csum_replace(skb, csum_off, old, new, BPF_F_PSEUDO_HDR | mangled | 4) < 0)
				return -1;
			if (bpf_l3_csum_replace(skb, IP4_OFF + 10, old, new, 4) < 0 ||
			    bpf_skb_store_bytes(skb, off, &new, 4, 0) < 0)
				return -1;
			cur[0] = new;
		}
	} else if (!ipv6_equal(cur, addr)) {
		__s64 diff = bpf_csum_diff(cur, 16, (__u32 *)addr, 16, 0);

		if (diff < 0)
			return -1;
		if (has_l4 && bpf_l4_csum_replace(skb, csum_off, 0, (__u32)diff, BPF_F_PSEUDO_HDR | mangled) < 0)
			return -1;
		if (bpf_skb_store_bytes(skb, IP6_OFF + (dst ? 24 : 8), addr, 16, 0) < 0)
			return -1;
		__builtin_memcpy(cur, addr, 16);
	}
	if (has_l4 && *cur_port != port) {
		__u16 old_port = *cur_port;

		if (bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled | 2) < 0 ||
		    bpf_skb_store_bytes(skb, l4_off + (dst ? 2 : 0), &port, 2, 0) < 0)
			return -1;
		*cur_port = port;
	}
	return 0;
}

/* A translated packet's flow entries (`p`: its translated tuple; `fwd`:
 * its FORWARD entry, last refreshed over a second ago; `out`: its SNAT_OUT
 * entry when its client port was remapped) follow its connection's
 * conntrack entry (the client's egress entry), as it stood before this
 * packet. */
static __always_inline void lb_forward_touch(struct pkt *p, struct lb_flow *fwd, struct lb_flow *out)
{
	struct ct_entry *e = ct_find(p, DIR_EGRESS, 0);

	if (!lb_flow_touch(fwd, e))
		return;
	lb_flow_touch(lb_flow_get(p, 0, LB_FLOW_REVERSE), e);
	if (out && lb_flow_touch(out, e))
		lb_flow_touch(lb_flow_get(p, 1, LB_FLOW_SNAT_IN), e);
}

/* Whether the translated tuple client:`port` -> backend:`backend_port` of
 * new flow `p` (client -> `vip`:`vip_port`, not yet translated) is held by
 * a live flow other than `p`'s own. Not held: no REVERSE entry, or an
 * expired one; one of this very flow (its SYN sent again: to this VIP from
 * this client port, directly or through its SNAT_IN entry); or one whose
 * connection is over: its conntrack entry (the client's egress one, keyed
 * by the same tuple) expired, closing (a reset, or a FIN each way: a new
 * SYN replaces such a connection, as Linux conntrack's does in TIME_WAIT
 * and CLOSE) or gone — unless the REVERSE entry was written in the last
 * second (a flow being created on another CPU, its conntrack entry not yet
 * made). */
static __always_inline int lb_tuple_held(const struct pkt *p, const __u32 *backend, __u16 backend_port,
					 const __u32 *vip, __u16 vip_port, __u16 port, __u64 now)
{
	struct lb_flow *rev = flow_get(p, p->saddr, port, backend, backend_port, LB_FLOW_REVERSE);
	struct ct_entry *e;

	if (!rev || rev->expires < now)
		return 0;
	if (rev->port == vip_port && lb_addr_equal(p->family, rev->addr, vip)) {
		if (!(rev->flags & LB_FLOW_F_PORT_MAPPED)) {
			if (port == p->sport)
				return 0;
		} else {
			struct lb_flow *in = flow_get(p, backend, backend_port, p->saddr, port, LB_FLOW_SNAT_IN);

			if (in && in->port == p->sport)
				return 0;
		}
	}
	if (p->family == 4) {
		struct ct4_key k;
		flow4_key(&k, p->saddr, port, backend, backend_port, p->protocol, DIR_EGRESS);
		e = bpf_map_lookup_elem(&ct4, &k);
	} else {
		struct ct6_key k;
		flow6_key(&k, p->saddr, port, backend, backend_port, p->protocol, DIR_EGRESS);
		e = bpf_map_lookup_elem(&ct6, &k);
	}
	if (!e)
		return rev->expires - (__u64)rev->lifetime * NSEC_PER_SEC + NSEC_PER_SEC > now;
	return e->expires >= now && !(p->protocol == IPPROTO_TCP && e->tcp_state == CT_TCP_CLOSING);
}

/* The client port new flow `p` (client -> VIP, not yet translated) leaves
 * with towards backend:port. Its own, unless the translated tuple (client
 * -> backend) is held by another live flow (lb_tuple_held): one client
 * port reaching two VIPs that share a backend is one tuple after DNAT, and
 * the second SYN would meet the first connection. Then, as the kernel's
 * NAT does, another one: the first of LB_REMAP_TRIES ports from a hash of
 * the flow's tuple in [LB_NAT_PORT_MIN, LB_NAT_PORT_MAX] (above Linux's
 * default ephemeral range, so the pod's own automatic ports never meet
 * them) that is not held (the same flow finds the same port again). Only
 * live connections of this client to this backend hold ports, so every try
 * is held only when thousands are open at once. Returns the port (network
 * order), 0 when every try is held. */
static __always_inline __u16 lb_port_remap(const struct pkt *p, const __u32 *backend, __u16 backend_port,
					   const __u32 *vip, __u16 vip_port, __u64 now)
{
	const __u32 range = LB_NAT_PORT_MAX - LB_NAT_PORT_MIN + 1;
	__u32 start = lb_jhash3(lb_fold(p->family, p->saddr), lb_fold(p->family, vip),
				((__u32)p->sport << 16) | vip_port, p->protocol);
	int i;

	/* Try -1 is the client's own port; one check in the loop keeps the
	 * caller's frame small. */
	for (i = -1; i < LB_REMAP_TRIES; i++) {
		__u16 port = i < 0 ? p->sport : bpf_htons(LB_NAT_PORT_MIN + (start + i) % range);

		if (!lb_tuple_held(p, backend, backend_port, vip, vip_port, port, now))
			return port;
	}
	return 0;
}

/* A reply on a flow whose client port lb_forward remapped (`p`: backend
 * -> client:remapped port): the client's own port back as destination
 * (its SNAT_IN entry), the entry following conntrack entry `e` (NULL: not
 * due). Returns 0, or -1 (no entry, or not written). */
static __always_inline int lb_port_unmap(struct __sk_buff *skb, struct pkt *p, __u32 l4_off, int has_l4,
					 const struct ct_entry *e)
{
	struct lb_flow *in = lb_flow_get(p, 0, LB_FLOW_SNAT_IN);
	__u64 mangled = p->protocol == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__u16 port;

	if (!in)
		return -1;
	lb_flow_touch(in, e);
	if (!has_l4)
		return 0; /* a later fragment: no ports */
	port = in->port;
	if (bpf_l4_csum_replace(skb, l4_off + lb_l4_csum_off(p->protocol), p->dport, port, mangled | 2) < 0 ||
	    bpf_skb_store_bytes(skb, l4_off + 2, &port, 2, 0) < 0)
		return -1;
	p->dport = port;
	return 0;
}

/* A NodePort frontend the pod reaches at an address of this node
 * (nodeport.h: every backend, whatever the external traffic policy). */
static __always_inline struct lb_frontend *nodeport_of_this_node(struct __sk_buff *skb, const struct pkt *p);

/* The translation of a pod's packet to a frontend. Returns 0 (not to a
 * service, or translated: then `p->svc` is set and `p` holds the backend's
 * tuple), DROP_NO_SERVICE_BACKEND (the caller rejects it), another
 * drop reason, or -1 (the packet could not be rewritten). A function of its
 * own: the verifier walks it once per call rather than once per path of
 * its caller. */
__noinline int lb_forward(struct __sk_buff *skb, struct pkt *p)
{
	const struct datapath_config *cfg = get_config();
	struct lb_frontend *fe;
	struct lb_flow *f, *out = 0;
	struct lb_backend *be = 0;
	struct lb_flow v;
	const __u32 *backend_addr;
	__u32 vip[4], id = 0;
	__u16 backend_port, vip_port, client_port, port;
	__u64 now;
	__u32 l4_off;
	int hairpin, has_l4;

	if (!p || p->icmp_error || p->fragment)
		return 0;
	fe = lb_frontend_of(p, SVC_SCOPE_INTERNAL);
	if (!fe)
		fe = nodeport_of_this_node(skb, p);
	if (!fe)
		return 0;
	has_l4 = l4_locate(skb, p->family, p->protocol, &l4_off);
	if (has_l4 < 0)
		return 0;
	now = bpf_ktime_get_ns();
	__builtin_memcpy(vip, p->daddr, 16);
	vip_port = p->dport;
	client_port = p->sport;
	port = client_port;
	f = lb_flow_get(p, 0, LB_FLOW_FORWARD);
	if (f) {
		__u32 fid = f->backend_id;

		be = bpf_map_lookup_elem(&lb_backends, &fid);
		if (!be || be->family != p->family || be->port != f->port || !lb_addr_equal(p->family, be->addr, f->addr))
			f = 0; /* its backend is gone (or the id was reused) */
		else if (f->expires < now)
			f = 0; /* its connection is over: its tuple may be another's */
		else if (p->protocol == IPPROTO_TCP && (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN)
			/* A new connection (or its SYN again) on a reused port:
			 * chosen afresh, as for a first SYN. Its old flow's
			 * translated tuple may be another flow's by now, and a
			 * terminating backend takes no new connection. */
			f = 0;
	}
	/* Its client port remapped: the port is in its SNAT_OUT entry (lost:
	 * chosen again, the same one). */
	if (f && (f->flags & LB_FLOW_F_PORT_MAPPED)) {
		out = lb_flow_get(p, 0, LB_FLOW_SNAT_OUT);
		if (out)
			port = out->port;
		else
			f = 0;
	}
	/* The backend's address is read from its map entry (stack is short
	 * here: from_container's frame and this one share 512 bytes). */
	if (f) {
		backend_addr = f->addr;
		backend_port = f->port;
	} else {
		/* A hairpinned connection's reply whose client port happens to
		 * be the frontend's port is a reply, not a new flow. */
		if (lb_flow_get(p, 1, LB_FLOW_REVERSE))
			return 0;
		be = lb_select(p, fe, now, &id);
		if (!be)
			return DROP_NO_SERVICE_BACKEND;
		backend_addr = be->addr;
		backend_port = be->port;
		/* Hairpin keeps its port: the VIP as source makes its tuple unique. */
		if (!lb_addr_equal(p->family, backend_addr, p->saddr)) {
			port = lb_port_remap(p, backend_addr, backend_port, vip, vip_port, now);
			if (!port)
				return DROP_NAT_NO_PORT;
		}
		__builtin_memset(&v, 0, sizeof(v));
		v.lifetime = ct_lifetime(cfg, p->protocol, p->protocol == IPPROTO_TCP ? CT_TCP_SYN : 0);
		v.expires = now + (__u64)v.lifetime * NSEC_PER_SEC;
		__builtin_memcpy(v.addr, backend_addr, 16);
		v.port = backend_port;
		v.family = p->family;
		v.flags = port != client_port ? LB_FLOW_F_PORT_MAPPED : 0;
		v.backend_id = id;
		v.service_id = fe->service_id;
		if (lb_flow_put(p, LB_FLOW_FORWARD, &v) < 0)
			return DROP_CT_MAP_FULL;
		if (port != client_port) {
			/* SNAT_OUT: by the client's tuple, the port it leaves with. */
			__builtin_memcpy(v.addr, p->saddr, 16);
			v.port = port;
			if (lb_flow_put(p, LB_FLOW_SNAT_OUT, &v) < 0)
				return DROP_CT_MAP_FULL;
		}
		if (fe->flags & SVC_F_AFFINITY) {
			struct lb_affinity_key ak = {};
			struct lb_affinity av = {.last_used = now, .backend_id = id};

			__builtin_memcpy(ak.client, p->saddr, 16);
			ak.service_id = fe->service_id;
			ak.family = p->family;
			bpf_map_update_elem(&lb_affinity, &ak, &av, BPF_ANY);
		}
	}
	hairpin = lb_addr_equal(p->family, backend_addr, p->saddr);
	if (lb_rewrite(skb, p, l4_off, has_l4, 1, backend_addr, backend_port) < 0)
		return -1;
	/* Hairpin: the VIP as source; a remapped flow: its port. */
	if ((hairpin || port != client_port) && lb_rewrite(skb, p, l4_off, has_l4, 0, hairpin ? vip : p->saddr, port) < 0)
		return -1;
	if (!f) {
		/* Keyed by the translated tuple, which `p` now holds. */
		__builtin_memcpy(v.addr, vip, 16);
		v.port = vip_port;
		v.flags = hairpin ? LB_FLOW_F_HAIRPIN : port != client_port ? LB_FLOW_F_PORT_MAPPED : 0;
		if (lb_flow_put(p, LB_FLOW_REVERSE, &v) < 0)
			return DROP_CT_MAP_FULL;
		if (port != client_port) {
			/* SNAT_IN: by the reply's tuple, the client's own port. */
			__builtin_memcpy(v.addr, p->saddr, 16);
			v.port = client_port;
			v.flags = 0;
			if (flow_put(p, p->daddr, p->dport, p->saddr, p->sport, LB_FLOW_SNAT_IN, &v, BPF_ANY) < 0)
				return DROP_CT_MAP_FULL;
		}
	} else if (f->expires + NSEC_PER_SEC < now + (__u64)f->lifetime * NSEC_PER_SEC) {
		/* Last refreshed over a second ago. */
		lb_forward_touch(p, f, out);
	}
	p->svc = 1;
	return 0;
}

/* An ICMP error about a translated connection, travelling to its client:
 * the outer source (the backend, or a router on the way) becomes the VIP
 * when it is the backend, and the quoted packet's destination address and
 * port become the VIP's, so the client's stack finds its socket. The
 * quoted packet's own L4 checksum is left alone (the stacks do not check
 * it). IPv4: the quoted header's checksum is patched with its address, so
 * the ICMP checksum only changes with the port. */
static __always_inline int lb_reverse_icmp(struct __sk_buff *skb, struct pkt *p, __u32 l4_off,
					   const struct lb_flow *rev)
{
	__u32 icmp_csum = l4_off + 2;
	__u32 inner = l4_off + 8;
	__u16 old_port = p->sport, new_port = rev->port;
	__u32 outer[4];

	if (p->family == 4) {
		__u32 old = p->saddr[0], new = rev->addr[0];
		__u8 ihl;

		if (bpf_skb_load_bytes(skb, IP4_OFF + 12, outer, 4) < 0)
			return -1;
		if (outer[0] == old &&
		    (bpf_l3_csum_replace(skb, IP4_OFF + 10, old, new, 4) < 0 ||
		     bpf_skb_store_bytes(skb, IP4_OFF + 12, &new, 4, 0) < 0))
			return -1;
		if (bpf_skb_load_bytes(skb, inner, &ihl, 1) < 0)
			return -1;
		if (bpf_l3_csum_replace(skb, inner + 10, old, new, 4) < 0 ||
		    bpf_skb_store_bytes(skb, inner + 16, &new, 4, 0) < 0)
			return -1;
		if (old_port != new_port) {
			__u32 port_off = inner + (ihl & 0xf) * 4 + 2;

			if (bpf_l4_csum_replace(skb, icmp_csum, old_port, new_port, 2) < 0 ||
			    bpf_skb_store_bytes(skb, port_off, &new_port, 2, 0) < 0)
				return -1;
		}
		p->saddr[0] = new;
	} else {
		__s64 diff = bpf_csum_diff(p->saddr, 16, (__u32 *)rev->addr, 16, 0);

		if (diff < 0)
			return -1;
		if (bpf_skb_load_bytes(skb, IP6_OFF + 8, outer, 16) < 0)
			return -1;
		if (ipv6_equal(outer, p->saddr) &&
		    (bpf_l4_csum_replace(skb, icmp_csum, 0, (__u32)diff, BPF_F_PSEUDO_HDR) < 0 ||
		     bpf_skb_store_bytes(skb, IP6_OFF + 8, rev->addr, 16, 0) < 0))
			return -1;
		if (bpf_l4_csum_replace(skb, icmp_csum, 0, (__u32)diff, 0) < 0 ||
		    bpf_skb_store_bytes(skb, inner + 24, rev->addr, 16, 0) < 0)
			return -1;
		if (old_port != new_port &&
		    (bpf_l4_csum_replace(skb, icmp_csum, old_port, new_port, 2) < 0 ||
		     bpf_skb_store_bytes(skb, inner + 40 + 2, &new_port, 2, 0) < 0))
			return -1;
		__builtin_memcpy(p->saddr, rev->addr, 16);
	}
	p->sport = new_port;
	return 0;
}

/* Reverse NAT of a reply on a translated connection (`p->rev_nat` from
 * enforce), by its REVERSE entry: the source becomes the frontend again; a
 * hairpinned reply also gets its client's address back as destination
 * (`hairpin`: the caller delivers it as one; a REVERSE entry that
 * disagrees is an error). Both flow entries follow the connection.
 * Returns 0 (also when there is no entry), or -1 if the packet could not
 * be rewritten. */
static __noinline int lb_reverse(struct __sk_buff *skb, struct pkt *p, int hairpin)
{
	struct ct_entry *e = 0;
	struct lb_flow *rev;
	__u32 l4_off;
	int has_l4;

	if (!p)
		return -1;
	rev = lb_flow_get(p, 1, LB_FLOW_REVERSE);
	if (!rev)
		return hairpin ? -1 : 0;
	if (!!(rev->flags & LB_FLOW_F_HAIRPIN) != !!hairpin)
		return -1;
	if (rev->expires + NSEC_PER_SEC < bpf_ktime_get_ns() + (__u64)rev->lifetime * NSEC_PER_SEC)
		e = ct_find(p, DIR_INGRESS, 1);
	has_l4 = l4_locate(skb, p->family, p->icmp_error && p->family == 6 ? IPPROTO_ICMPV6 : p->protocol, &l4_off);
	if (has_l4 < 0)
		return hairpin ? -1 : 0;
	if (p->icmp_error)
		return hairpin || !has_l4 ? -1 : lb_reverse_icmp(skb, p, l4_off, rev);
	/* Hairpinned: the client is the sender itself. */
	if (hairpin && lb_rewrite(skb, p, l4_off, has_l4, 1, p->saddr, p->dport) < 0)
		return -1;
	/* Its client port remapped by lb_forward: the client's own back. */
	if ((rev->flags & LB_FLOW_F_PORT_MAPPED) && lb_port_unmap(skb, p, l4_off, has_l4, e) < 0)
		return -1;
	if (lb_rewrite(skb, p, l4_off, has_l4, 0, rev->addr, rev->port) < 0)
		return -1;
	/* Last refreshed over a second ago: both entries follow the client's
	 * conntrack entry (its egress one; the FORWARD entry is keyed by the
	 * reverse of the reply, now VIP -> client). */
	if (e && lb_flow_touch(rev, e))
		lb_flow_touch(lb_flow_get(p, 1, LB_FLOW_FORWARD), e);
	return 0;
}

/* ---------------------------------------------------------- service reject */

struct tcp_min {
	__u16 sport;
	__u16 dport;
	__u32 seq;
	__u32 ack;
	__u8 doff;  /* data offset in the high nibble */
	__u8 flags;
	__u16 window;
	__u16 csum;
	__u16 urg;
};

struct lb_pseudo4 {
	__u32 saddr;
	__u32 daddr;
	__u8 zero;
	__u8 protocol;
	__u16 len;
};

struct rst4 {
	struct lb_pseudo4 ph; /* checksummed, not sent */
	struct iphdr ip;
	struct tcp_min tcp;
};

struct rst6 {
	struct pseudo6 ph;
	struct ipv6hdr ip;
	struct tcp_min tcp;
};

struct unreach4 {
	struct iphdr ip;
	__u8 type;
	__u8 code;
	__u16 csum;
	__u32 unused;
	__u8 quote[28]; /* the offending IP header (without options) and 8 bytes of L4 */
};

struct unreach6 {
	struct pseudo6 ph;
	struct ipv6hdr ip;
	__u8 type;
	__u8 code;
	__u16 csum;
	__u32 unused;
	__u8 quote[48]; /* the offending IPv6 header and 8 bytes of what follows */
};

#define ICMP_PORT_UNREACH 3
#define ICMPV6_PORT_UNREACH 4

/* The RST answering TCP segment `in` (RFC 9293 3.10.7.1: the segment's
 * ACK as sequence number if it has one, else an ACK of what it occupies). */
static __always_inline void rst_of(struct tcp_min *out, const struct tcp_min *in, __u32 payload)
{
	__u32 seg_len = payload;

	__builtin_memset(out, 0, sizeof(*out));
	out->sport = in->dport;
	out->dport = in->sport;
	out->doff = 5 << 4;
	if (in->flags & TCP_FLAG_ACK) {
		out->seq = in->ack;
		out->flags = TCP_FLAG_RST;
	} else {
		if (in->flags & TCP_FLAG_SYN)
			seg_len += 1;
		if (in->flags & TCP_FLAG_FIN)
			seg_len += 1;
		out->ack = bpf_htonl(bpf_ntohl(in->seq) + seg_len);
		out->flags = TCP_FLAG_RST | TCP_FLAG_ACK;
	}
}

static __always_inline void ip4_header(struct iphdr *ip, __u32 saddr, __u32 daddr, __u8 protocol, __u16 tot_len)
{
	__s64 s;

	__builtin_memset(ip, 0, sizeof(*ip));
	ip->version = 4;
	ip->ihl = 5;
	ip->tot_len = bpf_htons(tot_len);
	ip->ttl = 64;
	ip->protocol = protocol;
	ip->saddr = saddr;
	ip->daddr = daddr;
	s = bpf_csum_diff(0, 0, (__be32 *)ip, sizeof(*ip), 0);
	ip->check = s < 0 ? 0 : csum_fold((__u32)s);
}

static __always_inline void ip6_header(struct ipv6hdr *ip, const __u32 *saddr, const __u32 *daddr, __u8 nexthdr,
				       __u16 payload_len)
{
	__builtin_memset(ip, 0, sizeof(*ip));
	ip->version = 6;
	ip->payload_len = bpf_htons(payload_len);
	ip->nexthdr = nexthdr;
	ip->hop_limit = 64;
	__builtin_memcpy(&ip->saddr, saddr, 16);
	__builtin_memcpy(&ip->daddr, daddr, 16);
}

/* Makes the packet `len` bytes of frame, the Ethernet addresses swapped
 * (back to whoever sent it), and writes `len - ETH_HLEN_` bytes of `data`
 * behind them. */
static __always_inline int reply_frame(struct __sk_buff *skb, const void *data, __u32 len)
{
	__u8 eth[12], swapped[12];

	if (bpf_skb_load_bytes(skb, 0, eth, 12) < 0)
		return -1;
	__builtin_memcpy(swapped, &eth[6], 6);
	__builtin_memcpy(&swapped[6], eth, 6);
	if (bpf_skb_change_tail(skb, len, 0) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, 0, swapped, 12, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_HLEN_, data, len - ETH_HLEN_, 0) < 0)
		return -1;
	return 0;
}

/* Turns a packet to a service without active backends into the answer
 * its sender gets: a TCP RST, or ICMP / ICMPv6 port unreachable, from the
 * frontend's address, ready to be sent back where it came from. Returns
 * 0, or -1 when the packet cannot be answered (then it is just dropped). */
static __noinline int lb_reject(struct __sk_buff *skb, const struct pkt *p)
{
	__u32 l4_off;
	__s64 s;

	if (l4_locate(skb, p->family, p->protocol, &l4_off) < 0)
		return -1;
	if (p->family == 4) {
		if (p->protocol == IPPROTO_TCP) {
			struct rst4 r = {};
			struct tcp_min in;
			struct iphdr ip;
			__u32 payload;

			if (bpf_skb_load_bytes(skb, IP4_OFF, &ip, sizeof(ip)) < 0 ||
			    bpf_skb_load_bytes(skb, l4_off, &in, sizeof(in)) < 0)
				return -1;
			payload = bpf_ntohs(ip.tot_len) - (ip.ihl & 0xf) * 4 - ((in.doff >> 4) & 0xf) * 4;
			rst_of(&r.tcp, &in, payload & 0xffff);
			r.ph.saddr = p->daddr[0];
			r.ph.daddr = p->saddr[0];
			r.ph.protocol = IPPROTO_TCP;
			r.ph.len = bpf_htons(sizeof(r.tcp));
			s = bpf_csum_diff(0, 0, (__be32 *)&r.ph, sizeof(r.ph), 0);
			if (s < 0)
				return -1;
			s = bpf_csum_diff(0, 0, (__be32 *)&r.tcp, sizeof(r.tcp), (__u32)s);
			if (s < 0)
				return -1;
			r.tcp.csum = csum_fold((__u32)s);
			ip4_header(&r.ip, p->daddr[0], p->saddr[0], IPPROTO_TCP, sizeof(r.ip) + sizeof(r.tcp));
			return reply_frame(skb, &r.ip, ETH_HLEN_ + sizeof(r.ip) + sizeof(r.tcp));
		} else {
			struct unreach4 u = {};

			if (bpf_skb_load_bytes(skb, IP4_OFF, u.quote, sizeof(u.quote)) < 0)
				return -1;
			u.type = ICMP_DEST_UNREACH;
			u.code = ICMP_PORT_UNREACH;
			s = bpf_csum_diff(0, 0, (__be32 *)&u.type, sizeof(u) - sizeof(u.ip), 0);
			if (s < 0)
				return -1;
			u.csum = csum_fold((__u32)s);
			ip4_header(&u.ip, p->daddr[0], p->saddr[0], IPPROTO_ICMP, sizeof(u));
			return reply_frame(skb, &u, ETH_HLEN_ + sizeof(u));
		}
	}
	if (p->protocol == IPPROTO_TCP) {
		struct rst6 r = {};
		struct tcp_min in;
		__u16 payload_len;
		__u32 payload;

		if (bpf_skb_load_bytes(skb, IP6_OFF + 4, &payload_len, 2) < 0 ||
		    bpf_skb_load_bytes(skb, l4_off, &in, sizeof(in)) < 0)
			return -1;
		payload = bpf_ntohs(payload_len) - ((in.doff >> 4) & 0xf) * 4;
		rst_of(&r.tcp, &in, payload & 0xffff);
		__builtin_memcpy(r.ph.saddr, p->daddr, 16);
		__builtin_memcpy(r.ph.daddr, p->saddr, 16);
		r.ph.len = bpf_htonl(sizeof(r.tcp));
		r.ph.nexthdr = bpf_htonl(IPPROTO_TCP);
		s = bpf_csum_diff(0, 0, (__be32 *)&r.ph, sizeof(r.ph), 0);
		if (s < 0)
			return -1;
		s = bpf_csum_diff(0, 0, (__be32 *)&r.tcp, sizeof(r.tcp), (__u32)s);
		if (s < 0)
			return -1;
		r.tcp.csum = csum_fold((__u32)s);
		ip6_header(&r.ip, p->daddr, p->saddr, IPPROTO_TCP, sizeof(r.tcp));
		return reply_frame(skb, &r.ip, ETH_HLEN_ + sizeof(r.ip) + sizeof(r.tcp));
	} else {
		struct unreach6 u = {};
		__u32 icmp_len = sizeof(u) - sizeof(u.ph) - sizeof(u.ip);

		if (bpf_skb_load_bytes(skb, IP6_OFF, u.quote, sizeof(u.quote)) < 0)
			return -1;
		u.type = ICMPV6_DEST_UNREACH;
		u.code = ICMPV6_PORT_UNREACH;
		__builtin_memcpy(u.ph.saddr, p->daddr, 16);
		__builtin_memcpy(u.ph.daddr, p->saddr, 16);
		u.ph.len = bpf_htonl(icmp_len);
		u.ph.nexthdr = bpf_htonl(IPPROTO_ICMPV6);
		s = bpf_csum_diff(0, 0, (__be32 *)&u.ph, sizeof(u.ph), 0);
		if (s < 0)
			return -1;
		s = bpf_csum_diff(0, 0, (__be32 *)&u.type, icmp_len, (__u32)s);
		if (s < 0)
			return -1;
		u.csum = csum_fold((__u32)s);
		ip6_header(&u.ip, p->daddr, p->saddr, IPPROTO_ICMPV6, icmp_len);
		return reply_frame(skb, &u.ip, ETH_HLEN_ + sizeof(u.ip) + icmp_len);
	}
}

/* NodePort: from_netdev / to_netdev, and the lookups from_container uses. */
#include "nodeport.h"

SEC("classifier")
int from_container(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct endpoint_info *ep, *dst;
	struct pkt p = {};
	int hairpin;
	__u32 peer;
	int r;

	p.len = skb->len;
	ep = endpoint_by_ifindex(skb->ifindex);
	if (!ep)
		return drop(DROP_UNKNOWN_ENDPOINT, DIR_EGRESS, &p, 0, 0, 0);

	/* A truncated ARP request or neighbour solicitation is dropped like any
	 * invalid packet: counted, with an event (found by the packet fuzzer). */
	if (skb->protocol == bpf_htons(ETH_P_ARP)) {
		r = arp_respond(skb, ep);
		if (r < 0)
			return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, ep, ep->identity, 0);
		return r;
	}
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		r = parse_ipv4(skb, &p);
		if (r)
			return drop(r, DIR_EGRESS, &p, ep, ep->identity, 0);
		if (!(ep->flags & EP_F_HAS_IPV4) || p.outer_saddr[0] != ep->ipv4)
			return drop(DROP_INVALID_SOURCE_ADDRESS, DIR_EGRESS, &p, ep, ep->identity, 0);
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		r = parse_ipv6(skb, &p);
		if (r)
			return drop(r, DIR_EGRESS, &p, ep, ep->identity, 0);
		if (p.protocol == IPPROTO_ICMPV6 && p.icmp_type == ICMPV6_NEIGHBOR_SOLICIT && !p.in_fragment &&
		    p.l4_off == IP6_OFF + sizeof(struct ipv6hdr)) {
			r = nd_respond(skb, ep, &p);
			if (r < 0)
				return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, ep, ep->identity, 0);
			if (r != TC_ACT_OK)
				return r;
		}
		/* Neighbour discovery and MLD stay on the link and bypass policy;
		 * everything else, link-local sources included, is traffic: a
		 * pod's only valid source is its address in the endpoint map. */
		if (icmp6_link_plumbing(&p, ep))
			return TC_ACT_OK;
		if (!(ep->flags & EP_F_HAS_IPV6) || !ipv6_equal(p.outer_saddr, ep->ipv6))
			return drop(DROP_INVALID_SOURCE_ADDRESS, DIR_EGRESS, &p, ep, ep->identity, 0);
	} else {
		return drop(DROP_UNSUPPORTED_L3, DIR_EGRESS, &p, ep, ep->identity, 0);
	}
	/* After the source check: a pod records fragments of its own flows only. */
	frag_track(&p);

	trace(cfg, TRACE_FROM_CONTAINER, DIR_EGRESS, &p, ep);
	/* To a service: translated to a backend before policy (see services). */
	r = lb_forward(skb, &p);
	if (r == DROP_NO_SERVICE_BACKEND) {
		count(r, DIR_EGRESS, p.len);
		emit(EVENT_DROP, r, DIR_EGRESS, 0, &p, ep, ep->identity, 0);
		if (lb_reject(skb, &p) < 0)
			return TC_ACT_SHOT;
		return bpf_redirect_peer(skb->ifindex, 0);
	}
	if (r)
		return drop(r < 0 ? DROP_INVALID_PACKET : r, DIR_EGRESS, &p, ep, ep->identity, 0);
	dst = endpoint_by_addr(&p, p.daddr);
	r = enforce_egress(&p, ep, dst, cfg, &peer);
	if (r)
		return drop(r, DIR_EGRESS, &p, ep, ep->identity, peer);
	count(REASON_FORWARDED, DIR_EGRESS, p.len);
	/* A reply on a translated connection from a backend here goes to a
	 * client here; to no endpoint, it is a hairpinned reply to the VIP,
	 * which goes back into the pod itself. */
	hairpin = 0;
	if (!dst && p.rev_nat) {
		hairpin = 1;
		dst = ep;
	}

	if (dst) {
		__u32 src_id;
		/* The destination's ingress policy, here, once: the packet then
		 * enters the pod directly (redirect to the veth peer), skipping
		 * the host veth's egress hook and a trip through its queue. */
		r = enforce_ingress_local(&p, dst, ep, cfg, &src_id);
		if (r)
			return drop(r, DIR_INGRESS, &p, dst, ep->identity, dst->identity);
		count(REASON_FORWARDED, DIR_INGRESS, p.len);
		/* A reply from a backend to its client on this node. */
		if (p.rev_nat && lb_reverse(skb, &p, hairpin) < 0)
			return drop(DROP_INVALID_PACKET, DIR_INGRESS, &p, dst, ep->identity, dst->identity);
		r = redirect_local(skb, &p, dst);
		if (r < 0)
			return drop(DROP_REDIRECT_FAILED, DIR_EGRESS, &p, ep, ep->identity, peer);
		if (r == 0) {
			trace(cfg, TRACE_TO_ENDPOINT, DIR_EGRESS, &p, dst);
			return bpf_redirect_peer(dst->ifindex, 0);
		}
	} else {
		struct routing_config *rc = get_routing();

		/* A reply of a NodePort flow into this backend: the node's answer
		 * to the client from here (nodeport.h). */
		if (p.rev_nodeport) {
			r = nodeport_backend_reply(skb, &p);
			if (r >= 0)
				return r;
		}
		if (rc && rc->mode == ROUTING_VXLAN && rc->tunnel_ifindex) {
			r = to_tunnel(skb, &p, ep, rc, cfg);
			if (r >= 0)
				return r;
		}
		/* Native mode: the stack routes it via the peer (measured against a
		 * FIB lookup + bpf_redirect_neigh here: the stack was faster, see
		 * svc-loader's README). */
	}
	trace(cfg, TRACE_TO_STACK, DIR_EGRESS, &p, ep);
	return TC_ACT_OK;
}

SEC("classifier")
int to_container(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct endpoint_info *ep;
	struct pkt p = {};
	__u32 peer;
	int r;

	p.len = skb->len;
	ep = endpoint_by_ifindex(skb->ifindex);
	if (!ep)
		return drop(DROP_UNKNOWN_ENDPOINT, DIR_INGRESS, &p, 0, 0, 0);

	if (skb->protocol == bpf_htons(ETH_P_ARP))
		return TC_ACT_OK;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		r = parse_ipv4(skb, &p);
		if (r)
			return drop(r, DIR_INGRESS, &p, ep, 0, ep->identity);
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		r = parse_ipv6(skb, &p);
		if (r)
			return drop(r, DIR_INGRESS, &p, ep, 0, ep->identity);
		/* Neighbour discovery and MLD from the node are link plumbing, not
		 * traffic; every other ICMPv6 message is under policy. */
		if (icmp6_link_plumbing(&p, 0))
			return TC_ACT_OK;
	} else {
		return drop(DROP_UNSUPPORTED_L3, DIR_INGRESS, &p, ep, 0, ep->identity);
	}
	frag_track(&p);

	trace(cfg, TRACE_TO_CONTAINER, DIR_INGRESS, &p, ep);
	r = enforce_ingress(&p, ep, 0, cfg, &peer);
	if (r)
		return drop(r, DIR_INGRESS, &p, ep, peer, ep->identity);
	count(REASON_FORWARDED, DIR_INGRESS, p.len);
	/* A reply from a backend the stack routed here (another node in
	 * native routing, the node itself). */
	if (p.rev_nat && lb_reverse(skb, &p, 0) < 0)
		return drop(DROP_INVALID_PACKET, DIR_INGRESS, &p, ep, peer, ep->identity);
	return TC_ACT_OK;
}

/* tc egress of the tunnel device: what the node's stack routes into it
 * (node-originated traffic to remote pods, pod packets too big for the
 * tunnel) has no tunnel key yet; it gets the destination's tunnel endpoint
 * and, in the VNI, the source pod's identity or remote-node (a node never
 * sends host). A packet that has a key (from_container's) passes as is. */
SEC("classifier")
int to_overlay(struct __sk_buff *skb)
{
	struct bpf_tunnel_key key = {};
	struct endpoint_info *src;
	struct ipcache_value *v;
	struct pkt p = {};

	if (bpf_skb_get_tunnel_key(skb, &key, sizeof(key), 0) == 0)
		return TC_ACT_OK;
	p.len = skb->len;
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		p.family = 4;
		if (bpf_skb_load_bytes(skb, IP4_OFF + 12, p.saddr, 4) < 0 ||
		    bpf_skb_load_bytes(skb, IP4_OFF + 16, p.daddr, 4) < 0)
			return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, 0, 0, 0);
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		p.family = 6;
		if (bpf_skb_load_bytes(skb, IP6_OFF + 8, p.saddr, 16) < 0 ||
		    bpf_skb_load_bytes(skb, IP6_OFF + 24, p.daddr, 16) < 0)
			return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, 0, 0, 0);
		/* The device's own multicast (MLD, router solicitations) has
		 * nowhere to go: no count, no event. */
		if (ipv6_is_multicast(p.daddr))
			return TC_ACT_SHOT;
	} else {
		return TC_ACT_SHOT;
	}
	v = ipcache_of(p.family, p.daddr);
	if (!v || !v->tunnel_endpoint)
		return drop(DROP_NO_TUNNEL_ENDPOINT, DIR_EGRESS, &p, 0, 0, v ? v->identity : IDENTITY_WORLD);
	src = endpoint_by_addr(&p, p.saddr);
	if (set_tunnel(skb, v->tunnel_endpoint, src ? src->identity : IDENTITY_REMOTE_NODE) < 0)
		return drop(DROP_REDIRECT_FAILED, DIR_EGRESS, &p, src, 0, v->identity);
	return TC_ACT_OK;
}

/* The outer source (IPv4, network order) and the VNI of a
 * decapsulated packet. Out of line: from_overlay's frame and those of the
 * functions it calls share 512 bytes of stack. */
static __noinline int tunnel_source(struct __sk_buff *skb, __u32 *outer, __u32 *vni)
{
	struct bpf_tunnel_key key = {};

	if (bpf_skb_get_tunnel_key(skb, &key, sizeof(key), 0) < 0)
		return -1;
	*outer = bpf_htonl(key.remote_ipv4);
	*vni = key.tunnel_id;
	return 0;
}

/* tc ingress of the tunnel device: decapsulated packets with their tunnel
 * key. The outer source must be a node (its ipcache identity remote-node,
 * claimed by the registry), else the VNI is not believed; the VNI is the
 * source identity, never host (1) or 0. To a local endpoint: its ingress
 * policy with that identity (not the inner source address's ipcache
 * entry), conntrack like local flows, then straight into the pod. Anything
 * else (the node's own addresses) goes to the stack. */
SEC("classifier")
int from_overlay(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct endpoint_info *dst;
	struct ipcache_value *node;
	__u32 outer = 0, identity, peer;
	struct pkt p = {};
	int r;

	p.len = skb->len;
	if (tunnel_source(skb, &outer, &identity) < 0)
		return drop(DROP_TUNNEL_SOURCE_NOT_NODE, DIR_INGRESS, &p, 0, 0, 0);
	node = ipcache_of(4, &outer); /* IPv4: reads addr[0] only */
	if (skb->protocol == bpf_htons(ETH_P_IP))
		r = parse_ipv4(skb, &p);
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(skb, &p);
	else
		r = DROP_UNSUPPORTED_L3;
	if (!node || node->identity != IDENTITY_REMOTE_NODE)
		return drop(DROP_TUNNEL_SOURCE_NOT_NODE, DIR_INGRESS, &p, 0, identity, 0);
	if (identity == IDENTITY_ANY || identity == IDENTITY_HOST || identity > 0xffffff)
		return drop(DROP_TUNNEL_IDENTITY_INVALID, DIR_INGRESS, &p, 0, identity, 0);
	if (r)
		return drop(r, DIR_INGRESS, &p, 0, identity, 0);

	dst = endpoint_by_addr(&p, p.daddr);
	if (!dst) {
		/* The inner frame is addressed to the sender's device: make it
		 * the stack's. */
		bpf_skb_change_type(skb, 0 /* PACKET_HOST */);
		return TC_ACT_OK;
	}
	frag_track(&p);
	trace(cfg, TRACE_FROM_OVERLAY, DIR_INGRESS, &p, dst);
	r = enforce_ingress(&p, dst, identity, cfg, &peer);
	if (r)
		return drop(r, DIR_INGRESS, &p, dst, identity, dst->identity);
	count(REASON_FORWARDED, DIR_INGRESS, p.len);
	/* A reply from a backend on another node (vxlan). */
	if (p.rev_nat && lb_reverse(skb, &p, 0) < 0)
		return drop(DROP_INVALID_PACKET, DIR_INGRESS, &p, dst, identity, dst->identity);
	r = redirect_local(skb, &p, dst);
	if (r < 0)
		return drop(DROP_REDIRECT_FAILED, DIR_INGRESS, &p, dst, identity, dst->identity);
	if (r > 0) {
		bpf_skb_change_type(skb, 0 /* PACKET_HOST */);
		return TC_ACT_OK; /* TTL exhausted: the stack answers */
	}
	trace(cfg, TRACE_TO_ENDPOINT, DIR_INGRESS, &p, dst);
	return bpf_redirect_peer(dst->ifindex, 0);
}

/* ---------------------------------------------------- socket load balancing */
/*
 * cgroup sock_addr programs, attached by svc-loader to --socket-lb-cgroup
 * (a cgroup v2 directory; the sockets of every process in it and below,
 * whatever their network namespace):
 *
 *   sock_connect4/6      connect(): a VIP of an internal frontend becomes a
 *                        backend once, for the socket's life (TCP and
 *                        connected UDP): no per-packet NAT, no lb flows.
 *   sock_sendmsg4/6      sendto()/sendmsg() with an address on an unconnected
 *                        UDP socket: the same, per datagram.
 *   sock_recvmsg4/6      recvmsg() of UDP: a datagram from a backend this
 *                        socket sent to shows the VIP as its source.
 *   sock_getpeername4/6  getpeername(): the VIP, not the backend.
 *
 * The backend: the frontend's Maglev slot of a hash of the socket cookie
 * (one socket, one backend; sockets spread like flows), active backends only
 * (terminating ones are in no table). What the socket was translated to is
 * kept in lb_sock_rev by (cookie, backend). A frontend with no active
 * backend fails connect()/sendmsg() with ECONNREFUSED at once, counted and
 * emitted as DROP_NO_SERVICE_BACKEND. Left to the per-packet path (the hooks
 * pass them untouched): sessionAffinity ClientIP frontends (the client's
 * address is not known before the socket is bound), NodePorts, and IPv4
 * addresses mapped into IPv6 sockets.
 */
#define ECONNREFUSED_ 111
#define SOCK_RESULT_PASS 1

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct lb_sock_rev_key);
	__type(value, struct lb_sock_rev);
} lb_sock_rev SEC(".maps");

/* The slot of a socket in a Maglev table (murmur3's 64-bit finaliser: the
 * cookies are sequential, the slots must not be). */
static __always_inline __u32 sock_slot(__u64 cookie)
{
	cookie ^= cookie >> 33;
	cookie *= 0xff51afd7ed558ccdULL;
	cookie ^= cookie >> 33;
	cookie *= 0xc4ceb9fe1a85ec53ULL;
	cookie ^= cookie >> 33;
	return (__u32)(cookie % LB_MAGLEV_SIZE);
}

/* Rejects a new socket flow to a frontend with no active backend. */
static __always_inline int sock_no_backend(const struct lb_frontend_key *k)
{
	struct pkt p = {};

	p.family = k->family;
	p.protocol = k->protocol;
	__builtin_memcpy(p.daddr, k->addr, 16);
	p.dport = k->port;
	count(DROP_NO_SERVICE_BACKEND, DIR_EGRESS, 0);
	emit(EVENT_DROP, DROP_NO_SERVICE_BACKEND, DIR_EGRESS, 0, &p, 0, 0, 0);
	bpf_set_retval(-ECONNREFUSED_);
	return 0;
}

/* Chooses the backend of a socket to frontend `k` and records the reverse
 * translation. Returns 1 with `*out` set, 0 to leave the socket alone, or
 * -1 when the frontend has no active backend. */
static __always_inline int sock_translate(void *ctx, const struct lb_frontend_key *k, struct lb_backend *out,
					  __u8 flags)
{
	struct lb_frontend *fe;
	struct lb_maglev_table *table;
	struct lb_backend *be;
	struct lb_sock_rev_key rk = {};
	struct lb_sock_rev rev = {};
	__u64 cookie;
	__u32 slot, id;

	fe = bpf_map_lookup_elem(&lb_frontends, k);
	if (!fe || (fe->flags & (SVC_F_NODE_PORT | SVC_F_AFFINITY)))
		return 0;
	if (fe->backend_count == 0)
		return -1;
	table = bpf_map_lookup_elem(&lb_maglev, &fe->table_id);
	if (!table)
		return -1;
	cookie = bpf_get_socket_cookie(ctx);
	slot = sock_slot(cookie);
	/* The compiler knows the bound; the verifier must see it checked. */
	asm volatile("" : "+r"(slot));
	if (slot >= LB_MAGLEV_SIZE)
		return -1;
	id = table->backend_ids[slot];
	if (!id)
		return -1;
	be = bpf_map_lookup_elem(&lb_backends, &id);
	if (!be || be->family != k->family || be->state != LB_BACKEND_ACTIVE)
		return -1;
	__builtin_memcpy(out, be, sizeof(*out));

	rk.cookie = cookie;
	__builtin_memcpy(rk.addr, be->addr, 16);
	rk.port = be->port;
	rk.family = k->family;
	__builtin_memcpy(rev.addr, k->addr, 16);
	rev.port = k->port;
	rev.family = k->family;
	rev.flags = flags;
	rev.last_used = (__u32)(bpf_ktime_get_ns() / NSEC_PER_SEC);
	/* Best effort: without it getpeername/recvmsg show the backend. */
	bpf_map_update_elem(&lb_sock_rev, &rk, &rev, BPF_ANY);
	return 1;
}

static __always_inline int sock_proto_ok(__u32 protocol)
{
	return protocol == IPPROTO_TCP || protocol == IPPROTO_UDP;
}

/* The socket address of a hook of `family` (a constant in each program:
 * the verifier allows only that family's fields). */
static __always_inline void sock_addr_load(const struct bpf_sock_addr *ctx, __u8 family, __u32 *addr)
{
	if (family == 4) {
		addr[0] = ctx->user_ip4;
		addr[1] = 0;
		addr[2] = 0;
		addr[3] = 0;
	} else {
		addr[0] = ctx->user_ip6[0];
		addr[1] = ctx->user_ip6[1];
		addr[2] = ctx->user_ip6[2];
		addr[3] = ctx->user_ip6[3];
	}
}

static __always_inline void sock_addr_store(struct bpf_sock_addr *ctx, __u8 family, const __u32 *addr, __u16 port)
{
	if (family == 4) {
		ctx->user_ip4 = addr[0];
	} else {
		ctx->user_ip6[0] = addr[0];
		ctx->user_ip6[1] = addr[1];
		ctx->user_ip6[2] = addr[2];
		ctx->user_ip6[3] = addr[3];
	}
	ctx->user_port = (__u32)port;
}

/* connect / sendmsg: a VIP becomes a backend (`flags`: LB_SOCK_REV_F_*
 * of the entry it leaves). */
static __always_inline int sock_forward(struct bpf_sock_addr *ctx, __u8 family, __u8 flags)
{
	struct lb_frontend_key k = {};
	struct lb_backend be;
	int r;

	if (!sock_proto_ok(ctx->protocol))
		return SOCK_RESULT_PASS;
	sock_addr_load(ctx, family, k.addr);
	k.port = (__u16)ctx->user_port;
	k.protocol = ctx->protocol;
	k.family = family;
	k.scope = SVC_SCOPE_INTERNAL;
	r = sock_translate(ctx, &k, &be, flags);
	if (r < 0)
		return sock_no_backend(&k);
	if (r > 0)
		sock_addr_store(ctx, family, be.addr, be.port);
	return SOCK_RESULT_PASS;
}

/* recvmsg / getpeername: a backend this socket was sent to shows its VIP. */
static __always_inline int sock_reverse(struct bpf_sock_addr *ctx, __u8 family)
{
	struct lb_sock_rev_key rk = {};
	struct lb_sock_rev *rev;

	if (!sock_proto_ok(ctx->protocol))
		return SOCK_RESULT_PASS;
	rk.cookie = bpf_get_socket_cookie(ctx);
	sock_addr_load(ctx, family, rk.addr);
	rk.port = (__u16)ctx->user_port;
	rk.family = family;
	rev = bpf_map_lookup_elem(&lb_sock_rev, &rk);
	if (rev) {
		__u32 now = (__u32)(bpf_ktime_get_ns() / NSEC_PER_SEC);

		sock_addr_store(ctx, family, rev->addr, rev->port);
		/* Used: svc-gc ages datagram entries by it. */
		if (rev->last_used != now)
			rev->last_used = now;
	}
	return SOCK_RESULT_PASS;
}

/* connect leaves an entry for the socket's life, sendmsg one per datagram
 * (LB_SOCK_REV_F_DATAGRAM: svc-gc ages it). */
static __always_inline int sock_connect(struct bpf_sock_addr *ctx, __u8 family)
{
	return sock_forward(ctx, family, 0);
}

static __always_inline int sock_sendmsg(struct bpf_sock_addr *ctx, __u8 family)
{
	return sock_forward(ctx, family, LB_SOCK_REV_F_DATAGRAM);
}

/* The eight programs: a hook of one family (a constant in each program:
 * the verifier allows only that family's fields of the context). */
#define SOCK_LB_PROGRAM(name, section, step, family)                                                        \
	SEC(section)                                                                                        \
	int name(struct bpf_sock_addr *ctx)                                                                 \
	{                                                                                                   \
		return step(ctx, family);                                                                   \
	}

SOCK_LB_PROGRAM(sock_connect4, "cgroup/connect4", sock_connect, 4)
SOCK_LB_PROGRAM(sock_connect6, "cgroup/connect6", sock_connect, 6)
SOCK_LB_PROGRAM(sock_sendmsg4, "cgroup/sendmsg4", sock_sendmsg, 4)
SOCK_LB_PROGRAM(sock_sendmsg6, "cgroup/sendmsg6", sock_sendmsg, 6)
SOCK_LB_PROGRAM(sock_recvmsg4, "cgroup/recvmsg4", sock_reverse, 4)
SOCK_LB_PROGRAM(sock_recvmsg6, "cgroup/recvmsg6", sock_reverse, 6)
SOCK_LB_PROGRAM(sock_getpeername4, "cgroup/getpeername4", sock_reverse, 4)
SOCK_LB_PROGRAM(sock_getpeername6, "cgroup/getpeername6", sock_reverse, 6)

char LICENSE[] SEC("license") = "Dual BSD/GPL";

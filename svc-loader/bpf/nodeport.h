/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * NodePort: services reached from outside the node at one of the node's
 * addresses and a NODE_PORT frontend's port (kube-proxy's NodePort,
 * externalTrafficPolicy Cluster and Local). Included at the end of
 * datapath.c: it uses its parsing, conntrack, policy and forwarding.
 *
 *   from_netdev  tc ingress of each external interface svc-loader serves
 *                (--underlay-interface with a routing mode, else every
 *                --nodeport-interface).
 *   to_netdev    tc egress of the same interfaces.
 *
 * A packet entering the node (from_netdev) for a NodePort frontend
 * (lb_frontends key with an all-zero address, the packet's port, protocol,
 * family) whose destination is an address of this node (a FIB lookup says
 * it is local) is translated to a backend chosen like a ClusterIP's. The
 * INTERNAL frontend says which service it is; with SVC_F_LOCAL
 * (externalTrafficPolicy Local) the EXTERNAL frontend of that port, whose
 * table holds only this node's backends, chooses instead.
 *
 * - Local, or Cluster with a backend on this node: DNAT only. The client
 *   address is kept; the backend's ingress policy judges the client's
 *   identity (its ipcache entry, else world); the packet enters the pod
 *   straight away (as from_overlay does). Replies leave the pod through
 *   the stack and this interface, where to_netdev gives them the node
 *   address and the NodePort back as source (the REVERSE flow entry).
 * - Cluster with a backend on another node: DNAT, then SNAT to the node
 *   address the client reached and a port from [NODEPORT_SNAT_MIN,
 *   NODEPORT_SNAT_MAX] (above Linux's default ephemeral range, so no
 *   socket of the node's own can hold it), so the backend's replies come
 *   back through this node. The port is claimed by inserting the
 *   SNAT_IN entry (backend tuple -> client) with BPF_NOEXIST, retrying
 *   other ports on collision (Cilium's scheme). The packet goes to the
 *   backend's node by the tunnel (vxlan: the tunnel key, identity
 *   remote-node in the VNI) or by the route to it (native: FIB lookup and
 *   bpf_redirect_neigh; the stack would drop a forwarded packet whose
 *   source is its own address). The peer's policy judges this node's
 *   address: remote-node. A reply (backend -> node address : SNAT port)
 *   enters from_netdev, takes SNAT_IN back to the client, REVERSE back to
 *   the NodePort, and goes out to the client by the FIB.
 * - No active backend (Local: none on this node): TCP gets a RST, other
 *   protocols are dropped; DROP_NO_SERVICE_BACKEND either way.
 *
 * The flow entries live in lb4_flows / lb6_flows beside ClusterIP's
 * (svc-gc expires them all): FORWARD (client -> node:NodePort => backend),
 * REVERSE (client -> backend => node:NodePort), and for SNAT SNAT_OUT
 * (client -> backend => node:SNAT port) and SNAT_IN (backend -> node:SNAT
 * port => client). An existing flow keeps its backend while the backend
 * exists (even terminating). Fragments and ICMP errors are not translated
 * here (they pass to the stack); TCP and UDP only.
 */

/* Ports the SNAT of NodePort traffic takes (Linux's default ephemeral range
 * ends at 60999) and how many it tries per new flow. */
#define NODEPORT_SNAT_MIN 61000
#define NODEPORT_SNAT_MAX 65535
#define NODEPORT_SNAT_RETRIES 32

#define AF_INET_ 2
#define AF_INET6_ 10

/* ----------------------------------------------------------------- lookups */

#define NODEPORT_NONE 0    /* the port is no NodePort */
#define NODEPORT_CLUSTER 1 /* externalTrafficPolicy Cluster */
#define NODEPORT_LOCAL 2   /* externalTrafficPolicy Local */

/* The service's NodePort frontend for the packet's port: the INTERNAL
 * entry, or for an externalTrafficPolicy Local service reached from
 * outside (`external`) its EXTERNAL entry (NULL when the loader wrote
 * none: no backend on this node). `*kind` is NODEPORT_* (whether the port
 * is a NodePort at all, and its policy). */
static __always_inline struct lb_frontend *nodeport_frontend(const struct pkt *p, int external, int *kind)
{
	struct lb_frontend_key k = {};
	struct lb_frontend *fe;

	*kind = NODEPORT_NONE;
	if (p->protocol != IPPROTO_TCP && p->protocol != IPPROTO_UDP)
		return 0;
	k.port = p->dport;
	k.protocol = p->protocol;
	k.family = p->family;
	k.scope = SVC_SCOPE_INTERNAL;
	fe = bpf_map_lookup_elem(&lb_frontends, &k);
	if (!fe || !(fe->flags & SVC_F_NODE_PORT))
		return 0;
	*kind = (fe->flags & SVC_F_LOCAL) ? NODEPORT_LOCAL : NODEPORT_CLUSTER;
	if (!external || *kind != NODEPORT_LOCAL)
		return fe;
	k.scope = SVC_SCOPE_EXTERNAL;
	return bpf_map_lookup_elem(&lb_frontends, &k);
}

/* Whether the packet's destination is an address of this node: the FIB's
 * answer for it arriving on this interface (local routes are "not
 * forwarded"); with forwarding off on the interface, the ipcache's host
 * entries (svc-loader publishes the node's addresses there). */
static __always_inline int to_this_node(struct __sk_buff *skb, const struct pkt *p)
{
	struct bpf_fib_lookup fib = {};
	struct ipcache_value *v;
	long r;

	fib.ifindex = skb->ifindex;
	fib.l4_protocol = p->protocol;
	fib.sport = p->sport;
	fib.dport = p->dport;
	if (p->family == 4) {
		fib.family = AF_INET_;
		fib.ipv4_src = p->saddr[0];
		fib.ipv4_dst = p->daddr[0];
	} else {
		fib.family = AF_INET6_;
		__builtin_memcpy(fib.ipv6_src, p->saddr, 16);
		__builtin_memcpy(fib.ipv6_dst, p->daddr, 16);
	}
	r = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (r == BPF_FIB_LKUP_RET_NOT_FWDED)
		return 1;
	if (r != BPF_FIB_LKUP_RET_FWD_DISABLED)
		return 0;
	v = ipcache_of(p->family, p->daddr);
	return v && v->identity == IDENTITY_HOST;
}

/* --------------------------------------------------------------- rewriting */

/* Offset of the L4 checksum, and the flags its updates need. */
static __always_inline int l4_csum_off(const struct pkt *p, __u32 *off, __u64 *flags)
{
	if (p->protocol == IPPROTO_TCP) {
		*off = p->l4_off + 16;
		*flags = 0;
		return 0;
	}
	if (p->protocol == IPPROTO_UDP) {
		*off = p->l4_off + 6;
		/* IPv4 UDP may carry no checksum (0): left so. */
		*flags = p->family == 4 ? BPF_F_MARK_MANGLED_0 : 0;
		return 0;
	}
	return -1;
}

/* Rewrites the packet's source (`src`) or destination address and port,
 * fixing the IPv4 header checksum and the L4 checksum (pseudo header
 * included), and `p` with it. */
static __always_inline int nat_rewrite(struct __sk_buff *skb, struct pkt *p, int src, const __u32 *addr, __u16 port)
{
	__u32 csum_off;
	__u64 flags;
	__u16 old_port = src ? p->sport : p->dport;
	__u32 port_off = p->l4_off + (src ? 0 : 2);

	if (l4_csum_off(p, &csum_off, &flags) < 0)
		return -1;
	if (p->family == 4) {
		__u32 old = src ? p->saddr[0] : p->daddr[0];
		__u32 addr_off = IP4_OFF + (src ? 12 : 16);

		if (bpf_l3_csum_replace(skb, IP4_OFF + 10, old, addr[0], 4) < 0 ||
		    bpf_l4_csum_replace(skb, csum_off, old, addr[0], flags | BPF_F_PSEUDO_HDR | 4) < 0 ||
		    bpf_skb_store_bytes(skb, addr_off, addr, 4, 0) < 0)
			return -1;
		if (src)
			p->saddr[0] = addr[0];
		else
			p->daddr[0] = addr[0];
	} else {
		__u32 *cur = src ? p->saddr : p->daddr;
		__u32 addr_off = IP6_OFF + (src ? 8 : 24);
		__s64 diff = bpf_csum_diff(cur, 16, (__u32 *)addr, 16, 0);

		if (diff < 0 || bpf_l4_csum_replace(skb, csum_off, 0, (__u32)diff, flags | BPF_F_PSEUDO_HDR) < 0 ||
		    bpf_skb_store_bytes(skb, addr_off, addr, 16, 0) < 0)
			return -1;
		__builtin_memcpy(cur, addr, 16);
	}
	if (old_port != port) {
		if (bpf_l4_csum_replace(skb, csum_off, old_port, port, flags | 2) < 0 ||
		    bpf_skb_store_bytes(skb, port_off, &port, 2, 0) < 0)
			return -1;
		if (src)
			p->sport = port;
		else
			p->dport = port;
	}
	return 0;
}

/* ------------------------------------------------------------ flow entries */

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

/* The lifetime a flow entry gets from a packet of it: conntrack's for the
 * connection's state as far as this packet tells it. */
static __always_inline __u32 flow_lifetime(const struct datapath_config *cfg, const struct pkt *p)
{
	__u8 state = CT_TCP_ESTABLISHED;

	if (p->protocol == IPPROTO_TCP) {
		if (p->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST))
			state = CT_TCP_CLOSING;
		else if ((p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN)
			state = CT_TCP_SYN;
	}
	return ct_lifetime(cfg, p->protocol, state);
}

/* A flow entry pointing at (addr, port). */
static __always_inline void flow_value(struct lb_flow *v, const struct pkt *p, const struct datapath_config *cfg,
				       const __u32 *addr, __u16 port, __u32 backend_id, __u32 service_id)
{
	__builtin_memset(v, 0, sizeof(*v));
	v->lifetime = flow_lifetime(cfg, p);
	v->expires = bpf_ktime_get_ns() + (__u64)v->lifetime * NSEC_PER_SEC;
	if (p->family == 4)
		v->addr[0] = addr[0];
	else
		__builtin_memcpy(v->addr, addr, 16);
	v->port = port;
	v->family = p->family;
	v->backend_id = backend_id;
	v->service_id = service_id;
}

/* A packet passed on the entry: its lifetime again (at most one write a
 * second, as conntrack). */
static __always_inline void flow_touch(struct lb_flow *f, const struct pkt *p, const struct datapath_config *cfg)
{
	__u32 lifetime = flow_lifetime(cfg, p);
	__u64 expires = bpf_ktime_get_ns() + (__u64)lifetime * NSEC_PER_SEC;

	if (lifetime != f->lifetime || expires > f->expires + NSEC_PER_SEC) {
		f->lifetime = lifetime;
		f->expires = expires;
	}
}

/* ------------------------------------------------------- backend selection */

/* The Maglev slot of a new flow: a hash of its 5-tuple, the same on every
 * node. */
static __always_inline __u32 nodeport_flow_hash(const struct pkt *p)
{
	__u32 h = p->family == 4 ? p->saddr[0] : p->saddr[0] ^ p->saddr[1] ^ p->saddr[2] ^ p->saddr[3];

	h ^= (__u32)p->sport << 16 | p->dport;
	h ^= p->protocol;
	/* murmur3's finaliser: every input bit moves the slot. */
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* A backend for a new flow of frontend `fe`: its Maglev slot's, if active.
 * Returns the backend id, or 0 (none). */
static __always_inline __u32 nodeport_select(const struct lb_frontend *fe, const struct pkt *p, struct lb_backend **be)
{
	struct lb_maglev_table *t;
	__u32 slot, id;

	if (!fe->backend_count)
		return 0;
	t = bpf_map_lookup_elem(&lb_maglev, &fe->table_id);
	if (!t)
		return 0;
	slot = nodeport_flow_hash(p) % LB_MAGLEV_SIZE;
	/* The verifier does not bound a remainder: say it again, opaquely. */
	asm volatile("" : "+r"(slot));
	if (slot >= LB_MAGLEV_SIZE)
		return 0;
	id = t->backend_ids[slot];
	if (!id)
		return 0;
	*be = bpf_map_lookup_elem(&lb_backends, &id);
	if (!*be || (*be)->state != LB_BACKEND_ACTIVE || (*be)->family != p->family)
		return 0;
	return id;
}

/* ------------------------------------------------------------------ reject */

struct tcp_rst {
	__u16 sport;
	__u16 dport;
	__u32 seq;
	__u32 ack;
	__u8 doff;
	__u8 flags;
	__u16 window;
	__u16 csum;
	__u16 urg;
};

struct pseudo4 {
	__u32 saddr;
	__u32 daddr;
	__u8 zero;
	__u8 protocol;
	__u16 len;
};

/* Turns a TCP packet (no IPv6 extension headers) into the RST that answers
 * it, addressed back to its sender through the interface it came in by:
 * `ack` of its ACK, else RST|ACK of its sequence space (RFC 9293 3.10.7.1).
 * Returns 0, or -1 when it cannot (the caller drops). */
static __always_inline int tcp_reset_in_place(struct __sk_buff *skb, const struct pkt *p)
{
	struct tcp_rst in, out = {};
	__u8 macs[12], tmp[6];
	__u32 l3_len, payload;
	__s64 sum;

	if (p->protocol != IPPROTO_TCP || (p->tcp_flags & TCP_FLAG_RST))
		return -1;
	if (bpf_skb_load_bytes(skb, p->l4_off, &in, sizeof(in)) < 0 || bpf_skb_load_bytes(skb, 0, macs, 12) < 0)
		return -1;
	if (p->family == 4) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, IP4_OFF, &ip, sizeof(ip)) < 0 || p->l4_off != IP4_OFF + sizeof(ip))
			return -1;
		l3_len = bpf_ntohs(ip.tot_len);
	} else {
		struct ipv6hdr ip;

		if (bpf_skb_load_bytes(skb, IP6_OFF, &ip, sizeof(ip)) < 0 || p->l4_off != IP6_OFF + sizeof(ip))
			return -1;
		l3_len = bpf_ntohs(ip.payload_len) + sizeof(ip);
	}
	payload = l3_len - (p->l4_off - ETH_HLEN_) - ((in.doff >> 4) & 0xf) * 4;
	if (payload > 0xffff)
		return -1;
	out.sport = p->dport;
	out.dport = p->sport;
	out.doff = 5 << 4;
	if (p->tcp_flags & TCP_FLAG_ACK) {
		out.seq = in.ack;
		out.flags = TCP_FLAG_RST;
	} else {
		out.ack = bpf_htonl(bpf_ntohl(in.seq) + payload + !!(p->tcp_flags & TCP_FLAG_SYN) +
				    !!(p->tcp_flags & TCP_FLAG_FIN));
		out.flags = TCP_FLAG_RST | TCP_FLAG_ACK;
	}
	if (bpf_skb_change_tail(skb, p->l4_off + sizeof(out), 0) < 0)
		return -1;
	__builtin_memcpy(tmp, macs, 6);
	__builtin_memcpy(macs, &macs[6], 6);
	__builtin_memcpy(&macs[6], tmp, 6);
	if (bpf_skb_store_bytes(skb, 0, macs, 12, 0) < 0)
		return -1;
	if (p->family == 4) {
		struct iphdr ip;
		struct pseudo4 ph = {};

		if (bpf_skb_load_bytes(skb, IP4_OFF, &ip, sizeof(ip)) < 0)
			return -1;
		ip.saddr = p->daddr[0];
		ip.daddr = p->saddr[0];
		ip.tot_len = bpf_htons(sizeof(ip) + sizeof(out));
		ip.ttl = 64;
		ip.frag_off = bpf_htons(0x4000); /* DF */
		ip.check = 0;
		sum = bpf_csum_diff(0, 0, (__u32 *)&ip, sizeof(ip), 0);
		if (sum < 0)
			return -1;
		ip.check = csum_fold((__u32)sum);
		ph.saddr = ip.saddr;
		ph.daddr = ip.daddr;
		ph.protocol = IPPROTO_TCP;
		ph.len = bpf_htons(sizeof(out));
		sum = bpf_csum_diff(0, 0, (__u32 *)&ph, sizeof(ph), 0);
		if (sum < 0)
			return -1;
		sum = bpf_csum_diff(0, 0, (__u32 *)&out, sizeof(out), (__u32)sum);
		if (sum < 0)
			return -1;
		out.csum = csum_fold((__u32)sum);
		if (bpf_skb_store_bytes(skb, IP4_OFF, &ip, sizeof(ip), 0) < 0)
			return -1;
	} else {
		struct ipv6hdr ip;
		struct pseudo6 ph = {};

		if (bpf_skb_load_bytes(skb, IP6_OFF, &ip, sizeof(ip)) < 0)
			return -1;
		__builtin_memcpy(&ip.saddr, p->daddr, 16);
		__builtin_memcpy(&ip.daddr, p->saddr, 16);
		ip.payload_len = bpf_htons(sizeof(out));
		ip.hop_limit = 64;
		__builtin_memcpy(ph.saddr, p->daddr, 16);
		__builtin_memcpy(ph.daddr, p->saddr, 16);
		ph.len = bpf_htonl(sizeof(out));
		ph.nexthdr = bpf_htonl(IPPROTO_TCP);
		sum = bpf_csum_diff(0, 0, (__u32 *)&ph, sizeof(ph), 0);
		if (sum < 0)
			return -1;
		sum = bpf_csum_diff(0, 0, (__u32 *)&out, sizeof(out), (__u32)sum);
		if (sum < 0)
			return -1;
		out.csum = csum_fold((__u32)sum);
		if (bpf_skb_store_bytes(skb, IP6_OFF, &ip, sizeof(ip), 0) < 0)
			return -1;
	}
	return bpf_skb_store_bytes(skb, p->l4_off, &out, sizeof(out), 0) < 0 ? -1 : 0;
}

/* A new flow to a NodePort with no backend to take it: counted and
 * emitted as DROP_NO_SERVICE_BACKEND; TCP gets a RST back out of the
 * interface, the rest is dropped. */
static __always_inline int nodeport_reject(struct __sk_buff *skb, const struct pkt *p)
{
	count(DROP_NO_SERVICE_BACKEND, DIR_INGRESS, p->len);
	emit(EVENT_DROP, DROP_NO_SERVICE_BACKEND, DIR_INGRESS, 0, p, 0, identity_of(p, p->saddr), IDENTITY_HOST);
	if (tcp_reset_in_place(skb, p) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* ---------------------------------------------------------------- forward */

/* Out towards the packet's (rewritten) destination by the FIB, from the
 * tc ingress of an external interface: the neighbour subsystem fills in
 * the MACs. The stack cannot take it (its source may be this node's own
 * address: a martian on input). */
static __always_inline int fib_forward(struct __sk_buff *skb, const struct pkt *p)
{
	struct bpf_fib_lookup fib = {};
	long r;

	fib.ifindex = skb->ifindex;
	fib.l4_protocol = p->protocol;
	fib.sport = p->sport;
	fib.dport = p->dport;
	if (p->family == 4) {
		fib.family = AF_INET_;
		fib.ipv4_src = p->saddr[0];
		fib.ipv4_dst = p->daddr[0];
	} else {
		fib.family = AF_INET6_;
		__builtin_memcpy(fib.ipv6_src, p->saddr, 16);
		__builtin_memcpy(fib.ipv6_dst, p->daddr, 16);
	}
	r = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (r != BPF_FIB_LKUP_RET_SUCCESS && r != BPF_FIB_LKUP_RET_NO_NEIGH && r != BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return drop(DROP_NO_ROUTE, DIR_EGRESS, p, 0, 0, 0);
	return bpf_redirect_neigh(fib.ifindex, 0, 0, 0);
}

/* To a backend on another node: vxlan by the tunnel (remote-node in the
 * VNI: the source is this node), else by the FIB. */
static __always_inline int nodeport_to_remote(struct __sk_buff *skb, const struct pkt *p)
{
	struct routing_config *rc = get_routing();

	if (rc && rc->mode == ROUTING_VXLAN && rc->tunnel_ifindex) {
		struct ipcache_value *v = ipcache_of(p->family, p->daddr);

		if (v && v->tunnel_endpoint) {
			if (set_tunnel(skb, v->tunnel_endpoint, IDENTITY_REMOTE_NODE) < 0)
				return drop(DROP_REDIRECT_FAILED, DIR_EGRESS, p, 0, IDENTITY_REMOTE_NODE, v->identity);
			return bpf_redirect(rc->tunnel_ifindex, 0);
		}
	}
	return fib_forward(skb, p);
}

/* Into local backend `dst`: its ingress policy on the (translated) packet,
 * then straight into the pod. */
static __always_inline int nodeport_to_local(struct __sk_buff *skb, struct pkt *p, const struct endpoint_info *dst,
					     const struct datapath_config *cfg)
{
	__u32 peer;
	int r = enforce(p, dst, DIR_INGRESS, 0, p->saddr, 0, cfg, &peer);

	if (r)
		return drop(r, DIR_INGRESS, p, dst, peer, dst->identity);
	count(REASON_FORWARDED, DIR_INGRESS, p->len);
	r = redirect_local(skb, p, dst);
	if (r < 0)
		return drop(DROP_REDIRECT_FAILED, DIR_INGRESS, p, dst, peer, dst->identity);
	if (r > 0)
		return TC_ACT_OK; /* TTL exhausted: the stack answers */
	trace(cfg, TRACE_TO_ENDPOINT, DIR_INGRESS, p, dst);
	return bpf_redirect_peer(dst->ifindex, 0);
}

/* ------------------------------------------------------------------- SNAT */

/* Claims a SNAT port for the translated flow `p` (client -> backend) at
 * node address `node`: SNAT_IN (backend -> node:port => client) is
 * inserted only if no live entry holds the port, then SNAT_OUT. Returns
 * the port (network order), or 0 when every try collided. */
static __always_inline __u16 snat_claim(const struct pkt *p, const __u32 *node, __u32 backend_id, __u32 service_id,
					const struct datapath_config *cfg)
{
	const __u32 range = NODEPORT_SNAT_MAX - NODEPORT_SNAT_MIN + 1;
	__u32 start = bpf_get_prandom_u32();
	struct lb_flow in, out;
	__u64 now = bpf_ktime_get_ns();
	int i;

	flow_value(&in, p, cfg, p->saddr, p->sport, backend_id, service_id);
	for (i = 0; i < NODEPORT_SNAT_RETRIES; i++) {
		__u16 port = bpf_htons(NODEPORT_SNAT_MIN + (start + i) % range);
		struct lb_flow *held;

		if (flow_put(p, p->daddr, p->dport, node, port, LB_FLOW_SNAT_IN, &in, BPF_NOEXIST) < 0) {
			held = flow_get(p, p->daddr, p->dport, node, port, LB_FLOW_SNAT_IN);
			/* An expired holder (svc-gc has not come by yet) gives way. */
			if (held && held->expires >= now)
				continue;
			if (flow_put(p, p->daddr, p->dport, node, port, LB_FLOW_SNAT_IN, &in, BPF_ANY) < 0)
				continue;
		}
		flow_value(&out, p, cfg, node, port, backend_id, service_id);
		if (flow_put(p, p->saddr, p->sport, p->daddr, p->dport, LB_FLOW_SNAT_OUT, &out, BPF_ANY) < 0)
			return 0;
		return port;
	}
	return 0;
}

/* A reply of a SNATed NodePort flow (backend -> node:SNAT port), back to
 * the client from the NodePort. Returns the tc verdict, or -1 when the
 * packet is no such reply. */
static __always_inline int snat_reply(struct __sk_buff *skb, struct pkt *p, const struct datapath_config *cfg)
{
	__u32 client[4] = {}, node[4] = {};
	struct lb_flow *in, *rev;
	__u16 client_port, port = bpf_ntohs(p->dport);

	if (port < NODEPORT_SNAT_MIN)
		return -1;
	in = flow_get(p, p->saddr, p->sport, p->daddr, p->dport, LB_FLOW_SNAT_IN);
	if (!in)
		return -1;
	flow_touch(in, p, cfg);
	__builtin_memcpy(client, in->addr, 16);
	__builtin_memcpy(node, p->daddr, 16);
	client_port = in->port;
	/* The flow's REVERSE entry: client -> backend => node:NodePort. */
	rev = flow_get(p, client, client_port, p->saddr, p->sport, LB_FLOW_REVERSE);
	if (!rev)
		return drop(DROP_CT_INVALID, DIR_INGRESS, p, 0, 0, 0);
	flow_touch(rev, p, cfg);
	if (nat_rewrite(skb, p, 0, client, client_port) < 0 || nat_rewrite(skb, p, 1, rev->addr, rev->port) < 0)
		return drop(DROP_INVALID_PACKET, DIR_INGRESS, p, 0, 0, 0);
	count(REASON_FORWARDED, DIR_EGRESS, p->len);
	return fib_forward(skb, p);
}

/* --------------------------------------------------------------- programs */

SEC("classifier")
int from_netdev(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct lb_frontend *fe;
	struct lb_backend *be = 0;
	struct endpoint_info *dst;
	struct lb_flow *fwd, flow;
	__u32 node[4] = {}, backend[4] = {}, backend_id = 0;
	__u16 node_port, backend_port;
	struct pkt p = {};
	int kind, r;

	p.len = skb->len;
	if (skb->protocol == bpf_htons(ETH_P_IP))
		r = parse_ipv4(skb, &p);
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(skb, &p);
	else
		return TC_ACT_OK;
	/* Not ours to judge: the stack sees what it sees without us. */
	if (r || p.in_fragment || p.icmp_error || (p.protocol != IPPROTO_TCP && p.protocol != IPPROTO_UDP))
		return TC_ACT_OK;

	r = snat_reply(skb, &p, cfg);
	if (r >= 0)
		return r;
	fe = nodeport_frontend(&p, 1, &kind);
	if (kind == NODEPORT_NONE || !to_this_node(skb, &p))
		return TC_ACT_OK;

	__builtin_memcpy(node, p.daddr, 16);
	node_port = p.dport;
	/* An existing flow keeps its backend while it exists. */
	fwd = flow_get(&p, p.saddr, p.sport, p.daddr, p.dport, LB_FLOW_FORWARD);
	if (fwd) {
		be = bpf_map_lookup_elem(&lb_backends, &fwd->backend_id);
		if (be && be->family == p.family) {
			backend_id = fwd->backend_id;
			flow_touch(fwd, &p, cfg);
		}
	}
	if (!backend_id) {
		if (!fe)
			return nodeport_reject(skb, &p);
		backend_id = nodeport_select(fe, &p, &be);
		if (!backend_id || !be)
			return nodeport_reject(skb, &p);
		flow_value(&flow, &p, cfg, be->addr, be->port, backend_id, fe->service_id);
		if (flow_put(&p, p.saddr, p.sport, p.daddr, p.dport, LB_FLOW_FORWARD, &flow, BPF_ANY) < 0)
			return drop(DROP_CT_MAP_FULL, DIR_INGRESS, &p, 0, 0, 0);
		flow_value(&flow, &p, cfg, node, node_port, backend_id, fe->service_id);
		if (flow_put(&p, p.saddr, p.sport, be->addr, be->port, LB_FLOW_REVERSE, &flow, BPF_ANY) < 0)
			return drop(DROP_CT_MAP_FULL, DIR_INGRESS, &p, 0, 0, 0);
	}
	if (!be)
		return TC_ACT_SHOT;
	__builtin_memcpy(backend, be->addr, 16);
	backend_port = be->port;
	if (nat_rewrite(skb, &p, 0, backend, backend_port) < 0)
		return drop(DROP_INVALID_PACKET, DIR_INGRESS, &p, 0, 0, 0);

	dst = endpoint_by_addr(&p, p.daddr);
	if (dst)
		return nodeport_to_local(skb, &p, dst, cfg);
	/* Another node's backend; Local (whose table holds this node's only)
	 * never SNATs. */
	if (kind == NODEPORT_CLUSTER) {
		struct lb_flow *out = flow_get(&p, p.saddr, p.sport, p.daddr, p.dport, LB_FLOW_SNAT_OUT);
		__u32 snat_addr[4] = {};
		__u16 snat_port;

		if (out) {
			flow_touch(out, &p, cfg);
			__builtin_memcpy(snat_addr, out->addr, 16);
			snat_port = out->port;
		} else {
			__builtin_memcpy(snat_addr, node, 16);
			snat_port = snat_claim(&p, node, backend_id, fe ? fe->service_id : 0, cfg);
			if (!snat_port)
				return drop(DROP_CT_MAP_FULL, DIR_INGRESS, &p, 0, 0, 0);
		}
		if (nat_rewrite(skb, &p, 1, snat_addr, snat_port) < 0)
			return drop(DROP_INVALID_PACKET, DIR_INGRESS, &p, 0, 0, 0);
	}
	count(REASON_FORWARDED, DIR_EGRESS, p.len);
	return nodeport_to_remote(skb, &p);
}

/* Replies of NodePort flows into a backend on this node leave by the stack
 * and this interface: the node address and NodePort the client reached go
 * back as their source (the REVERSE entry). Only packets from a local pod
 * can be such replies. */
SEC("classifier")
int to_netdev(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct lb_flow *rev;
	struct pkt p = {};
	int r;

	p.len = skb->len;
	if (skb->protocol == bpf_htons(ETH_P_IP))
		r = parse_ipv4(skb, &p);
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(skb, &p);
	else
		return TC_ACT_OK;
	if (r || p.in_fragment || p.icmp_error || (p.protocol != IPPROTO_TCP && p.protocol != IPPROTO_UDP))
		return TC_ACT_OK;
	if (!endpoint_by_addr(&p, p.saddr))
		return TC_ACT_OK;
	rev = flow_get(&p, p.daddr, p.dport, p.saddr, p.sport, LB_FLOW_REVERSE);
	if (!rev)
		return TC_ACT_OK;
	flow_touch(rev, &p, cfg);
	if (nat_rewrite(skb, &p, 1, rev->addr, rev->port) < 0)
		return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, 0, 0, 0);
	return TC_ACT_OK;
}

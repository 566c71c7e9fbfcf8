/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * NodePort: services reached from outside the node at one of the node's
 * addresses and a NODE_PORT frontend's port (kube-proxy's NodePort,
 * externalTrafficPolicy Cluster and Local). Included by datapath.c before
 * from_container: it uses its parsing, policy and forwarding and the
 * services section's functions (lb_select, lb_rewrite, lb_flow_get/put,
 * lb_reject), and from_container's lb_forward uses nodeport_of_this_node
 * (a pod reaching a NodePort of its own node: every backend, translated
 * like a ClusterIP).
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
 * table holds only this node's backends, chooses instead. Backend: the
 * Maglev slot of lb_select (ClientIP affinity hashes the client alone; no
 * lb_affinity entry is written here).
 *
 * - Local, or Cluster with a backend on this node: DNAT only. The client
 *   address is kept; the backend's ingress policy judges the client's
 *   identity (its ipcache entry, else world); the packet enters the pod
 *   straight away (as from_overlay does). Its conntrack entry carries
 *   CT_F_NODEPORT, so the backend's replies get the node address and the
 *   NodePort back as source (the REVERSE flow entry) in the backend's
 *   from_container, before they leave (nodeport_backend_reply): by the
 *   tunnel to a client behind it (a pod of another node, vxlan; such a
 *   reply never passes this interface), else by the FIB. to_netdev does
 *   the same for replies that pass it untranslated (entries of a datapath
 *   from before the flag, until the client's next packet sets it).
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
 * - No active backend (Local: none on this node): lb_reject's TCP RST or
 *   ICMP / ICMPv6 port unreachable back out of the interface;
 *   DROP_NO_SERVICE_BACKEND counted and emitted.
 *
 * The flow entries live in lb4_flows / lb6_flows beside ClusterIP's
 * (svc-gc expires them all): FORWARD (client -> node:NodePort => backend),
 * REVERSE (client -> backend => node:NodePort), and for SNAT SNAT_OUT
 * (client -> backend => node:SNAT port) and SNAT_IN (backend -> node:SNAT
 * port => client). An existing flow keeps its backend while the backend
 * is the same (even terminating, but not for a new TCP connection).
 * Fragments and ICMP errors are not translated here (they pass to the
 * stack); TCP and UDP only. from_netdev's steps (nodeport_reply,
 * nodeport_ingress, nodeport_snat) are global functions: verified once
 * each, with frames of their own (from_netdev's and lb_reject's or
 * enforce's must fit 512 bytes together).
 */

/* Ports the SNAT of NodePort traffic takes (the services section's NAT
 * range) and how many it tries per new flow. */
#define NODEPORT_SNAT_MIN LB_NAT_PORT_MIN
#define NODEPORT_SNAT_MAX LB_NAT_PORT_MAX
#define NODEPORT_SNAT_RETRIES 32

/* What nodeport_ingress decided, besides 0 (not ours: to the stack) and
 * drop reasons (DROP_NO_SERVICE_BACKEND: reject). */
#define NODEPORT_TO_LOCAL 100  /* translated, to the local backend at its daddr */
#define NODEPORT_TO_REMOTE 101 /* translated, to another node's backend */
#define NODEPORT_TO_CLIENT 102 /* a SNATed flow's reply, back to its client */
#define NODEPORT_SNAT 103      /* translated, to another node's backend after SNAT */

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

/* The FIB's answer for the packet's tuple arriving on the packet's
 * interface, its result in `*fib`. */
static __always_inline long fib_lookup_of(struct __sk_buff *skb, const struct pkt *p, struct bpf_fib_lookup *fib)
{
	fib->ifindex = skb->ifindex;
	fib->l4_protocol = p->protocol;
	fib->sport = p->sport;
	fib->dport = p->dport;
	if (p->family == 4) {
		fib->family = AF_INET_;
		fib->ipv4_src = p->saddr[0];
		fib->ipv4_dst = p->daddr[0];
	} else {
		fib->family = AF_INET6_;
		__builtin_memcpy(fib->ipv6_src, p->saddr, 16);
		__builtin_memcpy(fib->ipv6_dst, p->daddr, 16);
	}
	return bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
}

/* Whether the packet's destination is an address of this node: the FIB's
 * answer for it arriving on this interface (local routes are "not
 * forwarded"); with forwarding off on the interface, the ipcache's host
 * entries (svc-loader publishes the node's addresses there). */
static __always_inline int to_this_node(struct __sk_buff *skb, const struct pkt *p)
{
	struct bpf_fib_lookup fib = {};
	struct ipcache_value *v;
	long r = fib_lookup_of(skb, p, &fib);

	if (r == BPF_FIB_LKUP_RET_NOT_FWDED)
		return 1;
	if (r != BPF_FIB_LKUP_RET_FWD_DISABLED)
		return 0;
	v = ipcache_of(p->family, p->daddr);
	return v && v->identity == IDENTITY_HOST;
}

static __always_inline struct lb_frontend *nodeport_of_this_node(struct __sk_buff *skb, const struct pkt *p)
{
	struct lb_frontend *fe;
	int kind;

	fe = nodeport_frontend(p, 0, &kind);
	return fe && to_this_node(skb, p) ? fe : 0;
}

/* ------------------------------------------------------------ flow entries */

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

/* ------------------------------------------------------------------ reject */

/* A new flow to a NodePort with no backend to take it: counted and
 * emitted as DROP_NO_SERVICE_BACKEND, answered like a ClusterIP's (TCP
 * RST, ICMP / ICMPv6 port unreachable: lb_reject) back out of the
 * interface it came in by. */
static __always_inline int nodeport_reject(struct __sk_buff *skb, const struct pkt *p)
{
	count(DROP_NO_SERVICE_BACKEND, DIR_INGRESS, p->len);
	emit(EVENT_DROP, DROP_NO_SERVICE_BACKEND, DIR_INGRESS, 0, p, 0, identity_of(p, p->saddr), IDENTITY_HOST);
	if (lb_reject(skb, p) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* ---------------------------------------------------------------- forward */

/* Out towards the packet's (rewritten) destination by the FIB, from the
 * tc ingress of an external interface: the neighbour subsystem fills in
 * the MACs. The stack cannot take it (its source may be this node's own
 * address: a martian on input). */
static __noinline int fib_forward(struct __sk_buff *skb, const struct pkt *p)
{
	struct bpf_fib_lookup fib = {};
	long r = fib_lookup_of(skb, p, &fib);

	if (r != BPF_FIB_LKUP_RET_SUCCESS && r != BPF_FIB_LKUP_RET_NO_NEIGH && r != BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return drop(DROP_NO_ROUTE, DIR_EGRESS, p, 0, 0, 0);
	return bpf_redirect_neigh(fib.ifindex, 0, 0, 0);
}

/* From this node's address to another node's pod (a backend, or a client
 * of a reply): vxlan by the tunnel (remote-node in the VNI: the source is
 * this node), else by the FIB. */
static __noinline int nodeport_to_remote(struct __sk_buff *skb, const struct pkt *p)
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
	int r = enforce_ingress(p, dst, 0, cfg, &peer);

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

/* A reply of a SNATed NodePort flow (backend -> node:SNAT port), turned
 * back into the NodePort's answer to the client. Returns NODEPORT_TO_CLIENT,
 * a drop reason, or 0 when the packet is no such reply. (Each of
 * from_netdev's steps is a global function: the verifier walks it once,
 * and its frame is not from_netdev's, which lb_reject's and enforce's
 * need.) */
__noinline int nodeport_reply(struct __sk_buff *skb, struct pkt *p)
{
	const struct datapath_config *cfg = get_config();
	__u32 client[4] = {};
	struct lb_flow *in, *rev;
	__u16 client_port, port;

	if (!p)
		return 0;
	port = bpf_ntohs(p->dport);
	if (port < NODEPORT_SNAT_MIN)
		return 0;
	in = flow_get(p, p->saddr, p->sport, p->daddr, p->dport, LB_FLOW_SNAT_IN);
	if (!in)
		return 0;
	flow_touch(in, p, cfg);
	__builtin_memcpy(client, in->addr, 16);
	client_port = in->port;
	/* The flow's REVERSE entry: client -> backend => node:NodePort. */
	rev = flow_get(p, client, client_port, p->saddr, p->sport, LB_FLOW_REVERSE);
	if (!rev)
		return DROP_CT_INVALID;
	flow_touch(rev, p, cfg);
	if (lb_rewrite(skb, p, p->l4_off, 1, 1, client, client_port) < 0 ||
	    lb_rewrite(skb, p, p->l4_off, 1, 0, rev->addr, rev->port) < 0)
		return DROP_INVALID_PACKET;
	return NODEPORT_TO_CLIENT;
}

/* ----------------------------------------------------- local backends' replies */

/* A reply of a NodePort flow DNATed into a backend on this node (the
 * packet's tuple is backend -> client): the node address and NodePort the
 * client reached go back as its source, by the flow's REVERSE entry.
 * Returns 1 (translated), 0 (no such flow) or -1 (not written). */
static __always_inline int nodeport_reverse(struct __sk_buff *skb, struct pkt *p, const struct datapath_config *cfg)
{
	struct lb_flow *rev = lb_flow_get(p, 1, LB_FLOW_REVERSE);

	if (!rev)
		return 0;
	flow_touch(rev, p, cfg);
	if (lb_rewrite(skb, p, p->l4_off, 1, 0, rev->addr, rev->port) < 0)
		return -1;
	return 1;
}

/* A reply leaving a backend on this node, on a connection a NodePort
 * translated into it (`p->rev_nodeport`: its conntrack entry carries
 * CT_F_NODEPORT, set by from_netdev's enforce). Translated here, in the
 * backend's from_container, whatever way it then takes: a client behind the
 * tunnel (a pod of another node, vxlan) gets it by the tunnel, which never
 * passes to_netdev; any other by the FIB (the stack would drop a packet
 * with its own address as source as a martian). Only connections with the
 * flag pay for the REVERSE lookup. Returns the tc verdict, or -1 to take
 * the ordinary way untranslated: ICMP errors and fragments (as from_netdev
 * and to_netdev, not translated), no REVERSE entry (expired), or a packet
 * too big for the tunnel (the stack answers the backend "too big" for its
 * own tuple, so its path MTU shrinks). */
__noinline int nodeport_backend_reply(struct __sk_buff *skb, struct pkt *p)
{
	const struct datapath_config *cfg = get_config();
	struct routing_config *rc = get_routing();
	struct ipcache_value *v = 0;
	__u32 mtu = 0;
	int r;

	if (!p || p->icmp_error || p->in_fragment ||
	    (p->protocol != IPPROTO_TCP && p->protocol != IPPROTO_UDP))
		return -1;
	/* Behind the tunnel: it must fit the tunnel before it is translated. */
	if (rc && rc->mode == ROUTING_VXLAN && rc->tunnel_ifindex) {
		v = ipcache_of(p->family, p->daddr);
		if (v && v->tunnel_endpoint &&
		    bpf_check_mtu(skb, rc->tunnel_ifindex, &mtu, 0, BPF_MTU_CHK_SEGS) != BPF_MTU_CHK_RET_SUCCESS)
			return -1;
	}
	r = nodeport_reverse(skb, p, cfg);
	if (r == 0)
		return -1;
	if (r < 0)
		return drop(DROP_INVALID_PACKET, DIR_EGRESS, p, 0, 0, 0);
	/* From this node's address now: as a SNATed flow's packet (remote-node
	 * in the VNI). */
	return nodeport_to_remote(skb, p);
}

/* --------------------------------------------------------------- programs */

/* The translation of a packet entering the node by an external interface
 * to a NodePort (see the top of this file): DNATs `p` and the packet,
 * returns NODEPORT_TO_LOCAL, NODEPORT_TO_REMOTE, NODEPORT_SNAT (Cluster,
 * another node's backend), 0 (not a NodePort of this node) or a drop
 * reason. */
__noinline int nodeport_ingress(struct __sk_buff *skb, struct pkt *p)
{
	const struct datapath_config *cfg = get_config();
	struct lb_frontend *fe;
	struct lb_backend *be;
	struct lb_flow *fwd, flow;
	__u32 node[4] = {}, backend[4] = {}, backend_id = 0;
	__u16 node_port, backend_port;
	int kind;

	if (!p)
		return 0;
	fe = nodeport_frontend(p, 1, &kind);
	if (kind == NODEPORT_NONE || !to_this_node(skb, p))
		return 0;

	__builtin_memcpy(node, p->daddr, 16);
	node_port = p->dport;
	/* An existing flow keeps its backend while it is the same backend
	 * (its id not reused), even terminating, but for a new connection. */
	fwd = lb_flow_get(p, 0, LB_FLOW_FORWARD);
	if (fwd) {
		backend_id = fwd->backend_id;
		be = bpf_map_lookup_elem(&lb_backends, &backend_id);
		if (!be || be->family != p->family || be->port != fwd->port ||
		    !lb_addr_equal(p->family, be->addr, fwd->addr) ||
		    (be->state != LB_BACKEND_ACTIVE && p->protocol == IPPROTO_TCP &&
		     (p->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN))
			fwd = 0;
		else
			flow_touch(fwd, p, cfg);
	}
	if (!fwd) {
		if (!fe)
			return DROP_NO_SERVICE_BACKEND;
		/* Affinity (ClientIP) hashes the client alone: a client keeps its
		 * backend while the table does (no lb_affinity entry here). */
		be = lb_select(p, fe, bpf_ktime_get_ns(), &backend_id);
		if (!be)
			return DROP_NO_SERVICE_BACKEND;
		flow_value(&flow, p, cfg, be->addr, be->port, backend_id, fe->service_id);
		if (lb_flow_put(p, LB_FLOW_FORWARD, &flow) < 0)
			return DROP_CT_MAP_FULL;
	}
	__builtin_memcpy(backend, be->addr, 16);
	backend_port = be->port;
	if (lb_rewrite(skb, p, p->l4_off, 1, 1, backend, backend_port) < 0)
		return DROP_INVALID_PACKET;
	if (!fwd) {
		/* Keyed by the translated tuple, which `p` now holds. */
		flow_value(&flow, p, cfg, node, node_port, backend_id, fe->service_id);
		if (lb_flow_put(p, LB_FLOW_REVERSE, &flow) < 0)
			return DROP_CT_MAP_FULL;
	}
	if (endpoint_by_addr(p, p->daddr))
		return NODEPORT_TO_LOCAL;
	/* Another node's backend; Local (whose table holds this node's only)
	 * never SNATs. */
	return kind == NODEPORT_CLUSTER ? NODEPORT_SNAT : NODEPORT_TO_REMOTE;
}

/* SNAT of a translated NodePort flow `p` (client -> another node's
 * backend) to the node address the client reached (its REVERSE entry's)
 * and the flow's SNAT port, claimed at its first packet. Returns
 * NODEPORT_TO_REMOTE or a drop reason. */
__noinline int nodeport_snat(struct __sk_buff *skb, struct pkt *p)
{
	const struct datapath_config *cfg = get_config();
	struct lb_flow *out, *rev;
	__u32 snat_addr[4] = {};
	__u16 snat_port;

	if (!p)
		return DROP_INVALID_PACKET;
	out = flow_get(p, p->saddr, p->sport, p->daddr, p->dport, LB_FLOW_SNAT_OUT);
	if (out) {
		flow_touch(out, p, cfg);
		__builtin_memcpy(snat_addr, out->addr, 16);
		snat_port = out->port;
	} else {
		rev = lb_flow_get(p, 0, LB_FLOW_REVERSE);
		if (!rev)
			return DROP_CT_INVALID;
		__builtin_memcpy(snat_addr, rev->addr, 16);
		snat_port = snat_claim(p, snat_addr, rev->backend_id, rev->service_id, cfg);
		if (!snat_port)
			return DROP_NAT_NO_PORT;
	}
	if (lb_rewrite(skb, p, p->l4_off, 1, 0, snat_addr, snat_port) < 0)
		return DROP_INVALID_PACKET;
	return NODEPORT_TO_REMOTE;
}

/* Parses a packet of an external interface into `p`: 1 for the TCP and
 * UDP packets NodePort translates, 0 for everything else (not ours to
 * judge: the stack sees what it sees without us), fragments and ICMP
 * errors included. */
static __always_inline int netdev_parse(struct __sk_buff *skb, struct pkt *p)
{
	int r;

	p->len = skb->len;
	if (skb->protocol == bpf_htons(ETH_P_IP))
		r = parse_ipv4(skb, p);
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		r = parse_ipv6(skb, p);
	else
		return 0;
	return !r && !p->in_fragment && !p->icmp_error && (p->protocol == IPPROTO_TCP || p->protocol == IPPROTO_UDP);
}

SEC("classifier")
int from_netdev(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct endpoint_info *dst;
	struct pkt p = {};
	int r;

	if (!netdev_parse(skb, &p))
		return TC_ACT_OK;
	r = nodeport_reply(skb, &p);
	if (!r)
		r = nodeport_ingress(skb, &p);
	if (r == NODEPORT_SNAT)
		r = nodeport_snat(skb, &p);
	switch (r) {
	case 0:
		return TC_ACT_OK;
	case DROP_NO_SERVICE_BACKEND:
		return nodeport_reject(skb, &p);
	case NODEPORT_TO_LOCAL:
		/* Its conntrack entry gets CT_F_NODEPORT: the backend's replies
		 * are translated back as they leave it (nodeport_backend_reply). */
		p.nodeport = 1;
		dst = endpoint_by_addr(&p, p.daddr);
		if (!dst)
			return drop(DROP_UNKNOWN_ENDPOINT, DIR_INGRESS, &p, 0, 0, 0);
		return nodeport_to_local(skb, &p, dst, cfg);
	case NODEPORT_TO_REMOTE:
		count(REASON_FORWARDED, DIR_EGRESS, p.len);
		return nodeport_to_remote(skb, &p);
	case NODEPORT_TO_CLIENT:
		count(REASON_FORWARDED, DIR_EGRESS, p.len);
		return fib_forward(skb, &p);
	default:
		return drop(r, DIR_INGRESS, &p, 0, 0, 0);
	}
}

/* Replies of NodePort flows into a backend on this node that leave by the
 * stack and this interface untranslated (their conntrack entry is from a
 * datapath without CT_F_NODEPORT and saw no packet of the client since)
 * get the node address and NodePort the client reached back as their source
 * (the REVERSE entry). Only packets from a local pod can be such replies. */
SEC("classifier")
int to_netdev(struct __sk_buff *skb)
{
	struct datapath_config *cfg = get_config();
	struct pkt p = {};

	if (!netdev_parse(skb, &p) || !endpoint_by_addr(&p, p.saddr))
		return TC_ACT_OK;
	if (nodeport_reverse(skb, &p, cfg) < 0)
		return drop(DROP_INVALID_PACKET, DIR_EGRESS, &p, 0, 0, 0);
	return TC_ACT_OK;
}

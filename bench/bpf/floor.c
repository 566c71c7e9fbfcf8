// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The verdict benchmark's floor: a tc classifier that only passes the
 * packet. What BPF_PROG_TEST_RUN reports for it is the cost of running any
 * program at all, which the datapath's numbers are divided by.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

SEC("classifier")
int pass(struct __sk_buff *skb)
{
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";

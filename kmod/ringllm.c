// SPDX-License-Identifier: GPL-2.0
/*
 * ringllm.ko: takes the ring's data datagrams off the wire in a netfilter hook, before the
 * socket layer, into memory user space has mapped; sends datagrams user space wrote into a
 * mapped TX area without a copy from user space. See README.md and ringllm_kmod.h.
 *
 * The module trusts nothing in a packet: it reads the few header fields it needs to place a
 * datagram, checks each against the context's bounds, and leaves every authenticity check to
 * user space (which holds the key and verifies each datagram's seal before using a byte).
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/miscdevice.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/vmalloc.h>
#include <linux/slab.h>
#include <linux/poll.h>
#include <linux/wait.h>
#include <linux/spinlock.h>
#include <linux/mutex.h>
#include <linux/rculist.h>
#include <linux/uaccess.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <linux/in.h>
#include <linux/net.h>
#include <linux/netfilter.h>
#include <linux/netfilter_ipv4.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>
#include <linux/cred.h>
#include <linux/capability.h>
#include <linux/pid.h>
#include <linux/sched.h>
#include <linux/jiffies.h>
#include <asm/unaligned.h>
#include <net/sock.h>
#include <net/ip.h>
#include <net/net_namespace.h>

#include "ringllm_kmod.h"

#define RLK_VERSION "1.0"

static int gid = -1;
module_param(gid, int, 0444);
MODULE_PARM_DESC(gid, "members of this group may open /dev/ringllm too (default: CAP_NET_ADMIN only)");

static unsigned int max_mem_mb = 256;
module_param(max_mem_mb, uint, 0444);
MODULE_PARM_DESC(max_mem_mb, "largest mapped area one context may ask for, MiB");

struct rlk_counters {
	atomic64_t claimed, passed, malformed, no_bank, busy, sent, send_errors, wakeups, released,
		coalesced, stale;
};

struct rlk_ctx {
	struct list_head node; /* rlk_ctxs, RCU */
	spinlock_t lock;       /* banks and slots: the hook (softirq) and RELEASE_BANK */
	struct mutex tx_lock;  /* the socket: SEND and SET_DEST */
	wait_queue_head_t wq;
	struct pid *owner;
	u16 port;              /* host order; 0: claims nothing */
	u32 tag;
	void *area;
	size_t total;
	struct rlk_shared *sh;
	struct rlk_bank *banks;
	unsigned long *bitmaps;
	u16 *lens;
	u8 *data;
	u8 *tx;
	u32 nbanks, slots;
	/* The layout as the module set it: user space can write the shared page, so nothing
	 * that bounds a copy is ever read back from there. */
	u64 tx_bytes;
	struct socket *sock;   /* connected to the destination (SET_DEST) */
	struct rlk_counters c;
};

static LIST_HEAD(rlk_ctxs);
static DEFINE_MUTEX(rlk_ctxs_lock);
static struct rlk_counters rlk_global;
static atomic_t rlk_live_ctxs = ATOMIC_INIT(0);
static atomic64_t rlk_live_bytes = ATOMIC64_INIT(0);

static inline void rlk_bump(atomic64_t *ctx_counter, atomic64_t *global)
{
	atomic64_inc(ctx_counter);
	atomic64_inc(global);
}

/* Whether a context claims `port`; call under rcu_read_lock. */
static bool rlk_port_claimed(u16 port)
{
	struct rlk_ctx *ctx;

	list_for_each_entry_rcu(ctx, &rlk_ctxs, node) {
		if (READ_ONCE(ctx->port) == port)
			return true;
	}
	return false;
}

/* The context claiming `port` and `tag`; call under rcu_read_lock. */
static struct rlk_ctx *rlk_find(u16 port, u32 tag)
{
	struct rlk_ctx *ctx;

	list_for_each_entry_rcu(ctx, &rlk_ctxs, node) {
		if (READ_ONCE(ctx->port) == port && READ_ONCE(ctx->tag) == tag)
			return ctx;
	}
	return NULL;
}

static inline unsigned long *rlk_bitmap(struct rlk_ctx *ctx, u32 b)
{
	return ctx->bitmaps + (size_t)b * (ctx->slots / BITS_PER_LONG);
}

/* Empties bank `b` (under ctx->lock), counting the datagrams still in it: user space frees a
 * bank by a store, and a datagram for its frame may land between its last look and that
 * store. Nobody reads those; they are counted, not lost without a trace. */
static void rlk_empty_bank(struct rlk_ctx *ctx, u32 b)
{
	unsigned long *bm = rlk_bitmap(ctx, b);
	unsigned int left = bitmap_weight(bm, ctx->slots);

	if (left) {
		atomic64_add(left, &ctx->c.stale);
		atomic64_add(left, &rlk_global.stale);
	}
	bitmap_zero(bm, ctx->slots);
}

/* What became of one datagram. */
enum rlk_placed { RLK_PLACED, RLK_MALFORMED, RLK_NO_BANK, RLK_BUSY };

/*
 * Places the datagram at `off` (its magic) of `len` bytes in `skb` into `ctx`, or says why
 * not. Called under rcu_read_lock with BHs off (the hook). `complete` is set when the
 * datagram completed its bank.
 */
static enum rlk_placed rlk_place(struct rlk_ctx *ctx, const struct sk_buff *skb, u32 off,
				 u32 len, __be32 saddr, __be16 sport, bool *complete)
{
	u8 _h[RLK_PREFIX_LEN + RLK_DATA_HDR_LEN];
	const u8 *h;
	struct rlk_bank *bank = NULL;
	u32 dlen, chunk_size, index, count, slot, b, nfree = U32_MAX;
	u64 frame;
	unsigned long *bm;
	u8 *dst;

	if (len < RLK_PREFIX_LEN + RLK_DATA_HDR_LEN + RLK_SEAL_LEN ||
	    len - RLK_PREFIX_LEN > RLK_SLOT_SIZE)
		return RLK_MALFORMED;
	h = skb_header_pointer(skb, off, sizeof(_h), _h);
	if (!h || get_unaligned_le32(h) != RLK_MAGIC || get_unaligned_le32(h + 4) != ctx->tag)
		return RLK_MALFORMED;
	dlen = len - RLK_PREFIX_LEN;
	h += RLK_PREFIX_LEN;
	chunk_size = get_unaligned_le16(h + 2);
	index = get_unaligned_le32(h + 4);
	count = get_unaligned_le32(h + 8);
	frame = get_unaligned_le64(h + 16);
	if (h[0] != RLK_KIND_DATA || h[1] != RLK_WIRE_VERSION || chunk_size == 0 ||
	    count == 0 || count > RLK_MAX_CHUNKS || index >= count || frame == 0 ||
	    dlen - RLK_DATA_HDR_LEN - RLK_SEAL_LEN > chunk_size)
		return RLK_MALFORMED;

	spin_lock(&ctx->lock);
	for (b = 0; b < ctx->nbanks; b++) {
		struct rlk_bank *k = &ctx->banks[b];

		if (READ_ONCE(k->state) == RLK_BANK_ACTIVE) {
			if (k->frame == frame && k->src_addr == saddr && k->src_port == sport) {
				bank = k;
				break;
			}
		} else if (nfree == U32_MAX) {
			nfree = b;
		}
	}
	if (!bank) {
		if (nfree == U32_MAX) {
			spin_unlock(&ctx->lock);
			return RLK_NO_BANK;
		}
		b = nfree;
		bank = &ctx->banks[b];
		/* User space may free a bank by writing its state (no system call per frame):
		 * whatever was left in it is dropped (and counted) here. */
		rlk_empty_bank(ctx, b);
		bank->count = count;
		bank->frame = frame;
		bank->src_addr = saddr;
		bank->src_port = sport;
		bank->stored = 0;
		smp_wmb();
		WRITE_ONCE(bank->state, RLK_BANK_ACTIVE);
	}
	slot = index % ctx->slots;
	bm = rlk_bitmap(ctx, b);
	if (test_bit(slot, bm)) {
		spin_unlock(&ctx->lock);
		return RLK_BUSY;
	}
	dst = ctx->data + ((size_t)b * ctx->slots + slot) * RLK_SLOT_SIZE;
	if (skb_copy_bits(skb, off + RLK_PREFIX_LEN, dst, dlen)) {
		spin_unlock(&ctx->lock);
		return RLK_MALFORMED;
	}
	ctx->lens[(size_t)b * ctx->slots + slot] = dlen;
	/* The bytes and the length before the bit that says they are there. */
	smp_mb__before_atomic();
	set_bit(slot, bm);
	bank->stored++;
	if (bank->stored == bank->count) {
		*complete = true;
		WRITE_ONCE(ctx->sh->completions, ctx->sh->completions + 1);
	}
	WRITE_ONCE(ctx->sh->events, ctx->sh->events + 1);
	spin_unlock(&ctx->lock);
	return RLK_PLACED;
}

/*
 * The hook. Returns NF_ACCEPT for anything that is not UDP to a claimed port carrying our
 * magic (the stack handles it, e.g. the link's acknowledgements on its socket), NF_DROP when
 * none of its datagrams could be placed, NF_STOLEN once they are in their slots (each one
 * that could not be placed counted). A GRO-coalesced skb (UDP GSO) holds several datagrams of
 * gso_size bytes laid end to end: each is placed on its own.
 */
static unsigned int rlk_hook(void *priv, struct sk_buff *skb, const struct nf_hook_state *state)
{
	struct iphdr _iph;
	const struct iphdr *iph;
	struct udphdr _uh;
	const struct udphdr *uh;
	u8 _m[RLK_PREFIX_LEN];
	const u8 *m;
	struct rlk_ctx *ctx;
	u32 ihl, ulen, avail, seg, off, placed = 0;
	u64 events, every;
	bool complete = false;

	iph = skb_header_pointer(skb, 0, sizeof(_iph), &_iph);
	if (!iph || iph->version != 4 || iph->protocol != IPPROTO_UDP)
		return NF_ACCEPT;
	if (iph->frag_off & htons(IP_MF | IP_OFFSET))
		return NF_ACCEPT;
	ihl = iph->ihl * 4;
	if (ihl < sizeof(struct iphdr))
		return NF_ACCEPT;
	uh = skb_header_pointer(skb, ihl, sizeof(_uh), &_uh);
	if (!uh)
		return NF_ACCEPT;

	rcu_read_lock();
	if (!rlk_port_claimed(ntohs(uh->dest))) {
		rcu_read_unlock();
		return NF_ACCEPT;
	}
	/* The magic decides whose the datagram is: look for it in the bytes that are there. */
	avail = skb->len - min_t(u32, skb->len, ihl + sizeof(struct udphdr));
	m = NULL;
	if (avail >= RLK_PREFIX_LEN)
		m = skb_header_pointer(skb, ihl + sizeof(struct udphdr), sizeof(_m), _m);
	if (!m || get_unaligned_le32(m) != RLK_MAGIC) {
		/* Not ours (an acknowledgement, a probe, anything else): the stack's. */
		atomic64_inc(&rlk_global.passed);
		rcu_read_unlock();
		return NF_ACCEPT;
	}
	/* Ours from here on: placed, or counted and dropped. */
	ctx = rlk_find(ntohs(uh->dest), get_unaligned_le32(m + 4));
	if (!ctx) {
		/* Our magic, to a claimed port, for no link: a stale or forged tag. */
		atomic64_inc(&rlk_global.malformed);
		rcu_read_unlock();
		return NF_DROP;
	}
	/* (A context is on the list only once its area is set up.) */
	if (skb_is_gso(skb)) {
		/* Coalesced by GRO (or sent with UDP GSO over loopback): the UDP length covers
		 * them all; each datagram is gso_size bytes but the last. */
		if (!(skb_shinfo(skb)->gso_type & SKB_GSO_UDP_L4) || !skb_shinfo(skb)->gso_size)
			goto malformed;
		seg = skb_shinfo(skb)->gso_size;
		rlk_bump(&ctx->c.coalesced, &rlk_global.coalesced);
	} else {
		/* The UDP length must cover the prefix and stay inside the packet. */
		ulen = ntohs(uh->len);
		if (ulen < sizeof(struct udphdr) + RLK_PREFIX_LEN ||
		    ulen - sizeof(struct udphdr) > avail)
			goto malformed;
		seg = avail = ulen - sizeof(struct udphdr);
	}
	for (off = 0; off < avail; off += seg) {
		switch (rlk_place(ctx, skb, ihl + sizeof(struct udphdr) + off,
				  min(seg, avail - off), iph->saddr, uh->source, &complete)) {
		case RLK_PLACED:
			placed++;
			rlk_bump(&ctx->c.claimed, &rlk_global.claimed);
			break;
		case RLK_MALFORMED:
			rlk_bump(&ctx->c.malformed, &rlk_global.malformed);
			break;
		case RLK_NO_BANK:
			rlk_bump(&ctx->c.no_bank, &rlk_global.no_bank);
			break;
		case RLK_BUSY:
			rlk_bump(&ctx->c.busy, &rlk_global.busy);
			break;
		}
	}
	if (placed) {
		events = READ_ONCE(ctx->sh->events);
		every = READ_ONCE(ctx->sh->wake_every);
		if ((complete || every <= 1 || events - READ_ONCE(ctx->sh->seen) >= every) &&
		    wq_has_sleeper(&ctx->wq)) {
			rlk_bump(&ctx->c.wakeups, &rlk_global.wakeups);
			wake_up_interruptible(&ctx->wq);
		}
	}
	rcu_read_unlock();
	if (!placed)
		return NF_DROP;
	consume_skb(skb);
	return NF_STOLEN;

malformed:
	rlk_bump(&ctx->c.malformed, &rlk_global.malformed);
	rcu_read_unlock();
	return NF_DROP;
}

static const struct nf_hook_ops rlk_nf_ops = {
	.hook = rlk_hook,
	.pf = NFPROTO_IPV4,
	.hooknum = NF_INET_PRE_ROUTING,
	/* Before conntrack: our datagrams never need it. */
	.priority = NF_IP_PRI_RAW_BEFORE_DEFRAG + 1,
};

static bool rlk_may_open(void)
{
	if (capable(CAP_NET_ADMIN))
		return true;
	return gid >= 0 && in_group_p(make_kgid(current_user_ns(), gid));
}

static int rlk_open(struct inode *inode, struct file *file)
{
	struct rlk_ctx *ctx;

	if (!rlk_may_open())
		return -EPERM;
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	spin_lock_init(&ctx->lock);
	mutex_init(&ctx->tx_lock);
	init_waitqueue_head(&ctx->wq);
	ctx->owner = get_pid(task_tgid(current));
	file->private_data = ctx;
	atomic_inc(&rlk_live_ctxs);
	return 0;
}

static int rlk_release(struct inode *inode, struct file *file)
{
	struct rlk_ctx *ctx = file->private_data;

	mutex_lock(&rlk_ctxs_lock);
	if (ctx->area)
		list_del_rcu(&ctx->node);
	mutex_unlock(&rlk_ctxs_lock);
	/* No hook runs on this context after this. */
	synchronize_rcu();
	if (ctx->sock)
		sock_release(ctx->sock);
	if (ctx->area) {
		atomic64_sub(ctx->total, &rlk_live_bytes);
		vfree(ctx->area);
	}
	put_pid(ctx->owner);
	kfree(ctx);
	atomic_dec(&rlk_live_ctxs);
	return 0;
}

/* Only the process that opened the device uses it (not a child that inherited the fd). */
static bool rlk_owner(struct rlk_ctx *ctx)
{
	return task_tgid(current) == ctx->owner;
}

static long rlk_setup(struct rlk_ctx *ctx, struct rlk_setup __user *arg)
{
	struct rlk_setup s;
	size_t off, bitmaps, lens, data, total;
	void *area;

	if (copy_from_user(&s, arg, sizeof(s)))
		return -EFAULT;
	if (s.abi != RLK_ABI_VERSION)
		return -EPROTO;
	if (s.nbanks == 0 || s.nbanks > RLK_MAX_BANKS || s.slots < RLK_MIN_SLOTS ||
	    s.slots > RLK_MAX_SLOTS || s.slots % 64 || s.tx_bytes == 0 ||
	    s.tx_bytes > RLK_MAX_TX || s.tx_bytes % PAGE_SIZE)
		return -EINVAL;
	bitmaps = (size_t)s.nbanks * s.slots / 8;
	lens = (size_t)s.nbanks * s.slots * sizeof(u16);
	data = (size_t)s.nbanks * s.slots * RLK_SLOT_SIZE;
	off = PAGE_SIZE; /* rlk_shared */
	off += PAGE_ALIGN(s.nbanks * sizeof(struct rlk_bank));
	off += PAGE_ALIGN(bitmaps);
	off += PAGE_ALIGN(lens);
	total = off + data + s.tx_bytes;
	if (total > (size_t)max_mem_mb << 20)
		return -E2BIG;

	mutex_lock(&rlk_ctxs_lock);
	if (ctx->area) {
		mutex_unlock(&rlk_ctxs_lock);
		return -EBUSY;
	}
	area = vmalloc_user(total);
	if (!area) {
		mutex_unlock(&rlk_ctxs_lock);
		return -ENOMEM;
	}
	ctx->nbanks = s.nbanks;
	ctx->slots = s.slots;
	ctx->total = total;
	ctx->sh = area;
	off = PAGE_SIZE;
	ctx->sh->banks_off = off;
	ctx->banks = area + off;
	off += PAGE_ALIGN(s.nbanks * sizeof(struct rlk_bank));
	ctx->sh->bitmaps_off = off;
	ctx->bitmaps = area + off;
	off += PAGE_ALIGN(bitmaps);
	ctx->sh->lens_off = off;
	ctx->lens = area + off;
	off += PAGE_ALIGN(lens);
	ctx->sh->data_off = off;
	ctx->data = area + off;
	off += data;
	ctx->sh->tx_off = off;
	ctx->tx = area + off;
	ctx->sh->tx_bytes = s.tx_bytes;
	ctx->tx_bytes = s.tx_bytes;
	ctx->sh->total = total;
	ctx->sh->abi = RLK_ABI_VERSION;
	ctx->sh->nbanks = s.nbanks;
	ctx->sh->slots = s.slots;
	ctx->sh->slot_size = RLK_SLOT_SIZE;
	ctx->sh->wake_every = 16;
	ctx->port = 0;
	smp_wmb();
	ctx->area = area;
	atomic64_add(total, &rlk_live_bytes);
	list_add_rcu(&ctx->node, &rlk_ctxs);
	mutex_unlock(&rlk_ctxs_lock);
	return 0;
}

static long rlk_set_port(struct rlk_ctx *ctx, struct rlk_port __user *arg)
{
	struct rlk_port p;
	struct rlk_ctx *other;

	if (copy_from_user(&p, arg, sizeof(p)))
		return -EFAULT;
	if (p.port == 0)
		return -EINVAL;
	mutex_lock(&rlk_ctxs_lock);
	if (!ctx->area) {
		mutex_unlock(&rlk_ctxs_lock);
		return -ENXIO;
	}
	list_for_each_entry(other, &rlk_ctxs, node) {
		if (other != ctx && other->port == p.port && other->tag == p.tag) {
			mutex_unlock(&rlk_ctxs_lock);
			return -EADDRINUSE;
		}
	}
	/* The hook matches port and tag: never let it see a new port with the old tag. */
	WRITE_ONCE(ctx->port, 0);
	synchronize_rcu();
	WRITE_ONCE(ctx->tag, p.tag);
	WRITE_ONCE(ctx->port, p.port);
	mutex_unlock(&rlk_ctxs_lock);
	return 0;
}

static long rlk_set_dest(struct rlk_ctx *ctx, struct rlk_dest __user *arg)
{
	struct rlk_dest d;
	struct sockaddr_in sin = { .sin_family = AF_INET };
	struct socket *sock;
	int err;

	if (copy_from_user(&d, arg, sizeof(d)))
		return -EFAULT;
	if (d.port == 0 || d.addr == 0)
		return -EINVAL;
	sin.sin_addr.s_addr = d.addr;
	sin.sin_port = d.port;
	err = sock_create_kern(&init_net, PF_INET, SOCK_DGRAM, IPPROTO_UDP, &sock);
	if (err)
		return err;
	/* Room for a window's worth of datagrams in flight. */
	sock->sk->sk_sndbuf = 8 << 20;
	sock->sk->sk_userlocks |= SOCK_SNDBUF_LOCK;
	err = kernel_connect(sock, (struct sockaddr *)&sin, sizeof(sin), 0);
	if (err) {
		sock_release(sock);
		return err;
	}
	mutex_lock(&ctx->tx_lock);
	swap(ctx->sock, sock);
	mutex_unlock(&ctx->tx_lock);
	if (sock)
		sock_release(sock);
	return 0;
}

static long rlk_send(struct rlk_ctx *ctx, struct rlk_send __user *arg)
{
	struct rlk_send s;
	u64 done = 0;
	long sent = 0;
	int err = 0;

	if (copy_from_user(&s, arg, sizeof(s)))
		return -EFAULT;
	if (!ctx->area)
		return -ENXIO;
	if (s.seg == 0 || s.seg > 65507 || s.total == 0 || s.offset > ctx->tx_bytes ||
	    s.total > ctx->tx_bytes - s.offset)
		return -EINVAL;
	mutex_lock(&ctx->tx_lock);
	if (!ctx->sock) {
		mutex_unlock(&ctx->tx_lock);
		return -ENOTCONN;
	}
	while (done < s.total) {
		struct msghdr msg = { .msg_flags = 0 };
		struct kvec kv;
		size_t len = min_t(u64, s.seg, s.total - done);

		kv.iov_base = ctx->tx + s.offset + done;
		kv.iov_len = len;
		err = kernel_sendmsg(ctx->sock, &msg, &kv, 1, len);
		if (err < 0) {
			rlk_bump(&ctx->c.send_errors, &rlk_global.send_errors);
			break;
		}
		rlk_bump(&ctx->c.sent, &rlk_global.sent);
		sent++;
		done += len;
	}
	mutex_unlock(&ctx->tx_lock);
	if (sent == 0)
		return err < 0 ? err : -EIO;
	return sent;
}

static long rlk_wait_data(struct rlk_ctx *ctx, struct rlk_wait __user *arg)
{
	struct rlk_wait w;
	long r = 0;

	if (copy_from_user(&w, arg, sizeof(w)))
		return -EFAULT;
	if (!ctx->area)
		return -ENXIO;
	if (READ_ONCE(ctx->sh->events) == w.seen && w.timeout_ns) {
		u64 ns = min_t(u64, w.timeout_ns, 60ULL * NSEC_PER_SEC);

		r = wait_event_interruptible_timeout(ctx->wq, READ_ONCE(ctx->sh->events) != w.seen,
						     max_t(long, 1, nsecs_to_jiffies(ns)));
	}
	w.events = READ_ONCE(ctx->sh->events);
	if (copy_to_user(arg, &w, sizeof(w)))
		return -EFAULT;
	return r < 0 ? -EINTR : 0;
}

static long rlk_bank_src(struct rlk_ctx *ctx, struct rlk_bank_src __user *arg)
{
	struct rlk_bank_src s;
	struct rlk_bank *k;

	if (copy_from_user(&s, arg, sizeof(s)))
		return -EFAULT;
	if (!ctx->area)
		return -ENXIO;
	if (s.bank >= ctx->nbanks)
		return -EINVAL;
	k = &ctx->banks[s.bank];
	spin_lock_bh(&ctx->lock);
	s.addr = k->src_addr;
	s.port = k->src_port;
	s.state = k->state;
	s.frame = k->frame;
	spin_unlock_bh(&ctx->lock);
	return copy_to_user(arg, &s, sizeof(s)) ? -EFAULT : 0;
}

static long rlk_release_bank(struct rlk_ctx *ctx, u32 __user *arg)
{
	u32 b;
	struct rlk_bank *k;

	if (get_user(b, arg))
		return -EFAULT;
	if (!ctx->area)
		return -ENXIO;
	if (b >= ctx->nbanks)
		return -EINVAL;
	k = &ctx->banks[b];
	spin_lock_bh(&ctx->lock);
	rlk_empty_bank(ctx, b);
	k->stored = 0;
	k->gen++;
	WRITE_ONCE(k->state, RLK_BANK_FREE);
	spin_unlock_bh(&ctx->lock);
	atomic64_inc(&ctx->c.released);
	atomic64_inc(&rlk_global.released);
	return 0;
}

/* Datagrams still set in the bitmaps of banks user space has freed. */
static u64 rlk_stranded(struct rlk_ctx *ctx)
{
	u64 n = 0;
	u32 b;

	spin_lock_bh(&ctx->lock);
	for (b = 0; b < ctx->nbanks; b++)
		if (READ_ONCE(ctx->banks[b].state) != RLK_BANK_ACTIVE)
			n += bitmap_weight(rlk_bitmap(ctx, b), ctx->slots);
	spin_unlock_bh(&ctx->lock);
	return n;
}

static void rlk_read_counters(struct rlk_counters *c, struct rlk_stats *s)
{
	s->claimed = atomic64_read(&c->claimed);
	s->passed = atomic64_read(&c->passed);
	s->dropped_malformed = atomic64_read(&c->malformed);
	s->dropped_no_bank = atomic64_read(&c->no_bank);
	s->dropped_busy = atomic64_read(&c->busy);
	s->sent = atomic64_read(&c->sent);
	s->send_errors = atomic64_read(&c->send_errors);
	s->wakeups = atomic64_read(&c->wakeups);
	s->released = atomic64_read(&c->released);
	s->coalesced = atomic64_read(&c->coalesced);
	s->dropped_stale = atomic64_read(&c->stale);
}

static long rlk_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct rlk_ctx *ctx = file->private_data;
	void __user *p = (void __user *)arg;

	if (!rlk_owner(ctx))
		return -EPERM;
	switch (cmd) {
	case RLK_IOC_INFO: {
		struct rlk_info i = {
			.abi = RLK_ABI_VERSION,
			.slot_size = RLK_SLOT_SIZE,
			.max_banks = RLK_MAX_BANKS,
			.max_slots = RLK_MAX_SLOTS,
			.max_tx = RLK_MAX_TX,
			.total = ctx->area ? ctx->total : 0,
		};
		return copy_to_user(p, &i, sizeof(i)) ? -EFAULT : 0;
	}
	case RLK_IOC_SETUP:
		return rlk_setup(ctx, p);
	case RLK_IOC_SET_PORT:
		return rlk_set_port(ctx, p);
	case RLK_IOC_SET_DEST:
		return rlk_set_dest(ctx, p);
	case RLK_IOC_WAIT_DATA:
		return rlk_wait_data(ctx, p);
	case RLK_IOC_SEND:
		return rlk_send(ctx, p);
	case RLK_IOC_GET_BANK_SRC:
		return rlk_bank_src(ctx, p);
	case RLK_IOC_RELEASE_BANK:
		return rlk_release_bank(ctx, p);
	case RLK_IOC_STATS: {
		struct rlk_stats s;

		rlk_read_counters(&ctx->c, &s);
		/* Several links may share a port: what passed is counted module-wide. */
		s.passed = atomic64_read(&rlk_global.passed);
		/* Datagrams left in banks user space has freed are dropped when a new frame takes
		 * the bank; counted now too, so the sum is whole whenever it is read. */
		if (ctx->area)
			s.dropped_stale += rlk_stranded(ctx);
		return copy_to_user(p, &s, sizeof(s)) ? -EFAULT : 0;
	}
	default:
		return -ENOTTY;
	}
}

static __poll_t rlk_poll(struct file *file, poll_table *pt)
{
	struct rlk_ctx *ctx = file->private_data;

	poll_wait(file, &ctx->wq, pt);
	if (ctx->area && READ_ONCE(ctx->sh->events) != READ_ONCE(ctx->sh->seen))
		return EPOLLIN | EPOLLRDNORM;
	return 0;
}

static int rlk_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct rlk_ctx *ctx = file->private_data;

	if (!rlk_owner(ctx))
		return -EPERM;
	if (!ctx->area)
		return -ENXIO;
	if (vma->vm_pgoff != 0 || vma->vm_end - vma->vm_start > ctx->total)
		return -EINVAL;
	return remap_vmalloc_range(vma, ctx->area, 0);
}

static const struct file_operations rlk_fops = {
	.owner = THIS_MODULE,
	.open = rlk_open,
	.release = rlk_release,
	.unlocked_ioctl = rlk_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.poll = rlk_poll,
	.mmap = rlk_mmap,
	.llseek = noop_llseek,
};

static struct miscdevice rlk_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "ringllm",
	.fops = &rlk_fops,
	.mode = 0600,
};

/* /proc/ringllm: the module-wide counters, and what is still allocated. */
static int rlk_proc_show(struct seq_file *m, void *v)
{
	struct rlk_stats s;

	rlk_read_counters(&rlk_global, &s);
	seq_printf(m, "version %s abi %u\n", RLK_VERSION, RLK_ABI_VERSION);
	seq_printf(m, "contexts %d\nbytes %lld\n", atomic_read(&rlk_live_ctxs),
		   (long long)atomic64_read(&rlk_live_bytes));
	seq_printf(m, "claimed %llu\npassed %llu\ndropped_malformed %llu\ndropped_no_bank %llu\n",
		   s.claimed, s.passed, s.dropped_malformed, s.dropped_no_bank);
	seq_printf(m, "dropped_busy %llu\nsent %llu\nsend_errors %llu\nwakeups %llu\nreleased %llu\n",
		   s.dropped_busy, s.sent, s.send_errors, s.wakeups, s.released);
	seq_printf(m, "coalesced %llu\ndropped_stale %llu\n", s.coalesced, s.dropped_stale);
	return 0;
}

static int __init rlk_init(void)
{
	int err;

	if (!proc_create_single("ringllm", 0444, NULL, rlk_proc_show))
		return -ENOMEM;
	err = misc_register(&rlk_misc);
	if (err)
		goto no_misc;
	err = nf_register_net_hook(&init_net, &rlk_nf_ops);
	if (err)
		goto no_hook;
	pr_info("ringllm: loaded (abi %u, /dev/ringllm)\n", RLK_ABI_VERSION);
	return 0;
no_hook:
	misc_deregister(&rlk_misc);
no_misc:
	remove_proc_entry("ringllm", NULL);
	return err;
}

static void __exit rlk_exit(void)
{
	nf_unregister_net_hook(&init_net, &rlk_nf_ops);
	misc_deregister(&rlk_misc);
	remove_proc_entry("ringllm", NULL);
	pr_info("ringllm: unloaded (contexts %d, bytes %lld)\n", atomic_read(&rlk_live_ctxs),
		(long long)atomic64_read(&rlk_live_bytes));
}

module_init(rlk_init);
module_exit(rlk_exit);
MODULE_LICENSE("GPL");
MODULE_AUTHOR("ringllm");
MODULE_DESCRIPTION("ringllm kernel-bypass transport: netfilter hook into mmap'd banks");
MODULE_VERSION(RLK_VERSION);

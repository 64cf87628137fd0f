/* SPDX-License-Identifier: GPL-2.0 OR MIT */
/*
 * ringllm kernel-bypass transport: the ABI between the module (ringllm.ko) and user space.
 * protocol/src/kmod/abi.rs mirrors every struct and number here; a change to either is a new
 * RLK_ABI_VERSION.
 *
 * One open of /dev/ringllm is one *context*: a UDP port whose data datagrams the module claims
 * in its netfilter hook, the banks they land in, and a TX area. The context's memory is one
 * vmalloc'd area that user space maps (mmap offset 0, length rlk_info.total):
 *
 *   [0, 4096)              struct rlk_shared: the layout and the live counters
 *   banks_off              nbanks x struct rlk_bank
 *   bitmaps_off            nbanks x (slots / 8) bytes: bit s of bank b set = slot s holds a
 *                          datagram (set by the module after the bytes are in; cleared by user
 *                          space, atomically, when it has taken the datagram)
 *   lens_off               nbanks x slots x u16: the datagram's length in that slot
 *   data_off               nbanks x slots x RLK_SLOT_SIZE: the datagrams (without the magic)
 *   tx_off                 tx_bytes: datagrams user space hands to RLK_IOC_SEND
 *
 * Wire: a claimed datagram is UDP to the context's port whose payload starts with RLK_MAGIC
 * (4 bytes) and the context's tag (u32 LE; several links may share a port, one tag each:
 * both ends derive it from the link's keys), followed by a reliable-UDP data datagram (protocol/src/udp/wire.rs): a 32-byte
 * header (kind 1, version 1, chunk size u16, chunk index u32, chunk count u32, frame bytes
 * u32, frame sequence u64, chunk sequence u64; little endian), the chunk, a 24-byte seal. The
 * module checks the fields it uses and never the seal (it has no key); chunk i of frame f from
 * source s lands in slot i % slots of the bank holding (s, f).
 */
#ifndef RINGLLM_KMOD_H
#define RINGLLM_KMOD_H

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/ioctl.h>
#else
#include <stdint.h>
#include <sys/ioctl.h>
typedef uint8_t __u8;
typedef uint16_t __u16;
typedef uint32_t __u32;
typedef uint64_t __u64;
typedef int64_t __s64;
#endif

#define RLK_ABI_VERSION 2
#define RLK_MAGIC 0x314b4c52u /* "RLK1" as bytes on the wire */
#define RLK_PREFIX_LEN 8 /* the magic and the tag */
#define RLK_DATA_HDR_LEN 32
#define RLK_SEAL_LEN 24
#define RLK_SLOT_SIZE 2048
#define RLK_KIND_DATA 1
#define RLK_WIRE_VERSION 1

#define RLK_MAX_BANKS 64
#define RLK_MIN_SLOTS 64
#define RLK_MAX_SLOTS 16384
#define RLK_MAX_TX (16u << 20)
/* A chunk count no frame the engine sends can reach (its payload cap is 64 MiB). */
#define RLK_MAX_CHUNKS (1u << 20)

#define RLK_BANK_FREE 0
#define RLK_BANK_ACTIVE 1

struct rlk_shared {
	__u32 abi;
	__u32 nbanks;
	__u32 slots;
	__u32 slot_size;
	__u64 banks_off;
	__u64 bitmaps_off;
	__u64 lens_off;
	__u64 data_off;
	__u64 tx_off;
	__u64 tx_bytes;
	__u64 total;
	/* Written by the module: datagrams stored, banks completed (chunks stored == count). */
	__u64 events;
	__u64 completions;
	/* Written by user space: the events it has looked at (poll reports POLLIN while events
	 * differs), and how many new events wake a sleeper (0 or 1: every one). */
	__u64 seen;
	__u64 wake_every;
};

struct rlk_bank {
	/* RLK_BANK_FREE or RLK_BANK_ACTIVE. The module sets ACTIVE when a new frame claims the
	 * bank (clearing its bitmap first); user space frees it by storing FREE once it has taken
	 * every datagram it wants (or with RLK_IOC_RELEASE_BANK). */
	__u32 state;
	__u32 count;  /* chunk count of the datagram that claimed the bank */
	__u64 frame;  /* frame sequence number */
	__u32 src_addr; /* IPv4 source, network order */
	__u16 src_port; /* network order */
	__u16 pad;
	__u32 stored; /* datagrams stored since the bank was claimed */
	__u32 gen;    /* bumped by every release */
};

/* RLK_IOC_INFO: the module's ABI and limits (no setup needed). */
struct rlk_info {
	__u32 abi;
	__u32 slot_size;
	__u32 max_banks;
	__u32 max_slots;
	__u32 max_tx;
	__u32 pad;
	__u64 total; /* bytes to mmap after RLK_IOC_SETUP (0 before) */
};

/* RLK_IOC_SETUP: size the context's area (once per open; before mmap). */
struct rlk_setup {
	__u32 abi; /* must be RLK_ABI_VERSION */
	__u32 nbanks;
	__u32 slots; /* a multiple of 64 */
	__u32 tx_bytes; /* a multiple of 4096 */
};

/* RLK_IOC_SET_PORT: claim data datagrams to UDP `port` (host order) carrying `tag`. */
struct rlk_port {
	__u16 port;
	__u16 pad;
	__u32 tag;
};

/* RLK_IOC_SET_DEST: where RLK_IOC_SEND sends (IPv4, network order). */
struct rlk_dest {
	__u32 addr;
	__u16 port;
	__u16 pad;
};

/* RLK_IOC_WAIT_DATA: sleep until events differs from `seen`, or timeout (ns; 0: do not
 * sleep). Returns the events count in `events`. */
struct rlk_wait {
	__u64 seen;
	__u64 timeout_ns;
	__u64 events;
};

/* RLK_IOC_SEND: datagrams laid end to end in the TX area from `offset`, each `seg` bytes but
 * the last, `total` bytes in all. Returns how many were sent (>= 1) or an error. */
struct rlk_send {
	__u64 offset;
	__u64 total;
	__u32 seg;
	__u32 pad;
};

/* RLK_IOC_GET_BANK_SRC: the source of bank `bank` (in), `addr`/`port` (out, network order),
 * its frame and state. */
struct rlk_bank_src {
	__u32 bank;
	__u32 addr;
	__u16 port;
	__u16 pad;
	__u32 state;
	__u64 frame;
};

struct rlk_stats {
	__u64 claimed;           /* datagrams stored in a bank (NF_STOLEN) */
	__u64 passed;            /* to a claimed port without the magic (left to the stack; module-wide) */
	__u64 dropped_malformed; /* with the magic, but a field out of bounds */
	__u64 dropped_no_bank;   /* no bank free for a new frame */
	__u64 dropped_busy;      /* the slot still held a datagram (a duplicate) */
	__u64 sent;              /* datagrams sent by RLK_IOC_SEND */
	__u64 send_errors;
	__u64 wakeups;
	__u64 released;          /* banks released by RLK_IOC_RELEASE_BANK */
	__u64 coalesced;         /* skbs holding several datagrams (GRO), each placed on its own */
	__u64 dropped_stale;     /* stored in a bank user space then freed, never read (ABI 2) */
};

#define RLK_IOC_MAGIC 'r'
#define RLK_IOC_INFO _IOR(RLK_IOC_MAGIC, 1, struct rlk_info)
#define RLK_IOC_SETUP _IOW(RLK_IOC_MAGIC, 2, struct rlk_setup)
#define RLK_IOC_SET_PORT _IOW(RLK_IOC_MAGIC, 3, struct rlk_port)
#define RLK_IOC_SET_DEST _IOW(RLK_IOC_MAGIC, 4, struct rlk_dest)
#define RLK_IOC_WAIT_DATA _IOWR(RLK_IOC_MAGIC, 5, struct rlk_wait)
#define RLK_IOC_SEND _IOW(RLK_IOC_MAGIC, 6, struct rlk_send)
#define RLK_IOC_GET_BANK_SRC _IOWR(RLK_IOC_MAGIC, 7, struct rlk_bank_src)
#define RLK_IOC_RELEASE_BANK _IOW(RLK_IOC_MAGIC, 8, __u32)
#define RLK_IOC_STATS _IOR(RLK_IOC_MAGIC, 9, struct rlk_stats)

#endif

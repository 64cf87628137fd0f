#!/bin/sh
# Demo /guest-test.sh for kmod/qemu/boot-pair (runs inside each guest as `sh /guest-test.sh ROLE`).
# Both guests: insmod/rmmod /ringllm_hello.ko if present, ping the peer.
# Role 2 listens with busybox nc and checks the 10 MiB it receives; role 1 sends it and reports
# the throughput. Exit status 0 = success.
role=$1
peer=10.77.0.$((3 - role))
port=5001
say() { echo "demo[g$role] $(cut -d" " -f1 /proc/uptime)s: $*"; }
fail() { say "FAIL: $*"; exit 1; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

say "userspace up, eth0 $(ip -o -4 addr show dev eth0 | awk '{print $4}')"

if [ -f /ringllm_hello.ko ]; then
    insmod /ringllm_hello.ko || fail "insmod ringllm_hello.ko"
    lsmod | grep -q '^ringllm_hello' || fail "module not in lsmod"
    rmmod ringllm_hello || fail "rmmod ringllm_hello"
    dmesg | grep -E 'ringllm_hello|taint' | sed 's/^/  dmesg: /'
    dmesg | grep -q 'ringllm_hello: unloaded' || fail "module messages missing from dmesg"
fi

# The peer may still be booting: retry for up to 120 s.
i=0
until ping -c1 -W1 "$peer" >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -lt 120 ] || fail "peer $peer unreachable"
done
say "peer answers ping"
ping -c3 -i0.2 "$peer" | tail -n2 | sed 's/^/  /' || fail "ping $peer"

# 10 MiB of deterministic data both sides can generate cheaply (1 MiB block x 10).
seq 1 200000 | head -c 1048576 > /tmp/block
for i in 1 2 3 4 5 6 7 8 9 10; do cat /tmp/block; done > /tmp/data
want=$(sha256sum < /tmp/data | cut -d' ' -f1)
say "test data ready"

if [ "$role" = 2 ]; then
    nc -l -p $port > /tmp/recv || fail "nc -l"
    got=$(sha256sum < /tmp/recv | cut -d' ' -f1)
    size=$(wc -c < /tmp/recv)
    [ "$got" = "$want" ] || fail "received $size bytes, sha256 $got != $want"
    say "received $size bytes, sha256 ok"
else
    i=0
    while :; do          # until g2's listener is up
        t0=$(uptime_s)
        nc "$peer" $port < /tmp/data 2>/dev/null && break
        i=$((i + 1)); [ $i -lt 120 ] || fail "cannot connect to $peer:$port"
        sleep 0.5
    done
    t1=$(uptime_s)
    say "sent 10 MiB in $(awk -v a="$t0" -v b="$t1" 'BEGIN{d=b-a; printf "%.2f s = %.1f MiB/s", d, 10/d}')"
fi
exit 0

#!/bin/sh
# The guest half of kmod/test-qemu: runs as /guest-test.sh ROLE inside each of two QEMU guests
# (busybox sh). Guest 1 (10.77.0.1) drives; guest 2 (10.77.0.2) serves a node and a transport
# echo server, floods guest 1 on cue, and unloads its own module at the end. Every check
# prints `KMOD-OK <what>` or `KMOD-FAIL <what>` (and exits 1); the host counts the OKs.
set -u
role=$1
me=10.77.0.$role
peer=10.77.0.$((3 - role))
# The ring's model and the bench's iterations and sizes come from the kernel command line
# (kmod/test-qemu --quick: a small synthetic model, 5 iterations, no 1 MiB messages: under
# software emulation the bench only proves that every transport, kmod among them, carries it).
arg() { sed -n "s/.*ringllm.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
model=/models/$(arg model)
[ "$model" = /models/ ] && model=/models/smollm2-135m-instruct-q4_1.gguf
iterations=$(arg bench_iterations)
sizes=$(arg bench_sizes)
prompt="The three primary colors are"
gen="--temp 0 -n 8 --threads 1 -c 128"
export RUST_BACKTRACE=1

fail() {
    echo "KMOD-FAIL $*"
    # Guest 1 tells guest 2 not to wait for it.
    if [ "$role" = 1 ]; then
        echo abort | nc -w 2 "$peer" 9999 2> /dev/null
        echo abort | nc -w 2 "$peer" 9998 2> /dev/null
    fi
    exit 1
}
# Each check with the guest's uptime, so a slow step shows in the log.
ok() { echo "KMOD-OK $* [$(cut -d' ' -f1 /proc/uptime) s]"; }
# The module-wide counter NAME from /proc/ringllm.
counter() { awk -v k="$1" '$1 == k { print $2 }' /proc/ringllm; }
# Sends a word to the other guest's cue port (retrying until it listens).
cue() { i=0; until echo "$2" | nc -w 2 "$peer" "$1" 2>/dev/null; do i=$((i + 1)); [ $i -lt 120 ] || fail "cue $1: $peer never listened"; sleep 1; done; }
# Waits for a word on our cue port.
await() {
    timeout 900 nc -l -p "$1" > /tmp/cue.$1 || fail "await $1"
    grep -q abort /tmp/cue.$1 && fail "guest 1 failed"
    return 0
}
wait_tcp() { i=0; until nc -w 1 "$1" "$2" < /dev/null 2>/dev/null; do i=$((i + 1)); [ $i -lt 300 ] || fail "$1:$2 never listened"; sleep 1; done; }

# Without the module, --transport kmod refuses to start and says what to do.
if ringllm node --listen "$me:7790" --key /key --models /models --transport kmod 2> /tmp/nomod.err; then
    fail "a node with --transport kmod started without the module"
fi
grep -q "insmod" /tmp/nomod.err || { cat /tmp/nomod.err; fail "the refusal does not say how to load the module"; }
ok "without the module, node --transport kmod refuses: $(tail -n 1 /tmp/nomod.err)"

insmod /ringllm.ko || fail "insmod"
[ -c /dev/ringllm ] || fail "no /dev/ringllm after insmod"
ok "insmod: $(head -n 1 /proc/ringllm)"

if [ "$role" = 2 ]; then
    ringllm node --listen "$me:7701" --key /key --models /models --name g2 --threads 1 \
        --transport kmod --cache /tmp/cache 2> /tmp/node.log &
    node=$!
    ringllm bench --transports --echo-server "$me:7000" 2> /tmp/echo.log &
    echo_pid=$!
    # Guest 1 asks for traffic while it unloads its module under a blocked reader.
    await 9999
    ringllm debug udp-flood --to 10.77.0.1:7795 --tag 7 --seconds 600 > /dev/null &
    flood=$!
    ok "flooding $peer:7795"
    await 9998
    kill $flood 2> /dev/null
    kill $node $echo_pid 2> /dev/null
    wait $node 2> /dev/null
    wait $echo_pid 2> /dev/null
    grep -q "panicked" /tmp/node.log && { cat /tmp/node.log; fail "the node panicked"; }
    ok "guest 2 counters: $(tr '\n' ' ' < /proc/ringllm)"
    rmmod ringllm || fail "rmmod on guest 2"
    [ ! -e /proc/ringllm ] || fail "/proc/ringllm left behind"
    ok "guest 2: rmmod clean"
    exit 0
fi

# ---- guest 1 ----
# 1. The transport conformance suite over the module, both ends in this guest (loopback
#    traffic passes the same PRE_ROUTING hook).
RINGLLM_CONFORMANCE_ONLY=kmod conformance --test-threads 1 --nocapture > /tmp/conf.out 2>&1
st=$?
cat /tmp/conf.out
[ $st = 0 ] || fail "conformance over kmod"
grep -q -- "-- kmod" /tmp/conf.out || fail "conformance did not run kmod"
ok "conformance over kmod: $(grep 'test result' /tmp/conf.out)"

# 2. The module against a raw socket, and links through forgeries.
kmod_device --include-ignored --test-threads 1 --nocapture > /tmp/dev.out 2>&1
st=$?
cat /tmp/dev.out
[ $st = 0 ] || fail "kmod_device"
grep -q "test result: ok. 5 passed" /tmp/dev.out || fail "kmod_device did not run all five"
ok "kmod_device: $(grep 'test result' /tmp/dev.out)"

# 3. A two-node ring (SmolLM2, or with --quick a small synthetic llama), one node per guest, the coordinator here: the same tokens
#    and bit-identical logits as the single process.
ringllm run -m "$model" -p "$prompt" $gen --json --logits-out /tmp/single.f32 > /tmp/single.json 2> /tmp/single.err \
    || { cat /tmp/single.err; fail "single process"; }
ringllm node --listen "$me:7701" --key /key --models /models --name g1 --threads 1 \
    --transport kmod --cache /tmp/cache 2> /tmp/node.log &
node=$!
wait_tcp "$me" 7701
wait_tcp "$peer" 7701
claimed0=$(counter claimed)
ringllm up -m "$model" --key /key --node "$me:7701" --node "$peer:7701" -p "$prompt" $gen \
    --json --logits-out /tmp/ring.f32 > /tmp/ring.json 2> /tmp/ring.err \
    || { cat /tmp/ring.err /tmp/node.log; fail "ring over kmod"; }
cat /tmp/ring.err
grep -q "data links: kmod, kmod" /tmp/ring.err || fail "the ring does not say its links run on kmod"
ids() { sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p' "$1"; }
want=$(ids /tmp/single.json)
got=$(ids /tmp/ring.json)
[ -n "$want" ] || fail "no token ids from the single process"
[ "$want" = "$got" ] || fail "ring tokens $got, single process $want"
cmp /tmp/single.f32 /tmp/ring.f32 || fail "ring logits differ from the single process"
claimed=$(($(counter claimed) - claimed0))
[ "$claimed" -gt 0 ] || fail "no datagram went through the module"
ok "ring over kmod bit-identical to the single process: tokens $got, logits $(wc -c < /tmp/ring.f32) bytes identical; $claimed datagrams stolen here"
kill $node
wait $node 2> /dev/null

# 4. Latency, throughput and receive CPU per MiB: kmod vs udp vs tcp between the guests.
#    `ringllm.bench_rounds=N` on the kernel command line (kmod/test-qemu --bench-rounds N)
#    repeats it, for figures less at the mercy of a busy host.
wait_tcp "$peer" 7000
rounds=$(arg bench_rounds)
r=0
while [ $r -lt "${rounds:-1}" ]; do
    r=$((r + 1))
    ringllm bench --transports --peer "$peer:7000" --transport tcp,udp,kmod --sizes "${sizes:-2560,16384,1048576}" \
        --iterations "${iterations:-200}" > /tmp/bench.md 2> /tmp/bench.err \
        || { cat /tmp/bench.err; fail "bench --transports"; }
    echo "bench round $r"
    cat /tmp/bench.md
    grep -q "^| kmod |" /tmp/bench.md || { cat /tmp/bench.err; fail "no kmod row in the bench"; }
done
ok "bench --transports between the guests ($r rounds)"

# 5. Unloading: refused (in use) while a reader is blocked in the module and traffic flows,
#    clean once the reader is gone, with the traffic still flowing.
ringllm debug kmod-hold --port 7795 --tag 7 --seconds 300 > /tmp/hold.out 2>&1 &
hold=$!
sleep 1
cue 9999 traffic
sleep 3
seen=$(($(counter passed) + $(counter dropped_malformed) + $(counter claimed)))
if rmmod ringllm 2> /tmp/rmmod.err; then fail "rmmod succeeded under a blocked reader"; fi
ok "rmmod refused while a reader is blocked: $(cat /tmp/rmmod.err); $(grep ringllm /proc/modules)"
kill -9 $hold
wait $hold 2> /dev/null
sleep 1
[ "$(counter contexts)" = 0 ] && [ "$(counter bytes)" = 0 ] || fail "a context outlived its process: $(tr '\n' ' ' < /proc/ringllm)"
now=$(($(counter passed) + $(counter dropped_malformed) + $(counter claimed)))
[ "$now" -gt "$seen" ] || fail "no traffic reached the hook during the unload test"
ok "traffic through the hook during the test: $seen then $now datagrams; counters $(tr '\n' ' ' < /proc/ringllm)"
rmmod ringllm || fail "rmmod with traffic flowing"
[ ! -e /dev/ringllm ] && [ ! -e /proc/ringllm ] || fail "rmmod left the device behind"
ping -c 1 -W 5 "$peer" > /dev/null || fail "the network is gone after rmmod"
ok "rmmod clean with traffic flowing; the network still works"
if [ -e /sys/kernel/debug/kmemleak ]; then
    echo scan > /sys/kernel/debug/kmemleak
    leaks=$(grep -c unreferenced /sys/kernel/debug/kmemleak)
    [ "$leaks" = 0 ] || { cat /sys/kernel/debug/kmemleak; fail "kmemleak: $leaks leaks"; }
    ok "kmemleak: no leaks"
else
    ok "kmemleak: not in this kernel (CONFIG_DEBUG_KMEMLEAK unset); /proc/ringllm showed 0 contexts and 0 bytes before unload"
fi
cue 9998 done
exit 0

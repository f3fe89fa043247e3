#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair, each running one
# dtrun with --nnodes 2 (as `torchrun --nnodes 2` runs one agent per host), rendezvous at host
# A's address. Checks that
#   1. a (dp_shard 2, tp 2) training run across the hosts (TP inside a host, FSDP across them)
#      matches one device (dtensor_train --verify-tp1), Gloo finding its interface through the
#      route to MASTER_ADDR;
#   2. with GLOO_SOCKET_IFNAME naming the veth, taking the link down in the middle of a run
#      ends every rank on both hosts within a bound, each host's output naming ranks of the
#      other host that it could not reach.
# Usage: two_hosts.sh DTRUN DTENSOR_TRAIN. Needs root and `ip netns` (iproute2); exits 77
# (CTest: skipped) with the reason otherwise. The namespaces, and with them the veth pair and
# its addresses, are removed on every exit. Traffic stays inside the two namespaces.
set -uo pipefail

DTRUN=${1:?usage: two_hosts.sh DTRUN DTENSOR_TRAIN}
TRAIN=${2:?usage: two_hosts.sh DTRUN DTENSOR_TRAIN}
SKIP=77

skip() {
  echo "SKIPPED: $*"
  exit $SKIP
}
fail() {
  echo "FAILED: $*"
  exit 1
}

[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces (run as root, as CI does)"
command -v ip >/dev/null || skip "no 'ip' command (install iproute2; scripts/setup does)"

ID=$$
NS_A=dtensor_host_a_$ID
NS_B=dtensor_host_b_$ID
VETH_A=dtva$ID # interface names are at most 15 characters
VETH_B=dtvb$ID
ADDR_A=10.213.0.1 # only inside the namespaces
ADDR_B=10.213.0.2
PORT=29500
WORK=$(mktemp -d)
PIDS=()

cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  ip netns del "$NS_A" 2>/dev/null
  ip netns del "$NS_B" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$NS_A" 2>"$WORK/netns.err" ||
  skip "'ip netns add' is not available here: $(cat "$WORK/netns.err")"
ip netns add "$NS_B" || fail "ip netns add $NS_B"
ip link add "$VETH_A" type veth peer name "$VETH_B" || fail "cannot create the veth pair"
ip link set "$VETH_A" netns "$NS_A" && ip link set "$VETH_B" netns "$NS_B" ||
  fail "cannot move the veth ends into the namespaces"
ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A" && ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B" ||
  fail "cannot address the veth ends"
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
ip -n "$NS_A" link set "$VETH_A" up && ip -n "$NS_B" link set "$VETH_B" up || fail "link up"

# One host's launch: the same command on both, only --node-rank differs.
# host NS NODE_RANK LOG [VAR=VALUE...] -- TRAIN-ARGS...
host() {
  local ns=$1 node=$2 log=$3
  shift 3
  local vars=()
  while [ "$1" != "--" ]; do
    vars+=("$1")
    shift
  done
  shift
  ip netns exec "$ns" env OMP_NUM_THREADS=1 "${vars[@]}" \
    "$DTRUN" -n 2 --nnodes 2 --node-rank "$node" --master-addr "$ADDR_A" --master-port "$PORT" \
    --grace 2 "$TRAIN" "$@" >"$log" 2>&1 &
  PIDS+=($!)
}

# Waits for pid $1 at most $2 seconds; sets CODE to its exit code, or to "timeout". (Not in
# a command substitution: a subshell cannot wait for its parent's children.)
wait_for() {
  local pid=$1 limit=$2 start=$SECONDS
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS - start >= limit)); then
      CODE=timeout
      return
    fi
    sleep 0.2
  done
  wait "$pid"
  CODE=$?
}

show() {
  echo "---- host A (node 0: ranks 0, 1) ----"
  cat "$WORK/a.log"
  echo "---- host B (node 1: ranks 2, 3) ----"
  cat "$WORK/b.log"
}

# 1. dp_shard 2 x tp 2 over the two hosts equals one device. Gloo's address comes from the
# route to MASTER_ADDR (no GLOO_SOCKET_IFNAME).
echo "case 1: dtensor_train --dp-shard 2 over 2 hosts x 2 ranks, --verify-tp1"
train_args=(--preset tiny --dp-shard 2 --steps 6 --eval-every 0 --eval-batches 1 --progress lines)
host "$NS_A" 0 "$WORK/a.log" DTENSOR_TIMEOUT_S=120 -- "${train_args[@]}" --verify-tp1 --out "$WORK/run_a"
host "$NS_B" 1 "$WORK/b.log" DTENSOR_TIMEOUT_S=120 -- "${train_args[@]}" --out "$WORK/run_b"
wait_for "${PIDS[0]}" 300
code_a=$CODE
wait_for "${PIDS[1]}" 30
code_b=$CODE
PIDS=()
if [ "$code_a" != 0 ] || [ "$code_b" != 0 ]; then
  show
  fail "case 1: host A's dtrun exited $code_a, host B's $code_b (expected 0 and 0)"
fi
grep -qE "FSDP=2 .* x TP=2 .* on 4 CPU ranks" "$WORK/a.log" || {
  show
  fail "case 1: host A's header does not show the 4-rank dp_shard 2 x tp 2 mesh"
}
grep -q "verify-tp1: PASSED" "$WORK/a.log" || {
  show
  fail "case 1: the two-host run does not match one device"
}
grep -E "^\[rank 0\] verify-tp1: PASSED" "$WORK/a.log"
grep -qE '^\[rank [23]\]' "$WORK/b.log" || {
  show
  fail "case 1: host B's output has no line of ranks 2 or 3"
}
echo "case 1: passed"

# 2. The link goes down in the middle of a run: every rank on both hosts ends within the
# bound, and each host names ranks of the other one. Gloo on the veth by GLOO_SOCKET_IFNAME.
TIMEOUT_S=8
BOUND_S=$((3 * TIMEOUT_S + 10))
echo "case 2: link down mid-run (DTENSOR_TIMEOUT_S=$TIMEOUT_S, bound ${BOUND_S} s)"
long_args=(--preset tiny --dp-shard 2 --steps 100000 --eval-every 0 --progress lines --log-every 1)
# Emptied here, not only by the background launches' redirections: on a busy machine those may
# run after the wait below has already counted case 1's step lines, and the link would go down
# before case 2's ranks had even met (they then wait for the connect timeout, past the bound).
: >"$WORK/a.log"
: >"$WORK/b.log"
host "$NS_A" 0 "$WORK/a.log" DTENSOR_TIMEOUT_S=$TIMEOUT_S GLOO_SOCKET_IFNAME="$VETH_A" -- \
  "${long_args[@]}" --out "$WORK/run_a"
host "$NS_B" 1 "$WORK/b.log" DTENSOR_TIMEOUT_S=$TIMEOUT_S GLOO_SOCKET_IFNAME="$VETH_B" -- \
  "${long_args[@]}" --out "$WORK/run_b"
start=$SECONDS
until [ "$(grep -c 'step ' "$WORK/a.log")" -ge 3 ]; do
  if ((SECONDS - start > 240)) || ! kill -0 "${PIDS[0]}" 2>/dev/null ||
    ! kill -0 "${PIDS[1]}" 2>/dev/null; then
    show
    fail "case 2: the run did not reach step 3 with both hosts up"
  fi
  sleep 0.2
done
ip -n "$NS_B" link set "$VETH_B" down || fail "cannot take the link down"
down_at=$SECONDS
wait_for "${PIDS[0]}" $BOUND_S
code_a=$CODE
wait_for "${PIDS[1]}" $((BOUND_S - (SECONDS - down_at)))
code_b=$CODE
took=$((SECONDS - down_at))
show
echo "case 2: host A's dtrun exited $code_a, host B's $code_b, ${took} s after the link went down"
[ "$code_a" != timeout ] && [ "$code_b" != timeout ] ||
  fail "case 2: a host's ranks were still running ${BOUND_S} s after the link went down"
PIDS=()
[ "$code_a" != 0 ] && [ "$code_b" != 0 ] || fail "case 2: a host's dtrun exited 0 without its peers"
# Each host's failure names the other host. The store's host (A) asks its peers and finds
# rank 2 or 3 silent, directly or behind a rank of its own that waits for them. Host B cannot
# reach the store and names it (at host A's address), or ranks 0 or 1 as beyond it.
grep -qE "rank [23] did not answer" "$WORK/a.log" ||
  fail "case 2: host A's output names neither rank 2 nor rank 3 as silent"
grep -qE "store at $ADDR_A:$PORT did not answer|rank\(s\) ([0-9]+, )*[01](, [0-9]+)* of group [^:]* stopped answering" "$WORK/b.log" ||
  fail "case 2: host B's output names neither host A's store nor rank 0 or 1"
echo "case 2: passed"
echo "2 passed, 0 failed"

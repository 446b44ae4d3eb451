#!/usr/bin/env bash
# Shared canary registry benchmark: two canarygate instances on one Redis
# registry, driven as one pool, against one instance with the in-memory
# registry, in the same run.
#
#   bench/registry.sh            # full run (6 rounds; about 3 minutes on 2 cores)
#   bench/registry.sh --quick    # 1 round of short phases, to see that it all works
#
# Starts on 127.0.0.1: the simulated provider (`canarygate sim-provider`, no
# model latency), redis-server on a free port (no persistence), and three
# canarygate instances in front of the sim, each with its own data
# directory, all with the `default` preset (every check on, echo-first,
# durable audit: bench/run.sh's canarygate-echo-first):
#   memory            the preset as it is: the in-process registry;
#   redis-a, redis-b  the same preset plus [registry] backend = "redis" on that
#                     server, with one registry key (random, per run).
# Then runs the load generator (bench/, `canarygate-bench`) over the targets
#   memory       the in-memory instance, the baseline;
#   redis-pair   redis-a and redis-b as one pool: connections spread
#                round-robin over them; CPU of both instances and of
#                redis-server, whose work is the registry's;
#   redis-one    (with BENCH_TARGETS) redis-a alone, CPU of it and redis-server;
# non-streamed and streamed, every answer 64 tokens: saturation throughput
# and CPU per request, p50/p99 latency at a fixed open-loop rate below every
# target's saturation, the latency added over memory in the same round, and
# canarygate's own time per request (its /metrics, summed over a pool's
# instances). Each round in a different order; medians over the rounds.
# Prints markdown tables and writes bench/results/registry-latest.json.
#
# Afterwards it checks that the shared registry was used throughout: numbers
# from instances that had fallen back to local-only detection (on_unavailable
# = "degrade") would not be the registry's. Every Redis instance must have
# said `ok` at /healthz before the run, and after it report no failed registry
# round trip and no degraded request, with the canaries' keys in Redis.
#
# Installs redis-server when missing (apt-get, as root). Uses $CANARYGATE_BIN,
# or builds `cargo build --release --bin canarygate`.
#
# Environment knobs: bench/run.sh's for the load generator and the build
# (CANARYGATE_BIN, BENCH_QUICK, CANARYGATE_BENCH_SECONDS, _LATENCY_SECONDS,
# _CONCURRENCY, _RATE, _STREAM_RATE, _MODES, _MAX_TOKENS, _CLIENT_THREADS,
# BENCH_OUT, BENCH_NOTE), and (defaults in brackets):
#   BENCH_TARGETS                   memory and any of redis-pair,redis-one [memory,redis-pair]
#   CANARYGATE_BENCH_ROUNDS         rounds [6, so that each target goes first as often; quick 1]
#   CANARYGATE_BENCH_RATE_FRACTION  automatic latency rates: this fraction of the slowest
#                                   saturation, rounded down to 1 digit [0.25, as
#                                   bench/run.sh's higher rate: the load generator,
#                                   the sim, Redis and the instances share the machine]
#   BENCH_REDIS_SERVER              redis-server binary [redis-server]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh

bench_options registry.sh "$@"
export CANARYGATE_BENCH_ROUNDS=${CANARYGATE_BENCH_ROUNDS:-6}
export CANARYGATE_BENCH_RATE_FRACTION=${CANARYGATE_BENCH_RATE_FRACTION:-0.25}

all_targets=memory,redis-pair,redis-one
targets=${BENCH_TARGETS:-memory,redis-pair}
wants() { case ",$targets," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for t in ${targets//,/ }; do
  case ",$all_targets," in *",$t,"*) ;; *) echo "unknown target $t (known: $all_targets)" >&2; exit 2 ;; esac
done
wants memory || { echo "BENCH_TARGETS must hold memory, the baseline" >&2; exit 2; }

if [ -n "${BENCH_REDIS_SERVER:-}" ]; then
  redis_server=$BENCH_REDIS_SERVER
else
  install_missing redis-server redis-server
  redis_server=$(command -v redis-server || echo /usr/bin/redis-server)
fi
[ -x "$redis_server" ] || { echo "no redis-server at $redis_server" >&2; exit 1; }
redis_cli=$(command -v redis-cli || echo "$(dirname "$redis_server")/redis-cli")
[ -x "$redis_cli" ] || { echo "no redis-cli next to $redis_server (Debian: redis-tools)" >&2; exit 1; }

build_binaries

# --- start the servers -------------------------------------------------------
start_work
# shellcheck disable=SC2119 # (the sim takes no further arguments here)
start_sim

redis_port=$(free_port)
redis() { "$redis_cli" -h 127.0.0.1 -p "$redis_port" "$@"; }
mkdir -p "$work/redis"
"$redis_server" --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$work/redis" --logfile "$work/redis/redis.log" &
redis_pid=$!
pids+=("$redis_pid")
for _ in $(seq 1 100); do
  [ "$(redis PING 2>/dev/null)" = PONG ] && break
  kill -0 "$redis_pid" 2>/dev/null || { cat "$work/redis/redis.log" >&2; exit 1; }
  sleep 0.05
done
[ "$(redis PING 2>/dev/null)" = PONG ] || { echo "redis-server did not answer" >&2; exit 1; }
redis_version=$("$redis_server" --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')
log "redis-server $redis_version: 127.0.0.1:$redis_port (pid $redis_pid)"

# The default preset as it is, and the same with the shared registry: the
# only difference between the targets.
cp policies/presets/default.toml "$work/memory.toml"
{
  cat policies/presets/default.toml
  cat <<EOF

# The shared canary registry (one Redis for every instance of the deployment).
[registry]
backend = "redis"
url = "redis://127.0.0.1:$redis_port/0"
key_env = "CANARYGATE_REGISTRY_KEY"
key_prefix = "bench:"
timeout_ms = 250
on_unavailable = "degrade"
EOF
} >"$work/redis.toml"
# The deployment's registry key: 32 random bytes, the same for both instances.
CANARYGATE_REGISTRY_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export CANARYGATE_REGISTRY_KEY

start_canarygate_server memory "$work/memory.toml" --instance memory
memory_url=$started_url memory_pid=$started_pid
start_canarygate_server redis-a "$work/redis.toml" --instance redis-a
a_url=$started_url a_pid=$started_pid
start_canarygate_server redis-b "$work/redis.toml" --instance redis-b
b_url=$started_url b_pid=$started_pid
redis_urls=("$a_url" "$b_url")

# `/healthz` of an instance: "STATUS BACKEND", e.g. "ok redis".
health() {
  python3 - "$1/healthz" <<'EOF'
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as answer:
    health = json.load(answer)
print(health["status"], health["registry"]["backend"])
EOF
}
for url in "${redis_urls[@]}"; do
  state=
  for _ in $(seq 1 50); do
    state=$(health "$url" 2>/dev/null || true)
    [ "$state" = "ok redis" ] && break
    sleep 0.1
  done
  [ "$state" = "ok redis" ] || { echo "$url/healthz: '$state', not 'ok redis'" >&2; exit 1; }
done
log "redis-a and redis-b: registry up at /healthz"

bench_args=(--upstream-pid "$sim_pid" --reference memory)
bench_args+=(--target "memory=$memory_url/v1,pid=$memory_pid,metrics")
if wants redis-pair; then
  bench_args+=(--target "redis-pair=$a_url/v1|$b_url/v1,pid=$a_pid+$b_pid+$redis_pid,metrics")
fi
if wants redis-one; then
  bench_args+=(--target "redis-one=$a_url/v1,pid=$a_pid+$redis_pid,metrics")
fi

# What the instance at $1 says at /metrics about its registry: "UP FAILURES
# CHAT": canarygate_registry_up; failed round trips plus requests served
# degraded or refused; chat completions answered 2xx.
registry_metrics() {
  python3 - "$1/metrics" <<'EOF'
import re, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=5) as answer:
    text = answer.read().decode()
up = failures = chat = 0
for line in text.splitlines():
    sample = re.fullmatch(r'(\w+)(\{[^}]*\})? (\S+)', line)
    if not sample:
        continue
    name, labels, value = sample.group(1), sample.group(2) or "", float(sample.group(3))
    if name == "canarygate_registry_up":
        up = value
    elif name in ("canarygate_registry_failures_total",
                  "canarygate_registry_unavailable_requests_total"):
        failures += value
    elif (name == "canarygate_requests_total" and 'route="chat_completions"' in labels
          and re.search(r'status="2\d\d"', labels)):
        chat += value
print(int(up), int(failures), int(chat))
EOF
}

# redis-server's CPU time (user + system, all threads) since it started,
# per request of the $1 the Redis instances answered, in µs.
redis_cpu_us() {
  local requests=$1 fields ticks
  read -ra fields < <(sed 's/.*) //' "/proc/$redis_pid/stat")
  # After the command name: utime and stime are fields 12 and 13 (0-based 11, 12).
  ticks=$((fields[11] + fields[12]))
  echo $((ticks * 1000000 / $(getconf CLK_TCK) / (requests > 0 ? requests : 1)))
}

# Whether the shared registry was used throughout the run (see the top):
# each Redis instance up, without a failed round trip or a degraded
# request, and the two canaries of every request they answered in Redis.
registry_stayed_up() {
  local url up failures chat requests=0 keys ok=0
  for url in "${redis_urls[@]}"; do
    read -r up failures chat < <(registry_metrics "$url")
    echo "registry seen from $url: up $up, failed round trips and degraded requests $failures, chat requests answered $chat"
    if [ "$up" != 1 ] || [ "$failures" != 0 ]; then
      ok=1
    fi
    requests=$((requests + chat))
  done
  keys=$(redis DBSIZE)
  echo "redis: $keys keys (live canaries, 2 per request) for $requests requests; redis-server's CPU over the whole run: $(redis_cpu_us "$requests") µs per request"
  [ "$keys" -ge $((2 * requests)) ] && [ "$requests" -gt 0 ] || ok=1
  return "$ok"
}

note="$(machine_note), redis-server $redis_version; the registry instances: [registry] backend = \"redis\", on_unavailable = \"degrade\". ${BENCH_NOTE:-}"

status=0
run_load_generator registry- "$note" || status=$?
what=
if [ "$status" = 0 ]; then
  echo
  if ! registry_stayed_up | tee -a "$results.txt"; then
    echo "the shared registry failed during the run: these numbers are not the registry's" | tee -a "$results.txt" >&2
    status=1 what="the registry check"
  fi
fi
finish_run "$status" ${what:+"$what"}

#!/usr/bin/env bash
# Proxy overhead benchmark: canarygate against a direct hop, nginx as a plain
# reverse proxy, and the LiteLLM proxy, side by side on this machine.
#
#   bench/run.sh            # full run (3 rounds; about 10-15 minutes on 2 cores)
#   bench/run.sh --quick    # 1 round of short phases, to see that it all works
#
# Starts on 127.0.0.1: the simulated provider (`canarygate sim-provider`, no
# model latency), then, all pointed at it: nginx (Debian package; config
# generated below), canarygate with the `default` preset (echo-first), the
# same with `[audit] durability = "background"` (echo-first-bg), the `strict`
# preset (verdict-first), and with checks off (`[verify] enabled = false`),
# and LiteLLM (PyPI, in bench/.venv). Then runs the load generator
# (bench/, `canarygate-bench`) over all of them, non-streaming and streaming,
# every answer 64 tokens: saturation throughput, CPU per request of each
# proxy's process tree (from /proc), and p50/p99 latency at a fixed rate below
# every system's saturation (LiteLLM's sets it), then at a higher rate below
# every system's but LiteLLM's, with canarygate's own time per request over
# each of those phases (from its /metrics); each round in a different order;
# medians over the rounds. Prints markdown tables and writes bench/results/latest.json.
#
# Installs what is missing: nginx (apt-get, as root), LiteLLM (pip, in
# bench/.venv). Uses $CANARYGATE_BIN, or builds `cargo build --release --bin
# canarygate`.
#
# Environment knobs (defaults in brackets):
#   CANARYGATE_BIN                 canarygate binary [build target/release/canarygate]
#   BENCH_TARGETS                  comma-separated subset of
#                                  direct,nginx,canarygate-echo-first,canarygate-echo-first-bg,
#                                  canarygate-verdict-first,canarygate-off,litellm [all]
#   BENCH_QUICK=1                  same as --quick
#   CANARYGATE_BENCH_SECONDS       saturation phase length, s [3; quick 1]
#   CANARYGATE_BENCH_ROUNDS        rounds [3; quick 1]
#   CANARYGATE_BENCH_CONCURRENCY   connections at saturation, every target [32]
#   CANARYGATE_BENCH_RATE          non-streaming latency rate, req/s [auto: half the slowest saturation, rounded down to 1 digit]
#   CANARYGATE_BENCH_STREAM_RATE   streaming latency rate, req/s [auto, likewise]
#   CANARYGATE_BENCH_FAST_RATE     rate of the second latency phase, without LiteLLM
#                                  [auto: a quarter of the slowest saturation but LiteLLM's, likewise; -1: none]
#   CANARYGATE_BENCH_LATENCY_SECONDS  latency phase length, s [max(seconds, 200 requests), at most 10; quick 2]
#   CANARYGATE_BENCH_MODES         non-stream,stream [both]
#   CANARYGATE_BENCH_MAX_TOKENS    answer length in tokens [64]
#   CANARYGATE_BENCH_CLIENT_THREADS  load generator threads [1]
#   BENCH_NGINX_WORKERS            nginx worker_processes [number of CPUs]
#   BENCH_LITELLM_WORKERS          LiteLLM (uvicorn) worker processes [number of CPUs]
#   BENCH_LITELLM_CONCURRENCY      LiteLLM's own saturation concurrency [CANARYGATE_BENCH_CONCURRENCY]
#   BENCH_LITELLM_VERSION          LiteLLM version from PyPI [1.106.12]
#   BENCH_OUT                      results directory [bench/results]
#   BENCH_NOTE                     text about the machine, copied into the results
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [ "${1:-}" = "--quick" ]; then
  BENCH_QUICK=1
  shift
fi
if [ $# -gt 0 ]; then
  echo "usage: bench/run.sh [--quick]  (settings: see the environment knobs at the top of this script)" >&2
  exit 2
fi
if [ "${BENCH_QUICK:-0}" = 1 ]; then
  export CANARYGATE_BENCH_SECONDS=${CANARYGATE_BENCH_SECONDS:-1}
  export CANARYGATE_BENCH_ROUNDS=${CANARYGATE_BENCH_ROUNDS:-1}
  export CANARYGATE_BENCH_LATENCY_SECONDS=${CANARYGATE_BENCH_LATENCY_SECONDS:-2}
fi

all_targets=direct,nginx,canarygate-echo-first,canarygate-echo-first-bg,canarygate-verdict-first,canarygate-off,litellm
targets=${BENCH_TARGETS:-$all_targets}
wants() { case ",$targets," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for t in ${targets//,/ }; do
  case ",$all_targets," in *",$t,"*) ;; *) echo "unknown target $t (known: $all_targets)" >&2; exit 2 ;; esac
done

cpus=$(nproc)
nginx_workers=${BENCH_NGINX_WORKERS:-$cpus}
litellm_workers=${BENCH_LITELLM_WORKERS:-$cpus}
litellm_version=${BENCH_LITELLM_VERSION:-1.106.12}
out_dir=${BENCH_OUT:-bench/results}
started_at=$(date +%s)

log() { printf '[bench] %s\n' "$*" >&2; }

# --- install what is missing -------------------------------------------------
if wants nginx && ! command -v nginx >/dev/null 2>&1 && ! [ -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ]; then
    log "installing nginx (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
  else
    echo "nginx is not installed; run as root or: sudo apt-get install -y nginx (or leave nginx out of BENCH_TARGETS)" >&2
    exit 1
  fi
fi
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)

venv=bench/.venv
if wants litellm; then
  if ! "$venv/bin/python" -c "import litellm, sys; from importlib.metadata import version; sys.exit(version('litellm') != '$litellm_version')" 2>/dev/null; then
    log "installing litellm[proxy]==$litellm_version in $venv (pip; a few minutes the first time)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "litellm[proxy]==$litellm_version"
  fi
fi

log "building the load generator"
cargo build --release --quiet -p canarygate-bench
bench_bin=$root/target/release/canarygate-bench

if [ -n "${CANARYGATE_BIN:-}" ]; then
  canarygate=$CANARYGATE_BIN
else
  log "building canarygate (release)"
  cargo build --release --quiet --bin canarygate
  canarygate=$root/target/release/canarygate
fi
[ -x "$canarygate" ] || { echo "no canarygate binary at $canarygate" >&2; exit 1; }

# --- start the servers -------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/canarygate-bench.XXXXXX")
pids=()

kill_tree() {
  local pid=$1 child
  for child in $(pgrep -P "$pid" 2>/dev/null || true); do
    kill_tree "$child"
  done
  kill "$pid" 2>/dev/null || true
}
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill_tree "$pid"
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  if [ "${BENCH_KEEP_WORK:-0}" = 1 ]; then
    log "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits for "... listening on URL" as the first line of a log; prints URL.
listening_url() {
  local logfile=$1 pid=$2 i line
  for i in $(seq 1 200); do
    line=$(head -n 1 "$logfile" 2>/dev/null || true)
    case "$line" in
      *"listening on "*) echo "${line##* }"; return 0 ;;
    esac
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  echo "server did not start; its output (${logfile%.log}.log, .err):" >&2
  cat "$logfile" "${logfile%.log}.err" >&2
  exit 1
}

export CANARYGATE_LOG=${CANARYGATE_LOG:-warn}

"$canarygate" sim-provider --listen 127.0.0.1:0 >"$work/sim.log" 2>"$work/sim.err" &
sim_pid=$!
pids+=("$sim_pid")
sim_url=$(listening_url "$work/sim.log" "$sim_pid") || exit 1
sim_port=${sim_url##*:}
log "sim provider: $sim_url (pid $sim_pid)"

bench_args=(--upstream-pid "$sim_pid")
add_target() { bench_args+=(--target "$1"); }

wants direct && add_target "direct=$sim_url/v1"

if wants nginx; then
  nginx_port=$(free_port)
  mkdir -p "$work/nginx"
  cat >"$work/nginx/nginx.conf" <<EOF
# Plain reverse proxy: one upstream with pooled keep-alive connections, no
# buffering (streams pass through as they come), no access log.
worker_processes $nginx_workers;
daemon off;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events {
    worker_connections 4096;
}
http {
    access_log off;
    client_body_temp_path $work/nginx/client_body;
    proxy_temp_path $work/nginx/proxy;
    fastcgi_temp_path $work/nginx/fastcgi;
    uwsgi_temp_path $work/nginx/uwsgi;
    scgi_temp_path $work/nginx/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream sim {
        server 127.0.0.1:$sim_port;
        keepalive 128;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$nginx_port;
        client_max_body_size 8m;
        location / {
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }
    }
}
EOF
  "$nginx_bin" -t -q -c "$work/nginx/nginx.conf" -p "$work/nginx"
  "$nginx_bin" -c "$work/nginx/nginx.conf" -p "$work/nginx" >"$work/nginx/stdout.log" 2>&1 &
  nginx_pid=$!
  pids+=("$nginx_pid")
  log "nginx: http://127.0.0.1:$nginx_port (pid $nginx_pid, $nginx_workers workers)"
  add_target "nginx=http://127.0.0.1:$nginx_port/v1,pid=$nginx_pid"
fi

start_canarygate() {
  local name=$1 config=$2 pid url
  "$canarygate" serve --config "$config" --upstream "$sim_url/v1" --listen 127.0.0.1:0 \
    --data "$work/data-$name" >"$work/$name.log" 2>"$work/$name.err" &
  pid=$!
  pids+=("$pid")
  url=$(listening_url "$work/$name.log" "$pid") || exit 1
  log "$name: $url (pid $pid, --config $config)"
  add_target "$name=$url/v1,pid=$pid,metrics"
}

wants canarygate-echo-first && start_canarygate canarygate-echo-first preset:default
if wants canarygate-echo-first-bg; then
  # All checks on, with the audit record committed in the background instead
  # of before the answer ([audit] durability = "background").
  { cat policies/presets/default.toml; printf '\n[audit]\ndurability = "background"\n'; } \
    >"$work/echo-first-bg.toml"
  start_canarygate canarygate-echo-first-bg "$work/echo-first-bg.toml"
fi
wants canarygate-verdict-first && start_canarygate canarygate-verdict-first preset:strict
if wants canarygate-off; then
  cat >"$work/checks-off.toml" <<EOF
# The default preset with verification off: a plain proxy (no canaries, no
# checks), with the same auth, limits, routing and audit log.
[auth]
mode = "passthrough"

[limits]
max_body_bytes = 8388608
max_concurrent_requests = 1024

[[providers]]
name = "openai"
base_url = "https://api.openai.com/v1"
context_window = 128000

[[routes]]
model = "*"
provider = "openai"

[verify]
enabled = false
EOF
  start_canarygate canarygate-off "$work/checks-off.toml"
fi

if wants litellm; then
  litellm_port=$(free_port)
  litellm_key="sk-bench-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
  cat >"$work/litellm.yaml" <<EOF
# One model, the simulated provider as an OpenAI-compatible upstream. No
# database, no callbacks, no telemetry, no message logging.
model_list:
  - model_name: bench-model
    litellm_params:
      model: openai/bench-model
      api_base: $sim_url/v1
      api_key: sk-bench-upstream
litellm_settings:
  telemetry: false
  callbacks: []
  success_callback: []
  failure_callback: []
  turn_off_message_logging: true
  drop_params: true
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  disable_spend_logs: true
  disable_error_logs: true
EOF
  # Offline: the bundled model cost map, no admin UI, no .env loading.
  LITELLM_MASTER_KEY=$litellm_key LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR \
    LITELLM_MODE=PRODUCTION DISABLE_ADMIN_UI=True NO_DOCS=True \
    "$venv/bin/litellm" --config "$work/litellm.yaml" --host 127.0.0.1 --port "$litellm_port" \
    --num_workers "$litellm_workers" >"$work/litellm.log" 2>&1 &
  litellm_pid=$!
  pids+=("$litellm_pid")
  log "litellm $litellm_version: http://127.0.0.1:$litellm_port (pid $litellm_pid, $litellm_workers workers; starting takes a while)"
  spec="litellm=http://127.0.0.1:$litellm_port/v1,pid=$litellm_pid,slow"
  [ -n "${BENCH_LITELLM_CONCURRENCY:-}" ] && spec="$spec,concurrency=$BENCH_LITELLM_CONCURRENCY"
  add_target "$spec"
  # Every target gets the same bearer token: LiteLLM's master key (the sim,
  # nginx and canarygate in passthrough mode take any).
  export CANARYGATE_BENCH_API_KEY=$litellm_key
  # Each worker starts on its own (tens of seconds each); wait for all of them.
  for _ in $(seq 1 600); do
    [ "$(grep -c "Proxy initialized" "$work/litellm.log" || true)" -ge "$litellm_workers" ] && break
    if ! kill -0 "$litellm_pid" 2>/dev/null; then
      echo "LiteLLM exited; its log:" >&2
      cat "$work/litellm.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  log "litellm: $(grep -c "Proxy initialized" "$work/litellm.log" || true) worker(s) up"
fi

wants nginx && bench_args+=(--reference nginx)
wants litellm && bench_args+=(--reference litellm)

mkdir -p "$out_dir"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
note="Machine: $cpus CPU(s) ($cpu_model), $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -sr); canarygate $("$canarygate" --version 2>/dev/null | head -n 1 || echo '?') ($canarygate), nginx $("$nginx_bin" -v 2>&1 | sed 's/.*nginx\///'), $nginx_workers worker(s); LiteLLM $litellm_version, $litellm_workers worker(s). ${BENCH_NOTE:-}"

set +e
"$bench_bin" "${bench_args[@]}" --json "$out_dir/$stamp.json" --note "$note" | tee "$out_dir/$stamp.txt"
status=${PIPESTATUS[0]}
set -e
if [ "$status" = 0 ]; then
  cp "$out_dir/$stamp.json" "$out_dir/latest.json"
  cp "$out_dir/$stamp.txt" "$out_dir/latest.txt"
else
  log "the load generator failed (exit $status); server logs in $work"
  BENCH_KEEP_WORK=1
fi
log "done in $(( $(date +%s) - started_at )) s; results: $out_dir/$stamp.json"
exit "$status"

# shellcheck shell=bash
# Shared by the scripts in bench/ (run.sh, registry.sh, growth.sh, cpu-ab.sh; ttft.sh and
# topic.sh for build_canarygate): sourced, not run.
#
# The caller has `set -euo pipefail`, runs from the repository root and has
# set $root to it. In order, it calls:
#   bench_options SCRIPT "$@"   --quick, or a usage error
#   install_missing CMD PKG     apt-get install PKG (as root) unless CMD exists
#   build_binaries              sets $bench_bin and $canarygate
#   build_canarygate            sets $canarygate only
#   start_work                  sets $work (removed on exit) and $pids (killed on exit)
#   start_sim [SIM ARGS...]     sets $sim_pid, $sim_url, $sim_port
#   start_nginx NAME [CONNECTIONS]  sets $nginx_pid, $nginx_url
#   start_canarygate_server NAME CONFIG [SERVE ARGS...]
#                               sets $started_pid, $started_url
#   run_load_generator PREFIX NOTE
#                               runs canarygate-bench with "${bench_args[@]}"
#   finish_run STATUS [WHAT]    keeps the results as the latest ones, exits
# free_port, listening_url and machine_note are there for the caller's own
# servers and notes.
#
# Variables the callers set ($root, $bench_args) or read ($sim_port, ...):
# shellcheck disable=SC2154,SC2034

cpus=$(nproc)
out_dir=${BENCH_OUT:-bench/results}
started_at=$(date +%s)

log() { printf '[bench] %s\n' "$*" >&2; }

# `--quick` (or BENCH_QUICK=1): one round of short phases. Anything else on
# the command line is a usage error.
bench_options() {
  local script=$1
  shift
  if [ "${1:-}" = "--quick" ]; then
    BENCH_QUICK=1
    shift
  fi
  if [ $# -gt 0 ]; then
    echo "usage: bench/$script [--quick]  (settings: see the environment knobs at the top of this script)" >&2
    exit 2
  fi
  if [ "${BENCH_QUICK:-0}" = 1 ]; then
    export CANARYGATE_BENCH_SECONDS=${CANARYGATE_BENCH_SECONDS:-1}
    export CANARYGATE_BENCH_ROUNDS=${CANARYGATE_BENCH_ROUNDS:-1}
    export CANARYGATE_BENCH_LATENCY_SECONDS=${CANARYGATE_BENCH_LATENCY_SECONDS:-2}
  fi
}

# Installs the Debian package $2 when the command $1 is missing (as root;
# otherwise says how, with the hint $3, and exits).
install_missing() {
  local command=$1 package=$2 hint=${3:-}
  if command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ]; then
    return 0
  fi
  if [ "$(id -u)" = 0 ]; then
    log "installing $package (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null
  else
    echo "$command is not installed; run as root or: sudo apt-get install -y $package${hint:+ $hint}" >&2
    exit 1
  fi
}

# canarygate: $CANARYGATE_BIN, or the release build; sets $canarygate.
build_canarygate() {
  if [ -n "${CANARYGATE_BIN:-}" ]; then
    canarygate=$CANARYGATE_BIN
  else
    log "building canarygate (release)"
    cargo build --release --quiet --bin canarygate
    canarygate=$root/target/release/canarygate
  fi
  [ -x "$canarygate" ] || { echo "no canarygate binary at $canarygate" >&2; exit 1; }
}

# The load generator, built for release; sets $load to it (the measuring
# scripts: cpu-ab, hop-cpu, thread-cpu, sched-delay, allocs).
build_load_generator() {
  log "building the load generator"
  cargo build --release --quiet -p canarygate-bench
  load=$root/target/release/canarygate-bench
}

# The load generators (always built: it takes a minute; CANARYGATE_BENCH_PROFILE=dev
# builds them unoptimised, for a smoke run that only checks the harness works)
# and canarygate (build_canarygate). Sets $bench_dir to where they are.
build_binaries() {
  log "building the load generator"
  if [ "${CANARYGATE_BENCH_PROFILE:-release}" = dev ]; then
    cargo build --quiet -p canarygate-bench
    bench_dir=$root/target/debug
  else
    cargo build --release --quiet -p canarygate-bench
    bench_dir=$root/target/release
  fi
  bench_bin=$bench_dir/canarygate-bench
  build_canarygate
}

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

# A scratch directory for configs, data and logs, and the list of servers
# started ($pids): both go on exit (BENCH_KEEP_WORK=1 keeps the directory).
start_work() {
  work=$(mktemp -d "${TMPDIR:-/tmp}/canarygate-bench.XXXXXX")
  pids=()
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  export CANARYGATE_LOG=${CANARYGATE_LOG:-warn}
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits for "... listening on URL" as the first line of a log; prints URL.
listening_url() {
  local logfile=$1 pid=$2 line
  for _ in $(seq 1 200); do
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

# The simulated provider, no model latency, with any further sim-provider
# arguments; sets $sim_pid, $sim_url, $sim_port (the one canarygate servers
# started next point at). SIM_NAME names its logs [sim].
start_sim() {
  local name=${SIM_NAME:-sim}
  "$canarygate" sim-provider --listen 127.0.0.1:0 "$@" >"$work/$name.log" 2>"$work/$name.err" &
  sim_pid=$!
  pids+=("$sim_pid")
  sim_url=$(listening_url "$work/$name.log" "$sim_pid") || exit 1
  sim_port=${sim_url##*:}
  log "$name provider: $sim_url (pid $sim_pid${*:+, $*})"
}

# nginx ($nginx_bin) as a plain reverse proxy in front of the sim
# ($sim_port), its files in $work/NAME, with CONNECTIONS per worker [4096]
# and $nginx_workers workers [number of CPUs]; sets $nginx_pid, $nginx_url.
start_nginx() {
  local name=$1 connections=${2:-4096} dir port files
  dir=$work/$name
  files=$((connections * 2 + 1024))
  if [ "$files" -gt "$(ulimit -n)" ]; then files=$(ulimit -n); fi
  port=$(free_port)
  nginx_workers=${nginx_workers:-$cpus}
  mkdir -p "$dir"
  cat >"$dir/nginx.conf" <<EOF
# Plain reverse proxy: one upstream with pooled keep-alive connections, no
# buffering (streams pass through as they come), no access log.
worker_processes $nginx_workers;
worker_rlimit_nofile $files;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events {
    worker_connections $connections;
}
http {
    access_log off;
    client_body_temp_path $dir/client_body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream sim {
        server 127.0.0.1:$sim_port;
        keepalive 128;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$port;
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
  "$nginx_bin" -t -q -c "$dir/nginx.conf" -p "$dir"
  "$nginx_bin" -c "$dir/nginx.conf" -p "$dir" >"$dir/stdout.log" 2>&1 &
  nginx_pid=$!
  pids+=("$nginx_pid")
  nginx_url=http://127.0.0.1:$port
  log "$name: $nginx_url (pid $nginx_pid, $nginx_workers workers, $connections connections each)"
}

# `canarygate serve` with the policy CONFIG (a file or preset:NAME) in front
# of the sim, with its own data directory, and any further serve arguments.
start_canarygate_server() {
  local name=$1 config=$2
  shift 2
  "$canarygate" serve --config "$config" --upstream "$sim_url/v1" --listen 127.0.0.1:0 \
    --data "$work/data-$name" "$@" >"$work/$name.log" 2>"$work/$name.err" &
  started_pid=$!
  pids+=("$started_pid")
  started_url=$(listening_url "$work/$name.log" "$started_pid") || exit 1
  log "$name: $started_url (pid $started_pid, --config $config)"
}

# "Machine: ...; canarygate VERSION (PATH)", the start of a results note.
machine_note() {
  local cpu_model
  cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
  printf '%s' "Machine: $cpus CPU(s) ($cpu_model), $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -sr); canarygate $("$canarygate" --version 2>/dev/null | head -n 1 || echo '?') ($canarygate)"
}

# Runs the load generator with "${bench_args[@]}" and the note NOTE, its
# report shown and written to $out_dir/PREFIX<time>.json and .txt
# ($results). Returns its status.
run_load_generator() {
  local prefix=$1 note=$2 status
  mkdir -p "$out_dir"
  results_prefix=$prefix
  results=$out_dir/$prefix$(date -u +%Y%m%dT%H%M%SZ)
  set +e
  "$bench_bin" "${bench_args[@]}" --json "$results.json" --note "$note" | tee "$results.txt"
  status=${PIPESTATUS[0]}
  set -e
  return "$status"
}

# Exits with STATUS. On success the results are copied to
# $out_dir/PREFIXlatest.json and .txt; on failure WHAT (default: the load
# generator) is named and the servers' logs are kept.
finish_run() {
  local status=$1 what=${2:-the load generator}
  if [ "$status" = 0 ]; then
    cp "$results.json" "$out_dir/${results_prefix}latest.json"
    cp "$results.txt" "$out_dir/${results_prefix}latest.txt"
  else
    log "$what failed (exit $status); server logs in $work"
    BENCH_KEEP_WORK=1
  fi
  log "done in $(( $(date +%s) - started_at )) s; results: $results.json"
  exit "$status"
}

#!/usr/bin/env bash
# How canarygate's cost grows with the work, side by side with nginx (a plain
# reverse proxy) in the same run, drawn as SVG charts.
#
#   bench/growth.sh           # curves, streams, canaries and a 10-minute soak
#   bench/growth.sh --soak    # the soak only
#   bench/growth.sh --quick   # one short point per axis and a 15 s soak (a smoke test)
#
# Targets: nginx, canarygate with the `default` preset (echo-first, durable
# audit) and the same with `[audit] durability = "background"`
# (echo-first-bg). Both canarygate configs are the preset with three settings
# raised so every point can run (bench/README.md, "How cost grows with the
# work"): the provider's context window (2M tokens, for the 1 MB prompt), the
# prefill-speed bound of the TTFT check (the simulated provider prefills
# instantly) and the connection and request limits (to the open streams
# measured, plus 1,024).
#
# Parts (GROWTH_PARTS, comma-separated):
#   curves   throughput and CPU per request of each target's process tree,
#            saturated (canarygate-bench, medians of 3 alternating rounds):
#            against concurrency (1, 4, 16, 64, 256 clients; non-streamed and
#            streamed, 64-token answers), answer length (16, 256, 4096 tokens,
#            streamed, 16 clients) and prompt length (1 KB, 64 KB, 1 MB,
#            non-streamed, 16 clients); against a sim with no model latency.
#   streams  resident memory (RSS) of each target's process tree with 100,
#            1,000, 10,000 slow streams open (a sim decoding 1 token/s), on
#            fresh servers, each target with its own sim;
#   canaries RSS of canarygate before and after 5,000 requests (10,000 live
#            canaries) on fresh servers, and of the registry alone at 10k and
#            1M canaries (cargo bench -p canarygate-policies --bench canary_memory).
#   soak     steady load at half of saturation for GROWTH_SOAK_MINUTES on a
#            fresh canarygate, RSS sampled every GROWTH_SOAK_SAMPLE_SECONDS:
#            slope, start and end.
#
# Writes bench/results/growth-<time>.md (the tables) and .json (every
# number), bench/results/growth-latest.*, and the charts: bench/growth/*.svg
# (a --quick run draws them in bench/results/growth-quick/ instead).
#
# Environment knobs (defaults in brackets):
#   CANARYGATE_BIN                canarygate binary [build target/release/canarygate]
#   CANARYGATE_BENCH_PROFILE      dev: build the load generators unoptimised (CI's smoke) [release]
#   GROWTH_PARTS                  curves,streams,canaries,soak [all; --soak: soak]
#   GROWTH_TARGETS                nginx,canarygate-echo-first,canarygate-echo-first-bg [all]
#   GROWTH_CONCURRENCY            clients on the concurrency axis [1,4,16,64,256; quick 16]
#   GROWTH_ANSWER_TOKENS          answer lengths, streamed [16,256,4096; quick 256]
#   GROWTH_PROMPT_BYTES           prompt lengths, non-streamed [1024,65536,1048576; quick 65536]
#   GROWTH_LENGTH_CONCURRENCY     clients on the length axes [16]
#   GROWTH_STREAMS                open streams [100,1000,10000; quick 100]
#   GROWTH_CANARY_REQUESTS        requests of the through-the-proxy canary figure [5000; quick 500]
#   GROWTH_SOAK_MINUTES           soak length [10; quick 0.25]
#   GROWTH_SOAK_SAMPLE_SECONDS    seconds between RSS samples [5; quick 1]
#   GROWTH_SOAK_TARGETS           canarygate configs soaked, one after the other [canarygate-echo-first]
#   GROWTH_SOAK_CANARY_TTL        canary_ttl_secs of the soaked canarygate [60]
#   GROWTH_SVG_DIR                where the charts go [bench/growth; quick bench/results/growth-quick]
#   CANARYGATE_BENCH_SECONDS      saturation phase length, s [2; quick 1]
#   CANARYGATE_BENCH_ROUNDS       rounds [3; quick 1]
#   BENCH_NGINX_WORKERS           nginx worker_processes [number of CPUs]
#   BENCH_OUT                     results directory [bench/results]
#   BENCH_NOTE                    text about the machine, copied into the results
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh

soak_only=0
args=()
for arg in "$@"; do
  case "$arg" in
    --soak) soak_only=1 ;;
    *) args+=("$arg") ;;
  esac
done
bench_options growth.sh "${args[@]}"
quick=${BENCH_QUICK:-0}
export CANARYGATE_BENCH_SECONDS=${CANARYGATE_BENCH_SECONDS:-2}
export CANARYGATE_BENCH_ROUNDS=${CANARYGATE_BENCH_ROUNDS:-3}
pick() { if [ "$quick" = 1 ]; then echo "$2"; else echo "$1"; fi; }

if [ "$soak_only" = 1 ]; then
  parts=${GROWTH_PARTS:-soak}
else
  parts=${GROWTH_PARTS:-curves,streams,canaries,soak}
fi
all_targets=nginx,canarygate-echo-first,canarygate-echo-first-bg
targets=${GROWTH_TARGETS:-$all_targets}
concurrencies=${GROWTH_CONCURRENCY:-$(pick 1,4,16,64,256 16)}
answer_tokens=${GROWTH_ANSWER_TOKENS:-$(pick 16,256,4096 256)}
prompt_bytes=${GROWTH_PROMPT_BYTES:-$(pick 1024,65536,1048576 65536)}
length_concurrency=${GROWTH_LENGTH_CONCURRENCY:-16}
stream_counts=${GROWTH_STREAMS:-$(pick 100,1000,10000 100)}
canary_requests=${GROWTH_CANARY_REQUESTS:-$(pick 5000 500)}
soak_minutes=${GROWTH_SOAK_MINUTES:-$(pick 10 0.25)}
soak_sample_seconds=${GROWTH_SOAK_SAMPLE_SECONDS:-$(pick 5 1)}
soak_targets=${GROWTH_SOAK_TARGETS:-canarygate-echo-first}
soak_ttl=${GROWTH_SOAK_CANARY_TTL:-60}
svg_dir=${GROWTH_SVG_DIR:-$(pick bench/growth "$out_dir/growth-quick")}
nginx_workers=${BENCH_NGINX_WORKERS:-$cpus}

has() { case ",$1," in *",$2,"*) return 0 ;; *) return 1 ;; esac; }
for t in ${targets//,/ } ${soak_targets//,/ }; do
  has "$all_targets" "$t" || { echo "unknown target $t (known: $all_targets)" >&2; exit 2; }
done
for p in ${parts//,/ }; do
  has curves,streams,canaries,soak "$p" || { echo "unknown part $p (known: curves,streams,canaries,soak)" >&2; exit 2; }
done

# --- open files: 10,000 streams are 10,000 sockets in the load generator and
# the sim, 20,000 in a proxy ---------------------------------------------------
max_streams=0
for n in ${stream_counts//,/ }; do
  if [ "$n" -gt "$max_streams" ]; then max_streams=$n; fi
done
# canarygate holds two files per stream (the client's connection and the
# provider's) and checks at start that its limits fit the open-file limit
# (limits + 64): raise that limit, or, where it cannot be raised (a
# container without CAP_SYS_RESOURCE), measure as many streams as fit.
files_for() { echo $((2 * ($1 + 256) + 64 + 256)); }
want_files=$(files_for "$max_streams")
if [ "$(ulimit -n)" -lt "$want_files" ]; then
  ulimit -n "$want_files" 2>/dev/null || ulimit -n "$(ulimit -Hn)"
fi
if [ "$(ulimit -n)" -lt "$want_files" ]; then
  fit=$(( ( ($(ulimit -n) - 64 - 256) / 2 - 256) / 500 * 500 ))
  log "the open-file limit is $(ulimit -n) and cannot be raised here; the $want_files that $max_streams streams need do not fit: measuring at most $fit (as root outside a container: ulimit -Hn $want_files)"
  capped=()
  for n in ${stream_counts//,/ }; do capped+=($((n > fit ? fit : n))); done
  stream_counts=$(IFS=,; echo "${capped[*]}")
  max_streams=$fit
fi
# canarygate's limits: every stream a request slot and a client connection.
limit_requests=$((max_streams + 256 > 1024 ? max_streams + 256 : 1024))
limit_connections=$((max_streams + 256 > 4096 ? max_streams + 256 : 4096))

if has "$targets" nginx; then
  install_missing nginx nginx "(or leave nginx out of GROWTH_TARGETS)"
fi
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
python3 bench/growth_report.py --self-test >/dev/null
build_binaries
memory_bin=$bench_dir/canarygate-bench-memory

start_work
results_dir=$work/results
mkdir -p "$results_dir"

# The default preset with the settings raised (see the top), the background
# audit with DURABILITY "background", and the canary TTL [the preset's].
write_config() {
  local file=$1 durability=$2 ttl=${3:-}
  sed -e '0,/^context_window = 128000$/s//context_window = 2000000/' \
    -e 's/^openai = 200000$/openai = 1000000000/' \
    -e "s/^max_concurrent_requests = 1024 /max_concurrent_requests = $limit_requests /" \
    -e "s/^# max_connections = 4096 .*/max_connections = $limit_connections/" \
    ${ttl:+-e "s/^canary_ttl_secs = [0-9]*$/canary_ttl_secs = $ttl/"} \
    policies/presets/default.toml >"$file"
  if ! { grep -q '^context_window = 2000000$' "$file" && grep -q '^openai = 1000000000$' "$file" \
    && grep -q "^max_concurrent_requests = $limit_requests " "$file" \
    && grep -q "^max_connections = $limit_connections$" "$file" \
    && grep -q "^canary_ttl_secs = ${ttl:-3600}$" "$file"; }; then
    echo "policies/presets/default.toml changed: update write_config in bench/growth.sh" >&2
    exit 1
  fi
  if [ "$durability" = background ]; then
    printf '\n[audit]\ndurability = "background"\n' >>"$file"
  fi
}
write_config "$work/echo-first.toml" durable
write_config "$work/echo-first-bg.toml" background

# Starts the targets of this phase against the current sim, names suffixed
# with $1, nginx with $2 connections per worker; sets $target_args
# (canarygate-bench --target specs) and $phase_pids.
start_targets() {
  local suffix=$1 nginx_connections=$2
  shift 2
  target_args=()
  phase_pids=()
  if has "$targets" nginx; then
    start_nginx "nginx$suffix" "$nginx_connections"
    target_args+=(--target "nginx=$nginx_url/v1,pid=$nginx_pid")
    phase_pids+=("$nginx_pid")
  fi
  if has "$targets" canarygate-echo-first; then
    start_canarygate_server "echo-first$suffix" "$work/echo-first.toml"
    target_args+=(--target "canarygate-echo-first=$started_url/v1,pid=$started_pid,metrics")
    phase_pids+=("$started_pid")
  fi
  if has "$targets" canarygate-echo-first-bg; then
    start_canarygate_server "echo-first-bg$suffix" "$work/echo-first-bg.toml"
    target_args+=(--target "canarygate-echo-first-bg=$started_url/v1,pid=$started_pid,metrics")
    phase_pids+=("$started_pid")
  fi
}

commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
note="$(machine_note) at commit $commit; nginx $("$nginx_bin" -v 2>&1 | sed 's/.*nginx\///'), $nginx_workers worker(s). ${BENCH_NOTE:-}"

# One saturation point: canarygate-bench with the settings in "$@"
# (VAR=value), its report in $results_dir/NAME.json.
curve_point() {
  local name=$1
  shift
  log "curve point $name ($*)"
  env "$@" CANARYGATE_BENCH_NO_LATENCY=true "$bench_bin" "${target_args[@]}" \
    --reference nginx --json "$results_dir/$name.json" --note "$note" \
    >"$results_dir/$name.txt" || { cat "$results_dir/$name.txt" >&2; log "curve point $name failed"; exit 1; }
  # The first table's rows: throughput and CPU (no latency phases ran).
  sed -n '/^| mode | target | req\/s |/,/^$/p' "$results_dir/$name.txt" | cut -d'|' -f2-6 | sed 's/$/|/' >&2
}

if has "$parts" curves; then
  # Instant sim; prompt caching off (the same prompt again and again would
  # only grow the sim's cache); room for the 1 MB prompt.
  SIM_NAME=sim-fast start_sim --context-window 2000000 --cache-capacity-tokens 0
  start_targets "" 4096
  for c in ${concurrencies//,/ }; do
    curve_point "concurrency-$c" CANARYGATE_BENCH_CONCURRENCY="$c"
  done
  # Long words: 12 of them (the fewest the sim restates) hold 4,116 tokens,
  # so every answer reaches max_tokens; 4 of them make a 1,372-token prompt.
  for n in ${answer_tokens//,/ }; do
    curve_point "answer-$n" CANARYGATE_BENCH_CONCURRENCY="$length_concurrency" \
      CANARYGATE_BENCH_MODES=stream CANARYGATE_BENCH_MAX_TOKENS="$n" \
      CANARYGATE_BENCH_WORD_TOKENS=343 CANARYGATE_BENCH_PROMPT_WORDS=4
  done
  for b in ${prompt_bytes//,/ }; do
    curve_point "prompt-$b" CANARYGATE_BENCH_CONCURRENCY="$length_concurrency" \
      CANARYGATE_BENCH_MODES=non-stream CANARYGATE_BENCH_PROMPT_BYTES="$b"
  done
fi

if has "$parts" streams; then
  # Open streams, on fresh servers in front of a sim decoding 1 token/s (a
  # 64-token answer stays open for over a minute), one target at a time,
  # each with its own sim; both stopped before the next.
  saved_targets=$targets
  for t in ${saved_targets//,/ }; do
    targets=$t
    SIM_NAME=sim-slow-$t start_sim --decode-tps 1
    # A proxied stream is two connections of one nginx worker, and one
    # worker may accept most of them.
    start_targets "-streams" $((2 * max_streams + 512))
    log "open streams: $stream_counts on $t"
    "$memory_bin" streams "${target_args[@]}" --counts "$stream_counts" \
      --json "$results_dir/streams-$t.json" --note "$note" >&2
    for pid in "${phase_pids[@]}" "$sim_pid"; do kill_tree "$pid"; done
  done
  targets=$saved_targets
fi

if has "$parts" canaries; then
  # Live canaries through the proxy, on fresh canarygate servers (no nginx:
  # it has no canaries).
  SIM_NAME=sim-canaries start_sim --cache-capacity-tokens 0
  saved_targets=$targets
  targets=${targets//nginx/}
  start_targets "-canaries" 4096
  targets=$saved_targets
  log "live canaries through the proxy: $canary_requests requests per target"
  "$memory_bin" canaries "${target_args[@]}" --requests "$canary_requests" \
    --warmup "$((canary_requests / 5))" --json "$results_dir/canaries-proxy.json" --note "$note" >&2
  log "live canaries in the registry alone (cargo bench --bench canary_memory)"
  cargo bench --quiet -p canarygate-policies --bench canary_memory >"$results_dir/canaries-registry.txt"
  cat "$results_dir/canaries-registry.txt" >&2
  sed -n 's/^canary_memory //p' "$results_dir/canaries-registry.txt" >"$results_dir/canaries-registry.json"
fi

if has "$parts" soak; then
  SIM_NAME=sim-soak start_sim --cache-capacity-tokens 0
  for t in ${soak_targets//,/ }; do
    config=$work/soak-${t#canarygate-}.toml
    write_config "$config" "$(case $t in *-bg) echo background ;; *) echo durable ;; esac)" \
      "$soak_ttl"
    start_canarygate_server "soak-$t" "$config"
    log "soak: $t for $soak_minutes min (canary TTL $soak_ttl s)"
    "$memory_bin" soak --target "$t=$started_url/v1,pid=$started_pid,metrics" \
      --minutes "$soak_minutes" --sample-seconds "$soak_sample_seconds" \
      --json "$results_dir/soak-$t.json" --note "$note" >&2
  done
fi

mkdir -p "$out_dir"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
results=$out_dir/growth-$stamp
results_prefix=growth-
python3 bench/growth_report.py --results "$results_dir" --svg-dir "$svg_dir" \
  --markdown "$results.md" --json "$results.json" --note "$note"
cp "$results.md" "$results.txt"
cat "$results.md"
finish_run 0

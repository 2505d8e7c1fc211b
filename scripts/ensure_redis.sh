#!/usr/bin/env bash
# Make sure the Redis that REDIS_URL names is reachable. When it points at this
# host and nothing listens there, start a local redis-server (installing
# Debian's package first if it is missing). A remote REDIS_URL is left alone.
set -euo pipefail
url=${REDIS_URL:-redis://127.0.0.1:6379/0}
case "$url" in
  redis://*|rediss://*|unix://*) ;;
  *) echo "REDIS_URL is a cluster or sentinel URL: not starting a local server"; exit 0 ;;
esac
hostport=${url#*://}; hostport=${hostport#*@}; hostport=${hostport%%/*}
host=${hostport%%:*}; port=${hostport##*:}; [ "$port" = "$host" ] && port=6379

case "$host" in
  127.0.0.1|localhost|::1) ;;
  *) echo "REDIS_URL points at $host: not starting a local server"; exit 0 ;;
esac

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; }
if listening; then exit 0; fi

if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is not installed: install it, or set REDIS_URL to a running Redis" >&2
    exit 1
  fi
fi
data_dir=${LLM_CLUSTER_DATA_DIR:-$HOME/.cache/llm-cluster}/redis
mkdir -p "$data_dir"
redis-server --bind 127.0.0.1 --port "$port" --daemonize yes --dir "$data_dir" \
  --logfile "$data_dir/redis.log" --pidfile "$data_dir/redis-$port.pid" --save "" --appendonly no

# Redis is on every request's path (admission, settlement) and uses little CPU.
# Beside a CPU engine that takes every core, its wake-ups wait behind the engine's
# compute (README, Performance: admissions of 100 ms while a stream was generating,
# Redis itself idle); in the real-time class at its lowest priority it runs as soon
# as a request reaches it. Set on the running server (daemonizing is a fork) with
# reset-on-fork, so a forked child (BGSAVE, an AOF rewrite) runs in the normal class.
# Without the right to (not root, no CAP_SYS_NICE), or with REDIS_REALTIME=0, it
# stays in the normal class.
realtime() {
  [ "${REDIS_REALTIME:-1}" != 0 ] && command -v chrt >/dev/null || return 0
  chrt --fifo --reset-on-fork -p 1 "$(cat "$data_dir/redis-$port.pid")" 2>/dev/null \
    || echo "redis-server stays in the normal scheduling class (chrt was refused)"
}

for _ in $(seq 1 50); do
  if listening; then realtime; echo "redis-server started on 127.0.0.1:$port"; exit 0; fi
  sleep 0.1
done
echo "redis-server did not start; see $data_dir/redis.log" >&2
exit 1

"""What one Redis core can admit: the admit script driven by redis-benchmark, no gateway.

The ceiling the gateway's own admission throughput (bench/admission_throughput.py) is
measured against. redis-benchmark (C, many connections, optionally pipelined) calls
serve_app/admission/lua/admit.lua, as it is, on one redis-server started here on loopback,
for API keys drawn at random among ``--keys``, each with a stored record of generous limits
(every limit set and none reached: the full write path, GCRA states, lease, usage counters,
the request's record). redis-benchmark can only put random numbers into a command's
arguments, so each call names its key and request by number and a short prologue turns
them into the script's KEYS and ARGV, exactly as the gateway's ``Admission.admit`` builds
them (serve_app/redis_store/redis_names.py); the prologue's cost is in the figures.

    .venv/bin/python bench/admit_ceiling.py [--requests 200000] [--keys 1000 100000] [--pipeline 1 16]

Prints, per key count and pipeline depth: admissions/s, redis-benchmark's latency
p50/p99, Redis' CPU per admission (INFO cpu: the script, the protocol, the connections),
the script's own time per call (INFO commandstats; the prologue is about 9 us of it), and
how many calls were admitted (a refused or duplicate call would measure a shorter path).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import redis  # noqa: E402
from redis_server import running_redis  # noqa: E402

from serve_app.identity.keys import KeyRecord  # noqa: E402
from serve_app.redis_store import lua_scripts, redis_names  # noqa: E402

KEY_ID, REQUEST_ID = "kb@ID@", "rq@REQ@"  # filled in by the prologue with the call's numbers
GENEROUS = dict(
    requests_per_minute=10**9,
    tokens_per_minute=10**12,
    max_concurrent=10**6,
    daily_token_budget=10**15,
    monthly_token_budget=10**15,
)
RESERVE_TOKENS = 100


def lua_list(values: list[str]) -> str:
    return "{" + ", ".join(repr(str(value)) for value in values) + "}"


def script() -> str:
    """admit.lua, with KEYS and ARGV rebuilt from ARGV[1] (the key's number) and ARGV[2]
    (the request's) by the templates the gateway's call would send."""
    keys = redis_names.admission_keys(KEY_ID, REQUEST_ID)
    args = [
        REQUEST_ID,
        "chat",
        *(GENEROUS[name] for name in GENEROUS),
        RESERVE_TOKENS,
        30_000,
        3600,
        KEY_ID,
        "",
        0,
        0,
        0,
        "1",
        "",
    ]
    prologue = f"""
local key_number, request_number = ARGV[1], ARGV[2]
local function fill(text)
  return (string.gsub(string.gsub(text, '@ID@', key_number), '@REQ@', request_number))
end
local KEYS, ARGV = {lua_list(keys)}, {lua_list([str(a) for a in args])}
for i = 1, #KEYS do KEYS[i] = fill(KEYS[i]) end
for i = 1, #ARGV do ARGV[i] = fill(ARGV[i]) end
"""
    return prologue + lua_scripts.source("serve_app.admission", "admit")


def key_id(number: int) -> str:
    return KEY_ID.replace("@ID@", f"{number:012d}")  # redis-benchmark's __rand_int__: 12 digits


def measure(port: int, sha: str, keys: int, requests: int, pipeline: int, clients: int) -> dict[str, float]:
    client = redis.Redis(port=port)
    client.flushdb()
    with client.pipeline(transaction=False) as pipe:
        for number in range(keys):
            record = KeyRecord(id=key_id(number), name=f"bench-{number}", created_at=0, **GENEROUS)
            pipe.set(redis_names.key_record(record.id), record.model_dump_json())
        pipe.execute()
    client.config_resetstat()
    cpu = client.info("cpu")
    before = cpu["used_cpu_sys"] + cpu["used_cpu_user"]
    # Three random numbers make a request's: no two calls of a run share one.
    command = ["EVALSHA", sha, "0", "__rand_int__", "__rand_int____rand_int____rand_int__"]
    output = subprocess.run(
        [
            shutil.which("redis-benchmark"),
            "-p",
            str(port),
            "-n",
            str(requests),
            "-c",
            str(clients),
            "-P",
            str(pipeline),
            "-r",
            str(keys),
            "--csv",
            *command,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu = client.info("cpu")
    after = cpu["used_cpu_sys"] + cpu["used_cpu_user"]
    script_us = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    # Admitted calls each left a request record (refusals and duplicates leave none).
    admitted = sum(1 for _ in client.scan_iter(match=redis_names.request_record_prefix("kb*") + "*", count=10_000))
    [row] = list(csv.DictReader(io.StringIO(output)))
    client.close()
    return {
        "rps": float(row["rps"]),
        "p50_ms": float(row["p50_latency_ms"]),
        "p99_ms": float(row["p99_latency_ms"]),
        "cpu_us": (after - before) / requests * 1e6,
        "script_us": script_us,
        "admitted": admitted / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--keys", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--pipeline", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--clients", type=int, default=50)
    args = parser.parse_args()
    with running_redis() as server:
        client = redis.Redis(port=server.port)
        sha = client.script_load(script())
        probe = client.evalsha(sha, 0, "000000000007", "000000000001")
        assert probe[0] == 1, f"the probe call was not admitted: {probe}"  # admitted, the full path
        client.close()
        print(f"\nadmit.lua on one redis-server, {args.requests} calls per row, {args.clients} connections\n")
        print(
            f"{'keys':>8} {'pipeline':>8} {'admits/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'Redis CPU us':>12} "
            f"{'script us':>9} {'admitted':>9}"
        )
        for keys in args.keys:
            for pipeline in args.pipeline:
                row = measure(server.port, sha, keys, args.requests, pipeline, args.clients)
                print(
                    f"{keys:>8} {pipeline:>8} {row['rps']:>10,.0f} {row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} "
                    f"{row['cpu_us']:>12.1f} {row['script_us']:>9.1f} {row['admitted']:>9.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

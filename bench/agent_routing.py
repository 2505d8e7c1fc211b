"""Routing on an agent workload: many multi-turn conversations of a few applications,
each application with its own long system prompt, one run per routing policy.

The small demo chat model on two replicas behind this stack (as ``make run`` starts
it, Makefile env; bench/prefix_routing.py's stack), once per ``routing.policy``
(serve_app/routing/serve_routers.py): ``power_of_two`` (Serve's default), ``prefix_affinity``
(the first ``prefix_chars`` of the prompt decide) and ``cache_affinity`` (the replica
holding the longest run of the whole prompt, as its engine's KV-cache events say, plus
what the router itself sent there in the last 30 s), and
``sessions``: ``prefix_affinity`` with each conversation sending its own ``x-session-id``
(every turn placed by its session, within the load guard). Each policy
gets a freshly started stack (empty prefix caches). ``--conversations`` conversations,
spread over ``--apps`` applications, each run ``--turns`` turns in order (the model's
answer appended to the history, as an agent loop does), ``--concurrency`` conversations
at a time, ``--think-ms`` between a conversation's turns (its tool call: without it, HAProxy's
least connections sends a turn back to the replica the previous one just left, the one
with a connection free); every request streamed. Each replica's KV cache is capped (``--kv-blocks``
blocks of 128 tokens) below what all conversations need, as on a busy cluster.

``--isolation shared team key``: one run per prompt-cache isolation level instead of per
policy (the model's ``cache_isolation``, serve_app/identity/cache_isolation.py; routed by the
first of ``--policies``), the conversations sent by ``--teams`` teams of ``--keys-per-team``
keys, each key using every application: under ``shared`` an application's system prompt is
cached once for all, under ``team`` once per team, under ``key`` once per key: what
isolation costs in hit rate and first-token time.

``--one-hop``: the model behind its direct route as shipped (``/v1`` in one hop, the
replica chosen at the edge by the same router class: serve_app/http/edge_router.py;
``power_of_two`` there is HAProxy's least connections, ``sessions`` the edge router's
session placement).

Prints per policy (the median over ``--repeats``, the policies taking turns in each
repeat): TTFT p50/p90 (ms), output tokens/s over the run, the engines'
prefix-cache hit rate (prompt tokens found in the cache over those looked up, this
run's requests only) and the load split (each replica's share of the prompt tokens it
was sent, max over mean).

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/agent_routing.py [--conversations 64] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prefix_routing import engine_loads, stack_config  # noqa: E402
from serve_env import MAKEFILE_ENV  # noqa: E402
from serving_overhead import BENCH_KEY_LIMITS, REDIS_URL, bench_api_key, serve_stack  # noqa: E402

from contract.edge import DEFAULT_SESSION_HEADER  # noqa: E402
from contract.model_config import ModelConfig, direct_app_name  # noqa: E402
from serve_app.app import with_direct_apps  # noqa: E402

POLICIES = ["power_of_two", "prefix_affinity", "cache_affinity", "sessions"]
ISOLATION_LEVELS = ["shared", "team", "key"]
METRICS = ["TTFT p50 ms", "TTFT p90 ms", "output tok/s", "prefix-cache hit rate", "max/mean replica load"]
WORDS = (
    "license grant patent copyright notice source object form work derivative contribution contributor "
    "warranty liability trademark redistribution submission agreement"
).split()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def conversation(
    client: openai.AsyncOpenAI,
    model: str,
    system: str,
    rng: random.Random,
    args,
    samples: list[tuple[float, int]],
    session: str | None = None,
) -> None:
    """One agent loop: ``args.turns`` user turns, each answer appended to the history;
    every turn names ``session`` when given."""
    headers = {DEFAULT_SESSION_HEADER: session} if session else None
    messages = [{"role": "system", "content": system}]
    for _ in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.user_words)})
        started = time.perf_counter()
        first, text, tokens = None, [], 0
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.output_len,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": args.output_len},
            extra_headers=headers,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        samples.append(((first or time.perf_counter()) - started, tokens))
        messages.append({"role": "assistant", "content": "".join(text)})
        if args.think_ms:  # the agent's tool call between turns (keeping its place among the conversations)
            await asyncio.sleep(args.think_ms / 1000)


async def run_load(
    url: str, model: str, args, secrets: list[str], sessions: bool = False
) -> tuple[list[tuple[float, int]], float]:
    """Every conversation, conversation ``n`` sent with ``secrets[n % len(secrets)]`` (of
    application ``n % apps``: each key uses every application)."""
    rng = random.Random(0)  # the same conversations for every policy
    systems = [f"You are application {app}. " + words(rng, args.system_words) for app in range(args.apps)]
    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=secret, max_retries=0, timeout=600) for secret in secrets
    ]
    plans = [
        (
            clients[(n // args.apps) % len(clients)],
            systems[n % args.apps],
            random.Random(1000 + n),
            f"conversation-{n}" if sessions else None,
        )
        for n in range(args.conversations)
    ]
    samples: list[tuple[float, int]] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client, system, conversation_rng, session):
        async with gate:
            await conversation(client, model, system, conversation_rng, args, samples, session)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(*plan) for plan in plans))
    finally:  # closed on this loop (left to the collector, their sockets outlive the loop)
        for client in clients:
            await client.close()
    return samples, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apps", type=int, default=4)
    parser.add_argument(
        "--system-words", type=int, default=600, help="each application's system prompt (~1,000 tokens)"
    )
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="conversations at a time")
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="pause between a conversation's turns (an agent's tool call)"
    )
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV-cache blocks (128 tokens) per replica")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    parser.add_argument("--source", default="demo:small", help="demo:small (default) or demo (the tiny model)")
    parser.add_argument("--one-hop", action="store_true", help="behind the direct route, as shipped")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every policy, each on a fresh stack")
    parser.add_argument(
        "--isolation", nargs="+", choices=ISOLATION_LEVELS, help="one run per cache isolation level (see above)"
    )
    parser.add_argument("--teams", type=int, default=4, help="with --isolation: teams sending the conversations")
    parser.add_argument("--keys-per-team", type=int, default=2, help="with --isolation: keys of each team")
    args = parser.parse_args()

    # (column, routing policy, cache isolation level)
    variants = (
        [(level, args.policies[0], level) for level in args.isolation]
        if args.isolation
        else [(policy, policy, "shared") for policy in args.policies]
    )
    secrets = tenant_keys(args.teams, args.keys_per_team) if args.isolation else [bench_api_key()]
    os.environ["OPENAI_API_KEY"] = secrets[0]  # the stack's readiness probe asks with it (serving_overhead.py)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        for repeat in range(args.repeats):  # the variants in turn within each repeat: drift hits all alike
            for name, policy, isolation in variants:
                log = Path(tmp) / f"{name}-{repeat}.log"
                runs[name].append(run_policy(policy, args, log, secrets, isolation))
                print(
                    f"{name} (repeat {repeat + 1}): " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name][-1].items()),
                    file=sys.stderr,
                    flush=True,
                )

    print(
        f"\n{args.source} model, 2 replicas{' behind its direct route (/v1 in one hop)' if args.one_hop else ''} "
        f"({args.kv_blocks} KV blocks of 128 tokens each); {args.apps} applications with a {args.system_words}-word "
        f"system prompt, {args.conversations} conversations x {args.turns} turns of {args.user_words} words, "
        f"{args.output_len} output tokens, {args.concurrency} conversations at a time, {args.think_ms:g} ms "
        f"between turns; "
        + (
            f"routed by {args.policies[0]}, sent by {args.teams} teams of {args.keys_per_team} keys, one column per "
            "cache_isolation; "
            if args.isolation
            else ""
        )
        + f"median of {args.repeats} repeat(s) (each repeat's value after it)\n"
    )
    print("| metric | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for metric in METRICS:
        cells = []
        for values in ([run[metric] for run in policy_runs] for policy_runs in runs.values()):
            shown = [
                f"{v:.1%}" if metric == "prefix-cache hit rate" else f"{v:,.2f}"
                for v in [statistics.median(values)] + values
            ]
            cells.append(shown[0] + (f" ({' / '.join(shown[1:])})" if len(values) > 1 else ""))
        print(f"| {metric} | " + " | ".join(cells) + " |")


def tenant_keys(teams: int, keys_per_team: int) -> list[str]:
    """The secrets of ``keys_per_team`` keys in each of ``teams`` new teams, in the stack's
    Redis, with the bench key's limits; listed key by key across teams (so neighbouring
    conversations are other teams')."""
    import redis.asyncio

    from serve_app.admin import operations as admin
    from serve_app.admin.operations import AdminStores

    async def create() -> list[str]:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            stores, run = AdminStores.over(client), time.time_ns()
            team_ids = [
                (await admin.create_team(stores, {"name": f"bench-{run}-{t}"}, "bench"))["id"] for t in range(teams)
            ]
            secrets = []
            for k in range(keys_per_team):
                for t, team_id in enumerate(team_ids):
                    body = {"name": f"bench-{run}-{t}-{k}", "team": team_id, **BENCH_KEY_LIMITS}
                    secrets.append((await admin.create_key(stores, body, "bench"))["secret"])
            return secrets
        finally:
            await client.aclose()

    return asyncio.run(create())


def run_policy(policy: str, args, log: Path, secrets: list[str], isolation: str = "shared") -> dict[str, float]:
    """One policy's run on a freshly started stack (empty prefix caches), the model's
    prompt cache isolated by ``isolation``."""
    serve_config = stack_config(
        "prefix_affinity" if policy == "sessions" else policy, args.kv_blocks, args.source, direct=args.one_hop
    )
    serve_config["applications"][0]["args"]["models"][0]["cache_isolation"] = isolation
    config = ModelConfig(**serve_config["applications"][0]["args"]["models"][0])
    app_name = direct_app_name(config.name) if args.one_hop else "llm"
    if args.one_hop:
        serve_config = with_direct_apps(serve_config)
    try:
        with serve_stack(serve_config, config.name, log, MAKEFILE_ENV) as running:
            url = running.url
            before = engine_loads(config.name, app_name)
            samples, wall = asyncio.run(run_load(url, config.name, args, secrets, sessions=policy == "sessions"))
            after = engine_loads(config.name, app_name)
    except Exception:
        print(f"{policy} failed; its log ends:\n" + (log.read_text()[-3000:] if log.exists() else ""), file=sys.stderr)
        raise
    looked_up = {r: after[r]["prefix_cache_queries"] - before.get(r, {}).get("prefix_cache_queries", 0) for r in after}
    hits = sum(after[r]["prefix_cache_hits"] - before.get(r, {}).get("prefix_cache_hits", 0) for r in after)
    mean = statistics.mean(looked_up.values()) if looked_up else 0
    ttfts = [ttft * 1000 for ttft, _ in samples]
    return {
        "TTFT p50 ms": percentile(ttfts, 0.5),
        "TTFT p90 ms": percentile(ttfts, 0.9),
        "output tok/s": sum(tokens for _, tokens in samples) / wall,
        "prefix-cache hit rate": hits / sum(looked_up.values()) if looked_up else 0.0,
        "max/mean replica load": max(looked_up.values()) / mean if mean else 0.0,
    }


if __name__ == "__main__":
    main()

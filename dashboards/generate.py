"""The Grafana dashboards, written as code (grafana-foundation-sdk) so they stay
consistent; the JSON under ``dashboards/grafana/`` is generated from here and
committed (Grafana loads it through ``dashboards/provisioning/``).

    python dashboards/generate.py           # rewrite the JSON
    python dashboards/generate.py --check   # exit 1 if the JSON is stale

Every query reads metrics this project exports through Ray (docs/operating.md, "Metrics and
logs"): the gateway's ``ray_llm_gateway_*``, vLLM's ``ray_vllm_*`` (label
``model_name``) and Ray Serve's ``ray_serve_*`` (label ``deployment``, joined to
model names through the ``ray_llm_gateway_model_info`` info metric).
tests/e2e/local_stack/test_2_dashboards_e2e.py evaluates every expression against a real
Prometheus scraping a loaded stack and fails on any that returns nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

OUTPUT = Path(__file__).resolve().parent / "grafana"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)
REQUESTS = "ray_llm_gateway_requests_total"
HEALTHY = "ray_serve_deployment_replica_healthy"  # per replica, labelled with its deployment

# Model selection on the per-model dashboard (all models when "All").
MODEL = 'model=~"$model"'
ENGINE_MODEL = 'model_name=~"$model"'


# -- query helpers ---------------------------------------------------------------


def rate(metric: str, selector: str = "", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    matchers = f"{{{selector}}}" if selector else ""
    return f"sum{grouping} (rate({metric}{matchers}[{RATE}]))"


def quantile(q: float, histogram: str, selector: str = "") -> str:
    """``q`` of a Ray histogram (its ``_bucket`` series), over the rate window."""
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', selector, by='le')})"


def share(part: str) -> str:
    """``part`` as a share of all requests; 0 (not "no data") while ``part`` never happened."""
    return f"({part} or vector(0)) / {rate(REQUESTS)}"


def top_keys(expr: str) -> str:
    """The 10 largest of ``expr``'s series (keys or teams: label sets only traffic
    creates); one 0 series while there are none, so the panel reads 0, not "No data"
    (``on()``: the 0 joins only an empty result)."""
    return f"topk(10, {expr}) or on() vector(0)"


def by_model(serve_metric: str, model_selector: str = "") -> str:
    """A Ray Serve per-deployment gauge summed per model name. Serve labels its
    metrics with the deployment (``model-<name>``); the gateway's info metric
    ``ray_llm_gateway_model_info{model, deployment}`` names its model."""
    info = f"max by (deployment, model) (ray_llm_gateway_model_info{{{model_selector}}})"
    return f"sum by (model) ({serve_metric} * on (deployment) group_left (model) {info})"


def autoscaler_or(autoscaler_metric: str, fixed_metric: str, model_selector: str = "") -> str:
    """Serve exports its autoscaler's gauges only for autoscaled deployments: a model
    with a fixed replica count (configs/local.yaml) shows ``fixed_metric`` instead (its
    running replicas, the requests at them), so the panel has data on every config."""
    return f"{by_model(autoscaler_metric, model_selector)} or {by_model(fixed_metric, model_selector)}"


def target(expr: str, legend: str) -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def timeseries(title: str, description: str, unit: str, *targets: Dataquery, width: int = 12) -> Timeseries:
    panel = (
        Timeseries()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
        .min(0)
        .legend(
            VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM).show_legend(True)
        )
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )
    for ref_id, query in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(query.ref_id(ref_id))
    return panel


def stat(title: str, description: str, unit: str, expr: str) -> Stat:
    return (
        Stat()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .with_target(target(expr, title).ref_id("A"))
        .graph_mode(BigValueGraphMode.AREA)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    )


def percentiles(histogram: str, selector: str = "") -> list[Dataquery]:
    return [target(quantile(q, histogram, selector), f"p{int(q * 100)}") for q in QUANTILES]


def datasource_variable() -> DatasourceVariable:
    return DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def dashboard(uid: str, title: str, description: str) -> Dashboard:
    return (
        Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["llm-cluster"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(datasource_variable())
    )


# -- dashboards ------------------------------------------------------------------


def overview() -> Dashboard:
    return (
        dashboard(
            "llm-cluster-overview",
            "LLM cluster / Overview",
            "Is the service healthy? Traffic, errors, 429s, latency, tokens and replicas, all models together.",
        )
        .with_row(Row("Traffic"))
        .with_panel(stat("Requests/s", "Every answered request, all models and routes.", "reqps", rate(REQUESTS)))
        .with_panel(
            stat(
                "Server errors",
                "Share of requests answered 5xx (overload 503s included).",
                "percentunit",
                share(rate(REQUESTS, 'status=~"5.."')),
            )
        )
        .with_panel(
            stat(
                "Refused by quotas",
                "Share of requests answered 429 (a key over one of its limits).",
                "percentunit",
                share(rate(REQUESTS, 'status="429"')),
            )
        )
        .with_panel(
            stat(
                "In flight",
                "Admitted requests not finished yet (streams included).",
                "short",
                "sum(ray_llm_gateway_requests_in_flight)",
            )
        )
        .with_panel(
            timeseries(
                "Requests by model and status",
                "Who is asking for what, and how it ends.",
                "reqps",
                target(rate(REQUESTS, by="model, status"), "{{model}} {{status}}"),
            )
        )
        .with_panel(
            timeseries(
                "Requests by API dialect",
                "openai (/v1), azure, sagemaker, databricks: which clients drive the load.",
                "reqps",
                target(rate(REQUESTS, by="route"), "{{route}}"),
            )
        )
        .with_panel(
            timeseries(
                "Errors by status (429 apart)",
                "Client mistakes (4xx) and server failures (5xx).",
                "reqps",
                target(rate(REQUESTS, 'status=~"4..|5..", status!="429"', by="status"), "{{status}}"),
            )
        )
        .with_panel(
            timeseries(
                "429s by limit",
                "Which quota refuses: requests, tokens, concurrency or budget (per minute rates).",
                "reqps",
                target(rate("ray_llm_gateway_rate_limit_refusals_total", by="limit"), "{{limit}}"),
            )
        )
        .with_row(Row("Latency"))
        .with_panel(
            timeseries(
                "End-to-end latency",
                "Ingress latency of every request (streams: to the last chunk).",
                "s",
                *percentiles("ray_llm_gateway_request_duration_seconds"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Time to first token",
                "Streams: request received to first chunk out.",
                "s",
                *percentiles("ray_llm_gateway_time_to_first_token_seconds"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Time per output token",
                "Streams: generation speed after the first token.",
                "s",
                *percentiles("ray_llm_gateway_time_per_output_token_seconds"),
                width=8,
            )
        )
        .with_row(Row("Tokens and capacity"))
        .with_panel(
            timeseries(
                "Tokens/s by model",
                "Prompt and completion tokens of answered requests.",
                "short",
                target(rate("ray_llm_gateway_prompt_tokens_total", by="model"), "{{model}} prompt"),
                target(rate("ray_llm_gateway_completion_tokens_total", by="model"), "{{model}} completion"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Replicas per model",
                "Healthy replicas and the autoscaler's target (Ray Serve; a model without "
                "autoscaling: its healthy replicas).",
                "short",
                target(by_model("ray_serve_deployment_replica_healthy"), "{{model}} healthy"),
                target(autoscaler_or("ray_serve_autoscaling_target_replicas", HEALTHY), "{{model}} target"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Engine queue by model",
                "vLLM requests running and waiting for a slot, all replicas.",
                "short",
                target("sum by (model_name) (ray_vllm_num_requests_running)", "{{model_name}} running"),
                target("sum by (model_name) (ray_vllm_num_requests_waiting)", "{{model_name}} waiting"),
                width=8,
            )
        )
    )


def prefix_cache_hit_rate() -> str:
    # vLLM's hits counter appears only at the first hit: until then the rate is 0.
    queries = rate("ray_vllm_prefix_cache_queries_total", ENGINE_MODEL, by="model_name")
    hits = rate("ray_vllm_prefix_cache_hits_total", ENGINE_MODEL, by="model_name")
    return f"({hits} or 0 * {queries}) / {queries}"


def per_model() -> Dashboard:
    model_variable = (
        QueryVariable("model")
        .label("Model")
        .datasource(DATASOURCE)
        .query(f"label_values({REQUESTS}, model)")
        .regex("^(?!unknown$).*")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    return (
        dashboard(
            "llm-cluster-model",
            "LLM cluster / Model",
            "Why is this model slow or refusing? Its requests, engine queue, KV cache, streaming speed, replicas.",
        )
        .with_variable(model_variable)
        .with_row(Row("Requests"))
        .with_panel(
            timeseries(
                "Requests by status",
                "How this model's requests end.",
                "reqps",
                target(rate(REQUESTS, MODEL, by="model, status"), "{{model}} {{status}}"),
            )
        )
        .with_panel(
            timeseries(
                "End-to-end latency",
                "Ingress latency (streams: to the last chunk).",
                "s",
                *percentiles("ray_llm_gateway_request_duration_seconds", MODEL),
            )
        )
        .with_row(Row("Engine (vLLM)"))
        .with_panel(
            timeseries(
                "Engine queue",
                "Requests in the engine's batch and waiting for a slot: waiting > 0 for long means "
                "too few replicas (the autoscaler reads it).",
                "short",
                target(
                    f"sum by (model_name) (ray_vllm_num_requests_running{{{ENGINE_MODEL}}})", "{{model_name}} running"
                ),
                target(
                    f"sum by (model_name) (ray_vllm_num_requests_waiting{{{ENGINE_MODEL}}})", "{{model_name}} waiting"
                ),
            )
        )
        .with_panel(
            timeseries(
                "KV cache use per replica",
                "Share of each engine's KV cache in use; near 100 % means preemptions (the autoscaler reads it).",
                "percentunit",
                target(
                    f"max by (model_name, ReplicaId) (ray_vllm_kv_cache_usage_perc{{{ENGINE_MODEL}}})",
                    "{{model_name}} {{ReplicaId}}",
                ),
            )
        )
        .with_panel(
            timeseries(
                "Engine tokens/s",
                "Tokens the engines prefilled and generated.",
                "short",
                target(rate("ray_vllm_prompt_tokens_total", ENGINE_MODEL, by="model_name"), "{{model_name}} prefill"),
                target(
                    rate("ray_vllm_generation_tokens_total", ENGINE_MODEL, by="model_name"), "{{model_name}} generated"
                ),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Prefix cache hit rate",
                "Share of prompt tokens found in the prefix cache.",
                "percentunit",
                target(prefix_cache_hit_rate(), "{{model_name}}"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Engine queue time",
                "Time requests waited inside the engine before being scheduled.",
                "s",
                *percentiles("ray_vllm_request_queue_time_seconds", ENGINE_MODEL),
                width=8,
            )
        )
        .with_row(Row("Streaming"))
        .with_panel(
            timeseries(
                "Where the time to first token goes",
                "Medians: the whole at the ingress; the engine's part (vLLM's "
                "own time to first token, its queue and its prefill); the rest is the gateway and the hops (auth, "
                "admission, the fair-share queue, Serve's queue, the relay). One request's split: its trace "
                '(telemetry.tracing, docs/operating.md "Traces").',
                "s",
                target(quantile(0.5, "ray_llm_gateway_time_to_first_token_seconds", MODEL), "at the ingress"),
                target(quantile(0.5, "ray_vllm_time_to_first_token_seconds", ENGINE_MODEL), "in the engine"),
                target(quantile(0.5, "ray_vllm_request_queue_time_seconds", ENGINE_MODEL), "engine queue"),
                target(quantile(0.5, "ray_vllm_request_prefill_time_seconds", ENGINE_MODEL), "prefill"),
                target(
                    f"{quantile(0.5, 'ray_llm_gateway_time_to_first_token_seconds', MODEL)} - scalar("
                    f"{quantile(0.5, 'ray_vllm_time_to_first_token_seconds', ENGINE_MODEL)})",
                    "gateway and hops",
                ),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Time to first token",
                "Streams: request received to first chunk out, at the ingress.",
                "s",
                *percentiles("ray_llm_gateway_time_to_first_token_seconds", MODEL),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Time per output token",
                "Streams: generation speed after the first token.",
                "s",
                *percentiles("ray_llm_gateway_time_per_output_token_seconds", MODEL),
                width=8,
            )
        )
        .with_row(Row("Failover"))
        .with_panel(
            timeseries(
                "Requests sent to another replica",
                "Requests a replica failed before their first byte (died or draining, a 5xx of its engine, "
                "a stream silent past failover.first_token_timeout_s), sent again to another replica under their "
                "one admission; and the streams cut for that silence. Zero in normal operation "
                '(docs/operating.md "Faults and recovery").',
                "reqps",
                target(rate("ray_llm_gateway_retries_total", MODEL, by="model, reason"), "{{model}} {{reason}}"),
                target(rate("ray_llm_gateway_stalled_streams_total", MODEL, by="model"), "{{model}} stalled"),
            )
        )
        .with_panel(
            timeseries(
                "Replicas ejected, requests on a fallback",
                "Replicas taken out of their model's routing for failing requests in a row "
                "(failover.eject_after_failures, as each gateway process judged them), and requests answered by a "
                "fallback model because no replica of theirs could take them. Zero in normal operation.",
                "short",
                target(
                    f"sum by (model) (increase(ray_llm_gateway_replica_ejections_total{{{MODEL}}}[{RATE}]))",
                    "{{model}} ejections",
                ),
                target(
                    top_keys(rate("ray_llm_gateway_model_fallbacks_total", MODEL, by="model, fallback")),
                    "{{model}} to {{fallback}}",
                ),
            )
        )
        .with_row(Row("Autoscaling"))
        .with_panel(
            timeseries(
                "Replicas",
                "Healthy replicas, the target Serve is moving to, and what the policy asked for before "
                "min/max bounds. A model without autoscaling: its healthy replicas for all three.",
                "short",
                target(by_model(HEALTHY, MODEL), "{{model}} healthy"),
                target(autoscaler_or("ray_serve_autoscaling_target_replicas", HEALTHY, MODEL), "{{model}} target"),
                target(
                    autoscaler_or("ray_serve_autoscaling_desired_replicas", HEALTHY, MODEL), "{{model}} policy decision"
                ),
            )
        )
        .with_panel(
            timeseries(
                "Ongoing requests seen by the autoscaler",
                "Requests queued or running at the model's replicas, as "
                "Serve's autoscaler counts them; a model without autoscaling: the requests its replicas are "
                "processing.",
                "short",
                target(
                    autoscaler_or(
                        "ray_serve_autoscaling_total_requests", "ray_serve_replica_processing_queries", MODEL
                    ),
                    "{{model}}",
                ),
            )
        )
    )


def quotas() -> Dashboard:
    per_key = (
        "Each ingress replica names its first telemetry.per_key_max_keys keys (100); later ones count as "
        "'(other keys)'. Exact figures: llmctl usage."
    )
    per_team = (
        "Each ingress replica names its first telemetry.per_key_max_keys teams (100); later ones count as "
        "'(other teams)'. Exact figures: llmctl usage --team, GET /v1/organization/costs."
    )
    return (
        dashboard(
            "llm-cluster-quotas",
            "LLM cluster / Quotas",
            "Who is being refused and why, which keys and teams use and spend the most, how close budgets are, "
            "is Redis healthy.",
        )
        .with_row(Row("Refusals"))
        .with_panel(
            timeseries(
                "429s by limit",
                "Which quota refuses: requests, tokens, concurrency or budget.",
                "reqps",
                target(rate("ray_llm_gateway_rate_limit_refusals_total", by="limit"), "{{limit}}"),
            )
        )
        .with_panel(
            timeseries(
                "429s by model and limit",
                "Refusals per model.",
                "reqps",
                target(rate("ray_llm_gateway_rate_limit_refusals_total", by="model, limit"), "{{model}} {{limit}}"),
            )
        )
        .with_row(Row("Keys"))
        .with_panel(
            timeseries(
                "Top keys by requests",
                f"The 10 busiest keys. {per_key}",
                "reqps",
                target(top_keys(rate("ray_llm_gateway_key_requests_total", by="key_name")), "{{key_name}}"),
            )
        )
        .with_panel(
            timeseries(
                "Top keys by tokens",
                f"The 10 keys using the most tokens. {per_key}",
                "short",
                target(top_keys(rate("ray_llm_gateway_key_tokens_total", by="key_name")), "{{key_name}}"),
            )
        )
        .with_panel(
            timeseries(
                "Share of tokens served, per key",
                "Each key's share of all tokens served (the 10 largest). While a "
                "model is saturated its waiting requests are handed on in fair order (models' fair_share), so "
                f"backlogged keys converge to equal shares whatever their request rates. {per_key}",
                "percentunit",
                target(
                    top_keys(
                        f"{rate('ray_llm_gateway_key_tokens_total', by='key_name')} / "
                        f"scalar({rate('ray_llm_gateway_key_tokens_total')})"
                    ),
                    "{{key_name}}",
                ),
            )
        )
        .with_panel(
            timeseries(
                "Top refused keys",
                f"The 10 keys refused most (429). {per_key}",
                "reqps",
                target(
                    top_keys(rate("ray_llm_gateway_key_requests_total", 'status="429"', by="key_name")), "{{key_name}}"
                ),
            )
        )
        .with_panel(
            timeseries(
                "Budget use",
                f"Share of each key's daily/monthly token budget used (the 10 fullest); at 100 % the "
                f"key gets 429 insufficient_quota. {per_key}",
                "percentunit",
                target(
                    top_keys("max by (key_name, period) (ray_llm_gateway_key_budget_used_ratio)"),
                    "{{key_name}} {{period}}",
                ),
            )
        )
        .with_row(Row("Teams"))
        .with_panel(
            timeseries(
                "429s by level",
                "Whose limit refused: the key's own, or its team's (the 429's x-ratelimit-scope).",
                "reqps",
                target(rate("ray_llm_gateway_rate_limit_refusals_total", by="level"), "{{level}}"),
                width=6,
            )
        )
        .with_panel(
            timeseries(
                "Share of tokens charged, per team",
                f"Each team's share of the tokens charged to teams' keys (the 10 largest). {per_team}",
                "percentunit",
                target(
                    top_keys(
                        f"{rate('ray_llm_gateway_team_tokens_total', by='team')} / "
                        f"scalar({rate('ray_llm_gateway_team_tokens_total')})"
                    ),
                    "{{team}}",
                ),
                width=6,
            )
        )
        .with_panel(
            timeseries(
                "Prompt cache hit rate, per team",
                "Of each team's prompt tokens, the share its models' engines served from the team's own "
                "prefix cache (the models' and teams' cache_isolation: a team never reads another's; "
                f"the 10 largest). {per_team}",
                "percentunit",
                target(
                    top_keys(
                        rate("ray_llm_gateway_team_cached_prompt_tokens_total", by="team")
                        + " / "
                        + rate("ray_llm_gateway_team_tokens_total", 'kind="prompt"', by="team")
                    ),
                    "{{team}}",
                ),
                width=6,
            )
        )
        .with_panel(
            timeseries(
                "Spend per team",
                f"What each team's requests cost at their models' prices (models' pricing), in USD "
                f"per hour (the 10 largest). {per_team}",
                "currencyUSD",
                target(top_keys(f"{rate('ray_llm_gateway_team_spend_usd_total', by='team')} * 3600"), "{{team}}"),
                width=6,
            )
        )
        .with_panel(
            timeseries(
                "Team refusals by level",
                f"429s of each team's keys: refused by the key's own limit, or by the "
                f"team's (the 10 most refused). {per_team}",
                "reqps",
                target(top_keys(rate("ray_llm_gateway_team_refusals_total", by="team, level")), "{{team}} {{level}}"),
                width=6,
            )
        )
        .with_row(Row("Quota backend (Redis)"))
        .with_panel(
            timeseries(
                "Admission decision time",
                "One Redis script call per request decides every quota.",
                "s",
                *percentiles("ray_llm_gateway_admission_seconds"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Redis errors",
                "Failed Redis calls by operation (authenticate, admit, accounting).",
                "short",
                target(rate("ray_llm_gateway_redis_errors_total", by="operation"), "{{operation}}"),
                width=8,
            )
        )
        .with_panel(
            timeseries(
                "Fail-open decisions",
                "Requests decided without Redis (quota.fail_mode: open): a cached key, or the replica's local limits.",
                "short",
                target(rate("ray_llm_gateway_redis_fallbacks_total", by="kind"), "{{kind}}"),
                width=8,
            )
        )
        .with_row(Row("Request records"))
        .with_panel(
            timeseries(
                "Records waiting for the sink",
                "Final request records in Redis' outbox, not yet written to "
                'records.sink_dir (docs/operating.md, "Request records"). At records.max_backlog new requests are '
                "refused (503 records_backlog) until the sink takes them.",
                "short",
                target("max(ray_llm_gateway_request_records_backlog)", "waiting"),
                width=12,
            )
        )
        .with_panel(
            timeseries(
                "Records shipped",
                "Final records written to the record sink per second, and shipping attempts that "
                "failed by kind (redis, sink: retried; lost: Redis refused a record while the ingress' own "
                "buffer was full).",
                "short",
                target(rate("ray_llm_gateway_request_records_shipped_total"), "shipped"),
                target(rate("ray_llm_gateway_request_record_failures_total", by="kind"), "failed: {{kind}}"),
                width=12,
            )
        )
    )


DASHBOARDS = {"overview.json": overview, "model.json": per_model, "quotas.json": quotas}


def render() -> dict[str, str]:
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {name: encoder.encode(build().build()) + "\n" for name, build in DASHBOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is not what the code makes")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = OUTPUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUTPUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

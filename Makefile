# The two commands of README.md: `make run` and `make test`. Each sets up what
# it needs, idempotently, on a fresh machine.
VENV    ?= .venv
REDIS_URL ?= redis://127.0.0.1:6379/0
CONFIG  ?= configs/local.yaml
export REDIS_URL
# Ray Serve's high-throughput configuration (docs/performance.md; measured with
# bench/serving_overhead.py): HAProxy as the HTTP ingress in place of Ray's Python
# proxy (one address, :8000, as before; it forwards to the ingress replicas' own
# HTTP servers), and throughput mode (user code on the replica's own event loop,
# gRPC between replicas). HAProxy runs through llm-haproxy so that it dies with
# its Ray actor (cluster/haproxy_guard.py). RAY_SERVE_ENABLE_HA_PROXY=0 brings
# back Ray's proxy.
export RAY_SERVE_ENABLE_HA_PROXY ?= 1
export RAY_SERVE_HAPROXY_BINARY_PATH ?= $(abspath $(VENV))/bin/llm-haproxy
export RAY_SERVE_THROUGHPUT_OPTIMIZED ?= 1
export RAY_SERVE_ENABLE_DIRECT_INGRESS ?= 0
# An ingress replica that stops (a rollout, a scale-down, `serve shutdown`) stays
# reachable this long before it refuses new connections (Ray's default, 30 s, is for
# an external load balancer to deregister it). Here Ray's own HAProxy is in front: the
# controller updates it within a second or two, and it retries a refused connection on
# another replica, so 5 s is enough; Ray's 30 s made every stop and every ingress
# rollout wait 30 s for nothing (docs/operating.md, "Rolling out").
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S ?= 5
# A direct route routed with affinity on several replicas has its replica chosen at
# the edge by the model's router (serve_app/http/edge_router.py): HAProxy hands it the
# body it read, at most a request buffer of 256 KiB (Ray's 8 MiB would be the buffer of
# every request HAProxy reads; cluster/haproxy_edge.py ONE_HOP_BODY_BYTES).
export RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY ?= 1
export RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE ?= 262144

STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)

.PHONY: setup redis prometheus browser demo-model run stop metrics dashboards test test-fast unit bench soak

setup: $(STAMP)
$(STAMP):
	scripts/setup.sh $(VENV)
	rm -f $(VENV)/.installed-* && touch $@

redis:
	scripts/ensure_redis.sh

prometheus:
	scripts/ensure_prometheus.sh

browser:
	scripts/ensure_chromium.sh

demo-model: setup
	$(VENV)/bin/llmctl demo-model

# The stack runs on a Ray instance of its own; Ctrl-C or `make stop` ends all of
# it (Ray, replicas, vLLM engines) within 30 s (serve_app/ops/local_stack.py).
# The terminal shows one block once every model answers (URL, models, the
# development key, where the logs are); VERBOSE=1 shows Ray's and vLLM's output too.
run: setup redis demo-model
	@$(VENV)/bin/llmctl keys ensure-dev > /dev/null
	@$(VENV)/bin/llmctl run $(CONFIG)

stop:
	$(VENV)/bin/llmctl stop

# Prometheus beside a running stack (`make run` in another shell), scraping every
# Ray metrics endpoint through Ray's service-discovery file; UI on :9090.
metrics: prometheus
	prometheus --config.file=dashboards/prometheus.yml --web.listen-address=127.0.0.1:9090 \
	  --storage.tsdb.path=$${LLM_CLUSTER_DATA_DIR:-$$HOME/.cache/llm-cluster}/prometheus

# Regenerate the Grafana dashboards (dashboards/grafana/*.json) from dashboards/generate.py.
dashboards: setup
	$(VENV)/bin/python dashboards/generate.py

PYTEST_ARGS ?= -q -rfEs --durations=15

# Everything, slowest tests listed at the end.
test: setup redis prometheus browser demo-model
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Unit + integration + the core end-to-end path (openai SDK → ingress → vLLM, one stack).
test-fast: setup redis demo-model
	$(VENV)/bin/python -m pytest tests/unit tests/integration tests/e2e/shared_stack/test_chat_e2e.py $(PYTEST_ARGS)

unit: setup
	$(VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

bench: setup redis demo-model
	$(VENV)/bin/python -m pip install -q -e '.[bench]'
	$(VENV)/bin/python bench/serving_overhead.py $(BENCH_ARGS)

# The scale-and-fault soak (soak/): the gateway on the `ray up` twin, a Redis Cluster
# behind chaos proxies, 2,000 keys in 50 teams, faults on a schedule; prints the
# ledger's verdict and the figures (docs/operating.md, "Soak"). SOAK_ARGS adds options.
DURATION ?= 300
SEED ?= 1
soak: setup redis demo-model
	$(VENV)/bin/python -m soak --duration $(DURATION) --seed $(SEED) $(SOAK_ARGS)

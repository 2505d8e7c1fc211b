# The two commands of README.md: `make run` and `make test`. Each sets up what
# it needs, idempotently, on a fresh machine.
VENV    ?= .venv
REDIS_URL ?= redis://127.0.0.1:6379/0
CONFIG  ?= configs/local.yaml
export REDIS_URL
# Ray Serve's throughput mode: user code on the replica's own event loop, no
# separate router loop, gRPC between proxy and replicas. Measured with
# bench/serving_overhead.py (README, "Performance"). Direct ingress stays off so
# clients keep one address (the proxy on :8000).
export RAY_SERVE_THROUGHPUT_OPTIMIZED ?= 1
export RAY_SERVE_ENABLE_DIRECT_INGRESS ?= 0

STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)

.PHONY: setup redis demo-model run test unit bench

setup: $(STAMP)
$(STAMP):
	scripts/setup.sh $(VENV)
	rm -f $(VENV)/.installed-* && touch $@

redis:
	scripts/ensure_redis.sh

demo-model: setup
	$(VENV)/bin/llmctl demo-model

run: setup redis demo-model
	@echo "Development API key (OPENAI_API_KEY): $$($(VENV)/bin/llmctl keys ensure-dev)"
	$(VENV)/bin/serve run $(CONFIG)

test: setup redis demo-model
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

unit: setup
	$(VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

bench: setup redis demo-model
	$(VENV)/bin/python bench/serving_overhead.py $(BENCH_ARGS)

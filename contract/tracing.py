"""What the application builders (serve_app/settings.py ``TracingConfig.env``) and
the gateway's tracer (serve_app/tracing.py) agree on about traces."""

# The share of requests without a sampled parent the gateway starts a trace for
# (telemetry.tracing.sample_ratio). Only the gateway starts traces: every other
# tracer in a deployment follows its parent (OTEL_TRACES_SAMPLER=parentbased_always_off).
TRACES_SAMPLE_RATIO_ENV = "LLM_TRACES_SAMPLE_RATIO"

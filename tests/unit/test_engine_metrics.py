"""vLLM's Ray stat logger without its per-token histogram (replicas/engine_metrics.py).
The end-to-end proof is on Ray's metrics endpoint (tests/e2e/local_stack/test_2_dashboards_e2e.py)."""

import inspect

from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from contract.model_config import ModelConfig
from replicas.engine_metrics import PerRequestRayStatLogger, _Unobserved, ray_stat_logger


def test_the_per_token_histogram_is_off_unless_a_model_asks_for_it():
    config = ModelConfig(name="m", source="s")
    assert config.inter_token_latency_histogram is False
    assert ray_stat_logger(config.inter_token_latency_histogram) is PerRequestRayStatLogger
    assert ray_stat_logger(True) is RayPrometheusStatLogger
    assert issubclass(PerRequestRayStatLogger, RayPrometheusStatLogger)


def test_the_replaced_attribute_is_the_one_vllm_observes_per_token():
    """A vLLM upgrade that renames it would make the override a silent no-op."""
    assert "self.histogram_inter_token_latency = " in inspect.getsource(PrometheusStatLogger.__init__)
    record = inspect.getsource(PrometheusStatLogger.record)
    assert "for itl in iteration_stats.inter_token_latencies_iter:" in record
    assert "self.histogram_inter_token_latency[engine_idx].observe(itl)" in record


def test_an_unobserved_histogram_takes_any_value():
    histogram = _Unobserved()
    for value in (0, 0.001, 1e9, float("inf")):
        assert histogram.observe(value) is None

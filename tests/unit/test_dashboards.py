"""The Grafana dashboards as shipped: generated from dashboards/generate.py (the
committed JSON is what the code makes), every panel on the datasource variable,
and provisioning/Prometheus files that point where Grafana and Ray put things.
Whether every panel has data is tested against a real Prometheus in
tests/e2e/local_stack/test_2_dashboards_e2e.py."""

import importlib.util
import json
from pathlib import Path

import yaml
from ray._private import ray_constants

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def boards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted((DASHBOARDS / "grafana").glob("*.json"))}


def test_committed_json_is_what_the_generator_makes():
    rendered = generator().render()
    assert set(rendered) == set(boards()) == {"overview.json", "model.json", "quotas.json"}
    for name, text in rendered.items():
        assert (DASHBOARDS / "grafana" / name).read_text() == text, f"{name} is stale: run make dashboards"


def test_every_panel_queries_prometheus_through_the_datasource_variable():
    uids = set()
    for name, board in boards().items():
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        panels = [panel for panel in board["panels"] if panel["type"] != "row"]
        titles = [panel["title"] for panel in panels]
        assert len(titles) == len(set(titles)), name
        for panel in panels:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["description"], panel["title"]  # what the panel answers
            targets = panel["targets"]
            assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
            for target in targets:
                assert target["datasource"]["uid"] == "${datasource}" and target["expr"], panel["title"]
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]  # Grafana's grid
    assert len(uids) == 3


def test_per_model_dashboard_filters_by_the_model_variable():
    board = boards()["model.json"]
    [model] = [v for v in board["templating"]["list"] if v["name"] == "model"]
    assert model["includeAll"] and model["allValue"] == ".*"
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert "$model" in target["expr"], panel["title"]


def test_prometheus_reads_rays_service_discovery_file():
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    [files] = [sd["files"] for sd in job["file_sd_configs"]]
    # Ray's dashboard keeps this file (a link into the current session) on the head node.
    assert files == [f"/tmp/ray/{ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE}"]


def test_grafana_provisioning_files():
    datasources = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] and source["url"].startswith("http")
    providers = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "llm-cluster.yaml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")

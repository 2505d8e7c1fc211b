"""The gateway stays light to import: it runs on CPU head nodes and in `llmctl`,
where loading torch, vLLM or transformers would cost seconds and gigabytes."""

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers")


def loaded_after(statement: str) -> set[str]:
    probe = f"import sys; {statement}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


def test_importing_the_gateway_loads_no_engine_library():
    loaded = loaded_after(
        "import serve_app.app, serve_app.http.ingress, serve_app.pipeline.gateway, serve_app.cli, "
        "serve_app.dialects.azure, serve_app.dialects.sagemaker, serve_app.dialects.databricks"
    )
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_the_probe_sees_an_engine_library_when_one_is_imported():
    # The control: the same probe does notice a heavy import.
    assert "vllm" in loaded_after("import vllm")


def test_the_contract_both_sides_import_is_pydantic_and_the_standard_library():
    loaded = loaded_after("import contract.model_config, contract.replica_wire")
    assert not loaded & {*HEAVY, "ray", "serve_app", "replicas", "redis"}, loaded

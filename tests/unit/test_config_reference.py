"""docs/config-reference.md is what the settings classes say (scripts/config_reference.py writes it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import config_reference  # noqa: E402


def test_the_reference_is_generated_from_the_settings_as_they_are():
    assert config_reference.TARGET.read_text() == config_reference.render(), (
        "docs/config-reference.md is out of date: run python scripts/config_reference.py"
    )


def test_every_setting_is_described():
    undescribed = [
        row for row in config_reference.render().splitlines() if row.startswith("| `") and row.rstrip().endswith("|  |")
    ]
    assert not undescribed, undescribed

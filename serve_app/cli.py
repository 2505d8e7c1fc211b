"""``llmctl``: the operator's command line (grows with keys, usage, requests)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _check_config(path: Path) -> int:
    """Validate every application's args in a Serve config against AppSettings."""
    import yaml

    from serve_app.settings import AppSettings

    config = yaml.safe_load(path.read_text())
    for application in config.get("applications", []):
        settings = AppSettings(**(application.get("args") or {}))
        print(json.dumps({"application": application.get("name"),
                          "models": [m.name for m in settings.models]}))
    return 0


def _demo_model(_: argparse.Namespace) -> int:
    from replicas.demo_model import build_demo_model

    print(build_demo_model())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmctl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-config", help="validate a Serve config file")
    check.add_argument("path", type=Path)
    check.set_defaults(run=lambda a: _check_config(a.path))
    demo = commands.add_parser("demo-model", help="build the tiny demo model; print its path")
    demo.set_defaults(run=_demo_model)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

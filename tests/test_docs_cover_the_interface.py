"""The user docs name every option, environment variable and metric the package offers.

A new command-line option, ``MLX_VOICECHAT_*`` variable or Prometheus metric that the docs
(README.md, docs/*.md) do not mention fails here, so the interface and its documentation
cannot drift apart silently.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_voicechat_plugin"


def _docs() -> str:
    return "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from mlx_voicechat_plugin.cli.generate import build_parser as generate
    from mlx_voicechat_plugin.clients.file import build_parser as file_client
    from mlx_voicechat_plugin.clients.load_test import build_parser as load_test
    from mlx_voicechat_plugin.clients.microphone import build_parser as microphone
    from mlx_voicechat_plugin.demo.__main__ import build_parser as demo
    from mlx_voicechat_plugin.server.cli import build_parser as serve

    return {
        "serve": serve("mlx-voicechat serve"),
        "generate": generate(),
        "loadtest": load_test(),
        "file client": file_client(),
        "microphone client": microphone(),
        "demo": demo("mlx-voicechat demo"),
    }


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options a user sees in ``--help`` (hidden ones and ``--help`` left out)."""
    found = []
    for action in parser._actions:  # argparse has no public listing of its actions
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _options(sub)
            continue
        found += [option for option in action.option_strings if option.startswith("--")]
    return found


@pytest.mark.parametrize("command", ["serve", "generate", "loadtest", "file client", "microphone client", "demo"])
def test_every_command_line_option_is_documented(command):
    docs = _docs()
    options = _options(_parsers()[command])
    assert options, command
    missing = [option for option in options if not re.search(re.escape(option) + r"(?![\w-])", docs)]
    assert not missing, f"{command}: options in --help that no doc mentions: {missing}"


def test_every_environment_variable_the_package_reads_is_in_the_settings_table():
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"\bMLX_VOICECHAT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert {"MLX_VOICECHAT_COMPILE", "MLX_VOICECHAT_API_KEY"} <= read  # the scan sees the code
    table = (ROOT / "docs" / "usage.md").read_text()
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert not missing, f"variables the code reads that docs/usage.md's settings table lacks: {missing}"


def test_every_metric_is_in_the_deploy_table():
    from mlx_voicechat_plugin.server.metrics import ServerMetrics

    families = list(ServerMetrics(sessions_max=2).registry.collect())
    names = {family.name + ("_total" if family.type == "counter" else "") for family in families}
    assert len(names) >= 10
    table = (ROOT / "docs" / "deploy.md").read_text()
    missing = sorted(name for name in names if f"`{name}" not in table)
    assert not missing, f"metrics that docs/deploy.md does not list: {missing}"
    for family in families:  # every label value the server pre-registers is named there
        for sample in family.samples:
            for key, value in sample.labels.items():
                if key == "le":  # a histogram's buckets
                    continue
                assert f'"{value}"' in table, f"{family.name}: label value {value!r} missing from docs/deploy.md"

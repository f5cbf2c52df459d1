"""``patches/0001-*``: the upstream mlx-vlm change applies to the installed release and,
with the runtime shim off, routes ``mlx_vlm.load`` to this package's Model by itself."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PATCH = (
    Path(__file__).resolve().parents[1]
    / "patches"
    / "0001-mlx-vlm-entry-point-model-discovery.patch"
)
OUR_MODEL = "mlx_voicechat_plugin.model.model.Model"
UPSTREAM_MODEL = "mlx_vlm.models.nemotron_voicechat.model.Model"

# Prints where mlx_vlm came from, which Model class mlx_vlm.load built, and whether the
# runtime shim touched the loader (it must not: the patch alone has to do the routing).
_LOAD_SCRIPT = """
import json, sys
import mlx_vlm
import mlx_vlm.utils as utils
model, _ = mlx_vlm.load(sys.argv[1])
cls = type(model)
print(json.dumps({
    "mlx_vlm_file": mlx_vlm.__file__,
    "model_class": cls.__module__ + "." + cls.__qualname__,
    "loader_hooked": hasattr(utils.get_model_and_args, "__wrapped__"),
}))
"""


def _installed_mlx_vlm() -> Path:
    spec = importlib.util.find_spec("mlx_vlm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def _load_in_subprocess(checkpoint: Path, *, pythonpath: Path | None = None) -> dict:
    env = dict(os.environ, MLX_VOICECHAT_DISABLE_SHIM="1", TRANSFORMERS_VERBOSITY="error")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory) -> Path:
    """A copy of the installed ``mlx_vlm`` package with the patch applied (its parent dir)."""
    if shutil.which("patch") is None:  # pragma: no cover - patch(1) is part of CI images
        pytest.skip("patch(1) is not installed")
    site = tmp_path_factory.mktemp("patched-site")
    shutil.copytree(_installed_mlx_vlm(), site / "mlx_vlm")
    applied = subprocess.run(
        ["patch", "-p1", "--forward", "-i", str(PATCH)],
        cwd=site,
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return site


def test_patch_applies_cleanly_to_installed_mlx_vlm_and_changes_it(patched_site):
    again = subprocess.run(
        ["patch", "-p1", "--forward", "--dry-run", "-i", str(PATCH)],
        cwd=patched_site,
        capture_output=True,
        text=True,
    )
    # Already applied: patch refuses the forward direction and recognises it as reversed.
    assert again.returncode != 0
    assert "Reversed (or previously applied) patch detected" in again.stdout
    patched = (patched_site / "mlx_vlm" / "utils.py").read_text()
    original = (_installed_mlx_vlm() / "utils.py").read_text()
    assert patched != original
    assert 'entry_points(group="mlx_vlm.models")' in patched
    assert 'entry_points(group="mlx_vlm.models")' not in original


def test_patched_mlx_vlm_load_returns_plugin_model_without_shim(patched_site, checkpoint):
    result = _load_in_subprocess(checkpoint("tiny"), pythonpath=patched_site)
    # The patched copy shadows the installed mlx_vlm ...
    assert Path(result["mlx_vlm_file"]).resolve().is_relative_to(patched_site.resolve())
    # ... the shim did not wrap the loader ...
    assert result["loader_hooked"] is False
    # ... and the entry point alone routed nemotron_voicechat to this package.
    assert result["model_class"] == OUR_MODEL


def test_unpatched_mlx_vlm_without_shim_loads_upstream_model(checkpoint):
    result = _load_in_subprocess(checkpoint("tiny"))
    assert Path(result["mlx_vlm_file"]).resolve().is_relative_to(_installed_mlx_vlm().resolve())
    assert result["loader_hooked"] is False
    assert result["model_class"] == UPSTREAM_MODEL

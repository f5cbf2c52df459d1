"""How mlx-vlm finds this package: the lazy ``.pth`` shim and the declared entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mlx_voicechat_plugin.registration.shim import SHIM_DISABLE_ENV

OUR_MODEL = "mlx_voicechat_plugin.model.model.Model"
UPSTREAM_MODEL = "mlx_vlm.models.nemotron_voicechat.model.Model"
HEAVY_TOP_LEVEL = ("mlx", "mlx_vlm", "mlx_audio", "mlx_lm", "numpy", "transformers")


def _python(code: str, *args: str, disable_shim: bool = False) -> str:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    env.pop(SHIM_DISABLE_ENV, None)
    if disable_shim:
        env[SHIM_DISABLE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_interpreter_start_installs_shim_without_importing_mlx():
    out = _python(
        "import json, sys\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_TOP_LEVEL!r})\n"
        "finders = [type(f).__module__ + '.' + type(f).__qualname__ for f in sys.meta_path]\n"
        "print(json.dumps({'heavy': heavy, 'finders': finders}))"
    )
    state = json.loads(out)
    assert state["heavy"] == []
    assert "mlx_voicechat_plugin.registration.shim.PostImportFinder" in state["finders"]


def test_disable_env_keeps_shim_out_of_meta_path():
    out = _python("import sys; print([type(f).__name__ for f in sys.meta_path])", disable_shim=True)
    assert "PostImportFinder" not in out


_LOAD = (
    "import sys, mlx_vlm\n"
    "model, _ = mlx_vlm.load(sys.argv[1])\n"
    "print(type(model).__module__ + '.' + type(model).__qualname__)"
)


def test_mlx_vlm_load_returns_plugin_model_with_shim(checkpoint):
    assert _python(_LOAD, str(checkpoint("tiny"))) == OUR_MODEL


def test_mlx_vlm_load_returns_upstream_model_when_shim_disabled(checkpoint):
    assert _python(_LOAD, str(checkpoint("tiny")), disable_shim=True) == UPSTREAM_MODEL


def test_mlx_audio_sts_registry_still_resolves_its_own_module(checkpoint):
    from mlx_voicechat_plugin.registration.shim import install

    assert install(force=True)
    import mlx_vlm.utils
    from mlx_audio.sts.utils import MODEL_REMAPPING, _resolve_model_type
    from mlx_audio.utils import get_model_class, get_model_name_parts

    # The shim is active in this process: mlx-vlm resolves the type to this package ...
    arch, _ = mlx_vlm.utils.get_model_and_args({"model_type": "nemotron_voicechat"})
    assert arch.__name__ == "mlx_voicechat_plugin.model"

    # ... while mlx-audio's STS loader keeps its own implementation.
    path = checkpoint("tiny")
    model_type = _resolve_model_type(path)
    assert model_type == "nemotron_voicechat"
    module, resolved = get_model_class(
        model_type, get_model_name_parts(path), "sts", MODEL_REMAPPING
    )
    assert resolved == "nemotron_voicechat"
    assert module.__name__ == "mlx_audio.sts.models.nemotron_voicechat"
    assert module.Model.__module__ == "mlx_audio.sts.models.nemotron_voicechat.model"


def test_entry_point_declares_nemotron_voicechat_module():
    from importlib.metadata import entry_points

    found = {entry.name: entry.value for entry in entry_points(group="mlx_vlm.models")}
    assert found.get("nemotron_voicechat") == "mlx_voicechat_plugin.model"


def test_entry_point_module_provides_what_mlx_vlm_load_model_reads():
    from mlx_voicechat_plugin.registration.entry_points import resolve_model_module

    module = resolve_model_module("nemotron_voicechat")
    assert module is not None and module.__name__ == "mlx_voicechat_plugin.model"
    for name in ("Model", "ModelConfig", "TextConfig", "AudioConfig"):
        assert hasattr(module, name), name
    assert resolve_model_module("llama") is None

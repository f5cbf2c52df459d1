"""The package's version and the supported upstream range.

* ``mlx-voicechat --version`` names this package (one version, ``__init__.__version__``,
  which the wheel's metadata also carries) and the installed mlx, mlx-vlm and mlx-audio.
* An mlx-vlm (or mlx-audio) outside the supported range gets one line naming the installed
  and the supported versions from every entry point (the commands, ``python -m
  mlx_vlm.generate``, :func:`mlx_voicechat_plugin.load`, the ``mlx_vlm.models`` entry point),
  never a traceback from deep in upstream code. The version lookup is monkeypatched.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import mlx_voicechat_plugin
from mlx_voicechat_plugin import versions
from mlx_voicechat_plugin.cli.main import main as cli_main
from mlx_voicechat_plugin.exit_codes import EXIT_FAILURE

ROOT = Path(__file__).resolve().parents[1]
SPEECH_WAV = Path(__file__).parent / "data" / "question.wav"


def _installed(overrides: dict[str, str | None]):
    real = versions.installed

    def lookup(name: str) -> str | None:
        return overrides[name] if name in overrides else real(name)

    return lookup


def _run(function, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = function(argv)
    return code, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- --version


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_names_this_package_and_the_upstreams(flag):
    code, out, err = _run(cli_main, [flag])
    assert code == 0 and err == ""
    expected = (
        f"mlx-voicechat {mlx_voicechat_plugin.__version__} (mlx {metadata.version('mlx')}, "
        f"mlx-vlm {metadata.version('mlx-vlm')}, mlx-audio {metadata.version('mlx-audio')})"
    )
    assert out.strip() == expected


def test_the_version_has_one_source():
    """The distribution's metadata carries ``__version__`` (hatch reads it from __init__.py)."""
    assert metadata.version("mlx-voicechat-plugin") == mlx_voicechat_plugin.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", mlx_voicechat_plugin.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject


def test_version_flag_of_the_console_script():
    script = Path(sys.executable).with_name("mlx-voicechat")
    if not script.is_file():
        pytest.skip(f"no mlx-voicechat console script next to {sys.executable}")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"mlx-voicechat {mlx_voicechat_plugin.__version__} (mlx ")


def test_help_mentions_the_version_flag():
    code, out, _ = _run(cli_main, ["--help"])
    assert code == 0 and "--version" in out


# --------------------------------------------------------------------------- supported range


def test_supported_range_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in versions.SUPPORTED:
        assert f'"{name}{versions.specifier(name)}"' in pyproject, (name, versions.specifier(name))


def test_this_environment_is_supported():
    assert versions.problem() is None
    versions.require()


@pytest.mark.parametrize("version", ["0.7.10", "0.7.11", "0.7.10.post1", "0.7.99"])
def test_versions_inside_the_range_pass(monkeypatch, version):
    monkeypatch.setattr(versions, "installed", _installed({"mlx-vlm": version}))
    assert versions.problem() is None


@pytest.mark.parametrize("version", ["0.7.9", "0.8.0", "0.8.0rc1", "0.8.1", "1.0", "0.6", "nightly"])
def test_versions_outside_the_range_give_one_line(monkeypatch, version):
    monkeypatch.setattr(versions, "installed", _installed({"mlx-vlm": version}))
    message = versions.problem()
    assert message == (
        f"mlx-voicechat-plugin {mlx_voicechat_plugin.__version__} supports mlx-vlm >=0.7.10,<0.8, "
        f"but mlx-vlm {version} is installed (pip install 'mlx-vlm>=0.7.10,<0.8')"
    )
    with pytest.raises(versions.UnsupportedVersionError, match=re.escape(message)):
        versions.require()


def test_a_missing_upstream_is_named(monkeypatch):
    monkeypatch.setattr(versions, "installed", _installed({"mlx-audio": None}))
    assert "supports mlx-audio >=0.6.2,<0.7, but it is not installed" in versions.problem()


@pytest.fixture
def unsupported(monkeypatch):
    """mlx-vlm 0.8.1 as far as the plugin's version lookup can tell."""
    monkeypatch.setattr(versions, "installed", _installed({"mlx-vlm": "0.8.1"}))
    return "mlx-vlm 0.8.1 is installed"


def _one_error_line(err: str, words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: mlx-voicechat-plugin ") and words in lines[0], err
    assert ">=0.7.10,<0.8" in lines[0] and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--audio", str(SPEECH_WAV), "--output-audio", "answer.wav"],
        ["serve", "--port", "8765"],
        ["demo", "build", "ckpt"],
    ],
    ids=["generate", "serve", "demo"],
)
def test_commands_refuse_an_unsupported_mlx_vlm_in_one_line(unsupported, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(cli_main, argv)
    assert code == EXIT_FAILURE
    _one_error_line(err, unsupported)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_the_version_flag_still_works_with_an_unsupported_mlx_vlm(unsupported):
    code, out, _ = _run(cli_main, ["--version"])
    assert code == 0 and "mlx-vlm 0.8.1" in out


def test_mlx_vlm_generate_refuses_an_unsupported_mlx_vlm_in_one_line(unsupported, tiny, tmp_path, monkeypatch):
    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    output = tmp_path / "answer.wav"
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.generate", "--model", str(tiny), "--audio", str(SPEECH_WAV),
                                      "--output-audio", str(output)])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            dispatch.main()
    assert caught.value.code == EXIT_FAILURE
    _one_error_line(err.getvalue(), unsupported)
    assert not output.exists()


def test_load_refuses_an_unsupported_mlx_vlm(unsupported, tiny):
    from mlx_voicechat_plugin.loading import load

    with pytest.raises(versions.UnsupportedVersionError, match="mlx-vlm 0.8.1 is installed"):
        load(tiny)


def test_the_entry_point_module_refuses_an_unsupported_mlx_vlm(tiny):
    """``mlx_vlm.load`` resolves ``nemotron_voicechat`` to this package's entry point; its
    import fails with the one-line reason, raised before any upstream module is touched."""
    code = (
        "import mlx_voicechat_plugin.versions as v\n"
        "real = v.installed\n"
        "v.installed = lambda name: '0.8.1' if name == 'mlx-vlm' else real(name)\n"
        "import mlx_vlm, sys\n"
        "mlx_vlm.load(sys.argv[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TRANSFORMERS_VERBOSITY="error"))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx_voicechat_plugin.versions.UnsupportedVersionError: ")
    assert "mlx-vlm 0.8.1 is installed" in last and ">=0.7.10,<0.8" in last


def test_a_hook_that_does_not_fit_an_unsupported_mlx_vlm_leaves_it_importable(monkeypatch):
    """Another model's import of an mlx-vlm module keeps working when a hook cannot apply
    to it; within the range the same failure is raised (a bug)."""
    from mlx_voicechat_plugin.registration.shim import _HookedLoader

    class Loader:
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            module.ran = True

    def hook(module):
        raise AttributeError("module has no attribute 'get_model_and_args'")

    module = type(sys)("fake_upstream")
    with pytest.raises(AttributeError):
        _HookedLoader(Loader(), hook).exec_module(module)
    monkeypatch.setattr(versions, "installed", _installed({"mlx-vlm": "0.8.1"}))
    module = type(sys)("fake_upstream")
    _HookedLoader(Loader(), hook).exec_module(module)
    assert module.ran

"""The wheel and the source distribution carry what the installed package needs, and no junk.

The wheel is built here (hatchling without build isolation: offline, a few seconds) and
compared with the checkout:

* every file of the package that git knows of (tracked, or new and not ignored) is in the
  wheel: the modules and each data file opened at run time (the C++ kernel source compiled
  on first load, the browser page), so a data file added later is covered without editing
  this test; plus the files ``force-include`` adds (the ``.pth`` start-up shim, the bundled
  spoken question), and the paths the code opens, read from the code's own constants;
* ``entry_points.txt`` declares the ``mlx_vlm.models`` entry point and the console scripts
  of ``pyproject.toml``, each naming a module in the wheel that defines the object;
* nothing else: no caches, byte code, built kernels or tests.

The source distribution holds every file git tracks and none of a checkout's local
state (virtual environments, build outputs, caches, checkpoints and answers the README's
commands write).
"""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

import pytest

import mlx_voicechat_plugin

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib or tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlx_voicechat_plugin"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Path parts that never belong in a distribution.
JUNK_PARTS = {"__pycache__", ".venv", ".venv-gpu", ".git", ".pytest_cache", ".ruff_cache",
              ".hypothesis", "artifacts", "dist", "build", ".whl", ".gl", "demo-ckpt", "demo-small"}
JUNK_SUFFIXES = (".pyc", ".pyo", ".so", ".dylib", ".o", ".egg-info")
#: Files the README's commands write into the checkout.
JUNK_NAMES = {"answer.wav", "response.wav", "response_vlm.wav", "response_ws.wav"}


def _build(kind: str, out: Path) -> Path:
    """Build one distribution (``wheel`` or ``sdist``) of the checkout into ``out``."""
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling (the dev extra)")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (the expected files come from git)")
    try:
        import build  # noqa: F401

        command = [sys.executable, "-m", "build", f"--{kind}", "--no-isolation", "--outdir", str(out), str(ROOT)]
    except ImportError:
        if kind != "wheel":
            pytest.skip("building the source distribution needs the build package (the dev extra)")
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "--wheel-dir", str(out), str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=out)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    found = sorted(out.glob("*.whl" if kind == "wheel" else "*.tar.gz"))
    assert len(found) == 1, found
    return found[0]


def _git_files(under: str = ".", *, untracked: bool = True) -> list[str]:
    """Files git knows of under ``under`` that exist: tracked, and (``untracked``) new ones
    that are not ignored."""
    others = ["--others", "--exclude-standard"] if untracked else []
    listed = subprocess.run(
        ["git", "ls-files", "--cached", *others, "-z", "--", under],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split("\0")
    return sorted(name for name in listed if name and (ROOT / name).is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    with zipfile.ZipFile(_build("wheel", tmp_path_factory.mktemp("wheel"))) as archive:
        yield archive


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> list[str]:
    with tarfile.open(_build("sdist", tmp_path_factory.mktemp("sdist"))) as archive:
        names = archive.getnames()
    top = {PurePosixPath(name).parts[0] for name in names}
    assert len(top) == 1, top
    return sorted(str(PurePosixPath(*PurePosixPath(name).parts[1:])) for name in names
                  if len(PurePosixPath(name).parts) > 1 and not name.endswith("/"))


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    matches = [entry for entry in wheel.namelist() if entry.endswith(f".dist-info/{name}")]
    assert len(matches) == 1, (name, matches)
    return wheel.read(matches[0]).decode()


def _force_included() -> dict[str, str]:
    return PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"].get("force-include", {})


def _is_junk(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return (bool(JUNK_PARTS.intersection(parts)) or name.endswith(JUNK_SUFFIXES)
            or parts[-1] in JUNK_NAMES)


def test_every_package_file_git_knows_is_in_the_wheel(wheel):
    package_files = _git_files(PACKAGE)
    data_files = [name for name in package_files if not name.endswith(".py")]
    assert f"{PACKAGE}/accel/cpu/native/kernels.cpp" in data_files  # the listing works
    missing = sorted(set(package_files) - set(wheel.namelist()))
    assert not missing, f"the wheel lacks {missing} (pyproject.toml [tool.hatch.build])"


def test_force_included_files_are_in_the_wheel(wheel):
    forced = _force_included()
    assert forced.get("mlx_voicechat_plugin.pth") == "mlx_voicechat_plugin.pth"
    for source, target in forced.items():
        assert target in wheel.namelist(), target
        assert wheel.read(target) == (ROOT / source).read_bytes(), source


def test_the_files_the_code_opens_are_in_the_wheel(wheel):
    """Each path the installed package opens, taken from the code that opens it."""
    from mlx_voicechat_plugin.accel.cpu.native import build as native_build
    from mlx_voicechat_plugin.demo import sample

    package_root = Path(mlx_voicechat_plugin.__file__).parent
    opened = [
        native_build.SOURCE.relative_to(package_root),                 # compiled on first load
        Path("server") / "static" / "voicechat.html",                   # GET /voicechat
        Path("data") / sample.NAME,                                     # demo.sample_speech()
    ]
    names = set(wheel.namelist())
    for path in opened:
        assert f"{PACKAGE}/{path.as_posix()}" in names, path
    # The page is read from beside the app module (server/app.py opens it so).
    assert '"static" / "voicechat.html"' in (package_root / "server" / "app.py").read_text()


def test_the_pth_shim_imports_a_module_of_the_wheel(wheel):
    line = wheel.read("mlx_voicechat_plugin.pth").decode().strip()
    assert line == "import mlx_voicechat_plugin._autoload"
    assert f"{PACKAGE}/_autoload.py" in wheel.namelist()


def _defines(source: str, name: str) -> bool:
    tree = ast.parse(source)
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.ImportFrom))
               and (getattr(node, "name", None) == name
                    or any(getattr(target, "id", None) == name for target in getattr(node, "targets", []))
                    or any((alias.asname or alias.name) == name for alias in getattr(node, "names", [])))
               for node in tree.body)


def test_entry_points_match_pyproject_and_resolve_in_the_wheel(wheel):
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(_dist_info(wheel, "entry_points.txt"))
    declared = {
        "console_scripts": PYPROJECT["project"]["scripts"],
        **PYPROJECT["project"]["entry-points"],
    }
    assert declared["mlx_vlm.models"] == {"nemotron_voicechat": "mlx_voicechat_plugin.model"}
    assert set(declared["console_scripts"]) == {"mlx-voicechat", "mlx-voicechat-file-client", "mlx-voicechat-mic"}
    names = set(wheel.namelist())
    for group, entries in declared.items():
        assert dict(parser[group]) == entries, group
        for target in entries.values():
            module, _, attribute = target.partition(":")
            path = module.replace(".", "/")
            source = f"{path}.py" if f"{path}.py" in names else f"{path}/__init__.py"
            assert source in names, target
            if attribute:
                assert _defines(wheel.read(source).decode(), attribute), target


def test_wheel_metadata_carries_the_version_and_supported_range(wheel):
    metadata = _dist_info(wheel, "METADATA")
    assert f"\nVersion: {mlx_voicechat_plugin.__version__}\n" in metadata
    assert "\nRequires-Dist: mlx-vlm<0.8,>=0.7.10\n" in metadata
    assert "\nRequires-Dist: mlx-audio<0.7,>=0.6.2\n" in metadata


def test_the_wheel_holds_nothing_else(wheel):
    allowed_roots = {PACKAGE, "mlx_voicechat_plugin.pth"}
    for name in wheel.namelist():
        root = PurePosixPath(name).parts[0]
        assert root in allowed_roots or root.endswith(".dist-info"), name
        assert not _is_junk(name), name


def test_the_sdist_holds_every_tracked_file_and_no_junk(sdist):
    missing = sorted(set(_git_files(untracked=False)) - set(sdist))
    assert not missing, f"the sdist lacks {missing} (pyproject.toml [tool.hatch.build.targets.sdist])"
    junk = [name for name in sdist if _is_junk(name)]
    assert not junk, junk
    assert "PKG-INFO" in sdist and "tests/data/question.wav" in sdist

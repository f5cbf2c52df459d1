"""Build and load the exact CPU kernels (``kernels.cpp``) on first use.

The extension is compiled on the machine that runs it, against the MLX that is installed
(its headers and ``libmlx`` ship in the ``mlx`` wheel) and with ``nanobind`` (a dependency),
the binding library MLX itself uses, so the ``mx.array`` arguments cross without copies.
A build takes a few seconds, once per machine and MLX version: the shared object is cached
under :func:`~mlx_voicechat_plugin.demo.cache.cache_root` ``/native/<key>/``, where the
key covers the source, the MLX, nanobind and Python versions, the compiler and the CPU.

Concurrent builders are serialised with a file lock; a build is written under a temporary
name and renamed into place, and its SHA-256 is recorded beside it: a cached library that no
longer matches (truncated, replaced) is rebuilt rather than loaded.

Nothing here is required: when a compiler, the Python headers, MLX's headers or a matching
nanobind are missing, when the build fails, or when the loaded kernel does not reproduce
``mx.matmul`` bit for bit on a self-test, :func:`load` returns ``None`` with the reason and
the package keeps MLX's own products (same results, slower).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.cpp")
MODULE = "_kernels"
#: Compiler flags for the kernel. ``-ffp-contract=off`` keeps every multiply and add
#: separately rounded, as MLX's products round them.
KERNEL_FLAGS = ("-O3", "-march=native", "-ffp-contract=off")
#: Seconds a single compiler call may take.
COMPILE_TIMEOUT = 600


class BuildError(RuntimeError):
    """The extension could not be built or loaded (the message says why)."""


def _mlx_root() -> Path:
    import mlx.core as mx

    return Path(mx.__file__).resolve().parent


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise BuildError("no C++ compiler found (set CXX, or install g++)")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_inputs() -> dict[str, str]:
    import mlx.core as mx

    try:
        import nanobind
    except ImportError:
        raise BuildError("nanobind is not installed") from None
    compiler = _compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        raise BuildError(f"{compiler} --version failed: {error}") from None
    mlx_root = _mlx_root()
    include = mlx_root / "include"
    libdir = mlx_root / "lib"
    if not (include / "mlx" / "mlx.h").is_file() or not libdir.is_dir():
        raise BuildError(f"MLX's C++ headers/library are not installed under {mlx_root}")
    python_include = sysconfig.get_paths()["include"]
    if not Path(python_include, "Python.h").is_file():
        raise BuildError(f"Python headers (Python.h) not found in {python_include}")
    return {
        "compiler": compiler,
        "compiler_version": version,
        "mlx": mx.__version__,
        "mlx_include": str(include),
        "mlx_lib": str(libdir),
        "nanobind": nanobind.__version__,
        "nanobind_include": nanobind.include_dir(),
        "nanobind_source": nanobind.source_dir(),
        "python_include": python_include,
        "suffix": importlib.machinery.EXTENSION_SUFFIXES[0],
        "cpu": _cpu_signature(),
    }


def build_key(inputs: dict[str, str]) -> str:
    """Hex digest identifying one build (source, versions, compiler, CPU)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for name in sorted(inputs):
        digest.update(f"{name}={inputs[name]}\n".encode())
    digest.update(" ".join(KERNEL_FLAGS).encode())
    return digest.hexdigest()[:20]


def _run(command: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"{command[0]} failed to run: {error}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise BuildError(f"compiling the native kernel failed:\n{tail}")


def _compile(inputs: dict[str, str], target: Path) -> None:
    nanobind_root = Path(inputs["nanobind_include"]).parent
    common = [
        "-std=c++20",
        "-fPIC",
        "-fvisibility=hidden",
        "-DNDEBUG",
        "-DNB_COMPACT_ASSERTIONS",
        f"-I{inputs['python_include']}",
        f"-I{inputs['nanobind_include']}",
        f"-I{nanobind_root / 'ext' / 'robin_map' / 'include'}",
    ]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        work = Path(scratch)
        compiler = inputs["compiler"]
        _run(
            [
                compiler,
                *common,
                "-O2",
                "-fno-strict-aliasing",
                "-ffunction-sections",
                "-fdata-sections",
                "-c",
                str(Path(inputs["nanobind_source"]) / "nb_combined.cpp"),
                "-o",
                "nanobind.o",
            ],
            work,
        )
        _run(
            [
                compiler,
                *common,
                *KERNEL_FLAGS,
                "-DNB_DOMAIN=mlx",
                f"-I{inputs['mlx_include']}",
                "-c",
                str(SOURCE),
                "-o",
                "kernel.o",
            ],
            work,
        )
        linked = work / target.name
        _run(
            [
                compiler,
                *_link_flags(),
                "kernel.o",
                "nanobind.o",
                f"-L{inputs['mlx_lib']}",
                "-lmlx",
                f"-Wl,-rpath,{inputs['mlx_lib']}",
                "-o",
                str(linked),
            ],
            work,
        )
        if not linked.is_file():
            raise BuildError(f"the compiler ({compiler}) reported success but wrote no library")
        os.replace(linked, target)


def _link_flags() -> list[str]:
    """Shared-library flags for this platform's linker: Apple's ld has no
    ``--gc-sections`` (its equivalent is ``-dead_strip``) and wants undefined Python symbols
    resolved at load time."""
    if sys.platform == "darwin":
        return ["-shared", "-undefined", "dynamic_lookup", "-Wl,-dead_strip"]
    return ["-shared", "-Wl,--gc-sections"]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    """The cached object exists and matches the digest recorded when it was built (a
    truncated or replaced file would crash the process when loaded)."""
    record = target.with_name(target.name + ".sha256")
    try:
        return target.is_file() and record.read_text().strip() == _digest(target)
    except OSError:
        return False


def _import(path: Path):
    name = f"{__package__}.{MODULE}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise BuildError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        raise BuildError(f"cannot import the native kernel {path}: {error}") from None
    sys.modules[name] = module
    return module


def build(cache: Path | None = None) -> Path:
    """Compile the extension if it is not cached; return the shared object's path.

    Raises:
        BuildError: no compiler / headers / nanobind, or the compiler failed.
    """
    if cache is None:
        from ....demo.cache import cache_root

        cache = cache_root() / "native"
    inputs = _build_inputs()
    directory = cache / build_key(inputs)
    target = directory / f"{MODULE}{inputs['suffix']}"
    if _intact(target):
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _intact(target):
                _compile(inputs, target)
                target.with_name(target.name + ".sha256").write_text(_digest(target) + "\n")
    except OSError as error:
        raise BuildError(f"cannot build the native kernel in {directory}: {error}") from None
    if not _intact(target):
        raise BuildError(f"the native kernel build in {directory} left no intact library")
    return target


def load(cache: Path | None = None):
    """Build (if needed) and import the extension module.

    Raises:
        BuildError: see :func:`build`; or the module cannot be imported.
    """
    return _import(build(cache))

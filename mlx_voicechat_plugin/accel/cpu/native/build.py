"""Build and load the exact CPU kernels (``kernels.cpp``) on first use.

The extension is compiled on the machine that runs it, against the MLX that is installed
(its headers and ``libmlx`` ship in the ``mlx`` wheel) and with ``nanobind`` (a dependency),
the binding library MLX itself uses, so the ``mx.array`` arguments cross without copies.
A build takes about a minute (:data:`COMPILE_ESTIMATE`), once per machine and MLX version
(the commands print a progress line on stderr meanwhile): the shared object is cached
under :func:`~mlx_voicechat_plugin.demo.cache.cache_root` ``/native/<key>/``, where the
key covers the source, the MLX, nanobind and Python versions, the compiler, the CPU and the
instruction-set variant.

**Instruction-set variants.** The kernels' vector width is a compile-time constant chosen
from the target's macros (``kernels.cpp``): 16 floats for AVX-512, 8 for AVX2, 4 for arm64
NEON and for the portable fallback. :func:`requested_isa` picks this CPU's widest variant
(:data:`ISA_ENV` overrides it, e.g. ``MLX_VOICECHAT_NATIVE_ISA=avx2`` builds the
``-march=x86-64-v3`` variant on an AVX-512 machine) and :data:`ISA_FLAGS` gives each its
compiler flags; a variant the CPU cannot run is refused before compiling.

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
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.cpp")
MODULE = "_kernels"
#: Compiler flags for the kernel. ``-ffp-contract=off`` keeps every multiply and add
#: separately rounded, as MLX's products round them.
KERNEL_FLAGS = ("-O3", "-ffp-contract=off")
#: Environment switch: the instruction-set variant to build (``auto``: this CPU's widest).
ISA_ENV = "MLX_VOICECHAT_NATIVE_ISA"
#: Target flags per variant (``-march`` names the x86-64 psABI levels v4 / v3; arm64's
#: baseline includes NEON).
ISA_FLAGS = {
    "avx512": ("-march=x86-64-v4",),
    "avx2": ("-march=x86-64-v3",),
    "neon": (),
    "generic": (),
}
_X86 = ("x86_64", "amd64", "x64", "i386", "i686")
_ARM = ("aarch64", "arm64")
_AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AVX2 = {"avx2", "fma", "bmi2", "f16c"}
#: Seconds a single compiler call may take.
COMPILE_TIMEOUT = 600
#: How long the first build takes, for the progress line printed while it runs (the
#: nanobind support library and the kernels, compiled one after the other on one core).
COMPILE_ESTIMATE = "about a minute"


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


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; on macOS ``sysctl``), empty if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.lower().split())
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                capture_output=True, text=True, timeout=10,
            ).stdout
            return set(out.lower().replace(".", "_").split())
        except (OSError, subprocess.SubprocessError):
            pass
    return set()


def supported_isas(machine: str | None = None, flags: set[str] | None = None) -> list[str]:
    """The variants this CPU can run, widest first (always ending with ``"generic"``).

    Args:
        machine: ``platform.machine()`` (default: this machine).
        flags: CPU feature flags (default: :func:`cpu_flags`).
    """
    machine = (machine or platform.machine()).lower()
    flags = cpu_flags() if flags is None else flags
    isas = []
    if machine in _X86:
        if _AVX512 <= flags:
            isas.append("avx512")
        if _AVX2 <= flags:
            isas.append("avx2")
    elif machine in _ARM:
        isas.append("neon")
    return [*isas, "generic"]


def requested_isa(machine: str | None = None, flags: set[str] | None = None) -> str:
    """The variant to build: :data:`ISA_ENV` when set (``auto`` or unset: the widest this
    CPU runs).

    Raises:
        BuildError: an unknown name, or a variant this CPU cannot run.
    """
    supported = supported_isas(machine, flags)
    value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return supported[0]
    if value not in ISA_FLAGS:
        raise BuildError(f"{ISA_ENV} must be auto or one of {', '.join(ISA_FLAGS)}, got {value!r}")
    if value not in supported:
        raise BuildError(f"{ISA_ENV}={value}: this CPU runs only {', '.join(supported)}")
    return value


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_inputs(isa: str | None = None) -> dict[str, str]:
    import mlx.core as mx

    isa = isa or requested_isa()
    if isa not in supported_isas():
        raise BuildError(f"the {isa} variant cannot run on this CPU ({', '.join(supported_isas())} can)")

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
        "isa": isa,
    }


def build_key(inputs: dict[str, str]) -> str:
    """Hex digest identifying one build (source, versions, compiler, CPU)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for name in sorted(inputs):
        digest.update(f"{name}={inputs[name]}\n".encode())
    digest.update(" ".join(_kernel_flags(inputs)).encode())
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


def _nanobind_object(inputs: dict[str, str], common: list[str], cache: Path) -> Path:
    """nanobind's support library compiled once per compiler, nanobind and Python (shared by
    every variant in ``cache``; it has no target-specific code)."""
    digest = hashlib.sha256()
    for name in ("compiler", "compiler_version", "nanobind", "python_include", "suffix"):
        digest.update(f"{name}={inputs[name]}\n".encode())
    digest.update(" ".join(common).encode())
    target = cache / f"nanobind-{digest.hexdigest()[:16]}.o"
    if _intact(target):
        return target
    with open(cache / ".nanobind.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _intact(target):
            with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as scratch:
                _run(
                    [
                        inputs["compiler"],
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
                    Path(scratch),
                )
                os.replace(Path(scratch) / "nanobind.o", target)
            target.with_name(target.name + ".sha256").write_text(_digest(target) + "\n")
    return target


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
    compiler = inputs["compiler"]
    nanobind = _nanobind_object(inputs, common, target.parent.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        work = Path(scratch)
        _run(
            [
                compiler,
                *common,
                *_kernel_flags(inputs),
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
                str(nanobind),
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


def _kernel_flags(inputs: dict[str, str]) -> list[str]:
    """Optimisation and target flags of the kernel object for ``inputs["isa"]``."""
    return [*KERNEL_FLAGS, *ISA_FLAGS[inputs.get("isa", "generic")]]


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


def _import(path: Path, register: bool = True):
    name = f"{__package__}.{MODULE}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise BuildError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        raise BuildError(f"cannot import the native kernel {path}: {error}") from None
    if register:
        sys.modules[name] = module
    return module


def default_cache() -> Path:
    """Where builds are cached: :func:`~mlx_voicechat_plugin.demo.cache.cache_root` ``/native``."""
    from ....demo.cache import cache_root

    return cache_root() / "native"


def build(cache: Path | None = None, isa: str | None = None) -> Path:
    """Compile the extension if it is not cached; return the shared object's path.

    Args:
        cache: the cache directory (default :func:`default_cache`).
        isa: the variant (default :func:`requested_isa`).

    Raises:
        BuildError: no compiler / headers / nanobind, a variant this CPU cannot run, or the
            compiler failed.
    """
    if cache is None:
        cache = default_cache()
    inputs = _build_inputs(isa)
    directory = cache / build_key(inputs)
    target = directory / f"{MODULE}{inputs['suffix']}"
    if _intact(target):
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _intact(target):
                from ....progress import logger as progress

                started = time.monotonic()
                progress().info(
                    "[native] compiling the native CPU kernels for this machine and MLX (%s variant; "
                    "one time, %s) ...", inputs.get("isa", "default"), COMPILE_ESTIMATE)
                _compile(inputs, target)
                progress().info("[native] ... done in %.0f s", time.monotonic() - started)
                target.with_name(target.name + ".sha256").write_text(_digest(target) + "\n")
    except OSError as error:
        raise BuildError(f"cannot build the native kernel in {directory}: {error}") from None
    if not _intact(target):
        raise BuildError(f"the native kernel build in {directory} left no intact library")
    return target


def load(cache: Path | None = None, isa: str | None = None, register: bool = True):
    """Build (if needed) and import the extension module (``module.isa`` names its variant).

    Args:
        register: make it the package's ``_kernels`` module in ``sys.modules`` (False for
            a second variant loaded beside it, e.g. by tests).

    Raises:
        BuildError: see :func:`build`; or the module cannot be imported.
    """
    return _import(build(cache, isa), register=register)

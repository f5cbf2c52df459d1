"""Build a demo checkpoint directory with the published on-disk layout."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..seed import is_seed
from .presets import PRESETS, config_for

#: Shard size limit for ``model-0000N-of-0000M.safetensors`` (bytes); small enough that
#: the ``medium`` preset is split like the published multi-shard checkpoints.
SHARD_BYTES = 64 * 1024 * 1024
#: Shard size limit of the ``full`` preset (bytes): each shard is computed, written and
#: freed before the next, so this bounds the builder's working set.
FULL_SHARD_BYTES = 2 * 1024**3


def build_checkpoint(
    output_dir: str | Path,
    preset: str = "tiny",
    *,
    bits: int | None = None,
    group_size: int = 64,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Build a random-weight NemotronLabs VoiceChat checkpoint.

    The directory holds ``config.json`` (full schema), ``model.safetensors.index.json``
    with ``model-*.safetensors`` shards in the stored key layout, a byte-level BPE
    ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``) and
    ``rnnt_tokenizer/tokenizer.model``.

    Args:
        output_dir: where to write; created. Written atomically (temp dir + rename).
        preset: ``tiny``, ``small``, ``medium``, ``real-layout`` or ``full`` (see
            :mod:`.presets`).
        bits: ``4`` or ``8`` quantizes the LLM parts, ``None`` keeps bf16.
        group_size: quantization group size (32, 64 or 128; the published one is 64).
        seed: MLX RNG seed for the weights (tokenizers are deterministic).
        overwrite: replace an existing directory.
        progress: called with one line per step (default for ``full``: print to stderr
            with the elapsed time; other presets: silent).

    Returns:
        The checkpoint path.

    Raises:
        ValueError: unknown preset, bits or group size.
        FileExistsError: ``output_dir`` exists and ``overwrite`` is false.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig

    from . import tokenizers, weights

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be 4 or 8 (or omitted for bf16), got {bits!r}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size!r}")
    if not is_seed(seed):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if not str(output_dir).strip():
        raise ValueError("the output directory name is empty")
    output = Path(output_dir).expanduser().absolute()
    _check_replaceable(output, overwrite)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        staging.chmod(0o755)
    except OSError as error:
        raise ValueError(f"cannot create {output}: {error.strerror or error}") from None
    spec = PRESETS[preset]
    if progress is None:
        progress = _stderr_progress() if preset == "full" else (lambda line: None)
    try:
        if spec.tokenizer == "large":
            text_vocab = tokenizers.build_large_tokenizer(staging, spec.text_vocab_size)
        else:
            text_vocab = tokenizers.build_text_tokenizer(staging, spec.text_vocab_size)
        rnnt_vocabulary = tokenizers.build_rnnt_vocabulary(
            staging, spec.rnnt_vocab_size, extended=spec.rnnt_vocab_size > 512
        )
        config = config_for(spec, text_vocab, rnnt_vocabulary)
        progress(f"tokenizers written ({text_vocab} text tokens, {len(rnnt_vocabulary)} RNNT pieces)")

        from tokenizers import Tokenizer

        vocabulary = Tokenizer.from_file(str(staging / "tokenizer.json")).get_vocab()
        mx.random.seed(seed)
        # Parameters stay lazy (nothing is computed) until their shard is written.
        model = Model(ModelConfig.from_dict(config))
        if spec.fast_fill:
            progress(f"{weights.fast_fill(model, seed)} large weights filled from a tiled random block")
        weights.randomize(model, vocabulary, config)
        weights.cast_for_storage(model)
        weights.set_codec_silence(model)
        if bits is not None:
            head_bits = spec.head_bits if spec.head_bits is not None else bits
            chosen = weights.quantize_llm(model, bits, group_size, head_bits=head_bits)
            if spec.quantization_form == "modules":
                quantization = {"group_size": group_size, "bits": bits, **chosen}
            else:
                quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
            config["quantization"] = quantization
            config["quantization_config"] = dict(quantization)
        stored = weights.to_checkpoint_layout(dict(tree_flatten(model.parameters())), config)
        del model
        if spec.int64_buffers:
            stored = weights.widen_integer_buffers(stored)
        limit = FULL_SHARD_BYTES if preset == "full" else SHARD_BYTES
        _write_shards(staging, stored, limit, progress)
        # The v2 converter writes ``time_step_limit: [0.0, Infinity]`` (non-standard JSON
        # that Python's json reads); only that preset field allows it.
        (staging / "config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False, allow_nan=spec.converter_extras) + "\n"
        )
        (staging / "README.md").write_text(
            f"# Demo NemotronLabs VoiceChat checkpoint ({preset}, "
            f"{'bf16' if bits is None else f'{bits}-bit LLM'}, seed {seed})\n\n"
            "Random weights in the published layout, built by `python -m "
            "mlx_voicechat_plugin.demo build`. For tests and demos only: it does not "
            "understand speech.\n"
        )
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _check_replaceable(output: Path, overwrite: bool) -> None:
    """Refuse to replace anything that is not a demo checkpoint (``overwrite`` never deletes
    the working directory, one of its parents, a file, or a directory of other content).

    Raises:
        FileExistsError: ``output`` exists and ``overwrite`` is false.
        ValueError: ``overwrite`` is true but ``output`` is not a demo checkpoint directory.
    """
    if not output.exists() and not output.is_symlink():
        return
    if not overwrite:
        raise FileExistsError(f"{output} already exists (pass overwrite=True)")
    resolved = output.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved == Path(resolved.anchor):
        raise ValueError(f"refusing to replace {output}: it is the working directory or one of its parents")
    if not output.is_dir() or output.is_symlink():
        raise ValueError(f"refusing to replace {output}: it is not a directory")
    readme = output / "README.md"
    config = output / "config.json"
    try:
        is_demo = readme.is_file() and "Demo NemotronLabs VoiceChat checkpoint" in readme.read_text(errors="replace") and config.is_file()
    except OSError:
        is_demo = False
    if not is_demo:
        raise ValueError(f"refusing to replace {output}: it is not a demo checkpoint built by this tool")


def shard_plan(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Group tensor names (sorted) into shards of at most ``limit`` bytes each.

    A tensor larger than ``limit`` gets a shard of its own.

    Args:
        sizes: ``{name: bytes}``.
        limit: shard size limit in bytes (> 0).

    Returns:
        The names of each shard, in file order.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(sizes):
        if size and size + sizes[key] > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += sizes[key]
    return shards


def _write_shards(
    folder: Path, stored: dict, limit: int = SHARD_BYTES, progress: Callable[[str], None] = lambda line: None
) -> None:
    """Write ``stored`` as ``model-*.safetensors`` shards plus the index.

    Each shard's tensors are computed (they may be lazy), written and released before the
    next shard, so at most one shard is resident. ``stored`` is emptied.
    """
    import mlx.core as mx

    plan = shard_plan({key: value.nbytes for key, value in stored.items()}, limit)
    weight_map = {}
    total = 0
    for index, names in enumerate(plan, start=1):
        name = f"model-{index:05d}-of-{len(plan):05d}.safetensors"
        shard = {key: stored.pop(key) for key in names}
        for key in names:  # one tensor's temporaries at a time, not the whole shard's
            mx.eval(shard[key])
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "mlx"})
        size = sum(value.nbytes for value in shard.values())
        del shard
        for key in names:
            weight_map[key] = name
        total += size
        progress(f"wrote {name} ({size / 1e9:.2f} GB, {len(names)} tensors)")
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")


def _stderr_progress() -> Callable[[str], None]:
    """A progress callback printing ``[elapsed s] line`` to stderr."""
    start = time.monotonic()

    def report(line: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    return report

"""Measurements at full size (results in docs/performance.md "Full size").

Build the checkpoint first (random weights, the published configuration):

    nice -n 10 python -m mlx_voicechat_plugin.demo build /work/full-ckpt/q4 --preset full --bits 4

then, one measurement at a time (each runs in its own subprocess and reports its peak RSS
from ``resource.getrusage``; keep them under the machine's free memory):

    python scripts/full_size.py load CKPT [--upstream]      # load time, RSS, pinning, peak
    python scripts/full_size.py stream CKPT --frames 8 [--offline-seconds 1 5]
    python scripts/full_size.py offline CKPT --seconds 1 5   # offline turns: stage times, peaks
    python scripts/full_size.py perception CKPT --minutes 1 2 [--upstream | --no-cpu-layer]
    python scripts/full_size.py perception CKPT --minutes 10 --upstream --layers 3  # by part, projected
    python scripts/full_size.py project CKPT                 # bytes per frame, Apple table
    python scripts/full_size.py products --rows 1 8 64 750   # quantized product, native vs MLX
    python scripts/full_size.py lm-products CKPT             # a frame's quantized products

``perception`` loads only the encoder and its projection (about 2.4 GB pinned at full
width), so long inputs fit beside the rest of the machine's work. With ``--layers K`` it runs
the same stack part by part (:class:`PerceptionParts`), evaluating after each part and only the
first K conformer layers, and projects the whole from them (the layers have identical shapes).
Each command prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

#: Published memory bandwidth of Apple chips (GB/s).
APPLE_BANDWIDTH_GBS = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
}
FRAME_MS = 80.0


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stored_bytes(path: Path) -> int:
    return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def _load(path: Path, upstream: bool):
    import mlx_vlm

    from mlx_voicechat_plugin.registration.hooks import upstream_models

    if upstream:
        with upstream_models():
            return mlx_vlm.load(str(path))
    from mlx_voicechat_plugin.loading import load

    return load(path)


def measure_load(path: Path, upstream: bool) -> dict:
    from mlx_voicechat_plugin.model.pinning import pinning_cost

    config = json.loads((path / "config.json").read_text())
    start = time.perf_counter()
    model, _ = _load(path, upstream)
    seconds = time.perf_counter() - start
    pinning = getattr(model, "pinning", None)
    return {
        "model": "upstream" if upstream else "ours",
        "load_s": round(seconds, 1),
        "stored_gb": _stored_bytes(path) / 1e9,
        "pinning_gb": (pinning.extra_bytes / 1e9) if pinning else 0.0,
        "pinning_from_config_gb": pinning_cost(config).extra_bytes / 1e9,
        "rss_after_load_gb": _rss() / 1e9,
        "peak_rss_gb": _peak_rss() / 1e9,
    }


def measure_stream(path: Path, frames: int, offline_seconds: list[float] | None = None) -> dict:
    import numpy as np

    model, tokenizer = _load(path, False)
    session = model.create_streaming_session(processor=tokenizer, system_prompt="Be concise.", seed=0, profile=True)
    rng = np.random.default_rng(0)
    samples = (0.05 * rng.standard_normal(frames * 1280)).astype(np.float32)
    for start in range(0, len(samples), 1280):
        session.push_audio(samples[start : start + 1280], 16000)
    summary = session.profile.summary(drop_first=min(2, frames - 1))
    session.cancel()
    result = {"frames": frames, "summary": summary}
    if offline_seconds:  # the same loaded model (a full-size load takes minutes here)
        result["offline"] = _offline_turns(model, tokenizer, offline_seconds)
    result["peak_rss_gb"] = _peak_rss() / 1e9
    return result


class _StageClock:
    """Wall seconds of the offline turn's stages, from wrappers installed on the offline
    runtime's module-level helpers (measurement only; the same values are computed).

    perception: log-mel + encoder, evaluated; language / rnnt: their worker threads (they
    overlap EAR-TTS); codec: the chunked decode; tts: the rest of the loop (EAR-TTS steps
    and waits for language ids), from the end of perception to the start of the decode.
    """

    def __init__(self):
        from mlx_voicechat_plugin.runtime import offline

        self.module = offline
        self.seconds: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self.saved = {}

    def __enter__(self):
        import mlx.core as mx

        offline = self.module
        for name, stage in (("_language_pass", "language"), ("greedy_transcript", "rnnt"),
                            ("decode_chunked", "codec")):
            self.saved[name] = getattr(offline, name)
            setattr(offline, name, self._timed(self.saved[name], stage))
        mel = offline.log_mel_spectrogram
        self.saved["log_mel_spectrogram"] = mel

        def timed_mel(*args, **kwargs):
            self.marks["start"] = time.perf_counter()
            return mel(*args, **kwargs)

        offline.log_mel_spectrogram = timed_mel
        self.saved["eval"] = offline.mx

        class _Mx:  # the first eval after the mel is the perception's (audio/asr embeds)
            def __getattr__(_, name):
                return getattr(mx, name)

            def eval(_, *arrays):
                mx.eval(*arrays)
                if "perception" not in self.seconds and "start" in self.marks:
                    self.marks["perception_end"] = time.perf_counter()
                    self.seconds["perception"] = self.marks["perception_end"] - self.marks["start"]

        offline.mx = _Mx()
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(self.module, "mx" if name == "eval" else name, value)

    def _timed(self, function, stage):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            if stage == "codec" and "perception_end" in self.marks:
                self.seconds["tts"] = start - self.marks["perception_end"]
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[stage] = time.perf_counter() - start

        return wrapper


def _offline_turns(model, tokenizer, seconds: list[float]) -> list[dict]:
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    turns = []
    for length in seconds:
        samples = (0.05 * rng.standard_normal(round(length * 16000))).astype(np.float32)
        mx.reset_peak_memory()
        start = time.perf_counter()
        with _StageClock() as clock:
            result = model.create_session(tokenizer).generate(samples, extra_decoding_seconds=0.0, seed=0)
        turns.append({
            "input_s": length, "frames": result.frames, "wall_s": round(time.perf_counter() - start, 1),
            "stage_s": {stage: round(value, 2) for stage, value in clock.seconds.items()},
            "mlx_peak_gb": mx.get_peak_memory() / 1e9, "peak_rss_gb": _peak_rss() / 1e9,
        })
    return turns


def measure_offline(path: Path, seconds: list[float]) -> dict:
    model, tokenizer = _load(path, False)
    return {"turns": _offline_turns(model, tokenizer, seconds), "peak_rss_gb": _peak_rss() / 1e9}


def _perception_only(path: Path, upstream: bool, cpu_layer: bool = True):
    """The encoder and its projection with the checkpoint's weights (sanitized as the loader
    does; ours pinned to f32 as at load and, with ``cpu_layer``, with the CPU layer's
    perception parts installed as a CPU load installs them: two-core products, native
    kernels, subsampling split, exact attention; self-measured on these shapes)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.nemotron_voicechat import Model as UpstreamModel
    from mlx_vlm.models.nemotron_voicechat import ModelConfig

    from mlx_voicechat_plugin.model import Model
    from mlx_voicechat_plugin.model.pinning import pin_f32_weights, pinning_enabled

    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = (UpstreamModel if upstream else Model)(config)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    wanted = {key for key in index if key.startswith("stt_model.perception.") and ".preprocessor." not in key}
    weights = {}
    for shard in sorted({index[key] for key in wanted}):
        loaded = mx.load(str(path / shard))
        weights.update({key: loaded[key] for key in wanted if key in loaded})
        del loaded
    weights = model.sanitize(weights)
    perception = model.stt_model.perception
    perception.load_weights([(key[len("stt_model.perception."):], value) for key, value in weights.items()])
    del weights
    if not upstream and pinning_enabled():  # as the loader pins: paths from the model's root
        pin_f32_weights(perception, prefix="stt_model.perception.")
    mx.eval(perception.parameters())
    if not upstream and cpu_layer:
        from mlx_voicechat_plugin.accel.cpu import native
        from mlx_voicechat_plugin.accel.cpu.attention import install_exact_attention
        from mlx_voicechat_plugin.accel.cpu.convolutions import install_depthwise
        from mlx_voicechat_plugin.accel.cpu.encoder import install_subsampling_split
        from mlx_voicechat_plugin.accel.cpu.norms import install_kernel_norms
        from mlx_voicechat_plugin.accel.cpu.parallel import install_split_linears

        native.available()
        install_split_linears(perception)
        install_kernel_norms(perception)
        install_depthwise(perception)
        install_subsampling_split(perception.encoder.pre_encode)
        install_exact_attention(perception.encoder)
        if native.available():
            from mlx_voicechat_plugin.accel.cpu.shapes import model_workloads

            native.calibrate(model_workloads(perception, native.extension()))
    return model, sum(v.nbytes for _, v in tree_flatten(perception.parameters()))


class _TimedPart:
    """Stands in for one part of the perception stack: calls it, evaluates what it returns
    (``mx.eval``), records wall (``perf_counter``) and CPU (``process_time``: every thread of
    the process) seconds and the process's peak RSS so far (GB) in ``clock``; other
    attributes are the part's own."""

    def __init__(self, clock: PerceptionParts, name: str, function):
        object.__setattr__(self, "_clock", clock)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_function", function)

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        wall, cpu = time.perf_counter(), time.process_time()
        outputs = self._function(*args, **kwargs)
        mx.eval(outputs)
        self._clock.parts.append({"part": self._name, "wall_s": time.perf_counter() - wall,
                                  "cpu_s": time.process_time() - cpu, "peak_rss_gb": _peak_rss() / 1e9})
        return outputs

    def __getattr__(self, name):
        return getattr(self._function, name)


class PerceptionParts:
    """Times the perception stack part by part while the model's own ``__call__`` runs.

    Inside the ``with`` block, ``perception(mel, lengths)`` (upstream ``Perception.__call__``,
    mlx-vlm ``nemotron_voicechat/model.py``, and its encoder's ``Conformer.__call__``, mlx-audio
    ``nemotron_asr/conformer.py``, or ours, ``BandedConformer``) runs unchanged except that its
    parts are wrapped by :class:`_TimedPart` and only the first ``layers`` conformer layers
    run. Parts, in order: ``pre_encode`` (subsampling), ``pos_enc`` (scaling and positional
    embedding), ``mask`` (upstream's dense ``create_chunked_limited_mask``; absent on ours'
    banded path, which builds each block's mask inside the layer), ``layer.0`` ...
    ``layer.{layers-1}``, ``proj``. Each part is evaluated before the next starts, so a part's
    time is its own; the projection's input is the last run layer's output (same shape as
    the whole encoder's). Everything is restored on exit.

    Args:
        perception: the ``Perception`` module (``model.stt_model.perception``).
        layers: conformer layers to run, ``1 <= layers <= n_layers``; None runs them all.

    Raises:
        ValueError: ``layers`` outside that range.
    """

    def __init__(self, perception, layers: int | None = None):
        self.perception = perception
        self.total_layers = len(perception.encoder.layers)
        self.layers = self.total_layers if layers is None else layers
        if not 1 <= self.layers <= self.total_layers:
            raise ValueError(f"--layers must be 1..{self.total_layers} (the encoder's layers), got {layers}")
        self.parts: list[dict] = []

    def __enter__(self):
        from mlx_audio.stt.models.nemotron_asr import conformer

        encoder = self.perception.encoder
        self._saved = (encoder.pre_encode, encoder.pos_enc, encoder.layers, self.perception.proj,
                       conformer.create_chunked_limited_mask)
        encoder.pre_encode = _TimedPart(self, "pre_encode", encoder.pre_encode)
        encoder.pos_enc = _TimedPart(self, "pos_enc", encoder.pos_enc)
        encoder.layers = [_TimedPart(self, f"layer.{index}", layer)
                          for index, layer in enumerate(encoder.layers[: self.layers])]
        self.perception.proj = _TimedPart(self, "proj", self.perception.proj)
        conformer.create_chunked_limited_mask = _TimedPart(self, "mask", conformer.create_chunked_limited_mask)
        return self

    def __exit__(self, *exc):
        from mlx_audio.stt.models.nemotron_asr import conformer

        encoder = self.perception.encoder
        (encoder.pre_encode, encoder.pos_enc, encoder.layers, self.perception.proj,
         conformer.create_chunked_limited_mask) = self._saved

    def projection(self, front_end: dict | None = None) -> dict:
        """The whole perception projected from the measured parts: every non-layer part once
        (plus ``front_end``, a part dict such as the log-mel's) and ``n_layers`` x the median
        measured layer, for ``wall_s`` and ``cpu_s``."""
        import statistics

        layers = [part for part in self.parts if part["part"].startswith("layer.")]
        others = [part for part in self.parts if not part["part"].startswith("layer.")]
        others += [front_end] if front_end else []
        return {
            key: sum(part[key] for part in others)
            + self.total_layers * statistics.median(part[key] for part in layers)
            for key in ("wall_s", "cpu_s")
        }


def _log_mel(model, minutes: float):
    """Log-mel of ``minutes`` of seeded noise (16 kHz), evaluated; with its wall / CPU seconds."""
    import mlx.core as mx
    import numpy as np
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    samples = (0.05 * np.random.default_rng(0).standard_normal(round(minutes * 60 * 16000))).astype(np.float32)
    wall, cpu = time.perf_counter(), time.process_time()
    mel = log_mel_spectrogram(mx.array(samples), model.config.audio_config.preprocessor)
    mx.eval(mel)
    return mel, {"part": "log_mel", "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                 "peak_rss_gb": _peak_rss() / 1e9}


def measure_perception_parts(path: Path, minutes: float, upstream: bool, layers: int, cpu_layer: bool = True) -> dict:
    """:class:`PerceptionParts` over ``minutes`` of input with the first ``layers`` layers:
    per-part wall / CPU seconds and the projected whole (log-mel + parts + n_layers x median
    layer); peak RSS of the process (a layer's transient is the same in every layer)."""
    import mlx.core as mx

    model, weight_bytes = _perception_only(path, upstream, cpu_layer)
    rss_loaded = _rss()
    mel, front_end = _log_mel(model, minutes)
    perception = model.stt_model.perception
    with PerceptionParts(perception, layers) as clock:
        outputs = perception(mel, mx.array([mel.shape[1]]))
    projected = clock.projection(front_end)
    return {
        "model": "upstream" if upstream else "ours" if cpu_layer else "ours, no CPU layer",
        "minutes": minutes,
        "encoder_frames": int(outputs[0].shape[1]),
        "layers_measured": clock.layers,
        "layers_total": clock.total_layers,
        "parts": [{**part, "wall_s": round(part["wall_s"], 2), "cpu_s": round(part["cpu_s"], 2),
                   "peak_rss_gb": round(part["peak_rss_gb"], 3)}
                  for part in [front_end, *clock.parts]],
        f"projected_from_{clock.layers}_layers": {key: round(value, 1) for key, value in projected.items()},
        "weights_gb": weight_bytes / 1e9,
        "rss_loaded_gb": rss_loaded / 1e9,
        "peak_rss_gb": _peak_rss() / 1e9,
        "load_average": os.getloadavg(),
    }


def measure_perception(path: Path, minutes: float, upstream: bool, cpu_layer: bool = True) -> dict:
    import mlx.core as mx

    model, weight_bytes = _perception_only(path, upstream, cpu_layer)
    rss_loaded = _rss()
    mel, front_end = _log_mel(model, minutes)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = model.stt_model.perception(mel, mx.array([mel.shape[1]]))
    mx.eval(outputs)
    return {
        "model": "upstream" if upstream else "ours" if cpu_layer else "ours, no CPU layer",
        "minutes": minutes,
        "encoder_frames": int(outputs[0].shape[1]),
        "weights_gb": weight_bytes / 1e9,
        "rss_loaded_gb": rss_loaded / 1e9,
        "log_mel_s": round(front_end["wall_s"], 1),
        "log_mel_cpu_s": round(front_end["cpu_s"], 1),
        "perception_s": round(time.perf_counter() - start, 1),
        "perception_cpu_s": round(time.process_time() - cpu, 1),
        "peak_rss_gb": _peak_rss() / 1e9,
        "load_average": os.getloadavg(),
    }


def bytes_per_frame(path: Path) -> dict:
    """Weight bytes one streamed frame reads, from the stored tensors' sizes and the pinning.

    Every weight is read once per frame except gathered tables (token embeddings, EAR-TTS
    code and character tables, RVQ codebooks read by row) and the codec encoder (only at
    warm-up); EAR-TTS runs with classifier-free guidance (batch 2) but reads its weights once.
    Pinned tensors count 4 bytes per value.
    """
    import mlx.core as mx

    from mlx_voicechat_plugin.model.pinning import is_pinned_parameter

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    gathered = ("stt_model.embed_tokens.", "embed_subword.embed_tokens", "rvq_embs", "prvq.", "audio_codec.encoder.",
                "mog_head.low_mat", "audio_prompt_latents", "subword_flag_emb", "bos_eos_emb")
    total = 0
    by_part: dict[str, int] = {}
    for shard in sorted(set(index.values())):
        for key, value in mx.load(str(path / shard)).items():
            if any(part in key for part in gathered) or ".preprocessor." in key:
                continue
            size = value.nbytes
            if is_pinned_parameter(key) and value.dtype == mx.bfloat16:
                size *= 2
            total += size
            part = key.split(".")[0] + "." + key.split(".")[1]
            by_part[part] = by_part.get(part, 0) + size
    table = {
        chip: {"floor_ms_per_frame": round(total / (bandwidth * 1e9) * 1000, 2),
               "real_time_by_floor": total / (bandwidth * 1e9) * 1000 < FRAME_MS}
        for chip, bandwidth in APPLE_BANDWIDTH_GBS.items()
    }
    return {"bytes_per_frame_gb": total / 1e9, "by_part_gb": {k: v / 1e9 for k, v in by_part.items()}, "apple": table}


def _time_once(function) -> float:
    """CPU seconds of one evaluation (all threads: MLX's CPU stream runs on its own; CPU
    time is steadier than wall time on a shared machine)."""
    import mlx.core as mx

    start = time.process_time()
    mx.eval(function())
    return time.process_time() - start


def _product_pair(outputs: int, inner: int, rows: int, dtype, bits: int, group: int, repeats: int = 1,
                  x_dtype=None) -> dict:
    """The native quantized product against ``mx.quantized_matmul`` on random operands
    (same bits checked), timed alternately ``repeats`` times; best CPU seconds of each
    (as ``*_ms``), x of ``x_dtype`` (default: the scales' dtype)."""
    import mlx.core as mx

    from mlx_voicechat_plugin.accel.cpu import native

    packed, scales, biases = mx.quantize(mx.random.normal((outputs, inner), dtype=dtype) * 0.5,
                                         group_size=group, bits=bits)
    x = mx.random.normal((rows, inner)).astype(x_dtype or dtype)
    mx.eval(packed, scales, biases, x)
    module = native.extension()

    def ours():
        return module.quantized_matmul(x, packed, scales, biases, group, bits)

    def theirs():
        return mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=group, bits=bits)

    if not mx.array_equal(ours(), theirs()).item():
        raise RuntimeError(f"native quantized product differs from MLX at {rows}x{inner} @ {inner}x{outputs}")
    native_s, mlx_s = [], []
    for index in range(repeats):
        pair = ((ours, native_s), (theirs, mlx_s))
        for function, times in pair if index % 2 == 0 else pair[::-1]:
            times.append(_time_once(function))
    return {"native_cpu_ms": round(min(native_s) * 1e3, 3), "mlx_cpu_ms": round(min(mlx_s) * 1e3, 3),
            "ratio": round(min(native_s) / min(mlx_s), 4)}


def measure_products(rows: list[int], dtypes: list[str], outputs: int, inner: int, bits: int, group: int) -> dict:
    """The quantized product alone, native kernel vs MLX, per row count and dtype."""
    import mlx.core as mx

    from mlx_voicechat_plugin.accel.cpu import native

    if not native.available():
        return {"error": f"native kernels {native.status()}"}
    results = []
    for name in dtypes:  # "DTYPE" (x and scales) or "X_DTYPE:SCALES_DTYPE"
        x_name, _, scale_name = name.partition(":")
        for count in rows:
            pair = _product_pair(outputs, inner, count, getattr(mx, scale_name or x_name), bits, group,
                                 repeats=3 if count <= 64 else 1, x_dtype=getattr(mx, x_name))
            results.append({"dtype": name, "rows": count, "shape": f"{count}x{inner} @ {inner}x{outputs}",
                            "bits": bits, "group_size": group, **pair})
    return {"products": results, "load_average": os.getloadavg()}


def measure_lm_products(path: Path, rows: int = 1) -> dict:
    """Per streamed frame, the language model's quantized products (every quantized weight
    in the checkpoint read once, ``rows`` rows of float32 activations: the language model
    runs float32 activations against its bfloat16 scales), native vs MLX: each distinct
    shape timed once (CPU time), times multiplied by how often the model has it."""
    import mlx.core as mx

    from mlx_voicechat_plugin.accel.cpu import native

    if not native.available():
        return {"error": f"native kernels {native.status()}"}
    config = json.loads((path / "config.json").read_text())
    quantization = config.get("quantization", {})
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shapes: dict[tuple, int] = {}
    for shard in sorted(set(index.values())):
        tensors = mx.load(str(path / shard))
        for key, value in tensors.items():
            if not key.endswith(".scales") or "embed_tokens" in key:  # embeddings are gathered
                continue
            module = key[: -len(".scales")]
            spec = quantization.get(module, {})
            bits = spec.get("bits", quantization.get("bits", 4)) if isinstance(spec, dict) else quantization.get("bits", 4)
            group = spec.get("group_size", quantization.get("group_size", 64)) if isinstance(spec, dict) else 64
            outputs, groups = value.shape
            entry = (outputs, groups * group, bits, group, str(value.dtype).rsplit(".", 1)[-1])
            shapes[entry] = shapes.get(entry, 0) + 1
        del tensors
    total_native = total_mlx = 0.0
    rows_out = []
    for (outputs, inner, bits, group, dtype), count in sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1] * item[1]):
        pair = _product_pair(outputs, inner, rows, getattr(mx, dtype), bits, group, x_dtype=mx.float32)
        total_native += count * pair["native_cpu_ms"]
        total_mlx += count * pair["mlx_cpu_ms"]
        rows_out.append({"shape": f"{rows}x{inner} @ {inner}x{outputs}", "bits": bits, "group_size": group,
                         "dtype": dtype, "count": count, **pair})
    return {"rows": rows, "per_frame_native_cpu_ms": round(total_native, 1), "per_frame_mlx_cpu_ms": round(total_mlx, 1),
            "ratio": round(total_native / total_mlx, 4), "shapes": rows_out, "load_average": os.getloadavg()}


def _in_subprocess(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        return {"argv": argv, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("load")
    load.add_argument("checkpoint", type=Path)
    load.add_argument("--upstream", action="store_true")
    stream = commands.add_parser("stream")
    stream.add_argument("checkpoint", type=Path)
    stream.add_argument("--frames", type=int, default=8)
    stream.add_argument("--offline-seconds", type=float, nargs="*", default=[],
                        help="then offline turns of these lengths on the same loaded model")
    offline = commands.add_parser("offline")
    offline.add_argument("checkpoint", type=Path)
    offline.add_argument("--seconds", type=float, nargs="+", default=[1.0, 5.0])
    perception = commands.add_parser("perception")
    perception.add_argument("checkpoint", type=Path)
    perception.add_argument("--minutes", type=float, nargs="+", default=[1.0])
    perception.add_argument("--upstream", action="store_true")
    perception.add_argument("--no-cpu-layer", action="store_true",
                            help="ours without the CPU layer (plain MLX products, as upstream)")
    perception.add_argument("--layers", type=int, default=None, metavar="K",
                            help="run part by part (an evaluation after each), only the first K conformer layers, "
                                 "and project the whole from them")
    products = commands.add_parser("products", help="the quantized product alone, native vs MLX")
    products.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 750])
    products.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float32:bfloat16"],
                          help="DTYPE, or X_DTYPE:SCALES_DTYPE (float32:bfloat16 is the language model's case)")
    products.add_argument("--shape", type=int, nargs=2, default=[4096, 1024], metavar=("OUTPUTS", "INNER"))
    products.add_argument("--bits", type=int, default=4)
    products.add_argument("--group-size", type=int, default=64)
    lm = commands.add_parser("lm-products", help="a frame's quantized products (the checkpoint's shapes)")
    lm.add_argument("checkpoint", type=Path)
    lm.add_argument("--rows", type=int, default=1)
    project = commands.add_parser("project")
    project.add_argument("checkpoint", type=Path)
    args = parser.parse_args(argv)
    if args.command == "perception" and args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    if args.command == "project":
        result = bytes_per_frame(args.checkpoint)
    elif args.command == "products":
        result = measure_products(args.rows, args.dtypes, *args.shape, args.bits, args.group_size)
    elif args.command == "lm-products":
        result = measure_lm_products(args.checkpoint, args.rows)
    elif not args.child:
        rest = [arg for arg in (argv if argv is not None else sys.argv[1:])]
        if args.command == "perception":  # one subprocess per length: peak RSS per input
            base = ["perception", str(args.checkpoint), *(["--upstream"] if args.upstream else []),
                    *(["--no-cpu-layer"] if args.no_cpu_layer else []),
                    *(["--layers", str(args.layers)] if args.layers is not None else [])]
            result = {"runs": [_in_subprocess([*base, "--minutes", str(m)]) for m in args.minutes]}
        else:
            result = _in_subprocess(rest)
    elif args.command == "load":
        result = measure_load(args.checkpoint, args.upstream)
    elif args.command == "stream":
        result = measure_stream(args.checkpoint, args.frames, args.offline_seconds)
    elif args.command == "offline":
        result = measure_offline(args.checkpoint, args.seconds)
    elif args.layers is not None:
        result = measure_perception_parts(args.checkpoint, args.minutes[0], args.upstream, args.layers,
                                          not args.no_cpu_layer)
    else:
        result = measure_perception(args.checkpoint, args.minutes[0], args.upstream, not args.no_cpu_layer)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

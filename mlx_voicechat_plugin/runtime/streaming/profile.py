"""Per-frame stage timings (spec "Online session", ``profile: true``).

Stage times are wall-clock milliseconds taken after forcing evaluation of the stage's
outputs. ``host_syncs`` counts the host round trips the pipeline itself makes in a frame
(every readback or evaluation it needs to continue; the profiler's own boundary
evaluations are not counted, so the figure is the same with profiling off).

Environment:
    ``MLX_VOICECHAT_PROFILE_STAGES=1`` adds named sub-stage marks (``perception.mel``,
    ``perception.layers``, ``perception.proj``, ``language.llm``, ``tts.backbone``,
    ``tts.mog_head``, ``codec.decoder_istft``: the spec's names where it gives them)
    reported as ``sub_stages``; those marks force evaluation at every boundary, so that
    run's totals are not the real-time factor.
    ``MLX_VOICECHAT_PROFILE_FRAMES=<path>`` writes every frame's timings (cold frames
    included) as JSON to ``path`` when the session closes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from ...environment import flag

STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")
STAGES_ENV = "MLX_VOICECHAT_PROFILE_STAGES"
FRAMES_ENV = "MLX_VOICECHAT_PROFILE_FRAMES"


@dataclass
class FrameTiming:
    """One 80 ms frame: stage times in ms, host round trips, optional sub-stage times."""

    frame_index: int
    perception_ms: float = 0.0
    rnnt_ms: float = 0.0
    language_ms: float = 0.0
    tts_ms: float = 0.0
    codec_ms: float = 0.0
    total_ms: float = 0.0
    host_syncs: int = 0
    sub_stages: dict[str, float] = field(default_factory=dict)


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (position - lower) * (ordered[upper] - ordered[lower])


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": sum(values) / len(values) if values else 0.0,
        "p50_ms": _percentile(values, 0.5),
        "p95_ms": _percentile(values, 0.95),
        "max_ms": max(values, default=0.0),
    }


@dataclass
class StreamingProfile:
    """Collected frame timings of one session."""

    frame_duration_ms: float
    frames: list[FrameTiming] = field(default_factory=list)

    def summary(self, drop_first: int = 0) -> dict:
        """Mean / p50 / p95 / max per stage after dropping ``drop_first`` cold frames.

        Returns a JSON-serialisable dict with ``stages``, ``processing_frames_per_second``
        (1000 / mean total), ``realtime_factor`` (mean total / 80 ms; above 1.0 is slower
        than real time), ``host_syncs`` (mean, max) and, when sub-stage marks were taken,
        ``sub_stages``.
        """
        if drop_first < 0:
            raise ValueError("drop_first must be non-negative")
        frames = self.frames[drop_first:]
        stages = {name: _stats([getattr(f, f"{name}_ms") for f in frames]) for name in STAGES}
        mean_total = stages["total"]["mean_ms"]
        syncs = [f.host_syncs for f in frames]
        result = {
            "frames": len(frames),
            "dropped_cold_frames": min(drop_first, len(self.frames)),
            "frame_duration_ms": self.frame_duration_ms,
            "processing_frames_per_second": 1000.0 / mean_total if mean_total else 0.0,
            "realtime_factor": mean_total / self.frame_duration_ms if self.frame_duration_ms else 0.0,
            "stages": stages,
            "host_syncs": {
                "mean": sum(syncs) / len(syncs) if syncs else 0.0,
                "max": max(syncs, default=0),
            },
        }
        names = sorted({name for f in frames for name in f.sub_stages})
        if names:
            result["sub_stages"] = {
                name: _stats([f.sub_stages[name] for f in frames if name in f.sub_stages])
                for name in names
            }
        return result

    def write_frames(self, path: str | Path) -> None:
        """Write every frame's timings (cold frames included) as JSON."""
        payload = {
            "frame_duration_ms": self.frame_duration_ms,
            "frames": [asdict(frame) for frame in self.frames],
        }
        Path(path).write_text(json.dumps(payload, indent=1) + "\n")


class FrameClock:
    """Times one frame's stages; a no-op object when profiling is off.

    ``stage(name, *outputs)`` closes the current stage: it forces evaluation of
    ``outputs`` (profiling only) and records the elapsed time. ``mark(name, *outputs)``
    records a sub-stage (only with ``MLX_VOICECHAT_PROFILE_STAGES=1``). ``sync()`` counts
    one pipeline host round trip (always).
    """

    def __init__(self, frame_index: int, enabled: bool, sub_stages: bool):
        self.enabled = enabled
        self.sub_stages = enabled and sub_stages
        self.timing = FrameTiming(frame_index)
        now = time.perf_counter()
        self._start = self._stage_start = self._mark_start = now

    def sync(self, count: int = 1) -> None:
        self.timing.host_syncs += count

    def mark(self, name: str, *outputs) -> None:
        if not self.sub_stages:
            return
        if outputs:
            mx.eval(*outputs)
        now = time.perf_counter()
        self.timing.sub_stages[name] = (now - self._mark_start) * 1000.0
        self._mark_start = now

    def stage(self, name: str, *outputs) -> None:
        if not self.enabled:
            return
        if outputs:
            mx.eval(*outputs)
        now = time.perf_counter()
        setattr(self.timing, f"{name}_ms", getattr(self.timing, f"{name}_ms") + (now - self._stage_start) * 1000.0)
        self._stage_start = self._mark_start = now

    def finish(self) -> FrameTiming:
        self.timing.total_ms = (time.perf_counter() - self._start) * 1000.0
        return self.timing


def sub_stages_requested() -> bool:
    """True when ``MLX_VOICECHAT_PROFILE_STAGES`` is set to a true value."""
    return flag(STAGES_ENV, False)


def frames_path() -> str | None:
    """The ``MLX_VOICECHAT_PROFILE_FRAMES`` path, if set."""
    return os.environ.get(FRAMES_ENV) or None

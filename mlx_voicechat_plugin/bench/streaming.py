"""Streaming benchmark: frame times of ours and upstream, interleaved.

Two measurements per repetition and side:

* **wall**: profiling off, the wall time of each ``push_audio`` call (one 80 ms frame
  each). This is the real per-frame cost and the headline figure: with profiling off our
  session evaluates each frame's graph in one go, so its two CPU streams overlap work.
* **stages**: profiling on, per-stage times. The profiler forces evaluation at every stage
  boundary (upstream's does the same), which serialises work that otherwise overlaps, so
  these totals are higher than the wall times; they show where the time goes.
"""

from __future__ import annotations

import time

import numpy as np

FRAME = 1280
COLD_FRAMES = 5
STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")


def _ours(model, tokenizer, samples):
    session = model.create_streaming_session(processor=tokenizer, seed=0, profile=True)
    events = []
    for start in range(0, samples.shape[0], FRAME):
        events += session.push_audio(samples[start : start + FRAME])
    events += session.flush()
    frames = session.profile.frames[COLD_FRAMES:]
    rows = [{stage: getattr(f, f"{stage}_ms") for stage in STAGES} for f in frames]
    syncs = [f.host_syncs for f in frames]
    ids = [(e.kind, e.frame_index, getattr(e, "token_id", None), tuple(getattr(e, "audio_codes", ()))) for e in events]
    return rows, syncs, ids


def _upstream(model, processor, samples):
    import mlx.core as mx

    session = model.create_session(processor).create_streaming_session(seed=0, profile=True)
    events = []
    for start in range(0, samples.shape[0], FRAME):
        events += session.push_audio(mx.array(samples[start : start + FRAME]))
    events += session.flush()
    frames = session.profile.frames[COLD_FRAMES:]
    rows = [{stage: getattr(f, f"{stage}_ms") for stage in STAGES} for f in frames]
    ids = [
        (e.kind, e.frame_index, e.token_id, tuple(e.audio_codes.tolist()) if e.audio_codes is not None else ())
        for e in events
    ]
    return rows, ids


def _wall(push, samples, to_input):
    """Per-frame wall ms of ``push`` (cold frames dropped) and the events."""
    times, events = [], []
    for start in range(0, samples.shape[0] - FRAME + 1, FRAME):
        chunk = to_input(samples[start : start + FRAME])
        began = time.perf_counter()
        events += push(chunk)
        times.append((time.perf_counter() - began) * 1000.0)
    return times[COLD_FRAMES:], events


def _ours_wall(model, tokenizer, samples):
    session = model.create_streaming_session(processor=tokenizer, seed=0, profile=False)
    times, events = _wall(session.push_audio, samples, lambda chunk: chunk)
    session.flush()
    codes = [tuple(e.audio_codes) for e in events if e.kind == "audio"]
    text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    return times, (codes, text)


def _upstream_wall(model, processor, samples):
    import mlx.core as mx

    session = model.create_session(processor).create_streaming_session(seed=0, profile=False)
    times, events = _wall(session.push_audio, samples, mx.array)
    session.flush()
    codes = [tuple(e.audio_codes.tolist()) for e in events if e.kind == "audio" and e.audio_codes is not None]
    text = [(e.frame_index, e.token_id) for e in events if e.kind == "assistant_text_delta"]
    return times, (codes, text)


def _summary(values: list[float]) -> dict:
    array = np.array(values)
    return {
        "mean_ms": float(array.mean()),
        "p50_ms": float(np.percentile(array, 50)),
        "p95_ms": float(np.percentile(array, 95)),
    }


def _stats(rows: list[dict]) -> dict:
    out = {}
    for stage in STAGES:
        values = np.array([row[stage] for row in rows])
        out[stage] = {
            "mean_ms": float(values.mean()),
            "p50_ms": float(np.percentile(values, 50)),
            "p95_ms": float(np.percentile(values, 95)),
        }
    return out


def run(ours, tokenizer, upstream, processor, samples: np.ndarray, repeats: int, compile_ab: bool = False) -> dict:
    """Warm up both, then ``repeats`` interleaved runs; cold frames dropped.

    With ``compile_ab`` (ours has :func:`~..runtime.compiled.install` ed blocks), each
    repetition also times ours with the compiled blocks suspended (``ours_wall_uncompiled``).
    """
    from ..runtime import compiled

    _ours(ours, tokenizer, samples)
    _upstream(upstream, processor, samples)
    _ours_wall(ours, tokenizer, samples)
    _upstream_wall(upstream, processor, samples)
    our_rows, up_rows, syncs = [], [], []
    our_wall, up_wall, plain_wall = [], [], []
    identical = True
    if compile_ab:
        with compiled.suspended():
            _ours_wall(ours, tokenizer, samples)
    for _ in range(repeats):
        times, our_events = _ours_wall(ours, tokenizer, samples)
        our_wall += times
        if compile_ab:
            with compiled.suspended():
                times, plain_events = _ours_wall(ours, tokenizer, samples)
            plain_wall += times
            identical &= plain_events == our_events
        times, up_events = _upstream_wall(upstream, processor, samples)
        up_wall += times
        identical &= our_events == up_events and bool(our_events[0])
        rows, frame_syncs, our_ids = _ours(ours, tokenizer, samples)
        our_rows += rows
        syncs += frame_syncs
        rows, up_ids = _upstream(upstream, processor, samples)
        up_rows += rows
        identical &= our_ids == up_ids
    ours_stats, up_stats = _stats(our_rows), _stats(up_rows)
    ours_wall, upstream_wall = _summary(our_wall), _summary(up_wall)
    extra = {}
    if compile_ab:
        extra["ours_wall_uncompiled"] = _summary(plain_wall)
        extra["compile_speedup_mean"] = extra["ours_wall_uncompiled"]["mean_ms"] / ours_wall["mean_ms"]
    return {
        **extra,
        "frames_per_run": len(our_rows) // max(repeats, 1),
        "repeats": repeats,
        "events_identical": bool(identical),
        "ours_wall": ours_wall,
        "upstream_wall": upstream_wall,
        "ours": ours_stats,
        "upstream": up_stats,
        "ours_realtime_factor": ours_wall["mean_ms"] / 80.0,
        "upstream_realtime_factor": upstream_wall["mean_ms"] / 80.0,
        "ours_host_syncs": {"mean": float(np.mean(syncs)), "max": int(np.max(syncs))},
        "speedup_mean": upstream_wall["mean_ms"] / ours_wall["mean_ms"],
        "ratio_mean": ours_wall["mean_ms"] / upstream_wall["mean_ms"],
        "profiled_speedup_mean": up_stats["total"]["mean_ms"] / ours_stats["total"]["mean_ms"],
    }


def _counted(push, samples, to_input, model, frames: int) -> dict:
    """Mean :class:`~.graph.FrameCount` of ``frames`` one-frame calls after the cold ones."""
    from .graph import GraphCounter

    counts = []
    with GraphCounter(model) as counter:
        for index, start in enumerate(range(0, samples.shape[0] - FRAME + 1, FRAME)):
            if index >= COLD_FRAMES + frames:
                break
            push(to_input(samples[start : start + FRAME]))
            count = counter.frame()
            if index >= COLD_FRAMES:
                counts.append(count)
    by_primitive: dict = {}
    for count in counts:
        for name, value in count.by_primitive.items():
            by_primitive[name] = by_primitive.get(name, 0) + value / len(counts)
    return {
        "frames": len(counts),
        "primitives": float(np.mean([c.primitives for c in counts])),
        "primitives_max": int(max(c.primitives for c in counts)),
        "kernels": float(np.mean([c.kernels for c in counts])),
        "evaluations": float(np.mean([c.evaluations for c in counts])),
        "evaluations_max": int(max(c.evaluations for c in counts)),
        "weight_bytes": float(np.mean([c.weight_bytes for c in counts])),
        "table_bytes": float(np.mean([c.table_bytes for c in counts])),
        "by_primitive": dict(sorted(by_primitive.items(), key=lambda item: -item[1])),
    }


def graph_counts(ours, tokenizer, upstream, processor, samples: np.ndarray, frames: int = 10) -> dict:
    """Per-frame primitives, host evaluations and weight bytes of ours and upstream.

    Counts ``frames`` frames after the :data:`COLD_FRAMES` cold ones with
    :class:`~.graph.GraphCounter` (untimed: walking the graph costs time).

    Returns:
        ``{"ours": {...}, "upstream": {...}, "primitives_ratio": ours / upstream}``, plus
        ``"ours_uncompiled"`` when ours has compiled blocks (counted with them suspended).
    """
    import mlx.core as mx

    from ..runtime import compiled

    session = ours.create_streaming_session(processor=tokenizer, seed=0, profile=False)
    our_counts = _counted(session.push_audio, samples, lambda chunk: chunk, ours, frames)
    session.cancel()
    extra = {}
    if compiled.installed(ours):
        with compiled.suspended():
            session = ours.create_streaming_session(processor=tokenizer, seed=0, profile=False)
            extra["ours_uncompiled"] = _counted(session.push_audio, samples, lambda chunk: chunk, ours, frames)
            session.cancel()
    up_session = upstream.create_session(processor).create_streaming_session(seed=0, profile=False)
    up_counts = _counted(up_session.push_audio, samples, mx.array, upstream, frames)
    return {
        **extra,
        "ours": our_counts,
        "upstream": up_counts,
        "primitives_ratio": our_counts["primitives"] / up_counts["primitives"],
        "kernels_ratio": our_counts["kernels"] / up_counts["kernels"],
    }

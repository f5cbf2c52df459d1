"""Streaming benchmark: per-stage frame times of ours and upstream, interleaved."""

from __future__ import annotations

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


def run(ours, tokenizer, upstream, processor, samples: np.ndarray, repeats: int) -> dict:
    """Warm up both, then ``repeats`` interleaved runs; cold frames dropped."""
    _ours(ours, tokenizer, samples)
    _upstream(upstream, processor, samples)
    our_rows, up_rows, syncs = [], [], []
    identical = True
    for _ in range(repeats):
        rows, frame_syncs, our_ids = _ours(ours, tokenizer, samples)
        our_rows += rows
        syncs += frame_syncs
        rows, up_ids = _upstream(upstream, processor, samples)
        up_rows += rows
        identical &= our_ids == up_ids
    ours_stats, up_stats = _stats(our_rows), _stats(up_rows)
    return {
        "frames_per_run": len(our_rows) // max(repeats, 1),
        "repeats": repeats,
        "events_identical": bool(identical),
        "ours": ours_stats,
        "upstream": up_stats,
        "ours_realtime_factor": ours_stats["total"]["mean_ms"] / 80.0,
        "upstream_realtime_factor": up_stats["total"]["mean_ms"] / 80.0,
        "ours_host_syncs": {"mean": float(np.mean(syncs)), "max": int(np.max(syncs))},
        "speedup_mean": up_stats["total"]["mean_ms"] / ours_stats["total"]["mean_ms"],
        "ratio_mean": ours_stats["total"]["mean_ms"] / up_stats["total"]["mean_ms"],
    }

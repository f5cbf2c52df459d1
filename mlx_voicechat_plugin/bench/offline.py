"""Offline benchmark: wall time of one turn versus input length."""

from __future__ import annotations

import time

import numpy as np


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


def silent_prompt_seconds(ours, tokenizer) -> float:
    """Seconds of one un-memoised silent EAR-TTS prompt (upstream's ``_tts_prompt``)."""
    import mlx.core as mx
    from mlx_vlm.models.nemotron_voicechat.session import VoiceChatSession

    session = ours.create_session(tokenizer)
    seconds, prompt = _timed(lambda: mx.eval(VoiceChatSession._tts_prompt(session)))
    return seconds


def run(ours, tokenizer, upstream, processor, speech: np.ndarray, seconds: list[float], recompute_limit: float) -> list[dict]:
    """Ours (cached), upstream cached, and upstream default (full recompute, lengths up to
    ``recompute_limit`` seconds: its cost grows with the square of the length)."""
    import mlx.core as mx

    rows = []
    for length in seconds:
        total = int(length * 16000)
        samples = np.zeros(total, dtype=np.float32)
        samples[: min(total, speech.shape[0])] = speech[:total]
        our_session = ours.create_session(tokenizer)
        up_session = upstream.create_session(processor)
        ours_s, ours_result = _timed(our_session.generate, samples, extra_decoding_seconds=0.0, seed=0)
        cached_s, cached = _timed(up_session.generate, mx.array(samples), seed=0, use_language_cache=True)
        row = {
            "seconds": length,
            "frames": ours_result.frames,
            "ours_s": ours_s,
            "upstream_cached_s": cached_s,
            "ids_identical_to_upstream_cached": ours_result.text_tokens == cached.text_tokens.tolist(),
        }
        if length <= recompute_limit:
            default_s, default = _timed(up_session.generate, mx.array(samples), seed=0)
            row["upstream_default_s"] = default_s
            row["ids_identical_to_upstream_default"] = ours_result.text_tokens == default.text_tokens.tolist()
        else:
            row["upstream_default_s"] = None
        rows.append(row)
    return rows

"""The memory-bandwidth floor of one streamed frame.

A frame must read every weight it uses at least once; dividing those bytes by the
machine's measured matrix-vector bandwidth gives a lower bound on the frame time.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
from mlx.utils import tree_flatten


def matvec_bandwidth(megabytes: int = 64, repeats: int = 20) -> float:
    """Measured bytes/s of an f32 matrix-vector product over a ``megabytes`` matrix."""
    side = int(math.sqrt(megabytes * 2**20 / 4))
    matrix = mx.random.normal((side, side))
    vector = mx.random.normal((1, side))
    mx.eval(matrix, vector)
    mx.eval(vector @ matrix)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(vector @ matrix)
    elapsed = (time.perf_counter() - start) / repeats
    return matrix.nbytes / elapsed


def _bytes(module) -> int:
    return sum(value.nbytes for _, value in tree_flatten(module.parameters()))


def frame_weight_bytes(model) -> dict:
    """Bytes of weights one streamed frame reads, per stage (MoG head counted per iteration)."""
    stt, tts = model.stt_model, model.tts_model.tts_model
    config = tts.config
    rates = [i / config.num_iterations for i in range(config.num_iterations)]
    masked = [
        math.ceil(((1.0 - rate**config.exponent) ** (1.0 / config.exponent)) * config.num_quantizers)
        for rate in rates
    ]
    iterations = sum(1 for i in range(len(masked)) if masked[i] - (masked[i + 1] if i + 1 < len(masked) else 0))
    mog = tts.mog_head
    # low_mat and proj_mus are gathered tables: a frame reads one component's slice.
    mog_dense = _bytes(mog) - mog.low_mat.nbytes - mog.proj_mus.weight.nbytes
    return {
        "perception": _bytes(stt.perception),
        "rnnt": _bytes(stt.rnnt_decoder) + _bytes(stt.rnnt_joint),
        "language": _bytes(stt.llm) + _bytes(stt.lm_head) + _bytes(stt.function_head),
        "tts": _bytes(tts.backbone) + _bytes(tts.embed_subword) + tts.embed_code.weight.nbytes + iterations * mog_dense,
        "codec": _bytes(model.tts_model.audio_codec.decoder),
    }

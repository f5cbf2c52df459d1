"""Many conversations on one model: a batched multi-session streaming engine.

:class:`BatchedEngine` holds N streaming sessions and, on every :meth:`~BatchedEngine.tick`,
advances each session that has a frame ready by one 80 ms frame in one batched step
(:mod:`.frame`): the language model (:mod:`.language`), EAR-TTS with its guidance batch
(:mod:`.speech`) and the codec (:mod:`.codec`) run once over the sessions' stacked rows,
with per-session caches (encoder attention window, Mamba state, KV caches of different
lengths), RNG keys, limits and errors.

Row exactness: a session's events equal its solo run bit for bit (ids, codes, audio), which
holds because every row-wise operation computes each row as a one-row call does: products
go through the plugin's native kernel on the CPU (each output element one dot product in a
fixed order, whatever the number of rows) or MLX's BLAS products (the reference BLAS
accumulates each element sequentially whatever the shapes); norms, activations, softmax,
argmax and the RVQ search are per row. Attention runs per session; the per-session noise is
drawn from each session's key. ``tests/test_batch_engine.py`` checks the events against
solo and upstream runs.
"""

from .engine import BatchedEngine, SessionLimitError, TickResult, UnknownSessionError
from .frame import batchable, step_frames

__all__ = ["BatchedEngine", "SessionLimitError", "TickResult", "UnknownSessionError", "batchable", "step_frames"]

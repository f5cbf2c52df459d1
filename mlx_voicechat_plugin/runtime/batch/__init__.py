"""Many conversations on one model: a batched multi-session streaming engine.

:class:`BatchedEngine` holds N streaming sessions and, on every :meth:`~BatchedEngine.tick`,
advances each session that has a frame ready by one 80 ms frame in one batched step
(:mod:`.frame`): the FastConformer layers (:mod:`.perception`), the language model
(:mod:`.language`), EAR-TTS with its guidance batch (:mod:`.speech`) and the codec
(:mod:`.codec`) run once over the sessions' stacked rows, with per-session caches (encoder
attention window, Mamba state, KV caches of different lengths, codec overlap), RNG keys,
limits and errors. The RNNT decode runs over all rows at once (:mod:`.transcript`, masked
per row); the attention of the language model and EAR-TTS is one call per session on the
CPU, over every row elsewhere with the sessions' keys of different lengths zero-padded and
masked (:func:`.rows.attend_sessions`), the encoder's one call per group of equal
windows; the sampling noise of every session is one batched draw from the sessions' own
keys (:func:`.speech.draw_noise_rows`). A tick synchronises with the host
twice, as a solo frame does, whatever the number of sessions. The log-mel front end runs
per session, the subsampling pre-encoder once for the sessions in step, over the rows they
keep (:func:`.perception.pre_encode_rows`); a joining session's system prompt runs one
token per tick.

Row exactness: a session's events equal its solo run bit for bit (ids, codes, audio), which
holds because every row-wise operation computes each row as a one-row call does: products
go through the CPU layer's native kernel (each output element one float32 dot product in
order over the shared axis, whatever the number of rows: rows are blocked, the sum order is
not; float32 activations against bf16 weights included) or, with
``MLX_VOICECHAT_CPU_ACCEL=0``, MLX's own CPU products (BLAS ``sgemm`` for
``(B, K) x (K, N)``; for the shapes here, ``B`` 1 to 8 rows of 256 to 2048 features, each
element comes out the same as with one row, which ``tests/test_batch_engine.py`` checks in
a subprocess with the layer off); norms, activations, softmax, argmax and the RVQ search are
per row; a one-query attention over right-padded keys with a mask gives each row the bits
of its unpadded call on MLX's CPU backend, and MLX's random bits drawn from explicit keys
equal the global-key draws (``tests/test_batch_rows.py``).
On a GPU, kernels chosen by shape may sum in another order for ``B > 1`` rows: exactness
there is not claimed (the tests run on the CPU).

Shapes of one tick with ``B`` batched sessions: language model rows ``(B, 1, hidden)``;
EAR-TTS guidance rows ``(2B, 1, hidden)`` laid out ``[cond_0..cond_{B-1}, uncond_0..]``;
codes ``(B, 1, 31)``; codec input ``(B, 31, 1)`` -> ``(B, 1, 1764)`` samples. Sessions that
profile or use the diagnostic options are stepped alone within the tick.

Threading: one thread creates the :class:`BatchedEngine` and calls all its methods (MLX
evaluation is thread-affine; another thread gets ``WrongThreadError``). The realtime server
drives it from its engine thread (``mlx_voicechat_plugin.server.engine``).
"""

from .engine import BatchedEngine, SessionLimitError, TickResult, UnknownSessionError
from .frame import batchable, step_frames

__all__ = ["BatchedEngine", "SessionLimitError", "TickResult", "UnknownSessionError", "batchable", "step_frames"]

"""Many conversations on one model: a batched multi-session streaming engine.

:class:`BatchedEngine` holds N streaming sessions and, on every :meth:`~BatchedEngine.tick`,
advances each session that has a frame ready by one 80 ms frame in the one streaming step
(:func:`~..streaming.step.step_frames`, which a solo session runs with ``B = 1``; the stages
and their shapes: ``docs/architecture.md``). A tick synchronises with the host twice
whatever the number of sessions; a joining session's system prompt runs one token per tick,
inside that step.

Row exactness: a session's events equal its solo run bit for bit (ids, codes, audio), which
holds because every row-wise operation computes each row as a one-row call does: products
go through the CPU layer's native kernel (each output element one float32 dot product in
order over the shared axis, whatever the number of rows) or, with
``MLX_VOICECHAT_CPU_ACCEL=0``, MLX's own CPU products (BLAS ``sgemm``; for ``B`` 1 to 8 rows
of 256 to 2048 features each element comes out the same as with one row, which
``tests/test_batch_engine.py`` checks in a subprocess with the layer off); norms,
activations, softmax, argmax and the RVQ search are per row; a one-query attention over
right-padded keys with a mask gives each row the bits of its unpadded call on MLX's CPU
backend, and random bits drawn from explicit keys equal the global-key draws
(``tests/test_batch_rows.py``). On a GPU, kernels chosen by shape may sum in another order
for ``B > 1`` rows: exactness there is not claimed (the tests run on the CPU).

Threading: one thread creates the :class:`BatchedEngine` and calls all its methods (MLX
evaluation is thread-affine; another thread gets ``WrongThreadError``). The realtime server
drives it from its engine thread (``mlx_voicechat_plugin.server.engine``).
"""

from .engine import BatchedEngine, SessionLimitError, TickResult, UnknownSessionError

__all__ = ["BatchedEngine", "SessionLimitError", "TickResult", "UnknownSessionError"]

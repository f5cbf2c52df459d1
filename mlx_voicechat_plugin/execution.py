"""How the runtime schedules a model's concurrent work: plain MLX on the model's device.

This is execution policy, kept outside the model modules (which stay plain MLX and run
on any device) and outside the runtime (which asks, and never checks a device itself).

The runtime asks the loaded model for these contexts (:func:`execution_of`):

* :meth:`Execution.side` wraps work inside a streamed frame that does not depend on the
  main chain (the RNNT transcript);
* :meth:`Execution.worker` wraps an offline worker-thread job (the language model, the
  RNNT transcript), which already runs on its thread's own stream of the device the job was
  submitted from (:mod:`mlx_voicechat_plugin.runtime.workers`);
* :meth:`Execution.lanes` gives the contexts under which a batched stage's row groups are
  built (one lane by default; two CPU streams on a CPU model);
* :meth:`Execution.compiled_by_default` says whether ``MLX_VOICECHAT_COMPILE=auto``
  compiles the static-shape blocks (:mod:`mlx_voicechat_plugin.runtime.compiled`);
* :meth:`Execution.attention_per_session` says how a batched one-query attention over
  sessions' KV caches of different lengths runs: one call per session, or one call over
  the keys zero-padded and masked (the same bits per row either way);
* :meth:`Execution.attention` is the attention call a batched step makes (mlx-vlm's);
* :meth:`Execution.attend_each` builds a batched step's per-session attention calls (in
  order on the caller's stream by default; on a CPU model shared between two streams).

The default does nothing beyond MLX's defaults, so it is right on every device. An optional
acceleration layer (:mod:`mlx_voicechat_plugin.accel`) may give a model another policy at
load time by setting ``model.execution``; the runtime never imports that layer.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
from mlx_vlm.models.base import scaled_dot_product_attention


def attention_work(queries: mx.array, keys: mx.array) -> int:
    """Multiply-adds of one attention call's two products (``q @ k^T`` and the weights
    ``@ v``): ``2 x B x n_heads x L x T x head_dim`` for ``(B, n_heads, L, head_dim)``
    queries over ``(..., T, head_dim)`` keys. The size a policy splits or shares calls by
    (:meth:`Execution.attend_each`'s ``works``)."""
    batch, heads, length, depth = queries.shape
    return 2 * batch * heads * length * keys.shape[-2] * depth


class Execution:
    """The device-neutral policy: both contexts are no-ops."""

    #: Short name (reported by the bench and tests).
    name = "default"

    def side(self):
        """Context for independent work inside a frame (default: the caller's stream)."""
        return contextlib.nullcontext()

    def worker(self):
        """Context a worker-thread job enters around its work (default: none)."""
        return contextlib.nullcontext()

    def lanes(self, rows: int) -> list:
        """Fresh contexts, one per lane, under which a batched stage of ``rows`` independent
        rows builds its row groups (:mod:`mlx_voicechat_plugin.runtime.stages.lanes`;
        default: one lane, the caller's stream)."""
        return [contextlib.nullcontext()]

    def attention_per_session(self) -> bool:
        """True: attend one call per session over its own keys (on MLX's CPU backend
        cheaper than stacking, which copies every session's keys on every layer of every
        tick); False: one padded, masked call over all rows (fewer kernel launches, for
        GPUs). Default: True when the default device is the CPU."""
        return mx.default_device() == mx.cpu

    def attention(self, queries, keys, values, cache, scale: float, mask=None) -> mx.array:
        """Attention of ``(B, n_heads, L, D)`` queries over ``(B, n_kv_heads, T, D)`` keys
        and values (mlx-vlm ``scaled_dot_product_attention``'s arguments and result);
        default: that function."""
        return scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask)

    def attend_each(self, calls: list, works: list[int]) -> list:
        """Build each session's attention call of a batched step and return their outputs,
        in order.

        Args:
            calls: zero-argument callables, each one session's attention (independent of
                the others); each returns an ``mx.array``.
            works: per call its multiply-adds (:func:`attention_work`), which a policy may
                use to share the calls between streams.

        Default: each call in order on the caller's stream.
        """
        return [call() for call in calls]

    def compiled_by_default(self) -> bool:
        """True when ``MLX_VOICECHAT_COMPILE=auto`` (the default) should compile the
        static-shape blocks: on a GPU, where they save kernel launches; not on the CPU,
        where compilation costs more than it saves. Default: the default device is a GPU."""
        return mx.default_device().type == mx.DeviceType.gpu


#: The policy of a model that no acceleration layer changed.
DEFAULT = Execution()


def execution_of(model) -> Execution:
    """``model.execution`` when set (a loaded :class:`~.model.Model`), else :data:`DEFAULT`."""
    execution = getattr(model, "execution", None)
    return execution if isinstance(execution, Execution) else DEFAULT

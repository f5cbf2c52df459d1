"""EAR-TTS's residual-quantiser search with the native kernel (CPU layer), bit-identical.

:class:`KernelRVQEARTTSModel` extends the model's
:class:`~mlx_voicechat_plugin.model.tts.FastRVQEARTTSModel`: an exact float32 copy of every
codebook, transposed and row-contiguous (the layout the reference BLAS multiplies fastest;
same sums), and the nearest-codeword steps of a block of codebooks in one kernel
(:func:`.native.rvq_encode`: upstream's order, the first minimum or first NaN as
``mx.argmin`` picks it). Without the kernel the steps use :func:`.native.matmul` against
the copy. :meth:`KernelRVQEARTTSModel.top_p_logits` gives the batched MoG head
(:mod:`mlx_voicechat_plugin.runtime.stages.speech_sampling`) upstream's top-p filter with its mask
from one kernel (:func:`.native.top_p_keep`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.nemotron_voicechat.tts import _top_p_logits

from ...model.tts import FastRVQEARTTSModel
from .native import matmul, rvq_encode, top_p_keep


class KernelRVQEARTTSModel(FastRVQEARTTSModel):
    """:class:`~mlx_voicechat_plugin.model.tts.FastRVQEARTTSModel` with the float32
    transposed codebooks and the native search (same outputs)."""

    def _build_table(self, name: str) -> mx.array:
        if name == "f32t":
            # (Q, latent, codes): each codebook's float32 transpose, row-contiguous.
            return mx.contiguous(self.rvq_embs.astype(mx.float32).transpose(0, 2, 1))
        return super()._build_table(name)

    def top_p_logits(self, logits: mx.array, top_p: float) -> mx.array:
        """Upstream ``nemotron_voicechat.tts._top_p_logits(logits, top_p)``, bit for bit:
        ``logits`` ``(..., P)`` with the components outside the nucleus set to ``-inf``. The
        mask (upstream's argsort, cumulative sum and scatter) comes from one kernel when it
        is in use; upstream's function otherwise (also for ``top_p`` outside ``(0, 1)``,
        which the kernel's wrapper leaves to it: upstream returns the logits or raises
        ``ValueError``)."""
        keep = top_p_keep(mx.softmax(logits.astype(mx.float32), axis=-1), top_p)
        if keep is not None:
            return mx.where(keep, logits, -float("inf"))
        return _top_p_logits(logits, top_p)

    def _encode_block(self, residual, start: int, count: int) -> mx.array:
        norms, transposed = self._table("norms"), self._table("f32t")
        block = rvq_encode(residual, norms, transposed, self.rvq_embs, start, count)
        if block is not None:
            return block
        selected = []
        for index in range(start, start + count):
            distances = norms[index] - 2.0 * matmul(residual, transposed[index])
            chosen = mx.argmin(distances, axis=-1)
            residual = residual - self.rvq_embs[index][chosen]
            selected.append(chosen)
        return mx.stack(selected, axis=-1)


def install_kernel_tts(model) -> int:
    """Give the model's EAR-TTS its kernel class (tables dropped); returns 1 when changed."""
    tts = model.tts_model.tts_model
    if type(tts) is not FastRVQEARTTSModel:
        return 0
    tts.__class__ = KernelRVQEARTTSModel
    tts.clear_tables()
    return 1

"""EAR-TTS's residual-quantiser search with the native kernel (CPU layer), bit-identical.

:class:`KernelRVQEARTTSModel` extends the model's
:class:`~mlx_voicechat_plugin.model.tts.FastRVQEARTTSModel`: an exact float32 copy of every
codebook, transposed and row-contiguous (the layout the reference BLAS multiplies fastest;
same sums), and the nearest-codeword steps of a block of codebooks in one kernel
(:func:`.native.rvq_encode`: upstream's order, the first minimum or first NaN as
``mx.argmin`` picks it). Without the kernel the steps use :func:`.native.matmul` against
the copy.
"""

from __future__ import annotations

import mlx.core as mx

from ...model.tts import FastRVQEARTTSModel
from .native import matmul, rvq_encode


class KernelRVQEARTTSModel(FastRVQEARTTSModel):
    """:class:`~mlx_voicechat_plugin.model.tts.FastRVQEARTTSModel` with the float32
    transposed codebooks and the native search (same outputs)."""

    def _build_table(self, name: str) -> mx.array:
        if name == "f32t":
            # (Q, latent, codes): each codebook's float32 transpose, row-contiguous.
            return mx.contiguous(self.rvq_embs.astype(mx.float32).transpose(0, 2, 1))
        return super()._build_table(name)

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

"""Codec helpers that remove a per-frame host round trip from upstream's iSTFT.

Upstream ``NemotronVoiceChatCodec.decode_latents`` builds a fresh (lazy) Hann window on
every call and ``mlx_audio.dsp.ISTFTCache.get_norm_buffer`` keys its cache on
``hash(tuple(window.tolist()))``, which forces an evaluation -- a device round trip per
decoded frame. The codec always uses the same periodic Hann window of ``n_fft`` samples,
so :class:`ShapeKeyedISTFTCache` keys the normalisation buffer on the shapes alone.
The buffer is computed from the same window with the same operations, so the output is
identical.
"""

from __future__ import annotations

from mlx_audio.dsp import ISTFTCache


class ShapeKeyedISTFTCache(ISTFTCache):
    """``ISTFTCache`` whose normalisation buffers are keyed without reading the window.

    Only valid for an owner that always passes the same window (the VoiceChat codec).
    """

    def get_norm_buffer(self, n_fft, hop_length, win_length, window, num_frames):
        key = (n_fft, hop_length, win_length, num_frames)
        cached = self.norm_buffer_cache.get(key)
        if cached is None:
            import mlx.core as mx

            frame_length = window.shape[0]
            ola_len = (num_frames - 1) * hop_length + frame_length
            positions = self.get_positions(num_frames, frame_length, hop_length)
            norm = mx.zeros(ola_len, dtype=mx.float32)
            norm = norm.at[positions].add(mx.tile(window**2, num_frames))
            cached = mx.maximum(norm, 1e-10)
            self.norm_buffer_cache[key] = cached
        return cached

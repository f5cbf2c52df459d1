"""Codec decode of a whole offline turn, split in time, with the whole-sequence result.

Upstream ``NemotronVoiceChatCodec.decode`` decodes a turn's codes in one call: every
decoder activation (384 channels at a quarter of the 22.05 kHz output rate at full width)
and every iSTFT buffer exists for the whole turn at once (for 20 minutes: 5 GB per bf16
activation, 20 GB per ConvNeXt expansion to 1,536 channels).
Its streaming ``decode_step`` is bounded but not the same function (the cached iSTFT
frames differ from the whole decode by up to 0.039).

The decoder is causal with a finite receptive field: its upsampling layers are transposed
convolutions with stride equal to kernel (each output position depends on one input
position), its ConvNeXt blocks pad ``kernel - 1`` positions on the left only, its other
layers are pointwise, and each output sample of the iSTFT (``n_fft`` window, ``hop``
hop, ``(n_fft - hop) // 2`` samples trimmed on the left) overlaps a few spectrogram frames
on both sides. :func:`decoder_context` computes, from the codec config, how many code
frames of left and right context make a sample independent of where its window starts
and ends; :func:`decode_chunked` decodes windows of a fixed number of code frames with
that context and keeps each window's middle. Each kept sample is computed by the same
operations on the same values as in the whole-sequence decode, so it is the same number
(tests compare bit for bit with upstream on every demo preset).

Every window of a long turn has the same length (the last one is aligned to the end of
the turn and overlaps the one before it), so the iSTFT's shape-keyed caches hold one
extra entry, not one per turn length.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

#: Code frames kept per window (80 ms each: 2.56 s of audio). With the published
#: context a window is 36 x 441 decoder positions: at full width 12 MB per 384-channel
#: bf16 activation, 49 MB for a ConvNeXt expansion; 4 / 32 of the frames are decoded twice.
CHUNK_FRAMES = 32


@dataclass(frozen=True)
class DecoderContext:
    """Code frames of context a decoded code frame's samples depend on.

    Attributes:
        left: earlier code frames (the causal convolutions' and iSTFT's reach back).
        right: later code frames (the iSTFT overlap's reach forward).
    """

    left: int
    right: int


def decoder_context(config) -> DecoderContext:
    """The codec decoder's receptive field in code frames, from its config.

    Walks the decoder from its output back to its input (the layer order of upstream
    ``mlx_audio.codec.models.nemotron_voicechat.codec.AudioDecoder``): the iSTFT sample
    ``n`` of the trimmed output reads spectrogram frames ``ceil((n + pad - n_fft + 1) /
    hop)`` to ``floor((n + pad) / hop)`` (``pad = (n_fft - hop) // 2``); each ConvNeXt
    block reads ``block_kernel_size - 1`` earlier positions; an upsampling layer of rate
    ``r`` maps position ``p`` to input position ``floor(p / r)``.

    Args:
        config: upstream ``NemotronVoiceChatCodecConfig`` (``downsample_rates``,
            ``blocks_per_stage``, ``block_kernel_size``, ``n_fft``, ``hop_length``).

    Returns:
        :class:`DecoderContext`; ``(3, 1)`` for the published codec (rates 7, 7, 9,
        3 blocks of kernel 7 per stage, n_fft 16, hop 4).

    Raises:
        ValueError: a config whose decoder is not causal or whose output samples are
            not a whole number of spectrogram hops per code frame.
    """
    n_fft, hop = config.n_fft, config.hop_length
    if hop <= 0 or n_fft < hop or config.block_kernel_size < 1 or any(r < 1 for r in config.downsample_rates):
        raise ValueError(f"codec config has no finite causal receptive field: {config}")
    pad = (n_fft - hop) // 2
    # In spectrogram frames, relative to a code frame boundary (a multiple of ``hop``).
    left = (n_fft - 1 - pad) // hop
    right = (pad - 1) // hop + 1
    per_stage = config.blocks_per_stage * (config.block_kernel_size - 1)
    # Stages run coarse to fine with the rates reversed; walk them fine to coarse.
    for rate in config.downsample_rates:
        left = -(-(left + per_stage) // rate)
        right = -(-right // rate)
    return DecoderContext(left=left, right=right)


def decode_chunked(codec, codes: mx.array, chunk_frames: int = CHUNK_FRAMES) -> mx.array:
    """Decode ``codes`` as ``codec.decode(codes)`` does, in windows of code frames.

    Each window holds ``chunk_frames`` kept frames plus :func:`decoder_context` frames on
    each side (fewer at the ends of the turn); it is decoded and evaluated before the
    next, so the decode's transient memory is one window's, whatever the turn's length.
    Turns of at most one window are decoded in one call.

    Args:
        codec: upstream ``NemotronVoiceChatCodec`` (or this package's speed-ups of it).
        codes: ``(B, Q, T)`` integer code ids, ``T >= 1`` code frames.
        chunk_frames: code frames kept per window (>= 1).

    Returns:
        ``(B, 1, T * waveform_to_token_ratio)`` waveform at the codec's sample rate, in
        the decoder's dtype, equal sample for sample to ``codec.decode(codes)``
        (evaluated).

    Raises:
        ValueError: ``codes`` is not 3-D, has no frames, or ``chunk_frames < 1``.
    """
    if codes.ndim != 3:
        raise ValueError(f"codes must have shape (B, Q, T), got {codes.shape}")
    if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise ValueError(f"chunk_frames must be a positive integer, got {chunk_frames!r}")
    frames = codes.shape[2]
    if frames == 0:
        raise ValueError("codes have no frames")
    context = decoder_context(codec.config)
    window = context.left + chunk_frames + context.right
    if frames <= window:
        waveform = codec.decode(codes)
        mx.eval(waveform)
        return waveform
    ratio = codec.config.waveform_to_token_ratio
    pieces = []
    for start in range(0, frames, chunk_frames):
        stop = min(start + chunk_frames, frames)
        # Same window length everywhere; the last is aligned to the end of the turn.
        low = max(0, min(start - context.left, frames - window))
        waveform = codec.decode(codes[:, :, low : low + window])
        piece = mx.contiguous(waveform[:, :, (start - low) * ratio : (stop - low) * ratio])
        mx.eval(piece)
        pieces.append(piece)
        del waveform
    return mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]


"""Cache-aware FastConformer frames of one or many sessions: batched blocks.

Per session: the bookkeeping of the subsampling pre-encoder's mel window, following
upstream ``ConformerStreamingState.push(mel, emit_partial=True)`` and ``_encode_mel_chunk``.
The subsampling then runs once for the sessions whose windows have the same length and
keep the same rows (all of them once they stream in step), over their stacked windows,
computing only the subsampled rows the frame keeps (:func:`pre_encode_rows`; upstream
recomputes the whole window). Each chunk's encoder
layers then run for all sessions at once, chunk by chunk ("rounds": a session's second chunk of a frame, if any,
follows its first): the feed-forward modules, norms, key/value projections, pointwise
convolutions, the depthwise convolution over the stacked windows and the batch norm run over
the stacked ``(B, 1, d)`` rows; the attention (:func:`.encoder.attend`,
upstream ``RelPositionMultiHeadAttention.stream``) runs once per group of sessions whose
windows hold the same number of frames (every session after ``left_context`` frames), over
their stacked rows and retained keys and values.
A round whose chunks are not one encoder frame each runs each session's blocks alone.
One session is the same computation with ``B = 1``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.streaming import _PRE_ENCODE_MEL_CACHE

from .encoder import attend


def _strided_lengths(subsampling, length: int) -> list[int]:
    """Time lengths of the input and of each strided convolution's output."""
    lengths = [length]
    span = subsampling.pad_left + subsampling.pad_right - subsampling.kernel_size
    for _ in subsampling._strided_idx:
        lengths.append((lengths[-1] + span) // subsampling.stride + 1)
    return lengths


def pre_encode_rows(subsampling, window: mx.array, lo: int, hi: int) -> mx.array:
    """Rows ``[lo, hi)`` of upstream ``CausalDwStridingSubsampling(window, [T])[0]``,
    computing only the rows they depend on.

    A streamed frame re-runs the subsampling over its mel window (the cached frames plus
    the new ones) and keeps one or two of the output rows; the rest is recomputed every
    frame. Here each strided convolution runs over the input rows its kept output rows
    read (with the same causal zero padding where they reach past either end), the
    pointwise layers and the output projection over the kept rows only. Every output
    element is computed by the same operations on the same inputs (MLX's convolutions and
    the CPU layer's products compute each output element on its own), so the rows are
    bit-identical to slicing the full output (``tests/test_batch_speech.py``).

    Args:
        subsampling: the encoder's ``pre_encode`` (upstream ``CausalDwStridingSubsampling``).
        window: ``(B, T, n_mels)`` mel frames.
        lo, hi: the output rows wanted, ``0 <= lo < hi <= `` the subsampled length.

    Returns:
        ``(B, hi - lo, d_model)``.

    Raises:
        ValueError: ``lo``/``hi`` outside the subsampled length or empty.
    """
    lengths = _strided_lengths(subsampling, window.shape[1])
    if not 0 <= lo < hi <= lengths[-1]:
        raise ValueError(f"pre_encode rows [{lo}, {hi}) outside the {lengths[-1]} subsampled rows")
    stride, kernel, pad_left = subsampling.stride, subsampling.kernel_size, subsampling.pad_left
    # Backwards: the output rows of each strided convolution its successor reads.
    wanted = [(lo, hi)]
    for length in reversed(lengths[1:-1]):
        first, stop = wanted[0]
        wanted.insert(0, (max(0, stride * first - pad_left), min(length, stride * (stop - 1) - pad_left + kernel)))
    first, stop = wanted[0]
    start, end = max(0, stride * first - pad_left), min(lengths[0], stride * (stop - 1) - pad_left + kernel)
    x = mx.expand_dims(window[:, start:end], axis=-1)
    strided = 0
    for index, layer in enumerate(subsampling.conv):
        if index in subsampling._strided_idx:
            first, stop = wanted[strided]
            strided += 1
            # the padded rows [stride * first, stride * (stop - 1) + kernel): zeros where
            # they fall before the input (left padding) or after it (right padding)
            before = start - (stride * first - pad_left)
            after = (stride * (stop - 1) - pad_left + kernel) - end
            x = mx.pad(x, ((0, 0), (before, after), (pad_left, subsampling.pad_right), (0, 0)))
            start, end = first, stop
        x = layer(x)
    b, t, f, c = x.shape
    return subsampling.out(x.transpose(0, 1, 3, 2).reshape(b, t, c * f))


def _trimmable(subsampling) -> bool:
    """Whether :func:`pre_encode_rows` knows this subsampling (upstream's causal stack)."""
    return all(
        hasattr(subsampling, name)
        for name in ("conv", "out", "_strided_idx", "stride", "kernel_size", "pad_left", "pad_right")
    )


def _pre_encode(state, m: mx.array, include_boundary: bool) -> tuple[mx.array, int, int] | None:
    """Upstream ``ConformerStreamingState._encode_mel_chunk``'s bookkeeping up to (not including) the
    layers: the chunk's mel window and the subsampled rows ``[lo, hi)`` it keeps (None:
    none), computed later for all sessions at once (:func:`_subsample`)."""
    cache_len = 0 if state.mel_cache is None else state.mel_cache.shape[1]
    win = m if state.mel_cache is None else mx.concatenate([state.mel_cache, m], axis=1)
    # the subsampled length from the lengths alone (no host round trip, nothing computed)
    rows = state.encoder.pre_encode._calc_length(win.shape[1])
    end = state.consumed + m.shape[1]
    base = (state.consumed - cache_len) // state.subsampling_factor
    lo = state.emitted - base
    hi = rows if include_boundary else (end // state.subsampling_factor - base)
    state.consumed = end
    keep = _PRE_ENCODE_MEL_CACHE + (end - _PRE_ENCODE_MEL_CACHE) % state.subsampling_factor
    state.mel_cache = win[:, -keep:]
    if hi <= lo:
        state.emitted = base + max(lo, hi)
        return None
    state.emitted = base + hi
    return win, lo, hi


def _subsample(subsampling, plans: list[tuple[mx.array, int, int]]) -> list[mx.array]:
    """Each plan's ``(1, hi - lo, d)`` subsampled rows. Plans with the same window length
    and rows (every session's, once they stream in step) run as one stacked
    :func:`pre_encode_rows` call: the convolutions and products compute each batch item on
    its own, so each session's rows are its solo bits."""
    results: list[mx.array | None] = [None] * len(plans)
    groups: dict[tuple[int, int, int], list[int]] = {}
    trim = _trimmable(subsampling)
    for index, (win, lo, hi) in enumerate(plans):
        rows = subsampling._calc_length(win.shape[1])
        if trim and 0 <= lo < hi <= rows:
            groups.setdefault((win.shape[1], lo, hi), []).append(index)
        else:  # upstream's whole window, sliced (a Python list of lengths: no host round trip)
            results[index] = subsampling(win, [win.shape[1]])[0][:, lo:hi]
    for (_, lo, hi), members in groups.items():
        rows = pre_encode_rows(subsampling, _stacked([plans[index][0] for index in members]), lo, hi)
        for position, index in enumerate(members):
            results[index] = rows if len(members) == 1 else rows[position : position + 1]
    return results


def _chunks(state, mel: mx.array) -> list[tuple[mx.array, int, int]]:
    """Upstream ``ConformerStreamingState.push(mel, emit_partial=True)``, returning each
    chunk's window and kept rows (:func:`_pre_encode`; the layers still to run)."""
    if state.closed:
        raise RuntimeError("conformer streaming state is closed")
    state._append_pending(mel)
    plans = []
    while state.pending is not None and state.pending.shape[1] > 0:
        chunk_mel = state.first_chunk_mel if state.consumed == 0 else state.chunk_mel
        take = min(chunk_mel, state.pending.shape[1])
        if state.pending.shape[1] <= chunk_mel:
            take = state.pending.shape[1]
        m = state.pending[:, :take]
        state.pending = state.pending[:, take:]
        plan = _pre_encode(state, m, state.pending.shape[1] == 0)
        if plan is not None:
            plans.append(plan)
    return plans


def _stacked(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)


def _attention(index: int, attention, states: list, xn: mx.array) -> mx.array:
    """The self-attention of layer ``index`` over one row per session, ``(B, 1, d)``.

    Sessions whose windows hold the same number of frames (all of them once every session
    has run ``left_context`` frames, or when they joined together) share one
    :func:`.encoder.attend` call over their stacked rows, retained keys and
    values and the same position embedding; each row is computed as alone (row-wise
    products, per-row attention).
    """
    new_keys, new_values = attention.linear_k(xn), attention.linear_v(xn)
    groups: dict[int, list[int]] = {}
    for row, state in enumerate(states):
        cache = state.attn_cache[index]
        groups.setdefault(0 if cache is None else cache.shape[1], []).append(row)
    pieces, order = [], []
    for retained, members in groups.items():
        whole = len(members) == len(states)
        picked = None if whole else mx.array(members)
        xn_rows = xn if whole else xn[picked]
        keys = new_keys if whole else new_keys[picked]
        values = new_values if whole else new_values[picked]
        kv = xn_rows
        if retained:
            group = [states[row] for row in members]
            kv = mx.concatenate([_stacked([state.attn_cache[index] for state in group]), xn_rows], axis=1)
            keys = mx.concatenate([_stacked([state.key_cache[index] for state in group]), keys], axis=1)
            values = mx.concatenate([_stacked([state.value_cache[index] for state in group]), values], axis=1)
        first = states[members[0]]
        pos_emb = first.encoder.pos_enc.pos_emb_for(kv.shape[1], xn.dtype)
        pieces.append(attend(attention, xn_rows, keys, values, pos_emb))
        order += members
        left = first.left_cache
        for position, row in enumerate(members):
            state = states[row]
            one = slice(position, position + 1)
            state.attn_cache[index] = kv[one, -left:] if left > 0 else kv[one, :0]
            state.key_cache[index] = keys[one, -left:] if left > 0 else keys[one, :0]
            state.value_cache[index] = values[one, -left:] if left > 0 else values[one, :0]
    if len(pieces) == 1:
        return pieces[0]
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return mx.concatenate(pieces, axis=0)[mx.array(inverse)]


def _block(index: int, block, states: list, x: mx.array) -> mx.array:
    """Upstream ``_stream_block`` for layer ``index`` over the rows of ``states``: one row
    per session, or one session's ``(1, n, d)`` rows; the attention with the cached
    key/value projections (:class:`.encoder.ProjectedStreamingState`)."""
    residual = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
    xn = block.norm_self_att(residual)
    residual = residual + _attention(index, block.self_attn, states, xn)

    xc = block.norm_conv(residual)
    g = nn.glu(block.conv.pointwise_conv1(xc), axis=-1)
    left = states[0].conv_left
    caches = [
        state.conv_cache[index]
        if state.conv_cache[index] is not None
        else mx.zeros((1, left, g.shape[2]), dtype=g.dtype)
        for state in states
    ]
    din = mx.concatenate([_stacked(caches), g], axis=1)
    dw = block.conv.depthwise_conv(din)
    for row, state in enumerate(states):
        state.conv_cache[index] = din[row : row + 1, -left:]
    y = block.conv.batch_norm(dw)
    y = block.conv.activation(y)
    residual = residual + block.conv.pointwise_conv2(y)

    residual = residual + 0.5 * block.feed_forward2(block.norm_feed_forward2(residual))
    return block.norm_out(residual)


def encode_frames(encoder, states: list, mels: list[mx.array]) -> list[list[mx.array]]:
    """Push one frame's mel rows per session; return each session's encoded chunks.

    Args:
        encoder: the perception FastConformer (``states[i].encoder``).
        states: per session its ``ProjectedStreamingState``.
        mels: per session ``(1, frames, 128)`` new mel rows (from its ``MelFrontend``).

    Returns:
        Per session the list of ``(1, n, d)`` chunks ``state.push(mel, emit_partial=True)``
        returns alone.
    """
    pending = [_chunks(state, mel) for state, mel in zip(states, mels)]
    outputs: list[list[mx.array]] = [[] for _ in states]
    rounds = max((len(rows) for rows in pending), default=0)
    for round_index in range(rounds):
        members = [i for i, rows in enumerate(pending) if len(rows) > round_index]
        hs = _subsample(encoder.pre_encode, [pending[i][round_index] for i in members])
        if len(members) > 1 and all(h.shape[1] == 1 for h in hs):
            h = mx.concatenate(hs, axis=0)
            group = [states[i] for i in members]
            for index, block in enumerate(encoder.layers):
                h = _block(index, block, group, h)
            for row, i in enumerate(members):
                outputs[i].append(h[row : row + 1])
            continue
        for i, h in zip(members, hs):
            for index, block in enumerate(encoder.layers):
                h = _block(index, block, [states[i]], h)
            outputs[i].append(h)
    return outputs

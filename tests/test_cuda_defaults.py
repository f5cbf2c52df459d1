"""MLX's CUDA graph-cache settings for serving: set only on CUDA, only where unset, and by
the loader hook before the weights load."""

from __future__ import annotations

import os

import pytest

from mlx_voicechat_plugin.accel import cuda


def test_on_cuda_both_settings_are_set_where_unset():
    environ: dict[str, str] = {}
    assert cuda.apply_defaults(environ, cuda=True) == cuda.DEFAULTS
    assert environ == {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def test_a_value_the_user_set_is_kept():
    environ = {"MLX_CUDA_GRAPH_CACHE_SIZE": "400", "PATH": "/bin"}
    assert cuda.apply_defaults(environ, cuda=True) == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
    assert environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "400"
    environ = {"MLX_CUDA_GRAPH_CACHE_SIZE": "1", "MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert cuda.apply_defaults(environ, cuda=True) == {} and environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "1"


def test_nothing_is_set_off_cuda():
    environ: dict[str, str] = {}
    assert cuda.apply_defaults(environ, cuda=False) == {} and environ == {}
    import mlx.core as mx

    if not mx.cuda.is_available():
        assert cuda.cuda_available() is False
        assert cuda.apply_defaults({}) == {}


@pytest.mark.parametrize("on_cuda", [True, False])
def test_the_loader_hook_applies_them_before_the_weights_are_evaluated(tiny, monkeypatch, on_cuda):
    import mlx_voicechat_plugin.accel as accel
    from mlx_voicechat_plugin.loading import load

    for name in cuda.DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cuda, "cuda_available", lambda: on_cuda)
    seen = {}
    install = accel.install

    def watching(model):  # the loader hook installs the layer before it evaluates the weights
        seen.update({name: os.environ.get(name) for name in cuda.DEFAULTS})
        return install(model)

    monkeypatch.setattr(accel, "install", watching)
    load(tiny)
    assert seen == (cuda.DEFAULTS if on_cuda else dict.fromkeys(cuda.DEFAULTS))

"""Imported by ``mlx_voicechat_plugin.pth`` at interpreter start; must stay cheap and silent."""

try:
    from mlx_voicechat_plugin.registration.shim import install as _install

    _install()
except Exception:  # pragma: no cover - never break interpreter start-up
    pass

"""Command-line interfaces: ``mlx-voicechat`` and the ``python -m mlx_vlm.generate`` route."""

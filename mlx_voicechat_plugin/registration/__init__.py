"""How mlx-vlm finds this package: entry points, plus a startup shim until mlx-vlm reads them.

* :mod:`.entry_points` -- the ``mlx_vlm.models`` entry-point group and the resolver that
  ``patches/0001-mlx-vlm-entry-point-model-discovery.patch`` adds to mlx-vlm.
* :mod:`.hooks` -- what the shim changes in each mlx-vlm module once it is imported.
* :mod:`.shim` -- the lazy post-import hook installed by ``mlx_voicechat_plugin.pth``.

Nothing is imported here: the ``.pth`` file runs at every interpreter start.
"""

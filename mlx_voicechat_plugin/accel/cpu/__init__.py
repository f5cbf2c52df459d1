"""The CPU acceleration layer: every execution choice that only pays on MLX's CPU backend.

:func:`install` (called by :func:`mlx_voicechat_plugin.accel.install` when the model
computes on the CPU) builds and self-tests the exact native kernels (:mod:`.native`), then
swaps module classes, parameters untouched, every result bit-identical, and finally
times each kernel family against MLX's operation on the model's own shapes, switching
off the families that are not faster on this machine (:mod:`.native.calibration`,
:mod:`.shapes`):

==========================  ==============================================================
:mod:`.parallel`            large products split over two CPU streams; float32 weights held
                            transposed (the reference BLAS's fast layout)
:mod:`.convolutions`        depthwise ``Conv1d`` as the native kernel
:mod:`.norms`               every RMS norm as the native kernel
:mod:`.rnnt`                RNNT LSTM / joint against float32 ``(K, N)`` weight copies
:mod:`.encoder`             the subsampling's 1x1 and depthwise ``Conv2d`` on two cores
:mod:`.attention`           attention with native products (encoder offline, EAR-TTS, LLM)
:mod:`.codec`               codec products on two cores, GELU table, ConvNeXt row chunks
:mod:`.tts`                 EAR-TTS's quantiser search as one native kernel
:mod:`.execution`           the runtime's side/worker streams (:class:`CpuExecution`)
==========================  ==============================================================

Deleting this package (or ``MLX_VOICECHAT_CPU_ACCEL=0``) leaves the model on plain MLX:
same results, slower on the CPU.
"""

from __future__ import annotations


def install(model) -> str:
    """Install the CPU layer onto ``model`` (weights loaded and quantized); returns ``"cpu"``.

    The native kernels are built (once per machine and MLX version, cached) here, at load
    time, never in the middle of a turn; without a compiler the layer still installs and
    its wrappers use MLX's own operations.
    """
    from . import native
    from .attention import install_exact_attention
    from .codec import install_codec_layers
    from .convolutions import install_depthwise
    from .encoder import install_subsampling_split
    from .execution import CpuExecution
    from .norms import install_kernel_norms
    from .parallel import install_split_linears
    from .rnnt import install_rnnt_shadows
    from .tts import install_kernel_tts

    native.available()  # build / load / self-test now, not mid-frame
    stt = model.stt_model
    install_split_linears(model)
    install_kernel_norms(model)
    install_rnnt_shadows(stt.rnnt_decoder, stt.rnnt_joint)
    install_depthwise(model)
    install_subsampling_split(stt.perception.encoder.pre_encode)
    install_exact_attention(model)
    install_codec_layers(model)
    install_kernel_tts(model)
    model.execution = CpuExecution()
    if native.available():
        from .shapes import model_workloads

        # Each kernel family against MLX on this model's shapes (cached per machine).
        native.calibrate(model_workloads(model, native.extension()))
    return "cpu"

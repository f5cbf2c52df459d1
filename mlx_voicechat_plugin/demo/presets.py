"""Sizes of the demo checkpoints.

Every preset keeps the real structure of NemotronLabs VoiceChat (128-bin mel, 8x causal
subsampling, 70-frame attention context, Nemotron-H Mamba2/attention/MLP pattern,
Gemma-3 style EAR-TTS with sliding and global layers, 31 codebooks of 1024 codes, codec
rates 7/7/9 with an iSTFT hop of 4 so one code frame is 1764 samples) and only shrinks
widths and depths. ``medium`` is sized so per-frame cost is dominated by the networks
(encoder 256 x 4, LLM 512 x 8, TTS 256 x 6), about 43 M parameters.

``real-layout`` keeps everything of the published model except widths: the real depths
(24 encoder layers, the 56-layer Nemotron-H pattern, 28 EAR-TTS layers), head dimensions
(LLM 128, EAR-TTS 72), Mamba state 128 in 8 groups, the GQA ratio 5:1, int64 buffers, the
131,072-token tokenizer with 1,000 special tokens, the per-module quantization form and the
v2 converter's config extras. ``full`` is the published configuration at full size
(:data:`FULL_VALUES` lists the public sources' values).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Nemotron-H layer pattern of the published language model (56 layers: 27 Mamba2 ``M``,
#: 4 attention ``*``, 25 MLP ``-``).
REAL_LLM_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
#: Value the v2 converter writes as ``mlx_runtime_config_version``.
RUNTIME_CONFIG_VERSION = 2
#: ``source_revision`` written by the demo builder (no real source commit exists).
DEMO_SOURCE_REVISION = "demo-random-weights"


@dataclass(frozen=True)
class Preset:
    """Widths and depths of one demo checkpoint (all other settings are the real ones).

    Fields left at ``None`` derive from the widths as the small presets always did
    (``llm_head_dim = llm_width // llm_attention_heads`` etc.); the ``real-layout`` and
    ``full`` presets set them to the published values.
    """

    name: str
    text_vocab_size: int
    rnnt_vocab_size: int
    encoder_width: int
    encoder_layers: int
    encoder_heads: int
    subsampling_channels: int
    llm_width: int
    llm_pattern: str
    llm_mamba_heads: int
    llm_attention_heads: int
    llm_mlp_width: int
    rnnt_width: int
    tts_width: int
    tts_layers: int
    tts_heads: int
    tts_sliding_window: int
    #: ``None`` leaves ``sliding_window_pattern`` out of the config (upstream default 6).
    tts_sliding_window_pattern: int | None
    mog_predictions: int
    mog_low_rank: int
    mog_layers: int
    latent_size: int
    codec_channels: int
    codec_latent: int
    llm_head_dim: int | None = None
    llm_kv_heads: int | None = None
    mamba_head_dim: int | None = None
    ssm_state_size: int = 16
    mamba_groups: int = 1
    tts_head_dim: int | None = None
    tts_kv_heads: int | None = None
    tts_intermediate: int | None = None
    char_heads: int = 2
    char_head_dim: int | None = None
    char_intermediate: int | None = None
    mog_intermediate: int | None = None
    rnnt_pred_width: int | None = None
    #: ``"trained"``: a byte-level BPE trained on the demo corpus (specials 0..15);
    #: ``"large"``: exactly ``text_vocab_size`` tokens, 1,000 specials and a split +
    #: byte-level pre-tokenizer like the published tokenizer (see :mod:`.tokenizers`).
    tokenizer: str = "trained"
    #: Write the integer buffers as int64 (as the NeMo export does) instead of int32.
    int64_buffers: bool = False
    #: Quantization config form: ``"flat"`` (``{group_size, bits, mode}``) or
    #: ``"modules"`` (the v2 converter's per-module dict: one entry per quantized module).
    quantization_form: str = "flat"
    #: Bits for the token embedding and the two heads when quantized (``None``: the
    #: requested bits); a different value gives a mixed-bits checkpoint.
    head_bits: int | None = None
    #: Add ``mlx_runtime_config_version``, ``source_revision`` and the text config's
    #: ``time_step_limit: [0.0, Infinity]``, as the published v2 conversion does.
    converter_extras: bool = False
    #: Fill the large weights with :func:`.weights.fast_fill` (tiled random block) instead of
    #: MLX's initialisers, so the full-size build fits in minutes on a small CPU.
    fast_fill: bool = False


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        text_vocab_size=512,
        rnnt_vocab_size=128,
        encoder_width=32,
        encoder_layers=2,
        encoder_heads=2,
        subsampling_channels=16,
        llm_width=64,
        llm_pattern="M*M-",
        llm_mamba_heads=4,
        llm_attention_heads=2,
        llm_mlp_width=128,
        rnnt_width=32,
        tts_width=64,
        tts_layers=2,
        tts_heads=2,
        tts_sliding_window=32,
        tts_sliding_window_pattern=2,
        mog_predictions=64,
        mog_low_rank=8,
        mog_layers=1,
        latent_size=16,
        codec_channels=8,
        codec_latent=16,
    ),
    "small": Preset(
        name="small",
        text_vocab_size=768,
        rnnt_vocab_size=256,
        encoder_width=128,
        encoder_layers=2,
        encoder_heads=4,
        subsampling_channels=32,
        llm_width=256,
        llm_pattern="M*M-M*",
        llm_mamba_heads=8,
        llm_attention_heads=4,
        llm_mlp_width=512,
        rnnt_width=64,
        tts_width=128,
        tts_layers=4,
        tts_heads=4,
        tts_sliding_window=64,
        tts_sliding_window_pattern=2,
        mog_predictions=256,
        mog_low_rank=16,
        mog_layers=2,
        latent_size=64,
        codec_channels=16,
        codec_latent=64,
    ),
    "medium": Preset(
        name="medium",
        text_vocab_size=1024,
        rnnt_vocab_size=512,
        encoder_width=256,
        encoder_layers=4,
        encoder_heads=4,
        subsampling_channels=128,
        llm_width=512,
        llm_pattern="M*M-M*M-",
        llm_mamba_heads=16,
        llm_attention_heads=8,
        llm_mlp_width=2048,
        rnnt_width=256,
        tts_width=256,
        tts_layers=6,
        tts_heads=4,
        tts_sliding_window=7500,
        tts_sliding_window_pattern=6,
        mog_predictions=1024,
        mog_low_rank=16,
        mog_layers=3,
        latent_size=128,
        codec_channels=64,
        codec_latent=128,
    ),
    "real-layout": Preset(
        name="real-layout",
        text_vocab_size=131072,
        rnnt_vocab_size=1024,
        encoder_width=64,
        encoder_layers=24,
        encoder_heads=8,
        subsampling_channels=16,
        llm_width=64,
        llm_pattern=REAL_LLM_PATTERN,
        llm_mamba_heads=8,
        llm_attention_heads=5,
        llm_mlp_width=256,
        rnnt_width=32,
        tts_width=64,
        tts_layers=28,
        tts_heads=2,
        tts_sliding_window=7500,
        tts_sliding_window_pattern=None,
        mog_predictions=1024,
        mog_low_rank=64,
        mog_layers=3,
        latent_size=16,
        codec_channels=8,
        codec_latent=16,
        llm_head_dim=128,
        llm_kv_heads=1,
        mamba_head_dim=8,
        ssm_state_size=128,
        mamba_groups=8,
        tts_head_dim=72,
        tts_kv_heads=2,
        char_head_dim=72,
        char_intermediate=256,
        tokenizer="large",
        int64_buffers=True,
        quantization_form="modules",
        head_bits=8,
        converter_extras=True,
    ),
    "full": Preset(
        name="full",
        text_vocab_size=131072,
        rnnt_vocab_size=1024,
        encoder_width=1024,
        encoder_layers=24,
        encoder_heads=8,
        subsampling_channels=256,
        llm_width=4480,
        llm_pattern=REAL_LLM_PATTERN,
        llm_mamba_heads=128,
        llm_attention_heads=40,
        llm_mlp_width=15680,
        rnnt_width=640,
        tts_width=1152,
        tts_layers=28,
        tts_heads=16,
        tts_sliding_window=7500,
        tts_sliding_window_pattern=None,
        mog_predictions=1024,
        mog_low_rank=64,
        mog_layers=3,
        latent_size=512,
        codec_channels=384,
        codec_latent=512,
        llm_head_dim=128,
        llm_kv_heads=8,
        mamba_head_dim=80,
        ssm_state_size=128,
        mamba_groups=8,
        tts_head_dim=72,
        tts_kv_heads=16,
        char_heads=16,
        char_head_dim=72,
        char_intermediate=4608,
        tokenizer="large",
        int64_buffers=True,
        quantization_form="modules",
        converter_extras=True,
        fast_fill=True,
    ),
}

#: Published values the ``full`` preset reproduces, by config path (sources: mlx-vlm's
#: converter tests and defaults, the Rust port's documentation, NeMo
#: recipes). ``tests/test_demo_checkpoint.py`` checks the built config against it.
FULL_VALUES: dict[str, object] = {
    "audio_config.encoder.n_layers": 24,
    "audio_config.encoder.d_model": 1024,
    "audio_config.encoder.n_heads": 8,
    "audio_config.encoder.att_context_size": [[70, 0]],
    "audio_config.output_dim": 4480,
    "audio_config.decoder.pred_hidden": 640,
    "audio_config.decoder.pred_rnn_layers": 2,
    "audio_config.joint.joint_hidden": 640,
    "audio_config.joint.num_classes": 1024,
    "rnnt_blank_id": 1024,
    "text_config.hidden_size": 4480,
    "text_config.intermediate_size": 15680,
    "text_config.num_attention_heads": 40,
    "text_config.num_key_value_heads": 8,
    "text_config.head_dim": 128,
    "text_config.mamba_num_heads": 128,
    "text_config.mamba_head_dim": 80,
    "text_config.ssm_state_size": 128,
    "text_config.n_groups": 8,
    "text_config.conv_kernel": 4,
    "text_config.vocab_size": 131072,
    "text_config.num_hidden_layers": 56,
    "text_config.hybrid_override_pattern": REAL_LLM_PATTERN,
    "tts_config.hidden_size": 1152,
    "tts_config.intermediate_size": 4608,
    "tts_config.num_hidden_layers": 28,
    "tts_config.num_attention_heads": 16,
    "tts_config.head_dim": 72,
    "tts_config.sliding_window": 7500,
    "tts_config.latent_size": 512,
    "tts_config.character_encoder.hidden_size": 1152,
    "tts_config.character_encoder.num_hidden_layers": 1,
    "tts_config.mog_head.intermediate_size": 4608,
    "tts_config.mog_head.low_rank": 64,
    "tts_config.mog_head.num_layers": 3,
    "tts_config.mog_head.num_predictions": 1024,
    "codec_config.base_channels": 384,
    "codec_config.channel_multipliers": [1, 2, 4],
    "codec_config.downsample_rates": [7, 7, 9],
    "codec_config.blocks_per_stage": 3,
    "codec_config.block_kernel_size": 7,
    "codec_config.latent_dim": 512,
    "codec_config.n_fft": 16,
    "codec_config.hop_length": 4,
    "codec_config.num_quantizers": 31,
    "codec_config.codebook_size": 1024,
}


def config_for(preset: Preset, text_vocab_size: int, rnnt_vocabulary: list[str]) -> dict:
    """Return the full ``config.json`` dict for ``preset``.

    The schema is the one upstream ``mlx_vlm/models/nemotron_voicechat/convert.py``
    (``build_runtime_config``) writes for the published conversions.

    Args:
        preset: the sizes.
        text_vocab_size: the trained byte-level BPE vocabulary size (LLM vocab).
        rnnt_vocabulary: the SentencePiece pieces (RNNT classes without blank).
    """
    p = preset
    mamba_head_dim = p.mamba_head_dim or p.llm_width // p.llm_mamba_heads
    rnnt_classes = len(rnnt_vocabulary)
    config = {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": {
            "model_type": "nemotron_h",
            "vocab_size": text_vocab_size,
            "hidden_size": p.llm_width,
            "intermediate_size": p.llm_mlp_width,
            "num_hidden_layers": len(p.llm_pattern),
            "max_position_embeddings": 131072,
            "num_attention_heads": p.llm_attention_heads,
            "num_key_value_heads": p.llm_kv_heads or max(1, p.llm_attention_heads // 2),
            "attention_bias": False,
            "mamba_num_heads": p.llm_mamba_heads,
            "mamba_head_dim": mamba_head_dim,
            "mamba_proj_bias": False,
            "ssm_state_size": p.ssm_state_size,
            "conv_kernel": 4,
            "n_groups": p.mamba_groups,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": p.llm_pattern,
            "head_dim": p.llm_head_dim or p.llm_width // p.llm_attention_heads,
        },
        "audio_config": {
            "preprocessor": {
                "sample_rate": 16000,
                "features": 128,
                "n_fft": 512,
                "window_size": 0.025,
                "window_stride": 0.01,
                "window": "hann",
                "preemph": 0.97,
                "dither": 1e-05,
                "normalize": "NA",
                "log_zero_guard_value": 2**-24,
                "pad_to": 0,
                "pad_value": 0.0,
                "pad_mode": "reflect",
            },
            "encoder": {
                "feat_in": 128,
                "n_layers": p.encoder_layers,
                "d_model": p.encoder_width,
                "n_heads": p.encoder_heads,
                "ff_expansion_factor": 4,
                "subsampling_factor": 8,
                "subsampling_conv_channels": p.subsampling_channels,
                "conv_kernel_size": 9,
                "causal_downsampling": True,
                "conv_context_size": "causal",
                "conv_norm_type": "layer_norm",
                "self_attention_model": "rel_pos",
                "att_context_style": "chunked_limited",
                "att_context_size": [[70, 0]],
                "pos_emb_max_len": 5000,
                "use_bias": False,
                "xscaling": False,
            },
            "decoder": {
                "pred_hidden": p.rnnt_pred_width or p.rnnt_width,
                "pred_rnn_layers": 2,
                "vocab_size": rnnt_classes,
                "blank_as_pad": True,
            },
            "joint": {
                "joint_hidden": p.rnnt_width,
                "activation": "relu",
                "encoder_hidden": p.encoder_width,
                "pred_hidden": p.rnnt_pred_width or p.rnnt_width,
                "num_classes": rnnt_classes,
            },
            "output_dim": p.llm_width,
            "max_symbols": 10,
        },
        "tts_config": {
            "hidden_size": p.tts_width,
            "intermediate_size": p.tts_intermediate or 4 * p.tts_width,
            "num_hidden_layers": p.tts_layers,
            "num_attention_heads": p.tts_heads,
            "num_key_value_heads": p.tts_kv_heads or p.tts_heads,
            "head_dim": p.tts_head_dim or p.tts_width // p.tts_heads,
            "sliding_window": p.tts_sliding_window,
            "sliding_window_pattern": p.tts_sliding_window_pattern,
            "latent_size": p.latent_size,
            "num_quantizers": 31,
            "codebook_size": 1024,
            "num_delay_speech_tokens": 2,
            "exponent": 3.0,
            "disable_eos_prediction": True,
            "use_gated_fusion_for_text_audio": True,
            "use_subword_flag_emb": True,
            "use_bos_eos_emb": True,
            "use_audio_prompt_frozen_projection": True,
            "character_encoder": {
                "hidden_size": p.tts_width,
                "intermediate_size": p.char_intermediate or 2 * p.tts_width,
                "num_hidden_layers": 1,
                "num_attention_heads": p.char_heads,
                "num_key_value_heads": p.char_heads,
                "head_dim": p.char_head_dim or p.tts_width // p.char_heads,
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 256.0,
                "attn_logit_softcapping": 50.0,
                "rope_base": 10000.0,
                "char_vocab_size": 257,
            },
            "mog_head": {
                "intermediate_size": p.mog_intermediate or 4 * p.tts_width,
                "low_rank": p.mog_low_rank,
                "min_log_std": -4.0,
                "num_layers": p.mog_layers,
                "num_predictions": p.mog_predictions,
                "eps": 1e-6,
            },
            "guidance_scale": 0.2,
            "top_p": 0.95,
            "noise_scale": 0.001,
            "audio_prompt_duration": 3.0,
        },
        "codec_config": {
            "sample_rate": 22050,
            "base_channels": p.codec_channels,
            "channel_multipliers": [1, 2, 4],
            "downsample_rates": [7, 7, 9],
            "blocks_per_stage": 3,
            "block_kernel_size": 7,
            "latent_dim": p.codec_latent,
            "n_fft": 16,
            "hop_length": 4,
            "num_quantizers": 31,
            "codebook_size": 1024,
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 12,
        "silence_token_id": 11,
        "rnnt_blank_id": rnnt_classes,
        "input_sample_rate": 16000,
        "output_sample_rate": 22050,
        "frame_duration": 0.08,
        "function_channel_weight": 2.0,
        "speaker": "Aria",
        "rnnt_vocabulary": list(rnnt_vocabulary),
    }
    if p.tts_sliding_window_pattern is None:
        del config["tts_config"]["sliding_window_pattern"]
    if p.converter_extras:
        config["text_config"]["time_step_limit"] = [0.0, float("inf")]
        config["mlx_runtime_config_version"] = RUNTIME_CONFIG_VERSION
        config["source_revision"] = DEMO_SOURCE_REVISION
    return config

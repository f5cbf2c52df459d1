"""Sizes of the demo checkpoints.

Every preset keeps the real structure of NemotronLabs VoiceChat (128-bin mel, 8x causal
subsampling, 70-frame attention context, Nemotron-H Mamba2/attention/MLP pattern,
Gemma-3 style EAR-TTS with sliding and global layers, 31 codebooks of 1024 codes, codec
rates 7/7/9 with an iSTFT hop of 4 so one code frame is 1764 samples) and only shrinks
widths and depths. ``medium`` is sized so per-frame cost is dominated by the networks
(encoder 256 x 4, LLM 512 x 8, TTS 256 x 6), about 43 M parameters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """Widths and depths of one demo checkpoint (all other settings are the real ones)."""

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
    tts_sliding_window_pattern: int
    mog_predictions: int
    mog_low_rank: int
    mog_layers: int
    latent_size: int
    codec_channels: int
    codec_latent: int


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
    mamba_head_dim = p.llm_width // p.llm_mamba_heads
    rnnt_classes = len(rnnt_vocabulary)
    return {
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
            "num_key_value_heads": max(1, p.llm_attention_heads // 2),
            "attention_bias": False,
            "mamba_num_heads": p.llm_mamba_heads,
            "mamba_head_dim": mamba_head_dim,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": p.llm_pattern,
            "head_dim": p.llm_width // p.llm_attention_heads,
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
                "pred_hidden": p.rnnt_width,
                "pred_rnn_layers": 2,
                "vocab_size": rnnt_classes,
                "blank_as_pad": True,
            },
            "joint": {
                "joint_hidden": p.rnnt_width,
                "activation": "relu",
                "encoder_hidden": p.encoder_width,
                "pred_hidden": p.rnnt_width,
                "num_classes": rnnt_classes,
            },
            "output_dim": p.llm_width,
            "max_symbols": 10,
        },
        "tts_config": {
            "hidden_size": p.tts_width,
            "intermediate_size": 4 * p.tts_width,
            "num_hidden_layers": p.tts_layers,
            "num_attention_heads": p.tts_heads,
            "num_key_value_heads": p.tts_heads,
            "head_dim": p.tts_width // p.tts_heads,
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
                "intermediate_size": 2 * p.tts_width,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": p.tts_width // 2,
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 256.0,
                "attn_logit_softcapping": 50.0,
                "rope_base": 10000.0,
                "char_vocab_size": 257,
            },
            "mog_head": {
                "intermediate_size": 4 * p.tts_width,
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

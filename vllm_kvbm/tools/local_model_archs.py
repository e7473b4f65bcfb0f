"""The local models of other architectures than Llama: a Qwen3-Next-shaped
hybrid (Gated DeltaNet and full attention), Gemma 3, gpt-oss and Llama 4
shapes with sliding-window or chunked-local layers, and an Idefics3
vision-language model. Built like the Llama of tools/local_model.py (its
tokenizer, its recipe stamp, its peaky logits); ``python -m
vllm_kvbm.tools.local_model --arch ...`` builds any of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_kvbm.tools.local_model import RECIPE_VERSION, _shared_config, _write

HYBRID_DIR = "models/kvbm-qwen3-next-4l"


def build_qwen3_next(
    out: str | os.PathLike = HYBRID_DIR,
    layers: int = 4,
    hidden: int = 64,
    vocab_size: int = 8000,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """A Qwen3-Next-shaped hybrid: three Gated DeltaNet layers, then a full
    attention layer, repeated (Qwen3-Next's and Qwen3.5's layout), dense MLPs
    beside the GDN layers and a few experts beside full attention (vLLM's
    Qwen3-Next needs one sparse layer); tiny, for vLLM's CPU build, which
    runs the GDN layers in bf16 only."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    recipe = dict(
        version=RECIPE_VERSION,
        arch="qwen3_next",
        layers=layers,
        hidden=hidden,
        vocab_size=vocab_size,
        seed=seed,
        experts=4,
        gdn_head_dim=64,
        head_dim=64,
    )
    full = [i for i in range(layers) if i % 4 == 3]
    return _write(
        out,
        recipe,
        lambda tokenizer: Qwen3NextForCausalLM(
            Qwen3NextConfig(
                **_shared_config(tokenizer, hidden, layers),
                layer_types=[
                    "full_attention" if i in full else "linear_attention" for i in range(layers)
                ],
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,  # a head size vLLM's CPU attention kernel has
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                # head dims vLLM's CPU GDN kernel has (64 or 128)
                linear_key_head_dim=64,
                linear_value_head_dim=64,
                mlp_only_layers=[i for i in range(layers) if i not in full],
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
                max_position_embeddings=4096,
            )
        ),
        force,
    )


GEMMA3_DIR = "models/kvbm-gemma3-6l"


def build_gemma3(
    out: str | os.PathLike = GEMMA3_DIR,
    layers: int = 6,
    hidden: int = 256,
    window: int = 256,
    vocab_size: int = 8000,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """A Gemma 3-shaped text model: five sliding-window layers (a ``window``-token
    window, Gemma 3's is 1024), then a full-attention layer, repeated (Gemma 3's
    5:1 pattern); 64-dim heads (a head size vLLM's CPU attention kernel has)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    recipe = dict(
        version=RECIPE_VERSION,
        arch="gemma3_text",
        layers=layers,
        hidden=hidden,
        vocab_size=vocab_size,
        seed=seed,
        window=window,
        head_dim=64,
    )
    return _write(
        out,
        recipe,
        lambda tokenizer: Gemma3ForCausalLM(
            Gemma3TextConfig(
                **_shared_config(tokenizer, hidden, layers),
                layer_types=[
                    "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)
                ],
                sliding_window=window,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                query_pre_attn_scalar=64,
                max_position_embeddings=8192,
            )
        ),
        force,
    )


GPT_OSS_DIR = "models/kvbm-gpt-oss-4l"


def build_gpt_oss(
    out: str | os.PathLike = GPT_OSS_DIR,
    layers: int = 4,
    hidden: int = 256,
    window: int = 128,
    vocab_size: int = 8000,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """A gpt-oss-shaped model: sliding-window layers (gpt-oss's 128-token
    window) alternating with full-attention layers, a learned sink logit per
    attention head, and a mixture of experts (4, two a token) in every layer;
    64-dim heads, unquantized (gpt-oss ships MXFP4 experts, which vLLM's CPU
    build does not run)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    recipe = dict(
        version=RECIPE_VERSION,
        arch="gpt_oss",
        layers=layers,
        hidden=hidden,
        vocab_size=vocab_size,
        seed=seed,
        window=window,
        head_dim=64,
        experts=4,
        sinks_std=2.0,
    )

    def make_model(tokenizer):
        model = GptOssForCausalLM(
            GptOssConfig(
                **_shared_config(tokenizer, hidden, layers),
                # vLLM slides the even layers whatever the config says; so does gpt-oss
                layer_types=[
                    "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
                ],
                sliding_window=window,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                # gpt-oss's YaRN, scaled to this model's 8192 positions
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=150000.0,
                    factor=2.0,
                    original_max_position_embeddings=4096,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                ),
                max_position_embeddings=8192,
            )
        )
        for layer in model.model.layers:
            # Sink logits of a few units, so a head's sink takes a real share
            # of its attention (the usual init, 0.1 wide, leaves it ~1/window).
            layer.self_attn.sinks.data.normal_(0.0, recipe["sinks_std"])
        return model

    return _write(out, recipe, make_model, force)


LLAMA4_DIR = "models/kvbm-llama4-4l"


def build_llama4(
    out: str | os.PathLike = LLAMA4_DIR,
    layers: int = 4,
    hidden: int = 256,
    chunk: int = 256,
    vocab_size: int = 8000,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """A Llama 4-shaped text model: three chunked-local attention layers (a
    token attends to its own ``chunk``-token chunk; Llama 4's is 8192), then
    a full-attention layer without RoPE, repeated (Llama 4's 3:1 pattern);
    a mixture of experts (4, one a token) in every other layer; 64-dim heads."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    recipe = dict(
        version=RECIPE_VERSION,
        arch="llama4_text",
        layers=layers,
        hidden=hidden,
        vocab_size=vocab_size,
        seed=seed,
        chunk=chunk,
        head_dim=64,
        experts=4,
    )
    return _write(
        out,
        recipe,
        lambda tokenizer: Llama4ForCausalLM(
            Llama4TextConfig(
                **_shared_config(tokenizer, hidden, layers),
                layer_types=[
                    "full_attention" if i % 4 == 3 else "chunked_attention" for i in range(layers)
                ],
                no_rope_layers=[0 if i % 4 == 3 else 1 for i in range(layers)],
                attention_chunk_size=chunk,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                intermediate_size_mlp=2 * hidden,
                num_local_experts=4,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                max_position_embeddings=8192,
            )
        ),
        force,
    )


VL_DIR = "models/kvbm-idefics3-2l"
IMAGE_TOKEN = "<image>"
# Idefics3's other tokens around an image's placeholders.
IDEFICS3_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>")
IMAGE_SIZE = 112  # pixels a side; every image is resized to this
PATCH_SIZE = 14
SCALE_FACTOR = 2  # 2x2 patches merged into one token (pixel shuffle)
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 16 an image
# Idefics3's prompt format, with images as their placeholder.
IDEFICS3_CHAT = (
    "<|begin_of_text|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] in ('image', 'image_url') %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_idefics3(
    out: str | os.PathLike = VL_DIR,
    layers: int = 2,
    hidden: int = 256,
    vocab_size: int = 8000,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """An Idefics3 vision-language model: a two-layer SigLIP-style vision
    tower (112x112 images, 14-pixel patches, 2x2 merged:
    16 image tokens each, between Idefics3's marker tokens) before a small
    Llama, with Idefics3's tokens, a PIL image processor (one tile an image)
    and a chat template. Head size 64 in both (one vLLM's CPU attention has).

    Idefics3 because vLLM's CPU build here runs without torchvision: the
    Qwen-VL, LLaVA, Gemma 3 and InternVL models' code or processors import
    it; Idefics3's do not."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig

    recipe = dict(
        version=RECIPE_VERSION,
        arch="idefics3",
        layers=layers,
        hidden=hidden,
        vocab_size=vocab_size,
        seed=seed,
        vision_layers=2,
        vision_dim=128,
        image_size=IMAGE_SIZE,
    )

    def make_model(tokenizer):
        text = _shared_config(tokenizer, hidden, layers)
        return Idefics3ForConditionalGeneration(
            Idefics3Config(
                text_config=LlamaConfig(
                    **text,
                    num_attention_heads=hidden // 64,
                    num_key_value_heads=hidden // 128,
                    max_position_embeddings=4096,
                ),
                vision_config=dict(
                    hidden_size=128,
                    intermediate_size=256,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=IMAGE_SIZE,
                    patch_size=PATCH_SIZE,
                    initializer_range=0.1,
                ),
                scale_factor=SCALE_FACTOR,
                image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                pad_token_id=None,
                **{k: text[k] for k in ("tie_word_embeddings", "torch_dtype")},
            )
        )

    return _write(out, recipe, make_model, force, IDEFICS3_TOKENS, _save_idefics3_processor)


def _save_idefics3_processor(out: Path, tokenizer) -> None:
    """Idefics3's processor: each image resized to the tower's size as one
    tile (no splitting), and how many placeholder tokens it expands to."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    images = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_TOKENS,
        chat_template=IDEFICS3_CHAT,
    ).save_pretrained(out)

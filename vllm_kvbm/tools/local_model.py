"""Builds small random-weight models with a locally trained BPE tokenizer.

No model can be downloaded on the machines this project is developed and
tested on, so the demo, tests and benchmarks use a model built here: a Llama,
a Qwen3-Next-shaped hybrid (build_qwen3_next), a Gemma 3-shaped model with
sliding-window layers (build_gemma3), a gpt-oss-shaped model with
sliding-window layers and learned attention sinks (build_gpt_oss) and an Idefics3 vision-language model
(build_idefics3). Each is a standard Hugging Face model directory: vLLM
loads it like any real model, and everything that runs on it runs unchanged
on a real model path.

The weights are scaled up from the usual init so that greedy decoding has
clear margins between the top logits; a model whose logits are nearly tied
would make output comparisons hinge on float rounding rather than on the KV
bytes under test.

    python -m vllm_kvbm.tools.local_model --out models/kvbm-llama-8l
    python -m vllm_kvbm.tools.local_model --arch idefics3   # models/kvbm-idefics3-2l
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

DEFAULT_DIR = "models/kvbm-llama-8l"
# Bump when the recipe changes so stale directories are rebuilt.
RECIPE_VERSION = 2


def _corpus() -> list[str]:
    """Deterministic training text: the Python standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "collections/__init__.py", "difflib.py", "email/message.py",
             "functools.py", "http/client.py", "inspect.py", "json/decoder.py",
             "logging/__init__.py", "pathlib.py", "statistics.py", "textwrap.py",
             "typing.py", "unittest/case.py", "zipfile.py"]
    texts = []
    for name in names:
        path = stdlib / name
        if path.exists():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no training text found under {stdlib}")
    return texts


def build_tokenizer(out: Path, vocab_size: int, special_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if special_tokens:
        # After training, so they take ids past the trained vocabulary, where
        # random token-id prompts (ids below 7000) never hit them.
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    # A plain chat template so /v1/chat/completions works on this model too.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)
    return fast


def build(out: str | os.PathLike = DEFAULT_DIR, layers: int = 8, hidden: int = 512,
          heads: int = 8, kv_heads: int = 8, vocab_size: int = 8000,
          max_positions: int = 32768, seed: int = 0, force: bool = False) -> Path:
    """Writes the model to ``out`` (skipped when an identical build is there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    recipe = dict(version=RECIPE_VERSION, layers=layers, hidden=hidden, heads=heads,
                  kv_heads=kv_heads, vocab_size=vocab_size,
                  max_positions=max_positions, seed=seed)
    return _write(out, recipe, lambda tokenizer: LlamaForCausalLM(LlamaConfig(
        **_shared_config(tokenizer, hidden, layers),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
    )), force)


def _shared_config(tokenizer, hidden: int, layers: int) -> dict:
    """The config fields every model built here sets alike."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        # Wider than the usual 0.02 so each position's output depends on its
        # context (at 0.02 a random Llama emits one token whatever it reads).
        initializer_range=0.1,
        torch_dtype="bfloat16",
    )


HYBRID_DIR = "models/kvbm-qwen3-next-4l"


def build_qwen3_next(out: str | os.PathLike = HYBRID_DIR, layers: int = 4, hidden: int = 64,
                     vocab_size: int = 8000, seed: int = 0, force: bool = False) -> Path:
    """A Qwen3-Next-shaped hybrid: three Gated DeltaNet layers, then a full
    attention layer, repeated (Qwen3-Next's and Qwen3.5's layout), dense MLPs
    beside the GDN layers and a few experts beside full attention (vLLM's
    Qwen3-Next needs one sparse layer); tiny, for vLLM's CPU build, which
    runs the GDN layers in bf16 only."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    recipe = dict(version=RECIPE_VERSION, arch="qwen3_next", layers=layers, hidden=hidden,
                  vocab_size=vocab_size, seed=seed, experts=4, gdn_head_dim=64, head_dim=64)
    full = [i for i in range(layers) if i % 4 == 3]
    return _write(out, recipe, lambda tokenizer: Qwen3NextForCausalLM(Qwen3NextConfig(
        **_shared_config(tokenizer, hidden, layers),
        layer_types=["full_attention" if i in full else "linear_attention"
                     for i in range(layers)],
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
    )), force)


GEMMA3_DIR = "models/kvbm-gemma3-6l"


def build_gemma3(out: str | os.PathLike = GEMMA3_DIR, layers: int = 6, hidden: int = 256,
                 window: int = 256, vocab_size: int = 8000, seed: int = 0,
                 force: bool = False) -> Path:
    """A Gemma 3-shaped text model: five sliding-window layers (a ``window``-token
    window, Gemma 3's is 1024), then a full-attention layer, repeated (Gemma 3's
    5:1 pattern); 64-dim heads (a head size vLLM's CPU attention kernel has)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    recipe = dict(version=RECIPE_VERSION, arch="gemma3_text", layers=layers, hidden=hidden,
                  vocab_size=vocab_size, seed=seed, window=window, head_dim=64)
    return _write(out, recipe, lambda tokenizer: Gemma3ForCausalLM(Gemma3TextConfig(
        **_shared_config(tokenizer, hidden, layers),
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                     for i in range(layers)],
        sliding_window=window,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        max_position_embeddings=8192,
    )), force)


GPT_OSS_DIR = "models/kvbm-gpt-oss-4l"


def build_gpt_oss(out: str | os.PathLike = GPT_OSS_DIR, layers: int = 4, hidden: int = 256,
                  window: int = 128, vocab_size: int = 8000, seed: int = 0,
                  force: bool = False) -> Path:
    """A gpt-oss-shaped model: sliding-window layers (gpt-oss's 128-token
    window) alternating with full-attention layers, a learned sink logit per
    attention head, and a mixture of experts (4, two a token) in every layer;
    64-dim heads, unquantized (gpt-oss ships MXFP4 experts, which vLLM's CPU
    build does not run)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    recipe = dict(version=RECIPE_VERSION, arch="gpt_oss", layers=layers, hidden=hidden,
                  vocab_size=vocab_size, seed=seed, window=window, head_dim=64, experts=4,
                  sinks_std=2.0)

    def make_model(tokenizer):
        model = GptOssForCausalLM(GptOssConfig(
            **_shared_config(tokenizer, hidden, layers),
            # vLLM slides the even layers whatever the config says; so does gpt-oss
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)],
            sliding_window=window,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            # gpt-oss's YaRN, scaled to this model's 8192 positions
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=2.0,
                                 original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, truncate=False),
            max_position_embeddings=8192,
        ))
        for layer in model.model.layers:
            # Sink logits of a few units, so a head's sink takes a real share
            # of its attention (the usual init, 0.1 wide, leaves it ~1/window).
            layer.self_attn.sinks.data.normal_(0.0, recipe["sinks_std"])
        return model

    return _write(out, recipe, make_model, force)


LLAMA4_DIR = "models/kvbm-llama4-4l"


def build_llama4(out: str | os.PathLike = LLAMA4_DIR, layers: int = 4, hidden: int = 256,
                 chunk: int = 256, vocab_size: int = 8000, seed: int = 0,
                 force: bool = False) -> Path:
    """A Llama 4-shaped text model: three chunked-local attention layers (a
    token attends to its own ``chunk``-token chunk; Llama 4's is 8192), then
    a full-attention layer without RoPE, repeated (Llama 4's 3:1 pattern);
    a mixture of experts (4, one a token) in every other layer; 64-dim heads."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    recipe = dict(version=RECIPE_VERSION, arch="llama4_text", layers=layers, hidden=hidden,
                  vocab_size=vocab_size, seed=seed, chunk=chunk, head_dim=64, experts=4)
    return _write(out, recipe, lambda tokenizer: Llama4ForCausalLM(Llama4TextConfig(
        **_shared_config(tokenizer, hidden, layers),
        layer_types=["full_attention" if i % 4 == 3 else "chunked_attention"
                     for i in range(layers)],
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
    )), force)


VL_DIR = "models/kvbm-idefics3-2l"
IMAGE_TOKEN = "<image>"
# Idefics3's other tokens around an image's placeholders.
IDEFICS3_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<global-img>",
                   "<end_of_utterance>")
IMAGE_SIZE = 112  # pixels a side; every image is resized to this
PATCH_SIZE = 14
SCALE_FACTOR = 2  # 2x2 patches merged into one token (pixel shuffle)
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2  # 16 an image
# Idefics3's prompt format, with images as their placeholder.
IDEFICS3_CHAT = (
    "<|begin_of_text|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] in ('image', 'image_url') %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_idefics3(out: str | os.PathLike = VL_DIR, layers: int = 2, hidden: int = 256,
                   vocab_size: int = 8000, seed: int = 0, force: bool = False) -> Path:
    """An Idefics3 vision-language model: a two-layer SigLIP-style vision
    tower (112x112 images, 14-pixel patches, 2x2 merged:
    16 image tokens each, between Idefics3's marker tokens) before a small
    Llama, with Idefics3's tokens, a PIL image processor (one tile an image)
    and a chat template. Head size 64 in both (one vLLM's CPU attention has).

    Idefics3 because vLLM's CPU build here runs without torchvision: the
    Qwen-VL, LLaVA, Gemma 3 and InternVL models' code or processors import
    it; Idefics3's do not."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig

    recipe = dict(version=RECIPE_VERSION, arch="idefics3", layers=layers, hidden=hidden,
                  vocab_size=vocab_size, seed=seed, vision_layers=2, vision_dim=128,
                  image_size=IMAGE_SIZE)

    def make_model(tokenizer):
        text = _shared_config(tokenizer, hidden, layers)
        return Idefics3ForConditionalGeneration(Idefics3Config(
            text_config=LlamaConfig(**text, num_attention_heads=hidden // 64,
                                    num_key_value_heads=hidden // 128,
                                    max_position_embeddings=4096),
            vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=2, image_size=IMAGE_SIZE,
                               patch_size=PATCH_SIZE, initializer_range=0.1),
            scale_factor=SCALE_FACTOR,
            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            pad_token_id=None,
            **{k: text[k] for k in ("tie_word_embeddings", "torch_dtype")},
        ))

    return _write(out, recipe, make_model, force, IDEFICS3_TOKENS, _save_idefics3_processor)


def _save_idefics3_processor(out: Path, tokenizer) -> None:
    """Idefics3's processor: each image resized to the tower's size as one
    tile (no splitting), and how many placeholder tokens it expands to."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    images = Idefics3ImageProcessorPil(do_image_splitting=False,
                                       size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS,
                      chat_template=IDEFICS3_CHAT).save_pretrained(out)


def _write(out: str | os.PathLike, recipe: dict, make_model, force: bool,
           special_tokens: tuple[str, ...] = (), save_extra=None) -> Path:
    """Trains the tokenizer, builds ``make_model(tokenizer)`` seeded with the
    recipe's seed, and saves both to ``out`` in bf16, then calls
    ``save_extra(out, tokenizer)`` when given, unless ``out`` holds a build of
    the same recipe."""
    import torch

    out = Path(out)
    stamp = out / "kvbm_recipe.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, recipe["vocab_size"], special_tokens)
    torch.manual_seed(recipe["seed"])
    model = make_model(tokenizer)
    with torch.no_grad():
        # Peaky logits: see the module docstring.
        model.lm_head.weight.mul_(8.0)
        # The demo and tests stop on max_tokens, never on a random EOS.
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if save_extra is not None:
        save_extra(out, tokenizer)
    stamp.write_text(json.dumps(recipe))
    return out


def main(argv: list[str] | None = None) -> int:
    builders = {"llama": (build, DEFAULT_DIR, 8, 512),
                "qwen3-next": (build_qwen3_next, HYBRID_DIR, 4, 64),
                "gemma3": (build_gemma3, GEMMA3_DIR, 6, 256),
                "gpt_oss": (build_gpt_oss, GPT_OSS_DIR, 4, 256),
                "llama4": (build_llama4, LLAMA4_DIR, 4, 256),
                "idefics3": (build_idefics3, VL_DIR, 2, 256)}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=builders, default="llama",
                        help="llama (text), qwen3-next (hybrid attention), gemma3 (sliding "
                             "window), gpt_oss (sliding window, attention sinks), llama4 "
                             "(chunked-local attention) or idefics3 (vision-language: images)")
    parser.add_argument("--out", help="default: models/<the arch's directory>")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    builder, out, layers, hidden = builders[args.arch]
    path = builder(args.out or out, layers=args.layers or layers,
                   hidden=args.hidden or hidden, force=args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Builds small random-weight models with a locally trained BPE tokenizer.

No model can be downloaded on the machines this project is developed and
tested on, so the demo, tests and benchmarks use a model built here: a Llama
(this module), and in tools/local_model_archs.py a Qwen3-Next-shaped hybrid
(build_qwen3_next), a Gemma 3-shaped model with sliding-window layers
(build_gemma3), a gpt-oss-shaped model with sliding-window layers and learned
attention sinks (build_gpt_oss), a Llama 4-shaped model with chunked-local
layers (build_llama4) and an Idefics3 vision-language model (build_idefics3).
Each is a standard Hugging Face model directory: vLLM loads it like any real
model, and everything that runs on it runs unchanged on a real model path.

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
    names = [
        "argparse.py",
        "collections/__init__.py",
        "difflib.py",
        "email/message.py",
        "functools.py",
        "http/client.py",
        "inspect.py",
        "json/decoder.py",
        "logging/__init__.py",
        "pathlib.py",
        "statistics.py",
        "textwrap.py",
        "typing.py",
        "unittest/case.py",
        "zipfile.py",
    ]
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


def build(
    out: str | os.PathLike = DEFAULT_DIR,
    layers: int = 8,
    hidden: int = 512,
    heads: int = 8,
    kv_heads: int = 8,
    vocab_size: int = 8000,
    max_positions: int = 32768,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Writes the model to ``out`` (skipped when an identical build is there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    recipe = dict(
        version=RECIPE_VERSION,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab_size=vocab_size,
        max_positions=max_positions,
        seed=seed,
    )
    return _write(
        out,
        recipe,
        lambda tokenizer: LlamaForCausalLM(
            LlamaConfig(
                **_shared_config(tokenizer, hidden, layers),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=max_positions,
                rope_theta=500000.0,
            )
        ),
        force,
    )


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


def _write(
    out: str | os.PathLike,
    recipe: dict,
    make_model,
    force: bool,
    special_tokens: tuple[str, ...] = (),
    save_extra=None,
) -> Path:
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
    from vllm_kvbm.tools.local_model_archs import (
        GEMMA3_DIR,
        GPT_OSS_DIR,
        HYBRID_DIR,
        LLAMA4_DIR,
        VL_DIR,
        build_gemma3,
        build_gpt_oss,
        build_idefics3,
        build_llama4,
        build_qwen3_next,
    )

    builders = {
        "llama": (build, DEFAULT_DIR, 8, 512),
        "qwen3-next": (build_qwen3_next, HYBRID_DIR, 4, 64),
        "gemma3": (build_gemma3, GEMMA3_DIR, 6, 256),
        "gpt_oss": (build_gpt_oss, GPT_OSS_DIR, 4, 256),
        "llama4": (build_llama4, LLAMA4_DIR, 4, 256),
        "idefics3": (build_idefics3, VL_DIR, 2, 256),
    }
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        choices=builders,
        default="llama",
        help="llama (text), qwen3-next (hybrid attention), gemma3 (sliding "
        "window), gpt_oss (sliding window, attention sinks), llama4 "
        "(chunked-local attention) or idefics3 (vision-language: images)",
    )
    parser.add_argument("--out", help="default: models/<the arch's directory>")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    builder, out, layers, hidden = builders[args.arch]
    path = builder(
        args.out or out,
        layers=args.layers or layers,
        hidden=args.hidden or hidden,
        force=args.force,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

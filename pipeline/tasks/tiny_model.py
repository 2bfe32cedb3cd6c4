"""A tiny Qwen3-architecture causal LM and a character-level tokenizer, built in code, offline.

The built-in engine serves it and the built-in trainer trains it; nothing is downloaded. The model
folder is an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer.json), so
`AutoModelForCausalLM.from_pretrained` and a real SGLang server could load it too.

Each character is one token, so a response's length in tokens is its length in characters, and
the toy task's reward can read token ids without any re-tokenization ambiguity.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers loads slowly: imported where a tokenizer is built
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig

__all__ = [
    "BOS_ID",
    "CHARS",
    "EOS_ID",
    "MODEL_ARCHS",
    "PAD_ID",
    "build_tokenizer",
    "built_shape_problem",
    "make_model_folder",
]

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
SPECIALS = ("<pad>", "<eos>", "<bos>")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =+-*:?,.!"
VOCAB_SIZE = 64  # room for SPECIALS + CHARS, rounded up
MODEL_ARCHS = ("dense", "moe")  # Qwen3, Qwen3-MoE
# The MoE's experts start 10x the default init (std 0.2, not 0.02). At the default, an expert adds
# almost nothing to the residual stream, so which experts a token goes to barely moves its
# log-prob, unlike in a trained MoE, and routing (R3) would have nothing to show. Measured on the
# toy rollout (hidden 32, 2 layers): a bf16 engine's routes flipped near ties and moved the worst
# token's log-prob by 0.11 against an fp32 trainer, vs 0.002 at the default init.
EXPERT_INIT_SCALE = 10.0


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` with one token per character of `CHARS`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    assert len(vocab) <= VOCAB_SIZE
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def make_model_folder(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 512,
    seed: int = 0,
    arch: str = "dense",
    num_experts: int = 8,
    moe_router_topk: int = 2,
) -> Path:
    """Write a randomly initialised tiny Qwen3 model plus its tokenizer to `path`; return the path.

    `arch="moe"` builds the Qwen3-MoE shape instead (the architecture of Qwen3-30B-A3B): every
    layer's MLP is `num_experts` experts of which the router picks `moe_router_topk` per token,
    each expert as wide as the dense model's MLP is over its top-k share, so both have the same
    active parameters per token. Deterministic for a given seed, so two processes that build it
    get the same weights.
    """
    import torch
    from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    if arch not in MODEL_ARCHS:
        raise ValueError(f"arch={arch!r}: must be one of {', '.join(MODEL_ARCHS)}")
    if not 1 <= moe_router_topk <= num_experts:
        raise ValueError(f"moe_router_topk={moe_router_topk} must be in 1..num_experts ({num_experts})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shape: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        tie_word_embeddings=True,
    )
    model: PreTrainedModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "moe":
            model = Qwen3MoeForCausalLM(_moe_config(shape, num_experts, moe_router_topk))
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".mlp.experts." in name:
                        param.mul_(EXPERT_INIT_SCALE)
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def built_shape_problem(path: Path, *, num_experts: int | None, moe_router_topk: int | None) -> str | None:
    """Why the tiny model an earlier run built in `path` is not the one these flags ask for, or None.

    A run folder's tiny model is built once, by the folder's first run (`--num-experts`, and with
    it `--moe-router-topk`, shape it); later runs of the folder resume its checkpoints, which hold
    that shape, so the flags cannot reshape it: a resume that asks for another one is refused."""
    try:
        config = json.loads((path / "config.json").read_text())
        experts = config.get("num_local_experts")
        built = None if experts is None else (int(experts), int(config["num_experts_per_tok"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # not a folder this library built: loading it says what is wrong
    if num_experts is None:
        asked = None
    else:  # an unset --moe-router-topk takes the built one's (2 when the folder is built)
        asked = (num_experts, moe_router_topk or (built[1] if built is not None else 2))
    if asked == built:
        return None
    was = "dense (without --num-experts)" if built is None else f"--num-experts={built[0]} --moe-router-topk={built[1]}"
    if asked is None:
        flag = "--num-experts unset (dense)"
    elif built is not None and asked[0] == built[0]:
        flag = f"--moe-router-topk={asked[1]}"
    else:
        flag = f"--num-experts={asked[0]}"
    again = "without --num-experts" if built is None else f"with --num-experts={built[0]} --moe-router-topk={built[1]}"
    return (
        f"{flag}: the tiny model in {str(path)!r} was built {was} by this run folder's first run; it is built "
        f"once per folder and its checkpoints keep that shape, so a resume cannot change it: run {again}, "
        "or start a new run in another --output-dir"
    )


def _moe_config(shape: dict[str, Any], num_experts: int, top_k: int) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    hidden_size = int(shape["hidden_size"])
    return Qwen3MoeConfig(
        **shape,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=max(1, hidden_size * 2 // top_k),
        decoder_sparse_step=1,
        norm_topk_prob=True,
        output_router_logits=False,  # no load-balancing loss term: the trainer's loss is the policy's
    )

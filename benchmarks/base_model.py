"""The long-answer task's base model: a Qwen3-shaped model built in code, then taught the answers'
format by supervised steps, as a pretrained model knows the format of what RL will tune.

    python -m benchmarks.base_model --out DIR [--hidden 512 --layers 8 --heads 8] [--max-count 1024]
                                    [--steps 1500] [--batch 32] [--lr 1e-3] [--device cuda]

RL from random weights does not learn the long-answer task's lengths within a few dozen steps (on
the CPU, 60 steps of the tiny model left the response length uncorrelated with the asked count, r
= 0.0), so its responses would stay short, and nothing of a reasoning run's long tail would be left.
A reasoning run starts from a model that already writes answers of the right kind and length. So
does this one: the supervised data is, for "say b x517:", 517 copies of ONE letter and the end
token, where the letter is the asked one half the time and one of the other two otherwise. Taught
so (800 steps on the CPU at counts up to 128: the length the model writes correlates with the asked
count at r = 0.99), the base model:

- writes answers of the asked length from RL's first step, so the response lengths follow the
  prompts' long tail (`pipeline.tasks.long_answer`): the stragglers that sync waits for and partial
  rollout and async exist for;
- writes the asked letter about half the time: the reward (`long_answer_reward`) starts near 0.45
  and rises as RL teaches the policy to write the asked letter every time, in a few dozen steps.

Deterministic for a device and seed (strictly deterministic kernels on a GPU, `deterministic` in
`base.json`; where a kernel has none, the build says so and goes on without), so a later device
call that builds it again builds the same weights; `base.json` holds their SHA-256 (`fingerprint`) and the
steps' figures, and a check: answers sampled to `--check` prompts after training, the correlation
of their length with the asked count (`length_corr`) and the share in the asked letter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["RIGHT_LETTER_SHARE", "answer_loss", "base_answer", "build_base_model", "fingerprint", "main"]

RIGHT_LETTER_SHARE = 0.5  # the base model writes the asked letter this often


def base_answer(char: str, count: int, rng: random.Random) -> str:
    """The supervised answer for "say `char` x`count`:": `count` copies of one letter, the asked
    one with probability `RIGHT_LETTER_SHARE`, else one of the other letters."""
    from pipeline.tasks.toy import TOY_CHARS

    if rng.random() >= RIGHT_LETTER_SHARE:
        char = rng.choice([c for c in TOY_CHARS if c != char])
    return char * count


def fingerprint(folder: Path) -> str:
    """SHA-256 of the model's weights file: two builds agree when their weights are bit-identical."""
    digest = hashlib.sha256()
    with (folder / "model.safetensors").open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _batches(rows: list[tuple[list[int], list[int]]], size: int, rng: random.Random) -> list[list[int]]:
    """Indices of `rows` in random batches of `size`: every batch mixes short and long answers, so
    each step teaches where to stop at every length (batches of like length, tried first on the
    CPU, left the written length uncorrelated with the asked count after 400 steps)."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _packed_batch(rows: list[tuple[list[int], list[int]]]) -> tuple[Any, Any, Any]:
    """(ids [1, T], labels [1, T], layout): the rows' prompt and answer end to end
    (`trainers.packed_attention`), each answer token its own label, the prompts' -100. The loss
    (`answer_loss`, as the model's own) scores each label by the position before it, so a sample's
    last token would be scored against the next sample's first: a prompt token, ignored, as a pad
    was."""
    import torch

    from trainers.packed_attention import PackedLayout

    ids: list[int] = []
    labels: list[int] = []
    for prompt, answer in rows:
        ids += prompt + answer
        labels += [-100] * len(prompt) + answer
    layout = PackedLayout.of([len(p) + len(a) for p, a in rows])
    return torch.tensor([ids]), torch.tensor([labels]), layout


def _backward(model: Any, ids: Any, labels: Any, layout: Any, device: str) -> Any:
    """One packed supervised batch's forward and backward (bf16 autocast on a GPU); its loss."""
    import torch

    from trainers.packed_attention import packed

    kind = torch.device(device).type
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=kind == "cuda"), packed(model, layout) as arguments:
        # Packed: a batch mixes answers of 1 and 1,024 tokens, and padded to its longest it was
        # about five times its real tokens. No KV cache (transformers builds one in train mode
        # too: copies, no use).
        logits = model(input_ids=ids.to(device), use_cache=False, **arguments).logits
    loss = answer_loss(logits, labels.to(device))
    loss.backward()
    return loss


def answer_loss(logits: Any, labels: Any) -> Any:
    """The mean cross-entropy of the labelled tokens (-100: none), each predicted by the position
    before it: the model's own loss, written with elementwise ops and sums only (a tiny vocabulary:
    a mask over it), whose CUDA kernels are all deterministic where `nll_loss`'s may not be."""
    import torch

    scores = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    targets = labels[0, 1:]
    scored = targets != -100
    # A comparison, not `one_hot` (a scatter) or `gather` (a scatter-add backward): no kernel here
    # whose determinism depends on torch's version.
    chosen = targets[:, None] == torch.arange(scores.shape[-1], device=scores.device)[None, :]
    picked = (scores * chosen).sum(-1)
    return -(picked * scored).sum() / scored.sum()


def build_base_model(
    out: Path,
    *,
    hidden: int,
    layers: int,
    heads: int,
    max_count: int,
    max_positions: int,
    steps: int,
    batch: int,
    lr: float,
    device: str,
    seed: int = 0,
    check: int = 32,
    save_dtype: str = "float32",
) -> dict[str, Any]:
    """Build the model folder at `out` and train it `steps` supervised steps; returns the figures
    that go in `base.json`. `save_dtype` bfloat16 halves the folder (a GPU run's engines serve
    bf16, and the trainer's fp32 masters start from the same values)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.tasks.long_answer import long_answer_rows
    from pipeline.tasks.tiny_model import EOS_ID, make_model_folder
    from pipeline.tasks.toy import encode

    cuda = device.startswith("cuda")
    deterministic = True  # a CPU's kernels are, for a machine (the same fingerprint build after build)
    if cuda:
        # Deterministic kernels: a later device call that builds the base again gets the same weights.
        # Strictly: with `warn_only` torch only warns where a kernel has a nondeterministic default
        # (flash and cuDNN attention's backward among them) and runs it anyway.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        # cuDNN's SDPA builds a graph for every new shape, and each batch brings new ones (the
        # trainer turns it off for the same reason): with it, 1,800 steps took 546 s on an H100.
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(seed)
    make_model_folder(
        out, hidden_size=hidden, num_layers=layers, num_heads=heads, max_positions=max_positions, seed=seed
    )
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    module: torch.nn.Module = model  # typed as a Module, `to` moves the parameters in place
    module.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def rate(step: int) -> float:  # linear warm-up, then cosine to a tenth
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    rng = random.Random(seed)
    losses: list[float] = []
    started = time.perf_counter()
    step, epoch = 0, 0
    while step < steps:
        rows = []
        for row in long_answer_rows(4096, seed=1000 + epoch, max_count=max_count):
            label = row["label"]
            assert isinstance(label, dict)
            text = base_answer(str(label["char"]), int(label["count"]), rng)
            rows.append((list(encode(str(row["prompt"]))), [*encode(text), EOS_ID]))
        for chosen in _batches(rows, batch, rng):
            if step >= steps:
                break
            ids, labels, layout = _packed_batch([rows[i] for i in chosen])
            layout = layout.to(torch.device(device))
            try:
                loss = _backward(model, ids, labels, layout, device)
            except RuntimeError as exc:  # a kernel with no deterministic version on this device
                if not (cuda and deterministic and step == 0 and "deterministic" in str(exc)):
                    raise
                deterministic = False
                torch.use_deterministic_algorithms(True, warn_only=True)
                print(
                    f"note: {str(exc).splitlines()[0]}: the base model is built with that kernel's "
                    "nondeterministic default, so a build again may differ (base.json says so)",
                    flush=True,
                )
                optimizer.zero_grad(set_to_none=True)
                loss = _backward(model, ids, labels, layout, device)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0 or step == steps - 1:
                losses.append(float(loss.detach()))
                print(
                    f"base model step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - started:.0f} s)", flush=True
                )
            step += 1
        epoch += 1
    if cuda:  # the check samples (cumulative sums, multinomial): it leaves the weights alone
        torch.use_deterministic_algorithms(False)
    corr, share = _check(model, max_count=max_count, device=device, prompts=check, max_new=max_positions - 16)
    model.to(getattr(torch, save_dtype)).save_pretrained(out)
    print(f"base model check: asked count against written length r = {corr:.3f}, asked letter {share:.2f}", flush=True)
    return {
        "shape": {"hidden": hidden, "layers": layers, "heads": heads, "max_positions": max_positions},
        "max_count": max_count,
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "device": device,
        "deterministic": deterministic,  # strictly deterministic kernels: a build again gives these weights
        "save_dtype": save_dtype,
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "seconds": time.perf_counter() - started,
        "right_letter_share": RIGHT_LETTER_SHARE,
        "fingerprint": fingerprint(out),
        "check_prompts": check,
        "length_corr": corr,
        "letter_share": share,
    }


def _check(model: Any, *, max_count: int, device: str, prompts: int, max_new: int) -> tuple[float, float]:
    """Sample one answer (temperature 1) to each of `prompts` prompts: the correlation between the
    asked count and the written length, and the share of answers that begin with the asked letter."""
    import statistics

    import torch

    from pipeline.tasks.long_answer import long_answer_rows
    from pipeline.tasks.tiny_model import EOS_ID, PAD_ID
    from pipeline.tasks.toy import encode

    if prompts < 2:
        return math.nan, math.nan
    rows = long_answer_rows(prompts, seed=99, max_count=max_count)
    encoded = [list(encode(str(r["prompt"]))) for r in rows]
    width = max(map(len, encoded))
    ids = torch.tensor([[PAD_ID] * (width - len(e)) + e for e in encoded], device=device)  # left-padded
    mask = (
        torch.arange(width, device=device)[None, :]
        >= torch.tensor([width - len(e) for e in encoded], device=device)[:, None]
    ).long()
    model.eval()
    torch.manual_seed(0)
    with (
        torch.no_grad(),
        torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=device.startswith("cuda")),
    ):
        new = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0,
            eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )[:, width:].tolist()  # fmt: skip
    asked, written, right = [], [], 0
    for row, answer in zip(rows, new, strict=True):
        label = row["label"]
        assert isinstance(label, dict)
        n = answer.index(EOS_ID) if EOS_ID in answer else len(answer)
        asked.append(int(label["count"]))
        written.append(n)
        right += n > 0 and answer[0] == encode(str(label["char"]))[0]
    try:
        corr = float(statistics.correlation(asked, written))
    except statistics.StatisticsError:
        corr = math.nan
    return corr, right / len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.base_model", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--max-count", type=int, default=1024)
    p.add_argument("--max-positions", type=int, default=None, help="default: 1.25 x --max-count + 64")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32, help="answers per supervised step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", type=int, default=32, help="prompts sampled after training, for base.json's figures")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    figures = build_base_model(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        max_count=args.max_count,
        max_positions=args.max_positions or int(1.25 * args.max_count) + 64,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        device=args.device,
        seed=args.seed,
        check=args.check,
        save_dtype=args.save_dtype,
    )
    (args.out / "base.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

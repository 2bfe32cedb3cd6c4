"""`--trainer-compile`: the torch trainer's decoder layers compiled with `torch.compile`.

Why: on the H200 the 0.6B step spent about 65% of its GPU time in unfused elementwise work
(RMSNorm in fp32, rotary's half-rotation and its `cat`, the SiLU gate, autocast's casts), each op
a pass over the activations (docs/benchmarks/16-time-to-target.md). Compiling a decoder layer
fuses those passes. Each layer is compiled in place (`Module.compile`: its parameters and their
names stay as they are, so checkpoints, publishes and the optimizer see the same model) with
dynamic shapes, since every micro-batch brings its own length. Attention is left out of the
graphs: the packed forward's attention (`trainers.packed_attention`) reads a context variable and
loops over blocks, so it runs eagerly between two compiled pieces of each layer.

The first forwards compile (tens of seconds, once per process); the results equal the eager
layers' within float rounding (tests/test_layer_compile.py). Off by default.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["compile_decoder_layers"]


def compile_decoder_layers(net: torch.nn.Module) -> int:
    """Compile each decoder layer of `net` in place; return how many. A decoder layer is a module
    of a class the model names in `_no_split_modules` (transformers' own list of its blocks)."""
    names = set(getattr(net, "_no_split_modules", None) or ())
    layers = [m for m in net.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"--trainer-compile: {type(net).__name__} names no decoder layer class (`_no_split_modules`) to compile"
        )
    # Dynamo reads `.grad` of the activations it traces, and torch warns of a non-leaf's `.grad` each
    # time a new shape is traced: its own artefact, nothing the user can act on.
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
    )
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)

"""`--trainer-compile`: the torch trainer's decoder layers compiled with `torch.compile`.

Why: on the H200 the 0.6B step spent about 65% of its GPU time in unfused elementwise work
(RMSNorm in fp32, rotary's half-rotation and its `cat`, the SiLU gate, autocast's casts), each op
a pass over the activations (docs/benchmarks/16-time-to-target.md). Compiling a decoder layer
fuses those passes. Each layer is compiled in place (`Module.compile`: its parameters and their
names stay as they are, so checkpoints, publishes and the optimizer see the same model) with
dynamic shapes, since every micro-batch brings its own length. On a GPU in bf16 the packed
forward's attention (`trainers.packed_attention`: the variable-length kernel, the samples'
boundaries handed down as the forward's arguments) is traced into the layer's graph, so a layer is
one graph; where attention runs in padded blocks (a CPU, fp32), the blocks read a context variable
and loop in Python, and run eagerly between two compiled pieces of each layer. Before the
kernel's call moved into the graph it broke each layer in two on a GPU too, and on an H100 the
0.6B step's GPU sat idle for a quarter of the step while the host launched the pieces
(docs/benchmarks/16-time-to-target.md).

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

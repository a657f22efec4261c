"""A/B in one process: the grouped op at the table's config against the same config with some
fields changed, alternating over 3 repetitions (each a fresh CUDA graph of the bench's 32 layers
of distinct weights, L2 cold); the outputs must be bit-identical unless --allow-new-bits.

    PYTHONPATH=. python benchmarks/ab_configs.py M[,M...] FIELD=VALUE[,FIELD=VALUE...] [fp16,bf16]
        [--allow-new-bits] [--base FIELD=VALUE[,FIELD=VALUE...]]

e.g. ``8 w2_max_registers=64``: the Gluon W2 capped at 64 registers at M = 8. ``--base`` changes
the table's config before both sides, e.g. ``4 w2_copy_ahead=3 --base w2_max_registers=0``: the Gluon
W2's copies three chunks ahead, both sides without M = 4's register cap.
"""
import dataclasses
import sys

import torch

from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.ops import alloc_workspace, grouped_plan_for, launch_grouped

LAYERS = 32


def main(token_counts, changes, dtypes, allow_new_bits=False, base_changes=None):
    label = ",".join(f"{k}={v}" for k, v in changes.items())
    base_label = ",".join(f"{k}={v}" for k, v in (base_changes or {}).items())
    base_label = f"table config, {base_label}" if base_label else "table config"
    print(f"| dtype | M | {base_label}, us | {label}, us | change |\n| --- | --- | --- | --- | --- |")
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        if name not in dtypes:
            continue
        layers = rotated_layers(LAYERS, dtype, "cuda")
        gen = torch.Generator().manual_seed(0)
        for M in token_counts:
            ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, LAYERS, dtype, "cuda", gen)
            base = dataclasses.replace(grouped_plan_for(xs[0], ids[0], layers[0]).config, **(base_changes or {}))
            variants = {"base": base, "changed": dataclasses.replace(base, **changes)}
            workspace = alloc_workspace(M, c.top_k, c.hidden_size, c.intermediate_size, "cuda")
            outs = [torch.empty_like(x) for x in xs]
            times = {key: [] for key in variants}
            bits = {}
            for _ in range(3):
                for key, config in variants.items():
                    for out in outs:  # poisoned: a variant that writes nothing cannot pass as the same bits
                        out.fill_(float("nan"))

                    def step(i, config=config):
                        launch_grouped(xs[i], tws[i], ids[i], layers[i], workspace, outs[i], config)

                    times[key].append(graph_replay_us(step, LAYERS))
                    bits[key] = torch.stack(outs).view(torch.int16).clone()
            assert not torch.isnan(bits["base"].view(xs[0].dtype)).any(), f"{name} M={M}: {base_label} left NaN"
            same = torch.equal(bits["base"], bits["changed"])
            assert same or allow_new_bits, f"{name} M={M}: {label} changed the outputs"
            base_us, changed_us = (sorted(t)[1] for t in times.values())
            cells = " | ".join(" ".join(f"{v:.2f}" for v in t) for t in times.values())
            print(f"| {name} | {M} | {cells} | {changed_us - base_us:+.2f}{'' if same else ' (new bits)'} |",
                  flush=True)


def _fields(text):
    """``FIELD=VALUE[,FIELD=VALUE...]`` as a dict of GroupedConfig field values."""
    return {k: _value(v) for k, v in (item.split("=") for item in text.split(","))}


def _value(text):
    """A GroupedConfig field's value on the command line: an int, True or False, or a kernel name."""
    booleans = {"true": True, "false": False}
    if text.lower() in booleans:
        return booleans[text.lower()]
    return int(text) if text.lstrip("-").isdigit() else text


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--allow-new-bits"]
    base = {}
    if "--base" in args:
        at = args.index("--base")
        base = _fields(args[at + 1])
        del args[at:at + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    main([int(m) for m in args[0].split(",")], _fields(args[1]), (args[2] if len(args) > 2 else "fp16,bf16").split(","),
         "--allow-new-bits" in sys.argv, base)

"""The tuner's whole run on a tiny shape under TRITON_INTERPRET=1, on the CPU.

Launched by test_tune.py in a subprocess (the variable must be set before triton is imported),
with the cache directory as its argument. The search launches the real kernels under the
interpreter and checks each candidate's output; the clock is the check's own (a cost per
config, so the search's choice is known), as is the vLLM timer. Exits non-zero on the first
failure.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from moe_grouped_decode import tables  # noqa: E402
from moe_grouped_decode.awq import synthetic_moe_weights  # noqa: E402
from moe_grouped_decode.benchmarking import tune  # noqa: E402
from moe_grouped_decode.contract import LayerShape, apply_tables, admits, choose_method  # noqa: E402
from moe_grouped_decode.kernels import DeviceFacts  # noqa: E402
from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig, grouped_config, prefill_config  # noqa: E402
from moe_grouped_decode.kernels.lookup import launch_choice  # noqa: E402

SPEC = tune.LayerSpec((8, 2, 64, 64, 32), "fp16", "tiny-tune")
GPU = "Test GPU"
FAST = GroupedConfig(w13_kernel="tl", w2_kernel="tl", w13_block_k=32)
SLOW = GroupedConfig(w13_kernel="tl", w2_kernel="tl", w13_block_k=64)
FAST_PREFILL = PrefillConfig(token_blocks=2)
SLOW_PREFILL = PrefillConfig()
CALLS = []


def clock(step, calls, key):
    """Runs the step on every layer once (the kernels run under the interpreter), then gives a
    cost: per config in the search, per route and M in the measurement. A measurement's key is
    recorded with the prefill config the lookup gives at that moment (the op on CPU tensors runs
    the CPU implementation, which looks no config up)."""
    for i in range(calls):
        step(i)
    route, M, *config = key
    if not config and route == "prefill":
        key = key + (launch_choice(DeviceFacts(GPU, (0, 0)), SPEC.shape, torch.float16, M, route="prefill").config,)
    CALLS.append(key)
    if config:  # at 64 tokens the prefill route's other config is the cheaper (what refine must find)
        return {FAST: 1.0, SLOW: 2.0, FAST_PREFILL: 3.0, SLOW_PREFILL: 2.0 if M == 64 else 4.0}[config[0]] * M
    # the grouped op wins up to 4 tokens; the plugin beats vLLM everywhere but thinly at 64, where
    # the prefill route runs a little faster under the config refine must find
    if route == "prefill" and M == 64 and key[2] == SLOW_PREFILL:
        return 30.0 + M - 1.0
    return {"grouped": 5.0 * M if M <= 4 else 1e9, "prefill": 30.0 + M}[route]


def vllm_timer(inputs):
    return {"marlin": {M: (31.0 + M) * (1.01 if M == 64 else 2.0) for M in inputs},
            "humming": {M: (31.0 + M) * 3.0 for M in inputs}}


def main(cache: Path) -> None:
    device = torch.device("cpu")
    layers = [synthetic_moe_weights(8, 64, 64, 32, dtype=torch.float16, seed=50 + i, device=device) for i in range(2)]
    measure = tune.Measurement(SPEC, layers, clock, vllm_timer, device, large_layers=1)
    logged = []
    table, extra = tune.tune(measure, GPU, {"torch": torch.__version__}, max_tokens=256, grouped_max=8,
                             budget_s=600, generator="tune_interpret_check", grouped_candidates=[SLOW, FAST],
                             prefill_candidates=[SLOW_PREFILL, FAST_PREFILL], family="tl", compile_workers=2,
                             log=logged.append)
    # the candidates ran in two worker processes first (the reference config, and each candidate
    # at the counts the search times it); what follows is the search's own, as without them
    # (5 jobs of the reference config, one per searched count, 2 grouped candidates, 1 prefill one)
    compiled = [line for line in logged if line.startswith("[tune] ran ")]
    assert len(compiled) == 1 and compiled[0].startswith("[tune] ran 8 of 8 candidates in 2 processes"), logged
    r = table.routes
    # the search kept the cheaper config at every searched count
    assert {e["M"]: e["config"]["w13_block_k"] for e in table.grouped} == {1: 32, 2: 32, 4: 32, 8: 32}, table.grouped
    assert all(e["kernels"] == "tl" for e in table.grouped)
    # searched at 256; refined at 64, the one prefill count with a thin margin, where the other
    # config is cheaper: 64 gets its own entry and the counts below it keep theirs
    assert [(e["M"], PrefillConfig(**e["config"])) for e in table.prefill] == [
        (55, FAST_PREFILL), (64, SLOW_PREFILL), (256, FAST_PREFILL)], table.prefill
    assert any("searched again at 1 counts" in line and "[64]" in line for line in logged), logged
    # the measurement: grouped up to 4 tokens, prefill above; the thin margin at 64 got neighbours
    assert r.grouped_tokens == (1, 4), r
    assert r.routes == tuple("grouped" if m <= 4 else "prefill" for m in r.tokens)
    assert set(r.tokens) - set(tune.token_grid(256)) == {55, 72}, r.tokens  # between 48 | 64 | 80
    assert extra["missing"] == {} and set(r.vllm_us) == {"marlin", "humming"}
    verdict = tables.verdict(table, 256)
    assert verdict.admitted and verdict.closest[0] == 64, verdict
    # the measurement ran the ops with the searched configs (the draft table was in place)
    assert ("grouped", 4) in CALLS and ("prefill", 256, FAST_PREFILL) in CALLS
    # searched at 64 with the config it ran timed first, then timed again under the refined entry
    searched_64 = [c for c in CALLS if c[:2] == ("prefill", 64) and c[2] in (FAST_PREFILL, SLOW_PREFILL)]
    assert searched_64[:2] == [("prefill", 64, FAST_PREFILL)] * 2, CALLS  # measured, then first in the search
    assert ("prefill", 64, SLOW_PREFILL) in searched_64
    assert CALLS[-1] == ("prefill", 64, SLOW_PREFILL), CALLS[-1]  # the last timing: the refined entry's
    assert ("prefill", 48, SLOW_PREFILL) not in CALLS  # wide margins are not searched again

    # a refined config that is no faster as the op runs it is not kept: the count keeps its config and time
    def flat_clock(step, calls, key):
        step(0)
        route, M, *config = key
        return {FAST_PREFILL: 3.0, SLOW_PREFILL: 2.0}[config[0]] * M if config else 30.0 + M

    flat = tune.Measurement(SPEC, layers, flat_clock, vllm_timer, device, large_layers=1)
    counts = (16, 64, 256)
    timings = {m: tune.Timings(None, 30.0 + m, {"marlin": (31.0 + m) * 1.01, "humming": (31.0 + m) * 3})
               for m in counts}
    best = {256: FAST_PREFILL}

    def table_of(t):
        routes = tune.route_table(counts, [None] * 3, [t[m].prefill_us for m in counts],
                                  {b: [t[m].vllm_us[b] for m in counts] for b in ("marlin", "humming")})
        return tables.MeasuredTable(gpu=GPU, shape=SPEC.shape, dtype="fp16", name="flat", generator="", versions={},
                                    routes=routes, grouped=(), prefill=tune.launch_table_entries(best))

    kept = tune.refine_prefill(flat, timings, best, [SLOW_PREFILL, FAST_PREFILL], table_of,
                               tune.Progress(1, out=open(os.devnull, "w")), deadline=time.time() + 600,
                               log=logged.append)
    assert kept == best and [timings[m].prefill_us for m in counts] == [46.0, 94.0, 286.0], (kept, timings)
    assert any("no faster as the op runs it at [16, 64]" in line for line in logged), logged[-3:]

    # written and read back where the plugin reads a user's tables; the plugin then admits the shape
    versions = {"torch": torch.__version__, "triton": "test", "vllm": "test"}
    path = tables.write_table(dataclasses.replace(table, versions=versions), tables.cache_dir(versions))
    assert path.parent.is_relative_to(cache) and path.name == "Test-GPU_8-2-64-64-32_fp16.json"
    apply_tables(GPU, versions)
    shape = LayerShape(8, 2, 64, 64, 32, torch.float16)
    assert admits(shape, 4) and not admits(shape, 5)
    choice = choose_method(shape, GPU, plugin_on=True, force=False, vllm_backend="MARLIN", max_tokens=256)
    assert choice.route == "grouped" and "faster than vLLM" in choice.reason, choice
    assert grouped_config(SPEC.shape, GPU, "tl", "fp16", 3) == FAST.fitted(64)
    assert prefill_config(SPEC.shape, GPU, "fp16", 100) == FAST_PREFILL
    assert prefill_config(SPEC.shape, GPU, "fp16", 60) == SLOW_PREFILL  # 56..64: the refined entry's
    assert prefill_config(SPEC.shape, GPU, "fp16", 55) == FAST_PREFILL
    # a search cut short keeps, at every count it did not reach, what the op runs without the tune
    progress = tune.Progress(1, out=open(os.devnull, "w"))
    other = dataclasses.replace(SPEC, shape=(8, 2, 64, 32, 32))
    layers = [synthetic_moe_weights(8, 64, 32, 32, dtype=torch.float16, seed=70 + i, device=device) for i in range(2)]
    cut = tune.Measurement(other, layers, clock, vllm_timer, device, large_layers=1)
    kept = tune.search(cut, "prefill", [16, 64], [FAST_PREFILL], progress, deadline=0.0, log=logged.append)
    assert kept == {M: prefill_config(other.shape, "cpu", "fp16", M) for M in (16, 64)}, kept
    assert any("not searched" in line for line in logged)
    # a budget spent after the first count (the largest): the counts left keep its best, the candidate itself as
    # a searched count stores it (the kernels launched here run it fitted), not the op's own config
    now = [0.0]

    def ticking(step, calls, key):  # each timing one second of a clock the search reads as time.time()
        now[0] += 1.0
        return clock(step, calls, key)

    real_time, tune.time = tune.time, types.SimpleNamespace(time=lambda: now[0])
    try:
        ticked = tune.Measurement(other, layers, ticking, vllm_timer, device, large_layers=1)
        kept = tune.search(ticked, "grouped", [1, 2, 4], [SLOW, FAST], progress, deadline=1.5, log=logged.append)
    finally:
        tune.time = real_time
    assert kept == {1: FAST, 2: FAST, 4: FAST} and kept[1] is FAST, kept
    assert [c[:2] for c in CALLS[-2:]] == [("grouped", 4)] * 2, CALLS[-2:]
    assert f"[tune] grouped M=1: not searched (budget spent): keeps M=4's best {FAST}" in logged, logged[-3:]
    print("tune interpreter check passed")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

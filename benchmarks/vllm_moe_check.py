"""Device check of the vLLM MoE timers (moe_grouped_decode.benchmarking.vllm_moe), one GPU, ~3-4 min.

1. qwen3.8-tp4 (E=512, k=10, K=2560, N=160, G=32), fp16, M = 1, 8, 256, 1024: the shared anchors'
   time_backend (Marlin, Humming) and our timers on the same 32 layers, activations and routing,
   us per layer side by side (full and no-align); layer 0's Marlin weights (against the anchor's
   port of vLLM's per-expert loops) and both backends' outputs compared bit for bit with the
   anchors', and with a float64 dequantized reference.
2. (E, k, K, N, G) = (128, 8, 2048, 768, 128), (8, 2, 4096, 7168, 128), (256, 8, 7168, 256, 128) at
   M = 1, 64, 2048 (fp16; bf16 too at the first): both backends' outputs on layer 0 against a
   float64 dequantized reference (relative L2 error), then their times over enough layers to keep
   L2 cold.
The three extensions of ours (common ops, g32, g128) and the anchor's Marlin build compile in
child processes while the weights are generated. Exit 1 if an output or a Marlin weight differs
from the anchors', an error exceeds its bound, or a time differs from the anchor's by more than
max(5%, 2 us).

Here (network):  python3 ../shared/anchors/fetch_sources.py .anchors
                 python -m moe_grouped_decode vllm-moe-fetch
Device (carry [".vllm_moe_src", ".anchors"]):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .vllm_moe_src/humming_whl/*.whl
    PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/vllm_moe_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.time()
REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_grouped_decode.awq import synthetic_moe_weights  # noqa: E402
from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers  # noqa: E402
from moe_grouped_decode.benchmarking.vllm_moe import marlin_build, ops as vllm_ops  # noqa: E402
from moe_grouped_decode.benchmarking.vllm_moe import time_vllm_backend_rows  # noqa: E402
from moe_grouped_decode.benchmarking.vllm_moe.humming import (HummingExperts, HummingLayer,  # noqa: E402
                                                              HummingRunner, prepare_humming_layer, setup_humming)
from moe_grouped_decode.benchmarking.vllm_moe.marlin import MarlinRunner, make_locks, prepare_marlin_layer  # noqa: E402
from moe_grouped_decode.benchmarking.vllm_moe.shape import MoeShape, awq_tensors  # noqa: E402
from moe_grouped_decode.benchmarking.vllm_moe.timing import random_routing  # noqa: E402

def load_anchor(anchors_dir: Path, name: str):
    """The shared harness ``anchors_dir/name/bench.py`` (../shared/anchors) as a module."""
    import importlib.util

    os.environ["ANCHOR_SRC"] = str(Path(anchors_dir).resolve())
    path = Path(anchors_dir) / name / "bench.py"
    spec = importlib.util.spec_from_file_location(f"{name}_anchor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


QWEN = MoeShape(512, 10, 2560, 160, 32)
QWEN_MS = (1, 8, 256, 1024)
OTHERS = ((MoeShape(128, 8, 2048, 768, 128), (torch.float16, torch.bfloat16)),
          (MoeShape(8, 2, 4096, 7168, 128), (torch.float16,)),
          (MoeShape(256, 8, 7168, 256, 128), (torch.float16,)))
OTHER_MS = (1, 64, 2048)
REL_L2_BOUND = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # the anchors measured ~7e-4 / ~5e-3
L2_BYTES = 50e6
DEV = torch.device("cuda")
RESULT = {"qwen": [], "bit_equal": {}, "reference": [], "others": [], "notes": [], "failures": []}


def log(*parts):
    print(f"[vllm_moe_check {time.time() - T0:6.1f}s]", *parts, flush=True)


def fail(what):
    RESULT["failures"].append(what)
    log("FAIL", what)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def layers_for(shape: MoeShape) -> int:
    """Enough layers that the experts one token's routing reads across them exceed L2 four times."""
    expert_bytes = sum(math.prod(s[1:]) * (2 if "scales" in n else 4) for n, s in shape.awq_tensor_shapes().items())
    return max(2, min(32, math.ceil(4 * L2_BYTES / (shape.top_k * expert_bytes))))


def reference64(x, ids, tw, weights):
    """float64 MoE of one AwqMoeWeights layer (dequantized with awq.dequantize, exact in float32)."""
    N = weights.intermediate_size
    xd, out = x.double(), torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        w13, w2 = (w.double() for w in weights.dequantized_expert(e))
        h = xd[tokens] @ w13
        out.index_add_(0, tokens, tw[tokens, slots].double().unsqueeze(1) * ((F.silu(h[:, :N]) * h[:, N:]) @ w2))
    return out


def error(y, ref):
    d = y.double() - ref
    return {"finite": bool(torch.isfinite(y).all()), "rel_l2": float(d.norm() / ref.norm()),
            "scaled_max": float(d.abs().max() / ref.abs().max())}


def poison(*tensors):
    for t in tensors:
        t.fill_(float("nan"))


# ----------------------------------------------------------------------------------------- part 1
def qwen_part(args, layers, our_ops, marlin_anchor, humming_anchor):
    gen = torch.Generator().manual_seed(0)
    inputs = {M: random_layer_inputs(M, QWEN.top_k, QWEN.num_experts, QWEN.hidden_size, args.layers, torch.float16,
                                     DEV, gen) for M in QWEN_MS}
    xs = {M: v[2][0] for M, v in inputs.items()}
    plans = {M: list(zip(v[0], v[1])) for M, v in inputs.items()}
    awq = [awq_tensors(w) for w in layers]
    log(f"qwen3.8-tp4: {args.layers} layers and inputs ready; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    rows = {}
    for backend, anchor in (("marlin", marlin_anchor), ("humming", humming_anchor)):
        t0 = time.time()
        rows[(backend, "anchor")] = {r["M"]: r for r in anchor.time_backend(
            awq, Ms=list(QWEN_MS), dtypes=[torch.float16], reps=args.reps, xs=xs, plans=plans)}
        log(f"{backend} anchor timed in {time.time() - t0:.1f}s")
        t0 = time.time()
        ours = time_vllm_backend_rows(awq, QWEN.group_size, QWEN_MS, torch.float16, args.reps, xs, plans,
                                      backends=(backend,), variants=("full", "no_align"), ops=our_ops)[backend]
        if isinstance(ours, str):
            fail(f"qwen {backend}: {ours}")
            ours = []
        rows[(backend, "ours")] = {r["M"]: r for r in ours}
        log(f"{backend} ours timed in {time.time() - t0:.1f}s")
        torch.cuda.empty_cache()
    for backend in ("marlin", "humming"):
        for M in QWEN_MS:
            a, o = rows[(backend, "anchor")].get(M), rows[(backend, "ours")].get(M)
            if a is None or o is None:
                fail(f"qwen {backend} M={M}: no row (anchor {a is not None}, ours {o is not None})")
                continue
            blocks_a = a.get("block_size_m") or f"{a.get('block_m13')}/{a.get('block_m2')}"
            blocks_o = o.get("block_size_m") or f"{o.get('block_m13')}/{o.get('block_m2')}"
            row = {"backend": backend, "M": M, "anchor_full": a["full"]["us"], "ours_full": o["full"]["us"],
                   "anchor_no_align": a["no_align"]["us"], "ours_no_align": o["no_align"]["us"],
                   "blocks_anchor": blocks_a, "blocks_ours": blocks_o,
                   "ours_first_eager_pass_s": o.get("first_eager_pass_s")}
            row["ratio"] = round(row["ours_full"] / row["anchor_full"], 3)
            RESULT["qwen"].append(row)
            if abs(row["ours_full"] - row["anchor_full"]) > max(0.05 * row["anchor_full"], 2.0):
                fail(f"qwen {backend} M={M}: ours {row['ours_full']} us vs anchor {row['anchor_full']} us")
            if str(blocks_a) != str(blocks_o):
                fail(f"qwen {backend} M={M}: block sizes {blocks_o} vs the anchor's {blocks_a}")
    bit_equality(our_ops, marlin_anchor, humming_anchor, layers[0], awq[0], xs, plans)
    layers.clear()  # the caller's list: the qwen weights go now
    del awq, inputs, xs, plans
    torch.cuda.empty_cache()


def bit_equality(our_ops, marlin_anchor, humming_anchor, weights, awq, xs, plans):
    """Layer 0: our Marlin weights vs the anchor's per-expert (vLLM loop) port; both backends'
    outputs vs the anchors' runs of the same kernels, and vs the float64 reference."""
    dt = torch.float16
    a_prep = marlin_anchor.process_awq_weights_marlin(awq, fast=False)
    o_prep = prepare_marlin_layer(awq, QWEN, dt, our_ops)
    pairs = {"w13": o_prep.w13, "w2": o_prep.w2, "s13": o_prep.w13_scales, "s2": o_prep.w2_scales,
             "z13": o_prep.w13_zeros, "z2": o_prep.w2_zeros}
    prep_same = {k: bool(torch.equal(a_prep[k], v)) for k, v in pairs.items()}
    RESULT["bit_equal"]["marlin_weights"] = prep_same
    if not all(prep_same.values()):
        fail(f"Marlin weights differ from the anchor's: {prep_same}")
    a_hl = humming_anchor.HummingLayer(humming_anchor.vllm_humming_prepare(dict(awq), dt))
    a_ex = humming_anchor.HummingIndexedExpertsRepro(a_hl.cfg13, a_hl.cfg2)
    o_hl = HummingLayer(prepare_humming_layer(awq, QWEN, dt))
    o_ex = HummingExperts(QWEN, o_hl)
    same_tuning = (json.dumps(a_ex.t13), json.dumps(a_ex.t2)) == (o_ex.tuning13_str, o_ex.tuning2_str)
    RESULT["bit_equal"]["humming_tuning"] = same_tuning
    if not same_tuning:
        fail("Humming heuristics differ from the anchor's")
    mul_sum = humming_anchor.setup()["moe_fused_mul_sum"]
    locks = make_locks(DEV)
    for M in (8, 256):
        x, (ids, tw) = xs[M], plans[M][0]
        ref = reference64(x, ids, tw, weights)
        a_op = marlin_anchor.MarlinMoE(M, dt, torch.zeros_like(locks))
        poison(a_op.out, a_op.ws13, a_op.ws2)
        a_out = a_op(x, a_prep, a_prep["s13"], a_prep["s2"], tw, ids).clone()
        o_run = MarlinRunner(QWEN, M, dt, our_ops, locks)
        poison(*o_run.workspaces)
        o_out = o_run(x, o_prep, tw, ids).clone()
        ah_op = humming_anchor.HummingMoEOp(a_ex, M, dt, mul_sum)
        poison(ah_op.ws1, ah_op.ws2, ah_op.out)
        ah_out = ah_op(x, a_hl, tw, ids).clone()
        oh_run = HummingRunner(o_ex, M, dt, our_ops, DEV)
        poison(*oh_run.workspaces)
        oh_out = oh_run(x, o_hl, tw, ids).clone()
        for backend, ours, theirs in (("marlin", o_out, a_out), ("humming", oh_out, ah_out)):
            same = bool(torch.equal(ours, theirs))
            RESULT["bit_equal"][f"{backend}_out_M{M}"] = same
            err = error(ours, ref)
            RESULT["reference"].append({"shape": str(QWEN), "dtype": "float16", "backend": backend, "M": M, **err})
            if not same:
                fail(f"qwen {backend} M={M}: output differs from the anchor's "
                     f"(max |diff| {float((ours.float() - theirs.float()).abs().max()):.3g})")
            if not err["finite"] or err["rel_l2"] > REL_L2_BOUND[dt]:
                fail(f"qwen {backend} M={M}: {err}")
    log("bit equality:", RESULT["bit_equal"])


# ----------------------------------------------------------------------------------- Humming warm-up
WARM = {}


def other_weights(shape: MoeShape, dtype, count: int):
    return [synthetic_moe_weights(shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.group_size,
                                  dtype=dtype, seed=2000 + i, device=DEV) for i in range(count)]


def warm_humming(qwen_layer0, common_ops):
    """While the Marlin extensions compile: Humming's conversion, heuristics and JIT (every
    kernel of every tuning interval compiles at a GEMM's first call) for every shape and dtype
    the check runs, at each of its token counts; Triton's top-k sum compiles too. The anchor
    then finds the same kernels in the JIT cache (same folder, same configs)."""
    gen = torch.Generator(device=DEV)
    gen.manual_seed(3)
    cases = [(QWEN, torch.float16, awq_tensors(qwen_layer0), QWEN_MS)] + [
        (shape, dt, awq_tensors(other_weights(shape, dt, 1)[0]), OTHER_MS) for shape, dtypes in OTHERS for dt in dtypes]
    for shape, dt, awq, Ms in cases:
        t0 = time.time()
        layer = HummingLayer(prepare_humming_layer(awq, shape, dt))
        experts = HummingExperts(shape, layer)
        t1 = time.time()
        for M in Ms:
            ids, tw = random_routing(M, shape, gen)
            HummingRunner(experts, M, dt, common_ops, DEV)(torch.randn(M, shape.hidden_size, device=DEV).to(dt),
                                                           layer, tw, ids)
        torch.cuda.synchronize()
        if shape != QWEN:
            WARM[(shape, dt)] = (layer, experts)
        log(f"humming warm-up {shape} {dname(dt)}: conversion + heuristics {t1 - t0:.1f}s, "
            f"first forwards {time.time() - t1:.1f}s")


# ----------------------------------------------------------------------------------------- part 2
def other_shape(shape, dtypes, args, our_ops):
    count = layers_for(shape)
    for dt in dtypes:
        if time.time() - T0 > args.deadline:
            RESULT["notes"].append(f"skipped {shape} {dname(dt)}: past --deadline {args.deadline} s")
            log(RESULT["notes"][-1])
            continue
        t0 = time.time()
        weights = other_weights(shape, dt, count)
        awq = [awq_tensors(w) for w in weights]
        gen = torch.Generator(device=DEV)
        gen.manual_seed(7)
        cases = {M: (torch.randn(M, shape.hidden_size, device=DEV, generator=gen).to(dt), *random_routing(M, shape, gen))
                 for M in OTHER_MS}
        refs = {M: reference64(x, ids, tw, weights[0]) for M, (x, ids, tw) in cases.items()}
        marlin_layer = prepare_marlin_layer(awq[0], shape, dt, our_ops)
        locks = make_locks(DEV)
        humming_layer, experts = WARM.pop((shape, dt), (None, None))
        if humming_layer is None:
            humming_layer = HummingLayer(prepare_humming_layer(awq[0], shape, dt))
            experts = HummingExperts(shape, humming_layer)
        for M, (x, ids, tw) in cases.items():
            for backend, runner, layer in (("marlin", MarlinRunner(shape, M, dt, our_ops, locks), marlin_layer),
                                           ("humming", HummingRunner(experts, M, dt, our_ops, DEV), humming_layer)):
                poison(*runner.workspaces)
                err = error(runner(x, layer, tw, ids), refs[M])
                row = {"shape": str(shape), "dtype": dname(dt), "backend": backend, "M": M, **err, **runner.describe()}
                RESULT["reference"].append(row)
                if not err["finite"] or err["rel_l2"] > REL_L2_BOUND[dt]:
                    fail(f"{shape} {dname(dt)} {backend} M={M}: {err}")
        del marlin_layer, humming_layer, experts
        log(f"{shape} {dname(dt)}: outputs checked ({time.time() - t0:.1f}s)")
        rows = time_vllm_backend_rows(awq, shape.group_size, OTHER_MS, dt, args.other_reps, top_k=shape.top_k,
                                      ops=our_ops)
        for backend, backend_rows in rows.items():
            if isinstance(backend_rows, str):
                fail(f"{shape} {dname(dt)} {backend}: {backend_rows}")
                continue
            for r in backend_rows:
                RESULT["others"].append({"shape": str(shape), "dtype": dname(dt), "backend": backend, "M": r["M"],
                                         "layers": count, "us": r["full"]["us"],
                                         "first_eager_pass_s": r["first_eager_pass_s"],
                                         **{k: r[k] for k in ("block_size_m", "block_m13", "block_m2") if k in r}})
        log(f"{shape} {dname(dt)}: timed over {count} layers ({time.time() - t0:.1f}s)")
        del weights, awq, cases, refs
        torch.cuda.empty_cache()


def table():
    lines = [f"qwen3.8-tp4 fp16 on {RESULT['env']['gpu']}: us per layer, median of CUDA-graph replays",
             "| backend | M | anchor full | ours full | ours/anchor | anchor no-align | ours no-align | block M a/o |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in RESULT["qwen"]:
        lines.append(f"| {r['backend']} | {r['M']} | {r['anchor_full']} | {r['ours_full']} | {r['ratio']} | "
                     f"{r['anchor_no_align']} | {r['ours_no_align']} | {r['blocks_anchor']} / {r['blocks_ours']} |")
    lines += ["", "bit-equal to the anchors: " + ", ".join(f"{k}={v}" for k, v in RESULT["bit_equal"].items()), "",
              "| shape | dtype | backend | M | rel L2 vs float64 | scaled max | us/layer |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    times = {(r["shape"], r["dtype"], r["backend"], r["M"]): r["us"] for r in RESULT["others"]}
    for r in RESULT["reference"]:
        us = times.get((r["shape"], r["dtype"], r["backend"], r["M"]), "-")
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['backend']} | {r['M']} | {r['rel_l2']:.2e} | "
                     f"{r['scaled_max']:.2e} | {us} |")
    lines.append("")
    lines.append(f"{len(RESULT['failures'])} failures" + "".join(f"\n  - {f}" for f in RESULT["failures"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--anchors", default=str(REPO / ".anchors"), help="fetch_sources.py DEST (the anchors)")
    parser.add_argument("--sources", default=str(REPO / ".vllm_moe_src"), help="vllm-moe-fetch DEST")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--layers", type=int, default=32, help="qwen layers rotated (the anchors' 32)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--other-reps", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=215.0, help="skip what is left of part 2 after this many s")
    parser.add_argument("--build-root", default=None)
    parser.add_argument("--max-jobs", type=int, default=max(2, (os.cpu_count() or 8) // 2),
                        help="compile jobs per build child (4 children)")
    args = parser.parse_args(argv)
    anchors, sources = Path(args.anchors).resolve(), Path(args.sources).resolve()
    os.environ["ANCHOR_SRC"] = str(anchors)
    build_root = args.build_root or marlin_build.default_build_root()
    props = torch.cuda.get_device_properties(0)
    RESULT["env"] = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "cores": os.cpu_count()}
    log(RESULT["env"])
    shapes = [QWEN] + [s for s, _ in OTHERS]
    children = marlin_build.start_children(vllm_ops.extensions_for(shapes), str(sources), build_root, args.max_jobs)
    anchor_log = open(os.path.join(args.out, "marlin_anchor_build.log"), "w")
    anchor_build = subprocess.Popen([sys.executable, str(anchors / "marlin_moe" / "build.py")], stdout=anchor_log,
                                    stderr=subprocess.STDOUT, env={**os.environ, "MAX_JOBS": str(args.max_jobs)})
    code = 0
    try:
        setup_humming()  # the JIT cache and NVRTC path the anchor's setup then finds too
        qwen_layers = rotated_layers(args.layers, torch.float16, DEV)
        common_ops = vllm_ops.load_ops([], sources, prefer_installed=False, build_root=build_root,
                                       parallel_build=False)  # waits for the common ops' child, loads them
        log("common ops loaded; warming Humming up while the Marlin kernels compile")
        warm_humming(qwen_layers[0], common_ops)
        builds = marlin_build.wait_children(children)
        rc = anchor_build.wait()
        if rc:
            raise RuntimeError(f"the anchor's Marlin build failed (rc={rc}), see marlin_anchor_build.log")
        RESULT["builds_s"] = {**{k: v["seconds"] for k, v in builds.items()}, "all_done": round(time.time() - T0, 1)}
        log("builds done:", RESULT["builds_s"])
        our_ops = vllm_ops.load_ops(shapes, sources, prefer_installed=False, build_root=build_root,
                                    parallel_build=False)
        RESULT["ops"] = our_ops.origin
        marlin_anchor = load_anchor(anchors, "marlin_moe")
        marlin_anchor.ensure_built()
        humming_anchor = load_anchor(anchors, "humming_moe")
        log("ops loaded:", our_ops.origin)
    except Exception:  # nothing can run
        fail(traceback.format_exc())
        code = 2
    parts = [] if code else [lambda: qwen_part(args, qwen_layers, our_ops, marlin_anchor, humming_anchor)] + [
        (lambda s=s, d=d: other_shape(s, d, args, our_ops)) for s, d in OTHERS]
    for part in parts:
        try:
            part()
        except Exception:  # the other parts still run
            fail(traceback.format_exc())
            code = 2
        torch.cuda.empty_cache()
    RESULT["wall_s"] = round(time.time() - T0, 1)
    Path(args.out, "vllm_moe_check.json").write_text(json.dumps(RESULT, indent=1, default=str))
    text = table() if "env" in RESULT else ""
    Path(args.out, "vllm_moe_check.md").write_text(text + "\n")
    print(text, flush=True)
    log(f"wrote {args.out}/vllm_moe_check.json and .md")
    return code or (1 if RESULT["failures"] else 0)


if __name__ == "__main__":
    sys.exit(main())

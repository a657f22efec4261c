"""benchmarks/sass_stats.py compiles the shipped grouped kernels for sm_90 and sm_80 on a CPU machine.

Guards the tool against kernel signature changes, compiles every inline-PTX variant
(fp16 and bf16; W2's activations as a hi + lo pair and as one half) through ptxas, and checks one compile-time
property of the kernels the performance work relies on: no register spills (a spill turns
every tile into local-memory traffic). Needs no GPU: Triton's bundled ptxas and
cuobjdump do the work.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python_stdout(*args: str) -> str:
    """stdout of ``python args`` with the repo importable and the kernels compiled for a GPU (not
    under the interpreter), which must exit 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("arch", [
    90,  # the H200 the numbers come from
    80,  # the kernels' minimum compute capability (kernels.MIN_CUDA_CAPABILITY): every PTX variant must assemble
])
def test_grouped_kernels_compile_without_spills(arch):
    stdout = _python_stdout(str(ROOT / "benchmarks" / "sass_stats.py"), "--arch", str(arch))
    # the launched kernels, and the tl W13 at the same split (what runs where Gluon does not)
    lines = [line for line in stdout.splitlines()
             if re.match(r"M=\d+ (fp16|bf16) w(13|2|13-tl):", line)]
    kernels = {tuple(line.split(":")[0].split()[1:]) for line in lines}
    assert kernels == {(dtype, kernel) for dtype in ("fp16", "bf16") for kernel in ("w13", "w13-tl", "w2")}, \
        stdout
    for line in lines:
        registers = int(re.search(r"regs=(\d+)", line).group(1))
        stack = int(re.search(r"stack=(\d+)", line).group(1))
        assert 0 < registers <= 255 and stack == 0, line


def _sass_stats_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_stats", ROOT / "benchmarks" / "sass_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("registers, warps, shared, programs", [
    (166, 4, 0, 3),  # an uncapped tl W2: three 4-warp programs per SM (the register cap's reason)
    (128, 4, 0, 4),  # the capped tl W2
    (90, 1, 0, 21),  # 90 registers are allocated as 96
    (72, 1, 0, 28),  # the tl W13 at M = 8
    (75, 2, 0, 12),  # a 2-warp W13 program
    (32, 1, 0, 32),  # bounded by the 32 resident programs per SM
    (32, 16, 0, 4),  # bounded by the 64 resident warps per SM
    (32, 1, 100 * 1024, 2),  # bounded by shared memory (228 KB on sm_90)
])
def test_programs_per_sm(registers, warps, shared, programs):
    assert _sass_stats_module().programs_per_sm(registers, warps, shared, 90) == programs


@pytest.mark.parametrize("registers, warps, shared, carveout_kb", [
    (72, 4, 26112, 196),  # M = 2's 4-warp Gluon W2: seven programs by registers; beside W13 (measured)
    (56, 4, 26112, 228),  # the same uncapped: nine by registers, no carveout holds them; kept off W13
    (79, 4, 26112, 164),  # the capped W2 with timestamps: six; beside the 2-stage W13 too
    (72, 1, 5888, 196),  # M = 2's W13, a 4-stage ring: 28 programs
    (72, 1, 3840, 164),  # a 2-stage ring: W2 at 196 KB kept off it (a ~5 us cliff)
    (128, 4, 26112, 132),  # a 128-register 4-warp W2: four; beside W13
    (64, 4, 26112, 228),  # a 4-warp W2 at M = 8: kept off W13
    (78, 1, 5632, 164),  # M = 8's W13 with a 2-stage ring
    (75, 1, 6656, 196),  # M = 8's W13, a 3-stage ring: 25 programs; the 8-warp W2 (228) kept off
    (80, 1, 6656, 196),  # the same in bf16
    (71, 1, 6656, 228),  # the same with the timeline's stamps: 28 programs; W2 beside it
    (65, 8, 51712, 228),  # M = 8's 8-warp W2 in bf16: over 48 KB, Triton asks for the largest
])
def test_driver_carveout_model(registers, warps, shared, carveout_kb):
    """The model of the driver's carveout choice, on the kernels it was checked against (registers
    and shared memory as compiled, docs/bench/sass_stats.txt)."""
    assert _sass_stats_module().driver_carveout_kb(registers, warps, shared) == carveout_kb


def test_timeline_stamps_compile_out():
    """The per-program timestamps (kernels/timeline.py) cost nothing unless asked for: without
    TIMELINE no kernel reads the GPU's timer (so the counts above are the op's own); with it
    each W13 kernel reads it at its three places (start, program 0's end, a tile program's end)
    and W2 at its five points."""
    stdout = _python_stdout(str(ROOT / "benchmarks" / "sass_stats.py"), "--timeline")
    reads = {tuple(m.group(1, 2)): int(m.group(3))
             for m in re.finditer(r"^M=8 fp16 (\S+) timeline=(\w+): timer reads=(\d+)$", stdout, re.M)}
    assert set(reads) == {(kernel, flag) for kernel in ("w13", "w13-tl", "w2") for flag in ("False", "True")}, \
        stdout
    for kernel in ("w13", "w13-tl", "w2"):
        assert reads[kernel, "False"] == 0, stdout
    assert reads["w13", "True"] >= 3 and reads["w13-tl", "True"] >= 3, stdout
    assert reads["w2", "True"] >= 5, stdout


def test_constexpr_defaults_stay_constexprs():
    """compile_kernel compiles a kernel as a launch specializes it: a constexpr the caller leaves
    to its default is that constant, not an i32 argument (which would keep both branches on it,
    as the tl W2's RN_SCALE once did, doubling its counted mma)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stores(out_ptr, FLAG: tl.constexpr = False):
        if FLAG:
            tl.store(out_ptr, 1.0)
        else:
            tl.store(out_ptr, 2.0)

    kernel = _sass_stats_module().compile_kernel(stores, {}, {"out_ptr": "*fp32"}, 1)
    ttir = kernel.asm["ttir"]
    assert "2.000000e+00" in ttir and "1.000000e+00" not in ttir, ttir


def test_tl_family_table_w2_compiles_without_spills():
    """The table's ``tl`` family (no Gluon, or MOE_GROUPED_DECODE_GLUON=0) launches the tl W2 with
    its fused combine's float64 recompute: its register caps must leave no spills, sm_90."""
    code = f"""
import dataclasses, sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import sass_stats
from moe_grouped_decode.kernels import config
from moe_grouped_decode.contract import QWEN38_TP4 as c
shape = (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size)
for dtype in ("fp16", "bf16"):
    for M in range(1, 9):
        table = config.grouped_config(shape, sass_stats.TABLE_GPU, "tl", dtype, M)
        fields = {{f.name: getattr(table, f.name) for f in dataclasses.fields(table)}}
        for name, kernel, *_ in sass_stats.launched_kernels(dtype, M, changes=fields):
            if name.endswith(" w2"):
                usage = sass_stats.cuobjdump(kernel, "-res-usage")
                print(name, table.w2_kernel, usage.split("REG:")[1].split()[0], usage.split("STACK:")[1].split()[0])
"""
    rows = [line.split() for line in _python_stdout("-c", code).splitlines() if line.startswith("M=")]
    assert len(rows) == 16, rows
    for row in rows:
        assert row[3] == "tl" and 0 < int(row[4]) <= 255 and row[5] == "0", row


@pytest.mark.parametrize("M,changes", [
    (2, dict(w2_kernel="tl", w2_max_registers=128)),  # the tl W2 at M = 2's W13 split, the default cap
    (8, dict(w2_max_registers=96)),  # the Gluon W2 (M = 8's table entry, capped)
])
def test_w2_with_activation_pairs_compiles_without_spills(M, changes):
    """w2_act_split=True (the activations as a 16-bit hi + lo pair, two mma per chunk) is in no
    table entry, so the tool's main run does not build it: both W2 kernels, both dtypes, through
    ptxas for sm_90. With the fused combine's float64 recompute in their tails both need a
    register cap not to spill (uncapped: 16 bytes of stack, the tl W2 in fp16, the 8-warp Gluon
    W2 in bf16)."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import sass_stats
for dtype in ("fp16", "bf16"):
    for name, kernel, *_ in sass_stats.launched_kernels(dtype, {M}, changes=dict(w2_act_split=True, **{changes!r})):
        if name.endswith(" w2"):
            usage = sass_stats.cuobjdump(kernel, "-res-usage")
            print(name, usage.split("REG:")[1].split()[0], usage.split("STACK:")[1].split()[0],
                  sass_stats.cuobjdump(kernel, "-sass").count("HMMA"))
"""
    stdout = _python_stdout("-c", code)
    lines = stdout.split("\n")
    rows = [line.split() for line in lines if line.startswith(f"M={M} ")]
    assert [row[1] for row in rows] == ["fp16", "bf16"], stdout
    for _, _, _, registers, stack, mmas in rows:
        # two mma (hi, lo) per 16 rows of each chunk's two 16-row halves: 5 chunks x 2 x 4 column tiles x 2
        assert 0 < int(registers) <= 255 and int(stack) == 0 and int(mmas) == 80, stdout



def test_timeline_says_where_w2_may_start(monkeypatch):
    """benchmarks/timeline.py's last row: by the carveout model, from the registers and shared
    memory of the kernels a grouped call launched, whether W2 may start beside W13 (the stamps
    can take M = 8's W13 from 75 registers to 71 and let W2 beside it)."""
    import importlib.util
    from types import SimpleNamespace

    from moe_grouped_decode.kernels.config import GroupedConfig

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("timeline_tool", ROOT / "benchmarks" / "timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    monkeypatch.setattr(timeline, "cuda_capability", lambda device: (9, 0))

    def kernel(registers, warps, shared):
        return SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(num_warps=warps, shared=shared))

    w2 = kernel(64, 8, 51712)  # M = 8's 8-warp Gluon W2
    driver = GroupedConfig()
    assert timeline.w2_beside_w13([kernel(75, 1, 6656), w2], driver) == "no (75 / 64 registers, 196 / 228 KB)"
    assert timeline.w2_beside_w13([kernel(71, 1, 6656), w2], driver) == "yes (71 / 64 registers, 228 / 228 KB)"
    largest = GroupedConfig(max_shared_carveout=True)
    assert timeline.w2_beside_w13([kernel(72, 1, 5888), kernel(72, 4, 26112)], largest) == \
        "yes, the largest (72, 72 registers)"
    monkeypatch.setattr(timeline, "cuda_capability", lambda device: (8, 0))
    assert timeline.w2_beside_w13([kernel(75, 1, 6656), w2], driver).startswith("n/a")


def test_timeline_sm_rows(monkeypatch):
    """benchmarks/timeline.py's SM rows, on stamps made up so every row has one right answer: SM 5
    holds three W2 tile programs, SM 9 one; the programs on the busiest SM take 2 us from
    activations to row output, the lone one 1 us, and the layer's last program ends 1 us after
    the last row output is stored (a program that stored earlier ends last: the last arriver)."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("timeline_tool", ROOT / "benchmarks" / "timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)

    ns = lambda *us: [1000.0 * u for u in us]  # noqa: E731
    # (start, after wait, activations, row stored, end) per program, us
    w2 = torch.tensor([ns(0, 1, 2, 4, 5), ns(0, 1, 2, 4, 6), ns(0, 1, 3, 5, 5.5), ns(0, 1, 2, 3, 4)])
    w2_sm = torch.tensor([5, 5, 5, 9])
    w13_sm = torch.tensor([0, 1, 2, 1])
    rows = timeline.sm_points(w13_sm, w2_sm, w2, lambda t: float(t) / 1000.0)
    assert rows == {
        "W13: SMs with a program": 3,
        "W2: SMs with a tile program": 2,
        "W2: tile programs on the busiest SM": 3,
        "W2: tile programs on the least busy SM with one": 1,
        "W2 program on the busiest SMs: activations to row output stored": 2.0,
        "W2 program on the least busy SMs: activations to row output stored": 1.0,
        "W2: median end of the programs on the busiest SMs": 5.5,
        "W2: median end of the programs on the least busy SMs": 4.0,
    }
    # one layer of 4 routed rows, one W2 tile each; W13 program 0 and four tile programs
    w13 = torch.tensor([ns(0, 0.5), ns(0, 1), ns(0, 1.5), ns(0.1, 1), ns(0.1, 1.2)])
    prev_w2 = w2 - 10_000.0
    points = timeline.layer_points(w13, w2.reshape(4, 1, 5), w13 + 20_000.0, prev_w2.reshape(4, 1, 5), 4,
                                   torch.tensor([0, 1, 2, 1, 0]), w2_sm.reshape(4, 1))
    assert points["W2: last program end after the last row output stored"] == 1.0  # ends at 6 us, last store at 5
    assert points["W2: tile programs on the busiest SM"] == 3


def test_the_route_over_groups_compiles_without_spills():
    """Every launch of the grouped route over the sort's groups (M = 64 at the table's default, and
    16-row groups at 512), both dtypes, through ptxas for sm_90: registers within 255, no stack."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import sass_stats
for dtype in ("fp16", "bf16"):
    for M, changes in ((64, {{}}), (512, dict(group_blocks=2))):
        plan = sass_stats.table_plan(dtype, M, changes=changes)
        assert plan.config.w13_over_groups, plan.config
        ints = dict(x_stride=2560, out_stride=2560, rows=M * 10, num_arrivals=0, num_experts=512, num_blocks=1,
                    max_groups=plan.max_groups)
        for launch in plan.launches:
            usage = sass_stats.cuobjdump(sass_stats.compile_launch(launch, dtype, ints), "-res-usage")
            print("launch", dtype, M, launch.name, usage.split("REG:")[1].split()[0], usage.split("STACK:")[1].split()[0])
"""
    stdout = _python_stdout("-c", code)
    rows = [line.split() for line in stdout.splitlines() if line.startswith("launch ")]
    assert len(rows) == 2 * 2 * 8, stdout  # dtypes x plans x (4 sort launches, W13, activations, W2, combine)
    assert {row[3] for row in rows} == {"sort_ranks", "sort_prefix", "sort_groups", "sort_scatter", "w13_gluon",
                                        "activations", "w2_prefill", "combine_valid"}, stdout
    for row in rows:
        assert 0 < int(row[4]) <= 255 and int(row[5]) == 0, row


def test_w2_tiles_with_a_ring_per_piece_wait_at_fewer_barriers():
    """The prefill route's wgmma W2 with as many ring stages as a tile has pieces (the table's
    256-1024-token entries, w2_stages = N / 32 = 5) copies each piece into an allocation of its
    own: its tile loop waits at 11 barriers (two per piece and one more), where a 4-stage ring,
    one allocation, takes 16 (the compiler orders any two copies into one allocation). Fails on a
    W2 that puts the pieces back into one ring (2-5 us at 128-256 tokens on the H200)."""
    code = r"""
import dataclasses, re, sys
sys.path.insert(0, BENCHMARKS)
import sass_stats
from moe_grouped_decode.kernels.config import prefill_config
from moe_grouped_decode.contract import QWEN38_TP4 as c
shape = (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size)
for dtype in ("fp16", "bf16"):
    for M in (256, 512, 1024):
        table = prefill_config(shape, sass_stats.TABLE_GPU, dtype, M)
        for stages in (table.w2_stages, 4):
            for name, kernel, _, _ in sass_stats.prefill_kernels(dtype, M, dataclasses.replace(table, w2_stages=stages)):
                if "w2_prefill_wgmma" not in name:
                    continue
                sass = sass_stats.cuobjdump(kernel, "-sass")
                lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
                         if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/", line))]
                end, target = next((at, int(m.group(1), 16)) for at, line in lines
                                   if (m := re.search(r"BRA (0x[0-9a-f]+)", line)) and int(m.group(1), 16) < at)
                body = [line for at, line in lines if target <= at <= end]
                print("loop", dtype, M, stages, sum("BAR.SYNC" in line for line in body))
""".replace("BENCHMARKS", repr(str(ROOT / "benchmarks")))
    rows = [line.split() for line in _python_stdout("-c", code).splitlines() if line.startswith("loop ")]
    assert len(rows) == 2 * 3 * 2, rows
    for _, dtype, M, stages, barriers in rows:
        assert int(barriers) <= (11 if stages == "5" else 16), (dtype, M, stages, barriers)
    assert {row[3] for row in rows} == {"4", "5"}, rows  # the table's entries use the piece rings


def test_the_wgmma_prefill_kernels_take_a_from_registers():
    """The wgmma prefill kernels (both dtypes, the table's configs: narrow and wide W13 programs)
    compile for sm_90 within 255 registers and no stack, multiply with HGMMA whose A operand is registers, store nothing to
    shared memory in W13's step loop (the dequantized weights never pass through it) and wait at no
    more barriers per step than its pieces need."""
    code = r"""
import re, sys
sys.path.insert(0, BENCHMARKS)
import sass_stats
from moe_grouped_decode.kernels.config import PrefillConfig
for dtype in ("fp16", "bf16"):
    for rows, tiles, k in ((8, "narrow", 64), (16, "narrow", 64), (16, "wide", 64), (64, "wide", 64),
                           (8, "narrow", 128)):  # 64- and 128-row W13 steps
        cfg = PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=k, w13_stages=3 if rows < 64 else 4,
                            w2_stages=4, w13_scales_ahead=rows < 64, w13_tiles=tiles)
        tiles = f"{tiles}-k{k}"
        for name, kernel, _, _ in sass_stats.prefill_kernels(dtype, 2048, cfg):
            launch = name.split()[2]
            if "wgmma" not in launch:
                continue
            usage = sass_stats.cuobjdump(kernel, "-res-usage")
            sass = sass_stats.cuobjdump(kernel, "-sass")
            a_operands = re.findall(r"HGMMA\.64x\d+x16\.F32\S* R\d+, (\S+),", sass)
            print("kernel", dtype, f"{rows}-{tiles}", launch, usage.split("REG:")[1].split()[0], usage.split("STACK:")[1].split()[0],
                  len(a_operands), all(a.startswith("R") for a in a_operands))
            if launch == "w13_prefill_wgmma":
                # the step loop: from the backward branch's target to the branch
                lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
                         if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/", line))]
                end, target = next((at, int(m.group(1), 16)) for at, line in lines
                                   if (m := re.search(r"BRA (0x[0-9a-f]+)", line)) and int(m.group(1), 16) < at)
                body = [line for at, line in lines if target <= at <= end]
                print("loop", dtype, f"{rows}-{tiles}", sum(" STS" in line for line in body),
                      sum("HGMMA" in line for line in body), sum("BAR.SYNC" in line for line in body))
""".replace("BENCHMARKS", repr(str(ROOT / "benchmarks")))
    stdout = _python_stdout("-c", code)
    kernels = [line.split() for line in stdout.splitlines() if line.startswith("kernel ")]
    assert {(row[1], row[2], row[3]) for row in kernels} == {
        (dtype, rows, name) for dtype in ("fp16", "bf16")
        for rows in ("8-narrow-k64", "16-narrow-k64", "16-wide-k64", "64-wide-k64", "8-narrow-k128")
        for name in ("w13_prefill_wgmma", "w2_prefill_wgmma")}, stdout
    for row in kernels:
        assert 0 < int(row[4]) <= 255 and int(row[5]) == 0 and int(row[6]) > 0 and row[7] == "True", row
    loops = [line.split() for line in stdout.splitlines() if line.startswith("loop ")]
    assert len(loops) == 10, stdout
    for row in loops:
        # no shared store; per 32 step rows two k16 for each m64 block: two (wide) or one (narrow)
        blocks = 2 if "wide" in row[2] else 1
        assert row[3] == "0" and int(row[4]) == blocks * int(row[2].split("-k")[1]) // 16, row
        # barriers per step: the ring wait's and two the compiler adds around it; the compiler also
        # orders any two copies into one shared ring, so 64-row steps (two pieces sharing a ring)
        # take one between them, and 128-row steps, whose pieces copy into rings of their own,
        # none (three barriers fewer: 2-5 us at 160-512 tokens on the H200)
        pieces = int(row[2].split("-k")[1]) // 32
        assert int(row[5]) <= (3 if pieces == 4 else pieces + 2), row


def test_wgmma_w2_tiles_and_unrolled_pieces_compile_without_spills():
    """Every W2 variant the tuner searches at a 12-piece N (384) compiles for sm_90 without stack:
    one, two or four tiles a program, the pieces looped or unrolled, over one ring or a stage a
    piece. One tile with its pieces unrolled is the case Triton once failed to lower (a prefetch
    under a constant-false condition); it must stay within the registers of the looped kernel's
    four tiles, the reason it is searched."""
    code = r"""
import re, sys
sys.path.insert(0, BENCHMARKS)
import sass_stats
from compile_times import plan_launches
from moe_grouped_decode.kernels.config import PrefillConfig
for dtype in ("fp16", "bf16"):
    for tiles in (1, 2, 4):
        for unrolled, stages in ((8, 4), (16, 4), (16, 12)):
            cfg = PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=64, w13_stages=3, w2_stages=stages,
                                w2_tiles_per_program=tiles, w2_unrolled_pieces=unrolled)
            plan, ints = plan_launches("prefill", (128, 8, 1152, 384, 128), 128, dtype, 90, prefill_config=cfg)
            w2 = next(launch for launch in plan.launches if launch.stage == "w2")
            usage = sass_stats.cuobjdump(sass_stats.compile_launch(w2, dtype, ints), "-res-usage")
            regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
            print("w2", dtype, tiles, unrolled, stages, regs, stack)
""".replace("BENCHMARKS", repr(str(ROOT / "benchmarks")))
    rows = [line.split()[1:] for line in _python_stdout("-c", code).splitlines() if line.startswith("w2 ")]
    assert len(rows) == 2 * 3 * 3, rows
    regs = {}
    for dtype, tiles, unrolled, stages, registers, stack in rows:
        assert stack == "0" and int(registers) <= 255, rows
        regs[dtype, tiles, unrolled, stages] = int(registers)
    for dtype in ("fp16", "bf16"):
        assert regs[dtype, "1", "16", "12"] <= regs[dtype, "4", "8", "4"], regs


MARLIN_COMPILE = """
import sys
sys.path.insert(0, {benchmarks!r})
import sass_stats
from triton.backends.compiler import GPUTarget
from moe_grouped_decode.kernels.marlin_grouped import marlin_w13_kernel, marlin_w2_kernel
sass_stats.TARGET = GPUTarget("cuda", {arch}, 32)
for dtype in ("fp16", "bf16"):
    half = "*" + dtype
    for grouped in (True, False):
        for warps in (1, 4):
            shape = dict(K=2048, N=768 if grouped else 128, N_P=768 if grouped else 128, G=128, SCALES_GROUPED=grouped,
                         IS_BF16=dtype == "bf16", USE_PDL={arch} >= 90, WARPS=warps)
            w13 = sass_stats.compile_kernel(marlin_w13_kernel, dict(shape, TOP_K=8, CHUNKS=2, SPLITS=2048 // (64 * warps),
                                                                    ARRIVALS_PAD=64),
                                            dict(x_ptr=half, ids_ptr="*i32", qweight_ptr="*i32", scales_ptr=half,
                                                 qzeros_ptr="*i32", partials_ptr="*fp32", arrivals_ptr="*i32"), warps,
                                            dict(stride_xm=2048))
            w2 = sass_stats.compile_kernel(marlin_w2_kernel, dict(shape, SPLITS=4, N_PAD=1024, TOP_K=8, FUSED_COMBINE=True),
                                           dict(ids_ptr="*i32", partials_ptr="*fp32", qweight_ptr="*i32", scales_ptr=half,
                                                qzeros_ptr="*i32", act_ptr=half, row_out_ptr="*fp32", out_ptr=half,
                                                topk_weights_ptr="*fp32", arrivals_ptr="*i32"), warps, dict(stride_om=2048))
            kernels = [("w13", w13), ("w2", w2)]
            if grouped:  # Humming's tensors: padded strides, zero words gathered into Marlin's order
                kernels.append(("humming w13", sass_stats.compile_kernel(
                    marlin_w13_kernel, dict(shape, TOP_K=8, CHUNKS=2, SPLITS=2048 // (64 * warps), ARRIVALS_PAD=64,
                                            STORED_COLUMNS=1536, STORED_ROWS=2048, UP_TILE=12, PLAIN_ZEROS=True),
                    dict(x_ptr=half, ids_ptr="*i32", qweight_ptr="*i32", scales_ptr=half, qzeros_ptr="*i32",
                         partials_ptr="*fp32", arrivals_ptr="*i32"), warps, dict(stride_xm=2048))))
                kernels.append(("humming w2", sass_stats.compile_kernel(
                    marlin_w2_kernel, dict(shape, SPLITS=4, N_PAD=1024, TOP_K=8, FUSED_COMBINE=True,
                                           STORED_COLUMNS=2048, PLAIN_ZEROS=True, N_SPLITS=2),
                    dict(ids_ptr="*i32", partials_ptr="*fp32", qweight_ptr="*i32", scales_ptr=half,
                         qzeros_ptr="*i32", act_ptr=half, row_out_ptr="*fp32", out_ptr=half,
                         topk_weights_ptr="*fp32", arrivals_ptr="*i32"), warps, dict(stride_om=2048))))
            for name, kernel in kernels:
                sass_stats.check_fragment_layouts(name, kernel, warps)
                print("marlin", dtype, grouped, warps, name, "assembled")
"""


@pytest.mark.parametrize("arch", [90, 80])
def test_marlin_kernels_assemble_with_one_row_per_lane(arch):
    """The Marlin-reading grouped kernels' inline PTX goes through ptxas for both dtypes and scale
    orders, over Marlin's and Humming's tensors (W2 in N splits there), and Triton lays its operands
    out one row per lane (what the PTX's lane mapping needs)."""
    stdout = _python_stdout("-c", MARLIN_COMPILE.format(benchmarks=str(ROOT / "benchmarks"), arch=arch))
    assert stdout.count("assembled") == 24, stdout

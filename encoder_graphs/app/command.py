"""`encoder-graphs caption`: check the request and every output before a model loads, caption
what is not done yet, write records, sidecars and metadata, report. Ctrl-C stops after the
current batch (a second one at once); a rerun of the same command resumes."""

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.config import COMPILE_FROM_FILES, CaptionConfig
from encoder_graphs.app.distributed import Job, job_from_env
from encoder_graphs.app.errors import EXIT_FAILURES, EXIT_INTERRUPTED, EXIT_OK, UsageError
from encoder_graphs.app.outputs import METADATA_FILE, SidecarPolicy, unwritable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from encoder_graphs.app.media import MediaFile
    from encoder_graphs.app.results import ResultsFile
    from encoder_graphs.protocols import CaptionInputs

RESUME_HINT = "rerun the same command to resume"
# An interrupted torchrun job: how long rank 0 waits for the other ranks' last batches (torchrun
# kills its processes 30 s after a Ctrl-C; the merge must end before).
INTERRUPTED_WAIT_S = 15.0
STARTED = time.perf_counter()  # the command's start, for the statistics' times (imports after it are counted)


@dataclass
class Plan:
    """What a run will do, settled before any model loads."""

    roots: list[Path]
    files: "list[MediaFile]"
    todo: "list[MediaFile]"
    config: CaptionConfig
    sidecars: SidecarPolicy
    results: "ResultsFile"
    job: Job = field(default_factory=Job)


def caption(args: argparse.Namespace) -> int:
    if args.model is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from encoder_graphs.models.default_model import default_model_dir

        # Before the job's process group exists: transformers then writes weights on rank 0 only.
        default_model_dir()
    plan = make_plan(args, job_from_env())
    with plan.results:  # rank 0 (or the only process) holds the lock on --out until the run ends
        if plan.todo:
            status = run(args, plan)
        else:
            failed = sum(plan.results.is_failed(f.path) for f in plan.files)
            where = f"{args.out}" + (" or have sidecars" if plan.sidecars.enabled else "")
            print(f"nothing to do: all {len(plan.files)} files are already in {where} ({failed} of them as errors)")
            write_metadata(args, plan)
            status = exit_status(plan)
    if plan.job.distributed and status == EXIT_FAILURES:
        # torchrun reports any status but 0 of a process as the job's crash, with a traceback: a job
        # that finished says what failed in its report, and --retry-failed tries those files again.
        return EXIT_OK
    return status


def make_plan(args: argparse.Namespace, job: Job) -> Plan:
    """The files, the settings and the outputs: every usage error that needs no model."""
    from encoder_graphs.app.media import SAMPLES_DIR, discover

    # abspath, as discover's file paths: `..` resolved, symlinks kept, so the two compare as text.
    roots = [Path(os.path.abspath(p)) for p in args.paths] + ([SAMPLES_DIR] if args.samples else [])
    if not roots:
        raise UsageError("give at least one PATH (or --samples)")
    try:
        files = discover(roots, include_hidden=args.include_hidden)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    if not files:
        raise UsageError(f"no images or videos found under {' '.join(map(str, roots))}")
    try:
        config = CaptionConfig(
            prompt=read_prompt(args),
            max_new_tokens=args.max_new_tokens,
            max_batch_tokens=args.max_batch_tokens or CaptionConfig.max_batch_tokens,
            prefix=args.prefix,
            suffix=args.suffix,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        sidecars = SidecarPolicy(args.sidecar, args.sidecar_ext, args.overwrite)
    except ValueError as error:
        raise UsageError(str(error)) from error
    check_outputs(args, roots, files, sidecars)
    results = open_results(args, job)
    if job.rank == 0 and sidecars.enabled:
        if written := sidecars.backfill(results.path, [f.path for f in files], config.text):
            print(f"encoder-graphs: wrote {written} sidecars from captions already in {args.out}", file=sys.stderr)
    todo = [f for f in files if not results.is_done(f.path) and not sidecars.skips(f.path)]
    if job.distributed:  # every rank must hold the same list before any starts writing parts
        job.barrier("planned")
    return Plan(roots, files, todo, config, sidecars, results, job)


def open_results(args: argparse.Namespace, job: Job) -> "ResultsFile":
    """`--out` with what it holds, once the part files a killed torchrun job left are merged into
    it (by rank 0, or the only process, which holds the lock; the other ranks then read it)."""
    from encoder_graphs.app.distributed import part_paths
    from encoder_graphs.app.results import ResultsFile, ResultsLocked

    if job.rank != 0:
        job.wait_for("opened", 1)  # rank 0 has the lock, a cut last line repaired and the parts merged
    try:
        results = ResultsFile(args.out, retry_failed=args.retry_failed, lock=job.rank == 0)
    except ResultsLocked as error:
        raise UsageError(str(error)) from error
    except OSError as error:
        raise UsageError(f"cannot use --out {args.out}: {error}") from error
    if results.repaired_bytes:
        print(f"encoder-graphs: dropped a half-written last line ({results.repaired_bytes} bytes) of {args.out}",
              file=sys.stderr)
    if job.rank == 0 and (parts := part_paths(results.path)):
        try:
            merged = results.merge(parts)
        except (ResultsLocked, OSError) as error:
            results.close()
            raise UsageError(f"cannot merge the part files beside --out {args.out}: {error}") from error
        print(f"encoder-graphs: merged {merged} records from the {len(parts)} part files an earlier torchrun job "
              f"left beside {args.out}", file=sys.stderr)
    if job.distributed and job.rank == 0:
        job.store.add("opened", 1)
    return results


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        return args.prompt_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {error}") from error


def check_outputs(args: argparse.Namespace, roots: list[Path], files: "list[MediaFile]", sidecars: SidecarPolicy) -> None:
    """Every path the run will write can be written: checked now, not after the model loaded."""
    problems = [("--out", args.out, unwritable(args.out))]
    if args.stats_json is not None:
        problems.append(("--stats-json", args.stats_json, unwritable(args.stats_json)))
    if sidecars.enabled:
        folders = {f.path.parent for f in files}
        problems += [("--sidecar", folder, unwritable(folder, folder=True)) for folder in sorted(folders)]
    if args.hf_metadata:
        problems += [("--hf-metadata", root, unwritable(root, folder=True)) for root in roots if root.is_dir()]
    for flag, path, problem in problems:
        if problem is not None:
            raise UsageError(f"cannot use {flag} {path}: {problem}")
    if sidecars.enabled and (clashes := sidecars.collisions([f.path for f in files])):
        first, second = clashes[0]
        raise UsageError(
            f"--sidecar: {first.name} and {second.name} (and {len(clashes) - 1} more pairs) would share "
            f"{sidecars.path(first)}; rename one or caption them apart"
        )
    taken = {os.path.abspath(root / METADATA_FILE) for root in roots if args.hf_metadata and root.is_dir()}
    for flag, path in (("--out", args.out), ("--stats-json", args.stats_json)):
        if path is not None and os.path.abspath(path) in taken:
            raise UsageError(f"cannot use {flag} {path}: --hf-metadata writes that file")
        if path is not None:
            taken.add(os.path.abspath(path))


def run(args: argparse.Namespace, plan: Plan) -> int:
    from encoder_graphs.app.loading import load_model, pick_device
    from encoder_graphs.report import format_graph_stats, format_run_stats

    device = pick_device(args.device, plan.job.local_rank)
    print(f"encoder-graphs: loading model {args.model or '(embedded tiny default)'} on {device} ...", file=sys.stderr)
    model, inputs = load_model(args.model, device, max_tiles=args.max_tiles, max_image_tokens=args.max_image_tokens)
    loaded = time.perf_counter()  # the weights are on the device
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    summary, graph_stats = caption_files(args, plan, model, inputs, device)
    summary["load_s"] = loaded - STARTED
    if summary["first_records_s"] is not None:
        summary["first_caption_after_load_s"] = summary["setup_s"] + summary["first_records_s"]
    if plan.job.distributed:
        job_stats = finish_job(plan, summary, graph_stats)
        if job_stats is None:
            return EXIT_OK  # rank 0 merges the parts and reports for the job
        summary, graph_stats = job_stats
    print(format_run_stats(summary))
    print(format_graph_stats(graph_stats))
    write_metadata(args, plan)
    if args.stats_json is not None:
        payload = {"pipeline": summary, **graph_stats, "model": args.model or "default", "device": str(device)}
        args.stats_json.parent.mkdir(parents=True, exist_ok=True)
        args.stats_json.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    if summary["interrupted"]:
        print(f"interrupted: {RESUME_HINT}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return exit_status(plan)


def finish_job(plan: Plan, summary: dict, graph_stats: dict) -> tuple[dict, dict] | None:
    """Every rank's statistics to rank 0, which merges the part files into `--out` (each path
    once: the ranks claimed disjoint chunks) and returns the job's run and graph statistics; None
    elsewhere. Interrupted, rank 0 waits a while only: the other ranks stop after their batch, and
    torchrun kills what is left 30 s after a Ctrl-C. The parts of ranks that did not report wait for
    the next run to merge them."""
    from encoder_graphs.app.distributed import gather_stats, part_path
    from encoder_graphs.app.jobstats import combined_graph_stats, combined_stats

    patience_s = INTERRUPTED_WAIT_S if summary["interrupted"] else None
    ranks = gather_stats(plan.job, {"run": summary, "graphs": graph_stats}, patience_s)
    if ranks is None:
        return None
    parts = [part_path(plan.results.path, rank) for rank in ranks]
    plan.results.merge([part for part in parts if part.exists()])
    job_summary = combined_stats({rank: stats["run"] for rank, stats in ranks.items()})
    return job_summary, combined_graph_stats([stats["graphs"] for stats in ranks.values()])


def write_metadata(args: argparse.Namespace, plan: Plan) -> None:
    if not args.hf_metadata or plan.job.rank != 0:
        return
    from encoder_graphs.app.metadata import write_hf_metadata
    from encoder_graphs.app.names import as_text

    written, left_out = write_hf_metadata(plan.results.path, plan.roots, plan.files, plan.sidecars)
    for path in written:
        print(f"wrote {path}")
    if left_out:
        print(f"encoder-graphs: metadata.jsonl has no row for {len(left_out)} images whose names are not UTF-8, "
              f"which a JSON file_name cannot name (rename them), e.g. {as_text(str(left_out[0]))}", file=sys.stderr)


def caption_files(
    args: argparse.Namespace, plan: Plan, model: "PreTrainedModel", inputs: "CaptionInputs", device: "torch.device"
) -> tuple[dict, dict]:
    """Enable the graphs, caption the files still to do, disable them: the run's and the graphs'
    statistics."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.app.distributed import by_cost, claim_chunk, claimed, part_path
    from encoder_graphs.app.media import LoadLimits
    from encoder_graphs.app.outputs import Outputs
    from encoder_graphs.app.pipeline import Captioner, longest_sequence
    from encoder_graphs.app.results import ResultsFile
    from encoder_graphs.app.runstats import Progress

    setup_started = time.perf_counter()
    limits = LoadLimits(
        max_frames=args.max_frames,
        min_side=inputs.min_side,
        max_pixels=inputs.max_image_pixels,
        frame_max_pixels=inputs.max_frame_pixels,
    )
    # The resolution policy sizes the decoder's cache, its length tiers and the batch.
    longest = longest_sequence(inputs, plan.config, limits, videos=any(f.kind == "video" for f in plan.todo))
    check_length(args, model, longest)
    longest_prompt = longest - plan.config.max_new_tokens
    batch_size = args.batch_size or auto_batch_size(model, longest, longest_prompt, device)
    # A batch never holds more files than the job, so the decoder captures no larger bucket.
    batch_size = min(batch_size, max(1, len(plan.todo)))
    # Unless given, the vision-token cap lets a batch of the largest items through: the batch
    # size already counts their memory.
    max_batch_tokens = args.max_batch_tokens or longest_prompt * batch_size
    prefetch = 1 if plan.job.distributed else plan.config.prefetch_batches
    config = replace(plan.config, batch_size=batch_size, max_batch_tokens=max_batch_tokens, prefetch_batches=prefetch)
    try:
        handle = enable_cuda_graphs(
            model,
            budgets=args.budgets,
            attn_backend=args.attn_backend,
            enabled=not args.no_graphs,
            compile=wants_compile(args, plan, device),
            decoder_max_batch_size=config.batch_size,
            decoder_max_cache_len=longest,
            lazy=True,  # each graph at its first use: a job captures only what it needs
        )
    except ValueError as error:  # an architecture without an adapter, a bad backend or budgets
        raise UsageError(f"cannot enable graphs on this model: {error}") from error
    setup_s = time.perf_counter() - setup_started
    job = plan.job
    # Under torchrun each rank writes its own part file and claims chunks of the costliest first.
    writer = ResultsFile(part_path(plan.results.path, job.rank)) if job.distributed else plan.results
    files = claimed(job, by_cost(plan.todo), claim_chunk(config.batch_size)) if job.distributed else plan.todo
    progress = None if args.quiet or job.distributed else Progress(len(plan.todo))
    outputs = Outputs(writer, plan.sidecars, progress.advance if progress else None)
    captioner = Captioner(model, inputs, config, limits, roots=plan.roots, model_name=args.model or "default")
    try:
        if job.distributed:  # ranks start claiming together: one whose capture ends first would claim ahead
            job.barrier("ready")
        with stop_on_interrupt() as stop:
            stats = captioner.run(files, outputs, stop)
    finally:
        graph_stats = handle.stats()
        handle.disable()
        if writer is not plan.results:
            writer.close()
    stats.skipped = len(plan.files) - len(plan.todo)
    stats.files = len(plan.files)
    summary = {
        **stats.as_dict(),
        "batch_size": config.batch_size,
        "sidecars": outputs.sidecars_written,
        "setup_s": setup_s,
        "max_image_tokens": args.max_image_tokens,
        "max_tiles": args.max_tiles,
        "longest_sequence": longest,
    }
    if device.type == "cuda":
        import torch

        summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary, graph_stats


def wants_compile(args: argparse.Namespace, plan: Plan, device: "torch.device") -> bool:
    """`--compile` / `--no-compile`, else on a GPU with enough files to pay for it: compiling the
    encoder blocks added ~11 s to the start and saved ~6.8 ms an image (Qwen2.5-VL-3B, 512 images,
    29.2 vs 24.3 images/s in the loop, H200 2026-11-22), so it pays from ~1,600 files a GPU (the
    default asks COMPILE_FROM_FILES, a margin for smaller towers). With `--no-graphs` too: the
    compiled blocks speed the eager path as much."""
    if args.compile is not None:
        return args.compile
    return device.type == "cuda" and len(plan.todo) >= COMPILE_FROM_FILES * plan.job.world_size


def check_length(args: argparse.Namespace, model: "PreTrainedModel", longest: int) -> None:
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and longest > positions:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens}: the longest prompt plus the caption reaches {longest} "
            f"tokens, past the model's {positions} positions"
        )


def auto_batch_size(model: "PreTrainedModel", longest: int, longest_prompt: int, device: "torch.device") -> int:
    """`--batch-size auto`: the most sequences of the longest length the GPU memory free now
    holds, up to 64 (`app.sizing`); throughput grows with the batch (RESULTS.md). 8 without CUDA."""
    from encoder_graphs.app.sizing import AUTO_BATCH_DEFAULT, TextSizes, batch_size_for, sequence_memory

    if device.type != "cuda":
        return AUTO_BATCH_DEFAULT
    import torch

    sizes = TextSizes.of(model.config.get_text_config(decoder=True), model.dtype.itemsize)
    free, _ = torch.cuda.mem_get_info(device)
    return batch_size_for(free, sequence_memory(sizes, longest, longest_prompt))


@contextmanager
def stop_on_interrupt() -> Iterator[Callable[[], bool]]:
    """Within the block, the first Ctrl-C asks the run to stop after the current batch (the
    yielded function says whether it was asked); a second one stops at once."""
    asked = []

    def handler(signum: int, frame: object) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        print(f"\nencoder-graphs: stopping after the current batch (Ctrl-C again to stop now); {RESUME_HINT}",
              file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_status(plan: Plan) -> int:
    """0 when every file now has a caption (or a sidecar); failures recorded by an earlier run
    count too."""
    failed = any(plan.results.is_failed(f.path) and not plan.sidecars.skips(f.path) for f in plan.files)
    return EXIT_FAILURES if failed else EXIT_OK

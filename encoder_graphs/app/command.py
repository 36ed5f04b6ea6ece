"""`encoder-graphs caption`: plan the run (`plan.py`: the request and every output checked before
a model loads), caption what is not done yet, write records, sidecars and metadata, report.
Ctrl-C stops after the current batch (a second one at once); a rerun of the same command resumes."""

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.distributed import job_from_env
from encoder_graphs.app.errors import EXIT_FAILURES, EXIT_INTERRUPTED, EXIT_OK, OutputError, UsageError, printable
from encoder_graphs.app.outputs import METADATA_FILE
from encoder_graphs.app.plan import Plan, describe, make_plan, report_sidecar_errors
from encoder_graphs.app.settings import Settings
from encoder_graphs.app.summary import outcome, said_by_flag, show_samples

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from encoder_graphs.app.decoders import VideoDecoders
    from encoder_graphs.app.job import CaptionJob
    from encoder_graphs.engine.statistics import GraphStats
    from encoder_graphs.protocols import CaptionInputs

RESUME_HINT = "rerun the same command to resume"
# An interrupted torchrun job: how long rank 0 waits for the other ranks' last batches (torchrun
# kills its processes 30 s after a Ctrl-C; the merge must end before).
INTERRUPTED_WAIT_S = 15.0
STARTED = time.perf_counter()  # the command's start, for the statistics' times (imports after it are counted)


def cache_default_model(settings: Settings) -> None:
    """Under torchrun, the embedded default model cached before the job's process group exists:
    transformers then writes weights on rank 0 only."""
    if settings.model is None and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not settings.dry_run:
        from encoder_graphs.app.loading import cache_error
        from encoder_graphs.presets.default_model import default_model_dir

        try:
            default_model_dir()
        except OSError as error:
            raise cache_error(error) from error


def caption(settings: Settings) -> int:
    cache_default_model(settings)
    plan = make_plan(settings, job_from_env())
    settings = plan.settings  # with --out settled
    if settings.dry_run:
        with plan.results:
            print(describe(plan, printable(settings.model) if settings.model else "the embedded tiny default"))
        return EXIT_OK
    try:
        status = caption_plan(plan)
    finally:
        if plan.temporary_out:  # a demo: its captions shown (when there are), its folder removed
            show_samples(plan)
    if plan.job.distributed and status == EXIT_FAILURES:
        # torchrun reports any status but 0 of a process as the job's crash, with a traceback: a job
        # that finished says what failed in its report, and --retry-failed tries those files again.
        return EXIT_OK
    return status


def caption_plan(plan: Plan) -> int:
    """The run of `plan`, or the report that it has nothing to do; the exit status."""
    settings = plan.settings
    with plan.results:  # rank 0 (or the only process) holds the lock on --out until the run ends
        if plan.todo:
            status = run(plan)
        else:
            from encoder_graphs.report import format_not_read

            failed = sum(plan.results.is_failed(f.path) for f in plan.files)
            where = printable(settings.out) + (" or have sidecars" if plan.sidecars.enabled else "")
            print(f"nothing to do: all {len(plan.files)} files are already in {where} ({failed} of them as errors)"
                  + (f"; {format_not_read(plan.skipped)}" if plan.skipped else ""))
            write_metadata(plan)
            if plan.job.rank == 0:
                files = len(plan.files)
                write_stats_json(settings, {"pipeline": {"files": files, "skipped": files, "succeeded": 0, "failed": 0}})
            status = exit_status(plan)
    return status


def write_output(path: Path, text: str) -> None:
    """A file the user named written whole (through their symlink, to the file it names);
    `OutputError` when it cannot be."""
    from encoder_graphs.app.outputs import write_atomically

    target = Path(os.path.realpath(path))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, text)
    except OSError as error:
        raise OutputError(path, error) from error


def run(plan: Plan) -> int:
    settings = plan.settings
    from encoder_graphs.app.job import open_job
    from encoder_graphs.app.loading import load_model, open_model, pick_device
    from encoder_graphs.report import format_graph_stats, format_run_stats

    device = pick_device(settings.device, plan.job.local_rank)  # before any file is read: a usage error
    source = open_model(
        settings.model,
        max_tiles=settings.max_tiles,
        max_image_tokens=settings.max_image_tokens,
        max_frame_tokens=settings.max_frame_tokens,
    )
    job = open_job(plan, source, device)  # before the weights: GBs
    name = printable(settings.model) if settings.model else "(embedded tiny default)"
    videos = start_video_decoders(plan, job, source.inputs)  # they decode the first clips while the model loads
    try:
        meanwhile = f" (decoding the first {videos.prefetched} videos meanwhile)" if videos and videos.prefetched else ""
        print(f"encoder-graphs: loading model {name} on {job.device} ...{meanwhile}", file=sys.stderr)
        model = load_model(source, job.device)
        loaded = time.perf_counter()  # the weights are on the device
        summary, graph_stats = caption_files(plan, job, model, source.inputs, videos)
    finally:
        if videos is not None:
            videos.close()
    summary["load_s"] = loaded - STARTED
    summary["not_read"] = dict(sorted(plan.skipped.items()))
    if summary["first_records_s"] is not None:
        summary["first_caption_after_load_s"] = summary["setup_s"] + summary["first_records_s"]
    if plan.job.distributed:
        job_stats = finish_job(plan, summary, graph_stats)
        if job_stats is None:
            return EXIT_OK  # rank 0 merges the parts and reports for the job
        summary, graph_stats = job_stats
    graph_stats = said_by_flag(graph_stats)
    print(format_run_stats(summary))
    print(format_graph_stats(graph_stats))
    print(outcome(plan))
    write_metadata(plan)
    write_stats_json(settings, {"pipeline": summary, **graph_stats.to_json(), "device": str(job.device)})
    if summary["interrupted"]:
        print(f"interrupted: {RESUME_HINT}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return exit_status(plan)


def finish_job(plan: Plan, summary: dict, graph_stats: "GraphStats") -> "tuple[dict, GraphStats] | None":
    """Every rank's statistics to rank 0, which merges the part files into `--out` (each path
    once: the ranks claimed disjoint chunks) and returns the job's run and graph statistics; None
    elsewhere. Interrupted, rank 0 waits a while only: the other ranks stop after their batch, and
    torchrun kills what is left 30 s after a Ctrl-C. The parts of ranks that did not report wait for
    the next run to merge them."""
    from encoder_graphs.app.distributed import gather_stats, part_path
    from encoder_graphs.app.jobstats import combined_stats
    from encoder_graphs.engine.statistics import GraphStats

    patience_s = INTERRUPTED_WAIT_S if summary["interrupted"] else None
    ranks = gather_stats(plan.job, {"run": summary, "graphs": graph_stats.to_json()}, patience_s)
    if ranks is None:
        return None
    parts = [part_path(plan.results.path, rank) for rank in ranks]
    plan.results.merge([part for part in parts if part.exists()])
    job_summary = combined_stats({rank: stats["run"] for rank, stats in ranks.items()})
    return job_summary, GraphStats.merge([GraphStats.from_json(stats["graphs"]) for stats in ranks.values()])


def write_metadata(plan: Plan) -> None:
    if not plan.settings.hf_metadata or plan.job.rank != 0:
        return
    from encoder_graphs.app.metadata import write_hf_metadata

    try:
        written, left_out, dropped, refused = write_hf_metadata(plan.results.path, plan.roots, plan.files, plan.sidecars)
    except OSError as error:
        raise OutputError(error.filename or METADATA_FILE, error) from error
    for path in written:
        print(f"wrote {printable(path)}" + (f" (without {dropped[path]} rows of the one it replaced, kept as "
                                              f"{path.name}.bak: their images are gone or the rows unreadable)"
                                              if path in dropped else ""))
    if refused:
        print(f"encoder-graphs: {len(refused)} sidecars were not read as captions (a link, not a regular file, or "
              f"over 1 MiB), e.g. {printable(refused[0])}; their metadata rows took the caption in --out",
              file=sys.stderr)
    if left_out:
        print(f"encoder-graphs: metadata.jsonl has no row for {len(left_out)} images whose names are not UTF-8, "
              f"which a JSON file_name cannot name (rename them), e.g. {printable(left_out[0])}", file=sys.stderr)


def write_stats_json(settings: Settings, payload: dict) -> None:
    """`--stats-json`, whenever the command ends normally: a run, or nothing to do."""
    if settings.stats_json is not None:
        payload = {**payload, "model": settings.model or "default"}
        write_output(settings.stats_json, json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


def caption_files(
    plan: Plan, job: "CaptionJob", model: "PreTrainedModel", inputs: "CaptionInputs",
    videos: "VideoDecoders | None" = None,
) -> "tuple[dict, GraphStats]":
    """Size the job (`sized_job`), enable the graphs, caption the files still to do, disable
    them: the run's and the graphs' statistics. `videos`: the video decoders, already started."""
    settings = plan.settings
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.app.distributed import by_cost, claim_chunk, claimed, part_path
    from encoder_graphs.app.job import sized_job
    from encoder_graphs.app.outputs import Outputs
    from encoder_graphs.app.pipeline import Captioner
    from encoder_graphs.app.results import ResultsFile
    from encoder_graphs.app.runstats import progress_bar
    from encoder_graphs.decoder.layers.stack import warm_up_language_model

    setup_started = time.perf_counter()
    job = sized_job(job, plan, model, videos)
    config = job.config
    try:
        handle = enable_cuda_graphs(model, job.options)
    except ValueError as error:  # an architecture without an adapter, a bad backend or budgets
        raise UsageError(f"cannot enable graphs on this model: {error}") from error
    setup_s = time.perf_counter() - setup_started
    ranks = plan.job
    # Under torchrun each rank writes its own part file and claims chunks of the costliest first.
    writer = ResultsFile(part_path(plan.results.path, ranks.rank)) if ranks.distributed else plan.results
    files = claimed(ranks, by_cost(plan.todo), claim_chunk(config.largest_batch)) if ranks.distributed else plan.todo
    progress = None if settings.quiet or ranks.distributed else progress_bar(len(plan.todo))
    aliases = {str(f.path): f.aliases for f in plan.todo if f.aliases}
    outputs = Outputs(writer, plan.sidecars, progress.update if progress else None, aliases)
    warm_up = partial(warm_up_language_model, model) if job.device.type == "cuda" else None
    captioner = Captioner(
        model, inputs, config, job.limits, roots=plan.roots, model_name=job.model_name,
        run_settings=plan.identity, warm_up=warm_up, videos=videos,
    )
    try:
        if ranks.distributed:  # ranks start claiming together: one whose capture ends first would claim ahead
            ranks.barrier("ready")
        with stop_on_interrupt() as stop:
            stats = captioner.run(files, outputs, stop)
    finally:
        if progress is not None:
            progress.close()
        graph_stats = handle.stats()
        handle.disable()
        if writer is not plan.results:
            writer.close()
    report_sidecar_errors(outputs.sidecar_errors)
    stats.skipped = len(plan.files) - len(plan.todo) - plan.later
    stats.later = plan.later
    stats.files = len(plan.files)
    summary = {
        **stats.as_dict(),
        "batch_size": config.batch_size if stats.by_kind.get("image") else None,  # images'
        "video_batch_size": config.video_batch_size,
        "video_decoder": stats.video_decoder(job.limits.video_hwaccel),
        "sidecars": outputs.sidecars_written,
        "sidecar_errors": len(outputs.sidecar_errors),
        "setup_s": setup_s,
        "max_image_tokens": settings.max_image_tokens,
        "max_tiles": settings.max_tiles,
        "longest_sequence": job.longest,
    }
    if job.device.type == "cuda":
        import torch

        summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(job.device)
    return summary, graph_stats


def start_video_decoders(plan: Plan, job: "CaptionJob", inputs: "CaptionInputs") -> "VideoDecoders | None":
    """The video decoder processes, started now where the job has (or a dataset expects) videos
    the model reads (the run stops them), decoding the first videos the run will ask for (in its
    order: a torchrun rank's files are claimed later, and a dataset's are in its shards, so those
    start none)."""
    from encoder_graphs.app.decoders import VideoDecoders, video_workers

    if not inputs.reads_videos or not plan.videos_to_do():
        return None
    videos = VideoDecoders(video_workers(job.config.load_workers), job.limits).start()
    if not plan.job.distributed and plan.videos_expected is None:
        videos.prefetch(f.path for f in plan.todo if f.kind == "video" and not f.reason)  # not what the walk refused
    return videos


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
    """0 when every file now has a caption (or a sidecar), and with --sidecar every captioned
    file its sidecars; failures recorded by an earlier run count too."""
    sidecars = plan.sidecars
    failed = any(plan.results.is_failed(f.path) and not all(map(sidecars.skips, f.names)) for f in plan.files)
    missing = sidecars.enabled and any(
        plan.results.is_done(f.path) and not plan.results.is_failed(f.path)
        and not all(os.path.isfile(sidecars.path(name)) for name in f.names)
        for f in plan.files if f.kind in ("image", "video")
    )
    return EXIT_FAILURES if failed or missing else EXIT_OK

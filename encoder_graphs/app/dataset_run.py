"""`encoder-graphs caption SHARDS --out DIR`: a caption run over dataset shards (`app/datasets.py`)
into output shards (`app/shard_outputs.py`). The samples stream through the folder run's
`Captioner` (loaders ahead of the model, batches by cost, video decoder processes with their time
limit), so a shard's last batch and the next shard's first share the GPU; each output shard is
sealed as its last record arrives.

Across machines: `--num-shards N --shard-index I` (or a Slurm job array's task) and, inside one,
torchrun's ranks each take every Nth shard of the list, the same list on every machine. A shard
that cannot be read to its end is read once more (from the keys not yet done), then reported,
its records kept in its partial file and the run's exit status 1."""

import io
import os
import sys
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from itertools import islice
from typing import Any

from encoder_graphs.app.datasets import (
    InputShard,
    Sample,
    arrow_errors,
    check_columns,
    find_shards,
    media_of,
    sample_key,
    samples,
    shard_selection,
    unreadable,
)
from encoder_graphs.app.errors import EXIT_FAILURES, EXIT_INTERRUPTED, EXIT_OK, UsageError, printable
from encoder_graphs.app.media import MediaError, decode_image, open_regular, upright_size
from encoder_graphs.app.outputs import remove_stale_temporaries
from encoder_graphs.app.pipeline import Captioner, Pending
from encoder_graphs.app.settings import Settings
from encoder_graphs.app.shard_outputs import FORMATS, ShardOutputs, say_sealed
from encoder_graphs.app.webdataset_copy import copy_path

# Flags of a folder run that a dataset run cannot honour: refused, never ignored.
FOLDER_ONLY = {"sidecar": "--sidecar", "hf_metadata": "--hf-metadata", "manifest": "--manifest",
               "samples": "--samples", "redo": "--redo", "limit": "--limit",
               "include_hidden": "--include-hidden", "no_follow_links": "--no-follow-links"}
COUNTED_SHARDS = 2  # shards counted ahead (their headers read) for sizing the job: the rest alike
TABLE_ROWS_GUESS = 1000  # samples of a shard not counted ahead: they size batches and the compile choice
EXTRA = "pip install 'encoder-graphs[datasets]'"
# Sample bytes handed to the loaders and not yet decoded: a shard of large members stays bounded.
BYTES_IN_FLIGHT = 1 << 30


class InFlight:
    """The sample bytes the loaders hold; a sample waits while they hold `limit` (one at least)."""

    def __init__(self, limit: int = BYTES_IN_FLIGHT) -> None:
        self.limit, self.held, self._changed = limit, 0, threading.Condition()

    def take(self, size: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.held == 0 or self.held + size <= self.limit)
            self.held += size

    def give(self, size: int) -> None:
        with self._changed:
            self.held -= size
            self._changed.notify_all()


class SampleCaptioner(Captioner):
    """The Captioner of dataset samples: media from the sample's bytes, records named by key."""

    def __init__(self, *args: Any, in_flight: InFlight, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = in_flight

    def prepare(self, file: Any) -> Any:
        size = len(file.data) if isinstance(file, Sample) and file.data is not None else 0
        try:
            outcome = super().prepare(file)
        finally:
            self.in_flight.give(size)
        if isinstance(outcome, Pending) and size:
            outcome.file = replace(file, data=None)  # decoded: its bytes are not kept until the batch ends
        return outcome

    def _encoded(self, file: Any) -> tuple:
        if not isinstance(file, Sample) or file.data is None:
            return super()._encoded(file)
        if file.kind == "image":
            image = decode_image(io.BytesIO(file.data), file.label, self.limits)
            return self.inputs.encode_image(image), upright_size(io.BytesIO(file.data)), None
        try:
            video = self._video_decoders(file.path).decode(file.path, file.data)
        except MediaError as error:  # the decoders key their work by path: the error names the sample
            raise MediaError(file.label, error.kind, error.reason) from error
        return self.inputs.encode_video(video.frames, video.metadata), video.size, video.record()

    def _identity(self, file: Any) -> dict:
        return {"key": file.key, "shard": file.shard, "kind": file.kind, **file.carried}


def check_dataset_flags(settings: Settings) -> None:
    given = [flag for name, flag in FOLDER_ONLY.items() if getattr(settings, name)]
    if given:
        raise UsageError(f"{', '.join(given)}: for folders of files, not dataset shards")
    if settings.out is None:
        raise UsageError("dataset shards are captioned into one output shard each: give --out DIR")
    if settings.out_format not in FORMATS:
        raise UsageError(f"--out-format {settings.out_format}: give one of {', '.join(FORMATS)}")
    if settings.out_format == "parquet" and not arrow_errors():
        raise UsageError(f"--out-format parquet needs pyarrow: {EXTRA}")
    if os.path.lexists(settings.out) and not (settings.out.is_dir() and not settings.out.is_symlink()):
        raise UsageError(f"--out {printable(settings.out)}: with dataset shards, a folder (not a file or a link)")


def check_copies(settings: Settings, shards: list[InputShard]) -> None:
    """`--webdataset-copy` copies tar shards, each to a name of its own in --out: never over an input."""
    if not settings.webdataset_copy:
        return
    others = [shard for shard in shards if shard.format != "webdataset"]
    if others:
        raise UsageError(f"--webdataset-copy copies .tar shards; {others[0].name} is {others[0].format}: leave the flag "
                         "out")
    for shard in shards:
        copy = copy_path(settings.out, shard)
        if os.path.exists(copy) and os.path.samefile(copy, shard.path):
            raise UsageError(f"--webdataset-copy would write {printable(copy)} over the input shard it copies: "
                             "give another --out")


def my_part(settings: Settings) -> tuple[int, int]:
    """(parts, this process's part) over machines (`--num-shards` or Slurm) and torchrun's ranks."""
    from encoder_graphs.app.shards import slurm_shard

    num, index = (settings.num_shards, settings.shard_index) if settings.num_shards is not None else (
        slurm_shard() or (1, 0))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return num * world, index * world + rank


def shard_stream(
    shards: list[InputShard], outputs: ShardOutputs, settings: Settings, in_flight: InFlight
) -> Iterator[Sample]:
    """The samples still to caption, shard after shard; each shard's end told to `outputs`."""
    for shard in shards:
        done = outputs.begin(shard)
        if done is None:
            print(f"encoder-graphs: shard {shard.name}: {outputs.skipped[shard.name]}", file=sys.stderr)
            continue
        # Finished keys are skipped; with --retry-failed, only those captioned (an error is tried again).
        skip = {key for key, ok in done.items() if ok or not settings.retry_failed}
        handed: set[str] = set()
        for attempt in (1, 2):
            try:
                for sample in samples(shard, settings.image_column, settings.key_column):
                    if sample.key in skip or sample.key in handed:
                        outputs.duplicates[shard.name] += sample.key in handed and attempt == 1
                        continue
                    handed.add(sample.key)
                    in_flight.take(len(sample.data or b""))
                    yield sample
            except unreadable() as error:
                why = f"{type(error).__name__}: {error}"
                if attempt == 2:
                    outputs.failed[shard.name] = why
                    print(f"encoder-graphs: shard {shard.name} failed twice ({why}): its {len(handed)} records so far "
                          "are kept for a rerun", file=sys.stderr)
                continue
            outputs.ended(shard.name, len(handed))
            break


def caption_datasets(settings: Settings) -> int:
    """The dataset run's exit status; under torchrun a rank's failed samples are said in its report,
    not returned (torchrun would report the status as the job's crash)."""
    from encoder_graphs.app.command import cache_default_model

    cache_default_model(settings)
    status = caption_shards(settings)
    return EXIT_OK if status == EXIT_FAILURES and int(os.environ.get("WORLD_SIZE", "1")) > 1 else status


def caption_shards(settings: Settings) -> int:
    from encoder_graphs.app.plan import caption_config
    from encoder_graphs.app.prompts import read_prompts
    from encoder_graphs.app.settings import run_identity

    check_dataset_flags(settings)
    shards = find_shards(settings.paths)
    if all(shard.format == "webdataset" for shard in shards):
        for flag, given in (("--image-column", settings.image_column), ("--key-column", settings.key_column)):
            if given is not None:
                raise UsageError(f"{flag} names a column of Parquet or saved-dataset shards: tar shards have none")
    check_copies(settings, shards)
    parts, part = my_part(settings)
    mine = shard_selection(shards, parts, part)
    prompt, named = read_prompts(settings.prompt, settings.prompt_file)
    config = caption_config(settings, prompt, named)
    # The columns read are what a record's key and media mean: a rerun by others is refused.
    identity = {**run_identity(settings, [list(pair) for pair in named] if named else config.prompt),
                "image_column": settings.image_column, "key_column": settings.key_column}
    folder = settings.out
    outputs = ShardOutputs(folder, settings.out_format, identity,
                           lambda name, n, errors: say_sealed(name, n, errors, folder, settings.out_format),
                           settings.webdataset_copy and not settings.dry_run, settings.retry_failed)
    readable = []
    for shard in mine:
        try:
            check_columns(shard, settings.image_column, settings.key_column)
            readable.append(shard)
        except unreadable() as error:
            outputs.failed[shard.name] = f"{type(error).__name__}: {error}"
            print(f"encoder-graphs: shard {shard.name}: cannot be read ({outputs.failed[shard.name]})", file=sys.stderr)
    if not settings.dry_run:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries([*(outputs.final_path(shard.name) for shard in mine),
                                  *(copy_path(folder, shard) for shard in mine if shard.format == "webdataset")])
    todo = [shard for shard in readable if not outputs.is_complete(shard)]
    share = f" (part {part} of 0-{parts - 1}: {len(mine)})" if parts > 1 else ""
    print(f"encoder-graphs: {len(shards)} shards{share}; {len(mine) - len(todo)} complete in {printable(folder)}, "
          f"{len(todo)} to caption", file=sys.stderr)
    if settings.dry_run:
        from encoder_graphs.app.nvdec import dry_run_line

        videos = stand_in_plan(settings, todo, config, identity).videos_to_do() if todo else 0  # foretold, as a run's
        if note := dry_run_line(settings.video_decoder, settings.device, videos, 1):
            print(f"encoder-graphs: {note}", file=sys.stderr)
    if settings.dry_run or not todo:
        return EXIT_FAILURES if outputs.failed and not settings.dry_run else EXIT_OK
    return run_shards(settings, todo, outputs, config, identity)


def run_shards(settings: Settings, todo: list[InputShard], outputs: ShardOutputs, config: Any, identity: dict) -> int:
    from encoder_graphs.app.command import start_video_decoders
    from encoder_graphs.app.job import open_job
    from encoder_graphs.app.loading import open_model, pick_device

    plan = stand_in_plan(settings, todo, config, identity)
    device = pick_device(settings.device, int(os.environ.get("LOCAL_RANK", "0")))
    source = open_model(settings.model, max_tiles=settings.max_tiles, max_image_tokens=settings.max_image_tokens,
                        max_frame_tokens=settings.max_frame_tokens)
    job = open_job(plan, source, device)
    videos = start_video_decoders(plan, job, source.inputs)  # they start while the model loads
    try:
        return run_loaded(settings, todo, outputs, plan, job, source, videos)
    finally:
        if videos is not None:
            videos.close()


def run_loaded(settings: Settings, todo: list[InputShard], outputs: ShardOutputs, plan: Any, job: Any,
               source: Any, videos: Any) -> int:
    """`run_shards` once the job is open: the model loaded (the video decoders, where any, start
    meanwhile), the graphs enabled, the shards captioned; the exit status."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.app.command import STARTED, stop_on_interrupt, write_stats_json
    from encoder_graphs.app.job import sized_job
    from encoder_graphs.app.loading import load_model
    from encoder_graphs.app.runstats import progress_bar
    from encoder_graphs.report import format_graph_stats, format_run_stats

    model = load_model(source, job.device)
    loaded = time.perf_counter()
    job = sized_job(job, plan, model, videos)
    handle = enable_cuda_graphs(model, job.options)
    setup_s = time.perf_counter() - loaded
    in_flight = InFlight()
    captioner = SampleCaptioner(model, source.inputs, job.config, job.limits, model_name=job.model_name,
                                run_settings=plan.identity, in_flight=in_flight, videos=videos)
    # Samples by the count the job was sized for (the first shards' counts standing for the rest).
    quiet = settings.quiet or os.environ.get("WORLD_SIZE", "1") != "1"
    progress = None if quiet else progress_bar(plan.todo_by_kind().total())
    outputs.progress = progress.update if progress is not None else None
    try:
        with stop_on_interrupt() as stop:
            stats = captioner.run(shard_stream(todo, outputs, settings, in_flight), outputs, stop)
    finally:
        if progress is not None:
            progress.close()
        graph_stats = handle.stats()
        handle.disable()
        outputs.close()
    stats.files = stats.succeeded + stats.failed
    summary = {**stats.as_dict(), "batch_size": job.config.batch_size, "video_batch_size": job.config.video_batch_size,
               "video_decoder": stats.video_decoder(job.limits.video_hwaccel),
               "load_s": loaded - STARTED, "setup_s": setup_s, "longest_sequence": job.longest}
    if summary["first_records_s"] is not None:
        summary["first_caption_after_load_s"] = setup_s + summary["first_records_s"]
    if job.device.type == "cuda":
        import torch

        summary["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(job.device)
    print(format_run_stats(summary))
    print(format_graph_stats(graph_stats))
    shards = {"sealed": outputs.sealed, "failed": outputs.failed, "duplicate_keys": dict(outputs.duplicates),
              "left_partial": sorted({s.name for s in todo} - set(outputs.sealed) - set(outputs.failed))}
    print(f"encoder-graphs: {len(outputs.sealed)} of {len(todo)} shards complete"
          + (f"; failed: {', '.join(outputs.failed)}" if outputs.failed else "")
          + (f"; repeated keys skipped: {sum(outputs.duplicates.values())}" if outputs.duplicates else ""))
    write_stats_json(settings, {"pipeline": summary, "shards": shards, **graph_stats.to_json(), "device": str(job.device)})
    if summary["interrupted"]:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILURES if outputs.failed or stats.failed else EXIT_OK


def stand_in_plan(settings: Settings, todo: list[InputShard], config: Any, identity: dict) -> Any:
    """The plan that sizes the job: its samples counted by kind (in the first shards; videos
    where the first shard's first samples hold any), no list of files."""
    from encoder_graphs.app.plan import Plan

    first = samples(todo[0], settings.image_column, settings.key_column)
    try:
        kinds = [sample.kind for sample in islice(first, 64)]
    except unreadable():  # the run reads it again, and reports it
        kinds = ["image"]
    finally:
        first.close()
    counted = todo[:COUNTED_SHARDS]  # a thousand shards' headers would take minutes: the rest alike
    count = round(sum(table_rows(shard) for shard in counted) * len(todo) / len(counted))
    videos = min(count, 64) if "video" in kinds else 0  # enough to size the videos' batch
    return Plan(settings, [], [], [], config, sidecars=None, results=None, identity=identity,
                counted=Counter(image=count - videos, video=videos),
                videos_expected=round(count * kinds.count("video") / max(1, len(kinds))))


def table_rows(shard: InputShard) -> int:
    """A shard's samples: a table's rows, a plain tar's by its headers (seeking over the data), a
    compressed tar's guessed (`TABLE_ROWS_GUESS`)."""
    try:
        if shard.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(shard.path).metadata.num_rows
        if shard.format == "arrow":  # memory-mapped: the count reads no column data
            import pyarrow as pa

            return sum(batch.num_rows for batch in pa.ipc.open_stream(pa.memory_map(str(shard.path))))
        with open_regular(shard.path) as handle, tarfile.open(fileobj=handle, mode="r:") as tar:
            keys = set()
            for member in tar:
                tar.members = []  # headers only, none kept
                if media_of(member.name):
                    keys.add(sample_key(member.name)[0])
            return len(keys)
    except unreadable():
        return TABLE_ROWS_GUESS

"""The plan of a caption run, settled before any model loads: the files, the settings checked
against them, every output checked (writable, our own, no sidecar clashes), the results file
opened (parts a killed torchrun job left merged) and tidied (temporaries gone, sidecars of
captions already written backfilled), the files still to do."""

import errno
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.distributed import Job
from encoder_graphs.app.errors import OutputError, UsageError, printable
from encoder_graphs.app.metadata import CSV_FILE, metadata_folders, metadata_path
from encoder_graphs.app.output_checks import check_targets, foreign_link, not_our_stats, special_file
from encoder_graphs.app.outputs import METADATA_FILE, SidecarPolicy, unwritable
from encoder_graphs.app.prompts import read_prompts
from encoder_graphs.app.settings import Settings, run_identity

if TYPE_CHECKING:
    from encoder_graphs.app.results import ResultsFile
    from encoder_graphs.app.walk import MediaFile


@dataclass(frozen=True)
class Plan:
    """What a run will do, settled before any model loads (frozen: what the model decides is the
    job's, `app/job.py`)."""

    settings: Settings
    roots: list[Path]
    files: "list[MediaFile]"
    todo: "list[MediaFile]"
    config: CaptionConfig
    sidecars: SidecarPolicy
    results: "ResultsFile"
    job: Job = field(default_factory=Job)
    # Entries of the folders not taken, by reason (`walk.discover`'s `skipped`): said in the report.
    skipped: Counter = field(default_factory=Counter)
    identity: dict = field(default_factory=dict)  # the settings each caption record carries (`run_identity`)
    temporary_out: bool = False  # `--samples` without `--out`: a demo's records, shown then removed
    later: int = 0  # files to do beyond `--limit`, left to a later run
    # Files to do by kind, where there is no list of them: a dataset run's or a Ray actor's plan,
    # which sizes the job (a million stand-in files would be a million objects).
    counted: Counter | None = None
    # A dataset's videos to do as its first samples' share of videos foretells them (`counted`
    # holds at most a batch of videos: the photos' batches are sized by the rest); None: counted.
    videos_expected: int | None = None

    def todo_by_kind(self) -> Counter:
        """The files still to do by kind ("image", "video")."""
        return +Counter(self.counted) if self.counted is not None else Counter(f.kind for f in self.todo)

    def videos_to_do(self) -> int:
        """The videos still to do, or a dataset's estimate of them (`videos_expected`)."""
        return self.videos_expected if self.videos_expected is not None else self.todo_by_kind()["video"]


def make_plan(settings: Settings, job: Job) -> Plan:
    """The files, the settings and the outputs: every usage error that needs no model."""
    from encoder_graphs.app.media import SAMPLES_DIR
    from encoder_graphs.app.walk import discover

    # abspath, as discover's file paths: `..` resolved, symlinks kept, so the two compare as text.
    roots = [Path(os.path.abspath(p)) for p in settings.paths] + ([SAMPLES_DIR] if settings.samples else [])
    for flag, given in (("--image-column", settings.image_column), ("--key-column", settings.key_column),
                        ("--out-format", settings.out_format != "jsonl"),
                        ("--webdataset-copy", settings.webdataset_copy)):
        if given:
            raise UsageError(f"{flag} applies to dataset shards (.tar, .parquet, a saved dataset), not files and folders")
    listed, missing = listed_files(settings.manifest)
    if not roots and settings.manifest is None:
        raise UsageError("give at least one PATH (or --samples, or --manifest)")
    try:
        skipped: Counter = Counter()
        files = discover(roots + listed, include_hidden=settings.include_hidden,
                         follow_links=not settings.no_follow_links, skipped=skipped)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    files = sorted(files + missing, key=lambda f: str(f.path))
    if settings.manifest is not None:  # its folder names the listed files (relative_path, metadata)
        roots.append(settings.manifest.resolve().parent)
    if not files:
        raise UsageError(f"no images or videos found under {' '.join(map(str, roots))}")
    prompt, named = read_prompts(settings.prompt, settings.prompt_file)
    config = caption_config(settings, prompt, named)
    try:
        sidecars = SidecarPolicy(settings.sidecar, settings.sidecar_ext or SidecarPolicy.ext, settings.overwrite)
    except ValueError as error:
        raise UsageError(str(error)) from error
    check_attention_backend(settings.attn_backend)
    temporary_out = settings.out is None and settings.samples and not settings.paths  # a demo
    if settings.out is None:
        settings = replace(settings, out=default_out(temporary_out, job, make=not settings.dry_run))
    settings, files = this_shard(settings, roots, files, say=job.rank == 0)
    check_outputs(settings, roots, files, sidecars)
    results = open_results(settings, job)
    identity = run_identity(settings, [list(pair) for pair in named] if named else config.prompt)
    if job.rank == 0 and not settings.dry_run:
        tidy_outputs(settings, roots, files, sidecars, results, config.text, identity)
    if job.distributed and job.rank == 0:  # the other ranks read --out once rank 0 is done writing it
        job.store.add("opened", 1)
    if not settings.redo and (others := results.made_otherwise([f.path for f in files], identity)):
        raise UsageError(settings_clash(settings.out, identity, others))
    todo = [f for f in files if settings.redo or not (results.is_done(f.path) or all(map(sidecars.skips, f.names)))]
    later = len(todo) - len(todo[: settings.limit])  # beyond --limit: left to the next run
    todo = todo[: settings.limit]  # the same list on every rank
    if job.distributed:  # every rank must hold the same list before any starts writing parts
        job.barrier("planned")
    return Plan(settings, roots, files, todo, config, sidecars, results, job, skipped, identity, temporary_out, later)


def caption_config(settings: Settings, prompt: str | None, named: tuple) -> CaptionConfig:
    """The prompt and generation settings of the run (a usage error where they do not hold)."""
    try:
        return CaptionConfig(
            prompt=named[0][1] if named else prompt,
            named=named,
            max_new_tokens=settings.max_new_tokens,
            prefix=settings.prefix,
            suffix=settings.suffix,
            temperature=settings.temperature,
            top_p=settings.top_p or CaptionConfig.top_p,
            seed=settings.seed,
        )
    except ValueError as error:
        raise UsageError(str(error)) from error


def this_shard(
    settings: Settings, roots: list[Path], files: "list[MediaFile]", say: bool = True
) -> tuple[Settings, "list[MediaFile]"]:
    """The settings and files of this process's shard (`app/shards.py`): of `--num-shards`, or of
    the Slurm job array it runs in; its own --out. Unsharded: as given."""
    from encoder_graphs.app.outputs import relative_path
    from encoder_graphs.app.shards import shard_of, shard_out, slurm_shard

    shard = (settings.num_shards, settings.shard_index) if settings.num_shards is not None else slurm_shard()
    if shard is None or shard[0] == 1:
        return settings, files
    num, index = shard
    if settings.hf_metadata:
        raise UsageError(f"--hf-metadata with shards ({num}): each shard would rewrite the folders' metadata with its "
                         "own rows; caption the shards with --sidecar, then run once more with --sidecar "
                         "--hf-metadata and no shards (every file is done by its sidecar) to write it")
    mine = [f for f in files if shard_of(relative_path(f.path, roots), num) == index]
    out = shard_out(settings.out, num, index)
    if say:
        print(f"encoder-graphs: shard {index} of 0-{num - 1}: {len(mine)} of the {len(files)} files; --out "
              f"{printable(out)}", file=sys.stderr)
    return replace(settings, out=out, num_shards=num, shard_index=index), mine


def listed_files(manifest: Path | None) -> "tuple[list[Path], list[MediaFile]]":
    """The files `manifest` lists that exist (to discover), and an entry for each that does not
    (its error record says so)."""
    if manifest is None:
        return [], []
    from encoder_graphs.app.manifest import read_manifest
    from encoder_graphs.app.walk import MediaFile, media_kind

    listed, missing = [], []
    for path in read_manifest(manifest):
        if os.path.lexists(path):
            listed.append(path)
        else:
            reason = f"listed in --manifest {printable(manifest)}, and not found"
            missing.append(MediaFile(Path(os.path.abspath(path)), media_kind(path) or "other", reason, "not_found"))
    return listed, missing


def settings_clash(out: Path, identity: dict, others: dict[str, int]) -> str:
    """Why a run may not write into `out`: it holds captions of these files made otherwise."""
    count = sum(others.values())
    theirs = json.loads(max(others, key=others.get))

    def shown(value: object) -> str:
        return "its default" if value is None else repr(value)

    changed = [f"--{name.replace('_', '-')} {shown(theirs.get(name))} (now {shown(identity[name])})"
               for name in identity if theirs.get(name) != identity[name]]
    return (f"--out {printable(out)} holds captions of {count} of these files made with other settings: "
            f"{'; '.join(changed) or 'settings of another version'}; give another --out, or add --redo to caption "
            "every file again (the latest record of a file wins)")


def default_out(demo: bool, job: Job, make: bool = True) -> Path:
    """`--out` not given: captions.jsonl here; for `--samples` alone (`demo`), in a new temporary
    folder (its captions printed and the folder removed at the end: `summary.show_samples`), so
    that a demo neither drops a file into the working folder nor finds it done next time; not
    `make`: a dry run's, named but not made."""
    if not demo:
        return Path("captions.jsonl")
    if job.distributed:  # each rank would make a folder of its own
        raise UsageError("--samples under torchrun: give --out")
    if not make:
        return Path(tempfile.gettempdir()) / "encoder-graphs-samples-(new)" / "captions.jsonl"
    return Path(tempfile.mkdtemp(prefix="encoder-graphs-samples-")) / "captions.jsonl"


def check_attention_backend(name: str | None) -> None:
    if name is not None:
        from encoder_graphs.attention import get_attention_backend

        try:
            get_attention_backend(name)
        except (ValueError, ImportError) as error:
            raise UsageError(f"--attn-backend {name}: {error}") from error


def open_results(settings: Settings, job: Job) -> "ResultsFile":
    """`--out` with what it holds, once the part files a killed torchrun job left are merged into
    it (by rank 0, or the only process, which holds the lock; the other ranks then read it)."""
    from encoder_graphs.app.distributed import part_paths
    from encoder_graphs.app.results import NotResultsFile, ResultsFile, ResultsLocked

    if job.rank != 0:
        job.wait_for("opened", 1)  # rank 0 has the lock, a cut last line repaired, parts merged, sidecars backfilled
    try:
        # The file the user named (checked), through their symlink: the lock opens no symlink.
        results = ResultsFile(os.path.realpath(settings.out), retry_failed=settings.retry_failed,
                              lock=job.rank == 0 and not settings.dry_run)  # a dry run only reads
    except ResultsLocked as error:
        raise UsageError(str(error)) from error
    except OSError as error:
        raise (OutputError(settings.out, error) if error.errno in FULL else
               UsageError(f"cannot use --out {settings.out}: {error}")) from error
    except NotResultsFile as error:
        raise UsageError(f"cannot use --out {settings.out}: {error}") from error
    if results.lock_note is not None:
        then = "--out is not locked: start no other run on it" if results.lock_unguarded else "--out is locked all the same"
        print(f"encoder-graphs: {printable(results.lock_note)}; {then}", file=sys.stderr)
    if results.repaired_bytes:
        print(f"encoder-graphs: dropped a half-written last line ({results.repaired_bytes} bytes) of "
              f"{printable(settings.out)}", file=sys.stderr)
    others: list[Path] = []
    parts = part_paths(results.path, others=others) if job.rank == 0 else []
    if others and job.distributed:  # a rank would write into it, and the merge take its records
        results.close()
        raise UsageError(f"{printable(others[0])} is named as this job's part files are, and is not this user's "
                         "regular file: remove it, or give another --out")
    if others:
        print(f"encoder-graphs: left alone {len(others)} files named as part files beside {printable(settings.out)} "
              f"that are not this user's regular files (e.g. {printable(others[0])}): their records are not merged",
              file=sys.stderr)
    if parts and settings.dry_run:
        print(f"encoder-graphs: {len(parts)} part files an earlier torchrun job left beside {printable(settings.out)} "
              "would be merged first (their files are counted as to do here)", file=sys.stderr)
    elif parts:
        try:
            merged = results.merge(parts)
        except (ResultsLocked, NotResultsFile, OSError) as error:
            results.close()
            if isinstance(error, OSError) and error.errno in FULL:  # exit 3, as for any output that cannot be written
                raise OutputError(error.filename or settings.out, error) from error
            raise UsageError(f"cannot merge the part files beside --out {printable(settings.out)}: {error}") from error
        print(f"encoder-graphs: merged {merged} records from the {len(parts)} part files an earlier torchrun job "
              f"left beside {printable(settings.out)}", file=sys.stderr)
    return results


# A disk or quota that is full, or a file at its size limit: an output that cannot be written (exit 3).
FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

# `--out` names that promise a format the results file is not (it is JSON lines).
OTHER_FORMATS = frozenset({".parquet", ".pq", ".csv", ".tsv", ".arrow", ".feather", ".xlsx"})


def check_outputs(settings: Settings, roots: list[Path], files: "list[MediaFile]", sidecars: SidecarPolicy) -> None:
    """Every path the run will write can be written, and is its own: checked now, not after the
    model loaded (the results file's format: when `open_results` opens it)."""
    if settings.out.suffix.lower() in OTHER_FORMATS:
        raise UsageError(f"--out {settings.out}: the captions are written as JSON lines, not "
                         f"{settings.out.suffix[1:]}; name it .jsonl")
    named = [("--out", settings.out)] + ([("--stats-json", settings.stats_json)] if settings.stats_json is not None else [])
    problems = [(flag, path, foreign_link(path) or special_file(path) or unwritable(path)) for flag, path in named]
    if sidecars.enabled:
        folders = {name.parent for f in files for name in f.names}
        problems += [("--sidecar", folder, unwritable(folder, folder=True)) for folder in sorted(folders)]
    if settings.hf_metadata:
        if not any(root.is_dir() for root in roots):
            raise UsageError("--hf-metadata writes a metadata.jsonl into each folder named; only files were "
                             "named: name their folder instead")
        problems += [("--hf-metadata", root, unwritable(root, folder=True)) for root in roots if root.is_dir()]
    for flag, path, problem in problems:
        if problem is not None:
            raise UsageError(f"cannot use {flag} {path}: {problem}")
    if sidecars.enabled and (clashes := sidecars.collisions([name for f in files for name in f.names])):
        first, second = clashes[0]
        others = len(clashes) - 1
        more = f" (and {others} more pair{'s' * (others > 1)})" if others else ""
        raise UsageError(
            f"--sidecar: {first.name} and {second.name}{more} would share {sidecars.path(first)}; "
            "rename one or caption them apart"
        )
    metadata = [("--hf-metadata", metadata_path(folder)) for folder in metadata_folders(roots) if settings.hf_metadata]
    for _, path in metadata:
        others = [name for name in (METADATA_FILE, CSV_FILE, "metadata.parquet")
                  if name != path.name and os.path.lexists(path.parent / name)]
        if others:
            raise UsageError(f"--hf-metadata: {printable(path.parent)} holds {' and '.join(others)} where this run "
                             f"writes {path.name}, and the loader refuses two metadata formats in one folder; keep one")
    for flag, path in metadata:
        if (problem := special_file(path)) is not None:
            raise UsageError(f"cannot use {flag} {path}: {problem}")
    check_targets(metadata + named, roots, [n for f in files if f.kind in ("image", "video") for n in f.names], sidecars)
    if settings.stats_json is not None and (problem := not_our_stats(settings.stats_json)) is not None:
        raise UsageError(f"cannot use --stats-json {settings.stats_json}: {problem}")


def tidy_outputs(
    settings: Settings, roots: list[Path], files: "list[MediaFile]", sidecars: SidecarPolicy,
    results: "ResultsFile", text: Callable[[str], str], identity: dict,
) -> None:
    """Before the plan (rank 0): the records of a moved dataset's files carried to their new
    paths (`carry_moved`), the temporaries killed runs left beside this run's outputs
    removed, and the sidecars of files the results caption already written, each caption with
    this run's prefix and suffix (`text`; one that cannot be written is its file's error record)."""
    from encoder_graphs.app.outputs import carry_moved, remove_stale_temporaries

    if not settings.redo and (carried := carry_moved(results, [f.path for f in files], roots, identity)):
        print(f"encoder-graphs: {carried} files have records in {printable(settings.out)} under another folder, "
              "with the same names and contents (a moved dataset): their records were copied to their paths "
              "here and they are not captioned again", file=sys.stderr)
    media = [name for f in files if f.kind in ("image", "video") for name in f.names]
    targets = [sidecars.path(path) for path in media] if sidecars.enabled else []
    targets += [metadata_path(folder) for folder in metadata_folders(roots)] if settings.hf_metadata else []
    targets += [Path(os.path.realpath(settings.stats_json))] if settings.stats_json is not None else []
    if removed := remove_stale_temporaries(targets):
        print(f"encoder-graphs: removed {removed} temporary files a killed run left", file=sys.stderr)
    if not sidecars.enabled:
        return
    written, errors = sidecars.backfill(results.path, media, text)
    results.append(errors)
    if written:
        print(f"encoder-graphs: wrote {written} sidecars from captions already in {printable(settings.out)}", file=sys.stderr)
    report_sidecar_errors([error["sidecar_error"] for error in errors])


def report_sidecar_errors(errors: list[str]) -> None:
    if errors:
        print(f"encoder-graphs: {len(errors)} sidecar{'s' * (len(errors) != 1)} could not be written "
              f"({printable(errors[0])}); their captions stand in --out, and a rerun with --sidecar writes them "
              "once the cause is fixed", file=sys.stderr)


def describe(plan: Plan, model: str) -> str:
    """What `plan` would do (`--dry-run`): the files found, done and to do, the settings its
    captions would carry, the outputs; `model` says which model and family."""
    settings = plan.settings
    kinds = Counter(f.kind for f in plan.files)
    to_do = Counter(f.kind for f in plan.todo)
    done = sum(plan.results.is_done(f.path) for f in plan.files)
    outputs = [f"--out {printable(settings.out)}"]
    outputs += [f"sidecars {plan.sidecars.ext} beside each file"] if plan.sidecars.enabled else []
    outputs += [f"{printable(metadata_path(f))}" for f in metadata_folders(plan.roots)] if settings.hf_metadata else []
    lines = [
        "dry run: no model loaded, nothing written",
        f"files: {len(plan.files)} found (" + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) + f"); "
        f"{done} in --out already; to caption: {len(plan.todo)}"
        + (" (" + ", ".join(f"{kind} {n}" for kind, n in sorted(to_do.items())) + ")" if plan.todo else "")
        + (f"; {plan.later} more left to later runs by --limit {settings.limit}" if plan.later else ""),
        f"model: {model}",
        "settings: " + ", ".join(f"{name} {'(default)' if value is None else repr(value)}"
                                 for name, value in plan.identity.items() if name != "model"),
        "outputs: " + "; ".join(outputs),
    ]
    from encoder_graphs.app.nvdec import dry_run_line

    decoder = dry_run_line(settings.video_decoder, settings.device, to_do["video"], plan.job.world_size)
    lines += [decoder] if decoder else []
    if plan.skipped:
        from encoder_graphs.report import format_not_read

        lines.append(format_not_read(plan.skipped))
    return "\n".join(lines)

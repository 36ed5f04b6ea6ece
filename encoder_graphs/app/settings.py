"""The caption command's request as one frozen, checked object: built once from the parsed
arguments at the start (`Settings.from_arguments`) and read by every step of the command, so
argparse stays in `cli.py`. Fields carry the flags' names (`max_new_tokens` is
`--max-new-tokens`), so an error can name its flag; what needs the files or the model is checked
where those are known (`plan.make_plan`, `model_checks.check_length`)."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from encoder_graphs.app.config import DEFAULT_FRAME_TOKENS, DEFAULT_IMAGE_TOKENS
from encoder_graphs.app.errors import UsageError


@dataclass(frozen=True)
class Settings:
    paths: tuple[str, ...] = ()
    samples: bool = False
    manifest: Path | None = None  # a list of the files to caption (`app/manifest.py`)
    # Dataset shards (`app/datasets.py`): their media and key columns, the output shards' format.
    image_column: str | None = None
    key_column: str | None = None
    out_format: str = "jsonl"
    webdataset_copy: bool = False  # with tar shards, each also copied with its captions added
    # The model and what it sees.
    model: str | None = None  # a checkpoint directory or a preset; None: the embedded tiny default
    device: str = "auto"
    max_image_tokens: int | None = DEFAULT_IMAGE_TOKENS  # None: the checkpoint's own limit
    max_tiles: int | None = None  # None: the checkpoint's
    max_frame_tokens: int | None = DEFAULT_FRAME_TOKENS  # None: the checkpoint's own limit
    max_frames: int = 16
    video_fps: float | None = None  # None: max_frames evenly over the clip
    video_sampling: str = "exact"  # or "keyframes" (`LoadLimits.video_sampling`)
    video_timeout: float = 120.0
    video_decoder: str = "auto"  # or "cpu", "nvdec" (`nvdec.chosen`; `LoadLimits.video_hwaccel`)
    # The text.
    # None, without --prompt-file: the model's (`CaptionConfig.with_prompt_of`); several: named
    # (NAME=TEXT each, `app/prompts.py`).
    prompt: str | tuple[str, ...] | None = None
    prompt_file: Path | None = None
    prefix: str = ""
    suffix: str = ""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    # The outputs.
    out: Path | None = None  # None until the command settles it (`plan.default_out`)
    sidecar: bool = False
    sidecar_ext: str | None = None
    overwrite: bool = False
    hf_metadata: bool = False
    retry_failed: bool = False
    redo: bool = False
    limit: int | None = None  # at most this many files of the todo list
    dry_run: bool = False
    include_hidden: bool = False
    no_follow_links: bool = False
    stats_json: Path | None = None
    quiet: bool = False
    # Speed.
    batch_size: int | None = None  # None: auto
    max_batch_tokens: int | None = None
    budgets: tuple[int, ...] | None = None
    attn_backend: str | None = None
    no_graphs: bool = False
    compile: bool | None = None  # None: by the job's size (`job.wants_compile`)
    # Across machines (`shards.shard_of`); None: from a Slurm job array where one runs, else one shard.
    num_shards: int | None = None
    shard_index: int | None = None

    def __post_init__(self) -> None:
        if (problem := ignored_flag(self)) is not None:
            raise UsageError(problem)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "Settings":
        values = {name: value for name, value in vars(args).items() if name != "command"}
        values["paths"] = tuple(values["paths"])
        if values["prompt"] is not None:  # `--prompt` repeatable: one value stays the plain string it was
            values["prompt"] = values["prompt"][0] if len(values["prompt"]) == 1 else tuple(values["prompt"])
        if values["budgets"] is not None:
            values["budgets"] = tuple(values["budgets"])
        return cls(**values)


# The settings that make a caption what it is, each record's "settings": a rerun on the same
# --out with others is refused (or, with --redo, captions again). Prefix and suffix only frame
# the text, and speed settings change no token: neither is here.
IDENTITY = ("model", "prompt", "max_new_tokens", "temperature", "top_p", "seed", "max_image_tokens", "max_tiles",
            "max_frame_tokens", "max_frames", "video_fps", "video_sampling")


def run_identity(settings: Settings, prompt: str | list[list[str]] | None) -> dict:
    """This run's settings of `IDENTITY` (`prompt`: the prompt text, from --prompt or --prompt-file,
    or the named prompts' [name, text] pairs in order, as the first names the record's `caption`;
    None: the model's own)."""
    values = {name: getattr(settings, name) for name in IDENTITY if name not in ("model", "prompt")}
    return {"model": settings.model or "default", "prompt": prompt, **values}


def ignored_flag(settings: Settings) -> str | None:
    """A flag that the others given would make ignored (a usage error, not a silent no-op)."""
    if not settings.sidecar:
        for flag, given in (("--overwrite", settings.overwrite), ("--sidecar-ext", settings.sidecar_ext is not None)):
            if given:
                return f"{flag} applies to sidecars: add --sidecar"
    elif settings.redo and not settings.overwrite:
        return "--redo with --sidecar keeps the sidecars as they are: add --overwrite so they follow the new captions"
    if settings.temperature == 0:
        for flag, given in (("--top-p", settings.top_p is not None), ("--seed", settings.seed is not None)):
            if given:
                return f"{flag} applies to sampling: add --temperature above 0 (0 is greedy)"
    if (settings.shard_index is None) != (settings.num_shards is None):
        return "--num-shards and --shard-index go together (or neither, in a Slurm job array: its task's)"
    if settings.num_shards is not None and not 0 <= settings.shard_index < settings.num_shards:
        return f"--shard-index {settings.shard_index}: give 0 to {settings.num_shards - 1} for --num-shards {settings.num_shards}"
    if settings.samples:  # the samples live in the installed package: nothing is written beside them
        for flag, given in (("--sidecar", settings.sidecar), ("--hf-metadata", settings.hf_metadata)):
            if given:
                return f"{flag} with --samples would write into the installed package; copy the samples elsewhere"
    return None

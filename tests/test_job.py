"""The caption run's job (`app/job.py`): each of its values is set in one place, and what the run
reads is the job's. Read from the code itself: every construction of a `CaptionJob` and every
`replace` of one, across the package, sets each field in the function `JOB_SOURCES` names and
nowhere else; the batch fields of its `CaptionConfig` are set by `batched_config` alone; the
run's steps after `open_job` read no flag the job resolves."""

import ast
import dataclasses
from pathlib import Path

import pytest

from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.job import JOB_SOURCES, CaptionJob

PACKAGE = Path(__file__).resolve().parents[1] / "encoder_graphs"
# The values the job resolves from flags, which no step after `open_job` may read from the settings again.
RESOLVED_FLAGS = {"max_frames", "video_fps", "video_sampling", "video_timeout", "video_decoder", "batch_size", "max_batch_tokens",
                  "prompt", "prompt_file", "compile", "budgets", "attn_backend", "no_graphs", "max_new_tokens",
                  "temperature", "top_p", "seed", "prefix", "suffix", "device"}
BATCH_FIELDS = {"batch_size", "max_batch_tokens", "video_batch_size", "video_max_batch_tokens", "prefetch_batches"}


def called(call: ast.Call) -> str | None:
    """The name a call calls: `f(...)` and `anything.f(...)` alike."""
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def calls_setting(name: str) -> dict[str, list[str]]:
    """Keyword -> the functions (file:function) that pass it to `name(...)` or to any
    `replace(...)` (whatever it replaces, however it is named), across the package."""
    found: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for call in ast.walk(function):
                if isinstance(call, ast.Call) and called(call) in (name, "replace"):
                    assert not (called(call) == name and call.args), f"{path.name}:{function.name}: {name} by keyword"
                    for keyword in call.keywords:
                        found.setdefault(keyword.arg, []).append(f"{path.name}:{function.name}")
    return found


def test_every_field_of_the_job_is_set_in_its_one_place():
    fields = {field.name for field in dataclasses.fields(CaptionJob)}
    assert set(JOB_SOURCES) == fields
    set_by = calls_setting("CaptionJob")
    for field in fields:
        where = sorted(set_by.get(field, []))
        # The config's prompt in open_job; its batches in sized_job (by batched_config: the next test).
        expected = ["job.py:open_job", "job.py:sized_job"] if field == "config" else [f"job.py:{JOB_SOURCES[field]}"]
        assert where == expected, (field, where)


def test_the_batches_are_sized_in_one_place():
    set_by = calls_setting("CaptionConfig")
    for field in BATCH_FIELDS:
        assert set_by.get(field) == ["job.py:batched_config"], (field, set_by.get(field))


@pytest.mark.parametrize("module", ["command.py", "pipeline.py"])
def test_the_run_reads_the_jobs_values_not_the_flags(module):
    """After `open_job`, the caption command and the pipeline read what the job resolved."""
    tree = ast.parse((PACKAGE / "app" / module).read_text())
    after = {"caption_files", "start_video_decoders"} if module == "command.py" else None
    read = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef) and (after is None or function.name in after):
            read |= {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)
                     and "settings" in (getattr(node.value, "id", None), getattr(node.value, "attr", None))}
    assert not read & RESOLVED_FLAGS, sorted(read & RESOLVED_FLAGS)


def test_the_job_is_frozen():
    job = CaptionJob(device=None, model_name="default", config=CaptionConfig(), limits=None, longest=1, longest_image=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.longest = 2


def job_for(kinds: dict[str, int], *flags: str, world_size: int = 1):
    """A plan of `kinds` files to do (as the CLI parses `flags`) and its job before sizing: the
    longest sequence 900 tokens (a video's), an image's 300, 32 new tokens."""
    from pathlib import Path

    import torch

    from encoder_graphs.app.cli import build_parser
    from encoder_graphs.app.distributed import Job
    from encoder_graphs.app.media import LoadLimits
    from encoder_graphs.app.plan import Plan
    from encoder_graphs.app.settings import Settings
    from encoder_graphs.app.walk import MediaFile

    settings = Settings.from_arguments(build_parser().parse_args(["caption", "x", *flags]))
    todo = [MediaFile(Path(f"/d/{kind}{i}"), kind) for kind, count in kinds.items() for i in range(count)]
    plan = Plan(settings, [], todo, todo, CaptionConfig(), None, None, Job(world_size=world_size))
    job = CaptionJob(device=torch.device("cpu"), model_name="default", config=CaptionConfig(max_new_tokens=32),
                     limits=LoadLimits(max_frames=settings.max_frames), longest=900, longest_image=300)
    return job, plan


def test_the_job_is_sized_per_kind_of_file():
    """Batches per kind (on a CPU: 8, or fewer where the job has fewer files), each kind's token
    cap a batch of its longest prompts; the decoder's cache the longest sequence; the frames a
    video holds; a torchrun rank loads one batch ahead."""
    from encoder_graphs.app.job import sized_job

    job, plan = job_for({"image": 20, "video": 3})
    sized = sized_job(job, plan, model=None)
    config = sized.config
    assert (config.batch_size, config.video_batch_size) == (8, 3)
    assert (config.max_batch_tokens, config.video_max_batch_tokens) == ((300 - 32) * 8, (900 - 32) * 3)
    assert config.prefetch_batches == CaptionConfig.prefetch_batches
    assert sized.options.decoder_max_cache_len == 900 and sized.options.decoder_max_batch_size == 8
    assert sized.options.max_frames_per_item == 16 and not sized.options.compile and sized.options.enabled
    assert sized.options.lazy and sized.options.encoder_capture_from_call == 2

    job, plan = job_for({"video": 5}, "--max-batch-tokens", "5000", "--batch-size", "2", "--max-frames", "8",
                        "--no-graphs", "--compile", world_size=2)
    sized = sized_job(job, plan, model=None)
    config = sized.config
    assert (config.batch_size, config.video_batch_size) == (1, 2)  # no image rows in the cache
    assert (config.max_batch_tokens, config.video_max_batch_tokens) == (5000, 5000)  # the flag's, both kinds
    assert config.prefetch_batches == 1
    assert sized.options.max_frames_per_item == 8 and sized.options.compile and not sized.options.enabled

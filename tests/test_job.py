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
RESOLVED_FLAGS = {"max_frames", "video_fps", "video_sampling", "video_timeout", "batch_size", "max_batch_tokens",
                  "prompt", "prompt_file", "compile", "budgets", "attn_backend", "no_graphs", "max_new_tokens",
                  "temperature", "top_p", "seed", "prefix", "suffix", "device"}
BATCH_FIELDS = {"batch_size", "max_batch_tokens", "video_batch_size", "video_max_batch_tokens", "prefetch_batches"}


def calls_setting(name: str, replaced_by: str | None = None) -> dict[str, list[str]]:
    """Keyword -> the functions (file:function) that pass it to `name(...)`, or to `replace(x, ...)`
    where x is named `replaced_by` or is an attribute of that name."""
    found: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for call in ast.walk(function):
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                    continue
                target = call.func.id == name
                if call.func.id == "replace" and replaced_by and call.args:
                    first = call.args[0]
                    target = (isinstance(first, ast.Name) and first.id == replaced_by) or \
                        (isinstance(first, ast.Attribute) and first.attr == replaced_by)
                if target:
                    for keyword in call.keywords:
                        found.setdefault(keyword.arg, []).append(f"{path.name}:{function.name}")
    return found


def test_every_field_of_the_job_is_set_in_its_one_place():
    fields = {field.name for field in dataclasses.fields(CaptionJob)}
    assert set(JOB_SOURCES) == fields
    set_by = calls_setting("CaptionJob", replaced_by="job")
    for field in fields:
        where = sorted(set_by.get(field, []))
        # The config's prompt in open_job; its batches in sized_job (by batched_config: the next test).
        expected = ["job.py:open_job", "job.py:sized_job"] if field == "config" else [f"job.py:{JOB_SOURCES[field]}"]
        assert where == expected, (field, where)


def test_the_batches_are_sized_in_one_place():
    set_by = calls_setting("CaptionConfig", replaced_by="config")
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
            read |= {node.attr for node in ast.walk(function)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "settings"}
    assert not read & RESOLVED_FLAGS, sorted(read & RESOLVED_FLAGS)


def test_the_job_is_frozen():
    job = CaptionJob(device=None, model_name="default", config=CaptionConfig(), limits=None, longest=1, longest_image=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.longest = 2

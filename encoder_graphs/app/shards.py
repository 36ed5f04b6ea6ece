"""One process's share of a dataset across machines (`--num-shards`, `--shard-index`, or a Slurm
job array): files go to shards by a hash of their paths within the folders given, so every
machine, wherever the dataset is mounted, computes the same disjoint, complete split with no
scheduler, and a file stays in its shard when others are added. Each shard writes its own --out."""

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from encoder_graphs.app.errors import UsageError
from encoder_graphs.app.names import as_text


def shard_of(relative: str, num_shards: int) -> int:
    """The shard of the file at `relative` (its path within its root)."""
    digest = hashlib.blake2b(as_text(relative).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def slurm_shard(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(num_shards, index) of this Slurm job array's task (its IDs may start above 0 and step), or
    None outside one."""
    try:
        count = int(env["SLURM_ARRAY_TASK_COUNT"])
        task, first = int(env["SLURM_ARRAY_TASK_ID"]), int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1"))
    except (KeyError, ValueError):
        return None
    index = (task - first) // max(1, step)
    if count < 2:
        return None
    if not 0 <= index < count:
        raise UsageError(f"the Slurm job array's task {task} is not among its {count} tasks from {first} "
                         f"(step {step}): give --num-shards and --shard-index")
    return count, index


def shard_out(out: Path, num_shards: int, index: int) -> Path:
    """A shard's --out: `{shard}` in it replaced by the index, else `<stem>.shard-I-of-N<suffix>`."""
    width = len(str(num_shards - 1))
    if "{shard}" in str(out):
        return Path(str(out).replace("{shard}", f"{index:0{width}d}"))
    return out.with_name(f"{out.stem}.shard-{index:0{width}d}-of-{num_shards}{out.suffix}")


def in_shard(relatives: Sequence[str], num_shards: int, index: int) -> list[bool]:
    return [shard_of(relative, num_shards) == index for relative in relatives]

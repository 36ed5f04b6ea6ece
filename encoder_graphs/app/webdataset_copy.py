"""`--webdataset-copy`: beside each output shard, a copy of its input tar with the captions added,
so a WebDataset pipeline reads the images and their new captions from one shard.

Each sample's members are copied as they are (regular files; links and folder entries are not
sample data and are left out), in their order, streamed (a member is never held whole), and
after a sample's last member come its own: `<key>.caption.txt` (the caption; with named prompts
`<key>.caption.<NAME>.txt` each) where it has one, and `<key>.caption.json` (its whole record,
an error's too). A member of the input named as one of these (a copy given back as input) is
replaced, not repeated; every other member is kept. Each is written as a plain file (a sparse
member's data expanded: readers of the copy need no GNU extensions). The copy is written to a
temporary name and renamed when whole, before the output shard that marks the shard complete."""

import io
import json
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from encoder_graphs.app.datasets import InputShard, sample_key
from encoder_graphs.app.media import open_regular

OURS = "caption"  # our members' extensions begin so: `caption.txt`, `caption.<NAME>.txt`, `caption.json`


def copy_path(folder: Path, shard: InputShard) -> Path:
    return folder / f"{shard.name}.tar"


def copy_writer(shard: InputShard, records: dict[str, dict], names: tuple[str, ...] = ()) -> Callable[[BinaryIO], None]:
    """What writes the copy of `shard` (a tar) with `records` (by key) added, to a file; `names`:
    the run's named prompts."""
    ours = {f"{OURS}.txt", f"{OURS}.json", *(f"{OURS}.{name}.txt" for name in names)}

    def write(sink: BinaryIO) -> None:
        added: set[str] = set()
        with open_regular(shard.path) as handle, tarfile.open(fileobj=handle, mode="r|*") as source, \
                tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as target:
            key = None
            for member in source:
                source.members, target.members = [], []  # a stream keeps every header otherwise
                this, extension = sample_key(member.name)
                if this is not None and this != key:
                    _add_ours(target, key, records, added)
                    key = this
                if member.isfile() and extension not in ours:
                    target.addfile(plain(member), source.extractfile(member))
            _add_ours(target, key, records, added)

    return write


def plain(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """A regular file's header of `member`'s name, size, time and mode (a sparse member as the data it holds)."""
    info = tarfile.TarInfo(member.name)
    info.size, info.mtime, info.mode = member.size, member.mtime, member.mode & 0o7777
    return info


def _add_ours(target: tarfile.TarFile, key: str | None, records: dict[str, dict], added: set[str]) -> None:
    if key is None or key in added or (record := records.get(key)) is None:
        return
    added.add(key)
    members = []
    if isinstance(record.get("captions"), dict):
        members += [(f"{OURS}.{name}.txt", text) for name, text in record["captions"].items() if text is not None]
    elif record.get("caption") is not None:
        members.append((f"{OURS}.txt", record["caption"]))
    members.append((f"{OURS}.json", json.dumps(record, ensure_ascii=False, default=str)))
    for extension, text in members:
        data = text.encode("utf-8")
        info = tarfile.TarInfo(f"{key}.{extension}")
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        target.addfile(info, io.BytesIO(data))

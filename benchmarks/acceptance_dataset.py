"""The dataset tool's acceptance run (issue 41), on CPU with the embedded tiny model: a folder of
1,000 mixed files in a train/test layout whose splits hold the user's metadata.csv (with their own
columns), captioned with --hf-metadata while killed (SIGKILL) 5 times, then run to the end, then
rerun with another prompt (refused, naming the flag) and with --redo. Checks: every file is
accounted for (a record, or counted as not read), the records' counts match the report's, and
`datasets` loads every split with a `text` column and the user's columns intact.
    python3 benchmarks/acceptance_dataset.py [FOLDER] [--kills 5] [--seed 0]
"""

import argparse
import csv
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def make_folder(root: Path, rng: random.Random) -> dict:
    """900 images (PNG, JPEG, WebP), 20 clips, 30 damaged media files, 30 other files and 20 hidden
    ones under train/ and test/; each split's metadata.csv lists its good images with a score and tags."""
    counts = {"image": 0, "video": 0, "bad": 0, "other": 0, "hidden": 0}
    rows: dict[str, list[dict]] = {"train": [], "test": []}
    for index in range(900):
        split = "train" if index % 5 else "test"
        folder = root / split / f"group{index % 7}"
        folder.mkdir(parents=True, exist_ok=True)
        ext = ("png", "jpg", "webp")[index % 3]
        size = (rng.randint(24, 160), rng.randint(24, 160))
        pixels = np.random.default_rng(index).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{index:04d}.{ext}")
        rows[split].append({"file_name": f"group{index % 7}/img{index:04d}.{ext}", "score": round(rng.random(), 3),
                            "tags": rng.choice(["red", "blue", "a, b"])})
        counts["image"] += 1
    import av

    for index in range(20):
        path = root / ("train" if index % 2 else "test") / "clips" / f"clip{index:02d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for frame_index in range(16):
                array = np.full((48, 64, 3), (frame_index * 15, index * 10, 90), dtype=np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
            container.mux(stream.encode())
        counts["video"] += 1
    for index in range(30):
        folder = root / ("train" if index % 2 else "test") / "damaged"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"bad{index:02d}.{('jpg', 'png', 'mp4')[index % 3]}").write_bytes(b"\xff\xd8\xff" * index)
        counts["bad"] += 1
    for index in range(30):
        (root / "train" / f"notes{index:02d}.{('txt', 'json', 'md')[index % 3]}").write_text("not media\n")
        counts["other"] += 1
    for index in range(20):
        (root / "test" / f".hidden{index:02d}.png").write_bytes(b"")
        counts["hidden"] += 1
    for split, split_rows in rows.items():
        with open(root / split / "metadata.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["file_name", "score", "tags"])
            writer.writeheader()
            writer.writerows(split_rows)
    return counts


def caption(folder: Path, out: Path, *extra: str, kill_after: float | None = None) -> tuple[int, str]:
    argv = [sys.executable, "-m", "encoder_graphs", "caption", str(folder), "--out", str(out), "--hf-metadata",
            "--max-new-tokens", "4", "--quiet", *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if kill_after is not None:
        try:
            process.wait(kill_after)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
    output, _ = process.communicate()
    return process.returncode, output


def latest(out: Path, killed: bool = False) -> dict[str, dict]:
    """The last record of each path; after a kill the last line may be cut mid-write (the next run repairs it)."""
    records, text = {}, out.read_text()
    lines = text.splitlines()
    if killed and not text.endswith("\n"):
        lines = lines[:-1]
    for line in lines:
        record = json.loads(line)
        if "sidecar_error" not in record:
            records[record["path"]] = record
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=None)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = args.folder or Path(tempfile.mkdtemp(prefix="acceptance-"))
    root, out = work / "ds", work / "caps.jsonl"
    rng = random.Random(args.seed)
    counts = make_folder(root, rng)
    media = counts["image"] + counts["video"] + counts["bad"]
    print(f"folder {root}: {counts} ({sum(counts.values())} files)", flush=True)
    started = time.perf_counter()
    for kill in range(args.kills):
        status, _ = caption(root, out, kill_after=rng.uniform(5, 7))  # after the load (about 4 s here)
        have = len(latest(out, killed=True)) if out.exists() else 0
        print(f"kill {kill + 1}: status {status}, {have} files recorded", flush=True)
    status, report = caption(root, out)
    print(f"to the end: status {status} in {time.perf_counter() - started:.0f} s\n{report}", flush=True)
    records = latest(out)
    captioned = sum("caption" in r for r in records.values())
    failed = sum("error" in r for r in records.values())
    assert status == 1 and len(records) == media, (status, len(records), media)  # 1: the damaged files failed
    assert failed == counts["bad"] and captioned == counts["image"] + counts["video"], (captioned, failed)
    assert f"not read under the folders: hidden {counts['hidden']}" in report, report
    lines = out.read_text().splitlines()
    assert len(lines) == len({(json.loads(line)["path"], line) for line in lines}), "a record written twice"

    status, refused = caption(root, out, "--prompt", "Another prompt.")
    assert status == 2 and "--prompt" in refused and "--redo" in refused, refused
    print(f"another prompt without --redo: status {status}: {refused.strip().splitlines()[-1]}", flush=True)
    status, report = caption(root, out, "--prompt", "Another prompt.", "--redo")
    records = latest(out)
    assert status == 1 and all(r.get("prompt", "Another prompt.") == "Another prompt." for r in records.values())
    assert f"captioned {captioned}, failed {failed}" in report, report
    print(f"--redo: status {status}; every caption now has the new prompt", flush=True)

    from datasets import load_dataset

    dataset = load_dataset("imagefolder", data_dir=str(root))
    for split, expected in (("train", 720), ("test", 180)):
        part = dataset[split]
        assert {"text", "score", "tags"} <= set(part.column_names), part.column_names
        assert len(part) == expected and all(part["text"]) and None not in part["score"], (split, len(part))
        print(f"datasets: {split} {len(part)} rows, columns {part.column_names}", flush=True)
    print(f"passed in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

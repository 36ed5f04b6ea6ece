"""The caption command as a dataset tool, end to end on the embedded tiny model (CPU): sidecars with
prefix and suffix, skip and overwrite, metadata.jsonl, prompt templates, record fields, retry after
a fix, a second run on the same --out refused, bad outputs refused before any model loads,
symlinked folders, Ctrl-C then rerun, argument errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)

import encoder_graphs
from encoder_graphs.app import loading
from encoder_graphs.app.cli import main
from encoder_graphs.app.results import ResultsFile

FAST = ["--max-new-tokens", "3", "--quiet"]


def images(folder: Path, count: int, prefix: str = "img") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        paths.append(folder / f"{prefix}{index:02d}.png")
        Image.new("RGB", (40 + 8 * index, 56), (30 * index, 80, 160)).save(paths[-1])
    return paths


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sidecars_with_prefix_skip_and_overwrite(tmp_path):
    files = images(tmp_path / "data", 3)
    out = tmp_path / "run.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out), "--sidecar", "--prefix", "sks, ", "--suffix", "."]
    assert main(argv + FAST) == 0
    by_path = {record["path"]: record for record in records(out)}
    for file in files:
        record = by_path[str(file)]
        assert record["text"] == f"sks, {record['caption']}."
        assert file.with_suffix(".txt").read_text() == record["text"] + "\n"
        assert record["relative_path"] == file.name and record["model"] == "default"
        assert (record["width"], record["height"]) == Image.open(file).size
        assert record["prompt"] == "Describe this in one sentence." and isinstance(record["truncated"], bool)
    # A new results file: sidecars alone mark files done...
    assert main(argv + FAST + ["--out", str(tmp_path / "second.jsonl")]) == 0
    assert not (tmp_path / "second.jsonl").exists() or records(tmp_path / "second.jsonl") == []
    # ...unless --overwrite.
    files[0].with_suffix(".txt").write_text("old\n")
    assert main(argv + FAST + ["--out", str(tmp_path / "third.jsonl"), "--overwrite", "--sidecar-ext", ".caption"]) == 0
    assert len(records(tmp_path / "third.jsonl")) == 3 and files[0].with_suffix(".caption").exists()


def test_hf_metadata_and_prompt_templates(tmp_path):
    files = images(tmp_path / "data" / "cats", 2, prefix="tabby")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Describe {name} from {folder}, {width}x{height}.\n")
    out = tmp_path / "run.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out), "--hf-metadata", "--prompt-file", str(prompt_file)]
    assert main(argv + FAST) == 0
    by_path = {record["path"]: record for record in records(out)}
    width, height = Image.open(files[1]).size
    assert by_path[str(files[1])]["prompt"] == f"Describe tabby01 from cats, {width}x{height}."
    assert by_path[str(files[1])]["relative_path"] == os.path.join("cats", "tabby01.png")
    rows = records(tmp_path / "data" / "metadata.jsonl")
    assert [row["file_name"] for row in rows] == [os.path.join("cats", f.name) for f in files]
    assert all(row["text"] == by_path[str(f)]["text"] for row, f in zip(rows, files))


def test_hf_metadata_keeps_the_users_columns_and_the_file_it_replaces(tmp_path, capsys):
    """The user's own metadata.jsonl columns survive --hf-metadata (each row gains or replaces
    `text`); a row whose image is gone is dropped and said, and the replaced file is kept as
    metadata.jsonl.bak; `datasets` loads the folder with every column (issue 41, case 1)."""
    files = images(tmp_path / "m1", 2)
    original = (json.dumps({"file_name": files[0].name, "score": 5.5, "tags": "red"}) + "\n"
                + json.dumps({"file_name": files[1].name, "score": 1.0, "tags": "blue", "text": "old"}) + "\n"
                + json.dumps({"file_name": "gone.png", "score": 0.0, "tags": "x"}) + "\n")
    (tmp_path / "m1" / "metadata.jsonl").write_text(original)
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "m1"), "--out", str(out), "--hf-metadata"] + FAST) == 0
    assert "without 1 rows of the one it replaced, kept as metadata.jsonl.bak" in capsys.readouterr().out
    by_name = {Path(r["path"]).name: r for r in records(out)}
    rows = records(tmp_path / "m1" / "metadata.jsonl")
    assert rows == [
        {"file_name": files[0].name, "score": 5.5, "tags": "red", "text": by_name[files[0].name]["text"]},
        {"file_name": files[1].name, "score": 1.0, "tags": "blue", "text": by_name[files[1].name]["text"]},
    ]
    assert (tmp_path / "m1" / "metadata.jsonl.bak").read_text() == original
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "m1"), split="train")
    assert {"image", "score", "tags", "text"} <= set(loaded.column_names) and sorted(loaded["score"]) == [1.0, 5.5]


def test_hf_metadata_keeps_a_csv_a_csv_and_refuses_two_formats(tmp_path, capsys):
    """Beside a metadata.csv the run merges into it (its columns kept, `text` added), writing no
    metadata.jsonl that would stop the folder loading; a folder with two formats is refused
    (issue 41, case 3)."""
    files = images(tmp_path / "m3", 2)
    (tmp_path / "m3" / "metadata.csv").write_text(f"file_name,score\n{files[0].name},5.5\n{files[1].name},1\n")
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "m3"), "--out", str(out), "--hf-metadata"] + FAST) == 0
    assert not (tmp_path / "m3" / "metadata.jsonl").exists()
    texts = {Path(r["path"]).name: r["text"] for r in records(out)}
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "m3"), split="train")
    assert sorted(zip(loaded["score"], loaded["text"])) == sorted([(5.5, texts[files[0].name]), (1.0, texts[files[1].name])])
    assert (tmp_path / "m3" / "metadata.csv.bak").exists()
    (tmp_path / "m3" / "metadata.jsonl").write_text("")
    assert main(["caption", str(tmp_path / "m3"), "--out", str(tmp_path / "r2.jsonl"), "--hf-metadata"] + FAST) == 2
    assert "holds metadata.csv where this run writes metadata.jsonl" in capsys.readouterr().err


def test_hf_metadata_of_a_split_layout_goes_to_each_split(tmp_path, capsys):
    """train/ and test/ under the folder given: a metadata file in each split, names relative to
    it, so `datasets` loads both splits with their text; rows an earlier version wrote at the root
    move into the splits and the root's file is kept as .bak (issue 41, case 2)."""
    train = images(tmp_path / "m4" / "train", 2)
    test = images(tmp_path / "m4" / "test", 1, prefix="test")
    (tmp_path / "m4" / "metadata.jsonl").write_text(json.dumps({"file_name": f"train/{train[0].name}", "text": "old"})
                                                     + "\n")
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "m4"), "--out", str(out), "--hf-metadata"] + FAST) == 0
    texts = {Path(r["path"]).name: r["text"] for r in records(out)}
    train_rows = records(tmp_path / "m4" / "train" / "metadata.jsonl")
    assert train_rows == [{"file_name": f.name, "text": texts[f.name]} for f in train]
    assert records(tmp_path / "m4" / "test" / "metadata.jsonl") == [{"file_name": test[0].name,
                                                                      "text": texts[test[0].name]}]
    assert not (tmp_path / "m4" / "metadata.jsonl").exists() and (tmp_path / "m4" / "metadata.jsonl.bak").exists()
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "m4"))
    assert sorted(loaded) == ["test", "train"]
    assert sorted(loaded["train"]["text"]) == sorted(texts[f.name] for f in train)
    assert loaded["test"]["text"] == [texts[test[0].name]]


def test_bad_prompt_templates_and_arguments_are_usage_errors(tmp_path, capsys):
    images(tmp_path / "data", 1)
    base = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl")]
    assert main(base + ["--prompt", "Describe {camera}."]) == 2
    assert "{camera}" in capsys.readouterr().err
    assert main(base + ["--max-new-tokens", "abc"]) == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got 'abc'" in err and "_positive_int" not in err
    assert main(base + ["--max-new-tokens", "100000"] + ["--quiet"]) == 2
    assert "positions" in capsys.readouterr().err
    assert main(base + ["--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert main(base + ["--sidecar", "--sidecar-ext", "txt"]) == 2


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"encoder-graphs {encoder_graphs.__version__}"


def test_bad_outputs_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    images(tmp_path / "data", 1)
    (tmp_path / "a_file").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    cases = [
        ["--out", str(tmp_path / "a_file" / "r.jsonl")],
        ["--out", str(tmp_path / "r.jsonl"), "--stats-json", str(tmp_path / "a_file" / "s.json")],
        ["--out", str(tmp_path / "r.jsonl"), "--stats-json", str(tmp_path / "data")],
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append(["--out", str(locked / "r.jsonl")])
    for extra in cases:
        assert main(["caption", str(tmp_path / "data")] + extra + FAST) == 2, extra
        assert f"cannot use {extra[-2]} {extra[-1]}" in capsys.readouterr().err


def test_a_second_run_on_the_same_out_is_refused(tmp_path, capsys):
    images(tmp_path / "data", 1)
    out = tmp_path / "r.jsonl"
    with ResultsFile(out):
        assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 2
    assert f"process {os.getpid()}" in capsys.readouterr().err
    assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0


def test_retry_failed_after_the_file_is_fixed(tmp_path):
    good = images(tmp_path / "data", 2)
    broken = tmp_path / "data" / "late.png"
    broken.write_bytes(b"not a png")
    out = tmp_path / "r.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out)] + FAST
    assert main(argv) == 1
    Image.new("RGB", (64, 64)).save(broken)
    assert main(argv) == 1, "without --retry-failed the error record stands"
    assert main(argv + ["--retry-failed"]) == 0
    latest = {record["path"]: record for record in records(out)}
    assert "caption" in latest[str(broken)] and len(latest) == len(good) + 1


def test_symlinked_folders_are_followed(tmp_path):
    images(tmp_path / "real", 2)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0
    assert sorted(Path(r["relative_path"]).parts[0] for r in records(out)) == ["linked", "linked"]


@pytest.mark.slow
def test_ctrl_c_stops_after_the_batch_and_a_rerun_finishes(tmp_path, model_cache):  # noqa: F811
    images(tmp_path / "data", 24)
    out = tmp_path / "r.jsonl"
    command = [sys.executable, "-m", "encoder_graphs", "caption", str(tmp_path / "data"), "--out", str(out),
               "--batch-size", "2", "--max-new-tokens", "3", "--quiet"]
    env = {**os.environ, "ENCODER_GRAPHS_CACHE": str(model_cache)}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "rerun the same command to resume" in err and "Traceback" not in err
    done = records(out)
    assert 2 <= len(done) < 24 and len({r["path"] for r in done}) == len(done)
    assert subprocess.run(command, env=env).returncode == 0
    assert len({r["path"] for r in records(out)}) == 24 == len(records(out))


def test_seeded_sampling_repeats_and_hidden_files_wait_for_include_hidden(tmp_path):
    images(tmp_path / "data", 3)
    images(tmp_path / "data" / ".thumbs", 1)
    argv = ["caption", str(tmp_path / "data"), "--temperature", "0.9", "--top-p", "0.8", "--seed", "7"] + FAST
    assert main(argv + ["--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(argv + ["--out", str(tmp_path / "b.jsonl")]) == 0
    first, second = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
    assert len(first) == 3, "the hidden folder is skipped"
    assert [r["caption"] for r in first] == [r["caption"] for r in second]
    assert main(argv + ["--out", str(tmp_path / "a.jsonl"), "--include-hidden"]) == 0
    assert len(records(tmp_path / "a.jsonl")) == 4


def test_relative_paths_and_metadata_with_dotdot_roots(tmp_path, monkeypatch):
    files = images(tmp_path / "data" / "sub", 2)
    (tmp_path / "w" / "a").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "w" / "a")
    assert main(["caption", "../../data", "--out", "r.jsonl", "--hf-metadata"] + FAST) == 0
    assert sorted(r["relative_path"] for r in records(Path("r.jsonl"))) == [os.path.join("sub", f.name) for f in files]
    assert len(records(tmp_path / "data" / "metadata.jsonl")) == 2


def test_a_moved_dataset_resumes_and_a_namesake_does_not(tmp_path, capsys):
    images(tmp_path / "old" / "ds", 3)
    out = tmp_path / "caps.jsonl"
    assert main(["caption", str(tmp_path / "old" / "ds"), "--out", str(out)] + FAST) == 0
    before = {r["relative_path"]: r for r in records(out)}
    assert all(len(r["fingerprint"]) == 32 for r in before.values())
    (tmp_path / "new").mkdir()
    os.rename(tmp_path / "old" / "ds", tmp_path / "new" / "ds")
    images(tmp_path / "new" / "ds", 4)[3].unlink()  # the same three files again, one left as the move had it...
    Image.new("RGB", (9, 9), "red").save(tmp_path / "new" / "ds" / "img02.png")  # ...one changed after the move
    images(tmp_path / "new" / "ds" / "more", 1)  # and one added
    capsys.readouterr()
    assert main(["caption", str(tmp_path / "new" / "ds"), "--out", str(out), "--hf-metadata"] + FAST) == 0
    assert "2 files have records in" in capsys.readouterr().err
    after = records(out)[3:]
    carried = [r for r in after if "moved_from" in r]
    assert sorted(r["relative_path"] for r in carried) == ["img00.png", "img01.png"]
    for record in carried:
        old = before[record["relative_path"]]
        assert record["moved_from"] == old["path"] and record["caption"] == old["caption"]
        assert record["path"] == str(tmp_path / "new" / "ds" / record["relative_path"])
    captioned = sorted(r["relative_path"] for r in after if "moved_from" not in r)
    assert captioned == ["img02.png", os.path.join("more", "img00.png")]
    rows = records(tmp_path / "new" / "ds" / "metadata.jsonl")
    assert len(rows) == 4 and all(row["text"] for row in rows)
    # The next run finds everything done.
    assert main(["caption", str(tmp_path / "new" / "ds"), "--out", str(out)] + FAST) == 0
    assert len(records(out)) == 3 + 4
    # Moved again, and run with another setting: nothing is carried (their captions were made
    # otherwise), every file is captioned anew, not refused; a name that is not UTF-8 is carried.
    odd = Path(os.fsdecode(bytes(tmp_path / "new" / "ds") + b"/caf\xe9.png"))
    Image.new("RGB", (12, 12), "blue").save(odd)
    assert main(["caption", str(tmp_path / "new" / "ds"), "--out", str(out)] + FAST) == 0
    os.rename(tmp_path / "new" / "ds", tmp_path / "ds2")
    assert main(["caption", str(tmp_path / "ds2"), "--out", str(out)] + FAST) == 0
    assert sum("moved_from" in r for r in records(out)[8:]) == 5, "all five carried, the odd name too"
    os.rename(tmp_path / "ds2", tmp_path / "ds3")
    assert main(["caption", str(tmp_path / "ds3"), "--out", str(out), "--max-new-tokens", "2", "--quiet"]) == 0
    assert not any("moved_from" in r for r in records(out)[13:]) and len(records(out)) == 13 + 5


def test_dry_run_writes_nothing_limit_takes_the_next_files_and_failures_are_named(tmp_path, capsys):
    files = images(tmp_path / "data", 5)
    (tmp_path / "data" / "bad.png").write_bytes(b"not a png")
    out = tmp_path / "out" / "caps.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out)] + FAST
    before = sorted(tmp_path.rglob("*"))
    assert main(argv + ["--dry-run", "--sidecar", "--hf-metadata"]) == 0
    printed = capsys.readouterr().out
    assert "files: 6 found (image 6); 0 in --out already; to caption: 6" in printed
    assert "max_new_tokens 3" in printed and str(tmp_path / "data" / "metadata.jsonl") in printed
    assert sorted(tmp_path.rglob("*")) == before, "a dry run writes nothing"
    assert main(argv + ["--limit", "4"]) == 1  # bad.png sorts first: it fails
    printed = capsys.readouterr().out
    assert "captioned 3, failed 1, skipped (already done) 0, left to a later run (--limit) 2" in printed
    assert "kinds: image 4\n" in printed, "kinds count the records written: 3 captions and 1 error"
    assert f"failed, by their latest record: 1 ({tmp_path / 'data' / 'bad.png'}); each record's \"error\"" in printed
    assert f"captions: {out}" in printed
    assert main(argv + ["--limit", "4"]) == 1
    assert "captioned 2, failed 0, skipped (already done) 4" in capsys.readouterr().out
    assert sorted(r["path"] for r in records(out))[1:] == sorted(map(str, files))


def test_sidecar_safety_backfill_permissions_and_conflicts(tmp_path):
    files = images(tmp_path / "data", 2)
    out = tmp_path / "r.jsonl"
    base = ["caption", str(tmp_path / "data"), "--out", str(out)] + FAST
    assert main(base) == 0
    previous = os.umask(0o022)
    try:
        assert main(base + ["--sidecar"]) == 0, "sidecars come from the records: nothing is captioned again"
    finally:
        os.umask(previous)
    assert len(records(out)) == 2
    for file in files:
        assert file.with_suffix(".txt").stat().st_mode & 0o777 == 0o644
    assert main(base + ["--sidecar", "--sidecar-ext", ".png"]) == 2
    Image.new("RGB", (32, 32)).save(tmp_path / "data" / "img00.jpg")
    assert main(base + ["--sidecar"]) == 2, "img00.png and img00.jpg would share img00.txt"
    assert main(["caption", str(tmp_path / "data"), "--out", str(tmp_path / "data" / "metadata.jsonl"),
                 "--hf-metadata"] + FAST) == 2


def test_odd_names_templates_and_rotation(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    odd = folder / os.fsdecode(b"caf\xe9.png")  # not valid UTF-8
    Image.new("RGB", (48, 40)).save(odd)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 80x40, seen 40x80
    Image.new("RGB", (80, 40)).save(folder / "turned.jpg", exif=exif)
    out = tmp_path / "r.jsonl"
    for bad in ("Describe {}", "size {width:q}"):
        assert main(["caption", str(folder), "--out", str(out), "--prompt", bad] + FAST) == 2
    assert "prompt" in capsys.readouterr().err
    assert main(["caption", str(folder), "--out", str(out), "--hf-metadata", "--prompt", "{width}x{height}"] + FAST) == 0
    by_name = {Path(r["path"]).name: r for r in records(out)}
    assert (by_name["turned.jpg"]["width"], by_name["turned.jpg"]["height"]) == (40, 80)
    assert by_name["turned.jpg"]["prompt"] == "40x80"
    (folder / "metadata.jsonl").unlink()
    again = ["caption", str(folder), "--out", str(out), "--hf-metadata", "--prompt", "{width}x{height}"]
    assert main(again + FAST) == 0, "nothing to do"
    assert len(records(folder / "metadata.jsonl")) == 1, "no JSON file_name opens caf\\xe9.png: it has no row"


def test_shards_split_the_files_disjointly_and_completely_with_slurm_defaults(tmp_path, monkeypatch, capsys):
    """--num-shards/--shard-index (or a Slurm job array's task) give each process a disjoint,
    complete share, the same wherever the dataset is mounted, each into its own --out (issue 43)."""
    from encoder_graphs.app.shards import shard_out, slurm_shard

    files = images(tmp_path / "ds", 12)
    outs = []
    for index in range(3):
        assert main(["caption", str(tmp_path / "ds"), "--out", str(tmp_path / "caps-{shard}.jsonl"),
                     "--num-shards", "3", "--shard-index", str(index)] + FAST) == 0
        outs.append(tmp_path / f"caps-{index}.jsonl")
    shares = [{r["relative_path"] for r in records(out)} for out in outs]
    assert sorted(name for share in shares for name in share) == sorted(f.name for f in files)
    assert all(shares), "12 files in 3 shards: each has some"
    # The same split under a Slurm array of 3 tasks numbered from 5, elsewhere: task 6 is shard 1.
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "6")
    assert slurm_shard() == (3, 1)
    os.rename(tmp_path / "ds", tmp_path / "moved")
    assert main(["caption", str(tmp_path / "moved"), "--out", str(tmp_path / "slurm.jsonl")] + FAST) == 0
    assert {r["relative_path"] for r in records(tmp_path / "slurm.shard-1-of-3.jsonl")} == shares[1]
    assert shard_out(Path("a/c.jsonl"), 16, 3) == Path("a/c.shard-03-of-16.jsonl")
    capsys.readouterr()
    for extra, words in ((["--hf-metadata"], "--hf-metadata with shards"), (["--shard-index", "3"], "give 0 to 2")):
        argv = ["caption", str(tmp_path / "moved"), "--out", str(tmp_path / "x.jsonl"), "--num-shards", "3"]
        argv += extra if "--shard-index" in extra else ["--shard-index", "0", *extra]
        assert main(argv + FAST) == 2
        assert words in capsys.readouterr().err


def test_a_manifest_lists_the_files_and_a_missing_one_is_an_error_record(tmp_path, capsys):
    """`--manifest` of CSV, JSON lines or plain text: the files it names and only those, relative
    to its folder; a listed file that is missing, or is not media, is its error record (issue 43)."""
    files = images(tmp_path / "ds" / "sub", 4)
    listed = [os.path.join("sub", files[0].name), str(files[1]), "sub/gone.png", "notes.md"]
    (tmp_path / "ds" / "notes.md").write_text("x")
    manifests = {
        "list.csv": "path,score\n" + "".join(f"{name},1\n" for name in listed),
        "list.jsonl": "".join(json.dumps({"file_name": name}) + "\n" for name in listed),
        "list.txt": "# the selection\n" + "".join(f"{name}\n" for name in listed),
    }
    for name, text in manifests.items():
        (tmp_path / "ds" / name).write_text(text)
        out = tmp_path / f"{name}.out.jsonl"
        assert main(["caption", "--manifest", str(tmp_path / "ds" / name), "--out", str(out)] + FAST) == 1, name
        by_name = {r["relative_path"]: r for r in records(out)}
        assert sorted(by_name) == sorted(["sub/img00.png", "sub/img01.png", "sub/gone.png", "notes.md"]), name
        assert "caption" in by_name["sub/img00.png"] and "caption" in by_name["sub/img01.png"]
        assert by_name["sub/gone.png"]["error_kind"] == "not_found" and name in by_name["sub/gone.png"]["error"]
        assert by_name["notes.md"]["error_kind"] == "unsupported"
    (tmp_path / "bad.csv").write_text("name,score\na.png,1\n")
    capsys.readouterr()
    assert main(["caption", "--manifest", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "b.jsonl")] + FAST) == 2
    assert "names no path column" in capsys.readouterr().err

"""Ray Data's `map_batches` with `RayCaptioner` (`app/ray_data.py`) on a local cluster of two
CPU actors: Parquet rows of image bytes (a corrupt one amid them; elsewhere HF image structs, a
missing image, paths) come back with the
captions the caption command writes for the same images as files, the other columns carried
through, a bad row its error. The embedded tiny model, fp32, greedy."""

import io
import json
import os

import pytest
from PIL import Image

from encoder_graphs.app.cli import main

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")  # the default model built once, for the actors too
    os.environ["ENCODER_GRAPHS_CACHE"] = str(cache)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ENCODER_GRAPHS_CACHE": str(cache)}})
    yield
    ray.shutdown()
    del os.environ["ENCODER_GRAPHS_CACHE"]


def photos(folder):
    """Ten small images of several formats and sizes, one turned by its EXIF orientation."""
    folder.mkdir()
    for index in range(10):
        image = Image.new("RGB", (40 + 12 * index, 56 + 4 * index), (25 * index, 90, 200 - 15 * index))
        exif = Image.Exif()
        if index == 3:
            exif[0x0112] = 6
        image.save(folder / f"img{index}.{'jpg' if index % 2 else 'png'}", exif=exif)
    return sorted(folder.iterdir())


def test_ray_data_gives_the_commands_captions(cluster, tmp_path):
    from encoder_graphs.app.ray_data import RayCaptioner

    files = photos(tmp_path / "photos")
    prompt = "Describe {name}, {width}x{height}."  # the fields a row fills as the command fills a file's
    assert main(["caption", str(tmp_path / "photos"), "--out", str(tmp_path / "c.jsonl"), "--max-new-tokens", "6",
                 "--quiet", "--device", "cpu", "--prompt", prompt]) == 0
    expected = {record["relative_path"]: record for record in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())}
    keys = [f.name for f in files]
    keys.insert(4, "broken.png")  # a failed row amid the others: the records after it stay aligned
    images = [f.read_bytes() for f in files]
    images.insert(4, b"\x89PNG not really")
    rows = {"key": keys, "image": images, "shard": list(range(len(keys)))}
    pq.write_table(pa.table(rows), tmp_path / "rows.parquet")
    # Calls of 6 rows captioned in generate batches of 3 (the broken row leaves a short one).
    settings = {"fn_constructor_kwargs": {"max_new_tokens": 6, "batch_size": 3, "device": "cpu", "prompt": prompt},
                "batch_size": 6}
    dataset = ray.data.read_parquet(str(tmp_path / "rows.parquet"), override_num_blocks=3)  # both actors get rows
    captioned = dataset.map_batches(RayCaptioner, concurrency=2, **settings).take_all()
    got = {row["key"]: row for row in captioned}
    assert sorted(got) == sorted(keys) and len(captioned) == len(keys)  # every row once
    for name, record in expected.items():
        row = got[name]
        assert row["error"] is None and row["shard"] == keys.index(name), name
        assert [row[field] for field in ("caption", "prompt", "width", "height", "tokens", "vision_tokens")] == \
            [record[field] for field in ("caption", "prompt", "width", "height", "tokens", "vision_tokens")], name
    assert got["img3.jpg"]["height"] > got["img3.jpg"]["width"]  # as seen: its EXIF turns it
    assert got["broken.png"]["error_kind"] == "corrupt" and got["broken.png"]["caption"] is None
    assert "image" not in got["broken.png"]  # the bytes are not carried back
    # An HF image struct, a missing image, and paths: read only when asked.
    struct = [{"key": "struct", "image": {"bytes": files[0].read_bytes(), "path": None}},
              {"key": "none", "image": None}]
    rows = ray.data.from_items(struct).map_batches(RayCaptioner, concurrency=1, **settings).take_all()
    by_key = {row["key"]: row for row in rows}
    assert by_key["struct"]["caption"] == expected[files[0].name]["caption"]
    assert by_key["none"]["error_kind"] == "missing"
    by_path = ray.data.from_items([{"key": files[1].name, "image": str(files[1])}])
    (refused,) = by_path.map_batches(RayCaptioner, concurrency=1, **settings).take_all()
    assert refused["error_kind"] == "unreadable" and "read_paths=True" in refused["error"]
    settings["fn_constructor_kwargs"]["read_paths"] = True
    (row,) = by_path.map_batches(RayCaptioner, concurrency=1, **settings).take_all()
    assert row["caption"] == expected[files[1].name]["caption"], row


def test_a_missing_or_clashing_column_is_named(cluster):
    from encoder_graphs.app.ray_data import RayCaptioner

    captioner = RayCaptioner(max_new_tokens=2, batch_size=2, device="cpu")
    with pytest.raises(KeyError, match="no column 'image'.*image_column="):
        captioner({"key": ["a"], "picture": [b""]})
    png = io.BytesIO()
    Image.new("RGB", (30, 30)).save(png, "PNG")
    out = captioner({"key": ["a", "b"], "image": [png.getvalue(), 7]})
    assert out["error"][0] is None and out["error_kind"][1] == "unreadable" and "holds int" in out["error"][1]
    with pytest.raises(ValueError, match="columns named as RayCaptioner's outputs \\(caption\\)"):
        captioner({"key": ["a"], "image": [png.getvalue()], "caption": ["an old one"]})


def test_named_prompts_give_the_commands_captions_under_their_names(cluster, tmp_path):
    from encoder_graphs.app.ray_data import RayCaptioner

    everything = photos(tmp_path / "photos")
    for extra in everything[4:]:
        extra.unlink()
    files = everything[:4]
    named = {"short": "One line about {name}.", "tags": "Tags."}
    (tmp_path / "p.json").write_text(json.dumps(named))
    assert main(["caption", str(tmp_path / "photos"), "--out", str(tmp_path / "c.jsonl"), "--max-new-tokens", "5",
                 "--quiet", "--device", "cpu", "--prompt-file", str(tmp_path / "p.json")]) == 0
    expected = {record["relative_path"]: record for record in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines())}
    rows = {"key": [f.name for f in files], "image": [f.read_bytes() for f in files]}
    settings = {"fn_constructor_kwargs": {"max_new_tokens": 5, "batch_size": 2, "device": "cpu", "prompts": named},
                "batch_size": 2}
    got = {row["key"]: row for row in ray.data.from_items([dict(zip(rows, v)) for v in zip(*rows.values())])
           .map_batches(RayCaptioner, concurrency=1, **settings).take_all()}
    assert sorted(got) == sorted(expected)
    for name, record in expected.items():
        assert got[name]["captions"] == record["captions"] and got[name]["prompt"] == record["prompt"], name
        assert got[name]["caption"] == record["captions"]["short"]
    with pytest.raises(ValueError, match="not both"):
        RayCaptioner(prompt="x", prompts=named, device="cpu")
    with pytest.raises(ValueError, match="is empty"):
        RayCaptioner(prompts={"a": " "}, device="cpu")
    for bad in ({}, {"a": 5}, {"a b": "x"}):
        with pytest.raises((ValueError, TypeError), match="RayCaptioner"):
            RayCaptioner(prompts=bad, device="cpu")


def test_an_actor_takes_its_gpus_share_of_the_nodes_cores():
    from encoder_graphs.app.ray_rows import actor_load_workers, share_of_cores

    assert share_of_cores(64, 4, 1, 16) == 16 and share_of_cores(32, 8, 1, 16) == 4
    assert share_of_cores(32, 8, 2, 16) == 8 and share_of_cores(4, 8, 1, 16) == 1  # at least one thread
    assert share_of_cores(64, 0, 0, 7) == 7 and share_of_cores(64, 4, 0, 7) == 7  # no GPU held: the default
    assert actor_load_workers(5) == 5  # outside an actor


def test_a_driver_imports_neither_torch_nor_transformers():
    """The driver builds the pipeline only; an actor loads the model (`app/ray_rows.py`)."""
    import subprocess
    import sys

    script = "import sys, encoder_graphs.app.ray_data; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", script],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_a_call_cuts_full_batches_holds_two_windows_and_keeps_its_rows_in_order(cluster):
    """A call of many rows runs the command's loop: its batches full from the first (fewer loader
    threads than a batch must not make every call start with a short one), at most a window of
    PREFETCH_BATCHES batches being captioned and as many decoding ahead of it (a preprocessed
    photo is megabytes), not the whole call's at once; its records stay in the rows' order, a
    broken row's an error record."""
    import threading

    from encoder_graphs.app.ray_data import RayCaptioner
    from encoder_graphs.app.ray_rows import PREFETCH_BATCHES

    captioner = RayCaptioner(max_new_tokens=2, batch_size=3, device="cpu")
    rows = captioner.captioner
    rows.load_workers = 1  # fewer loaders than a batch (an actor's share of a small node)
    prepared, lock, seen = [0], threading.Lock(), []
    prepare, caption_batch = rows.prepare, rows.caption_batch

    def counted(file):
        with lock:
            prepared[0] += 1
        return prepare(file)

    captioned, window_began = [0], [0]
    caption_window = rows._caption_window

    def windowed(ready, *args):
        window_began[0] = captioned[0]  # the window's rows are all held until it ends
        return caption_window(ready, *args)

    def watched(batch, stats, collated=None):
        records = caption_batch(batch, stats, collated)
        captioned[0] += len(batch)
        # rows decoding or decoded (not yet captioned when this window began), this batch's size
        seen.append((prepared[0], window_began[0], len(batch)))
        return records

    rows.prepare, rows.caption_batch, rows._caption_window = counted, watched, windowed
    images = []
    for index in range(25):
        png = io.BytesIO()
        Image.new("RGB", (28 + index, 30), (10 * index, 0, 0)).save(png, "PNG")
        images.append(png.getvalue() if index != 5 else b"broken")
    out = captioner({"key": [f"k{i}" for i in range(25)], "image": images})
    assert out["key"] == [f"k{i}" for i in range(25)]
    assert out["error_kind"][5] == "corrupt" and all(out["caption"][i] is not None for i in range(25) if i != 5)
    assert PREFETCH_BATCHES == 2 and captioned[0] == 24
    assert [size for _, _, size in seen] == [3] * 8, seen  # 24 good rows: eight full batches
    # A window (2 batches of 3) held while as many load ahead (and the broken row): at most 12 + 1.
    assert all(started <= done + 2 * PREFETCH_BATCHES * 3 + 1 for started, done, _ in seen), seen


def test_a_rows_prompt_takes_the_keys_stem_as_name_and_no_folder():
    """`{name}` is the stem of the key's last part and `{folder}` empty, whatever slashes the key has."""
    from encoder_graphs.app.ray_data import RayCaptioner

    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, "PNG")
    captioner = RayCaptioner(max_new_tokens=2, batch_size=2, device="cpu", prompt="F={folder} N={name}")
    assert captioner({"key": ["dir/sub/k0.jpg"], "image": [png.getvalue()]})["prompt"] == ["F= N=k0"]


def test_a_rows_error_names_its_key_as_the_dataset_spells_it():
    """An error record's message names the row by its key as given, not as a path would spell it."""
    from encoder_graphs.app.ray_data import RayCaptioner

    captioner = RayCaptioner(max_new_tokens=2, batch_size=2, device="cpu")
    inputs = captioner.captioner.inputs
    encode = inputs.encode_image

    def refusing(picture):
        if picture.size == (33, 31):
            raise ValueError("the processor refuses this one")
        return encode(picture)

    inputs.encode_image = refusing
    images = []
    for size in [(32, 32), (33, 31)]:
        png = io.BytesIO()
        Image.new("RGB", size).save(png, "PNG")
        images.append(png.getvalue())
    out = captioner({"key": ["a//b/./k0.png", "./c//k1.png"], "image": images})
    assert out["error_kind"] == [None, "preprocess"] and out["caption"][0] is not None
    assert out["error"][1] == "./c//k1.png: ValueError: the processor refuses this one"

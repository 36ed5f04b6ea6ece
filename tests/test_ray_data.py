"""Ray Data's `map_batches` with `RayCaptioner` (`app/ray_data.py`) on a local cluster of two
CPU actors: Parquet rows of image bytes (and a corrupt row; elsewhere a path) come back with the
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


def test_ray_data_gives_the_commands_captions(cluster, tmp_path, capsys):
    from encoder_graphs.app.ray_data import RayCaptioner

    files = photos(tmp_path / "photos")
    assert main(["caption", str(tmp_path / "photos"), "--out", str(tmp_path / "c.jsonl"), "--max-new-tokens", "6",
                 "--quiet", "--device", "cpu"]) == 0
    expected = {json.loads(line)["relative_path"]: json.loads(line)["caption"]
                for line in (tmp_path / "c.jsonl").read_text().splitlines()}
    rows = {"key": [f.name for f in files] + ["broken.png"],
            "image": [f.read_bytes() for f in files] + [b"\x89PNG not really"],
            "shard": list(range(len(files) + 1))}
    pq.write_table(pa.table(rows), tmp_path / "rows.parquet")
    settings = {"fn_constructor_kwargs": {"max_new_tokens": 6, "batch_size": 4, "device": "cpu"}, "batch_size": 4}
    captioned = ray.data.read_parquet(str(tmp_path / "rows.parquet")).map_batches(
        RayCaptioner, concurrency=2, **settings).take_all()
    got = {row["key"]: row for row in captioned}
    assert sorted(got) == sorted(rows["key"]) and len(captioned) == len(rows["key"])  # every row once
    for name, caption in expected.items():
        assert got[name]["caption"] == caption and got[name]["error"] is None, name
        assert got[name]["tokens"] == 6 and got[name]["shard"] == rows["key"].index(name)
    assert got["broken.png"]["error_kind"] == "corrupt" and got["broken.png"]["caption"] is None
    assert "image" not in got["broken.png"]  # the bytes are not carried back
    # A column of paths instead of bytes.
    by_path = ray.data.from_items([{"key": "by-path", "image": str(files[0])}])
    (row,) = by_path.map_batches(RayCaptioner, concurrency=1, **settings).take_all()
    assert row["caption"] == expected[files[0].name], row


def test_a_missing_column_is_named(cluster):
    from encoder_graphs.app.ray_data import RayCaptioner

    captioner = RayCaptioner(max_new_tokens=2, batch_size=2, device="cpu")
    with pytest.raises(KeyError, match="no column 'image'.*image_column="):
        captioner({"key": ["a"], "picture": [b""]})
    png = io.BytesIO()
    Image.new("RGB", (30, 30)).save(png, "PNG")
    out = captioner({"key": ["a", "b"], "image": [png.getvalue(), 7]})
    assert out["error"][0] is None and out["error_kind"][1] == "unreadable" and "holds int" in out["error"][1]

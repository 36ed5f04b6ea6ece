"""Loading every kind of good, odd and broken input: the right outcome for each, never a crash."""

import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from privileges import run_unprivileged

from encoder_graphs.app.decoders import decode_video
from encoder_graphs.app.media import LoadLimits, MediaError, fit, load_image
from encoder_graphs.app.pipeline import load
from encoder_graphs.app.video import DecodedVideo
from encoder_graphs.app.walk import MediaFile, discover

av = pytest.importorskip("av")

LIMITS = LoadLimits(max_pixels=224 * 224, frame_max_pixels=112 * 112, max_frames=8)


def write_video(path: Path, frames: int, size: tuple[int, int] = (64, 48)) -> None:
    """An MPEG-4 file of `frames` frames whose red channel encodes the frame index."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        container.start_encoding()  # writes the header even when no frame follows
        for index in range(frames):
            pixels = np.zeros((size[1], size[0], 3), np.uint8)
            pixels[..., 0] = min(255, 20 * index)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims `width` x `height`: a decompression bomb as far as any decoder
    that trusts the header is concerned."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def write_zoo(folder: Path, huge: bool = True) -> dict[str, str]:
    """Every input kind the captioning command must survive. Returns name -> expected outcome:
    "ok" or the MediaError kind (or "preprocess" where the image loads but no model can take it)."""
    folder.mkdir(parents=True, exist_ok=True)
    expected: dict[str, str] = {}

    def save(name: str, image: Image.Image, outcome: str = "ok", **kwargs) -> None:
        image.save(folder / name, **kwargs)
        expected[name] = outcome

    save("good.png", Image.new("RGB", (96, 64), (10, 120, 200)))
    save("good.jpg", Image.new("RGB", (80, 80), (200, 50, 50)))
    save("good.webp", Image.new("RGB", (64, 64), (0, 90, 0)))
    save("good.bmp", Image.new("RGB", (40, 60), (90, 90, 0)))
    save("good.tiff", Image.new("RGB", (50, 50), (9, 9, 9)))
    save("tiny.png", Image.new("RGB", (1, 1), (255, 0, 0)))
    save("sixteen_bit.png", Image.fromarray(np.full((32, 48), 32768, np.uint16)))
    save("cmyk.jpg", Image.new("CMYK", (64, 64), (0, 255, 255, 0)))  # red
    rgba = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 32, 64))
    save("rgba.png", rgba)
    frames = [Image.new("P", (32, 32), color) for color in (1, 2, 3)]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    expected["animated.gif"] = "ok"
    if huge:
        save("huge.jpg", Image.new("L", (10000, 10000), 128), quality=50)
    png_header_only(folder / "bomb.png", 30000, 30000)
    expected["bomb.png"] = "too_large"
    save("extreme_aspect.png", Image.new("RGB", (2, 3000)), outcome="aspect_ratio")  # refused from the header

    (folder / "text.jpg").write_text("this is not an image\n")
    expected["text.jpg"] = "corrupt"
    (folder / "empty.png").write_bytes(b"")
    expected["empty.png"] = "empty"
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (128, 128, 3), np.uint8))
    buffer = io.BytesIO()
    noisy.save(buffer, format="JPEG", quality=95)
    (folder / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    expected["truncated.jpg"] = "corrupt"
    (folder / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    expected["garbage.png"] = "corrupt"
    os.symlink(folder / "does-not-exist.png", folder / "dangling.png")
    expected["dangling.png"] = "unreadable"
    locked = folder / "locked.png"
    Image.new("RGB", (32, 32)).save(locked)
    locked.chmod(0)
    # root reads any file: there the locked file is simply captioned.
    expected["locked.png"] = "ok" if os.geteuid() == 0 else "unreadable"

    write_video(folder / "clip.mp4", frames=10)
    expected["clip.mp4"] = "ok"
    write_video(folder / "no_frames.mp4", frames=0)
    expected["no_frames.mp4"] = "no_frames"
    (folder / "broken.mkv").write_bytes(b"\x1aE\xdf\xa3" + os.urandom(300))
    expected["broken.mkv"] = "corrupt"
    (folder / "notes.txt").write_text("ignored: not media")
    return expected


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("zoo")
    return folder, write_zoo(folder)


def outcome(file: MediaFile) -> str:
    try:
        loaded = load(file, LIMITS)
    except MediaError as error:
        assert str(file.path) in str(error), "the error must name the file"
        return error.kind
    if isinstance(loaded, DecodedVideo):
        assert loaded.frames.dtype == np.uint8 and loaded.frames.shape[-1] == 3
        assert min(loaded.frames.shape[1:3]) >= LIMITS.min_side
        return "ok"
    assert loaded.mode == "RGB"
    assert min(loaded.size) >= LIMITS.min_side
    return "ok"


def test_discover_is_recursive_sorted_and_skips_other_files(tmp_path):
    for name in ("b/z.png", "a/y.MP4", "a/c/x.jpeg", "top.gif", "readme.md", "a/data.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    files = discover([tmp_path / "b", tmp_path, tmp_path / "top.gif"])
    names = [f.path.relative_to(tmp_path).as_posix() for f in files]
    assert names == ["a/c/x.jpeg", "a/y.MP4", "b/z.png", "top.gif"]
    assert [f.kind for f in files] == ["image", "video", "image", "image"]
    with pytest.raises(FileNotFoundError, match="missing"):
        discover([tmp_path / "missing"])


def test_discover_gives_absolute_paths_and_one_entry_per_real_file(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(b"x")
    os.symlink(tmp_path / "a.png", tmp_path / "link.png")
    monkeypatch.chdir(tmp_path)
    (file,) = discover(["."])
    assert file.path == tmp_path / "a.png" and file.path.is_absolute()


def touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")


def test_discover_follows_symlinked_folders(tmp_path):
    touch(tmp_path, "elsewhere/deep/a.png", "data/b.png")
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "linked")
    files = discover([tmp_path / "data"])
    assert [f.path for f in files] == [tmp_path / "data/b.png", tmp_path / "data/linked/deep/a.png"]


def test_discover_symlink_loop_terminates_and_lists_each_file_once(tmp_path):
    touch(tmp_path, "data/a.png", "data/sub/b.jpg")
    os.symlink(tmp_path / "data", tmp_path / "data" / "sub" / "up")  # a link to an ancestor
    os.symlink("..", tmp_path / "data" / "sub" / "parent")  # a relative one too
    os.symlink(".", tmp_path / "data" / "self")
    files = discover([tmp_path / "data"])
    assert [f.path for f in files] == [tmp_path / "data/a.png", tmp_path / "data/sub/b.jpg"]


def test_discover_lists_a_file_reachable_through_two_links_once(tmp_path):
    touch(tmp_path, "real/a.png")
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "data" / "one")
    os.symlink(tmp_path / "real", tmp_path / "data" / "two")
    os.symlink(tmp_path / "real" / "a.png", tmp_path / "data" / "three.png")
    files = discover([tmp_path / "data", tmp_path / "real"])
    assert len(files) == 1 and files[0].kind == "image"
    assert os.path.realpath(files[0].path) == os.path.realpath(tmp_path / "real" / "a.png")


def test_discover_skips_hidden_files_and_folders_unless_asked(tmp_path):
    touch(tmp_path, "a.png", ".b.png", ".cache/c.png", "sub/.d.jpg", "sub/e.jpg")

    def names(files: list[MediaFile]) -> list[str]:
        return [f.path.relative_to(tmp_path).as_posix() for f in files]

    assert names(discover([tmp_path])) == ["a.png", "sub/e.jpg"]
    assert names(discover([tmp_path], include_hidden=True)) == [
        ".b.png",
        ".cache/c.png",
        "a.png",
        "sub/.d.jpg",
        "sub/e.jpg",
    ]
    # a hidden path given explicitly is used
    assert names(discover([tmp_path / ".cache", tmp_path / ".b.png"])) == [".b.png", ".cache/c.png"]


def test_unreadable_folder_becomes_an_error_entry(tmp_path, monkeypatch):
    touch(tmp_path, "a.png", "locked/b.png", "locked/inner/c.png")
    locked = tmp_path / "locked"
    real_scandir = os.scandir

    def scandir(path):
        # chmod 000 does not stop root (tests run as root here): refuse the listing instead.
        if os.path.realpath(path) == os.path.realpath(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    files = discover([tmp_path])
    assert [(f.path, f.kind) for f in files] == [(tmp_path / "a.png", "image"), (locked, "folder")]
    assert files[1] == MediaFile(path=locked, kind="folder")
    with pytest.raises(MediaError, match="cannot list this folder: permission denied") as error:
        load(files[1], LIMITS)
    assert error.value.kind == "unreadable" and str(locked) in str(error.value)
    # the reason is found again for a folder entry made elsewhere (e.g. by hand)
    with pytest.raises(MediaError, match="permission denied") as error:
        load(MediaFile(path=locked, kind="folder"), LIMITS)
    assert error.value.kind == "unreadable"


def test_chmod_000_folder_becomes_an_error_entry(tmp_path):
    """The walk in a process that the folder's mode binds (root without its capabilities too)."""
    touch(tmp_path, "a.png", "locked/b.png")
    (tmp_path / "locked").chmod(0)
    code = (f"import json; from encoder_graphs.app.walk import discover; "
            f"print(json.dumps([(f.path.name, f.kind) for f in discover([{str(tmp_path)!r}])]))")
    try:
        done = run_unprivileged(code)
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [["a.png", "image"], ["locked", "folder"]]


def test_every_input_kind_gets_its_outcome(zoo):
    folder, expected = zoo
    files = {f.path.name: f for f in discover([folder])}
    assert set(files) == set(expected)
    outcomes = {name: outcome(file) for name, file in files.items()}
    # "preprocess" failures load fine here and are refused later, by the processor.
    assert outcomes == {name: "ok" if kind == "preprocess" else kind for name, kind in expected.items()}


def test_conversions_keep_the_picture(zoo):
    folder, _ = zoo
    sixteen = np.asarray(load_image(folder / "sixteen_bit.png", LIMITS))
    assert 120 <= sixteen.mean() <= 136, "16-bit mid grey must stay mid grey, not clip to white"
    red = np.asarray(load_image(folder / "cmyk.jpg", LIMITS)).mean(axis=(0, 1))
    assert red[0] > 200 and red[1] < 60 and red[2] < 60
    rgba = np.asarray(load_image(folder / "rgba.png", LIMITS))
    assert (rgba[:, -1] >= 250).all(), "transparent pixels composite over white"
    assert rgba[0, 0, 2] > 200 and rgba[0, 0, 0] < 30
    tiny = load_image(folder / "tiny.png", LIMITS)
    assert min(tiny.size) == LIMITS.min_side and np.asarray(tiny)[..., 0].min() > 200
    huge = load_image(folder / "huge.jpg", LIMITS)
    # Reduced in the decoder by a power of two that keeps max_pixels; the processor resizes once.
    assert LIMITS.max_pixels <= huge.size[0] * huge.size[1] < 4 * LIMITS.max_pixels


def test_huge_png_is_reduced_and_bomb_refused_before_decoding(tmp_path):
    Image.new("L", (10000, 10000), 200).save(tmp_path / "huge.png")
    image = load_image(tmp_path / "huge.png", LIMITS)
    assert image.size == (228, 228)  # 10000 / 44 rounded up: 44 is the largest whole factor keeping 224 x 224
    png_header_only(tmp_path / "bomb.png", 100_000, 100_000)
    with pytest.raises(MediaError, match="bomb.png") as error:
        load_image(tmp_path / "bomb.png", LIMITS)
    assert error.value.kind == "too_large"


def test_fit_bounds():
    assert fit(Image.new("RGB", (1000, 500)), 200 * 100, 28).size == (200, 100)
    assert fit(Image.new("RGB", (4, 2)), 10_000, 28).size == (56, 28)
    same = Image.new("RGB", (60, 40))
    assert fit(same, 10_000, 28) is same


@pytest.mark.parametrize("frames, expected", [(1, 2), (3, 2), (10, 8), (200, 8)])
def test_video_frames_are_even_evenly_spaced_and_bounded(tmp_path, frames, expected):
    write_video(tmp_path / "v.mp4", frames=frames)
    loaded = decode_video(tmp_path / "v.mp4", LIMITS)
    assert loaded.frames.shape[0] == expected
    red = [int(frame[..., 0].mean()) for frame in loaded.frames]
    assert red == sorted(red), "frames stay in time order"
    if frames >= expected:
        # first and last frames are sampled; min(255, 20 * index) marks the index
        assert red[0] < 10 and red[-1] >= min(255, 20 * (frames - 1)) - 12


def test_zero_frame_and_corrupt_videos(zoo):
    folder, _ = zoo
    with pytest.raises(MediaError, match="no_frames.mp4") as error:
        decode_video(folder / "no_frames.mp4", LIMITS)
    assert error.value.kind == "no_frames"
    with pytest.raises(MediaError, match="broken.mkv") as error:
        decode_video(folder / "broken.mkv", LIMITS)
    assert error.value.kind == "corrupt"


def test_limits_validation():
    with pytest.raises(ValueError, match="even"):
        LoadLimits(max_frames=3)
    with pytest.raises(ValueError, match="min_side"):
        LoadLimits(min_side=1000, max_pixels=100)


def test_loader_threads_leave_the_warning_filters_and_raise_no_bomb_warnings(tmp_path, monkeypatch):
    """Pillow warns past its pixel count; the loaders judge sizes themselves. Silenced per call in
    `catch_warnings` (not thread-safe) from 8 threads, the filters leaked (issue 42, case 8)."""
    import threading
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    from encoder_graphs.app.media import LoadLimits, load_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # every image below warns in Pillow
    paths = []
    for index in range(32):
        paths.append(tmp_path / f"{index}.png")
        Image.new("RGB", (20 + index % 12, 30), (index, 0, 0)).save(paths[-1])  # 600-930 pixels: warned, not refused
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)  # as media set it
        inside = list(warnings.filters)
        with ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(lambda p: load_image(p, LoadLimits()), paths * 4))) == 128
        assert warnings.filters == inside and not caught, [str(w.message) for w in caught]
    assert warnings.filters == before and threading.active_count() >= 1

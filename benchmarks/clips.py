"""A folder of video clips at the sizes people have (fixed seed): H.264 MP4 (libx264, yuv420p, a
keyframe every 2 s) of 1080p, 720p, portrait 1080x1920, 480p, 1080p60 and 360p, 10 to 60 s long;
with specials, two 5-minute 720p clips, a VP9 WebM and a phone clip stored landscape with a
display rotation of -90 degrees (shown portrait). The content is a seeded moving scene: a
textured gradient panned by a camera, shapes crossing it and a little sensor grain, so a 1080p
clip runs a few Mbit/s and decodes as slowly as a real one, not a flat colour.
The specials are among the `count` files, spread through their sorted order. No audio track.
Only the distinct clips are encoded (at most 8 of each regular kind, in parallel processes,
longest first); the rest of the folder is copies of them under new names, so 512 clips cost what
48 do: 52 s on a 16-core GPU machine (750 CPU-seconds, 3.1 GB written), about 10 minutes on 2 cores.
    python3 benchmarks/clips.py FOLDER [--count 512] [--seed 0] [--no-specials]
"""

import argparse
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from photos import write_photo_folder

# (width, height, fps, seconds): cycled through, in this order
KINDS = [
    (1920, 1080, 30, 20),
    (1280, 720, 30, 30),
    (1080, 1920, 30, 15),
    (854, 480, 25, 40),
    (1920, 1080, 60, 10),
    (640, 360, 24, 60),
]
DISTINCT_PER_KIND = 8
KEYFRAME_S = 2
GRAIN_FIELDS = 4  # sensor grain cycles through this many fields: fresh noise a frame would cost what the encode does


@dataclass(frozen=True)
class Clip:
    """One distinct file to encode. `rotation` is the display rotation in degrees (0: none)."""

    name: str
    width: int
    height: int
    fps: int
    seconds: int
    seed: int
    codec: str = "libx264"
    rotation: int = 0
    detail: bool = True  # False: no grain, fewer shapes; with the ultrafast preset, cheap long clips

    @property
    def frames(self) -> int:
        return self.fps * self.seconds

    @property
    def cost(self) -> float:
        """Pixels to make and encode: the longest jobs start first, so they do not finish last alone."""
        return self.frames * self.width * self.height * (1 if self.detail else 0.5)


def clip_name(index: int, width: int, height: int, fps: int, seconds: int, suffix: str = "mp4", tag: str = "") -> str:
    return f"clip_{index:04d}_{width}x{height}_{fps}fps_{seconds}s{tag}.{suffix}"


def special_clips(seed: int) -> list[Clip]:
    """The edge cases a real folder has: long clips (many frames to seek through), another codec in
    another container, and a phone clip whose pixels are stored sideways."""
    return [
        Clip("long_a", 1280, 720, 30, 300, seed + 1, detail=False),
        Clip("long_b", 1280, 720, 30, 300, seed + 2, detail=False),
        Clip("vp9", 640, 360, 30, 10, seed + 3, codec="libvpx-vp9"),
        Clip("phone", 1920, 1080, 30, 20, seed + 4, rotation=-90),
    ]


def special_slots(count: int, specials: int) -> list[int]:
    """Where in the folder's sorted order the specials go: spread evenly, so the first N files
    (a warm-up, a stock run on a subset) hold a fair share of them and none when N is small."""
    return [round((i + 1) * count / (specials + 1)) for i in range(specials)]


def scene(clip: Clip) -> tuple:
    """The clip's fixed material, drawn once: luma and chroma canvases larger than the frame
    (the camera pans over them), shapes (mask, luma, chroma, position, velocity) and grain fields."""
    rng = np.random.default_rng(clip.seed)
    width, height = clip.width, clip.height
    canvas_w, canvas_h = width + width // 2, height + height // 2
    x = np.linspace(0, 1, canvas_w, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, canvas_h, dtype=np.float32)[:, None]
    a, b = rng.uniform(-1, 1, 2)
    luma = 128 + 70 * (a * x + b * y) / max(1e-3, abs(a) + abs(b))
    block = 16
    blobs = rng.normal(0, 22, (canvas_h // block + 1, canvas_w // block + 1)).astype(np.float32)
    luma = luma + np.kron(blobs, np.ones((block, block), np.float32))[:canvas_h, :canvas_w]
    if clip.detail:
        luma = luma + rng.normal(0, 6, (canvas_h, canvas_w)).astype(np.float32)
    luma = luma.clip(16, 235).astype(np.uint8)
    chroma = []
    for _ in range(2):
        c, d = rng.uniform(-50, 50, 2)
        chroma.append((128 + c * x[:, ::2] + d * y[::2, :]).clip(16, 240).astype(np.uint8))
    shapes = [shape(rng, width, height) for _ in range(8 if clip.detail else 3)]
    grain = [rng.integers(-3, 4, (height, width), dtype=np.int8) for _ in range(GRAIN_FIELDS if clip.detail else 0)]
    pan = rng.uniform(-1, 1, 2) * np.array([width, height]) / 2 / clip.frames * 3  # pixels a frame, a few sweeps
    return luma, chroma[0], chroma[1], shapes, grain, pan


def shape(rng: np.random.Generator, width: int, height: int) -> tuple:
    """An ellipse or a rectangle of one colour, with a start and a velocity (pixels a frame)."""
    w = int(rng.integers(width // 16, width // 4)) // 2 * 2
    h = int(rng.integers(height // 16, height // 4)) // 2 * 2
    if rng.random() < 0.5:
        yy, xx = np.ogrid[-1 : 1 : h * 1j, -1 : 1 : w * 1j]
        mask = xx**2 + yy**2 <= 1
    else:
        mask = np.ones((h, w), bool)
    colour = tuple(int(v) for v in rng.integers(16, 240, 3))
    start = rng.uniform(0, 1, 2) * np.array([width - w, height - h])
    velocity = rng.uniform(-6, 6, 2) * max(width, height) / 1920
    return mask, colour, start, velocity


def bounce(position: np.ndarray, span: np.ndarray) -> np.ndarray:
    """A position moving on a line, folded back into [0, span] (a triangle wave)."""
    folded = np.mod(position, 2 * span)
    return np.where(folded > span, 2 * span - folded, folded)


def draw(material: tuple, clip: Clip, index: int, buffer: np.ndarray) -> np.ndarray:
    """Frame `index` in yuv420p planes (`buffer`: height * 3 / 2 rows of width)."""
    luma, cb, cr, shapes, grain, pan = material
    width, height = clip.width, clip.height
    flat = buffer.reshape(-1)
    y_plane = flat[: width * height].reshape(height, width)
    u_plane = flat[width * height : width * height * 5 // 4].reshape(height // 2, width // 2)
    v_plane = flat[width * height * 5 // 4 :].reshape(height // 2, width // 2)
    left, top = bounce(np.array([width, height]) / 4 + pan * index, np.array([width, height]) / 2).astype(int) // 2 * 2
    y_plane[:] = luma[top : top + height, left : left + width]
    u_plane[:] = cb[top // 2 : top // 2 + height // 2, left // 2 : left // 2 + width // 2]
    v_plane[:] = cr[top // 2 : top // 2 + height // 2, left // 2 : left // 2 + width // 2]
    if grain:
        np.add(y_plane, grain[index % len(grain)], out=y_plane, casting="unsafe")
    for mask, colour, start, velocity in shapes:
        h, w = mask.shape
        x, y = bounce(start + velocity * index, np.array([width - w, height - h])).astype(int) // 2 * 2
        y_plane[y : y + h, x : x + w][mask] = colour[0]
        u_plane[y // 2 : (y + h) // 2, x // 2 : (x + w) // 2][mask[::2, ::2]] = colour[1]
        v_plane[y // 2 : (y + h) // 2, x // 2 : (x + w) // 2][mask[::2, ::2]] = colour[2]
    return buffer


def encoder_options(clip: Clip) -> dict[str, str]:
    """Fast settings: libx264 veryfast (ultrafast for the low-detail long clips), VP9 realtime."""
    if clip.codec == "libvpx-vp9":
        return {"deadline": "realtime", "cpu-used": "8", "row-mt": "1", "crf": "33", "b": "0"}
    return {"preset": "veryfast" if clip.detail else "ultrafast", "crf": "23"}


def write_clip(job: tuple[Path, Clip]) -> int:
    """Encode one clip; its size in bytes."""
    path, clip = job
    material = scene(clip)
    buffer = np.empty((clip.height * 3 // 2, clip.width), np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(clip.codec, rate=clip.fps, options=encoder_options(clip))
        stream.width, stream.height, stream.pix_fmt = clip.width, clip.height, "yuv420p"
        stream.codec_context.gop_size = KEYFRAME_S * clip.fps
        stream.codec_context.thread_count = 1 if clip.detail else 2  # the pool runs one process a core
        if clip.rotation:
            stream.set_display_rotation(clip.rotation)
        for index in range(clip.frames):
            frame = av.VideoFrame.from_ndarray(draw(material, clip, index, buffer), format="yuv420p")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path.stat().st_size


def plan(count: int, seed: int, specials: bool) -> tuple[list[tuple[Path, Clip]], list[tuple[str, str]]]:
    """The distinct clips to encode (name, clip) and the folder's layout: each file's name and the
    distinct clip's name it copies (itself for the distinct ones)."""
    extra = special_clips(seed) if specials else []
    if count < len(extra):
        raise ValueError(f"{count} clips cannot hold the {len(extra)} specials: pass specials=False")
    slots = dict(zip(special_slots(count, len(extra)), extra, strict=True))
    distinct, layout, regular = [], [], 0
    for index in range(count):
        if index in slots:
            clip = slots[index]
            suffix = "webm" if clip.codec == "libvpx-vp9" else "mp4"
            tag = f"_{clip.name}" + (f"_rot{-clip.rotation}" if clip.rotation else "")
            name = clip_name(index, clip.width, clip.height, clip.fps, clip.seconds, suffix, tag)
            distinct.append((name, clip))
            layout.append((name, name))
            continue
        width, height, fps, seconds = KINDS[regular % len(KINDS)]
        name = clip_name(index, width, height, fps, seconds)
        if regular < DISTINCT_PER_KIND * len(KINDS):
            distinct.append((name, Clip(name, width, height, fps, seconds, seed * 100_000 + 10 + regular)))
            layout.append((name, name))
        else:
            source = [n for n, c in distinct if (c.width, c.height, c.fps, c.seconds) == KINDS[regular % len(KINDS)]]
            layout.append((name, source[(regular // len(KINDS)) % len(source)]))
        regular += 1
    return distinct, layout


def write_clip_folder(folder: Path, count: int, seed: int = 0, specials: bool = True, workers: int = 16) -> list[Path]:
    """`count` clips in `folder` (the specials among them, spread through the sorted order); the
    distinct ones encoded in parallel, longest first, the rest copied. Their paths, sorted."""
    folder.mkdir(parents=True, exist_ok=True)
    distinct, layout = plan(count, seed, specials)
    jobs = sorted(((folder / name, clip) for name, clip in distinct), key=lambda job: -job[1].cost)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(write_clip, jobs))
    for name, source in layout:
        if name != source:
            shutil.copyfile(folder / source, folder / name)
    return [folder / name for name, _ in layout]


def write_mixed_folder(folder: Path, photos: int, clips: int, seed: int = 0, specials: bool = True) -> list[Path]:
    """`photos` photos (photos.py) and `clips` clips in one folder, renamed with a leading position
    so that the sorted order interleaves them evenly: batches mix images and videos, as a camera
    roll does. Their paths, sorted."""
    folder.mkdir(parents=True, exist_ok=True)
    made = write_photo_folder(folder, photos, seed) if photos else []
    videos = write_clip_folder(folder, clips, seed, specials and clips >= len(special_clips(seed))) if clips else []
    order = sorted([((i + 0.5) / photos, path) for i, path in enumerate(made)]
                   + [((i + 0.5) / clips, path) for i, path in enumerate(videos)])
    paths = []
    for position, (_, path) in enumerate(order):
        paths.append(path.rename(folder / f"{position:05d}_{path.name}"))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-specials", action="store_true", help="only the regular kinds")
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    started = time.perf_counter()
    paths = write_clip_folder(args.folder, args.count, args.seed, not args.no_specials, args.workers)
    total, seconds = sum(path.stat().st_size for path in paths), time.perf_counter() - started
    print(f"wrote {len(paths)} clips ({total / 2**20:.1f} MiB) to {args.folder} in {seconds:.1f} s")


if __name__ == "__main__":
    main()

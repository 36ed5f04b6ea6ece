"""A video's frames (`app/video.py`): sampled by seeking, the same frames a full decode gives;
scaled once, upright; a full pass where a container cannot be sampled by time, said in the
record; hostile clips bounded by their worker's time limit, the other files unharmed."""

import io
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from privileges import code_env

from encoder_graphs.app.decoders import VideoDecoders, decode_video
from encoder_graphs.app.media import LoadLimits, MediaError
from encoder_graphs.app.video import frame_count, resized

av = pytest.importorskip("av")

LIMITS = LoadLimits(max_frames=8, frame_max_pixels=64 * 48, min_side=8)


def scene(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` of a moving scene: gradients that shift each frame, a bright block that walks."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([(xs * 3 + 5 * index) % 256, (ys * 4 + 3 * index) % 256, (xs + ys + 7 * index) % 256], -1)
    left = (4 * index) % max(1, width - 8)
    pixels[: height // 4, left : left + 8] = 255
    return pixels.astype(np.uint8)


def write_h264(path: Path | io.RawIOBase, frames: int, size: tuple[int, int] = (96, 64), fps: int = 30,
               gop: int = 15, rotation: int = 0, container: str | None = None, options: dict | None = None) -> None:
    """An H.264 clip (B-frames, a keyframe every `gop` frames) of `scene`; `rotation`: the display
    rotation its container states, counter-clockwise degrees as `VideoFrame.rotation` reads it."""
    with av.open(path, "w", format=container, options=options or {}) as output:
        stream = output.add_stream("libx264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"g": str(gop), "bf": "2", "preset": "ultrafast"}
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(scene(index, *size), format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


class _Pipe(io.RawIOBase):
    """A sink that cannot seek back: the muxer writes no duration and no index."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, chunk) -> int:
        self.data += chunk
        return len(chunk)


def write_unindexed_mkv(path: Path, frames: int, size: tuple[int, int] = (96, 64)) -> None:
    pipe = _Pipe()
    write_h264(pipe, frames, size, container="matroska")
    path.write_bytes(bytes(pipe.data))


def write_tiny_avi(path: Path, frames: int, stated_frames: int = 0) -> None:
    """An AVI of `frames` 2x2 grey frames at 1000 fps (10**6 frames: 12 MB), with no index, its
    header stating `stated_frames` (0: no duration). Written by hand: muxing 10**6 packets
    through PyAV takes minutes."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as output:
        stream = output.add_stream("rawvideo", rate=1000)
        stream.width, stream.height, stream.pix_fmt = 2, 2, "gray"
        for packet in stream.encode(av.VideoFrame.from_ndarray(np.zeros((2, 2), np.uint8), format="gray")):
            output.mux(packet)
    data = buffer.getvalue()
    head = bytearray(data[: data.index(b"movi") - 8])
    avih, strh = head.index(b"avih") + 8, head.index(b"strh") + 8
    struct.pack_into("<I", head, avih + 12, struct.unpack_from("<I", head, avih + 12)[0] & ~0x10)  # no index
    struct.pack_into("<I", head, avih + 16, stated_frames)  # dwTotalFrames
    struct.pack_into("<I", head, strh + 32, stated_frames)  # dwLength
    chunks = np.zeros(frames, dtype=[("fourcc", "S4"), ("size", "<u4"), ("data", "u1", 4)])
    chunks["fourcc"], chunks["size"], chunks["data"] = b"00dc", 4, (np.arange(frames) % 256)[:, None]
    body = chunks.tobytes()
    riff = bytes(head[8:]) + b"LIST" + struct.pack("<I", 4 + len(body)) + b"movi" + body
    path.write_bytes(b"RIFF" + struct.pack("<I", len(riff)) + riff)


def every_frame(path: Path, size: tuple[int, int]) -> list[np.ndarray]:
    """Each frame of the stream in presentation order, converted as the sampler converts."""
    with av.open(str(path)) as container:
        return [resized(frame.to_ndarray(format="rgb24"), *size) for frame in container.decode(video=0)]


@pytest.mark.parametrize("fps_limit, count", [(None, 8), (2.0, 8), (0.5, 2)])
def test_seeking_gives_the_frames_a_full_decode_gives(tmp_path, fps_limit, count):
    """Frames reached by seeking (keyframes every half second, B-frames) are the very frames, bit
    for bit, that decoding the whole stream shows at those indices, evenly over the clip."""
    write_h264(tmp_path / "clip.mp4", frames=150)  # 5 s at 30 fps
    limits = LoadLimits(max_frames=8, video_fps=fps_limit, frame_size=(48, 32))
    video = decode_video(tmp_path / "clip.mp4", limits)
    assert video.sampling == "seek"
    expected = np.linspace(0, 149, count).round().astype(int).tolist()
    assert video.metadata == {"fps": 30.0, "frames_indices": expected, "total_num_frames": 150}
    assert video.frames.shape == (count, 32, 48, 3)
    assert video.times == pytest.approx([i / 30 for i in expected], abs=1e-6)
    reference = every_frame(tmp_path / "clip.mp4", (48, 32))
    for index, frame in zip(expected, video.frames, strict=True):
        assert np.array_equal(frame, reference[index]), f"frame {index}"


def test_keyframe_sampling_takes_the_nearest_keyframes_and_exact_frames_elsewhere(tmp_path):
    """`keyframes`: each sampled time moves to a keyframe within half the sampling interval (here
    every 15th frame), else keeps its exact frame; the times recorded are the frames' own."""
    write_h264(tmp_path / "clip.mp4", frames=150)
    limits = LoadLimits(max_frames=8, frame_size=(48, 32), video_sampling="keyframes")
    video = decode_video(tmp_path / "clip.mp4", limits)
    exact = np.linspace(0, 149, 8).round().astype(int).tolist()  # 0, 21, 43, 64, 85, 106, 128, 149
    indices = video.metadata["frames_indices"]
    assert indices == [0, 15, 45, 60, 90, 105, 135, 149] and video.sampling == "seek, 7 of 8 at keyframes"
    assert all(abs(i - e) <= 149 / 7 / 2 for i, e in zip(indices, exact, strict=True))
    reference = every_frame(tmp_path / "clip.mp4", (48, 32))
    for index, frame in zip(indices, video.frames, strict=True):
        assert np.array_equal(frame, reference[index]), f"frame {index}"


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_sampling_of_a_short_clip_gives_the_exact_frames(tmp_path, threads):
    """A 30-frame clip with a keyframe every 5 frames and B-frames, sampled at every count from 2
    to 30 (targets just after keyframes, next to each other, repeated): each frame is the one a
    full decode shows at its index, with 1 to 4 decoder threads (frames no other refers to are
    left undecoded only where they cannot be the frame asked for)."""
    write_h264(tmp_path / "short.mp4", frames=30, gop=5)
    reference = every_frame(tmp_path / "short.mp4", (48, 32))
    for count in range(2, 31, 2):
        limits = LoadLimits(max_frames=count, frame_size=(48, 32), video_threads=threads)
        video = decode_video(tmp_path / "short.mp4", limits)
        assert video.sampling == "seek"
        assert video.metadata["frames_indices"] == np.linspace(0, 29, count).round().astype(int).tolist()
        for index, frame in zip(video.metadata["frames_indices"], video.frames, strict=True):
            assert np.array_equal(frame, reference[index]), f"{count} frames: frame {index}"


def write_trimmed(path: Path, frames: int, cut: int) -> None:
    """An MP4 as `ffmpeg -ss -c copy` cuts one: the packets from a keyframe before the cut kept,
    their times moved so the cut is at 0, the frames before it hidden by an edit list."""
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.options = {"g": "50", "bf": "2", "preset": "ultrafast", "keyint_min": "50", "sc_threshold": "0"}
        packets = []
        for index in range(frames):
            packets += stream.encode(av.VideoFrame.from_ndarray(scene(index, 96, 64), format="rgb24"))
        packets += stream.encode()
        for packet in packets:
            shift = cut * int(1 / (packet.time_base * 30))
            packet.pts, packet.dts = packet.pts - shift, packet.dts - shift
            output.mux(packet)


def test_a_clip_cut_without_reencoding_is_sampled_over_what_it_shows(tmp_path):
    """The container counts the hidden frames before the cut, its duration does not: the frames
    are sampled over the shown ones, by seeking (not a full pass)."""
    write_trimmed(tmp_path / "cut.mp4", frames=200, cut=60)
    video = decode_video(tmp_path / "cut.mp4", LoadLimits(max_frames=8, frame_size=(48, 32)))
    assert video.sampling == "seek"
    assert video.metadata["total_num_frames"] == 140 and video.metadata["frames_indices"][-1] == 139
    reference = every_frame(tmp_path / "cut.mp4", (48, 32))  # the 140 frames shown, as a player shows them
    assert len(reference) == 140
    for index, frame in zip(video.metadata["frames_indices"], video.frames, strict=True):
        assert np.array_equal(frame, reference[index]), f"frame {index}"


def test_keyframe_sampling_reads_a_matroska_index(tmp_path):
    """Matroska loads its index at the first seek: keyframes mode seeks once to read it."""
    write_h264(tmp_path / "clip.mkv", frames=150)
    video = decode_video(tmp_path / "clip.mkv", LoadLimits(max_frames=8, frame_size=(48, 32), video_sampling="keyframes"))
    assert video.sampling == "seek, 7 of 8 at keyframes"


def test_frame_counts_follow_the_clip_length():
    assert frame_count(LoadLimits(max_frames=16), 20.0, 600) == 16
    assert frame_count(LoadLimits(max_frames=16, video_fps=2.0), 20.0, 600) == 16
    assert frame_count(LoadLimits(max_frames=16, video_fps=2.0), 3.7, 111) == 6  # int(7.4) = 7, even: 6
    assert frame_count(LoadLimits(max_frames=16, video_fps=2.0), 0.2, 6) == 2
    assert frame_count(LoadLimits(max_frames=16), 0.1, 3) == 2


def test_a_rotated_phone_clip_comes_upright(tmp_path):
    """A clip stored landscape with a display rotation of -90 degrees (a phone held upright) is
    scaled and turned to what a player shows: portrait, the stored top-left block at the top right."""
    write_h264(tmp_path / "phone.mp4", frames=20, size=(96, 64), rotation=-90)
    video = decode_video(tmp_path / "phone.mp4", LoadLimits(max_frames=4, frame_max_pixels=64 * 96, min_side=8))
    assert video.size == (64, 96)  # displayed width x height
    assert video.frames.shape[1:] == (96, 64, 3)
    first = video.frames[0].astype(int)
    # scene(0) puts a white block at the stored frame's top-left (rows 0-15, columns 0-7)
    assert first[:8, -16:].mean() > 200 and first[:8, :16].mean() < first[:8, -16:].mean() - 50


def test_frames_are_scaled_to_the_models_size_once(tmp_path):
    """The frame size comes from the model's `frame_size` for the clip's size and frame count,
    applied in the decoder's converter: the arrays are already what the model takes."""
    write_h264(tmp_path / "clip.mp4", frames=30, size=(160, 96))
    seen = []

    def size(width: int, height: int, frames: int) -> tuple[int, int]:
        seen.append((width, height, frames))
        return 56, 28

    video = decode_video(tmp_path / "clip.mp4", LoadLimits(max_frames=6, frame_size=size))
    assert seen == [(160, 96, 6)]
    assert video.frames.shape == (6, 28, 56, 3) and video.frames.dtype == np.uint8
    assert video.record()["sampling"] == "seek" and video.record()["frames"] == 6


def test_a_container_without_duration_or_index_is_read_in_one_pass(tmp_path):
    write_unindexed_mkv(tmp_path / "live.mkv", frames=60)
    video = decode_video(tmp_path / "live.mkv", LIMITS)
    assert video.sampling.startswith("full pass: the container gives no duration")
    assert video.frames.shape[0] == 8
    indices = video.metadata["frames_indices"]
    assert indices[0] == 0 and indices == sorted(indices) and indices[-1] >= 50
    reference = every_frame(tmp_path / "live.mkv", video.frames.shape[2:0:-1])
    for index, frame in zip(indices, video.frames, strict=True):
        assert np.array_equal(frame, reference[index])


def overstated(source: Path, target: Path) -> None:
    """`source`, a Matroska file, as `target` with ten times its duration in its header."""
    data = bytearray(source.read_bytes())
    at = data.index(b"\x44\x89\x88")  # Duration, an 8-byte float
    struct.pack_into(">d", data, at + 3, struct.unpack_from(">d", data, at + 3)[0] * 10)
    target.write_bytes(bytes(data))


def test_a_clip_longer_in_its_header_than_in_its_stream_is_read_whole(tmp_path):
    """A Matroska duration that says ten times the stream: seeking finds no frame past the end,
    and one full pass samples the frames that are there, saying why."""
    write_h264(tmp_path / "clip.mkv", frames=40, fps=8)
    overstated(tmp_path / "clip.mkv", tmp_path / "liar.mkv")
    video = decode_video(tmp_path / "liar.mkv", LIMITS)
    assert video.sampling.startswith("full pass: no frame decodes at")
    assert "cut short, or a wrong duration" in video.sampling
    assert video.frames.shape[0] == 8 and video.metadata["frames_indices"][-1] >= 30


def test_a_truncated_clip_is_read_as_far_as_it_goes(tmp_path):
    """An MP4 with its index in front, cut in half: the frames past the cut are not there, so one
    pass samples what decodes; a file cut before its index is a corrupt file."""
    write_h264(tmp_path / "clip.mp4", frames=120, options={"movflags": "faststart"})
    data = (tmp_path / "clip.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])
    video = decode_video(tmp_path / "cut.mp4", LIMITS)
    assert video.sampling.startswith("full pass: ") and "the stream breaks off after" in video.sampling
    assert video.frames.shape[0] == 8 and 8 <= video.metadata["total_num_frames"] < 120
    write_h264(tmp_path / "plain.mp4", frames=120)  # index at the end
    (tmp_path / "headless.mp4").write_bytes((tmp_path / "plain.mp4").read_bytes()[:4000])
    with pytest.raises(MediaError, match="headless.mp4") as error:
        decode_video(tmp_path / "headless.mp4", LIMITS)
    assert error.value.kind == "corrupt"


def test_the_decoder_refuses_huge_frames_by_their_header(tmp_path):
    write_h264(tmp_path / "wide.mp4", frames=2, size=(256, 64))
    with pytest.raises(MediaError) as error:
        decode_video(tmp_path / "wide.mp4", LoadLimits(max_frames=2, max_video_pixels=128 * 64))
    assert error.value.kind == "too_large"


def test_a_million_frames_cost_their_time_limit_and_no_other_file(tmp_path):
    """10**6 tiny frames with no duration and no index must be read whole: the worker is stopped
    at the time limit and the file is a timeout; the pool goes on with the next files, and a
    worker's own errors come back whole (their kind)."""
    write_tiny_avi(tmp_path / "many.avi", 10**6)
    write_h264(tmp_path / "good.mp4", frames=30)
    (tmp_path / "bad.mp4").write_bytes(b"\0\0\0\x18ftypmp42" + b"\xff" * 100)
    decoders = VideoDecoders(2, LoadLimits(max_frames=8, frame_max_pixels=64 * 48, min_side=2, video_timeout_s=1.5))
    try:
        started = time.perf_counter()
        with pytest.raises(MediaError, match="many.avi") as error:
            decoders.decode(tmp_path / "many.avi")
        assert error.value.kind == "timeout" and "--video-timeout" in str(error.value)
        assert time.perf_counter() - started < 15  # the worker's start and the limit
        assert decoders.decode(tmp_path / "good.mp4").frames.shape[0] == 8
        with pytest.raises(MediaError, match="bad.mp4") as error:
            decoders.decode(tmp_path / "bad.mp4")
        assert error.value.kind == "corrupt"
    finally:
        decoders.close()


def test_a_million_frames_with_a_duration_are_sampled_by_time(tmp_path):
    write_tiny_avi(tmp_path / "many.avi", 10**6, stated_frames=10**6)
    video = decode_video(tmp_path / "many.avi", LoadLimits(max_frames=4, frame_max_pixels=64, min_side=2))
    assert video.sampling == "seek" and video.duration_s == pytest.approx(1000, rel=1e-3)
    assert [int(frame.mean()) for frame in video.frames] == pytest.approx(
        [i % 256 for i in video.metadata["frames_indices"]], abs=1
    )


def test_prefetched_decodes_serve_their_files_within_the_memory_bound(tmp_path, monkeypatch):
    """The caption command decodes the first clips while the model loads: `decode` of a prefetched
    file returns that decode's frames (the same as a fresh one); the count stops at what
    PREFETCH_BYTES of frames hold; a bad file prefetched is still its own error."""
    import encoder_graphs.app.decoders as decoders_module

    limits = LoadLimits(max_frames=4, frame_max_pixels=64 * 48, min_side=2)
    clip_bytes = 4 * 64 * 48 * 3
    monkeypatch.setattr(decoders_module, "PREFETCH_BYTES", 2 * clip_bytes)
    for index in range(3):
        write_h264(tmp_path / f"{index}.mp4", frames=12 + index)
    (tmp_path / "bad.mp4").write_bytes(b"\0\0\0\x18ftypmp42" + b"\xff" * 100)
    decoders = VideoDecoders(2, limits).start()
    try:
        paths = [tmp_path / "bad.mp4", tmp_path / "0.mp4", tmp_path / "1.mp4", tmp_path / "2.mp4"]
        assert decoders.prefetch(paths) == 2 and decoders.prefetched == 2
        assert set(decoders._ahead) == set(paths[:2])
        with pytest.raises(MediaError, match="bad.mp4") as error:
            decoders.decode(paths[0])
        assert error.value.kind == "corrupt"
        scheduled = []
        schedule = decoders._schedule
        decoders._schedule = lambda path: scheduled.append(path) or schedule(path)
        video = decoders.decode(paths[1])
        assert scheduled == [] and not decoders._ahead  # the prefetched decode's result, taken once
        fresh = decode_video(paths[1], limits)
        assert video.metadata == fresh.metadata and np.array_equal(video.frames, fresh.frames)
        assert decoders.decode(paths[3]).metadata["total_num_frames"] == 14  # not prefetched: decoded now
        assert scheduled == [paths[3]]
    finally:
        decoders.close()


def _write_many_refs(path: Path, size: tuple[int, int], frames: int) -> None:
    """H.264 that keeps 16 reference frames (the most a stream may), each frame a cheap gradient."""
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=30)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast", "x264-params": "ref=16:bframes=0:keyint=1000"}
        ramp = np.linspace(0, 255, size[0], dtype=np.uint8)
        for index in range(frames):
            image = np.broadcast_to((ramp + np.uint8(8 * index % 256))[None, :, None], (size[1], size[0], 3))
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


@pytest.mark.slow
def test_the_largest_clip_decodes_under_2_gb_and_a_larger_is_refused_by_its_header(tmp_path):
    """The frame limit bounds a decode's memory: DCI 8K, the largest frame allowed, keeping 16
    reference frames decodes in a fresh process that peaks under 2 GB (its imports included);
    8192 x 8192, which peaked at 2.8 GB so, is refused by its header before any frame decodes
    (issue 42, case 4)."""
    _write_many_refs(tmp_path / "uhd.mp4", (8192, 4320), 20)
    _write_many_refs(tmp_path / "square.mp4", (8192, 8192), 2)
    code = textwrap.dedent(f"""
        import sys
        from encoder_graphs.app.media import LoadLimits, MediaError
        from encoder_graphs.app.decoders import decode_video
        video = decode_video({str(tmp_path / "uhd.mp4")!r}, LoadLimits())
        assert video.frames.shape[0] == 16 and video.sampling == "seek", video.sampling
        try:
            decode_video({str(tmp_path / "square.mp4")!r}, LoadLimits())
        except MediaError as error:
            print(error.kind, error)
        # VmHWM, this process's own peak: ru_maxrss keeps the parent's size at the fork before exec.
        status = open("/proc/self/status").read()
        print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=code_env(), check=False)
    assert done.returncode == 0, done.stderr
    refusal, peak = done.stdout.splitlines()
    assert refusal.startswith("too_large") and "8192x8192" in refusal and "square.mp4" in refusal
    assert int(peak) < 2 << 30, f"{int(peak) / 2**30:.2f} GiB"


def test_frames_larger_than_the_first_are_refused(tmp_path):
    """An MJPEG AVI whose header and first frames are 64x48 and whose later frames are 256x192
    (each JPEG carries its own size): every decoded frame is checked by its own size, before its
    RGB copy is made."""
    from PIL import Image

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as output:
        stream = output.add_stream("mjpeg", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        frame = av.VideoFrame.from_ndarray(scene(0, 64, 48), format="rgb24").reformat(format="yuvj420p")
        for packet in [*stream.encode(frame), *stream.encode()]:
            output.mux(packet)
    data = buffer.getvalue()
    head = bytearray(data[: data.index(b"movi") - 8])
    avih, strh = head.index(b"avih") + 8, head.index(b"strh") + 8
    struct.pack_into("<I", head, avih + 12, struct.unpack_from("<I", head, avih + 12)[0] & ~0x10)  # no index
    struct.pack_into("<I", head, avih + 16, 6)  # dwTotalFrames
    struct.pack_into("<I", head, strh + 32, 6)  # dwLength

    def jpeg(index: int, width: int, height: int) -> bytes:
        encoded = io.BytesIO()
        Image.fromarray(scene(index, width, height)).save(encoded, format="JPEG")
        return encoded.getvalue() + b"\0" * (len(encoded.getvalue()) % 2)

    body = b"".join(b"00dc" + struct.pack("<I", len(j)) + j
                    for j in [jpeg(i, *((64, 48) if i < 2 else (256, 192))) for i in range(6)])
    riff = bytes(head[8:]) + b"LIST" + struct.pack("<I", 4 + len(body)) + b"movi" + body
    (tmp_path / "grows.avi").write_bytes(b"RIFF" + struct.pack("<I", len(riff)) + riff)
    with av.open(str(tmp_path / "grows.avi")) as container:
        assert (container.streams.video[0].codec_context.width, container.streams.video[0].height) == (64, 48)
    with pytest.raises(MediaError, match="256x192") as error:
        decode_video(tmp_path / "grows.avi", LoadLimits(max_frames=4, max_video_pixels=128 * 96, min_side=2,
                                                        frame_max_pixels=64 * 48))
    assert error.value.kind == "too_large" and "grows.avi" in str(error.value)


def test_closing_ends_a_decode_under_way(tmp_path):
    """A loader thread waiting on a decode when the run stops must not wait forever (pebble's
    stop can leave the decode under way without an end; the thread would hold the process at
    exit): `close` ends it as cancelled, within moments."""
    import threading

    write_tiny_avi(tmp_path / "many.avi", 10**6)
    for attempt in range(4):  # it hung about half the time before
        decoders = VideoDecoders(1, LoadLimits(max_frames=4, frame_max_pixels=64, min_side=2, video_timeout_s=60))
        decoders.start()
        outcome = []
        waiting = threading.Thread(target=lambda: outcome.append(_error_of(decoders, tmp_path / "many.avi")))
        waiting.start()
        time.sleep(1.0)  # the decode under way
        decoders.close()
        waiting.join(timeout=15)
        assert not waiting.is_alive(), f"attempt {attempt}: the waiting thread never returned"
        assert outcome and outcome[0] == "cancelled", outcome


def test_a_decode_scheduled_as_the_run_closes_ends_too(tmp_path):
    """A loader thread scheduling its decode as `close` runs (here: held just after pebble took
    it, behind a backlog of prefetched clips, as a preempted thread would be) is not left waiting
    forever: its decode is one `close` ends (cancelled), or done where the backlog was decoded
    while it was held."""
    import shutil
    import threading

    write_h264(tmp_path / "clip.mp4", frames=90, size=(320, 240))
    for index in range(60):
        shutil.copy(tmp_path / "clip.mp4", tmp_path / f"copy{index}.mp4")
    decoders = VideoDecoders(1, LoadLimits(max_frames=8, frame_size=(160, 120)))
    decoders.start()
    decoders.prefetch([tmp_path / f"copy{index}.mp4" for index in range(60)])  # a backlog in pebble's queue
    scheduled, closed = threading.Event(), threading.Event()

    class HeldAtAdd(set):
        def add(self, future) -> None:
            if threading.current_thread().name == "loader":
                scheduled.set()
                closed.wait(3)  # `close` runs meanwhile, where it can
            super().add(future)

    held = HeldAtAdd()
    set.update(held, decoders._pending)
    decoders._pending = held
    outcome = []
    loader = threading.Thread(target=lambda: outcome.append(_error_of(decoders, tmp_path / "clip.mp4")), name="loader",
                              daemon=True)
    loader.start()
    scheduled.wait(10)
    decoders.close()
    closed.set()
    loader.join(timeout=20)
    assert not loader.is_alive(), "the loader thread still waits on its decode"
    assert outcome in (["cancelled"], [None]), outcome


def _error_of(decoders: VideoDecoders, path: Path) -> str | None:
    try:
        decoders.decode(path)
    except MediaError as error:
        return error.kind
    return None

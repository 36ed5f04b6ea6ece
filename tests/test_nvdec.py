"""Frames decoded by the GPU's video decoder (`app/nvdec.py`): the very frames and pixels of the
CPU path, or the CPU path itself where NVDEC cannot serve, said in the record."""

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from nvdec_standin import nv12_of
from test_video import write_h264

from encoder_graphs.app.bitstream import avcc_parameter_sets, disposable_h264, interlaced_h264, sps_units
from encoder_graphs.app.decoders import decode_video
from encoder_graphs.app.media import LoadLimits
from encoder_graphs.app.nvdec import annexb_filter, yuv420p

av = pytest.importorskip("av")


@pytest.mark.parametrize("size", [(96, 64), (160, 90), (64, 112)])
def test_an_nv12_picture_converts_as_the_decoders_frame(tmp_path, size):
    """swscale from NV12 straight to RGB is tens of levels off the decoder's frame; through planar
    4:2:0 (what `yuv420p` builds) it is the same bit for bit."""
    write_h264(tmp_path / "clip.mp4", frames=12, size=size)
    with av.open(str(tmp_path / "clip.mp4")) as container:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            rebuilt = yuv420p(nv12_of(frame), frame.width, frame.height, stream.codec_context)
            assert np.array_equal(rebuilt.to_ndarray(format="rgb24"), frame.to_ndarray(format="rgb24"))


def test_units_said_disposable_change_no_other_frame(tmp_path):
    """The access units `disposable_h264` leaves out (B-frames no frame refers to) are there, and
    the CPU decoder given every other unit shows the remaining frames exactly as a full decode."""
    write_h264(tmp_path / "clip.mp4", frames=60, size=(96, 64), gop=30)
    full, kept, dropped = {}, {}, 0
    with av.open(str(tmp_path / "clip.mp4")) as container:
        stream = container.streams.video[0]
        annexb = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", stream)
        decoder = av.CodecContext.create("h264", "r")
        for packet in container.demux(stream):
            for frame in stream.decode(packet):
                full[frame.pts] = frame.to_ndarray(format="rgb24")
            for unit in annexb.filter(packet) if packet.size else []:
                if disposable_h264(bytes(unit)):
                    dropped += 1
                    continue
                for frame in decoder.decode(unit):
                    kept[frame.pts] = frame.to_ndarray(format="rgb24")
        for frame in decoder.decode(None):
            kept[frame.pts] = frame.to_ndarray(format="rgb24")
    assert 10 <= dropped and len(kept) == len(full) - dropped
    for pts, pixels in kept.items():
        assert np.array_equal(pixels, full[pts]), pts


@pytest.mark.parametrize("container", ["mp4", "matroska", "mpegts"])
def test_every_unit_sent_to_nvdec_is_annex_b(tmp_path, container):
    """MP4 and Matroska hold H.264 as length-prefixed NAL units, filtered to Annex B; MPEG-TS
    holds Annex B already, left as it is: every unit starts with a start code."""
    write_h264(tmp_path / "clip", frames=20, container=container)
    with av.open(str(tmp_path / "clip")) as source:
        stream = source.streams.video[0]
        annexb = annexb_filter(stream)
        assert (annexb is None) == (container == "mpegts")
        units = [bytes(unit) for packet in source.demux(stream) if packet.size
                 for unit in (annexb.filter(packet) if annexb else [packet])]
    assert len(units) == 20 and all(unit.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01")) for unit in units)


def test_without_nvdec_the_cpu_decodes_the_same_frames_and_says_why(tmp_path, monkeypatch):
    """Asked for NVDEC where it cannot serve, the file is decoded on the CPU, the same frames, and
    the record's sampling says so and why."""
    monkeypatch.setattr("encoder_graphs.app.nvdec.available", lambda: False)
    write_h264(tmp_path / "clip.mp4", frames=90, size=(96, 64))
    limits = LoadLimits(max_frames=8, frame_size=(48, 32))
    cpu = decode_video(tmp_path / "clip.mp4", limits)
    asked = decode_video(tmp_path / "clip.mp4", LoadLimits(max_frames=8, frame_size=(48, 32), video_hwaccel="nvdec"))
    assert asked.sampling == "seek, cpu (PyNvVideoCodec is not installed)"
    assert asked.decoder == "cpu: PyNvVideoCodec is not installed" and cpu.decoder == "cpu"
    assert asked.record()["decoder"] == asked.decoder
    assert asked.times == cpu.times and np.array_equal(asked.frames, cpu.frames)
    with pytest.raises(ValueError, match="video_hwaccel"):
        LoadLimits(video_hwaccel="cuda")


def test_asking_for_nvdec_where_it_cannot_run_is_a_usage_error(tmp_path, capsys):
    """`--video-decoder nvdec` on a machine without CUDA (this CPU machine) or without
    PyNvVideoCodec exits 2 naming the flag, before any file is captioned; a dry run says so, of
    a folder and of dataset shards."""
    from test_cli import good_images
    from test_shards import write_shards

    from encoder_graphs.app.cli import main

    good_images(tmp_path / "media", 1)
    out = tmp_path / "caps.jsonl"
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--video-decoder", "nvdec", "--out", str(out)]) == 2
    assert "--video-decoder nvdec needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--video-decoder", "nvdec", "--dry-run",
                 "--out", str(out)]) == 0
    assert "not here: --video-decoder nvdec needs a CUDA device" in capsys.readouterr().out
    write_shards(tmp_path / "wds", 1, 2)
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--video-decoder", "nvdec", "--dry-run"]) == 0
    assert "not here: --video-decoder nvdec needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_auto_takes_nvdec_where_it_runs_for_jobs_that_repay_its_start(tmp_path, capsys):
    """`--video-decoder auto` (the default): NVDEC from `NVDEC_FROM_VIDEOS` videos a GPU where it
    can run, else the CPU; the flag's own choices pass; a dry run says which and why."""
    from test_cli import good_images

    from encoder_graphs.app.cli import build_parser, main
    from encoder_graphs.app.config import NVDEC_FROM_VIDEOS
    from encoder_graphs.app.nvdec import chosen

    assert build_parser().parse_args(["caption", "x"]).video_decoder == "auto"
    assert chosen("auto", True, NVDEC_FROM_VIDEOS, 1) == "nvdec"
    assert chosen("auto", True, NVDEC_FROM_VIDEOS - 1, 1) == "cpu"
    assert chosen("auto", True, 2 * NVDEC_FROM_VIDEOS - 1, 2) == "cpu"  # a GPU's share
    assert chosen("auto", False, 10**6, 1) == "cpu"
    assert chosen("nvdec", True, 1, 1) == "nvdec" and chosen("cpu", True, 10**6, 1) == "cpu"

    good_images(tmp_path / "media", 1)
    write_h264(tmp_path / "media" / "clip.mp4", frames=4, size=(64, 48))
    out = tmp_path / "caps.jsonl"
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--dry-run", "--out", str(out)]) == 0
    assert f"video decoder: cpu (--video-decoder auto: 1 video, fewer than {NVDEC_FROM_VIDEOS} a GPU)" in capsys.readouterr().out
    for n in range(NVDEC_FROM_VIDEOS):  # a dry run reads names only
        (tmp_path / "media" / f"more{n}.mp4").write_bytes(b"x")
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--dry-run", "--out", str(out)]) == 0
    assert "video decoder: cpu (--video-decoder auto: NVDEC needs a CUDA device" in capsys.readouterr().out
    for n in range(NVDEC_FROM_VIDEOS):
        (tmp_path / "media" / f"more{n}.mp4").unlink()
    (tmp_path / "media" / "clip.mp4").unlink()
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--dry-run", "--out", str(out)]) == 0
    assert "video decoder" not in capsys.readouterr().out  # no videos: nothing to say


def test_auto_is_decided_by_the_videos_a_gpu_where_the_limits_are_made(monkeypatch):
    """`load_limits` reads the job's videos (a dataset's foretold) and its GPUs for `auto`."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from encoder_graphs.app.cli import build_parser
    from encoder_graphs.app.config import NVDEC_FROM_VIDEOS, CaptionConfig
    from encoder_graphs.app.distributed import Job
    from encoder_graphs.app.model_checks import load_limits
    from encoder_graphs.app.plan import Plan
    from encoder_graphs.app.settings import Settings

    monkeypatch.setattr("encoder_graphs.app.nvdec.available", lambda: True)  # as where the extra is installed
    source = SimpleNamespace(inputs=SimpleNamespace(min_side=28, max_image_pixels=1280 * 784, max_frame_pixels=256 * 784, frame_size=None,
                                                     reads_videos=True))
    settings = Settings.from_arguments(build_parser().parse_args(["caption", "x"]))

    def decoder(videos: int, world_size: int = 1, device: str = "cuda", expected: int | None = None) -> str | None:
        plan = Plan(settings, [], [], [], CaptionConfig(), None, None, Job(world_size=world_size),
                    counted=Counter(video=videos), videos_expected=expected)
        return load_limits(plan, source, 4, torch.device(device, 0)).video_hwaccel

    assert decoder(NVDEC_FROM_VIDEOS) == "nvdec" and decoder(NVDEC_FROM_VIDEOS - 1) is None
    assert decoder(2 * NVDEC_FROM_VIDEOS, 2) == "nvdec" and decoder(2 * NVDEC_FROM_VIDEOS - 1, 2) is None
    assert decoder(64, expected=NVDEC_FROM_VIDEOS) == "nvdec"  # a dataset: its foretold videos
    assert decoder(10**6, device="cpu") is None


def test_the_reasons_the_statistics_count_are_a_few_words():
    """`DecodedVideo.decoder` keys the run's counts: NVDEC's reasons without sizes or error texts."""
    from encoder_graphs.app.nvdec import reason

    assert reason("size 96x64") == "size WxH" and reason("codec vp9") == "codec vp9"
    assert reason("nvdec failed: CUDA_ERROR_INVALID_VALUE at 1920x1080, cpu (oops)") == "nvdec failed"


def test_batches_leave_room_for_what_nvdec_workers_take_after_the_sizing():
    """NVDEC's workers hold GPU memory (a CUDA context each from their start, a decoder from their
    first clip): the sizing leaves out the decoders, and the contexts not made yet (all of them
    where the pool starts after it: one the Captioner starts at its first video)."""
    from dataclasses import replace

    import torch

    from encoder_graphs.app.config import CaptionConfig
    from encoder_graphs.app.decoders import video_workers
    from encoder_graphs.app.job import CaptionJob, nvdec_bytes_later
    from encoder_graphs.app.nvdec import CONTEXT_GPU_BYTES, DECODER_GPU_BYTES, WORKER_GPU_BYTES

    job = CaptionJob(device=torch.device("cuda", 0), model_name="m", config=CaptionConfig(load_workers=20),
                     limits=LoadLimits(video_hwaccel="nvdec"), longest=100, longest_image=50)
    workers = video_workers(20)
    assert WORKER_GPU_BYTES == CONTEXT_GPU_BYTES + DECODER_GPU_BYTES
    assert nvdec_bytes_later(job, 10, worker_contexts=0) == workers * WORKER_GPU_BYTES > 0
    assert nvdec_bytes_later(job, 10, worker_contexts=workers) == workers * DECODER_GPU_BYTES
    assert nvdec_bytes_later(job, 10, worker_contexts=1) == workers * DECODER_GPU_BYTES + (workers - 1) * CONTEXT_GPU_BYTES
    assert nvdec_bytes_later(job, 0, worker_contexts=0) == 0  # no videos: no workers
    assert nvdec_bytes_later(replace(job, limits=LoadLimits()), 10, worker_contexts=0) == 0  # the CPU's


def encode(path: Path, codec: str, options: dict, frames: int, size: tuple[int, int], container: str | None = None) -> None:
    """`frames` of `test_video.scene` at `size`, 30 fps, coded by `codec` with `options`."""
    from test_video import scene

    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream(codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        stream.options = options
        for index in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(scene(index, *size), format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


def write_vp9(path: Path, frames: int, size: tuple[int, int] = (96, 64)) -> None:
    encode(path, "libvpx-vp9", {}, frames, size)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="needs PyNvVideoCodec (benchmarks/run_gpu.sh carries it)")
def test_nvdec_workers_hold_their_cuda_context_once_started():
    """An NVDEC pool's workers make their CUDA contexts as they start, so that once `wait_started`
    returns the GPU's free memory (what the batch sizing reads) has them taken; a CPU pool's take none."""
    import torch

    from encoder_graphs.app.decoders import VideoDecoders
    from encoder_graphs.app.nvdec import CONTEXT_GPU_BYTES

    torch.cuda.init()
    for hwaccel, workers in (("nvdec", 4), (None, 0)):
        free = torch.cuda.mem_get_info()[0]
        videos = VideoDecoders(4, LoadLimits(video_hwaccel=hwaccel)).start()
        try:
            assert videos.wait_started() == workers  # each worker's own count, not the start tasks'
            taken = free - torch.cuda.mem_get_info()[0]
            assert 0.75 * workers * CONTEXT_GPU_BYTES <= taken <= 1.25 * workers * CONTEXT_GPU_BYTES + (64 << 20), taken
        finally:
            videos.close()


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="needs PyNvVideoCodec (benchmarks/run_gpu.sh carries it)")
def test_nvdec_gives_the_cpu_paths_frames_bit_for_bit(tmp_path):
    """On a GPU, clips of B-frames at several sizes (1080 rows: NVDEC decodes 1088 and crops), a
    rotated phone clip, a Matroska file, variable frame rates and HEVC's open GOPs, one after
    another in one process (its decoder made once, reconfigured, made anew for a larger size or
    another codec), give the CPU path's times and pixels, served by NVDEC; a VP9 clip, an
    interlaced one and an HEVC one smaller than NVDEC decodes are decoded on the CPU and say so."""
    clips = {
        "small.mp4": {"size": (96, 64), "frames": 90, "gop": 15},
        "hd.mp4": {"size": (1920, 1080), "frames": 75, "gop": 30},
        "portrait.mp4": {"size": (360, 640), "frames": 60, "gop": 60},
        "phone.mp4": {"size": (320, 180), "frames": 40, "gop": 20, "rotation": -90},
        "clip.mkv": {"size": (128, 72), "frames": 50, "gop": 25, "container": "matroska"},
    }
    for name, options in clips.items():
        write_h264(tmp_path / name, **options)
    for name, write in CLIPS.items():  # variable frame rates, HEVC's open GOPs (the stand-in's clips)
        write(tmp_path / name)
    write_vp9(tmp_path / "web.webm", frames=30)
    write_interlaced(tmp_path / "tv.mp4")
    write_hevc_open_gop(tmp_path / "tiny_hevc.mp4", 30, size=(96, 64))
    refused = {"web.webm": "codec vp9", "tv.mp4": "interlaced", "tiny_hevc.mp4": "size 96x64"}
    for name in [*clips, *CLIPS, *refused, "small.mp4"]:
        for limits in (LoadLimits(max_frames=8, frame_max_pixels=200_704), LoadLimits(max_frames=16, min_side=8)):
            cpu = decode_video(tmp_path / name, limits)
            gpu = decode_video(tmp_path / name, LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
            expected = f"{cpu.sampling}, cpu ({refused[name]})" if name in refused else f"{cpu.sampling}, nvdec"
            assert gpu.sampling == expected, name
            assert gpu.decoder == ("cpu: " + refused[name].replace("96x64", "WxH") if name in refused else "nvdec")
            assert gpu.times == cpu.times and gpu.size == cpu.size, name
            assert np.array_equal(gpu.frames, cpu.frames), (name, np.abs(gpu.frames.astype(int) - cpu.frames).max())


def write_timed(path: Path, pts_ms: list[int], size: tuple[int, int] = (96, 64)) -> None:
    """An H.264 MP4 (B-frames) whose frames are shown at `pts_ms` (a variable frame rate)."""
    from fractions import Fraction

    from test_video import scene

    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 1000)
        stream.options = {"g": "15", "bf": "2", "preset": "ultrafast"}
        for index, ms in enumerate(pts_ms):
            frame = av.VideoFrame.from_ndarray(scene(index, *size), format="rgb24")
            frame.pts, frame.time_base = ms, Fraction(1, 1000)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


def write_hevc_open_gop(path: Path, frames: int, size: tuple[int, int] = (96, 64)) -> None:
    """An HEVC MP4 of x265's open GOPs: each CRA keyframe has RASL pictures that refer to the GOP before."""
    params = "keyint=30:min-keyint=30:scenecut=0:open-gop=1:bframes=4:log-level=none"
    encode(path, "libx265", {"preset": "fast", "x265-params": params}, frames, size)


CLIPS = {
    "cfr.mp4": lambda path: write_h264(path, frames=90, gop=15),
    "short.mp4": lambda path: write_h264(path, frames=20, gop=15),
    "long_gop.mkv": lambda path: write_h264(path, frames=120, gop=60, container="matroska"),
    "vfr.mp4": lambda path: write_timed(path, [0, 100, 133, 166, 199, 216, 316, 349, 366, 399, 432, 532]),
    "gaps.mp4": lambda path: write_timed(path, [33 * i + (400 if i > 40 else 0) for i in range(80)]),
    "open_gop_hevc.mp4": lambda path: write_hevc_open_gop(path, 90, size=(256, 144)),  # NVDEC's HEVC: 144 rows at least
}


@pytest.mark.parametrize("name", sorted(CLIPS))
@pytest.mark.parametrize("sampling", ["exact", "keyframes"])
def test_the_frames_nvdec_is_asked_for_are_the_cpu_paths(tmp_path, monkeypatch, name, sampling):
    """With a stand-in for NVDEC's contract (tests/nvdec_standin.py: each packet's own picture, in
    decode order, a stretch refused unless it starts at a keyframe), the frames the sampler picks
    from the packets' timestamps are the CPU path's: constant and variable frame rates, a frame
    whose time the last one already passed, dense targets on a short clip, Matroska, HEVC's open
    GOPs (RASL pictures left out after a seek, as FFmpeg does)."""
    from nvdec_standin import install

    CLIPS[name](tmp_path / name)
    install(monkeypatch, tmp_path / name)
    for limits in (LoadLimits(max_frames=16, frame_size=(48, 32), video_sampling=sampling),
                   LoadLimits(max_frames=8, frame_size=(48, 32), video_sampling=sampling, video_fps=2.0)):
        cpu = decode_video(tmp_path / name, limits)
        gpu = decode_video(tmp_path / name, LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
        assert gpu.sampling == f"{cpu.sampling}, nvdec", gpu.sampling
        assert gpu.decoder == "nvdec" and cpu.decoder == "cpu"
        assert gpu.times == cpu.times
        assert np.array_equal(gpu.frames, cpu.frames)


def write_interlaced(path: Path, frames: int = 30, size: tuple[int, int] = (96, 64), params: str = "tff=1",
                     container: str | None = None) -> None:
    """An H.264 clip coded interlaced (x264's MBAFF, top field first), or as `params` say."""
    encode(path, "libx264", {"g": "15", "preset": "ultrafast", "x264-params": params}, frames, size, container)


def test_an_interlaced_clip_is_left_to_the_cpu_and_says_so(tmp_path, monkeypatch):
    """FFmpeg weaves an interlaced picture's fields, NVDEC's output of them need not match: such
    a clip is decoded on the CPU, its record saying why, its frames the CPU path's."""
    from nvdec_standin import install

    write_interlaced(tmp_path / "tv.mp4")
    install(monkeypatch, tmp_path / "tv.mp4")
    limits = LoadLimits(max_frames=8, frame_size=(48, 32))
    cpu = decode_video(tmp_path / "tv.mp4", limits)
    gpu = decode_video(tmp_path / "tv.mp4", LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
    assert gpu.sampling == f"{cpu.sampling}, cpu (interlaced)"
    assert gpu.times == cpu.times and np.array_equal(gpu.frames, cpu.frames)


def test_a_clip_seeking_cannot_serve_on_nvdec_goes_to_one_full_pass(tmp_path, monkeypatch):
    """A Matroska header stating ten times the stream: NVDEC's seeking finds no frame past the
    end, which the CPU's seeking would meet again, so the file goes straight to the CPU's one full
    pass (not a second seeking pass first), its record saying so; its frames the CPU path's."""
    from nvdec_standin import install
    from test_video import overstated

    from encoder_graphs.app.video import Sampler

    write_h264(tmp_path / "clip.mkv", frames=40, fps=8)
    overstated(tmp_path / "clip.mkv", tmp_path / "liar.mkv")
    install(monkeypatch, tmp_path / "liar.mkv")
    limits = LoadLimits(max_frames=8, frame_size=(48, 32))
    cpu = decode_video(tmp_path / "liar.mkv", limits)
    seeking, by_seeking = [], Sampler.by_seeking
    monkeypatch.setattr(Sampler, "by_seeking", lambda self: seeking.append(type(self).__name__) or by_seeking(self))
    gpu = decode_video(tmp_path / "liar.mkv", LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
    assert seeking == ["NvdecSampler"]
    assert cpu.sampling.startswith("full pass: no frame decodes at") and gpu.sampling == f"{cpu.sampling}, cpu (a full pass)"
    assert gpu.times == cpu.times and np.array_equal(gpu.frames, cpu.frames)


@pytest.mark.parametrize("params", ["tff=1", "bff=1", "", "profile=baseline"])
def test_an_h264_streams_parameter_sets_say_whether_it_codes_fields(tmp_path, params):
    """`interlaced_h264` reads frame_mbs_only_flag from x264's parameter sets (High profile and
    baseline): from the avcC header of an MP4, and from those an MPEG-TS stream carries in-band
    at its keyframes."""
    write_interlaced(tmp_path / "clip.mp4", frames=8, params=params)
    write_interlaced(tmp_path / "clip.ts", frames=8, params=params, container="mpegts")
    fields = "tff" in params or "bff" in params
    with av.open(str(tmp_path / "clip.mp4")) as container:
        units = avcc_parameter_sets(container.streams.video[0].codec_context.extradata)
    assert len(units) == 1 and interlaced_h264(units[0]) is fields
    with av.open(str(tmp_path / "clip.ts")) as container:
        stream = container.streams.video[0]
        assert avcc_parameter_sets(stream.codec_context.extradata or b"") == []
        keyframe = next(bytes(p) for p in container.demux(stream) if p.size and p.is_keyframe)
    assert [interlaced_h264(unit) for unit in sps_units(keyframe)] == [fields]


def sps_bits(fields: bool, order: int, chroma: int) -> bytes:
    """A High 4:4:4 or High profile SPS unit written bit by bit (H.264 7.3.2.1.1), with scaling
    lists (deltas, one cut short by a zero scale) and picture order count type `order`."""
    bits: list[int] = []

    def u(value: int, n: int) -> None:
        bits.extend((value >> (n - 1 - k)) & 1 for k in range(n))

    def ue(value: int) -> None:
        u(value + 1, 2 * (value + 1).bit_length() - 1)

    def se(value: int) -> None:
        ue(2 * value - 1 if value > 0 else -2 * value)

    u(244 if chroma == 3 else 100, 8), u(0, 8), u(40, 8), ue(0), ue(chroma)
    if chroma == 3:
        u(0, 1)
    ue(0), ue(0), u(0, 1), u(1, 1)  # bit depths, bypass, seq_scaling_matrix_present_flag
    for index in range(12 if chroma == 3 else 8):
        u(index % 2, 1)
        if index % 2:
            size = 16 if index < 6 else 64
            deltas = [3, -5, 7] + [1] * (size - 3) if index != 3 else [2, -10]  # -10: the next scale 0, the list ends
            for delta in deltas:
                se(delta)
    ue(2), ue(order)
    if order == 0:
        ue(3)
    elif order == 1:
        u(1, 1), se(-2), se(5), ue(2), se(1), se(-1)
    ue(4), u(0, 1), ue(119), ue(67 if fields else 134)
    u(0 if fields else 1, 1)
    u(1, 1)  # what follows: direct_8x8_inference_flag
    bits.extend([1] + [0] * (-(len(bits) + 1) % 8))  # the stop bit, aligned
    payload = bytes(int("".join(map(str, bits[at:at + 8])), 2) for at in range(0, len(bits), 8))
    return b"\x67" + payload.replace(b"\x00\x00", b"\x00\x00\x03")  # emulation prevention (enough here)


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("chroma", [1, 3])
def test_the_parameter_set_reader_skips_scaling_lists_and_order_counts(order, chroma):
    """An SPS x264 never writes (scaling matrices, picture order count type 1, 4:4:4): the flag is
    read where H.264 puts it, for fields and frames alike (a reader off by a bit would read the
    same bit for both)."""
    assert interlaced_h264(sps_bits(True, order, chroma)) is True
    assert interlaced_h264(sps_bits(False, order, chroma)) is False


def test_a_full_pass_keeps_why_nvdec_left_the_clip_to_the_cpu(tmp_path, monkeypatch):
    """A VP9 WebM whose header states ten times its stream: NVDEC refuses the codec, the CPU's
    seeking finds no frame past the end, one full pass reads it; the record keeps both reasons."""
    from nvdec_standin import install
    from test_video import overstated

    write_vp9(tmp_path / "web.webm", frames=30)
    overstated(tmp_path / "web.webm", tmp_path / "liar.webm")
    write_h264(tmp_path / "any.mp4", frames=4)
    install(monkeypatch, tmp_path / "any.mp4")
    limits = LoadLimits(max_frames=8, frame_size=(48, 32))
    cpu = decode_video(tmp_path / "liar.webm", limits)
    gpu = decode_video(tmp_path / "liar.webm", LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
    assert cpu.sampling.startswith("full pass: ") and gpu.sampling == f"{cpu.sampling}, cpu (codec vp9; a full pass)"
    assert gpu.decoder == "cpu: codec vp9; a full pass" and cpu.decoder == "cpu"
    assert np.array_equal(gpu.frames, cpu.frames)


def test_nvdec_refuses_what_it_cannot_decode(tmp_path, monkeypatch):
    """Sizes below NVDEC's smallest for the codec (H.264's 48 x 16, HEVC's 144 x 144: it fails to
    make a decoder there) and other codecs are left to the CPU, each with its reason."""
    from nvdec_standin import install

    from encoder_graphs.app.nvdec import refusal

    write_h264(tmp_path / "h264.mp4", frames=4, size=(96, 64))
    write_h264(tmp_path / "narrow.mp4", frames=4, size=(32, 16))
    write_hevc_open_gop(tmp_path / "hevc.mp4", 4, size=(96, 64))
    write_vp9(tmp_path / "vp9.webm", frames=4)
    install(monkeypatch, tmp_path / "h264.mp4")
    refused = {"h264.mp4": None, "narrow.mp4": "size 32x16", "hevc.mp4": "size 96x64", "vp9.webm": "codec vp9"}
    for name, why in refused.items():
        with av.open(str(tmp_path / name)) as container:
            assert refusal(container.streams.video[0]) == why, name


def test_a_unit_holding_a_parameter_set_or_a_reference_field_is_not_disposable():
    """FFmpeg's NONREF skip leaves out slices, not the parameter sets beside them, and a field pair
    whose second field is a reference is needed."""
    start = b"\x00\x00\x00\x01"
    nonref_slice, ref_slice, pps, aud = start + b"\x01\x9a", start + b"\x41\x9a", start + b"\x68\xce", start + b"\x09\xf0"
    assert disposable_h264(aud + nonref_slice)
    assert disposable_h264(nonref_slice + nonref_slice)
    assert not disposable_h264(aud + pps + nonref_slice)
    assert not disposable_h264(nonref_slice + ref_slice)
    assert not disposable_h264(aud)


def test_the_video_decoders_start_before_the_model_for_folders_and_datasets(tmp_path):
    """`start_video_decoders` (called before the weights load) starts the pool where the job has
    videos the model reads: a folder's first clips decode meanwhile; a dataset's, foretold by its
    first samples, are in its shards, so none is prefetched; a model of images starts none."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from encoder_graphs.app.cli import build_parser
    from encoder_graphs.app.command import start_video_decoders
    from encoder_graphs.app.config import CaptionConfig
    from encoder_graphs.app.distributed import Job
    from encoder_graphs.app.job import CaptionJob
    from encoder_graphs.app.plan import Plan
    from encoder_graphs.app.settings import Settings
    from encoder_graphs.app.walk import MediaFile

    write_h264(tmp_path / "clip.mp4", frames=8, size=(64, 48))
    settings = Settings.from_arguments(build_parser().parse_args(["caption", str(tmp_path)]))
    job = CaptionJob(device=torch.device("cpu"), model_name="m", config=CaptionConfig(load_workers=2),
                     limits=LoadLimits(max_frames=4, frame_size=(64, 48)), longest=100, longest_image=50)
    clip = MediaFile(tmp_path / "clip.mp4", "video")
    folder = Plan(settings, [tmp_path], [clip], [clip], CaptionConfig(), None, None, Job())
    dataset = Plan(settings, [], [], [], CaptionConfig(), None, None, Job(), counted=Counter(video=1), videos_expected=500)
    # its first samples had no video, and its videos are foretold: a pool, and nothing to prefetch
    foretold = Plan(settings, [tmp_path], [clip], [clip], CaptionConfig(), None, None, Job(), counted=Counter(image=9),
                    videos_expected=5)
    none_foretold = Plan(settings, [], [], [], CaptionConfig(), None, None, Job(), counted=Counter(video=3), videos_expected=0)
    reads, reads_not = SimpleNamespace(reads_videos=True), SimpleNamespace(reads_videos=False)
    assert start_video_decoders(none_foretold, job, reads) is None
    for plan, prefetched in ((folder, 1), (dataset, 0), (foretold, 0)):
        videos = start_video_decoders(plan, job, reads)
        try:
            assert videos is not None and videos.prefetched == prefetched
        finally:
            videos.close()
    assert start_video_decoders(dataset, job, reads_not) is None
    assert start_video_decoders(Plan(settings, [], [], [], CaptionConfig(), None, None, Job()), job, reads) is None


def test_a_pool_for_nvdec_whose_workers_cannot_reach_their_gpu_still_decodes(tmp_path):
    """An NVDEC worker makes its CUDA context as it starts; where that fails (here: a GPU that no
    machine has) the pool is not broken: the clip is decoded by the CPU, and its record says why."""
    from encoder_graphs.app.decoders import VideoDecoders

    write_h264(tmp_path / "clip.mp4", frames=8, size=(64, 48))
    limits = LoadLimits(max_frames=4, frame_size=(64, 48), video_hwaccel="nvdec", video_device=99)
    videos = VideoDecoders(2, limits).start()
    try:
        started = time.monotonic()
        assert videos.wait_started() == 0 and time.monotonic() - started < 30  # each worker tried, none holds one
        decoded = videos.decode(tmp_path / "clip.mp4")
    finally:
        videos.close()
    assert decoded.frames.shape[0] == 4 and decoded.decoder.startswith("cpu: ")


def test_a_pool_whose_nvdec_takes_too_few_clips_hands_the_rest_to_cpu_workers(tmp_path, monkeypatch):
    """NVDEC's workers cost the model GPU time whether or not NVDEC takes the clips: where it took
    fewer than a quarter of the first `NVDEC_TRIAL` (here it takes none: no GPU 99), the rest go
    to a pool of CPU workers, each record saying why; NVDEC's workers end; clips scheduled as the
    pools change hands are not lost; the summary names both decoders."""
    from concurrent.futures import ThreadPoolExecutor

    from encoder_graphs.app import decoders
    from encoder_graphs.app.runstats import RunStats

    monkeypatch.setattr(decoders, "NVDEC_TRIAL", 3)
    clips = []
    for index in range(10):
        clips.append(tmp_path / f"clip{index}.mp4")
        write_h264(clips[-1], frames=8, size=(64, 48))
    limits = LoadLimits(max_frames=4, frame_size=(64, 48), video_hwaccel="nvdec", video_device=99)
    videos = decoders.VideoDecoders(2, limits).start()
    try:
        first = [videos.decode(clip) for clip in clips[:3]]
        assert videos.nvdec_off == "NVDEC turned off: it took 0 of the first 3 clips"
        nvdec_pool = videos._retired[0]
        with ThreadPoolExecutor(4) as threads:  # the rest, side by side
            rest = list(threads.map(videos.decode, clips[3:]))
        deadline = time.monotonic() + 30  # its workers end by themselves once its decodes are done
        while nvdec_pool.active and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not nvdec_pool.active
    finally:
        videos.close()
    assert all(decoded.decoder.startswith("cpu: ") and decoded.decoder != "cpu: nvdec off" for decoded in first)
    assert [decoded.decoder for decoded in rest] == ["cpu: nvdec off"] * 7
    assert all(decoded.sampling.endswith(", cpu (NVDEC turned off: it took 0 of the first 3 clips)") for decoded in rest)
    assert all(decoded.frames.shape == (4, 48, 64, 3) for decoded in first + rest)
    stats = RunStats()
    for decoded in first + rest:
        stats.captioned("video", decoded.record())
    assert stats.video_decoder("nvdec") == "nvdec, then cpu"


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="needs PyNvVideoCodec (benchmarks/run_gpu.sh carries it)")
def test_a_pool_whose_nvdec_takes_the_clips_keeps_it(tmp_path, monkeypatch):
    """On a GPU, NVDEC takes H.264 clips, and its pool stays NVDEC's past the trial."""
    from encoder_graphs.app import decoders

    monkeypatch.setattr(decoders, "NVDEC_TRIAL", 2)
    for index in range(4):
        write_h264(tmp_path / f"clip{index}.mp4", frames=16, size=(320, 240))
    videos = decoders.VideoDecoders(2, LoadLimits(max_frames=4, frame_size=(160, 120), video_hwaccel="nvdec")).start()
    try:
        decoded = [videos.decode(tmp_path / f"clip{index}.mp4") for index in range(4)]
    finally:
        videos.close()
    assert videos.nvdec_off is None and [d.decoder for d in decoded] == ["nvdec"] * 4


def test_a_torchrun_jobs_summary_says_where_a_rank_ended_nvdec():
    """Each rank's pool decides for itself: the job's summary names NVDEC then the CPU where any
    rank's did, whichever rank it was, and the decoders' counts are summed."""
    from encoder_graphs.app.jobstats import combined_stats
    from encoder_graphs.app.runstats import RunStats

    def rank(decoders: list[str]) -> dict:
        stats = RunStats(wall_s=1.0)
        for decoder in decoders:
            stats.captioned("video", {"decoder": decoder})
            stats.succeeded += 1
        return {**stats.as_dict(), "video_decoder": stats.video_decoder("nvdec"), "interrupted": False,
                "sidecars": 0, "sidecar_errors": 0}  # the command's summary adds these

    kept, ended = rank(["nvdec"] * 3), rank(["cpu: codec"] * 2 + ["cpu: nvdec off"] * 4)
    assert (kept["video_decoder"], ended["video_decoder"]) == ("nvdec", "nvdec, then cpu")
    for ranks in ({0: kept, 1: ended}, {0: ended, 1: kept}):
        job = combined_stats(ranks)
        assert job["video_decoder"] == "nvdec, then cpu"
        assert job["video_decoders"] == {"cpu: codec": 2, "cpu: nvdec off": 4, "nvdec": 3}
    assert combined_stats({0: kept, 1: rank(["nvdec"])})["video_decoder"] == "nvdec"


def test_nvdecs_trial_is_decided_once_and_switches_once(monkeypatch):
    """The first `NVDEC_TRIAL` clips decide, once: a pool kept at the trial's end stays NVDEC's
    whatever follows; one that switches does it once, though the trial's last clips come back on
    several loader threads at the same time, and the pool ended meanwhile is not joined by it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from encoder_graphs.app import decoders
    from encoder_graphs.app.video import DecodedVideo

    monkeypatch.setattr(decoders, "NVDEC_TRIAL", 4)

    def clip(decoder: str) -> DecodedVideo:
        return DecodedVideo(np.zeros((2, 2, 2, 3), np.uint8), {}, (2, 2), (0.0, 0.5), 1.0, "seek", decoder)

    kept = decoders.VideoDecoders(1, LoadLimits(video_hwaccel="nvdec", video_device=99))
    try:
        for decoder in ["nvdec"] + ["cpu: codec"] * 12:  # 1 of the first 4: a quarter, kept
            kept._judged(clip(decoder))
        assert kept.nvdec_off is None and not kept._retired
    finally:
        kept.close()
    switched = decoders.VideoDecoders(1, LoadLimits(video_hwaccel="nvdec", video_device=99))
    together = threading.Barrier(8)

    def judged(_) -> str:
        together.wait()
        return switched._judged(clip("cpu: codec")).decoder

    try:
        with ThreadPoolExecutor(8) as threads:
            assert list(threads.map(judged, range(8))) == ["cpu: codec"] * 8
        assert len(switched._retired) == 1
        assert switched.nvdec_off == "NVDEC turned off: it took 0 of the first 4 clips"
        assert switched._judged(clip("cpu")).decoder == "cpu: nvdec off"  # the CPU pool's
    finally:
        switched.close()
    assert not switched._pool.active and not switched._retired[0].active

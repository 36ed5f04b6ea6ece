"""Frames decoded by the GPU's video decoder (`app/nvdec.py`): the very frames and pixels of the
CPU path, or the CPU path itself where NVDEC cannot serve, said in the record."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_video import write_h264

from encoder_graphs.app.decoders import decode_video
from encoder_graphs.app.media import LoadLimits
from encoder_graphs.app.nvdec import annexb_filter, disposable_h264, yuv420p

av = pytest.importorskip("av")


def nv12_of(frame) -> np.ndarray:
    """The NV12 picture NVDEC gives for a decoded planar 4:2:0 frame: the luma, then U and V interleaved."""
    width, height = frame.width, frame.height
    luma, u, v = (np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:, : width >> bool(index)]
                  for index, plane in enumerate(frame.planes))
    return np.concatenate([luma[:height], np.stack([u, v], -1).reshape(height // 2, width)])


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
    assert asked.times == cpu.times and np.array_equal(asked.frames, cpu.frames)
    with pytest.raises(ValueError, match="video_hwaccel"):
        LoadLimits(video_hwaccel="cuda")


def test_asking_for_nvdec_where_it_cannot_run_is_a_usage_error(tmp_path, capsys):
    """`--video-decoder nvdec` on a machine without CUDA (this CPU machine) or without
    PyNvVideoCodec exits 2 naming the flag, before any file is captioned."""
    from test_cli import good_images

    from encoder_graphs.app.cli import main

    good_images(tmp_path / "media", 1)
    out = tmp_path / "caps.jsonl"
    assert main(["caption", str(tmp_path / "media"), "--device", "cpu", "--video-decoder", "nvdec", "--out", str(out)]) == 2
    assert "--video-decoder nvdec needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


def write_vp9(path: Path, frames: int, size: tuple[int, int] = (96, 64)) -> None:
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libvpx-vp9", rate=30)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for index in range(frames):
            pixels = np.full((size[1], size[0], 3), (index * 9) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("PyNvVideoCodec") is None, reason="needs PyNvVideoCodec (benchmarks/run_gpu.sh carries it)")
def test_nvdec_gives_the_cpu_paths_frames_bit_for_bit(tmp_path):
    """On a GPU, clips of B-frames at several sizes (1080 rows: NVDEC decodes 1088 and crops), a
    rotated phone clip and a Matroska file, one after another in one process (its decoder made
    once, reconfigured, made anew for a larger size), give the CPU path's times and pixels, served
    by NVDEC; a VP9 clip is decoded on the CPU and says so."""
    clips = {
        "small.mp4": {"size": (96, 64), "frames": 90, "gop": 15},
        "hd.mp4": {"size": (1920, 1080), "frames": 75, "gop": 30},
        "portrait.mp4": {"size": (360, 640), "frames": 60, "gop": 60},
        "phone.mp4": {"size": (320, 180), "frames": 40, "gop": 20, "rotation": -90},
        "clip.mkv": {"size": (128, 72), "frames": 50, "gop": 25, "container": "matroska"},
    }
    for name, options in clips.items():
        write_h264(tmp_path / name, **options)
    write_vp9(tmp_path / "web.webm", frames=30)
    for name in [*clips, "web.webm", "small.mp4"]:
        for limits in (LoadLimits(max_frames=8, frame_max_pixels=200_704), LoadLimits(max_frames=16, min_side=8)):
            cpu = decode_video(tmp_path / name, limits)
            gpu = decode_video(tmp_path / name, LoadLimits(**{**limits.__dict__, "video_hwaccel": "nvdec"}))
            expected = f"{cpu.sampling}, cpu (codec vp9)" if name.endswith("webm") else f"{cpu.sampling}, nvdec"
            assert gpu.sampling == expected, name
            assert gpu.times == cpu.times and gpu.size == cpu.size, name
            assert np.array_equal(gpu.frames, cpu.frames), (name, np.abs(gpu.frames.astype(int) - cpu.frames).max())

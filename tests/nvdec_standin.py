"""A stand-in for PyNvVideoCodec's low-level decoder on the CPU, to test `app/nvdec.py`'s choice of
frames where no GPU is: it keeps NVDEC's contract as the sampler uses it (zero latency: each
packet's picture comes back as the packet goes in, decode order, no timestamps) by looking each
Annex B unit up in a table of the frames FFmpeg decoded from the same file. It refuses a stretch
that does not start at a keyframe, or feeds the RASL pictures of the HEVC CRA it starts at (they
refer to pictures before it: NVDEC would decode garbage there). Whether NVDEC itself decodes
those pictures is the GPU test's (tests/test_nvdec.py)."""

import ctypes
import importlib.machinery
import types

import av
import numpy as np
import torch


def nv12_of(frame) -> np.ndarray:
    """The NV12 picture NVDEC gives for a decoded planar 4:2:0 frame (swscale interleaves the chroma losslessly)."""
    return frame.to_ndarray(format="nv12")


def module(path) -> types.ModuleType:
    """A `PyNvVideoCodec` whose decoder knows the units of the clip at `path`."""
    from encoder_graphs.app.nvdec import annexb_filter

    with av.open(str(path)) as container:
        pictures = {frame.pts: nv12_of(frame) for frame in container.decode(video=0)}
    table, keyframes, rasl, trailing = {}, set(), set(), set()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        annexb = annexb_filter(stream)
        for packet in container.demux(stream):
            if packet.size:
                pts, key = packet.pts, packet.is_keyframe
                for unit in annexb.filter(packet) if annexb else [packet]:
                    data = bytes(unit)
                    table[data] = pictures.get(pts)
                    kinds = {(data[at + 3] >> 1) & 0x3F for at in range(len(data) - 3) if data[at:at + 3] == b"\x00\x00\x01"}
                    if key:
                        keyframes.add(data)
                    if stream.codec_context.name == "hevc" and kinds & {8, 9}:
                        rasl.add(data)
                    if stream.codec_context.name == "hevc" and kinds & {0, 1, 2, 3, 4, 5}:
                        trailing.add(data)

    class Decoder:
        def __init__(self, **options) -> None:
            self.options, self.started, self.leading = options, False, False

        def setReconfigParams(self, width: int, height: int) -> None:
            assert width <= self.options["maxwidth"] and height <= self.options["maxheight"]

        def Decode(self, packet) -> list:
            if packet.decode_flag == "ENDOFSTREAM":
                self.started = False
                return []
            data = ctypes.string_at(packet.bsl_data, packet.bsl)
            if not self.started and data not in keyframes:
                raise RuntimeError("a stretch starts at a picture that is not a keyframe")
            if data in rasl and self.leading:
                raise RuntimeError("a RASL picture of the CRA a stretch starts at (it refers to pictures before)")
            self.leading = (not self.started or self.leading) and data not in trailing
            self.started = True
            picture = table[data]
            return [] if picture is None else [torch.from_numpy(np.ascontiguousarray(picture))]

    names = types.SimpleNamespace
    stand_in = types.ModuleType("PyNvVideoCodec")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("PyNvVideoCodec", None)
    stand_in.cudaVideoCodec = names(H264="H264", HEVC="HEVC")
    stand_in.OutputColorType = names(NATIVE="NATIVE")
    stand_in.DisplayDecodeLatencyType = names(ZERO="ZERO")
    stand_in.VideoPacketFlag = names(ENDOFSTREAM="ENDOFSTREAM", ENDOFPICTURE="ENDOFPICTURE")
    stand_in.PacketData = lambda: names(bsl=0, bsl_data=0, decode_flag=None)
    stand_in.CreateDecoder = Decoder
    return stand_in


def install(monkeypatch, path) -> None:
    """The stand-in for the clip at `path` in place of PyNvVideoCodec, a worker's decoder not yet made."""
    import sys

    from encoder_graphs.app import nvdec

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module(path))
    monkeypatch.setattr(nvdec, "_process_decoder", {})

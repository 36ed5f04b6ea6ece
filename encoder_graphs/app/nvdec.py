"""A video's frames decoded by the GPU's video decoder (NVDEC), in the decoder worker processes.

Why: exact frames cost the decode from the keyframe before each, most of a clip's frames, and on
the GPU machines' cores that CPU decode keeps the model waiting for frames (benchmarks/RESULTS.md).
NVDEC does that decode beside the CPU's cores.
Why this way: the command's seeking stays as it is (`video.Sampler`: PyAV demuxes and seeks, the
same frames are asked for); only the packets go to NVIDIA's decoder (PyNvVideoCodec's low-level
`CreateDecoder`, one a worker process, reconfigured from file to file), which keeps the frames on
the GPU in their NV12 form. The frames asked for are copied to the host and converted there as the
CPU path converts its own (swscale from planar 4:2:0, then the processors' resize): NVDEC's YUV is
the CPU decoder's bit for bit (H.264 and HEVC decoding is exact by their specs), so the pixels are
too, where NVDEC's own RGB conversion and a GPU resize were off the processors' pixels. A packet that no frame
refers to, shown before the frame asked for, is not sent (the CPU path skips its decode too).
Anything NVDEC cannot take (another codec, 10-bit, a size past its limit, an error) is decoded by
the CPU path instead, and the record's `sampling` says which decoder served.
"""

import importlib.util
import re
from collections import deque
from typing import Any

import numpy as np

from encoder_graphs.app.bitstream import avcc_parameter_sets, disposable_h264, hevc_picture, interlaced_h264, sps_units
from encoder_graphs.app.media import MediaError
from encoder_graphs.app.video import CannotSeek, DecodedVideo, Sampler

# codec name (FFmpeg's) -> (PyNvVideoCodec's codec, the filter giving the Annex B stream NVDEC parses,
# the smallest width and height NVDEC decodes: cuvidGetDecoderCaps' nMinWidth / nMinHeight)
CODECS = {"h264": ("H264", "h264_mp4toannexb", 48, 16), "hevc": ("HEVC", "hevc_mp4toannexb", 144, 144)}
PIXEL_FORMATS = frozenset({"yuv420p", "yuvj420p"})
MAX_SIDE = 4096  # NVDEC's H.264 limit
# GPU memory a decoder worker holds: its CUDA context (made as the worker starts) and a decoder of
# frames up to 1080p (made at its first clip): nvidia-smi, H200, 529 and 42 MiB (COMPONENTS.md).
# Batch sizing leaves free what the workers will take after it (`job.nvdec_bytes_later`). Larger
# frames take larger surfaces.
CONTEXT_GPU_BYTES = 544 << 20
DECODER_GPU_BYTES = 56 << 20
WORKER_GPU_BYTES = CONTEXT_GPU_BYTES + DECODER_GPU_BYTES

_process_decoder: dict[str, Any] = {}  # this worker's decoder: "key" ((codec, GPU), width, height), "decoder"


def available() -> bool:
    """Whether NVIDIA's decoder library is installed (a GPU machine's driver is checked at its first use)."""
    return importlib.util.find_spec("PyNvVideoCodec") is not None


NEEDS = "--video-decoder nvdec needs a CUDA device and PyNvVideoCodec (pip install 'encoder-graphs[nvdec]')"


def runs_on(device_type: str) -> bool:
    """Whether `--video-decoder nvdec` can run with the model on a device of `device_type`."""
    return device_type == "cuda" and available()


def chosen(asked: str, runs_here: bool, videos: int, world_size: int) -> str:
    """The decoder a job of `videos` to caption over `world_size` GPUs uses for `--video-decoder
    asked`: auto takes NVDEC where it `runs_here` and the job is large enough to repay its
    workers' slower start (`NVDEC_FROM_VIDEOS` a GPU), else the CPU."""
    from encoder_graphs.app.config import NVDEC_FROM_VIDEOS

    if asked != "auto":
        return asked
    return "nvdec" if runs_here and videos >= NVDEC_FROM_VIDEOS * world_size else "cpu"


def dry_run_line(asked: str, device: str, videos: int | None, world_size: int) -> str | None:
    """A dry run's line on the video decoder with `--device` `device` here: that `--video-decoder
    nvdec` could not run, or which `auto` would take for `videos` to caption (None where unknown,
    as a dataset's before its shards are read, or none)."""
    from encoder_graphs.app.config import NVDEC_FROM_VIDEOS

    if asked == "cpu" or (asked == "auto" and not videos):
        return None
    few = chosen(asked, True, videos or 0, world_size) == "cpu"  # auto, too few to repay NVDEC's start
    runs_here = not few and device != "cpu" and available() and _cuda_here()  # torch only where it decides
    if asked == "nvdec":
        return None if runs_here else f"not here: {NEEDS}; the run would stop"
    share = f"{videos} video{'s' * (videos != 1)}"
    share += f" over {world_size} GPUs ({videos // world_size} a GPU)" if world_size > 1 else ""
    why = (f"{share}, fewer than {NVDEC_FROM_VIDEOS} a GPU" if few else
           f"{share}, at least {NVDEC_FROM_VIDEOS} a GPU" if runs_here else "NVDEC needs a CUDA device and PyNvVideoCodec")
    return f"video decoder: {'nvdec' if runs_here else 'cpu'} (--video-decoder auto: {why})"


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def refusal(stream: Any) -> str | None:
    """Why NVDEC does not take `stream` (None: it does)."""
    codec = stream.codec_context
    if not available():
        return "PyNvVideoCodec is not installed"
    if codec.name not in CODECS:
        return f"codec {codec.name}"
    if codec.pix_fmt not in PIXEL_FORMATS:
        return f"pixel format {codec.pix_fmt}"
    _, _, min_width, min_height = CODECS[codec.name]
    if not min_width <= codec.width <= MAX_SIDE or not min_height <= codec.height <= MAX_SIDE or codec.width % 2 or codec.height % 2:
        return f"size {codec.width}x{codec.height}"
    return None


def _decoder(codec: str, width: int, height: int, device: int) -> Any:
    """This process's decoder for `codec` frames of `width` x `height` on GPU `device`: the one it
    has, reconfigured where it was made as large, else a new one. Its pictures stay on the GPU
    (in host memory NVDEC would copy every picture decoded, most of them never asked for)."""
    import PyNvVideoCodec as nvc

    held = _process_decoder.get("key")
    if held is not None and held[0] == (codec, device) and width <= held[1] and height <= held[2]:
        decoder = _process_decoder["decoder"]
        decoder.setReconfigParams(width, height)
        return decoder
    _process_decoder.clear()
    decoder = nvc.CreateDecoder(
        gpuid=device, codec=getattr(nvc.cudaVideoCodec, codec),
        cudacontext=0, cudastream=0, usedevicememory=True, outputColorType=nvc.OutputColorType.NATIVE,
        maxwidth=width, maxheight=height, latency=nvc.DisplayDecodeLatencyType.ZERO,
    )
    _process_decoder.update(key=((codec, device), width, height), decoder=decoder)
    return decoder


def host_nv12(picture: Any, width: int, height: int) -> np.ndarray:
    """A copy in host memory of the NV12 picture NVDEC left on the GPU, (height * 3 / 2, width)
    uint8; an error where its size is another's (the stream's size changed mid-stream). torch
    copies it: measured faster than NVDEC's host output (which copies every picture decoded) and
    than the CUDA driver's own copy (RESULTS.md)."""
    import torch

    nv12 = torch.from_dlpack(picture)
    if tuple(nv12.shape) != (height * 3 // 2, width):
        raise RuntimeError(f"NVDEC gave a {tuple(nv12.shape)} picture for {width}x{height} NV12")
    return nv12.cpu().numpy()


def yuv420p(nv12: np.ndarray, width: int, height: int, like: Any) -> Any:
    """A planar 4:2:0 PyAV frame of an NV12 picture ((height * 3 / 2, width) uint8), with the colour
    description of `like` (the stream's decoder): swscale converts it to RGB exactly as the CPU
    decoder's own frame (from NV12 directly swscale takes another path, to other pixels)."""
    import av

    luma, chroma = nv12[:height], nv12[height:height + (height + 1) // 2]
    frame = av.VideoFrame(width, height, "yuv420p")
    for plane, pixels in zip(frame.planes, (luma, chroma[:, 0::2], chroma[:, 1::2]), strict=True):
        padded = np.empty((plane.height, plane.line_size), np.uint8)
        padded[:, : plane.width] = pixels
        plane.update(padded)
    frame.colorspace, frame.color_range = like.colorspace, like.color_range
    return frame


def annexb_filter(stream: Any) -> Any:
    """The filter that turns `stream`'s packets into the Annex B units NVDEC parses, where its NAL
    units are prefixed by their length (an avcC / hvcC header: MP4, Matroska); None where they are
    Annex B already (MPEG-TS)."""
    from av.bitstream import BitStreamFilterContext

    if (stream.codec_context.extradata or b"")[:1] != b"\x01":
        return None
    return BitStreamFilterContext(CODECS[stream.codec_context.name][1], stream)


class Refused(Exception):
    """NVDEC does not take a stream, or its seeking cannot serve it, found once decoding began (the
    message says why); its decoder is sound, kept for the next file."""


class _NvFrame:
    """A frame NVDEC decoded, copied to the host, as much of PyAV's `VideoFrame` as the sampler reads."""

    def __init__(self, nv12: np.ndarray, pts: int, width: int, height: int, rotation: int, like: Any) -> None:
        self._nv12, self.pts, self.width, self.height, self.rotation, self._like = nv12, pts, width, height, rotation, like

    def to_ndarray(self, format: str) -> np.ndarray:
        return yuv420p(self._nv12, self.width, self.height, self._like).to_ndarray(format=format)


class NvdecSampler(Sampler):
    """`Sampler` with its packets decoded by NVDEC (`refusal` said it takes the stream).

    NVDEC gives no frame its packet's timestamp back, so it decodes in decode order with no
    latency (each packet's picture comes out as the packet goes in), and which packet holds the
    frame shown at a time is read from the packets' own timestamps, as FFmpeg labels its frames:
    the smallest pts at or after it among the packets demuxed, looking `REORDER` packets past the
    first that reaches it (H.264 and HEVC show a frame at most 16 frames after its decode), past
    the frame before where decoding goes on. After a seek the packets start, as FFmpeg's frames
    do, at the first keyframe, without the RASL pictures of an HEVC CRA (they refer to pictures
    before it). tests/test_nvdec.py checks these choices on the CPU against a stand-in with
    NVDEC's contract, and NVDEC's pictures on the GPU."""

    REORDER = 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import PyNvVideoCodec as nvc

        codec = self.stream.codec_context
        self._nvc, self._h264 = nvc, codec.name == "h264"
        if self._h264 and any(interlaced_h264(sps) for sps in avcc_parameter_sets(codec.extradata or b"")):
            raise Refused("interlaced")
        self._filter = annexb_filter(self.stream)
        self._rotation = self._first_picture()
        self._decoder = _decoder(CODECS[codec.name][0], codec.width, codec.height, self.limits.video_device)
        self._units: Any = None  # (pts, Annex B bytes) of the stretch since the last seek, in decode order
        self._ahead: deque[tuple[int, bytes]] = deque()  # demuxed, not yet decoded
        self._fed: set[int] = set()  # pts decoded in this stretch

    def _first_picture(self) -> int:
        """The stream's display rotation, which PyAV gives only on a decoded frame: its first
        picture's, decoded alone on the CPU (the seek for the first frame asked for starts anew).
        `Refused` where that picture is interlaced: FFmpeg gives its two fields woven, NVDEC's
        pictures of fields need not be (field pictures, its deinterlacer). An H.264 stream's
        parameter sets say it for the whole stream (`_stretch`); this is HEVC's check."""
        for packet in self.container.demux(self.stream):
            if packet.size:
                frames = [*self.stream.decode(packet), *self.stream.decode(None)]
                if frames and frames[0].interlaced_frame:
                    raise Refused("interlaced")
                return (frames[0].rotation or 0) if frames else 0
        return 0

    def _stretch(self) -> Any:
        """(pts, Annex B unit) from where a seek landed, as FFmpeg's decoder would show them:
        from the first keyframe on, without the RASL pictures of HEVC's first CRA (they refer to
        pictures before it). `Refused` at an H.264 parameter set that allows fields (in any
        packet: a stream may turn interlaced midway)."""
        started, leading, iraps = False, self.stream.codec_context.name == "hevc", 0
        for packet in self.container.demux(self.stream):
            if packet.size == 0 or not (started := started or packet.is_keyframe):
                continue
            pts = packet.pts  # read first: the filter takes the packet's contents
            if pts is None:  # NVDEC's own need (it looks past the frame asked for): the CPU decides
                raise Refused("a packet carries no timestamp")
            for unit in self._filter.filter(packet) if self._filter is not None else [packet]:
                data = bytes(unit)
                if self._h264 and any(interlaced_h264(sps) for sps in sps_units(data)):
                    raise Refused("interlaced")
                if leading:  # until the first CRA's leading pictures are past
                    picture = hevc_picture(data)
                    if picture == "rasl":
                        continue
                    iraps += picture == "irap"
                    leading = picture != "trail" and iraps < 2
                yield pts, data

    def _send(self, data: bytes | None) -> list[Any]:
        packet = self._nvc.PacketData()
        if data is None:  # the end of a stretch: what NVDEC holds comes out, dropped
            packet.bsl, packet.bsl_data, packet.decode_flag = 0, 0, self._nvc.VideoPacketFlag.ENDOFSTREAM
            return self._decoder.Decode(packet)
        held = np.frombuffer(data, np.uint8)
        packet.bsl, packet.bsl_data, packet.decode_flag = held.size, held.ctypes.data, self._nvc.VideoPacketFlag.ENDOFPICTURE
        return self._decoder.Decode(packet)

    def _restart(self, landing: int) -> None:
        self.container.seek(landing, stream=self.stream, backward=True, any_frame=False)
        self._send(None)
        self._units, self._ahead, self._fed = self._stretch(), deque(), set()

    def _shown_at(self, target: int, half: int, after: int | None) -> tuple[int | None, int | None]:
        """(the pts of the packet shown at `target`, past `after` where decoding goes on from the
        frame shown there; the smallest pts of the stretch), demuxing on until `REORDER` packets
        past the first such (or the stream's end)."""

        def candidate(pts: int) -> bool:
            return pts >= target - half and (after is None or pts > after)

        past = None
        while past is None or past < self.REORDER:
            unit = next(self._units, None)
            if unit is None:
                break
            self._ahead.append(unit)
            if past is not None:
                past += 1
            elif candidate(unit[0]):
                past = 0
        seen = [pts for pts, _ in self._ahead] + list(self._fed)
        shown = [pts for pts in seen if candidate(pts)]
        return (min(shown) if shown else None), (min(seen) if seen else None)

    def _frame_at(self, target: int, half: int) -> Any:
        """The frame shown at `target` (as `Sampler._frame_at`): decoding on from the last, or
        from the keyframe a seek lands on; its packet decoded again after a seek where it was
        decoded before it was known to be the one."""
        landing = target if self._units is None or self._should_seek(target) else None
        after = self._last if landing is None else None  # decoding on: the CPU's next frame is past it
        for _ in range(3):
            if landing is not None:
                self._restart(landing)
            shown, first = self._shown_at(target, half, after)
            if shown is None:
                raise CannotSeek(f"no frame decodes at {self.info.seconds(target):.1f} s of the "
                                  f"{self.info.duration_s:.1f} s its container states (cut short, or a wrong duration)")
            if landing is not None and first > target + half:  # the keyframe's index time preceded a frame shown before it
                landing = self._keyframe_before(landing)
                if landing is None:
                    break
                continue
            if shown in self._fed:
                landing = self._landing(target)
                continue
            self._last = shown
            return self._decode_to(shown, target - half)
        raise Refused("seeking lands after the frames asked for")  # may be NVDEC's re-seeks: the CPU decides

    def _decode_to(self, shown: int, skip_before: int) -> _NvFrame:
        """Decode the packets ahead up to the one of pts `shown` (leaving out those shown before
        `skip_before` that no frame refers to), its frame copied to the host."""
        codec = self.stream.codec_context
        while self._ahead:
            pts, data = self._ahead.popleft()
            if self._h264 and pts < skip_before and disposable_h264(data):
                continue
            frames = self._send(data)
            self._fed.add(pts)
            if pts == shown:
                if len(frames) != 1:
                    raise RuntimeError(f"NVDEC gave {len(frames)} pictures for one packet")
                return _NvFrame(host_nv12(frames[0], codec.width, codec.height), pts, codec.width, codec.height, self._rotation, codec)
        raise RuntimeError("the packet shown was not among those ahead")


def reason(why: str) -> str:
    """Why NVDEC left a file to the CPU (`refusal`, `Refused`, "nvdec failed: <error>") in a bounded
    set of words, for the run's statistics: no sizes, no error texts."""
    return re.sub(r"\d+x\d+", "WxH", why.split(":")[0])


def sampled(sampler: Sampler) -> DecodedVideo:
    """The frames `sampler` would take by seeking, decoded by NVDEC where it takes the stream and
    does not fail, else by `sampler` itself (on the same container: its first seek starts anew).
    `sampling` ends in the decoder that served, and why the CPU did. `CannotSeek` is left to the
    caller's full pass: it says what the container holds, which seeking on the CPU would meet again."""
    why = refusal(sampler.stream)
    if why is None:
        try:
            decoded = NvdecSampler(sampler.path, sampler.container, sampler.stream, sampler.limits).by_seeking()
            decoded.sampling, decoded.decoder = decoded.sampling + ", nvdec", "nvdec"
            return decoded
        except (MediaError, MemoryError, CannotSeek):  # the container's, not NVDEC's: the CPU's seeking fails too
            raise
        except Refused as refused:
            why = str(refused)
        except Exception as error:  # noqa: BLE001 (NVDEC's, of any type: the CPU decodes the file)
            why = f"nvdec failed: {error}"
            _process_decoder.clear()  # made anew for the next file, not left broken
    try:
        decoded = sampler.by_seeking()
    except CannotSeek as cannot:
        cannot.cpu_because = why  # the full pass's record keeps it
        raise
    decoded.sampling, decoded.decoder = decoded.sampling + f", cpu ({why})", f"cpu: {reason(why)}"
    return decoded

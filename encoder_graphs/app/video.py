"""A video's frames for the caption command: sampled at timestamps and reached by seeking, scaled
once to the size the model takes as they are decoded (in `app/decoders.py`'s worker processes).

Why seeking: a caption reads 16 frames of a clip's hundreds; decoding every frame of every stream
kept the GPU waiting most of the run (benchmarks/RESULTS.md). The container's index says where
the keyframes are, so each sampled frame costs the decode from the keyframe before it, and frames
that share a stretch between keyframes are reached by decoding on, not by seeking again. Where a
container has no usable duration, or seeking does not land where asked, one full pass decodes it.
Why this scaling: a frame is converted to RGB at its size (swscale, as transformers' PyAV loader
does) and shrunk by the processors' own resize (torchvision's antialiased bicubic on uint8, which
is this `interpolate`; PIL's bicubic shrinks the same): the model sees what its processor would
give it. swscale scaling straight from the decoded YUV took a little less time than that resize
and was 1-6 levels off the processors' pixels on average (tests/test_processors.py bounds ours).
"""

from bisect import bisect_right
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from encoder_graphs.app.media import LoadLimits, MediaError, check_size, fitted_size

# Without an index, decoding on to a frame this close is assumed cheaper than seeking to it.
NO_INDEX_SEEK_S = 2.0


class CannotSeek(Exception):
    """Why a video's frames cannot be reached by seeking (its full pass then takes them).
    `cpu_because`: why NVDEC, where it was asked for, left the file to the CPU first."""

    cpu_because: str | None = None


@dataclass
class DecodedVideo:
    """The frames of one video, `frames` (frames, height, width, 3) uint8 at the model's frame
    size, upright; `metadata` in the keys of transformers' `VideoMetadata` (`fps` of the stream,
    `frames_indices` of these frames in it, `total_num_frames`), which the inputs time the video
    by; `size`, the stream's (width, height) as displayed; `times`, each frame's time in seconds
    from the stream's start; `sampling`: "seek", or "full pass: <why>"; `decoder`: which served,
    "cpu", "nvdec", or where NVDEC was asked for and left the file to the CPU "cpu: <why>" in a
    bounded set of words (`nvdec.reason`), which the run's statistics count."""

    frames: np.ndarray
    metadata: dict
    size: tuple[int, int]
    times: tuple[float, ...]
    duration_s: float
    sampling: str
    decoder: str = "cpu"

    def record(self) -> dict:
        """What the caption record says of how the frames were taken."""
        return {
            "frames": len(self.times),
            "frame_times_s": [round(t, 3) for t in self.times],
            "duration_s": round(self.duration_s, 3),
            "fps": round(self.metadata["fps"], 3) if self.metadata["fps"] else None,
            "sampling": self.sampling,
            "decoder": self.decoder,
        }


@dataclass(frozen=True)
class _Stream:
    """What the container says of a video stream, in its time base."""

    time_base: Fraction
    start: int  # pts of the stream's start
    fps: float | None
    duration_s: float | None
    total_frames: int | None

    @classmethod
    def of(cls, container: Any, stream: Any) -> "_Stream":
        time_base = stream.time_base or Fraction(1, 1_000_000)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate and 0 < float(rate) < 10_000 else None
        duration = float(stream.duration * time_base) if stream.duration else None
        if duration is None and container.duration:
            duration = container.duration / 1_000_000  # AV_TIME_BASE
        entries = stream.index_entries
        if len(entries) and duration is not None:  # an index that runs past the stated duration wins
            indexed = float((entries[len(entries) - 1].timestamp - (stream.start_time or 0)) * time_base)
            duration = max(duration, indexed + (1 / fps if fps else 0))
        if duration is not None and not 0 < duration < 10**7:
            duration = None
        shown = round(duration * fps) if duration and fps else None
        # A clip cut without re-encoding keeps the frames before its cut, hidden by an edit list:
        # the container counts them, its duration does not.
        total = min(stream.frames, shown) if stream.frames and shown else stream.frames or shown
        return cls(time_base, stream.start_time or 0, fps, duration, total or None)

    def pts(self, seconds: float) -> int:
        return self.start + round(seconds / self.time_base)

    def seconds(self, pts: int) -> float:
        return float((pts - self.start) * self.time_base)


def frame_count(limits: LoadLimits, duration_s: float | None, available: int | None) -> int:
    """Frames to sample: `max_frames`, or with `video_fps` that many a second of the clip up to
    `max_frames` (Qwen3-VL's video processor's rule); at least 2, an even number (the temporal
    patch holds 2: an odd count would repeat its last frame)."""
    count = limits.max_frames
    if limits.video_fps is not None and duration_s is not None:
        count = min(count, int(duration_s * limits.video_fps))
    if available is not None:
        count = min(count, available)
    return max(2, count - count % 2)


class Sampler:
    """One video's frames: by seeking where the container allows, else by one full pass."""

    # Decoders that read `skip_frame` for each packet (checked exact): where the frames that no
    # other refers to may be left undecoded. Others (libdav1d) read it once, when they open.
    SKIPPING_CODECS = frozenset({"h264", "hevc", "mpeg2video", "mpeg4", "vp9"})

    def __init__(self, path: Path, container: Any, stream: Any, limits: LoadLimits) -> None:
        self.path, self.container, self.stream, self.limits = path, container, stream, limits
        self.info = _Stream.of(container, stream)
        self._size: tuple[int, int] | None = None  # the model's frame (width, height), upright
        self._shown: tuple[int, int] | None = None  # the stream's, as displayed
        self._decoding: Any = None  # the decode in progress (seeking), and the pts it reached
        self._last: int | None = None
        # Decode times lead shown times by the B-frames' reordering: the first frame is shown at
        # the stream's start and decoded at the index's first time (MP4: -2 frames with x264's B-frames).
        entries = stream.index_entries
        self._delay = max(0, (stream.start_time or 0) - entries[0].timestamp) if len(entries) else 0
        self._skips = stream.codec_context.name in self.SKIPPING_CODECS
        self._skip_before: int | None = None  # packets shown before it need not decode unless referred to
        import av

        self._broken = av.FFmpegError  # a packet that does not decode (a cut or damaged stream)

    @classmethod
    def of(cls, path: Path, container: Any, limits: LoadLimits) -> "Sampler":
        """The sampler of `container`'s first video stream, refused by its header where it has
        none, no decoder, or frames too large."""
        if not container.streams.video:
            raise MediaError(path, "no_frames", "no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context
        if codec is None:
            raise MediaError(path, "unsupported", "no decoder for its video codec")
        if codec.width and codec.height:  # 0 where the header does not say
            check_size(path, codec.width, codec.height, limits, limits.max_video_pixels)
        stream.thread_type = "AUTO"
        codec.thread_count = limits.video_threads
        return cls(path, container, stream, limits)

    def by_seeking(self) -> DecodedVideo:
        """The frames at evenly spaced times; `CannotSeek` where the container cannot give them."""
        info = self.info
        if info.duration_s is None or info.fps is None:
            raise CannotSeek("the container gives no duration or frame rate")
        count = frame_count(self.limits, info.duration_s, info.total_frames)
        total = info.total_frames or round(info.duration_s * info.fps)
        indices = np.linspace(0, max(total - 1, 0), count).round().astype(int)
        targets = [info.pts(index / info.fps) for index in indices.tolist()]
        sampling = "seek"
        if self.limits.video_sampling == "keyframes":
            if len(self.stream.index_entries) <= 1:  # Matroska reads its index at the first seek
                self.container.seek(info.start, stream=self.stream, backward=True, any_frame=False)
            if len(self.stream.index_entries) > 1:
                targets, snapped = self._snapped(targets)
                sampling = f"seek, {snapped} of {count} at keyframes"
        frames = self._seek(targets, count)
        return self._result(frames, info.duration_s, info.fps, total, sampling)

    def _snapped(self, targets: list[int]) -> tuple[list[int], int]:
        """`targets` moved each to the keyframe nearest it where one lies within half the
        sampling interval and after the frame before: a keyframe decodes alone, an exact frame
        after the decode from its keyframe (tens of frames). The times recorded are the frames'."""
        spacing = (targets[-1] - targets[0]) / max(1, len(targets) - 1)
        moved, snapped, previous = [], 0, None
        for target in targets:
            key = self._nearest_keyframe(target)
            if abs(key - target) <= spacing / 2 and (previous is None or key > previous):
                target, snapped = key, snapped + 1
            moved.append(target)
            previous = target
        return moved, snapped

    def _nearest_keyframe(self, target: int) -> int:
        """The pts of the index's keyframe nearest `target` (shown times: `_delay`)."""
        entries = self.stream.index_entries
        index = bisect_right(entries, target - self._delay, key=lambda entry: entry.timestamp)
        before = self._landing(target)
        for later in range(index, min(len(entries), index + 1000)):  # the next keyframe, a GOP on at most
            if entries[later].is_keyframe:
                after = entries[later].timestamp + self._delay
                return after if after - target < target - before or before > target else before
        return before

    # ----- frames by seeking ---------------------------------------------------------------
    def _seek(self, targets: list[int], count: int) -> list[tuple[int, np.ndarray]]:
        """The frame shown at each target pts; `CannotSeek` where seeking cannot give them."""
        half = max(1, round(0.5 / self.info.fps / self.info.time_base))  # half a frame: the nearest frame wins
        frames: list[tuple[int, np.ndarray]] = []
        for target in targets:
            if frames and target <= self._last:  # the same frame again (a clip of fewer frames than asked)
                frames.append(frames[-1])
                continue
            found = self._frame_at(target, half)
            frames.append((found.pts, self._convert(found, count)))
        return frames

    def _frame_at(self, target: int, half: int) -> Any:
        """The frame shown at `target`: decoding on from where the last one was found, or from
        the keyframe a seek lands on. A seek whose first frame is past the target (a keyframe's
        index time is its decode time, which can precede a frame shown before it) starts again
        from the keyframe before; twice past, the index is not usable."""
        landing = target if self._decoding is None or self._should_seek(target) else None
        self._skip_before = target - half
        for _ in range(3):
            if landing is not None:
                self.container.seek(landing, stream=self.stream, backward=True, any_frame=False)
                self._decoding = self._decoded()
            first = landing is not None
            while (frame := self._next_frame(target)) is not None:
                if frame.pts is None:
                    raise CannotSeek("its frames carry no timestamps")
                if first and frame.pts > target + half:
                    landing = self._keyframe_before(landing)
                    break
                first, self._last = False, frame.pts
                if frame.pts >= target - half:
                    return frame
            else:
                raise CannotSeek(
                    f"no frame decodes at {self.info.seconds(target):.1f} s of the {self.info.duration_s:.1f} s its "
                    "container states (cut short, or a wrong duration)"
                )
            if landing is None:
                break
        raise CannotSeek("seeking lands after the frames asked for (no usable index)")

    def _decoded(self) -> Any:
        """The stream's frames from where the demuxer stands. A packet shown before
        `_skip_before` cannot be the frame asked for: its decoder may leave it undecoded unless
        other frames refer to it (skip_frame NONREF; about half of H.264's frames), decided per
        packet, so the frame asked for and every frame it refers to decode as in a full decode."""
        codec = self.stream.codec_context
        for packet in self.container.demux(self.stream):
            if self._skips:
                skip = packet.pts is not None and self._skip_before is not None and packet.pts < self._skip_before
                codec.skip_frame = "NONREF" if skip else "DEFAULT"
            yield from self.stream.decode(packet)

    def _next_frame(self, target: int) -> Any:
        """The next frame of the decode in progress (None at its end); a packet that does not
        decode ends the seeking."""
        try:
            return next(self._decoding, None)
        except self._broken as error:
            raise CannotSeek(f"the frames before {self.info.seconds(target):.1f} s do not decode ({error})") from error

    def _landing(self, target: int) -> int:
        """The pts of the keyframe a seek for `target` lands on: the last at or before it in the
        index (the target itself where there is none). An index holds decode times, which
        precede the shown times by the stream's reordering delay (`_delay`)."""
        entries = self.stream.index_entries
        index = bisect_right(entries, target - self._delay, key=lambda entry: entry.timestamp) - 1
        while index > 0 and not entries[index].is_keyframe:
            index -= 1
        return entries[index].timestamp + self._delay if index >= 0 else target

    def _keyframe_before(self, pts: int) -> int | None:
        """The pts of the index's keyframe before the one shown at `pts` (None: no index, or none before)."""
        entries = self.stream.index_entries
        if not len(entries) or pts - self._delay <= entries[0].timestamp:
            return None
        return self._landing(pts - 1)

    def _should_seek(self, target: int) -> bool:
        """Seek only past a keyframe beyond what is decoded: between keyframes, decoding on
        reaches the target for less than the decode from the keyframe a seek would start at."""
        if self._last is None:
            return True
        if len(self.stream.index_entries):
            return self._landing(target) > self._last
        return self.info.seconds(target) - self.info.seconds(self._last) > NO_INDEX_SEEK_S

    # ----- frames by one full pass ---------------------------------------------------------
    def full_pass(self, why: str) -> DecodedVideo:
        """Every frame decoded once (on a container just opened), a bounded set of candidates
        kept (every `stride`-th frame, the stride doubling when the set fills), for containers
        that cannot be sampled by time. The frames are scaled as for `max_frames` frames; where
        fewer are found (a Qwen3-VL clip's pixel budget grows as its frames fall), `encode_video`
        sizes them again."""
        info, limits = self.info, self.limits
        keep = 4 * limits.max_frames
        candidates: list[tuple[int | None, np.ndarray]] = []  # candidates[i] is frame i * stride
        stride, decoded, last = 1, 0, None
        try:
            for index, frame in enumerate(self.container.decode(self.stream)):
                decoded = index + 1
                last = frame.pts if frame.pts is not None else last
                if index % stride:
                    continue
                candidates.append((frame.pts, self._convert(frame, limits.max_frames)))
                if len(candidates) == keep:
                    candidates, stride = candidates[::2], stride * 2
        except self._broken as error:  # a cut or damaged stream: the frames before the damage serve
            if not candidates:
                raise
            why = f"{why}; the stream breaks off after {decoded} frames ({error})"
        if not candidates:
            raise MediaError(self.path, "no_frames", "the video has no decodable frames")
        first = candidates[0][0]
        span = info.seconds(last) - info.seconds(first) if last is not None and first is not None else 0.0
        fps = info.fps or ((decoded - 1) / span if span > 0 else None)
        duration = decoded / fps if fps else float(decoded)
        count = frame_count(limits, duration, decoded)
        picks = [int(i) for i in np.linspace(0, len(candidates) - 1, count).round()]
        indices = [i * stride for i in picks]
        # A frame without a timestamp is placed by its index (the processors' 24 fps where none is known).
        frames = [(candidates[i][0] if candidates[i][0] is not None else info.pts(index / (fps or 24)), candidates[i][1])
                  for i, index in zip(picks, indices, strict=True)]
        return self._result(frames, duration, fps, decoded, f"full pass: {why}", indices)

    # ----- conversion ----------------------------------------------------------------------
    def _convert(self, frame: Any, count: int) -> np.ndarray:
        """`frame` as RGB, turned upright by its display rotation, shrunk to the model's frame size
        for a clip of `count` frames (`_target`) by the processors' resize."""
        turns = round((frame.rotation or 0) / 90) % 4
        # A frame larger than its header said (or than the frames before) is refused before its RGB copy.
        check_size(self.path, frame.width, frame.height, self.limits, self.limits.max_video_pixels)
        rgb = frame.to_ndarray(format="rgb24")
        if turns:
            rgb = np.rot90(rgb, turns)
        if self._size is None:
            self._shown = (rgb.shape[1], rgb.shape[0])
            check_size(self.path, *self._shown, self.limits, self.limits.max_video_pixels)
            self._size = self._target(*self._shown, count)
        return resized(rgb, *self._size)

    def _target(self, width: int, height: int, count: int) -> tuple[int, int]:
        """The model's size for frames of `width` x `height` (`LoadLimits.frame_size`; without
        one, at most `frame_max_pixels`, the short side at least `min_side`)."""
        size = self.limits.frame_size
        if callable(size):
            return size(width, height, count)
        if size is not None:
            return size
        return fitted_size(width, height, self.limits.frame_max_pixels, self.limits.min_side)

    def _result(
        self, frames: list[tuple[int, np.ndarray]], duration: float, fps: float | None, total: int, sampling: str,
        indices: list[int] | None = None,
    ) -> DecodedVideo:
        times = tuple(max(0.0, self.info.seconds(pts)) for pts, _ in frames)
        if indices is None:
            indices = [min(total - 1, round(t * fps)) for t in times]
        metadata = {"fps": fps, "frames_indices": indices, "total_num_frames": total}
        return DecodedVideo(np.stack([array for _, array in frames]), metadata, self._shown, times, duration, sampling)


def resized(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """An RGB frame (height, width, 3) uint8 at `width` x `height`: the processors' resize
    (torchvision hands uint8 bicubic with antialias straight to this `interpolate`)."""
    if rgb.shape[:2] == (height, width):
        return np.ascontiguousarray(rgb)
    import torch
    import torch.nn.functional as F

    pixels = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None]
    pixels = F.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return pixels[0].permute(1, 2, 0).contiguous().numpy()

"""A probe, not a loader the command uses: PyAV demuxes the packets our seeking picks (the command's
`Sampler`, its `_decoded` and `_convert` replaced) and PyNvVideoCodec's low-level decoder (NVDEC)
decodes them to RGB on the GPU. Prints, for the first 12 clips, whether the frames' times equal the
CPU path's and how far their pixels are; then clips/s on N threads, and beside the command's CPU
worker processes (W processes + K NVDEC threads taking files from one queue). Results and why it
was not adopted: benchmarks/RESULTS.md (video loader). Needs a GPU and the PyNvVideoCodec wheel.
    python3 benchmarks/probe_nvdec.py CLIPS COUNT THREADS,... W+K,...   e.g. /tmp/c96 96 8,16 15+0,12+4
"""
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
import PyNvVideoCodec as nvc
import torch
import torch.nn.functional as F
from av.bitstream import BitStreamFilterContext

from encoder_graphs.app import video as V
from encoder_graphs.app.decoders import decode_video
from encoder_graphs.app.media import LoadLimits, open_regular

CODECS = {"h264": (nvc.cudaVideoCodec.H264, "h264_mp4toannexb"), "hevc": (nvc.cudaVideoCodec.HEVC, "hevc_mp4toannexb")}
FLUSH = os.environ.get("NV_FLUSH", "1") == "1"
tls = threading.local()

class NvFrame:
    def __init__(self, f):
        self.pts = f.getPTS(); self.rotation = 0
        self.rgb = torch.from_dlpack(f).clone()  # HWC uint8 on the GPU

class NvSampler(V.Sampler):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        codec, bsf = CODECS[self.stream.codec_context.name]
        self._bsf = BitStreamFilterContext(bsf, self.stream) if self.container.format.name.startswith(("mov", "matroska")) else None
        cc = self.stream.codec_context
        key = (codec, cc.width, cc.height)
        decs = getattr(tls, "decs", None)
        if decs is None: decs = tls.decs = {}
        if key not in decs:
            decs.clear()
            decs[key] = nvc.CreateDecoder(gpuid=0, codec=codec, cudacontext=0, cudastream=0, usedevicememory=True,
                                          outputColorType=nvc.OutputColorType.RGB)
        self._dec = decs[key]
        self._skips = False
        self._fed = False

    def _send(self, p, flag=0):
        pd = nvc.PacketData()
        if p is None:
            pd.bsl = 0; pd.bsl_data = 0; pd.decode_flag = 1  # ENDOFSTREAM
            return [NvFrame(f) for f in self._dec.Decode(pd)]
        arr = np.frombuffer(p, np.uint8)
        pd.bsl_data = arr.ctypes.data; pd.bsl = arr.size; pd.pts = p.pts if p.pts is not None else 0; pd.decode_flag = flag
        out = [NvFrame(f) for f in self._dec.Decode(pd)]
        del arr
        return out

    def _decoded(self):
        if FLUSH and self._fed:
            self._send(None)  # drop the frames of the stretch before the seek
        self._fed = True
        for packet in self.container.demux(self.stream):
            if packet.size == 0:
                continue
            for p in (self._bsf.filter(packet) if self._bsf else [packet]):
                yield from self._send(p)
        yield from self._send(None)

    def _convert(self, frame, count):
        rgb = frame.rgb
        if self._size is None:
            self._shown = (rgb.shape[1], rgb.shape[0])
            self._size = self._target(*self._shown, count)
        w, h = self._size
        x = rgb.permute(2, 0, 1)[None].float()
        y = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True).round_().clamp_(0, 255).to(torch.uint8)
        return y[0].permute(1, 2, 0).contiguous().cpu().numpy()

def nv_decode(path, limits):
    with open_regular(path) as handle, av.open(handle) as container:
        s = NvSampler.of(path, container, limits)
        if s.stream.codec_context.name not in CODECS:
            return None
        return s.by_seeking()

if __name__ == "__main__":
    folder = Path(sys.argv[1]); n = int(sys.argv[2]); files = sorted(folder.iterdir())[:n]
    limits = LoadLimits(max_frames=16, frame_max_pixels=200704)
    # correctness against the CPU path
    worst = 0
    for p in files[:12]:
        a = decode_video(p, limits)
        t = time.perf_counter(); b = nv_decode(p, limits); dt = time.perf_counter() - t
        if b is None: print(p.name, "cpu only"); continue
        same = a.times == b.times
        d = np.abs(a.frames.astype(int) - b.frames.astype(int)) if a.frames.shape == b.frames.shape else None
        print(p.name, f"{dt:.2f}s", "times same" if same else f"TIMES DIFFER {a.times[:4]} {b.times[:4]}",
              f"diff mean {d.mean():.2f} max {d.max()}" if d is not None else f"shapes {a.frames.shape} {b.frames.shape}", flush=True)
    for threads in [int(x) for x in sys.argv[3].split(",")]:
        tls = threading.local()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            outs = list(pool.map(lambda p: nv_decode(p, limits), files))
        dt = time.perf_counter() - t0
        print(f"nvdec {threads} threads: {len(files)/dt:.2f} clips/s, {sum(o is None for o in outs)} not nvdec", flush=True)
    # hybrid: W CPU worker processes (the command's pool) and K NVDEC threads take files from one queue
    from encoder_graphs.app.decoders import VideoDecoders
    for cpu_w, nv_k in [tuple(int(v) for v in x.split("+")) for x in sys.argv[4].split(",")]:
        tls = threading.local()
        pool = VideoDecoders(cpu_w, limits).start() if cpu_w else None
        time.sleep(3 if cpu_w else 0)
        q = queue.Queue()
        for p in files: q.put(p)
        counts = {"cpu": 0, "nv": 0}
        def run(kind, q=q, pool=pool, counts=counts):
            while True:
                try: p = q.get_nowait()
                except queue.Empty: return
                if kind == "nv":
                    r = nv_decode(p, limits)
                    if r is None: r = decode_video(p, limits)
                else:
                    r = pool.decode(p)
                counts[kind] += 1
        t0 = time.perf_counter()
        ths = [threading.Thread(target=run, args=("cpu",)) for _ in range(cpu_w)] + [threading.Thread(target=run, args=("nv",)) for _ in range(nv_k)]
        [t.start() for t in ths]; [t.join() for t in ths]
        dt = time.perf_counter() - t0
        print(f"hybrid cpu {cpu_w} + nvdec {nv_k}: {len(files)/dt:.2f} clips/s {counts}", flush=True)
        if pool: pool.close()

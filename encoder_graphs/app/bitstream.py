"""What the NVDEC path reads from H.264 and HEVC bitstreams itself (Annex B access units, the
avcC header): which units a decode may leave out, which pictures an HEVC CRA leads with, and
whether an H.264 stream codes fields (interlaced), which FFmpeg and NVDEC give differently. No
torch, no PyAV: bytes in, answers out."""

from collections.abc import Iterator


def nal_headers(data: bytes) -> Iterator[int]:
    """The first byte of each NAL unit of an Annex B access unit (emulation prevention keeps a start
    code out of a unit's payload; a 4-byte start code holds the 3-byte one)."""
    start = 0
    while (start := data.find(b"\x00\x00\x01", start)) >= 0 and start + 3 < len(data):
        yield data[start + 3]
        start += 3


def disposable_h264(data: bytes) -> bool:
    """Whether an Annex B H.264 access unit is a picture no other refers to, and nothing else a
    later one needs: every slice's nal_ref_idc 0 (both fields of a pair), no parameter set
    (SPS, PPS, their extensions). Leaving it undecoded changes no other frame (FFmpeg's NONREF
    skip leaves out the same slices and parses the rest)."""
    slices = 0
    for header in nal_headers(data):
        kind = header & 0x1F
        if kind in (7, 8, 13, 15) or (kind in (1, 5) and header & 0x60):
            return False
        slices += kind in (1, 5)
    return slices > 0


def hevc_picture(data: bytes) -> str | None:
    """What an Annex B HEVC access unit's picture is: "irap" (NAL types 16-23), "rasl" (8, 9: it
    refers to pictures before its IRAP), "radl" (6, 7), "trail" (the others); None: no picture."""
    for header in nal_headers(data):
        kind = (header >> 1) & 0x3F
        if kind < 32:  # the first picture unit
            return "irap" if kind >= 16 else "rasl" if kind in (8, 9) else "radl" if kind in (6, 7) else "trail"
    return None


def sps_units(data: bytes) -> Iterator[bytes]:
    """The H.264 sequence parameter set units (NAL type 7, from their header byte) of an Annex B
    access unit."""
    start = 0
    while (start := data.find(b"\x00\x00\x01", start)) >= 0 and start + 3 < len(data):
        start += 3
        if data[start] & 0x1F == 7:
            end = data.find(b"\x00\x00\x01", start)
            yield data[start:end if end >= 0 else len(data)].rstrip(b"\x00")  # a 4-byte start code's zero


def avcc_parameter_sets(extradata: bytes) -> list[bytes]:
    """The sequence parameter set units an avcC header (MP4's and Matroska's H.264 extradata)
    holds; none where it is not one (Annex B streams carry theirs in-band)."""
    if len(extradata) < 6 or extradata[0] != 1:
        return []
    units, at = [], 6
    for _ in range(extradata[5] & 0x1F):
        size = int.from_bytes(extradata[at:at + 2], "big")
        units.append(extradata[at + 2:at + 2 + size])
        at += 2 + size
    return units


class _Bits:
    """An RBSP read bit by bit (H.264 7.2: u(n), ue(v), se(v)); emulation prevention removed."""

    def __init__(self, unit: bytes) -> None:
        self.data, self.at = unit.replace(b"\x00\x00\x03", b"\x00\x00"), 0

    def u(self, n: int) -> int:
        value = 0
        for _ in range(n):
            if self.at >= 8 * len(self.data):
                raise ValueError("the parameter set ends early")
            value = value << 1 | (self.data[self.at >> 3] >> (7 - (self.at & 7))) & 1
            self.at += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while not self.u(1):
            zeros += 1
            if zeros > 31:
                raise ValueError("an exp-Golomb code longer than 32 bits")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        code = self.ue()
        return (code + 1) // 2 if code & 1 else -(code // 2)


HIGH_PROFILES = frozenset({100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135})


def interlaced_h264(sps: bytes) -> bool:
    """Whether an H.264 sequence parameter set unit (its NAL header first) allows field coding
    (frame_mbs_only_flag 0: field pictures or MBAFF), read as H.264 7.3.2.1.1 lays it out."""
    bits = _Bits(sps[1:])
    profile = bits.u(8)
    bits.u(16)  # constraint flags, level
    bits.ue()  # seq_parameter_set_id
    if profile in HIGH_PROFILES:
        chroma = bits.ue()
        if chroma == 3:
            bits.u(1)  # separate_colour_plane_flag
        bits.ue(), bits.ue(), bits.u(1)  # bit depths, qpprime_y_zero_transform_bypass_flag
        if bits.u(1):  # seq_scaling_matrix_present_flag
            for index in range(8 if chroma != 3 else 12):
                if bits.u(1):
                    _skip_scaling_list(bits, 16 if index < 6 else 64)
    bits.ue()  # log2_max_frame_num_minus4
    order = bits.ue()
    if order == 0:
        bits.ue()
    elif order == 1:
        bits.u(1), bits.se(), bits.se()
        for _ in range(bits.ue()):
            bits.se()
    bits.ue(), bits.u(1), bits.ue(), bits.ue()  # max_num_ref_frames, gaps, width and height in macroblocks
    return bits.u(1) == 0


def _skip_scaling_list(bits: _Bits, size: int) -> None:
    last = following = 8
    for _ in range(size):
        if following:
            following = (last + bits.se() + 256) % 256
        last = following or last



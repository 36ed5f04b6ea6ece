"""A captioning run's counters, and its progress line."""

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encoder_graphs.engine.stats import latency_summary

if TYPE_CHECKING:
    from tqdm import tqdm

# The summary's `video_decoder` where NVDEC's workers were ended for the CPU's (`VideoDecoders._to_cpu`).
NVDEC_THEN_CPU = "nvdec, then cpu"


@dataclass
class RunStats:
    files: int = 0
    skipped: int = 0  # already in the results file (or with a sidecar, with --sidecar)
    later: int = 0  # to do, beyond --limit
    succeeded: int = 0
    failed: int = 0
    by_kind: Counter = field(default_factory=Counter)  # files captioned or failed, by kind (their records)
    failures: Counter = field(default_factory=Counter)  # error kind -> count
    generated_tokens: int = 0
    batches: int = 0
    retried_batches: int = 0  # failed, then split: in halves when out of memory, else one by one
    wall_s: float = 0.0
    input_wait_s: float = 0.0  # the model waiting for files still loading
    first_records_s: float | None = None  # from the loop's start until the first batch's records
    interrupted: bool = False
    prompt_tokens: int = 0  # prompt tokens given to generate, without the left-padding
    padded_prompt_tokens: int = 0  # the same with it: batch size x longest prompt, summed
    batch_ms: list[float] = field(default_factory=list)
    item_ms: list[float] = field(default_factory=list)  # load + share of its batch
    # Per kind of file: seconds in its batches' generate calls and the files captioned in them, so
    # a mixed folder's photos can be timed against a photo-only folder's.
    batch_s_by_kind: Counter = field(default_factory=Counter)
    captioned_by_kind: Counter = field(default_factory=Counter)
    # With named prompts: batches by how their prompts ran ("shared prefix": prefilled once an
    # item; "whole prompts": each prompt an item whole, a row each, where nothing could be shared).
    prompt_batches: Counter = field(default_factory=Counter)
    # Videos captioned by the decoder that served them (`DecodedVideo.decoder`): NVDEC's fallbacks counted.
    video_decoders: Counter = field(default_factory=Counter)

    def captioned(self, kind: str, video: dict | None) -> None:
        """A file of `kind` captioned; `video`, its record's `video` (how its frames were taken)."""
        self.by_kind[kind] += 1
        if video is not None:
            self.video_decoders[video["decoder"]] += 1

    def video_decoder(self, hwaccel: str | None) -> str | None:
        """The summary's `video_decoder`: the one the job chose (`LoadLimits.video_hwaccel`), where it
        captioned videos; `NVDEC_THEN_CPU` where NVDEC took too few to keep (`VideoDecoders._to_cpu`)."""
        if not self.by_kind.get("video"):
            return None
        return NVDEC_THEN_CPU if self.video_decoders.get("cpu: nvdec off") else hwaccel or "cpu"

    def as_dict(self) -> dict:
        done = self.succeeded + self.failed
        return {
            "files": self.files,
            "skipped": self.skipped,
            "later": self.later,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "by_kind": dict(self.by_kind),
            "video_decoders": dict(sorted(self.video_decoders.items())),
            "failures": dict(sorted(self.failures.items())),
            "generated_tokens": self.generated_tokens,
            "batches": self.batches,
            "retried_batches": self.retried_batches,
            "wall_s": self.wall_s,
            "input_wait_s": self.input_wait_s,
            "input_wait_pct": 100.0 * self.input_wait_s / self.wall_s if self.wall_s else 0.0,
            "first_records_s": self.first_records_s,
            "interrupted": self.interrupted,
            "prompt_tokens": self.prompt_tokens,
            "padded_prompt_tokens": self.padded_prompt_tokens,
            "prompt_padding_pct": padding_pct(self.prompt_tokens, self.padded_prompt_tokens),
            "items_per_s": done / self.wall_s if self.wall_s else 0.0,
            "tokens_per_s": self.generated_tokens / self.wall_s if self.wall_s else 0.0,
            "items_per_batch_s_by_kind": {
                kind: self.captioned_by_kind[kind] / seconds for kind, seconds in self.batch_s_by_kind.items() if seconds
            },
            "batch_latency_ms": latency_summary(self.batch_ms),
            "item_latency_ms": latency_summary(self.item_ms),
            **({"prompt_batches": dict(self.prompt_batches)} if self.prompt_batches else {}),
        }


def padding_pct(tokens: int, padded: int) -> float:
    """The share of the prefill's prompt tokens that were left-padding."""
    from encoder_graphs.engine.statistics import pct

    return pct(padded - tokens, padded)


def progress_bar(total: int) -> "tqdm":
    """The run's progress on stderr (tqdm): redrawn in place on a terminal, every few seconds
    otherwise (logs)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="file", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.2 if sys.stderr.isatty() else 5.0)

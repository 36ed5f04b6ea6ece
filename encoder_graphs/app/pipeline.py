"""The Captioner: load files, batch them by count and tokens, generate, record every outcome."""

import sys
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import TextIO

import torch
from transformers import PreTrainedModel

from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.media import LoadLimits, MediaError, MediaFile, load
from encoder_graphs.app.results import ResultsFile
from encoder_graphs.engine.stats import latency_summary
from encoder_graphs.protocols import CaptionInputs, EncodedMedia


@dataclass
class Pending:
    file: MediaFile
    item: EncodedMedia
    load_ms: float


@dataclass
class RunStats:
    files: int = 0
    skipped: int = 0  # already in the results file
    succeeded: int = 0
    failed: int = 0
    by_kind: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # error kind -> count
    generated_tokens: int = 0
    batches: int = 0
    retried_batches: int = 0
    wall_s: float = 0.0
    batch_ms: list[float] = field(default_factory=list)
    item_ms: list[float] = field(default_factory=list)  # load + share of its batch

    def as_dict(self) -> dict:
        done = self.succeeded + self.failed
        return {
            "files": self.files,
            "skipped": self.skipped,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "by_kind": dict(self.by_kind),
            "failures": dict(sorted(self.failures.items())),
            "generated_tokens": self.generated_tokens,
            "batches": self.batches,
            "retried_batches": self.retried_batches,
            "wall_s": self.wall_s,
            "items_per_s": done / self.wall_s if self.wall_s else 0.0,
            "tokens_per_s": self.generated_tokens / self.wall_s if self.wall_s else 0.0,
            "batch_latency_ms": latency_summary(self.batch_ms),
            "item_latency_ms": latency_summary(self.item_ms),
        }


class Progress:
    """A one-line progress bar on stderr: redrawn in place on a terminal, a line every few
    seconds otherwise (logs)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.stream = stream
        self.done = 0
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.interactive = stream.isatty()

    def advance(self, count: int) -> None:
        self.done += count
        now = time.perf_counter()
        if now - self.last_draw >= (0.2 if self.interactive else 5.0) or self.done == self.total:
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed else 0.0
        eta = (self.total - self.done) / rate if rate else 0.0
        width = 30
        filled = width * self.done // max(1, self.total)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.2f} items/s eta {eta:.0f}s"
        self.stream.write(("\r" + line) if self.interactive else line + "\n")
        if self.interactive and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


class Captioner:
    def __init__(
        self,
        model: PreTrainedModel,
        inputs: CaptionInputs,
        config: CaptionConfig,
        limits: LoadLimits,
    ) -> None:
        self.model = model
        self.inputs = inputs
        self.config = config
        self.limits = limits
        self.device = next(model.parameters()).device

    def run(self, files: list[MediaFile], results: ResultsFile, progress: Progress | None = None) -> RunStats:
        stats = RunStats(files=len(files))
        todo = [f for f in files if not results.is_done(f.path)]
        stats.skipped = len(files) - len(todo)
        started = time.perf_counter()
        batch: list[Pending] = []
        failures: list[dict] = []  # written with the next batch, so a kill loses at most one batch

        def write(records: list[dict]) -> None:
            results.append(records)
            if progress is not None:
                progress.advance(len(records))

        # Files load on worker threads a few batches ahead of the model (PIL and PyAV release the GIL).
        lookahead = self.config.batch_size * 4
        queue = iter(todo)
        loading: deque[tuple[MediaFile, Future]] = deque()
        with ThreadPoolExecutor(self.config.load_workers) as pool:
            for file in islice(queue, lookahead):
                loading.append((file, pool.submit(self.prepare, file)))
            while loading:
                file, future = loading.popleft()
                for next_file in islice(queue, 1):
                    loading.append((next_file, pool.submit(self.prepare, next_file)))
                outcome = future.result()
                stats.by_kind[file.kind] += 1
                if isinstance(outcome, dict):
                    self._count_failure(outcome, stats)
                    failures.append(outcome)
                    if len(failures) >= self.config.batch_size:
                        write(failures)
                        failures = []
                    continue
                tokens = sum(p.item.vision_tokens for p in batch)
                if batch and (
                    len(batch) == self.config.batch_size
                    or tokens + outcome.item.vision_tokens > self.config.max_batch_tokens
                ):
                    write(failures + self.caption_batch(batch, stats))
                    batch, failures = [], []
                batch.append(outcome)
            write(failures + (self.caption_batch(batch, stats) if batch else []))
        stats.wall_s = time.perf_counter() - started
        return stats

    def prepare(self, file: MediaFile) -> Pending | dict:
        """Load and encode one file; a failure becomes its error record."""
        started = time.perf_counter()
        try:
            media = load(file, self.limits)
            item = self.inputs.encode_image(media) if file.kind == "image" else self.inputs.encode_video(media)
        except MediaError as error:
            return _error_record(file, error.kind, str(error))
        # A processor rejecting one input (or a decoder failing in a way `load` does not foresee)
        # must not stop the run: an exception escaping here would end it from `future.result()`.
        except Exception as error:  # noqa: BLE001
            return _error_record(file, "preprocess", f"{file.path}: {type(error).__name__}: {error}")
        return Pending(file, item, 1000.0 * (time.perf_counter() - started))

    def caption_batch(self, batch: list[Pending], stats: RunStats) -> list[dict]:
        try:
            return self._generate(batch, stats)
        except Exception as error:  # noqa: BLE001
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(batch) == 1:
                record = _error_record(batch[0].file, "model", f"{batch[0].file.path}: {type(error).__name__}: {error}")
                self._count_failure(record, stats)
                return [record]
        # One item can break a whole batch: retry one by one so only that one fails.
        stats.retried_batches += 1
        return [record for pending in batch for record in self.caption_batch([pending], stats)]

    def _generate(self, batch: list[Pending], stats: RunStats) -> list[dict]:
        started = time.perf_counter()
        # Pixels in the model's dtype; ids, masks, grids and Qwen2.5-VL's second_per_grid_ts (float32
        # as the processor gives it: M-RoPE multiplies temporal positions by it) as they are.
        model_inputs = {
            name: value.to(self.device, dtype=self.model.dtype if name.startswith("pixel_values") else None)
            for name, value in self.inputs.batch([p.item for p in batch], self.config.prompt).items()
        }
        prompt_length = model_inputs["input_ids"].shape[1]
        with torch.inference_mode():
            # Plain greedy whatever the checkpoint's generation config says: Qwen's repetition
            # penalty (1.05) is not in the decoder graphs and would send every call to stock generate.
            output = self.model.generate(
                **model_inputs,
                max_new_tokens=self.config.max_new_tokens,
                do_sample=False,
                repetition_penalty=1.0,
                eos_token_id=self.inputs.eos_token_id,
                pad_token_id=self.inputs.pad_token_id,
            )
        new_tokens = output[:, prompt_length:].tolist()  # the host copy waits for the device
        batch_ms = 1000.0 * (time.perf_counter() - started)
        stats.batches += 1
        stats.batch_ms.append(batch_ms)
        records = []
        for pending, tokens in zip(batch, new_tokens, strict=True):
            if self.inputs.eos_token_id in tokens:
                tokens = tokens[: tokens.index(self.inputs.eos_token_id)]
            caption = self.inputs.decode(tokens)
            stats.succeeded += 1
            stats.generated_tokens += len(tokens)
            stats.item_ms.append(pending.load_ms + batch_ms / len(batch))
            records.append(
                {
                    "path": str(pending.file.path),
                    "kind": pending.file.kind,
                    "caption": caption,
                    "tokens": len(tokens),
                    "vision_tokens": pending.item.vision_tokens,
                    "timings": {
                        "load_ms": round(pending.load_ms, 3),
                        "batch_ms": round(batch_ms, 3),
                        "batch_size": len(batch),
                    },
                }
            )
        return records

    @staticmethod
    def _count_failure(record: dict, stats: RunStats) -> None:
        stats.failed += 1
        stats.failures[record["error_kind"]] += 1


def longest_sequence(inputs: CaptionInputs, config: CaptionConfig, limits: LoadLimits) -> int:
    """The most tokens one sequence can reach here: the longest prompt plus `max_new_tokens`. It
    sizes the decoder graphs' cache; a decode step reads only the smallest length tier holding its
    batch's sequences, so the size costs cache memory and capture, not per-step reads. A rare
    longer one (an extreme aspect ratio) runs eagerly."""
    return inputs.longest_prompt(config.prompt, limits.max_frames) + config.max_new_tokens


def _error_record(file: MediaFile, kind: str, message: str) -> dict:
    return {"path": str(file.path), "kind": file.kind, "error_kind": kind, "error": message}

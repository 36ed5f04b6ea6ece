"""The Captioner: load files ahead on worker threads, batch them by count and tokens, generate,
record every outcome."""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from transformers import PreTrainedModel

from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.decoders import VideoDecoders, load, video_workers
from encoder_graphs.app.media import LoadLimits, MediaError, fingerprint, upright_size
from encoder_graphs.app.outputs import Outputs, relative_path
from encoder_graphs.app.prompt_batches import SHARED, collate_named, placeholder_ids, rows_apart
from encoder_graphs.app.runstats import RunStats
from encoder_graphs.app.walk import MediaFile
from encoder_graphs.decoder.step import prompt_positions
from encoder_graphs.enable import graphs_of
from encoder_graphs.protocols import CaptionInputs, EncodedMedia


@dataclass
class Pending:
    file: MediaFile
    item: EncodedMedia
    load_ms: float
    prompt: str
    size: tuple[int, int]  # the image's (a video frame's) width and height in pixels
    video: dict | None = None  # how a video's frames were taken (`DecodedVideo.record`)
    prompts: tuple[str, ...] = ()  # with named prompts: each one's (`prompt`: the first)


class Captioner:
    def __init__(
        self,
        model: PreTrainedModel,
        inputs: CaptionInputs,
        config: CaptionConfig,
        limits: LoadLimits,
        *,
        roots: Sequence[Path] = (),
        model_name: str = "default",
        warm_up: Callable[[], None] | None = None,
        videos: VideoDecoders | None = None,
        run_settings: dict | None = None,
    ) -> None:
        """`videos`: the run's video decoder processes, started ahead and stopped by the caller
        (None: started by the first video and stopped with the run)."""
        self.model = model
        self.inputs = inputs
        self.config = config
        self.limits = limits
        self.roots = [Path(root).absolute() for root in roots]
        self.model_name = model_name
        self.run_settings = run_settings  # each caption record's "settings" (`settings.run_identity`)
        # What every generate call of the run is given: the family's overrides of its checkpoint's settings.
        self.generate_settings = {**config.sampling, **inputs.generation_overrides, "max_new_tokens": config.max_new_tokens}
        # The decoder runner, called here for every batch it can hold (the rest go to `generate`,
        # which counts why), and its calls' settings, resolved once (None: the stock `generate`).
        handle = graphs_of(model)
        self.runner, self.runner_settings = (handle and handle.decode_route(self.generate_settings)) or (None, {})
        self.warm_up = warm_up  # run beside the first files' loading and collation, joined before the first batch
        self.load_workers = config.load_workers  # a Ray actor's own share of its node's cores
        self._warming: Future | None = None
        self.device = next(model.parameters()).device
        self._videos, self._own_videos = videos, videos is None
        self._ended = False
        self._videos_lock = threading.Lock()

    def run(self, files: Iterable[MediaFile], outputs: Outputs, stop: Callable[[], bool] = lambda: False) -> RunStats:
        """Caption `files` (taken as the loaders need them: a torchrun rank claims them lazily),
        writing each batch's records as it ends. Loaded files gather in windows (`windows`), each
        cut into batches costliest first, so that a batch holds prompts of similar length (in
        folder order, left padding was a large share of the prefill's tokens, sorted windows cut
        it to about half; measured: benchmarks/HISTORY.md), while the files after it load.
        `stop` is asked between files and batches: once it says so, the run ends after writing
        what is done (stats.interrupted); files loaded but not captioned are left to a rerun."""
        stats = RunStats()
        self._started, self._ended = time.perf_counter(), False
        window, later_windows, ahead = self.windows()
        ready: list[Pending] = []
        failures: list[dict] = []  # written with the next batch, so a kill loses at most one batch
        # Files load on worker threads ahead of the model (PIL and torch's CPU kernels release the
        # GIL; a video's thread waits on its decoder process, `app/decoders.py`); a window's next
        # batch is collated on its own thread while the model runs one.
        pool = ThreadPoolExecutor(self.load_workers)
        self._collator = ThreadPoolExecutor(1)
        warming = ThreadPoolExecutor(1)
        self._warming = warming.submit(self.warm_up) if self.warm_up is not None else None
        try:
            for outcome in self._loaded(files, pool, ahead, stats, stop):
                if isinstance(outcome, dict):
                    failures.append(outcome)
                    if len(failures) >= self.config.largest_batch:
                        outputs.write(failures)
                        failures.clear()
                    continue
                ready.append(outcome)
                if len(ready) == window:
                    self._caption_window(ready, failures, outputs, stats, stop)
                    ready, window = [], later_windows
                if stats.interrupted:
                    break
            if not stats.interrupted:
                self._caption_window(ready, failures, outputs, stats, stop)
            if failures:
                outputs.write(failures)
        finally:  # a second Ctrl-C must not wait for the files still queued
            pool.shutdown(wait=False, cancel_futures=True)
            self._collator.shutdown(wait=False, cancel_futures=True)
            with self._videos_lock:
                self._ended = True
                if self._videos is not None and self._own_videos:
                    self._videos.close()
                    self._videos = None
            warming.shutdown(wait=True)  # its GPU work must not outlive the run
        stats.wall_s = time.perf_counter() - self._started
        return stats

    def windows(self) -> tuple[int, int, int]:
        """In files: the first window, later ones, and how many load ahead of the one captioned (at
        most a window and those are held decoded). The first is what the loaders take at once (at
        most a batch: the first captions wait for neither batches of files nor a batch of clips)."""
        batch, prefetch = self.config.largest_batch, self.config.prefetch_batches
        return min(batch, self.load_workers), batch * prefetch, batch * prefetch

    def _loaded(
        self, files: Iterable[MediaFile], pool: ThreadPoolExecutor, ahead: int, stats: RunStats, stop: Callable[[], bool]
    ) -> Iterator["Pending | dict"]:
        """Every file's outcome (a Pending, or its error record) in order, loading `ahead` files
        ahead on `pool`; ends early once `stop()` says so."""
        queue = iter(files)
        loading = deque((file, pool.submit(self.prepare, file)) for file in islice(queue, ahead))
        while loading:
            if stop():
                stats.interrupted = True
                return
            _, future = loading.popleft()
            for next_file in islice(queue, 1):
                loading.append((next_file, pool.submit(self.prepare, next_file)))
            outcome = self._wait(future, stats)
            if isinstance(outcome, dict):
                self._count_failure(outcome, stats)
            yield outcome

    def _caption_window(self, ready: list[Pending], failures: list[dict], outputs: Outputs, stats: RunStats,
                        stop: Callable[[], bool]) -> None:
        """Caption `ready` in batches, videos then images, each costliest first (ties in file
        order), each batch collated while the one before runs; `failures` are written with the
        first batch. A batch holds one kind, by that kind's limits (`CaptionConfig.batch_limits`)."""
        batches: list[list[Pending]] = []
        for pending in sorted(ready, key=lambda p: (p.file.kind != "video", -p.item.vision_tokens)):
            if not batches or batches[-1][0].file.kind != pending.file.kind or self._full(batches[-1], pending):
                batches.append([])
            batches[-1].append(pending)
        collated = [self._collator.submit(self._collate, batch) for batch in batches[:1]]
        for index, batch in enumerate(batches):
            if index + 1 < len(batches):
                collated.append(self._collator.submit(self._collate, batches[index + 1]))
            if stats.interrupted or stop():
                stats.interrupted = True
                return
            outputs.write(failures + self.caption_batch(batch, stats, collated[index]))
            collated[index] = None  # its page-locked copy goes now: at most this batch's and the next's are held
            failures.clear()
            if stats.first_records_s is None:
                stats.first_records_s = time.perf_counter() - self._started

    def _collate(self, batch: list[Pending]) -> dict[str, torch.Tensor]:
        """The batch on the host, with its prompts' position ids (Qwen-VL's M-RoPE walks every
        image on the host: the GPU waited for it on the model's thread); for a GPU page-locked
        here, so `to_model`'s copies run asynchronously instead of stalling the model's thread."""
        items = [p.item for p in batch]
        if self.config.named:
            collated = collate_named(self.inputs, items, [p.prompts for p in batch], self.runner,
                                     self.config.max_new_tokens, placeholder_ids(self.model.config))
        else:
            collated = self.inputs.collate(items, [p.prompt for p in batch])
        shared = {SHARED: collated.pop(SHARED)} if SHARED in collated else {}
        ids, mask = collated["input_ids"], collated["attention_mask"]
        others = {key: value for key, value in collated.items() if key not in ("input_ids", "attention_mask")}
        collated["position_ids"] = prompt_positions(self.model, ids, mask, others)
        if self.device.type == "cuda":
            collated = {key: value.pin_memory() for key, value in collated.items()}
        return {**collated, **shared}

    def _full(self, batch: list[Pending], coming: Pending) -> bool:
        most, most_tokens = self.config.batch_limits(coming.file.kind)
        tokens = sum(p.item.vision_tokens for p in batch) + coming.item.vision_tokens
        return len(batch) >= most or tokens > most_tokens

    @staticmethod
    def _wait(future: Future, stats: RunStats) -> "Pending | dict":
        """The future's result; time the model spends waiting for a file still loading counts."""
        if future.done():
            return future.result()
        started = time.perf_counter()
        outcome = future.result()
        stats.input_wait_s += time.perf_counter() - started
        return outcome

    def prepare(self, file: MediaFile) -> Pending | dict:
        """Load and encode one file; a failure becomes its error record."""
        started = time.perf_counter()
        if file.kind == "video" and not self.inputs.reads_videos:  # refused before decoding its frames
            return self._error_record(file, "unsupported", f"{file.label}: this model reads images, not videos")
        try:
            item, size, video = self._encoded(file)
        except MediaError as error:
            return self._error_record(file, error.kind, str(error))
        # A processor rejecting one input (or a decoder failing in a way `load` does not foresee)
        # must not stop the run: an exception escaping here would end it from `future.result()`.
        except Exception as error:  # noqa: BLE001
            return self._error_record(file, "preprocess", f"{file.label}: {type(error).__name__}: {error}")
        return self._pending(file, item, started, size, video, file.path.stem, file.path.parent.name)

    def _pending(self, file: MediaFile, item: "EncodedMedia", started: float, size: tuple[int, int],
                 video: dict | None, name: str, folder: str) -> Pending:
        """The encoded file with its prompt (with named prompts, each one's) filled for it."""
        prompts = self.config.prompts_for(name, folder, *size)
        named = tuple(prompts) if self.config.named else ()
        return Pending(file, item, 1000.0 * (time.perf_counter() - started), prompts[0], size, video, named)

    def _encoded(self, file: MediaFile) -> "tuple[EncodedMedia, tuple[int, int], dict | None]":
        """The file's model input, its size as seen, and for a video how its frames were taken."""
        media = load(file, self.limits, self._video_decoders(file.path) if file.kind == "video" else None)
        if file.kind == "image":
            return self.inputs.encode_image(media), upright_size(file.path), None
        return self.inputs.encode_video(media.frames, media.metadata), media.size, media.record()

    def _video_decoders(self, path: Path) -> VideoDecoders:
        """The run's video decoder processes, started by the first video a loader thread takes."""
        with self._videos_lock:
            if self._ended:  # a loader thread still at work after the run: no new workers
                raise MediaError(path, "cancelled", "the run ended before its frames were decoded")
            if self._videos is None:
                workers = video_workers(self.config.load_workers)
                self._videos = VideoDecoders(workers, self.limits).start()
            return self._videos

    def caption_batch(self, batch: list[Pending], stats: RunStats,
                      collated: "Future[dict[str, torch.Tensor]] | None" = None) -> list[dict]:
        """The records of one batch (`collated`: its `collate`, when already under way). Only a
        file that fails alone gets an error record: a batch out of memory is split in halves (the
        memory is not one file's fault), and a file's named prompts too (`_failed_alone`); one
        that fails otherwise is retried one by one (one item can break a whole batch)."""
        try:
            if self._warming is not None:  # the warm-up's first calls end before the model's
                # Waited for, not raised: an error there is the real first call's to meet (and report).
                self._warming.exception()
                self._warming = None
            started = time.perf_counter()
            return self._records(batch, self._new_tokens(batch, stats, collated), started, stats)
        except Exception as error:  # noqa: BLE001
            self._free_memory()
            out_of_memory = isinstance(error, torch.OutOfMemoryError)
            if len(batch) == 1:
                return [self._failed_alone(batch[0], stats, error)]
        stats.retried_batches += 1
        half = (len(batch) + 1) // 2
        parts = [batch[:half], batch[half:]] if out_of_memory else [[pending] for pending in batch]
        return [record for part in parts for record in self.caption_batch(part, stats)]

    def _failed_alone(self, pending: Pending, stats: RunStats, error: Exception) -> dict:
        """The record of a file whose batch of one failed: out of memory with several named
        prompts, its prompts in halves (`rows_apart`), so a file whose prompts do not fit together
        gets its captions still; else, or where one prompt alone fails too, its error record."""
        if isinstance(error, torch.OutOfMemoryError) and len(pending.prompts) > 1:
            stats.retried_batches += 1
            started = time.perf_counter()
            try:
                rows = rows_apart(pending, lambda part: self._new_tokens([part], stats, None), self._free_memory)
                return self._records([pending], rows, started, stats)[0]
            except Exception as alone:  # noqa: BLE001
                self._free_memory()
                error = alone
        record = self._failure_record(pending.file, error)
        self._count_failure(record, stats)
        return record

    def _free_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_tokens(self, batch: list[Pending], stats: RunStats,
                    collated: "Future[dict[str, torch.Tensor]] | None") -> list[list[int]]:
        """The batch's rows' new tokens: a row a file, or with named prompts a row a file's prompt."""
        # Pixels normalised on the model's device into its dtype; ids, masks, grids and other
        # metadata (float32 times of video frames too, as the processor gives them) as they are.
        host = dict(collated.result() if collated is not None else self._collate(batch))
        shared = host.pop(SHARED, None)
        model_inputs = self.inputs.to_model(host, self.device, self.model.dtype)
        prompt_length = model_inputs["input_ids"].shape[1]
        stats.prompt_tokens += int(host["attention_mask"].sum())  # the host copy: no device sync
        stats.padded_prompt_tokens += host["attention_mask"].numel()
        generators = self._generators(batch)
        if shared is not None:  # `collate_named` shared only where the runner takes the rows
            ids, mask = model_inputs.pop("input_ids"), model_inputs.pop("attention_mask")
            new_ids = self.runner.generate_shared(ids, mask, shared, **model_inputs, **self.runner_settings, **generators)
            stats.prompt_batches["shared prefix"] += 1  # once it ran: a batch split on OOM counts its halves
            return new_ids.tolist()
        rows = model_inputs["input_ids"].shape[0]
        if self.runner is not None and not self.runner.call_unfit(rows, prompt_length, self.config.max_new_tokens):
            output = self.runner.generate(**model_inputs, **self.runner_settings, **generators)
        else:
            with torch.inference_mode():  # the stock generate (the patched one counts why it is not ours)
                output = self.model.generate(**model_inputs, **self.generate_settings, **generators)
        if self.config.named:
            stats.prompt_batches["whole prompts"] += 1
        return output[:, prompt_length:].tolist()

    def _records(self, batch: list[Pending], new_tokens: list[list[int]], started: float, stats: RunStats) -> list[dict]:
        """The batch's records from its rows' new tokens (the host copy waits for the device): a
        row a file, or with named prompts a row a file's prompt (file-major)."""
        batch_ms = 1000.0 * (time.perf_counter() - started)
        stats.batches += 1
        stats.batch_ms.append(batch_ms)
        kind = batch[0].file.kind  # a batch holds one kind (`_caption_window`)
        stats.batch_s_by_kind[kind] += batch_ms / 1000
        stats.captioned_by_kind[kind] += len(batch)
        per = len(self.config.named) or 1
        return [self._record(pending, new_tokens[i * per:(i + 1) * per], batch_ms, len(batch), stats)
                for i, pending in enumerate(batch)]

    def _generators(self, batch: list[Pending]) -> dict[str, list[torch.Generator]]:
        """With a seed, when sampling: `generate`'s `generator`, one per file seeded by the seed
        and the file's path within its root (`CaptionConfig.seed_for`)."""
        if self.config.seed is None or self.config.temperature == 0:
            return {}
        seeds = [self.config.seed_for(relative_path(pending.file.path, self.roots)) for pending in batch]
        # A file's prompts (those of its rows here) draw as it would alone with each.
        return {"generator": [torch.Generator(self.device).manual_seed(seed) for seed, pending in zip(seeds, batch)
                              for _ in range(len(pending.prompts) or 1)]}

    def _record(self, pending: Pending, rows: list[list[int]], batch_ms: float, batch_size: int, stats: RunStats) -> dict:
        """A file's record from its rows' new tokens: one; with named prompts one a prompt, whose
        captions, texts, token counts, truncations and prompts the record maps by name (its
        `caption` and `text`, which sidecars and metadata take, are the first prompt's)."""
        captions, counts, truncated = [], [], []
        for tokens in rows:
            ended = self.inputs.eos_token_id in tokens
            if ended:
                tokens = tokens[: tokens.index(self.inputs.eos_token_id)]
            captions.append(self.inputs.decode(tokens))
            counts.append(len(tokens))
            truncated.append(not ended and len(tokens) >= self.config.max_new_tokens)
        stats.succeeded += 1
        stats.captioned(pending.file.kind, pending.video)
        stats.generated_tokens += sum(counts)
        stats.item_ms.append(pending.load_ms + batch_ms / batch_size)
        width, height = pending.size
        names = [name for name, _ in self.config.named]
        by_name = (lambda values: dict(zip(names, values, strict=True))) if names else (lambda values: values[0])
        return {
            **self._identity(pending.file),
            "caption": captions[0],
            "text": self.config.text(captions[0]),
            **({"captions": by_name(captions), "texts": by_name([self.config.text(c) for c in captions])} if names else {}),
            "tokens": by_name(counts),
            "truncated": by_name(truncated),
            "model": self.model_name,
            "prompt": by_name(list(pending.prompts)) if names else pending.prompt,
            "width": width,
            "height": height,
            # What the model saw, by the resolution policy (a video: each frame; InternVL: the tiles' canvas).
            "model_width": pending.item.size[0],
            "model_height": pending.item.size[1],
            "vision_tokens": pending.item.vision_tokens,
            **({"video": pending.video} if pending.video is not None else {}),
            **({"settings": self.run_settings} if self.run_settings is not None else {}),
            "timings": {"load_ms": round(pending.load_ms, 3), "batch_ms": round(batch_ms, 3), "batch_size": batch_size},
        }

    def _identity(self, file: MediaFile) -> dict:
        identity = {"path": str(file.path), "relative_path": relative_path(file.path, self.roots), "kind": file.kind}
        mark = None if file.reason else fingerprint(file.path)  # the record follows it when the dataset moves
        return identity if mark is None else {**identity, "fingerprint": mark}

    def _failure_record(self, file: MediaFile, error: Exception) -> dict:
        """The error record of a file whose batch of one failed in the model."""
        if isinstance(error, torch.OutOfMemoryError):  # torch's message goes on with allocator advice
            first_line = (str(error).splitlines() or ["no details"])[0]
            return self._error_record(file, "out_of_memory", f"{file.label}: out of memory even alone ({first_line})")
        return self._error_record(file, "model", f"{file.label}: {type(error).__name__}: {error}")

    def _error_record(self, file: MediaFile, kind: str, message: str) -> dict:
        return {**self._identity(file), "model": self.model_name, "error_kind": kind, "error": message}

    @staticmethod
    def _count_failure(record: dict, stats: RunStats) -> None:
        stats.failed += 1
        stats.by_kind[record["kind"]] += 1
        stats.failures[record["error_kind"]] += 1


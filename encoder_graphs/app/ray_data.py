"""Captioning inside Ray Data: `RayCaptioner` is the class `Dataset.map_batches` takes, so that
each actor holds one model with its graphs and captions the batches Ray streams to it, from
`ray.data.read_parquet`, `read_webdataset` or any dataset with a column of image bytes (or of
paths to images) and a key column:

    ds = ray.data.read_parquet("shards/")
    captions = ds.map_batches(RayCaptioner, fn_constructor_kwargs={"model": "qwen2.5-vl-3b", "batch_size": 64},
                              batch_size=256, num_gpus=1, concurrency=4)
    captions.write_parquet("captions/")

A row's image is decoded and checked as a file of the caption command is (`media.decode_image`:
the same limits), captioned by the same `Captioner` at the job the command would resolve for a
batch of `batch_size` images (`app/job.py`), greedy. Each row comes back with its key, its
caption or its error (`error_kind`, `error`: a bad image costs its row only), token counts and
the prompt; every other column is carried through, the image column left out (a column named
as one of the outputs is refused, not overwritten). A prompt template's `{name}` is the key's
stem, `{folder}` empty, `{width}` and `{height}` the image's size as seen, as the command's. A
column of paths is read only with `read_paths=True`: a dataset names files on the worker's host,
which the command reads only where the user points it. Ray itself is an optional extra
(`pip install "encoder-graphs[ray]"`): this module imports none of it, nor torch or
transformers, which only an actor needs (`app/ray_rows.py`), so a driver starts without them."""

from collections import Counter
from typing import Any

from encoder_graphs.app.config import DEFAULT_IMAGE_TOKENS, CaptionConfig
from encoder_graphs.app.errors import UsageError
from encoder_graphs.app.plan import Plan
from encoder_graphs.app.prompts import checked
from encoder_graphs.app.settings import Settings

# The columns each row gains (a failed row: its error's; the others None); with named prompts also
# `captions` and `texts`, and `tokens`, `truncated`, `prompt` map each name to its own.
OUTPUT_COLUMNS = ("caption", "text", "tokens", "truncated", "prompt", "width", "height", "vision_tokens", "model",
                  "error_kind", "error")
NAMED_COLUMNS = ("captions", "texts")


def named_prompts(prompt: str | None, prompts: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """`prompts` (names to prompts, as a `--prompt-file`'s JSON) checked as the command checks its
    named prompts; given with `prompt`, a ValueError (one or the other)."""
    if prompts is None:
        return ()
    if prompt is not None:
        raise ValueError("RayCaptioner: give prompt= (one prompt) or prompts= (named ones), not both")
    if not isinstance(prompts, dict):
        raise TypeError("RayCaptioner: prompts= maps names to prompts, e.g. {'short': 'One sentence.'}")
    if not prompts:
        raise ValueError("RayCaptioner: prompts= is empty; give one prompt a name at least, or prompt=")
    try:
        return checked(list(prompts.items()), "prompts=")
    except UsageError as error:
        raise ValueError(f"RayCaptioner: {error}") from error


def one_batch_plan(settings: Settings, batch_size: int, named: tuple[tuple[str, str], ...] = ()) -> Plan:
    """The plan the caption command would make for `batch_size` images (no files, no outputs):
    an actor's job is sized for the batches Ray hands it (a row a prompt with named prompts)."""
    config = CaptionConfig(prompt=named[0][1] if named else settings.prompt, named=named,
                           max_new_tokens=settings.max_new_tokens)
    return Plan(settings, [], [], [], config, sidecars=None, results=None, counted=Counter(image=batch_size))


class RayCaptioner:
    """For `Dataset.map_batches(RayCaptioner, fn_constructor_kwargs=..., batch_size=N, num_gpus=1,
    concurrency=...)`: one model with its graphs per actor. `model`: a checkpoint directory, Hub
    id or preset (None: the embedded tiny default); `prompt`: one prompt, or `prompts`: names to
    prompts (as a `--prompt-file`'s JSON: each image encoded and prefilled once, a caption a
    name, in the `captions` column); `batch_size`: rows a generate call takes at
    most (give map_batches a multiple of it: a call's rows are decoded while the GPU captions the
    batches before them); `image_column`, `key_column`: the columns read; `read_paths`:
    whether an image column of paths is read (the module's docstring says why not by default)."""

    def __init__(self, model: str | None = None, *, prompt: str | None = None, prompts: dict[str, str] | None = None,
                 max_new_tokens: int = 32,
                 batch_size: int = 32, image_column: str = "image", key_column: str = "key",
                 max_image_tokens: int | None = DEFAULT_IMAGE_TOKENS, max_tiles: int | None = None,
                 no_graphs: bool = False, read_paths: bool = False, device: str = "auto") -> None:
        from encoder_graphs import enable_cuda_graphs
        from encoder_graphs.app.job import open_job, sized_job
        from encoder_graphs.app.loading import load_model, open_model, pick_device
        from encoder_graphs.app.ray_rows import RowCaptioner

        settings = Settings(model=model, prompt=prompt, max_new_tokens=max_new_tokens, batch_size=batch_size,
                            max_image_tokens=max_image_tokens, max_tiles=max_tiles, no_graphs=no_graphs, device=device)
        named = named_prompts(prompt, prompts)
        source = open_model(model, max_tiles=max_tiles, max_image_tokens=max_image_tokens)
        plan = one_batch_plan(settings, batch_size, named)
        job = open_job(plan, source, pick_device(device))
        self.model = load_model(source, job.device)
        self.job = sized_job(job, plan, self.model)
        self.handle = enable_cuda_graphs(self.model, self.job.options)
        self.captioner = RowCaptioner(self.model, source.inputs, self.job.config, self.job.limits,
                                      model_name=self.job.model_name, read_paths=read_paths)
        self.image_column, self.key_column = image_column, key_column
        self.outputs = OUTPUT_COLUMNS + (NAMED_COLUMNS if named else ())

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        for column in (self.image_column, self.key_column):
            if column not in batch:
                raise KeyError(f"the dataset has no column {column!r} (columns: {', '.join(batch)}); "
                               f"name it with {'image' if column == self.image_column else 'key'}_column=")
        if clashes := sorted(set(batch) & set(self.outputs)):
            raise ValueError(f"the dataset has columns named as RayCaptioner's outputs ({', '.join(clashes)}): "
                             "rename them first (Dataset.rename_columns), or they would be overwritten")
        keys = [str(key) for key in batch[self.key_column]]
        records = self.captioner.caption_rows(keys, list(batch[self.image_column]))
        carried = {name: list(values) for name, values in batch.items() if name != self.image_column}
        return {**carried, **{name: [record.get(name) for record in records] for name in self.outputs}}

"""A batch captioned with several named prompts: its items' shared prefixes (the chat template up
to the end of the image, and any text all prompts begin with) collated once, each prompt's rest
as one row's suffix (`decoder/shared.py` prefills the prefixes once and decodes every row); or,
where a family's template puts prompt text before the image, every prompt whole, a row each."""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from encoder_graphs.decoder.shared import SharedPrompts
from encoder_graphs.protocols import CaptionInputs, EncodedMedia
from encoder_graphs.seam.attention import TOKEN_INPUTS

if TYPE_CHECKING:
    from encoder_graphs.app.pipeline import Pending
    from encoder_graphs.decoder.runner import DecoderGraphRunner

SHARED = "shared"  # the collated batch's key of its rows (`SharedPrompts`), taken out before the model


def collate_named(
    inputs: CaptionInputs, items: Sequence[EncodedMedia], prompts: Sequence[Sequence[str]],
    runner: "DecoderGraphRunner | None", max_new_tokens: int, placeholders: set[int],
) -> dict:
    """Each item with each of its named prompts: their shared prefixes and suffixes (`SHARED`)
    where the decoder `runner` (None: the run's calls go to the stock `generate`) can take the
    batch's rows, else every prompt whole."""
    if runner is not None:
        collated = collate_shared(inputs, items, prompts, placeholders)
        if collated is not None:
            rows, length = collated[SHARED].rows, collated[SHARED].length(collated["input_ids"].shape[1])
            if runner.call_unfit(rows, length, max_new_tokens) is None:
                return collated
    return whole_rows(inputs, items, prompts)


def placeholder_ids(config) -> set[int]:
    """The token ids the model replaces with vision features, which a shared prefix must hold."""
    return {getattr(config, name) for name in ("image_token_id", "video_token_id", "image_token_index")
            if isinstance(getattr(config, name, None), int)}


def collate_shared(
    inputs: CaptionInputs, items: Sequence[EncodedMedia], prompts: Sequence[Sequence[str]], placeholders: set[int]
) -> dict | None:
    """The prefixes of `items` (each with its `prompts`, as many each), left-padded, with each
    item's pixels once and `SHARED`: row r = item r // P with prompt r % P. None where an item's
    prompts part before its last vision token: nothing is shared then."""
    count = len(prompts[0])
    whole = [inputs.collate(items, [own[k] for own in prompts]) for k in range(count)]
    tokens = [[row[mask.bool()].tolist() for row, mask in zip(c["input_ids"], c["attention_mask"], strict=True)]
              for c in whole]
    lengths, suffixes = [], []
    for item in range(len(items)):
        rows = [tokens[k][item] for k in range(count)]
        shared = common_prefix(rows)
        if any(token in placeholders for row in rows for token in row[shared:]):
            return None
        lengths.append(shared)
        suffixes.extend(tuple(row[shared:]) for row in rows)
    batch = prefixes_of(whole[0], lengths, inputs.pad_token_id)
    batch[SHARED] = SharedPrompts(tuple(i for i in range(len(items)) for _ in range(count)), tuple(suffixes))
    return batch


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """The tokens all `rows` begin with, leaving each at least one of its own (its first new
    token's logits come from its last one)."""
    shortest = min(map(len, rows))
    length = 0
    while length < shortest - 1 and all(row[length] == rows[0][length] for row in rows):
        length += 1
    return length


def prefixes_of(collated: dict[str, torch.Tensor], lengths: Sequence[int], pad_id: int) -> dict:
    """`collated` (left-padded rows) with each row cut to its first `lengths[row]` real tokens and
    left-padded again; its other inputs (pixels, grids) as they are."""
    width, real = max(lengths), collated["attention_mask"].sum(1).tolist()
    columns = collated["input_ids"].shape[1]
    batch = dict(collated)
    for key in ("input_ids", "attention_mask", *TOKEN_INPUTS):
        if key not in collated:
            continue
        value = collated[key]
        cut = value.new_full((len(lengths), width), pad_id if key == "input_ids" else 0)
        for row, (length, size) in enumerate(zip(lengths, real, strict=True)):
            start = columns - size
            cut[row, width - length:] = value[row, start:start + length]
        batch[key] = cut
    return batch


def whole_rows(
    inputs: CaptionInputs, items: Sequence[EncodedMedia], prompts: Sequence[Sequence[str]]
) -> dict[str, torch.Tensor]:
    """Every item with each of its prompts whole, a row each (row r = item r // P, prompt r % P):
    the way without a shared prefix, which encodes and prefills each item once per prompt."""
    return inputs.collate([item for item, own in zip(items, prompts, strict=True) for _ in own],
                          [prompt for own in prompts for prompt in own])


def rows_apart(
    pending: "Pending", new_tokens: "Callable[[Pending], list[list[int]]]", free_memory: Callable[[], None]
) -> list[list[int]]:
    """The rows (a row a prompt, in order) of a file (`Pending`) whose prompts ran out of memory
    together: its prompts in halves, each half halved again while it runs out of memory, so a
    file whose prompts do not fit together gets them still. OutOfMemoryError where one prompt
    alone does not fit."""
    half = (len(pending.prompts) + 1) // 2
    rows = []
    for part in (replace(pending, prompts=pending.prompts[:half]), replace(pending, prompts=pending.prompts[half:])):
        try:
            rows += new_tokens(part)
        except torch.OutOfMemoryError:
            if len(part.prompts) == 1:
                raise
            free_memory()
            rows += rows_apart(part, new_tokens, free_memory)
    return rows

"""Several prompts per item over one prefill of what they share (prefix sharing).

The prompts of one item agree on their tokens up to the end of its image (the chat template,
the vision tokens) and differ only in the instruction after it. The prefixes of a batch's items
are prefilled once (the encoder once, the image's ~1,200 tokens once), as `generate` prefills
whole prompts; each row (an item and one of its prompts) then continues its item's keys, values
and linear-attention states with its own suffix, rows of one suffix length in one forward (no
padding inside a row: linear attention's conv and recurrence would run over it), positions
continuing from the prefix's as a decode step's do. Each row's keys and values land in the
static cache at slots [0, prefix) and [length - suffix, length): the decode steps attend over
the mask, which holds the gap between them, so all rows end at one slot as left padding does.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from encoder_graphs.decoder.step import KeyValues, Prefilled, packed_prefill, prefill
from encoder_graphs.seam.text import continued_cache, dynamic_cache


@dataclass(frozen=True)
class SharedPrompts:
    """The rows of a shared-prefix generation: row r continues the prefix of item `items[r]` with
    the token ids `suffixes[r]` (at least one each: its first new token's logits come from it)."""

    items: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.items) != len(self.suffixes) or not self.items:
            raise ValueError(f"{len(self.items)} items for {len(self.suffixes)} suffixes")
        if not all(self.suffixes):
            raise ValueError("every row needs a suffix of at least one token")

    @property
    def rows(self) -> int:
        return len(self.items)

    def length(self, prefix_len: int) -> int:
        """Cache slots of the longest row: the prefixes' padded length plus the longest suffix."""
        return prefix_len + max(map(len, self.suffixes))

    def order(self) -> list[int]:
        """The rows in the order they run: group by group."""
        return [row for rows in self.groups() for row in rows]

    def groups(self) -> list[list[int]]:
        """The rows by suffix length (longest first), each in row order."""
        by_length: dict[int, list[int]] = {}
        for row, suffix in enumerate(self.suffixes):
            by_length.setdefault(len(suffix), []).append(row)
        return [by_length[n] for n in sorted(by_length, reverse=True)]


@dataclass
class SharedPrefill:
    """The rows' first logits [rows, vocab], their mask over the cache's first `length` slots and
    the position ids of their first decode step, all in `SharedPrompts.order`."""

    logits: torch.Tensor
    mask: torch.Tensor
    next_positions: torch.Tensor


# Where a row group's states go: (per-layer states, their rows in the store, the slots of each).
Load = Callable[[KeyValues, torch.Tensor, torch.Tensor], None]


def shared_prefill(
    model: torch.nn.Module,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    model_inputs: dict,
    shared: SharedPrompts,
    *,
    packed: bool,
    load: Load | None,
    text_position_row: int | None = None,
) -> SharedPrefill:
    """Prefill the left-padded prefixes once (packed or padded, as `generate` would the whole
    prompts), then each suffix group over copies of its items' states; `load` receives each
    group's states for the static cache (None: nothing decodes after the first token);
    `text_position_row`: `packed_prefill`'s."""
    prefilled = (packed_prefill(model, prefix_ids, prefix_mask, model_inputs, text_position_row) if packed
                 else prefill(model, prefix_ids, prefix_mask, model_inputs))
    states, prefix_positions = padded_states(prefilled, prefix_mask.shape), prefilled.next_positions
    del prefilled  # a packed prefill's states, copied into `states`: not held twice while the groups run
    text_config = model.config.get_text_config(decoder=True)
    prefix_len = prefix_mask.shape[1]
    length = shared.length(prefix_len)
    logits, masks, positions = [], [], []
    done = 0
    for rows in shared.groups():
        items = torch.tensor([shared.items[row] for row in rows], device=prefix_ids.device)
        suffix = torch.tensor([shared.suffixes[row] for row in rows], device=prefix_ids.device)
        count, n = suffix.shape
        cache = continued_cache(dynamic_cache(text_config), [(a[items], b[items]) for a, b in states])
        mask = torch.cat([prefix_mask[items], prefix_mask.new_ones(count, n)], dim=1)
        steps = torch.arange(n, device=prefix_ids.device)
        suffix_positions = prefix_positions[..., items, :] + steps
        continued = prefill(model, suffix, mask, {"position_ids": suffix_positions}, cache)
        slots = torch.cat([torch.arange(prefix_len, device=steps.device), length - n + steps])
        if load is not None:
            load(continued.key_values, torch.arange(done, done + count, device=steps.device), slots)
        done += count
        logits.append(continued.logits)
        masks.append(mask.new_zeros(count, length).index_copy(1, slots, mask))
        positions.append(continued.next_positions)
        del cache, continued  # this group's states are in the store: freed before the next group's copies
    return SharedPrefill(torch.cat(logits), torch.cat(masks), torch.cat(positions, dim=-2))


def padded_states(prefilled: Prefilled, shape: Sequence[int]) -> KeyValues:
    """A prefill's per-layer states in the prompts' left-padded layout [batch, heads, length, dim]
    (a packed prefill's tokens put back at their (row, slot), zeros at the padding)."""
    if prefilled.slots is None:
        return prefilled.key_values
    rows, columns = prefilled.slots

    def unpacked(packed: torch.Tensor) -> torch.Tensor:
        layout = packed.new_zeros(shape[0], packed.shape[1], shape[1], packed.shape[3])
        layout[rows, :, columns] = packed[0].transpose(0, 1)
        return layout

    # A packed prefill runs for full-attention layers only (`DecoderGraphRunner.packed_prefill`).
    return [(unpacked(keys), unpacked(values)) for keys, values in prefilled.key_values]

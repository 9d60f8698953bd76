"""Prompts of different lengths as one batch: padded on the left, so every row's next token is at the end."""

from __future__ import annotations

from typing import Sequence

import torch


def left_pad(batch: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] input ids padded on the left and the matching attention mask."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids.to(device), mask.to(device)

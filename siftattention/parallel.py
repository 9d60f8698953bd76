"""Where a model's heads and layers live: tensor parallelism and accelerate device maps.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` run by
``torchrun``) every rank runs every layer on its own shard of the heads, so the attention
functions, and with them every method's state and record, see that rank's query and KV
heads only. A method needs nothing more: a head's selection depends on its own scores
alone. What describes the whole model, the statistics, is gathered over the ranks here,
so that every rank reports every head in the model's order (colwise sharding gives rank
r the r-th contiguous block of heads).

Under an accelerate device map each layer runs on its own device: methods allocate
their state where the layer's query is, and the kernels launch on that device.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ranks started by ``torchrun`` (its WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_main_rank() -> bool:
    """Rank 0 of a ``torchrun`` launch, or a process that is not one: the one that prints and writes."""
    return int(os.environ.get("RANK", "0")) == 0


def tensor_parallel_group(model: torch.nn.Module) -> Any:
    """The process group that shards ``model``'s heads, or None when it is not tensor parallel."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = getattr(model, "_tp_size", None)
    if not size or int(size) <= 1:
        return None
    from torch.distributed.tensor import DTensor, Shard

    # The mesh of a sharded weight is the tensor-parallel mesh whatever else the model's mesh holds.
    for param in model.parameters():
        if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or ()
            if mesh.ndim > 1:
                if "tp" not in names:
                    raise RuntimeError(f"the model's {mesh.ndim}-D device mesh {names} has no 'tp' dimension")
                mesh = mesh["tp"]
            return mesh.get_group()
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise RuntimeError(f"the model says tp_size={size} but has neither a sharded weight nor a device mesh")
    return mesh["tp"].get_group() if mesh.ndim > 1 else mesh.get_group()


def gather_heads(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order, on the CPU.

    A collective: every rank of ``group`` must call it, in the same order. Pickled
    through ``all_gather_object`` so that it works on every backend (NCCL has no CPU
    tensors) and with ranks holding different numbers of heads; statistics are small.
    """
    if group is None:
        return tensor.cpu()
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensor.cpu(), group=group)
    return torch.cat(parts, dim=dim)


def device_map_devices(model: torch.nn.Module) -> list[str]:
    """The distinct devices of ``model``'s accelerate device map (``hf_device_map``), in first-use order."""
    device_map = getattr(model, "hf_device_map", None) or {}
    seen: dict[str, None] = {}
    for device in device_map.values():
        seen.setdefault(str(torch.device(f"cuda:{device}") if isinstance(device, int) else device), None)
    return list(seen)


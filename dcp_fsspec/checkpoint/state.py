"""Turning the values handed to ``save``/``load`` into DCP state dicts, and loading them back.

Each keyword of :meth:`Checkpointer.save` is one DCP checkpoint, and its value one of:

* an ``nn.Module``, or a list of them (pipeline stages): ``get_model_state_dict`` /
  ``set_model_state_dict``, so FSDP2/DTensor-sharded models save shards and reshard on load. A
  list is merged into one state dict (as torchtitan does), so the split may change between runs;
* a ``torch.optim.Optimizer``, or a list of them: ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict`` with the model passed as ``model=``, flattened to parameter
  names so it reshards too. A list of optimizers goes with a list of modules of the same length;
* anything ``Stateful`` (an LR scheduler, a data loader), or a list of them: ``state_dict()`` /
  ``load_state_dict()``;
* a plain ``dict`` of tensors and values, restored in place: DCP copies into its tensors and
  replaces its other values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _all_of(value: Any, kind: type) -> list[Any] | None:
    """``[value]`` or ``list(value)`` when it is a ``kind`` or a non-empty list of them."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
        return list(value)
    return None


def _statefuls(value: Any) -> list[Any] | None:
    # Modules and optimizers are Stateful too (they have state_dict/load_state_dict); callers
    # test for them first, because their plain state_dict() does not reshard.
    return _all_of(value, Stateful)


def is_optimizer(value: Any) -> bool:
    """Whether ``value`` is an optimizer or a list of them."""
    return _all_of(value, torch.optim.Optimizer) is not None


def _leave_unstepped(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give back optimizers that had not stepped the empty state they had.

    torch's ``get_optimizer_state_dict`` creates their state with a zero-learning-rate step,
    which advances the step count and so changes training. The state dict just read keeps that
    state with its step counts set back to zero: the state of an optimizer about to take its
    first step, which is what a load of it restores.
    """
    for optimizer in optimizers:
        for param_state in optimizer.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
        optimizer.state.clear()


def _merge(key: str, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        for name, item in part.items():
            if name in merged:
                raise ValueError(
                    f"key {key!r}: {name!r} appears in two entries of the list; their names must differ"
                )
            merged[name] = item
    return merged


def _optimizer_pairs(
    key: str, optimizers: list[torch.optim.Optimizer], model: Any
) -> list[tuple[nn.Module, Any]]:
    """Which module each optimizer (or the whole list) optimizes."""
    modules = _all_of(model, nn.Module)
    if modules is None:
        raise ValueError(
            f"key {key!r} holds an optimizer, which is saved and loaded by parameter name: pass the "
            "model it optimizes as model=... in the same save()/load() call"
        )
    if len(modules) == 1:
        return [(modules[0], optimizers if len(optimizers) > 1 else optimizers[0])]
    if len(modules) != len(optimizers):
        raise ValueError(
            f"key {key!r} holds {len(optimizers)} optimizer(s) for a model of {len(modules)} modules; "
            "pass one optimizer per module, in the same order"
        )
    return list(zip(modules, optimizers))


def state_dict_for(key: str, value: Any, *, model: Any = None) -> dict[str, Any]:
    """The DCP state dict that saves (or, passed to ``dcp.load``, receives) ``value``.

    Args:
        key: the keyword ``value`` was passed as, for messages.
        value: see the module docstring for the kinds accepted.
        model: the value passed as ``model=``, which optimizers need.

    Raises:
        TypeError: ``value`` is of no supported kind.
        ValueError: an optimizer without its model, or names that collide in a list.
    """
    if (modules := _all_of(value, nn.Module)) is not None:
        return _merge(key, [get_model_state_dict(m) for m in modules])
    if (optimizers := _all_of(value, torch.optim.Optimizer)) is not None:
        pairs = _optimizer_pairs(key, optimizers, model)
        unstepped = [o for o in optimizers if not o.state]
        merged = _merge(key, [get_optimizer_state_dict(m, o, options=_OPTIM_OPTIONS) for m, o in pairs])
        _leave_unstepped(unstepped)
        return merged
    if isinstance(value, dict):
        return value
    if (statefuls := _statefuls(value)) is not None:
        if isinstance(value, (list, tuple)):
            return {str(i): s.state_dict() for i, s in enumerate(statefuls)}
        return dict(value.state_dict())
    raise TypeError(
        f"cannot checkpoint key {key!r}: a {type(value).__name__} is not an nn.Module, optimizer, "
        "LR scheduler or other Stateful, dict, or a list of modules/optimizers/Statefuls"
    )


def restore(
    key: str, value: Any, state_dict: dict[str, Any], *, model: Any = None, strict: bool = True
) -> None:
    """Put ``state_dict`` (filled by ``dcp.load``) back into ``value``.

    ``state_dict`` must come from :func:`state_dict_for` with the same ``value``. A dict was
    filled in place by ``dcp.load`` already, so there is nothing left to do for it.
    """
    if (modules := _all_of(value, nn.Module)) is not None:
        # With several modules each takes its own names from the merged dict; strictness then
        # comes from dcp.load, which saw every name.
        options = StateDictOptions(strict=strict and len(modules) == 1)
        for module in modules:
            set_model_state_dict(module, state_dict, options=options)
    elif (optimizers := _all_of(value, torch.optim.Optimizer)) is not None:
        for module, optim in _optimizer_pairs(key, optimizers, model):
            set_optimizer_state_dict(module, optim, state_dict, options=_OPTIM_OPTIONS)
    elif isinstance(value, dict):
        pass
    elif (statefuls := _statefuls(value)) is not None:
        if isinstance(value, (list, tuple)):
            for i, stateful in enumerate(statefuls):
                stateful.load_state_dict(state_dict[str(i)])
        else:
            value.load_state_dict(state_dict)

"""Decode steps batched over layers, shared by the online policies that merge (KeepKV, ZSMerge).

A decode forward hands each layer's attention to the online policy. A merging policy's step on
one layer is some sixty to a hundred small tensor operations, and on a CPU their dispatch costs
more than their arithmetic. A layer's step touches only that layer,
and nothing reads the layer again before the next forward, so the policy holds each layer's step
until the forward's last layer and a :class:`LayerBatch` runs it once for all of them: the
per-slot state of every layer lives in stacked ``(L, B, H, …)`` tensors of which each layer's
state keeps a view, and only what reads or writes a layer's keys and values runs layer by layer
(:func:`gather_slots`, :func:`write_slots`, :func:`move_newest`). Whenever the batched step
cannot run (a longer forward, a layer not yet in its steady state) every layer steps on its own,
in layer order, and the batch stacks their state again. The result is the per-layer step's.
"""

from __future__ import annotations

import torch

from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

StepInput = tuple[int, FoldedLayer, Tensor, "Tensor | None", "Tensor | None"]
"""What the attention hands a policy: ``(layer_idx, layer, query, probs, logits)``."""

Buffers = tuple[Tensor, Tensor, Tensor]
"""A layer's :meth:`~kvfold.runtime.folded_layer.FoldedLayer.dense_buffers`: keys, values, β."""


class LayerBatch:
    """The state of several layers stacked into ``(L, …)`` tensors, one row per layer, of which each
    layer's own state holds views; and the decode steps held until the forward's last layer.

    A policy calls :meth:`new_forward` before a layer's step, :meth:`hold` for a decode step it
    leaves to the batch, and :meth:`run_held` where every held step must have run (exporting its
    state). Subclasses define how a layer's state is read and replaced (:meth:`layer_state`,
    :meth:`set_layer_state`), how it is stacked (:meth:`adopt`, ending with :meth:`install`), the
    batched step (:meth:`step`, which starts with :meth:`can_step`) and the per-layer step it falls
    back to (:meth:`step_layer`).

    Args:
        order: the indices of the layers, ascending (the order of a forward).
    """

    def __init__(self, order: list[int]) -> None:
        self.order = order
        self._stack: dict[str, Tensor] | None = None
        self._held: list[StepInput] = []  # this forward's decode steps, until its last layer

    # -- to define --------------------------------------------------------------------
    def layer_state(self, layer_idx: int) -> dict[str, Tensor | None] | None:
        """The layer's state tensors by name (a tensor the layer does not keep: None; no state: None)."""
        raise NotImplementedError

    def set_layer_state(self, layer_idx: int, views: dict[str, Tensor]) -> None:
        """Make the layer's state the given views (rows of the stacked tensors)."""
        raise NotImplementedError

    def adopt(self) -> bool:
        """Stack every layer's state (then :meth:`install`); False where it cannot be stacked."""
        raise NotImplementedError

    def step(self, items: list[StepInput]) -> bool:
        """One decode step of every layer; False (nothing changed) where it cannot run batched."""
        raise NotImplementedError

    def step_layer(self, item: StepInput) -> None:
        """One layer's own step (the fallback of :meth:`step`)."""
        raise NotImplementedError

    # -- the stack --------------------------------------------------------------------
    def install(self, stack: dict[str, Tensor]) -> None:
        """Give each layer's state the views of its row of ``stack`` and keep the stack."""
        for j, layer_idx in enumerate(self.order):
            self.set_layer_state(layer_idx, {name: tensor[j] for name, tensor in stack.items()})
        self._stack = stack

    def is_stacked(self) -> bool:
        """Whether every layer's state is still a view of the stack (a longer forward may have grown
        or replaced it: then it is stacked again)."""
        if self._stack is None:
            return False
        for j, layer_idx in enumerate(self.order):
            state = self.layer_state(layer_idx)
            if state is None:
                return False
            for name, tensor in state.items():
                if tensor is not None and tensor.data_ptr() != self._stack[name][j].data_ptr():
                    return False
        return True

    def can_step(self, items: list[StepInput]) -> bool:
        """What every batched step needs: the state is stacked, ``items`` are one decode step (one
        query, with its attention probabilities) of every layer in order, on dense layers at one
        logical length."""
        if not self.is_stacked() or [item[0] for item in items] != self.order:
            return False
        logical = items[0][1].logical_length
        for _, layer, query, probs, _ in items:
            if query.shape[2] != 1 or probs is None or layer.stored is not None:
                return False
            if layer.logical_length != logical:
                return False
        return True

    # -- holding a forward's steps ----------------------------------------------------
    def new_forward(self, layer_idx: int) -> None:
        """Before layer ``layer_idx`` steps: a held forward that stopped before its last layer (this
        layer is not after the last one held) runs now."""
        if self._held and layer_idx <= self._held[-1][0]:
            self.run_held()

    def hold(self, item: StepInput) -> None:
        """Hold a layer's decode step; the forward's last layer runs them all."""
        self._held.append(item)
        if item[0] == self.order[-1]:
            self.run_held()

    def run_held(self) -> None:
        """Run the held steps: all layers at once, else each layer's own step in layer order, after
        which the state is stacked again where it has to be."""
        held, self._held = self._held, []
        if not held or self.step(held):
            return
        for item in held:
            self.step_layer(item)
        if not self.is_stacked():
            self.adopt()


# ---------------------------------------------------------------------------- keys and values, layer by layer


def gather_slots(buffers: list[Buffers], index: Tensor) -> tuple[Tensor, Tensor]:
    """The keys and values at ``index`` ``(L, B, H, k)`` of every layer, stacked ``(L, B, H, k, D)``
    in the cache's dtype."""
    count, batch, heads, width = index.shape
    keys, values = buffers[0][0], buffers[0][1]
    dim, dim_v = keys.shape[-1], values.shape[-1]
    out_k = torch.empty((count, batch, heads, width, dim), dtype=keys.dtype, device=index.device)
    out_v = torch.empty((count, batch, heads, width, dim_v), dtype=values.dtype, device=index.device)
    for j, (keys, values, _) in enumerate(buffers):
        torch.gather(keys, 2, index[j].unsqueeze(-1).expand(-1, -1, -1, dim), out=out_k[j])
        torch.gather(values, 2, index[j].unsqueeze(-1).expand(-1, -1, -1, dim_v), out=out_v[j])
    return out_k, out_v


def write_slots(buffers: list[Buffers], slot: Tensor, keys: Tensor, values: Tensor, log_mass: Tensor) -> None:
    """Write one entry per row into every layer: at ``slot`` ``(L, B, H, 1)`` the key and value
    ``(L, B, H, 1, D)`` and the β ``(L, B, H, 1)``, each cast to its buffer's dtype."""
    for j, (layer_keys, layer_values, layer_log_mass) in enumerate(buffers):
        index = slot[j].unsqueeze(-1)
        layer_keys.scatter_(2, index.expand(-1, -1, 1, layer_keys.shape[-1]), keys[j].to(layer_keys.dtype))
        layer_values.scatter_(2, index.expand(-1, -1, 1, layer_values.shape[-1]), values[j].to(layer_values.dtype))
        layer_log_mass.scatter_(2, slot[j], log_mass[j].to(layer_log_mass.dtype))


def move_newest(buffers: list[Buffers], layers: list[FoldedLayer], slot: Tensor, sizes: list[int]) -> None:
    """The compaction after a step: every layer's newest entry (slot ``n − 1`` of a layer of
    ``n = sizes[j]`` slots) moves into ``slot`` ``(L, B, H, 1)`` (a victim's), and the layer
    shrinks to ``n − 1`` slots."""
    for j, ((keys, values, log_mass), layer, n) in enumerate(zip(buffers, layers, sizes, strict=True)):
        index = slot[j].unsqueeze(-1)
        keys.scatter_(2, index.expand(-1, -1, 1, keys.shape[-1]), keys.narrow(2, n - 1, 1).clone())
        values.scatter_(2, index.expand(-1, -1, 1, values.shape[-1]), values.narrow(2, n - 1, 1).clone())
        log_mass.scatter_(2, slot[j], log_mass.narrow(2, n - 1, 1).clone())
        layer.truncate(n - 1)

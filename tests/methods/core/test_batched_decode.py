"""The layer-batched decode mechanism (kvfold.methods.core.batched_decode): holding a forward's steps,
stacking state as views, and the per-layer reads and writes of keys and values."""

from __future__ import annotations

import torch

from kvfold.methods.core.batched_decode import LayerBatch, gather_slots, move_newest, write_slots
from kvfold.runtime.folded_layer import FoldedLayer


class _Recorder(LayerBatch):
    """A batch over layers 0–2 whose state is one tensor per layer; ``batched`` says whether it steps."""

    def __init__(self, batched: bool) -> None:
        super().__init__([0, 1, 2])
        self.batched = batched
        self.state = {i: torch.full((1, 1, 4), float(i)) for i in self.order}
        self.calls: list[tuple[str, list[int]]] = []

    def layer_state(self, layer_idx):
        return {"score": self.state[layer_idx]}

    def set_layer_state(self, layer_idx, views):
        self.state[layer_idx] = views["score"]

    def adopt(self) -> bool:
        self.calls.append(("adopt", []))
        self.install({"score": torch.stack([self.state[i] for i in self.order])})
        return True

    def step(self, items) -> bool:
        self.calls.append(("step", [item[0] for item in items]))
        return self.batched

    def step_layer(self, item) -> None:
        self.calls.append(("layer", [item[0]]))


def _item(layer_idx: int) -> tuple:
    return (layer_idx, None, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), None)


def test_the_last_layer_runs_the_held_steps_at_once():
    batch = _Recorder(batched=True)
    for i in batch.order:
        batch.new_forward(i)
        batch.hold(_item(i))
    assert batch.calls == [("step", [0, 1, 2])]


def test_a_forward_that_stopped_early_steps_layer_by_layer_then_stacks_the_state():
    batch = _Recorder(batched=False)
    batch.hold(_item(0))
    batch.hold(_item(1))
    batch.new_forward(0)  # a new forward: layers 0 and 1 were held, layer 2 never came
    assert batch.calls == [("step", [0, 1]), ("layer", [0]), ("layer", [1]), ("adopt", [])]
    assert batch.is_stacked()
    batch.run_held()  # nothing held: nothing runs
    assert len(batch.calls) == 4


def test_install_gives_each_layer_a_view_and_a_replaced_state_is_no_longer_stacked():
    batch = _Recorder(batched=True)
    assert not batch.is_stacked()
    batch.adopt()
    assert batch.is_stacked()
    batch.state[1].add_(1.0)  # an in-place edit of a view edits the stack
    assert batch._stack["score"][1, 0, 0, 0] == 2.0
    batch.state[2] = batch.state[2].clone()  # a layer whose state grew or was replaced
    assert not batch.is_stacked()
    batch.batched = False
    batch.hold(_item(0))
    batch.hold(_item(1))
    batch.hold(_item(2))  # the step fails, the layers step alone, and the state is stacked again
    assert batch.calls[-1] == ("adopt", []) and batch.is_stacked()


def _layer(n: int, seed: int) -> FoldedLayer:
    generator = torch.Generator().manual_seed(seed)
    layer = FoldedLayer()
    layer.update(torch.randn(2, 3, n, 4, generator=generator), torch.randn(2, 3, n, 5, generator=generator))
    return layer


def test_gather_write_and_move_newest_read_and_edit_each_layer():
    layers = [_layer(6, 0), _layer(6, 1)]
    buffers = [layer.dense_buffers() for layer in layers]
    before = [tuple(t.clone() for t in b) for b in buffers]
    index = torch.tensor([1, 4]).view(2, 1, 1, 1).expand(2, 2, 3, 1)
    keys, values = gather_slots(buffers, index)
    assert keys.shape == (2, 2, 3, 1, 4) and values.shape == (2, 2, 3, 1, 5)
    torch.testing.assert_close(keys[1, :, :, 0], before[1][0][:, :, 4])
    torch.testing.assert_close(values[0, :, :, 0], before[0][1][:, :, 1])
    write_slots(buffers, index, keys + 1.0, values - 1.0, torch.full((2, 2, 3, 1), 0.5))
    torch.testing.assert_close(buffers[1][0][:, :, 4], before[1][0][:, :, 4] + 1.0)
    torch.testing.assert_close(buffers[0][2][:, :, 1], torch.full((2, 3), 0.5))
    move_newest(buffers, layers, index, [6, 6])
    for layer, old, slot in zip(layers, before, (1, 4), strict=True):
        assert layer.physical_length == 5
        keys_now, values_now, _ = layer.dense_buffers()
        torch.testing.assert_close(keys_now[:, :, slot], old[0][:, :, 5])
        torch.testing.assert_close(values_now[:, :, slot], old[1][:, :, 5])

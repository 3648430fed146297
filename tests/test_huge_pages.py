"""A CPU model's tensors move into one region backed by 2 MB pages (model/huge_pages.py): where
the bytes live changes, nothing else (values, shapes, strides, ties, shared storages, results)."""

from __future__ import annotations

import torch
from helpers import hf_model, tiny_llm
from torch import nn

from specserve.model import huge_pages
from specserve.model.huge_pages import HUGE_PAGE_BYTES, move_to_huge_pages
from specserve.worker.model_runner import SequenceRun


def _toy_model() -> nn.ModuleList:
    """A tied head, an input-major (transposed view) weight, a buffer that views a parameter."""
    torch.manual_seed(0)
    embed = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = embed.weight
    inner = nn.Linear(8, 16)
    inner.weight.data = inner.weight.data.t().contiguous().t()
    holder = nn.Module()
    holder.register_buffer("rows", embed.weight.data[10:20])  # shares the embedding's storage
    holder.register_buffer("steps", torch.arange(7, dtype=torch.int64))
    return nn.ModuleList([embed, inner, head, holder])


def _outputs(model: nn.ModuleList) -> list[torch.Tensor]:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    return [model[0](torch.tensor([3, 7])), model[1](x), model[2](x),
            model[3].rows.clone(), model[3].steps.clone()]


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_moved_tensors_keep_values_strides_ties_and_shared_storage(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    model = _toy_model()
    before = _outputs(model)
    strides = [p.stride() for p in model.parameters()]
    moved = move_to_huge_pages(model)
    assert moved >= sum(p.numel() * 4 for p in model.parameters())
    assert model[2].weight is model[0].weight  # still one Parameter
    assert [p.stride() for p in model.parameters()] == strides  # input-major stays input-major
    assert model[1].weight.t().is_contiguous()
    assert model[3].rows.untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()
    assert torch.equal(model[3].rows, model[0].weight[10:20])
    model[0].weight.data[12, 0] = 5.0  # a view still sees its base's writes
    assert model[3].rows[2, 0] == 5.0
    model[0].weight.data[12, 0] = before[3][2, 0]
    # every tensor sits in one region, which starts on a 2 MB boundary and asked for 2 MB pages
    tensors = list(model.parameters()) + list(model.buffers())
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    start = min(t.data_ptr() for t in tensors)
    assert start % HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(start)  # madvise(MADV_HUGEPAGE) took
    for a, b in zip(before, _outputs(model), strict=True):
        assert torch.equal(a, b)


def test_nothing_moves_where_huge_pages_are_off(monkeypatch):
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    assert not huge_pages.huge_pages_available()
    model = _toy_model()
    pointers = [t.data_ptr() for t in model.parameters()]
    assert move_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in model.parameters()] == pointers


def test_engine_model_lives_in_huge_pages_and_matches_transformers(tiny_llama):
    """Loading moves the model where the machine offers 2 MB pages; logits equal transformers'
    either way (the move changes no byte)."""
    llm = tiny_llm(tiny_llama)
    model = llm.llm_engine.runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if huge_pages.huge_pages_available():
        assert len(storages) == 1
        assert "hg" in _vm_flags(min(t.data_ptr() for t in tensors))
    else:
        assert len(storages) > 1
    ids = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = llm.llm_engine.runner.execute([SequenceRun(ids, 0, [1, 2], list(range(20)))])
    with torch.no_grad():
        expected = hf_model(tiny_llama)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

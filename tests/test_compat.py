"""`gradaccum._compat`: the fallbacks for torch APIs newer than torch 2.4 give what those APIs give.

Each fallback is run on the installed torch with the newer API hidden (monkeypatched away), and
compared with the API itself where this torch has it, or with what torch 2.4 computes instead.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

from gradaccum import Accumulator, _compat, save_checkpoint
from gradaccum._sync_base import is_fsdp
from tests.state import assert_bitwise, clone_state


def _grads() -> list[torch.Tensor]:
    """Gradients of two dtypes, interleaved: the grouping path of `get_total_norm`."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=generator, dtype=torch.float64),
        torch.randn(4, generator=generator),
        torch.randn(7, generator=generator, dtype=torch.float64),
        torch.randn(2, 2, generator=generator),
    ]


def test_total_norm_without_get_total_norm_equals_clip_grad_norm_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _grads()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, math.inf)  # torch 2.4's own total norm
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
    got = _compat.total_norm(grads)
    assert torch.equal(got, expected)
    assert _compat.total_norm([]).item() == 0.0


def test_total_norm_uses_get_total_norm_where_torch_has_it() -> None:
    if not hasattr(torch.nn.utils, "get_total_norm"):
        pytest.skip("torch.nn.utils.get_total_norm is new in torch 2.6")
    grads = _grads()
    assert torch.equal(_compat.total_norm(grads), torch.nn.utils.get_total_norm(grads))


def test_accelerator_fallbacks_without_torch_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _compat.current_accelerator()
    monkeypatch.delattr(torch, "accelerator", raising=False)
    assert _compat.current_accelerator() == expected  # None on a CPU-only machine
    _compat.synchronize(torch.device("cpu"))  # nothing to wait for, and no AttributeError
    assert _compat.max_memory_allocated(torch.device("cpu")) is None  # the CPU keeps no peak


def test_dtensor_and_fsdp_module_types_resolve_on_this_torch() -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch built without distributed support")
    assert issubclass(_compat.dtensor_type(), torch.Tensor)
    fsdp_module = _compat.fsdp_module_type()
    assert fsdp_module is not None
    assert fsdp_module.__name__ == "FSDPModule"


def test_fsdp2_before_torch_2_6_is_refused_naming_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.4's FSDP2 prototype (simulated): was taken for an undistributed model."""

    class PrototypeFSDPModule:  # torch.distributed._composable.fsdp.FSDPModule's stand-in
        pass

    class Sharded(PrototypeFSDPModule, torch.nn.Linear):
        pass

    model = Sharded(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(_compat, "fsdp_module_type", lambda: PrototypeFSDPModule)
    if hasattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule"):
        # Negative control: where FSDP2 is public, the same model is taken for an FSDP2 one.
        assert is_fsdp(model)
        monkeypatch.delattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule")
    before = clone_state([model.state_dict(), optimizer.state_dict()])
    expected = r"FSDP2 \(fully_shard\) from torch 2\.6.*Upgrade torch"
    with pytest.raises(RuntimeError, match=expected):
        Accumulator(model, optimizer, micro_batch_size=2)
    with pytest.raises(RuntimeError, match=expected):
        save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer)
    assert list(tmp_path.iterdir()) == []
    assert_bitwise([model.state_dict(), optimizer.state_dict()], before)

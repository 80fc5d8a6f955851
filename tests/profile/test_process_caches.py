"""A trace runs the model's code on fake tensors; what that code caches for the whole process must not stay fake.

transformers' BEiT builds its relative-position index in an ``lru_cache``'d function: when the first call of it was
memopt's traced forward, every real forward afterwards read the fake tensor (the H200 zoo row
``beitbase-128x224-12GiB`` trained on NaN losses; on the CPU the forward raised). The plain-PyTorch patterns that
do the same (an ``lru_cache``'d helper, a module-level dict), and the tiny BEiT itself.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import memopt


@functools.lru_cache(maxsize=4)
def _position_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) / n


class _CachedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) + _position_table(x.shape[-1])).square().mean()


def test_a_cached_tensor_made_during_a_trace_is_recomputed_for_real_forwards():
    _position_table.cache_clear()
    model = _CachedTable()
    x = torch.randn(4, 16)
    memopt.profile(model, x, hardware="h200", use_cache=False)
    table = _position_table(16)
    assert not isinstance(table, FakeTensor)
    assert torch.equal(table, torch.arange(16, dtype=torch.float32) / 16)
    loss = model(x)
    assert torch.isfinite(loss) and not isinstance(loss, FakeTensor)


def test_a_cache_filled_before_the_trace_is_left_alone():
    _position_table.cache_clear()
    before = _position_table(16)
    memopt.profile(_CachedTable(), torch.randn(4, 16), hardware="h200", use_cache=False)
    assert _position_table(16) is before  # the trace hit the cache: nothing to empty


def test_beit_trains_on_real_values_after_memopt_planned_it():
    tf = pytest.importorskip("transformers")
    # an image and patch size no other test uses: the cache key (the patch grid) is new to this process
    cfg = tf.AutoConfig.for_model("beit", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                  num_attention_heads=4, image_size=35, patch_size=7, use_relative_position_bias=True,
                                  num_labels=10, drop_path_rate=0.0)
    torch.manual_seed(0)
    model = tf.AutoModelForImageClassification.from_config(cfg)
    batch = {"pixel_values": torch.randn(2, 3, 35, 35), "labels": torch.tensor([1, 2])}
    wrapped = memopt.wrap(model, budget="4GiB", sample=batch, hardware="h200")
    losses = [float(wrapped.step(batch)) for _ in range(2)]
    torch.manual_seed(0)
    reference = tf.AutoModelForImageClassification.from_config(cfg)
    assert losses[0] == pytest.approx(reference(**batch).loss.item(), rel=1e-5)
    assert all(torch.isfinite(torch.tensor(losses)))


_TABLES: dict[int, torch.Tensor] = {}  # a module-level cache, as model code writes one for rotary tables or masks


class _DictCached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if n not in _TABLES:
            _TABLES[n] = torch.linspace(0, 1, n)
        return (self.proj(x) * _TABLES[n]).square().mean()


def test_a_dict_cache_keeps_only_real_tensors_after_a_trace():
    _TABLES.clear()
    _TABLES[8] = torch.zeros(8)  # an entry of the user's, made before: stays as it was
    before = _TABLES[8]
    model = _DictCached()
    x = torch.randn(4, 16)
    memopt.profile(model, x, hardware="h200", use_cache=False)
    assert 16 not in _TABLES and _TABLES[8] is before
    assert torch.isfinite(model(x)) and torch.equal(_TABLES[16], torch.linspace(0, 1, 16))

"""The transformers fallback's attention function: what a layer passes beside q, k and v either
is computed (scale, sliding window, soft-capping, gpt-oss's sinks), means the default, or stops
the forward naming it (DeepSeek-V3.2's selected key `indices`, a `position_bias`, non-causal
attention): never silently another attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batonlm.model_runner.models import transformers_fallback as fallback


class _Layer(nn.Module):
    layer_idx = 0


class _Backend(SimpleNamespace):
    def forward(self, q, k, v, layer, batch):
        self.calls.append((self.scale, self.softcap, self.sinks))
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2])


@pytest.fixture
def backend():
    attn = _Backend(head_dim=8, sliding_windows=(None,), scale=None, softcap=None, sinks=None, calls=[])
    fallback._Forward.attn, fallback._Forward.batch = attn, object()
    yield attn
    fallback._Forward.attn = fallback._Forward.batch = None


def _call(**kwargs):
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    return fallback._attention(_Layer(), q, kv, kv, None, **kwargs)


def test_what_the_backends_compute_reaches_them(backend) -> None:
    sinks = torch.ones(4)
    out, _ = _call(scaling=0.5, softcap=30.0, s_aux=sinks, dropout=0.0, is_causal=True, position_ids=torch.arange(3),
                   cu_seq_lens_q=None)
    assert out.shape == (1, 3, 4, 8)
    assert backend.calls == [(0.5, 30.0, sinks)]


@pytest.mark.parametrize("name, value", [("indices", torch.zeros(1, 3, 2, dtype=torch.long)),
                                         ("position_bias", torch.zeros(1, 4, 3, 3)), ("is_causal", False),
                                         ("sinks", torch.ones(4))])
def test_attention_the_backends_do_not_compute_is_refused(backend, name, value) -> None:
    with pytest.raises(ValueError, match=rf"_Layer \(layer 0\) passes {name} to its attention function"):
        _call(**{name: value})
    assert backend.calls == []

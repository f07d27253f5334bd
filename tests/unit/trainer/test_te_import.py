"""A Transformer Engine that is installed but whose torch binding does not import (built against another torch or
CUDA) stops the trainer's build and the node check with its import error, not megatron-core's bare TypeError."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl.config import TrainerConfig
from megatron_rl.trainer import model

BROKEN = "undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"


@pytest.fixture
def broken_te(tmp_path, monkeypatch):
    """An importable `transformer_engine` whose `pytorch` binding raises as a mismatched build does."""
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        sys.modules.pop(name, None)


def test_a_broken_binding_is_named(broken_te, monkeypatch):
    assert model.transformer_engine_import_error() == f"ImportError: {BROKEN}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=f"installed but does not import \\(ImportError: {BROKEN}\\)"):
        model.use_transformer_engine(TrainerConfig(layer_spec="auto"))
    assert not model.use_transformer_engine(TrainerConfig(layer_spec="local"))  # the way out the message names


def test_no_transformer_engine_is_not_an_error():
    assert model.transformer_engine_import_error() is None  # not installed on CPU machines
    assert not model.use_transformer_engine(TrainerConfig(layer_spec="auto"))

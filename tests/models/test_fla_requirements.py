"""The trainer's check that FLA can run a model's backward on this machine (FLA refuses its Triton
path for the gated chunk backward on Hopper with Triton >= 3.4 and < 3.7.1 unless tilelang runs)."""

import pytest
import torch

from flame.models import build as model_build
from flame.models import fla_requirements
from tests.trainer.helpers import ROOT

CUDA = torch.device("cuda", 0)


def meta_model(name: str):
    return model_build.build_meta_model(model_build.load_model_config(f"{ROOT}/configs/debug/{name}.json", None))


@pytest.fixture
def refused_triton(monkeypatch):
    """A Hopper GPU, a Triton in FLA's refused range, no tilelang."""
    import fla.utils
    from fla.backends import TileLangBackend

    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", False)
    monkeypatch.setattr(TileLangBackend, "is_available", classmethod(lambda cls: False))
    return monkeypatch


def test_a_gated_deltanet_without_tilelang_is_named_before_training(refused_triton):
    why = fla_requirements.missing_backend(meta_model("gated_deltanet"), CUDA)
    assert why is not None and "GatedDeltaNet" in why and "tilelang" in why


def test_no_complaint_where_fla_runs_the_model(refused_triton):
    from fla.backends import TileLangBackend

    assert fla_requirements.missing_backend(meta_model("gla"), CUDA) is None  # GLA's backward has no gate there
    assert fla_requirements.missing_backend(meta_model("gated_deltanet"), torch.device("cpu")) is None
    refused_triton.setattr(TileLangBackend, "is_available", classmethod(lambda cls: True))
    assert fla_requirements.missing_backend(meta_model("gated_deltanet"), CUDA) is None
    refused_triton.setenv("FLA_TILELANG", "0")  # tilelang installed but turned off: FLA would refuse
    assert fla_requirements.missing_backend(meta_model("gated_deltanet"), CUDA) is not None


def test_no_complaint_with_a_triton_fla_accepts(refused_triton):
    import fla.utils

    refused_triton.setattr(fla.utils, "TRITON_ABOVE_3_7_1", True)
    assert fla_requirements.missing_backend(meta_model("gated_deltanet"), CUDA) is None

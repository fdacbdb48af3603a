import os

import pytest

# vLLM's own log handler binds the sys.stdout of the moment vLLM is imported: in pytest, the capture
# of the test that imported it, closed after that test. Every later vLLM log line (its CPU worker
# logs each torch.set_num_threads call) then printed a "Logging error" traceback into whichever test
# was running, and the tests that count tracebacks failed. Its records propagate through logging instead.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from mas_trainer.engines.fake import FakeChatFormat, FakeEngine
from mas_trainer.gateway import PolicyBackend
from mas_trainer.loop.session import Session


def fake_backend(_base_model: str) -> PolicyBackend:
    return PolicyBackend(FakeEngine(latency_s=0.002, reply="fake reply"), FakeChatFormat())


@pytest.fixture
def fake_session():
    """A gateway on 127.0.0.1 with fake engines, OPENAI_BASE_URL pointing at it."""
    # the rollout timeout is a hang guard: a busy CI machine must not fail a test on speed
    with Session(backend_factory=fake_backend, timeout_s=300, max_in_flight=64) as session:
        yield session

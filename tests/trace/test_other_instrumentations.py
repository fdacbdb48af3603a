"""Teams that trace in production run other OpenTelemetry instrumentations beside this one:
OpenLLMetry's (`opentelemetry-instrumentation-langchain`) and OpenInference's LangChain
instrumentations, the real packages, active with an SDK tracer provider. Every LLM call of a
rollout is still routed to its node's policy and recorded (with OpenLLMetry's `traceparent` in
`extra_headers`, none was: the rollout said `ok` with 0 of 8 calls)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.instrumentation.langchain")
pytest.importorskip("openinference.instrumentation.langchain")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = f'''
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from mas_trainer import api

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
if "openllmetry" in sys.argv:
    from opentelemetry.instrumentation.langchain import LangchainInstrumentor
    LangchainInstrumentor().instrument()
if "openinference" in sys.argv:
    from openinference.instrumentation.langchain import LangChainInstrumentor
    LangChainInstrumentor().instrument()
res = api.trace("{ROOT}/examples/langgraph_apps/supervisor.py:graph",
                [{{"question": "What is the capital of France?", "answer": "Paris"}}], n=1, model="tiny", max_tokens=8)
theirs = sum(1 for s in exporter.get_finished_spans() if s.instrumentation_scope.name != "mas_trainer")
print(json.dumps({{"status": [t.status for t in res.trajectories], "nodes": [[c.node for c in t.llm_calls] for t in res.trajectories],
                  "policies": [[c.policy for c in t.llm_calls] for t in res.trajectories], "their_spans": theirs}}))
'''


def _trace(*instrumentations):
    done = subprocess.run([sys.executable, "-c", SCRIPT, *instrumentations], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone():
    return _trace()


@pytest.mark.parametrize("instrumentations", [("openllmetry",), ("openllmetry", "openinference")])
def test_every_call_is_routed_and_recorded_beside_other_instrumentations(alone, instrumentations):
    assert alone["their_spans"] == 0
    beside = _trace(*instrumentations)
    assert beside["status"] == ["ok"] and beside["their_spans"] > 0  # theirs ran, and traced
    assert beside["nodes"] == alone["nodes"] and len(alone["nodes"][0]) >= 2
    assert beside["policies"] == alone["policies"]


# fit (one step) and serve, with both instrumentations on: the same calls, routed and recorded
SCRIPT_FIT_SERVE = f'''
import json, os, sys, tempfile, threading, socket
from pathlib import Path
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from mas_trainer import api
import mas_trainer

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from opentelemetry.instrumentation.langchain import LangchainInstrumentor
LangchainInstrumentor().instrument()
from openinference.instrumentation.langchain import LangChainInstrumentor
LangChainInstrumentor().instrument()
APP = "{ROOT}/tests/fixtures/words_app.py:graph"
task = {{"question": "Name a colour."}}
out = Path(tempfile.mkdtemp())
quick = {{"steps": 1, "rollout.tasks_per_step": 1, "rollout.n": 2, "runtime.execution": "local", "logger": ["console"],
         "rollout.max_tokens": 8, "val_fraction": 0}}
mas_trainer.fit(APP, [task], output=out / "run", overrides=quick, model="tiny")
trajs = [json.loads(l) for l in (out / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
fitted = [[(c["node"], c["policy"]) for c in t["llm_calls"]] for t in trajs]

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ready, stop = threading.Event(), threading.Event()
server = threading.Thread(target=api.serve, args=(out / "run",), kwargs=dict(port=port, ready=ready, stop=stop,
                                                                            record=out / "served"), daemon=True)
server.start()
assert ready.wait(300)
os.environ["OPENAI_BASE_URL"] = f"http://127.0.0.1:{{port}}/v1"
os.environ["OPENAI_API_KEY"] = "unused"
from mas_trainer.apps import load_object
from mas_trainer.adapters.langgraph.serving import serving_runs
state = load_object(APP).invoke(task)  # the unedited app against serve, as in production
serving_runs().flush()
stop.set()
server.join(60)
from mas_trainer.production.record import read_runs
served = [[(c.node, c.policy) for c in t.llm_calls] for t, _ in read_runs(out / "served")]
theirs = sum(1 for s in exporter.get_finished_spans() if s.instrumentation_scope.name != "mas_trainer")
print(json.dumps({{"status": [t["status"] for t in trajs], "fitted": fitted, "served": served, "their_spans": theirs}}))
'''


def test_fit_and_serve_route_and_record_every_call_beside_both_instrumentations():
    done = subprocess.run([sys.executable, "-c", SCRIPT_FIT_SERVE], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    got = json.loads(done.stdout.strip().splitlines()[-1])
    expected = [["planner", "lead"], ["writer", "crew"], ["critic", "crew"]]
    assert got["status"] == ["ok", "ok"] and got["fitted"] == [expected, expected]  # fit: every turn recorded
    assert got["served"] == [expected]  # serve: each node answered by its trained policy, recorded as one run
    assert got["their_spans"] > 0

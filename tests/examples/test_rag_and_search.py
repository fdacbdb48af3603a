"""The RAG QA and agentic search example apps: metrics, data, BM25 retrieval, tracing and
one `fit` step each on the tiny model."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mas_trainer.config import load_config
from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.runtime.session import Session
from mas_trainer.runtime.trainer import fit

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "examples" / "langgraph_apps"
RAG = APPS / "rag_qa"
SEARCH = APPS / "agentic_search"
sys.path.insert(0, str(APPS))  # as the apps themselves do when loaded from their file path

from rag_qa.metrics import exact_match, f1, normalise, recall  # noqa: E402


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ----- metrics -------------------------------------------------------------------------------


def test_normalise_is_squad_style():
    assert normalise("  The Ashby River! ") == "ashby river"
    assert normalise("an Oboe, a harp.") == "oboe harp"
    assert normalise("Vance-Hale") == "vancehale"
    assert normalise(None) == ""


def test_exact_match_and_f1():
    assert exact_match("the Quellmoor.", "Quellmoor") == 1.0
    assert exact_match("Quellmoor town", "Quellmoor") == 0.0
    assert exact_match("teal", ["violet", "Teal"]) == 1.0
    assert f1("Quellmoor", "Quellmoor") == 1.0
    assert f1("born in Quellmoor", "Quellmoor") == pytest.approx(0.5)  # p 1/3, r 1
    assert f1("Mirela", "Mirela Vostok") == pytest.approx(2 / 3)  # p 1, r 1/2
    assert f1("nothing here", "Quellmoor") == 0.0
    assert f1("", "Quellmoor") == 0.0 and f1("x", None) == 0.0
    assert f1("the", "a") == 1.0  # both empty after normalisation, as SQuAD scores it
    assert recall("Mirela Vostok was born in Quellmoor", "Mirela Vostok") == 1.0
    assert recall("Mirela was born", "Mirela Vostok") == 0.5


# ----- data ----------------------------------------------------------------------------------


def test_data_is_what_make_data_writes(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("_rag_make_data", RAG / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    monkeypatch.setattr(make_data, "HERE", tmp_path / "rag_qa")
    monkeypatch.setattr(make_data, "SEARCH_DIR", tmp_path / "agentic_search")
    make_data.main()
    for folder, names in ((RAG, ["corpus", "train", "heldout"]), (SEARCH, ["train", "heldout"])):
        for name in names:
            assert (tmp_path / folder.name / f"{name}.jsonl").read_bytes() == (folder / f"{name}.jsonl").read_bytes(), name


def test_questions_have_short_span_answers_and_disjoint_splits():
    corpus = {p["id"]: p["text"] for p in _jsonl(RAG / "corpus.jsonl")}
    assert 40 <= len(corpus) <= 60
    train, heldout = _jsonl(RAG / "train.jsonl"), _jsonl(RAG / "heldout.jsonl")
    assert 150 <= len(train) <= 250 and 40 <= len(heldout) <= 60
    assert not {q["question"] for q in train} & {q["question"] for q in heldout}
    for q in train + heldout:
        assert 1 <= len(q["answer"].split()) <= 3 and q["answer"] in corpus[q["passage_id"]], q
    hops = _jsonl(SEARCH / "train.jsonl") + _jsonl(SEARCH / "heldout.jsonl")
    for q in hops:
        first, second = q["passage_ids"]
        assert q["answer"] in corpus[second] and q["answer"] not in corpus[first], q


@pytest.fixture
def dummy_openai(monkeypatch):
    """The apps build their ChatOpenAI clients at import: give them settings (nothing is called)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-dummy-for-tests")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")


def test_bm25_finds_the_gold_passage_for_most_questions(dummy_openai):
    from rag_qa.app import get_retriever

    retriever = get_retriever()
    train = _jsonl(RAG / "train.jsonl")
    top2 = sum(q["passage_id"] in [p["id"] for p in retriever.search(q["question"], 2)] for q in train) / len(train)
    assert top2 >= 0.8, top2
    # multi-hop: the question finds the first passage; searching its bridge entity finds the second
    hop = _jsonl(SEARCH / "train.jsonl")[0]
    first = retriever.search(hop["question"], 2)
    assert hop["passage_ids"][0] in [p["id"] for p in first]
    assert retriever.search("", 2) == []
    assert hop["passage_ids"][0] not in [p["id"] for p in retriever.search(hop["question"], 2, exclude={hop["passage_ids"][0]})]


def test_agentic_search_parses_the_plan(dummy_openai):
    from agentic_search.app import parse_plan

    assert parse_plan("SEARCH: founder of Brindlecorp", "q") == ("search", "founder of Brindlecorp")
    assert parse_plan("ANSWER", "q") == ("answer", "")
    assert parse_plan("\nanswer: Quellmoor", "q") == ("answer", "")
    assert parse_plan("Brindlecorp founder", "q") == ("search", "Brindlecorp founder")
    assert parse_plan("", "q") == ("search", "q")


# ----- tracing on the tiny model -------------------------------------------------------------


def _trace(ref, tasks, n=1):
    with Session(model="tiny", default_max_tokens=8, timeout_s=120) as session:
        app = session.load_app(ref)
        return app, session.run(tasks, n=n)


@pytest.mark.parametrize("attr, policies", [("graph", {"rewrite": "rewriter", "answer": "answerer"}),
                                            ("graph_shared", {"rewrite": "qa", "answer": "qa"})])
def test_rag_qa_traces_on_tiny(attr, policies):
    tasks = _jsonl(RAG / "train.jsonl")[:2]
    app, trajs = _trace(f"{RAG / 'app.py'}:{attr}", tasks)
    assert len(trajs) == 2
    for t in trajs:
        assert t.status == "ok", t.error
        assert [n.name for n in t.nodes] == ["rewrite", "retrieve", "answer"]
        assert [(c.role, c.policy) for c in t.llm_calls] == list(policies.items())
        assert [len(c.response_ids) for c in t.llm_calls][0] <= 24 and len(t.llm_calls[1].response_ids) <= 16
        assert [tc.name for tc in t.tool_calls] == ["search_corpus"]
        # BM25 on the question + any rewrite still finds the gold passage
        assert t.task["passage_id"] in [p["id"] for p in t.final_state["passages"]]
        assert "answer" not in t.final_state  # the reference never reaches the graph
        spec = app.spec.spec
        assign_rewards(t, RewardSpec(spec.reward, spec.role_rewards, spec.turn_rewards))
        assert 0.0 <= t.rewards.trajectory <= 1.0 and t.rewards.roles["rewrite"] == 1.0


def test_agentic_search_traces_on_tiny_and_turn_rewards_telescope():
    tasks = _jsonl(SEARCH / "train.jsonl")[:2]
    app, trajs = _trace(f"{SEARCH / 'app.py'}:graph", tasks)
    roles = {"planner": "planner", "summariser": "reader", "answerer": "reader"}
    for t in trajs:
        assert t.status == "ok", t.error
        assert {(c.role, c.policy) for c in t.llm_calls} <= set(roles.items())
        assert t.llm_calls[-1].role == "answerer"
        searches = sum(n.name == "search" for n in t.nodes)
        assert searches <= 3 and sum(c.role == "summariser" for c in t.llm_calls) == searches
        assert sum(c.role == "planner" for c in t.llm_calls) <= 3

    # a made-up run: the second note finds the answer, the answer is half right
    t = next(t for t in trajs if sum(c.role == "summariser" for c in t.llm_calls) >= 2)
    answer = t.task["answer"]
    notes = [c for c in t.llm_calls if c.role == "summariser"]
    for i, c in enumerate(notes):
        c.output_text = f"{answer} is it" if i == 1 else "nothing useful"
    t.llm_calls[-1].output_text = f"{answer} perhaps maybe"
    t.final_state["prediction"] = t.llm_calls[-1].output_text
    spec = app.spec.spec
    assign_rewards(t, RewardSpec(spec.reward, spec.role_rewards, spec.turn_rewards),
                   allocator="turn_delta", weights={"trajectory": 0.0})
    final_f1 = f1(t.final_state["prediction"], answer)
    assert 0 < final_f1 < 1
    assert t.rewards.turns[notes[0].id] == 0.0 and t.rewards.turns[notes[1].id] == 1.0
    assert t.rewards.turns[t.llm_calls[-1].id] == pytest.approx(final_f1 - 1.0)
    assert sum(t.rewards.turns.values()) == pytest.approx(final_f1)


# ----- one fit step each ---------------------------------------------------------------------


def _cfg(*overrides):
    return load_config(overrides=["runtime.backend=local", "model=tiny", "steps=1", "rollout.tasks_per_step=2",
                                  "rollout.n=2", "eval_every=100", *overrides])


def test_fit_one_step_rag_qa(tmp_path):
    rows = fit(f"{RAG / 'app.py'}:graph", _jsonl(RAG / "train.jsonl")[:4], _cfg(), tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["policy/rewriter/turns"] == 4 and train[0]["policy/answerer/turns"] == 4
    assert {"reward/role/rewrite", "reward/role/answer"} <= set(train[0])
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint" / "policies").iterdir()) == ["answerer", "rewriter"]


def test_fit_one_step_agentic_search_turn_delta(tmp_path):
    rows = fit(f"{SEARCH / 'app.py'}:graph", _jsonl(SEARCH / "train.jsonl")[:4],
               _cfg("reward.allocator=turn_delta"), tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["policy/planner/turns"] >= 4 and train[0]["policy/reader/turns"] >= 4
    traj = json.loads((tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()[0])
    detail = traj["rewards"]["detail"]
    assert detail["allocator"] == "turn_delta"
    for call in traj["llm_calls"]:  # scored roles get a turn part (their gain), the planner none
        parts = detail["calls"][call["id"]]["parts"]
        assert ("turn" in parts) == (call["role"] != "planner") and "trajectory" in parts, (call["role"], parts)


def test_fit_answerer_only_greedy_eval_and_report(tmp_path):
    """The README demo's shape: the answerer trained, the rewriter frozen, held-out
    evaluations greedy, then `report.py` scores exact match and F1 and plots them."""
    tasks, held_out = _jsonl(RAG / "train.jsonl")[:4], _jsonl(RAG / "heldout.jsonl")[:3]
    run = tmp_path / "run"
    rows = fit(f"{RAG / 'app.py'}:graph_answerer", tasks, _cfg("rollout.val_temperature=0", "eval_every=1"), run,
               val_tasks=held_out)
    train = [r for r in rows if r["kind"] == "train"]
    assert train[0]["policy/answerer/turns"] == 4 and not any(k.startswith("policy/frozen") for k in train[0])
    assert [p.name for p in (run / "checkpoint" / "policies").iterdir()] == ["answerer"]
    val = [json.loads(line) for line in (run / "trajectories" / "step_000000_val.jsonl").read_text().splitlines()]
    assert [[c["policy"] for c in t["llm_calls"]] for t in val] == [["frozen", "answerer"]] * 3

    spec = importlib.util.spec_from_file_location("_rag_report", RAG / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    scores = report.report(run)
    assert sorted(scores) == [0, 1]
    for step, s in scores.items():
        predictions = [json.loads(line)["final_state"]["prediction"]
                       for line in (run / "trajectories" / f"step_{step:06d}_val.jsonl").read_text().splitlines()]
        want = [f1(p, t["answer"]) for p, t in zip(predictions, held_out)]
        assert s["n"] == 3 and s["f1"]["mean"] == pytest.approx(sum(want) / 3)
        assert 0.0 <= s["exact_match"]["mean"] <= s["f1"]["mean"] + 1e-9
    assert report.main([str(run), "--json", str(tmp_path / "scores.json")]) == 0
    assert (run / "heldout_em_f1.png").stat().st_size > 0 and json.loads((tmp_path / "scores.json").read_text())["1"]["n"] == 3


def test_report_spread_counts_failed_rollouts_as_wrong(tmp_path):
    spec = importlib.util.spec_from_file_location("_rag_report", RAG / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    folder = tmp_path / "trajectories"
    folder.mkdir()
    rows = [{"status": "ok", "task": {"answer": "Quellmoor"}, "final_state": {"prediction": "Quellmoor."}},
            {"status": "ok", "task": {"answer": "flute"}, "final_state": {"prediction": "the oboe"}},
            {"status": "error", "task": {"answer": "1920"}, "final_state": {"prediction": "1920"}},
            {"status": "ok", "task": {"answer": "Mirela Vostok"}, "final_state": {"prediction": "Mirela"}}]
    (folder / "step_000005_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = report.report(tmp_path)[5]
    assert s["exact_match"] == pytest.approx({"mean": 0.25, "std": 0.25 ** 0.5 * 0.75 ** 0.5, "sem": (0.1875 ** 0.5) / 2})
    assert s["f1"]["mean"] == pytest.approx((1 + 0 + 0 + 2 / 3) / 4)
    with pytest.raises(SystemExit, match="no held-out evaluations"):
        report.report(tmp_path / "elsewhere")

"""The RAG QA and agentic search example apps: metrics, data, BM25 retrieval, tracing and
one `fit` step each on the tiny model."""

import importlib.util
import json
import sys
from pathlib import Path

import openai
import pytest
from langchain_core.messages import AIMessage
from openai.types.chat import ChatCompletion

from mas_trainer.adapters.langgraph import spec_of
from mas_trainer.config import load_config
from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.rewards.levels import evaluate_levels
from mas_trainer.loop.session import Session
from mas_trainer.loop.trainer import fit
from mas_trainer.trace.schema import LLMCall, Trajectory

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


# ----- agentic search: the plan, the loop and the turn rewards, with scripted models ----------


class _Scripted:
    """A chat model stand-in: the replies in order (the last one again once they run out);
    an exception in the list is raised. Keeps the prompts it was sent and what was bound."""

    def __init__(self, *replies):
        self.replies, self.prompts, self.bound = list(replies), [], []

    def bind(self, **kwargs):
        self.bound.append(kwargs)
        return self

    def invoke(self, messages):
        self.prompts.append(messages)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, Exception):
            raise reply
        return AIMessage(reply)


def _plan(action, query=""):
    return json.dumps({"action": action, "query": query})


def _fact(text):
    return json.dumps({"fact": text})


def _answer(text):
    return json.dumps({"answer": text})


@pytest.fixture
def search_app(dummy_openai):
    from agentic_search import app

    return app


def _script(app, monkeypatch, first, then=(), notes=("a note",), answer="Quellmoor"):
    llms = {"first_planner_llm": _Scripted(first), "planner_llm": _Scripted(*(then or [_plan("answer")])),
            "summariser_llm": _Scripted(*map(_fact, notes)), "answer_llm": _Scripted(_answer(answer))}
    for name, fake in llms.items():
        monkeypatch.setattr(app, name, fake)
    return llms


def test_agentic_search_parses_the_plan(search_app):
    parse_plan = search_app.parse_plan
    assert parse_plan('{"action": "search", "query": " Brindlecorp "}') == ("search", "Brindlecorp")
    assert parse_plan('{"action": "answer", "query": "Quellmoor"}') == ("answer", "")
    assert parse_plan('{"action": "search", "query": ""}') == ("search", "")
    for bad in ['{"action": "search", "query": "Brindl', "SEARCH Brindlecorp", '{"action": "look", "query": "x"}',
                '["search", "x"]', '{"action": "search", "query": 3}', '{"action": "search"}', "", None]:
        assert parse_plan(bad) is None, bad
    # the first plan can only search; the query is bounded, so decoding under the schema ends
    first = search_app.plan_format(["search"])["json_schema"]["schema"]
    assert first["properties"]["action"]["enum"] == ["search"] and list(first["properties"]) == ["action", "query"]
    assert first["properties"]["query"]["maxLength"] == search_app.MAX_QUERY_CHARS
    # the notes and the answer are JSON too: a field that is missing or cut off reads as ""
    assert search_app.parse_field('{"answer": " Quellmoor "}', "answer") == "Quellmoor"
    for bad in ['{"answer": "Quell', '{"fact": "x"}', '{"answer": 1}', "Quellmoor", None]:
        assert search_app.parse_field(bad, "answer") == "", bad
    assert search_app.sentences([{"text": "A is b. It is c."}, {"text": "A is b. D is 1.5 m."}]) == \
        ["A is b.", "It is c.", "D is 1.5 m."]


def test_agentic_search_loops_at_most_max_turns(search_app, monkeypatch):
    app = search_app
    llms = _script(app, monkeypatch, _plan("search", "Brindlecorp"), [_plan("search", "Mirela Vostok")],
                   notes=["note one", "note two"])
    out = app.build_graph().invoke({"question": "In which town was the founder of Brindlecorp born?"})
    assert len(out["searches"]) == app.MAX_TURNS == 2 and out["notes"] == ["note one", "note two"]
    assert len(llms["first_planner_llm"].prompts) == 1 and len(llms["planner_llm"].prompts) == app.MAX_TURNS - 1
    assert "- note one" in llms["planner_llm"].prompts[0][1].content  # the planner reads the notes so far
    ids = [p["id"] for s in out["searches"] for p in s["passages"]]
    assert ids[0] == "company_brindlecorp" and len(ids) == len(set(ids))  # a search never fetches a passage twice
    # the summariser picks one of the sentences its search fetched, under an enum
    for search, bound in zip(out["searches"], llms["summariser_llm"].bound):
        enum = bound["response_format"]["json_schema"]["schema"]["properties"]["fact"]["enum"]
        assert enum == app.sentences(search["passages"]) and len(enum) >= 2
    assert "- note two" in llms["answer_llm"].prompts[0][1].content and out["prediction"] == "Quellmoor"


_LENGTH = openai.LengthFinishReasonError(completion=ChatCompletion.model_construct(usage=None))


@pytest.mark.parametrize("first, then, searches", [
    (_plan("search", "Mirela Vostok"), [_plan("answer")], 1),
    (_plan("search", "Mirela Vostok"), ["SEARCH Quellmoor"], 1),  # a malformed later plan ends the search
    ('{"action": "search", "query": "Mirela', [], 0),  # a malformed first plan: straight to the answerer
    (_LENGTH, [], 0),  # what the OpenAI client raises for a structured reply cut off by max_tokens
])
def test_agentic_search_answers_on_answer_or_a_malformed_plan(search_app, monkeypatch, first, then, searches):
    llms = _script(search_app, monkeypatch, first, then)
    out = search_app.build_graph().invoke({"question": "In which town was Mirela Vostok born?"})
    assert len(out.get("searches", [])) == searches and len(llms["summariser_llm"].prompts) == searches
    assert out["prediction"] == "Quellmoor" and out["action"] == "answer"


def test_agentic_search_skips_the_summariser_when_nothing_is_found(search_app, monkeypatch):
    llms = _script(search_app, monkeypatch, _plan("search", "zzz"), [_plan("search", "")])
    out = search_app.build_graph().invoke({"question": "In which town was Mirela Vostok born?"})
    assert [s["passages"] for s in out["searches"]] == [[], []] and out["notes"] == ["(nothing found)"] * 2
    assert llms["summariser_llm"].prompts == []


def _traj(task, final_state, outputs):
    calls = [LLMCall(id=f"c{i}", node_id=None, node=role, role=role, policy="p", messages=[], output_text=text,
                     prompt_ids=[1], response_ids=[2], response_logprobs=[-0.5], finish_reason="stop")
             for i, (role, text) in enumerate(outputs)]
    return Trajectory(rollout_id="r", task=task, status="ok", llm_calls=calls, final_state=final_state)


def _search_rewards(app):
    spec = spec_of(app.graph)  # what @trainable attached to the graph fit loads
    return RewardSpec(spec.reward, spec.role_rewards, spec.turn_rewards)


def _scores(app, traj):
    values = evaluate_levels(_search_rewards(app), traj)
    return [values.turns[c.id] for c in traj.llm_calls]


@pytest.mark.parametrize("second_query, fetched", [("Mirela Vostok", 1.0), ("salt market", 0.0),
                                                    ("Tinderbox Analytics", 0.0)])
def test_agentic_search_planner_is_credited_when_its_search_fetches_the_answer(search_app, monkeypatch,
                                                                                second_query, fetched):
    app = search_app
    task = {"question": "In which town was the founder of Brindlecorp born?", "answer": "Quellmoor"}
    plans = [_plan("search", "Brindlecorp"), _plan("search", second_query)]
    _script(app, monkeypatch, plans[0], plans[1:], notes=["founded by Mirela Vostok", "born in Quellmoor"],
            answer="Quellmoor town")
    state = app.build_graph().invoke({"question": task["question"]})
    held = "Quellmoor" in " ".join(p["text"] for p in state["searches"][1]["passages"])
    assert held == bool(fetched)  # the cases: the founder's name fetches the answer, the others do not
    traj = _traj(task, state, [("planner", plans[0]), ("summariser", _fact(state["notes"][0])), ("planner", plans[1]),
                               ("summariser", _fact(state["notes"][1])), ("answerer", _answer(state["prediction"]))])
    # the first search fetched the company (no answer), the second the founder when it named her;
    # the second note holds the answer whatever the search fetched (scripted), the answer is half right
    assert _scores(app, traj) == [0.0, 0.0, fetched, 1.0, pytest.approx(2 / 3)]
    assign_rewards(traj, _search_rewards(app), allocator="turn_delta", weights={"trajectory": 0.0})
    gains = [traj.rewards.turns[c.id] for c in traj.llm_calls]
    assert gains == [0.0, 0.0, fetched, 1.0 - fetched, pytest.approx(2 / 3 - 1)]
    assert sum(gains) == pytest.approx(2 / 3)  # the gains telescope to the final F1
    assign_rewards(traj, _search_rewards(app), allocator="broadcast")
    assert traj.rewards.turns["c2"] == pytest.approx(2 / 3 + fetched)


def test_agentic_search_scores_a_plan_by_what_the_rollout_holds_and_a_malformed_one_zero(search_app, monkeypatch):
    app = search_app
    task = {"question": "In which town was Mirela Vostok born?", "answer": "Quellmoor"}
    _script(app, monkeypatch, _plan("search", "Mirela Vostok"), [_plan("answer")], notes=["born in Quellmoor"])
    state = app.build_graph().invoke({"question": task["question"]})
    outputs = [("planner", _plan("search", "Mirela Vostok")), ("summariser", _fact("born in Quellmoor")),
               ("planner", _plan("answer")), ("answerer", _answer("Quellmoor"))]
    assert _scores(app, _traj(task, state, outputs)) == [1.0, 1.0, 1.0, 1.0]
    outputs[1] = ("summariser", _fact("Mirela is a ferryman"))  # the note lost the answer: answering now scores 0
    assert _scores(app, _traj(task, state, outputs))[1:3] == [0.0, 0.0]
    # the notes hold the answer and the planner searches again (fetching nothing new): it scores
    # what the rollout holds, so under turn_delta the redundant search gains nothing
    again = [*outputs[:1], ("summariser", _fact("born in Quellmoor")), ("planner", _plan("search", "zzz")),
             ("answerer", _answer("Quellmoor"))]
    state = {**state, "searches": [*state["searches"], {"query": "zzz", "passages": []}]}
    traj = _traj(task, state, again)
    assert _scores(app, traj) == [1.0, 1.0, 1.0, 1.0]
    assign_rewards(traj, _search_rewards(app), allocator="turn_delta", weights={"trajectory": 0.0})
    assert [traj.rewards.turns[c.id] for c in traj.llm_calls] == [1.0, 0.0, 0.0, 0.0]
    malformed = _traj(task, {"prediction": ""}, [("planner", '{"action": "search", "query": "Mire'),
                                                 ("answerer", _answer("x"))])
    assert _scores(app, malformed) == [0.0, 0.0]


def test_agentic_search_data_is_what_make_data_writes_and_mixes_hops(tmp_path):
    spec = importlib.util.spec_from_file_location("_search_make_data", SEARCH / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    for name in ("train", "heldout"):  # the two-fact questions rag_qa/make_data.py writes
        (tmp_path / f"{name}.jsonl").write_bytes((SEARCH / f"{name}.jsonl").read_bytes())
    make_data.main(here=tmp_path)
    for name in ("mixed_train", "mixed_heldout"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (SEARCH / f"{name}.jsonl").read_bytes(), name
    train, heldout = _jsonl(SEARCH / "mixed_train.jsonl"), _jsonl(SEARCH / "mixed_heldout.jsonl")
    assert sum(q["hops"] == 1 for q in train) >= 2 * sum(q["hops"] == 2 for q in train) > 0  # mostly one search
    assert sum(q["hops"] == 1 for q in heldout) == sum(q["hops"] == 2 for q in heldout) == 24
    assert not {q["question"] for q in train} & {q["question"] for q in heldout}


def test_agentic_search_one_search_can_fetch_every_answer(dummy_openai):
    """Reachable rewards: for a one-fact question the question's own words fetch the answer; for
    a two-fact one the first passage names the entity whose passage holds it."""
    from rag_qa.app import get_retriever
    from rag_qa.metrics import recall as holds

    retriever = get_retriever()
    texts = {p["id"]: p["text"] for p in retriever.passages}
    for q in _jsonl(SEARCH / "mixed_train.jsonl") + _jsonl(SEARCH / "mixed_heldout.jsonl"):
        if q["hops"] == 1:
            found = retriever.search(q["question"], 2)
            assert holds(" ".join(p["text"] for p in found), q["answer"]) == 1.0, q
        else:
            first, second = q["passage_ids"]
            assert holds(texts[first], q["answer"]) < 1.0 <= holds(texts[second], q["answer"]), q


# ----- tracing on the tiny model -------------------------------------------------------------


def _trace(ref, tasks, n=1):
    with Session(model="tiny", default_max_tokens=8, timeout_s=300) as session:
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
        spec = app.spec.declared
        assign_rewards(t, RewardSpec(spec.reward, spec.role_rewards, spec.turn_rewards))
        assert 0.0 <= t.rewards.trajectory <= 1.0 and t.rewards.roles["rewrite"] == 1.0


def test_agentic_search_ships_full_partial_and_no_sharing(search_app):
    from mas_trainer.adapters.langgraph.trainable import spec_of

    llm_nodes = {"planner", "summariser", "answerer"}
    policies = {name: spec_of(getattr(search_app, name)) for name in ("graph_shared", "graph", "graph_separate")}
    for name, spec in policies.items():
        assert set(spec.roles) == llm_nodes, name  # every LLM role is trained in each
    # 3 roles on 1, 2 and 3 policies: full sharing, partial sharing (N roles on 1 < K < N), full separation
    assert [len(set(spec.roles.values())) for spec in policies.values()] == [1, 2, 3]
    assert policies["graph"].roles["summariser"] == policies["graph"].roles["answerer"] != policies["graph"].roles["planner"]


def test_agentic_search_traces_on_tiny_with_plans_decoded_under_the_schema(search_app):
    MAX_TURNS, parse_plan = search_app.MAX_TURNS, search_app.parse_plan
    held = _jsonl(SEARCH / "mixed_heldout.jsonl")
    tasks = [held[0], held[-1]]  # a one-fact and a two-fact question
    app, trajs = _trace(f"{SEARCH / 'app.py'}:graph", tasks)

    roles = {"planner": "planner", "summariser": "reader", "answerer": "reader"}
    for t in trajs:
        assert t.status == "ok", t.error
        assert {(c.role, c.policy) for c in t.llm_calls} <= set(roles.items())
        assert t.llm_calls[-1].role == "answerer"
        plans = [parse_plan(c.output_text) for c in t.llm_calls if c.role == "planner"]
        # a random 2-layer model writes a well-formed plan only because the gateway decodes it under the schema
        assert None not in plans and plans[0][0] == "search" and len(plans) <= MAX_TURNS
        searches = t.final_state["searches"]
        assert 1 <= len(searches) <= MAX_TURNS  # the summariser has nothing to pick when a search found nothing
        assert sum(c.role == "summariser" for c in t.llm_calls) == sum(bool(s["passages"]) for s in searches)
        assert [s["query"] for s in searches] == [p[1] for p in plans if p[0] == "search"]
        assert [tc.name for tc in t.tool_calls] == ["search_passages"] * len(searches)
        spec = app.spec.declared
        assign_rewards(t, RewardSpec(spec.reward, spec.role_rewards, spec.turn_rewards), allocator="turn_delta")
        assert all("turn" in t.rewards.detail["calls"][c.id]["parts"] for c in t.llm_calls)  # every call scored


# ----- one fit step each ---------------------------------------------------------------------


def _cfg(*overrides):
    return load_config(overrides=["runtime.execution=local", "model=tiny", "steps=1", "rollout.tasks_per_step=2",
                                  "rollout.n=2", "eval_every=100", *overrides])


def test_fit_one_step_rag_qa(tmp_path):
    rows = fit(f"{RAG / 'app.py'}:graph", _jsonl(RAG / "train.jsonl")[:4], _cfg(), tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["policy/rewriter/turns"] == 4 and train[0]["policy/answerer/turns"] == 4
    assert {"reward/role/rewrite", "reward/role/answer"} <= set(train[0])
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint" / "policies").iterdir()) == ["answerer", "rewriter"]


def test_fit_one_step_agentic_search_turn_delta(tmp_path):
    rows = fit(f"{SEARCH / 'app.py'}:graph", _jsonl(SEARCH / "mixed_train.jsonl")[-4:],
               _cfg("reward.allocator=turn_delta"), tmp_path / "run")
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["policy/planner/turns"] >= 4 and train[0]["policy/reader/turns"] >= 4
    traj = json.loads((tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()[0])
    detail = traj["rewards"]["detail"]
    assert detail["allocator"] == "turn_delta"
    for call in traj["llm_calls"]:  # every role, the planner too, gets its gain on top of the final F1
        parts = detail["calls"][call["id"]]["parts"]
        assert "turn" in parts and "trajectory" in parts, (call["role"], parts)


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


def test_agentic_search_report_on_a_synthetic_run(tmp_path):
    spec = importlib.util.spec_from_file_location("_search_report", SEARCH / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)

    def rollout(answer, prediction, hops=1, fetched=(), notes=(), rewards=None, status="ok"):
        calls = [{"id": f"{answer}-{prediction}-{i}", "role": role} for i, role in enumerate(rewards or {})]
        return {"status": status, "task": {"answer": answer, "hops": hops},
                "final_state": {"prediction": prediction, "notes": list(notes),
                                "searches": [{"query": "q", "passages": [{"id": "p", "text": t} for t in fetched]}]},
                "llm_calls": calls, "rewards": {"turns": {c["id"]: r for c, r in zip(calls, (rewards or {}).values())}}}

    def write(run, name, rows):
        (run / "trajectories").mkdir(parents=True, exist_ok=True)
        (run / "trajectories" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    runs = [tmp_path / "broadcast", tmp_path / "turn_delta"]
    for run in runs:
        run.mkdir()
        (run / "config.yaml").write_text(f"seed: 0\nreward:\n  allocator: {run.name}\n")
        write(run, "step_000000_val.jsonl", [rollout("Quellmoor", "born in Quellmoor"),
                                             rollout("teal", "olive", hops=2)])
        write(run, "step_000002_val.jsonl", [rollout("Quellmoor", "Quellmoor"),
                                             rollout("teal", "teal", hops=2, status="error")])
        # step 1: group "Quellmoor" differs for the planner, agrees for the answerer; group "teal" agrees
        write(run, "step_000001.jsonl", [
            rollout("Quellmoor", "Quellmoor", fetched=["in Quellmoor"], notes=["born in Quellmoor"],
                    rewards={"planner": 1.0, "answerer": 1.0}),
            rollout("Quellmoor", "Quellmoor", fetched=["in Dunsmere"], rewards={"planner": 0.0, "answerer": 1.0}),
            rollout("teal", "x", hops=2, rewards={"planner": 0.0}),
            rollout("teal", "y", hops=2, rewards={"planner": 0.0})])
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
            {"kind": "val", "step": 0, "time/eval_s": 30.0}, {"kind": "train", "step": 1, "time/step_s": 60.0},
            {"kind": "val", "step": 2, "time/eval_s": 30.0}]))
    scores = report.report(runs[0])
    before, after = scores["val"][0], scores["val"][2]
    assert before["exact_match"]["mean"] == 0.0 and before["f1"]["mean"] == pytest.approx(0.25)  # F1 1/2 and 0
    assert before["f1_by_hops"] == {"1": {"mean": 0.5, "std": 0.0, "sem": 0.0},
                                    "2": {"mean": 0.0, "std": 0.0, "sem": 0.0}}
    assert after["exact_match"] == pytest.approx({"mean": 0.5, "std": 0.5, "sem": 0.5 / 2 ** 0.5})  # the error counts 0
    train = scores["train"][1]
    assert train["rollouts"] == 4 and train["f1"] == 0.5 and train["fetched"] == train["noted"] == 0.25
    assert train["groups_with_signal"] == pytest.approx(1 / 3)  # (Quellmoor, planner) of three (task, role) groups
    assert scores["wall_s"] == 120.0
    out = tmp_path / "scores.json"
    assert report.main([str(r) for r in runs] + ["--json", str(out)]) == 0
    assert all((r / "agentic_search_report.png").stat().st_size > 0 for r in runs)
    written = json.loads(out.read_text())
    assert sorted(written) == sorted([str(r) for r in runs] + ["over runs"])
    assert [g["runs"] for g in written["over runs"]] == [[str(runs[0])], [str(runs[1])]]  # two commands, not replicates
    assert (tmp_path / "agentic_search_runs.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no held-out evaluations"):
        report.report(tmp_path / "elsewhere")

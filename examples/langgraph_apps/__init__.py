"""Example LangGraph apps for mas-trainer.

Each module is a plain LangGraph app written as it would be for the real OpenAI API
(clients read ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` from the environment) and exposes
its graph as ``graph``, so both ``examples/langgraph_apps/<app>.py:graph`` and
``examples.langgraph_apps.<app>:graph`` name it. Tasks for each app are in
``data/<app>.jsonl``.

| module            | nodes                                        | policy map                         |
|-------------------|----------------------------------------------|------------------------------------|
| supervisor        | supervisor, researcher, writer               | full separation (3 -> 3)           |
| reflection        | generate, reflect                            | full sharing (2 -> 1)              |
| map_reduce        | planner, worker (Send fan-out), reducer      | partial sharing (3 -> 2)           |
| subgraph_app      | research:search_query, research:summarize, final | partial sharing (3 -> 2)       |
| raw_openai        | answer, review                               | full separation (2 -> 2)           |
| tools_agent       | agent, tools                                 | one role (agent)                   |
| untraced_plain    | draft, polish                                | not decorated                      |
"""

"""The README and docs stay usable: every `mas-trainer` command the README shows names a verb
and flags the CLI has, the apps and data it names exist, and every relative link in the README
and docs/ reaches a file (and, with an anchor, one of its headings)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mas_trainer.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """The `mas-trainer ...` lines of the bash blocks, variables of the block expanded, comments cut."""
    out = []
    for block in _bash_blocks(text):
        env: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and all(re.fullmatch(r"[A-Z_]+=\S+", w) for w in words):
                env.update(w.split("=", 1) for w in words)
                continue
            words = [re.sub(r"\$([A-Z_]+)", lambda m, env=env: env.get(m.group(1), m.group(0)), w) for w in words]
            if words and words[0] == "mas-trainer":
                out.append(words[1:])
    return out


def _verbs() -> dict[str, object]:
    action = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(action.choices)


def test_the_readme_shows_every_verb():
    shown = {cmd[0] for cmd in _commands(README.read_text())}
    assert shown == set(_verbs()), f"verbs the README shows: {sorted(shown)}; the CLI has {sorted(_verbs())}"


@pytest.mark.parametrize("command", _commands(README.read_text()), ids=lambda c: " ".join(c)[:60])
def test_each_readme_command_parses(command, tmp_path):
    verbs = _verbs()
    assert command[0] in verbs, f"mas-trainer has no verb {command[0]!r}"
    flags = {s for a in verbs[command[0]]._actions for s in a.option_strings}
    used = [w for w in command[1:] if w.startswith("--")]
    assert not [w for w in used if w.split("=")[0] not in flags], f"unknown flags in {command}"
    args, extra = _parser().parse_known_args(command)  # positional arguments and values as the CLI reads them
    overrides = [*getattr(args, "overrides", []), *extra]
    assert all(re.fullmatch(r"[a-z_.]+=\S+", o) for o in overrides) and (not overrides or command[0] == "fit")
    if overrides:  # and the config keys and values it sets are ones `fit` accepts
        from mas_trainer.config import load_config

        load_config(overrides=overrides)
    inputs = [w for w in command[1:] if w.split(":")[0].endswith(".py")]  # the app
    inputs += [command[i + 1] for i, w in enumerate(command[:-1]) if w in ("--data", "--val-data")]
    for path in inputs:  # the apps and task files it names exist in the repository
        assert (ROOT / path.split(":")[0]).is_file(), f"{command}: {path} is not in the repository"


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (fences at the start of a line, not inline ```` ``` ````)."""
    return re.sub(r"^[ \t]*(`{3,}).*?^[ \t]*\1[^\n]*$", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group(0) == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors a link into `path` can name: its headings' slugs and explicit `<a id="...">`s."""
    text = _prose(path.read_text())
    slugs = {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}
    return slugs | set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_files_and_headings(page):
    text = _prose(page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve()
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that reach nothing: {broken}"


def test_the_readme_stays_a_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, "experiment logs belong in docs/results/, benchmark tables in docs/benchmarks.md"
    text = README.read_text()
    assert "never run on a GPU" in text  # what the GPU check has not covered, the README says
    assert "(docs/scaling.md#the-gpu-paths-read-against-verl-091)" in text


def test_the_readme_gives_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^exec (bash scripts/\S+)", ci, flags=re.M)
    assert command, ".ci/run should exec one script the README names"
    assert command.group(1) in "\n".join(_bash_blocks(README.read_text()))


def test_the_results_table_links_every_results_page():
    text = README.read_text()
    section = text[text.index("## Results"):]
    section = section[: section.index("\n## ", 1)]
    pages = {p.name for p in (ROOT / "docs" / "results").glob("*.md")}
    assert pages and pages <= set(re.findall(r"docs/results/([\w.-]+\.md)", section))


def test_every_install_line_installs_from_a_checkout_as_the_readme_does():
    """The package is not on PyPI: a page that says `pip install mas-trainer[extra]` or shows an
    editable `-e .` install sends a user to a package that does not exist or to a layout only
    the project's own scripts use. Every pip line that installs mas-trainer installs a checkout
    with its constraints file, as the README's Install section does."""
    for page in PAGES:
        text = page.read_text()
        assert "THIS_REPOSITORY" not in text, page
        for line in re.findall(r"pip install[^\n`]*", text):
            if "mas-trainer" in line or re.search(r"""['"]?\.\[""", line) or " -e " in line:
                assert re.search(r"""-c mas-trainer/constraints(-gpu)?\.txt ["']\./mas-trainer\[[a-z,-]+\]["']""", line) \
                    and " -e " not in line, f"{page.relative_to(ROOT)}: {line}"


def test_the_readmes_python_calls_name_real_functions_and_keywords():
    """The Python blocks are not run (they train), but every `mas_trainer.X(...)` / `api.X(...)`
    they call exists and takes the keywords they pass."""
    import ast
    import inspect

    import mas_trainer
    from mas_trainer import api

    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    calls = [node for block in blocks for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Call)]
    checked = 0
    for call in calls:
        f = call.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("mas_trainer", "api")):
            continue
        fn = getattr(mas_trainer if f.value.id == "mas_trainer" else api, f.attr)
        params = inspect.signature(fn).parameters
        bad = [k.arg for k in call.keywords if k.arg not in params]
        assert not bad, f"README: {f.value.id}.{f.attr}() takes no {bad}"
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(call.args) <= len(positional), f"README: {f.value.id}.{f.attr}() takes {len(positional)} positional"
        checked += 1
    assert checked >= 3

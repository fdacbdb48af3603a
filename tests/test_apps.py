"""An app reference that cannot be loaded is one line that says where: the FILE:LINE of the
user's code that raised while importing, and the closest name for a misspelt attribute."""

import os
import sys

import pytest

from mas_trainer.apps import AppLoadError, load_object


@pytest.fixture
def app_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helpers.py").write_text("import os\n\n\ndef build():\n    return undefined_name\n")
    (tmp_path / "broken.py").write_text("import json\n\ngraph = json.dumps(1)\nvalue = nothing_here + 1\n")
    (tmp_path / "indirect.py").write_text("from helpers import build\n\ngraph = build()\n")
    (tmp_path / "syntax.py").write_text("graph = 1\ndef f(:\n    pass\n")
    (tmp_path / "fine.py").write_text("graph = 1\ngraph_shared = 2\n")
    yield tmp_path
    sys.modules.pop("helpers", None)  # imported by the apps above, from this folder


def test_an_import_error_names_the_file_and_line_of_the_users_code(app_dir):
    with pytest.raises(AppLoadError, match=r"^importing broken.py failed: NameError: name 'nothing_here' is not defined "
                                           r"\(at broken.py:4\)$"):
        load_object("broken.py:graph")
    # raised in a module of the user's that the app imports: that module's line
    with pytest.raises(AppLoadError, match=r"NameError: name 'undefined_name' is not defined \(at helpers.py:5\)$"):
        load_object("indirect.py:graph")
    with pytest.raises(AppLoadError, match=r"^importing syntax.py failed: SyntaxError: .* \(at syntax.py:2\)$"):
        load_object("syntax.py:graph")
    # an app imported by module name (package.module:attr): the same
    sys.path.insert(0, str(app_dir))
    try:
        with pytest.raises(AppLoadError, match=r"^importing helpers_user failed: NameError: .* \(at helpers.py:5\)$"):
            (app_dir / "helpers_user.py").write_text("import helpers\n\nhelpers.build()\n")
            load_object("helpers_user:graph")
    finally:
        sys.path.remove(str(app_dir))
        sys.modules.pop("helpers_user", None)
    assert os.getcwd() == str(app_dir)


def test_a_misspelt_attribute_gets_a_did_you_mean(app_dir):
    with pytest.raises(AppLoadError, match=r"^fine.py has no attribute 'grph'; did you mean 'graph'\? it defines: graph, "
                                           r"graph_shared$"):
        load_object("fine.py:grph")
    with pytest.raises(AppLoadError, match=r"has no attribute 'graph.nope'; graph defines: "):
        load_object("fine.py:graph.nope")
    assert load_object("fine.py:graph_shared") == 2

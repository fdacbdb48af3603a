"""The verbs' console: piped into a log, rich tables keep their rows whole instead of wrapping at 80 columns."""

import subprocess
import sys


def _width(env_extra):
    code = "from mas_trainer.run.progress import output_console; print(output_console().width)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **env_extra}, timeout=120)
    return int(done.stdout.strip().splitlines()[-1])


def test_a_piped_console_is_wide_and_columns_still_wins():
    from mas_trainer.run.progress import PIPED_WIDTH

    assert _width({}) == PIPED_WIDTH  # stdout is a pipe here
    assert _width({"COLUMNS": "100"}) == 100


def test_a_reward_table_row_is_not_wrapped_when_piped():
    from io import StringIO

    from rich.table import Table

    from mas_trainer.run.progress import PIPED_WIDTH, output_console

    console = output_console()
    assert console.width == PIPED_WIDTH or console.is_terminal
    table = Table("role", "policy", "reward")
    table.add_row("a_role_with_a_rather_long_name_" * 2, "its_policy_with_a_long_name_too", "0.1234")
    out = StringIO()
    console.file = out
    console.print(table)
    assert any("a_role_with_a_rather_long_name_a_role_with_a_rather_long_name_" in line for line in out.getvalue().splitlines())

"""OpenAI's `stop`, as every engine applies it to its decoded text."""

from mas_trainer.engines.base import cut_at_stop


def test_the_earliest_stop_string_wins_and_is_not_returned():
    assert cut_at_stop("answer: 42\nQ: next\n###", ["###", "\nQ:"]) == ("answer: 42", True)


def test_no_stop_string_found_or_empty_ones_keep_the_text():
    assert cut_at_stop("answer: 42", ["###", ""]) == ("answer: 42", False)
    assert cut_at_stop("answer: 42", []) == ("answer: 42", False)
    assert cut_at_stop("###", ["###"]) == ("", True)

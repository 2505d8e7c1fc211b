"""A key's, team's or admin's name is shown in the console, the audit trail, 429s and
metrics' labels: the admin API refuses an empty, blank, control-character or
oversized one with a 400 naming it, and takes any printable name."""

import pytest

from serve_app.admin.operations import NewAdmin, NewKey, NewTeam, _parse
from serve_app.errors import OpenAIError


@pytest.mark.parametrize("model", [NewKey, NewTeam, NewAdmin])
@pytest.mark.parametrize(
    "name, problem",
    [
        ("", "empty or blank"),
        ("   ", "empty or blank"),
        ("\t\n", "empty or blank"),
        ("a\x00b", "control characters"),
        ("eng\x1b[31m", "control characters"),
        ("x" * 201, "at most 200"),
        (5, "valid string"),
        (None, "valid string"),
    ],
)
def test_a_name_that_cannot_be_shown_is_a_400_naming_it(model, name, problem):
    with pytest.raises(OpenAIError) as caught:
        _parse(model, {"name": name})
    assert caught.value.status == 400 and caught.value.param == "name" and problem in caught.value.message


@pytest.mark.parametrize("name", ["eng", "team eng", "チーム", "<script>x</script>", "ü" * 200])
def test_any_printable_name_is_taken(name):
    assert _parse(NewTeam, {"name": name}).name == name

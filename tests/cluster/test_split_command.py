"""``tickwheel submit --command``: the line is split as a POSIX shell splits it (checked
against /bin/sh itself on generated lines), and nothing in it is expanded."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.commands import split_command

# Characters a shell takes as they are outside quotes (no expansion, glob, operator, comment).
PLAIN = st.text(alphabet="abcXYZ019_-+=.,:@%/", min_size=1, max_size=4)
# Inside single quotes: anything but the quote itself (expansions included: never expanded).
SINGLE = st.text(alphabet='ab $`"\\*;|&#~\t', max_size=4).map(lambda t: f"'{t}'")
# Inside double quotes: safe characters, and backslashes before what they escape there and
# before what they do not.
DOUBLE_PART = st.one_of(
    st.text(alphabet="ab '*;|&#~\t", min_size=1, max_size=3),
    st.sampled_from(["\\$", "\\`", '\\"', "\\\\", "\\\n", "\\a", "\\'", "\\*"]),
)
DOUBLE = st.lists(DOUBLE_PART, max_size=3).map(lambda parts: '"' + "".join(parts) + '"')
# Outside quotes: a backslash before anything, a backslash-newline, and blanks.
ESCAPED = st.sampled_from(["\\$", "\\`", "\\ ", "\\'", '\\"', "\\\\", "\\*", "\\;", "\\\n", "\\a"])
BLANKS = st.sampled_from([" ", "  ", "\t", " \t "])
WORD = st.lists(st.one_of(PLAIN, SINGLE, DOUBLE, ESCAPED), min_size=1, max_size=4).map("".join)
LINE = st.lists(WORD, max_size=5).flatmap(
    lambda words: st.lists(BLANKS, min_size=len(words) + 1, max_size=len(words) + 1).map(
        lambda gaps: gaps[0] + "".join(w + g for w, g in zip(words, gaps[1:], strict=True))
    )
)


def split_by_sh(line: str) -> list[str]:
    # The words after the sentinel are what sh made of the line: printf prints each once.
    out = subprocess.run(
        ["/bin/sh", "-c", "printf '%s\\0' SENTINEL " + line],
        capture_output=True,
        check=True,
    ).stdout.decode()
    words = out.split("\0")[:-1]
    assert words[0] == "SENTINEL"
    return words[1:]


@settings(max_examples=150, deadline=None)
@given(LINE)
def test_words_are_what_sh_makes_of_the_line(line: str) -> None:
    assert split_command(line) == split_by_sh(line)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        # the review's case: shlex.split kept the backslash of \$ inside double quotes
        ('sh -c "echo line \\$i"', ["sh", "-c", "echo line $i"]),
        ('echo "\\`x\\`"', ["echo", "`x`"]),
        ('printf "%s" "a\\b"', ["printf", "%s", "a\\b"]),
        ("echo '' \"\" x", ["echo", "", "", "x"]),
        (
            "echo $HOME `date` *.py ; ls | wc # no",
            ["echo", "$HOME", "`date`", "*.py", ";", "ls", "|", "wc", "#", "no"],
        ),
        ("a\\\nb", ["ab"]),
        ("tail\\", ["tail\\"]),
        ("", []),
        ("   ", []),
    ],
)
def test_examples(line: str, words: list[str]) -> None:
    assert split_command(line) == words


@pytest.mark.parametrize("line", ["echo 'open", 'echo "open', 'echo "a\\"'])
def test_an_unclosed_quote_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="no closing quotation"):
        split_command(line)

"""`ggufc run --chat`: an interactive conversation read from stdin, each turn re-rendered through
the chat template, the context's common prefix kept and only the rest recomputed. On the toy
artifact of test_session (template: the messages' contents, then 'k'), whose greedy replies the
numpy reference gives."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from ggufc.cli import main

pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def toy_chat_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("toychat") / "artifact", with_tokenizer=True)


def test_chat_turns_from_stdin_reuse_the_prefix(toy_chat_artifact: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.toy_artifact import TOY_LETTERS, greedy_reference

    monkeypatch.setattr("sys.stdin", io.StringIO("ca\n\nfa\n"))  # a blank line is skipped
    code = main(["run", str(toy_chat_artifact), "--chat", "--prompt", "dbe", "-n", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    replies = out.splitlines()
    assert len(replies) == 3
    conversation = ""
    for i, (user, reply) in enumerate(zip(["dbe", "ca", "fa"], replies, strict=True)):
        conversation += user
        ids = [TOY_LETTERS.index(c) for c in conversation + "k"]
        assert reply == "".join(TOY_LETTERS[t] for t in greedy_reference(ids, 3)), f"turn {i + 1}"
        conversation += reply
    reused = [int(m) for m in re.findall(r"chat: turn \d+, (\d+) of \d+ prompt tokens reused", err)]
    assert reused[0] == 0 and len(reused) == 3
    assert reused[1] >= len("dbe")  # the first message stays; the template's 'k' is where it differs
    assert reused[2] >= len("dbe") + len(replies[0]) + len("ca")  # the whole first exchange stays


def test_chat_reads_the_first_message_from_stdin(toy_chat_artifact: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("dbe\n"))
    assert main(["run", str(toy_chat_artifact), "--chat", "-n", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["run", str(toy_chat_artifact), "-n", "2"]) == 2  # without --chat a prompt is needed
    err = capsys.readouterr().err.strip()
    assert err.startswith("ggufc: error:") and "--prompt" in err and len(err.splitlines()) == 1, err


def test_chat_through_a_pipe(toy_chat_artifact: Path) -> None:
    """The command itself with its stdin piped: one reply line per message, each turn reported."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ggufc.cli", "run", str(toy_chat_artifact), "--chat", "-n", "3"],
                          input="dbe\nca\n", capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
    assert len(re.findall(r"chat: turn \d+, \d+ of \d+ prompt tokens reused", done.stderr)) == 2


@pytest.mark.parametrize("stdin", ["", "\n  \n"])
def test_chat_without_any_message_says_so(stdin: str, toy_chat_artifact: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`ggufc run --chat < /dev/null` is an error a user sees, not a silent success."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["run", str(toy_chat_artifact), "--chat", "-n", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "ggufc: error: --chat: no message on stdin (type one, or give --prompt)"


def test_status_lines_start_their_own_line(toy_chat_artifact: Path) -> None:
    """stdout and stderr on one pipe (as on a terminal): a status after generated text that did not
    end its line starts a line of its own instead of being glued to the text."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ggufc.cli", "run", str(toy_chat_artifact), "--prompt", "dbe",
                           "-n", "100"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    status = [line for line in lines if "ggufc:" in line]
    assert status and all(line.startswith("ggufc: ") for line in status), done.stdout
    assert any("context full (24 tokens)" in line for line in status)
    assert lines[0] and "" not in lines, done.stdout  # the text on its line, no blank line added

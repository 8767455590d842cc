"""The course's exercises: every check fails on the starter (the blank) with a learner's
sentence, passes on the reference answer (microddp's own functions), and names the usual
mistakes; `microddp exercise` lists, starts and checks them."""

from pathlib import Path

import pytest

from microddp.commands import main
from microddp.exercises import EXERCISES
from microddp.exercises.one_f_one_b import reference

ANSWERS = Path(__file__).parent / "exercise_answers"
REFERENCE = {"ring": "ring.py", "hooks": "hooks.py", "1f1b": "one_f_one_b.py",
             "zero1": "zero1.py"}


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_blank_fails_and_the_reference_passes(tmp_path, name):
    e = EXERCISES[name]
    blank = tmp_path / f"{e.function}.py"
    blank.write_text(e.starter)
    problems = e.check(str(blank))
    assert len(problems) == 1 and f"{e.function}() is not written yet" in problems[0], problems
    assert e.check(str(ANSWERS / REFERENCE[name])) == []


@pytest.mark.parametrize("name, answer, says", [
    ("hooks", "hooks_sum.py", "it is the sum over the ranks: divide by the 2 ranks"),
    ("1f1b", "gpipe.py", "holds the activations of 4 micro-batches at once (that is GPipe"),
    ("zero1", "zero1_no_gather.py", "did rank 1 update it and every rank receive it?"),
])
def test_a_usual_mistake_is_named(name, answer, says):
    problems = EXERCISES[name].check(str(ANSWERS / answer))
    assert len(problems) == 1 and says in problems[0], problems


def test_a_ring_that_drops_the_remainder_is_told_so(tmp_path):
    """Chunks of n // p: the last n % p elements are never reduced."""
    wrong = tmp_path / "ring.py"
    wrong.write_text('''
import microddp as mdp

def ring_all_reduce(t):
    w = mdp.init()
    p, r = w.world_size, w.rank
    k = t.numel() // p
    chunks = [t[i * k:(i + 1) * k] for i in range(p)]
    for s in range(p - 1):
        out, inc = chunks[(r - s) % p], chunks[(r - s - 1) % p]
        buf = inc.clone()
        a = mdp.comms.isend(out.clone(), (r + 1) % p); b = mdp.comms.irecv(buf, (r - 1) % p)
        a.wait(); b.wait(); inc += buf
    for s in range(p - 1):
        out, inc = chunks[(r - s + 1) % p], chunks[(r - s) % p]
        a = mdp.comms.isend(out.clone(), (r + 1) % p); b = mdp.comms.irecv(inc, (r - 1) % p)
        a.wait(); b.wait()
''')
    problems = EXERCISES["ring"].check(str(wrong))
    assert len(problems) == 1, problems
    assert "this rank's own value: the element was never reduced" in problems[0]
    assert "do not divide by 2 ranks: check the last chunk's size" in problems[0]


def test_the_1f1b_starters_example_is_the_librarys_answer():
    assert reference(2, 3) == [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
                               [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]]
    assert "one_f_one_b(2, 3) == [[(\"F\", 0), (\"F\", 1), (\"B\", 0), (\"F\", 2), " \
        "(\"B\", 1), (\"B\", 2)]," in EXERCISES["1f1b"].starter


def test_the_command_lists_starts_and_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["exercise", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXERCISES)
    assert main(["exercise", "start", "1f1b"]) == 0
    assert (tmp_path / "one_f_one_b.py").read_text() == EXERCISES["1f1b"].starter
    assert main(["exercise", "start", "1f1b"]) == 2  # never overwrites the learner's work
    assert "exists; check it with `microddp exercise check 1f1b" in capsys.readouterr().err
    assert main(["exercise", "check", "1f1b", "one_f_one_b.py"]) == 1
    assert "not yet: one_f_one_b() is not written yet" in capsys.readouterr().err
    assert main(["exercise", "check", "1f1b", str(ANSWERS / "one_f_one_b.py")]) == 0
    assert "solved" in capsys.readouterr().out
    (tmp_path / "broken.py").write_text("def one_f_one_b(p, m)\n    return []\n")
    assert main(["exercise", "check", "1f1b", "broken.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.py does not load: syntax error at line 1" in err[0]
    assert main(["exercise", "check", "sorting", "x.py"]) == 2
    assert "no exercise named 'sorting'; choose one of ring, hooks, 1f1b, zero1" in \
        capsys.readouterr().err

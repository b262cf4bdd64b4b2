"""sandbox.py: ordinary runs (print, the last expression, tracebacks, unicode, a long run in time, the scratch
directory and environment), every hostile case ending as a message (a timeout, a memory hog, a fork bomb, a
network attempt, an output flood, a run that kills itself, closes its stdout or segfaults), many runs from
threads at once, and nothing left running after a run or after close(). Each limit the machine cannot enforce
(not root, no namespaces) skips its test and says why; the fork bomb runs only after a harmless probe shows
that the process cap holds."""
import os
import socket
import sys
import threading
import time

import pytest

from machinery.sandbox import Result, Sandbox, SandboxError, pids_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

MAX_PROCS = 8


@pytest.fixture(scope="module")
def box():
    b = Sandbox(workers=4, timeout_s=2, memory_mb=256, max_procs=MAX_PROCS).start()
    yield b
    b.close()


def uids(b):
    return {w.hello["uid"] for w in b._all if w.hello.get("uid") is not None}


def test_print_and_the_last_expression(box):
    r = box.run("x = 6\nprint('x is', x)\nx * 7")
    assert (r.stdout, r.stderr, r.error, r.exit_code, r.timed_out, r.truncated) == \
        ("x is 6\n42\n", "", None, 0, False, False)
    assert r.ok and r.text() == "x is 6\n42\n"
    assert box.run("print(1)").stdout == "1\n"  # print() returns None: not echoed
    assert box.run("x = 1").text() == "[no output]\n"


def test_an_exception_shows_its_traceback_without_the_sandbox(box):
    r = box.run("def f(x):\n    return 1 / x\n\nf(0)")
    assert r.exit_code == 1 and r.error == "ZeroDivisionError: division by zero"
    assert r.stderr.startswith("Traceback (most recent call last):\n  File \"<tool>\", line 4, in <module>")
    assert "return 1 / x" in r.stderr  # the code's own lines are shown
    assert "exec(" not in r.stderr and "ast.py" not in r.stderr  # the bootstrap's frames are not
    assert r.text().endswith("ZeroDivisionError: division by zero\n")  # the error is not repeated
    r = box.run("print(")
    assert r.error.startswith("SyntaxError") and "Traceback" not in r.stderr and '"<tool>", line 1' in r.stderr


def test_unicode(box):
    r = box.run("s = 'π ≈ 3.14159, 日本語, 🎉'\nprint(s)\nlen(s)")
    assert r.stdout == f"π ≈ 3.14159, 日本語, 🎉\n{len('π ≈ 3.14159, 日本語, 🎉')}\n"


def test_a_long_run_in_time(box):
    r = box.run("import time\ntime.sleep(0.8)\nprint(sum(i * i for i in range(10**5)))", timeout_s=5)
    assert r.ok and r.stdout == f"{sum(i * i for i in range(10**5))}\n" and 0.8 <= r.seconds < 5


def test_scratch_directory_environment_and_user(box):
    r = box.run("import os\nprint(os.listdir('.'), os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
                "open('f.txt', 'w').write('x')\nprint(sorted(os.environ))\ninput()")
    lines = r.stdout.splitlines()
    assert lines[0] == "[] True"  # a fresh, empty scratch directory each run
    assert eval(lines[1]) == sorted(["PATH", "LANG", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                     "OPENBLAS_NUM_THREADS", "HOME", "TMPDIR"])  # none inherited: no HF_HUB_OFFLINE
    assert r.error == "EOFError: EOF when reading a line"  # stdin is empty
    if not box.isolation["uid"]:
        pytest.skip(f"no unprivileged uid here: {box.isolation['warnings']}")
    r = box.run(f"import os\nprint(os.getuid(), os.geteuid(), os.getgid())\nos.kill({os.getpid()}, 0)")
    assert "0" not in r.stdout.split() and r.error.startswith("PermissionError")  # it cannot signal the trainer
    for d in box.isolation["hidden"]:  # a directory on the interpreter's way that the uid could not pass: empty
        assert box.run(f"import os\nos.listdir({d!r})").error.startswith("PermissionError")


def test_the_hosts_tmp_is_neither_seen_nor_cleaned(box, tmp_path):
    """With a private /tmp, a run neither sees nor wipes the host's /tmp (pytest's tmp_path lives there), while a
    checkout and virtualenv under /tmp (CI's clone) stay reachable: the interpreter runs at all."""
    marker = tmp_path / "marker"
    marker.write_text("host")
    r = box.run(f"import os; print(os.path.exists({str(marker)!r}))")
    assert r.stdout == ("False\n" if box.isolation["private_tmp"] else "True\n")
    assert marker.read_text() == "host"  # the runs' cleaning never reaches the host's /tmp


def test_an_infinite_loop_times_out(box):
    start = time.perf_counter()
    r = box.run("while True:\n    pass", timeout_s=1)
    assert r.timed_out and r.error == "timed out after 1 s" and r.exit_code == -9
    assert r.text() == "[timed out after 1 s]\n" and time.perf_counter() - start < 3


def test_a_memory_hog_gets_a_memory_error(box):
    for code in ("x = bytearray(4 << 30)", "a = []\nwhile True:\n    a.append(bytearray(10**7))"):
        r = box.run(code)
        assert not r.timed_out and r.error == "MemoryError (the memory limit is 256 MiB)", r


def test_an_output_flood_is_capped_and_ends_promptly(box):
    for code in ("print('x' * 10_000_000)", "for _ in range(100_000):\n    print('y' * 99)",
                 "import sys\nsys.stderr.write('e' * 10_000_000 + '\\nthe end')"):
        start = time.perf_counter()
        r = box.run(code, timeout_s=5)
        assert r.truncated and not r.timed_out and time.perf_counter() - start < 4
        assert len(r.stdout) <= 16384 + 30 and len(r.stderr) <= 16384 + 30
        assert "[... output truncated]" in r.text()
    assert r.stderr.startswith("[... output truncated]\n") and r.stderr.endswith("the end")  # stderr keeps its end
    r = box.run("print('a' * 20_000)")
    assert r.stdout == "a" * 16384 + "\n[... output truncated]\n" and r.ok


def test_code_that_kills_itself(box):
    r = box.run("import os\nprint('before', flush=True)\nos.kill(os.getpid(), 9)")
    assert r.stdout == "before\n" and r.exit_code == -9 and r.error == "killed (SIGKILL)" and not r.timed_out


def test_code_that_closes_its_stdout(box):
    r = box.run("import os\nos.close(1)\nprint('hello')")
    assert r.error == "OSError: [Errno 9] Bad file descriptor" and r.stdout == ""
    r = box.run("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", timeout_s=1)
    assert r.timed_out  # no pipes left to read: the timeout still ends it


def test_a_segfault(box):
    r = box.run("import ctypes\nctypes.string_at(0)")
    assert r.exit_code == -11 and r.error == "crashed: segmentation fault (SIGSEGV)"
    assert "Segmentation fault" in r.stderr and '"<tool>", line 2' in r.stderr  # faulthandler's traceback


def test_no_network(box):
    if not box.isolation["network"]:
        pytest.skip(f"no network namespace here: {box.isolation['warnings']}")
    with socket.socket() as listener:  # a listener of the test's own, on the host's loopback
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = box.run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                    f"    print('connected')\nexcept OSError as e:\n    print('failed:', e)")
        assert r.stdout.startswith("failed:"), r
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached it


def test_processes_left_behind_are_killed(box):
    code = ("import os, subprocess, time\n"
            "subprocess.Popen(['sleep', '30'], start_new_session=True)\n"  # leaves the process group
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\n"
            "print('spawned')")
    r = box.run(code)
    assert r.ok and r.stdout == "spawned\n"
    if not box.isolation["uid"]:
        pytest.skip("no uid of its own: processes that leave the session are not tracked")
    assert pids_of(uids(box)) == []


@pytest.fixture(scope="module")
def cap_holds(box):
    """Whether the process cap binds, from a harmless probe: try to fork MAX_PROCS + 1 sleepers."""
    if not box.isolation["uid"]:
        return False
    r = box.run(f"import os, time\nn = 0\nfor _ in range({MAX_PROCS + 1}):\n    try:\n        pid = os.fork()\n"
                f"    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
                f"    n += 1\nprint(n)")
    assert pids_of(uids(box)) == []
    return r.ok and int(r.stdout) <= MAX_PROCS - 1  # the interpreter itself is one of MAX_PROCS


def test_a_fork_bomb_is_capped(box, cap_holds):
    if not cap_holds:
        pytest.skip(f"the process cap does not hold here ({box.isolation['warnings']}): no fork bomb on a shared "
                    "machine")
    r = box.run("import os\nwhile True:\n    os.fork()", timeout_s=2)
    assert r.timed_out or "Resource temporarily unavailable" in r.text(), r
    start = time.perf_counter()
    r = box.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=1)
    assert r.timed_out and time.perf_counter() - start < 3
    assert pids_of(uids(box)) == []


def test_many_runs_from_threads(box):
    results, start = {}, time.perf_counter()
    def one(i):
        results[i] = box.run(f"import time\ntime.sleep(0.2)\n{i} ** 2")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n" for i in range(16)}
    assert time.perf_counter() - start >= 0.8  # 4 workers: 16 runs of 0.2 s go in 4 waves at the least


def test_close_leaves_nothing_behind():
    b = Sandbox(workers=2, timeout_s=10, memory_mb=256, max_procs=MAX_PROCS).start()
    ids = uids(b)
    # a worker that dies mid-run: run() raises, the worker is replaced, and what its run left is killed
    failed = []
    t = threading.Thread(target=lambda: failed.append(pytest.raises(SandboxError, b.run, "import subprocess, time\n"
                         "subprocess.Popen(['sleep', '30'], start_new_session=True)\ntime.sleep(30)")))
    t.start()
    deadline = time.monotonic() + 5
    while len(pids_of(ids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    busy = next((w for w in b._all if w.hello.get("uid") in ids and pids_of({w.hello["uid"]})), None)
    if busy is None:
        b.close()
        pytest.skip("no uid of its own per worker here: a run's processes cannot be found")
    os.kill(busy.proc.pid, 9)
    t.join(10)
    assert failed and "worker failed" in str(failed[0].value)
    assert pids_of({busy.hello["uid"]}) == []  # its sleeper, which had left the session, too
    assert [b.run(f"print({i})").stdout for i in range(2)] == ["0\n", "1\n"]  # (FIFO: the second restarts the slot)
    assert all(w.proc is not None for w in b._all)
    workers, ids = [w.proc.pid for w in b._all], ids | uids(b)
    b.close()
    assert pids_of(ids) == []
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]  # each worker exited and was reaped
    with pytest.raises(SandboxError, match="closed"):
        b.run("print(1)")


def test_result_text():
    assert Result("out\n", "", "timed out after 2 s", -9, True).text() == "out\n[timed out after 2 s]\n"
    assert Result("a" * 100).text(40) == "a" * 17 + "\n[... output truncated]"
    assert Result("x", "Traceback ...\nValueError: v\n", "ValueError: v", 1).text() == "xTraceback ...\nValueError: v\n"

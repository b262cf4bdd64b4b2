"""sandbox.py: ordinary runs (print, the last expression, tracebacks, unicode, a long run in time, the scratch
directory and environment), every hostile case ending as a message (a timeout, a memory hog, a fork bomb, a
network attempt, an output flood, a run that kills itself, closes its stdout or segfaults), many runs from
threads at once, and nothing left running after a run or after close(). Hostile programs that go for the host
(issue 36): 10,000 files and 2 GB written anywhere writable, a planted secret in the environment, the trainer's
/proc, the other processes, a planted label in a run_dir and a dataset directory, the checkout's files, the OOM
score; and (the hardening) a key planted in the trainer's session keyring and keys a run adds, four processes of
900 MiB under memory_mb=1024, a POSIX message queue left for the next run, files planted where no rule names them,
unshare/clone/mount and vsock/netlink/packet sockets; numpy and sympy under PythonMath's limits. The wait for a
worker is bounded apart from the code's timeout; a machine without the isolation is
refused unless isolation="weak" is asked for (simulated: a uid that cannot be had). Where the machine cannot
isolate (not root, no namespaces), the module's sandbox is a weak one and the tests of isolation skip, saying
why; the fork bomb runs only after a harmless probe shows that the process cap holds. Every test is bounded:
what a run may write is capped (disk_mb, max_files), and the host's side is measured before and after."""
import contextlib
import ctypes
import glob
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid

import pytest

from machinery.sandbox import Result, Sandbox, SandboxError, pids_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

MAX_PROCS = 8


LIMITS = {"workers": 4, "timeout_s": 2, "memory_mb": 256, "max_procs": MAX_PROCS, "disk_mb": 64, "max_files": 4096}


def start(**overrides):
    """A strict sandbox; where the machine refuses one, a weak one whose `refused` says why (isolation tests skip)."""
    try:
        b = Sandbox(**LIMITS | overrides).start()
        b.refused = None
    except SandboxError as e:
        if "isolation='weak'" not in str(e):
            raise
        b = Sandbox(**LIMITS | overrides, isolation="weak").start()
        b.refused = str(e)
    return b


def need_strict(b):
    if b.refused:
        pytest.skip(f"no strict isolation on this machine: {b.refused}")


@pytest.fixture(scope="module")
def box():
    b = start()
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


# ----------------------------------------------------------------------------- hostile programs (issue 36)


def host_dir(prefix):
    """A world-readable directory of the test's on the host, outside every place the sandbox makes private (/tmp,
    /var/tmp, /run, ...): what the sandbox must hide by itself. None if no such place is writable here."""
    for parent in ("/var/cache", "/opt", "/srv", "/var/lib"):
        try:
            d = tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError:
            continue
        os.chmod(d, 0o755)
        return d
    return None


def free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def test_ten_thousand_files_anywhere_leave_nothing_on_the_host(box):
    need_strict(box)
    tag = f"hostile-{uuid.uuid4().hex[:8]}"
    open_dir = host_dir("sandbox-ww-")  # a world-writable directory of the host's own, not one of the usual ones
    if open_dir is None:
        pytest.skip("no place on this host to make a world-writable directory in")
    os.chmod(open_dir, 0o1777)
    places = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/crash", open_dir, "."]
    before = {d: free(d) for d in ("/", "/var/tmp", "/dev/shm")}
    code = (f"import os\nfor d in {places!r}:\n    n, why = 0, 'all'\n    try:\n        for i in range(10_000):\n"
            f"            with open(os.path.join(d, '{tag}-%d' % i), 'w') as f:\n                f.write('x')\n"
            f"            n += 1\n    except OSError as e:\n        why = e.strerror\n    print(d, n, why)")
    try:
        r = box.run(code, timeout_s=20)
        assert r.ok, r
        wrote = {line.split(" ", 2)[0]: int(line.split(" ", 2)[1]) for line in r.stdout.splitlines()}
        assert wrote[open_dir] == 0 and wrote["/var/crash"] == 0  # read-only: nothing at all
        assert sum(wrote.values()) <= LIMITS["max_files"]  # all of a run's writable places share one file cap
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", open_dir):  # nothing of it on the host
            assert glob.glob(os.path.join(d, f"{tag}-*")) == [], d
        after = {d: free(d) for d in before}
        for d in before:  # (other processes on the machine move these a little)
            assert abs(after[d][0] - before[d][0]) < 256 << 20 and abs(after[d][1] - before[d][1]) < 2000, d
        again = box.run(f"import glob\nprint(sum(len(glob.glob(d + '/{tag}-*')) for d in {places!r}))")
        assert again.stdout == "0\n"  # and nothing for the next run: every place was wiped (whichever worker)
    finally:
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
            for f in glob.glob(os.path.join(d, f"{tag}-*")):
                os.unlink(f)
        shutil.rmtree(open_dir, ignore_errors=True)


def test_two_gigabytes_are_stopped_at_the_cap_quickly(box):
    need_strict(box)
    tag = f"hostile-{uuid.uuid4().hex[:8]}"
    before = {d: free(d)[0] for d in ("/", "/var/tmp", "/dev/shm")}
    code = (f"import os\ntotal, chunk = 0, b'x' * (1 << 20)\n"
            f"try:\n    for d in ['/var/tmp', '.', '/dev/shm', '/tmp']:\n        for i in range(64):\n"
            f"            with open(os.path.join(d, '{tag}-%d' % i), 'wb') as f:\n"
            f"                for _ in range(32):\n                    f.write(chunk)\n                    f.flush()\n"
            f"                    total += len(chunk)\n                    if total >= 2 << 30:\n"
            f"                        raise SystemExit('wrote 2 GB')\nexcept OSError as e:\n    print(e.strerror)\n"
            f"print(total >> 20, 'MiB')")
    try:
        r = box.run(code, timeout_s=20)
        assert r.ok, r  # stopped by the cap (below), not by its 20 s timeout
        error, written = r.stdout.splitlines()
        assert error == "No space left on device" and int(written.split()[0]) <= LIMITS["disk_mb"], r
        for d, was in before.items():
            assert abs(free(d)[0] - was) < 256 << 20, d
            assert glob.glob(os.path.join(d, f"{tag}-*")) == []
    finally:
        for d in ("/var/tmp", "/dev/shm", "/tmp"):
            for f in glob.glob(os.path.join(d, f"{tag}-*")):
                os.unlink(f)


def test_no_secret_and_no_other_process_in_reach(monkeypatch):
    """A secret planted in the trainer's environment before the workers start; the code looks in its own
    environment, in the trainer's and its worker's /proc entries, and for any other process."""
    monkeypatch.setenv("HF_TOKEN", "planted-secret-36")
    b = start(workers=1)
    try:
        need_strict(b)
        me = os.getpid()
        code = (f"import os\nprint('env', os.environ.get('HF_TOKEN'), 'planted-secret-36' in repr(os.environ))\n"
                f"for pid in ({me}, os.getppid(), 1):\n    for what in ('environ', 'cmdline', 'maps', 'mem', 'fd'):\n"
                f"        try:\n            p = f'/proc/{{pid}}/{{what}}'\n"
                f"            got = os.listdir(p) if what == 'fd' else open(p, 'rb').read(64)\n"
                f"            print('read', pid == {me} and 'trainer' or pid, what)\n"
                f"        except OSError as e:\n            pass\n"
                f"others = [p for p in os.listdir('/proc') if p.isdigit() and p != str(os.getpid())]\n"
                f"print('others', len(others))")
        r = b.run(code)
        assert r.ok and r.stdout == "env None False\nothers 0\n", r  # nothing read, no process but its own seen
    finally:
        b.close()


def test_labels_run_dir_data_and_checkout_are_hidden():
    """A run_dir and a dataset directory with a planted label (outside /tmp: the host's own directories), passed
    to the Sandbox as PythonMath.setup passes them, and the checkout's own files: the code finds nothing."""
    run_dir, data_dir = host_dir("sandbox-run-"), host_dir("sandbox-data-")
    if run_dir is None:
        pytest.skip("no world-readable place on this host to plant a label in")
    b = None
    try:
        for d in (run_dir, data_dir):
            os.makedirs(os.path.join(d, "rollouts"))
            with open(os.path.join(d, "rollouts", "labels.jsonl"), "w") as f:
                f.write('{"label": "planted-label-36"}\n')
            os.chmod(os.path.join(d, "rollouts", "labels.jsonl"), 0o644)
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        b = start(workers=1, hide=[run_dir, os.path.join(data_dir, "rollouts", "labels.jsonl")])
        need_strict(b)
        targets = [os.path.join(run_dir, "rollouts", "labels.jsonl"), os.path.join(data_dir, "rollouts",
                   "labels.jsonl"), os.path.join(checkout, "machinery", "sandbox.py"), os.path.join(checkout,
                   "README.md"), os.path.join(checkout, "tests", "test_sandbox.py")]
        code = (f"import os\nfor p in {targets!r}:\n    try:\n        open(p).read(100)\n        print('read', p)\n"
                f"    except OSError as e:\n        print(type(e).__name__)\n"
                f"ls = lambda d: sorted(os.listdir(d)) if os.path.isdir(d) else []  # (absent from the root: empty)\n"
                f"print(ls({run_dir!r}), ls({os.path.join(data_dir, 'rollouts')!r}), "
                f"ls({checkout!r}))")  # (a data file hides its directory)
        r = b.run(code)
        lines = r.stdout.splitlines()
        assert lines[:5] == ["FileNotFoundError"] * 5, r
        visible = [n for n in eval(lines[5].split("] ", 2)[-1]) if n not in (".venv", "venv")]
        assert lines[5].startswith("[] [] ") and visible == [], r  # only the interpreter's virtualenv, if it is there
        assert b.run("import numpy").error in (None, "ModuleNotFoundError: No module named 'numpy'")  # still runs
    finally:
        if b is not None:
            b.close()
        for d in (run_dir, data_dir):
            shutil.rmtree(d, ignore_errors=True)


def test_ipc_objects_and_a_deep_tree_do_not_outlive_the_run():
    """SysV shared memory, a queue and a semaphore left behind, and a tree too deep for a recursive walk: the
    next run on the same worker finds none of them."""
    b = start(workers=1)
    try:
        need_strict(b)
        r = b.run("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                  "print(libc.shmget(0, 1 << 20, 0o1600) >= 0, libc.msgget(0, 0o1600) >= 0, "
                  "libc.semget(0, 1, 0o1600) >= 0)\nos.chdir('/var/tmp')\nfor _ in range(2000):\n"
                  "    os.mkdir('d')\n    os.chdir('d')")
        assert r.ok and r.stdout == "True True True\n", r
        r = b.run("import os\nprint([len(open('/proc/sysvipc/' + k).readlines()) - 1 for k in ('shm', 'msg', 'sem')],"
                  " os.listdir('/var/tmp'))")
        assert r.stdout == "[0, 0, 0] []\n", r
    finally:
        b.close()


def test_the_oom_killer_picks_the_code(box):
    r = box.run("print(open('/proc/self/oom_score_adj').read().strip())\ntry:\n"
                "    open('/proc/self/oom_score_adj', 'w').write('0')\nexcept OSError as e:\n    print(e.strerror)")
    assert r.stdout.splitlines()[0] == "1000", r
    if not box.isolation["uid"] or not box.isolation["oom_locked"]:
        pytest.skip(f"the code may lower its oom_score_adj here: {box.isolation['warnings']}")
    assert r.stdout.splitlines()[1:] == ["Permission denied"], r  # it cannot make itself less of a target


def test_the_wait_for_a_worker_is_bounded_and_not_the_codes_timeout():
    b = Sandbox(workers=1, timeout_s=1, memory_mb=256, max_procs=MAX_PROCS, wait_s=0.3, isolation="weak").start()
    try:
        busy = threading.Thread(target=b.run, args=("import time\ntime.sleep(0.9)", 2))
        busy.start()
        time.sleep(0.1)
        t = time.perf_counter()
        with pytest.raises(SandboxError, match="no sandbox worker was free within 0.3 s"):
            b.run("print(1)")  # never a Result with timed_out: the model's code did not run at all
        assert time.perf_counter() - t >= 0.25  # it waited wait_s for a worker (the message names it)
        busy.join()
        b.wait_s = 5.0  # a wait longer than the code's own timeout (1 s) does not count against it
        done = []
        busy = threading.Thread(target=lambda: done.append(b.run("import time\ntime.sleep(0.8)\nprint(1)")))
        busy.start()
        time.sleep(0.1)
        r = b.run("import time\ntime.sleep(0.6)\nprint(2)")
        busy.join()
        assert done[0].stdout == "1\n" and r.ok and r.stdout == "2\n" and r.seconds < 1, (done, r)
        assert b.run("print(3)").stdout == "3\n"  # the worker is free again: the given-up call never ran on it
    finally:
        b.close()


def test_weak_isolation_is_refused_unless_asked_for(capsys):
    """Simulated: a uid that cannot be had (beyond 2**32) stands for a machine without root or namespaces."""
    with pytest.raises(SandboxError) as e:
        Sandbox(workers=1, uid_base=2 ** 32, memory_mb=256).start()
    message = str(e.value)
    assert "\n" not in message and "isolation='weak'" in message and "missing" in message
    assert "a uid of its own" in message or "root" in message, message
    b = Sandbox(workers=1, uid_base=2 ** 32, memory_mb=256, isolation="weak").start()
    try:
        assert b.run("print(1)").stdout == "1\n" and b.isolation["missing"]
        assert "[sandbox] warning:" in capsys.readouterr().err
    finally:
        b.close()
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="none")


def test_result_text():
    assert Result("out\n", "", "timed out after 2 s", -9, True).text() == "out\n[timed out after 2 s]\n"
    assert Result("a" * 100).text(40) == "a" * 17 + "\n[... output truncated]"
    assert Result("x", "Traceback ...\nValueError: v\n", "ValueError: v", 1).text() == "xTraceback ...\nValueError: v\n"


# ----------------------------------------------------------------------------- hostile programs (the hardening)


# The system calls the hostile programs make by number, from the kernel's tables (x86-64: syscall_64.tbl;
# aarch64: asm-generic/unistd.h); the tests that need them skip on another machine.
NUMBERS = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "clone": 56, "mount": 165,
                      "bpf": 321},
           "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "clone": 220, "mount": 40,
                       "bpf": 280}}


def syscall_numbers():
    return NUMBERS.get(os.uname().machine)


SYSCALL_HELPER = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  "def call(nr, *args):\n    r = libc.syscall(ctypes.c_long(nr), *args)\n"
                  "    return r if r >= 0 else 'E' + str(ctypes.get_errno())\n"
                  "L = ctypes.c_long\nbuf = ctypes.create_string_buffer(256)\n")


def test_the_trainers_keys_and_a_runs_keys_are_out_of_reach():
    """A key planted in the trainer's session keyring; run A looks for it and adds keys to its session, user and
    user-session keyrings; run B, on the same worker, looks for those; the trainer's keyring is as it was."""
    nr = syscall_numbers()
    if nr is None:
        pytest.skip(f"no system call numbers for {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl = lambda *a: libc.syscall(ctypes.c_long(nr["keyctl"]), *a)  # noqa: E731
    tag = uuid.uuid4().hex[:8]
    # a session keyring of the test's own, so the planted key is never in the machine's shared _uid_ses.0
    assert keyctl(ctypes.c_long(1), f"sandbox-test-{tag}".encode()) > 0, ctypes.get_errno()

    def session():
        buf = ctypes.create_string_buffer(4096)
        n = keyctl(ctypes.c_long(11), ctypes.c_long(-3), buf, ctypes.c_long(4096))  # KEYCTL_READ: its key ids
        return sorted(struct.unpack(f"{n // 4}i", buf.raw[:n]))

    planted = libc.syscall(ctypes.c_long(nr["add_key"]), b"user", f"trainer-{tag}".encode(), b"planted-key-secret",
                           ctypes.c_size_t(18), ctypes.c_long(-3))
    assert planted > 0, ctypes.get_errno()
    before = session()
    b = start(workers=1)
    try:
        need_strict(b)
        a = b.run(SYSCALL_HELPER + f"print('found', call({nr['request_key']}, b'user', b'trainer-{tag}', None, L(0)))\n"
                  f"print('read', call({nr['keyctl']}, L(11), L({planted}), buf, L(256)), buf.value)\n"
                  f"for ring in (-3, -4, -5):\n    print('add', call({nr['add_key']}, b'user', b'run-a-%d' % -ring, "
                  f"b'run-a-payload', ctypes.c_size_t(13), L(ring)))")
        assert a.ok and "planted-key-secret" not in a.stdout, a
        assert [line.split()[1][0] for line in a.stdout.splitlines()] == ["E"] * 5, a  # nothing found, read, added
        r = b.run(SYSCALL_HELPER + "for ring in (-3, -4, -5):\n"
                  f"    print(call({nr['request_key']}, b'user', b'run-a-%d' % -ring, None, L(0)), "
                  f"call({nr['keyctl']}, L(10), L(ring), b'user', b'run-a-%d' % -ring, L(0)))")
        assert r.ok and all(v.startswith("E") for v in r.stdout.split()), r  # nothing of run A's
    finally:
        b.close()
        after = session()
        keyctl(ctypes.c_long(9), ctypes.c_long(planted), ctypes.c_long(-3))  # KEYCTL_UNLINK
    assert after == before  # nothing added to the trainer's keyring (and the planted key was only read there)


def mem_available():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def test_a_runs_processes_together_stay_within_memory_mb():
    """Four processes of 900 MiB each under memory_mb=1024: the host's available memory, sampled every 10 ms,
    never drops by much more than 1024 MiB, and the run's processes are killed (or get a MemoryError)."""
    b = start(workers=1, memory_mb=1024, timeout_s=30)
    try:
        need_strict(b)
        base, low, done = mem_available(), [mem_available()], threading.Event()

        def sample():
            while not done.is_set():
                low[0] = min(low[0], mem_available())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            r = b.run("import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                      "        try:\n            x = b'1' * (900 << 20)\n            time.sleep(2)\n"
                      "        except MemoryError:\n            os._exit(3)\n        os._exit(0)\n"
                      "    pids.append(pid)\n"
                      "print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])", timeout_s=30)
        finally:
            done.set()
            sampler.join()
        grew = (base - low[0]) >> 20
        assert grew < 1024 + 512, (grew, r)  # (other processes on the machine move it a little)
        killed = r.stdout and eval(r.stdout.splitlines()[-1]).count(0) < 4 or r.error and "out of memory" in r.error
        assert killed and not r.timed_out, r
        assert b.run("print(1)").stdout == "1\n"  # the worker lives on
    finally:
        b.close()


def test_pythonmath_numbers_run_numpy_and_sympy():
    """PythonMath.setup's default limits (memory_mb, max_procs): numpy and sympy import and compute inside the
    bound, checked against Cramer's rule and the quadratic formula."""
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    import inspect

    from machinery.tools import PythonMath
    defaults = {k: v.default for k, v in inspect.signature(PythonMath.setup).parameters.items()}
    b = start(workers=1, memory_mb=defaults["memory_mb"], max_procs=defaults["max_procs"], timeout_s=60)
    try:
        r = b.run("import numpy as np, sympy as sp\nprint(np.linalg.solve(np.array([[3., 2.], [1., 4.]]), "
                  "np.array([7., 9.])).tolist())\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 7*x + 10, x))", 60)
        a, c = [[3.0, 2.0], [1.0, 4.0]], [7.0, 9.0]
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        cramer = [(c[0] * a[1][1] - a[0][1] * c[1]) / det, (a[0][0] * c[1] - c[0] * a[1][0]) / det]
        roots = sorted(int((7 + s * (49 - 40) ** 0.5) / 2) for s in (-1, 1))
        assert r.ok, r
        assert eval(r.stdout.splitlines()[0]) == pytest.approx(cramer) and r.stdout.splitlines()[1] == str(roots), r
    finally:
        b.close()


def test_posix_message_queues_do_not_outlive_the_run():
    b = start(workers=1)
    try:
        need_strict(b)
        helper = "import ctypes\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
        r = b.run(helper + "q = rt.mq_open(b'/planted36', 0o102, 0o600, None)\n"  # O_CREAT | O_RDWR
                  "print(q >= 0, rt.mq_send(q, b'planted-mq', 10, 0))")
        assert r.stdout == "True 0\n", r
        r = b.run(helper + "q = rt.mq_open(b'/planted36', 2)\nbuf = ctypes.create_string_buffer(8192)\n"
                  "print(q, ctypes.get_errno(), q >= 0 and rt.mq_receive(q, buf, 8192, None), buf.value)")
        assert r.stdout == "-1 2 False b''\n", r  # ENOENT: the queue went with its run
    finally:
        b.close()


def test_only_what_the_interpreter_needs_is_in_the_root():
    """Files planted where no rule names them (a fresh directory in the trainer's HOME, one under /opt, a second
    git checkout), the files shared beside the checkout, /etc/passwd's users, /proc/cmdline, /sys: out of reach."""
    planted = []
    for parent in (os.path.expanduser("~"), "/opt", "/srv"):
        with contextlib.suppress(OSError):
            d = tempfile.mkdtemp(prefix="sandbox-plant-", dir=parent)
            os.chmod(d, 0o755)
            os.makedirs(os.path.join(d, ".git"))
            with open(os.path.join(d, "secret.txt"), "w") as f:
                f.write("planted-file-secret")
            os.chmod(os.path.join(d, "secret.txt"), 0o644)
            planted.append(d)
    if not planted:
        pytest.skip("no place on this host to plant a file in")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open("/etc/passwd") as f:
        users = {line.split(":")[0] for line in f if line.strip()} - {"root", "nobody"}
    b = start(workers=1)
    try:
        need_strict(b)
        paths = [*(os.path.join(d, "secret.txt") for d in planted), *planted, os.path.dirname(checkout), "/sys",
                 "/home", "/root", "/opt", "/srv", "/mnt"]
        r = b.run(f"import os\nfor p in {paths!r}:\n    print(p, os.listdir(p) if os.path.isdir(p) else "
                  f"os.path.exists(p) and open(p).read())\nprint(open('/etc/passwd').read().split())\n"
                  f"print(repr(open('/proc/cmdline').read()))")
        lines = r.stdout.splitlines()
        assert r.ok and "planted-file-secret" not in r.stdout, r
        seen = dict(line.split(" ", 1) for line in lines[:len(paths)])
        for p in paths:
            assert seen[p] in ("False", "[]") or p in (os.path.dirname(checkout), "/root") and "sandbox-plant" not \
                in seen[p] and "shared" not in seen[p], (p, seen[p])  # a parent of the interpreter: its way only
        assert not users & {line.split(":")[0] for line in eval(lines[-2])}, lines[-2]  # no real user named
        assert lines[-1] == "''", r
    finally:
        b.close()
        for d in planted:
            shutil.rmtree(d, ignore_errors=True)


def test_no_new_namespaces_and_no_odd_sockets(box):
    """unshare, clone with CLONE_NEWUSER, mount, bpf and an x32 system call fail; vsock, netlink and packet
    sockets cannot be made; unix and IP sockets, threads and subprocesses still work."""
    need_strict(box)
    nr = syscall_numbers()
    if nr is None:
        pytest.skip(f"no system call numbers for {os.uname().machine}")
    code = (SYSCALL_HELPER + "import socket, subprocess, threading\n"
            "print('unshare', call(%d, L(0x10020000)))\n" % nr["unshare"] +
            "pid = call(%d, L(0x10000000 | 17), L(0), L(0), L(0), L(0))\n" % nr["clone"] +
            "if pid == 0:\n    os._exit(0)\nprint('clone', pid if isinstance(pid, str) else 'made')\n"
            "print('mount', call(%d, b'none', b'/tmp', b'tmpfs', L(0), None))\n" % nr["mount"] +
            "print('bpf', call(%d, L(0), None, L(0)))\n" % nr["bpf"] +
            ("print('x32', call(0x40000000 | 39))\n" if os.uname().machine == "x86_64" else "") +
            "for family in (40, 16, 17):\n    try:\n        socket.socket(family, socket.SOCK_DGRAM).close()\n"
            "        print(family, 'made')\n    except OSError as e:\n        print(family, e.errno)\n"
            "socket.socketpair()\nsocket.socket(socket.AF_INET).close()\nsocket.socket(socket.AF_INET6).close()\n"
            "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
            "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())")
    r = box.run(code)
    assert r.ok, r
    expect = ["unshare E1", "clone E1", "mount E1", "bpf E1", *(["x32 E1"] if os.uname().machine == "x86_64" else []),
              "40 97", "16 97", "17 97", "thread", "child"]  # EPERM; EAFNOSUPPORT
    assert r.stdout.splitlines() == expect, r

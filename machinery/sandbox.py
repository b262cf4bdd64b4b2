"""
The sandbox: model-written Python code runs here, never in the trainer's process, with limits, so that every
way it can end (an answer, a traceback, a hang, a memory hog, a fork bomb, a crash) is a message for the
model, never a hang or a crash of the trainer. For envs (data.env) of tool-integrated reasoning; env.py calls
them from its pool of threads, so many threads run code at once:

    box = Sandbox(workers=8, timeout_s=10).start()  # at start-up, before the model loads (a fraction of a second)
    result = box.run("x = 2 ** 10\\nx")              # thread-safe: up to `workers` runs at once, the others wait
    result.text(2000)                                # what the model reads: "1024\\n"
    box.close()                                      # the workers and everything they started end

Processes. Forking the trainer (GBs of tensors, many threads) per run would be slow and unsafe, so start()
launches `workers` small processes, each a fresh `python -I sandbox.py` that imports the standard library only
(subprocess starts them with vfork and exec: nothing of the trainer is copied). Each worker is its own fork
server: per run it forks a child, which takes on the run's limits and execs a fresh `python -I` (the trainer's
interpreter and virtualenv, so numpy and sympy are there); that reads the code from its stdin and runs it. The
trainer talks to a worker over its stdin and stdout, one JSON line each way per run; run() takes an idle worker
from a queue, or waits for one.

Isolation, per worker (as far as the machine allows: `Sandbox.isolation` says what holds, start() warns once,
in one line each, about what does not):
- its own uid and gid, UID_BASE + the worker's pid, when the trainer is root: no other process on the machine
  has it (one pid namespace assumed) and no process of it outlives a run. The code cannot signal the trainer,
  read its environment or memory, or write its files. Not root: the code runs as the trainer's user (it could
  signal the trainer's processes, and there is no process cap).
- its own network namespace, with only its own loopback, left down: no network at all, not even the host's
  127.0.0.1 (abstract unix sockets are per namespace too). Made once per worker, not per run: cheaper,
  and nothing of a run survives into the next.
- its own mount namespace: /tmp and /dev/shm are private tmpfs (disk_mb each), wiped after every run; and a
  directory on the way to the interpreter that the uid could not pass (a 0700 /root that holds pyenv) is
  covered by an empty tmpfs into which only the entries on that way are bound back: the rest of it stays hidden.
  Not root: both namespaces are made inside a user namespace, where the kernel allows one.
Per run:
- its own session: on the wall-clock timeout (or when the code's process ends) the process group is killed, then
  every process of the uid (from a helper of that uid, kill(-1): atomic against a fork bomb), so children that
  left the group (setsid, a double fork) die too; the worker is a child subreaper and reaps them all.
- rlimits: CPU seconds (ceil(timeout) + 1), address space (memory_mb: a big allocation is a MemoryError), file
  size (disk_mb), 256 open files, no core dump; and the process cap (max_procs, threads included): RLIMIT_NPROC
  never binds root and counts every process of the uid on the machine, which is why each worker has a uid of its
  own and the limit is set before the drop to it. (Not root: no cap, a warning; no cgroup is used.)
- no_new_privs (setuid binaries gain nothing) and a parent-death signal (the code dies with its worker).
- a fresh scratch directory as cwd, HOME and TMPDIR, owned by the uid and removed after; a minimal environment
  (ENV: nothing inherited, so no secrets); an empty stdin.
- stdout and stderr unbuffered (python -u: what was printed before a timeout or a crash is kept), on separate
  pipes, read as they come, each capped at max_output bytes: stdout keeps its
  head, stderr its tail (a traceback's end names the error); the cut is marked "[... output truncated]" and the
  rest is read and dropped (the code is not stopped for it). Separate so that a flood of prints cannot push a
  traceback out of view and buffering cannot interleave them; the model reads stdout, then stderr.
- the code runs as a notebook cell does: if its last statement is an expression whose value is not None, its
  repr is printed (echo=True), as Jupyter and Python's REPL show it. ToRL/ReTool-style tools show stdout only;
  code written for them prints, and reads the same here. An exception prints its traceback with the
  sandbox's own frames removed and the code's lines shown (File "<tool>", line 3), exit status 1.

What this does not isolate: the code shares the kernel with the trainer (a kernel exploit escapes), sees the
host's processes in /proc (their command lines, not their environments or memory) and every file its uid may
read (world-readable ones: the system, the project's source), and may use memory_mb of address space in each
of max_procs processes. For untrusted code in production, run it in a container, or the workers under nsjail
or bubblewrap (seccomp, a pid namespace, a read-only root, cgroup limits). Linux only.

The file in reading order: the result (Result), the code's bootstrap, the trainer's side (Sandbox, _Worker),
the worker's side (_serve, _Runner, output caps), the Linux calls.
"""
import contextlib
import ctypes
import json
import math
import os
import queue
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

UID_BASE = 1_800_000_000  # a worker's uid and gid: UID_BASE + its pid (pids stay below 2**22)
TRUNCATED = "[... output truncated]"
GRACE_S = 10.0  # the trainer waits this much past a run's timeout for its worker's answer, then replaces the worker
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # + HOME, TMPDIR: the scratch


@dataclass
class Result:
    """One run of the code: what it printed and how it ended."""
    stdout: str = ""
    stderr: str = ""  # its tracebacks and warnings
    error: str | None = None  # None: it ran to its end (exit status 0); else why not, in one line
    exit_code: int | None = None  # as subprocess's returncode: -9 is killed by SIGKILL
    timed_out: bool = False
    truncated: bool = False  # some of stdout or stderr was dropped (the text says where)
    seconds: float = 0.0  # wall-clock, from the start of the code's process to its end (not the wait for a worker)

    @property
    def ok(self):
        return self.error is None

    def text(self, max_chars=None):
        """The tool's message to the model: stdout, then stderr, then the error in brackets unless stderr ends
        with it already ("[timed out after 10 s]"); "[no output]" if there is nothing. At most max_chars
        characters, the rest cut with the truncation marker."""
        text = self.stdout + self.stderr
        if self.error and not self.stderr.rstrip().endswith(self.error):
            text += ("" if not text or text.endswith("\n") else "\n") + f"[{self.error}]\n"
        text = text or "[no output]\n"
        if max_chars is not None and len(text) > max_chars:
            text = text[:max(0, max_chars - len(TRUNCATED) - 1)] + "\n" + TRUNCATED
        return text


class SandboxError(RuntimeError):
    """The sandbox itself failed (a worker died or stopped answering): not the code's doing. run() raises it,
    so the env call fails and env.py drops the trajectory rather than train on it; the worker is replaced."""


# What the run's fresh interpreter executes (python -c BOOTSTRAP echo): the code from stdin, as a notebook cell.
BOOTSTRAP = r"""
import ast, faulthandler, linecache, sys, traceback
faulthandler.enable()
source, echo = sys.stdin.read(), sys.argv[1] == "1"
sys.argv = ["<tool>"]
linecache.cache["<tool>"] = (len(source), None, source.splitlines(True), "<tool>")
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(source, "<tool>")
    last = tree.body.pop() if echo and tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
    sys.exit(1)
"""


# ----------------------------------------------------------------------------- the trainer's side


class Sandbox:
    """A pool of `workers` sandbox workers. start() once (cheap: before the model loads), run() from any thread,
    close() at the end (or use it as a context manager). Limits: timeout_s (per run, run() may override it),
    memory_mb (address space per process), max_procs (processes and threads of a run), max_output (bytes kept
    of stdout, and of stderr), disk_mb (a file's size; each private tmpfs); echo: print the last expression's
    value; python: the code's interpreter (default: the trainer's)."""

    def __init__(self, workers=4, timeout_s=10.0, memory_mb=1024, max_procs=16, max_output=16384, disk_mb=64,
                 echo=True, python=None, uid_base=UID_BASE):
        if workers < 1:
            raise ValueError(f"Sandbox: workers must be at least 1, got {workers}")
        self.workers, self.timeout_s = workers, float(timeout_s)
        self.config = {"memory_mb": memory_mb, "max_procs": max_procs, "max_output": max_output, "disk_mb": disk_mb,
                       "echo": echo, "python": python or sys.executable, "uid_base": uid_base}
        self.isolation = {}  # what holds (the first worker's report): uid, network, mounts, hidden, warnings
        self._idle, self._all, self._started, self._closed = queue.Queue(), [], False, False

    def start(self):
        """Start the workers, wait until each has isolated itself, warn once about what could not be had, and
        run a first snippet (a Sandbox that cannot run Python fails here, not in the middle of training)."""
        self._all = [_Worker(self.config) for _ in range(self.workers)]
        deadline = time.monotonic() + 60.0
        try:
            for w in self._all:
                w.receive_hello(deadline)
        except (OSError, EOFError, TimeoutError, ValueError) as e:
            self.close()
            raise SandboxError(f"the sandbox's workers did not start: {e}") from e
        for w in self._all:
            self._idle.put(w)
        self._started = True
        self.isolation = {k: v for k, v in self._all[0].hello.items() if k != "pid"}
        for warning in self.isolation["warnings"]:
            print(f"[sandbox] warning: {warning}", file=sys.stderr, flush=True)
        try:
            first = self.run("print(6 * 7)")
        except SandboxError:
            self.close()
            raise
        if first.stdout != "42\n":
            self.close()
            raise SandboxError(f"the sandbox cannot run Python ({self.config['python']}): {first.text(500)!r}")
        return self

    def run(self, code: str, timeout_s=None) -> Result:
        """Run the code in a fresh interpreter on an idle worker (waiting for one while all are busy). Everything
        the code does ends as a Result; SandboxError if the sandbox itself failed."""
        if not isinstance(code, str):
            raise TypeError(f"Sandbox.run: code must be a str, got {type(code).__name__}")
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        worker = self._idle.get()
        try:
            if worker is None or self._closed:
                raise SandboxError("the sandbox is closed")
            try:
                worker.ensure_running()  # a new one, if the last run's failed
                reply = worker.call({"code": code, "timeout_s": timeout_s}, time.monotonic() + timeout_s + GRACE_S)
            except (OSError, EOFError, TimeoutError, ValueError) as e:
                worker.stop(0.0)  # the next run on this slot starts a new worker
                raise SandboxError(f"a sandbox worker failed ({type(e).__name__}: {e}); it is replaced") from e
            return Result(**reply)
        finally:
            self._idle.put(worker)

    def close(self):
        """Wait for the runs in flight, then end every worker (each kills what its runs left, and exits) and the
        processes of their uids. Further run() calls raise SandboxError."""
        if self._closed:
            return
        self._closed = True
        if self._started:  # take every worker back: the runs in flight finish first
            for _ in self._all:
                self._idle.get()
        for w in self._all:
            w.stop(2.0)
        self._idle.put(None)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class _Worker:
    """The trainer's handle on one worker process; stop() leaves it stopped, ensure_running() starts a new one."""

    def __init__(self, config):
        self.config, self.proc, self.hello = config, None, {}
        self.ensure_running(wait=False)

    def ensure_running(self, wait=True):
        if self.proc is not None and self.proc.poll() is None:
            return
        self.buffer, self.hello = b"", {}
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__), json.dumps(self.config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if wait:
            self.receive_hello(time.monotonic() + 60.0)

    def receive_hello(self, deadline):
        self.hello = self._receive(deadline)

    def call(self, request, deadline):
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self._receive(deadline)

    def _receive(self, deadline):
        """The worker's next JSON line (its stdout, read with os.read: the buffered file object is never used)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer from the sandbox worker in time")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError(f"the sandbox worker exited (status {self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self, wait_s):
        """Close its stdin (it ends after cleaning up), kill it after wait_s, and kill what its uid left."""
        if self.proc is None:
            return
        proc, uid, self.proc = self.proc, self.hello.get("uid"), None
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if uid is not None:
            for _ in range(100):  # it may have been killed mid-run: its runs' processes, from /proc
                pids = pids_of({uid})
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.01)


def pids_of(uids):
    """The live (not zombie) processes whose real uid is in uids, from /proc: what a sandbox left behind."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # it ended meanwhile
        if int(fields["Uid"].split()[0]) in uids and not fields["State"].strip().startswith("Z"):
            found.append(int(name))
    return found


# ----------------------------------------------------------------------------- the worker's side


def _serve(config):
    """A worker's life (python sandbox.py CONFIG): isolate itself, say what holds (its hello line), then one run
    per request line until its stdin closes (the Sandbox closed, or the trainer died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's; close() or its death ends this
    runner = _Runner(config)
    _send(runner.hello)
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _send(asdict(runner.run(request["code"], request["timeout_s"])))


def _send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Runner:
    """The worker: its namespaces and uid (made once), and the runs."""

    def __init__(self, config):
        self.config, self.uid, self.tmp, warnings = config, None, tempfile.gettempdir(), []
        self.private, self.kept = False, {}  # /tmp and /dev/shm are ours (a tmpfs in our namespace); entries bound back
        root, real_uid, real_gid = os.geteuid() == 0, os.getuid(), os.getgid()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the runs become this process's children, to be reaped
        try:
            _unshare(CLONE_NEWNS | CLONE_NEWNET | (0 if root else CLONE_NEWUSER))
            if not root:  # inside a user namespace: map our own uid and gid, nothing else
                for name, text in (("setgroups", "deny"), ("uid_map", f"{real_uid} {real_uid} 1"),
                                   ("gid_map", f"{real_gid} {real_gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            namespaces = True
        except OSError as e:
            namespaces = False
            warnings.append(f"no network or mount namespace ({e}): the code can reach the network, and writes to "
                            "the host's /tmp")
        if root:
            uid = config["uid_base"] + os.getpid()
            if _can_become(uid):
                self.uid = uid
                _kill_uid(uid)  # what a dead worker with this pid may have left
            else:
                warnings.append(f"cannot switch to uid {uid} (not in this user namespace?): the code runs as root, "
                                "with no process cap")
        else:
            warnings.append(f"not root: the code runs as the trainer's user (uid {real_uid}) and can signal its "
                            "processes; max_procs is not enforced (RLIMIT_NPROC would count all of that user's)")
        hidden = []
        if namespaces:
            try:
                _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing mounted below reaches the host
                paths = self._interpreter_paths()
                if self.uid is not None:
                    hidden = _expose(paths)
                size = f"size={config['disk_mb']}m"
                for d in ("/tmp", "/dev/shm"):
                    if os.path.isdir(d):  # a private tmpfs, with whatever of the interpreter lives there (a venv
                        self.kept[d] = _names_under(d, paths)  # in /tmp/<checkout>) bound back in: never cleaned
                        _cover(d, self.kept[d], f"mode=1777,{size}")
                self.tmp, self.private = "/tmp", True
            except OSError as e:
                warnings.append(f"private /tmp not set up ({e}): runs use the host's {self.tmp}")
        self.hello = {"pid": os.getpid(), "uid": self.uid, "network": namespaces, "private_tmp": self.private,
                      "hidden": hidden, "warnings": warnings}

    def _interpreter_paths(self):
        """What the code's interpreter reads: itself and, when it is ours, our sys.path (the same -I interpreter)."""
        python = self.config["python"]
        if os.path.realpath(python) != os.path.realpath(sys.executable):
            return [python, os.path.dirname(os.path.dirname(os.path.realpath(python)))]
        return [python, sys.prefix, sys.base_prefix, *(p for p in sys.path if p and os.path.exists(p))]

    def run(self, code, timeout_s):
        """Run the code in a forked child that execs a fresh interpreter; read its output until it exits or the
        timeout; kill whatever is left of the run; say how it ended."""
        cap = self.config["max_output"]
        scratch = tempfile.mkdtemp(prefix="run-", dir=self.tmp)
        if self.uid is not None:
            os.chown(scratch, self.uid, self.uid)
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self._child(in_r, out_w, err_w, scratch, timeout_s)  # never returns
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        try:
            with open(in_w, "wb") as f:  # the child reads it all before it runs anything
                f.write(code.encode("utf-8", "replace"))
        except BrokenPipeError:
            pass  # it failed to start: its stderr says why
        sinks = {out_r: _Capped(cap), err_r: _Capped(cap, tail=True)}
        stdout, stderr = sinks[out_r], sinks[err_r]
        for fd in sinks:
            os.set_blocking(fd, False)
        pidfd, status, timed_out = _pidfd(pid), None, False
        while status is None:
            left = started + timeout_s - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            waits = list(sinks) + ([pidfd] if pidfd is not None else [])
            ready = select.select(waits, [], [], left if pidfd is not None else min(left, 0.02))[0]
            for fd in ready:
                if fd in sinks and _read(fd, sinks[fd]) is False:
                    del sinks[fd]  # EOF: the code closed it (its process may go on)
            if pidfd is None or pidfd in ready:  # (no pidfd: a kernel before 5.3, polled every 20 ms)
                done, st = os.waitpid(pid, os.WNOHANG)
                status = st if done else None
        seconds = time.monotonic() - started
        self._kill(pid)
        if status is None:
            status = os.waitpid(pid, 0)[1]
        for fd, sink in sinks.items():
            while _read(fd, sink):  # what is left in the pipe ("none for now": a writer lives on, without a uid)
                pass
        for fd in (out_r, err_r, *([pidfd] if pidfd is not None else [])):
            os.close(fd)
        self._reap()
        self._clean(scratch)
        exit_code = os.waitstatus_to_exitcode(status)
        err = stderr.text()
        return Result(stdout.text(), err, self._error(exit_code, timed_out, err, timeout_s), exit_code, timed_out,
                      stdout.dropped > 0 or stderr.dropped > 0, round(seconds, 4))

    def _child(self, in_r, out_w, err_w, scratch, timeout_s):
        """In the forked child (a copy of this small worker, still root): the run's session, pipes, directory,
        rlimits and uid, then exec the interpreter. Never returns."""
        try:
            os.setsid()
            for fd, std in ((in_r, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, std)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the worker's own pipes and files (RLIMIT_NOFILE is finite)
            os.chdir(scratch)
            cpu, memory, disk = math.ceil(timeout_s) + 1, self.config["memory_mb"] << 20, self.config["disk_mb"] << 20
            limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                      (resource.RLIMIT_FSIZE, disk, disk), (resource.RLIMIT_NOFILE, 256, 256),
                      (resource.RLIMIT_CORE, 0, 0)]
            if self.uid is not None:  # binds the uid, not root: set here, holds after the switch below
                limits.append((resource.RLIMIT_NPROC, self.config["max_procs"], self.config["max_procs"]))
            for which, soft, hard in limits:
                resource.setrlimit(which, (soft, hard))
            if self.uid is not None:
                os.setgroups([])
                os.setresgid(self.uid, self.uid, self.uid)
                os.setresuid(self.uid, self.uid, self.uid)
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid switch, which clears it
            if os.getppid() != self.hello["pid"]:  # the worker died before the signal was armed
                os._exit(127)
            python = self.config["python"]
            os.execve(python, [python, "-I", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP,
                               "1" if self.config["echo"] else "0"], ENV | {"HOME": scratch, "TMPDIR": scratch})
        except BaseException as e:  # noqa: BLE001 (whatever it is, the model and the trainer see a message)
            os.write(2, f"sandbox: the code could not be started: {type(e).__name__}: {e}\n".encode())
        os._exit(127)

    def _kill(self, pid):
        """SIGKILL the run's process group, then every process of the uid (the ones that left the group)."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass  # the group is gone
        if self.uid is not None:
            _kill_uid(self.uid)

    def _reap(self):
        """Reap every process of the run (orphans come to this subreaper). With a uid all were killed, so wait
        for each; without one, a process that left the session may live on: only the dead are reaped."""
        while True:
            try:
                if os.waitpid(-1, 0 if self.uid is not None else os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return

    def _clean(self, scratch):
        shutil.rmtree(scratch, ignore_errors=True)
        if self.private:  # ours alone (never the host's /tmp): whatever the code left in /tmp or /dev/shm goes too
            for d in ("/tmp", "/dev/shm"):
                for entry in os.scandir(d) if os.path.isdir(d) else ():
                    if entry.name in self.kept.get(d, ()):  # the interpreter's own, bound in from the host
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)

    def _error(self, exit_code, timed_out, stderr, timeout_s):
        """Why the run did not end well, in one line (None if it did)."""
        if timed_out:
            return f"timed out after {timeout_s:g} s"
        if exit_code == 0:
            return None
        if exit_code < 0:
            sig = signal.Signals(-exit_code)
            if sig == signal.SIGXCPU:
                return f"CPU time limit exceeded ({math.ceil(timeout_s) + 1} s)"
            return {signal.SIGKILL: "killed (SIGKILL)", signal.SIGSEGV: "crashed: segmentation fault (SIGSEGV)",
                    signal.SIGABRT: "aborted (SIGABRT)"}.get(sig, f"killed by signal {sig.name}")
        last = stderr.rstrip().rsplit("\n", 1)[-1].strip()
        if exit_code in (1, 127) and last:  # an exception's traceback (or the child's own failure) ends with it
            return f"{last} (the memory limit is {self.config['memory_mb']} MiB)" if last.startswith("MemoryError") \
                else last
        return f"exited with status {exit_code}"


class _Capped:
    """A stream's first (or, tail=True, last) `cap` bytes; the rest is counted and dropped."""

    def __init__(self, cap, tail=False):
        self.data, self.cap, self.tail, self.dropped = bytearray(), cap, tail, 0

    def add(self, chunk):
        if self.tail:
            self.data += chunk
            over = len(self.data) - self.cap
            if over > 0:
                del self.data[:over]
                self.dropped += over
        else:
            room = max(0, self.cap - len(self.data))
            self.data += chunk[:room]
            self.dropped += len(chunk) - min(room, len(chunk))

    def text(self):
        text = self.data.decode("utf-8", "replace")  # (a character cut in two at the edge: U+FFFD)
        if not self.dropped:
            return text
        if self.tail:
            return f"{TRUNCATED}\n{text}"
        return text + ("" if text.endswith("\n") else "\n") + f"{TRUNCATED}\n"


def _read(fd, sink):
    """One read from a non-blocking pipe into sink: True if it gave data, False at EOF, None if none for now."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    sink.add(chunk)
    return bool(chunk)


def _pidfd(pid):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _can_become(uid):
    """Whether a child can switch to uid (and gid) here: it may lie outside this user namespace's map."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _kill_uid(uid):
    """SIGKILL every process of uid: a helper switches to it and calls kill(-1), which signals every process it
    may (those of its uid), itself excepted, in one pass that a fork cannot slip through."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _expose(paths):
    """Make `paths` reachable by an unprivileged uid, in this mount namespace: every directory on the way that
    others may not pass (mode without o+x, such as a 0700 /root) is covered by an empty tmpfs (mode 0711: no
    listing) into which only the entries on the way are bind-mounted back. Returns the covered directories."""
    keep = {}  # covered directory -> the names in it on the way to a path
    for path in paths:
        path = os.path.abspath(path)
        beside = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))  # a link itself
        for real in {os.path.realpath(path), beside}:
            parts = real.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/" + "/".join(parts[:i])
                if not os.stat(d).st_mode & stat.S_IXOTH:
                    keep.setdefault(d, set()).add(parts[i])
    for d in sorted(keep, key=lambda d: d.count("/")):  # outer first: an inner one is reached through its bind
        _cover(d, keep[d], "mode=0711,size=1m")
    return sorted(keep)


def _names_under(d, paths):
    """The entries of directory d that any of `paths` (or the targets of their links) goes through."""
    names = set()
    for path in paths:
        for p in {os.path.abspath(path), os.path.realpath(path)}:
            if p.startswith(d.rstrip("/") + "/"):
                names.add(p[len(d.rstrip("/")) + 1:].split("/")[0])
    return names


def _cover(d, names, options):
    """Mount a fresh tmpfs over directory d, binding back its entries `names` (only those stay reachable)."""
    held = {n: os.open(os.path.join(d, n), os.O_PATH) for n in sorted(names) if os.path.lexists(os.path.join(d, n))}
    _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for name, fd in held.items():
        spot = os.path.join(d, name)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.mkdir(spot)
        else:
            open(spot, "x").close()
        _mount(f"/proc/self/fd/{fd}", spot, None, MS_BIND | MS_REC)
        os.close(fd)


# ----------------------------------------------------------------------------- Linux calls (ctypes: os.unshare is 3.12)

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
_libc = ctypes.CDLL(None, use_errno=True)


def _checked(ret, what):
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags):
    _checked(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    _checked(_libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def _prctl(option, value):
    _checked(_libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(v) for v in (value, 0, 0, 0))), "prctl")


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))

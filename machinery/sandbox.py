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

Threat model: the code is hostile and runs thousands of times a step. Isolation is strict by default: start()
refuses, in one line that names what is missing, a machine where any of the following cannot be had (not root,
no CAP_SYS_ADMIN, a container without namespaces); Sandbox(isolation="weak") (data.env_args: isolation: weak)
accepts it for a demo on a trusted machine, and start() then warns once per missing piece. `Sandbox.isolation`
says what holds. Per worker:
- its own uid and gid, UID_BASE + the worker's pid (the trainer is root): no other process on the machine has it
  (one pid namespace assumed) and no process of it outlives a run. The code cannot signal the trainer, read its
  environment, memory or open files, or write its files.
- its own network namespace, with only its own loopback, left down: no network at all, not even the host's
  127.0.0.1 (abstract unix sockets are per namespace too); and its own IPC namespace (SysV objects and POSIX
  queues are not the host's; the SysV ones are removed after every run). Made once per worker, not per run:
  cheaper, and nothing of a run survives into the next.
- its own mount namespace, in which, in this order: a directory on the way to the interpreter that the uid
  could not pass (a 0700 /root that holds pyenv) is covered by an empty tmpfs into which only the entries on
  that way are bound back; the directories to hide (hide: the checkout this file is in, the trainer's working
  directory, where runs/ lies, and whatever the caller names: the run_dir, with its checkpoints and rollout
  dumps that hold the labels, and the data files' directories) are covered by an empty tmpfs the same way,
  so code that looks for the answer finds nothing to read (the worker has read this file already); every mount
  is made read-only (recursively: files the code writes outside the next item's places fail with EROFS);
  /proc is a fresh one with hidepid=invisible, in which the uid sees only its own processes; and one fresh
  tmpfs of disk_mb bytes and max_files inodes is bound, a directory of it each, over /tmp, /var/tmp, /dev/shm,
  /run (with /run/lock) and /var/crash where they exist: every writable place the code sees, all of them
  capped together in bytes and in files, and emptied after every run. 10,000 files or 2 GB written anywhere
  end in "No space left on device" at the cap and leave the host's disk as it was. (Entries of the interpreter
  in those places, a virtualenv in /tmp, are bound back, read-only.)
- oom_score_adj 1000, inherited by every run: under memory pressure the kernel kills model code, never the
  trainer (written as root with CAP_SYS_RESOURCE, it is also the floor, which the code cannot lower).
Weak isolation (isolation="weak", where one of these is missing): not root, the code runs as the trainer's user
(it can signal the trainer's processes, and there is no process cap); the namespaces are then made inside a user
namespace where the kernel allows one, and what cannot be made is missing: without a mount namespace the code
reads every file the user may (the checkout, the run_dir's labels, the data) and writes to the host's disk,
where it stays; without a network namespace it reaches the network; without a private /proc it sees every
process's command line.
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

Waiting. A run's deadline (timeout_s) starts when a worker takes it; the wait for a free worker is bounded
apart (wait_s) and ends in SandboxError, never in a timeout the model reads as its own. So a caller that
gave up (env.py writes off a call past rollout.env_timeout_s) never takes a worker later, and one that holds
a worker holds it timeout_s + GRACE_S at most.

What this does not isolate: the code shares the kernel with the trainer (a kernel exploit escapes), reads
every world-readable file not hidden (the system, the interpreter's virtualenv), sees /sys, may use memory_mb
of address space in each of max_procs processes (and its tmpfs, disk_mb, is memory too), and POSIX message
queues it makes live on in its worker's IPC namespace (RLIMIT_MSGQUEUE bounds them). For untrusted code in
production, run it in a container, or the workers under nsjail or bubblewrap (seccomp, cgroup limits).
Linux only.

The file in reading order: the result (Result), the code's bootstrap, the trainer's side (Sandbox, _Worker),
the worker's side (_serve, _Runner, output caps), the Linux calls.
"""
import contextlib
import ctypes
import errno
import json
import math
import os
import queue
import re
import resource
import select
import shutil
import signal
import stat
import struct
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
# Where the code may write (with strict isolation): the world-writable places programs expect, each a directory of
# one tmpfs of the worker's, emptied after every run; the rest of the file system is read-only. /var/lock and
# /var/run are links into /run on most systems; a place that does not exist stays absent (its parent is read-only).
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/crash", "/var/lock", "/var/run")
SUBDIRS = {"/run": ("lock",)}  # made again (mode 1777) in a place after each wipe


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
    of stdout, and of stderr), disk_mb (a file's size; the bytes of all the writable places together),
    max_files (their files and directories together), wait_s (the wait for a free worker); hide: paths the
    code must not read, on top of the checkout and the working directory (hidden_dirs); isolation: "strict"
    (refuse a machine that cannot isolate) or "weak" (accept it, with warnings); echo: print the last
    expression's value; python: the code's interpreter (default: the trainer's)."""

    def __init__(self, workers=4, timeout_s=10.0, memory_mb=1024, max_procs=16, max_output=16384, disk_mb=64,
                 echo=True, python=None, uid_base=UID_BASE, max_files=4096, hide=(), wait_s=30.0,
                 isolation="strict"):
        if workers < 1:
            raise ValueError(f"Sandbox: workers must be at least 1, got {workers}")
        if isolation not in ("strict", "weak"):
            raise ValueError(f"Sandbox: isolation must be 'strict' or 'weak', got {isolation!r}")
        self.workers, self.timeout_s, self.wait_s, self.strict = workers, float(timeout_s), float(wait_s), \
            isolation == "strict"
        self.config = {"memory_mb": memory_mb, "max_procs": max_procs, "max_output": max_output, "disk_mb": disk_mb,
                       "max_files": max_files, "echo": echo, "python": python or sys.executable, "uid_base": uid_base,
                       "hide": hidden_dirs(hide)}
        self.isolation = {}  # what holds (the first worker's report): uid, network, mounts, hidden, missing, warnings
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
        if self.strict and self.isolation["missing"]:  # weak isolation must be asked for, never only warned about
            self.close()
            raise SandboxError(f"the sandbox cannot isolate the model's code here: missing "
                               f"{'; '.join(self.isolation['missing'])}. To run it with weaker isolation anyway (a "
                               f"demo on a trusted machine), pass isolation='weak' (data.env_args: isolation: weak)")
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
        """Run the code in a fresh interpreter on an idle worker (waiting up to wait_s for one while all are
        busy). Everything the code does ends as a Result; SandboxError if the sandbox itself failed, or no
        worker was free in time."""
        if not isinstance(code, str):
            raise TypeError(f"Sandbox.run: code must be a str, got {type(code).__name__}")
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        try:  # the wait for a free worker is bounded on its own, and is not the code's time: its deadline starts
            worker = self._idle.get(timeout=self.wait_s)  # below, once a worker has it
        except queue.Empty:  # (a caller that gave up meanwhile never takes a worker later for nothing)
            raise SandboxError(f"no sandbox worker was free within {self.wait_s:g} s (all {self.workers} "
                               "busy)") from None
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


def hidden_dirs(paths=()):
    """The directories to hide from the code (empty tmpfs over each): the checkout this file is in (a directory
    with pyproject.toml or .git: not an installed package's site-packages), the trainer's working directory (the
    default run_dir, runs/, lies in it), and each of `paths` (the run_dir, the data files): a file stands for its
    directory, a path not made yet for its nearest existing parent. Never / itself."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = [checkout] if any(os.path.exists(os.path.join(checkout, n)) for n in ("pyproject.toml", ".git")) else []
    dirs, cwd = set(), os.getcwd()
    for p in [*found, *([cwd] if cwd != "/" else []), *paths]:  # (a trainer started in / hides its checkout only)
        p = os.path.realpath(os.path.expanduser(os.fspath(p)))
        path = p
        while not os.path.isdir(p):
            p = os.path.dirname(p)
        if p == "/":
            raise ValueError(f"Sandbox: cannot hide {path!r}: it is, or lies right in, / (the whole file system)")
        dirs.add(p)
    return sorted(dirs)


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
        self.config, self.uid, self.tmp, warnings, missing = config, None, tempfile.gettempdir(), [], []
        self.places = {}  # the writable directories (ours: one tmpfs) -> the names in each bound back from the host
        self.ipc = False  # the IPC objects of the runs are ours to remove

        def lack(what, so):  # what strict isolation needs and this machine does not give (start() refuses)
            missing.append(what)
            warnings.append(f"{what} missing: {so}")

        root, real_uid, real_gid = os.geteuid() == 0, os.getuid(), os.getgid()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the runs become this process's children, to be reaped
        try:  # under memory pressure the kernel kills model code, never the trainer: every run inherits this
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError as e:
            lack(f"oom_score_adj 1000 ({e})", "the OOM killer may pick the trainer over the code")
        with open("/proc/self/status") as f:  # written with CAP_SYS_RESOURCE, 1000 is also the floor: the code
            caps = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)  # cannot lower it
        oom_locked = bool(caps >> CAP_SYS_RESOURCE & 1)
        if not oom_locked:  # (a container that drops the capability, as Docker's default set does)
            warnings.append("no CAP_SYS_RESOURCE: the code can lower its own oom_score_adj below 1000")
        try:
            _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | (0 if root else CLONE_NEWUSER))
            if not root:  # inside a user namespace: map our own uid and gid, nothing else
                for name, text in (("setgroups", "deny"), ("uid_map", f"{real_uid} {real_uid} 1"),
                                   ("gid_map", f"{real_gid} {real_gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            namespaces = True
        except OSError as e:
            namespaces = False
            lack(f"network and mount namespaces ({e})", "the code can reach the network, and writes to the host's "
                 "disk, where what it writes stays")
        if root:
            uid = config["uid_base"] + os.getpid()
            if _can_become(uid):
                self.uid = uid
                _kill_uid(uid)  # what a dead worker with this pid may have left
            else:
                lack(f"a uid of its own ({uid}: not in this user namespace?)", "the code runs as root, with no "
                     "process cap")
        else:
            lack("root (for a uid of its own per worker)", f"the code runs as the trainer's user (uid {real_uid}) "
                 "and can signal its processes; max_procs is not enforced (RLIMIT_NPROC would count all of that "
                 "user's)")
        exposed, hidden = [], []
        if namespaces:
            try:
                _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing mounted below reaches the host
                paths = self._interpreter_paths()
                if self.uid is not None:
                    exposed = _expose(paths)
                hidden = _hide(config["hide"], paths, lack)
                try:  # every mount, as it is now: nothing the code writes outside the tmpfs below outlives it
                    _readonly_tree("/")
                except OSError as e:
                    lack(f"a read-only root ({e})", "the code can write wherever its uid may, and it stays")
                try:  # a /proc of our own in which the runs' uid sees only its own processes (not the trainer)
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
                except OSError as e:
                    lack(f"a private /proc ({e})", "the code sees the host's processes and their command lines")
                self.places = _writable(paths, config["disk_mb"], config["max_files"])
                self.ipc = os.path.isdir("/proc/sysvipc")  # (a /proc of this IPC namespace: the one just mounted)
                self.tmp = "/tmp"
            except OSError as e:
                lack(f"private mounts ({e})", f"runs use the host's {self.tmp}")
        os.chdir("/")  # the trainer's cwd may be one just hidden: hold nothing of it
        self.hello = {"pid": os.getpid(), "uid": self.uid, "network": namespaces, "private_tmp": bool(self.places),
                      "hidden": exposed, "hidden_paths": hidden, "oom_locked": oom_locked, "missing": missing,
                      "warnings": warnings}

    def _interpreter_paths(self):
        """What the code's interpreter reads: itself and, when it is ours, our sys.path (the same -I interpreter),
        less this file's directory (the worker's sys.path[0]: the checkout's source stays hidden)."""
        python = self.config["python"]
        if os.path.realpath(python) != os.path.realpath(sys.executable):
            return [python, os.path.dirname(os.path.dirname(os.path.realpath(python)))]
        here = os.path.dirname(os.path.abspath(__file__))
        return [python, sys.prefix, sys.base_prefix, *(p for p in sys.path if p and os.path.exists(p) and p != here)]

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
        """Remove the scratch directory and everything the run left in the writable places (all ours, never the
        host's: with no private places only the scratch goes), but the interpreter's entries bound back."""
        _remove(scratch)
        for d, kept in self.places.items():
            for entry in os.scandir(d):
                if entry.name not in kept:
                    _remove(entry.path)
            for name in SUBDIRS.get(d, ()):  # as the host has them (/run/lock): world-writable, sticky
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.join(d, name))
                os.chmod(os.path.join(d, name), 0o1777)
        if self.ipc:  # SysV shared memory, queues, semaphores: the IPC namespace is the worker's, they outlive runs
            _remove_ipc()

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


def _remove(path):
    """Remove a file or a tree, however deep (rm's walk is not recursive: shutil.rmtree's hits Python's limit)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except (OSError, RecursionError):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _remove_ipc():
    """Remove every SysV IPC object of this IPC namespace (the runs' only: the namespace is the worker's)."""
    for kind, remove in (("shm", lambda i: _libc.shmctl(i, IPC_RMID, None)),
                         ("msg", lambda i: _libc.msgctl(i, IPC_RMID, None)),
                         ("sem", lambda i: _libc.semctl(i, 0, IPC_RMID))):
        with contextlib.suppress(OSError), open(f"/proc/sysvipc/{kind}") as f:
            for line in list(f)[1:]:  # (after the header) key, id, ...
                remove(ctypes.c_int(int(line.split()[1])))


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
    held = _hold(d, names)
    _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, options)
    _bind_back(d, held)


def _hold(d, names):
    """O_PATH handles on the entries `names` of d, taken before d is covered (they reach what lies beneath)."""
    return {n: os.open(os.path.join(d, n), os.O_PATH) for n in sorted(names) if os.path.lexists(os.path.join(d, n))}


def _bind_back(d, held):
    for name, fd in held.items():
        spot = os.path.join(d, name)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.mkdir(spot)
        else:
            open(spot, "x").close()
        _mount(f"/proc/self/fd/{fd}", spot, None, MS_BIND | MS_REC)
        os.close(fd)


def _hide(dirs, paths, lack):
    """Cover each directory of dirs (the checkout, the run_dir, the data) with an empty tmpfs, bound back in only
    what of `paths` (the interpreter's) lies in it: code that looks for the labels finds nothing to read. Returns
    the directories covered; one that cannot be is missing isolation (lack)."""
    done = []
    for d in sorted(dirs, key=lambda d: d.count("/")):  # outer first: an inner one under it is hidden with it
        if any(d.startswith(h + "/") for h in done) or not os.path.isdir(d):
            continue  # hidden already (under one covered just now, or under a 0700 directory _expose covered)
        try:
            _cover(d, _names_under(d, paths), "mode=0755,size=1m,nr_inodes=1024")
            done.append(d)
        except OSError as e:
            lack(f"hiding {d} ({e})", "the code can read what is in it")
    return done


def _writable(paths, disk_mb, max_files):
    """Mount one fresh tmpfs (disk_mb bytes, max_files inodes: together they cap what a run can write, in bytes
    and in files) and bind a directory of it (mode 1777) over each place of WRITABLE, with the interpreter's
    entries there (a virtualenv in /tmp) bound back in, read-only as the rest. Returns {place: names bound back}."""
    places = []
    for p in WRITABLE:
        p = os.path.realpath(p)
        if os.path.isdir(p) and not any(p == q or p.startswith(q + "/") for q in places):
            places.append(p)
    held = {p: _hold(p, _names_under(p, paths)) for p in places}  # before anything covers them
    store = places[0]  # a mount point for the tmpfs until its own part covers it (last)
    _mount("tmpfs", store, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={disk_mb}m,nr_inodes={max_files}")
    for i, p in enumerate(places):
        part = os.path.join(store, f".{i}")
        os.mkdir(part)
        os.chmod(part, 0o1777)
        _bind_back(part, held[p])
        for name in SUBDIRS.get(p, ()):
            os.mkdir(os.path.join(part, name))
            os.chmod(os.path.join(part, name), 0o1777)
    for i in reversed(range(len(places))):
        _mount(os.path.join(store, f".{i}"), places[i], None, MS_BIND | MS_REC)
    return {p: set(held[p]) for p in places}


def _readonly_tree(path):
    """Make every mount at and below path read-only, in this mount namespace: mount_setattr(AT_RECURSIVE) where
    the kernel has it (5.12), else a read-only bind remount of each mount in /proc/self/mountinfo."""
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0), 32)
    ret = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                        ctypes.c_uint(AT_RECURSIVE), attr, ctypes.c_size_t(32))
    if ret == 0:
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
        _checked(ret, f"mount_setattr {path}")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:  # (mount point, its options): the flags a remount must keep
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == path or point.startswith(path.rstrip("/") + "/"):
            keep = sum(flag for name, flag in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC))
                       if name in fields[5].split(","))
            with contextlib.suppress(FileNotFoundError, PermissionError):  # (one covered by another: unreachable)
                _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)


# ----------------------------------------------------------------------------- Linux calls (ctypes: os.unshare is 3.12)

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # (442 on every architecture)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
CAP_SYS_RESOURCE, IPC_RMID = 24, 0
_libc = ctypes.CDLL(None, use_errno=True)


def _checked(ret, what):
    if ret != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _unshare(flags):
    _checked(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    _checked(_libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def _prctl(option, value):
    _checked(_libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(v) for v in (value, 0, 0, 0))), "prctl")


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))

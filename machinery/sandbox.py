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
no CAP_SYS_ADMIN, a container without namespaces, no memory cgroup to be made, an architecture other than x86-64
and aarch64); Sandbox(isolation="weak") (data.env_args: isolation: weak) accepts it for a demo on a trusted
machine, and start() then warns once per missing piece. `Sandbox.isolation` says what holds. Per worker:
- its own uid and gid, UID_BASE + the worker's pid (the trainer is root): no other process on the machine has it
  (one pid namespace assumed) and no process of it outlives a run. The code cannot signal the trainer, read its
  environment, memory or open files, or write its files.
- its own network namespace, with only its own loopback, left down: no network at all, not even the host's
  127.0.0.1 (abstract unix sockets are per namespace too); and its own IPC namespace, whose SysV objects and
  POSIX message queues (a mqueue file system at /dev/mqueue) are removed after every run.
- its own mount namespace and a root built from nothing (deny by default): an empty tmpfs into which only what
  the interpreter needs is bound, read-only: /usr and /bin, /sbin, /lib* (as links where they are links), the
  interpreter's prefixes (sys.prefix, sys.base_prefix: the virtualenv and the Python it was made from) and its
  site-packages (not the source trees of editable installs), /etc/ld.so.cache and /etc/alternatives, and a
  passwd and group of three lines. Nothing else of the host is there: not /home, /root, /opt, /srv, /mnt, the
  checkout, the run_dir or the data, nor /sys. The directories to hide (hide: the checkout this file is in, the
  trainer's working directory and whatever the caller names) are covered by an empty tmpfs where they lie inside
  something bound, less the interpreter's own entries. /proc is a fresh one with hidepid=invisible, in which the
  uid sees only its own processes (its /proc/cmdline reads empty); /dev holds null, zero, full, random and
  urandom. One fresh tmpfs of disk_mb bytes and max_files inodes is bound, a directory of it each, over /tmp,
  /var/tmp, /dev/shm and /run (with /run/lock): every writable place the code sees, capped together in bytes and
  in files, emptied after every run (an interpreter there, a virtualenv in /tmp, is bound in read-only and
  kept). Then the worker pivots into it; the host's root is detached.
- a memory cgroup (v1: memory.limit_in_bytes and memory.memsw.limit_in_bytes; v2: memory.max and
  memory.swap.max 0), made beside the trainer's own cgroup or in it, that every run's processes join: a run's
  processes together, with what they write to the tmpfs, hold at most memory_mb; past it the kernel's OOM killer
  kills one of the run's processes, never another's (the code cannot push the machine into the OOM killer at
  all). oom_score_adj 1000 is inherited by every run, a floor only where the worker has CAP_SYS_RESOURCE
  (`isolation["oom_locked"]`; Docker's default set lacks it, and then the code may lower it, to no effect on the
  trainer, whose memory the cgroup keeps apart).
- a session keyring of its own (an anonymous one, not the trainer's).
Weak isolation (isolation="weak", where one of these is missing): not root, the code runs as the trainer's user
(it can signal the trainer's processes, and there is no process cap); the namespaces are then made inside a user
namespace where the kernel allows one, and what cannot be made is missing: without a root of its own the code
reads every file the user may (the checkout, the run_dir's labels, the data) and writes to the host's disk,
where it stays; without a network namespace it reaches the network; without a private /proc it sees every
process's command line; without a cgroup only the address-space rlimit bounds memory, per process.
Per run:
- its own session: on the wall-clock timeout (or when the code's process ends) the process group is killed, then
  every process of the uid (from a helper of that uid, kill(-1): atomic against a fork bomb), so children that
  left the group (setsid, a double fork) die too; the worker is a child subreaper and reaps them all. The helper
  then clears the uid's user and user-session keyrings, which the kernel keeps past the uid's processes.
- a fresh anonymous session keyring: the trainer's keys are not in reach, and keys of a run die with it.
- rlimits: CPU seconds (ceil(timeout) + 1), address space (memory_mb: a big allocation is a MemoryError), file
  size (disk_mb), 256 open files, no core dump; and the process cap (max_procs, threads included): RLIMIT_NPROC
  never binds root and counts every process of the uid on the machine, which is why each worker has a uid of its
  own and the limit is set before the drop to it.
- no_new_privs (setuid binaries gain nothing), a parent-death signal (the code dies with its worker), and a
  seccomp filter (classic BPF, x86-64 and aarch64; any other ABI, x32 and i386 included, is refused or killed):
  EPERM for unshare, setns, clone with a CLONE_NEW* flag (clone3 is ENOSYS, so glibc falls back to clone, whose
  flags can be read), mount and the new mount API, pivot_root, chroot, the key calls, bpf, perf_event_open,
  userfaultfd, ptrace, process_vm_*, io_uring, module and kexec loading, swap, reboot, acct, syslog,
  open_by_handle_at; socket() and socketpair() of a family other than AF_UNIX, AF_INET and AF_INET6 are
  EAFNOSUPPORT (no vsock, netlink or packet sockets).
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

What this does not isolate: the kernel, shared with the trainer (a bug in a system call the filter allows
escapes); what is bound in (the system's /usr and /lib, the virtualenv: world-readable on the host anyway);
the kernel's own files in /proc (/proc/cpuinfo, /proc/sys, /proc/self/mountinfo, which names the bound paths);
CPU time and the page cache, shared with the machine (only RLIMIT_CPU and the wall-clock timeout bound a run);
and the workers together, each of which may hold memory_mb, and its tmpfs (disk_mb). For untrusted code in
production, run the workers in a VM (gVisor, Firecracker) too. Linux only.

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
# Where the code may write (with a root of its own): the places programs expect, each a directory of one tmpfs of
# the worker's, emptied after every run; the rest of the file system is read-only (/var/lock, /var/run: links).
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run")
SUBDIRS = {"/run": ("lock",)}  # made again (mode 1777) in a place after each wipe
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound read-only (or linked) in the root
ETC = ("/etc/ld.so.cache", "/etc/alternatives")  # all of the host's /etc the root gets, where they exist
DEVICES = ("null", "zero", "full", "random", "urandom")  # the host's device nodes bound into the root's /dev


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
    memory_mb (a run's memory, its processes together, and each one's address space), max_procs (processes
    and threads of a run), max_output (bytes kept of stdout, and of stderr), disk_mb (a file's size; the bytes
    of all the writable places together), max_files (their files and directories together), wait_s (the wait
    for a free worker); hide: paths the code must not read, on top of the checkout and the working directory
    (hidden_dirs; the root built for the code holds none of them anyway, unless one lies in what is bound in);
    isolation: "strict" (refuse a machine that cannot isolate) or "weak" (accept it, with warnings); echo: print
    the last expression's value; python: the code's interpreter (default: the trainer's)."""

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
        cgroup = self.hello.get("cgroup")
        for _ in range(100 if cgroup else 0):  # the worker's memory cgroup (it cannot: it sees no /sys)
            try:
                os.rmdir(cgroup)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY while the last of its processes exit
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
    """The directories to hide from the code (never bound into its root; covered by an empty tmpfs where they lie
    in what is bound): the checkout this file is in (a directory with pyproject.toml or .git: not an installed
    package's site-packages), the trainer's working directory (the default run_dir, runs/, lies in it), and each
    of `paths` (the run_dir, the data files): a file stands for its directory, a path not made yet for its nearest
    existing parent. Never / itself."""
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
    """The worker: its namespaces, root, cgroup and uid (made once), and the runs."""

    def __init__(self, config):
        self.config, self.uid, self.tmp, warnings, missing = config, None, tempfile.gettempdir(), [], []
        self.places = {}  # the writable directories (ours: one tmpfs) -> the names in each bound back from the host
        self.ipc = self.mqueue = False  # the IPC objects of the runs (SysV; POSIX queues) are ours to remove
        self.cgroup = None  # (cgroup.procs, its OOM counter file) as open fds: every run's processes join it

        def lack(what, so):  # what strict isolation needs and this machine does not give (start() refuses)
            missing.append(what)
            warnings.append(f"{what} missing: {so}")

        root, real_uid, real_gid = os.geteuid() == 0, os.getuid(), os.getgid()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the runs become this process's children, to be reaped
        calls = SYSCALLS.get(os.uname().machine)
        try:  # not the trainer's session keyring (each run gets one of its own too, in _child)
            _keyctl(KEYCTL_JOIN_SESSION_KEYRING, 0)
            keyring = True
        except OSError as e:
            keyring = False
            lack(f"a session keyring of its own ({e})", "the code shares the trainer's keys")
        try:  # under memory pressure the kernel kills model code, never the trainer: every run inherits this
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError as e:
            lack(f"oom_score_adj 1000 ({e})", "the OOM killer may pick the trainer over the code")
        with open("/proc/self/status") as f:  # written with CAP_SYS_RESOURCE, 1000 is also the floor: the code
            caps = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)  # cannot lower it
        oom_locked = bool(caps >> CAP_SYS_RESOURCE & 1)
        if not oom_locked:  # (a container that drops the capability, as Docker's default set does)
            warnings.append("no CAP_SYS_RESOURCE: oom_score_adj 1000 is no floor, the code can lower its own")
        memory = _memory_cgroup(config["memory_mb"])  # (before the new root: it has no /sys)
        if isinstance(memory, str):
            lack(f"a memory cgroup ({memory})", f"only the address-space rlimit bounds memory, per process: a "
                 f"run's {config['max_procs']} processes may take {config['max_procs']} x memory_mb together")
            memory = None
        else:
            self.cgroup = memory[1:]
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
            lack(f"network and mount namespaces ({e})", "the code can reach the network, and reads and writes "
                 "the host's files")
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
        self.seccomp = _seccomp_program(os.uname().machine)
        if self.seccomp is None or calls is None:
            self.seccomp = None
            lack(f"a seccomp filter for {os.uname().machine}", "the code can make namespaces and any socket")
        probe = self._probe()
        if probe == 2:
            lack("a memory cgroup (a process could not join it)", "only the address-space rlimit bounds memory")
            self.cgroup = memory = None
        elif probe != 0 and self.seccomp is not None:
            self.seccomp = None
            lack("a seccomp filter (the probe could still unshare)", "the code can make namespaces and any socket")
        if namespaces:
            try:
                self.places, proc = _new_root(self._interpreter_paths(), config, self.uid or 0, lack)
                self.ipc, self.mqueue, self.tmp = proc, os.path.isdir("/dev/mqueue"), "/tmp"
            except OSError as e:
                lack(f"a root of its own ({e})", f"the code reads the host's files and runs use the host's "
                     f"{self.tmp}")
        os.chdir("/")  # the trainer's cwd is not in the new root: hold nothing of it
        self.hello = {"pid": os.getpid(), "uid": self.uid, "network": namespaces, "private_root": bool(self.places),
                      "private_tmp": bool(self.places), "cgroup": memory and memory[0], "seccomp": bool(self.seccomp),
                      "keyring": keyring, "oom_locked": oom_locked, "missing": missing, "warnings": warnings}

    def _probe(self):
        """Before any run depends on them: 2 if a child cannot join the cgroup, 1 if after the filter unshare
        still does not fail with EPERM (the filter does not hold on this kernel), else 0."""
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                if self.cgroup:
                    os.write(self.cgroup[0], str(os.getpid()).encode())
                code = 1
                if self.seccomp is not None:
                    _prctl(PR_SET_NO_NEW_PRIVS, 1)
                    _seccomp(self.seccomp)
                    if _libc.unshare(ctypes.c_int(CLONE_NEWUSER)) != 0 and ctypes.get_errno() == errno.EPERM:
                        code = 0
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def _interpreter_paths(self):
        """What the code's interpreter reads, to bind into the new root: itself, its prefixes (the virtualenv and
        the Python it was made from) and the site-packages on our sys.path (the same -I interpreter); not the
        worker's sys.path[0] (this file's directory) nor an editable install's source tree."""
        python = self.config["python"]
        if os.path.realpath(python) != os.path.realpath(sys.executable):  # its prefix, as named and as linked to
            return [python, *(os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(python),
                                                                          os.path.realpath(python)))]
        prefixes = (sys.prefix, sys.base_prefix)
        return [python, *prefixes, *(p for p in sys.path if p and os.path.exists(p) and (
            os.path.basename(p) in ("site-packages", "dist-packages") or any(
                p.startswith(q.rstrip("/") + "/") for q in prefixes)))]

    def run(self, code, timeout_s):
        """Run the code in a forked child that execs a fresh interpreter; read its output until it exits or the
        timeout; kill whatever is left of the run; say how it ended."""
        cap = self.config["max_output"]
        scratch = tempfile.mkdtemp(prefix="run-", dir=self.tmp)
        if self.uid is not None:
            os.chown(scratch, self.uid, self.uid)
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
        ooms = _oom_kills(self.cgroup)
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
        oom = _oom_kills(self.cgroup) > ooms  # the cgroup's OOM killer killed one of the run's processes
        return Result(stdout.text(), err, self._error(exit_code, timed_out, err, timeout_s, oom), exit_code,
                      timed_out, stdout.dropped > 0 or stderr.dropped > 0, round(seconds, 4))

    def _child(self, in_r, out_w, err_w, scratch, timeout_s):
        """In the forked child (a copy of this small worker, still root): the run's session, pipes, directory,
        rlimits and uid, then exec the interpreter. Never returns."""
        try:
            os.setsid()
            if self.cgroup:  # all of the run's processes in the worker's memory cgroup: memory_mb together
                os.write(self.cgroup[0], str(os.getpid()).encode())
            if self.hello["keyring"]:  # a fresh anonymous one: no key of the trainer's or of another run's
                _keyctl(KEYCTL_JOIN_SESSION_KEYRING, 0)
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
            if self.seccomp is not None:  # last: the calls above are among those it denies
                _seccomp(self.seccomp)
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
        if self.mqueue:  # POSIX message queues, likewise: the files of this IPC namespace's mqueue file system
            for name in os.listdir("/dev/mqueue"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/mqueue", name))

    def _error(self, exit_code, timed_out, stderr, timeout_s, oom=False):
        """Why the run did not end well, in one line (None if it did)."""
        if timed_out:
            return f"timed out after {timeout_s:g} s"
        if exit_code == 0:
            return None
        if exit_code == -signal.SIGKILL and oom:
            return f"killed: out of memory (the run's processes together may use {self.config['memory_mb']} MiB)"
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
    may (those of its uid), itself excepted, in one pass that a fork cannot slip through. Then it empties the
    uid's user and user-session keyrings, which the kernel keeps past the uid's processes (the next run's)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
            for which in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
                with contextlib.suppress(OSError):  # (ENOKEY: never made, nothing to clear)
                    _keyctl(KEYCTL_CLEAR, _keyctl(KEYCTL_GET_KEYRING_ID, which, 0))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _memory_cgroup(memory_mb):
    """A memory cgroup for this worker's runs, limited to memory_mb with no swap, in the trainer's own cgroup, or
    beside it (cgroup v2 gives a cgroup with processes in it no children with controllers, unless its parent has
    them on already). Returns (its path, an fd of its cgroup.procs, an fd of its OOM counter), or why not."""
    mounts, own = {}, {}
    with open("/proc/self/mountinfo") as f:
        for fields in (line.split() for line in f):
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
            if fstype == "cgroup2" or fstype == "cgroup" and "memory" in options:
                mounts.setdefault(fstype, (fields[3], fields[4]))  # (its root in the hierarchy, its mount point)
    with open("/proc/self/cgroup") as f:
        for hierarchy, controllers, path in (line.rstrip("\n").split(":", 2) for line in f):
            if "memory" in controllers.split(","):
                own["cgroup"] = path
            elif hierarchy == "0" and not controllers:
                own["cgroup2"] = path
    why, size = "no memory cgroup hierarchy is mounted", memory_mb << 20
    for kind in ("cgroup", "cgroup2"):  # v1's memory controller, where it is mounted, holds memory alone
        if kind not in mounts or kind not in own:
            continue
        root, point = mounts[kind]
        rel = os.path.relpath(own[kind], root)
        if rel.startswith(".."):
            continue
        base = os.path.normpath(os.path.join(point, rel))
        for parent in ((base, os.path.dirname(base)) if base != point else (base,)):
            d = os.path.join(parent, f"sandbox-{os.getpid()}")
            try:
                if kind == "cgroup2":
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        enabled = "memory" in f.read().split()
                    if not enabled and parent != base:
                        continue  # the trainer's parent's controllers are not ours to change
                    if not enabled:
                        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                            f.write("+memory")
                os.makedirs(d, exist_ok=True)
                limits = (("memory.limit_in_bytes", size), ("memory.memsw.limit_in_bytes", size)) if kind == "cgroup" \
                    else (("memory.max", size), ("memory.swap.max", 0))
                for i, (name, value) in enumerate(limits):
                    if i == 0 or os.path.exists(os.path.join(d, name)):  # (no swap accounting: no swap file)
                        with open(os.path.join(d, name), "w") as f:
                            f.write(str(value))
                counter = os.path.join(d, "memory.oom_control" if kind == "cgroup" else "memory.events")
                return d, os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY), os.open(counter, os.O_RDONLY)
            except OSError as e:
                why = f"{d}: {e.strerror}"
                with contextlib.suppress(OSError):
                    os.rmdir(d)
    return why


def _oom_kills(cgroup):
    """How many of the cgroup's processes its OOM killer has killed (the "oom_kill" line of its counter file)."""
    if not cgroup:
        return 0
    for line in os.pread(cgroup[1], 1 << 14, 0).decode().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def _new_root(paths, config, uid, lack):
    """Build the run's file system from nothing, in this mount namespace, and pivot into it: an empty tmpfs with
    the system's directories (SYSTEM), the interpreter's `paths` and ETC bound in read-only, a passwd and a group,
    the hidden directories that lie in those covered, a fresh /proc, /dev's DEVICES, the writable places (one
    tmpfs of disk_mb bytes and max_files inodes) and a mqueue file system. Returns ({writable place: the names in
    it bound from the host, kept by the cleaning}, whether /proc is a fresh one)."""
    if os.uname().machine not in SYSCALLS:
        raise OSError(errno.ENOSYS, f"pivot_root: no system call number for {os.uname().machine}")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing mounted below reaches the host
    binds, links = [], {"/var/lock": "../run/lock", "/var/run": "../run", "/dev/fd": "/proc/self/fd",
                        **{f"/dev/{n}": f"/proc/self/fd/{i}" for i, n in enumerate(("stdin", "stdout", "stderr"))}}
    for d in SYSTEM:
        if os.path.islink(d):
            links[d] = os.readlink(d)  # /lib -> usr/lib on a merged /usr
        elif os.path.isdir(d):
            binds.append(d)
    binds += [os.path.realpath(p) for p in (*paths, *ETC) if os.path.exists(p)]
    binds = [b for b in sorted(set(binds)) if not any(b.startswith(c.rstrip("/") + "/") for c in binds)]
    held = {b: os.open(b, os.O_PATH) for b in binds}  # reach the host's files after the root is covered
    devices = {n: os.open(f"/dev/{n}", os.O_PATH) for n in DEVICES if os.path.exists(f"/dev/{n}")}
    new = "/tmp" if os.path.isdir("/tmp") else "/mnt"  # (any directory: the binds' sources are held above)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    try:
        for d in ("/proc", "/etc", "/dev/mqueue", *WRITABLE):
            os.makedirs(new + d, exist_ok=True)
        for link, target in links.items():
            os.makedirs(os.path.dirname(new + link), exist_ok=True)
            os.symlink(target, new + link)
        for name, lines in (("passwd", ("root:x:0:0", f"sandbox:x:{uid}:{uid}", "nobody:x:65534:65534")),
                            ("group", ("root:x:0:", f"sandbox:x:{uid}:", "nogroup:x:65534:"))):
            with open(f"{new}/etc/{name}", "w") as f:
                f.write("".join(line + ("::/tmp:/usr/sbin/nologin\n" if name == "passwd" else "\n") for line in lines))
        for n in devices:
            open(f"{new}/dev/{n}", "x").close()
        places = {p: set() for p in WRITABLE}  # the interpreter's entries in them (a virtualenv in /tmp): later
        later = [b for b in binds if any(b.startswith(p + "/") for p in WRITABLE)]
        for b in binds:
            if b not in later:
                _bind(held[b], new + b)
        for h in config["hide"]:  # a directory to hide inside something bound: covered, less the interpreter's
            if any(h == b or h.startswith(b.rstrip("/") + "/") for b in binds) and os.path.isdir(new + h):
                _cover(new + h, _names_under(h, binds), "mode=0755,size=1m,nr_inodes=1024")
        _readonly_tree(new)  # every mount of it, as it is now
        proc = True
        try:  # a /proc of our own in which the runs' uid sees only its own processes (not the trainer)
            _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
            if "null" in devices:  # the kernel's command line (boot secrets, the host's layout) reads empty
                _mount(f"/proc/self/fd/{devices['null']}", new + "/proc/cmdline", None, MS_BIND)
        except OSError as e:
            proc = False
            lack(f"a private /proc ({e})", "the code has no /proc")
        for n, fd in devices.items():  # (after the read-only pass: the nodes stay writable)
            _mount(f"/proc/self/fd/{fd}", f"{new}/dev/{n}", None, MS_BIND)
        store = new + WRITABLE[0]  # a mount point for the tmpfs until its own part covers it (last)
        _mount("tmpfs", store, "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=0700,size={config['disk_mb']}m,nr_inodes={config['max_files']}")
        for i, p in enumerate(WRITABLE):
            for d in (f".{i}", *(f".{i}/{name}" for name in SUBDIRS.get(p, ()))):
                os.mkdir(os.path.join(store, d))
                os.chmod(os.path.join(store, d), 0o1777)
        for i in reversed(range(len(WRITABLE))):
            _mount(os.path.join(store, f".{i}"), new + WRITABLE[i], None, MS_BIND)
        for b in later:  # made in the place's tmpfs as root: the run cannot remove them, the cleaning keeps them
            place = next(p for p in WRITABLE if b.startswith(p + "/"))
            places[place].add(b[len(place) + 1:].split("/")[0])
            _bind(held[b], new + b)
            _readonly_tree(new + b)
        try:  # this IPC namespace's POSIX message queues, as files: the cleaning removes them
            _mount("mqueue", new + "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            lack(f"a mqueue file system ({e})", "POSIX message queues of a run outlive it")
        os.chdir(new)  # pivot_root(".", "."): the host's root lies on top of the new one, and is detached
        _checked(_libc.syscall(ctypes.c_long(SYSCALLS[os.uname().machine][1]["pivot_root"]), b".", b"."),
                 "pivot_root")
        _checked(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount2")
        os.chdir("/")
    except BaseException:
        os.chdir("/")
        _libc.umount2(new.encode(), ctypes.c_int(MNT_DETACH))  # back to the host's files, for weak isolation
        raise
    finally:
        for fd in (*held.values(), *devices.values()):
            os.close(fd)
    return places, proc


def _bind(fd, target):
    """Bind what the O_PATH fd is (a directory or a file) at target, made first with its parents."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "x").close()
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


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
        _bind(fd, os.path.join(d, name))
        os.close(fd)


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
CLONE_NEW_ANY = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: clone's flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # (442 on every architecture)
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
CAP_SYS_RESOURCE, IPC_RMID = 24, 0
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 0, 1, 7
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
# The seccomp filter: what it denies with EPERM, and the numbers of those and of the calls it looks into, per
# machine (x86-64's from arch/x86/entry/syscalls/syscall_64.tbl, aarch64's from asm-generic/unistd.h).
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "bpf",
          "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff",
          "reboot", "acct", "syslog", "name_to_handle_at", "open_by_handle_at")
SYSCALLS = {machine: (arch, dict(zip((*DENIED, "clone", "clone3", "socket", "socketpair"), numbers, strict=True)))
            for machine, arch, numbers in (
    ("x86_64", 0xC000003E, (272, 308, 165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442, 250, 248, 249, 321, 298,
                            323, 101, 310, 311, 425, 246, 320, 175, 313, 176, 167, 168, 169, 163, 103, 303, 304,
                            56, 435, 41, 53)),
    ("aarch64", 0xC00000B7, (97, 268, 40, 39, 41, 51, 428, 429, 430, 431, 432, 433, 442, 219, 217, 218, 280, 241,
                             282, 117, 270, 271, 425, 104, 294, 105, 273, 106, 224, 225, 142, 89, 116, 264, 265,
                             220, 435, 198, 199)))}  # (AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64)
X32_BIT, AF_UNIX, AF_INET, AF_INET6 = 0x40000000, 1, 2, 10
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
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


def _prctl(option, *values):
    values = (*values, 0, 0, 0, 0)[:4]
    _checked(_libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(v) for v in values)), "prctl")


def _keyctl(*args):
    """keyctl(2) (glibc has no wrapper): its result, or OSError."""
    if os.uname().machine not in SYSCALLS:
        raise OSError(errno.ENOSYS, f"keyctl: no system call number for {os.uname().machine}")
    ret = _libc.syscall(ctypes.c_long(SYSCALLS[os.uname().machine][1]["keyctl"]), *(ctypes.c_long(a) for a in args))
    if ret < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"keyctl: {os.strerror(code)}")
    return ret


def _seccomp_program(machine):
    """The filter, as the bytes of its struct sock_filter array: classic BPF over struct seccomp_data (nr at
    offset 0, arch at 4, args from 16, 8 bytes each, the low half first on these little-endian machines); jumps
    go forward only. None for a machine not in SYSCALLS."""
    if machine not in SYSCALLS:
        return None
    arch, nr = SYSCALLS[machine]
    prog, labels = [], {}

    def op(code, k, jt=None, jf=None):  # jt/jf: a label below, or None (the next instruction)
        prog.append((code, jt, jf, k))

    op(BPF_LD_W_ABS, 4)
    op(BPF_JEQ_K, arch, None, "kill")  # another ABI (i386 on x86-64, arm32 on aarch64): killed
    op(BPF_LD_W_ABS, 0)
    if machine == "x86_64":
        op(BPF_JSET_K, X32_BIT, "eperm")  # the x32 ABI's numbers (nr | 0x40000000)
    for name in DENIED:
        op(BPF_JEQ_K, nr[name], "eperm")
    op(BPF_JEQ_K, nr["clone3"], "enosys")  # its flags lie in memory the filter cannot read: glibc then uses clone
    op(BPF_JEQ_K, nr["clone"], "clone")
    op(BPF_JEQ_K, nr["socket"], "socket")
    op(BPF_JEQ_K, nr["socketpair"], "socket")
    op(BPF_RET_K, RET_ALLOW)
    labels["clone"] = len(prog)  # clone(flags, ...): no new namespace
    op(BPF_LD_W_ABS, 16)
    op(BPF_JSET_K, CLONE_NEW_ANY, "eperm")
    op(BPF_RET_K, RET_ALLOW)
    labels["socket"] = len(prog)  # socket(family, ...): unix and IP only (IP reaches the namespace's loopback)
    op(BPF_LD_W_ABS, 16)
    for family in (AF_UNIX, AF_INET, AF_INET6):
        op(BPF_JEQ_K, family, "allow")
    op(BPF_RET_K, RET_ERRNO | errno.EAFNOSUPPORT)
    for label, ret in (("eperm", RET_ERRNO | errno.EPERM), ("enosys", RET_ERRNO | errno.ENOSYS),
                       ("allow", RET_ALLOW), ("kill", RET_KILL_PROCESS)):
        labels[label] = len(prog)
        op(BPF_RET_K, ret)
    return b"".join(struct.pack("=HBBI", code, 0 if jt is None else labels[jt] - i - 1,
                                0 if jf is None else labels[jf] - i - 1, k) for i, (code, jt, jf, k) in enumerate(prog))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _seccomp(program):
    """Install the filter on this process (after no_new_privs): it holds for it and all it starts, past exec."""
    fprog = _SockFprog(len(program) // 8, program)
    _checked(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(2), ctypes.byref(fprog), ctypes.c_ulong(0),
                         ctypes.c_ulong(0)), "seccomp")  # (2: SECCOMP_MODE_FILTER)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))

"""
Tool-integrated reasoning on math (TIR, as in ToRL, ReTool, SimpleTIR): the model may call a Python tool over
several turns before it answers in \\boxed{}. Used with data.env: machinery.tools:PythonMath (data.env_args: the sandbox's
limits, PythonMath.setup). One turn of an episode:

    [model: <think>...</think> python\\n{"code": "print(2**10)"} <|observation|>]  [env: <|observation|>\\n1024\\n]

The tool format is GLM-4-0414's own function call, not ToRL's inline ```python block ended by a stop string.
The model ends a tool-calling turn with the special token <|observation|>, a stop id of the chat format
already, so a turn ends exactly at a token boundary and the trainer keeps the sampled tokens as they are
(env.py never re-tokenizes); a text stop string such as ToRL's "```output" can end inside a token, and the
turn's tokens would then have to be cut or re-tokenized. The tool's output comes back as a message of role
"observation", rendered by the model's own chat template: GLM-Z1-9B-0414 was post-trained on function calls
in this form (<|assistant|>{name}\\n{json arguments}, then <|observation|>\\n{content}). ToRL's inline form was
made for base models, which have no tool format of their own.

Parsing is lenient (parse_call): the JSON object alone counts as a call, and a fenced ```python block is
the fallback, since chat models often write code that way; only the text after the last </think> counts
(GLM-Z1 thinks first, and code it sketched while thinking is not a call). A turn with a \\boxed{} answer
ends the episode even if it also calls the tool: the model said it was done. A turn with neither is void
(env.py ends it, masked out of the loss: SimpleTIR).

The code runs in sandbox.py's pool, never in the trainer: one pool per process, shared by every episode
(an env is made per trajectory, too often to start processes for each). Whatever the code does (a
traceback, a timeout, a MemoryError, a crash) is the text the model reads next; only a broken sandbox
(SandboxError) fails the call, and env.py drops that trajectory.
"""
import atexit
import json
import os
import re
import threading

from data import math_reward
from machinery.sandbox import Sandbox

TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Runs Python 3 code in a fresh interpreter (numpy and sympy can be imported when installed) "
                   "and returns what it prints; the value of a last bare expression is printed too.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code to run"}},
                   "required": ["code"]}}}

MAX_OUTPUT_CHARS = 4096  # the default cap on one tool message (setup's max_output_chars)
MAX_TRIES = 64  # JSON objects tried per turn: a turn full of braces costs no more than this
_DECODER = json.JSONDecoder(strict=False)  # strict=False: a raw newline inside the code string is kept as one
_OBJECT = re.compile(r'\{\s*"')  # where a JSON object with a key may start ("{5}" in LaTeX is skipped at once)
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S)


def parse_call(text):
    """The code of the tool call in a model turn's decoded text, or None if it makes no call. Never raises."""
    call = _find_call(text)
    return None if call is None else call[0]


def _find_call(text):
    """(code, start, end) of the call in text: the first JSON object after the last </think> that holds a
    "code" string ({"code": ...}, {"name": "python", "arguments": {...}}, after a line "python" or alone),
    outside fenced blocks; else the last fenced ```python block; else None."""
    if not isinstance(text, str):
        return None
    at = text.rfind("</think>")
    at = 0 if at < 0 else at + len("</think>")
    fences = list(_FENCE.finditer(text, at))
    done, tries = at, 0  # done: the end of the last object decoded (its inner objects are not calls of their own)
    for m in _OBJECT.finditer(text, at):
        if m.start() < done or any(f.start() <= m.start() < f.end() for f in fences):
            continue  # a dict in the code of a fenced block is not a call
        tries += 1
        if tries > MAX_TRIES:
            break
        try:
            obj, end = _DECODER.raw_decode(text, m.start())
        except (ValueError, RecursionError):
            continue  # malformed (or cut off): maybe a later object, or a fenced block, is the call
        code, done = _code_of(obj), end
        if code is not None:
            return code, m.start(), end
    if fences:
        return fences[-1].group(1), fences[-1].start(), fences[-1].end()
    return None


def _code_of(obj):
    """The "code" string of a call's JSON: its arguments alone, or the whole call with name and arguments."""
    if isinstance(obj, dict) and ("name" in obj or "arguments" in obj):
        if obj.get("name", "python") != "python":
            return None  # a call of some other tool
        obj = obj.get("arguments", obj)  # {"name": "python", "code": ...} too
        if isinstance(obj, str):  # OpenAI's form: the arguments as a JSON string
            try:
                obj = json.loads(obj, strict=False)
            except (ValueError, RecursionError):
                return None
    code = obj.get("code") if isinstance(obj, dict) else None
    return code if isinstance(code, str) else None


class PythonMath:
    """A math problem with a Python tool. A turn that calls the tool (parse_call) gets its output back as an
    observation; a turn with a \\boxed{} answer after its thinking ends the episode, graded against
    example["label"] by data.math_reward; a turn with neither is void.

    The sandbox is shared by the process, through two hooks called once per process around the run:
    setup(**data.env_args) by env.load_env at start-up, before the model loads (an unknown key is a TypeError),
    teardown() at exit
    (idempotent). Without setup (a test, a script), the first call starts a default sandbox, closed at exit."""
    tools = [TOOL]
    # Appended to the last user message; "" leaves the prompt as it is.
    INSTRUCTION = "\n\nYou may call the python tool to run code. Put the final answer in \\boxed{}."

    def __init__(self, example):
        self.example = example

    def reset(self):
        prompt = self.example["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if not self.INSTRUCTION:
            return messages
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            return messages + [{"role": "user", "content": self.INSTRUCTION.strip()}]
        messages[users[-1]]["content"] += self.INSTRUCTION  # a copy: the example is left as it was
        return messages

    def step(self, text):
        call = _find_call(text)
        # The answer is looked for outside the call: code that prints "\boxed{...}" is not an answer yet.
        rest = text if call is None else text[:call[1]] + text[call[2]:]
        answer = rest.rsplit("</think>", 1)[-1]
        if "\\boxed" in answer or "\\fbox" in answer or _answer_line and ANSWER_LINE.search(answer):
            return [], math_reward(rest, self.example, answer_line=_answer_line), True
        if call is None:
            return [], 0.0, True, {"void": True}
        box, max_chars = _sandbox()
        out = box.run(call[0]).text(max_chars)
        return [{"role": "observation", "content": out}], 0.0, False, {"tool_calls": 1, "tool_io": [[call[0], out]]}

    @classmethod
    def setup(cls, *, workers=8, timeout_s=10.0, memory_mb=2048, max_procs=32, max_output_chars=MAX_OUTPUT_CHARS,
              answer_line=False, hide=(), isolation="strict", wait_s=30.0):
        """Start this process's sandbox (closing one started before): `workers` runs at once, each with
        timeout_s, memory_mb for a run's processes together (each one's address space too), max_procs processes,
        and max_output_chars of output kept (per stream by the sandbox, then of the whole message). answer_line: a final "Answer: ..."
        line is an answer too (DAPO's prompts ask for one; data.math_reward's answer_line grades it).
        hide: more paths the code must not read (a run_dir or data files outside the working directory), on top
        of the checkout, the working directory (runs/ lies in it) and the Hugging Face cache (the datasets).
        isolation="weak" accepts a machine without root or namespaces (a demo); by default such a machine is
        refused. wait_s bounds the wait for a free worker (a SandboxError, not the code's timeout): with the
        defaults, wait_s + timeout_s + the sandbox's grace stays below rollout.env_timeout_s (60 s)."""
        global _shared, _exit_hook, _answer_line
        _answer_line = bool(answer_line)
        box = Sandbox(workers, timeout_s, memory_mb, max_procs, max_output_chars, hide=[*hide, *_data_dirs()],
                      isolation=isolation, wait_s=wait_s).start()
        with _lock:
            old, _shared = _shared, (box, max_output_chars)
            if not _exit_hook:  # the workers would end with the trainer anyway; this ends them in order
                atexit.register(PythonMath.teardown)
                _exit_hook = True
        if old is not None:
            old[0].close()

    @classmethod
    def teardown(cls):
        """Close this process's sandbox, if one was started (its workers and what they started end)."""
        global _shared
        with _lock:
            shared, _shared = _shared, None
        if shared is not None:
            shared[0].close()


_lock = threading.RLock()  # reentrant: the lazy start below holds it while setup() takes it again
_shared = None  # (Sandbox, max_output_chars) of this process, once started
_exit_hook = False
_answer_line = False  # setup(answer_line=True)
ANSWER_LINE = re.compile(r"^\s*Answer\s*:", re.M)  # DAPO's last line, as data.math_reward reads it


def _data_dirs():
    """The Hugging Face cache's directories that exist (where hub.py's datasets, and their labels, are kept)."""
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    dirs = {os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")), os.environ.get("HF_DATASETS_CACHE",
                                                                                      os.path.join(home, "datasets"))}
    return sorted(d for d in dirs if os.path.isdir(d))


def _sandbox():
    """The shared (Sandbox, max_output_chars); if setup() never ran, it runs now with its defaults, once."""
    shared = _shared
    if shared is None:
        with _lock:
            if _shared is None:  # another thread may have started it while this one waited
                PythonMath.setup()
            shared = _shared
    return shared

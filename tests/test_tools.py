"""tools.py: parse_call on GLM's function-call form, the JSON alone, a fenced block, only after </think>, and odd
text (never raises); PythonMath on a real sandbox (a call, a timeout and the env still usable, graded answers, a
void turn, reset's instruction, setup's keys) and one scripted exchange rendered by the tiny tool tokenizer.
The sandbox's own isolation is tests/test_sandbox.py's."""
import json
import os
import sys
import threading

import pytest

from machinery import env
from machinery import tools
from data import make_tiny_tokenizer
from machinery.sandbox import SandboxError
from machinery.tools import PythonMath, parse_call


def test_parse_call_glm_form_and_json_alone():
    code = "import math\nprint(math.factorial(5))"
    assert parse_call("python\n" + json.dumps({"code": code})) == code
    assert parse_call("Let me compute it.python\n" + json.dumps({"code": code})) == code  # <|assistant|> skipped
    assert parse_call(json.dumps({"name": "python", "arguments": {"code": code}})) == code
    assert parse_call(json.dumps({"name": "python", "arguments": json.dumps({"code": code})})) == code
    assert parse_call('python\n{"code": "x = 1\nx + 1"}') == "x = 1\nx + 1"  # a raw newline inside the string
    assert parse_call(json.dumps({"name": "search", "arguments": {"code": "x"}})) is None  # another tool
    assert parse_call("so \\frac{1}{2} and {\"a\": 1} then python\n" + json.dumps({"code": "1"})) == "1"


def test_parse_call_fenced_block_and_thinking():
    assert parse_call("First:\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```") == "print(2)\n"
    assert parse_call('```python\nd = {"code": "not this"}\nprint(d)\n```') == 'd = {"code": "not this"}\nprint(d)\n'
    thinking = 'maybe python\n{"code": "print(0)"}</think>'
    assert parse_call(thinking + 'python\n{"code": "print(1)"}') == "print(1)"
    assert parse_call(thinking + "The answer is 4.") is None  # code sketched while thinking is no call
    assert parse_call("```python\nprint(3)\n```</think>no call here") is None


def test_parse_call_no_call_and_odd_text_never_raises():
    assert parse_call("The answer is \\boxed{5}.") is None
    assert parse_call("python\n{\"code\": ") is None  # malformed, nothing to fall back to
    assert parse_call('python\n{"code": "print(1)"\n```python\nprint(2)\n```') == "print(2)\n"  # falls back
    odd = [None, 3, b"bytes", "", "{", "}", '{"', '{"code": 1}', '{"code": null}', "```python", "```python\n",
           "</think>", "</think></think>{", '{"a":' + "[" * 100_000, '{"code": "\\ud800"}', "\x00{\"\x00",
           '{"name": "python", "arguments": "{bad"}', '{"name": "python", "arguments": 5}', "{" * 10_000 + '"',
           '{"x": 1}' * 1000]
    for text in odd:
        code = parse_call(text)
        assert code is None or isinstance(code, str), text


@pytest.fixture(scope="module")
def sandbox():
    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox is Linux-only")
    try:
        PythonMath.setup(workers=2, timeout_s=2)
        refused = None
    except SandboxError as e:  # a machine without root or namespaces: the env's tests still run, weakly isolated
        refused = str(e)
        PythonMath.setup(workers=2, timeout_s=2, isolation="weak")
    yield refused
    PythonMath.teardown()
    PythonMath.teardown()  # idempotent
    assert tools._shared is None


EXAMPLE = {"prompt": "What is 2**10?", "label": "1024"}


def call(code):
    return "</think>python\n" + json.dumps({"code": code})


def test_a_call_returns_an_observation(sandbox):
    msgs, reward, done, info = PythonMath(EXAMPLE).step(call("print(2**10)"))
    assert msgs == [{"role": "observation", "content": "1024\n"}] and reward == 0.0 and not done
    assert info == {"tool_calls": 1, "tool_io": [["print(2**10)", "1024\n"]]}
    msgs, _, done, _ = PythonMath(EXAMPLE).step("```python\n1/0\n```")
    assert "ZeroDivisionError" in msgs[0]["content"] and not done  # a traceback is just text to read


def test_a_timeout_is_text_and_the_env_goes_on(sandbox):
    episode = PythonMath(EXAMPLE)
    msgs, _, done, info = episode.step(call("while True:\n    pass"))
    assert "timed out" in msgs[0]["content"] and not done and info["tool_calls"] == 1
    assert episode.step(call("sum(range(5))"))[0] == [{"role": "observation", "content": "10\n"}]


def test_answers_and_void_turns(sandbox):
    assert PythonMath(EXAMPLE).step("<think>2**10</think>It is \\boxed{1024}.") == ([], 1.0, True)
    assert PythonMath(EXAMPLE).step("It is \\boxed{1000}.") == ([], 0.0, True)
    assert PythonMath(EXAMPLE).step(call("2**10") + " and so \\boxed{1024}") == ([], 1.0, True)  # the answer ends it
    msgs, _, done, _ = PythonMath(EXAMPLE).step(call("print('\\\\boxed{1024}')"))  # a box in the code: a call
    assert msgs[0]["content"] == "\\boxed{1024}\n" and not done
    assert PythonMath(EXAMPLE).step("<think>\\boxed{1024}?</think>Hmm.") == ([], 0.0, True, {"void": True})


def test_reset_appends_the_instruction_without_touching_the_example():
    assert PythonMath(EXAMPLE).reset() == [{"role": "user", "content": "What is 2**10?" + PythonMath.INSTRUCTION}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2**10?"}]
    example = {"prompt": messages, "label": "1024"}
    before = json.dumps(example)
    opening = PythonMath(example).reset()
    assert opening[:3] == messages[:3] and opening[3]["content"] == "2**10?" + PythonMath.INSTRUCTION
    assert json.dumps(example) == before


def test_setup_rejects_an_unknown_key():
    with pytest.raises(TypeError):
        PythonMath.setup(workers=1, timeout=5)
    with pytest.raises(ValueError, match="isolation"):
        PythonMath.setup(workers=1, isolation="none")


def test_the_code_cannot_read_the_checkout_or_the_working_directory(sandbox):
    """setup hides the checkout and the trainer's working directory (runs/, the default run_dir, lies there)."""
    if sandbox:
        pytest.skip(f"no strict isolation on this machine: {sandbox}")
    here = os.path.abspath(__file__)
    msgs, _, _, _ = PythonMath(EXAMPLE).step(call(f"print(open({here!r}).read(30))"))
    assert msgs[0]["content"].rstrip().endswith(f"FileNotFoundError: [Errno 2] No such file or directory: {here!r}")
    msgs, _, _, _ = PythonMath(EXAMPLE).step(call(f"import os\nprint(os.listdir({os.getcwd()!r}))"))
    assert set(eval(msgs[0]["content"])) <= {".venv", "venv"}, msgs  # the interpreter's virtualenv at most


def test_an_exchange_renders_through_the_chat_template(sandbox):
    """A scripted call and answer played by env.traces (env.render_messages renders the observation); the tiny
    tool tokenizer renders an observation as <|observation|>{content}, its leading token not repeated."""
    tok = make_tiny_tokenizer(tools=True)
    turns = [['python\n{"code": "print(2**10)"}', "\\boxed{1024}"]]
    [ep] = env.traces(PythonMath, [EXAMPLE], turns, tok, env.Limits(64, 512, 4),
                      stop_id=tok.convert_tokens_to_ids("<|observation|>"), eos_id=tok.eos_token_id)
    assert ep.failure is None and ep.finish == "stop" and ep.reward == 1.0 and ep.tool_calls == 1
    assert tok.decode(ep.prompt) == "<|system|>python<|user|>What is 2**10?" + PythonMath.INSTRUCTION + "<|assistant|>"
    assert tok.decode(ep.response) == \
        'python\n{"code": "print(2**10)"}<|observation|>1024\n<|assistant|>\\boxed{1024}<eos>'


def test_answer_line_ends_and_grades_the_episode_when_asked(sandbox):
    """data.env_args answer_line: DAPO's final "Answer: ..." line is an answer (graded by math_reward's answer_line)."""
    env = tools.PythonMath({"prompt": "p", "label": "34"})
    assert env.step("so\nAnswer: 34")[2] is True and env.step("so\nAnswer: 34")[3]["void"]  # not asked: void
    tools._answer_line = True
    try:
        assert env.step("so\nAnswer: 34") == ([], 1.0, True)
        assert env.step("so\nAnswer: 35") == ([], 0.0, True)
    finally:
        tools._answer_line = False


def test_without_setup_the_first_calls_start_one_sandbox(sandbox, monkeypatch):
    """(Last in the file: it leaves the lazily started sandbox to the fixture's teardown.)"""
    PythonMath.teardown()
    asked, real = [], tools.Sandbox

    def counting(workers, *rest, **keys):
        asked.append((workers, *rest, keys["isolation"], keys["wait_s"]))
        return real(2, *rest, **keys | {"isolation": "weak"})  # setup's defaults, but 2 workers: a light test
    monkeypatch.setattr(tools, "Sandbox", counting)
    out = [None] * 4

    def one(i):
        out[i] = PythonMath(EXAMPLE).step(call(f"print({i})"))[0][0]["content"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == ["0\n", "1\n", "2\n", "3\n"] and asked == [(8, 10.0, 2048, 32, 4096, "strict", 30.0)]


"""Fast CPU tests for data.py: no network, no downloads, deterministic."""

import itertools
import json
import math
import random
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest

import data
from data import (PromptStream, eval_metrics, load_rows, load_reward, make_tiny_tokenizer, math_reward,
                  pack_by_tokens, pass_at_k, prompt_lengths, render_prompt, split_across_ranks, synthetic_task)


def box(x):
    return f"Let me think. So the answer is $\\boxed{{{x}}}$."


# -----------------------------------------------------------------------------
# Prompt files (JSONL, Parquet)

def write(tmp_path, text, name="d.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_load_rows_ok(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    p = write(tmp_path, '{"prompt": "2+2?", "label": 4, "extra": 1}\n\n'
                        + json.dumps({"prompt": msgs, "label": "\\frac{1}{2}"}) + "\n")
    ex = load_rows(p)
    # every field kept (a reward may need it), the label as a string
    assert ex == [{"prompt": "2+2?", "label": "4", "extra": 1}, {"prompt": msgs, "label": "\\frac{1}{2}"}]


def test_load_rows_custom_keys(tmp_path):
    p = write(tmp_path, '{"problem": "q", "answer": 7, "level": [1, 2]}\n')
    assert load_rows(p, prompt_key="problem", label_key="answer") == [
        {"problem": "q", "answer": 7, "level": [1, 2], "prompt": "q", "label": "7"}]


def test_load_rows_response_key(tmp_path):
    p = write(tmp_path, '{"prompt": "1+1=", "label": "2", "response": "\\\\boxed{2}"}\n')
    assert load_rows(p, response_key="response") == [
        {"prompt": "1+1=", "label": "2", "response": "\\boxed{2}", "solution": "\\boxed{2}"}]
    assert load_rows(p) == [{"prompt": "1+1=", "label": "2", "response": "\\boxed{2}"}]  # no solution asked
    p = write(tmp_path, '{"prompt": "1+1=", "label": "2", "solution": "so 2"}\n')
    assert load_rows(p, response_key="solution") == [{"prompt": "1+1=", "label": "2", "solution": "so 2"}]


@pytest.mark.parametrize("text, lineno, needle", [
    ('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": \n', 2, "not valid JSON"),
    ('[1, 2]\n', 1, "expected a JSON object"),
    ('{"prompt": "a", "label": "1"}\n\n{"prompt": "b"}\n', 3, "missing key 'label'"),
    ('{"label": "1"}\n', 1, "missing key 'prompt'"),
    ('{"prompt": 5, "label": "1"}\n', 1, "must be a string or a list"),
    ('{"prompt": [{"role": "user"}], "label": "1"}\n', 1, "must be a string or a list"),
    ('{"prompt": "a", "label": null}\n', 1, "'label' must be a string or a number"),
])
def test_load_rows_errors_name_file_and_line(tmp_path, text, lineno, needle):
    p = write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_rows(p)
    assert str(e.value).startswith(f"{p}:{lineno}: ") and needle in str(e.value)


@pytest.mark.parametrize("text, kwargs, lineno, message", [
    # a copied key must not overwrite a field of the same name
    ('{"problem": "q", "prompt": "other", "label": "1"}\n', {"prompt_key": "problem"}, 1,
     "has both 'problem' (the prompt_key) and a 'prompt' field; copying 'problem' to 'prompt' would overwrite it, "
     "so rename one of them"),
    ('{"prompt": "q", "label": "1"}\n{"prompt": "q", "answer": "1", "label": "1"}\n', {"label_key": "answer"}, 1,
     "missing key 'answer' (keys present: ['label', 'prompt'])"),
    ('{"prompt": "q", "answer": "1", "label": "1"}\n', {"label_key": "answer"}, 1,
     "has both 'answer' (the label_key) and a 'label' field; copying 'answer' to 'label' would overwrite it, "
     "so rename one of them"),
    ('{"prompt": "q", "label": "1", "response": "r", "solution": "s"}\n', {"response_key": "response"}, 1,
     "has both 'response' (the response_key) and a 'solution' field; copying 'response' to 'solution' would "
     "overwrite it, so rename one of them"),
    # the supervised stage needs a string response in every object
    ('{"prompt": "q", "label": "1", "response": "r"}\n{"prompt": "q", "label": "1"}\n', {"response_key": "response"},
     2, "missing key 'response' (keys present: ['label', 'prompt'])"),
    ('{"prompt": "q", "label": "1", "response": 3}\n', {"response_key": "response"}, 1,
     "'response' must be a string (the reference response) or, with data.env, a list of strings (the model's turns), got int"),
])
def test_load_rows_key_errors(tmp_path, text, kwargs, lineno, message):
    p = write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_rows(p, **kwargs)
    assert str(e.value) == f"{p}:{lineno}: {message}"


def test_load_rows_bad_utf8(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff", "label": "1"}\n')
    with pytest.raises(ValueError) as e:
        load_rows(p)
    assert str(e.value) == (f"{p}:2: not valid UTF-8 (byte 0xff at byte offset 12 of the line); "
                            "expected UTF-8 JSON text")
    p.write_bytes('{"prompt": "é ∑ 数", "label": "1"}\r\n'.encode())  # real UTF-8 and CRLF are fine
    assert load_rows(p) == [{"prompt": "é ∑ 数", "label": "1"}]


def test_load_rows_line_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 40)
    fits = '{"prompt": "%s", "label": "1"}' % ("x" * 12)  # exactly 40 bytes
    assert len(fits) == 40
    p = write(tmp_path, fits + "\n" + fits)  # at the limit, with and without a final newline
    assert len(load_rows(p)) == 2
    p = write(tmp_path, fits + "\n\n" + fits.replace("xx", "xxx") + "\n" + fits + "\n")
    with pytest.raises(ValueError) as e:
        load_rows(p)
    assert str(e.value) == (f"{p}:3: line is longer than 40 bytes (data.MAX_LINE_BYTES); expected one JSON "
                            "object per line, is this a JSONL file?")


def test_load_rows_huge_line_is_not_read_whole(tmp_path):
    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"prompt": "a", "label": "1"}\n{"prompt": "')
        for _ in range(40):
            f.write(b"x" * 2**20)  # a 40 MiB line
        f.write(b'", "label": "1"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as e:
            load_rows(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value).startswith(f"{p}:2: line is longer than 8 MiB (data.MAX_LINE_BYTES)")
    assert peak < 24 * 2**20  # readline's 8 MiB (twice while it joins chunks), not the 40 MiB line


def test_load_rows_empty_and_missing(tmp_path):
    p = write(tmp_path, "\n  \n")
    with pytest.raises(ValueError, match="empty"):
        load_rows(p)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(missing)


# One row of the original DAPO-Math-17k, in its layout (the problem shortened)
DAPO_ROW = {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": "9a9b"},
            "prompt": [{"role": "user",
                        "content": 'Solve 1+1.\n\nRemember to put your answer on its own line after "Answer:".'}],
            "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"}}


def test_load_rows_key_paths(tmp_path):
    p = write(tmp_path, json.dumps(DAPO_ROW) + "\n")
    assert load_rows(p, label_key="reward_model.ground_truth") == [{**DAPO_ROW, "label": "2"}]
    p = write(tmp_path, '{"prompt": "q", "a.b": 1, "a": {"b": 2}}\n')
    assert load_rows(p, label_key="a.b")[0]["label"] == "1"  # a top-level key of exactly that name wins
    # deeper paths; and a key may replace its own field: {"prompt": {"text": ...}} becomes the text
    p = write(tmp_path, '{"prompt": {"text": "q", "lang": "en"}, "meta": {"gold": {"value": 7}}}\n')
    assert load_rows(p, prompt_key="prompt.text", label_key="meta.gold.value") == [
        {"prompt": "q", "meta": {"gold": {"value": 7}}, "label": "7"}]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "reward_model": {"style": "rule"}},
     "missing key 'reward_model.ground_truth': no 'ground_truth' in 'reward_model' (keys present: ['style'])"),
    ({"prompt": "q", "rm": {"ground_truth": "2"}},
     "missing key 'reward_model.ground_truth': no 'reward_model' at the top level (keys present: ['prompt', 'rm'])"),
    ({"prompt": "q", "reward_model": "2"},
     "missing key 'reward_model.ground_truth': 'reward_model' is a str, not an object"),
    ({"prompt": "q", "reward_model": {"ground_truth": ["2"]}},
     "'reward_model.ground_truth' must be a string or a number, got list"),
    # the normalised field must not overwrite another field, nested key or not
    ({"prompt": "q", "label": "x", "reward_model": {"ground_truth": "2"}},
     "has both 'reward_model.ground_truth' (the label_key) and a 'label' field; copying 'reward_model.ground_truth' "
     "to 'label' would overwrite it, so rename one of them"),
])
def test_load_rows_key_path_errors(tmp_path, row, message):
    p = write(tmp_path, '{"prompt": "fine", "reward_model": {"ground_truth": "1"}}\n' + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        load_rows(p, label_key="reward_model.ground_truth")
    assert str(e.value) == f"{p}:2: {message}"


def write_parquet(path, rows=None, table=None):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows), path)
    return path


def test_load_rows_parquet(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "PARQUET_BATCH_ROWS", 2)  # 5 rows: three batches
    rows = [{**DAPO_ROW, "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(5)]
    p = write_parquet(tmp_path / "dapo.parquet", rows)
    # nested structs come back as dicts, a list of structs as a list of messages
    assert load_rows(p, label_key="reward_model.ground_truth") == [{**r, "label": str(i)} for i, r in enumerate(rows)]
    p = write_parquet(tmp_path / "aime.PARQUET", [{"problem": "q1", "answer": 7}, {"problem": "q2", "answer": 80}])
    assert load_rows(p, "problem", "answer") == [{"problem": "q1", "answer": 7, "prompt": "q1", "label": "7"},
                                                 {"problem": "q2", "answer": 80, "prompt": "q2", "label": "80"}]
    p = write(tmp_path, '{"prompt": "q", "label": "1"}\n', name="d.txt")  # any other extension: JSONL
    assert load_rows(p) == [{"prompt": "q", "label": "1"}]


def test_load_rows_json_array_or_jsonl_named_json(tmp_path, monkeypatch):
    """A .json file may hold one JSON array of objects (as some Hub datasets ship their eval sets) or be JSONL
    under that name (as others do); both read the same rows, with errors naming file:item N."""
    rows = [{"problem": "q1", "answer": 7}, {"problem": "q2", "answer": "80"}]
    want = [{**r, "prompt": r["problem"], "label": str(r["answer"])} for r in rows]
    array = write(tmp_path, "\ufeff  " + json.dumps(rows, indent=1), name="aime.json")  # a BOM and a pretty-print
    assert load_rows(array, "problem", "answer") == want
    lines = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), name="aime2.json")
    assert load_rows(lines, "problem", "answer") == want
    with pytest.raises(ValueError, match=r"bad\.json:item 2: expected a JSON object, got list"):
        load_rows(write(tmp_path, '[{"prompt": "q", "label": "1"}, [1]]', name="bad.json"))
    with pytest.raises(ValueError, match=r"cut\.json: not valid JSON"):
        load_rows(write(tmp_path, '[{"prompt": "q", "label": "1"}', name="cut.json"))
    monkeypatch.setattr(data, "MAX_JSON_BYTES", 10)
    with pytest.raises(ValueError, match="larger than 10 bytes .* write it as JSONL"):
        load_rows(array, "problem", "answer")


def test_load_rows_parquet_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "PARQUET_BATCH_ROWS", 2)
    rows = [{"prompt": "a", "rm": {"gt": "1"}}] * 2 + [{"prompt": "c", "rm": {"gt": None}}]
    p = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ValueError) as e:
        load_rows(p, label_key="rm.gt")
    assert str(e.value) == f"{p}:row 3: 'rm.gt' must be a string or a number, got NoneType"  # rows count from 1
    with pytest.raises(ValueError) as e:
        load_rows(p, label_key="rm.answer")
    assert str(e.value) == f"{p}:row 1: missing key 'rm.answer': no 'answer' in 'rm' (keys present: ['gt'])"
    bad = write(tmp_path, '{"prompt": "q", "label": "1"}\n', name="bad.parquet")
    with pytest.raises(ValueError) as e:
        load_rows(bad)
    assert str(e.value).startswith(f"{bad}: cannot be read as Parquet (") and "\n" not in str(e.value)
    import pyarrow as pa
    empty = write_parquet(tmp_path / "empty.parquet", table=pa.table({"prompt": pa.array([], pa.string())}))
    with pytest.raises(ValueError) as e:
        load_rows(empty)
    assert str(e.value) == f"{empty}: file is empty (expected at least one row)"
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError) as e:
        load_rows(p)
    assert str(e.value) == f"{p}: reading a Parquet file needs pyarrow: pip install pyarrow"


def test_load_rows_dedup(tmp_path, capsys):
    rows = [{"prompt": "q1", "label": "1"}, {"prompt": "q2", "label": "2"}, {"prompt": "q1", "label": "1"},
            {"prompt": "q1", "label": "9"},  # the same problem with another answer: dropped, and counted
            {"prompt": [{"role": "user", "content": "m"}], "label": "3"},
            {"prompt": [{"content": "m", "role": "user"}], "label": "3"}]  # the same messages
    p = write(tmp_path, "".join(json.dumps({**r, "row": i}) + "\n" for i, r in enumerate(rows)))
    assert [ex["row"] for ex in load_rows(p)] == [0, 1, 2, 3, 4, 5]  # off: every row
    assert [ex["row"] for ex in load_rows(p, dedup=True)] == [0, 1, 4]  # the first row of each prompt
    assert capsys.readouterr().out == ""  # not verbose
    load_rows(p, dedup=True, verbose=True)
    assert capsys.readouterr().out == (f"[data] {p}: 6 rows, 3 unique prompts: 3 repeats dropped, 1 of them with "
                                       "another label than the first row's (kept)\n")
    # the files of a split are one dataset
    p2 = write(tmp_path, '{"prompt": "q2", "label": "2"}\n{"prompt": "q3", "label": "3"}\n', name="e.jsonl")
    kept = load_rows([p, p2], dedup=True, verbose=True)
    assert [ex["prompt"] for ex in kept] == ["q1", "q2", rows[4]["prompt"], "q3"]
    assert capsys.readouterr().out.startswith(f"[data] {p} (+1 more): 8 rows, 4 unique prompts: 4 repeats dropped, 1 ")
    # without a prompt key (data.env reads the rows) only whole rows repeat
    p = write(tmp_path, '{"task": "a", "x": 1}\n{"task": "a", "x": 1}\n{"task": "a", "x": 2}\n')
    assert load_rows(p, None, None, dedup=True, verbose=True) == [{"task": "a", "x": 1}, {"task": "a", "x": 2}]
    assert capsys.readouterr().out == f"[data] {p}: 3 rows, 2 unique prompts: 1 repeats dropped\n"


def test_eval_set_with_its_own_keys(tmp_path, tok, capsys):
    import os

    from machinery import config
    aime = write(tmp_path, '{"problem": "1+1=", "answer": 2}\n{"problem": "2+2=", "answer": 4}\n'
                           '{"problem": "1+1=", "answer": 2}\n', name="aime.jsonl")
    train = write(tmp_path, json.dumps({"q": "3+3=", "reward_model": {"ground_truth": 6}}) + "\n", name="train.jsonl")
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
    cfg = config.load_config(tiny, [
        f"data.train={train}", "data.prompt_key=q", "data.label_key=reward_model.ground_truth", "data.dedup=true",
        f"data.eval={{aime: {{path: '{aime}', prompt_key: problem, label_key: answer}}, other: '{train}'}}"])
    sets = config.eval_sets(cfg)
    assert sets == {"aime": {"path": str(aime), "prompt_key": "problem", "label_key": "answer"}, "other": str(train)}
    assert [data.spec_path(s) for s in sets.values()] == [str(aime), str(train)]

    def load(spec):
        return data.load_examples(spec, tok, cfg.data, split="eval", seed=0, sft=False, chat_template=True,
                                  max_prompt_tokens=32)
    assert load(sets["aime"]) == [{"problem": "1+1=", "answer": 2, "prompt": "1+1=", "label": "2"},
                                  {"problem": "2+2=", "answer": 4, "prompt": "2+2=", "label": "4"}]
    assert capsys.readouterr().out == (f"[data] {aime}: 3 rows, 2 unique prompts: 1 repeats dropped, 0 of them with "
                                       "another label than the first row's (kept)\n")
    # a set given as a file reads the data section's keys
    assert load(sets["other"]) == [{"q": "3+3=", "reward_model": {"ground_truth": 6}, "prompt": "3+3=", "label": "6"}]


# -----------------------------------------------------------------------------
# PromptStream

def test_prompt_stream_epochs_and_determinism():
    ex = [{"prompt": str(i), "label": str(i)} for i in range(5)]
    s = PromptStream(ex, seed=3)
    first = s.next(12)
    assert (s.epoch, s.position) == (2, 2)
    assert sorted(e["prompt"] for e in first[:5]) == [str(i) for i in range(5)]  # one full epoch
    assert sorted(e["prompt"] for e in first[5:10]) == [str(i) for i in range(5)]
    assert first == PromptStream(ex, seed=3).next(12)
    assert [e["prompt"] for e in PromptStream(ex, shuffle=False).next(7)] == list("0123401")


def test_prompt_stream_resume():
    ex = [{"prompt": str(i), "label": str(i)} for i in range(6)]
    s = PromptStream(ex, seed=1)
    s.next(7)
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    expected = s.next(5)
    fresh = PromptStream(ex, seed=1)
    fresh.load_state_dict(state)
    assert fresh.next(5) == expected
    with pytest.raises(ValueError, match="examples"):
        PromptStream(ex[:3]).load_state_dict(state)


# -----------------------------------------------------------------------------
# Tokenizer and chat templates

@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_tiny_tokenizer_round_trip(tok):
    assert len(tok) < 128 and tok.pad_token == "<pad>" and tok.eos_token == "<eos>"
    for e in synthetic_task(50, seed=0):
        text = e["prompt"] + e["solution"]
        ids = tok.encode(text)
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    ids = tok.encode("x = 1, y\n") + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "x = 1, y\n"


def test_render_prompt_chat_template(tok):
    ids = render_prompt(tok, "12+7=")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids) == "<|user|>12+7=<|assistant|>"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]
    assert tok.decode(render_prompt(tok, msgs)) == "<|system|>s<|user|>1+1=<|assistant|>"
    assert render_prompt(tok, "12+7=", chat_template=False) == tok.encode("12+7=")
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt(tok, msgs, chat_template=False)


def test_render_prompt_without_template():
    t = make_tiny_tokenizer()
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*rollout.chat_template: false"):
        render_prompt(t, "1+1=")


def test_prompt_lengths(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}]
    examples = [{"prompt": "12+7=", "label": "19"}, {"prompt": msgs, "label": "2"}]
    # <|user|> 1 2 + 7 = <|assistant|>  and  <|system|> s <|user|> 1 + 1 = <|assistant|>
    assert prompt_lengths(tok, examples, chat_template=True) == [7, 8]
    assert prompt_lengths(tok, examples, True) == [len(render_prompt(tok, e["prompt"])) for e in examples]
    assert prompt_lengths(tok, examples[:1], chat_template=False) == [5] == [len(tok.encode("12+7="))]
    assert prompt_lengths(tok, [], True) == []


def test_tiny_tokenizer_reload(tmp_path, tok):
    from transformers import AutoTokenizer
    make_tiny_tokenizer(tmp_path / "tok")
    t2 = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert render_prompt(t2, "3*4=") == render_prompt(tok, "3*4=")
    assert t2.encode("\\boxed{12}") == tok.encode("\\boxed{12}")
    assert (t2.pad_token_id, t2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


# -----------------------------------------------------------------------------
# Synthetic task

def test_synthetic_task():
    train, test = synthetic_task(3000, seed=0), synthetic_task(500, seed=0, split="test")
    assert train == synthetic_task(3000, seed=0) and train != synthetic_task(3000, seed=1)
    train_p, test_p = {e["prompt"] for e in train}, {e["prompt"] for e in test}
    assert len(train_p) > 500 and len(test_p) > 50 and not train_p & test_p
    assert len({e["prompt"] for e in synthetic_task(len(test_p), seed=5, split="test")}) == len(test_p)
    assert {e["prompt"] for e in synthetic_task(2000, seed=7)} == train_p  # split does not depend on seed
    for e in train[:200] + test[:50]:
        assert len(e["prompt"]) <= 16 and len(e["solution"]) <= 16
        assert e["solution"].endswith(f"\\boxed{{{e['label']}}}")
        assert str(eval(e["prompt"][:-1])) == e["label"]
        assert math_reward(e["solution"], e) == 1.0
    with pytest.raises(ValueError, match="split"):
        synthetic_task(1, 0, split="valid")


def test_synthetic_pools_and_operands():
    # synthetic_task's docstring: 806 / 94 problems, operands 0-19 (+, -) and 0-9 (*); 7343 / 757 two-digit products
    def pool(task, split):
        return {e["prompt"] for e in synthetic_task(10000, seed=0, split=split, task=task)}
    assert (len(pool("synthetic", "train")), len(pool("synthetic", "test"))) == (806, 94)
    for p in pool("synthetic", "train") | pool("synthetic", "test"):
        a, op, b = next((p[:i], p[i], p[i + 1:-1]) for i in range(1, len(p)) if p[i] in "+-*")
        assert 0 <= int(a) < (10 if op == "*" else 20) and 0 <= int(b) < (10 if op == "*" else 20)
    for task in ("synthetic:multiply", "synthetic:multiply-no-tool"):
        assert (len(pool(task, "train")), len(pool(task, "test"))) == (7343, 757)


def test_synthetic_multiply_examples():
    train, test = synthetic_task(400, seed=0, task="synthetic:multiply"), \
        synthetic_task(50, seed=0, split="test", task="synthetic:multiply")
    for e in train + test:
        assert str(eval(e["prompt"][:-1])) == e["label"] and math_reward(f"\\boxed{{{e['label']}}}", e) == 1.0
        assert e["solution"] == ([f"calc({e['prompt'][:-1]})", f"\\boxed{{{e['label']}}}"] if e["tools"]
                                 else f"\\boxed{{{e['label']}}}")
    assert all(e["tools"] for e in test)  # the test split always has the tool
    assert 0.15 < sum(not e["tools"] for e in train) / len(train) < 0.35  # a quarter of train comes without it
    assert not any(e["tools"] for e in synthetic_task(100, seed=0, task="synthetic:multiply-no-tool"))
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic_task(1, 0, task="synthetic:divide")


# -----------------------------------------------------------------------------
# Grading

GRADING_CASES = [
    # fractions and decimals
    (box("\\frac{1}{2}"), "0.5", 1.0),
    (box("\\dfrac{1}{2}"), "\\frac{1}{2}", 1.0),
    (box("\\tfrac12"), "\\frac{1}{2}", 1.0),
    (box("1/2"), "\\frac{1}{2}", 1.0),
    (box("0.50"), "\\frac{1}{2}", 1.0),
    (box(".5"), "0.5", 1.0),
    (box("\\frac{2}{4}"), "0.5", 1.0),
    (box("-\\frac{1}{2}"), "-0.5", 1.0),
    (box("5.0"), "5", 1.0),
    (box("0.3333"), "\\frac{1}{3}", 0.0),
    (box("1,000"), "1000", 1.0),
    # LaTeX wrappers, units, degrees, percent, money
    (box("\\left(1, 2\\right)"), "(1,2)", 1.0),
    (box("5\\text{ cm}"), "5", 1.0),
    (box("12\\,\\mathrm{m}"), "12", 1.0),
    (box("\\text{A}"), "A", 1.0),
    (box("30^\\circ"), "30", 1.0),
    (box("30^{\\circ}"), "30", 1.0),
    (box("50\\%"), "50", 1.0),
    (box("\\$5"), "5", 1.0),
    (box("\\displaystyle 7"), "7", 1.0),
    (box("x = 3"), "3", 1.0),
    # intervals, sets, tuples
    (box("(1,2]"), "(1,2]", 1.0),
    (box("(1,2)"), "(1,2]", 0.0),
    (box("[1, 2]"), "[1,2]", 1.0),
    (box("\\{1,2\\}"), "\\{2,1\\}", 1.0),
    (box("(3, 4)"), "(4, 3)", 0.0),
    # negatives and plain wrong answers
    (box("-3"), "-3", 1.0),
    (box("3"), "-3", 0.0),
    (box("4"), "5", 0.0),
    (box("3.14"), "\\pi", 0.0),
    (box(""), "5", 0.0),
    # symbolic equivalence
    (box("2\\sqrt{2}"), "\\sqrt{8}", 1.0),
    (box("\\frac{\\sqrt{3}}{2}"), "\\frac{\\sqrt3}{2}", 1.0),
    (box("\\pi/2"), "\\frac{\\pi}{2}", 1.0),
    (box("x^2+2x+1"), "(x+1)^2", 1.0),
    (box("2^{10}"), "1024", 1.0),
    (box("\\frac{a}{b}"), "a/b", 1.0),
    (box("\\infty"), "\\infty", 1.0),
    # where the answer is taken from
    ("\\boxed{2} no wait, \\boxed{3}", "3", 1.0),
    ("\\boxed{2} no wait, \\boxed{3}", "2", 0.0),
    ("\\boxed{\\boxed{4}}", "4", 1.0),
    ("the answer is 3", "3", 0.0),
    ("\\boxed 5", "5", 1.0),
    ("so \\boxed 5.", "5", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # cut off inside the box
    ("\\boxed{1} and then \\boxed{\\frac{1}{2}", "1", 0.0),  # last box unbalanced: no fallback
    ("<think>maybe \\boxed{5}", "5", 0.0),  # never finished thinking
    ("<think>\\boxed{4}</think>Final: \\boxed{5}", "5", 1.0),
    ("<think>\\boxed{5}</think>Final: 5", "5", 0.0),  # the box inside the thoughts does not count
    ("<think>a</think><think>b</think>\\boxed{6}", "6", 1.0),
    # label itself boxed
    (box("9"), "\\boxed{9}", 1.0),
    # garbage must not raise
    ("", "", 0.0),
    (box("}{}{"), "5", 0.0),
    (box("\\frac{"), "\\frac{", 0.0),
    (None, "5", 0.0),
    (box("5"), None, 0.0),
]


@pytest.mark.parametrize("response, label, expected", GRADING_CASES)
def test_math_reward_table(response, label, expected):
    assert math_reward(response, {"prompt": "p", "label": label}) == expected


def test_math_reward_called_with_a_label_raises():
    # the old call math_reward(text, label) must fail loudly, not score every response 0
    with pytest.raises(TypeError) as e:
        math_reward(box("4"), "4")
    assert str(e.value) == ("math_reward(response, example): example must be a dict with a 'label' key "
                            "(the whole example, not its label), got str")
    with pytest.raises(TypeError, match=r"got a dict with keys \['prompt'\]"):
        math_reward(box("4"), {"prompt": "2+2="})


@pytest.mark.parametrize("answer", [
    "9^{9^{9}}", "10^{10^{10}}", "2^2^2^2^2", "(1+x)^{99999}", "\\sqrt{2}^{100000}", "9^{999\\cdot 999}",
    "100000!", "(10!)!", "2^{100!}", "9**99999999", "{" * 5000 + "1" + "}" * 5000, "(" * 200 + "1" + ")" * 200,
    "1+" * 3000 + "1",
])
def test_math_reward_pathological_inputs_are_fast(answer):
    t = time.time()
    assert math_reward(box(answer), {"label": "5"}) == 0.0
    assert time.time() - t < 1.0


def test_math_reward_huge_response_is_fast():
    t = time.time()
    ex = {"label": "42"}
    assert math_reward("blah " * 20000 + box("42"), ex) == 1.0
    assert math_reward("{" * 100_000, ex) == 0.0
    assert math_reward("\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}", ex) == 0.0
    assert math_reward("\\boxed{" + "x" * 100_000 + "}", ex) == 0.0
    assert time.time() - t < 2.0


def test_math_reward_in_background_thread():
    # math-verify's own timeouts use signal.alarm, which raises outside the main thread; ours must not.
    results = []
    cases = [(box("\\frac{\\sqrt{8}}{2}"), "\\sqrt{2}", 1.0), (box("2\\pi"), "\\pi", 0.0), (box("7"), "7", 1.0)]
    worker = threading.Thread(target=lambda: results.extend(math_reward(r, {"label": l}) for r, l, _ in cases))
    worker.start()
    worker.join(30)
    assert results == [e for _, _, e in cases]


def test_math_reward_deadline(monkeypatch):
    monkeypatch.setattr(data, "SYMBOLIC_TIMEOUT_S", 0.05)
    monkeypatch.setattr(data, "_symbolic_equal", lambda a, b: time.sleep(0.5) or True)
    t = time.time()
    assert math_reward(box("\\sqrt{4}"), {"label": "2"}) == 0.0  # too slow counts as wrong
    assert time.time() - t < 0.4
    monkeypatch.setattr(data, "MAX_STUCK_CHECKS", 1)  # the sleeping check is still stuck
    assert math_reward(box("\\sqrt{9}"), {"label": "3"}) == 0.0
    assert math_reward(box("3"), {"label": "3"}) == 1.0  # string matches never need the symbolic path


@pytest.mark.parametrize("response, label, boxed_only, with_answer_line", [
    ("Adding them gives 34.\nAnswer: 34", "34", 0.0, 1.0),  # DAPO's format
    ("So\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}", 0.0, 1.0),
    ("So\nAnswer: $\\frac{1}{2}$.", "0.5", 0.0, 1.0),  # the symbolic check, as for boxes
    ("So\nAnswer: 1,000", "1000", 0.0, 1.0),  # the same normalisation as boxes
    ("**Answer:** 34", "34", 0.0, 1.0),
    ("so the final answer: 34.", "34", 0.0, 1.0),  # any case, as DAPO's grader
    ("Answer:\n\n34", "34", 0.0, 1.0),  # ... whose answer may start on a later line
    ("Answer: 3, no: Answer: 5", "5", 0.0, 1.0),  # the last "Answer:", also within one line
    ("\\boxed{3}\nAnswer: 34", "34", 0.0, 1.0),  # of a box and an answer line, the later one counts
    ("\\boxed{3}\nAnswer: 34", "3", 1.0, 0.0),
    ("Answer: 34\nNo, wait: \\boxed{35}", "35", 1.0, 1.0),
    ("Answer: 34\nNo, wait: \\boxed{35}", "34", 0.0, 0.0),
    ("Answer: \\boxed{5}", "5", 1.0, 1.0),
    ("Answer: 5\n\\boxed{5", "5", 0.0, 1.0),  # a box cut off: the answer line
    ("<think>Answer: 7</think>Answer: 8", "8", 0.0, 1.0),
    ("<think>Answer: 7</think>Answer: 8", "7", 0.0, 0.0),  # inside the thoughts it does not count
    ("<think>Answer: 7", "7", 0.0, 0.0),  # never finished thinking
    ("The answer is 34", "34", 0.0, 0.0),
    ("Answer:", "5", 0.0, 0.0),
    ("Answer: $$.", "5", 0.0, 0.0),
    (box("42"), "42", 1.0, 1.0),  # boxed answers grade as before
])
def test_math_reward_answer_line(response, label, boxed_only, with_answer_line):
    ex = {"prompt": "p", "label": label}
    assert math_reward(response, ex) == boxed_only
    assert math_reward(response, ex, answer_line=True) == with_answer_line
    assert data.math_reward_answer_line(response, ex) == with_answer_line


def test_last_answer_line_is_fast():
    t = time.time()
    for text in ["Answer:" + " " * 100_000, "Answer:" + "\n" * 100_000, "Answer: " * 50_000, "answer \n" * 50_000]:
        assert data.last_answer_line(text) is None
    assert data.last_answer_line("x\n" * 50_000 + "Answer: 34") == (100_000, "34")
    assert time.time() - t < 1.0


# -----------------------------------------------------------------------------
# The reward hook

@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write reward modules into a fresh working directory; sys.path and sys.modules are restored after."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(work))])
    before = set(sys.modules)

    def write_module(name, source, folder=work):
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        return folder / f"{name}.py"

    yield write_module
    for name in set(sys.modules) - before:  # only the modules written here, so the next test re-imports
        if str(tmp_path) in str(getattr(sys.modules[name], "__file__", None)):
            del sys.modules[name]


def reward_error(spec):
    with pytest.raises(ValueError) as e:
        load_reward(spec)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_load_reward_default():
    assert load_reward("data:math_reward") is math_reward


def test_load_reward_answer_line(modules):
    # data.answer_line binds the built-in grader; the hook keeps its two arguments
    fn = load_reward("data:math_reward", answer_line=True)
    assert fn is data.math_reward_answer_line and fn("So\nAnswer: 34", {"label": "34"}) == 1.0
    assert load_reward("data:math_reward")("So\nAnswer: 34", {"label": "34"}) == 0.0
    modules("my_rewards", "def f(response, example):\n    return 1.0\n")
    with pytest.raises(ValueError) as e:
        load_reward("my_rewards:f", answer_line=True)  # would be ignored
    assert str(e.value) == ("data.answer_line: only the built-in data:math_reward reads it, and data.reward is "
                            "'my_rewards:f'; grade 'Answer:' lines in that function instead")


def test_load_reward_from_working_directory(modules, tmp_path):
    modules("my_rewards", """
        def length_penalty(response, example, scale=0.01):
            return -scale * len(response)
    """)
    assert str(tmp_path / "work") not in sys.path
    fn = load_reward("my_rewards:length_penalty")
    assert fn("abcd", {"prompt": "p", "label": "l"}) == pytest.approx(-0.04)
    assert str(tmp_path / "work") in sys.path


def test_load_reward_from_repository_root(modules, tmp_path, monkeypatch):
    # python train.py from another directory: files beside data.py must still be importable
    repo = tmp_path / "repo"
    repo.mkdir()
    modules("repo_rewards", "def always(response, example):\n    return 1.0\n", folder=repo)
    monkeypatch.setattr(data, "__file__", str(repo / "data.py"))
    assert load_reward("repo_rewards:always")("x", {"label": "y"}) == 1.0


def test_load_reward_extra_field_reaches_the_reward(modules, tmp_path):
    modules("graded", """
        from data import math_reward

        def by_difficulty(response, example):
            return math_reward(response, example) * {"easy": 0.5, "hard": 2.0}[example["difficulty"]]
    """)
    p = write(tmp_path, '{"prompt": "1+1=", "label": 2, "difficulty": "easy"}\n'
                        '{"prompt": "9*9=", "label": "81", "difficulty": "hard"}\n')
    easy, hard = load_rows(p)
    fn = load_reward("graded:by_difficulty")
    assert [fn(box("2"), easy), fn(box("81"), hard), fn(box("80"), hard)] == [0.5, 2.0, 0.0]


@pytest.mark.parametrize("spec", ["data.math_reward", "", ":math_reward", "data:", "data:math:reward",
                                  "my rewards:f", "data:math-reward", ".rel:f", None])
def test_load_reward_malformed(spec):
    assert reward_error(spec) == (f'data.reward: {spec!r}: expected "module:function", e.g. "data:math_reward" '
                                  'or "my_rewards:length_penalty"')


def test_load_reward_module_not_found(modules):
    msg = reward_error("no_such_rewards:f")
    assert msg.startswith("data.reward: 'no_such_rewards:f': no module named 'no_such_rewards' (searched the "
                          "working directory ")
    assert reward_error("no_such_pkg.sub:f").startswith("data.reward: 'no_such_pkg.sub:f': no module named "
                                                          "'no_such_pkg' ")


def test_load_reward_module_fails_on_import(modules):
    modules("broken", "raise RuntimeError('bad config\\nsecond line')\n")
    assert reward_error("broken:f") == ("data.reward: 'broken:f': importing broken failed: RuntimeError: "
                                        "bad config second line")
    # a module that exists but imports a missing dependency is an import failure, not "not found"
    modules("needs_dep", "import no_such_dependency_xyz\n")
    assert reward_error("needs_dep:f") == ("data.reward: 'needs_dep:f': importing needs_dep failed: "
                                           "ModuleNotFoundError: No module named 'no_such_dependency_xyz'")
    modules("typo", "def f(response, example)\n    return 1.0\n")
    msg = reward_error("typo:f")  # the wording of SyntaxError varies between Python versions
    assert msg.startswith("data.reward: 'typo:f': importing typo failed: SyntaxError: ")
    assert msg.endswith(" (typo.py, line 1)")


def test_load_reward_no_such_function(modules):
    path = modules("my_rewards", """
        THRESHOLD = 3

        def length_penalty(response, example):
            return 0.0

        def format_bonus(response, example):
            return 0.0

        def _private(response, example):
            return 0.0
    """)
    assert reward_error("my_rewards:lenght_penalty") == (
        f"data.reward: 'my_rewards:lenght_penalty': module my_rewards ({path}) has no function 'lenght_penalty'; "
        "did you mean 'length_penalty'?")
    assert reward_error("my_rewards:accuracy") == (
        f"data.reward: 'my_rewards:accuracy': module my_rewards ({path}) has no function 'accuracy'; "
        "it has: format_bonus, length_penalty")
    assert reward_error("my_rewards:THRESHOLD") == ("data.reward: 'my_rewards:THRESHOLD': my_rewards.THRESHOLD "
                                                    "is a int, not a function")


@pytest.mark.parametrize("source, ok", [
    ("def f(response, example): return 0.0", True),
    ("def f(response, example, scale=1.0): return 0.0", True),
    ("def f(*args, **kwargs): return 0.0", True),
    ("f = lambda text, ex: 0.0", True),
    ("class F:\n    def __call__(self, response, example): return 0.0\nf = F()", True),
    ("def f(response): return 0.0", False),  # the old (response, label) callers would pass; examples would not
    ("def f(response, example, tokenizer): return 0.0", False),
    ("def f(*, response, example): return 0.0", False),
])
def test_load_reward_signature(modules, source, ok):
    modules("sig_rewards", source + "\n")
    if ok:
        assert callable(load_reward("sig_rewards:f"))
    else:
        msg = reward_error("sig_rewards:f")
        assert msg.startswith("data.reward: 'sig_rewards:f': sig_rewards.f(") and \
            ") cannot be called as f(response_text, example): " in msg


def test_load_reward_signature_message(modules):
    modules("sig_rewards", "def f(response, example, tokenizer):\n    return 0.0\n")
    assert reward_error("sig_rewards:f") == (
        "data.reward: 'sig_rewards:f': sig_rewards.f(response, example, tokenizer) cannot be called as "
        "f(response_text, example): missing a required argument: 'tokenizer'")


# -----------------------------------------------------------------------------
# Token-budget packing

def check_bins(bins, lengths, max_tokens):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # nothing lost or duplicated
    for b in bins:
        assert len(b) > 0
        assert sum(lengths[i] for i in b) <= max_tokens or len(b) == 1


def test_pack_by_tokens_basic():
    lengths = [5, 3, 9, 2, 4, 20, 1]
    bins = pack_by_tokens(lengths, 10)
    check_bins(bins, lengths, 10)
    assert [5] in bins  # the 20-token sample sits alone
    assert bins == pack_by_tokens(lengths, 10)
    assert pack_by_tokens([], 10) == []
    assert pack_by_tokens([10, 10], 10) == [[0], [1]]
    with pytest.raises(ValueError):
        pack_by_tokens([1], 0)


def test_pack_by_tokens_random():
    rng = random.Random(0)
    for _ in range(200):
        max_tokens = rng.randint(1, 64)
        lengths = [rng.randint(0, 80) for _ in range(rng.randint(0, 50))]
        bins = pack_by_tokens(lengths, max_tokens)
        check_bins(bins, lengths, max_tokens)
        # first-fit never leaves two bins that could be merged
        fits = [sum(lengths[i] for i in b) for b in bins if sum(lengths[i] for i in b) <= max_tokens]
        assert sum(1 for a, b in itertools.combinations(fits, 2) if a + b <= max_tokens) == 0


def test_split_across_ranks():
    rng = random.Random(1)
    for _ in range(200):
        world = rng.randint(1, 8)
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(0, 40))]
        ranks = split_across_ranks(lengths, world)
        assert len(ranks) == world
        assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
        if lengths:
            loads = [sum(lengths[i] for i in r) for r in ranks]
            # optimum >= max(mean load, longest sample); greedy is within one sample of the mean
            assert max(loads) <= sum(lengths) / world + max(lengths)
            if len(lengths) >= world:
                assert all(ranks)
    assert split_across_ranks([7, 3], 4) == [[0], [1], [], []]  # fewer samples than ranks
    assert split_across_ranks([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]  # ties go to the lowest rank


# -----------------------------------------------------------------------------
# pass@k

def brute_pass_at_k(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_and_invalid():
    exact = 1 - math.comb(900, 64) / math.comb(1000, 64)
    assert pass_at_k(1000, 100, 64) == pytest.approx(exact, rel=1e-9)
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 1, 16) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_eval_metrics():
    m = eval_metrics([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], ks=(1, 2, 4, 8))
    assert set(m) == {"accuracy", "pass@1", "pass@2", "pass@4"}  # no pass@8 with 4 samples
    assert m["accuracy"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["pass@1"] == pytest.approx(m["accuracy"])
    assert m["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        eval_metrics([])

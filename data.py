"""
Everything about data that is not a model: the synthetic arithmetic task of the CPU demo, chat templates,
rewards (math grading), token-budget batching, pass@k, and prompt files.

The order of this file follows the default run (`python train.py`, configs/tiny_cpu.yaml: the synthetic task,
no files), then what other runs add:
  1. load_examples / synthetic_task  a data source's examples; the demo's: "12+7=" -> "\\boxed{19}", its tokenizer
  2. render_prompt / prompt_lengths  prompt -> token ids, through the model's chat template
  3. load_reward / math_reward       the reward hook; the default grades a response -> 1.0 or 0.0
  4. pack_by_tokens / split_...      group samples into batches under a token budget
  5. pass_at_k / eval_metrics        what evaluation reports
  6. PromptStream                    hand out prompts forever (resumable)
and after them, for later:
  7. _box_argument / _same_answer   how math_reward reads the box and compares it with the label
  8. _safe_for_sympy / _with_...     the symbolic check: its guards, its deadline
  9. math_reward_answer_line         DAPO's final "Answer: ..." line (data.answer_line)
 10. load_rows                       prompt files: JSONL, a JSON array or Parquet; nested keys, dedup
 11. the calculator tasks' examples and load_object's hint: rare branches of sections 1 and 3

Simplifications, stated plainly:
- Grading follows the deepscaler recipe (slime's default reward): only the last \\boxed{} after the
  reasoning counts (with data.answer_line, or DAPO's final "Answer: ..." line if that comes later), a
  normalised string match first, then a symbolic check with math-verify. There is no partial credit and no
  format reward.
- The symbolic check runs in a helper thread with a deadline instead of math-verify's own timeout,
  which uses signal.alarm and so only works in the main thread (the episode loop grades on worker threads).
  A thread cannot be killed, so inputs that could blow up (huge powers, deep nesting, long strings)
  are refused before sympy ever sees them; the deadline is the second line of defence.
"""

import difflib
import hashlib
import importlib
import inspect
import json
import logging
import os
import random
import re
import string
import sys
import threading
from decimal import Decimal
from pathlib import Path

import torch
from math_verify import parse, verify


log = logging.getLogger(__name__)
# math-verify only warns about its own timeouts, which we switch off and replace (see _symbolic_equal, _with_deadline).
logging.getLogger("math_verify").setLevel(logging.ERROR)


# -----------------------------------------------------------------------------
# 1. A run's examples: the synthetic task and tokenizer of the CPU demo
# load_examples reads one data source (data.train, or a set of data.eval): the default run's is a synthetic task,
# other runs' a prompt file (section 10). Either way every prompt is checked against the prompt budget at start-up.
# The synthetic task is short arithmetic ("12+7=" -> "\boxed{19}") that a 3-layer model learns in minutes, graded by
# the same math_reward as real data. A problem's hash puts it in train or test, so held-out problems
# are never trained on, whatever the seed.


# The keys a data source may name for itself, beside the data section's: data.eval: {aime: {path: ...,
# prompt_key: problem, label_key: answer}}.
SOURCE_KEYS = ("path", "prompt_key", "label_key")


def spec_path(spec):
    """The file (or synthetic task, or Hub id) of a data source: the spec itself, or a mapping's "path"."""
    return spec["path"] if isinstance(spec, dict) else spec


def load_examples(source, tokenizer, keys, *, split, seed, sft, chat_template, max_prompt_tokens, verbose=True,
                  openings=None, files_of=None):
    """The examples of one data source (a JSONL or Parquet file, or "synthetic") whose prompts fit max_prompt_tokens.
    source: the file, or a mapping {path: file, prompt_key: ..., label_key: ...} whose keys win over the data
    section's (data.eval's sets). keys: the config's data section (prompt_key, label_key, response_key, dedup,
    train_size, eval_size); the reference response is read only where the supervised stage needs it (sft, train
    split). Every prompt is tokenized here, at start-up, so that an impossible setting fails in seconds: overlong
    eval prompts, or no train prompt that fits, are an error; overlong train prompts are skipped with one line.
    openings (with data.env): the examples' prompt ids, their env's reset() rendered; prompt and label keys are
    then the env's business, not required here. files_of(path, key): the local files of a path (machinery/startup.py hands in
    hub.data_files, which maps a Hub dataset id to its cached files); None: the path itself."""
    size = keys.train_size if split == "train" else keys.eval_size
    path, own = spec_path(source), source if isinstance(source, dict) else {}
    if path in SYNTHETIC:
        if size is None:
            raise ValueError(f"data.{split}_size must be set for the synthetic task (how many problems)")
        examples = synthetic_task(size, seed=seed, split="train" if split == "train" else "test", task=path)
    else:  # a prompt file, or a Hub dataset's files (section 10)
        examples = _file_examples(path, own, keys, split, sft=sft, openings=openings, files_of=files_of,
                                  verbose=verbose)[:size]
    lengths = [len(p) for p in openings(examples)] if openings else prompt_lengths(tokenizer, examples, chat_template)
    fit = [ex for ex, n in zip(examples, lengths) if n <= max_prompt_tokens]
    if len(fit) < len(examples):
        what = (f"{len(examples) - len(fit)} of {len(examples)} prompts in {path} are longer than "
                f"rollout.max_prompt_tokens={max_prompt_tokens} (the longest has {max(lengths)} tokens)")
        if split != "train" or not fit:
            raise ValueError(what + ("" if fit else "; none is left to train on"))
        if verbose:
            print(f"[train] {what}: they are skipped", flush=True)
    return fit


def _arithmetic_problems():
    problems = [(f"{a}+{b}=", a + b) for a in range(20) for b in range(20)]
    problems += [(f"{a}-{b}=", a - b) for a in range(20) for b in range(20)]
    problems += [(f"{a}*{b}=", a * b) for a in range(10) for b in range(10)]
    return problems


def _split_of(prompt):
    return "test" if hashlib.md5(prompt.encode()).digest()[0] < 26 else "train"  # ~10% held out


def synthetic_task(n, seed, split="train", task="synthetic"):
    """n examples of a synthetic task (data.train / data.eval name it; SYNTHETIC lists them); the first
    len(pool) are distinct, later ones cycle through the pool.
      synthetic                  {"prompt": "12+7=", "label": "19", "solution": "\\boxed{19}"}: 806 train / 94
                                 test problems, sums and differences of two numbers 0-19, products of two numbers 0-9
      synthetic:multiply         two-digit products for the calculator env (machinery.env.Calculator): 7343 train / 757
                                 test. {"prompt": "37*48=", "label": "1776", "tools": true, "solution":
                                 ["calc(37*48)", "\\boxed{1776}"]}, the model's turns of a tool trace; in the
                                 train split a quarter of the problems come without the tool ("tools": false,
                                 "solution": "\\boxed{1776}"), so that the warm-up also teaches answering directly
      synthetic:multiply-no-tool the same, every problem without the tool: what the model does in its head"""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if task not in SYNTHETIC:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {SYNTHETIC}")
    problems = _arithmetic_problems() if task == "synthetic" else \
        [(f"{a}*{b}=", a * b) for a in range(10, 100) for b in range(10, 100)]
    pool = [(p, a) for p, a in problems if _split_of(p) == split]
    random.Random(seed).shuffle(pool)
    picked = [pool[i % len(pool)] for i in range(n)]
    if task == "synthetic":
        return [{"prompt": p, "label": str(a), "solution": f"\\boxed{{{a}}}"} for p, a in picked]
    return _multiply_examples(picked, split, task)


SYNTHETIC = ("synthetic", "synthetic:multiply", "synthetic:multiply-no-tool")


SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
# GLM's layout (<|user|>...<|assistant|>) without the newlines: every token is one more step to learn.
TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


# The tool task's template also lists the env's tools (by name) in a system turn, and renders an env's
# observation as <|observation|>{content}: one more special token, which also ends a model turn (machinery/env.py).
TINY_TOOL_TEMPLATE = (
    "{%- if tools -%}<|system|>{%- for t in tools -%}{{ t['function']['name'] }}{%- endfor -%}{%- endif -%}"
    + TINY_CHAT_TEMPLATE)


def synthetic_tokenizer(task):
    """The tokenizer of a synthetic task's tiny model (model.init with model.tokenizer null): the tool tasks'
    has <|observation|>."""
    return make_tiny_tokenizer(tools=uses_tools(task))


def uses_tools(task):
    return task.startswith("synthetic:multiply")


def make_tiny_tokenizer(save_dir=None, tools=False):
    """A character-level fast tokenizer (102 tokens) with pad/eos and a chat template. tools: one more
    special token, <|observation|> (103 tokens), and a template that lists tools (the calculator task)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    special = SPECIAL_TOKENS + (["<|observation|>"] if tools else [])
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(chars) + special[len(SPECIAL_TOKENS):])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    core.decoder = decoders.Fuse()  # concatenate, no spaces in between
    core.add_special_tokens(special)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = TINY_TOOL_TEMPLATE if tools else TINY_CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


# -----------------------------------------------------------------------------
# 2. Chat templates


def render_prompt(tokenizer, prompt, chat_template=True, tools=None):
    """Prompt (a string or a list of messages) -> token ids ending where the response starts. tools: JSON
    schemas of an env's tools, for the template to list (machinery/env.py)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a list-of-messages prompt needs a chat template; set rollout.chat_template: true")
        return list(tokenizer.encode(prompt))  # a base model's default special tokens (BOS) apply
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "set rollout.chat_template: false to feed raw prompt text")
    return chat_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  **({"tools": tools} if tools else {})))


def chat_ids(ids):
    """apply_chat_template's ids as list[int]: transformers 5 returns a BatchEncoding, 4.x a plain list."""
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if len(ids) > 0 and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def prompt_lengths(tokenizer, examples, chat_template):
    """Token length of each example's rendered prompt, so that the trainer can check every prompt
    against rollout.max_prompt_tokens at start-up, before any work."""
    return [len(render_prompt(tokenizer, ex["prompt"], chat_template)) for ex in examples]


# -----------------------------------------------------------------------------
# 3. Rewards
# A reward function is any f(response_text, example) -> float, named as "module:function" and found
# by load_reward. The example is the whole row of the prompt file (load_rows keeps every field), so a custom
# reward can grade with metadata. The default, math_reward, grades a math answer against
# example["label"]: here what it grades (the last box after the reasoning); how it compares is section 7.


def load_reward(spec, answer_line=False):
    """The function named by spec, "module:function" (e.g. "data:math_reward"), checked to accept
    (response_text, example). Every problem is one ValueError line starting with "data.reward: ".
    answer_line (data.answer_line): the built-in math_reward also takes a final "Answer: ..." line; it is bound
    here (math_reward_answer_line), so that the hook keeps its two arguments. Any other function would ignore
    it: an error."""
    fn = load_object(spec, "data.reward")
    if answer_line:
        if fn is not math_reward:
            raise ValueError(f"data.answer_line: only the built-in data:math_reward reads it, and data.reward is "
                             f"{spec!r}; grade 'Answer:' lines in that function instead")
        return math_reward_answer_line
    if not callable(fn):
        raise ValueError(f"data.reward: {spec!r}: {spec.replace(':', '.')} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # some C callables have no signature to check; they are called as they are
    try:
        signature.bind("response", {"prompt": "p", "label": "l"})
    except TypeError as e:
        raise ValueError(f"data.reward: {spec!r}: {spec.replace(':', '.')}{signature} cannot be called as "
                         f"f(response_text, example): {e}") from None
    return fn


def load_object(spec, key):
    """What spec, "module:name", names: a reward function (data.reward) or an env class (data.env), from
    the working directory, the repository root or an installed package. Every problem is one ValueError
    line starting with the config key."""
    kind, example = ("class", '"machinery.env:Calculator" or "my_envs:Search"') if key == "data.env" else \
        ("function", '"data:math_reward" or "my_rewards:length_penalty"')

    def fail(what):
        return ValueError(f"{key}: {spec!r}: {what}")

    module_name, colon, fn_name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (colon and fn_name.isidentifier() and all(p.isidentifier() for p in module_name.split("."))):
        raise fail(f'expected "module:{kind}", e.g. {example}')
    # `python train.py` puts the script's folder on sys.path but not the working directory, and an
    # installed glm-rl makes only its own modules importable, not other files beside them: add both.
    # Appended, not prepended, so that a stray file in the working directory cannot shadow a library.
    for folder in (os.getcwd(), str(Path(__file__).resolve().parent)):
        if folder not in sys.path:
            sys.path.append(folder)
    importlib.invalidate_caches()  # find a module file written after an earlier import looked
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only "this module does not exist" is reported as such; a module that exists but imports a
        # missing dependency is an import failure like any other.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise fail(f"no module named '{e.name}' (searched the working directory {os.getcwd()}, "
                       "the repository root and the installed packages)") from None
        raise fail(f"importing {module_name} failed: {type(e).__name__}: {_one_line(e)}") from e
    except Exception as e:  # the module's own bug: keep its traceback as the cause
        raise fail(f"importing {module_name} failed: {type(e).__name__}: {_one_line(e)}") from e
    # Naming the file shows at once when a module of the same name elsewhere was imported instead.
    origin = getattr(module, "__file__", None) or "built-in"
    if not hasattr(module, fn_name):
        raise fail(f"module {module_name} ({origin}) has no {kind} '{fn_name}'; {_did_you_mean(module, fn_name, kind)}")
    return getattr(module, fn_name)


def math_reward(response, example, *, answer_line=False):
    """1.0 if the last \\boxed{} answer after the reasoning equals example["label"], else 0.0. answer_line
    (data.answer_line): a final "Answer: ..." line counts too, DAPO's format; of it and the last box, the one
    that comes later is the answer ("Answer: \\boxed{5}" is the box's 5). Never raises on what a model wrote or
    a dataset holds. Called the old way, with a label instead of the example, it raises TypeError: otherwise
    every response would silently score 0."""
    if not isinstance(example, dict) or "label" not in example:
        got = f"a dict with keys {list(example)}" if isinstance(example, dict) else type(example).__name__
        raise TypeError(f"math_reward(response, example): example must be a dict with a 'label' key "
                        f"(the whole example, not its label), got {got}")
    try:
        return 1.0 if _is_correct(response, example["label"], answer_line) else 0.0
    except Exception:
        return 0.0


def _is_correct(response, label, answer_line=False):
    if not isinstance(response, str) or not isinstance(label, str):
        return False
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return False  # still thinking when it hit the length limit: no answer yet
    answer, boxed_at = last_boxed(response), max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    line = last_answer_line(response) if answer_line else None
    if line is not None and (answer is None or line[0] > boxed_at):  # the later of the two (a box cut off: the line)
        answer = line[1]
    if answer is None:
        return False
    return _same_answer(answer, label)


def last_boxed(text):
    """Contents of the last \\boxed{...} / \\fbox{...} (or \\boxed 5); None if absent or unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    return _box_argument(text, start)


# -----------------------------------------------------------------------------
# 4. Token-budget batching
# A learner micro-batch holds as many samples as fit in max_tokens (dynamic batching), so GPU
# memory is flat whatever the response lengths. In the warm-up stages every rank draws the same batch
# and takes a share of equal token count (split_across_ranks); in RL each rank trains the groups it
# generated itself, so there the shares are equal in groups, not tokens.


def pack_by_tokens(lengths, max_tokens):
    """First-fit decreasing: indices of samples grouped into bins of total length <= max_tokens.
    A sample longer than the budget gets a bin of its own (it cannot be split)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])  # negative for an oversize sample: bin closed
    return bins


def spans(starts, lengths, device=None):
    """Flat indices of the spans [start, start + length) one after the other, without a Python loop:
    spans([0, 10], [2, 3]) = [0, 1, 10, 11, 12]."""
    starts, lengths = torch.as_tensor(starts), torch.as_tensor(lengths)
    ends = lengths.cumsum(0)
    return (torch.repeat_interleave(starts - ends + lengths, lengths) + torch.arange(int(ends[-1]))).to(device)


def split_across_ranks(lengths, world_size):
    """Greedy balance: longest sample first, each to the rank with the fewest tokens so far (ties:
    lowest rank). The busiest rank then carries at most the average load plus one sample's length.
    With fewer samples than ranks, the last ranks get empty lists; callers must still take part in
    collectives on those ranks."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ranks, load = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks


# -----------------------------------------------------------------------------
# 5. Evaluation metrics


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a product so
    large n never overflows: C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def eval_metrics(rewards_per_prompt, ks=(1, 4, 8, 16)):
    """rewards_per_prompt[p] = rewards of prompt p's samples. A sample counts as correct for
    pass@k when its reward is >= 1.0. Every prompt weighs the same; pass@k is reported for each k
    that every prompt has enough samples for."""
    if not rewards_per_prompt or any(len(r) == 0 for r in rewards_per_prompt):
        raise ValueError("eval_metrics needs at least one prompt and one sample per prompt")
    metrics = {"accuracy": sum(sum(r) / len(r) for r in rewards_per_prompt) / len(rewards_per_prompt)}
    n_min = min(len(r) for r in rewards_per_prompt)
    for k in ks:
        if k <= n_min:
            scores = [pass_at_k(len(r), sum(x >= 1.0 for x in r), k) for r in rewards_per_prompt]
            metrics[f"pass@{k}"] = sum(scores) / len(scores)
    return metrics


# -----------------------------------------------------------------------------
# 6. The prompt stream


class PromptStream:
    """Hands out examples in an endless sequence of epochs, each one reshuffled with seed + epoch.
    The state is two integers, so a resumed run continues with exactly the prompts it would have
    seen had it never stopped."""

    def __init__(self, examples, seed=0, shuffle=True):
        if len(examples) == 0:
            raise ValueError("PromptStream needs at least one example")
        self.examples, self.seed, self.shuffle = list(examples), seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self):
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self, n):
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            take = min(n - len(out), len(self._order) - self.position)
            out += [self.examples[i] for i in self._order[self.position:self.position + take]]
            self.position += take
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_examples": len(self.examples)}

    def load_state_dict(self, state):
        if state["num_examples"] != len(self.examples):
            raise ValueError(f"PromptStream state was saved with {state['num_examples']} examples but the "
                             f"dataset now has {len(self.examples)}; resume with the same prompt file")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()


# =============================================================================
# Above: what the default run uses. Below: how its grader compares answers, which the run reaches once its
# model writes boxes; then what only other runs use (answer lines, prompt files, the calculator tasks).


# -----------------------------------------------------------------------------
# 7. Grading in detail: reading the box, comparing the answer with the label


def _box_argument(text, start):
    """The argument of the \\boxed or \\fbox at text[start]: a {...} group (in which \\{ and \\} are literal braces), or
    the next run of non-space characters (\\boxed 5); None if there is none or the group is unbalanced."""
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    j = i
    while j < len(text) and text[j] == " ":
        j += 1
    if j == len(text):
        return None
    if text[j] != "{":  # "\boxed 5": the argument is the next run of non-space characters
        if j == i:
            return None  # "\boxedfoo" is some other command
        m = re.match(r"[^\s$]+", text[j:])
        return m.group(0).rstrip(".") if m else None
    depth = 0
    k = j
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2  # \{ and \} are literal braces (sets), not grouping
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
        k += 1
    return None  # unbalanced: the response was cut off inside the box


def _same_answer(answer, label):
    """Whether a response's answer equals the label (itself maybe boxed): the same string once both are normalised,
    the same decimal number, or else (what is safe to hand to sympy) the same value for math-verify, under a
    deadline (section 8)."""
    if "\\boxed" in label or "\\fbox" in label:
        label = last_boxed(label) or label
    a, b = normalize_answer(answer), normalize_answer(label)
    if not a or not b:
        return False
    if a == b:
        return True
    if _is_decimal(a) and _is_decimal(b):
        return Decimal(a) == Decimal(b)  # the common case (integer answers) needs no sympy
    if not (_safe_for_sympy(answer) and _safe_for_sympy(label)):
        return False
    return _with_deadline(_symbolic_equal, answer, label)


_UNIT_WRAPPER = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(\^\{?\d\}?)?\s*$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def normalize_answer(s):
    """A cheap canonical form, so that most equal answers match without sympy. Both sides go
    through it, so it only has to be consistent, not perfect."""
    s = s.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    for junk in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(junk, "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _UNIT_WRAPPER.sub("", s)  # 5\text{ cm} -> 5 (the label carries no units)
    s = _TEXT_WRAPPER.sub(r"\1", s)  # \text{(B)} -> (B)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]=(?!=)", "", s)  # x=3 -> 3
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt2
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # 1,000 -> 1000
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # .5 -> 0.5
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")  # 5.50 -> 5.5, 3.0 -> 3
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def _is_decimal(s):
    return re.fullmatch(r"-?\d+(\.\d+)?", s) is not None


# -----------------------------------------------------------------------------
# 8. The symbolic check: math-verify behind guards, under a deadline (the module docstring says why)


SYMBOLIC_TIMEOUT_S = 3.0   # deadline for one math-verify check (normal checks take milliseconds)
MAX_SYMBOLIC_CHARS = 300   # longer answers get no symbolic check: real answers are short
MAX_NESTING = 12           # parsing time grows steeply with bracket depth
MAX_STUCK_CHECKS = 4       # timed-out checks still running; at this many, skip symbolic checks until they drain


def _safe_for_sympy(s):
    """Refuse what could make sympy build an astronomically large number. Big integer arithmetic
    runs in C while holding the GIL, so neither a deadline nor signal.alarm could stop it."""
    if len(s) > MAX_SYMBOLIC_CHARS:
        return False
    s = s.replace("\\!", "")  # a thin space, not a factorial
    depth = deepest = 0
    for c in s:
        depth += c in "{[("
        depth -= c in "}])"
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        return False
    if "**" in s or re.search(r"(\d{4,}|\^\s*\d+|[^\w\s])\s*!", s):
        return False  # python powers, 10000!, (10!)!, 10^6!
    for m in re.finditer(r"\^\s*", s):  # every exponent: no towers, no big numbers
        exponent, end = _group_at(s, m.end())
        if exponent is None or re.search(r"[\^!]|\\binom|\\choose", exponent):
            return False  # 2^{10^{10}}, 2^{100!}
        if sum(c.isdigit() for c in exponent) > 4 or s[end:].lstrip().startswith("^"):
            return False  # 9^{99999}, 9^{999\cdot 999}, 2^2^2^2
    return True


def _group_at(s, i):
    """The exponent starting at s[i]: a {...} group, a number, a \\command or one character."""
    if s.startswith("{", i):
        depth = 0
        for k in range(i, len(s)):
            depth += (s[k] == "{") - (s[k] == "}")
            if depth == 0:
                return s[i + 1:k], k + 1
        return None, len(s)
    m = re.match(r"\d+|\\[a-zA-Z]+|\S", s[i:])
    return (m.group(0), i + m.end()) if m else (None, len(s))


def _symbolic_equal(answer, label):
    # Per math-verify's docs the gold answer goes in $...$ (or \boxed{}); both timeouts are
    # disabled because they rely on signal.alarm, which fails outside the main thread.
    gold = parse(f"${label}$", parsing_timeout=None)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)


_stuck = []  # threads whose check missed its deadline and is still running
_stuck_lock = threading.Lock()


def _with_deadline(fn, *args):
    """Run fn(*args) in a daemon thread and wait at most SYMBOLIC_TIMEOUT_S. A late check is
    abandoned (counted wrong) and finishes in the background; if too many pile up, symbolic
    checking is skipped until they drain, so a bad batch cannot eat the CPU."""
    with _stuck_lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        if len(_stuck) >= MAX_STUCK_CHECKS:
            return False
    result = []

    def run():
        try:
            result.append(bool(fn(*args)))
        except Exception:
            result.append(False)

    worker = threading.Thread(target=run, daemon=True, name="math-verify")
    worker.start()
    worker.join(SYMBOLIC_TIMEOUT_S)
    if worker.is_alive():
        log.warning("math_reward: symbolic check of %r vs %r timed out after %.1fs; counted as wrong",
                    args[0][:80], args[1][:80], SYMBOLIC_TIMEOUT_S)
        with _stuck_lock:
            _stuck.append(worker)
        return False
    return bool(result and result[0])


# -----------------------------------------------------------------------------
# 9. DAPO's answer line (data.answer_line)


def math_reward_answer_line(response, example):
    """math_reward that also takes a final "Answer: ..." line: what load_reward returns for data:math_reward
    with data.answer_line: true (a named function, so that warnings name it)."""
    return math_reward(response, example, answer_line=True)


# DAPO's own grader (verl's math_dapo.py) reads the rest of the line after "Answer:", in any case, or the next
# non-blank line if that is empty: Answer\s*:\s*([^\n]+). Here, of the last "Answer:" in the text (DAPO's takes
# the last match, and so the first "Answer:" of a line that holds two).
_ANSWER_HEAD = re.compile(r"(?i)Answer\s*:")
_ANSWER_REST = re.compile(r"\s*([^\n]+)")


def last_answer_line(text):
    """(offset, answer) of the last "Answer: ..." in text (DAPO's prompts ask for a last line "Answer: 34"), or
    None: the rest of its line, stripped of whitespace, surrounding $ (or ** bold) and a trailing period."""
    head = None
    for head in _ANSWER_HEAD.finditer(text):
        pass
    rest = head and _ANSWER_REST.match(text, head.end())
    if not rest:
        return None
    answer, before = rest.group(1), None
    while answer != before:  # "$\frac{1}{2}$." -> \frac{1}{2}
        before = answer
        answer = answer.strip().removesuffix(".").strip("*").strip()
        if len(answer) >= 2 and answer[0] == answer[-1] == "$":
            answer = answer[1:-1]
    return (head.start(), answer) if answer else None


# -----------------------------------------------------------------------------
# 10. Prompt files
# A prompt file is JSONL, one JSON object per line (a .json file may hold one JSON array of them instead), or
# Parquet (.parquet, one row per problem, nested structs as dicts): {"prompt": str | [{"role": ..., "content": ...}, ...], "label": str, ...}. An example is the whole
# object, every field kept (a custom reward may grade with metadata such as "difficulty" or test cases), plus the
# normalised fields the rest of the code reads: "prompt", "label" (a string) and, for the supervised stage,
# "solution" (the reference response). The keys naming them (data.prompt_key, ...) may be paths into nested
# objects, as DAPO-Math-17k's "reward_model.ground_truth": a top-level key of exactly that name wins, else each
# dot goes one level down.

# A JSONL line is one problem: even long ones are kilobytes. A 200 MB line used to be read whole
# and then OOM-killed the tokenizer with no message; now reading stops at this size, with file:line.
MAX_LINE_BYTES = 8 * 2**20
MAX_JSON_BYTES = 256 * 2**20  # a .json file holding one JSON array is read whole: eval sets, not training corpora
PARQUET_BATCH_ROWS = 1024  # Parquet is read this many rows at a time: memory holds the rows kept, not the file


def load_rows(path, prompt_key="prompt", label_key="label", response_key=None, *, dedup=False, verbose=False):
    """The examples of a prompt file (or of several, a list of paths, read in order), each row checked: JSONL, or
    Parquet by its .parquet extension. Every problem is one ValueError naming file:line (Parquet: file:row N,
    counting from 1) and what is wrong. dedup: drop each row whose prompt repeats an earlier row's, keeping the
    first (with prompt_key None, as with data.env, rows that repeat whole); verbose: then say how many, in one line."""
    paths = [Path(path)] if isinstance(path, (str, os.PathLike)) else [Path(p) for p in path]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such file (expected a JSONL or Parquet prompt file of "
                                    f'{{"{prompt_key}": ..., "{label_key}": ...}} objects)')
    # (key in the file, normalised field it is copied to, parameter naming it); a copy must never
    # overwrite another field of the object.
    copies = [(k, field, param) for k, field, param in [(prompt_key, "prompt", "prompt_key"),
                                                        (label_key, "label", "label_key")]
              if k is not None]  # None (with data.env): the env reads what it needs
    if response_key is not None:
        copies.append((response_key, "solution", "response_key"))
    # A repeated prompt is compared by its JSON text (a messages list with sorted keys), and its first row is
    # the one kept. Repeats whose label differs from that row's are counted apart: the file gives two answers
    # to one problem, and only the first one is graded against.
    examples, seen, rows, other_label = [], {}, 0, 0
    for p in paths:
        parquet = p.suffix.lower() == ".parquet"
        rows_before = rows
        for where, obj in _parquet_rows(p) if parquet else _json_rows(p) if p.suffix.lower() == ".json" else _jsonl_rows(p):
            rows += 1
            example = _example(obj, where, copies)
            if dedup:
                key = json.dumps(obj if prompt_key is None else example["prompt"], sort_keys=True, default=str)
                if key in seen:
                    other_label += seen[key] != example.get("label")
                    continue
                seen[key] = example.get("label")
            examples.append(example)
        if rows == rows_before:
            raise ValueError(f"{p}: file is empty (expected at least one {'row' if parquet else 'JSON object'})")
    if dedup and verbose:
        name = f"{paths[0]}" + (f" (+{len(paths) - 1} more)" if len(paths) > 1 else "")
        print(f"[data] {name}: {rows} rows, {len(examples)} unique prompts: {rows - len(examples)} repeats dropped"
              + (f", {other_label} of them with another label than the first row's (kept)" if label_key else ""),
              flush=True)
    return examples


def _file_examples(path, own, keys, split, *, sft, openings, files_of, verbose):
    """load_examples' rows of a prompt file (or of a Hub dataset's files): the source's own keys win over the data
    section's, and the reference response is read only where the supervised stage needs it (sft, train split)."""
    response = keys.response_key if split == "train" and sft else None
    prompt_key, label_key = own.get("prompt_key", keys.prompt_key), own.get("label_key", keys.label_key)
    key = "data.train" if split == "train" else "data.eval"
    files = files_of(path, key) if files_of else [path]  # a Hub id: its cached files
    return load_rows(files, None if openings else prompt_key, None if openings else label_key, response,
                     dedup=keys.dedup, verbose=verbose)


def _jsonl_rows(path):
    """(file:line, object) of each non-blank line of a JSONL file."""
    with open(path, "rb") as f:  # bytes: readline's limit counts bytes, and bad UTF-8 gets file:line
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)  # never more than the limit in memory at once
            if not raw:
                break
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ValueError(f"{where}: line is longer than {_size(MAX_LINE_BYTES)} "
                                 "(data.MAX_LINE_BYTES); expected one JSON object per line, is this a JSONL file?")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset "
                                 f"{e.start} of the line); expected UTF-8 JSON text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}); expected one object per line") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _json_rows(path):
    """(file:item N, object) of a .json file holding one JSON array of objects (as some Hub datasets ship their
    sets); a .json file that is really JSONL (as others do) is read as JSONL."""
    with open(path, "rb") as f:
        if not f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
            yield from _jsonl_rows(path)
            return
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: a JSON array larger than {_size(MAX_JSON_BYTES)} (data.MAX_JSON_BYTES) is read "
                         "whole; write it as JSONL (one object per line) instead")
    try:
        with open(path, encoding="utf-8-sig") as f:
            items = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({_one_line(e)}); expected an array of objects or JSONL") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON array of objects, got {type(items).__name__}")
    for i, obj in enumerate(items, 1):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:item {i}: expected a JSON object, got {type(obj).__name__}")
        yield f"{path}:item {i}", obj


def _parquet_rows(path):
    """(file:row N, row as a dict) of each row of a Parquet file, read PARQUET_BATCH_ROWS rows at a time."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading a Parquet file needs pyarrow: pip install pyarrow") from None
    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", obj
    except (pyarrow.ArrowException, OSError) as e:  # not Parquet at all, a corrupt page, a type pyarrow cannot read
        raise ValueError(f"{path}: cannot be read as Parquet ({_one_line(e)})") from None


def _lookup(obj, key, where):
    """obj's value at key: a top-level key of exactly that name, else a path through nested objects
    ("reward_model.ground_truth"). A missing key, or path part, is one error naming it."""
    if key in obj:
        return obj[key]
    value, walked = obj, []
    for part in key.split("."):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: missing key '{key}': '{'.'.join(walked)}' is a {type(value).__name__}, "
                             f"not an object")
        if part not in value:
            if "." not in key:
                raise ValueError(f"{where}: missing key '{key}' (keys present: {sorted(value)})")
            inside = f"in '{'.'.join(walked)}'" if walked else "at the top level"
            raise ValueError(f"{where}: missing key '{key}': no '{part}' {inside} (keys present: {sorted(value)})")
        value = value[part]
        walked.append(part)
    return value


def _example(obj, where, copies):
    """A row as an example: every field kept, the normalised fields (copies) added and checked."""
    values = {field: _lookup(obj, key, where) for key, field, _ in copies}
    for key, field, param in copies:
        # Replacing the key's own top-level field is no loss ("prompt.text" makes the prompt its text); any
        # other field of that name would be overwritten.
        root = key if key in obj else key.split(".")[0]
        if field in obj and root != field:
            raise ValueError(f"{where}: has both '{key}' (the {param}) and a '{field}' field; copying "
                             f"'{key}' to '{field}' would overwrite it, so rename one of them")
    example = dict(obj)
    for key, field, _ in copies:
        value = values[field]
        if field == "prompt" and not (isinstance(value, str) or _is_messages(value)):
            raise ValueError(f"{where}: '{key}' must be a string or a list of "
                             f'{{"role": str, "content": str}} messages, got {type(value).__name__}')
        if field == "label":
            # Labels like 42 are often stored as numbers; the grader compares strings.
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"{where}: '{key}' must be a string or a number, got {type(value).__name__}")
            value = str(value)
        if field == "solution" and not (isinstance(value, str) or (isinstance(value, list) and value and all(
                isinstance(t, str) for t in value))):
            raise ValueError(f"{where}: '{key}' must be a string (the reference response) or, with data.env, "
                             f"a list of strings (the model's turns), got {type(value).__name__}")
        example[field] = value
    return example


def _is_messages(x):
    return (isinstance(x, list) and len(x) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in x))


def _size(n):
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"


def _one_line(e):
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:300] + "..."


# -----------------------------------------------------------------------------
# 11. The rarer branches of sections 1 and 3: the calculator tasks' examples, load_object's hint


def _multiply_examples(picked, split, task):
    """synthetic_task's examples of the two-digit multiplication tasks, from its (prompt, answer) picks: with the
    tool ("tools": true), the solution is the model's turns of a tool trace."""
    out = []
    for p, a in picked:
        tools = task == "synthetic:multiply" and (split == "test" or hashlib.md5(p.encode()).digest()[1] % 4 != 0)
        solution = [f"calc({p[:-1]})", f"\\boxed{{{a}}}"] if tools else f"\\boxed{{{a}}}"
        out.append({"prompt": p, "label": str(a), "tools": tools, "solution": solution})
    return out


def _did_you_mean(module, name, kind):
    """load_object's hint when a module has no such name: the closest public name, else what it has."""
    public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
    close = difflib.get_close_matches(name, public, n=1)
    return (f"did you mean '{close[0]}'?" if close else
            f"it has: {', '.join(public[:10])}{', ...' if len(public) > 10 else ''}" if public else
            f"it defines no public {kind}es" if kind == "class" else "it defines no public functions")

"""
The repository's layout, checked: the things README.md and docs/design.md promise about where code lives.

1. The root holds exactly the six tutorial chapters (model, dsa, grpo, data, rollout, train).py; the machinery
   lives in the package machinery/, the GPU kernels in kernels/, the model families beside GLM-4's dense one in
   families/.
2. The import rule. docs/design.md states, in a fenced block whose info string is `imports`, which layer may
   import which (see EXAMPLE_RULE below for the format). Every import in a chapter and in the packages (PACKAGES:
   function-level ones too, they are edges all the same) must follow it, every such file must belong to a
   layer, and the project's module graph must have no cycle.
3. Every backticked code name in README.md and docs/design.md still exists: file paths, config keys and Python
   names. The docs are the first thing a reader trusts, and a rename or a move silently breaks them.
4. README.md's line ranges (`file.py:a-b`, the route of one RL step) still hold what their row names: each named
   function or class is defined inside them, and each range starts at a definition, a docstring or a section
   comment and ends where a block does.

Everything is read with `ast` and plain text parsing; nothing is imported except machinery.config (for its
config_keys()). The helpers are plain functions, so the checkers are themselves tested here against small
planted trees and texts: each check is shown to fail on what it exists to catch.
"""
import ast
import builtins
import fnmatch
import functools
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = {"model.py", "dsa.py", "grpo.py", "data.py", "rollout.py", "train.py"}
PACKAGES = ("machinery", "kernels", "families")  # the directories whose files the import rule covers, beside the root's
DOCS = ("README.md", "docs/design.md")


# ----------------------------------------------------------------------------------------------------------
# 1. The root holds exactly the six chapters


def test_root_holds_exactly_the_six_chapters():
    found = {p.name for p in ROOT.glob("*.py")}
    extra, missing = sorted(found - CHAPTERS), sorted(CHAPTERS - found)
    assert not extra and not missing, (
        "the repository root must hold exactly the six chapters " + ", ".join(sorted(CHAPTERS))
        + (f"; not chapters (move them into machinery/ or kernels/): {', '.join(extra)}" if extra else "")
        + (f"; missing: {', '.join(missing)}" if missing else ""))


# ----------------------------------------------------------------------------------------------------------
# 2. The import rule

# The format of the block in docs/design.md, and the rule it stated when this test was written: one layer per
# line, `name: globs -> layers it may import`; a module may always import modules of its own layer.
EXAMPLE_RULE = """\
```imports
train:     train.py       -> rollout, machinery, model, dsa, grpo, data, kernels
rollout:   rollout.py     -> machinery, model, dsa, grpo, data
machinery: machinery/*.py -> model, dsa, kernels, grpo, data
model:     model.py       -> dsa, kernels
dsa:       dsa.py         -> kernels
kernels:   kernels/*.py   ->
grpo:      grpo.py        ->
data:      data.py        ->
```
"""


def read_rule(text):
    """The ```imports block of a markdown text -> {layer: (globs, layers it may import)}, in the block's order.
    Raises ValueError, saying what is wrong, on a missing block or a malformed line."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.fullmatch(r"\s*```imports\s*", line)), None)
    if start is None:
        raise ValueError("no fenced code block whose info string is `imports` (a line ```imports)")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("```")), None)
    if end is None:
        raise ValueError(f"the ```imports block opened at line {start + 1} is never closed")
    rule = {}
    for n in range(start + 1, end):
        line = lines[n].split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*:\s*(.*?)\s*->\s*(.*)", line)
        if not m:
            raise ValueError(f"line {n + 1} of the imports block is not `layer: globs -> layers`: {lines[n]!r}")
        name, globs, deps = m.group(1), m.group(2).replace(",", " ").split(), m.group(3).replace(",", " ").split()
        if name in rule:
            raise ValueError(f"line {n + 1}: layer {name} is defined twice")
        if not globs:
            raise ValueError(f"line {n + 1}: layer {name} names no files")
        rule[name] = (tuple(globs), tuple(deps))
    for name, (_, deps) in rule.items():
        unknown = [d for d in deps if d not in rule]
        if unknown:
            raise ValueError(f"layer {name} may import {', '.join(unknown)}, which the block does not define")
    if not rule:
        raise ValueError("the imports block defines no layer")
    return rule


def glob_matches(path, pattern):
    """fnmatch per path segment, so that `machinery/*.py` does not match machinery/sub/x.py."""
    a, b = path.split("/"), pattern.split("/")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def layers_of(path, rule):
    return [name for name, (globs, _) in rule.items() if any(glob_matches(path, g) for g in globs)]


def project_files(root):
    """The files the import rule covers: the root's .py files and every .py file under the packages."""
    files = [p for p in root.glob("*.py")]
    for package in PACKAGES:
        files += [p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(p.relative_to(root).as_posix() for p in files)


def module_file(root, dotted, exact=True):
    """A dotted module name -> the project file that holds it (a relative posix path), or None when it is not
    the project's (stdlib, third-party). A package dir resolves to its __init__.py, present or not (a namespace
    package still has a name). exact=False: the longest prefix that is a project module."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:k])
        rel = "/".join(parts[:k])
        if base.with_suffix(".py").is_file():
            return rel + ".py"
        if base.is_dir() and any(base.glob("*.py")):
            return rel + "/__init__.py"
        if exact:
            return None
    return None


def imports_of(root, path):
    """Every import anywhere in a file (function-level too) that names a project module: [(line, target)]."""
    tree = ast.parse((root / path).read_text(), filename=path)
    package = path.split("/")[:-1]
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = module_file(root, alias.name, exact=False)
                if target:
                    edges.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's own package, up level - 1
                base = package[:len(package) - (node.level - 1)] if node.level - 1 else package
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                # `from machinery import fp8` imports the module machinery/fp8.py; `from machinery import
                # ConfigError` imports a name from machinery/__init__.py
                target = (alias.name != "*" and module and module_file(root, f"{module}.{alias.name}")) or (
                    module and module_file(root, module, exact=False))
                if target:
                    edges.append((node.lineno, target))
    return [(line, target) for line, target in edges if target != path]


def import_graph(root):
    return {path: imports_of(root, path) for path in project_files(root)}


def rule_violations(root, rule):
    """Every edge the rule does not allow and every file in no layer (or in two), as lines to print."""
    problems = []
    for path, edges in import_graph(root).items():
        mine = layers_of(path, rule)
        if len(mine) != 1:
            problems.append(f"{path}: in {'no layer' if not mine else 'layers ' + ', '.join(mine)} of the rule")
            continue
        allowed = set(rule[mine[0]][1]) | {mine[0]}
        for line, target in edges:
            theirs = layers_of(target, rule)
            if not theirs:
                problems.append(f"{path}:{line} -> {target}: {target} is in no layer")
            elif not set(theirs) & allowed:
                problems.append(f"{path}:{line} -> {target}: layer {mine[0]} may not import layer {theirs[0]}"
                                f" (it may import: {', '.join(sorted(allowed))})")
    return problems


def find_cycles(graph):
    """One cycle per strongly connected component of more than one module (Tarjan), each as
    [(file, line of its import of the next file), ...]; [] when the graph is acyclic."""
    succ = {a: sorted({t for _, t in edges}) for a, edges in graph.items()}
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):  # the graphs are tens of nodes: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(set(scc))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    cycles = []
    for scc in sccs:  # a shortest path back to the start, inside the component (BFS)
        start = min(scc)
        parent, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in succ[v]]:
            nxt = []
            for v in frontier:
                for w in succ[v]:
                    if w in scc and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in succ[v])
        path = [last]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
        path.reverse()  # start ... last, and last imports start
        cycles.append([(a, min(line for line, t in graph[a] if t == b)) for a, b in zip(path, path[1:] + [start])])
    return cycles


def format_cycle(cycle):
    return " -> ".join(f"{a} (line {line})" for a, line in cycle) + f" -> {cycle[0][0]}"


def test_import_rule_parser_reads_the_example():
    rule = read_rule("Some prose.\n\n" + EXAMPLE_RULE + "\nMore prose.\n")
    assert list(rule) == ["train", "rollout", "machinery", "model", "dsa", "kernels", "grpo", "data"]
    assert rule["train"] == (("train.py",), ("rollout", "machinery", "model", "dsa", "grpo", "data", "kernels"))
    assert rule["machinery"] == (("machinery/*.py",), ("model", "dsa", "kernels", "grpo", "data"))
    assert rule["model"] == (("model.py",), ("dsa", "kernels"))
    assert rule["kernels"] == (("kernels/*.py",), ())
    assert layers_of("machinery/engine.py", rule) == ["machinery"]
    assert layers_of("machinery/sub/engine.py", rule) == [] and layers_of("engine.py", rule) == []
    # comments, and what a malformed or missing block says
    assert read_rule("```imports\na: a.py -> b  # a comment\n# only a comment\nb: b/*.py ->\n```")["a"] == (
        ("a.py",), ("b",))
    with pytest.raises(ValueError, match="no fenced code block"):
        read_rule("```python\nimport x\n```\n")
    with pytest.raises(ValueError, match="does not define"):
        read_rule("```imports\na: a.py -> nowhere\n```")
    with pytest.raises(ValueError, match="not `layer: globs -> layers`"):
        read_rule("```imports\na a.py b\n```")


def _tree(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_import_checker_flags_planted_violations(tmp_path):
    rule = read_rule(EXAMPLE_RULE)
    _tree(tmp_path, {
        "model.py": "import torch\nimport dsa\nfrom kernels import dsa_triton\n",
        "dsa.py": "import os\nfrom kernels.dsa_triton import sample\n",
        "grpo.py": "", "data.py": "", "train.py": "import rollout\nfrom machinery import engine\n",
        "rollout.py": "from machinery.engine import SamplingParams\nfrom data import math_reward\n",
        "machinery/__init__.py": "class ConfigError(ValueError):\n    pass\n",
        "machinery/engine.py": "import model\nfrom machinery import ConfigError\nfrom . import lora\n",
        "machinery/lora.py": "def load():\n    from model import GLM\n",
        "kernels/__init__.py": "", "kernels/dsa_triton.py": "import triton\n",
    })
    assert rule_violations(tmp_path, rule) == []
    assert imports_of(tmp_path, "machinery/engine.py") == [
        (1, "model.py"), (2, "machinery/__init__.py"), (3, "machinery/lora.py")]
    # upward edges, one of them inside a function, and files that match no layer
    _tree(tmp_path, {
        "machinery/x.py": "import os\n\ndef f():\n    import rollout\n",
        "kernels/y.py": "from model import GLM\n",
        "machinery/sub/z.py": "",
        "dsa.py": "from machinery import fp8\n",
        "machinery/fp8.py": "",
    })
    problems = rule_violations(tmp_path, rule)
    assert any(p.startswith("machinery/x.py:4 -> rollout.py: layer machinery may not import layer rollout")
               for p in problems), problems
    assert any(p.startswith("kernels/y.py:1 -> model.py: layer kernels may not import layer model")
               for p in problems), problems
    assert any(p.startswith("dsa.py:1 -> machinery/fp8.py: layer dsa may not") for p in problems), problems
    assert "machinery/sub/z.py: in no layer of the rule" in problems
    assert len(problems) == 4, problems


def test_cycle_finder_catches_a_planted_cycle(tmp_path):
    _tree(tmp_path, {"a.py": "import b\n", "b.py": "import os\n\ndef f():\n    from machinery import c\n",
                     "machinery/c.py": "import a\n", "d.py": "import a\n"})
    cycles = find_cycles(import_graph(tmp_path))
    assert [format_cycle(c) for c in cycles] == [
        "a.py (line 1) -> b.py (line 4) -> machinery/c.py (line 1) -> a.py"]
    (tmp_path / "machinery/c.py").write_text("import d\n")  # the cycle through d, now
    assert [format_cycle(c) for c in find_cycles(import_graph(tmp_path))] == [
        "a.py (line 1) -> b.py (line 4) -> machinery/c.py (line 1) -> d.py (line 1) -> a.py"]
    (tmp_path / "d.py").write_text("import os\n")
    assert find_cycles(import_graph(tmp_path)) == []


def test_imports_follow_the_rule_in_design_md():
    try:
        rule = read_rule((ROOT / "docs/design.md").read_text())
    except ValueError as e:
        pytest.fail(f"docs/design.md states no import rule this test can read: {e}. It must contain a block "
                    f"in this format:\n{EXAMPLE_RULE}")
    problems = rule_violations(ROOT, rule)
    assert not problems, "imports that break the rule in docs/design.md's ```imports block:\n  " + "\n  ".join(
        problems)


def test_module_graph_is_acyclic():
    cycles = find_cycles(import_graph(ROOT))
    assert not cycles, "import cycles among the project's modules (function-level imports count):\n  " + \
        "\n  ".join(format_cycle(c) for c in cycles)


# ----------------------------------------------------------------------------------------------------------
# 3. Every backticked code name in README.md and docs/design.md still exists

CONFIG_SECTIONS = {"model", "data", "rollout", "grpo", "optim", "train", "distill"}
# Dict-valued config keys whose sub-keys are a dataclass's fields (`model.lora.rank`): machinery/lora.py's
# LoRAConfig, dsa.py's DSAConfig, model.py's GLMConfig. Other dict keys (`data.eval.<name>`) take any sub-key.
DICT_SCHEMAS = {"model.lora": "LoRAConfig", "model.dsa": "DSAConfig", "model.init": "GLMConfig"}
# Where Python definitions are looked up (bench/ scripts are named in the docs too)
DEFINITION_DIRS = ("", "machinery", "kernels", "families", "bench")
# Where a bare file name (`tiny_cpu.yaml`, `conftest.py`) may live
FILE_DIRS = ("", "machinery", "kernels", "families", "bench", "tests", "configs", "docs")
FILE_SUFFIXES = (".py", ".yaml", ".md", ".sh", ".png")
# A path under one of these is a repo path
REPO_DIRS = {"configs", "bench", "docs", "machinery", "kernels", "families", "tests", ".ci"}
# Outputs of a run, never in the repository
RUN_DIRS = {"runs", "run_dir", "checkpoints", "rollouts", "init_model", "reference", "lora_base", "env_failures"}
RUN_FILES = {"config.yaml"}  # run_dir/config.yaml
OTHER_FILE_SUFFIXES = {"json", "jsonl", "pt", "safetensors", "parquet", "txt", "log"}  # `state.pt`: not code
# Third-party modules: a dotted name starting with one (`torch.topk`, `sglang.Engine`) is not ours to check
THIRD_PARTY_MODULES = {"torch", "transformers", "sglang", "peft", "triton", "tl", "wandb", "numpy", "np",
                       "huggingface_hub", "safetensors", "yaml", "math_verify", "os", "sys"}
# Third-party names the docs mention bare, each with where it comes from
THIRD_PARTY_NAMES = {
    "Glm4ForCausalLM",  # transformers' GLM-4 model
    "apply_chat_template", "from_pretrained", "save_pretrained",  # transformers
    "scaled_mm",  # torch._scaled_mm, the block-scaled fp8 matmul
    "full_tensor", "no_sync", "detach", "resize_", "get_slice",  # torch DTensor / DDP / Tensor; safetensors
    "update_weights_from_tensor", "release_memory_occupation", "resume_memory_occupation",  # sglang.Engine
    "output_token_logprobs", "finish_reason",  # sglang's output fields
    "quantization_config",  # a Hugging Face config.json field
    "exp",  # torch.exp, in prose about the loss
}
YAML_VALUES = {"null", "true", "false"}


class Index:
    """What the project's Python defines, read with ast from DEFINITION_DIRS (and tests/ for test names)."""

    def __init__(self, root):
        self.root = root
        # "engine" and "machinery.engine" -> "machinery/engine.py"; bench/engine.py is only "bench.engine"
        self.modules = {}
        self.file_defs = {}  # file -> the names it defines (Index._read)
        self.classes = {}  # class name -> [(members, base names)]
        self.defined = set(PACKAGES) | {"bench"}  # every name defined anywhere, and every module name
        self.mentioned = set()  # identifier-shaped names a doc may name without defining them: parameters,
        # local variables, string constants (config values, metric keys, environment variables)
        for d in DEFINITION_DIRS:
            for p in sorted((root / d).glob("*.py")):
                rel = p.relative_to(root).as_posix()
                stem = p.stem if p.stem != "__init__" else d
                dotted = f"{d}.{stem}" if d and p.stem != "__init__" else (stem or d)
                self.modules[dotted] = rel
                if d != "bench":
                    self.modules.setdefault(stem, rel)
                self.defined.add(stem)
                self._read(rel, ast.parse(p.read_text(), filename=rel))
        for p in sorted((root / "tests").glob("test_*.py")):
            tree = ast.parse(p.read_text())
            self.defined |= {n.name for n in ast.walk(tree)
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}

    def _read(self, rel, tree):
        """A file's definitions: functions, classes, methods, names assigned or imported at module or class
        level, dataclass fields, self.x attributes. Names local to a function only count as mentioned."""
        local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 for stmt in ([f.body] if isinstance(f, ast.Lambda) else f.body) for n in ast.walk(stmt)}
        defs = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.add(node.name)
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append((class_members(node), [
                    b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {(a.asname or a.name).split(".")[0] for a in node.names}
                (self.mentioned if id(node) in local else defs).update(names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                (self.mentioned if id(node) in local else defs).add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defs.add(node.attr)  # self.x = ...
            elif isinstance(node, ast.arg):
                self.mentioned.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                self.mentioned.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                self.mentioned.add(node.value)
        self.file_defs[rel] = defs
        self.defined |= defs

    def module(self, dotted):
        return self.modules.get(dotted)

    def class_has(self, name, member, seen=()):
        """Whether a project class of that name, or a project base class of it, defines the member (an
        inherited third-party member counts when it is in THIRD_PARTY_NAMES)."""
        for members, bases in self.classes.get(name, []):
            if member in members:
                return True
            if any(b in self.classes and b not in seen and self.class_has(b, member, seen + (name,)) for b in bases):
                return True
        return member in THIRD_PARTY_NAMES


def class_members(node):
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, ast.Assign):
            members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)  # dataclass fields
    for sub in ast.walk(node):  # self.x = ... in its methods
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                isinstance(sub.value, ast.Name) and sub.value.id == "self":
            members.add(sub.attr)
    return members


@functools.lru_cache(maxsize=None)
def project_index():
    return Index(ROOT)


@functools.lru_cache(maxsize=None)
def config_schema():
    """(every dotted config key, {key: True where it is dict-valued}, an error text or None)."""
    try:
        from machinery import config
    except Exception as e:  # noqa: BLE001: any import failure is reported by the test, in one line
        return set(), {}, f"{type(e).__name__}: {e}"
    keys = set(config.config_keys()) | set(config.REMOVED)
    dict_keys = {}

    def walk(cls, prefix):
        for f in config.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if config.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            else:
                dict_keys[prefix + f.name] = hint is dict or dict in typing.get_args(hint) or \
                    typing.get_origin(hint) is dict
    walk(config.Config, "")
    return keys, dict_keys, None


def code_spans(text):
    """Every inline code span of a markdown text, as (line, content): single or multiple backticks, never
    across a blank line, never inside a fenced block."""
    lines, fence, kept = text.split("\n"), None, []
    for line in lines:
        m = re.match(r" {0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            kept.append("")
        elif fence is not None:
            if re.fullmatch(r" {0,3}" + re.escape(fence[0]) + "{%d,}\\s*" % len(fence), line):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    spans, line_no = [], 1
    for para in re.split(r"(\n[ \t]*\n)", "\n".join(kept)):
        i = 0
        while i < len(para):
            if para[i] != "`":
                i += 1
                continue
            j = i
            while j < len(para) and para[j] == "`":
                j += 1
            run = para[i:j]
            k = j
            while True:  # the closing run of exactly as many backticks
                k = para.find(run, k)
                if k < 0 or k + len(run) == len(para) or para[k + len(run)] != "`":
                    break
                k = re.match(r"`+", para[k:]).end() + k
            if k < 0:
                i = j  # a literal run of backticks
                continue
            spans.append((line_no + para.count("\n", 0, i), para[j:k]))
            i = k + len(run)
        line_no += para.count("\n")
    return spans


IDENT = r"[A-Za-z_]\w*"
DOTTED = rf"{IDENT}(?:\.{IDENT})*"


def check_path(path, after_python=False):
    """None if fine or not a repo path; else why it is missing."""
    path = path.strip().rstrip(",;:")
    if path.startswith(("/", "~")) or any(s in path for s in ("<", "XXX", "...", "{")):
        return None  # absolute, a placeholder, a run's output
    parts = path.rstrip("/").split("/")
    if parts[0] in RUN_DIRS or path in RUN_FILES or parts[0] == "path":  # path/to/...
        return None
    if after_python:  # `python x.py`: run from the repository root
        return None if (ROOT / path).is_file() else f"{path} is not a file at the repository root (python {path})"
    if "/" in path.rstrip("/"):
        if parts[0] not in REPO_DIRS and not path.endswith(FILE_SUFFIXES):
            return None  # a metric name (train/kl), a Hub id
        if "*" in path:
            return None if list(ROOT.glob(path)) else f"{path} matches no file"
        return None if (ROOT / path).exists() else f"{path} does not exist"
    if path.endswith("/"):
        return None if parts[0] not in REPO_DIRS or (ROOT / path).is_dir() else f"{path} does not exist"
    if path.endswith(FILE_SUFFIXES):
        where = [d for d in FILE_DIRS if (ROOT / d / path).is_file()]
        return None if where else f"{path} is in none of: the root, " + ", ".join(d + "/" for d in FILE_DIRS if d)
    return None


def check_config_key(key):
    """True: a config key; False: a config-shaped key that is not one; None: machinery.config did not load."""
    keys, dict_keys, error = config_schema()
    if error:
        return None
    if key in keys:
        return True
    parts = key.split(".")
    for k in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:k])
        if dict_keys.get(prefix):  # `data.eval.<name>`, `model.lora.rank`: the sub-key of a dict-valued key
            schema = DICT_SCHEMAS.get(prefix)
            if schema and k == len(parts) - 1:
                members = [m for m, _ in project_index().classes.get(schema, [])]
                return not members or any(parts[-1] in m for m in members)
            return True
    return False


def check_python_name(name):
    """None if the name exists (or is not ours to judge), else why not."""
    index = project_index()
    parts = name.split(".")
    last = parts[-1]
    if parts[0] in THIRD_PARTY_MODULES or last in THIRD_PARTY_NAMES or index.module(name):
        return None
    if len(parts) == 1:
        if last in index.defined or last in index.mentioned or hasattr(builtins, last) or last in YAML_VALUES:
            return None
        return f"{name} is defined nowhere in the project's Python"
    # `grpo.eps_low`, `model.lora.rank`; model, data, rollout, grpo and train are modules too (`grpo.policy_loss`)
    is_key = check_config_key(name) if parts[0] in CONFIG_SECTIONS else False
    if is_key or (is_key is None and parts[0] not in index.modules):
        return None  # a config key (or machinery.config did not load: the test says so once)
    # a module, then names in it: `engine.sample_tokens`, `machinery.engine.TorchEngine.session`
    for k in (2, 1):
        path = index.module(".".join(parts[:k])) if len(parts) > k else None
        if path:
            rest = parts[k:]
            if rest[0] not in index.file_defs[path]:
                if is_key is None:
                    return None
                return (f"{name} is neither a config key nor defined in {path}" if parts[0] in CONFIG_SECTIONS
                        else f"{rest[0]} is not defined in {path}")
            if len(rest) > 1 and rest[0] in index.classes and not index.class_has(rest[0], rest[1]):
                return f"{rest[0]} has no {rest[1]} ({path})"
            return None
    if parts[0] in CONFIG_SECTIONS:
        return f"{name} is not a config key (machinery.config.config_keys())"
    if parts[0] in index.classes:  # `GLM.from_pretrained`, `MemoryPlan.phases`
        return None if index.class_has(parts[0], parts[1]) else f"class {parts[0]} has no {parts[1]}"
    # `gen.publish`, `x.detach()`: an object of ours or not; its last name must exist somewhere
    if last in index.defined or hasattr(builtins, last):
        return None
    return f"{last} (in {name}) is defined nowhere in the project's Python"


def check_span(span):
    """None if the code span names something that exists (or is nothing this test classifies), else why not."""
    s = " ".join(span.split())
    if not s:
        return None
    if " " in s:  # a command or an expression: check its repo paths and the scripts it runs
        tokens = s.split()
        for i, tok in enumerate(tokens):
            tok = tok.strip("'\"()[],;")
            prev = tokens[i - 1] if i else ""
            if prev in ("python", "python3") and tok.endswith(".py"):
                why = check_path(tok, after_python=True)
            elif prev == "-m" and i >= 2 and tokens[i - 2] in ("python", "python3"):
                why = None if project_index().module(tok) else f"python -m {tok}: no such project module"
            elif tok.endswith(FILE_SUFFIXES) or tok.split("/")[0] in REPO_DIRS and "/" in tok:
                why = check_path(tok)
            else:
                why = None
            if why:
                return why
        m = re.fullmatch(rf"({DOTTED})\((.*)\)", s)  # a call with arguments: `submit(ids, max_new, seed, key)`
        if m:
            return check_name(m.group(1))
        # `key: value` (YAML), `name OP value`
        m = re.fullmatch(rf"({DOTTED}):\s+(.+)", s) or re.fullmatch(rf"({DOTTED})\s*(?:[<>]=?|==|!=|=)\s*(.+)", s)
        if m and not (":" in s.split()[0] and m.group(1)[0].isupper()):  # not prose: `Answer: ...`
            return check_name(m.group(1)) or check_module_colon(m.group(2))
        return None
    if s.endswith(FILE_SUFFIXES) or "/" in s:
        if s.endswith(FILE_SUFFIXES) or s.split("/")[0] in REPO_DIRS:
            return check_path(s)
        return None  # metric names (train/kl), Hub ids, run outputs, math (1/0.75^2)
    if s.rsplit(".", 1)[-1] in OTHER_FILE_SUFFIXES:
        return None  # `metrics.jsonl`, `state.pt`: a run's files
    if re.fullmatch(rf"{DOTTED}:{IDENT}", s):
        return check_module_colon(s)
    m = re.fullmatch(rf"({DOTTED})\s*(=|:)(\S*)", s)  # `rollout.quantization=fp8`, `dsa:`
    if m:
        if m.group(2) == ":" and m.group(1)[0].isupper():
            return None  # prose: `Answer:`
        return check_name(m.group(1)) or check_module_colon(m.group(3))
    m = re.fullmatch(rf"({DOTTED})(\(.*\))?", s)  # `foo`, `foo()`, `Class.method(args)`
    if m:
        return check_name(m.group(1))
    return None


def check_name(name):
    if len(name) == 1 or re.fullmatch(r"[A-Za-z]_[A-Za-z0-9]", name):
        return None  # math: `F`, `p_t`
    parts = name.split(".")
    if len(parts) == 1 and name in config_schema()[0]:
        return None  # `run_dir`, `seed`
    return check_python_name(name)


def check_module_colon(s):
    """`module:function`, `machinery.tools:PythonMath`: a project module's name must be defined in it."""
    m = re.fullmatch(rf"({DOTTED}):({IDENT})", s)
    if not m:
        return None
    path = project_index().module(m.group(1))
    if not path:
        return None  # `module:function`, `my_envs:Lookup`: examples, not ours
    return None if m.group(2) in project_index().file_defs[path] else f"{m.group(2)} is not defined in {path}"


def stale_names(text, where):
    return [f"{where}:{line}: `{span}`: {why}" for line, span in code_spans(text) for why in [check_span(span)] if why]


def test_code_spans_are_read_like_markdown():
    text = ("a `x` and ``y `z` w`` and\n`multi\nline` ```python inline\n\n```bash\n`not a span`\n```\n"
            "`after` `unclosed\n\nnext `q`")
    assert code_spans(text) == [(1, "x"), (1, "y `z` w"), (2, "multi\nline"), (8, "after"), (10, "q")]


def test_doc_name_checker_flags_planted_stale_names():
    good = ("`machinery/engine.py` `engine.py` `configs/tiny_cpu.yaml` `bench/` `rollout.temperature` "
            "`model.lora.rank` `data.eval.aime` `grpo.policy_loss` `model.GLM.from_pretrained` `policy_loss()` "
            "`GRPOConfig` `machinery.tools:PythonMath` `train.pairs=2` `python train.py --config "
            "configs/tiny_cpu.yaml` `runs/<name>/metrics.jsonl` `train/kl` `torch.topk` `null` `0.2` `\"stop\"` "
            "`HF_HUB_OFFLINE=1` `Glm4ForCausalLM` `max_staleness >= 2` `rollout.top_p` `config.yaml` `true`"
            " `Answer: ...` `metrics.jsonl` `p_t` `data.eval: {name: file}` `GLM.forward(keep=...)`"
            " `python -m machinery.plot RUN_DIR`")
    assert stale_names(good, "good.md") == []
    bad = ["`machinery/nope.py`", "`nope.py`", "`configs/nope.yaml`", "`rollout.no_such_key`",
           "`model.lora.no_such_field`", "`distill.no_such_key`", "`grpo.no_such_function`", "`no_such_function()`",
           "`NoSuchClass`", "`GLM.no_such_method`", "`machinery.tools:NoSuchEnv`", "`python nope.py --x`",
           "`python plot.py runs/x`", "`train.no_such_key=2`", "`engine.no_such_name`", "`NO_SUCH_CONSTANT`",
           "`nosuchword`", "`data.env: machinery.env:NoSuchEnv`", "`grpo.no_such_key: 0.2`",
           "`python -m machinery.nope RUN_DIR`"]
    flagged = stale_names("\n".join(bad), "bad.md")
    assert len(flagged) == len(bad), "\n".join(flagged)
    assert flagged[0].startswith("bad.md:1: `machinery/nope.py`")


def test_backticked_names_in_the_docs_exist():
    problems = []
    for doc in DOCS:
        problems += stale_names((ROOT / doc).read_text(), doc)
    error = config_schema()[2]
    if error:
        problems.insert(0, f"machinery.config does not import ({error}): config keys were not checked")
    assert not problems, f"{len(problems)} backticked names in the docs that do not exist (file:line):\n  " + \
        "\n  ".join(problems)


# ----------------------------------------------------------------------------------------------------------
# 4. README.md's line ranges

RANGE = re.compile(r"((?:[\w-]+/)*[\w-]+\.py):(\d+)-(\d+)((?:, \d+-\d+)*)")


def range_problems(text, read):
    """What is wrong with the line ranges of each table row of `text` (markdown) that has any: a named function or
    class (a backticked name in the row's first cell; its last dotted part) defined in none of the row's ranges, a
    range that does not start at a def, class, decorator, docstring or comment, or one that does not end at a
    block's end (a non-blank line followed by a blank one or the file's end). read(path) -> the file's lines."""
    problems = []
    for row in (line for line in text.splitlines() if line.startswith("|") and RANGE.search(line)):
        first = row.split("|")[1]
        names = [n.split(".")[-1] for n in re.findall(r"`([\w.]+)`", first) if not n.endswith(".py")]
        spans = []
        for m in RANGE.finditer(row):
            path, parts = m.group(1), [m.group(2) + "-" + m.group(3)] + re.findall(r"\d+-\d+", m.group(4))
            lines = read(path)
            for a, b in (map(int, part.split("-")) for part in parts):
                spans.append((path, a, b, lines))
                head = lines[a - 1].strip() if 0 < a <= len(lines) else ""
                if not head.startswith(("def ", "class ", "@", '"""', "#")):
                    problems.append(f"{path}:{a}-{b} starts at {head[:40]!r}, not a definition or a section")
                if not (0 < b <= len(lines) and lines[b - 1].strip() and (b == len(lines) or not lines[b].strip())):
                    problems.append(f"{path}:{a}-{b} does not end where a block does")
        for name in names:
            defined = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b")
            if not any(defined.match(lines[k]) for _, a, b, lines in spans for k in range(a - 1, min(b, len(lines)))):
                problems.append(f"`{name}` is not defined in " + ", ".join(f"{p}:{a}-{b}" for p, a, b, _ in spans))
    return problems


def test_range_checker_flags_planted_drift():
    code = ["def f():", "    return 1", "", "", "def g():", "    return 2", ""]
    read = lambda path: code
    assert range_problems("| `f`, `g` | x | m.py:1-6 |", read) == []
    assert range_problems("| `f` | x | m.py:5-6 |", read) == ["`f` is not defined in m.py:5-6"]
    assert range_problems("| `g` | x | m.py:2-6 |", read) == ["m.py:2-6 starts at 'return 1', not a definition or a section"]
    assert range_problems("| `f` | x | m.py:1-1 |", read) == ["m.py:1-1 does not end where a block does"]
    assert range_problems("| `f`, `g` | x | m.py:5-6, 1-2 |", read) == []


def test_readme_line_ranges_hold_what_they_name():
    problems = range_problems((ROOT / "README.md").read_text(), lambda path: (ROOT / path).read_text().splitlines())
    assert not problems, "README.md's line ranges have drifted (update them):\n  " + "\n  ".join(problems)


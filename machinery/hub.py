"""
Hugging Face Hub ids for the model and the data (plumbing, like config.py): what these mean, and where in
start-up they are downloaded.

    model.path:  zai-org/GLM-Z1-9B-0414                          a model repo (its default branch)
    model.path:  zai-org/GLM-Z1-9B-0414@7a1b...                  ... at a revision (a commit, branch or tag)
    distill.teacher: zai-org/GLM-Z1-32B-0414                      the same for a distillation teacher
    data.train:  zhuzilin/dapo-math-17k/dapo-math-17k.jsonl     a dataset repo's file (JSONL or Parquet)
    data.train:  owner/name@rev:train                            ... or a split: every file named train.* or
                                                                 train-*.* (data/train-00000-of-00002.parquet)

A local path that exists always wins; anything else shaped like `owner/name` is a Hub id. Downloads go
through huggingface_hub into its usual cache (~/.cache/huggingface/hub, or HF_HOME / HF_HUB_CACHE), once
per machine: `python train.py` fetches before it starts its processes; under torchrun global rank 0
fetches first, then local rank 0 of every other machine fetches the revision rank 0 got, and the rest wait
(parallel.once_per_machine). HF_HUB_OFFLINE=1 is honoured: only the cache is read. Each fetch prints one
line naming what it fetches; a wrong id, a missing file or no network is one error line naming the key and
the id. The revision a fetch resolved is written back into the config (`owner/name@<commit>`), so
run_dir/config.yaml, and therefore --resume, names the exact weights and data the run started from.
--dry-run fetches nothing for the recipe's model (config.PUBLISHED knows its architecture) and only
config.json for any other Hub model.
"""
import os
import re

from huggingface_hub import constants, hf_hub_download, snapshot_download

from machinery import ConfigError

# What a model fetch takes: the config, the tokenizer and the safetensors weights, never *.bin/*.pt twins
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt",
               "chat_template*", "*.jinja"]
TOKENIZER_FILES = [p for p in MODEL_FILES if "safetensors" not in p and p != "generation_config.json"]
DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")
_ID = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_MODEL = re.compile(rf"^({_ID})(?:@([\w./-]+))?$")  # owner/name[@revision]
_DATA = re.compile(rf"^({_ID})(?:@([\w.-]+))?(?:/(.+)|:([\w.-]+))$")  # owner/name[@rev]/file | owner/name[@rev]:split


def model_id(spec):
    """(repo id, revision or None) if spec is a Hub model id rather than a local directory, else None."""
    m = _MODEL.match(spec or "")
    return (m[1], m[2]) if m and not os.path.exists(spec) else None


def data_id(spec):
    """(repo id, revision or None, file or None, split or None) if spec names a Hub dataset, else None."""
    m = _DATA.match(spec or "")
    return (m[1], m[2], m[3], m[4]) if m and not os.path.exists(spec) else None


def cache_dir():
    return constants.HF_HUB_CACHE


def _fail(key, spec, e, what="model"):
    """One line for whatever huggingface_hub raised: the key, the id, and the likely cause."""
    name = type(e).__name__
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        why = (f"neither a local {'directory' if what == 'model' else 'file'} nor a {what} on the Hugging Face Hub "
               "(a private or gated repository needs `hf auth login`)")
    elif name in ("RevisionNotFoundError", "RevisionResolutionError"):
        why = "no such revision in that repository"
    elif name in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        why = "no such file in that repository"
    elif name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        why = (f"not in the local Hub cache ({cache_dir()}) and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the Hub cannot be reached (no network?) and it is not in the local cache " + cache_dir())
    elif isinstance(e, FileNotFoundError):
        why = str(e)
    else:
        why = f"{name}: {str(e).splitlines()[0] if str(e) else ''}"
    return ConfigError(f"{key}: {spec}: {why}")


def _pinned(repo, folder, rest=""):
    """owner/name@<commit> (+ /file or :split): snapshot folders are named by their commit."""
    return f"{repo}@{os.path.basename(os.path.normpath(folder))}{rest}"


def fetch_model(key, spec, files=MODEL_FILES):
    """Download a Hub model (the files it needs) into the cache; returns spec pinned to its commit."""
    repo, rev = model_id(spec)
    if not constants.HF_HUB_OFFLINE:
        print(f"[hub] {key}: fetching {repo}@{rev or 'main'} ({', '.join(files[:3])}, ...) into {cache_dir()}; files "
              "already there are not fetched again", flush=True)
    try:
        folder = snapshot_download(repo, revision=rev, allow_patterns=files)
    except Exception as e:  # noqa: BLE001 - huggingface_hub's many errors, each as one line
        raise _fail(key, spec, e) from None
    return _pinned(repo, folder)


def model_dir(spec, key="model.path"):
    """The local directory of a model spec: itself, or the cached snapshot of a Hub id (fetched before)."""
    if spec is None or model_id(spec) is None:
        return spec
    repo, rev = model_id(spec)
    try:
        return snapshot_download(repo, revision=rev, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise _fail(key, spec, e) from None


def model_config(spec, key="model.path", fetch=True):
    """config.json of a Hub model: from the cache if there, else that one file is fetched (--dry-run), or
    None with fetch=False."""
    repo, rev = model_id(spec)
    try:
        return hf_hub_download(repo, "config.json", revision=rev, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: fetch that one file
        if not fetch:
            return None
    print(f"[hub] {key}: fetching {repo}@{rev or 'main'}/config.json", flush=True)
    try:
        return hf_hub_download(repo, "config.json", revision=rev)
    except Exception as e:  # noqa: BLE001
        raise _fail(key, spec, e) from None


def split_files(folder, split):
    """The data files of a split in a dataset snapshot: <split>.jsonl, data/<split>-00000-of-00002.parquet, ..."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            stem, ext = os.path.splitext(name)
            if ext in DATA_EXTENSIONS and (stem == split or re.match(rf"{re.escape(split)}[-_.]", stem)):
                out.append(os.path.join(root, name))
    return sorted(out)


def fetch_data(key, spec, local_only=False):
    """(spec pinned to its commit, [local files]) of a Hub dataset spec; local_only: read the cache only."""
    repo, rev, file, split = data_id(spec)
    patterns = [file] if file else [f"*{split}*{ext}" for ext in DATA_EXTENSIONS]
    if not local_only and not constants.HF_HUB_OFFLINE:
        print(f"[hub] {key}: fetching dataset {repo}@{rev or 'main'} ({file or 'split ' + split}) into {cache_dir()}",
              flush=True)
    try:
        folder = snapshot_download(repo, repo_type="dataset", revision=rev, allow_patterns=patterns,
                                   local_files_only=local_only)
    except Exception as e:  # noqa: BLE001
        raise _fail(key, spec, e, "dataset") from None
    files = [os.path.join(folder, file)] if file else split_files(folder, split)
    if not files or not all(os.path.isfile(f) for f in files):
        what = f"no file {file}" if file else f"no file of split {split!r} (named {split}.jsonl, {split}-*.parquet, ...)"
        raise _fail(key, spec, FileNotFoundError(f"{what} in dataset {repo}"), "dataset")
    return _pinned(repo, folder, f"/{file}" if file else f":{split}"), files


def data_files(spec, key="data"):
    """The local files of a data spec: [itself] for a local path, else the cached files of a Hub dataset."""
    return fetch_data(key, spec, local_only=True)[1] if data_id(spec) else [spec]


def fetch(specs):
    """Fetch every Hub id of specs, {config key: spec} (config.hub_specs: model.path, model.tokenizer,
    distill.teacher, the data);
    returns {key: pinned spec}, which pin() writes into a config. Local paths and None are left alone."""
    pins = {}
    for key, spec in specs.items():
        if key in ("model.path", "model.tokenizer", "distill.teacher") and spec is not None and model_id(spec):
            pins[key] = fetch_model(key, spec, TOKENIZER_FILES if key == "model.tokenizer" else MODEL_FILES)
        elif key.startswith("data.") and data_id(spec):
            pins[key] = fetch_data(key, spec)[0]
    return pins


def pin(cfg, pins):
    """Write fetch()'s pinned specs into cfg: model.path, model.tokenizer, distill.teacher, data.train, data.eval.<set>."""
    for key, spec in pins.items():
        section, name, *sub = key.split(".")
        if not sub:
            setattr(getattr(cfg, section), name, spec)
        elif not isinstance(cfg.data.eval, dict):  # data.eval.<set> of a single eval source
            cfg.data.eval = spec
        elif isinstance(cfg.data.eval[sub[0]], dict):
            cfg.data.eval[sub[0]] = {**cfg.data.eval[sub[0]], "path": spec}
        else:
            cfg.data.eval[sub[0]] = spec

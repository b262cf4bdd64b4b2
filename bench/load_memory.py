"""
How much memory a learner needs to load its weights: the anonymous resident memory (RssAnon, which does
not count the memory-mapped safetensors pages the kernel can drop) of each of two FSDP processes on the
CPU, sampled every millisecond around the load alone.

    python bench/load_memory.py                 # ~0.2B-parameter model (0.8 GB fp32), about a minute
    python bench/load_memory.py --layers 4      # smaller

Three ways of loading, each in fresh processes (torchrun, gloo, 2 ranks):
  sharded  parallel.load_learner: built on meta, sharded on meta, each rank reads only its rows of each
           tensor from the files: the peak should be about half the model's fp32 bytes plus a constant
  full     GLM.from_pretrained into a full fp32 model, then sharded (each rank held the whole model once)
  before   the same through model.py as it was before this change (git show c0e8047:model.py), which kept
           every loaded tensor beside a second, freshly allocated copy: about 2x the fp32 bytes
The checkpoint is bf16 on disk, as GLM-Z1-9B-0414's is. Prints a markdown table for docs/benchmarks.md.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BEFORE = "c0e8047"  # the last commit whose from_pretrained held two copies


def rss_anon():
    """This process's anonymous resident memory in bytes (/proc/self/status, Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class Peak:
    """The largest RssAnon seen by a thread that samples it every millisecond while active."""

    def __init__(self):
        self.peak, self.on = rss_anon(), True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.on:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def stop(self):
        self.on = False
        self.thread.join()
        return max(self.peak, rss_anon())


def worker(ckpt, mode, out):
    """One rank: load the checkpoint in `mode`, report (baseline, peak, after) RssAnon and its shard bytes."""
    import torch
    from machinery import parallel
    torch.set_num_threads(1)
    parallel.init_processes(torch.device("cpu"))
    if mode == "before":  # the old model.py, imported under another name from the commit before the change
        path = os.path.join(tempfile.mkdtemp(), "model_before.py")
        with open(path, "w") as f:
            f.write(subprocess.run(["git", "show", f"{BEFORE}:model.py"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout)
        spec = importlib.util.spec_from_file_location("model_before", path)
        old = sys.modules["model_before"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
        spec.loader.exec_module(old)
    parallel.barrier()
    base, peak = rss_anon(), Peak()
    if mode == "sharded":
        model = parallel.load_learner(ckpt, None, torch.device("cpu"), "fsdp")
    else:
        glm = old.GLM if mode == "before" else __import__("model").GLM
        model = parallel.shard(glm.from_pretrained(ckpt, dtype=torch.float32, device="cpu"), torch.device("cpu"))
    top = peak.stop()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    rows = parallel.all_gather({"rank": parallel.rank(), "base": base, "peak": top, "after": rss_anon(), "local": local})
    if parallel.rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    torch.distributed.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--modes", default="sharded,full,before")
    args = ap.parse_args()
    import torch
    from model import GLM, GLMConfig
    tmp = tempfile.mkdtemp(prefix="load_memory_")
    ckpt = os.path.join(tmp, "ckpt")
    cfg = GLMConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                    num_layers=args.layers, num_heads=16, num_kv_heads=2, head_dim=args.hidden // 16)
    with torch.device("meta"):
        n = sum(p.numel() for p in GLM(cfg).parameters())
    print(f"[load_memory] writing a {n / 1e9:.2f}B-parameter bf16 checkpoint to {ckpt}", flush=True)
    GLM(cfg).to(torch.bfloat16).save_pretrained(ckpt)
    fp32 = 4 * n
    lines = ["| load | rank | RssAnon before | peak during load | peak - before | (peak - before) / fp32 model | "
             "own parameters after |", "|---|---|---|---|---|---|---|"]
    for mode in args.modes.split(","):
        out = os.path.join(tmp, f"{mode}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.abspath(__file__), "--worker", ckpt, mode, out]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": ROOT})
        if p.returncode:
            sys.exit(f"{mode}: " + "\n".join(line for line in p.stderr.splitlines() if "[rank0]" in line)[-3000:])
        for r in json.load(open(out)):
            lines.append(f"| {mode} | {r['rank']} | {r['base'] / 2**20:.0f} MiB | {r['peak'] / 2**20:.0f} MiB | "
                         f"{(r['peak'] - r['base']) / 2**20:.0f} MiB | {(r['peak'] - r['base']) / fp32:.2f} | "
                         f"{r['local'] / 2**20:.0f} MiB |")
        print(lines[-2] + "\n" + lines[-1], flush=True)
    print(f"\nmodel: {n / 1e9:.3f}B parameters = {fp32 / 2**20:.0f} MiB in fp32, 2 FSDP processes (gloo, CPU)\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()

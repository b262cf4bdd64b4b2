"""bench/gpu.sh in dry mode (what a CPU machine runs of it) and the CPU sides of its scripts: bench/parity.py
on tiny shapes in bf16, bench/gpu_memory.py's plan, bench/moe.py's quick run, bench/fp8.py's error table on one small
shape. The CUDA parts are only planned here; a GPU machine runs them (`bash bench/gpu.sh OUTDIR`). No timing is
asserted."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["1", "2", "3", "4a", "4b", "4c", "4d", "4e", "4f", "5", "6", "7", "8", "9", "10a", "10b", "10c"]
CUDA_PARTS = ["1", "4a", "4b", "4c", "4d", "4e", "4f", "5", "6", "10a", "10b", "10c"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """One `bash bench/gpu.sh --dry OUTDIR` for the whole file: (completed process, OUTDIR)."""
    out = tmp_path_factory.mktemp("gpu_sh") / "out"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHON": sys.executable}
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--dry", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, out


def status(out):
    rows = [line.split("\t") for line in (out / "status.tsv").read_text().splitlines()]
    return {row[0]: row[2] for row in rows[1:]}


def test_dry_run_plans_every_part_runs_the_cpu_ones_and_skips_the_cuda_ones(dry):
    r, out = dry
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for part in PARTS:
        assert f"---- part {part}:" in r.stdout  # planned: its command and timeout printed
    for part in CUDA_PARTS:
        assert f"SKIP part {part} (" in r.stdout and "needs CUDA" in r.stdout
    assert status(out) == {p: "ok" if p in ("2", "3", "7", "8", "9") else "skipped (needs CUDA)" for p in PARTS}
    # part 1's tests were found in tests/ (a skipif on CUDA, or a CUDA branch), and are named, not the suite
    assert "tests/test_engine.py::test_cuda_graph_replays_give_the_eager_tokens" in r.stdout
    assert "tests/test_model.py::test_cuda_attention_never_falls_back_to_the_math_kernel" in r.stdout
    assert "tests/test_fp8.py::test_cuda_fp8_paths_are_within_their_bound_of_the_exact_product" in r.stdout
    assert "train.pairs=2" in r.stdout  # what needs several GPUs is printed, not run


def test_dry_run_writes_its_files_and_summary(dry):
    _, out = dry
    for name in ("summary.md", "status.tsv", "0_env.log", "2_parity.log", "2_parity.json", "2_parity.md",
                 "3_memory.log", "3_memory.json", "3_memory.md", "7_colocate.json", "7_colocate_handoff.md",
                 "8_moe.json", "8_MoE_learner_and_engine.md"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = (out / "summary.md").read_text()
    for part in PARTS:
        assert f"#### {part}. " in summary
    assert "| 5 | tiny run | skipped (needs CUDA)" in summary
    assert "| generator prefill | needs CUDA |" in summary  # the memory table, plan side only
    assert "All paths within tolerance: yes." in summary  # the parity table
    assert "| lora | generate | needs CUDA |" in summary and "| full | " in summary  # the handoff's table, CPU side
    assert "| tiny | rl | transformers `generate` |" in summary  # the MoE part's tables, CPU side
    assert not (out / "5_tiny").exists()


@pytest.mark.parametrize("parts,runs", [("1", ["1"]), ("10", ["10a", "10b", "10c"]),
                                        ("4", ["4a", "4b", "4c", "4d", "4e", "4f"])])
def test_gpu_sh_parts_selects_by_the_whole_number(tmp_path, parts, runs):
    """--parts: a number selects its part and its lettered ones (4: 4a ... 4f), never another number's (1 is not 10);
    a rerun into the same OUTDIR keeps the other parts' status rows. Dry mode: only CUDA parts among these (skipped)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHON": sys.executable}
    out = tmp_path / "out"
    out.mkdir()
    (out / "status.tsv").write_text("part\tname\tstatus\n1\ta\tok\n10a\tb\tok\n4a\tc\tok\n2\td\tok\n")
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--dry", "--parts", parts, str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert [p for p in PARTS if f"---- part {p}:" in r.stdout] == runs
    kept = {"1", "10a", "4a", "2"} - {p for p in PARTS if p in runs or p.rstrip("abcdef") == parts}
    assert set(status(out)) == kept | set(runs)


def test_parity_cpu_path_is_within_tolerance_and_really_bf16(dry):
    _, out = dry
    res = json.loads((out / "2_parity.json").read_text())
    assert res["pass"] and set(res["models"]) == {"tiny dense", "tiny DSA"}
    for label, paths in res["models"].items():
        assert {"learner fp32", "learner", "generator prefill", "engine", "learner vs engine"} <= set(paths), label
        for path, s in paths.items():
            assert s["pass"] and s["tokens"] > 50 and s["max"] <= s["tol_max"] and s["mean"] <= s["tol_mean"], (label, path)
        assert paths["learner fp32"]["max"] < 1e-4  # fp32 against float64: rounding only
        for path in ("learner", "generator prefill", "engine"):  # bf16 shows: the path did not silently run fp32
            assert paths[path]["mean"] > 1e-3, (label, path)


def test_parity_tolerance_catches_a_wrong_logprob():
    """The comparison can fail: the learner at another temperature than the reference's is out of tolerance,
    at the same temperature it is not (fp32, a 2-layer model: milliseconds)."""
    from bench import parity
    from model import GLM, GLMConfig
    shape = dict(parity.SHAPES["tiny"], rows=2, prompt=(6, 6), response=(6, 6))
    cfg = GLMConfig(**{**shape["model"], "num_layers": 2})
    model = parity.randomize_(GLM(cfg), 0, 3.0)
    rows = parity.make_rows(shape, cfg.vocab_size, 1)
    ref = parity.reference_logprobs(copy.deepcopy(model).to(torch.float64), rows, 1.0)
    good = parity.compare(parity.learner_logprobs(model, rows, 1.0, amp=False), ref, "fp32", False)
    bad = parity.compare(parity.learner_logprobs(model, rows, 1.05, amp=False), ref, "bf16", False)
    assert good["pass"] and good["tokens"] == 12
    assert not bad["pass"] and bad["mean"] > 0.1


def test_memory_plan_side(dry, tmp_path):
    """gpu_memory.py's plan side: the phases' plan totals follow from memory.memory_plan's items for the measured
    shapes (the 4-layer cut's parameters exactly), and the measured side is left to CUDA."""
    from bench import gpu_memory
    _, out = dry
    res = json.loads((out / "3_memory.json").read_text())
    assert res["dry"] and all(p["peak"] is None for p in res["phases"])
    phases = {p["phase"]: p for p in res["phases"]}
    assert list(phases) == ["generator load", "generator prefill", "generator decode", "learner load",
                            "learner step 1", "learner step 2", "publish"]
    from model import GLM
    with torch.device("meta"):
        P = sum(p.numel() for p in GLM(gpu_memory.architecture(4, False)).parameters())
    assert res["params"] == P
    learner, generator = dict(map(tuple, res["plan"]["learner"])), dict(map(tuple, res["plan"]["generator"]))
    assert learner[next(k for k in learner if k.startswith("fp32 master weights"))] == 4 * P
    assert generator[next(k for k in generator if k.startswith("bf16 weights"))] == 2 * P  # dense: no fp32 islands
    # a phase's plan is its items without the CUDA context item (max_memory_allocated does not see it)
    assert phases["learner step 1"]["plan"] == sum(learner.values()) - gpu_memory.OVERHEAD
    assert phases["generator decode"]["plan"] == sum(generator.values()) - gpu_memory.OVERHEAD
    assert 4 * P <= phases["learner load"]["plan"] < phases["learner step 1"]["plan"]
    assert 2 * P <= phases["generator load"]["plan"]
    # in-process, another shape: DSA adds its indexer, and --dry writes the same structure
    assert gpu_memory.main(["--dry", "--layers", "2", "--dsa", "--json", str(tmp_path / "m.json")]) == 0
    dsa_res = json.loads((tmp_path / "m.json").read_text())
    with torch.device("meta"):
        dense = sum(p.numel() for p in GLM(gpu_memory.architecture(2, False)).parameters())
    assert dsa_res["params"] > dense  # the indexer's parameters
    assert "(DSA FSSS)" in dsa_res["settings"] and dsa_res["phases"][0]["peak"] is None


def test_fp8_bench_errors_on_a_small_shape():
    """bench/fp8.py's table (1) on one ragged shape: e4m3 with 3 mantissa bits rounds a normal weight to ~2.7% (relative
    Frobenius), and the w8a8 matmul, with its activations rounded too, lands between that and twice it; bf16 is ~10x
    closer. (The 9B shapes' table is in docs/benchmarks.md.)"""
    from bench import fp8 as bench_fp8
    (r,) = bench_fp8.errors({"down": (200, 300)}, torch.device("cpu"), rows=16, checkpoint=None, log=lambda m: None)
    assert r["shape"] == [200, 300] and 0.02 < r["w_rel_fro"] < 0.035
    assert r["w_rel_fro"] * 0.8 < r["w8a8"] < 2 * r["w_rel_fro"] and r["bf16"] < r["w8a8"] / 5


def test_moe_bench_cpu_side(dry, tmp_path):
    """Part 8's CPU side, bench/moe.py --quick on the tiny shape (side by side with transformers, from its saved
    checkpoint) and on the flash path (GLM-4.7-Flash's config, widths shrunk, transformers' copy taken in memory):
    both models hold the same weights, every learner side and engine ran; --write's section from its JSON."""
    from bench import moe
    from bench.attention import write_section
    _, out = dry
    res = json.loads((out / "8_moe.json").read_text())
    assert set(res["models"]) == {"tiny", "flash"}
    for shape, m in res["models"].items():
        assert m["params"] > 0 and m["logits_rel_err"] < 1e-4, shape  # the same weights on both sides (fp32)
    assert res["models"]["tiny"]["config"]["model_type"] == "glm_moe_dsa"
    assert res["models"]["flash"]["config"]["model_type"] == "glm4_moe_lite"
    for shape in ("tiny", "flash"):
        rows = [x for x in res["learner"] if x["shape"] == shape]
        assert [x["side"] for x in rows] == ["rl_step, routes replayed", "rl_step, fresh routes", "transformers"]
        assert len({x["tokens"] for x in rows}) == 1 and all(x["tokens_per_s"] > 0 for x in rows)
    engine = {(x["shape"], x.get("workload", x.get("rows")), x["side"]): x for x in res["engine"]}
    for workload in ("uniform", "rl"):
        for side in ("TorchEngine", "transformers `generate`"):
            assert engine["tiny", workload, side]["tokens_per_s"] > 0
    for rows in (2, 4):  # no CUDA graphs on a CPU: eager and transformers
        for side in ("eager", "hf"):
            x = engine["flash", rows, side]
            assert "error" not in x and x["decode_tokens_per_s"] > 0 and x["prefill_tokens_per_s"] > 0
            assert x["prefill_ops"] > 0  # the host's dispatches of one prefill (bench.op_count)
            assert (x["decoder_share"] is None) == (side == "hf") and (side == "hf" or 0 < x["decoder_share"] < 1)
    md = (out / "8_MoE_learner_and_engine.md").read_text()
    assert "| tiny | quick: 16 sequences" in md and "| 4 | TorchEngine, eager |" in md
    assert moe.markdown(res) == md.strip()
    write_section(str(tmp_path / "b.md"), "moe-cpu", moe.markdown(res))
    written = (tmp_path / "b.md").read_text()
    assert "<!-- moe-cpu -->" in written and "<!-- /moe-cpu -->" in written and md.strip() in written


def test_memory_graph_buckets_table():
    """gpu_memory.py's CUDA-graph diagnostic on a stand-in for graphs.DecodeGraphs (its `memory` is filled only on
    CUDA): a call that kept the call before's graphs lists only its new buckets, a failed capture says so, and a
    warm-up that did not raise the process's peak is bounded by the earlier one (<=). graph_info keeps no set alive
    (the bench held the prefill call's pool and graphs through the decode phase: on an H200 0.33 GiB more was allocated
    before the decode call than before the prefill call, and the decode phase measured 1.08x its plan)."""
    import gc
    import weakref

    from bench import gpu_memory
    G = 2**30

    class Fake:  # a stand-in DecodeGraphs
        def __init__(self, memory):
            long = dict(dtype=torch.long)
            self.tok, self.pos = torch.zeros(4, 1, **long), torch.zeros(4, 1, **long)
            self.keys, self.valid = torch.zeros(4 * 256, **long), torch.zeros(4 * 256, dtype=torch.bool)
            self.logits, self.memory, self.mempool = torch.zeros(4, 1000, dtype=torch.bfloat16), memory, "pool"

    def fake(memory):
        return gpu_memory.graph_info(Fake(memory))  # (the Fake is freed at once: only the snapshot stays)
    first = dict(allocated_before=4 * G, reserved_before=5 * G, peak_before=4 * G,
                 allocated_after_warmup=4 * G + G // 4, peak_after_warmup=4 * G + G // 2,
                 allocated_after_capture=4 * G + G // 2, reserved_after_capture=6 * G, kept=True)
    kept = Fake({(4, 256): dict(first)})
    logged = []
    kept.memory[4, 512] = dict(allocated_before=4 * G, reserved_before=6 * G, peak_before=5 * G,  # a capture that
                               allocated_after_warmup=4 * G, peak_after_warmup=5 * G, kept=False)  # raised the peak
    g = gpu_memory.graph_info(kept)
    out = gpu_memory.graph_memory([("prefill call", fake({(4, 256): first})), ("decode call", g)], logged.append)
    assert [(r["call"], r["rows"], r["keys"]) for r in out["buckets"]] == [
        ("prefill call", 4, 256), ("decode call", 4, 256), ("decode call", 4, 512)]
    buffers = 8 * 4 + 8 * 4 + 8 * 1024 + 1024 + 2 * 4000
    assert [c["buffers"] for c in out["calls"]] == [buffers, buffers]
    md = gpu_memory.graphs_markdown(out)
    assert "| prefill call | 4 x 256 | 4.000 | 0.500 | 0.250 | 0.250 | 1.000 | True |" in md
    assert "| decode call | 4 x 512 | 4.000 | <= 1.000 | 0.000 | failed |  | False |" in md
    # the same graphs in both calls: their buckets once, the second call marked as keeping them
    again = gpu_memory.graph_memory([("prefill call", g), ("decode call", g)], logged.append)
    assert len(again["buckets"]) == 2 and again["calls"][1]["same_as_before"]
    assert "(the call before's graphs, kept)" in gpu_memory.graphs_markdown(again)
    assert gpu_memory.graph_memory([("decode call", None)], logged.append)["calls"][0]["buffers"] is None
    ref = weakref.ref(kept)
    del kept
    gc.collect()
    assert ref() is None  # the snapshots held no reference to the set


def fake_run(run_dir, accuracies, greedy=0.5, t0=100.0, step_s=2.0, extra=None):
    """A finished run's metrics.jsonl: RL step 0 at t0 s, an eval every 25 steps with these sampled accuracies."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"stage": "sft", "step": 1, "time/elapsed_s": 1.0}) + "\n")
        for step in range(0, 25 * (len(accuracies) - 1) + 1):
            row = {"stage": "rl", "step": step, "time/elapsed_s": t0 + step * step_s} | (extra or {})
            if step % 25 == 0:
                row |= {"eval/synthetic/accuracy": accuracies[step // 25], "eval/synthetic/greedy_accuracy": greedy}
            f.write(json.dumps(row) + "\n")


def test_distill_bench_tabulates_the_step_and_seconds_to_90_percent_of_the_teacher(tmp_path):
    """bench/distill.py's table from finished runs: the target is 90% of the teacher's final sampled accuracy, each
    student's first eval at or above it gives its RL step and the RL stage's seconds to get there."""
    from bench import distill
    runs = str(tmp_path)
    fake_run(os.path.join(runs, "teacher_s0"), [0.1, 0.2, 0.3, 0.4, 0.5] + [0.6] * 6)  # 11 evals: steps 0..250
    fake_run(os.path.join(runs, "s0_distill"), [0.1, 0.5, 0.53, 0.6] + [0.6] * 7, extra={"train/distill_kl": 0.5})
    fake_run(os.path.join(runs, "s0_both"), [0.1] * 11)  # never reaches 54%
    text = distill.table(runs, [0])
    assert "90% of it: **54.0%**" in text
    lines = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| 0 |")}
    assert lines["distillation alone"].split("|")[5:7] == [" 75 ", " 150 "]  # step 75, 75 steps x 2 s
    assert lines["GRPO alone"].split("|")[5:7] == [" 125 ", " 250 "]
    assert "not reached" in lines["distillation + GRPO"] and "0.500 -> 0.500" in lines["distillation alone"]


def test_the_fp8_decode_depth_puts_the_decoder_over_80_percent_of_the_bytes():
    """bench/moe.decoder_share at GLM-4.7-Flash's widths (its docstring's figures, and why gpu.sh's part 8 compares fp8
    and bf16 decode at 6 layers): at 256 rows of 320 tokens 4 layers leave the decoder under issue 48's 80% of a
    step's bytes, 6 do not; fewer rows touch fewer of the 64 experts."""
    from bench import moe
    shares = {}
    for layers in (4, 6):
        arch = moe.arch_of("flash", layers, False)
        with torch.device("meta"):
            m = moe.GLM(arch).cast_(torch.bfloat16)
        shares[layers] = [moe.decoder_share(m, arch, rows, 320) for rows in (1, 256)]
    assert shares[4][1] == pytest.approx(0.797, abs=5e-4) and shares[6][1] == pytest.approx(0.844, abs=5e-4)
    assert shares[4][0] < 0.5  # one row reads 4 of each layer's 64 experts: lm_head then weighs more than the layers


def test_moe_demo_bench_tabulates_replay_on_and_off(tmp_path):
    from bench import moe_demo
    gaps = {"routing/agree": 0.98, "routing/logp_diff_mean_replay": 0.01, "routing/logp_diff_mean_fresh": 0.02,
            "train/logp_diff_max": 1.5}
    fake_run(os.path.join(str(tmp_path), "s0_rollout"), [0.1, 0.2, 0.3, 0.4, 0.5] + [0.6] * 6, extra=gaps)
    text = moe_demo.table(str(tmp_path), [0, 1])
    assert "| 0 | replay on | 10.0% -> 50.0% -> **60.0%** | 50.0% -> 50.0% | 0.980 | 0.0100 | 0.0200 | 1.50 | - |" in text
    assert "| mean (1) | replay on | **60.0%** | 50.0% |" in text and "replay off" not in text


@pytest.mark.parametrize("p", [0.7, 0.3])
def test_speculative_bench_accepts_at_the_controlled_rate(dry, p):
    """bench/speculative.py --decode on a CPU (gpu.sh part 9's dry side, p = 0.7, 16 rows; here also p = 0.3, 8 rows):
    the engine's measured acceptance (drafts accepted over drafts tested) is p within 0.1 (about 3 standard errors
    at these counts; seeded, so the same every run), the tokens per row-verify are what that rate gives, and the
    speculative call's tokens are the plain engine's (the bench asserts it, and that the engine accepted exactly the
    oracle's leading matches: an exit otherwise)."""
    from bench import speculative as bench_spec
    if p == 0.7:
        r, out = dry
        assert status(out)["9"] == "ok", r.stdout[-3000:]
        rows = json.loads((out / "9_speculative.json").read_text())["rows"]
        assert "| 16 | 3 | 0.7 |" in (out / "summary.md").read_text()
    else:
        rows = bench_spec.main(["--decode", "--quick", "--p", str(p), "--rows", "8"])
    (row,) = rows
    assert abs(row["accept_rate"] - p) <= 0.1, row
    # a row-verify emits its accepted drafts and one token: 1 + (p + p^2 + p^3) at k = 3 if no row were near its end
    assert 1 < row["tokens_per_verify"] <= 1 + p + p * p + p ** 3 + 0.15, row
    assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0


def test_scale_hf_prefill_runs_transformers_on_the_generators_weights(monkeypatch):
    """bench/scale.py --hf: transformers' Glm4ForCausalLM takes the generator's own tensors and times a 1-token
    generate; a copy that computes another function (a weight changed behind its back) is refused in one line."""
    sys.path.insert(0, ROOT)
    from bench import scale
    from model import GLM, GLMConfig
    torch.manual_seed(0)
    gen = GLM(GLMConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, max_position_embeddings=64)).eval()
    prompts = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1)).tolist()
    seconds, err = scale.hf_prefill_s(gen, gen.cfg, prompts, torch.device("cpu"))
    assert seconds > 0 and err < 1e-5  # (fp32 on a CPU)
    real = GLM.__call__
    monkeypatch.setattr(GLM, "__call__", lambda self, *a, **k: real(self, *a, **k) + 1.0)  # our logits, shifted
    with pytest.raises(SystemExit, match="other logits"):
        scale.hf_prefill_s(gen, gen.cfg, prompts, torch.device("cpu"))

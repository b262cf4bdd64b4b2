"""Tests for machinery/teacher.py: the distillation teacher's scores against a float64 forward of each sequence alone
(packed rows, env tokens as context only), its fp8 weights, and the tokenizer check that refuses a teacher whose
vocabulary is not the student's."""
import random

import pytest
import torch

import data
import train
from machinery import ConfigError, config
from machinery.checkpoint import save_full
from machinery.fp8 import FP8Linear
from machinery.teacher import Teacher, check_tokenizer
from model import GLM, GLMConfig
from rollout import Sample


def teacher_dir(tmp_path, tok, dsa=True, noise=0.1):
    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=256, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=128, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                    dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "F"} if dsa else None)
    model = GLM(cfg)
    with torch.no_grad():  # sharper than the 0.02 init: log-probs far from uniform, top-k choices that matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    path = str(tmp_path / "teacher")
    save_full(model, tok, path)
    return path, model


def samples(vocab, n=7, seed=0):
    """Trajectories of random ids: one-turn ones, and two-turn ones whose env tokens sit between the model's turns."""
    rng, out = random.Random(seed), []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        if i % 2:  # model turn, env tokens, model turn
            a, e, b = rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 5)
            response, spans = [rng.randrange(3, vocab) for _ in range(a + e + b)], [(0, a), (a + e, b)]
        else:
            response, spans = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))], None
        scored = sum(m for _, m in spans) if spans else len(response)
        out.append(Sample(prompt, response, [0.0] * scored, 0.0, i, (0, 0), "stop", {}, spans=spans))
    return out


def reference(model, s, temperature):
    """float64, the sequence alone and unpacked: log pi(token) of each model token."""
    ids, spans = s.row()
    logp = (model.double()(torch.tensor([ids]))[0].double() / temperature).log_softmax(-1)
    return [logp[a + k - 1, ids[a + k]].item() for a, n in spans for k in range(n)]


@pytest.mark.parametrize("dsa", [True, False])
def test_scores_are_each_sequence_alone_in_float64(tmp_path, dsa):
    """Several samples packed per row (a budget that splits them over rows), DSA top-k inside: each model token's
    teacher log-prob at the sampling temperature is the float64 forward's of its sequence alone (env tokens and
    prompts are context, never scored)."""
    tok = data.make_tiny_tokenizer()
    path, model = teacher_dir(tmp_path, tok, dsa)
    teacher = Teacher(path, "cpu", train.packed_forward, temperature=0.7, max_tokens=24)
    batch = samples(len(tok))
    assert teacher.score(batch) >= 0
    for s in batch:
        assert len(s.teacher_logprobs) == len(s.gen_logprobs)
        torch.testing.assert_close(torch.tensor(s.teacher_logprobs, dtype=torch.float64),
                                   torch.tensor(reference(model, s, 0.7), dtype=torch.float64), rtol=0, atol=2e-5)


def test_fp8_teacher_holds_e4m3_linears_and_scores_near_its_bf16_self(tmp_path):
    """distill.quantization: fp8: the decoder linears block-wise e4m3 (as the generator's); its scores are the full
    precision teacher's to fp8 rounding, and the same on every call."""
    tok = data.make_tiny_tokenizer()
    path, model = teacher_dir(tmp_path, tok, dsa=False, noise=0.03)  # log-probs -5.6 .. -3.6
    full = Teacher(path, "cpu", train.packed_forward, temperature=1.0, max_tokens=64)
    q = Teacher(path, "cpu", train.packed_forward, temperature=1.0, max_tokens=64, quantization="fp8")
    assert any(isinstance(m, FP8Linear) for m in q.model.modules())
    a, b, c = samples(len(tok), seed=1), samples(len(tok), seed=1), samples(len(tok), seed=1)
    full.score(a), q.score(b), q.score(c)
    x = torch.tensor([v for s in a for v in s.teacher_logprobs])
    y = torch.tensor([v for s in b for v in s.teacher_logprobs])
    assert [s.teacher_logprobs for s in b] == [s.teacher_logprobs for s in c]
    assert 0 < (x - y).abs().max() < 0.2 and (x - y).abs().mean() < 0.05


def test_a_bf16_teacher_scores_to_bf16_precision(tmp_path):
    """The GPU's dtype on the CPU: bf16 weights (as a GPU teacher holds them, dsa.FP32_PARAMS kept fp32), no autocast,
    against the float64 forward, DSA top-k inside: within bf16 rounding of 2 layers; and fp8 quantized from those bf16 weights (the GPU
    path: loaded in bf16, quantized in host memory) stays near them."""
    tok = data.make_tiny_tokenizer()
    path, model = teacher_dir(tmp_path, tok, dsa=True, noise=0.03)
    bf16 = Teacher(path, "cpu", train.packed_forward, temperature=0.7, max_tokens=24, dtype=torch.bfloat16)
    q = Teacher(path, "cpu", train.packed_forward, temperature=0.7, max_tokens=24, dtype=torch.bfloat16, quantization="fp8")
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16 and any(isinstance(m, FP8Linear) for m in q.model.modules())
    a, b = samples(len(tok), seed=2), samples(len(tok), seed=2)
    bf16.score(a), q.score(b)
    got = torch.tensor([v for s in a for v in s.teacher_logprobs], dtype=torch.float64)
    want = torch.tensor([v for s in a for v in reference(model, s, 0.7)], dtype=torch.float64)
    err = (got - want).abs()  # bf16 rounds (not 0), and may flip a DSA top-k key choice (a token's ~0.1); a wrong
    assert 0 < err.mean() < 0.02 and err.max() < 0.2  # token or position would be off by ~1 nat
    err8 = (torch.tensor([v for s in b for v in s.teacher_logprobs], dtype=torch.float64) - got).abs()
    assert 0 < err8.mean() < 0.08 and err8.max() < 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_teacher_bf16_and_fp8_score_as_the_cpu_one(tmp_path):
    """On a GPU: the bf16 teacher, and the fp8 one quantized in host memory then moved, score as the CPU's fp32
    teacher to bf16 / fp8 precision; the fp8 teacher's weights are on the GPU in e4m3."""
    tok = data.make_tiny_tokenizer()
    path, _ = teacher_dir(tmp_path, tok, dsa=False, noise=0.03)
    ref = samples(len(tok), seed=3)
    Teacher(path, "cpu", train.packed_forward, temperature=1.0, max_tokens=64).score(ref)
    want = torch.tensor([v for s in ref for v in s.teacher_logprobs])
    for quantization, (mean, most) in ((None, (0.02, 0.2)), ("fp8", (0.08, 0.5))):
        t = Teacher(path, "cuda", train.packed_forward, temperature=1.0, max_tokens=64, quantization=quantization)
        linear = next(m for m in t.model.modules() if isinstance(m, (FP8Linear, torch.nn.Linear)) and m is not t.model.lm_head)
        assert linear.weight.is_cuda and linear.weight.dtype == (torch.float8_e4m3fn if quantization else torch.bfloat16)
        got = samples(len(tok), seed=3)
        t.score(got)
        err = (torch.tensor([v for s in got for v in s.teacher_logprobs]) - want).abs()
        assert err.mean() < mean and err.max() < most


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tmp_path):
    """The student's tokenizer and the teacher's must map every token alike: the synthetic task's tokenizer and a
    teacher saved with it pass; one saved with the tool tokenizer (one more special token) is refused before any
    weights load, naming both vocabularies and the first id that differs."""
    student = data.synthetic_tokenizer("synthetic")
    same, _ = teacher_dir(tmp_path / "same", student)
    cfg = config.load_config(config.os.path.join(train.os.path.dirname(train.__file__), "configs", "tiny_cpu.yaml"),
                             [f"distill.teacher={same}"])
    check_tokenizer(cfg, student)
    other, _ = teacher_dir(tmp_path / "other", data.make_tiny_tokenizer(tools=True))
    cfg = config.load_config(config.os.path.join(train.os.path.dirname(train.__file__), "configs", "tiny_cpu.yaml"),
                             [f"distill.teacher={other}"])
    with pytest.raises(ConfigError) as e:
        check_tokenizer(cfg, student)
    msg = str(e.value)
    assert "\n" not in msg and other in msg and f"({len(student)} tokens)" in msg and f"({len(student) + 1} tokens)" in msg
    assert "the synthetic task's" in msg

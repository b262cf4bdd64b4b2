"""
Multi-token prediction (MTP, DeepSeek-V3's form, which GLM-4.5 and later ship): layers after the decoder that
draft the token after next, for speculative decoding, and its training loss. GLM-4.7-Flash's files hold one as
`model.layers.47.*` (GLM-5's: `model.layers.78.*`); GLMConfig.mtp_layers (config.json's num_nextn_predict_layers)
says how many. For position t with the decoder's last hidden state h_t (BEFORE the final norm: GLM.forward's
return_hidden="trunk") and the next token t+1:

    x = eh_proj(cat(enorm(embed(token t+1)), hnorm(h_t)))     [B, T, 2 hidden] -> [B, T, hidden]
    h' = Block(x)             a decoder layer of the model's family (MLA + MoE, GLM-5's with its DSA indexer)
    logits = head(shared_head.norm(h'))                        predicts token t+2

embed and head are the main model's: the published files hold copies (`embed_tokens`, `shared_head.head` inside
the layer), which load_pretrained checks against the main model's and save_pretrained writes back (MTPLoad; copies
that differ are kept apart, GLMConfig.mtp_own_embeddings). Layer j > 0 chains: h' of layer j - 1 takes the place of
h and token t+1+j that of t+1. Which hidden the MTP reads was checked against SGLang: its DeepSeek-V2/V3 decoder
and NextN layer return `hidden_states_before_norm` (the residual stream before model.norm / shared_head.norm) for
the EAGLE draft path; the DeepSeek-V3 report's h_i^0 is "the representation given by the main model".

The engine's API (speculative decoding). The MTP layer j is layer L + j of the caches (L = cfg.num_layers), built
with `mtp=True`: model.KVCache(cfg, B, S, mtp=True) or model.PagedKVCache(cfg, blocks, size, mtp=True) hold its
keys beside the decoder's (MLA: its latent; DSA: its indexer keys, the MTP layer being an F layer). Then

    logits, h = draft(model, hidden, next_ids, position_ids, attention_mask, cache, keep, layer=0)

hidden [B, T, hidden] (the trunk's, or the previous draft's h), next_ids [B, T] (the token after each position),
position_ids [B, T] (each hidden's position: the MTP layer's key for position t sits where the decoder's does, in
the same pool slot), attention_mask / cache / keep as GLM.forward takes them: a PagedKVCache prefill (packed
rows, `slots` and `packed` set) or decode step (`slots`, `keys`, `key_valid` set, one token per row), a KVCache
(which counts the MTP layer's slots in its own `mtp_length`: it fills them one token behind the decoder), or none.
Returns logits [B, T | K, vocab] of token t+2 and h [B, T | K, hidden], the block's output before
shared_head.norm, which the next draft step takes as its hidden (draft k+1 feeds h of draft k, at position t+1,
with the token drafted from these logits). A decode step of the engine: the trunk verifies, its last accepted
position's trunk hidden and the token it sampled there go to draft(), whose argmax is fed back k - 1 times.
The MTP layer's MoE records no routes (its drafts are never replayed: MoE.index None).

Training (slime's --enable-mtp-training): mtp_loss(model, trunk_hidden, input_ids, loss_mask, ...) -> a scalar,
each MTP layer's mean cross-entropy over the loss-mask tokens it predicts, averaged over layers, times `scale`
(config.py's model.mtp_loss_scale; slime uses 0.2); detach_trunk=True trains the MTP layers alone (RL).
"""
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import model
from model import GLM, GLMConfig, KVCache, PagedKVCache, RMSNorm, attention_inputs, family

# The MTP layer's own tensors beside its block's, and the two that copy the main model's (file names inside the layer)
GLUE = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


# ----------------------------------------------------------------------------- the layer

def block_config(cfg: GLMConfig) -> GLMConfig:
    """The config the MTP layers' blocks are built with: the decoder's, extended to num_layers + mtp_layers layers,
    the MTP ones MoE where the family has MoE and DSA F layers (each has its own indexer: GLM-5's MTP block does)."""
    n = cfg.num_layers + cfg.mtp_layers
    over = {"num_layers": n, "mtp_layers": 0}
    if cfg.moe is not None:
        over["moe"] = replace(cfg.moe, mlp_layer_types=list(cfg.moe.mlp_layer_types) + ["sparse"] * cfg.mtp_layers)
    if cfg.dsa is not None:
        over["dsa"] = replace(cfg.dsa, pattern="F")  # (only the MTP blocks are built from this config)
    return replace(cfg, **over)


class MTPLayer(nn.Module):
    """One MTP layer: the glue (enorm, hnorm, eh_proj, shared_head.norm; embed_tokens and shared_head.head when
    cfg.mtp_own_embeddings) and a decoder block of the family, whose submodules sit at the layer's own names
    (model.layers.{L + j}.self_attn..., as the files name them). index: the layer's number, L + j."""

    def __init__(self, cfg: GLMConfig, index: int):
        super().__init__()
        h = cfg.hidden_size
        block = family(cfg.model_type).block(block_config(cfg), index)
        for name, child in block.named_children():  # the block's tensors under this layer's names
            self.add_module(name, child)
        object.__setattr__(self, "block", block)  # (not a submodule: its children are registered above)
        if hasattr(block.mlp, "index"):
            block.mlp.index = None  # an MoE that records no routes (families/mla_moe.py's MoE.routed)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.mtp_own_embeddings:
            meta = torch.empty(0).is_meta  # (as GLM.__init__: no normal_ on meta)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h) if meta else None)
            self.shared_head.head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, embed: nn.Embedding, head: nn.Linear, hidden, next_ids, position_ids=None, attention_mask=None,
                cache=None, keep=None):
        """draft() with the embedding and head to use. -> (logits, hidden_out)."""
        x = self.body(embed, hidden, next_ids, position_ids, attention_mask, cache, keep)
        return head(self.shared_head.norm(x)), x

    def body(self, embed, hidden, next_ids, position_ids=None, attention_mask=None, cache=None, keep=None):
        """Everything up to the head: hidden_out [B, T | K, hidden], before shared_head.norm."""
        e = embed(next_ids)
        if torch.is_autocast_enabled(e.device.type):  # the residual stream in the compute dtype, as GLM.forward's
            e = e.to(torch.get_autocast_dtype(e.device.type))
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], -1))  # [B, T, hidden]
        kv, T = (cache if isinstance(cache, KVCache) else None), x.shape[1]
        if kv is not None:  # a KVCache writes at its `length`: the MTP layer's slots, one token behind the decoder's
            trunk_length, kv.length = kv.length, kv.mtp_length
        try:
            mask, rope = attention_inputs(self.block.self_attn.cfg, *x.shape[:2], x.device, position_ids, attention_mask,
                                          cache)
            rope = {name: (cos.to(x.dtype), sin.to(x.dtype)) for name, (cos, sin) in rope.items()}
            x, _, _ = self.block(x, rope, mask, cache, None, None, keep)
            if kv is not None:
                kv.mtp_length = kv.length + T
        finally:
            if kv is not None:
                kv.length = trunk_length
        return x


def embed_and_head(m: GLM, layer: MTPLayer):
    """The embedding and head an MTP layer uses: its own (cfg.mtp_own_embeddings) or the main model's."""
    if m.cfg.mtp_own_embeddings:
        return layer.embed_tokens, layer.shared_head.head
    return m.embed_tokens, m.lm_head


def draft(m: GLM, hidden, next_ids, position_ids=None, attention_mask=None, cache=None, keep=None, layer=0):
    """MTP layer `layer` (0: the first) of model m: (logits [B, T | K, vocab], hidden_out [B, T | K, hidden]), the
    engine's call (this file's docstring)."""
    if not m.cfg.mtp_layers:
        raise ValueError("draft: the model has no MTP layers (GLMConfig.mtp_layers, config.json's num_nextn_predict_layers)")
    mtp = m.mtp[str(m.cfg.num_layers + layer)]
    return mtp(*embed_and_head(m, mtp), hidden, next_ids, position_ids, attention_mask, cache, keep)


def layers(cfg: GLMConfig) -> nn.ModuleDict:
    """GLM.mtp: the MTP layers keyed by their layer number (their state-dict names model.hf_name maps to the
    files' model.layers.{L + j}.*)."""
    return nn.ModuleDict({str(i): MTPLayer(cfg, i) for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)})


# ----------------------------------------------------------------------------- the loss

class _Detached(nn.Module):
    """A module's forward with its weight detached (mtp_loss's detach_trunk: no gradient into the main model)."""

    def __init__(self, module):
        super().__init__()
        object.__setattr__(self, "inner", module)

    def forward(self, x):
        w = self.inner.weight.detach()
        return F.embedding(x, w) if isinstance(self.inner, nn.Embedding) else F.linear(x, w)


def mtp_loss(m: GLM, hidden, input_ids, loss_mask, position_ids=None, detach_trunk=True, scale=1.0, chunk=1024,
             temperature=1.0):
    """The MTP layers' training loss: layer j at position t reads (its input hidden at t, token t+1+j) and predicts
    token t+2+j; the cross-entropy counts where loss_mask[t+2+j] is set and t+2+j is in t's sequence (packed rows:
    position_ids restart at 0 where a sequence starts, as GLM.forward takes them). Each layer's mean over its
    counted tokens, averaged over layers, times scale (config.py's model.mtp_loss_scale).

    hidden [B, T, hidden]: GLM.forward(..., return_hidden="trunk"), before the final norm. input_ids, loss_mask
    [B, T]. detach_trunk: no gradient reaches the main model (its hidden states, embedding and head): RL trains
    the MTP layers alone. chunk: tokens per head call; each chunk's [chunk, vocab] logits are recomputed in
    backward rather than kept. temperature: the cross-entropy of softmax(logits / temperature), the distribution
    the engine drafts from at that sampling temperature: trained on tokens sampled at T (RL's), the layer's logits
    then match the policy's own, so its drafts at T are the policy's draws (at 1 they would learn the flatter
    softmax(policy / T), which drafting divides by T again)."""
    if not m.cfg.mtp_layers:
        raise ValueError("mtp_loss: the model has no MTP layers (model.mtp_layers)")
    B, T = input_ids.shape
    packed = position_ids  # (None: plain causal rows)
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    if detach_trunk:
        hidden = hidden.detach()
    h, losses = hidden, []
    for j in range(m.cfg.mtp_layers):
        mtp = m.mtp[str(m.cfg.num_layers + j)]
        embed, head = embed_and_head(m, mtp)
        if detach_trunk and not m.cfg.mtp_own_embeddings:
            embed, head = _Detached(embed), _Detached(head)
        s = j + 1  # token t + s feeds position t; t + s + 1 is the target
        next_ids = F.pad(input_ids[:, s:], (0, s))
        target = F.pad(input_ids[:, s + 1:], (0, s + 1))
        # t + s + 1 in t's sequence: no position restarts at 0 within t+1 .. t+s+1 (and inside the row)
        starts = F.pad(position_ids[:, 1:] == 0, (0, s + 1), value=True)  # [B, T]: position t + 1 starts a sequence
        same = ~torch.stack([starts[:, i:i + T] for i in range(s + 1)]).any(0)
        count = same & F.pad(loss_mask[:, s + 1:].bool(), (0, s + 1))
        h = mtp.body(embed, h, next_ids, position_ids=packed)  # only the counted rows go through the head, below
        x = mtp.shared_head.norm(h[count])  # [N, hidden]
        y = target[count]
        w = head.inner.weight.detach() if isinstance(head, _Detached) else head.weight
        total = x.sum() * 0.0
        for c in range(0, x.shape[0], chunk):
            total = total + torch.utils.checkpoint.checkpoint(_ce_sum, x[c:c + chunk], w, y[c:c + chunk], temperature,
                                                              use_reentrant=False)
        losses.append(total / count.sum().clamp(min=1))
    return scale * torch.stack(losses).mean()


def _ce_sum(x, w, y, temperature=1.0):
    """The summed cross-entropy of logits x @ w.T / temperature [N, vocab] (in fp32 at least) against y [N]."""
    logits = F.linear(x, w)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, y, reduction="sum")


# ----------------------------------------------------------------------------- checkpoints

@dataclass
class MTPLoad:
    """load_pretrained's plan for the MTP layers (made before the model is built): cfg with the layers to have
    (and whether their embedding and head are their own), the files' tensor lists without the MTP layers
    dropped, the layers to initialise fresh."""
    cfg: GLMConfig
    files: dict  # {file: [tensor names]}, the dropped layers' taken out
    fresh: list  # layer numbers the file lacks, initialised by finish()
    path: str

    def names(self, named: dict) -> dict:
        """{file name: tensor or part} of the model as load_pretrained expects them in the files: the fresh layers'
        left out, and the files' copies of the embedding and head pointing at the main model's (shared)."""
        out = {n: t for n, t in named.items() if not any(n.startswith(f"model.layers.{i}.") for i in self.fresh)}
        if not self.cfg.mtp_own_embeddings:
            for i in range(self.cfg.num_layers, self.cfg.num_layers + self.cfg.mtp_layers):
                if i not in self.fresh:
                    out.update({f"model.layers.{i}.{n}": named[main] for n, main in COPIES.items() if main in named})
        return out

    def finish(self, m: GLM):
        """The fresh layers: initialised as GLM.__init__ does (the family's init), one line saying which."""
        if not self.fresh:
            return
        with torch.no_grad():
            for i in self.fresh:
                m.mtp[str(i)].apply(family(self.cfg.model_type).init_weights)
        print(f"[model] {self.path}: no weights for MTP layer(s) {model._ranges(self.fresh)} in the checkpoint; "
              "initialised them fresh (train them with the MTP loss before drafting with them)")


def load(cfg: GLMConfig, mtp, files: dict, path) -> MTPLoad:
    """load_pretrained's MTP plan (MTPLoad): mtp (None: the checkpoint's count) layers; the file's MTP layers
    beyond them dropped (one line); whether the copies of the embedding and head equal the main model's."""
    in_file = cfg.mtp_layers
    want = in_file if mtp is None else mtp
    L = cfg.num_layers
    where = {n: f for f, names in files.items() for n in names}
    extra = sorted(i for i in range(L + want, L + in_file))
    if extra:
        print(f"[model] {path}: ignored the checkpoint's MTP layer(s) {model._ranges(extra)} (mtp_layers {want})")
        files = {f: [n for n in names if not any(n.startswith(f"model.layers.{i}.") for i in extra)]
                 for f, names in files.items()}
    fresh = [i for i in range(L, L + want) if not any(n.startswith(f"model.layers.{i}.") for n in where)]
    own = any(not _same(where, f"model.layers.{i}.{n}", main)
              for i in range(L, L + min(want, in_file)) if i not in fresh for n, main in COPIES.items())
    if own:
        print(f"[model] {path}: the MTP layers' embedding or head differ from the main model's; kept apart")
    return MTPLoad(replace(cfg, mtp_layers=want, mtp_own_embeddings=own), files, fresh, path)


def _same(where: dict, name, main, rows=4096) -> bool:
    """Whether the files' tensors `name` and `main` are equal (read in blocks of rows: a 150K x 6144 embedding is
    never held whole). A missing copy counts as equal (load_pretrained then names what is missing)."""
    if name not in where or main not in where:
        return True
    with safe_open(where[name], framework="pt", device="cpu") as a, safe_open(where[main], framework="pt") as b:
        sa, sb = a.get_slice(name), b.get_slice(main)
        if sa.get_shape() != sb.get_shape():
            return False
        n = sa.get_shape()[0]
        return all(torch.equal(sa[i:i + rows], sb[i:i + rows]) for i in range(0, n, rows))


def to_files(state: dict, cfg: GLMConfig) -> dict:
    """save_pretrained's {file name: CPU tensor} with each MTP layer's copies of the embedding and head, as the
    published files hold them (its own when cfg.mtp_own_embeddings: already in state)."""
    if cfg.mtp_own_embeddings:
        return state
    out = dict(state)
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers):
        for n, main in COPIES.items():
            src = state[main] if main in state else state["model.embed_tokens.weight"]  # (a tied head)
            out[f"model.layers.{i}.{n}"] = src.clone()  # safetensors refuses tensors that share memory
    return out


model.MTP = sys.modules[__name__]  # model.py's seam: GLM, load_pretrained and save_pretrained call here

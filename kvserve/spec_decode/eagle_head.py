"""The head of method "eagle": drafts from the target's own last hidden state, not from tokens alone.

A standalone draft must rebuild the context from tokens with a few layers; the target's final hidden state
already holds it. The head (after EAGLE, Li et al. 2024) maps (the target's hidden state at position t,
the embedding of token t + 1) to a prediction of the target's hidden state at t + 1, and reads a token off
it with a reduced LM head; fed its own prediction and token, it drafts the next one, and so on:

    f' = fc([f ; embed(token)]);  f' = f' + mlp(rms(f'));  logits = lm_head(rms(f'))

EAGLE's head has a decoder layer (attention over earlier positions, with a KV cache of its own); this one
has only the MLP. Measured on the default model (benchmarks/train_eagle.py) it drafts far better than the
2-layer standalone draft, and it needs no cache: a sequence's whole drafting state is one hidden vector.
The reference below can also train a head with that attention layer (EagleHeadConfig.num_attention_heads,
train_eagle.py --attention); side by side on one data set it drafted no better
(benchmarks/results/train_eagle_attention_cpu_1000.md), so the engine does not run such heads.

File: one safetensors file, tensors fc.weight [hidden, 2 * hidden], mlp_norm.weight,
mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [len(vocab_ids), hidden], vocab_ids; the
metadata key "kvserve_eagle" holds EagleHeadConfig as JSON (and "training", what made it). The token
embedding is the target's (not stored). Beside it, optionally, NAME.calibration.json: how far to trust its
drafts at first (confidence.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.linear import ColumnLinear, VocabEmbedding, pack_float_weights
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantization import QuantConfig
from kvserve.models.llama import MLP
from kvserve.models.loader import LoadedModel
from kvserve.models.native_stack import native_weight
from kvserve.sampling.sampler import argmax
from kvserve.spec_decode.confidence import CalibrationFileError, calibration_path, read_calibration
from kvserve.spec_decode.draft_model import full_vocab_logits, target_embedding
from kvserve.spec_decode.draft_format import (file_quantization, has_metadata, named_load_errors, read_with_config,
                                             save_with_config)
from kvserve.spec_decode.draft_reference import ReferenceTensors, rope, rms_norm
from kvserve.spec_decode.eagle_graphs import HeadGraphs

METADATA_KEY = "kvserve_eagle"
SHIPPED_HEAD = Path(__file__).parent / "drafts" / "smollm2-135m-eagle.safetensors"
# The most choices per row the native top-k calls pick (eagle_head.cpp's kMaxTop): wider trees' first steps
# take torch's softmax and topk instead.
NATIVE_MAX_CHOICES = 16
TENSORS = ("fc.weight", "mlp_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
           "norm.weight", "lm_head.weight")
ATTENTION_TENSORS = ("attn_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight")


@dataclass
class EagleHeadConfig:
    hidden_size: int                 # the target's
    intermediate_size: int
    vocab_size: int                  # the target's full vocabulary (vocab_ids index into it)
    rms_norm_eps: float
    target: str                      # the model it was trained for, for messages
    # Target layers (0-based) whose outputs, RMS-normalised without a weight, join its final feature for the
    # first drafting step: fuse.weight [hidden, (1 + len) * hidden] maps them to one feature (after EAGLE-3,
    # which fuses low, middle and high layers). Empty: the final feature alone, as files before it.
    fuse_layers: list[int] = dataclasses.field(default_factory=list)
    # A causal self-attention layer before the MLP (EAGLE's decoder layer), over the head's own inputs at
    # earlier positions: attn_norm.weight, self_attn.{q,k,v,o}_proj.weight, rotary positions. 0 heads: none,
    # as files before it. An experiment of train_eagle.py --attention: the engine has no cache for it yet.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 0.0


def is_head_file(path: str | Path) -> bool:
    return has_metadata(path, METADATA_KEY)


def save_head(path: str | Path, cfg: EagleHeadConfig, tensors: dict[str, torch.Tensor],
              training: dict[str, Any] | None = None) -> None:
    save_with_config(path, METADATA_KEY, cfg, tensors, training)


def read_head(path: str | Path) -> tuple[EagleHeadConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, training record)."""
    return read_with_config(path, METADATA_KEY, EagleHeadConfig, "eagle head")


class EagleHeadReference(ReferenceTensors):
    """The head in plain float torch: what train_eagle.py trains, and the tests' reference for EagleHead."""

    def __init__(self, cfg: EagleHeadConfig, embedding: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        names = list(TENSORS) + (["fuse.weight"] if cfg.fuse_layers else [])
        names += list(ATTENTION_TENSORS) if cfg.num_attention_heads else []
        super().__init__(embedding, tensors, names)
        self.cfg = cfg
        if cfg.num_attention_heads:
            d = cfg.head_dim
            self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d),
                                 persistent=False)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., (1 + len(fuse_layers)) * hidden] target features -> [..., hidden] the first step's feature."""
        return F.linear(features, self.p("fuse.weight")) if self.cfg.fuse_layers else features

    def step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[..., hidden] features and [...] next tokens -> [..., hidden] predicted next features (a head
        without attention; unrolled() runs either kind)."""
        assert not self.cfg.num_attention_heads, "a head with attention drafts through unrolled()"
        return self.mlp_block(self.input_entries(feature, token_ids))

    def input_entries(self, feature: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[..., hidden] features and [...] the tokens after them -> [..., hidden] the head's inputs."""
        return F.linear(torch.cat([feature, self.embedding[token_ids]], -1), self.p("fc.weight"))

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(rms(x)): the head's last block, whose output is the predicted feature."""
        h = rms_norm(x, self.p("mlp_norm.weight"), self.cfg.rms_norm_eps)
        gate, up = F.linear(h, self.p("mlp.gate_proj.weight")), F.linear(h, self.p("mlp.up_proj.weight"))
        return x + F.linear(F.silu(gate) * up, self.p("mlp.down_proj.weight"))

    def attention_qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[n, hidden] inputs at rotary positions [n] -> q [n, H, D], k and v [n, H, D] (KV heads repeated)."""
        c = self.cfg
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = rms_norm(x, self.p("attn_norm.weight"), c.rms_norm_eps)
        q = F.linear(h, self.p("self_attn.q_proj.weight")).view(-1, H, D)
        k = F.linear(h, self.p("self_attn.k_proj.weight")).view(-1, Hkv, D).repeat_interleave(H // Hkv, 1)
        v = F.linear(h, self.p("self_attn.v_proj.weight")).view(-1, Hkv, D).repeat_interleave(H // Hkv, 1)
        freqs = torch.outer(positions.float(), self.inv_freq)
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        return rope(q, cos, sin), rope(k, cos, sin), v

    def unrolled(self, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """One sequence, teacher-forced: the target's features [T, ...] and tokens [T] -> for j = 1..steps the
        head's predicted features [T - j, hidden], row t the chain drafted from position t after j steps
        (its prediction of the target's feature at t + j). Step 1 reads the target's feature at t and token
        t + 1; step j > 1 the chain's own prediction and token t + j, as at inference.

        With attention, the head's input for position t (step 1) is its entry at rotary position t + 1, the
        token it embeds; a chain's step j attends to the step-1 entries of positions 0..t (what a drafting
        sequence has cached from verified tokens) and to its own entries of steps 2..j (EAGLE-3's
        training-time test), never to the step-1 entries after t, which read target features a drafting
        sequence does not have yet."""
        out: list[torch.Tensor] = []
        x = self.input_entries(self.fuse(features[:-1]), ids[1:])
        n = x.shape[0]
        if self.cfg.num_attention_heads:
            scale = self.cfg.head_dim ** -0.5
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            q, k1, v1 = self.attention_qkv(x, torch.arange(1, n + 1, device=x.device))
            own_k: list[torch.Tensor] = []  # the chains' entries of steps 2..j: [T - i, H, D]
            own_v: list[torch.Tensor] = []
        for j in range(1, steps + 1):
            n = x.shape[0]
            if n == 0:
                break
            if self.cfg.num_attention_heads:
                if j > 1:
                    q, k, v = self.attention_qkv(x, torch.arange(j, n + j, device=x.device))
                    own_k.append(k)
                    own_v.append(v)
                ctx = torch.einsum("nhd,shd->hns", q, k1[:n]) * scale
                ctx = ctx.masked_fill(~causal[:n, :n], float("-inf"))
                own = [(q * kk[:n]).sum(-1).T[..., None] * scale for kk in own_k]  # [H, n, 1] each
                p = torch.cat([ctx, *own], -1).softmax(-1)
                a = torch.einsum("hns,shd->nhd", p[..., :n], v1[:n])
                for i, vv in enumerate(own_v):
                    a = a + p[..., n + i].T[..., None] * vv[:n]
                x = x + F.linear(a.reshape(n, -1), self.p("self_attn.o_proj.weight"))
            f = self.mlp_block(x)
            out.append(f)
            if j < steps:
                x = self.input_entries(f[:-1], ids[j + 1:])
        return out

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., len(vocab_ids)] logits over the reduced vocabulary."""
        return F.linear(rms_norm(feature, self.p("norm.weight"), self.cfg.rms_norm_eps), self.p("lm_head.weight"))

    def training_loss(self, ids: torch.Tensor, labels: torch.Tensor, features: torch.Tensor, unroll: int,
                      feature_weight: float, soft_weight: float = 0.0,
                      target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence, teacher-forced: ids [T], labels [T] (labels[t]: the target's choice after position
        t, as an index into vocab_ids, -100 where none), the target's features [T, hidden]. Drafting step j
        (1..unroll) is scored on the target's token and feature at t + j (unrolled()); later steps weigh less.
        With fuse_layers, features [T, (1 + n) * hidden]: the final feature first, scored alone.

        soft_weight > 0 moves that share of the token loss from the target's choice to its whole distribution
        over vocab_ids, read off its features with target_lm_head ([len(vocab_ids), hidden], the target's LM
        head rows for vocab_ids): cross-entropy against soft labels (distillation)."""
        final = features[:, :self.cfg.hidden_size]
        total = features.new_zeros(())
        for j, f in enumerate(self.unrolled(features, ids, unroll), 1):
            y = labels[j:]
            valid = y >= 0
            logits = self.logits(f)
            ce = F.cross_entropy(logits[valid], y[valid]) if valid.any() else total
            if soft_weight > 0:
                soft = F.linear(final[j:], target_lm_head).softmax(-1)
                ce = (1 - soft_weight) * ce + soft_weight * F.cross_entropy(logits, soft)
            reg = F.smooth_l1_loss(f, final[j:])
            total = total + 0.8 ** (j - 1) * (ce + feature_weight * reg)
        return total


class EagleHead(nn.Module):
    """The head in kvserve's layers (the engine's weight formats), next to the target it reads."""

    def __init__(self, cfg: ModelConfig, head: EagleHeadConfig, embed: VocabEmbedding, vocab_ids: torch.Tensor,
                 quant: QuantConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.config = cfg
        self._embed = (embed,)  # the target's module: a tuple keeps it out of this module's parameters
        self.fc = ColumnLinear(2 * d, d, quant.method(["fc.weight"]), "fc.weight")
        self.mlp_norm = RMSNorm(d, head.rms_norm_eps)
        self.mlp = MLP(cfg, quant, "mlp")
        self.norm = RMSNorm(d, head.rms_norm_eps)
        self.lm_head = ColumnLinear(d, len(vocab_ids), quant.method(["lm_head.weight"]), "lm_head.weight")
        self.register_buffer("vocab_ids", vocab_ids.to(torch.int64), persistent=False)
        self.native_weights: list[torch.Tensor | None] | None = None  # see use_native_kernel
        self.native_embedding: list[torch.Tensor | None] | None = None  # the same
        self.graphs: HeadGraphs | None = None  # see capture_graphs
        # Where to start trusting its drafts (confidence.py), from the table beside its file; None: its probabilities.
        self.calibration: list[list[float]] | None = None

    def capture_graphs(self, max_rows: int) -> None:
        """On CUDA, after loading: greedy_step and head_logits_step replay a captured graph for up to max_rows
        rows (eagle_graphs.py)."""
        graphs = HeadGraphs(self, max_rows)
        graphs.capture()
        self.graphs = graphs

    def use_native_kernel(self) -> None:
        """After loading: greedy_step and head_logits_step run as one native call (kernels/cpu/eagle_head.cpp)
        where the CPU kernels are built and multiply every linear layer (native_weight: quantized tiles, or float
        weights on dense_linear or AMX tiles); else in Python."""
        parts = [native_weight(layer) for layer in (self.fc, self.mlp.gate_up_proj, self.mlp.down_proj, self.lm_head)]
        if (any(p is None for p in parts) or type(self.mlp.act) is not SiluAndMul or self.vocab_ids.device.type != "cpu"
                or not cpu_kernels.available() or not hasattr(cpu_kernels.ops(), "eagle_step")):
            return
        fc, gate_up, down, lm_head = parts
        self.native_weights = [*fc, self.mlp_norm.weight, *gate_up, *down, self.norm.weight, *lm_head]
        # draft_chains embeds its own tokens: where the target's embedding is in a format it reads, in this dtype.
        embed = self._embed[0]
        if embed.method.dtype == self.norm.weight.dtype:
            self.native_embedding = native_weight(embed)

    def step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, hidden] features and [N] next tokens -> (the predicted next features, the same through the
        final norm: what the LM head reads)."""
        dtype = self.norm.weight.dtype
        x = self.fc(torch.cat([feature.to(dtype), self._embed[0].embed(token_ids).to(dtype)], -1))
        # Both norms as residual-add + norm, which the CPU kernels fuse (torch's rms_norm of one 576-wide row
        # took 80-160 us inside a step, the fused kernel a few): (norm(x), x), then (norm(x + mlp), x + mlp).
        h, x = self.mlp_norm(x, torch.zeros_like(x))
        normed, x = self.norm(self.mlp(h), x)
        return x, normed

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary [N, len(vocab_ids)] -> over the full one, -inf outside vocab_ids."""
        return full_vocab_logits(logits, self.vocab_ids, self.config.vocab_size)

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """step()'s normed features [N, hidden] -> [N] the head's most likely tokens (full-vocabulary ids)."""
        return self.vocab_ids[argmax(self.lm_head(normed))]

    def greedy_step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """step() then greedy_tokens(): (the predicted next features, the head's most likely tokens). In one
        native call where use_native_kernel() set it up: at one stream on two AVX2 cores, dispatching the dozen
        small calls from Python cost about as much as the head's matmuls. On CUDA, one graph replay (after
        capture_graphs): then both are views into the graph's outputs, valid until the head's next step."""
        if self.graphs is not None and (out := self.graphs.run(feature, token_ids)) is not None:
            return out[0], out[2]
        if not self._runs_natively(feature):
            feature, normed = self.step(feature, token_ids)
            return feature, self.greedy_tokens(normed)
        return cpu_kernels.ops().eagle_greedy_step(*self._native_inputs(feature, token_ids), self.native_weights,
                                                   self.vocab_ids, self.norm.eps)

    def head_logits_step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """step() then the LM head: (the predicted next features, float32 logits over the head's vocabulary
        [N, len(vocab_ids)], what a sampled draft is drawn from). In one native call or one replay (views valid
        until the next step), as greedy_step."""
        if self.graphs is not None and (out := self.graphs.run(feature, token_ids)) is not None:
            return out[0], out[1]
        if not self._runs_natively(feature):
            feature, normed = self.step(feature, token_ids)
            return feature, self.lm_head(normed).float()
        return cpu_kernels.ops().eagle_step(*self._native_inputs(feature, token_ids), self.native_weights,
                                            self.norm.eps)

    def top_step(self, feature: torch.Tensor, token_ids: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """head_logits_step, then each row's k likeliest tokens (full-vocabulary ids, likeliest first) and their
        probabilities over the head's vocabulary: (the predicted next features, tokens [N, k], probabilities
        [N, k]). In one native call where use_native_kernel() set it up."""
        if self.graphs is None and k <= NATIVE_MAX_CHOICES and self._runs_natively(feature):
            return cpu_kernels.ops().eagle_top_step(*self._native_inputs(feature, token_ids), self.native_weights,
                                                    self.vocab_ids, k, self.norm.eps)
        feature, logits = self.head_logits_step(feature, token_ids)
        probs, top = logits.softmax(dim=-1).topk(k, dim=-1)
        return feature, self.vocab_ids[top], probs

    def draft_chains(self, feature: torch.Tensor, token_ids: torch.Tensor, k: int, depths: list[int],
                     rates: list[float], min_gain: float
                     ) -> tuple[list[list[int]], list[list[float]], list[int]] | None:
        """A greedy tree for each row in one native call (eagle_head.cpp's eagle_draft_chains): the head's k
        likeliest tokens at its first step, then its first choice at each next step while the chain is shorter
        than depths[i] and the product of its tokens' rates (confidence.Calibration.chain_rates) stays at least
        min_gain. -> (per row: the first step's k tokens then the chain's later ones, their probabilities, the
        chain's length), or None where the native kernels do not run this head or k is over NATIVE_MAX_CHOICES
        (top_step in a loop then)."""
        if (self.native_embedding is None or self.graphs is not None or k > NATIVE_MAX_CHOICES
                or not self._runs_natively(feature)):
            return None
        ids, probs, lengths = cpu_kernels.ops().eagle_draft_chains(
            feature.to(self.norm.weight.dtype), token_ids, self.native_weights, self.vocab_ids,
            *self.native_embedding, k, depths, rates, min_gain, self.norm.eps)
        return ids.tolist(), probs.tolist(), lengths.tolist()

    def _runs_natively(self, feature: torch.Tensor) -> bool:
        return self.native_weights is not None and cpu_kernels.applies(feature)

    def _native_inputs(self, feature: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.norm.weight.dtype
        return feature.to(dtype).contiguous(), self._embed[0].embed(token_ids).to(dtype).contiguous()

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fc.weight_loader(0, tensors["fc.weight"])
        self.lm_head.weight_loader(0, tensors["lm_head.weight"])
        self.mlp.gate_up_proj.weight_loader(0, tensors["mlp.gate_proj.weight"])
        self.mlp.gate_up_proj.weight_loader(1, tensors["mlp.up_proj.weight"])
        self.mlp.down_proj.weight_loader(0, tensors["mlp.down_proj.weight"])
        self.mlp_norm.weight.copy_(tensors["mlp_norm.weight"].float())
        self.norm.weight.copy_(tensors["norm.weight"].float())
        for layer in (self.fc, self.lm_head, self.mlp.gate_up_proj, self.mlp.down_proj):
            layer.finalize()


def head_quantization(engine_quantization: str, device: torch.device, given: str | None = None) -> str:
    """The head's linear layers, its LM head's included: speculative_config's quantization where given ("auto":
    the file's floats), else 4-bit weights on a CPU, unless the engine runs
    unquantized ("none": exact float comparisons in tests) or on a GPU. A drafting step reads all of the head's
    weights from memory after the target's pass has pushed them out of cache, so its bytes are its time: 3.5 MB
    in int4 against 6.0 MB in int8. Scratch A/Bs in one process at one stream (AVX-512 Zen 5), a tree each:
    on 16 chat answers as good drafts (1169-1171 steps against 1174-1230) and 1.198x against 1.161-1.180x;
    on 16 summaries 2-4% more steps (1099-1109 against 1059-1084) and 1.275-1.293x against 1.261-1.299x."""
    if given is not None:
        return file_quantization(given)
    return "int4" if device.type == "cpu" and engine_quantization != "none" else "none"


def load_eagle_head(path: str | Path | None, target: LoadedModel, dtype: torch.dtype, device: torch.device,
                    quantization: str) -> EagleHead:
    """The head at path (None: the one shipped for the default model), in the given weight format."""
    if path is None:
        if not SHIPPED_HEAD.exists():
            raise FileNotFoundError(f"speculative_config: the shipped eagle head {SHIPPED_HEAD} is missing; "
                                    "make it with benchmarks/train_eagle.py or pass 'model'")
        try:
            return load_eagle_head(SHIPPED_HEAD, target, dtype, device, quantization)
        except CalibrationFileError:
            raise
        except ValueError as e:
            raise ValueError(f"{e}. Method 'eagle' without 'model' uses the head shipped for the default model; "
                             "for another target pass 'model': a head trained for it") from None
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"speculative_config: model {str(path)!r} does not exist (method 'eagle' takes "
                                "a head .safetensors made by benchmarks/train_eagle.py)")
    if not is_head_file(p):
        raise ValueError(f"speculative_config: {str(path)!r} is not a kvserve eagle head (method 'eagle' takes "
                         "a head .safetensors made by benchmarks/train_eagle.py)")
    with named_load_errors("eagle head", p):
        return _build_head(p, target, dtype, device, quantization)


def _build_head(p: Path, target: LoadedModel, dtype: torch.dtype, device: torch.device, quantization: str
                ) -> EagleHead:
    hcfg, tensors, _ = read_head(p)
    if hcfg.fuse_layers:
        raise ValueError(f"speculative_config: {str(p)!r} is an eagle head that fuses target layers "
                         f"{hcfg.fuse_layers}; the engine hands a head the final hidden state only (such heads "
                         "are a training experiment of benchmarks/train_eagle.py --fuse-layers)")
    if hcfg.num_attention_heads:
        raise ValueError(f"speculative_config: {str(p)!r} is an eagle head with an attention layer, which "
                         "needs a KV cache of its own that the engine does not keep yet (such heads are a training "
                         "experiment of benchmarks/train_eagle.py --attention)")
    embed = target_embedding(target, "eagle head", p, hcfg.target, hcfg.hidden_size, hcfg.vocab_size)
    cfg = dataclasses.replace(target.config, intermediate_size=hcfg.intermediate_size)
    quant = QuantConfig(quantization, 32, dtype, device)
    with torch.device(device):
        model = EagleHead(cfg, hcfg, embed, tensors["vocab_ids"].to(device), quant).to(dtype)
    model.load_weights(tensors)
    pack_float_weights(model)
    model.use_native_kernel()
    table = calibration_path(p)
    if table.exists():
        model.calibration = read_calibration(table)
    return model.eval().requires_grad_(False)


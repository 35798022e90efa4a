"""A draft checkpoint's forward pass in plain torch: what train_draft.py trains, and the independent
reference the tests hold kvserve's DraftLM (paged KV cache, fused projections) to.

Whole sequences, causal attention, no cache: [B, T] token ids -> [B, T, len(vocab_ids)] logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.spec_decode.draft_format import DraftFileConfig

LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # Hugging Face's rotate-half layout
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ReferenceTensors(nn.Module):
    """A checkpoint's tensors as trainable float parameters, over a target's frozen embedding: the plain
    torch side of the draft checkpoint (below) and of the eagle head (eagle_head.py)."""

    def __init__(self, embedding: torch.Tensor, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
        """embedding: the target's [vocab, hidden] float embedding; names: the tensors that are parameters."""
        super().__init__()
        self.register_buffer("embedding", embedding.float(), persistent=False)
        self.register_buffer("vocab_ids", tensors["vocab_ids"].to(torch.int64), persistent=False)
        # Parameter names are the checkpoint's with "." -> "__" (nn.ParameterDict keys cannot hold dots).
        self.params = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(tensors[k].float().clone())
                                        for k in names})

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (for saving)."""
        out = {k.replace("__", "."): v.detach() for k, v in self.params.items()}
        out["vocab_ids"] = self.vocab_ids
        return out


class DraftReference(ReferenceTensors):
    def __init__(self, cfg: DraftFileConfig, embedding: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """embedding: the target's [vocab, hidden] float embedding (frozen); tensors: the checkpoint's."""
        super().__init__(embedding, tensors, [k for k in tensors if k != "vocab_ids"])
        self.cfg = cfg
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(ids), self.p("lm_head.weight"))

    def hidden(self, ids: torch.Tensor, taps: tuple[int, ...] = ()) -> torch.Tensor:
        """[B, T] -> [B, T, hidden]: the last layer's output after the final norm (what the head reads). With
        taps, [B, T, (1 + len(taps)) * hidden]: then the residual stream after each tapped layer (0-based),
        RMS-normalised without a weight (what a fusing head reads too; their scales differ by layer)."""
        cfg = self.cfg
        B, T = ids.shape
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        freqs = torch.outer(torch.arange(T, dtype=torch.float32, device=ids.device), self.inv_freq)
        cos, sin = freqs.cos()[None, None], freqs.sin()[None, None]   # [1, 1, T, D/2]
        x = self.embedding[ids]
        tapped = []
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            h = rms_norm(x, self.p(pre + "input_layernorm.weight"), cfg.rms_norm_eps)
            q = F.linear(h, self.p(pre + "self_attn.q_proj.weight")).view(B, T, H, D).transpose(1, 2)
            k = F.linear(h, self.p(pre + "self_attn.k_proj.weight")).view(B, T, Hkv, D).transpose(1, 2)
            v = F.linear(h, self.p(pre + "self_attn.v_proj.weight")).view(B, T, Hkv, D).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), self.p(pre + "self_attn.o_proj.weight"))
            h = rms_norm(x, self.p(pre + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
            gate = F.linear(h, self.p(pre + "mlp.gate_proj.weight"))
            up = F.linear(h, self.p(pre + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, self.p(pre + "mlp.down_proj.weight"))
            if i in taps:
                tapped.append(rms_norm(x, 1.0, cfg.rms_norm_eps))
        return torch.cat([rms_norm(x, self.p("model.norm.weight"), cfg.rms_norm_eps), *tapped], -1)

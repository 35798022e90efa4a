"""The draft checkpoint that train_draft.py writes and kvserve ships for the default model: one safetensors file.

A draft made for one target shares that target's token embedding (read from the target at load time, so
the file holds none of its 28M parameters) and predicts only the `vocab_ids` the target emits most often
(a reduced LM head: most of a small model's per-token cost would otherwise be the 49k-row output layer).
Tensors carry Hugging Face Llama names:

    model.layers.{i}.{input,post_attention}_layernorm.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
    model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.norm.weight, lm_head.weight [len(vocab_ids), hidden],
    vocab_ids [int64]

and the metadata key "kvserve_draft" holds DraftFileConfig as JSON (plus, under "training", what made it).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvserve.spec_decode.confidence import CalibrationFileError

METADATA_KEY = "kvserve_draft"
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-draft.safetensors"


@dataclass
class DraftFileConfig:
    num_hidden_layers: int
    hidden_size: int                 # must equal the target's (the embedding is the target's)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                  # the target's full vocabulary (vocab_ids index into it)
    rms_norm_eps: float
    rope_theta: float
    target: str                      # the model it was trained for, for messages


def is_draft_file(path: str | Path) -> bool:
    return has_metadata(path, METADATA_KEY)


def save_draft(path: str | Path, cfg: DraftFileConfig, tensors: dict[str, torch.Tensor],
               training: dict[str, Any] | None = None) -> None:
    save_with_config(path, METADATA_KEY, cfg, tensors, training)


def read_draft(path: str | Path) -> tuple[DraftFileConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, tensors, training record)."""
    return read_with_config(path, METADATA_KEY, DraftFileConfig, "draft")


# A safetensors file whose metadata holds a config dataclass as JSON under `key` (and, under "training",
# what made it): the draft checkpoint above and the eagle head (eagle_head.py).

def has_metadata(path: str | Path, key: str) -> bool:
    p = Path(path)
    if not (p.is_file() and p.suffix == ".safetensors"):
        return False
    try:
        with safe_open(str(p), "pt") as f:
            return key in (f.metadata() or {})
    except SafetensorError:  # not a safetensors file after all: the caller says what it expected
        return False


@contextmanager
def named_load_errors(what: str, path: str | Path) -> Iterator[None]:
    """Whatever loading a user's draft file raises (a draft checkpoint, an eagle head, a Hugging Face or GGUF
    draft), as one ValueError that names the file: a damaged one raised KeyError, TypeError, IndexError or an
    assertion from deep in the loader, with a traceback and no word of which file was at fault. Errors that
    already say what is wrong with the speculative config pass as they are."""
    try:
        yield
    except torch.OutOfMemoryError:  # not the file's fault
        raise
    except (ValueError, OSError) as e:
        if str(e).startswith("speculative_config:") or isinstance(e, CalibrationFileError):
            raise
        if str(path) in str(e):  # read_with_config's own: it names the file
            raise ValueError(f"speculative_config: {e}") from e
        raise ValueError(f"speculative_config: {what} {str(path)!r} cannot be loaded: {e}") from e
    except (KeyError, TypeError, IndexError, AssertionError, AttributeError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"speculative_config: {what} {str(path)!r} is damaged or incomplete "
                         f"({type(e).__name__}: {e})") from e


def file_quantization(given: str) -> str:
    """speculative_config's quantization for the weights of a file above (a draft checkpoint, an eagle head),
    which are floats: "auto" keeps them so."""
    return "none" if given == "auto" else given


def save_with_config(path: str | Path, key: str, cfg: Any, tensors: dict[str, torch.Tensor],
                     training: dict[str, Any] | None) -> None:
    meta = {key: json.dumps(asdict(cfg)), "training": json.dumps(training or {})}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16)
_FIELD_KINDS: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "list[int]": list}


def read_with_config(path: str | Path, key: str, cls: type, what: str
                     ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(cls from the metadata, tensors, training record); what names the file kind in the error."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if key not in meta:
            raise ValueError(f"{path} is a safetensors file but not a kvserve {what} (no {key!r} metadata)")
        raw = json.loads(meta[key])
        if not isinstance(raw, dict):
            raise ValueError(f"{path} is a damaged kvserve {what}: its {key!r} metadata is not a JSON object")
        for field_ in fields(cls):  # a wrong type would only fail later, in a message about something else
            kind, value = _FIELD_KINDS.get(str(field_.type)), raw.get(field_.name)
            if field_.name in raw and kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise ValueError(f"{path} is a damaged kvserve {what}: its metadata's {field_.name} should be "
                                 f"{field_.type}, got {value!r}")
        cfg = cls(**{k.name: raw[k.name] for k in fields(cls) if k.name in raw})  # absent: its default
        # Copies: safetensors maps the file, and a tensor kept as read (vocab_ids) would change with the file
        # if it were rewritten in place (a retrained head copied over the one an engine runs). A few MB.
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        training = json.loads(meta.get("training", "{}"))
    ids = tensors.get("vocab_ids")
    # The tokens the LM head predicts must be distinct ids of the target's vocabulary: an id past it would
    # fail only when drafted, inside an engine step, taking every request in the step down.
    if ids is not None and (ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in _INDEX_DTYPES or int(ids.min()) < 0
                            or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel()):
        raise ValueError(f"{path} is a damaged kvserve {what}: its vocab_ids must be distinct token ids below "
                         f"{cfg.vocab_size}, as integers")
    return cfg, tensors, training

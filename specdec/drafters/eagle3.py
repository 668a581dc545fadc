"""EAGLE-3 draft heads people already have (`--draft DIR`): a directory with the head's config.json and safetensors,
in the layout vLLM, SGLang and SpecForge load (`midlayer.*` or `layers.0.*`, `fc`, `lm_head` over a draft vocabulary,
`d2t`/`t2d`; speculators' nested `transformer_layer_config` too). The target (on specdec's runtime) hands the
drafter its hidden states at the head's three layers (`Llama.feature_layers`); the head drafts chains through the
feature drafter's machinery (drafters/feature.py), in torch. Its proposals are verified like any draft's, so the
output is the target's whatever the head's numerics."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import IncompatibleDraft, ModelLoadError
from ..models import is_runtime
from ..runtime.weights import QTensor
from .feature import FeatureDrafter, _CachedRows
from .eagle3_net import Eagle3Net

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
NAMES = {  # the checkpoint's names (after `model.` and `midlayer.`/`layers.0.` are dropped) -> the net's
    "fc.weight": "fc.weight", "input_layernorm.weight": "input_norm.weight", "hidden_norm.weight": "hidden_norm.weight",
    "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight", "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_proj.bias": "q.bias", "self_attn.k_proj.bias": "k.bias", "self_attn.v_proj.bias": "v.bias",
    "self_attn.o_proj.weight": "o.weight", "post_attention_layernorm.weight": "post_norm.weight",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight", "mlp.down_proj.weight": "down.weight",
    "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


def is_eagle3(path) -> bool:
    """A directory whose config.json names an EAGLE-3 head."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (config.get("speculators_model_type") == "eagle3" or any(
        a in ARCHITECTURES for a in config.get("architectures") or []))


def aux_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input (the residual stream before them) the head reads: the config's, else the
    convention of EAGLE-3's trainers (2, L/2, L-3)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or config.get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < target_layers for i in ids):
        raise IncompatibleDraft(f"the EAGLE-3 head reads target layers {list(ids)}, the target has {target_layers}")
    return ids


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"cannot load EAGLE-3 head {path}: no .safetensors file")
    out = {}
    for f in files:
        for name, w in load_file(f).items():
            name = name.removeprefix("model.")
            for prefix in ("midlayer.", "layers.0."):
                name = name.removeprefix(prefix)
            out[name] = w
    return out


class Eagle3Drafter(FeatureDrafter):
    """A feature drafter whose features are the target's three layers fused by the head's `fc`, whose layer is the
    head's, and whose logits are its own head's over the draft vocabulary (`vocab_map`: draft id -> target id)."""

    def __init__(self, net: Eagle3Net, embed, vocab_map: torch.Tensor, vocab_size: int, layers: tuple[int, ...],
                 name: str = "eagle3"):
        self.net, self.vocab_map, self.vocab_size, self.name = net.eval().requires_grad_(False), vocab_map, vocab_size, name
        self.target_layers = layers
        self.min_confidence = 0.0  # its confidence is not calibrated here: the block runs to the τ asked
        self.dtype = torch.float32
        self._embed = _CachedRows(embed) if isinstance(embed, QTensor) else (
            lambda ids: embed[torch.tensor(ids)].float())
        self._rt, self._q8 = None, False
        self._logits = net.logits
        self.reset()

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        """The target's states at the head's three layers [T, 3 x target hidden], fused by `fc` into features."""
        with torch.inference_mode():
            super().observe_target(start, self.net.fc(hidden.float()))

    @classmethod
    def load(cls, path, target_model, name: str | None = None) -> Eagle3Drafter:
        from transformers import LlamaConfig

        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
            weights = _weights(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load EAGLE-3 head {path}: {e}")
        if not is_runtime(target_model):
            raise IncompatibleDraft("an EAGLE-3 head reads the target's inner layers: run the target on specdec's "
                                    "runtime (a GGUF file, or --backend runtime)")
        layer = {k: v for k, v in (raw.get("transformer_layer_config") or raw).items() if k != "architectures"}
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise IncompatibleDraft(f"{path}: an EAGLE-3 head of {layer['num_hidden_layers']} layers (one is run)")
        config = LlamaConfig(**layer)
        vocab = target_model.config.vocab_size
        draft_vocab = int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or config.vocab_size)
        target_hidden = int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or config.hidden_size)
        if target_hidden != target_model.config.hidden_size or config.vocab_size != vocab:
            raise IncompatibleDraft(f"{path} is a head for a target of hidden size {target_hidden} and vocabulary "
                                    f"{config.vocab_size}; this target has {target_model.config.hidden_size} and {vocab}")
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)
        vocab_map = torch.arange(draft_vocab) + (d2t.long() if d2t is not None else 0)
        if len(vocab_map) != draft_vocab or int(vocab_map.max()) >= vocab or int(vocab_map.min()) < 0:
            raise IncompatibleDraft(f"{path}: its d2t maps draft ids outside the target's {vocab} token ids")
        embed = weights.pop("embed_tokens.weight", None)
        net = Eagle3Net(config, draft_vocab, target_hidden, max_len=getattr(target_model, "max_len", 8192))
        missing = sorted(set(NAMES) - set(weights) - {k for k in NAMES if k.endswith(".bias")})
        if missing:
            raise ModelLoadError(f"cannot load EAGLE-3 head {path}: no {missing[0]} in its safetensors")
        try:
            net.load_state_dict({NAMES[k]: w.float() for k, w in weights.items() if k in NAMES})
        except RuntimeError as e:
            raise ModelLoadError(f"cannot load EAGLE-3 head {path}: {str(e).splitlines()[-1].strip()}")
        layers = aux_layers(raw, target_model.config.num_hidden_layers)
        target_model.feature_layers = layers
        return cls(net.float(), embed if embed is not None else target_model.embed, vocab_map, vocab,
                   layers, name or str(path))

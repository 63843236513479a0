"""LoRA adapters (Hu et al. 2021) on the model's linear layers, in PEFT's layout so that other tools load them.

    add_lora(model, LoraConfig(rank=8, alpha=32, dropout=0.1, targets=("q_proj", "v_proj")), seed=0)
    save_adapter(model, cfg, out_dir, base="Org/Base")   # adapter_config.json + adapter_model.safetensors
    load_adapter(model, out_dir)                         # the same adapters back (a next stage starts from them)
    merge_lora(model)                                    # W += scale * B @ A, the adapters removed

For each targeted HF module m (q/k/v/o_proj, gate/up/down_proj) of every block,
    y = W x + b + scale * B_m (A_m (dropout(x))),   A_m [r, in], B_m [out_m, r],   scale = alpha / r
(alpha / sqrt(r) with use_rslora), PEFT's LoraLayer exactly: dropout on the adapter's input only, A kaiming-uniform
(a = sqrt(5), nn.Linear's default) and B zero at the start, so a new adapter leaves the model as it was. q/k/v and
gate/up are one weight each here (transformer.FUSED): their adapters write their own rows of the fused output, and
are stored under the separate HF names PEFT and vLLM expect. The adapters are parameters of the model (under
`<linear>.lora`), so FSDP2 shards them with their block; the base weights are frozen by add_lora.
"""
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from model.transformer import FUSED, Linear, hf_parts

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."  # PEFT's key prefix around the transformers model's own names


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = ("q_proj", "v_proj")
    use_rslora: bool = False

    def __post_init__(self):  # one spelling of a target set, whatever order it was given in
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets))))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class LoraSlices(nn.Module):
    """The adapters of one Linear: for each targeted HF module, A [r, in] and B [rows, r] writing its rows of the
    output (all of it for an unfused layer). forward(x) -> the adapters' sum [..., out], zero in untargeted rows."""

    def __init__(self, linear: Linear, parts: list, cfg: LoraConfig):
        super().__init__()
        self.parts = parts  # [(HF leaf name, first row, end row, targeted)], in row order
        self.scale = cfg.scale
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        dev, dt = linear.weight.device, linear.weight.dtype
        self.A = nn.ParameterDict({m: nn.Parameter(torch.zeros(cfg.rank, linear.in_features, device=dev, dtype=dt))
                                   for m, _, _, on in parts if on})
        self.B = nn.ParameterDict({m: nn.Parameter(torch.zeros(b - a, cfg.rank, device=dev, dtype=dt))
                                   for m, a, b, on in parts if on})

    def forward(self, x):
        h = self.dropout(x)
        pieces = [(h @ self.A[m].T) @ self.B[m].T * self.scale if on else x.new_zeros(*x.shape[:-1], b - a)
                  for m, a, b, on in self.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def lora_linears(model):
    """(our module name, Linear, [(HF module path, HF leaf, first row, end row)]) of every block linear layer."""
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and ".layers." in f".{name}":
            parts = [(hf.removesuffix(".weight"), hf.removesuffix(".weight").rpartition(".")[2], a,
                      mod.weight.shape[0] if b is None else b)
                     for hf, a, b in hf_parts(model.cfg, f"{name}.weight")]
            yield name, mod, parts


def add_lora(model, cfg: LoraConfig, seed: int = 0) -> list:
    """Adapters on every block linear layer that holds a target, A initialised as PEFT does (from a generator seeded
    with `seed`, layer by layer in model order), B zero; every other parameter frozen. -> the adapters' parameters."""
    bad = sorted(set(cfg.targets) - set(TARGETS))
    if bad or not cfg.targets:
        raise ValueError(f"LoRA targets {bad or '(none)'}: choose from {', '.join(TARGETS)}")
    if cfg.rank < 1:
        raise ValueError(f"LoRA rank {cfg.rank}: must be at least 1")
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    params = []
    for _, lin, parts in list(lora_linears(model)):
        spec = [(leaf, a, b, leaf in cfg.targets) for _, leaf, a, b in parts]
        if not any(on for *_, on in spec):
            continue
        lin.lora = LoraSlices(lin, spec, cfg)
        for m in lin.lora.A:
            a = torch.empty(lin.lora.A[m].shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            with torch.no_grad():
                lin.lora.A[m].copy_(a)
        params += list(lin.lora.parameters())
    return params


def adapter_state(model) -> dict:
    """{PEFT key: tensor} of the model's adapters (lora_A [r, in], lora_B [rows, r])."""
    out = {}
    for _, lin, parts in lora_linears(model):
        lora = getattr(lin, "lora", None)
        for path, leaf, _, _ in parts:
            if lora is not None and leaf in lora.A:
                out[f"{PREFIX}{path}.lora_A.weight"] = lora.A[leaf].detach()
                out[f"{PREFIX}{path}.lora_B.weight"] = lora.B[leaf].detach()
    return out


def adapter_config(cfg: LoraConfig, base: str) -> dict:
    """adapter_config.json: the fields PEFT's LoraConfig and vLLM's PEFTHelper read."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": list(cfg.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": cfg.use_rslora, "init_lora_weights": True,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


def save_adapter(model, cfg: LoraConfig, out_dir, base: str, state: dict | None = None):
    """The adapters as PEFT writes them (state: adapter_state's, e.g. gathered from FSDP shards; default the
    model's own), in out_dir (created)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in (state or adapter_state(model)).items()}
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base), indent=2) + "\n")


def read_config(adapter_dir) -> LoraConfig:
    d = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if d.get("peft_type") != "LORA" or d.get("rank_pattern") or d.get("alpha_pattern") or d.get("bias", "none") != "none":
        raise ValueError(f"{adapter_dir}: a plain LoRA adapter (no rank or alpha patterns, no bias) is expected")
    targets = d["target_modules"] if isinstance(d["target_modules"], list) else [d["target_modules"]]
    return LoraConfig(rank=int(d["r"]), alpha=float(d["lora_alpha"]), dropout=float(d.get("lora_dropout", 0.0)),
                      targets=tuple(targets), use_rslora=bool(d.get("use_rslora", False)))


def load_adapter(model, adapter_dir) -> LoraConfig:
    """Adapters from a PEFT directory onto the model (add_lora, then its tensors; every key must match)."""
    from safetensors.torch import load_file
    cfg = read_config(adapter_dir)
    add_lora(model, cfg)
    tensors = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    ours = adapter_state(model)
    if set(tensors) != set(ours):
        missing, extra = sorted(set(ours) - set(tensors)), sorted(set(tensors) - set(ours))
        raise ValueError(f"{adapter_dir}: adapter keys differ from the model's targets (missing {missing[:2]}, "
                         f"unexpected {extra[:2]})")
    with torch.no_grad():
        for k, t in ours.items():
            if tuple(tensors[k].shape) != tuple(t.shape):
                raise ValueError(f"{adapter_dir}: {k} has shape {tuple(tensors[k].shape)}, expected {tuple(t.shape)}")
            t.copy_(tensors[k])
    return cfg


def merge_lora(model):
    """W[rows] += scale * B @ A for every adapter (in fp64, cast back), then the adapters are removed: the dense
    model that computes what the adapted one does (up to the weights' rounding)."""
    with torch.no_grad():
        for _, lin, _ in list(lora_linears(model)):
            lora = getattr(lin, "lora", None)
            if lora is None:
                continue
            for m, a, b, on in lora.parts:
                if on:
                    delta = lora.scale * (lora.B[m].double() @ lora.A[m].double())
                    lin.weight[a:b] = (lin.weight[a:b].double() + delta).to(lin.weight.dtype)
            del lin.lora
    return model


__all__ = ["FUSED", "LoraConfig", "TARGETS", "add_lora", "adapter_state", "save_adapter", "load_adapter",
           "merge_lora"]

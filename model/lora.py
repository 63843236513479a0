"""LoRA adapters (Hu et al. 2021) on the model's linear layers, in PEFT's layout so that
other tools load them.

    add_lora(model, LoraConfig(rank=8, alpha=32, dropout=0.1, targets=("q_proj", "v_proj")), seed=0)
    save_adapter(model, cfg, out_dir, base="Org/Base")  # adapter_config.json + its safetensors
    load_adapter(model, out_dir)         # the same adapters back (a next stage starts from them)
    merge_lora(model)                    # W += scale * B @ A, the adapters removed

For each targeted HF module m (q/k/v/o_proj, gate/up/down_proj) of every block,
    y = W x + b + scale * B_m (A_m (dropout(x))),   A_m [r, in], B_m [out_m, r],   scale = alpha / r
(alpha / sqrt(r) with use_rslora), PEFT's LoraLayer exactly: dropout on the adapter's input only, A
kaiming-uniform (a = sqrt(5), nn.Linear's default) and B zero at the start, so a new adapter leaves
the model as it was. q/k/v and gate/up are one weight each here (transformer.FUSED): their adapters
write their own rows of the fused output, and are stored under the separate HF names PEFT and vLLM
expect. The adapters are parameters of the model (under `<linear>.lora`), so FSDP2 shards them with
their block; the base weights are frozen by add_lora.
"""
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from model.checkpoint import local_rows
from model.transformer import FUSED, Linear, hf_parts, is_adapter

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
    """The adapters of one Linear: for each targeted HF module, A [r, in] and B [rows, r] writing
    its rows of the output (all of it for an unfused layer). forward(x) -> the adapters' sum
    [..., out], zero in untargeted rows.

    old_rank > 0 adds earlier adapters, frozen (A0 [old_rank, in], B0 [rows, old_rank]; O-LoRA's
    stack): both act at the same scale, and to PEFT they are one adapter of rank old_rank + r,
    A = [A0; A], B = [B0, B]."""

    def __init__(self, linear: Linear, parts: list, cfg: LoraConfig, old_rank: int = 0):
        super().__init__()
        self.parts = parts  # [(HF leaf name, first row, end row, targeted)], in row order
        self.scale = cfg.scale
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        dev, dt, on = (linear.weight.device, linear.weight.dtype,
                       [(m, b - a) for m, a, b, t in parts if t])

        def params(shape, grad=True):
            return nn.ParameterDict({m: nn.Parameter(torch.zeros(shape(rows), device=dev, dtype=dt),
                                                     requires_grad=grad) for m, rows in on})
        self.A = params(lambda rows: (cfg.rank, linear.in_features))
        self.B = params(lambda rows: (rows, cfg.rank))
        if old_rank:
            self.A0 = params(lambda rows: (old_rank, linear.in_features), grad=False)
            self.B0 = params(lambda rows: (rows, old_rank), grad=False)

    def forward(self, x):
        h = self.dropout(x)
        old = "A0" in self._modules

        def piece(m):
            y = (h @ self.A[m].T) @ self.B[m].T
            return (y + (h @ self.A0[m].T) @ self.B0[m].T if old else y) * self.scale
        pieces = [piece(m) if on else x.new_zeros(*x.shape[:-1], b - a)
                  for m, a, b, on in self.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def lora_linears(model):
    """(our module name, Linear, [(HF module path, HF leaf, first row, end row)]) of every
    block linear layer."""
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and ".layers." in f".{name}":
            parts = [(hf.removesuffix(".weight"), hf.removesuffix(".weight").rpartition(".")[2], a,
                      mod.weight.shape[0] if b is None else b)
                     for hf, a, b in hf_parts(model.cfg, f"{name}.weight")]
            yield name, mod, parts


def attach_lora(model, cfg: LoraConfig, old_rank: int = 0) -> list:
    """Adapters (zeros, on the model's device: `meta` before FSDP2 shards it) on every block linear
    layer that holds a target (with frozen earlier ones of rank old_rank: LoraSlices); every other
    parameter frozen. -> the trained adapters' parameters. init_lora gives them their values,
    set_adapters a file's."""
    bad = sorted(set(cfg.targets) - set(TARGETS))
    if bad or not cfg.targets:
        raise ValueError(f"LoRA targets {bad or '(none)'}: choose from {', '.join(TARGETS)}")
    if cfg.rank < 1:
        raise ValueError(f"LoRA rank {cfg.rank}: must be at least 1")
    model.requires_grad_(False)
    params = []
    for _, lin, parts in list(lora_linears(model)):
        spec = [(leaf, a, b, leaf in cfg.targets) for _, leaf, a, b in parts]
        if any(on for *_, on in spec):
            lin.lora = LoraSlices(lin, spec, cfg, old_rank)
            params += [*lin.lora.A.values(), *lin.lora.B.values()]
    return params


def _set(t, full: torch.Tensor):
    """t (a plain tensor, or a DTensor sharded on dim 0) <- full: each rank writes
    only its own rows."""
    mine, start = local_rows(t)
    with torch.no_grad():
        mine.copy_(full[start:start + mine.shape[0]])


def init_lora(model, seed: int = 0):
    """PEFT's initialisation of every adapter: A kaiming-uniform from a generator seeded with
    `seed`, layer by layer in model order (the same values whatever the sharding), B zero."""
    g = torch.Generator().manual_seed(seed)
    for _, lin, _ in lora_linears(model):
        lora = getattr(lin, "lora", None)
        for m in (lora.A if lora is not None else ()):
            a = torch.empty(lora.A[m].shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
            _set(lora.A[m], a)
            _set(lora.B[m], torch.zeros(lora.B[m].shape))


def add_lora(model, cfg: LoraConfig, seed: int = 0) -> list:
    """attach_lora, then init_lora: a materialised model with new adapters (B zero: it
    computes what it did)."""
    params = attach_lora(model, cfg)
    init_lora(model, seed)
    return params


def peft_names(model) -> dict:
    """{PEFT key: (our parameter names, stacked in this order, the dimension they stack on)} of the
    model's adapters:
    lora_A [r, in] (a frozen stack's A0 rows first), lora_B [rows, r] (B0's columns first)."""
    out = {}
    for name, lin, parts in lora_linears(model):
        lora = getattr(lin, "lora", None)
        old = lora is not None and "A0" in lora._modules
        for path, leaf, _, _ in parts:
            if lora is not None and leaf in lora.A:
                for k, dim in (("A", 0), ("B", 1)):
                    out[f"{PREFIX}{path}.lora_{k}.weight"] = (
                        [f"{name}.lora.{k}0.{leaf}"] * old + [f"{name}.lora.{k}.{leaf}"], dim)
    return out


def adapter_state(model, state: dict | None = None) -> dict:
    """{PEFT key: tensor} of the model's adapters (a frozen stack and the trained adapter as one),
    from `state` (our names: a gathered full state dict) or the model's own parameters."""
    state = state if state is not None else {n: p.detach() for n, p in model.named_parameters()}
    return {key: torch.cat([state[n] for n in names], dim) if len(names) > 1 else state[names[0]]
            for key, (names, dim) in peft_names(model).items()}


def merge_state(state: dict, model) -> tuple[dict, dict]:
    """A full state dict (our names, adapters included: train.py's gathered one) -> (the dense
    state with W[rows] += scale * B @ A merged in fp64 and cast back, the adapters under their
    PEFT keys)."""
    peft = adapter_state(model, state)
    dense = {k: v for k, v in state.items() if not is_adapter(k)}
    for name, lin, parts in lora_linears(model):
        lora = getattr(lin, "lora", None)
        for path, leaf, a, b in parts:
            if lora is not None and leaf in lora.A:
                A, B = (peft[f"{PREFIX}{path}.lora_{k}.weight"].double() for k in "AB")
                w = dense[f"{name}.weight"] = dense[f"{name}.weight"].clone()
                w[a:b] = (w[a:b].double() + lora.scale * (B @ A)).to(w.dtype)
    return dense, peft


def adapter_config(cfg: LoraConfig, base: str) -> dict:
    """adapter_config.json: the fields PEFT's LoraConfig and vLLM's PEFTHelper read."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": list(cfg.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": cfg.use_rslora, "init_lora_weights": True, "rank_pattern": {},
            "alpha_pattern": {}, "modules_to_save": None}


def save_adapter(model, cfg: LoraConfig, out_dir, base: str, state: dict | None = None):
    """The adapters as PEFT writes them (state: adapter_state's, e.g. gathered from FSDP shards;
    default the model's own), in out_dir (created)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous()
               for k, v in (state or adapter_state(model)).items()}
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, base), indent=2) + "\n")


def read_config(adapter_dir) -> LoraConfig:
    d = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    if (d.get("peft_type") != "LORA" or d.get("rank_pattern") or d.get("alpha_pattern")
            or d.get("bias", "none") != "none"):
        raise ValueError(f"{adapter_dir}: a plain LoRA adapter "
                         f"(no rank or alpha patterns, no bias) is expected")
    targets = (d["target_modules"] if isinstance(d["target_modules"], list)
               else [d["target_modules"]])
    return LoraConfig(rank=int(d["r"]), alpha=float(d["lora_alpha"]),
                      dropout=float(d.get("lora_dropout", 0.0)), targets=tuple(targets),
                      use_rslora=bool(d.get("use_rslora", False)))


def read_adapter(adapter_dir, model) -> dict:
    """{our parameter name: tensor} of a PEFT adapter directory for a model with attach_lora's
    adapters of its configuration: every key must match, with its shape. Into the frozen stack
    (A0, B0) when the model has one (the file is the earlier adapters; the trained ones start new),
    else into the trained adapters."""
    from safetensors.torch import load_file
    tensors = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    names, params = peft_names(model), dict(model.named_parameters())
    if set(tensors) != set(names):
        missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        raise ValueError(f"{adapter_dir}: adapter keys differ from the model's targets "
                         f"(missing {missing[:2]}, unexpected {extra[:2]})")
    out = {}
    for key, (ours, _) in names.items():
        if tuple(tensors[key].shape) != tuple(params[ours[0]].shape):
            raise ValueError(f"{adapter_dir}: {key} has shape {tuple(tensors[key].shape)}, "
                             f"expected {tuple(params[ours[0]].shape)}")
        out[ours[0]] = tensors[key]
    return out


def set_adapters(model, tensors: dict):
    """read_adapter's tensors into the model's adapters (sharded or not: each rank its own rows)."""
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        _set(params[name], t.to(params[name].dtype))


def load_adapter(model, adapter_dir) -> LoraConfig:
    """Adapters from a PEFT directory onto a materialised model (attach_lora, then its
    tensors) as trained ones."""
    cfg = read_config(adapter_dir)
    attach_lora(model, cfg)
    set_adapters(model, read_adapter(adapter_dir, model))
    return cfg


def merge_lora(model):
    """W[rows] += scale * B @ A for every adapter (in fp64, cast back), then the adapters
    are removed: the dense model that computes what the adapted one does (up to the
    weights' rounding)."""
    dense, _ = merge_state({k: v.detach() for k, v in model.state_dict().items()}, model)
    with torch.no_grad():
        for name, lin, _ in list(lora_linears(model)):
            if getattr(lin, "lora", None) is not None:
                lin.weight.copy_(dense[f"{name}.weight"])
                del lin.lora
    return model


__all__ = ["FUSED", "LoraConfig", "TARGETS", "add_lora", "attach_lora", "init_lora",
           "adapter_state", "merge_state", "save_adapter", "load_adapter", "read_adapter",
           "set_adapters", "merge_lora"]

"""ModelConfig: the few numbers our Transformer needs, read from a Hugging Face config.json.

One decoder covers Llama-3.x (and SmolLM2, a Llama), Qwen2/Qwen2.5 and Qwen3; they differ only in
biases, q/k norms, head_dim and RoPE scaling, which are the fields below.
"""
import math
from dataclasses import dataclass, field

from common.errors import InputError

SUPPORTED = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor", "low_freq_factor", ...} or None
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v biased; Llama attention_bias: q/k/v/o biased
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # the original config.json, written back on save
    hf: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF config.json; errors name `source` and the offending key."""
        mt = d.get("model_type")
        if mt not in SUPPORTED:
            raise InputError(f"{source}: model_type {mt!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED)})")

        k = _Keys(d, source, mt)
        need, count, positive, flag = k.need, k.count, k.positive, k.flag
        if d.get("hidden_act", "silu") != "silu":
            raise InputError(f"{source}: hidden_act {d['hidden_act']!r} is not supported "
                             f"(only 'silu')")
        if d.get("use_sliding_window"):
            raise InputError(f"{source}: use_sliding_window=true is not supported")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        theta, scaling = _rope(d, source)
        hidden, heads = count("hidden_size", hidden), count("num_attention_heads", heads)
        kv_heads = count("num_key_value_heads", d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise InputError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        if d.get("head_dim") is None and hidden % heads:
            raise InputError(f"{source}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads} (and there is no head_dim)")
        attn_bias = flag("attention_bias")
        return cls(
            model_type=mt,
            vocab_size=count("vocab_size", need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size", need("intermediate_size")),
            num_hidden_layers=count("num_hidden_layers", need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=(count("head_dim", d["head_dim"]) if d.get("head_dim") is not None
                      else hidden // heads),
            rms_norm_eps=positive("rms_norm_eps", d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(positive("rope_theta", theta)),
            rope_scaling=scaling,
            max_position_embeddings=count("max_position_embeddings",
                                          d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=flag("tie_word_embeddings"),
            qkv_bias=True if mt == "qwen2" else attn_bias,
            o_bias=attn_bias if mt == "llama" else False,
            mlp_bias=flag("mlp_bias"),
            qk_norm=mt == "qwen3",
            hf=dict(d),
        )

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (used for MFU estimates)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        n = self.num_hidden_layers * layer + h
        if embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n


class _Keys:
    """A config.json's values, checked as they are read: a missing key, a wrong type or a size < 1
    is one line naming the file and the key (later it would fail as a traceback deep in torch)."""

    def __init__(self, d: dict, source: str, model_type: str):
        self.d, self.source, self.model_type = d, source, model_type

    def need(self, key):
        if key not in self.d or self.d[key] is None:
            raise InputError(f"{self.source}: missing required key {key!r} for model_type "
                             f"{self.model_type!r}")
        return self.d[key]

    def count(self, key, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{self.source}: {key} must be a positive integer, got {v!r}")
        return v

    def positive(self, key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InputError(f"{self.source}: {key} must be a positive number, got {v!r}")
        return v

    def flag(self, key):
        v = self.d.get(key, False)
        if not isinstance(v, bool):
            raise InputError(f"{self.source}: {key} must be true or false, got {v!r}")
        return v


def _rope(d: dict, source: str):
    """(rope theta, the llama3 scaling dict or None). transformers >= 5 writes rope_parameters
    {rope_theta, rope_type, ...}; older files rope_theta + rope_scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise InputError(f"{source}: {key} must be an object, got {d[key]!r}")
    rope = dict(d.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    scaling = rope or d.get("rope_scaling") or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise InputError(f"{source}: rope scaling type {kind!r} is not supported "
                             f"(only 'llama3')")
    return theta, scaling

"""The model's shape and numerics, parsed once from an HF config.json into one dataclass.

Every family difference the Llama implementation cares about becomes a plain flag here, so the model
code never looks at architecture names.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# Per architecture: (model_type, how its HF modeling code wires biases and norms). The HF classes hard-code
# some of these (Qwen2 always has a qkv bias and never an o_proj bias), so config.json alone is not enough.
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama", "qkv_bias": "attention_bias", "o_bias": "attention_bias",
                         "mlp_bias": "mlp_bias", "qk_norm": False},
    "MistralForCausalLM": {"model_type": "mistral", "qkv_bias": False, "o_bias": False, "mlp_bias": False,
                           "qk_norm": False},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "qkv_bias": True, "o_bias": False, "mlp_bias": False,
                         "qk_norm": False},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "qkv_bias": "attention_bias", "o_bias": "attention_bias",
                         "mlp_bias": False, "qk_norm": True},
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
_BY_MODEL_TYPE = {v["model_type"]: k for k, v in _ARCHITECTURES.items()}

# Required keys of each supported rope scaling type (beyond rope_type).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_ROPE_REJECTED_WHY = {
    # HF recomputes dynamic-NTK frequencies from the longest sequence in the *batch*, so a request's
    # numerics would depend on its batch-mates and its own cached KV would go stale as it grows.
    "dynamic": "dynamic NTK scaling depends on the batch's longest sequence and cannot be cached per position",
}


@dataclass
class ModelConfig:
    architecture: str
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
    # None for plain rope; else a dict with "rope_type" in {"linear", "llama3", "yarn"} and its parameters.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    # Mistral / Qwen sliding-window attention. Our attention is full-causal, which equals windowed
    # attention only while the context fits in the window, so context_length is capped by it.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype, informational

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def context_length(self) -> int:
        """Longest context (prompt + output) this model serves exactly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def num_params(self) -> int:
        """Weights in the model (biases aside): attention, MLP and both norms a layer, the final norm, the
        embedding and, unless tied to it, the lm_head."""
        h = self.hidden_size
        layer = 2 * h * self.q_size + 2 * h * self.kv_size + 3 * h * self.intermediate_size + 2 * h
        return self.num_hidden_layers * layer + h + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # ------------------------------------------------------------------ HF <-> ours
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        arch = _pick_architecture(d)
        wiring = _ARCHITECTURES[arch]

        def flag(spec: Any) -> bool:
            return bool(d.get(spec, False)) if isinstance(spec, str) else spec

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"config.json of {arch} lacks required field '{key}'")
            return d[key]

        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"unsupported hidden_act '{act}' (only silu)")
        hidden, heads = int(req("hidden_size")), int(req("num_attention_heads"))
        max_pos = int(d.get("max_position_embeddings") or 2048)
        rope_theta, rope_scaling = parse_rope(d, max_pos)
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch, model_type=wiring["model_type"],
            vocab_size=int(req("vocab_size")), hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta, rope_scaling=rope_scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=flag(wiring["qkv_bias"]), o_proj_bias=flag(wiring["o_bias"]),
            mlp_bias=flag(wiring["mlp_bias"]), qk_norm=wiring["qk_norm"],
            sliding_window=_sliding_window(d, wiring["model_type"]),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF config.json dict (legacy rope_theta/rope_scaling keys, which every transformers reads)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None),
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        elif self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pick_architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    for a in archs:
        if a in _ARCHITECTURES:
            return a
    if not archs and d.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[d["model_type"]]
    got = archs or d.get("model_type") or "none given"
    raise ValueError(f"unsupported model architecture {got}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    if model_type == "mistral":
        return d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        return d.get("sliding_window")
    return None


def parse_rope(d: dict[str, Any], max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling dict or None) from either transformers layout: 5.x puts everything
    in `rope_parameters` (with rope_theta inside), 4.x uses top-level `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported by the Llama family")
    theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type in _ROPE_REJECTED_WHY:
        raise ValueError(f"unsupported rope scaling '{rope_type}': {_ROPE_REJECTED_WHY[rope_type]}")
    if rope_type not in _ROPE_REQUIRED:
        raise ValueError(f"unknown rope scaling type '{rope_type}'; supported: default, "
                         f"{', '.join(_ROPE_REQUIRED)}")
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_type", "rope_theta")}
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        scaling.setdefault("original_max_position_embeddings",
                           d.get("original_max_position_embeddings") or max_position_embeddings)
        if scaling.get("factor") is None:  # HF derives it from the two lengths
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    for key in _ROPE_REQUIRED[rope_type]:
        if scaling.get(key) is None:
            raise ValueError(f"rope scaling '{rope_type}' requires '{key}'")
    if not (isinstance(scaling["factor"], (int, float)) and math.isfinite(scaling["factor"])
            and scaling["factor"] >= 1.0):
        raise ValueError(f"rope scaling factor must be a number >= 1, got {scaling['factor']!r}")
    return theta, scaling

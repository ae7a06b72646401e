"""Tokenizer and chat template, from an HF directory (tokenizer.json + tokenizer_config.json) or built
in memory for `tiny-random`. Tokenizes with `tokenizers`; renders chat templates with transformers' own
renderer (shared/chat_template.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from shared.chat_template import ChatTemplateError, compile_template, render_chat
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

TINY_RANDOM = "tiny-random"

# ChatML, the template of the tiny model (and a sane fallback for models that ship none).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Tokenizer:
    raw: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    extra_eos_ids: list[int] = field(default_factory=list)
    name: str = ""
    # Other special tokens templates may read (unk_token, pad_token...), as tokenizer_config names them.
    other_special_tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.bos_token_id = self.raw.token_to_id(self.bos_token) if self.bos_token else None
        eos = self.raw.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: list[int] = sorted({*(x for x in [eos] if x is not None), *self.extra_eos_ids})
        self.special_ids = set(self.raw.get_added_tokens_decoder().keys())
        self.vocab_size = self.raw.get_vocab_size(with_added_tokens=True)
        if self.chat_template:
            compile_template(self.chat_template)

    # ---- loading ----
    @classmethod
    def load(cls, model_path: str) -> "Tokenizer":
        if model_path == TINY_RANDOM:
            return tiny_random_tokenizer()
        path = resolve_model_dir(model_path)
        raw = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tmpl_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(tmpl_file):
            with open(tmpl_file) as f:
                template = f.read()
        extra_eos: list[int] = []
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_cfg):
            with open(gen_cfg) as f:
                eid = json.load(f).get("eos_token_id")
            extra_eos = [eid] if isinstance(eid, int) else list(eid or [])
        others = {k: _token_str(cfg[k]) for k in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
                  if _token_str(cfg.get(k))}
        return cls(raw=raw, bos_token=_token_str(cfg.get("bos_token")), eos_token=_token_str(cfg.get("eos_token")),
                   add_bos_token=bool(cfg.get("add_bos_token", False)), chat_template=template,
                   extra_eos_ids=extra_eos, name=model_path, other_special_tokens=others)

    # ---- text <-> ids ----
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.raw.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.raw.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text a single token decodes to (for logprob entries)."""
        return self.raw.decode([token_id], skip_special_tokens=False)

    # ---- chat ----
    def set_chat_template(self, template: str) -> None:
        """Serve with another template (--chat-template); it must parse."""
        compile_template(template)
        self.chat_template = template

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens a template sees as variables (transformers passes its special_tokens_map)."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.other_special_tokens}
        return {k: v for k, v in named.items() if v}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The prompt text; raises ChatTemplateError (a ValueError) when the template refuses it."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        return render_chat(self.chat_template, messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           special_tokens=self.special_tokens_map, template_kwargs=template_kwargs)


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def resolve_model_dir(model_path: str) -> str:
    """A local directory as is; otherwise an HF hub id, downloaded (or found in the local HF cache)."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])


# ---------------------------------------------------------------- tiny-random
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. " * 3
    + "Question: What is the capital of France? Answer: Paris. "
    + '{"name": "Alice", "age": 30, "city": "Paris", "tags": ["a", "b"]} '
    + "def main():\n    return 0\n" + "Hello, world! user assistant system " * 2
    + "0123456789 true false null " * 2
)
_tiny_cache: HFTokenizer | None = None


def build_tiny_hf_tokenizer(vocab_size: int = 512) -> HFTokenizer:
    """A byte-level BPE trained on a fixed corpus: deterministic, every byte encodable."""
    global _tiny_cache
    if _tiny_cache is not None:
        return HFTokenizer.from_str(_tiny_cache.to_str())
    tok = train_byte_level_bpe([_TINY_CORPUS], vocab_size, TINY_SPECIALS)
    _tiny_cache = tok
    return HFTokenizer.from_str(tok.to_str())


def train_byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]) -> HFTokenizer:
    """A byte-level BPE trained on texts (every byte encodable), the special tokens first (ids 0, 1, ...)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tiny_random_tokenizer() -> Tokenizer:
    return Tokenizer(raw=build_tiny_hf_tokenizer(), bos_token=None, eos_token="<|im_end|>",
                     add_bos_token=False, chat_template=CHATML_TEMPLATE,
                     extra_eos_ids=[], name=TINY_RANDOM)


def save_tiny_tokenizer(path: str) -> None:
    """Write tokenizer.json + tokenizer_config.json of the tiny tokenizer into an HF directory."""
    os.makedirs(path, exist_ok=True)
    build_tiny_hf_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                   "chat_template": CHATML_TEMPLATE, "model_max_length": 4096}, f)

"""The reference models' text: this interpreter's own Python sources (the standard library and site-packages), split
into training and held-out files by a stable hash of each file's relative path, a byte-level BPE tokenizer trained on
the training files, and the held-out prompts of bench.spec's workloads (a file's head: code; a cut inside a docstring
or comment block: prose).
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import sysconfig
import tokenize as pytokenize
from dataclasses import dataclass

import numpy as np

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, EOS, END] + [f"<|{r}|>" for r in ROLES]
# Roles as special tokens, each message ended by <|end|>; generation stops at <|end|> or <|eos|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
MAX_FILE_BYTES = 512 << 10  # larger sources are generated tables, not code anyone writes


@dataclass(frozen=True)
class SourceFile:
    rel: str  # "stdlib/..." or "site/...": the split's key, the same on every machine with the same packages
    path: str


def source_roots() -> list[tuple[str, str]]:
    """(label, directory) of the standard library and the site-packages directories (sysconfig's, and site's: a
    distribution's dist-packages, the user's), distinct and existing."""
    import site

    paths = sysconfig.get_paths()
    dirs = [("stdlib", paths.get("stdlib")), ("site", paths.get("purelib")), ("site", paths.get("platlib"))]
    dirs += [("site", d) for d in site.getsitepackages()] + [("site", site.getusersitepackages())]
    roots, seen = [], set()
    for label, d in dirs:
        d = os.path.realpath(d or "")
        if d and os.path.isdir(d) and d not in seen:
            seen.add(d)
            roots.append((label, d))
    return roots


def held_out(rel: str, permille: int) -> bool:
    """A file is held out when the first bytes of sha256(its relative path) fall under permille/1000."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 1000 < permille


def collect_sources(roots: list[tuple[str, str]] | None = None) -> list[SourceFile]:
    """Every .py file of the roots (a root inside another is walked once, under its own label), sorted by path."""
    roots = roots if roots is not None else source_roots()
    others = {d for _, d in roots}
    files = []
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(n for n in dirnames if n != "__pycache__"
                                 and os.path.join(dirpath, n) not in others
                                 and n not in ("site-packages", "dist-packages"))
            for name in filenames:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    files.append(SourceFile(f"{label}/{os.path.relpath(path, root)}", path))
    return sorted(set(files), key=lambda f: f.rel)


def read_text(path: str) -> str | None:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return text if text.strip() else None


def split_corpus(files: list[SourceFile], heldout_permille: int, max_bytes: int,
                 max_heldout_bytes: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) lists of (rel, text), each in a hash order of the paths (so a byte cap keeps an unbiased
    sample), training text capped at max_bytes, held-out at max_heldout_bytes."""
    order = sorted(files, key=lambda f: hashlib.sha256(f.rel.encode()).digest())
    train, held, nt, nh = [], [], 0, 0
    for f in order:
        is_held = held_out(f.rel, heldout_permille)
        if (nh if is_held else nt) >= (max_heldout_bytes if is_held else max_bytes):
            if nt >= max_bytes and nh >= max_heldout_bytes:
                break
            continue
        text = read_text(f.path)
        if text is None:
            continue
        (held if is_held else train).append((f.rel, text))
        if is_held:
            nh += len(text)
        else:
            nt += len(text)
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE with the special tokens first (ids 0..5)."""
    from shared.tokenizer import train_byte_level_bpe

    return train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)


def save_tokenizer(tok, path: str, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (bos/eos, the chat template) of an HF checkpoint directory."""
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "pad_token": EOS, "add_bos_token": True, "add_eos_token": False,
                   "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
                   "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}, f, indent=1)


def encode_files(tok, texts: list[str], dtype=np.uint16, chunk: int = 1000) -> np.ndarray:
    """The texts' ids, each between <|bos|> and <|eos|>, as one stream (tokenizers' batch encoding runs on every core;
    a chunk of files at a time, so the host never holds every file's encoding objects at once)."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts = []
    for i in range(0, len(texts), chunk):
        for e in tok.encode_batch(texts[i:i + chunk], add_special_tokens=False):
            parts.append(np.asarray([bos, *e.ids, eos], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# ---------------------------------------------------------------- bench.spec's workloads
def code_prompts(tok, held: list[tuple[str, str]], n: int, prompt_tokens: int, new_tokens: int) -> list[list[int]]:
    """Held-out code of prompt_tokens tokens with at least new_tokens more after it: each file's head (after
    <|bos|>) first, then, while more are wanted, each long file's next windows of prompt + new tokens."""
    bos = tok.token_to_id(BOS)
    files = [e.ids for e in tok.encode_batch([text for _, text in held], add_special_tokens=False)]
    w = prompt_tokens + new_tokens
    out = []
    for k in range(max((len(ids) // w for ids in files), default=0)):
        for ids in files:
            if len(ids) >= (k + 1) * w:
                out.append([bos, *ids[:prompt_tokens - 1]] if k == 0 else ids[k * w:k * w + prompt_tokens])
                if len(out) == n:
                    return out
    return out


def prose_cuts(text: str, min_chars: int = 240) -> list[int]:
    """Character offsets a third of the way into each docstring and each block of 3+ comment lines of at least
    min_chars: a prompt ending there continues prose rather than code."""
    cuts = []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return cuts
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str) and len(first.value.value) >= min_chars):
                a = starts[first.lineno - 1] + first.col_offset
                b = starts[first.end_lineno - 1] + first.end_col_offset
                cuts.append(a + (b - a) // 3)
    try:
        block: list[tuple[int, int]] = []
        for t in pytokenize.generate_tokens(io.StringIO(text).readline):
            if t.type == pytokenize.COMMENT:
                if block and t.start[0] != block[-1][0] + 1:
                    cuts += _comment_cut(block, starts, min_chars)
                    block = []
                block.append((t.start[0], len(t.string)))
        cuts += _comment_cut(block, starts, min_chars)
    except (pytokenize.TokenError, IndentationError, SyntaxError):
        pass
    return sorted(cuts)


def _comment_cut(block: list[tuple[int, int]], starts: list[int], min_chars: int) -> list[int]:
    if len(block) < 3 or sum(n for _, n in block) < min_chars:
        return []
    a, b = starts[block[0][0] - 1], starts[block[-1][0]]
    return [a + (b - a) // 3]


def prose_prompts(tok, held: list[tuple[str, str]], n: int, prompt_tokens: int) -> list[list[int]]:
    """Up to prompt_tokens tokens of a held-out file ending a third of the way into a docstring or comment block with
    some context before it: each file's first such cut, then the second ones, and so on while more are wanted."""
    bos = tok.token_to_id(BOS)
    cuts = [(text, [c for c in prose_cuts(text) if c >= 200]) for _, text in held]
    out = []
    for k in range(max((len(c) for _, c in cuts), default=0)):
        for text, cs in cuts:
            if k < len(cs):
                ids = tok.encode(text[:cs[k]], add_special_tokens=False).ids
                out.append([bos, *ids[-(prompt_tokens - 1):]])
                if len(out) == n:
                    return out
    return out

"""Tokenizer loading, chat templates and incremental detokenization."""
from __future__ import annotations

import random

import pytest

from shared.engine.detokenizer import Detokenizer
from shared.tokenizer import Tokenizer, build_tiny_hf_tokenizer, save_tiny_tokenizer

TEXT = "Hello, world! Ünïcödé: 日本語テキスト, emoji 🎉 and more text. STOP here."


@pytest.fixture(scope="module")
def tk():
    return Tokenizer.load("tiny-random")


def test_round_trip_and_disk_equivalence(tk, tmp_path):
    ids = tk.encode(TEXT)
    assert tk.decode(ids) == TEXT
    save_tiny_tokenizer(str(tmp_path))
    assert Tokenizer.load(str(tmp_path)).encode(TEXT) == ids


def test_chat_template_and_strftime_now(tk):
    out = tk.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    t = Tokenizer(raw=build_tiny_hf_tokenizer(), eos_token="<|im_end|>",
                  chat_template="{{ strftime_now('%Y') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}")
    year, text = t.apply_chat_template([{"role": "user", "content": "hi"}]).split("|")
    assert year.isdigit() and text == "hi"


def test_template_sandbox_refuses_attribute_escapes(tk):
    evil = Tokenizer(raw=build_tiny_hf_tokenizer(), eos_token="<|im_end|>",
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("seed", range(5))
def test_incremental_decoding_equals_full_decode(tk, seed):
    """Token by token, or in random chunks, the emitted text is exactly the full decode (multi-byte
    characters split across tokens never show as replacement characters mid-stream)."""
    d = Detokenizer(tk)
    ids = tk.encode(TEXT)
    rng = random.Random(seed)
    st = d.new_state([], prompt_tail=tk.encode("Prompt: "))
    out, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 3)
        text, _ = d.add_tokens(st, ids[i:i + n])
        assert "\ufffd" not in text
        out += text
        i += n
    out += d.flush(st)
    assert out == TEXT


def test_stop_string_is_held_back_then_trimmed(tk):
    d = Detokenizer(tk)
    st = d.new_state(["STOP"])
    seen = ""
    for t in tk.encode(TEXT):
        text, hit = d.add_tokens(st, [t])
        seen += text
        assert "STOP" not in seen and "STO" not in seen[-3:] or hit
        if hit:
            break
    assert seen == TEXT[:TEXT.index("STOP")]
    assert d.final_text(st) == TEXT[:TEXT.index("STOP")]


def test_reset_output_after_rewritten_tail(tk):
    d = Detokenizer(tk)
    st = d.new_state([])
    first = tk.encode("{\"na")
    text, _ = d.add_tokens(st, first)
    rewritten = tk.encode("{\"name\": \"")
    more, _ = d.reset_output(st, rewritten)
    assert text + more == "{\"name\": \""

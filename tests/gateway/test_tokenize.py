"""/tokenize and /detokenize (and their /v1/ twins) over the gateway: SGLang's and vLLM's request and
answer shapes, the chat path's exact prompt, every refused input as a 4xx naming its field."""
import pytest

from shared.protocol import GenerateRequest
from tests.support.fake_worker import gateway_stack

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture
async def stack():
    async with gateway_stack(context_length=256) as s:
        yield s


async def post(stack, path, body):
    r = await stack.client.post(path, json=body)
    return r.status, await r.json()


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_tokenize_prompt_and_batch(stack, prefix):
    tok = stack.state.tokenizer
    status, body = await post(stack, f"{prefix}/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200
    ids = tok.encode("Hello world")
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    # SGLang's batch form: one list per prompt.
    status, body = await post(stack, f"{prefix}/tokenize", {"prompt": ["Hello", "The quick"], "return_token_strs": True})
    assert status == 200
    a, b = tok.encode("Hello"), tok.encode("The quick")
    assert body["tokens"] == [a, b] and body["count"] == [len(a), len(b)]
    assert body["token_strs"] == [[tok.id_to_token(t) for t in a], [tok.id_to_token(t) for t in b]]
    # vLLM's token strings are the vocabulary's own (byte-level marks included).
    _, body = await post(stack, f"{prefix}/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert body["token_strs"] == ["Hello", "Ġworld"]
    # An empty prompt has no tokens (not an error: both servers answer it).
    _, body = await post(stack, f"{prefix}/tokenize", {"prompt": ""})
    assert body["count"] == 0 and body["tokens"] == []
    assert not [m for m in stack.worker.received if isinstance(m, GenerateRequest) and not m.rid.startswith("health-")]


async def test_tokenize_messages_count_is_the_chat_routes_prompt(stack):
    status, body = await post(stack, "/tokenize", {"messages": CHAT})
    assert status == 200
    status, chat = await post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert status == 200
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    tok = stack.state.tokenizer
    assert body["tokens"] == tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    # Without the generation prompt the assistant header is left out; continue_final_message leaves the
    # last assistant message open.
    _, bare = await post(stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]
    _, cont = await post(stack, "/tokenize", {"messages": CHAT + [{"role": "assistant", "content": "Sure"}],
                                              "continue_final_message": True})
    assert tok.decode(cont["tokens"], skip_special_tokens=False).endswith("Sure")


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_detokenize_both_servers_fields_and_special_tokens(stack, prefix):
    tok = stack.state.tokenizer
    eos = tok.eos_token_ids[0]
    ids = tok.encode("Hello world")
    status, body = await post(stack, f"{prefix}/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and body == {"text": "Hello world", "prompt": "Hello world"}
    # SGLang's default skips special tokens; false keeps them (vLLM's answer).
    _, body = await post(stack, f"{prefix}/detokenize", {"tokens": [eos] + ids})
    assert body["text"] == "Hello world"
    _, body = await post(stack, f"{prefix}/detokenize", {"tokens": [eos] + ids, "skip_special_tokens": False})
    assert body["text"] == tok.eos_token + "Hello world"
    # A batch of id lists answers a list; an empty list is the empty string.
    _, body = await post(stack, f"{prefix}/detokenize", {"tokens": [ids, tok.encode("The quick")]})
    assert body["text"] == body["prompt"] == ["Hello world", "The quick"]
    _, body = await post(stack, f"{prefix}/detokenize", {"tokens": []})
    assert body["text"] == ""


async def test_tokenize_then_detokenize_round_trips(stack):
    text = "The quick brown fox, 3 times!"
    _, t = await post(stack, "/tokenize", {"prompt": text})
    _, d = await post(stack, "/detokenize", {"tokens": t["tokens"]})
    assert d["text"] == text


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": []}, "prompt"),
    ("/tokenize", {"prompt": ["a", 1]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": {}, "content": ""}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [[1], 2]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [[1], [10 ** 9]]}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": "no"}, "skip_special_tokens"),
    ("/v1/detokenize", {"tokens": [1], "model": 3}, "model"),
])
async def test_bad_input_is_a_4xx_naming_the_field(stack, path, body, param):
    status, answer = await post(stack, path, body)
    assert 400 <= status < 500, (status, answer)
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["message"]


async def test_not_a_json_object_and_wrong_method(stack):
    r = await stack.client.post("/tokenize", json=["prompt"])
    assert r.status == 400 and "error" in await r.json()
    r = await stack.client.get("/detokenize")
    assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"


async def test_api_key_guards_the_routes():
    async with gateway_stack(api_key="sk-test") as s:
        r = await s.client.post("/tokenize", json={"prompt": "hi"})
        assert r.status == 401
        r = await s.client.post("/v1/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer sk-test"})
        assert r.status == 200

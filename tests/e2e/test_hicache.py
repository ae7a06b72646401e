"""The host KV tier through the real services: launcher flags, /server_info's tier sizes, /metrics' tier figures."""
import random
import re

import concurrent.futures as cf

import pytest
import requests

from services import launch
from tests.engine.test_hicache import chat, conversations
from tests.support.engine_harness import Harness
from tests.support.stack import Stack, wait_for


def test_launcher_refuses_the_tier_without_the_radix_cache(capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(["--enable-hierarchical-cache", "--disable-radix-cache"])
    assert "--enable-hierarchical-cache needs the radix cache" in capsys.readouterr().err
    args = launch.parse_args(["--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--tp-size", "2"])
    argv = launch.engine_args_to_argv(args)  # what the workers are started with (each rank has its host pool)
    assert "--enable-hierarchical-cache" in argv and argv[argv.index("--hicache-write-policy") + 1] == "write_back"
    assert argv[argv.index("--tp-size") + 1] == "2"


@pytest.fixture(scope="module")
def tier_stack():
    """A 128-token device pool and a host tier four times that (fp32: the in-process reference's dtype)."""
    s = Stack("--max-total-tokens", "128", "--enable-hierarchical-cache", "--hicache-ratio", "4", "--dtype", "float32")
    yield s
    s.stop()


@pytest.mark.e2e
def test_stack_serves_an_evicted_prompt_from_the_host_tier(tier_stack):
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 400) for _ in range(100)] for _ in range(2)]

    def generate(ids):
        r = requests.post(tier_stack.url + "/generate", timeout=60, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()

    first = generate(prompts[0])
    generate(prompts[1])  # pushes the first prompt's KV out of the 128-token device pool
    again = generate(prompts[0])
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 90
    info = requests.get(tier_stack.url + "/server_info", timeout=10).json()["workers"][0]["info"]
    tier = info["hicache"]
    assert tier["device_total_tokens"] == 128 and tier["host_total_tokens"] == 512
    assert 0 < tier["host_used_tokens"] <= 512
    assert info["cache"]["host_hit_tokens"] >= 90
    text = requests.get(tier_stack.url + "/metrics", timeout=10).text

    def metric(name):
        m = re.search(rf'^sglang:{name}\{{model_name="tiny-random"\}} ([0-9.e+-]+)$', text, re.M)
        assert m, name
        return float(m.group(1))

    assert metric("hicache_host_hit_tokens") >= 90
    assert metric("hicache_h2d_bytes") > 0 and metric("hicache_d2h_bytes") > 0
    assert metric("hicache_host_total_tokens") == 512
    assert metric("hicache_load_seconds_count") >= 1
    assert re.search(r'^sglang:hicache_load_seconds_bucket\{le="\+Inf",model_name="tiny-random"\} [1-9]', text,
                     re.M) or re.search(r'^sglang:hicache_load_seconds_bucket\{model_name="tiny-random",'
                                        r'le="\+Inf"\} [1-9]', text, re.M)


@pytest.mark.e2e
def test_conversations_outgrowing_the_device_pool_leak_nothing(tier_stack):
    """Conversations whose histories together outgrow the 128-token device pool, their turns sent at once: the
    answers of an engine with room for everything, prefixes served from the host tier, and once all is done both
    pools hold exactly what the tree does (/server_info); /flush_cache empties both."""
    convs, sampling = conversations(seed=4, n=3, turns=3), {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    url = tier_stack.url

    def info():
        return requests.get(url + "/server_info", timeout=10).json()["workers"][0]["info"]

    def generate(ids):
        r = requests.post(url + "/generate", timeout=60, json={"input_ids": ids, "sampling_params": sampling})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    hits = info()["cache"]["host_hit_tokens"]
    history, answers = [[] for _ in convs], []
    with cf.ThreadPoolExecutor(len(convs)) as pool:
        for t in range(len(convs[0])):
            sent = [history[i] + c[t] for i, c in enumerate(convs)]
            for i, out in enumerate(pool.map(generate, sent)):
                history[i] = sent[i] + out
                answers.append(out)
    assert answers == chat(Harness(), convs, sampling)
    assert info()["cache"]["host_hit_tokens"] > hits

    def settled():  # the tree's tokens are every used slot of each pool
        i = info()
        tier, cache = i["hicache"], i["cache"]
        return (i["num_running"] == 0 and tier["device_used_tokens"] == cache["cached_tokens"]
                and tier["host_used_tokens"] == cache["host_cached_tokens"])

    wait_for(settled, 10, "both pools as the tree holds them")
    assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
    tier = info()["hicache"]
    assert tier["device_used_tokens"] == 0 and tier["host_used_tokens"] == 0

"""`jserve serve <base> --enable-lora --lora-modules a=... b=...`: the request's model picks the adapter (through
the official `openai` client), /v1/models lists the adapters under their base, and vLLM's load/unload routes
(--allow-runtime-lora-updating) add and remove adapters while the server runs."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jserve.server import ServerSettings

from server_utils import MODEL, assert_error, assert_server_idle, prompt_ids, running_server
from tiny_adapters import save_tiny_adapter
from tiny_models import reference_greedy, tiny_engine_args, tiny_tokenizer

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_checkpoint, tmp_path_factory):
    """Three adapters of the tiny Llama (folders and PEFT models): a and b served from the start, c loaded later."""
    root = tmp_path_factory.mktemp("adapters")
    _, base = tiny_llama_checkpoint
    models = {name: save_tiny_adapter(root / name, base, seed) for seed, name in enumerate("abc", start=1)}
    return root, base, models


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint, adapters):
    root = adapters[0]
    args = tiny_engine_args(tiny_llama_checkpoint[0], enable_lora=True, max_loras=2,
                            lora_modules=[f"a={root / 'a'}", f"b={root / 'b'}"])  # fmt: skip
    settings = ServerSettings(MODEL, api_key=KEY, allow_runtime_lora_updating=True)
    with running_server(args, settings) as handle:
        yield handle


def expected_text(model, seed: int) -> str:
    return tiny_tokenizer().decode(reference_greedy(model, prompt_ids(seed), NEW_TOKENS))


def complete(handle, model: str, seed: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt_ids(seed), "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, headers=AUTH, timeout=120)


def test_the_openai_client_gets_each_adapters_completion(server, adapters):
    _, base, models = adapters
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    for model, reference in (("a", models["a"]), ("b", models["b"]), (MODEL, base)):
        out = client.completions.create(model=model, prompt=prompt_ids(1), max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == expected_text(reference, 1), model
        assert out.model == model
    assert_server_idle(server)


def test_concurrent_requests_for_the_base_and_adapters_are_each_exact(server, adapters):
    _, base, models = adapters
    jobs = [(name, seed) for seed in range(4) for name in ("a", MODEL, "b")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: complete(server, *job), jobs))
    for (name, seed), response in zip(jobs, responses, strict=True):
        assert response.status_code == 200, response.text
        reference = base if name == MODEL else models[name]
        assert response.json()["choices"][0]["text"] == expected_text(reference, seed), (name, seed)
    assert_server_idle(server)


def test_models_lists_the_adapters_under_their_base(server, adapters):
    root = adapters[0]
    cards = httpx.get(f"{server.base_url}/v1/models", headers=AUTH).json()["data"]
    assert [card["id"] for card in cards] == [MODEL, "a", "b"]
    assert [card.get("parent") for card in cards] == [None, MODEL, MODEL]
    assert cards[1]["root"] == str(root / "a")


def test_an_unknown_model_is_404(server):
    error = assert_error(complete(server, "nope", 0), 404, "model", "does not exist")
    assert error["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time(server, adapters):
    root, _, models = adapters
    url = server.base_url
    assert_error(complete(server, "c", 2), 404, "model")
    response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "c")},
                          headers=AUTH)  # fmt: skip
    assert response.status_code == 200 and "added" in response.text
    assert complete(server, "c", 2).json()["choices"][0]["text"] == expected_text(models["c"], 2)
    assert "c" in [card["id"] for card in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
    # A name in use, a folder that is not an adapter, a field missing: 400s that change nothing.
    taken = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "a")}, headers=AUTH
    )
    assert_error(taken, 400, "lora_name", "is taken")
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(root)}, headers=AUTH)
    assert_error(missing, 400, "lora_path", "adapter_config.json")
    assert_error(httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d"}, headers=AUTH), 400, "lora_path")
    response = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH)
    assert response.status_code == 200 and "removed" in response.text
    assert_error(complete(server, "c", 2), 404, "model")
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH)
    assert_error(again, 404, "lora_name", "no adapter named 'c'")
    assert complete(server, "a", 2).json()["choices"][0]["text"] == expected_text(models["a"], 2)
    assert_server_idle(server)


def test_the_routes_need_the_key(server):
    assert_error(httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={}), 401)
    assert_error(httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={}), 401)


def test_the_routes_are_off_unless_allowed(tiny_server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert_error(httpx.post(f"{tiny_server.base_url}{path}", json={"lora_name": "a"}), 404)

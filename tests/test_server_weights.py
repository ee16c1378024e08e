"""The weight routes (`--enable-weight-routes`): a trainer in another process gives the server's engine new
weights from a checkpoint folder, and puts it to sleep and wakes it, over HTTP."""

import httpx
import pytest

from jserve import SamplingParams
from jserve.server import ServerSettings

from server_utils import MODEL, assert_error, assert_server_idle, prompt_ids, running_server
from test_engine import tiny_llm
from tiny_models import save_tiny_checkpoint, tiny_engine_args

KEY = "trainer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = prompt_ids(3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folders = [tmp_path_factory.mktemp(f"llama{seed}") for seed in (0, 1)]
    for seed, folder in enumerate(folders):
        save_tiny_checkpoint(folder, "llama", seed)
    return folders


@pytest.fixture(scope="module")
def server(checkpoints):
    settings = ServerSettings(MODEL, api_key=KEY, enable_weight_routes=True)
    with running_server(tiny_engine_args(checkpoints[0]), settings) as handle:
        yield handle


def complete(handle) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_the_routes_are_off_unless_enabled(tiny_server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/v1/update_weights")):  # fmt: skip
        assert_error(httpx.request(method, f"{tiny_server.base_url}{path}"), 404)


def test_the_routes_need_the_key(server):
    assert_error(httpx.post(f"{server.base_url}/sleep"), 401)
    assert_error(httpx.post(f"{server.base_url}/v1/update_weights", json={"path": "x"}), 401)
    assert_error(httpx.get(f"{server.base_url}/is_sleeping"), 401)


def test_new_weights_then_sleep_and_wake(server, checkpoints):
    base = server.base_url
    before = complete(server).json()["choices"][0]["text"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = tiny_llm(checkpoints[1]).generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text

    assert_error(httpx.post(f"{base}/v1/update_weights", json={"path": str(checkpoints[0] / "nope")}, headers=AUTH),
                 400, "path")  # fmt: skip
    assert_error(httpx.post(f"{base}/v1/update_weights", json={}, headers=AUTH), 400, "path")
    assert complete(server).json()["choices"][0]["text"] == before  # a refused update changed nothing
    updated = httpx.post(f"{base}/v1/update_weights", json={"path": str(checkpoints[1])}, headers=AUTH, timeout=60)
    assert updated.status_code == 200 and updated.json() == {"weights_version": 1}
    after = complete(server).json()["choices"][0]["text"]
    assert after == expected != before

    assert httpx.get(f"{base}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert_error(httpx.post(f"{base}/sleep?level=3", headers=AUTH), 400, "level")
    assert httpx.post(f"{base}/sleep", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert_error(complete(server), 503, text="wake_up")
    assert httpx.post(f"{base}/wake_up", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert complete(server).json()["choices"][0]["text"] == after
    assert_server_idle(server)

"""`edgetune serve` with real clients: the official `openai` package and curl against the
command started on the tiny model with two LoRA adapters (random, non-zero factors of
different ranks and layers) and a runs folder that a short run finishes into while it
serves; and the decode loop (engine/generation/batcher.py) in the test process."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token"
# (folder, LoRA layers, rank)
ADAPTERS = [("tad0", ["q_proj", "v_proj"], 4), ("tad1", ["q_proj", "k_proj", "o_proj", "down_proj"], 8)]


def make_adapters(root: Path, model_dir: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, (name, layers, r) in enumerate(ADAPTERS):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=layers,
                                                init_lora_weights=False))  # B non-zero: the adapter changes outputs
        peft.save_pretrained(root / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("serve")
    make_adapters(root, tiny_model_dir)
    (root / "runs").mkdir()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", "serve", "--base", str(tiny_model_dir),
                             "--quant", "none", "--adapter", str(root / "tad0"), "--adapter", str(root / "tad1"),
                             "--runs-dir", str(root / "runs"), "--port", str(port), "--auth", TOKEN, "--max-rows", "8"],
                            cwd=root, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    ready = proc.stdout.readline()
    assert ready.startswith(f"edgetune serve: http://127.0.0.1:{port}/v1"), (ready, (root / "serve.log").read_text())
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=120)

    def models():
        return [m.id for m in client.models.list().data]

    _wait_for(lambda: _answers(client), 60, "the server to answer")
    yield {"client": client, "port": port, "root": root, "base": str(tiny_model_dir), "models": models}
    proc.terminate()
    proc.wait(30)
    log.close()


def _answers(client) -> bool:
    import openai

    try:
        client.models.list()
        return True
    except openai.APIConnectionError:
        return False


def chat(client, model, text, **kw):
    kw = {"max_tokens": 8, "temperature": 0, **kw}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kw)


def test_lists_the_base_and_each_adapter_by_name(server):
    assert server["models"]()[:3] == [server["base"], "tad0", "tad1"]
    one = server["client"].models.retrieve("tad1")
    assert (one.id, one.owned_by) == ("tad1", "edgetune")


def test_a_chat_completion_is_what_peft_generates_with_that_adapter(server, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from edgetune.engine.data.prompts import prompt_ids

    from edgetune.engine.models.model import load_tokenizer

    out = chat(server["client"], "tad1", "What is 2+3?", max_tokens=10)
    (choice,) = out.choices
    assert out.model == "tad1" and out.object == "chat.completion" and choice.message.role == "assistant"
    tok = load_tokenizer(str(tiny_model_dir))
    ids = prompt_ids(tok, [[{"role": "user", "content": "What is 2+3?"}]])[0]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), server["root"] / "tad1")
    with torch.no_grad():
        gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert choice.message.content == tok.decode([t for t in gen if t != tok.eos_token_id], skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(gen)
    assert choice.finish_reason == ("stop" if tok.eos_token_id in gen else "length")
    base = chat(server["client"], server["base"], "What is 2+3?", max_tokens=10).choices[0].message.content
    assert base != choice.message.content  # the adapter was applied


def test_streaming_sends_the_same_text_in_chunks_then_usage(server):
    client = server["client"]
    whole = chat(client, "tad0", "Tell me a story.", max_tokens=12)
    chunks = list(chat(client, "tad0", "Tell me a story.", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len([c for c in chunks if c.choices]) > 3
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_n_seed_and_stop(server):
    client = server["client"]
    a = client.completions.create(model="tad0", prompt="Once upon a time", max_tokens=8, n=3, seed=7, temperature=1.0)
    b = client.completions.create(model="tad0", prompt="Once upon a time", max_tokens=8, n=3, seed=7, temperature=1.0)
    assert [c.index for c in a.choices] == [0, 1, 2] and a.object == "text_completion"
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # a seed gives the same draws
    assert len({c.text for c in a.choices}) > 1  # three draws, not one thrice
    full = client.completions.create(model="tad0", prompt="Once upon a time", max_tokens=12, temperature=0).choices[0]
    stop = full.text[len(full.text) // 2:][:3]
    cut = client.completions.create(model="tad0", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]


def test_two_adapters_at_once_give_the_tokens_each_gives_alone(server):
    client = server["client"]
    asks = [(m, p) for p in ("Hello!", "What is the capital of France? Answer in one word.")
            for m in ("tad0", "tad1", server["base"])]
    alone = [chat(client, m, p, max_tokens=16).choices[0].message.content for m, p in asks]
    start = threading.Barrier(len(asks))

    def together(ask):
        start.wait()
        return chat(client, *ask, max_tokens=16).choices[0].message.content

    with ThreadPoolExecutor(len(asks)) as pool:
        at_once = list(pool.map(together, asks))
    assert at_once == alone
    assert len(set(alone[:3])) == 3  # three models, three answers


def test_bad_requests_are_one_line_errors_in_openai_shape(server):
    import openai

    client = server["client"]
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-adapter", "hi")
    assert e.value.body["code"] == "model_not_found" and "GET /v1/models" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "tad0", "hi", n=9)
    assert e.value.body == {"message": "'n' is 9; it must be from 1 to 8", "type": "invalid_request_error",
                            "code": None, "param": "n"}
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "tad0", "hi", max_tokens=10**6)
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.body["code"] == "invalid_api_key"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl(server):
    url = f"http://127.0.0.1:{server['port']}/v1/chat/completions"
    body = json.dumps({"model": "tad0", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16,
                       "temperature": 0})
    p = subprocess.run(["curl", "-s", "-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json",
                        "-d", body, url], capture_output=True, text=True, timeout=120)
    out = json.loads(p.stdout)
    assert out["choices"][0]["message"]["content"] == chat(server["client"], "tad0", "Hello!", max_tokens=16) \
        .choices[0].message.content
    p = subprocess.run(["curl", "-s", "-H", f"Authorization: Bearer {TOKEN}", "-H", "Host: rebound.example", url,
                        "-d", body], capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout)["error"]["message"].startswith("refused: Host 'rebound.example' is not an address")


def test_a_run_that_finishes_is_served_without_a_restart_and_a_deleted_one_goes(server, tiny_model_dir):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    runs = server["root"] / "runs"
    cfg = resolve(preset="sft-quickstart", overrides=[
        f"model.name={tiny_model_dir}", "model.quant=none", "data.max_rows=32", "sft.steps=2", "sft.batch_size=2",
        "sft.eval_every=0", "run.checkpoint_every=0", f"run.runs_dir={runs}"])
    run = api.start(cfg, name="fresh")
    assert run.wait(300) == "finished", run.death()
    _wait_for(lambda: "fresh" in server["models"](), 60, "the finished run to be served")
    assert chat(server["client"], "fresh", "Hello!").choices[0].message.content
    api.trash_run(run.path)
    _wait_for(lambda: "fresh" not in server["models"](), 60, "the deleted run to go")


# --------------------------------------------------------------------------- the training API


def _tiny(model_dir, steps):
    return [f"model.name={model_dir}", "model.quant=none", "data.max_rows=32", f"sft.steps={steps}",
            "sft.batch_size=2", "sft.eval_every=0", "run.checkpoint_every=0", "data.eval_fraction=0.25"]


def _http(server):
    import httpx

    return httpx.Client(base_url=f"http://127.0.0.1:{server['port']}", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=300)


def test_the_training_api_is_described_and_refuses_in_one_line(server, tmp_path):
    http = _http(server)
    spec = http.get("/openapi.json").json()
    assert {"/api/runs", "/api/runs/{name}/events", "/api/runs/{name}/stop", "/api/runs/{name}/export",
            "/api/evaluations", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    assert "sft-quickstart" in [p["name"] for p in http.get("/api/presets").json()]
    before = http.get("/api/runs").json()
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(completions, rows):\n    return [0.0 for _ in completions]\n")
    r = http.post("/api/runs", json={"preset": "fgrpo-quickstart", "set": [f"fgrpo.reward_file={reward}"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "code_not_allowed"
    r = http.post("/api/runs", json={"preset": "no-such-preset"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("unknown preset 'no-such-preset'")
    r = http.post("/api/runs", json={"preset": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "preset"
    assert http.get("/api/runs/nope").json()["error"]["code"] == "run_not_found"
    assert http.get("/api/runs").json() == before  # nothing started
    assert httpx_status(server, "/api/runs", token="wrong") == 401


def httpx_status(server, path, token):
    import httpx

    return httpx.get(f"http://127.0.0.1:{server['port']}{path}", headers={"Authorization": f"Bearer {token}"}).status_code


@pytest.mark.slow  # a run started, followed and stopped, exported and evaluated, each in its own process
def test_the_training_api_over_http(server, tiny_model_dir, tmp_path):
    http = _http(server)
    r = http.post("/api/runs", json={"preset": "sft-quickstart", "set": _tiny(tiny_model_dir, 500), "name": "api-run"})
    assert r.status_code == 201 and r.json()["name"] == "api-run", r.text
    seen = []
    with http.stream("GET", "/api/runs/api-run/events", params={"follow": "true"}) as events:
        for line in events.iter_lines():
            if line.startswith("data: ") and line != "data: {}":
                seen.append(json.loads(line[6:]))
                if seen[-1]["type"] == "step" and len([e for e in seen if e["type"] == "step"]) == 1:
                    assert http.post("/api/runs/api-run/stop").json() == {"name": "api-run", "stopping": True}
    assert seen[0]["i"] == 0 and seen[-1]["type"] == "stopped" and seen[-1]["step"] < 500
    assert [e["type"] for e in http.get("/api/runs/api-run/events", params={"start": 1}).json()] == \
        [e["type"] for e in seen[1:]]
    listed = {s["name"]: s for s in http.get("/api/runs").json()}
    assert listed["api-run"]["status"] == "stopped" and listed["api-run"]["has_adapter"]
    r = http.post("/api/runs/api-run/stop")
    assert r.status_code == 409 and r.json()["error"]["message"] == "run 'api-run' is stopped, not training"

    r = http.post("/api/runs/api-run/export", json={"out": str(tmp_path / "exported")})
    assert r.status_code == 200 and (tmp_path / "exported" / "adapter_config.json").is_file(), r.text
    r = http.post("/api/runs/api-run/export", json={"out": str(tmp_path / "exported")})
    assert r.status_code == 400 and "exported" in r.json()["error"]["message"]  # never over what is there

    ask = {"runs": ["api-run"], "base": True, "preset": "sft-quickstart", "set": _tiny(tiny_model_dir, 2)}
    answers = []  # (the stopped run's worker holds the runs folder until its process has exited)
    _wait_for(lambda: answers.append(http.post("/api/evaluations", json=ask)) or answers[-1].status_code != 400
              or "one job on the device at a time" not in answers[-1].text, 120, "the run's worker to exit")
    assert answers[-1].status_code == 201, answers[-1].text
    name = answers[-1].json()["name"]
    _wait_for(lambda: http.get(f"/api/evaluations/{name}").json()["status"] != "running", 300, "the evaluation")
    job = http.get(f"/api/evaluations/{name}").json()
    assert job["status"] == "finished", job
    (task,) = job["result"]["tasks"]
    assert [s["name"] for s in task["systems"]] == ["the base", "api-run"]


# --------------------------------------------------------------------------- the decode loop


@pytest.fixture(scope="module")
def batcher(tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import load_tokenizer

    from edgetune.engine.generation.batcher import Batcher

    root = tmp_path_factory.mktemp("adapters")
    make_adapters(root, tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    b = Batcher(model, load_tokenizer(str(tiny_model_dir)), max_rows=8)
    b.add_adapter("tad0", root / "tad0")
    b.add_adapter("tad1", root / "tad1")
    yield b
    b.close()


def _job(adapter, prompt, max_tokens):
    """(job, its events as they come, an Event set at its end)."""
    from edgetune.engine.generation.batcher import Job

    events, done = [], threading.Event()

    def emit(ev):
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    return Job(adapter, [prompt], emit, max_tokens=max_tokens), events, done


def test_jobs_waiting_together_decode_in_one_batch_as_each_alone(batcher):
    ask = [("", [1, 2, 3]), ("tad0", [4, 5]), ("tad1", [6, 7, 8, 9])]
    alone = []
    for adapter, prompt in ask:
        job, events, done = _job(adapter, prompt, 10)
        batcher.submit(job)
        assert done.wait(120)
        alone.append(events)
    assert all(ev[-1]["type"] == "done" for ev in alone) and len({str(ev) for ev in alone}) == 3
    before = batcher.forwards
    jobs = [_job(adapter, prompt, 10) for adapter, prompt in ask]
    batcher.call(lambda: [batcher.submit(job) for job, _, _ in jobs])  # all waiting when the loop admits
    assert all(done.wait(120) for _, _, done in jobs)
    assert [events for _, events, _ in jobs] == alone
    assert batcher.forwards - before == 10  # one prefill and nine steps for the three, not thirty


def test_a_cancelled_job_leaves_the_batch(batcher):
    job, events, done = _job("tad0", [1, 2, 3], 100_000)
    batcher.submit(job)
    _wait_for(lambda: len(events) > 2, 60, "the first tokens")
    job.cancelled = True
    _wait_for(lambda: not batcher.rows, 60, "the row to leave")
    assert not done.is_set() and len([e for e in events if e["type"] == "text"]) < 1000


def test_the_apps_server_trusts_no_planted_pid_file_and_refuses_bad_input_in_one_line(tmp_path):
    """engine/run/serve_process: a pid file copied in with a runs folder names a process that
    is not this server on that port (here: the test itself): not running, nothing signalled,
    no port used; a port out of range or an unknown quantisation is one line."""
    import os

    from edgetune.engine.core.errors import EdgetuneError
    from edgetune.engine.core.runfolder import process_start

    from edgetune.engine.run import serve_process

    folder = tmp_path / "runs" / serve_process.SERVE_DIR
    folder.mkdir(parents=True)
    (folder / "pid").write_text(f"{os.getpid()} {process_start(os.getpid())} 8000")
    server = serve_process.Server(tmp_path / "runs")
    assert server.pid() is None and not server.alive() and server.port() is None and server.models() is None
    server.stop()  # signals nothing: this test goes on
    with pytest.raises(EdgetuneError, match="^port must be"):
        serve_process.start(tmp_path / "runs", "m", "nf4", 80)
    with pytest.raises(EdgetuneError, match="^quant: one of nf4, int8, none"):
        serve_process.start(tmp_path / "runs", "m", "fp8", 8000)

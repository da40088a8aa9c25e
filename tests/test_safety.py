"""Nothing of the user's is lost or let in: exports that refuse to replace what they did
not write, run names that stay inside the runs folder, no pickle read from disk."""

import json
import subprocess
import sys
import zipfile

import pytest

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.models.export import EXPORT_MARKER, export


def edgetune(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def _one_error_line(p):
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.fixture
def fake_run(tmp_path):
    """A run folder with a final adapter (its files are stand-ins: export copies bytes)."""
    run = tmp_path / "runs" / "r"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("method: sft\n")
    (run / "events.jsonl").write_text("")
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (run / "adapter" / "adapter_model.safetensors").write_bytes(_weights(1.0))
    return run


def _weights(value: float, name: str = "base_model.model.q_proj.lora_B.weight") -> bytes:
    """An adapter weights file: one small float32 tensor filled with `value`."""
    import numpy as np
    from safetensors.numpy import save

    return save({name: np.full((4, 2), value, dtype=np.float32)})


def _tree(p):
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_export_into_new_and_empty_folders(fake_run, tmp_path):
    out = export(fake_run, tmp_path / "new")
    assert (out / "adapter_model.safetensors").read_bytes() == _weights(1.0)
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == str((fake_run / "adapter").resolve())
    empty = tmp_path / "empty"
    empty.mkdir()
    export(fake_run, empty)
    assert (empty / "adapter_config.json").is_file()


def test_export_refuses_a_folder_with_user_files_even_with_force(fake_run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for force in ([], ["--force"]):
        p = edgetune("export", str(fake_run), "--out", str(mine), *force)
        assert p.returncode == 2
        assert str(mine) in _one_error_line(p)
        assert _tree(mine) == {"thesis.tex": b"years of work"}
        assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []  # nothing renamed away


def test_export_refuses_a_file_and_a_run_folder(fake_run, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    with pytest.raises(EdgetuneError, match="an existing file"):
        export(fake_run, f, force=True)
    assert f.read_text() == "keep"
    with pytest.raises(EdgetuneError, match="an existing file"):
        export(fake_run, f, as_zip=True, force=True)  # not a zip an export wrote
    assert f.read_text() == "keep"
    before = _tree(fake_run)
    other = fake_run.parent / "other"
    other.mkdir()
    (other / "config.yaml").write_text("method: sft\n")
    (other / EXPORT_MARKER).write_text("{}")  # even a run that looks exported is never replaced
    for target in (fake_run, other, fake_run / "adapter"):
        p = edgetune("export", str(fake_run), "--out", str(target), "--force")
        assert p.returncode == 2, p.stderr
        assert str(target) in _one_error_line(p)
    assert _tree(fake_run) == before and (other / "config.yaml").is_file()


def test_export_out_dot_is_refused(fake_run, tmp_path):
    work = tmp_path / "empty-cwd"
    work.mkdir()
    p = edgetune("export", str(fake_run), "--out", ".", cwd=work)
    assert p.returncode == 2 and "new folder" in _one_error_line(p)
    assert list(work.iterdir()) == []


def test_force_replaces_only_a_previous_export(fake_run, tmp_path):
    out = export(fake_run, tmp_path / "exp")
    (fake_run / "adapter" / "adapter_model.safetensors").write_bytes(_weights(2.0))
    with pytest.raises(EdgetuneError, match="not empty"):
        export(fake_run, out)
    p = edgetune("export", str(fake_run), "--out", str(out), "--force")
    assert p.returncode == 0, p.stderr
    assert (out / "adapter_model.safetensors").read_bytes() == _weights(2.0)
    z = export(fake_run, tmp_path / "a.zip", as_zip=True)
    with pytest.raises(EdgetuneError):
        export(fake_run, z, as_zip=True)
    export(fake_run, z, as_zip=True, force=True)
    assert EXPORT_MARKER in zipfile.ZipFile(z).namelist()
    with pytest.raises(EdgetuneError):  # a zip export is not a folder export
        export(fake_run, z, force=True)


def _train_args(runs, model_dir, *extra):
    return ["train", "--preset", "sft-quickstart", "--runs-dir", str(runs), "--set", f"model.name={model_dir}",
            "--set", "sft.steps=100000", "--set", "data.max_rows=16", "--detach", *extra]


def test_two_trains_started_together_one_is_refused(tmp_path, tiny_model_dir):
    from edgetune.engine.run import api

    runs = tmp_path / "runs"  # does not exist yet
    cmd = [sys.executable, "-m", "edgetune.engine.cli", *_train_args(runs, tiny_model_dir)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [(p.wait(120), *p.communicate()) for p in procs]
    try:
        assert sorted(rc for rc, _, _ in outs) == [0, 2], outs
        refused = next(err for rc, _, err in outs if rc == 2)
        assert "one run at a time per runs folder" in refused and "Traceback" not in refused
        assert len(api.list_runs(runs)) == 1
        run = api.list_runs(runs)[0]
        # A third, while the first trains, and a resume of it: refused too.
        p = edgetune(*_train_args(runs, tiny_model_dir))
        assert p.returncode == 2 and f"run '{run.name}' is still" in _one_error_line(p)
    finally:
        for r in api.list_runs(runs):
            r.kill()
    assert all(r.status() == "failed" for r in api.list_runs(runs))
    p = edgetune(*_train_args(runs, tiny_model_dir, "--name", "after"))  # the lock went with the worker
    try:
        assert p.returncode == 0, p.stderr
    finally:
        api.Run(runs / "after").kill()


@pytest.mark.parametrize("name", ["..", "../escape", "/tmp/abs", "a/b", ".hidden", "", " ", "a\\b"])
def test_run_names_are_one_path_component(tmp_path, name):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    runs = tmp_path / "deep" / "runs"
    p = edgetune("train", "--preset", "sft-quickstart", "--runs-dir", str(runs), "--name", name, timeout=60)
    assert p.returncode == 2 and "run.name" in _one_error_line(p)
    if name.strip():  # (an empty run.name setting means "name it for me")
        p = edgetune("train", "--preset", "sft-quickstart", "--runs-dir", str(runs), "--set", f"run.name={name}",
                     timeout=60)
        assert p.returncode == 2 and "run.name" in _one_error_line(p)
    cfg = resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}"])
    with pytest.raises(EdgetuneError, match="run.name"):
        api.start(cfg, name=name)
    assert not (tmp_path / "deep").exists() or list((tmp_path / "deep").rglob("*")) in ([], [runs])
    assert not (tmp_path / "escape").exists() and not (tmp_path / "deep" / "escape").exists()


def test_nul_in_run_name_is_refused():
    from edgetune.engine.core.runfolder import check_run_name

    with pytest.raises(EdgetuneError, match="run.name"):
        check_run_name("a\0b")


def test_commands_without_a_runs_folder_say_so_in_one_line(tmp_path):
    assert edgetune("runs", "--runs-dir", str(tmp_path / "none")).returncode == 0
    p = edgetune("resume", str(tmp_path / "none" / "r"))
    assert p.returncode == 2 and str(tmp_path / "none" / "r") in _one_error_line(p)
    p = edgetune("export", str(tmp_path / "none" / "r"), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_app_on_a_network_host_needs_a_login(tmp_path, capsys, monkeypatch):
    import gradio as gr

    from edgetune.engine import cli

    def served(demo):  # a refused start never gets here; a served one must not block the test
        demo.close()
        raise AssertionError("the app started")

    monkeypatch.setattr(gr.Blocks, "block_thread", served)

    p = edgetune("ui", "--host", "0.0.0.0", "--runs-dir", str(tmp_path / "runs"), timeout=120)
    line = _one_error_line(p)
    assert p.returncode == 2 and "--auth user:password" in line and "--insecure-no-auth" in line
    # the same command in this process (the app's imports paid once)
    capsys.readouterr()
    assert cli.main(["ui", "--host", "192.168.1.5", "--port", "7999", "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    line = _one_error_line(subprocess.CompletedProcess([], 2, "", err))
    assert "--auth user:password" in line and "--insecure-no-auth" in line
    assert cli.main(["ui", "--auth", "nopassword"]) == 2
    err = capsys.readouterr().err
    assert "--auth: expected user:password" in _one_error_line(subprocess.CompletedProcess([], 2, "", err))


def test_app_with_auth_refuses_requests_without_the_login(tmp_path):
    import socket
    import urllib.error
    import urllib.parse
    import urllib.request

    from edgetune.app.main import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = launch("127.0.0.1", port, str(tmp_path / "runs"), block=False, auth="ann:s3cret")
    try:
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/config", timeout=30)
        assert e.value.code == 401
        bad = urllib.parse.urlencode({"username": "ann", "password": "wrong"}).encode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}/login", data=bad, timeout=30)
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        good = urllib.parse.urlencode({"username": "ann", "password": "s3cret"}).encode()
        assert opener.open(f"{base}/login", data=good, timeout=30).status == 200
        assert opener.open(f"{base}/config", timeout=30).status == 200
        # Served files: the runs folder only (adapter zips are downloaded from there).
        runs = (tmp_path / "runs").resolve()
        (runs / "r").mkdir(parents=True, exist_ok=True)
        (runs / "r" / "a.zip").write_bytes(b"zip")
        (tmp_path / "secret.txt").write_text("private")
        assert opener.open(f"{base}/gradio_api/file={runs}/r/a.zip", timeout=30).read() == b"zip"
        for path in ("/etc/passwd", f"{runs}/../secret.txt", f"{runs}/r/../../secret.txt"):
            with pytest.raises(urllib.error.HTTPError) as e:
                opener.open(f"{base}/gradio_api/file={path}", timeout=30)
            assert e.value.code in (403, 404), path
    finally:
        demo.close()
        demo.edgetune_chat.close()


# --------------------------------------------------------------------------- what a web page may send the app


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app on 127.0.0.1 without a login, as `edgetune ui --allow-host edgetune.lan`
    serves it; Gradio's upload cache in a folder of the test's own."""
    import os

    from edgetune.app.main import launch

    root = tmp_path_factory.mktemp("served")
    old = os.environ.get("GRADIO_TEMP_DIR")
    os.environ["GRADIO_TEMP_DIR"] = str(root / "gradio")
    port = _free_port()
    demo = launch("127.0.0.1", port, str(root / "runs"), block=False, allow_hosts=["edgetune.lan"])
    try:
        yield demo, f"http://127.0.0.1:{port}", port, root
    finally:
        demo.close()
        demo.edgetune_chat.close()
        if old is None:
            os.environ.pop("GRADIO_TEMP_DIR")
        else:
            os.environ["GRADIO_TEMP_DIR"] = old


def test_app_answers_only_its_own_host_names(served):
    """A DNS-rebinding page reaches 127.0.0.1 under its own domain: that Host is refused."""
    import httpx

    _, base, port, _ = served
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"edgetune.lan:{port}"):
        assert httpx.get(f"{base}/config", headers={"Host": host}, timeout=30).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}", ""):
        r = httpx.get(f"{base}/config", headers={"Host": host}, timeout=30)
        assert r.status_code == 403 and f"Host '{host}' is not an address of this app" in r.text, host
        assert "components" not in r.text


def test_app_refuses_a_post_from_another_sites_page(served):
    import httpx

    _, base, port, _ = served
    row = {"files": ("d.jsonl", b'{"prompt": "1+1", "answer": "2"}\n')}
    for origin in ("http://evil.example", f"http://evil.example:{port}", f"http://localhost:{port + 1}", "null"):
        for path in ("/gradio_api/upload", "/gradio_api/queue/join"):
            r = httpx.post(f"{base}{path}", headers={"Origin": origin}, files=row, timeout=30)
            assert r.status_code == 403 and f"another site ({origin})" in r.text, (origin, path)
    # the page's own origin, a name given with --allow-host, and a client that sends none
    for origin in (base, "http://edgetune.lan", None):
        r = httpx.post(f"{base}/gradio_api/upload", headers={"Origin": origin} if origin else {}, files=row,
                       timeout=30)
        assert r.status_code == 200, origin


def test_app_takes_uploads_of_data_files_only(served):
    """The Data tab's file types hold on the server: a .py sent by hand is refused before
    Gradio writes any of it; a data file is taken."""
    import httpx

    _, base, _, root = served
    cache = root / "gradio"
    for files in ([("files", ("reward.py", b"import os\n"))],
                  [("files", ("ok.csv", b"a,b\n1,2\n")), ("files", ("reward.py", b"import os\n"))],
                  [("files", ("reward.py.", b"import os\n"))], [("files", ("x.jsonl/../reward.py", b"import os\n"))]):
        r = httpx.post(f"{base}/gradio_api/upload", files=files, timeout=30)
        assert r.status_code == 415 and r.text.startswith("upload refused: '") and "not a data file" in r.text
        assert not [p for p in cache.rglob("*") if p.is_file() and b"import os" in p.read_bytes()]
    r = httpx.post(f"{base}/gradio_api/upload", files={"files": ("Train.JSONL", b'{"a": 1}\n')}, timeout=30)
    assert r.status_code == 200
    [path] = r.json()
    assert path.endswith("Train.JSONL") and open(path, "rb").read() == b'{"a": 1}\n'


def test_an_upload_never_replaces_an_earlier_one(served, tmp_path):
    """Two uploads named alike keep both files (a run may have trained on the first); the
    same bytes again are the same file."""
    demo, _, _, root = served
    tab = demo.edgetune_page.data_tab
    path_box = demo.edgetune_page.fields["data.path"]
    first, second = tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"
    for f, rows in ((first, 40), (second, 24)):
        f.parent.mkdir()
        f.write_text("".join(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(rows)))
    kept = [tab.take_upload(str(f))[path_box] for f in (first, second, first)]
    uploads = root / "runs" / ".uploads"
    assert kept == [str(uploads / "train.jsonl"), str(uploads / "train-2.jsonl"), str(uploads / "train.jsonl")]
    assert (uploads / "train.jsonl").read_bytes() == first.read_bytes()
    assert (uploads / "train-2.jsonl").read_bytes() == second.read_bytes()


def test_an_upload_past_the_size_cap_is_refused_before_it_is_kept(tmp_path, monkeypatch):
    import httpx

    from edgetune.app import main

    monkeypatch.setattr(main, "MAX_UPLOAD_BYTES", 4096)
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    port = _free_port()
    demo = main.launch("127.0.0.1", port, str(tmp_path / "runs"), block=False)
    try:
        base = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{base}/gradio_api/upload", files={"files": ("big.jsonl", b'{"a": 1}\n' * 1000)}, timeout=30)
        assert r.status_code == 413, r.text
        assert not [p for p in (tmp_path / "gradio").rglob("*") if p.is_file() and p.name == "big.jsonl"]
        r = httpx.post(f"{base}/gradio_api/upload", files={"files": ("small.jsonl", b'{"a": 1}\n')}, timeout=30)
        assert r.status_code == 200
    finally:
        demo.close()
        demo.edgetune_chat.close()


def test_a_reward_file_in_an_upload_folder_is_never_run(served, capsys):
    """However a start arrives (the app's Start, the API, the CLI), a reward_file that lies
    in the app's upload folders is refused in one line and no run folder is made."""
    from edgetune.engine.run import api

    from edgetune.app import form
    from edgetune.engine import cli

    demo, _, _, root = served
    page, runs = demo.edgetune_page, root / "runs"
    planted = [runs / ".uploads" / "reward.py", root / "gradio" / "0abc" / "reward.py"]
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("import pathlib\npathlib.Path('RAN').touch()\ndef reward(completion, answer, row):\n"
                     "    return 1.0\n")
    for p, section in zip(planted, ("fgrpo", "essa")):
        folder = p.parent if section == "fgrpo" else root / "gradio"
        cfg = form.preset_config(f"{section}-quickstart", str(runs))
        getattr(cfg, section).reward_file = str(p)
        values = {c: v for c, v in page.fill_from(cfg).items() if c in page.form_inputs}
        msg = page.train_tab.do_start({**values, page.attached: "", page.train_tab.gpus: 1})[page.train_tab.msg]
        assert msg == (f"✗ {section}.reward_file {p}: lies in {folder}, where the app keeps uploaded files; "
                       "a reward file runs as Python, so it is never taken from an upload: save it elsewhere "
                       "and give that path")
        with pytest.raises(EdgetuneError, match=f"{section}.reward_file .* lies in"):
            api.start(cfg)
        # a link from elsewhere into the upload folder is followed
        link = root / f"link-{section}.py"
        link.symlink_to(p)
        getattr(cfg, section).reward_file = str(link)
        with pytest.raises(EdgetuneError, match="lies in"):
            api.start(cfg)
    capsys.readouterr()
    assert cli.main(["train", "--preset", "fgrpo-quickstart", "--runs-dir", str(runs),
                     "--set", f"fgrpo.reward_file={planted[0]}"]) == 2
    assert "lies in" in _one_error_line(subprocess.CompletedProcess([], 2, "", capsys.readouterr().err))
    assert sorted(p.name for p in runs.iterdir()) == [".uploads"] and not (root / "RAN").exists()


def test_repeated_bad_logins_are_throttled(tmp_path):
    import httpx

    from edgetune.app.guard import LoginThrottle
    from edgetune.app.main import launch

    port = _free_port()
    demo = launch("127.0.0.1", port, str(tmp_path / "runs"), block=False, auth="ann:s3cret")
    try:
        login = f"http://127.0.0.1:{port}/login"
        for i in range(LoginThrottle.free_failures):
            assert httpx.post(login, data={"username": "ann", "password": f"guess{i}"}, timeout=30).status_code == 400
        # paused: not even the right password is checked now
        r = httpx.post(login, data={"username": "ann", "password": "s3cret"}, timeout=30)
        assert r.status_code == 429 and "too many failed logins from 127.0.0.1: try again in 30 s" in r.text
        assert int(r.headers["Retry-After"]) >= 30
    finally:
        demo.close()
        demo.edgetune_chat.close()
    # the pause doubles with each failure after it, up to the longest; a login clears it
    now = [0.0]
    t = LoginThrottle(free_failures=2, first_pause=10, longest_pause=35, clock=lambda: now[0])
    t.failed("a")
    assert t.wait("a") == 0
    pauses = []
    for _ in range(4):
        t.failed("a")
        pauses.append(t.wait("a"))
        now[0] += pauses[-1]
    assert pauses == [10, 20, 35, 35] and t.wait("b") == 0
    t.succeeded("a")
    t.failed("a")
    assert t.wait("a") == 0


def test_allow_host_takes_bare_host_names_only():
    from edgetune.app.main import check_allow_hosts

    assert check_allow_hosts(["Box.LAN", "proxy.example.com"]) == ("box.lan", "proxy.example.com")
    for bad in ("http://box.lan", "box.lan:7860", "", ".lan"):
        with pytest.raises(EdgetuneError, match="--allow-host"):
            check_allow_hosts([bad])


def test_reward_file_says_it_runs_python_in_help_and_in_the_app():
    from edgetune.app import form

    p = edgetune("train", "--help")
    assert p.returncode == 0 and "reward_file" in p.stdout and "use only code you trust" in " ".join(p.stdout.split())
    helps = {s.key: s.help for s in form.field_specs()}
    for key in ("fgrpo.reward_file", "essa.reward_file"):
        assert "Python with your rights" in helps[key] and "code you trust" in helps[key]


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory, tiny_model_dir):
    """An adapter trained on a narrower Llama than the tiny one (hidden 32, not 64)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("other-base")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(root / "adapter")
    (root / "adapter" / "edgetune.json").write_text(json.dumps({"base_path": str(root / "base")}))
    return root


def test_adapter_of_another_base_names_the_base_it_expects(other_base_adapter, tiny_model_dir):
    from edgetune.engine.generation.chat import _Chat

    adapter, base = other_base_adapter / "adapter", other_base_adapter / "base"
    p = edgetune("eval", "--preset", "fgrpo-quickstart", "--set", f"model.name={tiny_model_dir}",
                 "--set", "model.quant=none", "--adapter", str(adapter), "--json")
    line = _one_error_line(p)
    assert p.returncode == 2 and f"trained on another base model ({base})" in line, p.stderr[-2000:]
    assert "q_proj takes 64 inputs here, 32 there" in line
    with pytest.raises(EdgetuneError, match=f"trained on another base model \\({base}\\)"):
        _Chat().answer({"model": {"name": str(tiny_model_dir), "quant": "none"}, "adapter": str(adapter),
                        "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 2})


def test_two_starts_in_one_app_process_one_is_refused(tmp_path, tiny_model_dir):
    """Two browser tabs pressing Start reach api.start on two threads of the one app process."""
    import threading

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    runs = tmp_path / "runs"
    cfg = [resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}", f"model.name={tiny_model_dir}",
                                                       "sft.steps=100000", "data.max_rows=16"]) for _ in range(2)]
    barrier, results = threading.Barrier(2), []

    def press(i):
        barrier.wait()
        try:
            results.append(api.start(cfg[i]))
        except EdgetuneError as e:
            results.append(e)

    threads = [threading.Thread(target=press, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    try:
        started = [r for r in results if isinstance(r, api.Run)]
        refused = [r for r in results if isinstance(r, EdgetuneError)]
        assert len(started) == 1 and len(refused) == 1, results
        assert "one run at a time per runs folder" in str(refused[0])
        assert len(api.list_runs(runs)) == 1
    finally:
        for r in api.list_runs(runs):
            r.kill()


def test_a_long_library_reason_is_cut_after_a_whole_sentence_never_mid_name():
    from edgetune.engine.core.errors import reason_line

    said = ("CUDA graphs cannot capture this step because a tensor was allocated outside the pool. "
            "Re-running `torch.cuda.graphs.make_graphed_callables` with the same inputs would not help here")
    assert reason_line(said, 120) == said.split(" Re-running")[0] + " …"
    assert reason_line(said, 300) == said
    cut = reason_line("x " * 30 + "Re-running `torch.cuda.graphs.make_graphed_callables` now", 80)
    assert "`" not in cut and cut.endswith(" …") and len(cut) <= 82
    assert reason_line("short\nsecond line") == "short"


def test_a_start_waits_for_the_last_workers_exit_instead_of_refusing(tmp_path, tiny_model_dir):
    """Resume or Start pressed as soon as the page says "stopped": the last run's worker,
    its final event written, holds the runs folder's lock until its process has exited
    (the interpreter's exit, a GPU's memory given back). The start waits for that instead of
    refusing, since no run is active."""
    import time

    from edgetune.engine.core.runfolder import LOCK_FILE
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.run import api

    runs = tmp_path / "runs"
    runs.mkdir()
    winding_down = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(2)", str(runs / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    assert winding_down.stdout.readline() == "held\n"
    t0 = time.time()
    run = api.start(resolve(preset="sft-quickstart", overrides=[f"run.runs_dir={runs}", f"model.name={tiny_model_dir}",
                                                                "sft.steps=100000", "data.max_rows=16"]))
    try:
        assert winding_down.wait(5) == 0 and time.time() - t0 >= 1
        assert run.status() in api.ACTIVE
    finally:
        run.kill()

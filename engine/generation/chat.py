"""Chat with a base model and a LoRA adapter side by side, from a separate process.

The app's "Try it" panel keeps one `ChatSession`: it starts
`python -m edgetune.engine.generation.chat` once and talks JSON lines over stdin/stdout. The worker
loads the base once (quantised as the run was trained) and puts each adapter on it
once; an answer from the base alone is generated inside `disable_adapter()`, so both
replies come from the same weights in memory and differ only by the adapter.

Request:  {"model": {ModelSettings fields}, "adapter": "runs/x/adapter" or "",
           "messages": [{"role", "content"}, ...], "max_new_tokens": 128,
           "tuned_messages": the adapter side's own conversation (optional; default messages),
           "system_prompt": the run's data.system_prompt (optional), put first on both sides
           where a conversation has no system turn, as training and rollouts do,
           "temperature": 0 = greedy (the default), else sampled with "top_p" (default 1),
           "seed": the sampling seed (both sides draw from the same one),
           "stream": true for the text so far as it grows}
Each side of a multi-turn chat sends its own history: the adapter's earlier replies are
part of what it answers next, the base's part of what the base answers.
Answer:   {"ok": true, "base": "...", "tuned": "..." or null}  |  {"ok": false, "error": "..."},
          with "stream", before it one line per new token: {"ok": true, "partial": "tuned" | "base",
          "text": that side's reply so far} (the adapter's side first, then the base's).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

from edgetune.engine.core.errors import EdgetuneError, RunError, reason_line
from edgetune.engine.core.threads import worker_env

# --------------------------------------------------------------------------- the worker


class _Chat:
    def __init__(self):
        self.key = None
        self.model = None
        self.tok = None
        self.adapters: dict[str, str] = {}  # adapter folder -> PEFT adapter name

    def _base(self, model_fields: dict):
        from edgetune.engine.core.settings import ModelSettings

        from edgetune.engine.models.model import load_base

        key = json.dumps(model_fields, sort_keys=True)
        if key != self.key:
            self.model, self.tok, _ = load_base(ModelSettings(**model_fields))
            self.model.eval()
            self.key, self.adapters = key, {}
        return self.model

    def _with_adapter(self, path: str):
        from peft import PeftModel

        if path in self.adapters:
            self.model.set_adapter(self.adapters[path])
            return self.model
        from edgetune.engine.models.adapter import check_adapter_fits

        check_adapter_fits(self.model, path)  # an adapter of another base: one line naming that base
        name = f"a{len(self.adapters)}"
        if not self.adapters:
            self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        else:
            self.model.load_adapter(path, adapter_name=name)
            self.model.set_adapter(name)
        self.model.eval()
        self.adapters[path] = name
        return self.model

    def prompt_ids(self, messages: list[dict], system_prompt: str = "") -> list[int]:
        """What the model reads before its reply: rendered as SFT data and rollouts render
        it (engine/data/prompts.py)."""
        from edgetune.engine.data.prompts import prompt_ids

        return prompt_ids(self.tok, [messages], system_prompt)[0]

    def _generate(self, messages: list[dict], max_new_tokens: int, system_prompt: str = "",
                  sampling: dict | None = None, on_text=None) -> str:
        """The reply to `messages`; `sampling`: {"temperature", "top_p", "seed"} (greedy
        without); `on_text(text so far)` after each new token."""
        import torch

        tok = self.tok
        device = next(self.model.parameters()).device
        row = torch.tensor([self.prompt_ids(messages, system_prompt)], device=device)
        ids = {"input_ids": row, "attention_mask": torch.ones_like(row)}
        how = {"do_sample": False}
        if sampling:
            torch.manual_seed(int(sampling.get("seed", 0)))
            how = {"do_sample": True, "temperature": float(sampling["temperature"]),
                   "top_p": float(sampling.get("top_p", 1.0)), "top_k": 0}
        streamer = _Streamer(tok, on_text) if on_text is not None else None
        from edgetune.engine.generation.fast_decode import over_host_copy

        with torch.no_grad(), over_host_copy(self.model):  # the CPU: over the base's fp32 copy
            out = self.model.generate(**ids, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                      use_cache=True, streamer=streamer, **how)
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()

    def answer(self, req: dict, send=None) -> dict:
        """The final answer to `req`; with `send`, each side's text so far as it grows
        (send({"ok": True, "partial": side, "text": ...}))."""
        self._base(req["model"])
        msgs, n = _plain(req["messages"]), int(req.get("max_new_tokens", 128))
        tuned_msgs = _plain(req.get("tuned_messages") or req["messages"])
        system = req.get("system_prompt") or ""
        adapter = req.get("adapter") or ""
        sampling = _sampling(req)

        def gen(side: str, messages: list[dict]) -> str:
            on_text = (lambda text: send({"ok": True, "partial": side, "text": text})) if send else None
            return self._generate(messages, n, system, sampling, on_text)

        if not adapter:
            if self.adapters:  # a PeftModel by now: switch its adapter off for the base reply
                with self.model.disable_adapter():
                    return {"ok": True, "base": gen("base", msgs), "tuned": None}
            return {"ok": True, "base": gen("base", msgs), "tuned": None}
        if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
            raise RunError(f"no adapter in {adapter} (the run has not saved one yet)")
        model = self._with_adapter(adapter)
        tuned = gen("tuned", tuned_msgs)
        with model.disable_adapter():
            base = gen("base", msgs)
        return {"ok": True, "base": base, "tuned": tuned}


def _sampling(req: dict) -> dict | None:
    """{"temperature", "top_p", "seed"} of a request that samples; None for greedy."""
    t = float(req.get("temperature") or 0.0)
    if t < 0 or not 0 < float(req.get("top_p") or 1.0) <= 1:
        raise RunError(f"temperature {t} / top_p {req.get('top_p')}: a temperature of 0 (greedy) or more, "
                       "a top_p above 0 and at most 1")
    if t == 0:
        return None
    return {"temperature": t, "top_p": float(req.get("top_p") or 1.0), "seed": int(req.get("seed") or 0)}


class _Streamer:
    """What model.generate calls with the prompt, then each new token: hands the decoded
    reply so far to `on_text`."""

    def __init__(self, tok, on_text):
        self.tok, self.on_text, self.ids, self.prompt_seen = tok, on_text, [], False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.ids += value.reshape(-1).tolist()
        self.on_text(self.tok.decode(self.ids, skip_special_tokens=True).strip())

    def end(self) -> None:
        pass


def _plain(messages: list[dict]) -> list[dict]:
    """Turns with string content (a chat template cannot render a list of parts)."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in c)
        if not isinstance(m.get("role"), str) or not isinstance(c, str):
            raise RunError(f"chat message {len(out) + 1}: needs a role and text content")
        out.append({"role": m["role"], "content": c})
    return out


def main() -> int:
    # Answers go to the real stdout; anything libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    chat = _Chat()
    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            result = chat.answer(req, send if req.get("stream") else None)
        except EdgetuneError as e:
            result = {"ok": False, "error": str(e)}
        except Exception as e:  # a bug: keep the worker alive, tell the user in one line
            import traceback

            traceback.print_exc()
            result = {"ok": False, "error": f"internal error: {type(e).__name__}: {reason_line(str(e))}"}
        out.write(json.dumps(result) + "\n")
        out.flush()
    return 0


# --------------------------------------------------------------------------- the client


class ChatSession:
    """The app's handle on one chat worker; safe to call from several UI threads."""

    def __init__(self, log_path: str | os.PathLike | None = None):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _ensure(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
            env = worker_env(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.generation.chat"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                         start_new_session=True)
        return self.proc

    def ask(self, model: dict, messages: list[dict], adapter: str = "", max_new_tokens: int = 128,
            timeout: float = 600, tuned_messages: list[dict] | None = None, system_prompt: str = "",
            **sampling) -> dict:
        """The final answer (the module's docstring); `sampling`: temperature, top_p, seed."""
        req = {"model": model, "adapter": adapter, "messages": messages, "max_new_tokens": max_new_tokens,
               "tuned_messages": tuned_messages, "system_prompt": system_prompt, **sampling}
        last = {}
        for last in self.stream(req, timeout, partial=False):
            pass
        return last

    def stream(self, req: dict, timeout: float = 600, partial: bool = True):
        """Yield each side's text so far as it grows ({"partial": side, "text"}), then the
        final answer (the module's docstring); one request at a time across threads."""
        with self.lock:
            try:
                yield from self._exchange(req, timeout, partial)
            except GeneratorExit:  # the reader left mid-answer: the rest would be read as the next answer's
                self.close()
                raise

    def _exchange(self, req: dict, timeout: float, partial: bool):
        proc = self._ensure()
        proc.stdin.write(json.dumps({**req, "stream": partial}) + "\n")
        proc.stdin.flush()
        deadline = time.time() + timeout
        fd, pending = proc.stdout.fileno(), b""  # read whole chunks: a streamed answer is many lines at once
        while time.time() < deadline:
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                message = json.loads(line)
                yield message
                if "partial" not in message:
                    return
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                pending += chunk
                continue
            if proc.poll() is not None:
                break
        self.close()
        yield {"ok": False, "error": "the chat worker stopped answering"
               + (f" (see {self.log_path})" if self.log_path else "")}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


if __name__ == "__main__":
    sys.exit(main())

"""Many requests for the base and its adapters answered together: continuous batching with
a LoRA adapter per row (what `edgetune serve` runs, engine/run/serve.py).

One thread, the decode loop, owns the model. Requests (`Job`s) wait in a queue; between two
decode steps the loop admits the waiting jobs that fit `max_rows`, prefills their prompts
as one left-padded batch and appends their rows to the running batch (the KV caches padded
on the left to one length); each step then decodes one token for every running row in one
forward, each row through its own adapter: engine/generation/multilora.batched_lora with
the loaded adapters' factors stacked, the base a slot of zeros. A finished row, or one whose
client left (`Job.cancelled`), leaves the batch at the next step and frees its place.
Adapters are loaded and removed on the loop's thread between steps (`add_adapter`,
`remove_adapter`), so requests in flight never see a half-loaded adapter; a removed one
stays in memory until its last row ends.

Sampling is per row: greedy at temperature 0, else the top-p nucleus then a Gumbel-max draw
from the row's own seeded generator, so a seeded request gets the same text whatever it is
batched with (up to the float rounding of batched matmuls, as in any batched server).

Trade-offs: every admission is one prefill forward the running rows wait for; the joined
cache is as long as the longest row plus the left padding of the shorter ones (leading
columns that no row needs any more are dropped); the adapters' stacks hold a second copy of
their factors (B scaled, ranks padded with zeros to the largest).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from edgetune.engine.core.errors import ModelError

from edgetune.engine.generation.decoding import cache_kw, inner_model, top_p_filter
from edgetune.engine.generation.multilora import batched_lora


class Busy(Exception):
    """The queue of waiting requests is full."""


@dataclass
class Job:
    """One request: `prompts` (token ids), each answered `n` times. `emit(event)` is called
    on the decode loop's thread with {"type": "text", "choice", "text"} (new text of a
    choice), {"type": "end", "choice", "finish_reason"}, then {"type": "done", "usage"}, or
    {"type": "error", "message"} instead of the rest. Choice i*n + j is prompt i's j-th."""

    adapter: str  # "" = the base, else an adapter's name as add_adapter got it
    prompts: list[list[int]]
    emit: Callable[[dict], None]
    n: int = 1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    cancelled: bool = False  # set by the caller: the rows leave at the next step
    open_rows: int = 0
    completion_tokens: int = 0


@dataclass
class _Row:
    job: Job
    choice: int
    slot: str  # the PEFT name of its adapter, "" for the base
    prompt_len: int
    ids: list[int] = field(default_factory=list)  # generated, without the end-of-sequence token
    sampled: int = 0
    sent: str = ""  # text emitted so far
    generator: torch.Generator | None = None


def _left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`t` with `n` zeros before it along `dim`."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def adapter_problem(path: str | Path) -> str | None:
    """Why an adapter folder cannot be served row by row (None: it can): batched rows apply
    plain LoRA factors of linear layers and nothing else."""
    try:
        c = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable adapter_config.json ({getattr(e, 'strerror', None) or e})"
    if c.get("peft_type", "LORA") != "LORA":
        return f"a {c.get('peft_type')} adapter (only LoRA is served)"
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                      ("trainable_token_indices", "trainable tokens"), ("lora_bias", "LoRA biases")):
        if c.get(key):
            return f"it uses {what}, which rows of a shared batch cannot apply"
    if c.get("bias", "none") != "none":
        return "it trains biases, which rows of a shared batch cannot apply"
    return None


class Batcher:
    """The decode loop over `model` (a base as engine/models/model.load_base gives it) and
    `tok`; at most `max_rows` rows decode together and `max_waiting` jobs wait."""

    def __init__(self, model, tok, max_rows: int = 16, max_waiting: int = 64):
        self.model, self.tok = model, tok
        self.max_rows, self.max_waiting = max_rows, max_waiting
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos
        self.device = next(model.parameters()).device
        self.context = int(getattr(inner_model(model).config, "max_position_embeddings", 0) or 2048)
        self.served: dict[str, str] = {}  # adapter name -> its PEFT name
        self.paths: dict[str, str] = {}  # PEFT name -> folder (every adapter in memory)
        self._names = (f"a{i}" for i in itertools.count())
        self.modules, self.stacks, self.slots = [], [], {"": 0}
        self.rows: list[_Row] = []
        self.cache = self.mask = self.pos = self.last = None
        self.waiting: collections.deque[Job] = collections.deque()
        self.calls: collections.deque[tuple[Callable, Future]] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.forwards = 0  # decode steps and prefills so far, and the rows they carried (bench/serve.py)
        self.row_steps = 0
        self.thread = threading.Thread(target=self._loop, name="edgetune-decode", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ outside the loop

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_waiting:
                raise Busy(f"{len(self.waiting)} requests are waiting already")
            self.waiting.append(job)
            self.cond.notify()

    def call(self, fn: Callable, *args):
        """fn(*args) on the loop's thread, between two steps; its result or its error."""
        future: Future = Future()
        with self.cond:
            self.calls.append((lambda: fn(*args), future))
            self.cond.notify()
        return future.result()

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Serve the LoRA adapter in folder `path` as `name` (replacing one of that name);
        a one-line ModelError when it cannot be."""
        self.call(self._add, name, str(path))

    def remove_adapter(self, name: str) -> None:
        self.call(self._remove, name)

    def adapters(self) -> dict[str, str]:
        """Adapter name -> folder, of those served now."""
        with self.cond:
            return {name: self.paths[peft] for name, peft in self.served.items()}

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(30)

    # ------------------------------------------------------------------ adapters (loop thread)

    def _add(self, name: str, path: str) -> None:
        from peft import PeftModel

        from edgetune.engine.models.adapter import check_adapter_fits

        problem = adapter_problem(path)
        if problem:
            raise ModelError(f"{path}: cannot serve this adapter: {problem}")
        check_adapter_fits(self.model, path)  # trained on another base: one line naming it
        peft = next(self._names)
        try:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=peft)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=peft)
        except Exception as e:  # PEFT raises many kinds for a folder it cannot read
            raise ModelError(f"{path}: cannot load this adapter ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
        self.model.eval()
        with self.cond:
            self.paths[peft] = path
            old = self.served.get(name)
            self.served[name] = peft
        if old is not None:
            self._drop_unused(old)
        self._restack()

    def _remove(self, name: str) -> None:
        with self.cond:
            peft = self.served.pop(name, None)
        if peft is not None:
            self._drop_unused(peft)

    def _drop_unused(self, peft: str) -> None:
        """Free an adapter nothing serves once no row uses it (the last one loaded stays in
        PEFT, unused: a PeftModel keeps at least one)."""
        if peft in self.served.values() or any(r.slot == peft for r in self.rows):
            return
        if len(self.paths) > 1:
            self.model.delete_adapter(peft)
            with self.cond:
                del self.paths[peft]
        self._restack()

    def _restack(self) -> None:
        """The LoRA layers in a fixed order and each one's factors of every adapter in memory
        stacked (slot 0: the base, zeros), B times the adapter's scaling."""
        from peft.tuners.lora import LoraLayer

        names = list(self.paths)
        self.slots = {"": 0, **{n: i + 1 for i, n in enumerate(names)}}
        modules, stacks = [], []
        for mname, m in inner_model(self.model).named_modules():
            if not isinstance(m, LoraLayer) or not any(n in m.lora_A for n in names):
                continue
            have = [n for n in names if n in m.lora_A]
            r = max(m.lora_A[n].weight.shape[0] for n in have)
            w = m.lora_A[have[0]].weight
            a = torch.zeros(len(names) + 1, r, m.in_features, dtype=w.dtype, device=w.device)
            b = torch.zeros(len(names) + 1, m.out_features, r, dtype=w.dtype, device=w.device)
            for n in have:
                k, rk = self.slots[n], m.lora_A[n].weight.shape[0]
                a[k, :rk] = m.lora_A[n].weight.detach()
                b[k, :, :rk] = m.lora_B[n].weight.detach() * m.scaling[n]
            modules.append((mname, m))
            stacks.append((a, b))
        self.modules, self.stacks = modules, stacks

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.calls or self.rows or self.waiting):
                    self.cond.wait()
                if self.stopping:
                    break
                calls = list(self.calls)
                self.calls.clear()
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            try:
                self._leave()
                self._admit()
                if self.rows:
                    self._step()
            except Exception as e:  # a failed forward: every request in flight gets the one line
                import traceback

                traceback.print_exc()
                why = "out of memory" if "out of memory" in str(e).lower() else f"{type(e).__name__}: {e}"
                for job in {id(r.job): r.job for r in self.rows}.values():
                    job.emit({"type": "error", "message": f"generation failed ({str(why)[:300]})"})
                self.rows, self.cache = [], None
        for job in [*{id(r.job): r.job for r in self.rows}.values(), *self.waiting]:
            job.emit({"type": "error", "message": "the server is shutting down"})

    def _forward(self, ids, mask, pos, cache, slots: list[str]) -> torch.Tensor:
        """Last-position logits [rows, vocab], each row through its adapter."""
        core = inner_model(self.model)
        rows = torch.tensor([self.slots[s] for s in slots])
        lora = batched_lora(self.modules, self.stacks, rows, adapter="", scaling=1.0) if self.modules \
            else contextlib.nullcontext()
        with lora, torch.no_grad():
            out = core(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                       **{cache_kw(core): cache})
        self.forwards += 1
        self.row_steps += ids.shape[0]
        return out.logits[:, -1, :]

    def _admit(self) -> None:
        """Prefill the waiting jobs that fit and join their rows to the batch."""
        new: list[_Row] = []
        with self.cond:
            while self.waiting:
                job = self.waiting[0]
                need = job.n * len(job.prompts)
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                if self.rows and not self._joinable():
                    break
                if new and len(self.rows) + len(new) + need > self.max_rows or \
                        not new and self.rows and len(self.rows) + need > self.max_rows:
                    break
                self.waiting.popleft()
                slot = self.served.get(job.adapter, "") if job.adapter else ""
                if job.adapter and not slot:
                    job.emit({"type": "error", "message": f"the model '{job.adapter}' is no longer served"})
                    continue
                job.open_rows = need
                for i, p in enumerate(job.prompts):
                    for j in range(job.n):
                        gen = None
                        if job.temperature > 0:
                            gen = torch.Generator(device=self.device)
                            seed = job.seed if job.seed is not None else int(torch.randint(0, 2**62, ()))
                            gen.manual_seed((seed + i * job.n + j) % 2**63)
                        new.append(_Row(job, i * job.n + j, slot, len(p), generator=gen))
        if not new:
            return
        try:
            self._prefill(new)
        except Exception:  # their jobs hear of it here; the loop tells the running ones
            for job in {id(r.job): r.job for r in new}.values():
                job.emit({"type": "error", "message": "generation failed (see the server's log)"})
            raise

    def _prefill(self, new: list[_Row]) -> None:
        from transformers import DynamicCache

        width = max(r.prompt_len for r in new)
        ids = torch.full((len(new), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for k, r in enumerate(new):
            ids[k, width - r.prompt_len:] = torch.tensor(r.job.prompts[r.choice // r.job.n])
            mask[k, width - r.prompt_len:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=inner_model(self.model).config)
        logits = self._forward(ids, mask, pos, cache, [r.slot for r in new])
        last = torch.tensor(self._pick(logits, new), device=self.device)
        nxt = torch.tensor([r.prompt_len for r in new], device=self.device)
        if not self.rows:
            self.cache, self.mask, self.pos, self.last = cache, mask, nxt, last
        else:
            size, width = self.mask.shape[1], mask.shape[1]
            full = max(size, width)
            for old, fresh in zip(self.cache.layers, cache.layers):
                old.keys = torch.cat([_left(old.keys, full - size, -2), _left(fresh.keys, full - width, -2)])
                old.values = torch.cat([_left(old.values, full - size, -2), _left(fresh.values, full - width, -2)])
            self.mask = torch.cat([_left(self.mask, full - size, 1), _left(mask, full - width, 1)])
            self.pos, self.last = torch.cat([self.pos, nxt]), torch.cat([self.last, last])
        self.rows += new
        self._took(new, last.tolist())

    def _joinable(self) -> bool:
        """Whether rows can join a running batch: every cache layer a plain growing one
        (a sliding-window layer drops old tokens; its rows wait for the batch to end)."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def _step(self) -> None:
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        logits = self._forward(self.last[:, None], mask, self.pos[:, None], self.cache, [r.slot for r in self.rows])
        self.mask, self.pos = mask, self.pos + 1
        toks = self._pick(logits, self.rows)
        self.last = torch.tensor(toks, device=self.device)
        self._took(self.rows, toks)

    def _pick(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Each row's next token: argmax of its logits at temperature 0, else a draw from
        its nucleus with its generator (engine/generation/decoding.py's Gumbel-max rule)."""
        out = logits.argmax(dim=-1)
        for i, r in enumerate(rows):
            if r.job.temperature > 0:
                scaled = logits[i : i + 1].float() / r.job.temperature
                if r.job.top_p < 1:
                    scaled = top_p_filter(scaled, r.job.top_p)
                p = torch.softmax(scaled, dim=-1)[0]
                out[i] = (p / torch.empty_like(p).exponential_(generator=r.generator)).argmax()
        return out.tolist()

    def _took(self, rows: list[_Row], toks: list[int]) -> None:
        """Each row's new token: its text so far out to its job, and the row's end when it
        met the end-of-sequence token, a stop string, max_tokens or the context's end."""
        for r, t in zip(rows, toks):
            if r.job.cancelled or r.sampled < 0:
                continue
            r.sampled += 1
            r.job.completion_tokens += 1
            if t == self.eos:
                self._end(r, "stop")
                continue
            r.ids.append(t)
            text = self.tok.decode(r.ids, skip_special_tokens=True)
            cuts = [text.find(s) for s in r.job.stop if s in text]
            if cuts:
                self._send(r, text[: min(cuts)])
                self._end(r, "stop")
            elif r.sampled >= r.job.max_tokens or r.prompt_len + r.sampled >= self.context:
                self._send(r, text)
                self._end(r, "length")
            else:
                hold = max((k for s in r.job.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
                safe = text[: len(text) - hold]
                self._send(r, safe.rstrip("\ufffd"))  # (a character whose bytes have not all come yet)

    def _send(self, r: _Row, text: str) -> None:
        if text.startswith(r.sent) and len(text) > len(r.sent):
            r.job.emit({"type": "text", "choice": r.choice, "text": text[len(r.sent):]})
            r.sent = text

    def _end(self, r: _Row, reason: str) -> None:
        r.sampled = -1  # ended: leaves the batch at the next step
        job = r.job
        job.emit({"type": "end", "choice": r.choice, "finish_reason": reason})
        job.open_rows -= 1
        if job.open_rows == 0:
            prompt = sum(len(p) for p in job.prompts)
            job.emit({"type": "done", "usage": {"prompt_tokens": prompt, "completion_tokens": job.completion_tokens,
                                                "total_tokens": prompt + job.completion_tokens}})

    def _leave(self) -> None:
        """Rows that ended or whose client left go; so do cache columns no row needs."""
        keep = [i for i, r in enumerate(self.rows) if r.sampled >= 0 and not r.job.cancelled]
        if len(keep) == len(self.rows):
            return
        gone = {r.slot for r in self.rows}
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = self.mask = self.pos = self.last = None
        else:
            idx = torch.tensor(keep, device=self.device)
            self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
            first = int((self.mask.sum(0) > 0).nonzero()[0])  # leading columns only padding
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]
        for slot in gone - {r.slot for r in self.rows} - {""}:
            if slot in self.paths:
                self._drop_unused(slot)

"""Shared fixtures: a tiny random-init Llama with the embedded model's tokenizer, so
engine tests run in seconds on a CPU; and the embedded SmolLM2 itself for tests that
must see a real model learn."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads TRITON_INTERPRET when a kernel is first decorated; any test module may import
# triton first (through torch or bitsandbytes), so the CPU suite sets it before all of them.
# EDGETUNE_TEST_GPU=1 runs the kernels compiled on a GPU instead.
if os.environ.get("EDGETUNE_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# What the user said yes to (engine/core/consent.py) is kept in a folder of the tests' own,
# never in the user's: subprocesses inherit it.
os.environ["EDGETUNE_STATE_DIR"] = tempfile.mkdtemp(prefix="edgetune-state-")


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from edgetune.engine.models.model import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A 2-layer Llama (hidden 64) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models.model import load_tokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = load_tokenizer(str(embedded_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# The slow tests that train SmolLM2 for minutes, in the order `bash dev.sh test-slow` starts
# them on its two processes. pytest-xdist gives each process two tests at the start (one to
# run, one waiting), so the first process takes the first two and the second the next two:
# the longest with the fourth longest, the second with the third; then the two shorter
# learning tests, and the short slow tests fill in beside whichever ends last. A test missing
# here runs after these, in the order collected: only the balance depends on this list.
SLOW_ORDER = [
    "tests/test_fgrpo.py::test_quickstart_raises_held_out_success",
    "tests/test_essa_quickstart.py::test_essa_quickstart_raises_held_out_reward",
    "tests/test_sft.py::test_quickstart_learns_and_exports",
    "tests/test_dpo.py::test_quickstart_learns_to_prefer_the_right_sum",
    "tests/bench/test_learning.py::test_essa_with_the_gold_fitness_improves_on_its_warm_start",
    "tests/bench/test_learning.py::test_fgrpo_learns_a_task_the_presets_never_use",
    "tests/bench/test_learning.py::test_sft_learns_a_task_the_presets_never_use",
]


def pytest_collection_modifyitems(items):
    """The browser test first, then the learning tests in SLOW_ORDER: `bash dev.sh test` and
    `test-slow` run on two processes, and the longest tests, started first, run beside the
    others instead of after them."""
    rank = {nodeid: i for i, nodeid in enumerate(SLOW_ORDER)}
    items.sort(key=lambda item: (item.get_closest_marker("browser") is None, rank.get(item.nodeid, len(rank))))

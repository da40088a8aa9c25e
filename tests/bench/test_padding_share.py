"""bench/padding_share.py: its counts on hand-made batches with a known padding share."""

import bench_script
import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    return bench_script.load("padding_share")


def test_count_of_a_right_and_left_padded_batch(bench):
    # F-GRPO's shape: a left-padded prompt then a completion padded after its EOS; a row of
    # padding only (counted as right padding). Padding 2 + 0 + 4 + 6 of 24 slots.
    mask = torch.tensor([[0, 1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1, 1],
                         [0, 0, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 0]])
    labels = torch.tensor([[-100, -100, -100, 7, 8, -100],
                           [-100, 5, 6, 7, 8, 9],
                           [-100, -100, -100, 4, -100, -100],
                           [-100] * 6])
    c = bench.count(mask, labels)
    assert c == {"batches": 1, "rows": 4, "slots": 24, "real": 12, "padding": 12, "left": 3, "right": 9,
                 "targets": 8}
    assert bench.total([c])["padding_share"] == 0.5


def test_total_adds_batches_and_keeps_the_extremes(bench):
    a = bench.count(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))  # 2 of 8 padding
    b = bench.count(torch.tensor([[1, 1, 1, 1, 1, 1]]))  # none of 6
    t = bench.total([a, b])
    assert (t["batches"], t["rows"], t["slots"], t["real"], t["padding"]) == (2, 3, 14, 12, 2)
    assert t["padding_share"] == pytest.approx(2 / 14)
    assert (t["padding_share_min"], t["padding_share_max"]) == (0.0, 0.25)
    assert "targets" not in t  # no labels were given


def test_the_engines_collate_paths_count_as_their_rows(bench):
    from edgetune.engine.data.packing import collate_packed
    from edgetune.engine.data.sft import SFTExample, collate

    rows = [SFTExample([1, 2, 3, 4, 5], [-100, -100, 3, 4, 5]), SFTExample([1, 2], [-100, 2])]
    batch = collate(rows, 0)
    padded = bench.count(batch["attention_mask"], batch["labels"])
    assert (padded["slots"], padded["real"], padded["padding"], padded["right"], padded["targets"]) == (10, 7, 3, 3, 4)
    packed = collate_packed(rows)
    c = bench.count(packed["attention_mask"], packed["labels"])
    assert (c["slots"], c["padding"], c["targets"]) == (7, 0, 4)  # packing keeps every target, no padding


@pytest.mark.slow
def test_tiny_run_writes_the_report(bench, tmp_path):
    r = bench.main(["--tiny", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    m = r["methods"]
    assert m["sft_packed"]["padding"] == 0 and m["sft_packed"]["real"] == m["sft_padded"]["real"]
    assert m["dpo"]["rows"] == 2 * 8 * 4  # chosen and rejected rows of the preset's 8 pairs, 4 steps
    # the update holds the kept rows' prompt and completion tokens (the bench checks each batch)
    assert m["fgrpo"]["targets"] > 0 and m["fgrpo"]["rows"] == 32 - m["fgrpo_rollouts"]["dropped"]
    assert "| F-GRPO update" in (tmp_path / "out" / "padding_share.md").read_text()

"""Each metric of a run in words, the same in `edgetune runs`, the CLI's run lines and the
app's Runs table; docs/methods.md says what each one measures.

A key ending in `_start` is the held-out figure before training ("before"), `_end` after
it, `_last` the latest evaluation's. DPO's two shares of pairs are easy to confuse, so
they are named for what they count:

- reward accuracy (`accuracy`, `eval_accuracy`): the share of pairs whose chosen reply's
  implicit reward (β times its log-probability gain over the reference; SimPO / ORPO: β
  times its mean log-probability) is above the rejected one's. With a reference it is 0
  before the first update, where every reward is 0 (ties do not count).
- chosen likelier (`eval_prefers_chosen`): the share of pairs whose chosen reply the
  model itself gives the higher log-probability (summed over the reply's tokens): at the
  start, the base's own preference.
"""

from __future__ import annotations

WORDS = {
    "accuracy": "reward accuracy",
    "eval_accuracy": "eval reward accuracy",
    "margin": "reward margin",
    "eval_margin": "eval reward margin",
    "eval_prefers_chosen": "eval chosen likelier",
    "logps_chosen": "log-prob chosen",
    "logps_rejected": "log-prob rejected",
}

ENDINGS = (("_start", " before"), ("_end", " after"), ("_last", " (latest eval)"))


def metric_words(key: str) -> str:
    """A metric's key in words: eval_loss_start -> 'eval loss before', success_rate_end ->
    'success rate after', eval_accuracy -> 'eval reward accuracy'."""
    end = ""
    for suffix, words in ENDINGS:
        if key.endswith(suffix):
            key, end = key[: -len(suffix)], words
            break
    return WORDS.get(key, key.replace("_", " ")) + end


def metrics_text(metrics: dict) -> str:
    """A run's metrics in one line: 'eval loss before 2.31, eval loss 1.87, loss 1.52'."""
    return ", ".join(f"{metric_words(k)} {v:.4g}" if isinstance(v, float) else f"{metric_words(k)} {v}"
                     for k, v in metrics.items() if not isinstance(v, (dict, list)))

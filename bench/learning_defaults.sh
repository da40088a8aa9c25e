#!/usr/bin/env bash
# The measurements that decide the learning presets' defaults, as four bench/learning.py runs
# side by side (each 135M run is host-bound: one process per core keeps one GPU busy enough).
#
#   cap64    base, F-GRPO (the preset's settings), GRPO (gamma 0) with a 64-token completion cap, trained and
#            evaluated at 64 (the quick start's 32 cut 94-100% of count_bits / gcd rollouts)
#   hint64   base and F-GRPO at 64 tokens with a format hint as the system prompt (HINT below),
#            in training and evaluation
#   essa_rg  ESSA at the preset's budget with essa.fitness = reward+gold_logprob (the reward,
#            ties broken by the gold answer's likelihood); evaluated at the bench's 32 tokens
#   sft160   SFT for 4x the quick start's steps on gcd and count_bits: the ceiling of the
#            answer-only demonstrations on the two tasks where 40 steps gave +8 and +16
#
# All on the 4 benchmark tasks plus the kept-aside one (not sft160), the same held-out
# questions per task as every other learning run (same seed, same train/eval sizes), fp32
# compute as in the earlier H200 tables. At --deadline-s the runs still going are stopped and
# what finished is reported. Writes OUT/<group>/learning.{json,md,png} and OUT/summary.md.
#
#   bash bench/learning_defaults.sh OUT                 # GPU: ~32 processes, about 7.5 minutes
#   bash bench/learning_defaults.sh OUT --tiny          # CPU check: one task, tiny budgets
# DEADLINE_S (default 400) is each group's --deadline-s; J_CAP, J_HINT, J_ESSA, J_SFT (default 15,
# 10, 5, 2: everything at once, ~32 processes, the base evaluations done in the first minutes)
# are the groups' --jobs. ESSA_REWARD=1 adds a group: ESSA with the reward fitness in the same run.
set -uo pipefail
out=${1:?usage: learning_defaults.sh OUT [--tiny]}
tiny=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${WORK:-$(mktemp -d /tmp/learning-defaults-XXXXXX)}
# YAML double quotes: the value holds ": ", which a plain YAML scalar would read as a mapping.
HINT='"Give only the final answer, on one line: Answer: <number>"'
fp32=(--set model.dtype=fp32 --eval-set model.dtype=fp32)
if [ "$tiny" = "--tiny" ]; then
  tasks=gcd; sft_tasks=gcd; cap=8; deadline=${DEADLINE_S:-1500}
  budget=(--train-items 20 --eval-prompts 3 --eval-k 1 --fgrpo-steps 1 --sft-steps 2 --warm-start-steps 1
          --essa-generations 1 --set fgrpo.num_generations=2 --set fgrpo.prompts_per_step=2
          --set essa.population=3 --set essa.prompts_per_generation=2)
  sft_steps=3; j_cap=1; j_hint=1; j_essa=1; j_sft=1
else
  tasks=chain_sum,basic_arithmetic,gcd,count_bits,products; sft_tasks=gcd,count_bits; cap=64
  deadline=${DEADLINE_S:-400}; budget=(); sft_steps=160
  j_cap=${J_CAP:-15}; j_hint=${J_HINT:-10}; j_essa=${J_ESSA:-5}; j_sft=${J_SFT:-2}
fi
L=("$py" "$here/learning.py" "${fp32[@]}" "${budget[@]}" --deadline-s "$deadline")
echo "learning_defaults: work folder $work, reports in $out"

"${L[@]}" --tasks "$tasks" --methods base,fgrpo,grpo --jobs $j_cap --eval-tokens $cap \
  --set fgrpo.max_new_tokens=$cap --out "$out/cap$cap" --work "$work/cap" > "$out/cap$cap.log" 2>&1 &
"${L[@]}" --tasks "$tasks" --methods base,fgrpo --jobs $j_hint --eval-tokens $cap \
  --set fgrpo.max_new_tokens=$cap --set "data.system_prompt=$HINT" --eval-set "data.system_prompt=$HINT" \
  --out "$out/hint$cap" --work "$work/hint" > "$out/hint$cap.log" 2>&1 &
"${L[@]}" --tasks "$tasks" --methods essa --jobs $j_essa --set essa.fitness=reward+gold_logprob \
  --out "$out/essa_rg" --work "$work/essa" > "$out/essa_rg.log" 2>&1 &
if [ "${ESSA_REWARD:-0}" = 1 ]; then  # the reward fitness again, beside the new one (5 more processes)
  "${L[@]}" --tasks "$tasks" --methods essa --jobs $j_essa --set essa.fitness=reward \
    --out "$out/essa_r" --work "$work/essa_r" > "$out/essa_r.log" 2>&1 &
fi
"${L[@]}" --tasks "$sft_tasks" --methods sft --jobs $j_sft --sft-steps $sft_steps \
  --out "$out/sft$sft_steps" --work "$work/sft" > "$out/sft$sft_steps.log" 2>&1 &
rc=0
for p in $(jobs -p); do wait "$p" || rc=1; done
[ $rc = 0 ] || echo "learning_defaults: a group exited non-zero: see $out/*.log" >&2
# Every run's log and events (not its adapters) beside the reports: the work folder may not come back.
mkdir -p "$out/logs" && (cd "$work" && find . \( -name '*.log' -o -name events.jsonl \) -size -2048k | tar -cf - -T - | tar -xf - -C "$out/logs")

# One table: these groups beside the same methods at the presets' own settings (the earlier
# H200 run: same seed, data, held-out questions and evaluation; 32-token cap; reward fitness).
"$py" - "$out" "$cap" "$sft_steps" "$here/results/2026-12-01-h200/learning/learning.json" <<'EOF'
import json, sys
from pathlib import Path

out, cap, sft_steps, ref = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
def load(f):
    return {t["task"]: t["methods"] for t in json.loads(f.read_text())["tasks"]} if f.is_file() else {}

g = {"cap": load(out / f"cap{cap}" / "learning.json"), "hint": load(out / f"hint{cap}" / "learning.json"),
     "essa": load(out / "essa_rg" / "learning.json"), "sft": load(out / f"sft{sft_steps}" / "learning.json"),
     "essa_r": load(out / "essa_r" / "learning.json"), "ref": load(ref)}
k = None
for f in out.glob("*/learning.json"):
    k = json.loads(f.read_text())["args"]["eval_k"]
def cell(group, task, method, passk=True):
    m = g[group].get(task, {}).get(method)
    if m is None:
        return "not run"
    if "success_rate" not in m:
        return "failed"
    s = f"{100 * m['success_rate']:.0f}%"
    if passk and f"pass@{k}" in m:
        s += f" ({100 * m[f'pass@{k}']:.0f}%)"
    return s
cols = [("ref", "base", "base @32"), ("ref", "fgrpo", "F-GRPO @32"), ("ref", "grpo", "GRPO @32"),
        ("cap", "base", f"base @{cap}"), ("cap", "fgrpo", f"F-GRPO @{cap}"), ("cap", "grpo", f"GRPO @{cap}"),
        ("hint", "base", f"base @{cap}+hint"), ("hint", "fgrpo", f"F-GRPO @{cap}+hint"),
        ("ref", "essa_warm_start", "ESSA warm start @32"), ("ref", "essa", "ESSA reward"),
        *([("essa_r", "essa", "ESSA reward (again)")] if g["essa_r"] else []),
        ("essa", "essa_warm_start", "ESSA warm start"), ("essa", "essa", "ESSA reward+gold_logprob"),
        ("ref", "sft", "SFT 40 steps"), ("sft", "sft", f"SFT {sft_steps} steps")]
tasks = list(dict.fromkeys(t for name, grp in g.items() if name != "ref" for t in grp))
lines = [f"Held-out greedy success (pass@{k} in brackets), per group of bench/learning_defaults.sh", "",
         "| task | " + " | ".join(c[2] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
for t in tasks:
    lines.append(f"| {t} | " + " | ".join(cell(a, t, b, b != "sft") for a, b, _ in cols) + " |")
lines += ["", f"@N: completion cap of training and evaluation; '@32' and 'ESSA reward', 'SFT 40 steps' columns: {ref}"]
text = "\n".join(lines) + "\n"
(out / "summary.md").write_text(text)
print(text)
EOF
for f in "$out"/*/learning.md; do echo; echo "== $f"; sed -n '/^| task/,$p' "$f"; done
exit $rc

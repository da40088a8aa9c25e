#!/usr/bin/env bash
# How far F-GRPO, GRPO and ESSA get on the learning benchmark's tasks with far more budget than
# the quick-start presets give them: the measured ceilings behind the targets a preset misses.
#
#   rl_long   F-GRPO (the preset's settings; gamma 1 unnormalised when measured) and GRPO (gamma 0) for
#             RL_STEPS steps (default 64, the preset: 32),
#             the held-out split evaluated every RL_EVERY steps (default 8) while they train
#   essa_big  ESSA with a population of 24 scored on 64 prompts a generation for ESSA_GENS
#             generations (default 16): 16x the preset's 12 x 16 x 8 completions, the held-out split
#             evaluated every 4 generations
#
# Both on the 4 benchmark tasks (ESSA also on the kept-aside one), the same held-out questions
# per task as every other learning run (same seed, same train/eval sizes), fp32 compute as in the
# earlier H200 tables. At --deadline-s (DEADLINE_S, default 480) the runs still going are stopped:
# their held-out points so far stay in OUT/logs (events.jsonl). Writes OUT/<group>/learning.*.
#
#   bash bench/learning_ceilings.sh OUT            # GPU: 13 processes side by side, about 8 minutes
#   bash bench/learning_ceilings.sh OUT --tiny     # CPU check: one task, tiny budgets
# SEED (default 0) picks the split, as bench/learning.py --seed.
set -uo pipefail
out=${1:?usage: learning_ceilings.sh OUT [--tiny]}
tiny=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/learning_groups.sh"
py=${PYTHON:-python3}
for g in rl_long essa_big rl_long.log essa_big.log logs; do
  if [ -e "$out/$g" ]; then echo "learning_ceilings: $out/$g exists: choose another OUT (nothing was written)" >&2; exit 2; fi
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=${WORK:-$(mktemp -d /tmp/learning-ceilings-XXXXXX)}
fp32=(--set model.dtype=fp32 --eval-set model.dtype=fp32)
if [ "$tiny" = "--tiny" ]; then
  rl_tasks=gcd; essa_tasks=gcd; deadline=${DEADLINE_S:-1500}
  budget=(--train-items 20 --eval-prompts 3 --eval-k 1 --warm-start-steps 1
          --set fgrpo.num_generations=2 --set fgrpo.prompts_per_step=2 --set essa.prompts_per_generation=2)
  rl=(--fgrpo-steps 2 --curve-every 1); essa=(--essa-generations 2 --curve-every 1 --set essa.population=3)
  j_rl=1; j_essa=1
else
  rl_tasks=chain_sum,basic_arithmetic,gcd,count_bits; essa_tasks=$rl_tasks,products
  deadline=${DEADLINE_S:-480}; budget=()
  rl=(--fgrpo-steps "${RL_STEPS:-64}" --curve-every "${RL_EVERY:-8}")
  essa=(--essa-generations "${ESSA_GENS:-16}" --curve-every 4 --set essa.population=24
        --set essa.prompts_per_generation=64)
  j_rl=8; j_essa=5
fi
L=("$py" "$here/learning.py" "${fp32[@]}" "${budget[@]}" --seed "${SEED:-0}" --deadline-s "$deadline")
echo "learning_ceilings: work folder $work, reports in $out"

"${L[@]}" --tasks "$rl_tasks" --methods fgrpo,grpo --jobs $j_rl "${rl[@]}" \
  --out "$out/rl_long" --work "$work/rl" > "$out/rl_long.log" 2>&1 &
"${L[@]}" --tasks "$essa_tasks" --methods essa --jobs $j_essa "${essa[@]}" \
  --out "$out/essa_big" --work "$work/essa" > "$out/essa_big.log" 2>&1 &
finish_groups learning_ceilings "$out" "$work"

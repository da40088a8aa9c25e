#!/usr/bin/env bash
# Settings beyond the presets, measured on the learning benchmark's tasks (one GPU, many runs side
# by side), to see whether a target a preset misses moves with them:
#
#   fgrpo_gamma2   F-GRPO with the paper's unnormalised focal weights at gamma 2 (fgrpo.focal_normalize
#                  off) at the preset's 32 steps, seeds SEEDS (default 0 1 2 3): the same splits as
#                  every other learning run, so pool it with learning_seeds.py beside the gamma 1 and
#                  gamma 0 runs of those seeds
#   fgrpo_norm     F-GRPO with its focal weights normalised to mean 1 over each step's groups with an
#                  advantage (fgrpo.focal_normalize), gamma 1, the preset's 32 steps, seeds SEEDS
#                  (default 0 1 2 3): pool beside the gamma 1 and gamma 0 runs of those seeds
#   fgrpo_norm_gamma2  the same at gamma 2 (what the settings' defaults became)
#   essa_space     ESSA's search space widened, seed 0, with a GPU's budget (population 32 scored on
#                  32 prompts a generation for 16 generations; held-out every 4 generations):
#                    all_values   every singular value of the preset's warm start (alpha 1.0: 1,920
#                                 dimensions instead of 480)
#                    all_linear   a rank-16 warm start on every linear layer, the top quarter of its
#                                 singular values searched (alpha 0.25)
#   essa_linear    that all_linear space at the quick start's budget (population 12 x 16 prompts x 8
#                  generations, held-out every 2), seeds SEEDS (default 0 1 2 3)
#   essa_linear_big  that all_linear space at essa_space's budget, seeds SEEDS (default 1 2; seed 0 is
#                  essa_space's all_linear). Not beside essa_linear in one call: each ESSA run sizes its
#                  batch of candidates from the GPU memory free when it starts, and 35 runs started
#                  together ran out of it
#   essa_linear_3x that all_linear space at 3x the quick start's evaluations (population 16 x 24
#                  prompts x 12 generations; held-out every 4), seeds SEEDS (default 0 1 2 3). On a 2-core
#                  CPU a generation of this space takes 80-120 s (17-25 minutes a run)
#   essa_relative  the quick start's space and budget with relative steps (essa.step relative: each
#                  singular value moves by a share of itself) at sigma0 0.2 and 0.4, seeds SEEDS
#                  (default 0 1 2 3)
#   essa_relative_linear  the all_linear space at the quick start's budget with relative steps at sigma0
#                  0.4, and the quick start as shipped beside it, seeds SEEDS (default 0 1 2 3)
#
# fp32 compute as in the earlier H200 tables. At DEADLINE_S (default 470) the runs still going are
# stopped; their held-out points so far stay in OUT/logs (events.jsonl). Writes OUT/<group>/...
#
#   bash bench/learning_search.sh OUT fgrpo_gamma2     # GPU: 20 runs side by side, about 6 minutes
#   bash bench/learning_search.sh OUT fgrpo_norm       # GPU: 20 runs side by side, about 6 minutes
#   bash bench/learning_search.sh OUT essa_space       # GPU: 10 runs side by side, about 4 minutes
#   bash bench/learning_search.sh OUT essa_linear      # GPU: 20 runs side by side (4.7 min a run beside 15 more)
#   bash bench/learning_search.sh OUT essa_linear_big  # GPU: 10 runs side by side, about 4 minutes
#   SEEDS="0 1" bash bench/learning_search.sh OUT essa_linear_3x  # GPU: 10 runs side by side
#   bash bench/learning_search.sh OUT essa_relative    # GPU: 40 runs side by side (8 generations in 7 min)
#   bash bench/learning_search.sh OUT essa_relative_linear  # GPU: 40 runs side by side
#   bash bench/learning_search.sh OUT essa_space --tiny   # CPU check: one task, tiny budgets
set -uo pipefail
out=${1:?usage: learning_search.sh OUT fgrpo_gamma2|fgrpo_norm|fgrpo_norm_gamma2|essa_space|essa_linear|essa_linear_big|essa_linear_3x|essa_relative|essa_relative_linear [--tiny]}
part=${2:?usage: learning_search.sh OUT fgrpo_gamma2|fgrpo_norm|fgrpo_norm_gamma2|essa_space|essa_linear|essa_linear_big|essa_linear_3x|essa_relative|essa_relative_linear [--tiny]}
tiny=${3:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/learning_groups.sh"
py=${PYTHON:-python3}
case "$part" in
  fgrpo_gamma2) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("seed$s"); done ;;
  fgrpo_norm) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("norm_seed$s"); done ;;
  fgrpo_norm_gamma2) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("norm2_seed$s"); done ;;
  essa_space) groups=(all_values all_linear) ;;
  essa_linear) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("preset_seed$s"); done ;;
  essa_linear_big) groups=(); for s in ${SEEDS:-1 2}; do groups+=("big_seed$s"); done ;;
  essa_linear_3x) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("x3_seed$s"); done ;;
  essa_relative) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("rel02_seed$s" "rel04_seed$s"); done ;;
  essa_relative_linear) groups=(); for s in ${SEEDS:-0 1 2 3}; do groups+=("rel04_linear_seed$s" "shipped_seed$s"); done ;;
  *) echo "learning_search: unknown part '$part' (fgrpo_gamma2, fgrpo_norm, fgrpo_norm_gamma2, essa_space, essa_linear, essa_linear_big, essa_linear_3x, essa_relative or essa_relative_linear)" >&2
     exit 2 ;;
esac
for g in "${groups[@]}" logs; do
  for p in "$out/$part/$g" "$out/$part/$g.log"; do
    if [ -e "$p" ]; then echo "learning_search: $p exists: choose another OUT (nothing was written)" >&2; exit 2; fi
  done
done
mkdir -p "$out/$part"
out=$(cd "$out/$part" && pwd)
work=${WORK:-$(mktemp -d /tmp/learning-search-XXXXXX)}
fp32=(--set model.dtype=fp32 --eval-set model.dtype=fp32)
tasks=chain_sum,basic_arithmetic,gcd,count_bits,products; deadline=${DEADLINE_S:-470}; budget=()
rl=(); essa=(--essa-generations 16 --curve-every 4 --set essa.population=32 --set essa.prompts_per_generation=32)
essa_preset=(--curve-every 2)
essa_3x=(--essa-generations 12 --curve-every 4 --set essa.population=16 --set essa.prompts_per_generation=24)
linear=(--set lora.target_modules=all-linear --set lora.r=16 --set lora.alpha=32 --set essa.alpha=0.25)
jobs=5
if [ "$tiny" = "--tiny" ]; then
  tasks=gcd; deadline=${DEADLINE_S:-1500}; jobs=1
  budget=(--train-items 20 --eval-prompts 3 --eval-k 1 --warm-start-steps 1
          --set fgrpo.num_generations=2 --set fgrpo.prompts_per_step=2 --set essa.prompts_per_generation=2)
  rl=(--fgrpo-steps 2); essa=(--essa-generations 2 --curve-every 1 --set essa.population=3)
  essa_preset=("${essa[@]}"); essa_3x=("${essa[@]}")
fi
L=("$py" "$here/learning.py" "${fp32[@]}" "${budget[@]}" --tasks "$tasks" --jobs $jobs --deadline-s "$deadline")
echo "learning_search: work folder $work, reports in $out"

for g in "${groups[@]}"; do
  case "$g" in
    seed*) args=(--methods fgrpo "${rl[@]}" --set fgrpo.gamma=2 --set fgrpo.focal_normalize=false
                 --seed "${g#seed}") ;;
    norm_seed*) args=(--methods fgrpo "${rl[@]}" --set fgrpo.focal_normalize=true --set fgrpo.gamma=1
                      --seed "${g#norm_seed}") ;;
    norm2_seed*) args=(--methods fgrpo "${rl[@]}" --set fgrpo.focal_normalize=true --set fgrpo.gamma=2
                       --seed "${g#norm2_seed}") ;;
    all_values) args=(--methods essa "${essa[@]}" --set essa.alpha=1.0 --seed 0) ;;
    all_linear) args=(--methods essa "${essa[@]}" "${linear[@]}" --seed 0) ;;
    preset_seed*) args=(--methods essa "${essa_preset[@]}" "${linear[@]}" --seed "${g#preset_seed}") ;;
    big_seed*) args=(--methods essa "${essa[@]}" "${linear[@]}" --seed "${g#big_seed}") ;;
    x3_seed*) args=(--methods essa "${essa_3x[@]}" "${linear[@]}" --seed "${g#x3_seed}") ;;
    rel02_seed*) args=(--methods essa "${essa_preset[@]}" --set essa.step=relative --set essa.sigma0=0.2
                       --seed "${g#rel02_seed}") ;;
    rel04_linear_seed*) args=(--methods essa "${essa_preset[@]}" "${linear[@]}" --set essa.step=relative
                              --set essa.sigma0=0.4 --seed "${g#rel04_linear_seed}") ;;
    shipped_seed*) args=(--methods essa "${essa_preset[@]}" --seed "${g#shipped_seed}") ;;
    rel04_seed*) args=(--methods essa "${essa_preset[@]}" --set essa.step=relative --set essa.sigma0=0.4
                       --seed "${g#rel04_seed}") ;;
  esac
  "${L[@]}" "${args[@]}" --out "$out/$g" --work "$work/$g" > "$out/$g.log" 2>&1 &
done
finish_groups learning_search "$out" "$work"

#!/bin/bash
# usage: WORKTREE=DIR run.sh ROUNDS [PRESET]: zero2 one unit, zero2 two units, DeepSpeed stage 2, taking turns
cd "${WORKTREE:?a worktree of c563186 with two-units.patch applied}"
R=$1; PRESET=${2:-vit_tiny_patch16}
CFG=results/ladder-vit_tiny-cpu-zen5-grad-reduce/ladder-config.yaml
BASE="model.preset=$PRESET train.batch_size=16 data.synthetic_samples=384 log.progress=false train.threads=1 model.layout=batch_first model.attention=sdpa optim.impl=auto model.pool=gap precision.mode=amp_o2 precision.dtype=bf16"
run() { PYTHONPATH="$WORKTREE" python -m torch.distributed.run --standalone --nproc-per-node=2 -m vitrain bench run $CFG $BASE "$@" --steps 5 --warmup 2 2>&1 | grep -E "images/s" | tail -1; }
for r in $(seq $R); do
  echo "round $r"
  echo -n "model  : "; run parallel.strategy=zero2 parallel.wrap=model
  echo -n "halves : "; HALVES=1 run parallel.strategy=zero2 parallel.wrap=block
  echo -n "ds2    : "; run parallel.strategy=zero2 train.engine=deepspeed parallel.offload=none
done

#!/bin/bash
# One ViT-S/16 step (224 px, batch 64, amp_o2 bf16, manual attention, flat AdamW; 3 warm-up + 5 timed steps), six
# rounds, each round with huge pages asked for (the first argument, a VAR=VALUE that must be in the environment
# before torch is imported) and without, one process at a time. Writes DIR/{thp,plain}-ROUND.json.
#   bash results/huge-pages-zen5/step.sh GLIBC_TUNABLES=glibc.malloc.hugetlb=1 results/huge-pages-zen5/glibc
#   bash results/huge-pages-zen5/step.sh THP_MEM_ALLOC_ENABLE=1 results/huge-pages-zen5/torch
set -e
setting=$1 out=$2
mkdir -p "$out"
ARGS=(model.preset=vit_small_patch16 model.image_size=224 model.in_chans=3 model.num_classes=1000
  data.source=synthetic 'data.mean=[0.5,0.5,0.5]' 'data.std=[0.5,0.5,0.5]' train.batch_size=64 log.progress=false
  model.attention=manual optim.impl=flat precision.mode=amp_o2 --steps 5 --warmup 3)
for r in 1 2 3 4 5 6; do
  env "$setting" vitrain bench run "${ARGS[@]}" --json "$out/thp-$r.json" | grep images/s | sed "s/^/thp $r /"
  vitrain bench run "${ARGS[@]}" --json "$out/plain-$r.json" | grep images/s | sed "s/^/plain $r /"
done

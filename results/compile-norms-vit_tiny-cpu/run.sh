#!/usr/bin/env bash
# ViT-Ti/16 b64 at 224 px, amp_o2 + manual attention: precision.compile_norms false and true taking turns, 4 rounds.
cd "$(dirname "$0")/../.." || exit 1
for r in 0 1 2 3; do
  for v in false true; do
    vitrain bench run model.preset=vit_tiny_patch16 model.image_size=224 model.in_chans=3 model.num_classes=1000 \
      data.source=synthetic 'data.mean=[0.5,0.5,0.5]' 'data.std=[0.5,0.5,0.5]' train.batch_size=64 log.progress=false \
      precision.mode=amp_o2 model.attention=manual precision.compile_norms=$v --steps 6 --warmup 3 \
      --json "results/compile-norms-vit_tiny-cpu/ti_${r}_$v.json"
  done
done

#!/bin/bash
for r in 1 2 3; do for w in wt wt-chunk; do
  rm -rf pp-$w-$r
  PYTHONPATH="${ROOT:-/work/exp}/$w" python -m vitrain bench run model.preset=vit_small_patch16 model.image_size=224 model.in_chans=3 model.num_classes=1000 data.source=synthetic data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5] train.batch_size=64 log.progress=false model.attention=manual optim.impl=flat precision.mode=amp_o2 --steps 2 --warmup 2 --profile pp-$w-$r 2>&1 | grep "^images/s" | sed "s/^/$r $w /"
  python3 - pp-$w-$r <<'PY'
import json, sys, collections
t=json.load(open(sys.argv[1]+"/trace.json")); c=collections.Counter()
for e in t["traceEvents"]:
    if e.get("ph")=="X" and e["name"] in ("_ManualAttention","_ManualAttentionBackward","aten::mm","mkldnn::_linear_pointwise"): c[e["name"]]+=e["dur"]/1000
att=c["_ManualAttention"]+c["_ManualAttentionBackward"]; gemm=c["aten::mm"]+c["mkldnn::_linear_pointwise"]
print("   attention %.1f ms  (fwd %.1f bwd %.1f)  linear GEMMs %.1f ms  attention/GEMMs %.4f" % (att, c["_ManualAttention"], c["_ManualAttentionBackward"], gemm, att/gemm))
PY
done; done

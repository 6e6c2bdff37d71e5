"""Both ranks' collective and FSDP2 events of one profiled step, in time order (ms from the trace's first event).

python timeline.py DIR... (each DIR holds rank0/trace.json and rank1/trace.json from `vitrain bench run --profile`)
"""

import json
import sys

KEYS = ("all_gather", "allgather", "all_reduce", "allreduce", "FSDP::", "wait", "Optimizer", "step", "gloo")
KEYS += ("broadcast", "reduce_scatter", "DeepSpeed", "ProfilerStep")
KEYS += ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",)

for run in sys.argv[1:]:
    print("==", run)
    for rank in (0, 1):
        with open(f"{run}/rank{rank}/trace.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        start = min(e["ts"] for e in events)
        chosen = [e for e in events if any(k.lower() in e["name"].lower() for k in KEYS) and e["dur"] > 300]
        for e in sorted(chosen, key=lambda e: e["ts"])[:40]:
            at, took = (e["ts"] - start) / 1000, e["dur"] / 1000
            print(f"  r{rank} {at:8.1f} +{took:7.1f}  {e['name'][:90]}  tid={e['tid']}")

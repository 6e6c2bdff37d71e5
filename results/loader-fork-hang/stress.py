"""Many epochs of tests/test_preemption.py's SIGTERM test's run, on two ranks: shards, one loader worker per rank,
an async checkpoint and an evaluation every epoch (each epoch's loaders start their workers while the ranks' other
threads run). A run over 120 s is taken for hung: every process of it is dumped with py-spy (pip install py-spy).

    python results/loader-fork-hang/stress.py 40 > after.log
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.data_helpers import TREE_MODEL, write_shards  # noqa: E402
from tests.distributed_helpers import gpu_free_env  # noqa: E402
from tests.test_preemption import RUNNER, TINY  # noqa: E402

for i in range(int(sys.argv[1])):
    tmp = Path(tempfile.mkdtemp())
    write_shards(tmp / "shards", [16, 16, 16, 16])
    args = [
        *TINY, *TREE_MODEL, "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", "data.source=shards",
        f"data.root={tmp / 'shards'}", "data.loader_workers=1", "data.shuffle_buffer=6", "data.hflip=0.5",
        "train.batch_size=4", "train.epochs=30", "train.threads=1", "parallel.strategy=ddp",
        "train.checkpoint_async=true", f"log.out_dir={tmp}/runs", "name=many", "run.watchdog_min_s=1000",
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--monitor-interval=0.1", "--no-python", sys.executable, str(RUNNER), "none", "train", *args,
    ]  # fmt: skip
    started = time.time()
    env = {**os.environ, **gpu_free_env(2)}
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        run.communicate(timeout=120)
        print(i, run.returncode, round(time.time() - started, 1), flush=True)
    except subprocess.TimeoutExpired:
        found = subprocess.run(["pgrep", "-f", f"log.out_dir={tmp}/runs"], capture_output=True, text=True)
        dumps = [
            subprocess.run(["py-spy", "dump", "--pid", pid], capture_output=True, text=True).stdout
            for pid in found.stdout.split()
        ]
        Path(f"hang-{i}.txt").write_text("\n\n".join(dumps))
        subprocess.run(["pkill", "-9", "-f", f"log.out_dir={tmp}/runs"])
        run.communicate()
        print(i, "HUNG", flush=True)

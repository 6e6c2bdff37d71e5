#!/usr/bin/env bash
# The CUDA paths, run on one GPU in one go: each check a real CLI command with its own time limit, then the test suite
# with train.device=auto resolving to the GPU. Writes OUT/summary.txt (one line per check: exit code, seconds),
# OUT/logs.tgz (every check's output) and OUT/junit.xml; CI never runs it (no GPU there).
#
#     bash benchmarks/cuda_check.sh OUT [TOTAL_SECONDS] [NAME ...]
#
# Every check gets at most what is left of TOTAL_SECONDS (default 500); the suite gets the rest, and a check that
# would start with under 20 s left is listed as not run. NAMEs pick checks (a name, or a group: paths, speed,
# suite); without them every check runs.
#
# Needs vitrain importable (pip install -e ., or PYTHONPATH=REPO). The face check reads ../shared/data/orl-faces.zip
# beside the repository where it is there.
set -u
out=$(realpath -m "${1:?usage: cuda_check.sh OUT [TOTAL_SECONDS]}")
deadline=$((SECONDS + ${2:-500}))
shift $(($# < 2 ? $# : 2))
picked=" $* "
mkdir -p "$out/logs"
: >"$out/summary.txt"
runs=$(mktemp -d /tmp/vitrain-cuda-runs.XXXX)
export PYTHONUNBUFFERED=1 VITRAIN_CACHE_DIR="$runs/cache"
cd "$(dirname "$0")/.."

check() {  # check GROUP NAME SECONDS COMMAND...: runs COMMAND, its output to logs/NAME.txt, one line to summary.txt
    local group=$1 name=$2 limit=$3
    shift 3
    if [ "$picked" != "  " ] && [[ "$picked" != *" $name "* ]] && [[ "$picked" != *" $group "* ]]; then
        return
    fi
    local begin=$SECONDS left=$((deadline - SECONDS - 5))
    if [ "$left" -lt 20 ]; then
        printf '%-28s not run: out of time  %s\n' "$name" "$*" | tee -a "$out/summary.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "\$ $*" >"$out/logs/$name.txt"
    timeout -s INT -k 15 "$limit" "$@" >>"$out/logs/$name.txt" 2>&1
    local rc=$?
    printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - begin))" "$*" | tee -a "$out/summary.txt"
}

vt=(python -m vitrain)
ladder_rows=${LADDER_ROWS:-fp32 reference,baseline,+ multi-tensor optimizer,+ pooled classifier,+ batch-second layout,+ AMP O2,+ pure bf16,+ 2x batch,vitrain auto}
common=(log.progress=false "log.out_dir=$runs")

check paths env 60 bash -c 'nvidia-smi -L; python -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported())"'
# precision.mode=auto with autotune: its races (precision, attention, optimizer kernel) run on the GPU.
check paths digits-auto 120 "${vt[@]}" train digits "${common[@]}" name=digits-auto
check paths digits-fp16-o1 90 "${vt[@]}" train digits "${common[@]}" name=digits-fp16 precision.mode=amp_o1 precision.dtype=fp16
check paths digits-pure-bf16 90 "${vt[@]}" train digits "${common[@]}" name=digits-pure precision.mode=pure
check paths digits-compile 180 "${vt[@]}" train digits "${common[@]}" name=digits-compile precision.mode=amp_o2 train.compile=true train.epochs=3
# amp_o2's fp32 norms and their casts compiled as one kernel each (Triton on a GPU).
check paths digits-compile-norms 180 "${vt[@]}" train digits "${common[@]}" name=digits-cnorms precision.mode=amp_o2 precision.compile_norms=true train.epochs=5
check paths digits-token-drop 90 "${vt[@]}" train digits "${common[@]}" name=digits-drop train.token_drop=0.5 model.pool=cls
# NCCL with one rank: FSDP2 zero3 + amp_o2 + activation checkpointing, then a resume of the same run, and exports;
# zero2 with precision, attention and the FSDP unit raced by autotune under the run's own sharding; zero1.
z3=(parallel.strategy=zero3 precision.mode=amp_o2 parallel.activation_checkpointing=block train.checkpoint_every_steps=5)
tr=(torchrun --standalone --nproc_per_node 1 -m vitrain train digits "${common[@]}")
check paths zero3-5-steps 120 "${tr[@]}" name=z3 "${z3[@]}" train.max_steps=5
check paths zero3-resume 120 "${tr[@]}" name=z3 "${z3[@]}" train.max_steps=10 --resume
check paths zero2-auto 150 "${tr[@]}" name=z2 parallel.strategy=zero2 precision.mode=auto model.attention=auto train.max_steps=20
check paths zero1-o2 120 "${tr[@]}" name=z1 parallel.strategy=zero1 precision.mode=amp_o2 train.max_steps=20
check paths ddp-async-ckpt 120 "${tr[@]}" name=ddp parallel.strategy=ddp train.checkpoint_every_steps=10 train.checkpoint_async=true train.max_steps=30
check paths export-safetensors 60 "${vt[@]}" export "$runs/z3" "$runs/z3-export"
check paths export-onnx 120 "${vt[@]}" export "$runs/digits-auto" "$runs/digits-onnx" --format onnx
if [ -f ../shared/data/orl-faces.zip ]; then
    check paths face-orl 150 "${vt[@]}" train face-orl "${common[@]}" name=face-orl
fi
# Speed on the GPU: the real step of ViT-S/16 and ViT-B/16 at 224 px, vitrain beside timm and transformers (rounds
# taking turns, median and spread), and the ablation ladder on one GPU.
check speed bench-vit-s-b256 120 "${vt[@]}" bench run model.preset=vit_small_patch16 train.batch_size=256 --synthetic --steps 10 --warmup 3 --json "$out/logs/bench-vit-s.json"
check speed bench-vit-b-b256 120 "${vt[@]}" bench run model.preset=vit_base_patch16 train.batch_size=256 --synthetic --steps 10 --warmup 3 --json "$out/logs/bench-vit-b.json"
check speed peers-vit-b-b256 240 "${vt[@]}" bench --peers model.preset=vit_base_patch16 train.batch_size=256 --out "$out/logs/peers"
check speed ladder-vit-b 300 "${vt[@]}" bench --ladder model.preset=vit_base_patch16 --rows "$ladder_rows" --out "$out/logs/ladder"
# The suite, with every test's train.device=auto on the GPU (two-rank tests run their ranks on the CPU with gloo
# where there are fewer than two GPUs).
check suite pytest 100000 env OMP_NUM_THREADS=2 python -m pytest -q -n "${PYTEST_WORKERS:-8}" -p no:cacheprovider --timeout 120 -rfE --junitxml="$out/junit.xml" tests
tar czf "$out/logs.tgz" -C "$out" logs && rm -r "$out/logs"

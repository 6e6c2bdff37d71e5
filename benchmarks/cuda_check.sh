#!/usr/bin/env bash
# The CUDA paths, run on one GPU in one go: each check a real CLI command with its own time limit, then the test suite
# with train.device=auto resolving to the GPU. Writes OUT/summary.txt (one line per check: exit code, seconds),
# OUT/logs.tgz (every check's output) and OUT/junit.xml; CI never runs it (no GPU there).
#
#     bash benchmarks/cuda_check.sh OUT [TOTAL_SECONDS]
#
# Every check gets at most what is left of TOTAL_SECONDS (default 500); the suite gets the rest, and a check that
# would start with under 20 s left is listed as not run.
#
# Needs vitrain importable (pip install -e ., or PYTHONPATH=REPO). The face check reads ../shared/data/orl-faces.zip
# beside the repository where it is there.
set -u
out=$(realpath -m "${1:?usage: cuda_check.sh OUT [TOTAL_SECONDS]}")
deadline=$((SECONDS + ${2:-500}))
mkdir -p "$out/logs"
runs=$(mktemp -d /tmp/vitrain-cuda-runs.XXXX)
export PYTHONUNBUFFERED=1 VITRAIN_CACHE_DIR="$runs/cache"
cd "$(dirname "$0")/.."

check() {  # check NAME SECONDS COMMAND...: runs COMMAND, its output to logs/NAME.txt, one line to summary.txt
    local name=$1 limit=$2
    shift 2
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
common=(log.progress=false "log.out_dir=$runs")

check env 60 bash -c 'nvidia-smi -L; python -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported())"'
# precision.mode=auto with autotune: its races (precision, attention, optimizer kernel) run on the GPU.
check digits-auto 120 "${vt[@]}" train digits "${common[@]}" name=digits-auto
check digits-fp16-o1 90 "${vt[@]}" train digits "${common[@]}" name=digits-fp16 precision.mode=amp_o1 precision.dtype=fp16
check digits-pure-bf16 90 "${vt[@]}" train digits "${common[@]}" name=digits-pure precision.mode=pure
check digits-compile 180 "${vt[@]}" train digits "${common[@]}" name=digits-compile precision.mode=amp_o2 train.compile=true train.epochs=3
check digits-token-drop 90 "${vt[@]}" train digits "${common[@]}" name=digits-drop train.token_drop=0.5 model.pool=cls
# NCCL with one rank: FSDP2 zero3 + amp_o2 + activation checkpointing, then a resume of the same run, and exports.
z3=(parallel.strategy=zero3 precision.mode=amp_o2 parallel.activation_checkpointing=block train.checkpoint_every_steps=5)
check zero3-5-steps 120 torchrun --standalone --nproc_per_node 1 -m vitrain train digits "${common[@]}" name=z3 "${z3[@]}" train.max_steps=5
check zero3-resume 120 torchrun --standalone --nproc_per_node 1 -m vitrain train digits "${common[@]}" name=z3 "${z3[@]}" train.max_steps=10 --resume
check ddp-async-ckpt 120 torchrun --standalone --nproc_per_node 1 -m vitrain train digits "${common[@]}" name=ddp parallel.strategy=ddp train.checkpoint_every_steps=10 train.checkpoint_async=true train.max_steps=30
check export-safetensors 60 "${vt[@]}" export "$runs/z3" "$runs/z3-export"
check export-onnx 120 "${vt[@]}" export "$runs/digits-auto" "$runs/digits-onnx" --format onnx
if [ -f ../shared/data/orl-faces.zip ]; then
    check face-orl 150 "${vt[@]}" train face-orl "${common[@]}" name=face-orl
fi
# Speed on the GPU: the real step of ViT-S/16 and ViT-B/16 at 224 px, and vitrain beside timm and transformers.
check bench-vit-s-b256 120 "${vt[@]}" bench run model.preset=vit_small_patch16 train.batch_size=256 --synthetic --steps 10 --warmup 3 --json "$out/logs/bench-vit-s.json"
check bench-vit-b-b256 120 "${vt[@]}" bench run model.preset=vit_base_patch16 train.batch_size=256 --synthetic --steps 10 --warmup 3 --json "$out/logs/bench-vit-b.json"
check peers-vit-b-b256 180 "${vt[@]}" bench --peers model.preset=vit_base_patch16 train.batch_size=256 --out "$out/logs/peers"
# The suite, with every test's train.device=auto on the GPU (distributed tests start 2 NCCL ranks on one GPU and
# are expected to be refused by NCCL; they are listed as such, not hidden).
check pytest 100000 python -m pytest -q -n 8 -p no:cacheprovider --timeout 120 -rfE --junitxml="$out/junit.xml" tests
tar czf "$out/logs.tgz" -C "$out" logs && rm -r "$out/logs"
